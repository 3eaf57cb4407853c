"""GDN prefill checkpoints through vLLM's own interface: no block-aligned split in align mode.

In align mode vLLM stores a GDN state only where a step ends on a block boundary, so its scheduler
ends every cold prompt's step at the prompt's last block boundary
(``Scheduler._mamba_block_aligned_split``): one more forward per cold prompt. A Mamba layer whose
``MambaSpec`` declares ``num_prefill_checkpoint_blocks = 1`` (vLLM >= 0.30) keeps the prompt in
one step and writes the state at the prompt's checkpoint into a reserved block from inside the
step. vLLM 0.30 / 0.32 do that for Kimi's KDA only, vLLM 0.33 for Qwen GDN with FlashInfer only;
this module does it for Qwen3-Next / Qwen3.5 GDN layers on the paths they leave without it: vLLM's
CPU GDN function (``cpu``: the split, as two calls of it), CUDA's FLA kernels (``triton``: one
pass, our chunk-state kernel in place of FLA's writing the checkpoint states; the split only with
``FLA_USE_FAST_OPS=1``) and vllm-ascend 0.30.0rc2's three prefill paths (:mod:`.vllm_ascend_gdn`:
the split). The methods are
:mod:`vllm_hybrid_npu.ops.gdn_checkpoint`'s; the plan is
:func:`~vllm_hybrid_npu.core.prefill_checkpoints.plan_step`'s (on vLLM 0.33 of vLLM's own plan),
built per step and KV-cache group in the GDN metadata builder and handed to the layers as a typed
field (:data:`FIELD`) of the GDN metadata. Elsewhere (speculative decoding where
:func:`speculative_off` says, FlashInfer, a block off the 64-token grid,
``VLLM_HYBRID_NPU_PREFILL_CHECKPOINTS=off``) nothing is declared and vLLM keeps its split (or, on 0.33 with FlashInfer, exports itself); the spec's INFO line says which
path and method export and who planned, or why none does.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import itertools
import logging
import os
import sys
from typing import Any, Callable, Sequence

import torch

from vllm_hybrid_npu import envs
from vllm_hybrid_npu.core import prefill_checkpoints as core
from vllm_hybrid_npu.ops import gdn_checkpoint as ops
from vllm_hybrid_npu.patches import registry
from vllm_hybrid_npu.patches.registry import Patch, is_ours
from vllm_hybrid_npu.support import Stack, detect_stack

logger = logging.getLogger("vllm_hybrid_npu")

#: Environment variable: ``auto`` (default: export where a path exists) or ``off``.
ENV_VAR = "VLLM_HYBRID_NPU_PREFILL_CHECKPOINTS"
MODES = ("auto", "off")
#: Architectures whose recurrent layers are Qwen GDN (``QwenGatedDeltaNetAttention``).
GDN_ARCHITECTURES = frozenset({
    "Qwen3NextForCausalLM", "Qwen3NextMTP", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM",
    "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration",
})
#: The GDN metadata field carrying a step's ``ops.CheckpointMetadata`` (:func:`with_checkpoints`).
FIELD = "prefill_checkpoints"
#: The version gate: vLLM versions the entries were read against. On ``OWN_PLAN`` ours plans (vLLM
#: 0.30 / 0.32's rule); on ``VLLM_PLAN`` vLLM's GDN builder does (its ``checkpoint``) and ours writes.
OWN_PLAN, VLLM_PLAN = ("0.30.0", "0.32.0"), ("0.33.0",)
VLLM_VERSIONS = OWN_PLAN + VLLM_PLAN
ASCEND_VERSIONS = ("0.30.0rc2",)
ASCEND_GDN = "vllm_ascend.ops.gdn"
QWEN_GDN = "vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn"

_logged: set[str] = set()


def mode() -> str:
    """``$VLLM_HYBRID_NPU_PREFILL_CHECKPOINTS`` (default ``auto``); raises ValueError naming the
    variable for a value other than ``auto`` or ``off``."""
    return envs.choice(ENV_VAR, MODES, "auto")


def is_gdn_model(model_config: Any) -> bool:
    """Whether ``model_config`` (``vllm.config.ModelConfig``) is a Qwen GDN hybrid."""
    archs = getattr(getattr(model_config, "hf_config", None), "architectures", None) or []
    return not GDN_ARCHITECTURES.isdisjoint([*archs, getattr(model_config, "architecture", None)])


# --------------------------------------------------------------------------- which path
#: Exporter paths whose worker writes the engine's checkpoints under EAGLE/MTP speculative
#: decoding, on the vLLM versions of :data:`SPEC_DECODE_VLLM` (and, on the NPU, the vllm-ascend
#: versions of :data:`SPEC_DECODE_ASCEND`). The conv state is ``width - 1 + k`` wide there and a
#: prefill reads and writes its first ``width - 1`` columns. The CPU worker's part: vLLM 0.30's
#: speculative CPU GDN path split at the checkpoints by the ``gdn-checkpoint-cpu-spec*`` entries
#: in steps with and without speculative decode rows. vllm-ascend's: its one prefill kernel of a
#: step runs the non-speculative rows alone (``non_spec_token_indx``'s tokens, ``num_decodes``
#: 0), which the NPU paths' kernel wrappers split as without speculative decoding; the forward
#: wrapper takes the conv rows through that index (:func:`make_forward`). In steps with
#: speculative decode rows the builder plans the other rows alone (:func:`build_checkpoints`).
#: CUDA's one pass does not wrap vLLM's speculative path (multi-slot SSM states, the wide conv
#: buffer, the rows reordered by ``spec_sequence_masks``). A path named here declares the
#: checkpoint under EAGLE/MTP; the engine's side (the drafter-drop checkpoint,
#: :func:`speculative_off`) is the same for every path.
SPEC_DECODE_PATHS: frozenset[str] = frozenset(
    {"cpu", "ascend", "ascend-fla-npu", "ascend-fused", "ascend-chunk"})
#: vLLM versions whose speculative GDN paths the entries were read against: the CPU functions
#: (``_spec_aware_nonspec``, ``_spec_aware_nonspec_subset``) and the GDN metadata vllm-ascend's
#: builder fills (``spec_sequence_masks``, ``non_spec_token_indx``).
SPEC_DECODE_VLLM = ("0.30.0",)
#: vllm-ascend versions whose speculative GDN forward and builder
#: (``AscendGatedDeltaNetAttention._forward_core``, ``AscendGDNAttentionMetadataBuilder.build``)
#: the NPU paths' export was read against.
SPEC_DECODE_ASCEND = ("0.30.0rc2",)


def cpu_amx_tiles() -> bool:
    """Whether this CPU has AMX tiles (``torch.cpu._is_amx_tile_supported``), where vLLM 0.30's
    speculative CPU GDN path runs the prefill's conv through its C++ ``causal_conv1d_fwd_cpu`` on
    the ``width - 1 + k`` wide conv state; the CPU export under speculative decoding was checked
    against the torch convolution only (:func:`speculative_off` refuses there)."""
    import torch

    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe and probe())


def speculative_off(vllm_config: Any, path: str, stack: Stack | None = None) -> str | None:
    """Why the exporter ``path`` declares no checkpoint under the speculative decoding of
    ``vllm_config`` (a str), or None (no speculative decoding, or an EAGLE/MTP drafter on a path
    of :data:`SPEC_DECODE_PATHS` with vLLM of :data:`SPEC_DECODE_VLLM` and, on the NPU,
    vllm-ascend of :data:`SPEC_DECODE_ASCEND`). vLLM 0.30 treats
    ``speculative_config.use_eagle()`` drafters (``eagle``, ``eagle3``, ``mtp``:
    ``qwen3_next_mtp`` is rewritten to ``mtp``, ``dflash``, ``dspark``) by its EAGLE block drop, which the Mamba manager's checkpoint follows
    (``get_mamba_prefill_checkpoint_position(..., drop)``, one prefix-match unit lower) and the
    engine's plan lists (``core.step_checkpoints``); other drafters (``ngram``, a draft model,
    ``suffix``, ``medusa``) are not checked against the plan. ``stack``: the stack to judge
    (the hit-rate lab's modelled target); default the plugin's loaded stack, else the installed
    one."""
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None:
        return None
    if not spec.use_eagle():
        return (f"speculative decoding with method {getattr(spec, 'method', None)!r}, not an "
                "EAGLE/MTP drafter (vLLM's split kept)")
    if path == "cpu" and cpu_amx_tiles():
        return ("EAGLE/MTP speculative decoding on a CPU with AMX tiles: vLLM's C++ conv kernel "
                "writes the wide conv state there, which the CPU export was not checked against "
                "(vLLM's split kept)")
    if path not in SPEC_DECODE_PATHS:
        return (f"EAGLE/MTP speculative decoding: the {path} path does not write GDN checkpoints "
                "under speculative decoding (its worker wraps no speculative GDN path; only "
                f"{sorted(SPEC_DECODE_PATHS)} does; vLLM's split kept)")
    # the plugin's loaded stack, else (an engine built without the plugin's load: the lab) the
    # installed vLLM's version, read from its package metadata
    stack = stack or registry.REPORT.stack or detect_stack(target_of(path))
    if stack.vllm not in SPEC_DECODE_VLLM:
        return (f"EAGLE/MTP speculative decoding on vLLM {stack.vllm}: the {path} path writes under "
                f"speculative decoding on vLLM {SPEC_DECODE_VLLM} only (vLLM's split kept)")
    if target_of(path) == "npu" and stack.vllm_ascend not in SPEC_DECODE_ASCEND:
        return (f"EAGLE/MTP speculative decoding on vllm-ascend {stack.vllm_ascend}: the {path} "
                f"path writes under speculative decoding on vllm-ascend {SPEC_DECODE_ASCEND} only "
                "(vllm-ascend's split kept)")
    return None


def target_of(path: str) -> str:
    """The target (``cpu``, ``cuda``, ``npu``) of an exporter path of :func:`exporter_path`."""
    return "cpu" if path == "cpu" else "cuda" if path == "triton" else "npu"


def exporter_path(vllm_config: Any, target: str) -> tuple[str | None, str]:
    """Which path exports GDN prefill checkpoints for the engine of ``vllm_config`` on ``target``
    (``cpu``, ``cuda``, ``npu``): ``(path, "")`` (``cpu``, ``triton``, ``ascend-fla-npu``,
    ``ascend-fused``, ``ascend-chunk``; ``ascend`` before the worker knows which) or
    ``(None, reason)``; under speculative decoding only where :func:`speculative_off` allows."""
    if getattr(vllm_config, "speculative_config", None) is not None and \
            target not in {target_of(p) for p in SPEC_DECODE_PATHS}:
        # no path of this target writes under speculative decoding (CUDA): refused before its
        # backend is probed
        return None, speculative_off(vllm_config, {"cpu": "cpu", "cuda": "triton"}.get(target, "ascend"))
    path, reason = _path(vllm_config, target)
    if path is not None and (why := speculative_off(vllm_config, path)) is not None:
        return None, why
    return path, reason


def _path(vllm_config: Any, target: str) -> tuple[str | None, str]:
    """:func:`exporter_path` before the speculative decoding check."""
    if mode() == "off":
        return None, f"{ENV_VAR}=off"
    cache = getattr(vllm_config, "cache_config", None)
    model = getattr(vllm_config, "model_config", None)
    if cache is None or model is None or not is_gdn_model(model):
        return None, "not a Qwen GDN model"
    if not getattr(cache, "enable_prefix_caching", False) or cache.mamba_cache_mode != "align":
        return None, "prefix caching not in align mode"
    if target == "cpu":  # vLLM 0.33 sends other dtypes to the Triton path (triton-cpu)
        dtype = str(getattr(model, "dtype", "torch.bfloat16"))
        return ("cpu", "") if dtype == "torch.bfloat16" else (None, f"CPU GDN in {dtype}")
    if target == "cuda":
        backend = sys.modules[QWEN_GDN]._resolve_gdn_prefill_backend(vllm_config)[1] \
            if QWEN_GDN in sys.modules else "triton"
        if backend == "triton":
            return "triton", ""
        return None, f"GDN prefill backend {backend} (ours exports on the Triton/FLA path only)"
    if target != "npu":
        return None, f"no exporter for target {target} (vLLM's split kept)"
    # vllm-ascend 0.30.0rc2's prefill path as its _forward_core chooses it (step 2.3); before the
    # worker imports its GDN module (engine configuration) only the configuration is read
    version = getattr(registry.REPORT.stack, "vllm_ascend", None)
    if version not in ASCEND_VERSIONS:
        return None, f"no GDN exporter for vllm-ascend {version} (read against {ASCEND_VERSIONS[0]})"
    pcp = getattr(getattr(vllm_config, "parallel_config", None), "prefill_context_parallel_size", 1)
    if (pcp or 1) > 1:
        return None, "prefill context parallel on (vllm-ascend carries the conv state across ranks)"
    from vllm_ascend.device.hardware_profile import HardwareCapability as cap
    from vllm_ascend.device.hardware_profile import get_current_hardware_profile

    profile = get_current_hardware_profile()
    if profile.supports(cap.GDN_COMPATIBILITY):
        return None, "310P: vllm-ascend's 310P GDN forward (_310p/ops/fla/gdn_310.py)"
    gdn = sys.modules.get(ASCEND_GDN)
    if gdn is None:
        return "ascend", ""
    core_fn = getattr(sys.modules[QWEN_GDN].QwenGatedDeltaNetAttention, "_forward_core", None)
    if core_fn is None or not is_ours(core_fn):
        return None, "vLLM's Qwen GDN forward is not vllm-ascend's, wrapped by the plugin"
    if profile.supports(cap.FLA_GDN_PREFILL) and gdn._get_fla_gdn_prefill_op() is not None:
        return "ascend-fla-npu", ""
    if gdn.AscendGatedDeltaNetAttention._probe_fused_chunk():
        return "ascend-fused", ""
    return "ascend-chunk", ""


def export_method(path: str, spec: Any = None, vllm_config: Any = None) -> str:
    """``"fused"`` on the Triton/FLA path (our chunk-state kernel writes the checkpoints in the one
    pass; not with ``FLA_USE_FAST_OPS=1``, whose fast ``exp`` ours does not mirror), else
    ``"split"`` (CPU, vllm-ascend). ``spec`` and ``vllm_config`` are not read (kept for callers)."""
    return "fused" if path == "triton" and os.environ.get("FLA_USE_FAST_OPS", "0") != "1" else "split"


def _log_once(key: str, msg: str, *args: Any) -> None:
    if key not in _logged:
        _logged.add(key)
        logger.info("vllm-hybrid-npu: GDN prefill checkpoints " + msg, *args)


# --------------------------------------------------------------------------- step metadata
@functools.lru_cache(maxsize=None)
def _with_field(cls: type) -> type:
    return dataclasses.make_dataclass(cls.__name__, [(FIELD, "ops.CheckpointMetadata | None", None)],
                                      bases=(cls,), namespace={"__module__": cls.__module__})


def with_checkpoints(metadata: Any, checkpoints: ops.CheckpointMetadata) -> Any:
    """``metadata`` (vLLM's ``GDNAttentionMetadata``, a dataclass) as an instance of a subclass
    with the field :data:`FIELD` set; attributes set on it outside its fields (vllm-ascend's
    builder adds some) are carried over."""
    names = {f.name for f in dataclasses.fields(metadata) if f.init}
    out = _with_field(type(metadata))(**{n: getattr(metadata, n) for n in names},
                                      **{FIELD: checkpoints})
    vars(out).update({k: v for k, v in vars(metadata).items() if k not in names})
    return out


def _to_device(device: Any) -> ops.ToDevice:
    from vllm.utils.torch_utils import async_tensor_h2d

    return lambda values, dtype: async_tensor_h2d(values, dtype=dtype, device=device)


def build_checkpoints(builder: Any, common: Any, metadata: Any, stack: Stack,
                      kernel_meta: Callable[[Any, Any], ops.KernelMeta | None],
                      draft_tokens_cpu: torch.Tensor | None = None):
    """The step's :class:`~vllm_hybrid_npu.ops.gdn_checkpoint.CheckpointMetadata` for a GDN
    metadata ``builder`` (vLLM's or vllm-ascend's; its ``kv_cache_spec``, ``vllm_config``), or None,
    from the step's ``CommonAttentionMetadata`` (host ``query_start_loc_cpu`` and
    ``seq_lens_cpu_upper_bound``, device ``block_table_tensor``) and the ``metadata`` upstream
    built; ``kernel_meta(builder, device)`` gives the split's chunk metadata. One checkpoint per
    row is vLLM's plan: on :data:`VLLM_PLAN` vLLM 0.33's own (``metadata.checkpoint``:
    ``compute_mamba_prefill_checkpoints`` offsets and the blocks it gathered; None where it
    exports itself), else ``core.checkpoint_offsets``, in the row's block-table column. Every other
    checkpoint (junctions, crossed boundaries, second blocks) is the engine's explicit list for
    the step (:data:`STEP`, :mod:`.gdn_step_checkpoints`), with its block ids: no block-table
    column is read for them.

    Per step, the plan is made once: the step's other GDN KV-cache groups, whose lists differ in
    block ids only, take it (:data:`_PLAN`) with its device tensors (``ops.build_metadata``), and
    the blocks the engine named for every group go up in one upload (:func:`_named_blocks`); a
    group's own work is then its table's gather, or nothing where the engine named every block.

    In a step with speculative decode rows (``metadata.spec_sequence_masks`` set; the rows whose
    ``draft_tokens_cpu``, vLLM's ``num_decode_draft_tokens_cpu`` int32 [R], is >= 0) the plan is
    of the other rows alone, in vLLM's non-speculative order and token layout (the rows and
    tokens its ``non_spec_token_indx`` selects, ``num_decodes`` 0: vLLM and vllm-ascend run their
    1-token rows as prefills there), which the CPU path's ``_spec_aware_nonspec_subset`` and
    vllm-ascend's prefill kernel receive; only on :data:`SPEC_DECODE_VLLM` and the CPU and NPU
    targets (nothing of ours is declared under speculative decoding elsewhere:
    :data:`SPEC_DECODE_PATHS`).

    Raises:
        RuntimeError: the runner gave no ``seq_lens_cpu_upper_bound`` where it is read (the
            reserved checkpoint block would be cached unwritten), the engine's list names a
            position outside its row's chunk (:func:`_with_explicit`) or a speculative decode row.
    """
    spec, config, table = builder.kv_cache_spec, builder.vllm_config, common.block_table_tensor
    if getattr(spec, "num_prefill_checkpoint_blocks", 0) <= 0 or metadata.num_prefills == 0:
        return None
    n = int(common.num_reqs)
    qsl = common.query_start_loc_cpu[: n + 1].tolist()
    lists = _step_lists(builder, n)
    explicit = _explicit_rows(lists)
    table_rows = None  # the plan's rows are the batch's
    if common.seq_lens_cpu_upper_bound is None and (explicit or stack.vllm not in VLLM_PLAN):
        raise RuntimeError(f"vllm-hybrid-npu GDN prefill checkpoints: the model runner passed no "
                           f"seq_lens_cpu_upper_bound; set {ENV_VAR}=off")
    seq_lens = None if common.seq_lens_cpu_upper_bound is None else \
        common.seq_lens_cpu_upper_bound[:n].tolist()
    if metadata.spec_sequence_masks is not None:
        if stack.target not in ("cpu", "npu") or stack.vllm not in SPEC_DECODE_VLLM:
            return None  # no speculative path of ours: nothing of ours declared (speculative_off)
        drafted = (draft_tokens_cpu[:n] >= 0).tolist() if draft_tokens_cpu is not None \
            else metadata.spec_sequence_masks[:n].tolist()
        keep = [r for r in range(n) if not drafted[r]]  # vLLM's non-speculative rows, in order
        if bad := sorted(set(explicit) - set(keep)):
            raise RuntimeError(f"vllm-hybrid-npu GDN checkpoints: the engine sent checkpoints for "
                               f"speculative decode rows {bad}: {[explicit[r] for r in bad]}")
        explicit = {keep.index(r): v for r, v in explicit.items()}
        qlens = [qsl[r + 1] - qsl[r] for r in keep]
        qsl, seq_lens, n = [0, *itertools.accumulate(qlens)], [seq_lens[r] for r in keep], len(keep)
        table_rows = keep  # the plan's row r is the batch's keep[r]
        assert metadata.num_decodes == 0, "vLLM and vllm-ascend run 1-token rows as prefills here"
    if stack.vllm in VLLM_PLAN:  # request rows 0..n-1; each row's block (gathered) as a column
        planned = metadata.checkpoint
        if _path_of(builder, stack) is None or (planned is None and not explicit):
            return None  # no path of ours (vLLM's FlashInfer exports its own plan), or nothing
        offsets, cols = (list(planned.offsets), [0] * n) if planned else ([0] * n, [-1] * n)
        table = planned.state_indices[:, None] if planned else common.block_table_tensor[:n, :0]
        table_rows, width = None, table.shape[1]
        plan = _plan(qsl, seq_lens, offsets, cols, explicit, width, metadata.num_decodes)
    else:
        spec_config, width = config.speculative_config, table.shape[1]
        rule = (getattr(config.cache_config, "prefix_match_unit", None) or spec.block_size,
                spec.block_size, spec.prefill_checkpoint_alignment,
                bool(spec_config is not None and spec_config.use_eagle_block_drop()))
        key = (tuple(qsl), tuple(seq_lens), metadata.num_decodes, width, rule,
               tuple((r, tuple((p, k) for p, _, k in e)) for r, e in explicit.items()))
        memo = _PLAN[:]
        if memo[0] == key:  # planned by the step's first GDN KV-cache group (the others alike)
            plan = memo[1]
        else:
            from vllm.v1 import kv_cache_interface as kv

            offsets, cols = core.checkpoint_offsets(
                seq_lens, [e - s for s, e in zip(qsl, qsl[1:])], hash_block_size=rule[0],
                block_size=rule[1], alignment=rule[2], drop_eagle_block=rule[3],
                position_fn=kv.get_mamba_prefill_checkpoint_position,
                valid_fn=kv.is_mamba_prefill_checkpoint_valid)
            plan = _plan(qsl, seq_lens, offsets, cols, explicit, width, metadata.num_decodes)
            _PLAN[:] = [key, plan]
    if plan is None:
        return None
    method, to_device = _method_of(builder, stack), _to_device(table.device)
    named = _named_blocks(lists, plan, width, table_rows, to_device) if explicit else None
    return ops.build_metadata(plan, table, to_device, method,
                              kernel_meta(builder, table.device) if method == "split" else None,
                              named=named, table_rows=table_rows)


#: ``[key, plan]``: the last plan :func:`build_checkpoints` made from ``core.checkpoint_offsets``,
#: keyed by everything it reads (the rows' lengths, the listed positions and kinds, the table's
#: width, the block, alignment and drop rule); the step's other GDN KV-cache groups, whose lists
#: differ in block ids only, take it as it is.
_PLAN: list = [None, None]


def _plan(qsl: list, seq_lens: list, offsets: list, cols: list, explicit: dict, width: int,
          num_decodes: int) -> core.StepPlan | None:
    """``core.plan_step`` of the rows' own checkpoints (``offsets``, ``cols``) with the engine's
    ``explicit`` lists (:func:`_with_explicit`, columns from ``width``)."""
    junctions: dict = {}
    if explicit:
        offsets, cols, junctions = _with_explicit(
            explicit, seq_lens, [e - s for s, e in zip(qsl, qsl[1:])], list(offsets), list(cols), width)
    return core.plan_step(qsl, offsets, cols, num_decodes, junctions=junctions)


def _path_of(builder: Any, stack: Stack) -> str | None:
    """:func:`exporter_path` of ``builder``'s engine on ``stack``'s target, decided once per GDN
    metadata builder and stack (it reads the configuration, the resolved GDN backend and the
    environment, none of which changes while the worker runs)."""
    memo = vars(builder).setdefault("_vhn_exporter_path", {})
    if stack not in memo:
        memo[stack] = exporter_path(builder.vllm_config, stack.target)[0]
    return memo[stack]


def _method_of(builder: Any, stack: Stack) -> str:
    """:func:`export_method` of :func:`_path_of`."""
    return export_method(_path_of(builder, stack))


#: The step a model runner is executing with explicit checkpoints (the ``gdn-checkpoint-receive*``
#: entries set it, :mod:`.gdn_step_checkpoints`): ``(runner, {KV-cache group id: {request id:
#: ((position, block id, kind), ...)}})``, or None.
STEP: contextvars.ContextVar = contextvars.ContextVar("vhn_step_checkpoints", default=None)
#: The V2 runner's attribute (set by ``gdn-checkpoint-v2-rows``) holding the step's batch order,
#: ``input_batch.req_ids``.
V2_REQ_IDS = "_vhn_req_ids"


#: A step's explicit lists as one GDN metadata builder reads them (:func:`_step_lists`):
#: ``(payload, KV-cache group id, request ids of the batch rows)``, ``payload`` as in
#: :data:`STEP`.
StepLists = tuple


def _step_lists(builder: Any, num_reqs: int) -> StepLists | None:
    """For a GDN metadata ``builder`` of the step the model runner is executing (:data:`STEP`)
    whose KV-cache group the engine listed checkpoints for: ``(payload, group id, request ids
    of the first num_reqs batch rows)`` (rows: the runner's ``input_batch.req_ids``, vLLM's and
    vllm-ascend's V1 runners, or the V2 runner's batch order, :data:`V2_REQ_IDS`); else None."""
    step = STEP.get()
    if step is None:
        return None
    runner, payload = step
    for gid, groups in enumerate(runner.attn_groups):
        if gid in payload and any(builder in g.metadata_builders for g in groups):
            rows = vars(runner).get(V2_REQ_IDS)
            rows = runner.input_batch.req_ids if rows is None else rows
            return payload, gid, list(rows[:num_reqs])
    return None


def _explicit_rows(lists: StepLists | None) -> dict[int, tuple]:
    """``{batch row: ((position, block id, kind), ...)}`` of the rows the engine listed in the
    builder's KV-cache group (:func:`_step_lists`); empty without."""
    if lists is None:
        return {}
    payload, gid, rids = lists
    ids = payload[gid]
    return {r: ids[rid] for r, rid in enumerate(rids) if rid in ids}


def _step_checkpoints(builder: Any, num_reqs: int) -> dict[int, tuple]:
    """:func:`_explicit_rows` of ``builder``'s step (empty outside a step with lists)."""
    return _explicit_rows(_step_lists(builder, num_reqs))


#: ``[(payload, plan, width, table rows), {KV-cache group id: int64 [m] device tensor}]``: the
#: named blocks of the last step's plan, uploaded once for every group the engine listed alike
#: (:func:`_named_blocks`).
_NAMED: list = [None, {}]


def _named_blocks(lists: StepLists, plan: core.StepPlan, width: int,
                  table_rows: Sequence[int] | None, to_device: ops.ToDevice) -> torch.Tensor:
    """int64 [m] on the device: the engine's block for each of ``plan``'s checkpoints in a
    column at or past ``width`` (:func:`_with_explicit`'s), in the plan's order, for the
    builder's KV-cache group. The step's first group uploads the blocks of every group whose
    lists name the same positions and kinds for those rows, in one ``to_device``; the others
    take their slice (:data:`_NAMED`)."""
    payload, gid, rids = lists
    key, found = _NAMED[:]
    if (key is not None and key[0] is payload and key[1:] == (plan, width, table_rows)
            and gid in found):
        return found[gid]
    picks = [(rids[r if table_rows is None else table_rows[r]], c - width)
             for r, c in zip(plan.rows, plan.cols) if c >= width]
    own = payload[gid]
    shape = {rid: [(p, k) for p, _, k in own[rid]] for rid, _ in picks}
    blocks = {g: [lists_[rid][j][1] for rid, j in picks] for g, lists_ in payload.items()
              if all(rid in lists_ and [(p, k) for p, _, k in lists_[rid]] == s
                     for rid, s in shape.items())}
    m = len(picks)
    buf = to_device([b for ids in blocks.values() for b in ids], torch.int64)
    found = {g: buf[i * m:(i + 1) * m] for i, g in enumerate(blocks)}
    _NAMED[:] = [(payload, plan, width, table_rows), found]
    return found[gid]


def _with_explicit(explicit: dict[int, tuple], seq_lens: list, qlens: list, offsets: list,
                   cols: list, width: int):
    """The step's plan inputs with the engine's explicit checkpoints: each row of ``explicit``
    (``{row: ((position, block id, kind), ...)}``, :func:`core.step_checkpoints`, ascending) takes
    all of its checkpoints from the list, the ``j``-th in column ``width + j`` (past the group's
    block table, ``width`` columns: a block the engine names, :func:`_named_blocks`). A list
    ending in the chunk's own checkpoint (``prompt`` or ``second``) gives the row's checkpoint;
    the rest are junctions (``plan_step``'s). Returns ``(offsets, cols, junctions)``; host
    lists only.

    A row whose own plan (``offsets[row]`` > 0) is not the list's last checkpoint takes the
    list's (the blocks the KV-cache manager keys), logged once as a warning.

    Raises:
        RuntimeError: a listed position outside the row's chunk (the engine and the worker
            disagree on the chunk: its blocks would be cached with other states).
    """
    junctions = {}
    for r, entries in explicit.items():
        start = seq_lens[r] - qlens[r]
        points = [(p - start, width + j) for j, (p, _, _) in enumerate(entries)]
        own = points.pop() if entries[-1][2] in ("prompt", "second") else (0, -1)
        if not all(0 < o < qlens[r] for o, _ in points + [own] * (own[1] >= 0)):
            raise RuntimeError(f"vllm-hybrid-npu GDN checkpoints: row {r} ({start}-{seq_lens[r]} "
                               f"tokens): the engine sent {entries}, outside the row's chunk")
        if offsets[r] and offsets[r] != own[0] and "plan-mismatch" not in _logged:
            _logged.add("plan-mismatch")
            logger.warning("vllm-hybrid-npu: GDN prefill checkpoints: row %d (%d-%d tokens) plans "
                           "offset %d, the engine's KV-cache manager reserved %s; the engine's "
                           "list is written (logged once)", r, start, seq_lens[r], offsets[r], entries)
        offsets[r], cols[r] = own
        if points:
            junctions[r] = points
    return offsets, cols, junctions


#: Exporter paths that write several checkpoints per row (shared-prefix junctions, crossed block
#: boundaries, second blocks: the engine's explicit list, :mod:`.gdn_step_checkpoints`): vLLM's
#: CPU GDN function (one call per round), vllm-ascend 0.30.0rc2's three prefill paths
#: (``ops.run_split`` in rounds) and, on vLLM 0.30.0's V2 GPU model runner, the Triton/FLA path's
#: one pass (``triton``: the chunk-state kernel stores every checkpoint of a row, one per chunk
#: start); ``ascend`` is the NPU paths' name before the worker knows which (the engine-core
#: process). :func:`junctions_off` lists the configurations they leave out.
JUNCTION_PATHS = ("cpu", "triton", "ascend", "ascend-fla-npu", "ascend-fused", "ascend-chunk")
#: vLLM versions whose V2 GPU model runner receives the explicit list (``gdn-checkpoint-receive-v2``
#: and ``-v2-rows``, read against 0.30.0's ``vllm/v1/worker/gpu/model_runner.py``).
RUNNER_V2_VERSIONS = ("0.30.0",)


def junctions_off(vllm_config: Any, path: str | None) -> str | None:
    """Why the exporter ``path`` (:func:`exporter_path`'s) of the engine of ``vllm_config``
    writes no checkpoint beyond one per row (a str), or None where it does. Read by the engine
    alone, once per scheduler (:mod:`.gdn_step_checkpoints`, :mod:`.gdn_junction`, the mid-block
    stop, the second block); the worker writes what the engine sends. Off: paths outside
    :data:`JUNCTION_PATHS` (FlashInfer; CUDA's split with ``FLA_USE_FAST_OPS=1``), runners without
    a receive entry (vLLM's V1 GPU runner on CUDA, vllm-ascend's V2 runner) and configurations
    whose block tables or chunks are not vLLM's one table per KV-cache group: decode or prefill
    context parallel (the DCP table holds rows per rank; the PCP manager's own), micro-batching
    (the ubatch runner's tables), and on vllm-ascend a KV transfer connector
    (``AscendMambaManager`` counts a block more for a synchronous external hit and vllm-ascend
    keeps a KV consumer's chunk whole, ``patch_mamba_block_aligned_split``: neither composed with
    the junction block here), and on vllm-ascend speculative decoding (its paths are replayed with
    one checkpoint a row beside speculative decode rows: no junction, crossed boundary, second
    block or mid-block run-on there; ``gdn_junction.DROP_TARGETS``)."""
    if path not in JUNCTION_PATHS:
        return f"exporter path {path}: one checkpoint per row"
    if path == "triton":
        return _triton_junctions_off(vllm_config)
    if not path.startswith("ascend"):
        return None
    if getattr(vllm_config, "use_v2_model_runner", False):
        return "vllm-ascend's V2 model runner (no receive entry for its execute_model)"
    parallel = getattr(vllm_config, "parallel_config", None)
    if (getattr(parallel, "decode_context_parallel_size", 1) or 1) > 1:
        return "decode context parallel (the DCP block table is not read here)"
    if getattr(vllm_config, "kv_transfer_config", None) is not None:
        return "a KV transfer connector (vllm-ascend's external-hit block and KV-consumer window)"
    if getattr(vllm_config, "speculative_config", None) is not None:
        return ("speculative decoding (vllm-ascend's paths are replayed with one checkpoint a row "
                "beside speculative decode rows)")
    return None


#: The option (``VLLM_HYBRID_NPU_OPTIONS`` key) of CUDA's junction export (default ``on``;
#: ``off`` keeps vLLM's stops on CUDA).
CUDA_JUNCTIONS_KEY = "junctions"


def cuda_junctions_off() -> str | None:
    """The reason CUDA's junction export is off by the option :data:`CUDA_JUNCTIONS_KEY`
    (``off``), or None with ``on``, the default. Raises ValueError naming the variable for a
    value other than ``off`` or ``on``."""
    if envs.option(CUDA_JUNCTIONS_KEY) == "on":
        return None
    return (f"{envs.option_text(CUDA_JUNCTIONS_KEY, 'off')} (vLLM's junction, mid-block and "
            "block-rounded stops kept on CUDA)")


def _triton_junctions_off(vllm_config: Any) -> str | None:
    """:func:`junctions_off` for the ``triton`` path (CUDA)."""
    if (reason := cuda_junctions_off()) is not None:
        return reason
    version = getattr(registry.REPORT.stack, "vllm", None)
    if version not in RUNNER_V2_VERSIONS:
        return f"CUDA on vLLM {version} (the V2 runner receives the explicit list on {RUNNER_V2_VERSIONS})"
    if export_method("triton") != "fused":
        return "FLA_USE_FAST_OPS=1 (the split of the FLA call: its rounds are not run on CUDA)"
    if not getattr(vllm_config, "use_v2_model_runner", False):
        return "vLLM's V1 GPU model runner on CUDA (no receive entry for its execute_model)"
    parallel = getattr(vllm_config, "parallel_config", None)
    if (getattr(parallel, "decode_context_parallel_size", 1) or 1) > 1:
        return "decode context parallel (the DCP block table is not read here)"
    if (getattr(parallel, "prefill_context_parallel_size", 1) or 1) > 1:
        return "prefill context parallel (the PCP manager's block tables)"
    if getattr(parallel, "use_ubatching", False):
        return "micro-batching (the ubatch runner's block tables)"
    return None


def make_builder(kernel_meta: Callable[[Any, Any], ops.KernelMeta | None],
                 rows: Callable[..., Any] | None = None):
    """Registry ``make`` of a GDN metadata builder's ``build``: upstream's metadata, with the
    step's checkpoints in :data:`FIELD` when it has some. ``rows(builder, common_attn_metadata,
    *args, **kwargs)`` (``build``'s arguments after ``common_prefix_len``) gives the step's rows
    as upstream's ``build`` reads them where it rewrites its ``CommonAttentionMetadata`` first
    (vllm-ascend's); None: as passed."""
    def make(upstream: Any, stack: Stack) -> Any:
        @functools.wraps(upstream)
        def build(self, common_prefix_len, common_attn_metadata, *args, **kwargs):
            md = upstream(self, common_prefix_len, common_attn_metadata, *args, **kwargs)
            # vLLM 0.30's build(common_prefix_len, m, num_accepted_tokens,
            # num_decode_draft_tokens_cpu, fast_build): the rows drafted for (>= 0)
            drafts = kwargs.get("num_decode_draft_tokens_cpu", args[1] if len(args) > 1 else None)
            common = common_attn_metadata if rows is None else \
                rows(self, common_attn_metadata, *args, **kwargs)
            ck = build_checkpoints(self, common, md, stack, kernel_meta, drafts)
            return md if ck is None else with_checkpoints(md, ck)

        return build

    return make


def _fla_kernel_meta(builder: Any, device: Any) -> ops.KernelMeta | None:
    # the chunk indices and offsets vLLM's GDN builder computes for the FLA kernels (CUDA)
    if device.type == "cpu":
        return None
    from vllm.third_party.flash_linear_attention.ops import index

    up = _to_device(device)
    return lambda host, dev: (up(index.prepare_chunk_indices(host, core.ALIGNMENT), None),
                              up(index.prepare_chunk_offsets(host, core.ALIGNMENT), None))


# --------------------------------------------------------------------------- layer wrappers
def make_forward(upstream: Any, stack: Stack) -> Any:
    """Registry ``make`` of a GDN layer's ``_forward_core`` (vLLM's on CUDA, vllm-ascend's on the
    NPU): the conv checkpoints from the step's input rows, then upstream inside an export scope
    whose kernel wrapper writes the SSM ones; no export where one was planned raises. A step
    without checkpoints (every decode-only step) reads the step's GDN metadata and calls
    upstream: nothing else, once per GDN layer where the layer runs eagerly (vLLM's module
    ``vllm.forward_context`` is bound here, at the entry's application, not imported per call:
    an import statement would cost host time on every layer and step).

    In a step with speculative decode rows (the metadata's ``spec_sequence_masks`` set:
    vllm-ascend under MTP) the plan is of the other rows, in the token layout of
    ``non_spec_token_indx`` (int [T'], their batch token indices in order; ``mixed_qkv`` [T, D] is
    in batch order): the conv rows are taken through it."""
    import vllm.forward_context as forward_context

    @functools.wraps(upstream)
    def _forward_core(self, mixed_qkv, b, a, core_attn_out):
        raw = forward_context.get_forward_context().attn_metadata
        md = raw.get(self.prefix) if isinstance(raw, dict) else None
        ck = getattr(md, FIELD, None)
        if ck is None:
            return upstream(self, mixed_qkv, b, a, core_attn_out)
        from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

        width, rows = self.conv_kernel_size, None
        if md.spec_sequence_masks is not None:  # shared by the group's layers, once per step
            rows = ck.memo(f"conv-spec-{width}", lambda: md.non_spec_token_indx.index_select(
                0, ck.conv_rows(width)))
        ops.write_conv(self.kv_cache[0], mixed_qkv, ck, width, is_conv_state_dim_first(), rows)
        with ops.exporting(ck, self.kv_cache[1], ck.method) as scope:
            result = upstream(self, mixed_qkv, b, a, core_attn_out)
        if scope.exports != 1:
            raise RuntimeError(f"vllm-hybrid-npu: {self.prefix}: {len(ck.plan.rows)} prefill "
                               f"checkpoint(s) planned ({ck.method}) but {scope.exports} kernel "
                               f"call(s) exported; set {ENV_VAR}=off")
        return result

    return _forward_core


def _make_fla_split(upstream: Any, stack: Stack) -> Any:
    @functools.wraps(upstream)
    def forward_native(self, q, k, v, g, beta, initial_state, output_final_state,
                       cu_seqlens=None, chunk_indices=None, chunk_offsets=None,
                       use_qk_l2norm_in_kernel=True, core_attn_out=None, **kwargs):
        scope = ops.current("split")  # kwargs: vLLM 0.32's aiter_prefill_metadata (ROCm)
        if scope is None or core_attn_out is not None or any(x is not None for x in kwargs.values()):
            return upstream(self, q, k, v, g, beta, initial_state, output_final_state, cu_seqlens,
                            chunk_indices, chunk_offsets, use_qk_l2norm_in_kernel, core_attn_out,
                            **kwargs)
        md = scope.metadata

        def run(inputs, state, part, out=None):  # out: FLA writes o into it (core_attn_out)
            return upstream(self, *inputs, state, True, md.bounds[part], *md.kernel_meta[part],
                            use_qk_l2norm_in_kernel, out)

        # one o, no cat; contiguous (FLA's input_guard would write a permuted buffer's copy)
        out = torch.empty(v.shape, dtype=v.dtype, device=v.device) if md.plan.tails_are_suffix else None
        return scope.split(run, (q, k, v, g, beta), initial_state, out=out)

    return forward_native


FLA_H = "vllm.third_party.flash_linear_attention.ops.chunk_delta_h"
FLA_H_SIGNATURE = ("k", "w", "u", "g", "gk", "initial_state", "output_final_state", "chunk_size",
                   "save_new_value", "cu_seqlens", "chunk_indices", "chunk_offsets", "use_exp2")
#: (H, V, Hg, K, input dtype, initial-state dtype, final state?) -> our kernel's launch config
_FLA_H_CONFIGS: dict[tuple, dict] = {}
#: the same key -> vLLM's autotuning space for its kernel, as ``(BV, num_warps, num_stages)``
_FLA_H_SPACES: dict[tuple, frozenset] = {}
#: A step whose longest prefill row has at least this many 64-token chunks (8,129 tokens and up)
#: launches our chunk-state kernel with :data:`LONG_ROW_CONFIGS`' configuration for the GPU.
LONG_ROW_CHUNKS = 128
#: compute capability -> our kernel's launch configuration for long rows (:func:`step_config`),
#: where measured: on an H200 (sm_90) BV 32, 4 warps, 3 stages runs a long row several times
#: faster than the configuration vLLM's autotuner picks on its one 64-token warm-up prefill
#: (``_warmup_prefill_kernels``; its key has no length), and every configuration of vLLM's space
#: gives the same bits (``benchmarks/gdn_chunk_states.py --bits``), ours and vLLM's (timings in
#: docs/benchmarks.md).
LONG_ROW_CONFIGS: dict[tuple[int, int], dict] = {(9, 0): {"bv": 32, "num_warps": 4, "num_stages": 3}}


def fla_h_config(upstream: Callable, args: tuple, key: tuple) -> dict:
    """The launch configuration (``bv``, ``num_warps``, ``num_stages``) vLLM's autotuned
    ``chunk_gated_delta_rule_fwd_kernel_h_blockdim64`` uses for calls of ``key``, so our kernel
    tiles and rounds as it does (a dot's rounding can differ between warp layouts): read off its
    autotuner after one call of ``upstream(*args)`` per key and process (its result is dropped).
    Without an autotuner to read (another vLLM), a fixed configuration, logged once; a
    configuration read off is logged once per ``key`` (INFO), so a run's log names the launch
    its export took."""
    if (config := _FLA_H_CONFIGS.get(key)) is None:
        upstream(*args)
        kernel = getattr(sys.modules.get(FLA_H), "chunk_gated_delta_rule_fwd_kernel_h_blockdim64", None)
        best = getattr(getattr(kernel, "fn", kernel), "best_config", None)
        if best is None or "BV" not in best.kwargs:
            _log_once("fla-config", "export: vLLM's FLA state kernel has no autotuned configuration "
                      "to mirror; ours runs with BV 64, 4 warps, 2 stages")
            config = {"bv": 64, "num_warps": 4, "num_stages": 2}
        else:
            config = {"bv": best.kwargs["BV"], "num_warps": best.num_warps,
                      "num_stages": best.num_stages}
            _FLA_H_SPACES[key] = frozenset(
                (c.kwargs.get("BV"), c.num_warps, c.num_stages)
                for c in getattr(getattr(kernel, "fn", kernel), "configs", ()) or ())
            _log_once(f"fla-config-{key}", "export: our chunk-state kernel runs with vLLM's "
                      "autotuned configuration %s for (H, V, Hg, K, dtype, state dtype, final state) = %s",
                      config, key)
        _FLA_H_CONFIGS[key] = config
    return config


@functools.lru_cache(maxsize=None)
def _capability(device: Any) -> tuple[int, int] | None:
    """``torch.cuda.get_device_capability`` of a CUDA device (a query, no sync); None elsewhere."""
    return tuple(torch.cuda.get_device_capability(device)) if device.type == "cuda" else None


def step_config(config: dict, plan: core.StepPlan, device: Any, key: tuple) -> dict:
    """Our chunk-state kernel's launch configuration for one step: ``config`` (vLLM's autotuned
    pick, :func:`fla_h_config`) unless the step's longest prefill row has :data:`LONG_ROW_CHUNKS`
    64-token chunks or more (``plan.chunk_starts``, ``plan.num_chunks``: host values) on a GPU
    whose compute capability :data:`LONG_ROW_CONFIGS` names and whose configuration is in vLLM's
    autotuning space for ``key``; then that configuration (logged once per ``key``). Every
    configuration of that space computes the same bits (measured: :data:`LONG_ROW_CONFIGS`), so
    the choice changes time only; vLLM's pick is made on a 64-token prefill, where a row's loop
    has one chunk and the long rows' pipelining does not show."""
    bounds = (*plan.chunk_starts, plan.num_chunks)
    longest = max((b - a for a, b in zip(bounds, bounds[1:])), default=0)
    long = LONG_ROW_CONFIGS.get(_capability(device)) if longest >= LONG_ROW_CHUNKS else None
    if long is None or long == config or \
            (long["bv"], long["num_warps"], long["num_stages"]) not in _FLA_H_SPACES.get(key, ()):
        return config
    _log_once(f"fla-long-{key}", "export: our chunk-state kernel runs with %s (not vLLM's autotuned "
              "%s) in steps with a prefill row of %d or more 64-token chunks on this GPU (compute "
              "capability %s): the same bits, measured faster for long rows", long, config,
              LONG_ROW_CHUNKS, _capability(device))
    return long


def _make_fla_h(upstream: Any, stack: Stack) -> Any:
    @functools.wraps(upstream)
    def chunk_gated_delta_rule_fwd_h(k, w, u, g=None, gk=None, initial_state=None,
                                     output_final_state=False, chunk_size=64, save_new_value=True,
                                     cu_seqlens=None, chunk_indices=None, chunk_offsets=None,
                                     use_exp2=False):
        args = (k, w, u, g, gk, initial_state, output_final_state, chunk_size, save_new_value,
                cu_seqlens, chunk_indices, chunk_offsets, use_exp2)
        scope = ops.current("fused")
        if (scope is None or g is None or gk is not None or use_exp2 or not save_new_value
                or chunk_size != core.ALIGNMENT or cu_seqlens is None
                or cu_seqlens.numel() != len(scope.metadata.plan.head_spans) + 1):
            return upstream(*args)  # not the step's GDN prefill call: no export (the layer raises)
        key = (*u.shape[-2:], *k.shape[-2:], k.dtype, getattr(initial_state, "dtype", None),
               bool(output_final_state))
        config = fla_h_config(upstream, args, key)
        md = scope.metadata
        return scope.chunk_states(k, w, u, g, initial_state, output_final_state, cu_seqlens,
                                  md.memo(f"launch-{key}", lambda: step_config(config, md.plan, k.device, key)))

    return chunk_gated_delta_rule_fwd_h


def _make_cpu_forward(upstream: Any, stack: Stack) -> Any:
    @functools.wraps(upstream)
    def _cpu_gdn_attention_nonspec(layer, attn_metadata_i, mixed_qkv, b, a, core_attn_out):
        ck = getattr(attn_metadata_i, FIELD, None)
        if ck is None:
            return upstream(layer, attn_metadata_i, mixed_qkv, b, a, core_attn_out)
        for idx, sub, copy in ck.memo("cpu-rounds", lambda: _cpu_rounds(ck.plan, attn_metadata_i)):
            _copy_states(layer, ck, copy)  # the whole conv block: it is width - 1 wide here
            out = core_attn_out.new_zeros((idx.numel(), *core_attn_out.shape[1:]))
            upstream(layer, sub, mixed_qkv[idx], b[idx], a[idx], out)
            core_attn_out[idx] = out

    return _cpu_gdn_attention_nonspec


def _make_cpu_spec_forward(upstream: Any, stack: Stack) -> Any:
    """vLLM 0.30's ``_spec_aware_nonspec``: the CPU GDN function under speculative decoding in a
    step without speculative decode rows (the conv state ``width - 1 + k`` wide), split at the
    checkpoints as :func:`_make_cpu_forward` splits the non-speculative one."""
    @functools.wraps(upstream)
    def _spec_aware_nonspec(layer, attn_metadata_i, mixed_qkv, b, a, core_attn_out, conv_buf,
                            ssm_state, width):
        ck = getattr(attn_metadata_i, FIELD, None)
        if ck is None:
            return upstream(layer, attn_metadata_i, mixed_qkv, b, a, core_attn_out, conv_buf,
                            ssm_state, width)
        for idx, sub, copy in ck.memo("cpu-rounds", lambda: _cpu_rounds(ck.plan, attn_metadata_i)):
            _copy_states(layer, ck, copy, width - 1)
            out = core_attn_out.new_zeros((idx.numel(), *core_attn_out.shape[1:]))
            upstream(layer, sub, mixed_qkv[idx], b[idx], a[idx], out, conv_buf, ssm_state, width)
            core_attn_out[idx] = out

    return _spec_aware_nonspec


def _make_cpu_spec_subset(upstream: Any, stack: Stack) -> Any:
    """vLLM 0.30's ``_spec_aware_nonspec_subset``: the non-speculative rows of a step with
    speculative decode rows (``mixed_qkv`` [T, D] their tokens, ``non_spec_token_indx``'s order;
    returns their output [T, H, V]), split at the checkpoints (the plan is of these rows alone,
    :func:`build_checkpoints`). The speculative rows run before, on their own state slots."""
    @functools.wraps(upstream)
    def _spec_aware_nonspec_subset(layer, attn_metadata_i, mixed_qkv, b, a, conv_buf, ssm_state,
                                   width):
        ck = getattr(attn_metadata_i, FIELD, None)
        if ck is None:
            return upstream(layer, attn_metadata_i, mixed_qkv, b, a, conv_buf, ssm_state, width)
        result = None
        for idx, sub, copy in ck.memo("cpu-rounds", lambda: _cpu_rounds(ck.plan, attn_metadata_i)):
            _copy_states(layer, ck, copy, width - 1)
            out = upstream(layer, sub, mixed_qkv[idx], b[idx], a[idx], conv_buf, ssm_state, width)
            if result is None:
                result = out.new_empty((mixed_qkv.shape[0], *out.shape[1:]))
            result[idx] = out
        return result

    return _spec_aware_nonspec_subset


def _copy_states(layer: Any, ck: ops.CheckpointMetadata, copy: tuple | None,
                 conv_cols: int | None = None) -> None:
    """The running states after a round into the checkpoint blocks that round ends at (``copy``:
    ``(checkpoints, source slots)``, int64 [m] each; None: nothing). The SSM state [slots, H, V,
    K] whole; of the conv state the first ``conv_cols`` time columns (None: the whole block, which
    is ``width - 1`` wide without speculative decoding). Under speculative decoding the conv
    buffer is ``width - 1 + k`` wide and ``conv_cols`` is ``width - 1``: the columns vLLM's
    prefill convolution reads and writes (``causal_conv1d_fn_cpu``'s ``conv_states[slot, :,
    :width - 1]``); a prefill never writes the other ``k``, so vLLM's split leaves the checkpoint
    block's as they were, and so does this copy."""
    if copy is None:
        return
    dst, src = ck.slots[copy[0]], copy[1]
    if conv_cols is None:
        conv = layer.kv_cache[0]
    else:
        from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

        conv = layer.kv_cache[0] if is_conv_state_dim_first() else layer.kv_cache[0].transpose(-1, -2)
        conv = conv[:, :, :conv_cols]  # [slots, D, conv_cols], a view of the cache
    conv[dst] = conv[src]
    layer.kv_cache[1][dst] = layer.kv_cache[1][src]


def _cpu_rounds(plan: core.StepPlan, md: Any) -> list:
    """vLLM's CPU GDN function (conv and recurrence in one; its non-speculative function, or under
    speculative decoding ``_spec_aware_nonspec`` or ``_spec_aware_nonspec_subset``, whose rows
    ``md`` describes with ``num_decodes`` 0) split at the checkpoints: the decodes
    and every prefill row up to its first checkpoint, then (``plan.rounds``) each row's next
    segment once the running states are copied into the checkpoint blocks that segment starts at.
    ``(token index, metadata, copy)`` per call; ``copy`` None or ``(checkpoints, source states)``."""
    states, initial = md.non_spec_state_indices_tensor.tolist(), md.has_initial_state.tolist()
    d, base, out = plan.num_decodes, plan.prefill_start, []
    for k, spans in enumerate(plan.rounds):
        rows = [(t, t + 1, states[t], True) for t in range(d)] if k == 0 else []
        rows += [(s + base, e + base, states[d + q], bool(initial[d + q]) or k > 0)
                 for q, s, e in spans if e > s]
        ends = [i for i, r in enumerate(plan.round_of) if r == k - 1]
        copy = None if k == 0 else (torch.tensor(ends), torch.tensor(
            [states[d + plan.ckpt_seq[i]] for i in ends]))
        decodes = d if k == 0 else 0
        cu = [0, *itertools.accumulate(e - s for s, e, _, _ in rows)]
        slots, has_state = [r[2] for r in rows], [r[3] for r in rows]
        out.append((torch.tensor([t for s, e, _, _ in rows for t in range(s, e)]), dataclasses.replace(
            md, num_decodes=decodes, num_decode_tokens=decodes, num_prefills=len(rows) - decodes,
            num_prefill_tokens=cu[-1] - decodes, num_actual_tokens=cu[-1],
            has_initial_state=torch.tensor(has_state),
            non_spec_query_start_loc=torch.tensor(cu, dtype=torch.int32),
            non_spec_state_indices_tensor=torch.tensor(slots, dtype=torch.int32),
            # what the speculative path's subset function reads (vLLM's prefill fields)
            prefill_query_start_loc=torch.tensor([c - decodes for c in cu[decodes:]], dtype=torch.int32),
            prefill_state_indices=torch.tensor(slots[decodes:], dtype=torch.int32),
            prefill_has_initial_state=torch.tensor(has_state[decodes:])),
            copy))
    return out


# --------------------------------------------------------------------------- spec and scheduler
def _make_spec(upstream: Any, stack: Stack) -> Any:
    @functools.wraps(upstream)
    def get_kv_cache_spec(self, vllm_config):
        spec = upstream(self, vllm_config)
        if getattr(spec, "num_prefill_checkpoint_blocks", 0):  # vLLM's own (0.33's FlashInfer)
            _log_once("spec-vllm", "exported by vLLM itself (its own declaration); ours stands aside")
            return spec
        path, reason = exporter_path(vllm_config, stack.target)
        if path is None or spec is None or getattr(spec, "mamba_cache_mode", None) != "align":
            _log_once("spec-none", "off: %s; vLLM's block-aligned split kept",
                      reason or "not align mode")
            return spec
        if spec.block_size % core.ALIGNMENT:
            _log_once("spec-grid", "off: block size %d is not a multiple of %d (set by "
                      "--block-size?); vLLM's split kept", spec.block_size, core.ALIGNMENT)
            return spec
        grid, vllm_plans = core.ALIGNMENT, stack.vllm in VLLM_PLAN
        if vllm_plans:  # 0.33's grid, as its FlashInfer path declares it; only if every layer can
            from vllm.model_executor.layers.mamba import abstract

            if abstract.get_mamba_prefill_checkpoint_alignment(vllm_config) is None:
                _log_once("spec-layers", "off: a Mamba layer cannot export; vLLM's split kept")
                return spec
            grid = abstract.get_mamba_prefill_checkpoint_grid(vllm_config)
        _log_once("spec-on", "exported by the %s path (method %s, block %d tokens, alignment %d, "
                  "planned by %s): cold prompts are not split", path, export_method(
                      path, spec, vllm_config), spec.block_size, grid, "vLLM" if vllm_plans else "us")
        return core.declare(spec, grid)

    return get_kv_cache_spec


def _make_alignment(upstream: Any, stack: Stack) -> Any:
    @functools.wraps(upstream)  # vLLM 0.33's block rounding and grid read it
    def get_prefill_checkpoint_alignment(self):
        own = upstream(self)  # vLLM's own (FlashInfer)
        ours = own is None and exporter_path(self.vllm_config, stack.target)[0] is not None
        return core.ALIGNMENT if ours else own

    return get_prefill_checkpoint_alignment


def _make_regather(upstream: Any, stack: Stack) -> Any:
    @functools.wraps(upstream)  # group 0's metadata for another group (a copy: our field too)
    def update_block_table(self, metadata, blk_table, slot_mapping):
        out = upstream(self, metadata, blk_table, slot_mapping)
        if (ck := getattr(out, FIELD, None)) is None:
            return out
        # vLLM 0.33 re-gathered its own plan for this group: its blocks are our table's one column
        table = out.checkpoint.state_indices[:, None] if stack.vllm in VLLM_PLAN else blk_table
        return dataclasses.replace(out, **{FIELD: ops.regather(ck, table)})  # the rest is shared

    return update_block_table


def _make_block_size(upstream: Any, stack: Stack) -> Any:
    fn = upstream.__func__

    @functools.wraps(fn)
    def _align_hybrid_block_size(cls, vllm_config, backend_cls):
        fn(cls, vllm_config, backend_cls)
        cache = vllm_config.cache_config
        if exporter_path(vllm_config, stack.target)[0] is None or cache.mamba_cache_mode != "align":
            return
        if changed := core.round_hybrid_block(cache, lambda: fn(cls, vllm_config, backend_cls)):
            logger.info("vllm-hybrid-npu: hybrid block size %d -> %d tokens (a multiple of %d, the "
                        "GDN prefill checkpoint alignment, as vLLM 0.33 aligns it)", *changed,
                        core.ALIGNMENT)

    return classmethod(_align_hybrid_block_size)


#: The option (``VLLM_HYBRID_NPU_OPTIONS`` key): which prefill checkpoints of a chunked prompt
#: stay cached at a retention interval above 0 (``all``, vLLM 0.30's rule, or ``final``;
#: :func:`chunk_checkpoints`).
CHUNK_KEY = "ckpt"
CHUNK_MODES = envs.OPTIONS[CHUNK_KEY].values
#: A Mamba manager's attribute naming its :data:`CHUNK_MODES` value, set by whoever builds the
#: manager for one engine only (the hit-rate lab, per replay); unset: the option :data:`CHUNK_KEY`.
CHUNK_RULE = "_vhn_chunk_checkpoints"


def chunk_checkpoints() -> str:
    """The option ``ckpt`` (default ``all``); raises ValueError naming the variable for a value
    other than ``all`` or ``final``."""
    return envs.option(CHUNK_KEY)


def retention(manager: Any, request: Any, retention_interval: int | None) -> int | None:
    """The retention interval (tokens: ``None`` dense, ``0`` vLLM's default, ``> 0`` a grid) to
    hand vLLM 0.30's ``MambaManager._cache_partial_tail_block(request, num_tokens,
    retention_interval)`` of ``manager``, which caches the block vLLM reserved for a prefill
    checkpoint (``manager._checkpoints[request_id] = (position in tokens, block column)``; the
    exporter declares one, so every prefill chunk has one, one hash block below the chunk's end).
    Upstream's branches do the rest (``gdn-manager-cache``, :mod:`.gdn_mamba_manager`):

    * the prompt's own checkpoint (``get_mamba_prefill_checkpoint_position`` of the prompt) at
      retention 0: ``None``, so it is cached as vLLM 0.32's ``is_prompt_checkpoint`` caches it;
    * with :func:`chunk_checkpoints` ``final`` (or the manager's :data:`CHUNK_RULE`), any other
      checkpoint at retention > 0: ``0``, so upstream's retention-0 branch decides: a non-final
      chunk's checkpoint is dropped (``BlockPool._maybe_evict_cached_block``: no hash; the block
      and the state written into it are untouched) and a shared-prefix junction's, or one a
      chunk reaching the prompt's end leaves, is cached as before;
    * otherwise ``retention_interval`` unchanged.

    Raises ValueError (naming ``VLLM_HYBRID_NPU_OPTIONS``) at the first such checkpoint for a bad value.
    """
    checkpoint = manager._checkpoints.get(request.request_id)
    if checkpoint is None or retention_interval is None:
        return retention_interval
    from vllm.v1.kv_cache_interface import get_mamba_prefill_checkpoint_position

    is_prompt = checkpoint[0] == get_mamba_prefill_checkpoint_position(
        request.num_prompt_tokens, manager.block_pool.hash_block_size,
        manager.drop_eagle_checkpoint_block)
    if retention_interval == 0 and is_prompt:
        return None  # vLLM 0.32's is_prompt_checkpoint: cache it as the split would
    if retention_interval > 0 and not is_prompt and \
            (vars(manager).get(CHUNK_RULE) or chunk_checkpoints()) == "final":
        return 0  # upstream's retention-0 rule: kept only at a junction
    return retention_interval


#: A scheduler's flags, by target (a dict): its engine's exporter path on that target writes the
#: state at the block boundary a chunk started mid-block crosses (:func:`junctions_off`), so the
#: mid-block stop stands aside. Per target, so that a second stop built for another target around
#: the same scheduler (the e2e tests force the stop of a path without the write) decides its own.
CROSSING_WRITTEN = "_vhn_crossing_written"


#: Where the mid-block stop applies: the paths whose step may not write the boundary a chunk
#: started mid-block crosses (the CPU path always writes it).
MID_BLOCK_TARGETS = ("cuda", "npu")


def _make_mid_block_stop(upstream: Any, stack: Stack) -> Any:
    """The mid-block stop around ``upstream`` (vLLM's ``Scheduler._mamba_block_aligned_split``),
    the inner layer of the ``gdn-chunk-end`` entry (:mod:`.gdn_junction`) on CUDA and the NPU: a
    chunk started mid-block (a hit inside a block, ``--prefix-match-unit``) ends at its next
    block boundary where a prefill checkpoint is declared (``core.mid_block_chunk``): vLLM lifts
    that stop under an internal checkpoint and caches the initial state's block at the boundary
    with the state at the chunk's start. It stands aside where the path writes the crossed
    boundary's state (:func:`junctions_off` None: vllm-ascend's paths; CUDA's one pass on vLLM
    0.30's V2 runner from a start on the 64-token grid), decided once per scheduler and target
    (:data:`CROSSING_WRITTEN`), and for a KV consumer's chunk on the NPU (vllm-ascend keeps it
    whole)."""
    @functools.wraps(upstream)
    def _mamba_block_aligned_split(self, request, num_new_tokens, num_new_local_computed_tokens=0,
                                   num_external_computed_tokens=0):
        n = upstream(self, request, num_new_tokens, num_new_local_computed_tokens,
                     num_external_computed_tokens)
        # vLLM lifts its mid-block stop only where a prefill checkpoint block is declared (ours
        # or, on 0.33 with FlashInfer, vLLM's own: the same one-checkpoint-per-row plan); the
        # scheduler's own flag, not the GDN backend, which this process may not have resolved
        if not getattr(self, "mamba_has_prefill_checkpoint_blocks", False):
            return n
        memo = vars(self).setdefault(CROSSING_WRITTEN, {})
        if (writes := memo.get(stack.target)) is None:  # decided once per scheduler and target
            writes = memo[stack.target] = stack.target in ("npu", "cuda") and junctions_off(
                self.vllm_config, exporter_path(self.vllm_config, stack.target)[0]) is None
        start = request.num_computed_tokens + num_new_local_computed_tokens + num_external_computed_tokens
        # the step writes the crossed boundary's state (_junctions), as on CPU; the one pass
        # (CUDA) only at a 64-token chunk start: a start off that grid (a prefix-match unit
        # below 64) keeps the stop
        if writes and (stack.target != "cuda" or start % core.ALIGNMENT == 0):
            return n
        kv = getattr(self.vllm_config, "kv_transfer_config", None)
        if stack.target == "npu" and start > 0 and kv is not None and kv.is_kv_consumer:
            return n  # vllm-ascend keeps a KV consumer's window whole (patch_mamba_block_aligned_split)
        return core.mid_block_chunk(start, n, self.cache_config.block_size)

    return _mamba_block_aligned_split


def wanted(stack: Stack) -> str | None:
    """Skip reason for every entry when ``VLLM_HYBRID_NPU_PREFILL_CHECKPOINTS=off`` (else None)."""
    return f"{ENV_VAR}=off" if mode() == "off" else None


def entry(name: str, module: str, qualname: str, make: Callable, targets: tuple, why: str,
          **kw: Any) -> Patch:
    """A behaviour-changing ``gdn-checkpoint-*`` entry (off with :data:`ENV_VAR`; ``wanted`` in
    ``kw`` replaces :func:`wanted`)."""
    return Patch(name=name, module=module, qualname=qualname, targets=targets,
                 wanted=kw.pop("wanted", wanted),
                 make=make, behaviour_changing=True, why=why,
                 **{"vllm": VLLM_VERSIONS, "until": "vLLM's or vllm-ascend's GDN path exports "
                    "prefill checkpoints itself (vLLM 0.33: FlashInfer only)", **kw})


FORWARD_SIGNATURE = ("self", "mixed_qkv", "b", "a", "core_attn_out")
BUILD_SIGNATURE = ("self", "common_prefix_len", "common_attn_metadata")
PATCHES = [
    entry("gdn-checkpoint-spec", QWEN_GDN, "QwenGatedDeltaNetAttention.get_kv_cache_spec",
          _make_spec, ("cpu", "cuda", "npu"), "declares one prefill checkpoint block (alignment "
          "64; vLLM 0.33: its grid) in the GDN layers' MambaSpec where ours exports, so vLLM "
          "drops its split", signature=("self", "vllm_config")),
    entry("gdn-checkpoint-alignment", QWEN_GDN,
          "QwenGatedDeltaNetAttention.get_prefill_checkpoint_alignment", _make_alignment,
          ("cpu", "cuda"), "the GDN layers report alignment 64 where ours exports, as 0.33's "
          "FlashInfer path does: vLLM's block rounding, grid and lockstep see it",
          vllm=VLLM_PLAN, signature=("self",)),
    entry("gdn-checkpoint-block-size", "vllm.platforms.interface",
          "Platform._align_hybrid_block_size", _make_block_size, ("cpu", "cuda", "npu"),
          "hybrid block rounded up to the 64-token checkpoint grid (vLLM 0.33's lcm rule)",
          vllm=OWN_PLAN, signature=("cls", "vllm_config", "backend_cls")),
    entry("gdn-checkpoint-plan", "vllm.v1.attention.backends.gdn_attn",
          "GDNAttentionMetadataBuilder.build", make_builder(_fla_kernel_meta), ("cpu", "cuda"),
          "per-step checkpoint plan (core.plan_step; vLLM 0.33: of vLLM's plan) in the GDN "
          "metadata, with (CUDA) the FLA chunk metadata of the split's two calls",
          signature=BUILD_SIGNATURE),
    entry("gdn-checkpoint-regather", "vllm.v1.attention.backends.gdn_attn",
          "GDNAttentionMetadataBuilder.update_block_table", _make_regather, ("cuda",),
          "the V2 runner reuses group 0's GDN metadata for the other groups (update_block_table, "
          "a dataclasses.replace copy): their checkpoints re-gathered from their own block table",
          vllm=("0.32.0",) + VLLM_PLAN, signature=("self", "metadata", "blk_table", "slot_mapping")),
    entry("gdn-checkpoint-cpu", "vllm.model_executor.layers.mamba.ops.cpu.gdn_attention",
          "_cpu_gdn_attention_nonspec", _make_cpu_forward, ("cpu",),
          "vLLM's CPU GDN function in two rounds split at the checkpoint (split-exact)",
          signature=("layer", "attn_metadata_i", "mixed_qkv", "b", "a", "core_attn_out")),
    entry("gdn-checkpoint-cpu-spec", "vllm.model_executor.layers.mamba.ops.cpu.gdn_attention",
          "_spec_aware_nonspec", _make_cpu_spec_forward, ("cpu",),
          "under EAGLE/MTP speculative decoding, a step without speculative decode rows: vLLM's "
          "CPU GDN function (the wide conv buffer) in rounds split at the checkpoints",
          vllm=SPEC_DECODE_VLLM, signature=("layer", "attn_metadata_i", "mixed_qkv", "b", "a",
                                            "core_attn_out", "conv_buf", "ssm_state", "width")),
    entry("gdn-checkpoint-cpu-spec-subset", "vllm.model_executor.layers.mamba.ops.cpu.gdn_attention",
          "_spec_aware_nonspec_subset", _make_cpu_spec_subset, ("cpu",),
          "under EAGLE/MTP speculative decoding, the prefill rows of a step with speculative "
          "decode rows in rounds split at the checkpoints (the decode rows untouched)",
          vllm=SPEC_DECODE_VLLM, signature=("layer", "attn_metadata_i", "mixed_qkv", "b", "a",
                                            "conv_buf", "ssm_state", "width")),
    entry("gdn-checkpoint-triton", QWEN_GDN, "QwenGatedDeltaNetAttention._forward_core",
          make_forward, ("cuda",), "conv checkpoints from the step's input rows; the SSM ones "
          "from the FLA kernel (next two entries)", signature=FORWARD_SIGNATURE),
    entry("gdn-checkpoint-fla-split", QWEN_GDN, "ChunkGatedDeltaRule.forward_native",
          _make_fla_split, ("cuda",), "FLA chunk call split at the checkpoints (only with "
          "FLA_USE_FAST_OPS=1, whose fast exp our one-pass kernel does not mirror)",
          signature=("self", "q", "k", "v", "g", "beta", "initial_state", "output_final_state")),
    entry("gdn-checkpoint-fla-h", "vllm.third_party.flash_linear_attention.ops.chunk",
          "chunk_gated_delta_rule_fwd_h", _make_fla_h, ("cuda",),
          "one pass: our chunk-state kernel (vLLM's FLA recurrence, same arithmetic) stores each "
          "checkpoint's float32 state into its block in the SSM cache dtype, in the step's one "
          "FLA call", signature=FLA_H_SIGNATURE),
]
