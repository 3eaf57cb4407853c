"""Torch fallback of ``batch_memcpy``: one ``Tensor.copy_`` per copy over views of raw addresses.

For CPU tensors (a CPU without ``triton``, the tests) and CUDA without Triton. Reads the
address and size tensors on the host (a device-to-host sync on an accelerator), then, per copy,
wraps the two byte ranges in non-owning uint8 tensors on the same device and copies; a copy whose
ranges overlap goes through a temporary (memmove semantics).

Not for NPUs: torch_npu needs its own storage type for device memory, which PyTorch's generic
constructor does not build. On 310P (no Triton batch memcpy) the plugin keeps vllm-ascend's own
tensor-copy path (``as_strided`` views of the state tensors) and never calls this; a direct call
with NPU tensors raises.

Views over raw addresses: ``torch._C._construct_storage_from_data_pointer`` (device-generic,
non-owning; used by torch inductor's CUDA-graph trees) where it exists; otherwise ctypes on the
CPU and ``__cuda_array_interface__`` on CUDA.
"""

from __future__ import annotations

import ctypes

import torch

_from_ptr = getattr(torch._C, "_construct_storage_from_data_pointer", None)


class _CudaRange:
    """Minimal ``__cuda_array_interface__`` (v2, no stream) over ``nbytes`` at ``addr``."""

    def __init__(self, addr: int, nbytes: int):
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (addr, False), "version": 2,
        }


def byte_view(addr: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 tensor of ``nbytes`` that aliases memory at byte address ``addr`` on ``device``.

    The view does not own the memory; it must not outlive the allocation it points into.

    Raises:
        RuntimeError: ``device`` is not a CPU or CUDA device (see the module docstring).
    """
    if device.type not in ("cpu", "cuda"):
        raise RuntimeError(
            f"batch_memcpy torch fallback: raw-address views are not supported on {device.type} "
            "(on 310P vllm-ascend's tensor-copy path is used; the plugin does not route copies here)"
        )
    if _from_ptr is not None:
        storage = _from_ptr(addr, device, nbytes)
        return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
    if device.type == "cpu":
        return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(addr), dtype=torch.uint8)
    if device.type == "cuda":
        return torch.as_tensor(_CudaRange(addr, nbytes), device=device)
    raise RuntimeError(
        f"this torch ({torch.__version__}) cannot view raw addresses on {device}: "
        "torch._C._construct_storage_from_data_pointer is missing"
    )


def batch_memcpy_torch(src_ptrs: torch.Tensor, dst_ptrs: torch.Tensor, sizes: torch.Tensor) -> None:
    """Same contract as :func:`vllm_hybrid_npu.ops.batch_memcpy`; inputs already validated."""
    device = src_ptrs.device
    srcs = src_ptrs.tolist()
    dsts = dst_ptrs.tolist()
    lens = sizes.tolist()
    for s, d, n in zip(srcs, dsts, lens):
        if n <= 0 or s == d:
            continue
        src = byte_view(s, n, device)
        dst = byte_view(d, n, device)
        if abs(d - s) < n:  # overlapping ranges: memmove through a temporary
            src = src.clone()
        dst.copy_(src)
