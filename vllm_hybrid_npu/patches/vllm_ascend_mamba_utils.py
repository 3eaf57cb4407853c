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
tensor-copy path (``as_strided`` views of the state tensors): the probes skip both launcher
entries and that path stays. One bug of it is fixed (``ascend-310p-layerwise-copies``): on
0.30.0rc2, behind a layerwise KV connector, ``_collect_mamba_copy_meta_torch`` stages the tensor
pairs only in ``_tensor_copy_pairs``; the connector takes the copy over
(``prepare_mamba_state_copy`` -> True, so no batched copy), ``do_mamba_copy_block_for_layer``
finds no ``_layer_copy_metadata`` and returns, and ``finish_mamba_copy_by_layer`` drops the pairs:
the align-mode state copies never happen and outputs go wrong silently (found by the CPU replay,
``tests/ascend``). The fix also files each staged pair under its layer
(``_layer_tensor_copy_pairs`` / ``_layer_copy_metadata``, the structures vllm-ascend's own
per-layer 310P branch reads), so each layer's copies run right after its KV load; the batched path
is unchanged.
"""

from __future__ import annotations

import sys
from typing import Any

from vllm_hybrid_npu import envs
from vllm_hybrid_npu.patches.registry import Patch
from vllm_hybrid_npu.patches.vllm_mamba_utils import (
    COPY_KERNEL_KEY,
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
        return envs.option_text(COPY_KERNEL_KEY, "upstream")
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


def _probe_310p_collector(upstream: Any, stack: Stack) -> str | None:
    if _no_triton_copy() is None:
        return "Triton batch memcpy available: vllm-ascend's per-layer pointer path is in use"
    if (getattr(upstream, "__module__", ""), getattr(upstream, "__name__", "")) != (
        ASCEND_MODULE, "_collect_mamba_copy_meta_torch",
    ):
        return "mamba_utils.collect_mamba_copy_meta is not vllm-ascend's 310P collector"
    if not hasattr(sys.modules.get(ASCEND_MODULE), "do_mamba_copy_block_for_layer"):
        return "this vllm-ascend has no layerwise copy path"
    return None


def _make_310p_collector(upstream: Any, stack: Stack) -> Any:
    """vllm-ascend's 310P collector, then each pair it staged filed under its layer.

    Same signature and effect as ``patch_mamba_utils._collect_mamba_copy_meta_torch`` (it runs
    first, unchanged); the pairs it appended to ``copy_bufs._tensor_copy_pairs`` are also put in
    ``copy_bufs._layer_tensor_copy_pairs[layer]`` with an (empty) entry in
    ``copy_bufs._layer_copy_metadata[layer]``, in its own iteration order (KV-cache group, layer,
    state). No tensor is touched; no host sync.

    Raises:
        RuntimeError: the collector appended a number of pairs that does not match its layers'
            states (an upstream change: better loud than a silent wrong copy).
    """
    funcs_for_layer = getattr(sys.modules[ASCEND_MODULE], "_get_state_copy_funcs_for_layer")

    def collect_mamba_copy_meta(copy_bufs, kv_cache_config, mamba_state_copy_funcs,
                                mamba_group_ids, src_block_idx, dest_block_idx,
                                accept_token_bias, req_state, forward_context):
        before = len(getattr(copy_bufs, "_tensor_copy_pairs", ())) if copy_bufs.offset else 0
        upstream(copy_bufs, kv_cache_config, mamba_state_copy_funcs, mamba_group_ids,
                 src_block_idx, dest_block_idx, accept_token_bias, req_state, forward_context)
        pairs = getattr(copy_bufs, "_tensor_copy_pairs", [])[before:]
        if not pairs:
            return
        per_layer = getattr(copy_bufs, "_layer_tensor_copy_pairs", None)
        if per_layer is None:
            per_layer = copy_bufs._layer_tensor_copy_pairs = {}
        meta = getattr(copy_bufs, "_layer_copy_metadata", None)
        if meta is None:
            meta = copy_bufs._layer_copy_metadata = {}
        i = 0
        for gid in mamba_group_ids:
            group = kv_cache_config.kv_cache_groups[gid]
            for layer_name in group.layer_names:
                funcs = funcs_for_layer(group, layer_name, mamba_state_copy_funcs)
                n = min(len(forward_context[layer_name].kv_cache), len(funcs))
                per_layer.setdefault(layer_name, []).extend(pairs[i:i + n])
                meta.setdefault(layer_name, ([], [], []))
                i += n
        if i != len(pairs):
            raise RuntimeError(
                f"vllm-hybrid-npu: vllm-ascend's 310P collector staged {len(pairs)} state copies, "
                f"its layers have {i} states"
            )

    return collect_mamba_copy_meta


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
    Patch(
        name="ascend-310p-layerwise-copies",
        module="vllm.v1.worker.mamba_utils",
        qualname="collect_mamba_copy_meta",
        trigger=ASCEND_MODULE,
        targets=("npu",),
        vllm=("0.30.0",),
        vllm_ascend=("0.30.0rc2",),
        signature=("copy_bufs", "kv_cache_config", "mamba_state_copy_funcs", "mamba_group_ids",
                   "src_block_idx", "dest_block_idx", "accept_token_bias", "req_state",
                   "forward_context"),
        probe=_probe_310p_collector,
        make=_make_310p_collector,
        behaviour_changing=True,
        why=(
            "310P behind a layerwise KV connector (AscendStoreConnector use_layerwise, or a "
            "multi-connector wrapping one): vllm-ascend 0.30.0rc2 drops every align-mode state "
            "copy (its 310P collector never fills the per-layer pairs its per-layer path reads); "
            "the pairs are filed per layer so each layer's copies run after its KV load"
        ),
        until="vllm-ascend's 310P collector fills _layer_tensor_copy_pairs itself",
    ),
]
