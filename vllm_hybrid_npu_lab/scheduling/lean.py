"""Scheduler mixin of the ``lean`` checkpoint policy: sparse state retention and segment-ordered
eviction (the rules are in :mod:`.retention`, the measurements in
docs/first-repeat-hits.md).

What it changes in vLLM 0.30.0 (``vllm/v1/core``), all on the scheduler's own objects, set up in
``__init__`` (nothing global is patched; another scheduler in the same process is unaffected):

1. Chunk ends: ``_mamba_block_aligned_split`` as vLLM computes it, then shortened to the next
   boundary of :func:`.retention.extra_stops` (never longer).
2. Retention: vLLM's ``prefix_cache_retention_interval=0`` (its default: only replay boundaries
   and shared-prefix junctions keep a Mamba state, ``MambaManager.reachable_block_mask``), with
   ``KVCacheCoordinator.get_replay_boundaries`` (instance attribute) returning vLLM's boundaries
   plus :func:`.retention.kept_boundaries`.
3. Eviction order: ``KVCacheManager.free(request)`` (instance attribute) pops the request's
   blocks from every group (``SingleTypeKVCacheManager.pop_blocks_for_free``), looks up the
   request's kept states that it released earlier and are still cached (``BlockPool.touch`` takes
   them out of the free queue), and returns everything to the pool in
   :func:`.retention.eviction_order`: orphaned attention blocks to the front of the free queue,
   then kept-state segments tail first, appended (LRU among requests, as upstream).

The chunk-end override and the retention-interval handling are inherited from
:class:`.policy_base.CheckpointPolicyMixin` (``_policy_stop`` overridden, ``dense_retention``
False). The lab's levers (hold, supersede, the power-of-two ladder, other windows, no decode states)
live in ``vllm_hybrid_npu_lab/lean_levers.py`` and use the extension points
:meth:`LeanRetentionMixin._lean_kept`, :meth:`LeanRetentionMixin._lean_stops`,
:meth:`LeanRetentionMixin._lean_on_hit`, :meth:`LeanRetentionMixin._lean_take_held`,
:meth:`LeanRetentionMixin._lean_low_value` and :meth:`LeanRetentionMixin._lean_install_extra`.

With vLLM's OffloadingConnector (``--kv-offloading-size``) the connector's store jobs read the
request's blocks after ``KVCacheManager.free``; vLLM fences a freed block whose store is still
pending (``jobs_to_flush`` when it is reallocated), so the reordered free queue never loses a
state the connector still has to copy; the policy is replayed with the connector in the lab.

With speculative decoding configured the policy does not act at all (no chunk ends, no hooks;
:func:`.policy_base.deferral_reason`): vLLM's scheduler changes align mode itself there (EAGLE/MTP
drop the last matched block; multi-module MTP reads ahead of a chunk end), which the policy does
not model and which could not be verified here. Not verified: vLLM 0.32.

The hooks need the vLLM 0.30 internals named above; when one is missing (another vLLM
version), when the model has no Mamba/GDN group, when the mode is not align, or when the groups'
block sizes differ, the policy logs why (hybrid models only) and keeps only the chunk ends (1)
with the configured retention.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from vllm_hybrid_npu_lab.scheduling.policy_base import CheckpointPolicyMixin
from vllm_hybrid_npu_lab.scheduling.retention import eviction_order, extra_stops, kept_boundaries
from vllm_hybrid_npu_lab.scheduling.split import LEAN_WINDOW

logger = logging.getLogger("vllm_hybrid_npu")


class LeanRetentionMixin(CheckpointPolicyMixin):
    """Mixin placed before vLLM's ``Scheduler``/``AsyncScheduler`` in the MRO (use
    :func:`.scheduler.scheduler_class` with ``"lean"``).

    Class attributes: ``lean_window`` (int >= 1, prompt boundaries kept), ``lean_decode`` (keep
    the boundaries crossed in decode), ``lean_order`` (segment-ordered eviction),
    ``lean_low_first`` (kept states never hit below the top leave before the request's other
    blocks), ``lean_modes`` (Mamba cache modes the hooks act in: ``align``; the lab's
    ``gdn-lean`` uses ``all``).
    """

    checkpoint_policy: str = "lean"
    dense_retention: bool = False
    lean_window: int = LEAN_WINDOW
    lean_order: bool = True
    lean_low_first: bool = True
    lean_decode: bool = True
    lean_modes: tuple[str, ...] = ("align",)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        vllm_config = kwargs.get("vllm_config", args[0] if args else None)
        kv_cache_config = kwargs.get("kv_cache_config", args[1] if len(args) > 1 else None)
        self._lean_active = False
        reason = _unsupported(vllm_config, kv_cache_config, self.lean_modes)
        super().__init__(*args, **kwargs)
        if self.policy_deferred is not None:
            return  # vLLM's own schedule and retention (CheckpointPolicyMixin logged why)
        if reason is None:
            reason = self._lean_install()
        if reason is not None:
            if vllm_config is not None and kv_cache_config is not None and _has_mamba(kv_cache_config):
                logger.warning("checkpoint policy lean: %s; using the chunk ends only", reason)
            return
        self._lean_active = True

    def _policy_modes(self) -> tuple[str, ...]:
        return self.lean_modes

    # -- extension points (the lab's levers override these) -----------------------------------
    def _lean_stops(self, start: int, num_new_tokens: int, prefill_end: int, block_size: int) -> int:
        """Chunk ends: :func:`.retention.extra_stops` with the window (no ladder)."""
        return extra_stops(start, num_new_tokens, prefill_end, block_size, self.lean_window, False)

    def _lean_kept(self, num_prompt_tokens: int, num_tokens: int, block_size: int) -> list[int]:
        """Boundaries (tokens) whose state is kept besides vLLM's: :func:`.retention.kept_boundaries`."""
        return kept_boundaries(num_prompt_tokens, num_tokens, block_size, self.lean_window, False)

    def _lean_on_hit(self, request: Any, hit_blocks: int) -> None:
        """Called after a prefix-cache hit of ``hit_blocks`` blocks (lean itself: nothing)."""

    def _lean_take_held(self, request_id: str) -> list[Any]:
        """Blocks held for ``request_id`` outside its block lists, freed with it (lean itself: none)."""
        return []

    def _lean_low_value(self, request: Any, index: int) -> bool:
        """Whether the kept state at block ``index`` (below the window, not the junction) leaves
        first: True (lean itself)."""
        return True

    def _lean_install_extra(self) -> None:
        """Called at the end of :meth:`_lean_install` (lean itself: nothing)."""

    # -- chunk ends --------------------------------------------------------------------------
    def _policy_stop(self, start: int, num_new_tokens: int, prefill_end: int, block_size: int) -> int:
        return self._lean_stops(start, num_new_tokens, prefill_end, block_size)

    # -- hooks ---------------------------------------------------------------------------------
    def _lean_install(self) -> str | None:
        from vllm.v1.kv_cache_interface import MambaSpec

        mgr = self.kv_cache_manager
        coord = getattr(mgr, "coordinator", None)
        pool = getattr(mgr, "block_pool", None)
        managers = getattr(coord, "single_type_managers", None)
        if coord is None or pool is None or managers is None:
            return "this vLLM's KVCacheManager has no coordinator/block_pool"
        for name in ("get_replay_boundaries",):
            if not hasattr(coord, name):
                return f"this vLLM's coordinator has no {name}"
        if not hasattr(pool, "free_block_queue") or not hasattr(pool.free_block_queue, "prepend_n"):
            return "this vLLM's block pool has no free_block_queue.prepend_n"
        groups = mgr.kv_cache_config.kv_cache_groups
        self._lean_mamba = [i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, MambaSpec)]
        self._lean_attn = [i for i in range(len(groups)) if i not in self._lean_mamba]
        sizes = {g.kv_cache_spec.block_size for g in groups}
        if len(sizes) != 1 or pool.hash_block_size not in sizes:
            return f"group block sizes {sorted(sizes)} / hash block size {pool.hash_block_size} differ"
        for gid in self._lean_mamba:
            if not all(hasattr(managers[gid], a) for a in ("remove_skipped_blocks", "pop_blocks_for_free")):
                return "this vLLM's MambaManager lacks remove_skipped_blocks/pop_blocks_for_free"
        from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager

        base_free_impl = getattr(SingleTypeKVCacheManager, "free", None)
        for m in managers:
            # the ordered free replaces exactly "free_blocks(reversed(pop_blocks_for_free))"
            if type(m).free is not base_free_impl:
                return f"{type(m).__name__}.free is not vLLM's plain free"
        block_size = sizes.pop()
        self._lean_block_size = block_size

        base_boundaries = coord.get_replay_boundaries

        def get_replay_boundaries(request: Any) -> tuple[int, ...]:
            extra = self._lean_kept(
                request.num_prompt_tokens,
                max(request.num_tokens, request.num_prompt_tokens)
                if self.lean_decode
                else request.num_prompt_tokens,
                block_size,
            )
            return tuple(sorted({*base_boundaries(request), *extra}))

        coord.get_replay_boundaries = get_replay_boundaries

        self._lean_hit: dict[int, Any] = {}
        base_get = mgr.get_computed_blocks
        hit_ids = self._lean_hit

        def get_computed_blocks(request: Any):  # type: ignore[no-untyped-def]
            result = base_get(request)
            blocks, hit = result[0], result[1]
            if hit > 0:
                if self.lean_order:
                    for gid in self._lean_mamba:
                        group = blocks.blocks[gid] if hasattr(blocks, "blocks") else blocks[gid]
                        if group and not group[-1].is_null and group[-1].block_hash is not None:
                            hit_ids[group[-1].block_id] = group[-1].block_hash
                self._lean_on_hit(request, hit // block_size)
            return result

        mgr.get_computed_blocks = get_computed_blocks

        base_free = mgr.free

        def free(request: Any) -> None:
            self._lean_free(request, base_free)

        mgr.free = free
        self._lean_offloading_hook()
        self._lean_install_extra()
        return None

    def _lean_offloading_hook(self) -> None:
        """Make vLLM's OffloadingConnector copy the states lean keeps to the host tier.

        vLLM 0.30's ``OffloadingConnectorScheduler._reachable_store_block_mask`` selects the
        Mamba blocks a store job copies from its own rule (retention interval 0: the replay
        boundary ``num_prompt_tokens - 1`` and the junction, passed as ``reachable_boundaries``),
        which knows nothing of lean's window and decode states: without this, a state lean keeps
        on the device would never reach the host. The wrapper adds :meth:`_lean_kept`'s
        boundaries (the prompt length read back from the replay boundary, the decode boundary
        from the store's end) to ``reachable_boundaries``; the block selection itself stays
        vLLM's ``MambaManager.reachable_block_mask``. No-op without the connector.
        """
        from vllm_hybrid_npu_lab.scheduling.policy_base import offloading_scheduler

        cs = offloading_scheduler(self)
        if cs is None:
            return
        from vllm.v1.kv_cache_interface import MambaSpec

        base_mask = cs._reachable_store_block_mask
        bs = self._lean_block_size

        def reachable_store_block_mask(group_config: Any, start_chunk_idx: int, end_chunk_idx: int,
                                       final_segment_end_chunk_idx: Any,
                                       reachable_boundaries: tuple[int, ...]) -> Any:
            extra: tuple[int, ...] = ()
            if reachable_boundaries and isinstance(group_config.kv_cache_spec, MambaSpec):
                prompt = reachable_boundaries[0] + 1
                end = end_chunk_idx * group_config.tokens_per_chunk
                extra = tuple(self._lean_kept(prompt, max(prompt, end) if self.lean_decode else prompt, bs))
            return base_mask(
                group_config=group_config,
                start_chunk_idx=start_chunk_idx,
                end_chunk_idx=end_chunk_idx,
                final_segment_end_chunk_idx=final_segment_end_chunk_idx,
                reachable_boundaries=tuple(reachable_boundaries) + extra,
            )

        cs._reachable_store_block_mask = reachable_store_block_mask

    def _lean_free(self, request: Any, base_free: Any) -> None:
        from vllm.v1.core.kv_cache_utils import get_block_hash

        rid = request.request_id
        held = self._lean_take_held(rid)
        if not self.lean_order:
            base_free(request)
            if held:
                self.kv_cache_manager.block_pool.free_blocks(held)
            return
        mgr = self.kv_cache_manager
        pool = mgr.block_pool
        managers = mgr.coordinator.single_type_managers
        lists = [m.pop_blocks_for_free(rid) for m in managers]
        index = {bytes(h): i for i, h in enumerate(request.block_hashes)}
        # per mamba group: block index -> block holding a kept state (hash set)
        states: dict[int, dict[int, Any]] = {g: {} for g in self._lean_mamba}
        loose: list[Any] = []  # hashed mamba blocks that are no complete state
        for g in self._lean_mamba:
            for i, b in enumerate(lists[g]):
                if not b.is_null and b.block_hash is not None:
                    states[g][i] = b
        for b in held:
            key = b.block_hash
            i = index.get(bytes(get_block_hash(key))) if key is not None else None
            g = _group_of(key)
            if i is None or g not in states or i in states[g]:
                loose.append(b)
            else:
                states[g][i] = b
        num_attn = max((len(lists[g]) for g in self._lean_attn), default=0)
        # kept states along this request's chain that left its lists earlier (freed mid-run)
        # and still sit in the prefix cache: re-queue them with their segment
        touched: list[Any] = []
        for i in range(min(num_attn, len(request.block_hashes))):
            if all(i in states[g] for g in self._lean_mamba):
                continue
            cached = pool.get_cached_block(request.block_hashes[i], self._lean_mamba)
            if cached is None:
                continue
            for g, b in zip(self._lean_mamba, cached):
                if i in states[g]:
                    continue
                if b.ref_cnt == 0:
                    touched.append(b)
                else:
                    b.ref_cnt += 1  # referenced elsewhere: stays out of the queue
                states[g][i] = b
        if touched:
            pool.touch(touched)
        full = set.intersection(*(set(s) for s in states.values())) if states else set()
        bs = self._lean_block_size
        window_start = (request.num_prompt_tokens // bs - self.lean_window + 1) * bs
        junction = getattr(request, "shared_prefix_boundary", 0) or 0
        last_prompt = request.num_prompt_tokens // bs * bs
        last_decode = request.num_tokens // bs * bs
        low = [
            i
            for i in full
            if ((i + 1) * bs < window_start or last_prompt < (i + 1) * bs < last_decode)
            and (i + 1) * bs != junction
            and self._lean_low_value(request, i)
            and not any(self._lean_hit.get(states[g][i].block_id) == states[g][i].block_hash
                        for g in self._lean_mamba)
        ]
        for i in full:
            for g in self._lean_mamba:
                self._lean_hit.pop(states[g][i].block_id, None)
        orphans, segments = eviction_order(num_attn, full, low if self.lean_low_first else ())
        used: set[int] = set()
        front: list[Any] = []
        for i in orphans:
            for g in self._lean_attn:
                if i < len(lists[g]):
                    front.append(lists[g][i])
                    used.add(id(lists[g][i]))
        ordered: list[Any] = []
        for kind, i in segments:
            if kind == "state":
                for g in self._lean_mamba:
                    ordered.append(states[g][i])
                    used.add(id(states[g][i]))
            else:
                for g in self._lean_attn:
                    if i < len(lists[g]):
                        ordered.append(lists[g][i])
                        used.add(id(lists[g][i]))
        # partial states (not in every GDN group) go with the orphans
        for g in self._lean_mamba:
            for i, b in states[g].items():
                if i not in full:
                    front.append(b)
                    used.add(id(b))
        front.extend(loose)
        used.update(id(b) for b in loose)
        # everything else (running state blocks, nulls, other groups' blocks) as upstream:
        # reversed allocation order, uncached blocks go to the front of the queue
        others = [b for lst in lists for b in reversed(lst) if id(b) not in used]
        # orphans: evicted before anything already in the queue
        queue = pool.free_block_queue
        to_front = []
        for b in front:
            b.ref_cnt -= 1
            if b.ref_cnt == 0 and not b.is_null:
                to_front.append(b)
        queue.prepend_n(to_front)
        pool.free_blocks(ordered + others)


def _group_of(key: Any) -> int | None:
    if key is None:
        return None
    from vllm.v1.core.kv_cache_utils import get_group_id

    return get_group_id(key)


def _has_mamba(kv_cache_config: Any) -> bool:
    from vllm.v1.kv_cache_interface import MambaSpec

    return any(isinstance(g.kv_cache_spec, MambaSpec) for g in kv_cache_config.kv_cache_groups)


def _unsupported(vllm_config: Any, kv_cache_config: Any, modes: tuple[str, ...] = ("align",)) -> str | None:
    if vllm_config is None or kv_cache_config is None:
        return "no vllm_config/kv_cache_config"
    if not _has_mamba(kv_cache_config):
        return "no Mamba/GDN group"
    if getattr(vllm_config.cache_config, "mamba_cache_mode", None) not in modes:
        return f"mamba_cache_mode is not one of {modes}"
    if not vllm_config.cache_config.enable_prefix_caching:
        return "prefix caching is off"
    return None

