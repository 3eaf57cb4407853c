"""The runtime's GDN prefill-checkpoint exporter, replayed by the lab (issue 19).

What the exporter changes is all in vLLM's scheduler and KV-cache manager once the GDN layers'
``MambaSpec`` declares ``num_prefill_checkpoint_blocks=1`` and ``prefill_checkpoint_alignment=64``
(:func:`vllm_hybrid_npu_lab.model.build_setup` with ``prefill_checkpoints=True`` builds such specs
on the runtime's 64-token block grid): the scheduler drops its block-aligned split
(``use_internal_checkpoint``), the Mamba manager reserves and caches the checkpoint block. The
forward pass that writes the state is not replayed (the lab has none), only its bookkeeping.

On vLLM 0.30 the runtime also carries vLLM 0.32's retention fix (registry entry
``gdn-manager-cache``: ``MambaManager._cache_partial_tail_block`` keeps the prompt's checkpoint at
retention interval 0) and, with ``VLLM_HYBRID_NPU_OPTIONS=ckpt=final``, drops a non-final
chunk's checkpoint at a retention interval above 0. The lab takes that entry from the runtime's
registry (:data:`vllm_hybrid_npu.patches.gdn_mamba_manager.PATCHES`, the Mamba managers' hooks)
and applies its replacement to the replay scheduler's own Mamba managers only (bound on the
instances), so other replays in the same process keep vLLM's unpatched class; the option is set
per replay on those managers (``CHUNK_RULE``, which the rule reads before the environment). Each
hook is bound once per instance (:func:`bind_entry`), whichever ``apply_*`` binds it first; the
rules it runs follow what the instance's attributes switch on. The lab imports the runtime; the runtime never imports the lab.

By default the lab models CUDA's exporter, so it takes the runtime's ``gdn-chunk-end``
entry (its mid-block stop): a chunk started inside a block (after a hit finer than the block, ``--prefix-match-unit``)
ends at the next block boundary, as vLLM's own split does without a prefill checkpoint, where the
step does not write the crossed boundary. Bound on the replay scheduler instance, like the
retention fix. Since 2026-11-29 the runtime lifts vLLM's junction stop on CUDA too (vLLM 0.30's V2
runner, ``VLLM_HYBRID_NPU_OPTIONS=junctions=on``, the default), as on the CPU path and vllm-ascend's
paths (replayed on CPU only): :mod:`.replay` binds the junction entries for both targets
(:func:`apply_junction_entries`); on CUDA the stop stays for chunks started off the 64-token grid.
"""

from __future__ import annotations

import types
from typing import Any

#: the runtime registry entry carrying vLLM 0.32's retention rule to vLLM 0.30 (the Mamba
#: manager's caching hook)
RETENTION_ENTRY = "gdn-manager-cache"
#: the runtime registry entry of the scheduler's chunk end, whose inner layer ends a chunk started
#: mid-block at its next block boundary (and whose outer layer is the junction rule)
MID_BLOCK_STOP_ENTRY = "gdn-chunk-end"


def _entry(name: str) -> Any:
    """The runtime's :class:`~vllm_hybrid_npu.patches.registry.Patch` ``name`` of
    :data:`vllm_hybrid_npu.patches.gdn_prefill_checkpoint.PATCHES` or
    :data:`vllm_hybrid_npu.patches.gdn_mamba_manager.PATCHES` when it applies to the installed
    vLLM (its ``vllm`` versions), else ``None``."""
    import vllm

    from vllm_hybrid_npu.patches import gdn_junction, gdn_mamba_manager, gdn_prefill_checkpoint
    from vllm_hybrid_npu.support import base_version

    entry = next(p for p in gdn_prefill_checkpoint.PATCHES + gdn_mamba_manager.PATCHES
                 + gdn_junction.PATCHES if p.name == name)
    if base_version(vllm.__version__) not in entry.vllm:
        return None
    return entry


def retention_entry() -> Any:
    """The runtime's ``gdn-manager-cache`` :class:`~vllm_hybrid_npu.patches.registry.Patch`
    when it applies to the installed vLLM (its ``vllm`` versions), else ``None``."""
    return _entry(RETENTION_ENTRY)


def apply_retention_fix(scheduler: Any, chunk_checkpoints: str = "all") -> int:
    """Bind the runtime's retention replacement on ``scheduler``'s Mamba managers, with the
    runtime's option ``ckpt`` value ``chunk_checkpoints`` (``all`` or
    ``final``) set on each of them, whatever this process's environment says.

    Returns the number of managers patched (0 when the installed vLLM needs no fix or a manager
    already runs the runtime's replacement; the value is set on them all the same).

    Raises:
        ValueError: ``chunk_checkpoints`` is not one of the runtime's values, or is ``final``
            where the entry does not apply (vLLM other than 0.30).
    """
    import vllm
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager

    from vllm_hybrid_npu.patches.gdn_prefill_checkpoint import CHUNK_MODES, CHUNK_RULE
    from vllm_hybrid_npu.patches.registry import MARK
    from vllm_hybrid_npu.support import Stack, base_version

    if chunk_checkpoints not in CHUNK_MODES:
        raise ValueError(f"chunk checkpoints {chunk_checkpoints!r} is not one of {', '.join(CHUNK_MODES)}")
    entry = retention_entry()
    if entry is None:
        if chunk_checkpoints != "all":
            raise ValueError(f"ckpt=final needs the runtime's {RETENTION_ENTRY} entry (vLLM 0.30), "
                             f"not vLLM {vllm.__version__}")
        return 0
    stack = Stack(target="cpu", vllm=base_version(vllm.__version__))
    done = 0
    for mgr in scheduler.kv_cache_manager.coordinator.single_type_managers:
        if not isinstance(mgr, MambaManager):
            continue
        setattr(mgr, CHUNK_RULE, chunk_checkpoints)
        if getattr(type(mgr)._cache_partial_tail_block, MARK, False):
            continue  # the runtime's patch is applied process-wide already
        done += bind_entry(mgr, "_cache_partial_tail_block", entry, stack)
    return done


def apply_mid_block_stop(scheduler: Any) -> bool:
    """Bind the runtime's ``gdn-chunk-end`` replacement of ``Scheduler._mamba_block_aligned_split``
    (vLLM 0.30-0.33) on ``scheduler``, as the runtime applies it on CUDA (its stack's target; on
    the NPU its mid-block stop stands aside where vllm-ascend's paths write the crossed boundary,
    and a KV consumer's chunk stays whole, neither replayed here), with its junction rule off
    (``gdn_junction.RULE`` None on the scheduler and its KV-cache manager, unless set before):
    :func:`apply_junction_entries` turns it on.

    Returns True when bound; False when the installed vLLM is outside the entry's versions or
    the runtime applied this entry process-wide for CUDA or the NPU (``registry.REPORT``). Applied
    for the CPU target (its junction layer only), the stop alone is bound over it.
    """
    import vllm

    from vllm_hybrid_npu.patches import registry
    from vllm_hybrid_npu.support import Stack, base_version

    from vllm_hybrid_npu.patches import gdn_prefill_checkpoint as gdn
    from vllm_hybrid_npu.patches.gdn_junction import RULE

    entry = _entry(MID_BLOCK_STOP_ENTRY)
    upstream = type(scheduler)._mamba_block_aligned_split
    report = registry.REPORT
    if entry is None:
        return False
    stack = Stack(target="cuda", vllm=base_version(vllm.__version__))
    if MID_BLOCK_STOP_ENTRY in report.applied:
        if report.stack is None or report.stack.target in gdn.MID_BLOCK_TARGETS:
            return False  # the runtime's stop is in the class's split already
        # applied for the CPU target: its junction layer only; the stop alone over it
        fn = gdn._make_mid_block_stop(upstream, stack)
        setattr(fn, BOUND, MID_BLOCK_STOP_ENTRY)
        scheduler._mamba_block_aligned_split = types.MethodType(fn, scheduler)
        return True
    for obj in (scheduler, scheduler.kv_cache_manager):
        vars(obj).setdefault(RULE, None)
    return bind_entry(scheduler, "_mamba_block_aligned_split", entry, stack, upstream)


#: the runtime registry entries exporting shared-prefix junction states and budget chunk ends
#: inside the step (:mod:`vllm_hybrid_npu.patches.gdn_junction`'s split and the Mamba managers'
#: hooks, :mod:`vllm_hybrid_npu.patches.gdn_mamba_manager`; vLLM 0.30)
JUNCTION_ENTRIES = ("gdn-chunk-end", "gdn-manager-allocate", "gdn-manager-count",
                    "gdn-manager-blocks")


def apply_junction_entries(scheduler: Any, target: str = "npu") -> bool:
    """Model a path that exports junction states inside the step: the runtime's junction entries
    (:data:`JUNCTION_ENTRIES`, vLLM 0.30) on ``scheduler``, as the runtime applies them on the NPU
    (``target`` ``npu``: vllm-ascend 0.30.0rc2's three prefill paths, replayed on CPU only) or on
    CUDA (``cuda``: the one pass on vLLM 0.30's V2 runner, ``VLLM_HYBRID_NPU_OPTIONS=junctions=on``).
    A chunk no longer stops at a shared-prefix junction whose state the step exports, nor below
    the token budget's end at a block boundary, and a chunk started mid-block runs on (the step
    writes the crossed boundary): the runtime's ``gdn-chunk-end`` is bound for ``target`` (its
    mid-block stop told that the path writes the crossing: on the NPU it stands aside, on CUDA
    it stands aside for a start on the 64-token grid and stops one off it, a prefix-match unit
    below 64). The blocks they reserve are cached by vLLM's
    own manager.

    Binds the entries on this scheduler, its KV-cache manager and its align-mode Mamba managers
    (the classes stay untouched), unless the runtime applied them process-wide; then only the
    rule is set. The rule is the runtime's
    (:func:`vllm_hybrid_npu.patches.gdn_junction.junction_rule`, without the exporter path's
    check). Returns True when the rule is on; False, with vLLM's junction stop kept, outside
    vLLM 0.30 or where that rule is None (a setting without the exporter). The caller leaves it
    off where the runtime does (``junctions_off``: a KV connector on vllm-ascend's paths).
    """
    import vllm

    from vllm_hybrid_npu.patches import gdn_junction as J
    from vllm_hybrid_npu.patches import registry
    from vllm_hybrid_npu.support import Stack, base_version

    from vllm_hybrid_npu.patches.gdn_prefill_checkpoint import CROSSING_WRITTEN

    kv = scheduler.kv_cache_manager
    # the runtime exports junctions on vLLM 0.30 / 0.32 / 0.33 (J.VERSIONS), but the paths the lab models
    # (CUDA's V2 runner, vllm-ascend 0.30.0rc2) do only on 0.30, budget-sized chunks with them
    version = base_version(vllm.__version__)
    rule = (J.junction_rule(scheduler, drop=J.drop_read(Stack(target, version)))
            if version in J.BUDGET_VERSIONS else None)
    setattr(scheduler, J.RULE, rule)
    setattr(kv, J.RULE, rule)
    if rule is None:
        return False
    # the mid-block stop's own decision, as the runtime takes it on these paths
    vars(scheduler).setdefault(CROSSING_WRITTEN, {})[target] = True
    bound = getattr(vars(scheduler).get("_mamba_block_aligned_split"), "__func__", None)
    if bound is not None and target != "cuda":  # bound for CUDA (apply_mid_block_stop): rebind
        vars(scheduler).pop("_mamba_block_aligned_split")
    if JUNCTION_ENTRIES[0] in registry.REPORT.applied:
        return True  # the runtime's class-level entries read the rule set above
    from vllm_hybrid_npu.patches import gdn_mamba_manager as M

    hooks = {p.name: p for p in M.PATCHES}
    stack = Stack(target=target, vllm=base_version(vllm.__version__))
    bind_entry(scheduler, "_mamba_block_aligned_split", J.PATCHES[0], stack)
    bind_entry(kv, "allocate_slots", hooks["gdn-manager-allocate"], stack)
    for mgr in rule.managers:
        bind_entry(mgr, "get_num_blocks_to_allocate", hooks["gdn-manager-count"], stack)
        bind_entry(mgr, "allocate_new_blocks", hooks["gdn-manager-blocks"], stack)
    return True


#: attribute of a function :func:`bind_entry` bound: the registry entry's name
BOUND = "_vhn_lab_entry"


def bind_entry(obj: Any, attr: str, patch: Any, stack: Any, upstream: Any = None) -> bool:
    """Bind a runtime registry entry ``patch`` (a :class:`~vllm_hybrid_npu.patches.registry.Patch`)
    on the instance ``obj`` alone (its class untouched): its ``make`` over ``upstream``, else over
    a runtime entry bound on this instance before (another ``apply_*`` here), else over the
    class's ``attr``; ``stack`` (a :class:`~vllm_hybrid_npu.support.Stack`) as the registry
    passes it. An entry already bound there (the Mamba managers' hooks, which several
    ``apply_*`` share) stays as it is: each upstream method is wrapped once, as the runtime
    wraps it. Returns whether it bound."""
    bound = getattr(vars(obj).get(attr), "__func__", None)
    if getattr(bound, BOUND, None) == patch.name:
        return False
    upstream = upstream or bound or getattr(type(obj), attr)
    fn = patch.make(upstream, stack)
    setattr(fn, BOUND, patch.name)
    setattr(obj, attr, types.MethodType(fn, obj))
    return True


def exporter_scheduler(base: type, chunk_checkpoints: str = "all") -> type:
    """A subclass of ``base`` (vLLM's ``Scheduler``) with the runtime's retention fix on its
    Mamba managers, with the option ``ckpt`` = ``chunk_checkpoints`` for them
    (see :func:`apply_retention_fix`), and the runtime's mid-block stop on its split
    (:func:`apply_mid_block_stop`); pair it with a setup built with
    ``prefill_checkpoints=True``."""

    class ExporterScheduler(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            apply_retention_fix(self, chunk_checkpoints)
            apply_mid_block_stop(self)

    ExporterScheduler.__name__ = ExporterScheduler.__qualname__ = f"Exporter{base.__name__}"
    return ExporterScheduler


def tail_split_off_scheduler(base: type) -> type:
    """A subclass of ``base`` (vLLM's ``Scheduler``, or a lab subclass of it) whose align-mode
    split runs a prompt's last chunk whole where vLLM's checkpoint check fails by its column
    clause alone: the runtime's ``sub-block-tail-split-off`` entry
    (:mod:`vllm_hybrid_npu.patches.sub_block_tail_split`, ``VLLM_HYBRID_NPU_OPTIONS=tailsplit=off``;
    vLLM 0.30), whose replacement of the scheduler module's
    ``is_mamba_prefill_checkpoint_valid`` is bound only while this scheduler's
    ``_mamba_block_aligned_split`` runs (restored after each call; a replay runs in one thread of
    its process), so other replays keep vLLM's answer and the KV-cache manager, which imports the
    function under its own name, keeps it here too. The runtime's split entries bound on the
    instance later (:func:`apply_mid_block_stop`, :func:`apply_junction_entries`) wrap this
    method, and the lab's step reasons (:class:`~vllm_hybrid_npu_lab.step_reasons.SplitRecorder`)
    read the split through it, as through those (``RUNTIME_SPLIT``). The installed vLLM is the
    policy's to check (``tailsplit=off`` settings carry the
    entry's versions, :func:`vllm_hybrid_npu_lab.upstream_grid.policy_of`)."""
    import vllm.v1.core.sched.scheduler as S

    from vllm_hybrid_npu.patches import registry
    from vllm_hybrid_npu.patches import sub_block_tail_split as T

    class TailSplitOffScheduler(base):  # type: ignore[misc, valid-type]
        def _mamba_block_aligned_split(self, *args: Any, **kwargs: Any) -> int:
            upstream = S.is_mamba_prefill_checkpoint_valid
            if registry.is_ours(upstream):  # the runtime's entry applied process-wide
                return super()._mamba_block_aligned_split(*args, **kwargs)
            S.is_mamba_prefill_checkpoint_valid = T.make_valid(upstream)
            try:
                return super()._mamba_block_aligned_split(*args, **kwargs)
            finally:
                S.is_mamba_prefill_checkpoint_valid = upstream

    from vllm_hybrid_npu_lab.step_reasons import RUNTIME_SPLIT

    # the runtime's entry, not a lab policy: the step reasons read the split through it
    setattr(TailSplitOffScheduler._mamba_block_aligned_split, RUNTIME_SPLIT, True)
    TailSplitOffScheduler.__name__ = TailSplitOffScheduler.__qualname__ = f"TailSplitOff{base.__name__}"
    return TailSplitOffScheduler


def apply_second_checkpoint(scheduler: Any) -> bool:
    """Turn the runtime's second checkpoint block on for ``scheduler``
    (:mod:`vllm_hybrid_npu.patches.gdn_second_checkpoint`'s rules, the runtime's
    ``VLLM_HYBRID_NPU_OPTIONS=second=on``; vLLM 0.30: where the runtime's step exports junction
    states), whatever this process's environment says: its KV-cache manager's second-block
    managers set (``eligible``), the Mamba managers' hooks (``gdn-manager-*``) and the engine's
    plan (``gdn-checkpoint-send``) bound on the scheduler, its KV-cache manager and those
    managers: a prompt whose checkpoint lies inside its last block also keeps the state at that
    block's start, in a second block. The worker's entry has no part in a replay. Returns False where the installed vLLM is outside the entries' versions or
    no manager qualifies (no exporter, a prefix-match unit at the block); True when bound, or
    when the runtime applied them process-wide."""
    import vllm

    from vllm_hybrid_npu.patches import gdn_second_checkpoint as S
    from vllm_hybrid_npu.patches import registry
    from vllm_hybrid_npu.support import Stack, base_version

    if base_version(vllm.__version__) not in S.VERSIONS:
        return False
    kv = scheduler.kv_cache_manager
    managers = S.eligible(kv)
    S.set_managers(kv, managers)  # the lab's key, whatever this process's environment says
    if not managers:
        return False
    from vllm_hybrid_npu.patches import gdn_mamba_manager as M

    if M.PATCHES[0].name in registry.REPORT.applied:
        return True
    from vllm_hybrid_npu.patches import gdn_step_checkpoints as P

    hooks = {p.name.rsplit("-", 1)[1]: p for p in M.PATCHES}
    stack = Stack(target="cpu", vllm=base_version(vllm.__version__))
    # the engine's plan marks each second block sent (or unused) once its step is scheduled
    vars(scheduler).setdefault(P.MANAGERS, tuple(managers))
    bind_entry(scheduler, "_update_after_schedule",
               next(p for p in P.PATCHES if p.name == "gdn-checkpoint-send"), stack)
    bind_entry(kv, "allocate_slots", hooks["allocate"], stack)
    for mgr in managers:
        for attr, key in (("get_num_blocks_to_allocate", "count"), ("allocate_new_blocks", "blocks"),
                          ("_cache_partial_tail_block", "cache"),
                          ("remove_skipped_blocks", "retire"), ("pop_blocks_for_free", "free")):
            bind_entry(mgr, attr, hooks[key], stack)
    return True


def second_checkpoint_scheduler(base: type) -> type:
    """A subclass of ``base`` (vLLM's ``Scheduler`` or a lab subclass of it) with the runtime's
    second checkpoint block (:func:`apply_second_checkpoint`) bound on each instance; the lab's
    ``second=on`` key. The junction entries, bound later by the replay, share its Mamba managers'
    hooks (bound once) and wrap the split."""

    class SecondCheckpointScheduler(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            apply_second_checkpoint(self)

    SecondCheckpointScheduler.__name__ = SecondCheckpointScheduler.__qualname__ = f"SecondCheckpoint{base.__name__}"
    return SecondCheckpointScheduler
