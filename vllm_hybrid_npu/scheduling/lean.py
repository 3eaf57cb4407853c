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
4. Hold (off in the engine policy; the lab's ``lean-hold`` lever measures it): while a
   ``MambaManager.remove_skipped_blocks`` call of this scheduler frees a state block that carries
   a prefix-cache hash (a kept state) and no other request references, the block stays
   referenced by its request (``BlockPool.free_blocks`` of this pool is wrapped) until
   ``KVCacheManager.free`` for that request.

Not verified: speculative decoding (EAGLE/MTP) with ``lean`` (its chunk ends do not model
EAGLE's dropped block), vLLM 0.32.

The hooks need the vLLM 0.30 internals named above; when one is missing (another vLLM
version), when the model has no Mamba/GDN group, when the mode is not align, or when the groups'
block sizes differ, the policy logs why (hybrid models only) and keeps only the chunk ends (1)
with the configured retention.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from vllm_hybrid_npu.scheduling.retention import eviction_order, extra_stops, kept_boundaries
from vllm_hybrid_npu.scheduling.split import LEAN_LADDER, LEAN_WINDOW

logger = logging.getLogger("vllm_hybrid_npu")


class LeanRetentionMixin:
    """Mixin placed before vLLM's ``Scheduler``/``AsyncScheduler`` in the MRO (use
    :func:`.scheduler.scheduler_class` with ``"lean"``).

    Class attributes (the engine policy ``lean`` uses the defaults; the hit-rate lab registers
    variants to measure each lever): ``lean_window`` (int >= 1, prompt boundaries kept),
    ``lean_ladder`` (keep the adaptive ladder's states), ``lean_retain`` (sparse retention with
    the kept boundaries; False = vLLM's dense retention), ``lean_hold`` (hold kept states until
    the request is freed), ``lean_order`` (segment-ordered eviction), ``lean_low_first`` (ladder
    states never hit leave before the request's other blocks), ``lean_decode`` (keep the
    boundaries crossed in decode), ``lean_supersede`` (on a hit, the free cached states of the
    window boundaries just below it go to the front of the free queue).
    """

    checkpoint_policy: str = "lean"
    lean_window: int = LEAN_WINDOW
    lean_ladder: bool = LEAN_LADDER
    lean_retain: bool = True
    lean_hold: bool = False
    lean_order: bool = True
    lean_low_first: bool = True
    lean_decode: bool = True
    lean_supersede: bool = False
    #: Mamba cache modes the hooks act in: ``align`` (the engine policy); the lab's
    #: ``gdn-lean`` uses ``all`` (states captured in the step, kept like ``lean``)
    lean_modes: tuple[str, ...] = ("align",)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        vllm_config = kwargs.get("vllm_config", args[0] if args else None)
        kv_cache_config = kwargs.get("kv_cache_config", args[1] if len(args) > 1 else None)
        self._lean_active = False
        reason = _unsupported(vllm_config, kv_cache_config, self.lean_modes)
        if reason is None and not self.lean_retain and kv_cache_config.prefix_cache_retention_interval == 0:
            dense = dataclasses.replace(kv_cache_config, prefix_cache_retention_interval=None)
            if "kv_cache_config" in kwargs:
                kwargs["kv_cache_config"] = dense
            else:
                args = (args[0], dense, *args[2:])
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        if reason is None:
            reason = self._lean_install()
        if reason is not None:
            if vllm_config is not None and kv_cache_config is not None and _has_mamba(kv_cache_config):
                logger.warning("checkpoint policy lean: %s; using the chunk ends only", reason)
            return
        self._lean_active = True

    # -- chunk ends --------------------------------------------------------------------------
    def _mamba_block_aligned_split(  # type: ignore[override]
        self,
        request: Any,
        num_new_tokens: int,
        num_new_local_computed_tokens: int = 0,
        num_external_computed_tokens: int = 0,
    ) -> int:
        """vLLM's split (``Scheduler._mamba_block_aligned_split``, vLLM 0.30), then the next stop
        of :func:`.retention.extra_stops`. Returns tokens to schedule (never more)."""
        num = super()._mamba_block_aligned_split(  # type: ignore[misc]
            request, num_new_tokens, num_new_local_computed_tokens, num_external_computed_tokens
        )
        if num <= 0:
            return num
        from vllm_hybrid_npu.scheduling.scheduler import chunk_span

        start, prefill_end = chunk_span(
            request, num_new_local_computed_tokens, num_external_computed_tokens
        )
        return extra_stops(
            start, num, prefill_end, self.cache_config.block_size, self.lean_window, self.lean_ladder
        )

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
        self._lean_held: dict[str, list[Any]] = {}
        self._lean_ctx: list[str] = []

        if self.lean_retain:
            base_boundaries = coord.get_replay_boundaries

            def get_replay_boundaries(request: Any) -> tuple[int, ...]:
                extra = kept_boundaries(
                    request.num_prompt_tokens,
                    max(request.num_tokens, request.num_prompt_tokens)
                    if self.lean_decode
                    else request.num_prompt_tokens,
                    block_size,
                    self.lean_window,
                    self.lean_ladder,
                )
                return tuple(sorted({*base_boundaries(request), *extra}))

            coord.get_replay_boundaries = get_replay_boundaries

        if self.lean_hold:
            base_free_blocks = pool.free_blocks
            ctx = self._lean_ctx
            held = self._lean_held

            def free_blocks(ordered_blocks: Any) -> None:
                if not ctx:
                    return base_free_blocks(ordered_blocks)
                rest = []
                for block in ordered_blocks:
                    if (
                        block.block_hash is not None
                        and block.ref_cnt == 1
                        and not block.is_null
                        and self._lean_should_hold(ctx[-1], block)
                    ):
                        held.setdefault(ctx[-1], []).append(block)
                    else:
                        rest.append(block)
                return base_free_blocks(rest)

            pool.free_blocks = free_blocks
            for gid in self._lean_mamba:
                m = managers[gid]
                base_rsb = m.remove_skipped_blocks

                def remove_skipped_blocks(request_id: str, *a: Any, _base=base_rsb, **k: Any) -> None:
                    ctx.append(request_id)
                    try:
                        _base(request_id, *a, **k)
                    finally:
                        ctx.pop()

                m.remove_skipped_blocks = remove_skipped_blocks

        self._lean_hit: dict[int, Any] = {}
        if self.lean_order:
            base_get = mgr.get_computed_blocks
            hit_ids = self._lean_hit

            def get_computed_blocks(request: Any):  # type: ignore[no-untyped-def]
                result = base_get(request)
                blocks, hit = result[0], result[1]
                if hit > 0:
                    for gid in self._lean_mamba:
                        group = blocks.blocks[gid] if hasattr(blocks, "blocks") else blocks[gid]
                        if group and not group[-1].is_null and group[-1].block_hash is not None:
                            hit_ids[group[-1].block_id] = group[-1].block_hash
                    if self.lean_supersede:
                        self._lean_supersede_below(request, hit // block_size)
                return result

            mgr.get_computed_blocks = get_computed_blocks

        if self.lean_order or self.lean_hold:
            base_free = mgr.free

            def free(request: Any) -> None:
                self._lean_free(request, base_free)

            mgr.free = free
        return None

    def _lean_supersede_below(self, request: Any, hit_blocks: int) -> None:
        """Move the free cached states of the ``lean_window - 1`` boundaries just below a hit
        at ``hit_blocks`` blocks to the front of the free queue: a later turn of the same
        conversation resumed at the hit, so the earlier turn's other window states are unlikely
        to be reused."""
        pool = self.kv_cache_manager.block_pool
        queue = pool.free_block_queue
        front = []
        for i in range(max(0, hit_blocks - self.lean_window), hit_blocks - 1):
            if i >= len(request.block_hashes):
                break
            cached = pool.get_cached_block(request.block_hashes[i], self._lean_mamba)
            if cached is None or any(b.ref_cnt != 0 or b.is_null for b in cached):
                continue
            for b in cached:
                queue.remove(b)
                front.append(b)
        if front:
            queue.prepend_n(front)

    def _lean_should_hold(self, request_id: str, block: Any) -> bool:
        """Hold a kept state of the prompt's last-boundary window or of decode, not a ladder state."""
        from vllm.v1.core.kv_cache_utils import get_block_hash

        request = self.requests.get(request_id)
        if request is None:
            return False
        key = bytes(get_block_hash(block.block_hash))
        bs = self._lean_block_size
        last = request.num_prompt_tokens // bs * bs
        first_kept = last - (self.lean_window - 1) * bs
        hashes = request.block_hashes
        for i in range(len(hashes) - 1, -1, -1):
            if (i + 1) * bs < first_kept:
                return False
            if bytes(hashes[i]) == key:
                return True
        return False

    def _lean_free(self, request: Any, base_free: Any) -> None:
        from vllm.v1.core.kv_cache_utils import get_block_hash

        rid = request.request_id
        held = self._lean_held.pop(rid, [])
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

