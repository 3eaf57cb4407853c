"""GDN prefill checkpoints on vllm-ascend 0.30.0rc2: its three prefill paths, split at the checkpoint.

vllm-ascend replaces vLLM's GDN metadata builder (``AscendGDNAttentionMetadataBuilder.build``) and
forward (``AscendGatedDeltaNetAttention._forward_core``, installed as vLLM's Qwen forward by
``patch_qwen3_5`` on A2 / A3 / A5), so :mod:`.gdn_prefill_checkpoint`'s plan and forward wrapper
are applied to them here, and the prefill kernel the forward chooses (step 2.3) runs split at the
checkpoints (:func:`~vllm_hybrid_npu.ops.gdn_checkpoint.run_split`, exact in a bf16 and a float32
SSM cache): ``fla_npu``'s fused op through ``DeviceOperator.fla_gdn_prefill`` (state ``[N, HV, V,
K]``), the fused CANN op ``torch_npu.npu_chunk_gated_delta_rule`` through
``_chunk_gated_delta_rule_fused`` (bf16 state; the default on A2 / A3 with torch-npu
2.10.0.post4), the Triton / AscendC chunk pipeline through ``chunk_gated_delta_rule`` (state
``[N, HV, K, V]``). Each returns only final states (the AscendC op's ``h`` is dropped inside the
glue). The split's chunk metadata is vllm-ascend's own (``_build_non_spec_chunked_prefill_metadata``).
A row with several checkpoints (a shared-prefix junction before the prompt's own, or the block
boundary a row started mid-block crosses: :mod:`.gdn_junction`) runs in one kernel call per
segment (``ops.run_split``'s rounds); the engine sends those blocks with the step
(:mod:`.gdn_step_checkpoints`), so the builder reads no block-table column.

Under EAGLE/MTP speculative decoding (vLLM 0.30.0 with vllm-ascend 0.30.0rc2:
``gdn.SPEC_DECODE_PATHS``) the forward runs the speculative decode rows on their own kernels
(``causal_conv1d_update``, ``recurrent_gated_delta_rule`` on ``k + 1`` state slots: not wrapped)
and the others, all prefills, in its one prefill kernel call, in the token layout of
``non_spec_token_indx``: the builder plans those rows alone, the kernel wrappers split that call
as without speculative decoding, and the forward wrapper takes the conv rows through that index
into the first ``width - 1`` columns of the conv state (``width - 1 + k`` wide there). Verified on
CPU only, replaying vllm-ascend's code (``tests/ascend/gdn_replay.py``).
"""

from __future__ import annotations

import functools
from typing import Any

from vllm_hybrid_npu.ops import gdn_checkpoint as ops
from vllm_hybrid_npu.patches import gdn_prefill_checkpoint as gdn
from vllm_hybrid_npu.patches.registry import is_ours
from vllm_hybrid_npu.support import Stack

ASCEND_BUILDER = "vllm_ascend.ops.gdn_attn_builder"
ASCEND_QWEN_PATCH = "vllm_ascend.patch.worker.patch_qwen3_5"
VLLM_VERSIONS = ("0.30.0",)


def _kernel_meta(builder: Any, device: Any) -> ops.KernelMeta:
    from vllm_ascend.ops.gdn_attn_builder import _build_non_spec_chunked_prefill_metadata

    device_meta = getattr(builder, "build_device_chunk_metadata", True)
    return lambda host, dev: _build_non_spec_chunked_prefill_metadata(
        builder, host, device, build_device_metadata=device_meta)


def _rows(builder: Any, common: Any, num_accepted_tokens: Any = None,
          num_decode_draft_tokens_cpu: Any = None, fast_build: bool = False,
          num_actual_reqs: int | None = None) -> Any:
    """The step's rows as vllm-ascend 0.30.0rc2's ``AscendGDNAttentionMetadataBuilder.build``
    (same arguments) reads them before it splits the batch: under a full graph with speculative
    decoding its ``_remove_spec_graph_padding_queries`` gives the padded suffix rows FIA spans
    ``k + 1`` tokens wide zero tokens, and rows past ``num_actual_reqs`` (graph padding) are cut
    (``CommonAttentionMetadata.unpadded``). The plan's rows and token layout are then vllm-ascend's
    prefill rows' (its kernels get one initial state per row)."""
    if builder.use_full_cuda_graph and builder.use_spec_decode:
        from vllm_ascend.ops.gdn_attn_builder import _remove_spec_graph_padding_queries

        common = _remove_spec_graph_padding_queries(common, num_decode_draft_tokens_cpu)
    if num_actual_reqs is not None and num_actual_reqs < common.num_reqs:
        common = common.unpadded(common.num_actual_tokens, num_actual_reqs)
    return common


def _probe_forward(upstream: Any, stack: Stack) -> str | None:
    if is_ours(upstream):
        return "already the plugin's wrapper (applied on AscendGatedDeltaNetAttention)"
    where = f"{getattr(upstream, '__module__', '?')}.{getattr(upstream, '__qualname__', '?')}"
    if where != f"{gdn.ASCEND_GDN}.AscendGatedDeltaNetAttention._forward_core":
        return f"the GDN forward is {where}, not vllm-ascend's"
    return None


def _make_fused(upstream: Any, stack: Stack) -> Any:
    fn = getattr(upstream, "__func__", upstream)  # a staticmethod, or inherited

    @functools.wraps(fn)
    def _chunk_gated_delta_rule_fused(q, k, v, g, beta, initial_state, cu_seqlens, scale):
        if (scope := ops.current("split")) is None:
            return fn(q, k, v, g, beta, initial_state, cu_seqlens, scale)
        bounds = scope.metadata.bounds
        return scope.split(lambda xs, state, part: fn(*xs, state, bounds[part], scale),
                           (q, k, v, g, beta), initial_state)

    return staticmethod(_chunk_gated_delta_rule_fused)


def _make_fla_npu(upstream: Any, stack: Stack) -> Any:
    fn = getattr(upstream, "__func__", upstream)  # a staticmethod, or inherited

    @functools.wraps(fn)
    def fla_gdn_prefill(q, k, v, g, beta, initial_state, scale, prebuilt_meta, fused_fwd):
        if (scope := ops.current("split")) is None:
            return fn(q, k, v, g, beta, initial_state, scale, prebuilt_meta, fused_fwd)
        meta = scope.metadata.kernel_meta
        return scope.split(lambda xs, state, part: fn(*xs, state, scale, meta[part], fused_fwd),
                           (q, k, v, g, beta), initial_state)

    return staticmethod(fla_gdn_prefill)


def _make_chunk(upstream: Any, stack: Stack) -> Any:
    @functools.wraps(upstream)
    def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None,
                               output_final_state=False, cu_seqlens=None, prebuilt_meta=None,
                               head_first=False, use_qk_l2norm_in_kernel=False, **kwargs):
        scope = ops.current("split")
        if scope is None or head_first or kwargs:
            return upstream(q, k, v, g, beta, scale, initial_state, output_final_state,
                            cu_seqlens, prebuilt_meta, head_first, use_qk_l2norm_in_kernel,
                            **kwargs)
        md = scope.metadata

        def run(inputs, state, part):
            return upstream(*inputs, scale, state, True, md.bounds[part], md.kernel_meta[part],
                            False, use_qk_l2norm_in_kernel)

        # the chunk glue's state is [N, HV, K, V], the cache's [.., V, K]
        return scope.split(run, (q, k, v, g, beta), initial_state, transpose=True)

    return chunk_gated_delta_rule


def _entry(name, module, qualname, make, why, **kw):
    return gdn.entry(name, module, qualname, make, ("npu",), why, vllm=VLLM_VERSIONS,
                     vllm_ascend=gdn.ASCEND_VERSIONS,
                     until="vllm-ascend's GDN forward exports prefill checkpoints itself", **kw)


PATCHES = [
    _entry("gdn-checkpoint-ascend-plan", ASCEND_BUILDER, "AscendGDNAttentionMetadataBuilder.build",
           gdn.make_builder(_kernel_meta, _rows), "per-step checkpoint plan in vllm-ascend's GDN "
           "metadata (its builder replaces vLLM's; under MTP of the non-speculative rows, in its "
           "token layout), with its chunk metadata of the split's calls",
           signature=gdn.BUILD_SIGNATURE),
    _entry("gdn-checkpoint-ascend-forward", gdn.ASCEND_GDN,
           "AscendGatedDeltaNetAttention._forward_core", gdn.make_forward,
           "conv checkpoints from the step's input rows (under MTP the non-speculative rows', "
           "through non_spec_token_indx); the SSM ones from the chunk kernel vllm-ascend chooses, "
           "split (next three entries)", signature=gdn.FORWARD_SIGNATURE,
           probe=_probe_forward),
    _entry("gdn-checkpoint-ascend-forward-qwen", gdn.QWEN_GDN,
           "QwenGatedDeltaNetAttention._forward_core", gdn.make_forward, "the same, where "
           "patch_qwen3_5 copied vllm-ascend's forward into vLLM's Qwen layer before the entry "
           "above applied", signature=gdn.FORWARD_SIGNATURE, trigger=ASCEND_QWEN_PATCH,
           probe=_probe_forward),
    _entry("gdn-checkpoint-ascend-fla-npu", gdn.ASCEND_GDN, "DeviceOperator.fla_gdn_prefill",
           _make_fla_npu, "fla_npu's fused prefill op split at the checkpoints",
           signature=("q", "k", "v", "g", "beta", "initial_state", "scale", "prebuilt_meta")),
    _entry("gdn-checkpoint-ascend-fused", gdn.ASCEND_GDN,
           "AscendGatedDeltaNetAttention._chunk_gated_delta_rule_fused", _make_fused,
           "the fused CANN op npu_chunk_gated_delta_rule split at the checkpoints",
           signature=("q", "k", "v", "g", "beta", "initial_state", "cu_seqlens", "scale")),
    _entry("gdn-checkpoint-ascend-chunk", gdn.ASCEND_GDN, "chunk_gated_delta_rule", _make_chunk,
           "vllm-ascend's Triton/AscendC chunk pipeline split at the checkpoints",
           signature=("q", "k", "v", "g", "beta", "scale", "initial_state", "output_final_state",
                      "cu_seqlens", "prebuilt_meta")),
]
