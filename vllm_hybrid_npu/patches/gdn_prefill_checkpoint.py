"""GDN prefill checkpoints through vLLM's own interface: no block-aligned split in align mode.

In align mode vLLM stores a GDN state only where a step ends on a block boundary, so its
scheduler ends every cold prompt's step at the prompt's last block boundary
(``Scheduler._mamba_block_aligned_split``): one more forward per cold prompt. Since vLLM 0.30 a
Mamba layer can instead declare ``MambaSpec.num_prefill_checkpoint_blocks = 1`` and
``prefill_checkpoint_alignment`` (``vllm/v1/kv_cache_interface.py``): the scheduler then keeps the
prompt in one step (``use_internal_checkpoint``), the Mamba manager reserves one more state block
at block-table column ``cdiv(seq_len, block) - 2`` (``MambaManager._needs_internal_checkpoint``)
and caches it under the checkpoint position, and the layer must write the state at that position
there from inside the step. vLLM 0.30 / 0.32 do this for Kimi's KDA only; vLLM 0.33 for Qwen GDN
with the FlashInfer prefill backend only. This module fills the slot for Qwen3-Next / Qwen3.5 GDN
layers on the paths vLLM leaves without it:

* ``cpu``: vLLM's CPU GDN function (``_cpu_gdn_attention_nonspec`` in
  ``vllm/model_executor/layers/mamba/ops/cpu/gdn_attention.py``) runs in two rounds for a step
  with checkpoints: every row up to its checkpoint (the others whole), then the checkpointed rows'
  rest, after copying their running state (conv and SSM) into the checkpoint block. The chunk
  function is split-exact at 64-token multiples (``tests/ops/test_gdn_split.py``) and the
  checkpoint offset is one, so outputs and states are bit-identical to one pass.
* ``triton`` (CUDA, ``--gdn-prefill-backend triton``): the FLA chunk kernel already computes the
  state at every 64-token chunk start (``h`` of ``chunk_gated_delta_rule_fwd_h``) and drops it; the
  state at the checkpoint's chunk is copied into the checkpoint block (cast to the SSM cache
  dtype), and the conv state from the step's input rows before the checkpoint.

Entries (``docs/patches.md``): the spec declaration (``get_kv_cache_spec``), the hybrid block
rounded up to the 64-token grid (``Platform._align_hybrid_block_size``, as vLLM 0.33 does), the
per-step plan in ``GDNAttentionMetadataBuilder.build``, the two layer paths, and on vLLM 0.30 the
retention fix vLLM 0.32 made (``MambaManager._cache_partial_tail_block``: the prompt's checkpoint is
its reusable boundary, not a transient state; without it the repeat of a cold prompt hits nothing
at the default ``--prefix-cache-retention-interval 0``).

Where it does not apply (speculative decoding, the FlashInfer backend, a block off the 64-token
grid, NPU, ``VLLM_HYBRID_NPU_PREFILL_CHECKPOINTS=off``) nothing is declared and vLLM keeps its split:
correct, one step more. The load line and one INFO line per engine say which path exports.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any

from vllm_hybrid_npu.core.prefill_checkpoints import ALIGNMENT, aligned_block_size, plan_checkpoints
from vllm_hybrid_npu.patches.registry import Patch
from vllm_hybrid_npu.support import Stack
from vllm_hybrid_npu import envs

logger = logging.getLogger("vllm_hybrid_npu")

#: Environment variable: ``auto`` (default: export where a path exists) or ``off``.
ENV_VAR = "VLLM_HYBRID_NPU_PREFILL_CHECKPOINTS"
MODES = ("auto", "off")

#: Architectures whose recurrent layers are Qwen GDN (``QwenGatedDeltaNetAttention``).
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

#: Attribute under which the builder wrapper attaches the step's :class:`StepCheckpoints`.
PLAN_ATTR = "vllm_hybrid_npu_checkpoints"

#: Profiler range prefix of the export writes (``benchmarks/cuda_serving.py`` sums their GPU time).
PROFILE_RANGE = "vllm_hybrid_npu.export"

#: vLLM versions whose GDN code the layer wrappers were read against.
VLLM_VERSIONS = ("0.30.0", "0.32.0")

_logged: set[str] = set()


def mode() -> str:
    """``$VLLM_HYBRID_NPU_PREFILL_CHECKPOINTS`` (default ``auto``).

    Raises:
        ValueError: a value other than ``auto`` or ``off`` (the message names the variable).
    """
    return envs.choice(ENV_VAR, MODES, "auto")


def is_gdn_model(model_config: Any) -> bool:
    """Whether ``model_config`` (``vllm.config.ModelConfig``) is a Qwen GDN hybrid."""
    archs = getattr(getattr(model_config, "hf_config", None), "architectures", None) or []
    arch = getattr(model_config, "architecture", None)
    return bool(GDN_ARCHITECTURES.intersection([*archs, *([arch] if arch else [])]))


def exporter_path(vllm_config: Any, target: str) -> tuple[str | None, str]:
    """Which path exports GDN prefill checkpoints for this engine.

    Args:
        vllm_config: the engine's ``VllmConfig``.
        target: ``cpu``, ``cuda`` or ``npu``.

    Returns:
        ``("cpu" | "triton", "")`` where ours applies, else ``(None, reason)``.
    """
    if mode() == "off":
        return None, f"{ENV_VAR}=off"
    cache = getattr(vllm_config, "cache_config", None)
    model = getattr(vllm_config, "model_config", None)
    if cache is None or model is None or not is_gdn_model(model):
        return None, "not a Qwen GDN model"
    if not getattr(cache, "enable_prefix_caching", False) or cache.mamba_cache_mode != "align":
        return None, "prefix caching not in align mode"
    if getattr(vllm_config, "speculative_config", None) is not None:
        return None, "speculative decoding configured (vLLM's split kept)"
    if target == "cpu":
        return "cpu", ""
    if target == "cuda":
        from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
            _resolve_gdn_prefill_backend,
        )

        backend = _resolve_gdn_prefill_backend(vllm_config)[1]
        if backend == "triton":
            return "triton", ""
        return None, f"GDN prefill backend {backend} (ours exports from the Triton/FLA kernel only)"
    if target == "npu":
        from vllm_hybrid_npu.patches.vllm_ascend_gdn_path import npu_exporter_path

        return npu_exporter_path(vllm_config)
    return None, f"no exporter for target {target} yet (vLLM's split kept)"


def _log_once(key: str, msg: str, *args: Any) -> None:
    if key not in _logged:
        _logged.add(key)
        logger.info(msg, *args)


# --------------------------------------------------------------------------- step plan
@dataclasses.dataclass
class CpuRound:
    """One call of vLLM's CPU GDN function in a step with checkpoints.

    Attributes:
        token_index: int64 [n] batch token indices of the round, request-major.
        query_start_loc: int32 [k + 1] offsets of the round's ``k`` segments in ``token_index``.
        state_indices: int32 [k] block ids each segment reads and writes.
        has_initial_state: bool [k].
        num_decodes: one-token decode segments, first.
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
class StepCheckpoints:
    """The checkpoints of one step for one GDN KV-cache group (shared by its layers).

    Attributes:
        slots: int64 [n] checkpoint block id per checkpoint (device).
        conv_end: int64 [n] batch token index of the checkpoint (its conv state is the
            ``width - 1`` input rows before it) (device).
        chunk_index: int64 [n] index of the checkpoint's chunk in the FLA kernel's ``h``
            (prefill rows, 64-token chunks) (device).
        rounds: the CPU path's rounds (``None`` off the CPU).
    """

    slots: Any
    conv_end: Any
    chunk_index: Any
    rounds: list[CpuRound] | None = None
    _conv_rows: dict = dataclasses.field(default_factory=dict, repr=False)

    def conv_row_index(self, width: int) -> Any:
        """int64 [n * (width - 1)]: batch indices of the ``width - 1`` input rows before each
        checkpoint, checkpoint-major (device of ``conv_end``). Built once per step and conv
        kernel width, then reused by every GDN layer of the group (one fewer arange, add and
        flatten per layer on the host)."""
        idx = self._conv_rows.get(width)
        if idx is None:
            import torch

            steps = torch.arange(1 - width, 0, device=self.conv_end.device, dtype=torch.int64)
            idx = self._conv_rows[width] = (self.conv_end[:, None] + steps).flatten()
        return idx


def _cpu_rounds(qsl, num_reqs, num_decodes, state_slots, has_initial, ckpts, ckpt_slots, torch):
    by_row = {c.row: (c, s) for c, s in zip(ckpts, ckpt_slots)}
    first = ([], [0], [], [], [], [])
    for row in range(num_reqs):
        start, end = qsl[row], qsl[row + 1]
        if end == start:
            continue
        hit = by_row.get(row)
        stop = start + hit[0].offset if hit else end
        first[0].extend(range(start, stop))
        first[1].append(first[1][-1] + stop - start)
        first[2].append(state_slots[row])
        first[3].append(bool(has_initial[row]) if row >= num_decodes else True)
    second = ([], [0], [], [], [], [])
    for c, slot in zip(ckpts, ckpt_slots):
        start, end = qsl[c.row] + c.offset, qsl[c.row + 1]
        second[0].extend(range(start, end))
        second[1].append(second[1][-1] + end - start)
        second[2].append(state_slots[c.row])
        second[3].append(True)
        second[4].append(state_slots[c.row])
        second[5].append(slot)

    def make(parts, decodes):
        return CpuRound(
            token_index=torch.tensor(parts[0], dtype=torch.int64),
            query_start_loc=torch.tensor(parts[1], dtype=torch.int32),
            state_indices=torch.tensor(parts[2], dtype=torch.int32),
            has_initial_state=torch.tensor(parts[3], dtype=torch.bool),
            num_decodes=decodes,
            copy_src=torch.tensor(parts[4], dtype=torch.int64),
            copy_dst=torch.tensor(parts[5], dtype=torch.int64),
        )

    return [make(first, num_decodes), make(second, 0)]


def build_step_checkpoints(builder: Any, common_attn_metadata: Any, metadata: Any):
    """The step's :class:`StepCheckpoints` for one GDN metadata builder, or None.

    Args:
        builder: vLLM's ``GDNAttentionMetadataBuilder`` (``kv_cache_spec``, ``vllm_config``).
        common_attn_metadata: the step's ``CommonAttentionMetadata`` (``query_start_loc_cpu``
            int32 [R + 1], ``seq_lens_cpu_upper_bound`` int32 [R] (exact for prefill rows),
            ``block_table_tensor`` int32 [R, columns]).
        metadata: the ``GDNAttentionMetadata`` upstream built.

    Raises:
        RuntimeError: the runner gave no host ``seq_lens_cpu_upper_bound`` (the checkpoint block
            the manager reserved would stay unwritten while it is cached).
    """
    import torch
    from vllm.utils.torch_utils import async_tensor_h2d
    from vllm.v1.kv_cache_interface import (
        get_mamba_prefill_checkpoint_position,
        is_mamba_prefill_checkpoint_valid,
    )

    spec = builder.kv_cache_spec
    if (
        getattr(spec, "num_prefill_checkpoint_blocks", 0) <= 0
        or metadata.num_prefills == 0
        or metadata.spec_sequence_masks is not None
    ):
        return None
    m = common_attn_metadata
    if m.seq_lens_cpu_upper_bound is None:
        raise RuntimeError(
            "vllm-hybrid-npu GDN prefill checkpoints: the model runner passed no "
            "seq_lens_cpu_upper_bound; set VLLM_HYBRID_NPU_PREFILL_CHECKPOINTS=off"
        )
    num_reqs = int(m.num_reqs)
    qsl = m.query_start_loc_cpu[: num_reqs + 1].tolist()
    seq_lens = m.seq_lens_cpu_upper_bound[:num_reqs].tolist()
    cache = builder.vllm_config.cache_config
    spec_config = builder.vllm_config.speculative_config
    ckpts = plan_checkpoints(
        qsl,
        seq_lens,
        first_row=metadata.num_decodes,
        block_size=spec.block_size,
        hash_block_size=getattr(cache, "prefix_match_unit", None) or spec.block_size,
        alignment=spec.prefill_checkpoint_alignment,
        drop_eagle_block=bool(spec_config is not None and spec_config.use_eagle_block_drop()),
        position_fn=get_mamba_prefill_checkpoint_position,
        valid_fn=is_mamba_prefill_checkpoint_valid,
    )
    if not ckpts:
        return None
    device = m.block_table_tensor.device
    rows = [c.row for c in ckpts]
    cols = [c.column for c in ckpts]
    # chunk index of each prefill sequence's first chunk in the FLA kernel's h
    first_prefill = metadata.num_decodes
    chunk_starts, acc = {}, 0
    for row in range(first_prefill, num_reqs):
        chunk_starts[row] = acc
        acc += -(-(qsl[row + 1] - qsl[row]) // ALIGNMENT)
    chunk_index = [chunk_starts[c.row] + c.offset // ALIGNMENT for c in ckpts]
    conv_end = [qsl[c.row] + c.offset for c in ckpts]
    if device.type == "cpu":
        table = m.block_table_tensor
        slots_t = table[torch.tensor(rows), torch.tensor(cols)].to(torch.int64)
        slots = slots_t.tolist()
        state_slots = metadata.non_spec_state_indices_tensor.tolist()
        has_initial = metadata.has_initial_state.tolist()
        rounds = _cpu_rounds(qsl, num_reqs, metadata.num_decodes, state_slots, has_initial,
                             ckpts, slots, torch)
        return StepCheckpoints(slots_t, torch.tensor(conv_end), torch.tensor(chunk_index), rounds)
    rows_t = async_tensor_h2d(rows, dtype=torch.int64, device=device)
    cols_t = async_tensor_h2d(cols, dtype=torch.int64, device=device)
    slots_t = m.block_table_tensor[rows_t, cols_t].to(torch.int64)
    return StepCheckpoints(
        slots=slots_t,
        conv_end=async_tensor_h2d(conv_end, dtype=torch.int64, device=device),
        chunk_index=async_tensor_h2d(chunk_index, dtype=torch.int64, device=device),
    )


def run_cpu_rounds(upstream_nonspec, layer, metadata, rounds, mixed_qkv, b, a, out) -> None:
    """Run vLLM's CPU GDN function once per round (see :class:`CpuRound`).

    Args:
        upstream_nonspec: vLLM's ``_cpu_gdn_attention_nonspec(layer, metadata, mixed_qkv, b, a,
            core_attn_out)``; it reads and writes ``layer.kv_cache`` (conv state, SSM state) in
            place at ``metadata.non_spec_state_indices_tensor``.
        layer: the GDN layer.
        metadata: the step's ``GDNAttentionMetadata``.
        rounds: from :func:`build_step_checkpoints`.
        mixed_qkv, b, a: [T, ...] bf16 layer inputs (batch token order).
        out: [T, heads, v_dim] output.
    """
    conv_state, ssm_state = layer.kv_cache[0], layer.kv_cache[1]
    for rnd in rounds:
        k = rnd.state_indices.numel()
        if k == 0:
            continue
        if rnd.copy_src.numel():
            conv_state[rnd.copy_dst] = conv_state[rnd.copy_src]
            ssm_state[rnd.copy_dst] = ssm_state[rnd.copy_src]
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


# The FLA kernel's h for the layer running now: (ssm_state, slots, chunk_index) or None.
_fla_export: list[tuple[Any, Any, Any]] = []


# --------------------------------------------------------------------------- patches
def _make_spec(upstream: Any, stack: Stack) -> Any:
    @functools.wraps(upstream)
    def get_kv_cache_spec(self, vllm_config):
        spec = upstream(self, vllm_config)
        path, reason = exporter_path(vllm_config, stack.target)
        if path is None or spec is None or getattr(spec, "mamba_cache_mode", None) != "align":
            _log_once("spec-none", "vllm-hybrid-npu: GDN prefill checkpoints off: %s; vLLM's "
                      "block-aligned split kept", reason or "not align mode")
            return spec
        if spec.block_size % ALIGNMENT:
            _log_once("spec-grid", "vllm-hybrid-npu: GDN prefill checkpoints off: block size %d "
                      "is not a multiple of %d (set by --block-size?); vLLM's split kept",
                      spec.block_size, ALIGNMENT)
            return spec
        if path == "triton" and any(str(d) == "torch.float32" for d in spec.dtypes[1:]):
            _log_once("spec-fp32", "vllm-hybrid-npu: the SSM cache is float32: the exported "
                      "checkpoint is the FLA kernel's bf16 chunk state cast to float32 (vLLM's "
                      "split stores its float32 final state there); set %s=off for the split",
                      ENV_VAR)
        _log_once("spec-on", "vllm-hybrid-npu: GDN prefill checkpoints exported by the %s path "
                  "(block %d tokens, alignment %d): cold prompts are not split",
                  path, spec.block_size, ALIGNMENT)
        return dataclasses.replace(
            spec, num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=ALIGNMENT
        )

    return get_kv_cache_spec


def _make_block_size(upstream: Any, stack: Stack) -> Any:
    fn = upstream.__func__

    @functools.wraps(fn)
    def _align_hybrid_block_size(cls, vllm_config, backend_cls):
        fn(cls, vllm_config, backend_cls)
        cache = vllm_config.cache_config
        if exporter_path(vllm_config, stack.target)[0] is None or cache.mamba_cache_mode != "align":
            return
        block = cache.block_size
        if not block or block % ALIGNMENT == 0:
            return
        cache.block_size = aligned_block_size(block)
        logger.info(
            "vllm-hybrid-npu: hybrid block size %d -> %d tokens (a multiple of %d, the GDN "
            "prefill checkpoint alignment, as vLLM 0.33 aligns it)", block, cache.block_size,
            ALIGNMENT,
        )
        fn(cls, vllm_config, backend_cls)  # page padding for the new block

    return classmethod(_align_hybrid_block_size)


def _make_builder(upstream: Any, stack: Stack) -> Any:
    @functools.wraps(upstream)
    def build(self, common_prefix_len, common_attn_metadata, *args, **kwargs):
        metadata = upstream(self, common_prefix_len, common_attn_metadata, *args, **kwargs)
        plan = build_step_checkpoints(self, common_attn_metadata, metadata)
        if plan is not None:
            setattr(metadata, PLAN_ATTR, plan)
        return metadata

    return build


def _make_cpu_forward(upstream: Any, stack: Stack) -> Any:
    @functools.wraps(upstream)
    def _cpu_gdn_attention_nonspec(layer, attn_metadata_i, mixed_qkv, b, a, core_attn_out):
        plan = getattr(attn_metadata_i, PLAN_ATTR, None)
        if plan is None or plan.rounds is None:
            return upstream(layer, attn_metadata_i, mixed_qkv, b, a, core_attn_out)
        return run_cpu_rounds(upstream, layer, attn_metadata_i, plan.rounds, mixed_qkv, b, a,
                              core_attn_out)

    return _cpu_gdn_attention_nonspec


def _make_forward_core(upstream: Any, stack: Stack) -> Any:
    @functools.wraps(upstream)
    def _forward_core(self, mixed_qkv, b, a, core_attn_out):
        import torch
        from vllm.forward_context import get_forward_context
        from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

        raw = get_forward_context().attn_metadata
        md = raw.get(self.prefix) if isinstance(raw, dict) else None
        plan = getattr(md, PLAN_ATTR, None)
        if plan is None:
            return upstream(self, mixed_qkv, b, a, core_attn_out)
        # conv state at the checkpoint: the width - 1 input rows before it (their batch indices
        # built by the step's first GDN layer, reused by the others: same plan, same width)
        conv_cache = self.kv_cache[0]
        width = self.conv1d.weight.size(-1)
        with torch.profiler.record_function(PROFILE_RANGE + ".conv"):
            rows = mixed_qkv.index_select(0, plan.conv_row_index(width))
            rows = rows.view(plan.conv_end.numel(), width - 1, -1).to(conv_cache.dtype)
            conv_cache.index_copy_(0, plan.slots, rows.transpose(1, 2) if is_conv_state_dim_first() else rows)
        _fla_export.append((self.kv_cache[1], plan.slots, plan.chunk_index))
        try:
            return upstream(self, mixed_qkv, b, a, core_attn_out)
        finally:
            _fla_export.pop()

    return _forward_core


def _make_fwd_h(upstream: Any, stack: Stack) -> Any:
    @functools.wraps(upstream)
    def chunk_gated_delta_rule_fwd_h(*args, **kwargs):
        h, v_new, final_state = upstream(*args, **kwargs)
        if _fla_export:
            import torch

            ssm_state, slots, chunk_index = _fla_export[-1]
            # h: [1, chunks, H, V, K], the state at each chunk's start; SSM cache [blocks, H, V, K]
            with torch.profiler.record_function(PROFILE_RANGE + ".ssm"):
                ssm_state.index_copy_(0, slots, h[0].index_select(0, chunk_index).to(ssm_state.dtype))
        return h, v_new, final_state

    return chunk_gated_delta_rule_fwd_h


def _make_retention(upstream: Any, stack: Stack) -> Any:
    @functools.wraps(upstream)
    def _cache_partial_tail_block(self, request, num_tokens, retention_interval):
        from vllm.v1.kv_cache_interface import get_mamba_prefill_checkpoint_position

        checkpoint = self._checkpoints.get(request.request_id)
        if checkpoint is not None and retention_interval == 0:
            prompt_checkpoint = get_mamba_prefill_checkpoint_position(
                request.num_prompt_tokens,
                self.block_pool.hash_block_size,
                self.drop_eagle_checkpoint_block,
            )
            if checkpoint[0] == prompt_checkpoint:
                # the prompt's checkpoint is its reusable boundary (vLLM 0.32's
                # is_prompt_checkpoint): cache it as vLLM's split would have
                retention_interval = None
        return upstream(self, request, num_tokens, retention_interval)

    return _cache_partial_tail_block


def wanted(stack: Stack) -> str | None:
    """Skip reason for every entry when ``VLLM_HYBRID_NPU_PREFILL_CHECKPOINTS=off`` (else None)."""
    if mode() == "off":
        return f"{ENV_VAR}=off"
    return None


def _patch(name, module, qualname, make, targets, why, vllm=VLLM_VERSIONS, signature=None,
           until="vLLM's or vllm-ascend's GDN path exports prefill checkpoints itself (vLLM 0.33: "
           "FlashInfer backend only)"):
    return Patch(
        name=name,
        module=module,
        qualname=qualname,
        targets=targets,
        vllm=vllm,
        wanted=wanted,
        make=make,
        signature=signature,
        behaviour_changing=True,
        why=why,
        until=until,
    )


_GDN = "vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn"
PATCHES = [
    _patch("gdn-checkpoint-spec", _GDN, "QwenGatedDeltaNetAttention.get_kv_cache_spec",
           _make_spec, ("cpu", "cuda", "npu"), "declares one prefill checkpoint block (alignment 64) in "
           "the GDN layers' MambaSpec where ours exports, so vLLM drops its block-aligned split",
           signature=("self", "vllm_config")),
    _patch("gdn-checkpoint-block-size", "vllm.platforms.interface",
           "Platform._align_hybrid_block_size", _make_block_size, ("cpu", "cuda", "npu"),
           "hybrid block rounded up to the 64-token checkpoint grid (vLLM 0.33's lcm rule)",
           signature=("cls", "vllm_config", "backend_cls")),
    _patch("gdn-checkpoint-plan", "vllm.v1.attention.backends.gdn_attn",
           "GDNAttentionMetadataBuilder.build", _make_builder, ("cpu", "cuda"),
           "per-step checkpoint rows, offsets and blocks, computed as vLLM's KDA builder does",
           signature=("self", "common_prefix_len", "common_attn_metadata")),
    _patch("gdn-checkpoint-cpu", "vllm.model_executor.layers.mamba.ops.cpu.gdn_attention",
           "_cpu_gdn_attention_nonspec", _make_cpu_forward, ("cpu",),
           "vLLM's CPU GDN function in two rounds split at the checkpoint (split-exact)",
           signature=("layer", "attn_metadata_i", "mixed_qkv", "b", "a", "core_attn_out")),
    _patch("gdn-checkpoint-triton", _GDN, "QwenGatedDeltaNetAttention._forward_core",
           _make_forward_core, ("cuda",), "conv state at the checkpoint from the step's input "
           "rows; SSM state taken from the FLA kernel (next entry)",
           signature=("self", "mixed_qkv", "b", "a", "core_attn_out")),
    _patch("gdn-checkpoint-fla-h", "vllm.third_party.flash_linear_attention.ops.chunk",
           "chunk_gated_delta_rule_fwd_h", _make_fwd_h, ("cuda",),
           "the FLA chunk kernel's per-chunk state h at the checkpoint copied into its block"),
    _patch("gdn-checkpoint-retention", "vllm.v1.core.single_type_kv_cache_manager",
           "MambaManager._cache_partial_tail_block", _make_retention, ("cpu", "cuda"),
           "vLLM 0.32's fix carried: the prompt's checkpoint is cached at retention interval 0",
           vllm=("0.30.0",), signature=("self", "request", "num_tokens", "retention_interval"),
           until="vLLM 0.30 leaves the support matrix (vLLM 0.32 has the rule)"),
]
