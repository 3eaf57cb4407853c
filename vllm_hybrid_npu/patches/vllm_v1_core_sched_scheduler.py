"""Scheduler-side counters: align-mode state moves and prefix-cache miss reasons, in memory.

Patches (vLLM 0.23.0, 0.30.0, 0.32.0, 0.33.0, 0.34.0; every target, since they only read the
schedule):

* ``vllm.v1.core.sched.scheduler:Scheduler.schedule`` (``step-counters``): after upstream's
  ``schedule()`` returns its ``SchedulerOutput``, counts in plain ints (a) the align-mode state
  moves of the step and their bytes and (b) the missed prompt tokens, by reason, of each request
  scheduled for the first time. O(scheduled requests) Python per step, no tensor, no host sync.
* ``vllm.v1.core.sched.scheduler:Scheduler.make_stats`` (``step-counters-stats``): attaches the
  counts since the previous call to upstream's ``SchedulerStats`` as
  ``SchedulerStats.vllm_hybrid_npu`` (declared by :func:`vllm_hybrid_npu.metrics.
  declare_stats_field`), which vLLM ships to the API server; :mod:`vllm_hybrid_npu.metrics`
  serves them on ``/metrics``.
* ``vllm.v1.core.kv_cache_manager:KVCacheManager.free`` and, on vLLM 0.30.0 - 0.34.0,
  ``KVCacheManager.pop_blocks_for_free`` (``step-counters-free``, ``step-counters-pop``): a
  request releasing its blocks had its full blocks cached; their hashes go to the
  :class:`~vllm_hybrid_npu.core.miss_reasons.SeenBlocks` memory, which later tells ``evicted``
  from ``new`` misses.

Wrapping these methods rather than subclassing the scheduler composes with any ``Scheduler``
subclass that calls them (vLLM's ``AsyncScheduler``, vllm-ascend's schedulers that keep
upstream's ``schedule``, the hit-rate lab's checkpoint-policy schedulers); a subclass replacing
``schedule`` without calling it gets no counts (nothing else changes).

**State moves** (``vllm_hybrid_npu:state_copies_total``). In align mode
(``--enable-prefix-caching --mamba-cache-mode align``) the worker keeps a request's running
GDN/Mamba state in the block-table column of the block holding the request's last scheduled
token: ``curr = ceil((num_computed_tokens + num_scheduled_tokens) / block_size) - 1``. Before a
step, ``preprocess_mamba`` (vllm/v1/worker/mamba_utils.py, vLLM 0.23.0/0.30.0/0.32.0; vllm-ascend
0.30.0rc2 ``patch_mamba_utils.preprocess_mamba``; on vLLM 0.34.0, whose runners are all the V2
runner, ``preprocess_mamba_align_fused_kernel`` in ``vllm/v1/worker/gpu/model_states/mamba_hybrid.py``
with the same rule: the column seeded at ``(num_computed_tokens - 1) // block_size`` for a new or
resumed request, a copy when it was ``>= 0`` and differs) copies the state from the previous step's
column ``prev`` to ``curr`` when ``prev != -1 and prev != curr``, where ``prev`` is the column it
remembered for the request, or ``(num_computed_tokens - 1) // block_size`` for a request it has
no column for (new, resumed after preemption, or forgotten because finished/preempted: a new
request with a prefix-cache hit moves the cached state at the hit boundary). This hook runs the
same rule on the ``SchedulerOutput`` the worker receives (``scheduled_new_reqs`` /
``scheduled_cached_reqs`` ``num_computed_tokens``, ``num_scheduled_tokens``; columns forgotten
for ``finished_req_ids``, ``preempted_req_ids`` and ``resumed_req_ids``), so one count here is
one request whose state the worker moves. The worker's ``preprocess_mamba`` performs each move
as one byte-range copy per GDN/Mamba layer per state tensor (conv state, SSM state) on each
tensor-parallel rank; ``vllm_hybrid_npu:state_copy_bytes_total`` adds, per move,
``tensor_parallel_size x sum over GDN/Mamba layers of the state bytes of one block`` (from the
``MambaSpec`` of each KV-cache group: ``prod(shape) x dtype.itemsize`` over its state shapes,
unpadded, times its layer count). With speculative decoding the conv copy skips the rejected
tokens' columns, so the bytes are an upper bound there. Not counted: pipeline-parallel stages
beyond the scheduler's ``KVCacheConfig``; copies done by a KV connector.

**Miss reasons** (``vllm_hybrid_npu:prefix_cache_miss_tokens_total{reason}``): for each request
in ``scheduled_new_reqs`` that was never preempted: tokens ``request.num_tokens``, hit
``NewRequestData.num_computed_tokens`` (local + connector), attention-only cached prefix
``request.shared_prefix_boundary`` (vLLM 0.30.0/0.32.0; absent on 0.23.0, where ``no_state``
misses count as ``evicted``/``new``), classified by
:class:`vllm_hybrid_npu.core.miss_reasons.MissTracker`. ``evicted_host`` replaces ``evicted``
when the configured KV connector is a host-tier offloading one (its name contains ``Offload``
or ``LMCache``).

Until: vLLM exports align-mode state moves and miss reasons itself (vllm #53749, #48401,
#40696 report silent sub-block misses).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from vllm_hybrid_npu.core.miss_reasons import REASONS, MissTracker, drafter_drop_tokens
from vllm_hybrid_npu.patches.registry import Patch
from vllm_hybrid_npu.support import Stack

logger = logging.getLogger("vllm_hybrid_npu")

#: Attribute holding a scheduler's :class:`StepCounters` (on the scheduler instance).
ATTR = "_vllm_hybrid_npu_counters"
#: Attribute holding the :class:`MissTracker` on the scheduler's ``KVCacheManager``.
TRACKER_ATTR = "_vllm_hybrid_npu_miss_tracker"

_SCHED = "vllm.v1.core.sched.scheduler"
_KVM = "vllm.v1.core.kv_cache_manager"


def state_bytes_per_move(kv_cache_config: Any, tensor_parallel_size: int = 1) -> tuple[int, int | None]:
    """Bytes one align-mode state move copies, and the GDN/Mamba block size.

    Args:
        kv_cache_config: vLLM's ``KVCacheConfig`` (``kv_cache_groups[i].kv_cache_spec`` /
            ``.layer_names``).
        tensor_parallel_size: ranks whose shards each copy their part (int >= 1).

    Returns:
        ``(bytes, block_size)``: ``tensor_parallel_size x sum over MambaSpec groups of
        len(layer_names) x sum(prod(shape) x dtype.itemsize)`` (int bytes), and the first
        MambaSpec's ``block_size`` in tokens (None, with 0 bytes, when no group is a MambaSpec).
    """
    from vllm.v1.kv_cache_interface import MambaSpec

    total = 0
    block_size = None
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        if not isinstance(spec, MambaSpec):
            continue
        per_layer = 0
        for shape, dtype in zip(spec.shapes, spec.dtypes):
            n = 1
            for d in shape:
                n *= int(d)
            per_layer += n * int(dtype.itemsize)
        total += per_layer * len(group.layer_names)
        if block_size is None:
            block_size = int(spec.block_size)
    return total * max(int(tensor_parallel_size), 1), block_size


class StepCounters:
    """One scheduler's in-memory counts (see the module docstring for what is counted).

    Attributes:
        align: whether state moves are counted (align mode with GDN/Mamba layers).
        block_size: GDN/Mamba block size (tokens) or None.
        bytes_per_move: bytes one move copies (int).
        moves, move_bytes: totals since creation (ints).
        tracker: the :class:`MissTracker` (None when prefix caching is off).
    """

    def __init__(self, scheduler: Any) -> None:
        cache_config = scheduler.cache_config
        tp = getattr(getattr(scheduler.vllm_config, "parallel_config", None), "tensor_parallel_size", 1)
        self.bytes_per_move, self.block_size = state_bytes_per_move(scheduler.kv_cache_config, tp)
        self.align = (
            self.block_size is not None
            and bool(cache_config.enable_prefix_caching)
            and getattr(cache_config, "mamba_cache_mode", None) == "align"
        )
        self._col: dict[str, int] = {}
        self.moves = self.move_bytes = 0
        self._p_moves = self._p_bytes = 0
        self.prefill_steps = self._p_prefill_steps = 0
        self.tracker: MissTracker | None = None
        kvm = scheduler.kv_cache_manager
        if cache_config.enable_prefix_caching:
            # the scheduler's block size (LCM of the KV-cache groups' block sizes), where vLLM
            # registers full-block entries; cache_config.block_size is not always it in the
            # engine-core process (vLLM 0.30.0 CPU serve: 128 there, 384-token
            # cache blocks; the INFO line below shows both)
            bs = int(getattr(scheduler, "block_size", None) or cache_config.block_size)
            hbs = int(getattr(scheduler, "hash_block_size", None) or bs)
            kvc = scheduler.kv_cache_config
            cap = max(4 * int(getattr(kvc, "num_blocks", 0)) * max(bs // hbs, 1), 1 << 16)
            tbs = bs if bs % hbs == 0 else hbs
            self.tracker = MissTracker(
                hbs, host_tier=_host_tier(scheduler), capacity=cap, block_size=tbs,
                drop_tokens=drafter_drop_unit(scheduler, tbs, hbs),
            )
            setattr(kvm, TRACKER_ATTR, self.tracker)
        self._broken = False
        logger.info(
            "vllm-hybrid-npu: step counters on: align=%s, GDN/Mamba block %s tokens, %d bytes "
            "per state move; miss reasons %s (cache block %s, hash block %s tokens; "
            "cache_config.block_size %s; the drafter's block drop %s tokens)",
            self.align, self.block_size, self.bytes_per_move,
            "on" if self.tracker else "off (prefix caching off)",
            self.tracker.block_size if self.tracker else "-",
            self.tracker.hash_block_size if self.tracker else "-",
            cache_config.block_size, self.tracker.drop_tokens if self.tracker else "-",
        )

    def on_schedule(self, scheduler: Any, out: Any) -> None:
        """Count one ``SchedulerOutput``; never raises (a failure is logged once, counting stops)."""
        if self._broken:
            return
        try:
            self._count(scheduler, out)
        except Exception as exc:
            self._broken = True
            logger.warning("vllm-hybrid-npu: step counters disabled: %s: %s", type(exc).__name__, exc)

    def _count(self, scheduler: Any, out: Any) -> None:
        num_sched = out.num_scheduled_tokens
        cached = out.scheduled_cached_reqs
        requests = scheduler.requests
        computed = [(n.req_id, n.num_computed_tokens) for n in out.scheduled_new_reqs]
        computed += [(rid, nc) for rid, nc in zip(cached.req_ids, cached.num_computed_tokens)
                     if rid in num_sched]
        if any(rid in requests and nc < requests[rid].num_prompt_tokens for rid, nc in computed):
            self.prefill_steps += 1
            self._p_prefill_steps += 1
        if self.align:
            col = self._col
            bs = self.block_size
            for rid in out.finished_req_ids:
                col.pop(rid, None)
            for rid in getattr(out, "preempted_req_ids", None) or ():
                col.pop(rid, None)
            for rid in getattr(cached, "resumed_req_ids", None) or ():
                col.pop(rid, None)
            moves = 0
            for new in out.scheduled_new_reqs:
                rid = new.req_id
                nc = new.num_computed_tokens
                prev = col.get(rid, (nc - 1) // bs)
                curr = -(-(nc + num_sched[rid]) // bs) - 1  # ceil((nc + k) / bs) - 1
                col[rid] = curr
                moves += prev != -1 and prev != curr
            for rid, nc in zip(cached.req_ids, cached.num_computed_tokens):
                k = num_sched.get(rid)
                if k is None:
                    continue
                prev = col.get(rid, (nc - 1) // bs)
                curr = -(-(nc + k) // bs) - 1
                col[rid] = curr
                moves += prev != -1 and prev != curr
            if moves:
                b = moves * self.bytes_per_move
                self.moves += moves
                self.move_bytes += b
                self._p_moves += moves
                self._p_bytes += b
        tracker = self.tracker
        if tracker is not None and out.scheduled_new_reqs:
            for new in out.scheduled_new_reqs:
                req = requests.get(new.req_id)
                if req is None or req.num_preemptions > 0:
                    continue
                tracker.on_admit(
                    req.block_hashes,
                    req.num_tokens,
                    new.num_computed_tokens,
                    getattr(req, "shared_prefix_boundary", 0) or 0,
                )

    def drain(self) -> dict[str, int] | None:
        """Counts since the previous drain as the ``SchedulerStats.vllm_hybrid_npu`` dict (None
        when all are 0)."""
        from vllm_hybrid_npu import metrics

        out: dict[str, int] = {}
        if self._p_prefill_steps:
            out[metrics.KEY_PREFILL_STEPS] = self._p_prefill_steps
            self._p_prefill_steps = 0
        if self._p_moves:
            out[metrics.KEY_STATE_COPIES] = self._p_moves
            out[metrics.KEY_STATE_COPY_BYTES] = self._p_bytes
            self._p_moves = self._p_bytes = 0
        if self.tracker is not None:
            d = self.tracker.drain()
            if d["requests"]:
                out[metrics.KEY_REQUESTS] = d["requests"]
                for r in REASONS:
                    if d[r]:
                        out[metrics.MISS_PREFIX + r] = d[r]
        return out or None


def drafter_drop_unit(scheduler: Any, block_size: int, hash_block_size: int) -> int:
    """:func:`~vllm_hybrid_npu.core.miss_reasons.drafter_drop_tokens` (tokens) read off vLLM's
    ``scheduler``: its ``use_eagle_block_drop`` (0 where absent: vLLM 0.23, and 0.33 under
    lookahead block hashes) and its coordinator's ``enable_partial_hash_hits``; ``block_size`` /
    ``hash_block_size`` the miss classifier's (tokens). Raises ValueError as that function does."""
    coordinator = getattr(getattr(scheduler, "kv_cache_manager", None), "coordinator", None)
    return drafter_drop_tokens(bool(getattr(scheduler, "use_eagle_block_drop", False)), block_size,
                               hash_block_size,
                               bool(getattr(coordinator, "enable_partial_hash_hits", False)))


def _host_tier(scheduler: Any) -> bool:
    ktc = getattr(scheduler.vllm_config, "kv_transfer_config", None)
    name = str(getattr(ktc, "kv_connector", "") or "") if ktc is not None else ""
    return "offload" in name.lower() or "lmcache" in name.lower()


def counters(scheduler: Any) -> StepCounters:
    """The scheduler's :class:`StepCounters`, created on first use."""
    c = scheduler.__dict__.get(ATTR)
    if c is None:
        c = StepCounters(scheduler)
        scheduler.__dict__[ATTR] = c
    return c


def totals(scheduler: Any) -> dict[str, int]:
    """Totals since the scheduler was built: ``state_copies``, ``state_copy_bytes``, each miss
    reason (tokens), ``requests``, ``prompt_tokens``, ``hit_tokens`` (ints; for tests, the lab
    and the offline ``LLM`` engine)."""
    c = counters(scheduler)
    out = {"state_copies": c.moves, "state_copy_bytes": c.move_bytes,
           "prefill_steps": c.prefill_steps}
    if c.tracker is not None:
        out.update(c.tracker.totals)
    else:
        out.update(dict.fromkeys((*REASONS, "requests", "prompt_tokens", "hit_tokens"), 0))
    return out


def miss_totals(scheduler: Any) -> dict[str, int]:
    """``{reason: tokens}`` since the scheduler was built (every reason of ``REASONS``)."""
    t = totals(scheduler)
    return {r: t[r] for r in REASONS}


# ------------------------------------------------------------------------------ replacements
def _make_schedule(upstream: Any, stack: Stack) -> Any:
    from vllm_hybrid_npu import metrics

    metrics.declare_stats_field()

    @functools.wraps(upstream)
    def schedule(self, *args, **kwargs):
        out = upstream(self, *args, **kwargs)
        counters(self).on_schedule(self, out)
        return out

    return schedule


def _make_make_stats(upstream: Any, stack: Stack) -> Any:
    from vllm_hybrid_npu import metrics

    metrics.declare_stats_field()

    @functools.wraps(upstream)
    def make_stats(self, *args, **kwargs):
        stats = upstream(self, *args, **kwargs)
        if stats is not None:
            c = self.__dict__.get(ATTR)
            if c is not None:
                setattr(stats, metrics.STATS_FIELD, c.drain())
        return stats

    return make_stats


def _remember_cached(kvm: Any, request: Any) -> None:
    tracker = kvm.__dict__.get(TRACKER_ATTR)
    if tracker is not None:
        tracker.on_cached(
            request.block_hashes, request.num_computed_tokens, None, request.num_prompt_tokens
        )


def _make_free(upstream: Any, stack: Stack) -> Any:
    @functools.wraps(upstream)
    def free(self, request, *args, **kwargs):
        _remember_cached(self, request)
        return upstream(self, request, *args, **kwargs)

    return free


def _make_pop(upstream: Any, stack: Stack) -> Any:
    @functools.wraps(upstream)
    def pop_blocks_for_free(self, request, *args, **kwargs):
        _remember_cached(self, request)
        return upstream(self, request, *args, **kwargs)

    return pop_blocks_for_free


_ALL = ("npu", "cuda", "cpu")
_WHY = (
    "counts align-mode state moves (+ bytes) and prefix-cache misses by reason from the "
    "schedule, in memory (no worker hook, file or host sync); sub-block misses are invisible "
    "upstream (vllm #53749, #48401, #40696)"
)
_WHY_STATS = "carries those counts to the API server's /metrics in SchedulerStats.vllm_hybrid_npu"
_WHY_FREE = "remembers the blocks a request released as cached (miss reason evicted vs new)"
_UNTIL = "vLLM exports align-mode state moves and prefix-cache miss reasons itself"

PATCHES = [
    Patch(
        name="step-counters",
        module=_SCHED,
        qualname="Scheduler.schedule",
        targets=_ALL,
        vllm=("0.23.0", "0.30.0", "0.32.0", "0.33.0", "0.34.0"),
        signature=("self",),
        make=_make_schedule,
        why=_WHY,
        until=_UNTIL,
    ),
    Patch(
        name="step-counters-stats",
        module=_SCHED,
        qualname="Scheduler.make_stats",
        targets=_ALL,
        vllm=("0.23.0", "0.30.0", "0.32.0", "0.33.0", "0.34.0"),
        signature=("self",),
        make=_make_make_stats,
        why=_WHY_STATS,
        until=_UNTIL,
    ),
    Patch(
        name="step-counters-free",
        module=_KVM,
        qualname="KVCacheManager.free",
        targets=_ALL,
        vllm=("0.23.0", "0.30.0", "0.32.0", "0.33.0", "0.34.0"),
        signature=("self", "request"),
        make=_make_free,
        why=_WHY_FREE,
        until=_UNTIL,
    ),
    Patch(
        name="step-counters-pop",
        module=_KVM,
        qualname="KVCacheManager.pop_blocks_for_free",
        targets=_ALL,
        vllm=("0.30.0", "0.32.0", "0.33.0", "0.34.0"),
        signature=("self", "request"),
        make=_make_pop,
        why=_WHY_FREE,
        until=_UNTIL,
    ),
]


def apply(stack: Stack | None = None) -> None:
    """Apply this module's entries through the registry (idempotent: entries already applied
    in this process are left as they are; for the lab and tests)."""
    from vllm_hybrid_npu.patches.registry import apply_all
    from vllm_hybrid_npu.support import detect_stack

    apply_all(PATCHES, stack or detect_stack())


def applied() -> bool:
    """Whether ``Scheduler.schedule`` is this module's wrapper in this process."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from vllm_hybrid_npu.patches.registry import is_ours

    return is_ours(vars(Scheduler).get("schedule"))


def unapply() -> None:
    """Restore upstream's objects for this module's entries only (idempotent; other registry
    entries stay applied; for the lab and tests)."""
    from vllm_hybrid_npu.patches import registry

    names = {p.name for p in PATCHES}
    with registry._lock:
        keep = []
        for owner, attr, previous, name in registry._replaced:
            if name not in names:
                keep.append((owner, attr, previous, name))
                continue
            if previous is registry._ABSENT:
                try:
                    delattr(owner, attr)
                except AttributeError:
                    pass
            else:
                setattr(owner, attr, previous)
        registry._replaced[:] = keep
        report = registry.REPORT
        report.applied[:] = [n for n in report.applied if n not in names]
        for n in names:
            report.pending.pop(n, None)
            report.skipped.pop(n, None)
