"""Which accelerator target this process runs on: ``npu``, ``cuda`` or ``cpu``.

Target-independent: imports neither vLLM's model runners nor vllm-ascend. The answer decides
which per-target patch module :mod:`vllm_hybrid_npu.patches` applies.
"""

from __future__ import annotations

import importlib.util
from vllm_hybrid_npu import envs

TARGETS = envs.OPTIONS["target"].values

#: The option (``VLLM_HYBRID_NPU_OPTIONS`` key) that forces the target (one of :data:`TARGETS`);
#: for tests and for machines where detection guesses wrong.
TARGET_KEY = "target"


def detect_target() -> str:
    """Return the target of this process: ``"npu"``, ``"cuda"`` or ``"cpu"``.

    Order: the option ``target`` if set; then vLLM's own ``current_platform`` when vLLM
    is importable (``device_type`` ``"npu"`` comes from the vllm-ascend platform plugin,
    ``"cuda"`` from CUDA, ``"cpu"`` from the CPU build); else ``torch_npu`` / ``torch.cuda``
    availability; else ``"cpu"``.

    Raises:
        ValueError: the option ``target`` is set to something not in :data:`TARGETS` (or
            ``VLLM_HYBRID_NPU_OPTIONS`` is malformed).
    """
    forced = envs.option(TARGET_KEY)
    if forced:
        return forced
    if importlib.util.find_spec("vllm") is not None:
        try:
            from vllm.platforms import current_platform

            device_type = getattr(current_platform, "device_type", "") or ""
            if device_type in TARGETS:
                return device_type
        except Exception:  # a broken platform plugin must not break detection
            pass
    if importlib.util.find_spec("torch_npu") is not None:
        return "npu"
    try:
        import torch

        if torch.cuda.is_available():
            return "cuda"
    except ImportError:
        pass
    return "cpu"
