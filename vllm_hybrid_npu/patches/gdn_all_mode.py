"""GDN states at every block boundary inside the step: vLLM's ``'all'`` mode for GDN models (issue 8).

vLLM 0.30.0 caches a Mamba state at every block boundary in ``--mamba-cache-mode all``, but only
for models that declare ``SupportsMambaPrefixCaching``; Qwen3-Next / Qwen3.5 (GDN) do not, so
``MambaModelConfig.verify_and_update_config`` (``vllm/model_executor/models/config.py``) falls back
to ``align`` with the warning "Hybrid or mamba-based model detected without support for prefix
caching with Mamba cache 'all' mode". Its GDN backend has no 'all'-mode path either:
``GDNAttentionMetadataBuilder.build`` (``vllm/v1/attention/backends/gdn_attn.py``) would take
column 0 of the block table as every request's state slot. This module supplies what is missing,
on the CPU target (vLLM 0.30.0, verified here):

* ``vllm.config.model.ModelConfig.supports_mamba_prefix_caching`` (a property): also ``True`` for
  GDN architectures (:data:`GDN_ARCHITECTURES`), so ``--mamba-cache-mode all`` stays ``all``.
* ``ModelConfig.get_mamba_chunk_size``: :data:`GDN_CHUNK_SIZE` (64) for GDN models, whose
  configs name no chunk size (upstream then answers Mamba1's 2048). ``'all'`` mode aligns the
  block size to it (``Platform._align_hybrid_block_size``), so a GDN model keeps the block size
  it has in align mode (256 tokens for the tiny CPU model instead of 2048).
* ``Qwen3NextForCausalLM.__init__`` (``vllm/model_executor/models/qwen3_next.py``) and
  ``Qwen3_5ForCausalLMBase.__init__`` (``qwen3_5.py``) raise ``NotImplementedError("... does not
  support 'all' prefix caching")``; the wrapper runs them with the cache config reading
  ``align`` (their only use of the mode during construction; the layers read it later, in
  ``get_kv_cache_spec``) and restores ``all`` at once.
* ``GDNAttentionMetadataBuilder.build``: in ``'all'`` mode, attaches a :class:`GdnStepPlan`
  (from :func:`vllm_hybrid_npu.core.gdn_checkpoints.plan_segments`, block ids looked up in the
  block table) to the metadata.
* ``vllm.model_executor.layers.mamba.ops.cpu.gdn_attention._cpu_gdn_attention_nonspec``: with a
  plan, runs upstream's own CPU GDN computation (conv + ``chunk_gated_delta_rule_cpu`` / decode
  update) once per *round* of segments that end on block boundaries, copying each segment's
  start state (conv and SSM) into the slot it writes first. Each boundary's state thus lands in
  its own block, which vLLM's KV-cache manager caches by hash like an attention block.
  ``chunk_gated_delta_rule_cpu`` is split-exact at 64-token multiples (outputs and states
  bit-identical to one pass, bf16 and float32 states: ``tests/ops/test_gdn_split.py``), and block
  sizes are multiples of 64, so the step computes exactly what upstream's one pass computes.
* ``VLLM_HYBRID_NPU_CHECKPOINTS=gdn``: :func:`maybe_switch_to_all` turns ``--mamba-cache-mode
  align`` into ``all`` for GDN models (run from our ``VllmConfig.try_verify_and_update_config``
  wrapper, before vLLM's model hooks).

Not done: CUDA (vLLM's FLA chunk kernel) and NPU (vllm-ascend's GDN kernels) have no 'all'-mode
path here; on those targets nothing is patched and vLLM's fallback to ``align`` stays. vLLM 0.32.0
removed ``'all'`` (its prefill-checkpoint mechanism is the replacement): there ``gdn`` logs a
warning and keeps align mode (:func:`all_mode_available`), and the patches have nothing to act on. Speculative decoding with ``'all'`` is rejected (vLLM's
'all'-mode spec-decode bookkeeping is not mirrored here).

When it can go: when vLLM's GDN backend caches per-block states itself.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any

from vllm_hybrid_npu.core.gdn_checkpoints import plan_segments
from vllm_hybrid_npu.patches.registry import Patch
from vllm_hybrid_npu.support import Stack

logger = logging.getLogger("vllm_hybrid_npu")

#: Architectures whose recurrent layers are GDN (``MambaSpec.mamba_type == "gdn_attention"``).
GDN_ARCHITECTURES = frozenset(
    {
        "Qwen3NextForCausalLM",
        "Qwen3NextMTP",
        "Qwen3_5ForCausalLM",
        "Qwen3_5MoeForCausalLM",
        "Qwen3_5ForConditionalGeneration",
        "Qwen3_5MoeForConditionalGeneration",
    }
)

#: Token chunk of the GDN chunked kernels (vLLM's FLA ``chunk_gated_delta_rule`` and the CPU
#: ``chunk_gated_delta_rule_cpu``): a split at a multiple of it leaves the computation unchanged.
GDN_CHUNK_SIZE = 64

#: Attribute under which the builder wrapper attaches the :class:`GdnStepPlan` to the metadata.
PLAN_ATTR = "vllm_hybrid_npu_gdn_plan"

#: Targets with an in-step GDN checkpoint implementation.
SUPPORTED_TARGETS = ("cpu",)


class GdnAllModeConfigError(ValueError):
    """A configuration 'all' mode for GDN cannot run with; the message names the flag."""


@dataclasses.dataclass
class GdnRound:
    """One batched kernel call of a step: the ``s``-th segment of every request that has one.

    Attributes:
        token_index: int64 [n] batch token indices of the round's tokens, request-major.
        query_start_loc: int32 [k + 1] offsets of the ``k`` segments inside ``token_index``.
        state_indices: int32 [k] block ids the segments read (after the copy) and write.
        has_initial_state: bool [k] whether a segment continues a state (else zeros).
        num_decodes: segments of one token from decode rows (they come first).
        copy_src, copy_dst: int64 [c] block ids: before the call, the conv and SSM states of
            ``copy_src[i]`` are copied into ``copy_dst[i]``.
    """

    token_index: Any
    query_start_loc: Any
    state_indices: Any
    has_initial_state: Any
    num_decodes: int
    copy_src: Any
    copy_dst: Any


@dataclasses.dataclass
class GdnStepPlan:
    """The rounds of one step for one KV-cache group (shared by the group's GDN layers)."""

    rounds: list[GdnRound]
    num_tokens: int
    #: int32 [R] block id each request's state ends the step in (its last segment's slot; the
    #: row's column 0 for a request with no tokens this step)
    final_state_indices: Any


def is_gdn_model(model_config: Any) -> bool:
    """Whether ``model_config`` (``vllm.config.ModelConfig``) is a GDN hybrid (by architecture)."""
    archs = getattr(getattr(model_config, "hf_config", None), "architectures", None) or []
    arch = getattr(model_config, "architecture", None)
    return bool(GDN_ARCHITECTURES.intersection([*archs, *([arch] if arch else [])]))


def all_mode_available() -> bool:
    """Whether the installed vLLM has ``--mamba-cache-mode all`` (vLLM 0.30.0: ``MambaCacheMode =
    Literal["all", "align", "none"]`` in ``vllm/config/cache.py``; 0.32.0 dropped ``"all"``)."""
    import typing

    try:
        from vllm.config.cache import MambaCacheMode
    except ImportError:  # pragma: no cover - every supported vLLM has it
        return False
    return "all" in typing.get_args(MambaCacheMode)


def build_plan(common_attn_metadata: Any, block_size: int, num_decodes: int) -> GdnStepPlan:
    """Build the step's :class:`GdnStepPlan` from vLLM's ``CommonAttentionMetadata``.

    Args:
        common_attn_metadata: vLLM 0.30.0 ``CommonAttentionMetadata`` (``num_reqs``,
            ``query_start_loc_cpu`` int32 [R + 1], ``compute_num_computed_tokens()`` [R + ...],
            ``block_table_tensor`` int32 [R, columns] of block ids).
        block_size: the GDN group's block size, tokens.
        num_decodes: the first ``num_decodes`` rows are decodes (vLLM orders decodes first).

    Raises:
        IndexError: a segment's column is outside the block table (a sizing bug upstream of us).
    """
    import torch

    m = common_attn_metadata
    num_reqs = int(m.num_reqs)
    qsl = m.query_start_loc_cpu[: num_reqs + 1].tolist()
    computed = m.compute_num_computed_tokens()[:num_reqs].cpu().tolist()
    table = m.block_table_tensor[:num_reqs].cpu()
    rounds = []
    final = table[:, 0].to(torch.int32).clone()
    for segments in plan_segments(qsl, computed, block_size):
        token_index, offsets, states, initial, src, dst = [], [0], [], [], [], []
        decodes = 0
        for seg in segments:
            token_index.extend(range(seg.start, seg.end))
            offsets.append(offsets[-1] + seg.end - seg.start)
            block = int(table[seg.request, seg.dst_col])
            states.append(block)
            final[seg.request] = block
            initial.append(seg.has_initial_state)
            decodes += int(seg.request < num_decodes)
            if seg.needs_copy:
                src.append(int(table[seg.request, seg.src_col]))
                dst.append(block)
        device = m.block_table_tensor.device
        rounds.append(
            GdnRound(
                token_index=torch.tensor(token_index, dtype=torch.int64, device=device),
                query_start_loc=torch.tensor(offsets, dtype=torch.int32, device=device),
                state_indices=torch.tensor(states, dtype=torch.int32, device=device),
                has_initial_state=torch.tensor(initial, dtype=torch.bool, device=device),
                num_decodes=decodes,
                copy_src=torch.tensor(src, dtype=torch.int64, device=device),
                copy_dst=torch.tensor(dst, dtype=torch.int64, device=device),
            )
        )
    return GdnStepPlan(
        rounds=rounds,
        num_tokens=int(qsl[-1]),
        final_state_indices=final.to(m.block_table_tensor.device),
    )


def run_rounds(upstream_nonspec, layer, metadata, plan: GdnStepPlan, mixed_qkv, b, a, out) -> None:
    """Run upstream's non-speculative CPU GDN function once per round of ``plan``.

    Args:
        upstream_nonspec: vLLM 0.30.0 ``_cpu_gdn_attention_nonspec(layer, metadata, mixed_qkv, b,
            a, core_attn_out)``; it reads and writes the states of ``layer.kv_cache`` (conv
            state, SSM state) in place at ``metadata.non_spec_state_indices_tensor``.
        layer: the GDN layer (``layer.kv_cache = (conv_state, ssm_state)``, first dim = blocks).
        metadata: the step's ``GDNAttentionMetadata``.
        plan: from :func:`build_plan`.
        mixed_qkv, b, a: [T, ...] bf16 layer inputs (batch token order).
        out: [T, heads, v_dim] output, written for the plan's tokens.
    """
    conv_state, ssm_state = layer.kv_cache[0], layer.kv_cache[1]
    for rnd in plan.rounds:
        if rnd.copy_src.numel():
            conv_state[rnd.copy_dst] = conv_state[rnd.copy_src]
            ssm_state[rnd.copy_dst] = ssm_state[rnd.copy_src]
        k = rnd.state_indices.numel()
        n = rnd.token_index.numel()
        sub = dataclasses.replace(
            metadata,
            num_decodes=rnd.num_decodes,
            num_decode_tokens=rnd.num_decodes,
            num_prefills=k - rnd.num_decodes,
            num_prefill_tokens=n - rnd.num_decodes,
            num_actual_tokens=n,
            has_initial_state=rnd.has_initial_state,
            non_spec_query_start_loc=rnd.query_start_loc,
            non_spec_state_indices_tensor=rnd.state_indices,
        )
        idx = rnd.token_index
        sub_out = out.new_zeros((n, *out.shape[1:]))
        upstream_nonspec(layer, sub, mixed_qkv[idx], b[idx], a[idx], sub_out)
        out[idx] = sub_out


# --------------------------------------------------------------------------- patches
def _make_support_property(upstream: Any, stack: Stack) -> property:
    fget = upstream.fget

    @functools.wraps(fget)
    def supports_mamba_prefix_caching(self) -> bool:
        return bool(fget(self)) or is_gdn_model(self)

    return property(supports_mamba_prefix_caching)


def _make_chunk_size(upstream: Any, stack: Stack) -> Any:
    @functools.wraps(upstream)
    def get_mamba_chunk_size(self) -> int:
        text = getattr(self, "hf_text_config", None)
        if is_gdn_model(self) and not any(
            getattr(text, name, None) for name in ("mamba_chunk_size", "chunk_size")
        ):
            return GDN_CHUNK_SIZE
        return upstream(self)

    return get_mamba_chunk_size


def _make_builder(upstream: Any, stack: Stack) -> Any:
    @functools.wraps(upstream)
    def build(self, common_prefix_len, common_attn_metadata, *args, **kwargs):
        metadata = upstream(self, common_prefix_len, common_attn_metadata, *args, **kwargs)
        if self.vllm_config.cache_config.mamba_cache_mode == "all":
            if metadata.spec_sequence_masks is not None:
                raise GdnAllModeConfigError(
                    "--mamba-cache-mode all for GDN models does not support speculative decoding "
                    "in vllm-hybrid-npu; drop --speculative-config or use align mode"
                )
            plan = build_plan(common_attn_metadata, self.kv_cache_spec.block_size, metadata.num_decodes)
            setattr(metadata, PLAN_ATTR, plan)
            # the slot each request ends the step in (what upstream code reading it sees)
            metadata.non_spec_state_indices_tensor = plan.final_state_indices
        return metadata

    return build


#: (module, class) pairs whose ``__init__`` rejects ``'all'`` mode in vLLM 0.30.0.
GUARDED_INITS = (
    ("vllm.model_executor.models.qwen3_next", "Qwen3NextForCausalLM"),
    ("vllm.model_executor.models.qwen3_5", "Qwen3_5ForCausalLMBase"),
)


def _make_init_guard(upstream: Any, stack: Stack) -> Any:
    @functools.wraps(upstream)
    def __init__(self, *args, **kwargs):
        vllm_config = kwargs.get("vllm_config", args[0] if args else None)
        cache = getattr(vllm_config, "cache_config", None)
        if cache is None or cache.mamba_cache_mode != "all":
            return upstream(self, *args, **kwargs)
        cache.mamba_cache_mode = "align"
        try:
            return upstream(self, *args, **kwargs)
        finally:
            cache.mamba_cache_mode = "all"

    return __init__


def _make_cpu_forward(upstream: Any, stack: Stack) -> Any:
    @functools.wraps(upstream)
    def _cpu_gdn_attention_nonspec(layer, attn_metadata_i, mixed_qkv, b, a, core_attn_out):
        plan = getattr(attn_metadata_i, PLAN_ATTR, None)
        if plan is None:
            return upstream(layer, attn_metadata_i, mixed_qkv, b, a, core_attn_out)
        return run_rounds(upstream, layer, attn_metadata_i, plan, mixed_qkv, b, a, core_attn_out)

    return _cpu_gdn_attention_nonspec


def gdn_wanted(stack: Stack) -> str | None:
    """Skip reason for the ``gdn-*`` entries unless ``VLLM_HYBRID_NPU_CHECKPOINTS=gdn`` (None)."""
    from vllm_hybrid_npu.scheduling import ENV_VAR, selected_policy

    if selected_policy(stack.target) != "gdn":
        return f"{ENV_VAR} is not gdn"
    return None


def _patch(name: str, module: str, qualname: str, make, signature=None) -> Patch:
    return Patch(
        name=name,
        module=module,
        qualname=qualname,
        targets=SUPPORTED_TARGETS,
        vllm=("0.30.0",),
        wanted=gdn_wanted,
        make=make,
        signature=signature,
        behaviour_changing=True,
        why="VLLM_HYBRID_NPU_CHECKPOINTS=gdn: GDN states at every block boundary inside the step "
        "('all' mode for GDN models, CPU)",
        until="vLLM's GDN backend caches per-block states itself",
    )


PATCHES = [
    _patch("gdn-support", "vllm.config.model", "ModelConfig.supports_mamba_prefix_caching",
           _make_support_property),
    _patch("gdn-chunk-size", "vllm.config.model", "ModelConfig.get_mamba_chunk_size",
           _make_chunk_size, ("self",)),
    _patch("gdn-init-qwen3-next", GUARDED_INITS[0][0], f"{GUARDED_INITS[0][1]}.__init__",
           _make_init_guard, ("self",)),
    _patch("gdn-init-qwen3-5", GUARDED_INITS[1][0], f"{GUARDED_INITS[1][1]}.__init__",
           _make_init_guard, ("self",)),
    _patch("gdn-metadata-plan", "vllm.v1.attention.backends.gdn_attn",
           "GDNAttentionMetadataBuilder.build", _make_builder,
           ("self", "common_prefix_len", "common_attn_metadata")),
    _patch("gdn-cpu-rounds", "vllm.model_executor.layers.mamba.ops.cpu.gdn_attention",
           "_cpu_gdn_attention_nonspec", _make_cpu_forward,
           ("layer", "attn_metadata_i", "mixed_qkv", "b", "a", "core_attn_out")),
]


def maybe_switch_to_all(vllm_config: Any, target: str) -> bool:
    """Under ``VLLM_HYBRID_NPU_CHECKPOINTS=gdn``, turn align mode into ``'all'`` for a GDN model.

    Called with the user's configuration before vLLM's model hooks (from our
    ``VllmConfig.try_verify_and_update_config`` wrapper). Also validates an explicit
    ``--mamba-cache-mode all`` for GDN models.

    Returns:
        True when the configuration now uses ``'all'`` mode for a GDN model.

    Raises:
        GdnAllModeConfigError: ``'all'`` (requested or selected by ``gdn``) with
            ``--speculative-config``.
    """
    from vllm_hybrid_npu.scheduling import ENV_VAR, selected_policy

    cache = getattr(vllm_config, "cache_config", None)
    model = getattr(vllm_config, "model_config", None)
    if cache is None or model is None or not is_gdn_model(model):
        return False
    if not getattr(cache, "enable_prefix_caching", False):
        return False
    wants_gdn = selected_policy(target) == "gdn"
    switch = wants_gdn and cache.mamba_cache_mode == "align"
    if switch and target not in SUPPORTED_TARGETS:
        logger.warning(
            "%s=gdn: GDN states inside the step are implemented for %s only (not %s); "
            "staying in align mode", ENV_VAR, ", ".join(SUPPORTED_TARGETS), target,
        )
        return False
    if switch and not all_mode_available():
        logger.warning(
            "%s=gdn: this vLLM has no --mamba-cache-mode all (removed in vLLM 0.32); staying in "
            "align mode", ENV_VAR,
        )
        return False
    if not switch and cache.mamba_cache_mode != "all":
        return False
    if getattr(vllm_config, "speculative_config", None) is not None:
        raise GdnAllModeConfigError(
            "--mamba-cache-mode all (or VLLM_HYBRID_NPU_CHECKPOINTS=gdn) for GDN models does not "
            "support --speculative-config in vllm-hybrid-npu; use --mamba-cache-mode align"
        )
    if switch:
        cache.mamba_cache_mode = "all"
        logger.info(
            "%s=gdn: --mamba-cache-mode align -> all (GDN states at every block boundary)", ENV_VAR
        )
    return True
