"""Lab-only levers of the ``lean`` policy (issue 13: they do not belong in the runtime).

:class:`LeanLeversMixin` is placed before the lab's ``LeanCheckpointScheduler``
(:class:`vllm_hybrid_npu_lab.scheduling.lean.LeanRetentionMixin`) and switches on, through that
mixin's extension points, what the lab measures one lever at a time:

* ``lean_ladder``: also stop and keep states at the adaptive ladder (1, 2, 4, ... blocks below the
  prompt's last boundary, :func:`vllm_hybrid_npu_lab.scheduling.retention.ladder_boundaries`); those
  states leave first when the request is freed (low value) unless hit;
* ``lean_hold``: while a ``MambaManager.remove_skipped_blocks`` call (vLLM 0.30,
  ``vllm/v1/core/single_type_kv_cache_manager.py``) frees a kept state of the prompt's window
  (a hashed block no other request references), the block stays referenced by its request
  (``BlockPool.free_blocks`` of this pool is wrapped) until ``KVCacheManager.free``;
* ``lean_supersede``: on a hit, the free cached states of the window boundaries just below it go
  to the front of the free queue.

The window (``lean_window``) and decode states (``lean_decode``) are class attributes of the
lean mixin; the lab's ``lean-w1``/``lean-w3``/``lean-nodecode`` variants set them.
"""

from __future__ import annotations

from typing import Any

from vllm_hybrid_npu_lab.scheduling.retention import extra_stops, kept_boundaries


class LeanLeversMixin:
    """The lab's lean levers (see module docstring); defaults = the lean policy."""

    lean_ladder: bool = False
    lean_hold: bool = False
    lean_supersede: bool = False

    def _lean_stops(self, start: int, num_new_tokens: int, prefill_end: int, block_size: int) -> int:
        return extra_stops(start, num_new_tokens, prefill_end, block_size, self.lean_window, self.lean_ladder)

    def _lean_kept(self, num_prompt_tokens: int, num_tokens: int, block_size: int) -> list[int]:
        return kept_boundaries(num_prompt_tokens, num_tokens, block_size, self.lean_window, self.lean_ladder)

    def _lean_on_hit(self, request: Any, hit_blocks: int) -> None:
        if self.lean_supersede:
            self._lean_supersede_below(request, hit_blocks)

    def _lean_take_held(self, request_id: str) -> list[Any]:
        return getattr(self, "_lean_held", {}).pop(request_id, [])

    def _lean_install_extra(self) -> None:
        self._lean_held: dict[str, list[Any]] = {}
        if not self.lean_hold:
            return
        mgr = self.kv_cache_manager
        pool = mgr.block_pool
        managers = mgr.coordinator.single_type_managers
        ctx: list[str] = []
        held = self._lean_held
        base_free_blocks = pool.free_blocks

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

    def _lean_supersede_below(self, request: Any, hit_blocks: int) -> None:
        """Move the free cached states of the ``lean_window - 1`` boundaries just below a hit at
        ``hit_blocks`` blocks to the front of the free queue."""
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


def lever_scheduler(name: str, overrides: dict[str, Any], base: type | None = None) -> type:
    """``LeanLeversMixin`` over the lab's lean scheduler (``base``: default the
    ``Scheduler``-based ``LeanCheckpointScheduler``), with ``overrides`` as class attributes."""
    from vllm_hybrid_npu_lab.scheduling.scheduler import scheduler_class

    lean = scheduler_class("lean") if base is None else base
    cls_name = "Lab" + name.replace("-", " ").title().replace(" ", "") + "Scheduler"
    return type(cls_name, (LeanLeversMixin, lean), dict(overrides))
