"""GDN prefill checkpoints on vllm-ascend 0.30.0rc2: the state ``h`` its chunk op already returns.

Issue 19, Ascend path. :mod:`vllm_hybrid_npu.patches.gdn_prefill_checkpoint` declares one prefill
checkpoint block per GDN layer (vLLM's ``MambaSpec.num_prefill_checkpoint_blocks``) where an
exporter exists, so vLLM's scheduler drops its block-aligned split; the layer must then write the
conv and SSM states at the checkpoint (a 64-token multiple from the step's first token of the
request) into the block the Mamba manager reserved. On the NPU the layer and the metadata builder
are vllm-ascend's:

* layer: ``vllm_ascend/patch/worker/patch_qwen3_5.py`` installs
  ``vllm_ascend.ops.gdn.AscendGatedDeltaNetAttention._forward_core`` as vLLM's
  ``QwenGatedDeltaNetAttention._forward_core`` (A2 / A3 / A5; on 310P, hardware capability
  ``GDN_COMPATIBILITY``, the 310P forward of ``_310p/ops/fla/gdn_310.py`` instead). The spec
  (``get_kv_cache_spec``) stays vLLM's ``MambaBase`` method, and ``NPUPlatform`` calls vLLM's
  ``Platform._align_hybrid_block_size`` through ``super()``: the shared entries of
  ``gdn_prefill_checkpoint`` cover both on ``npu``.
* builder: ``vllm_ascend.ops.gdn_attn_builder.AscendGDNAttentionMetadataBuilder.build`` replaces
  vLLM's ``GDNAttentionMetadataBuilder.build`` (no ``super()`` call), so the step plan is attached
  here, by :func:`~vllm_hybrid_npu.patches.gdn_prefill_checkpoint.build_step_checkpoints` (the same
  rows, offsets, blocks and chunk indices as on CPU / CUDA).

Which prefill path ``_forward_core`` takes (its step 2.3), and what it exposes:

1. ``fla_npu.ops.ascendc.chunk_gated_delta_rule_fwd`` (flash-linear-attention-npu, fused FLA
   prefill) when prefill context parallel is off (``get_pcp_group().world_size == 1``), the
   hardware profile has ``FLA_GDN_PREFILL`` (A2, A3, A5) and ``fla_npu`` has that function.
   vllm-ascend keeps ``output, final_state`` of its results: no per-chunk state.
2. else ``torch_npu.npu_chunk_gated_delta_rule`` (fused CANN op) when PCP is off and
   ``AscendGatedDeltaNetAttention._probe_fused_chunk()`` (the attribute exists and a smoke call
   on the NPU succeeds): returns ``o, final_state`` only.
3. else the chunk path, ``vllm_ascend/ops/triton/fla/chunk.py``: Triton WY preparation, then the
   AscendC op ``torch.ops._C_ascend.chunk_gated_delta_rule_fwd_h_vllm(k, w, u, g, ...)`` ->
   ``(h, v_new, final_state)``, with ``h`` ``[1, HV, NT, K, V]`` in k's dtype (bf16): the state at
   the start of each 64-token chunk of the prefill rows (zero-length rows have no chunk;
   ``csrc/torch_binding.cpp`` / ``torch_binding_meta.cpp`` give the shapes), then
   ``chunk_fwd_o_vllm`` reads ``h`` and it is dropped.

Only path 3 exports: ``h[0, :, chunk]`` at the checkpoint's chunk, transposed to the SSM cache's
``[HV, V, K]`` (vllm-ascend's own ``ssm_state[idx] = final_state.transpose(-1, -2)``), is copied
into the checkpoint block; the conv state from the ``width - 1`` input rows before the checkpoint
(``mixed_qkv``, the rows ``causal_conv1d_fn`` keeps). Where path 1 or 2 is chosen, or PCP is on,
or on 310P, nothing is declared: vLLM keeps its split (correct, one step more), and the reason is
logged (a skipped entry at load, or the spec's INFO line per engine). vllm-ascend 0.30.0rc2's documented
stack ships flash-linear-attention-npu (v26.9.1-beta2) in its images: where that package has the
fused prefill function, path 1 is the default and this exporter does not apply.

The SSM cache must be bf16 (``--mamba-ssm-cache-dtype auto`` on a bf16 model): ``h`` is kept in
bf16, so a float32 cache would get the checkpoint rounded where the split stores float32; then
nothing is declared either.

Verified on CPU only (``tests/ascend/test_gdn_checkpoint_replay.py``: vllm-ascend's real builder,
``_forward_core`` and chunk glue, its AscendC / Triton / fla_npu kernels replaced by torch
references of their contracts); never on an NPU.
"""

from __future__ import annotations

import functools
from typing import Any

from vllm_hybrid_npu.patches import gdn_prefill_checkpoint as gdn
from vllm_hybrid_npu.patches.registry import Patch, is_ours
from vllm_hybrid_npu.patches.vllm_ascend_gdn_path import (
    ASCEND_GDN,
    ASCEND_VERSIONS,
    QWEN_GDN,
    fused_prefill_reason,
)
from vllm_hybrid_npu.support import Stack

ASCEND_BUILDER = "vllm_ascend.ops.gdn_attn_builder"
ASCEND_QWEN_PATCH = "vllm_ascend.patch.worker.patch_qwen3_5"
VLLM_VERSIONS = ("0.30.0",)
#: the AscendC op whose ``h`` is exported (``torch.ops._C_ascend``)
FWD_H_OP = "chunk_gated_delta_rule_fwd_h_vllm"


# --------------------------------------------------------------------------- patches
def _wanted(stack: Stack) -> str | None:
    return gdn.wanted(stack)


def _probe_forward(upstream: Any, stack: Stack) -> str | None:
    if is_ours(upstream):
        return "already the plugin's wrapper (applied on AscendGatedDeltaNetAttention)"
    if (getattr(upstream, "__module__", ""), getattr(upstream, "__qualname__", "")) != (
        ASCEND_GDN, "AscendGatedDeltaNetAttention._forward_core",
    ):
        return (f"the GDN forward is {getattr(upstream, '__module__', '?')}."
                f"{getattr(upstream, '__qualname__', '?')}, not vllm-ascend's chunk-path forward")
    return fused_prefill_reason(True, probe_device=False)


class _CaptureH:
    """``torch.ops._C_ascend.chunk_gated_delta_rule_fwd_h_vllm`` for one layer call: upstream's
    op, then ``h`` at the plan's chunks copied into the checkpoint blocks of ``ssm_state``."""

    def __init__(self, op, ssm_state, plan):
        self.op, self.ssm_state, self.plan, self.calls = op, ssm_state, plan, 0

    def __call__(self, *args, **kwargs):
        h, v_new, final_state = self.op(*args, **kwargs)
        import torch

        # h: [1, HV, NT, K, V] at each chunk start; SSM cache [blocks, HV, V, K]
        with torch.profiler.record_function(gdn.PROFILE_RANGE + ".ssm"):
            picked = h[0].index_select(1, self.plan.chunk_index)  # [HV, n, K, V]
            self.ssm_state[self.plan.slots] = picked.permute(1, 0, 3, 2).to(self.ssm_state.dtype)
        self.calls += 1
        return h, v_new, final_state


def _make_forward(upstream: Any, stack: Stack) -> Any:
    @functools.wraps(upstream)
    def _forward_core(self, mixed_qkv, b, a, core_attn_out):
        import torch
        from vllm.forward_context import get_forward_context
        from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

        raw = get_forward_context().attn_metadata
        md = raw.get(self.prefix) if isinstance(raw, dict) else None
        plan = getattr(md, gdn.PLAN_ATTR, None)
        if plan is None:
            return upstream(self, mixed_qkv, b, a, core_attn_out)
        conv_cache = self.kv_cache[0]
        width = self.conv_kernel_size
        steps = torch.arange(1 - width, 0, device=plan.conv_end.device, dtype=torch.int64)
        rows = mixed_qkv.index_select(0, (plan.conv_end[:, None] + steps).flatten())
        with torch.profiler.record_function(gdn.PROFILE_RANGE + ".conv"):
            rows = rows.view(plan.conv_end.numel(), width - 1, -1).to(conv_cache.dtype)
            conv_cache[plan.slots] = rows.transpose(1, 2) if is_conv_state_dim_first() else rows
        namespace = torch.ops._C_ascend
        op = getattr(namespace, FWD_H_OP)
        capture = _CaptureH(op, self.kv_cache[1], plan)
        setattr(namespace, FWD_H_OP, capture)
        try:
            result = upstream(self, mixed_qkv, b, a, core_attn_out)
        finally:
            setattr(namespace, FWD_H_OP, op)
        if capture.calls != 1:
            raise RuntimeError(
                f"vllm-hybrid-npu: {self.prefix}: a prefill checkpoint was planned but vllm-ascend's "
                f"GDN forward called {FWD_H_OP} {capture.calls} times (a fused prefill op ran?); "
                f"set {gdn.ENV_VAR}=off"
            )
        return result

    return _forward_core


def _make_builder(upstream: Any, stack: Stack) -> Any:
    @functools.wraps(upstream)
    def build(self, common_prefix_len, common_attn_metadata, *args, **kwargs):
        metadata = upstream(self, common_prefix_len, common_attn_metadata, *args, **kwargs)
        plan = gdn.build_step_checkpoints(self, common_attn_metadata, metadata)
        if plan is not None:
            plan.rounds = None  # the CPU path's rounds; the NPU path exports from h
            setattr(metadata, gdn.PLAN_ATTR, plan)
        return metadata

    return build


_UNTIL = "vllm-ascend's GDN forward exports prefill checkpoints itself"
_CORE_SIGNATURE = ("self", "mixed_qkv", "b", "a", "core_attn_out")


def _patch(name, module, qualname, make, why, **kw) -> Patch:
    return Patch(name=name, module=module, qualname=qualname, targets=("npu",),
                 vllm=VLLM_VERSIONS, vllm_ascend=ASCEND_VERSIONS, wanted=_wanted, make=make,
                 behaviour_changing=True, why=why, until=_UNTIL, **kw)


PATCHES = [
    _patch("gdn-checkpoint-ascend-plan", ASCEND_BUILDER, "AscendGDNAttentionMetadataBuilder.build",
           _make_builder, "per-step checkpoint rows, offsets, blocks and h chunk indices on "
           "vllm-ascend's GDN builder (it replaces vLLM's build)",
           signature=("self", "common_prefix_len", "common_attn_metadata")),
    _patch("gdn-checkpoint-ascend-forward", ASCEND_GDN, "AscendGatedDeltaNetAttention._forward_core",
           _make_forward, "vllm-ascend's chunk path: h of its AscendC op "
           "chunk_gated_delta_rule_fwd_h_vllm at the checkpoint's chunk -> SSM block, input rows "
           "-> conv block; skipped where a fused prefill op (fla_npu, or 310P's forward) is chosen",
           signature=_CORE_SIGNATURE, probe=_probe_forward),
    _patch("gdn-checkpoint-ascend-forward-qwen", QWEN_GDN, "QwenGatedDeltaNetAttention._forward_core",
           _make_forward, "the same, where patch_qwen3_5 copied vllm-ascend's forward into vLLM's "
           "Qwen layer before the entry above applied", signature=_CORE_SIGNATURE,
           trigger=ASCEND_QWEN_PATCH, probe=_probe_forward),
    Patch(name="gdn-checkpoint-retention-npu", module="vllm.v1.core.single_type_kv_cache_manager",
          qualname="MambaManager._cache_partial_tail_block", targets=("npu",), vllm=VLLM_VERSIONS,
          wanted=_wanted, make=gdn._make_retention, behaviour_changing=True,
          signature=("self", "request", "num_tokens", "retention_interval"),
          why="gdn-checkpoint-retention on the NPU (vLLM 0.32's fix: the prompt's checkpoint is "
          "cached at retention interval 0); scheduler side, vLLM's own manager under vllm-ascend",
          until="vLLM 0.32 (or gdn-checkpoint-retention lists npu)"),
]
