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
field (:data:`FIELD`) of the GDN metadata. Elsewhere (speculative decoding, FlashInfer, a block
off the 64-token grid, ``VLLM_HYBRID_NPU_PREFILL_CHECKPOINTS=off``) nothing is declared and vLLM
keeps its split (or, on 0.33 with FlashInfer, exports itself); the spec's INFO line says which
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
import weakref
from typing import Any, Callable

import torch

from vllm_hybrid_npu import envs
from vllm_hybrid_npu.core import prefill_checkpoints as core
from vllm_hybrid_npu.ops import gdn_checkpoint as ops
from vllm_hybrid_npu.patches import registry
from vllm_hybrid_npu.patches.registry import Patch, is_ours
from vllm_hybrid_npu.support import Stack

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
def exporter_path(vllm_config: Any, target: str) -> tuple[str | None, str]:
    """Which path exports GDN prefill checkpoints for the engine of ``vllm_config`` on ``target``
    (``cpu``, ``cuda``, ``npu``): ``(path, "")`` (``cpu``, ``triton``, ``ascend-fla-npu``,
    ``ascend-fused``, ``ascend-chunk``; ``ascend`` before the worker knows which) or
    ``(None, reason)``."""
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
                      kernel_meta: Callable[[Any, Any], ops.KernelMeta | None]):
    """The step's :class:`~vllm_hybrid_npu.ops.gdn_checkpoint.CheckpointMetadata` for a GDN
    metadata ``builder`` (vLLM's or vllm-ascend's; its ``kv_cache_spec``, ``vllm_config``), or None,
    from the step's ``CommonAttentionMetadata`` (host ``query_start_loc_cpu`` and
    ``seq_lens_cpu_upper_bound``, device ``block_table_tensor``) and the ``metadata`` upstream
    built; ``kernel_meta(builder, device)`` gives the split's chunk metadata. The plan: on
    :data:`VLLM_PLAN` vLLM 0.33's own (``metadata.checkpoint``: ``compute_mamba_prefill_checkpoints``
    offsets and the blocks it gathered; None where it exports itself), else ``core.checkpoint_offsets``.
    Raises RuntimeError where the runner gave no ``seq_lens_cpu_upper_bound`` (the reserved
    checkpoint block would be cached unwritten)."""
    spec, config, table = builder.kv_cache_spec, builder.vllm_config, common.block_table_tensor
    if (getattr(spec, "num_prefill_checkpoint_blocks", 0) <= 0 or metadata.num_prefills == 0
            or metadata.spec_sequence_masks is not None):
        return None
    n, path, junctions = int(common.num_reqs), None, {}
    qsl = common.query_start_loc_cpu[: n + 1].tolist()
    if stack.vllm in VLLM_PLAN:  # request rows 0..n-1; each row's block (gathered) as a column
        planned, path = metadata.checkpoint, exporter_path(config, stack.target)[0]
        crossing = _junctions_on(builder, path) and common.seq_lens_cpu_upper_bound is not None
        if path is None or (planned is None and not crossing):
            return None
        offsets, cols = (planned.offsets, [0] * n) if planned else ([0] * n, [0] * n)
        table = planned.state_indices[:, None] if planned else common.block_table_tensor[:n, :0]
        if crossing:
            # a mid-block row crossing a boundary (vLLM's own plan writes only the checkpoint,
            # and plans nothing for a row it clips at a junction past the boundary): its initial
            # state's block, from the step's block table after the gathered column
            seq_lens = common.seq_lens_cpu_upper_bound[:n].tolist()
            qlens = [e - s for s, e in zip(qsl, qsl[1:])]
            own = [-(-s // spec.block_size) - 2 if o else -1 for s, o in zip(seq_lens, offsets)]
            if junctions := _junctions(common.block_table_tensor, seq_lens, qlens, own,
                                       metadata.num_decodes, spec.block_size):
                shift = table.shape[1]
                table = torch.cat([table, common.block_table_tensor[:n]], dim=1)
                junctions = {r: [(o, c + shift) for o, c in found] for r, found in junctions.items()}
    elif common.seq_lens_cpu_upper_bound is None:
        raise RuntimeError(f"vllm-hybrid-npu GDN prefill checkpoints: the model runner passed no "
                           f"seq_lens_cpu_upper_bound; set {ENV_VAR}=off")
    else:
        from vllm.v1 import kv_cache_interface as kv

        spec_config = config.speculative_config
        seq_lens, qlens = common.seq_lens_cpu_upper_bound[:n].tolist(), [e - s for s, e in zip(qsl, qsl[1:])]
        offsets, cols = core.checkpoint_offsets(
            seq_lens, qlens,
            hash_block_size=getattr(config.cache_config, "prefix_match_unit", None) or spec.block_size,
            block_size=spec.block_size, alignment=spec.prefill_checkpoint_alignment,
            drop_eagle_block=bool(spec_config is not None and spec_config.use_eagle_block_drop()),
            position_fn=kv.get_mamba_prefill_checkpoint_position,
            valid_fn=kv.is_mamba_prefill_checkpoint_valid)
        if _junctions_on(builder, path := exporter_path(config, stack.target)[0]):
            junctions = _junctions(table, seq_lens, qlens, cols, metadata.num_decodes, spec.block_size)
        if _junctions_on(builder, path) and (second := _second_blocks(builder, n)):
            table, offsets, cols, junctions = _with_second_blocks(
                table[:n], second, seq_lens, qlens, list(offsets), list(cols), junctions,
                spec.block_size, _to_device(table.device))
    if (plan := core.plan_step(qsl, offsets, cols, metadata.num_decodes, junctions=junctions)) is None:
        return None
    method = export_method(path or exporter_path(config, stack.target)[0], spec, config)
    return ops.build_metadata(plan, table, _to_device(table.device), method,
                              kernel_meta(builder, table.device) if method == "split" else None)


#: The step a model runner is executing with second checkpoint blocks
#: (:mod:`.gdn_second_checkpoint`'s ``-receive`` entries set it): ``(runner, {group id: {request
#: id: (block id, cp tokens)}})``, or None.
SECOND_STEP: contextvars.ContextVar = contextvars.ContextVar("vhn_second_step", default=None)


def _second_blocks(builder: Any, num_reqs: int) -> dict[int, tuple[int, int]]:
    """For a GDN metadata ``builder`` of the step the model runner is executing
    (:data:`SECOND_STEP`): ``{batch row: (block id, cp tokens)}`` of the rows whose prompt took a
    second checkpoint block in the builder's KV-cache group (rows: the runner's
    ``input_batch.req_ids``, vLLM 0.30's V1 runner, or the V2 runner's batch order,
    :data:`V2_REQ_IDS`; the first ``num_reqs``). Empty outside such a step."""
    step = SECOND_STEP.get()
    if step is None:
        return {}
    runner, payload = step
    for gid, groups in enumerate(runner.attn_groups):
        if gid in payload and any(builder in g.metadata_builders for g in groups):
            ids = payload[gid]
            rows = vars(runner).get(V2_REQ_IDS)
            rows = runner.input_batch.req_ids if rows is None else rows
            return {r: ids[rid] for r, rid in enumerate(rows[:num_reqs]) if rid in ids}
    return {}


def _with_second_blocks(table: torch.Tensor, second: dict[int, tuple[int, int]], seq_lens: list,
                        qlens: list, offsets: list, cols: list, junctions: dict, block: int,
                        to_device: ops.ToDevice | None = None):
    """The step's plan inputs with each row of ``second`` (``{row: (block id E, cp)}``,
    :mod:`.gdn_second_checkpoint`) checkpointed twice: ``q = cp // block * block`` into its
    checkpoint column (which the KV-cache manager keyed at ``q``) and ``cp`` into ``E``, one
    column appended to ``table`` (int32 [R, columns], the block table of the builder's group;
    0, vLLM's null block, in the other rows), uploaded by ``to_device`` (vLLM's
    ``async_tensor_h2d``: pinned memory, no host sync; default: a host tensor) where ``table``
    is device memory: only in a step with such a row. Returns ``(table, offsets, cols,
    junctions)``.

    Raises:
        RuntimeError: a row's plan is not the checkpoint the manager reserved (``cp`` at column
            ``q // block - 1``): the blocks would be cached with other states.
    """
    extra, junctions = [0] * table.shape[0], {r: list(v) for r, v in junctions.items()}
    for r, (block_id, cp) in second.items():
        start, q = seq_lens[r] - qlens[r], cp // block * block
        if offsets[r] != cp - start or cols[r] != q // block - 1 or not start < q:
            raise RuntimeError(f"vllm-hybrid-npu second GDN checkpoint: row {r} ({start}-"
                               f"{seq_lens[r]} tokens) plans offset {offsets[r]} in column "
                               f"{cols[r]}, the KV-cache manager reserved {cp} with {q} in "
                               f"column {q // block - 1}")
        junctions[r] = sorted([*junctions.get(r, ()), (q - start, cols[r])])
        cols[r], extra[r] = table.shape[1], block_id
    column = (to_device(extra, table.dtype) if to_device is not None
              else torch.tensor(extra, dtype=table.dtype))
    return torch.cat([table, column[:, None]], dim=1), offsets, cols, junctions


def _junctions_on(builder: Any, path: str | None) -> bool:
    """``junctions_off(builder.vllm_config, path) is None``, decided once per GDN metadata
    builder and path (the V2 runner's flag, ``VllmConfig.use_v2_model_runner``, reads entry
    points: not per step)."""
    memo = vars(builder).setdefault("_vhn_junctions_on", {})
    if path not in memo:
        memo[path] = junctions_off(builder.vllm_config, path) is None
    return memo[path]


#: Exporter paths that export shared-prefix junction states and crossed block boundaries
#: (:mod:`.gdn_junction`, several checkpoints in a row): vLLM's CPU GDN function (one call per
#: round, the block table host memory), vllm-ascend 0.30.0rc2's three prefill paths
#: (``ops.run_split`` in rounds; the builder reads the host copy of the device block table,
#: :func:`host_block_table`) and, on vLLM 0.30.0's V2 GPU model runner, the Triton/FLA path's
#: one pass (``triton``: the chunk-state kernel stores every checkpoint of a row, one per chunk
#: start; the builder reads the host mirror of the V2 block tables, :class:`RunnerHostTable`);
#: ``ascend`` is the NPU paths' name before the worker knows which (the engine-core process).
#: :func:`junctions_off` lists the configurations they leave out.
JUNCTION_PATHS = ("cpu", "triton", "ascend", "ascend-fla-npu", "ascend-fused", "ascend-chunk")
#: vLLM versions whose V2 GPU model runner's block tables :class:`RunnerHostTable` mirrors (read
#: against 0.30.0's ``vllm/v1/worker/gpu/block_table.py`` and ``model_runner.py``).
RUNNER_V2_VERSIONS = ("0.30.0",)


def junctions_off(vllm_config: Any, path: str | None) -> str | None:
    """Why the exporter ``path`` (:func:`exporter_path`'s) of the engine of ``vllm_config``
    exports no shared-prefix junction state or crossed block boundary (a str), or None where it
    does. Read from the configuration alone, so the scheduler's entries (:mod:`.gdn_junction`,
    the mid-block stop) and the worker's builder (:func:`build_checkpoints`) decide alike. Off:
    paths outside :data:`JUNCTION_PATHS` (CUDA's one-pass kernel writes one checkpoint per row
    and its block table is device memory), and on vllm-ascend's paths, which read the host copy
    of the block table that vllm-ascend 0.30.0rc2's V1 ``BlockTable`` keeps: its V2 model runner
    (``vllm_ascend/worker/v2``, other block tables, not recorded), decode context parallel (the
    DCP table holds rows per rank and draft token; ``AscendMambaManager`` looks hits up at rank
    size 1: not read here) and a KV transfer connector (``AscendMambaManager`` counts a block more
    for a synchronous external hit and vllm-ascend keeps a KV consumer's chunk whole,
    ``patch_mamba_block_aligned_split``: neither composed with the junction block here). On
    CUDA's Triton/FLA path (``triton``): only vLLM 0.30.0's V2 GPU model runner (its block tables
    mirrored on the host, :class:`RunnerHostTable`; the V1 runner's ``BlockTable`` is not
    recorded here) with the one-pass export (``FLA_USE_FAST_OPS=1``'s split in rounds is not run
    on CUDA), without decode or prefill context parallel (other tables: the DCP one per rank, the
    PCP manager's own) and without micro-batching (the ubatch runner gathers into tables of its
    own)."""
    if path not in JUNCTION_PATHS:
        return f"exporter path {path}: one checkpoint per row"
    if path == "triton":
        return _triton_junctions_off(vllm_config)
    if not path.startswith("ascend"):
        return None
    if getattr(vllm_config, "use_v2_model_runner", False):
        return "vllm-ascend's V2 model runner (its block tables are not the host-mirrored V1 BlockTable)"
    parallel = getattr(vllm_config, "parallel_config", None)
    if (getattr(parallel, "decode_context_parallel_size", 1) or 1) > 1:
        return "decode context parallel (the DCP block table is not read here)"
    if getattr(vllm_config, "kv_transfer_config", None) is not None:
        return "a KV transfer connector (vllm-ascend's external-hit block and KV-consumer window)"
    return None


#: Environment variable: CUDA's junction export (default ``on``; ``off`` keeps vLLM's stops on
#: CUDA).
CUDA_JUNCTIONS_ENV = "VLLM_HYBRID_NPU_CUDA_JUNCTIONS"
CUDA_JUNCTIONS_MODES = ("off", "on")


def cuda_junctions_off() -> str | None:
    """The reason CUDA's junction export is off by :data:`CUDA_JUNCTIONS_ENV` (``off``), or None
    with ``on``, the default. Raises ValueError naming the variable for a value other than
    ``off`` or ``on``."""
    if envs.choice(CUDA_JUNCTIONS_ENV, CUDA_JUNCTIONS_MODES, "on") == "on":
        return None
    return f"{CUDA_JUNCTIONS_ENV}=off (vLLM's junction, mid-block and block-rounded stops kept on CUDA)"


def _v2_host_wanted(stack: Stack) -> str | None:
    """:func:`wanted`, and the mirror only where CUDA's junction export is on
    (:func:`cuda_junctions_off`: nothing reads it otherwise)."""
    return wanted(stack) or cuda_junctions_off()


def _triton_junctions_off(vllm_config: Any) -> str | None:
    """:func:`junctions_off` for the ``triton`` path (CUDA)."""
    if (reason := cuda_junctions_off()) is not None:
        return reason
    version = getattr(registry.REPORT.stack, "vllm", None)
    if version not in RUNNER_V2_VERSIONS:
        return f"CUDA on vLLM {version} (the V2 runner's block tables are mirrored for {RUNNER_V2_VERSIONS})"
    if export_method("triton") != "fused":
        return "FLA_USE_FAST_OPS=1 (the split of the FLA call: its rounds are not run on CUDA)"
    if not getattr(vllm_config, "use_v2_model_runner", False):
        return "vLLM's V1 GPU model runner (its BlockTable's host copy is not recorded here)"
    parallel = getattr(vllm_config, "parallel_config", None)
    if (getattr(parallel, "decode_context_parallel_size", 1) or 1) > 1:
        return "decode context parallel (the DCP block table is not read here)"
    if (getattr(parallel, "prefill_context_parallel_size", 1) or 1) > 1:
        return "prefill context parallel (the PCP manager's block tables are not mirrored)"
    if getattr(parallel, "use_ubatching", False):
        return "micro-batching (the ubatch runner's block tables are not mirrored)"
    return None


#: The host copies of device block tables: the device storage (address, bytes) -> vLLM's
#: ``CpuGpuBuffer`` (``vllm/v1/utils.py``: ``.cpu`` host, ``.gpu`` device, one shape and dtype),
#: recorded by :func:`remember_host_table` (vllm-ascend's ``BlockTable.__init__`` entry), or a
#: :class:`RunnerHostTable` (vLLM 0.30's V2 runner, :func:`runner_host_tables`).
_HOST_TABLES: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _storage_key(tensor: Any) -> tuple[int, int]:
    storage = tensor.untyped_storage()  # no device access: the allocation's address and size
    return storage.data_ptr(), storage.nbytes()


def remember_host_table(buffer: Any) -> None:
    """Record ``buffer`` (a ``CpuGpuBuffer``, vLLM 0.30's ``vllm/v1/utils.py``; vllm-ascend
    0.30.0rc2's ``BlockTable.block_table`` and vLLM's own ``BlockTable.block_table`` are one) so
    :func:`host_block_table` finds its host tensor from a view of its device tensor. Weak: a
    dropped buffer is forgotten."""
    _HOST_TABLES[_storage_key(buffer.gpu)] = buffer


def host_block_table(table: Any) -> Any:
    """The host copy of ``table`` (a block table on the device, int32 [R, columns], a view of a
    recorded ``CpuGpuBuffer``'s ``.gpu``, as ``CommonAttentionMetadata.block_table_tensor`` is:
    ``BlockTable.get_device_tensor()[:num_reqs_padded]``): the same view of its ``.cpu``, which
    the model runner copied to the device this step (``commit_block_table``), so no device read
    and no host sync. A host ``table`` not recorded is itself. Raises RuntimeError for a device
    table whose host copy is not recorded (a runner other than vllm-ascend's V1, or the
    ``gdn-checkpoint-ascend-host-table`` entry not applied)."""
    key = _storage_key(table)
    buf = _HOST_TABLES.get(key)
    if isinstance(buf, RunnerHostTable):  # vLLM 0.30's V2 runner: rows by batch row, from 0
        if (table.storage_offset() == 0 and table.stride() == buf.gpu.stride()
                and table.dtype == buf.gpu.dtype and _storage_key(buf.gpu) == key):
            return buf
    elif (buf is not None and _storage_key(buf.gpu) == key and buf.cpu.dtype == table.dtype and buf.cpu.shape == buf.gpu.shape
            and buf.cpu.stride() == buf.gpu.stride()):
        return buf.cpu.as_strided(table.size(), table.stride(), table.storage_offset())
    if table.device.type == "cpu":
        return table
    raise RuntimeError(
        f"vllm-hybrid-npu GDN prefill checkpoints: no host copy recorded for the {table.device} "
        f"block table (shape {tuple(table.shape)}): the shared-prefix junction columns cannot be "
        f"found without a device read (the gdn-checkpoint-ascend-host-table entry records "
        f"vllm-ascend's V1 BlockTable, gdn-checkpoint-v2-host-table vLLM 0.30's V2 runner's "
        f"BlockTables); set {ENV_VAR}=off")


class RunnerHostTable:
    """The host mirror of one KV-cache group's block table in vLLM 0.30.0's V2 GPU model runner
    (CUDA; ``vllm/v1/worker/gpu/block_table.py``, ``BlockTables``), where the block ids live on
    the device only: ``append_block_ids`` stages each request's new ids (a ``StagedWriteTensor``
    per group, rows by request index, the staged lists cleared when ``apply_staged_writes``
    writes them to the device), ``gather_block_tables`` copies the step's rows in batch order into
    ``input_block_tables[g]`` (the first ``num_blocks`` entries of each), and the GDN builder gets
    a view of that (``CommonAttentionMetadata.block_table_tensor``, rows ``[:num_reqs_padded]``).

    ``mirror`` (int32 [max_num_reqs, columns], host) takes the same writes as the staged tensor
    (``gdn-checkpoint-v2-host-table``, around ``append_block_ids``); ``num_blocks`` is the
    runner's own host count per request (``BlockTables.num_blocks.np[g]``); ``rows`` the step's
    batch order, ``input_batch.idx_mapping_np`` (``gdn-checkpoint-v2-host-rows``, before
    ``GPUModelRunner.prepare_attn`` gathers), or None after ``prepare_dummy_attn`` (a dummy
    batch: every entry reads null). Indexed as the device table: ``host[r, cols]`` (a batch row,
    a slice) is that row's block ids as an int32 numpy array, null (0) past the request's blocks
    and for rows outside the batch. No device read, no host sync: the builder runs after this
    step's writes were staged, on the same host thread."""

    def __init__(self, device_table: torch.Tensor, num_blocks: Any):
        import numpy as np

        self.gpu = device_table
        self.mirror = np.zeros(tuple(device_table.shape), dtype=np.int32)
        self.num_blocks = num_blocks
        self.rows: Any = None

    def write(self, req_index: int, block_ids: list[int]) -> None:
        """``block_ids`` (already expanded to kernel blocks) as the request's last entries, where
        the runner's ``append_block_ids`` has just staged them (its ``num_blocks`` updated)."""
        end = int(self.num_blocks[req_index])
        self.mirror[req_index, end - len(block_ids):end] = block_ids

    def __getitem__(self, key: tuple[int, slice]) -> Any:
        import numpy as np

        r, cols = key
        out = np.zeros_like(self.mirror[0, cols])  # the slice's length, null
        if self.rows is None or not 0 <= r < len(self.rows):
            return out
        req = int(self.rows[r])
        out[:] = self.mirror[req, cols]
        first = cols.start or 0
        out[max(0, int(self.num_blocks[req]) - first):] = 0  # past the request's blocks: stale
        return out


def runner_host_tables(block_tables: Any) -> list[RunnerHostTable | None]:
    """Per KV-cache group of vLLM 0.30's V2 ``BlockTables`` its :class:`RunnerHostTable` (made
    and recorded by the device storage of ``input_block_tables[g]`` on first use), or None for a
    group whose kernel blocks split the block (``blocks_per_kv_block > 1``: attention groups; a
    GDN group's kernel block is its block)."""
    hosts = vars(block_tables).get("_vhn_host_tables")
    if hosts is None:
        hosts = []
        for g, table in enumerate(block_tables.input_block_tables):
            host = None
            if block_tables.blocks_per_kv_block[g] == 1:
                host = RunnerHostTable(table, block_tables.num_blocks.np[g])
                _HOST_TABLES[_storage_key(table)] = host
            hosts.append(host)
        vars(block_tables)["_vhn_host_tables"] = hosts  # the registry's values are weak
    return hosts


def _make_v2_append(upstream: Any, stack: Stack) -> Any:
    @functools.wraps(upstream)
    def append_block_ids(self, req_index, new_block_ids, overwrite):
        out = upstream(self, req_index, new_block_ids, overwrite)
        for host, ids in zip(runner_host_tables(self), new_block_ids):
            if host is not None:
                host.write(req_index, list(ids))
        return out

    return append_block_ids


#: The V2 runner's attribute (set here) holding the step's batch order, ``input_batch.req_ids``
#: (:func:`_second_blocks` reads it).
V2_REQ_IDS = "_vhn_req_ids"


def _make_v2_rows(upstream: Any, stack: Stack) -> Any:
    @functools.wraps(upstream)
    def prepare_attn(self, input_batch):
        rows = input_batch.idx_mapping_np if self.pcp_manager is None else None
        for host in runner_host_tables(self.block_tables):
            if host is not None:
                host.rows = rows
        vars(self)[V2_REQ_IDS] = input_batch.req_ids if rows is not None else ()
        return upstream(self, input_batch)

    return prepare_attn


def _make_v2_dummy(upstream: Any, stack: Stack) -> Any:
    @functools.wraps(upstream)
    def prepare_dummy_attn(self, input_batch, *args, **kwargs):
        for host in runner_host_tables(self.block_tables):
            if host is not None:
                host.rows = None  # zeroed rows (or vLLM's dummy state slots): no junction there
        vars(self)[V2_REQ_IDS] = ()
        return upstream(self, input_batch, *args, **kwargs)

    return prepare_dummy_attn


def _junctions(table: Any, seq_lens: list, qlens: list, cols: list, num_decodes: int,
               block: int) -> dict[int, list[tuple[int, int]]]:
    """Per prefill row the checkpoints inside the row the KV-cache manager keeps a block for
    (:func:`core.junction_columns` on the row of ``table``, int32 [R, columns], read on the host:
    :func:`host_block_table`; RuntimeError where a device table has no host copy): shared-
    prefix junctions, and the block boundary a row started mid-block crosses, whose state goes
    to the initial state's block (column ``start // block``). Mid-block rows cross a boundary in
    two cases: :mod:`.gdn_junction`'s budget rule, and vLLM's own chunk from a start on a finer
    prefix-match unit (``--prefix-match-unit 64``, a partial hit inside a block) that reaches the
    prompt's end with an internal checkpoint: ``Scheduler._mamba_block_aligned_split`` (vLLM
    0.30-0.33) lifts the mid-block stop there, also where a shared-prefix junction stop then
    clips the chunk past the boundary without a checkpoint, and ``MambaManager.cache_blocks``
    caches that block at the boundary when a retention interval or the junction keeps it, so it
    must hold the boundary's state, not the hit's. Every other mid-block chunk of vLLM ends at or
    before its next boundary and finds none. Paths without this write stop such chunks at the
    boundary instead (``gdn-checkpoint-mid-block-stop``)."""
    out, host = {}, None
    for r in range(num_decodes, len(qlens)):
        start = seq_lens[r] - qlens[r]
        limit = cols[r] if cols[r] >= 0 else -(-seq_lens[r] // block) - 1
        if qlens[r] > 1 and limit > start // block:
            host = host_block_table(table) if host is None else host
            if found := core.junction_columns(start, seq_lens[r], block, cols[r], host[r, :limit].tolist()):
                out[r] = found
    return out


def make_builder(kernel_meta: Callable[[Any, Any], ops.KernelMeta | None]):
    """Registry ``make`` of a GDN metadata builder's ``build``: upstream's metadata, with the
    step's checkpoints in :data:`FIELD` when it has some."""
    def make(upstream: Any, stack: Stack) -> Any:
        @functools.wraps(upstream)
        def build(self, common_prefix_len, common_attn_metadata, *args, **kwargs):
            md = upstream(self, common_prefix_len, common_attn_metadata, *args, **kwargs)
            ck = build_checkpoints(self, common_attn_metadata, md, stack, kernel_meta)
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
    an import statement would cost host time on every layer and step)."""
    import vllm.forward_context as forward_context

    @functools.wraps(upstream)
    def _forward_core(self, mixed_qkv, b, a, core_attn_out):
        raw = forward_context.get_forward_context().attn_metadata
        ck = getattr(raw.get(self.prefix) if isinstance(raw, dict) else None, FIELD, None)
        if ck is None:
            return upstream(self, mixed_qkv, b, a, core_attn_out)
        from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

        ops.write_conv(self.kv_cache[0], mixed_qkv, ck, self.conv_kernel_size,
                       is_conv_state_dim_first())
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
        rounds = ck.memo("cpu-rounds", lambda: _cpu_rounds(ck.plan, attn_metadata_i))
        for idx, sub, copy in rounds:
            if copy is not None:  # the running states (conv, SSM) after a round are checkpoints
                dst, src = copy
                for state in (layer.kv_cache[0], layer.kv_cache[1]):
                    state[ck.slots[dst]] = state[src]
            out = core_attn_out.new_zeros((idx.numel(), *core_attn_out.shape[1:]))
            upstream(layer, sub, mixed_qkv[idx], b[idx], a[idx], out)
            core_attn_out[idx] = out

    return _cpu_gdn_attention_nonspec


def _cpu_rounds(plan: core.StepPlan, md: Any) -> list:
    """vLLM's CPU GDN function (conv and recurrence in one) split at the checkpoints: the decodes
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
        out.append((torch.tensor([t for s, e, _, _ in rows for t in range(s, e)]), dataclasses.replace(
            md, num_decodes=decodes, num_decode_tokens=decodes, num_prefills=len(rows) - decodes,
            num_prefill_tokens=cu[-1] - decodes, num_actual_tokens=cu[-1],
            has_initial_state=torch.tensor([r[3] for r in rows]),
            non_spec_query_start_loc=torch.tensor(cu, dtype=torch.int32),
            non_spec_state_indices_tensor=torch.tensor([r[2] for r in rows], dtype=torch.int32)),
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


#: Environment variable: which prefill checkpoints of a chunked prompt stay cached at a retention
#: interval above 0 (``all``, vLLM 0.30's rule, or ``final``; :func:`chunk_checkpoints`).
CHUNK_ENV = "VLLM_HYBRID_NPU_CHUNK_CHECKPOINTS"
CHUNK_MODES = ("all", "final")
#: A Mamba manager's attribute naming its :data:`CHUNK_MODES` value, set by whoever builds the
#: manager for one engine only (the hit-rate lab, per replay); unset: :data:`CHUNK_ENV`.
CHUNK_RULE = "_vhn_chunk_checkpoints"


def chunk_checkpoints() -> str:
    """``$VLLM_HYBRID_NPU_CHUNK_CHECKPOINTS`` (default ``all``); raises ValueError naming the
    variable for a value other than ``all`` or ``final``."""
    return envs.choice(CHUNK_ENV, CHUNK_MODES, "all")


def _make_retention(upstream: Any, stack: Stack) -> Any:
    """Wrap vLLM 0.30's ``MambaManager._cache_partial_tail_block(self, request, num_tokens,
    retention_interval)`` (``retention_interval`` in tokens: ``None`` dense, ``0`` vLLM's
    default, ``> 0`` a grid), which caches the block vLLM reserved for a prefill checkpoint
    (``self._checkpoints[request_id] = (position in tokens, block column)``; the exporter
    declares one, so every prefill chunk has one, one hash block below the chunk's end).

    Only the ``retention_interval`` handed to upstream changes; upstream's branches do the rest:

    * the prompt's own checkpoint (``get_mamba_prefill_checkpoint_position`` of the prompt) at
      retention 0: ``None``, so it is cached as vLLM 0.32's ``is_prompt_checkpoint`` caches it;
    * with :func:`chunk_checkpoints` ``final`` (or the manager's :data:`CHUNK_RULE`), any other
      checkpoint at retention > 0: ``0``, so upstream's retention-0 branch decides: a non-final
      chunk's checkpoint is dropped (``BlockPool._maybe_evict_cached_block``: no hash; the block
      and the state written into it are untouched) and a shared-prefix junction's, or one a
      chunk reaching the prompt's end leaves, is cached as before.

    Raises ValueError (naming :data:`CHUNK_ENV`) at the first such checkpoint for a bad value.
    """
    @functools.wraps(upstream)
    def _cache_partial_tail_block(self, request, num_tokens, retention_interval):
        checkpoint = self._checkpoints.get(request.request_id)
        if checkpoint is not None and retention_interval is not None:
            from vllm.v1.kv_cache_interface import get_mamba_prefill_checkpoint_position

            is_prompt = checkpoint[0] == get_mamba_prefill_checkpoint_position(
                request.num_prompt_tokens, self.block_pool.hash_block_size,
                self.drop_eagle_checkpoint_block)
            if retention_interval == 0 and is_prompt:
                retention_interval = None  # vLLM 0.32's is_prompt_checkpoint: cache it as the split would
            elif retention_interval > 0 and not is_prompt and \
                    (vars(self).get(CHUNK_RULE) or chunk_checkpoints()) == "final":
                retention_interval = 0  # upstream's retention-0 rule: kept only at a junction
        return upstream(self, request, num_tokens, retention_interval)

    return _cache_partial_tail_block


def _retention_wanted(stack: Stack) -> str | None:
    """:func:`wanted`, after reading :data:`CHUNK_ENV` (a bad value raises ValueError at load)."""
    chunk_checkpoints()
    return wanted(stack)


#: A scheduler's flags, by target (a dict): its engine's exporter path on that target writes the
#: state at the block boundary a chunk started mid-block crosses (:func:`junctions_off`), so the
#: mid-block stop stands aside. Per target, so that a second stop built for another target around
#: the same scheduler (the e2e tests force the stop of a path without the write) decides its own.
CROSSING_WRITTEN = "_vhn_crossing_written"


def _make_mid_block_stop(upstream: Any, stack: Stack) -> Any:
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
    entry("gdn-checkpoint-v2-host-table", "vllm.v1.worker.gpu.block_table",
          "BlockTables.append_block_ids", _make_v2_append, ("cuda",),
          "a host mirror of the V2 runner's block tables (device memory only), written where the "
          "runner stages its writes, so the GDN builder finds the shared-prefix junction columns "
          "without a device read (RunnerHostTable)", vllm=RUNNER_V2_VERSIONS,
          wanted=_v2_host_wanted, signature=("self", "req_index", "new_block_ids", "overwrite")),
    entry("gdn-checkpoint-v2-host-rows", "vllm.v1.worker.gpu.model_runner",
          "GPUModelRunner.prepare_attn", _make_v2_rows, ("cuda",),
          "the step's batch order (idx_mapping_np) for the mirror, before the V2 runner gathers "
          "its block tables", vllm=RUNNER_V2_VERSIONS, wanted=_v2_host_wanted, signature=("self", "input_batch")),
    entry("gdn-checkpoint-v2-host-dummy", "vllm.v1.worker.gpu.model_runner",
          "GPUModelRunner.prepare_dummy_attn", _make_v2_dummy, ("cuda",),
          "a dummy batch's rows read as null in the mirror (no junction planned there)",
          vllm=RUNNER_V2_VERSIONS, wanted=_v2_host_wanted, signature=("self", "input_batch", "valid_state_slots")),
    entry("gdn-checkpoint-regather", "vllm.v1.attention.backends.gdn_attn",
          "GDNAttentionMetadataBuilder.update_block_table", _make_regather, ("cuda",),
          "the V2 runner reuses group 0's GDN metadata for the other groups (update_block_table, "
          "a dataclasses.replace copy): their checkpoints re-gathered from their own block table",
          vllm=("0.32.0",) + VLLM_PLAN, signature=("self", "metadata", "blk_table", "slot_mapping")),
    entry("gdn-checkpoint-cpu", "vllm.model_executor.layers.mamba.ops.cpu.gdn_attention",
          "_cpu_gdn_attention_nonspec", _make_cpu_forward, ("cpu",),
          "vLLM's CPU GDN function in two rounds split at the checkpoint (split-exact)",
          signature=("layer", "attn_metadata_i", "mixed_qkv", "b", "a", "core_attn_out")),
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
    entry("gdn-checkpoint-mid-block-stop", "vllm.v1.core.sched.scheduler",
          "Scheduler._mamba_block_aligned_split", _make_mid_block_stop, ("cuda", "npu"),
          "a chunk started mid-block (e.g. a hit inside a block, --prefix-match-unit) ends at its "
          "next block boundary where a prefill checkpoint is declared (core.mid_block_chunk): "
          "vLLM lifts that stop under an internal checkpoint and caches the initial state's "
          "block at the boundary with the state at the chunk's start; it stands aside where the "
          "path writes the crossed boundary's state (junctions_off: vllm-ascend's paths, CUDA's "
          "one pass on vLLM 0.30's V2 runner from a start on the 64-token grid)",
          signature=("self", "request", "num_new_tokens", "num_new_local_computed_tokens",
                     "num_external_computed_tokens"),
          until="the one-pass kernel's several checkpoints per row run on every "
                "CUDA runner and vLLM version (vLLM 0.30's V2 runner only so far)"),
    entry("gdn-checkpoint-retention", "vllm.v1.core.single_type_kv_cache_manager",
          "MambaManager._cache_partial_tail_block", _make_retention, ("cpu", "cuda", "npu"),
          "vLLM 0.32's fix carried: the prompt's checkpoint is cached at retention interval 0; "
          "with VLLM_HYBRID_NPU_CHUNK_CHECKPOINTS=final a non-final chunk's checkpoint is not "
          "kept at retention > 0 (fewer states where a host tier evicts)",
          vllm=("0.30.0",), signature=("self", "request", "num_tokens", "retention_interval"),
          wanted=_retention_wanted,
          until="vLLM 0.30 leaves the support matrix (vLLM 0.32 has the rule)"),
]
