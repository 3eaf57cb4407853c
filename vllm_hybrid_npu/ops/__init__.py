"""Device ops of vllm-hybrid-npu (torch + optional triton; no vLLM import).

* :func:`batch_memcpy` - batched byte copies between raw device addresses (mamba/GDN state
  copies in align mode); see :mod:`vllm_hybrid_npu.ops.memcpy`.
* :func:`active_impl` - which implementation it uses on a device (``"triton"`` / ``"torch"``).
* :func:`warm_up` - compile the kernel variants on a device at start-up.
* :data:`COPY_IMPL_KEY` - the option ``copy-impl`` (``VLLM_HYBRID_NPU_OPTIONS``) = ``auto`` |
  ``triton`` | ``torch``
  (read once per process; :func:`refresh_settings` re-reads it).
"""

from vllm_hybrid_npu.ops.memcpy import (
    COPY_IMPL_KEY,
    active_impl,
    batch_memcpy,
    refresh_settings,
    triton_available,
    warm_up,
)

__all__ = ["COPY_IMPL_KEY", "active_impl", "batch_memcpy", "refresh_settings", "triton_available", "warm_up"]
