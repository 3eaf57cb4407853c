"""Shared-prefix junction states exported from inside the step: no align-mode stop at a junction.

When a request's attention blocks hit a prefix that has no GDN state at its end (the second
request sharing a system prompt, a document asked a second question), vLLM 0.30 sets
``request.shared_prefix_boundary`` (the attention hit, ``KVCacheManager.get_computed_blocks``) and
``Scheduler._mamba_block_aligned_split`` ends the request's chunk there, floored to the block
(``jf``), so that align mode caches the state at ``jf`` for the next sharer: one more prefill
step for that request, even where the GDN layers export the prompt's own checkpoint from inside
the step (:mod:`.gdn_prefill_checkpoint`). Here, where the exporter path can also write the
junction state (:data:`~.gdn_prefill_checkpoint.JUNCTION_PATHS`: vLLM's CPU GDN function,
vllm-ascend 0.30.0rc2's three GDN prefill paths; :func:`~.gdn_prefill_checkpoint.junctions_off`
says where not), the
chunk runs on and the state at ``jf`` goes into a block of its own, in the block-table column
vLLM's split would have left it in (``jf // block - 1``), so vLLM caches it there under the same
block hash, retention rule and host-tier offer as the split's step end. One rule decides for all
(:func:`vllm_hybrid_npu.core.prefill_checkpoints.junction_checkpoint`):

* ``Scheduler._mamba_block_aligned_split`` (``gdn-chunk-end``, :data:`ENTRY`, whose inner layer
  is the mid-block stop on CUDA and the NPU): upstream's chunk, and
  upstream's chunk without the junction stop; the longer one where the rule exports (or the
  prompt checkpoint sits at ``jf`` already);
* the Mamba managers' hooks (:mod:`.gdn_mamba_manager`): ``KVCacheManager.allocate_slots``
  applies the same rule to the chunk being allocated (:func:`allocation_checkpoint`) and hands
  each align-mode Mamba manager the junction for that call only; ``get_num_blocks_to_allocate`` /
  ``allocate_new_blocks`` count one block more and put it in the junction's column
  (:func:`place`; vLLM leaves it null); vLLM's own ``cache_blocks`` then caches it (the junction
  is one of its reachable boundaries);
* the engine's plan (:mod:`.gdn_step_checkpoints`) sends that block's id and position with the
  step; the worker's GDN metadata builder plans a second checkpoint in the row; vLLM's CPU GDN
  function, or vllm-ascend's prefill kernel (``ops.run_split``), runs in one more round; CUDA's
  one-pass chunk-state kernel stores it at its chunk start in the same pass.

The same entries end a prefill chunk where the token budget ends, where vLLM
floors a non-final chunk to the block and stops a chunk started mid-block at its next boundary
(``Scheduler._mamba_block_aligned_split``'s invariant: slot ``p`` holds the state after ``(p + 1) *
block`` tokens). The chunk ends on the 64-token checkpoint grid (:meth:`JunctionRule.budget_end`)
and the step writes the state at each block boundary whose block vLLM keeps: from a start on the
grid vLLM 0.30's own ``MambaManager`` reserves the checkpoint at the chunk's last boundary (it
reads the chunk's end, final or not); from a start mid-block the initial state's block takes the
next boundary's state (the engine lists it, ``core.step_checkpoints``) and ``allocate_slots``
hands the managers the prompt checkpoint or the chunk's last boundary past it
(:meth:`JunctionRule.crossed`). Only with the prefix-match unit at the block, and only on vLLM
0.30 (:data:`BUDGET_VERSIONS`).

Under EAGLE/MTP's block drop (vLLM 0.30's CPU path, :data:`DROP_VERSIONS` and
:data:`DROP_TARGETS`, the prefix-match unit at the block: :func:`drop_off`) both rules hold at the drop's
positions (:attr:`JunctionRule.eagle_drop`): a later request's attention lookup matches one block
past its hit and drops it, so its Mamba lookup wants the state exactly there. The junction
(``shared_prefix_boundary``) is that post-drop hit already; the prompt checkpoint the manager
reserves is ``get_mamba_prefill_checkpoint_position(end, unit, True)``, one unit lower; a chunk
started mid-block hands the crossed position one block lower (:func:`core.crossed_checkpoint`);
and a non-final chunk that would run past the prompt's drop checkpoint without keeping it ends
there (:func:`core.drop_chunk_end`, as vLLM's own split does), so a repeat always finds it.

On vLLM 0.32 and 0.33 the junction rule applies as on 0.30 (:data:`VERSIONS`): their split,
``MambaManager`` and ``KVCacheManager.allocate_slots`` keep 0.30's contracts for it (the prompt
checkpoint in column ``cdiv(end, block) - 2``, the junction among the boundaries ``cache_blocks``
keeps). Two
differences are read from the engine: under sparse retention their manager reserves the prompt
checkpoint only on the chunk reaching the prefill end (:func:`reserves_final_chunk_only`), and
``--enable-mamba-shared-prefix-checkpoint`` makes vLLM stop at the junction itself and cache it
there (:func:`exact_junction_stop`), where the rule defers to vLLM.

The Mamba managers are vLLM's ``MambaManager`` or a subclass (vllm-ascend's
``AscendMambaManager``, :func:`is_mamba_manager`). On CUDA the one pass writes every checkpoint of
a row (a junction, the crossed boundary, the prompt's own) on vLLM 0.30's V2 runner, which
receives the engine's list. Elsewhere (CUDA's V1 runner, FlashInfer,
``FLA_USE_FAST_OPS=1``, DCP / PCP / micro-batching; vllm-ascend's V2 runner, DCP, a KV connector;
speculative decoding on vLLM 0.32 or on vllm-ascend's paths, with EAGLE/MTP's block drop or
without, logged)
nothing applies and vLLM stops at the junction, as before (:func:`~.gdn_prefill_checkpoint.junctions_off`). A junction the manager cannot place (its column not null) keeps nothing
there: the chunk already ran past it, so a later sharer hits less, but no block is cached
unwritten. Until: vLLM exports junction states inside the step itself (RFC #52959).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any

from vllm_hybrid_npu.core import prefill_checkpoints as core
from vllm_hybrid_npu.patches import gdn_prefill_checkpoint as gdn
from vllm_hybrid_npu.support import Stack

logger = logging.getLogger("vllm_hybrid_npu")

#: The KV-cache manager's rule (:class:`JunctionRule`), set by the scheduler entry; None: off.
RULE = "_vhn_junction_rule"
#: A Mamba manager's ``{request id: junction position}`` for the allocation in progress.
HINT = "_vhn_junction"
#: Where the junction rule applies: vLLM's ``MambaManager`` reserves the chunk's prompt
#: checkpoint in column ``cdiv(end, block) - 2`` and caches each full block at a reachable
#: boundary (the junction is one), so a block placed in the junction's column is kept there
#: (0.33: 0.32's split, manager and ``allocate_slots`` but for the lookahead block hashes of an
#: EAGLE/MTP drafter, which move the checkpoint positions; :func:`junction_rule` declines them).
VERSIONS = ("0.30.0", "0.32.0", "0.33.0")
#: Where prefill chunks also run to the token budget's end (:meth:`JunctionRule.budget_end`,
#: :meth:`JunctionRule.crossed`): vLLM 0.30, read against its ``MambaManager``, which reserves a
#: checkpoint on every chunk.
BUDGET_VERSIONS = ("0.30.0",)
#: Where the rule also applies under EAGLE/MTP's block drop, at the drop's positions
#: (:attr:`JunctionRule.eagle_drop`): vLLM 0.30, whose attention lookup matches one block past
#: the hit and drops it, and whose ``MambaManager`` reserves
#: ``get_mamba_prefill_checkpoint_position(end, hash_block, True)``, ``(end - 1) // unit * unit -
#: unit``, where that dropped hit lands. vLLM 0.32 reads ``end // unit * unit - unit`` under the
#: drop (a different proof limit), not read here; vLLM 0.33 turns the drop off under its
#: lookahead block hashes, which the rule declines.
DROP_VERSIONS = ("0.30.0",)
#: The targets where the rule also applies under the drop: those whose worker was checked writing
#: several checkpoints a row beside speculative decode rows, vLLM's CPU GDN functions
#: (``tests/patches/test_cpu_spec_checkpoints.py``). vllm-ascend's paths are replayed under MTP
#: with one checkpoint a row only, so the rule stays off there under the drop; CUDA declares no
#: checkpoint under MTP.
DROP_TARGETS = ("cpu",)
#: Where the junction entries apply: vLLM's CPU GDN function, CUDA's one pass on vLLM 0.30's V2
#: runner and vllm-ascend's GDN paths (:data:`.gdn_prefill_checkpoint.JUNCTION_PATHS`; each
#: engine decides by :func:`decide`).
TARGETS = ("cpu", "cuda", "npu")
SINGLE_TYPE = "vllm.v1.core.single_type_kv_cache_manager"


@dataclasses.dataclass(frozen=True)
class JunctionRule:
    """The engine's parameters of :func:`core.junction_checkpoint`, :func:`core.budget_chunk_end`
    and :func:`core.crossed_checkpoint` (tokens): the Mamba block, the prefix-match unit (vLLM's
    hash block), the declared checkpoint alignment, EAGLE/MTP's block drop (``eagle_drop``: vLLM's
    ``Scheduler.use_eagle_block_drop``, which the Mamba managers read as
    ``drop_eagle_checkpoint_block``); and the engine's align-mode
    Mamba managers that declare prefill checkpoints. ``final_only``: the managers reserve the
    prompt checkpoint only on the chunk that reaches the prefill end
    (:func:`reserves_final_chunk_only`); ``budget``: budget-sized chunks and crossed boundaries on
    (:data:`BUDGET_VERSIONS`)."""

    block: int
    hash_block: int
    alignment: int
    eagle_drop: bool
    managers: tuple
    final_only: bool = False
    budget: bool = True

    def decide(self, request: Any, start: int, end: int) -> tuple[str, int]:
        """The rule on the chunk ``[start, end)`` of ``request``, with the prompt checkpoint vLLM's
        ``MambaManager.get_num_blocks_to_allocate`` reserves for that chunk (the last hash
        boundary before ``end`` where ``is_mamba_prefill_checkpoint_valid``; under
        :attr:`final_only` none before the prefill end)."""
        from vllm.v1.kv_cache_interface import (get_mamba_prefill_checkpoint_position,
                                                is_mamba_prefill_checkpoint_valid)

        position = get_mamba_prefill_checkpoint_position(end, self.hash_block, self.eagle_drop)
        valid = is_mamba_prefill_checkpoint_valid(
            query_start=start, query_end=end, checkpoint_position=position,
            hash_block_size=self.hash_block, mamba_block_size=self.block,
            checkpoint_alignment=self.alignment)
        if self.final_only and end < max(request.num_prompt_tokens, request.num_tokens - 1):
            valid = False
        return core.junction_checkpoint(start, end, request.num_prompt_tokens,
                                        getattr(request, "shared_prefix_boundary", 0) or 0,
                                        self.block, position if valid else 0)

    def budget_end(self, request: Any, start: int, end: int) -> int:
        """Where the chunk ``[start, end)`` the token budget offers ``request`` ends when the
        step exports the GDN state at every block boundary it crosses
        (:func:`core.budget_chunk_end`), or 0 where vLLM's chunking stays: a prefix-match unit
        below the block (its tail stops), a start off the alignment grid, a request past its
        first prefill (a resumed one replaying output tokens), or :attr:`budget` off. Under
        :attr:`eagle_drop` a non-final chunk ends at the prompt's drop checkpoint where it would
        run past it without keeping it (:func:`core.drop_chunk_end`)."""
        if (not self.budget or self.hash_block != self.block or start % self.alignment
                or request.num_tokens > request.num_prompt_tokens):
            return 0
        end = core.budget_chunk_end(start, end, request.num_prompt_tokens, self.alignment)
        if self.eagle_drop:  # no chunk runs past the drop checkpoint without keeping it
            end = core.drop_chunk_end(start, end, request.num_prompt_tokens, self.block,
                                      self.alignment)
        return end

    def crossed(self, request: Any, start: int, end: int) -> int:
        """The position whose state the chunk ``[start, end)`` of ``request``, started off the
        block grid, leaves in a block of its own (:func:`core.crossed_checkpoint`), or 0 (also
        with :attr:`budget` off: vLLM's chunks then start on the block grid past a hit). Under
        :attr:`eagle_drop` the positions one block lower, where the drafter's dropped hit
        lands."""
        if (not self.budget or self.hash_block != self.block
                or request.num_tokens > request.num_prompt_tokens):
            return 0
        return core.crossed_checkpoint(start, end, request.num_prompt_tokens, self.block,
                                       self.alignment, drop=self.eagle_drop)


def is_mamba_manager(manager: Any) -> bool:
    """Whether ``manager`` is vLLM 0.30's ``MambaManager``
    (``vllm/v1/core/single_type_kv_cache_manager.py``) or a subclass of it: vllm-ascend
    0.30.0rc2's ``AscendMambaManager`` (``patch/platform/patch_mamba_manager.py``, which rebinds
    the module's ``MambaManager`` to it) keeps its allocation and caching and wraps
    ``get_num_blocks_to_allocate`` around vLLM's. By the class's module and name along the MRO:
    the module attribute may name either class, depending on the import order."""
    return any(c.__name__ == "MambaManager" and c.__module__ == SINGLE_TYPE
               for c in type(manager).__mro__)


def checkpoint_managers(kv_cache_manager: Any) -> tuple:
    """The Mamba managers of ``kv_cache_manager`` (vLLM's ``KVCacheManager``) whose blocks the
    plugin's rules place: :func:`is_mamba_manager`, align mode, a prefill checkpoint block
    declared (``has_prefill_checkpoint_blocks``), in KV-cache group order. The junction rule,
    the engine's plan and the second block each narrow this set."""
    return tuple(m for m in kv_cache_manager.coordinator.single_type_managers
                 if is_mamba_manager(m) and m.mamba_cache_mode == "align"
                 and getattr(m, "has_prefill_checkpoint_blocks", False))


def exact_junction_stop(scheduler: Any) -> bool:
    """Whether vLLM's split of ``scheduler`` stops at the junction itself, not floored to the
    block, and its Mamba manager caches the state there (``cache_partial_block``): vLLM 0.30's
    ``mamba_fine_grained_prefix_cache``, vLLM 0.32's / 0.33's ``mamba_shared_prefix_checkpoint``
    (``--enable-mamba-shared-prefix-checkpoint``). vLLM carries that junction; the rule stays off."""
    return bool(getattr(scheduler, "mamba_fine_grained_prefix_cache", False)
                or getattr(scheduler, "mamba_shared_prefix_checkpoint", False))


def reserves_final_chunk_only(kv_cache_manager: Any) -> bool:
    """Whether the Mamba managers of ``kv_cache_manager`` reserve the prompt checkpoint only on the
    chunk reaching the prefill end: vLLM 0.32's / 0.33's ``MambaManager.get_num_blocks_to_allocate`` takes
    ``prefill_end``, which the coordinator passes at ``prefix_cache_retention_interval`` 0 (its
    default: only the replay boundary and junctions kept) and zeroes otherwise (a positive
    interval or None: every chunk's checkpoint reserved); vLLM 0.30's has no such parameter and
    reserves on every chunk."""
    import inspect

    from vllm.v1.core import single_type_kv_cache_manager as single

    takes = "prefill_end" in inspect.signature(single.MambaManager.get_num_blocks_to_allocate).parameters
    return takes and getattr(kv_cache_manager.coordinator, "retention_interval", None) == 0


def junction_rule(scheduler: Any, budget: bool = True, drop: bool = False) -> JunctionRule | None:
    """The :class:`JunctionRule` of vLLM 0.30's, 0.32's or 0.33's ``scheduler`` (``Scheduler``) as
    its align-mode configuration allows it, whatever the exporter path: None without align-mode
    Mamba managers that declare prefill checkpoint blocks, with EAGLE/MTP's block drop where
    :func:`drop_off` says why (``drop``, default False: the caller's vLLM is one the rule was
    read against under the drop, :data:`DROP_VERSIONS`; a prefix-match unit below the block),
    with vLLM 0.33's lookahead block hashes (``num_hash_lookahead_tokens``: an EAGLE/MTP drafter, where
    0.33 turns the drop off; its checkpoint positions read the lookahead, which
    :meth:`JunctionRule.decide` does not) or where vLLM stops at the junction itself
    (:func:`exact_junction_stop`). ``budget``: the rule also runs chunks to the token budget's
    end. Under the drop the rule's positions are the drop's (:attr:`JunctionRule.eagle_drop`).
    :func:`decide` adds the path's check; the lab's ``--target npu`` takes it as is
    (``vllm_hybrid_npu_lab.exporter.apply_junction_entries``)."""
    managers = checkpoint_managers(scheduler.kv_cache_manager)
    if (not managers or not scheduler.mamba_has_prefill_checkpoint_blocks
            or (speculative(scheduler) and drop_off(scheduler, drop) is not None)
            or getattr(scheduler, "num_hash_lookahead_tokens", 0)
            or exact_junction_stop(scheduler)):
        return None
    return JunctionRule(scheduler.cache_config.block_size, scheduler.hash_block_size,
                        scheduler.mamba_prefill_checkpoint_alignment,
                        bool(scheduler.use_eagle_block_drop), managers,
                        final_only=reserves_final_chunk_only(scheduler.kv_cache_manager),
                        budget=budget)


def drop_read(stack: Stack) -> bool:
    """Whether the rule holds under EAGLE/MTP's block drop on ``stack``: its vLLM in
    :data:`DROP_VERSIONS` and its target in :data:`DROP_TARGETS`."""
    return stack.vllm in DROP_VERSIONS and stack.target in DROP_TARGETS


def speculative(scheduler: Any) -> bool:
    """Whether ``scheduler``'s engine decodes speculatively (a ``speculative_config``: its
    steps may hold speculative decode rows, with EAGLE/MTP's block drop or without; the drop
    itself, ``use_eagle_block_drop``, implies one)."""
    return (bool(getattr(scheduler, "use_eagle_block_drop", False))
            or getattr(scheduler.vllm_config, "speculative_config", None) is not None)


def drop_off(scheduler: Any, drop: bool) -> str | None:
    """Why the junction rule is off under speculative decoding (:func:`speculative`) for
    ``scheduler`` (vLLM's ``Scheduler``), or None where it holds (under EAGLE/MTP's block drop at
    the drop's positions): ``drop`` False (the stack is not one :func:`drop_read` names: no
    worker of it was checked writing several checkpoints a row beside speculative decode rows,
    with the drop or without), or under the drop a prefix-match unit below the block
    (``hash_block_size`` under ``cache_config.block_size``: the drop then moves hits by the unit,
    which the rule was not checked against on vLLM's scheduler)."""
    if not drop:
        return (f"read against vLLM {', '.join(DROP_VERSIONS)} on the "
                f"{', '.join(DROP_TARGETS)} path only")
    if scheduler.use_eagle_block_drop and scheduler.hash_block_size != scheduler.cache_config.block_size:
        return "a prefix-match unit below the block"
    return None


def decide(scheduler: Any, stack: Stack) -> JunctionRule | None:
    """The scheduler's :class:`JunctionRule`, or None where junctions keep vLLM's stop (vLLM
    outside :data:`VERSIONS`, or :func:`~.gdn_prefill_checkpoint.junctions_off`; budget-sized
    chunks only on :data:`BUDGET_VERSIONS`); decided once per
    scheduler, at its start (``gdn-manager-engine``) or its first split, logged, and handed to
    its KV-cache manager (:data:`RULE`)."""
    if hasattr(scheduler, RULE):
        return getattr(scheduler, RULE)
    rule = None
    if stack.vllm in VERSIONS and gdn.junctions_off(
            scheduler.vllm_config, gdn.exporter_path(scheduler.vllm_config, stack.target)[0]) is None:
        rule = junction_rule(scheduler, budget=stack.vllm in BUDGET_VERSIONS,
                             drop=drop_read(stack))
        if rule is None and speculative(scheduler) and (
                why := drop_off(scheduler, drop_read(stack))) is not None:
            gdn._log_once("junction-eagle", "shared-prefix junction states and budget-sized "
                          "chunks: off under speculative decoding%s on vLLM %s, %s (%s; vLLM's "
                          "junction stop and block-floored chunks kept); the prompt's checkpoint "
                          "is exported%s", " with EAGLE/MTP's block drop"
                          if scheduler.use_eagle_block_drop else "", stack.vllm, stack.target, why,
                          " at the drafter-drop position" if scheduler.use_eagle_block_drop else "")
    if rule is not None:
        logger.info("vllm-hybrid-npu: shared-prefix junction states exported from inside the step "
                    "(block %d tokens): the scheduler does not stop at a junction it can export%s",
                    rule.block, "" if not rule.budget or rule.hash_block != rule.block else
                    ", and prefill chunks end where the token budget ends (the states at the "
                    "block boundaries they cross exported too)")
    setattr(scheduler, RULE, rule)
    setattr(scheduler.kv_cache_manager, RULE, rule)
    return rule


def budget_rule_expected(vllm_config: Any, target: str) -> bool:
    """Whether an engine of ``vllm_config`` on ``target`` will run prefill chunks to the token
    budget's end (:meth:`JunctionRule.budget_end`), read from the configuration before the
    scheduler exists: the exporter path writes the states there (:func:`gdn.junctions_off`), the
    split entry's budget rule is applied or pending (:func:`budget_applied`), and no ``--prefix-match-unit`` is set (below
    the block its tail stops stay; the block is not known yet). The ``token-budget`` entries
    then leave the budget alone: no chunk ends on the block grid for them to save. Under
    speculative decoding (EAGLE/MTP's block drop or not) only on :data:`DROP_TARGETS` (the budget
    rule's vLLM, :data:`BUDGET_VERSIONS`, is one the rule takes the drop on, :data:`DROP_VERSIONS`)."""
    spec = getattr(vllm_config, "speculative_config", None)
    return (gdn.junctions_off(vllm_config, gdn.exporter_path(vllm_config, target)[0]) is None
            and budget_applied()
            and getattr(vllm_config.cache_config, "prefix_match_unit", None) is None
            and (target in DROP_TARGETS or spec is None))


def _make_split(upstream: Any, stack: Stack) -> Any:
    @functools.wraps(upstream)
    def _mamba_block_aligned_split(self, request, num_new_tokens, num_new_local_computed_tokens=0,
                                   num_external_computed_tokens=0):
        args = (num_new_tokens, num_new_local_computed_tokens, num_external_computed_tokens)
        n = upstream(self, request, *args)
        if n >= num_new_tokens or (rule := decide(self, stack)) is None:
            return n
        start = request.num_computed_tokens + num_new_local_computed_tokens + num_external_computed_tokens
        junction = getattr(request, "shared_prefix_boundary", 0)
        if junction:
            request.shared_prefix_boundary = 0  # upstream only reads it: its chunk without the stop
            try:
                free = upstream(self, request, *args)
            finally:
                request.shared_prefix_boundary = junction
            n = free if free > n and rule.decide(request, start, start + free)[0] else n
        # the budget's chunk: no block rounding, no stop at the next boundary after a mid-block
        # start; the step exports the states there (a junction inside it only where it exports)
        end = rule.budget_end(request, start, start + num_new_tokens)
        if end - start <= n or (junction and start < junction < end
                                and not rule.decide(request, start, end)[0]):
            return n
        return end - start

    return _mamba_block_aligned_split


def allocation_checkpoint(rule: JunctionRule, request: Any, start: int, end: int) -> int:
    """The position (tokens) whose state the chunk ``[start, end)`` of ``request`` leaves in a
    block of its own, for the Mamba managers to reserve in this allocation: the shared-prefix
    junction where the rule exports it (:meth:`JunctionRule.decide`), else the boundary a chunk
    started mid-block crosses (:meth:`JunctionRule.crossed`), else 0. Read by
    ``gdn-manager-allocate`` (:mod:`.gdn_mamba_manager`) for chunks inside the prompt only: no
    junction lies inside a chunk at or past the prompt's end, and a request with output tokens
    crosses nothing (docs/gdn-checkpoints.md, "Decode steps")."""
    if getattr(request, "shared_prefix_boundary", 0):
        decision, position = rule.decide(request, start, end)
        if decision == "export":
            return position
    return rule.crossed(request, start, end)


def place(manager: Any, request_id: str, position: int, before: int, out: list,
          prior: Any = None) -> None:
    """Put a new block in the column ``position // block - 1`` of ``request_id``'s blocks in
    ``manager`` (vLLM 0.30's, 0.32's or 0.33's ``MambaManager``), the column vLLM's split would have cached the
    junction's state in, after upstream's ``allocate_new_blocks`` returned ``out`` (the request's
    new columns, after a copy-on-write block for a new request's partial hit; ``before``: the
    request's block count before that call). ``out`` and the request's blocks name the same
    block. Where that column is not null or not new, nothing is kept (logged once): the chunk
    runs past the junction, so a later sharer hits less, but no block is cached unwritten.

    One column below ``before`` is taken too: one that held a real block before that call
    (``prior``) and is null after it. That is a speculative block of EAGLE/MTP
    (``num_speculative_blocks``) that vLLM 0.30's ``allocate_new_blocks`` moved to the row's end
    (``_relocate_speculative_block``) because the running state passed its column. The new block
    is not in ``out``: the worker's block table is append-only and keeps the moved block's id
    there, but the step's explicit list (:mod:`.gdn_step_checkpoints`) gives the worker this
    block's id, and no block-table column is read for it."""
    blocks, col = manager.req_to_blocks[request_id], position // manager.block_size - 1
    if (getattr(manager, "num_speculative_blocks", 0) and prior is not None and not prior.is_null
            and 0 <= col < before <= len(blocks) and blocks[col].is_null):
        blocks[col] = manager.block_pool.get_new_blocks(1)[0]
        return
    at = col - before + len(out) - (len(blocks) - before)
    if not (before <= col < len(blocks) and blocks[col].is_null and 0 <= at < len(out)):
        gdn._log_once("junction-column", "junction at %d tokens: column %d not free (%d "
                      "blocks before, %d after); its state is not kept", position, col,
                      before, len(blocks))
        return
    blocks[col] = out[at] = manager.block_pool.get_new_blocks(1)[0]


#: The registry entry of the scheduler's chunk end (the split's one wrapper).
ENTRY = "gdn-chunk-end"


def _make_chunk_end(upstream: Any, stack: Stack) -> Any:
    """Registry ``make`` of ``Scheduler._mamba_block_aligned_split`` (vLLM 0.30-0.33): one
    wrapper of two layers, the mid-block stop inside (CUDA, the NPU:
    ``gdn_prefill_checkpoint._make_mid_block_stop``) and the junction and token-budget rule
    outside (:func:`_make_split`; vLLM 0.30 / 0.32 / 0.33, where :func:`decide` gives a rule). The rule's
    second upstream call (the chunk without the junction stop) goes through the stop too."""
    inner = (gdn._make_mid_block_stop(upstream, stack) if stack.target in gdn.MID_BLOCK_TARGETS
             else upstream)
    return _make_split(inner, stack)


def _chunk_end_wanted(stack: Stack) -> str | None:
    """:func:`.gdn_prefill_checkpoint.wanted`; on CPU outside :data:`VERSIONS` neither layer
    applies (no mid-block stop on the CPU path, the junction rule is read against those)."""
    if stack.target == "cpu" and stack.vllm not in VERSIONS:
        return (f"nothing to do on CPU with vLLM {stack.vllm} (the junction rule is read against "
                f"vLLM {', '.join(VERSIONS)})")
    return gdn.wanted(stack)


def rule_applied(versions: tuple = VERSIONS) -> bool:
    """Whether this process's load applied (or will apply) the chunk end's junction rule:
    :data:`ENTRY` applied or pending, on vLLM in ``versions`` (elsewhere the entry is the
    mid-block stop alone)."""
    from vllm_hybrid_npu.patches import registry

    report = registry.REPORT
    return ((ENTRY in report.applied or ENTRY in report.pending)
            and (report.stack is None or report.stack.vllm in versions))


def budget_applied() -> bool:
    """Whether this process's load applied (or will apply) the chunk end's token-budget rule:
    :func:`rule_applied` on :data:`BUDGET_VERSIONS`."""
    return rule_applied(BUDGET_VERSIONS)


PATCHES = [
    gdn.entry(ENTRY, "vllm.v1.core.sched.scheduler",
              "Scheduler._mamba_block_aligned_split", _make_chunk_end, TARGETS,
              "where a prefill chunk ends: no end at a shared-prefix junction whose state the "
              "step exports (core.junction_checkpoint), nor below the token budget's end at a "
              "block boundary (core.budget_chunk_end; vLLM 0.30); on CUDA and the NPU a chunk "
              "started mid-block ends at its next block boundary where the path does not write "
              "the crossed boundary's state (core.mid_block_chunk)",
              wanted=_chunk_end_wanted,
              signature=("self", "request", "num_new_tokens", "num_new_local_computed_tokens",
                         "num_external_computed_tokens"),
              until="vLLM exports junction and crossed-boundary states inside the step "
                    "(RFC #52959)"),
]
