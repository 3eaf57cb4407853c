"""Patches of ``vllm_ascend.patch.worker.patch_mamba_utils`` (vllm-ascend 0.30.0rc2, 0.23.0.post1).

vllm-ascend (since its PR #7103) runs vLLM's align-mode path on the NPU: its own
``preprocess_mamba`` stages the copy metadata, ``NPUModelRunner.execute_model`` copies after the
KV-transfer load, and with a layerwise KV connector (AscendStoreConnector ``use_layerwise``, or
a multi-connector wrapping one) per layer through ``prepare_mamba_copy_by_layer`` /
``do_mamba_copy_block_for_layer`` / ``finish_mamba_copy_by_layer``. All of that is kept. Its
copy kernel is launched with one program per copy (8 KiB blocks; tiling off because of
triton-ascend's 65535 grid limit), through:

* 0.30.0rc2: the module global ``patch_mamba_utils._batch_memcpy_triton(src_ptrs, dst_ptrs,
  sizes)``, called by ``_do_mamba_copy_block_npu`` (batched) and ``do_mamba_copy_block_for_layer``
  (per layer), and also installed as ``vllm.v1.worker.mamba_utils.batch_memcpy``;
* 0.23.0.post1: ``vllm.v1.worker.mamba_utils.batch_memcpy`` set to ``_batch_memcpy_triton``,
  called by vLLM 0.23's own ``do_mamba_copy_block``.

Both launchers become :func:`vllm_hybrid_npu.patches.vllm_mamba_utils.make_launcher` (our
bounded-grid kernel, grid <= vector cores), so every path, the layerwise one included, runs our
kernel on metadata vllm-ascend staged. Not measured on an NPU (none was available); what was
verified is the CPU replay of vllm-ascend's own code (``tests/ascend``) and the triton-ascend
front-end compile of the kernel.

310P: vllm-ascend's ``_can_launch_triton_batch_memcpy()`` is False there and it uses its own
tensor-copy path (``as_strided`` views of the state tensors): the probes skip both entries and
that path stays.
"""

from __future__ import annotations

import sys
from typing import Any

from vllm_hybrid_npu.patches.registry import Patch
from vllm_hybrid_npu.patches.vllm_mamba_utils import (
    COPY_KERNEL_ENV,
    LAUNCHER_SIGNATURE,
    copy_kernel_choice,
    make_launcher,
)
from vllm_hybrid_npu.support import Stack

ASCEND_MODULE = "vllm_ascend.patch.worker.patch_mamba_utils"
ASCEND_VERSIONS = ("0.30.0rc2", "0.23.0.post1")
VLLM_VERSIONS = ("0.30.0", "0.23.0")


def _wanted(stack: Stack) -> str | None:
    if copy_kernel_choice() == "upstream":
        return f"{COPY_KERNEL_ENV}=upstream"
    return None


def _no_triton_copy() -> str | None:
    module = sys.modules.get(ASCEND_MODULE)
    can = getattr(module, "_can_launch_triton_batch_memcpy", None)
    if can is None:
        return f"{ASCEND_MODULE}._can_launch_triton_batch_memcpy is missing"
    if not can():
        return "no Triton batch memcpy on this SoC (310P): vllm-ascend's tensor-copy path kept"
    return None


def _probe_ascend_launcher(upstream: Any, stack: Stack) -> str | None:
    return _no_triton_copy()


def _probe_vllm_attr(upstream: Any, stack: Stack) -> str | None:
    reason = _no_triton_copy()
    if reason:
        return reason
    if (getattr(upstream, "__module__", ""), getattr(upstream, "__name__", "")) != (
        ASCEND_MODULE, "_batch_memcpy_triton",
    ):
        return (
            "mamba_utils.batch_memcpy is not vllm-ascend's _batch_memcpy_triton "
            f"({getattr(upstream, '__module__', '?')}.{getattr(upstream, '__name__', '?')})"
        )
    return None


_WHY = (
    "vllm-ascend's copy launches (batched and layerwise) through our bounded-grid kernel "
    "(grid <= vector cores, several programs per copy); its plan, staging and per-layer path stay"
)
_UNTIL = "vllm-ascend's batch_memcpy_kernel spreads one copy over several cores"

PATCHES = [
    Patch(
        name="copy-kernel-ascend",
        module=ASCEND_MODULE,
        qualname="_batch_memcpy_triton",
        targets=("npu",),
        vllm=VLLM_VERSIONS,
        vllm_ascend=ASCEND_VERSIONS,
        signature=LAUNCHER_SIGNATURE,
        wanted=_wanted,
        probe=_probe_ascend_launcher,
        make=make_launcher,
        why=_WHY + " (launcher of _do_mamba_copy_block_npu and do_mamba_copy_block_for_layer)",
        until=_UNTIL,
    ),
    Patch(
        name="copy-kernel-ascend-vllm",
        module="vllm.v1.worker.mamba_utils",
        qualname="batch_memcpy",
        trigger=ASCEND_MODULE,
        targets=("npu",),
        vllm=VLLM_VERSIONS,
        vllm_ascend=ASCEND_VERSIONS,
        signature=LAUNCHER_SIGNATURE,
        wanted=_wanted,
        probe=_probe_vllm_attr,
        make=make_launcher,
        why=_WHY + " (mamba_utils.batch_memcpy as vllm-ascend sets it: vLLM's do_mamba_copy_block "
        "calls it on 0.23.0.post1)",
        until=_UNTIL,
    ),
]
