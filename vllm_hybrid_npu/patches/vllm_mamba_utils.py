"""Patches of ``vllm.v1.worker.mamba_utils`` (vLLM 0.30.0, 0.32.0): the align-mode copy launcher.

vLLM's align mode already plans the state copies (``preprocess_mamba`` /
``collect_mamba_copy_meta``) and runs them once per step through
``do_mamba_copy_block(copy_bufs)``, which uploads the staged pointer arrays (pinned
``CpuGpuBuffer``, non-blocking) and calls the module global ``batch_memcpy(src_ptrs, dst_ptrs,
sizes)``. All of that stays upstream's. Only the launcher is replaced, where ours is measurably
faster: ``batch_memcpy`` -> :func:`vllm_hybrid_npu.ops.batch_memcpy` (bounded grid, tiles spread
over the SMs, 16-byte accesses; 1.3x to 20x vLLM 0.30's one-program-per-copy kernel on an H100,
``docs/benchmarks.md``).

On CUDA, vLLM 0.30's V2 model runner (its default for Qwen3-Next / Qwen3.5 on an H100,
docs/cuda.md) copies align-mode states in its own fused kernel
(``preprocess_mamba_align_fused_kernel``) and never calls ``batch_memcpy``: there the entry is
applied but off the path (the warm-up entry logs it); the V1 runner (``VLLM_USE_V2_MODEL_RUNNER=0``)
calls it.

Not applied on CPU by default: vLLM's CPU runner swaps in its own CPU copy kernel
(``CPUModelRunner`` sets ``mamba_utils.batch_memcpy_kernel``) and ours is not faster there;
``VLLM_HYBRID_NPU_OPTIONS=copy=ours`` applies it anyway (the e2e tests compare both paths).
NPU: :mod:`vllm_hybrid_npu.patches.vllm_ascend_mamba_utils`.
"""

from __future__ import annotations

from typing import Any

from vllm_hybrid_npu.patches.registry import Patch
from vllm_hybrid_npu.support import Stack
from vllm_hybrid_npu import envs

#: The option (``VLLM_HYBRID_NPU_OPTIONS`` key): ``auto`` (default: ours where it is measured
#: faster), ``ours`` (also on CPU) or ``upstream`` (never).
COPY_KERNEL_KEY = "copy"

#: Parameters of every launcher we replace.
LAUNCHER_SIGNATURE = ("src_ptrs", "dst_ptrs", "sizes")


def copy_kernel_choice() -> str:
    """The option ``copy`` (default ``auto``).

    Raises:
        ValueError: a value other than ``auto``, ``ours``, ``upstream`` (the message names the
            variable).
    """
    return envs.option(COPY_KERNEL_KEY)


def make_launcher(upstream: Any, stack: Stack) -> Any:
    """Our replacement of a ``batch_memcpy(src_ptrs, dst_ptrs, sizes)`` launcher.

    Args (of the returned function): ``src_ptrs`` / ``dst_ptrs``: uint64 (vLLM) or int64
    (vllm-ascend) ``[N]`` device tensors of byte addresses; ``sizes``: int32 or int64 ``[N]``
    byte counts. uint64 addresses are reinterpreted as int64 (a view: same bits, no copy, no
    launch). No host sync, no value check (the pointer arrays come from the runner's own
    metadata), nothing written to a file: the call only enqueues the kernel on the current
    stream.
    """
    import torch

    from vllm_hybrid_npu.ops import batch_memcpy

    u64 = getattr(torch, "uint64", None)

    def batch_memcpy_launcher(src_ptrs, dst_ptrs, sizes):
        if u64 is not None and src_ptrs.dtype == u64:
            src_ptrs = src_ptrs.view(torch.int64)
            dst_ptrs = dst_ptrs.view(torch.int64)
        batch_memcpy(src_ptrs, dst_ptrs, sizes, check_values=False)

    batch_memcpy_launcher.__doc__ = make_launcher.__doc__
    batch_memcpy_launcher.__wrapped__ = upstream  # type: ignore[attr-defined]
    return batch_memcpy_launcher


def _wanted(stack: Stack) -> str | None:
    choice = copy_kernel_choice()
    if choice == "upstream":
        return f"{envs.option_text(COPY_KERNEL_KEY, 'upstream')}"
    if stack.target == "cpu" and choice == "auto":
        return (
            "vLLM's CPU copy kernel kept (ours is not faster on CPU); "
            f"{envs.option_text(COPY_KERNEL_KEY, 'ours')} applies it"
        )
    return None


def _probe(upstream: Any, stack: Stack) -> str | None:
    where = getattr(upstream, "__module__", "")
    if where != "vllm.v1.worker.mamba_utils":
        return f"batch_memcpy already replaced by {where}.{getattr(upstream, '__name__', '?')}"
    return None


PATCHES = [
    Patch(
        name="copy-kernel",
        module="vllm.v1.worker.mamba_utils",
        qualname="batch_memcpy",
        targets=("cuda", "cpu"),
        vllm=("0.30.0", "0.32.0"),
        signature=LAUNCHER_SIGNATURE,
        wanted=_wanted,
        probe=_probe,
        make=make_launcher,
        why=(
            "align-mode state copies through vllm_hybrid_npu.ops.batch_memcpy: bounded grid, "
            "16-byte accesses; 1.3x-20x vLLM 0.30's kernel on an H100 (docs/benchmarks.md). "
            "Plan, staging and the call site stay vLLM's"
        ),
        until="vLLM's batch_memcpy_kernel reaches the device's copy bandwidth for few requests",
    ),
]
