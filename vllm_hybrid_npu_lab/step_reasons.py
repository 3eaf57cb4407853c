"""Why a prompt took more prefill steps than its uncached tokens need (issue 38 item 1).

The replay counts, per request, the engine steps that computed part of its prompt; the fewest it
could take is ``ceil(uncached prompt tokens / B)`` with ``B`` the token budget of a step
(``--max-num-batched-tokens``). Every step beyond that gets exactly one reason here, read from
the decision of vLLM's own scheduler (vLLM 0.30 to 0.33, ``vllm/v1/core/sched/scheduler.py``), never
recomputed:

* :class:`SplitRecorder` wraps ``Scheduler._mamba_block_aligned_split`` on one scheduler
  instance (the one method that cuts prefill chunks in align mode; ``schedule()`` calls it for
  running and waiting requests once the token budget and ``--long-prefill-token-threshold`` have
  set the chunk) and keeps, per request and step, the tokens it was asked for, vLLM's answer and
  the request's fields the answer depends on (vLLM 0.30, 0.32 and 0.33: where they differ,
  :func:`tail_stops` and :meth:`SplitRecorder.begin_step` say how).
* :func:`chunk_reason` names why a chunk that stops short of the prompt's end stops where it
  does (below).
* :class:`PrefillLedger` walks each request's chunks and decides which of them are the extra
  ones: with ``F`` the furthest prompt position computed so far (the cache hit before the first
  chunk) and ``m(r) = ceil(r / B)``, a chunk ``[start, end)`` is on schedule when
  ``m(prompt - F)`` drops (by one: a chunk is at most ``B`` tokens), extra when it does not. The
  extra chunks of a request number exactly ``chunks - ceil(uncached / B)``, so the reasons sum to
  the replay's total. (After a preemption the resumed request may find more of its prompt cached
  than it had computed; the walk then starts again from there, so the fewest steps are counted
  from that hit too.)

Reasons (:data:`REASONS`), in the order they are tested (one position can be several of vLLM's
stops at once: the first named here wins):

* ``preemption``: the chunk recomputed prompt tokens the request had already computed before a
  preemption (vLLM frees a preempted request's blocks; it starts again from its cache hit).
* ``policy_stop``: a lab-only policy (the retired ``lean``, ``tail``, ``adaptive``) shortened
  vLLM's chunk (:mod:`.scheduling.scheduler`); vLLM's own split would have gone further.
* ``junction``: vLLM stopped at the request's shared-prefix junction
  (``request.shared_prefix_boundary``, block-floored unless fine-grained junction stops are on),
  to cache the state there for sibling requests.
* ``prompt_tail``: vLLM stopped at the prompt's last block boundary (``last_cache_position``) or,
  with ``--prefix-match-unit`` below the block, its last hash boundary (``tail_boundary``), so
  that align mode can store the prompt's state there: the split of a cold prompt.
* ``checkpoint_invalid``: the same stop while the GDN layers declare a prefill checkpoint (the
  plugin's exporter): the chunk reached the prompt's end but the checkpoint was not valid for it
  (``is_mamba_prefill_checkpoint_valid``: a start off the hash grid, a checkpoint off the
  64-token alignment, too short a chunk), so vLLM split as without the exporter.
* ``mid_block_start``: the chunk started inside a block (after a hit finer than the block, with
  ``--prefix-match-unit``, or after a sub-block chunk) and vLLM stopped it at the next block
  boundary, where a state can be stored.
* ``shared_budget``: the token budget left for the request in that step was below ``B`` (and
  below the threshold and what the request still had): other requests of the step (decodes,
  other prefills) took the rest: load. The chunk ends at that budget or, in align mode, at the
  block boundary below it, or (the runtime's junction entries: ``--target npu``, the CPU path)
  at the 64-token checkpoint alignment below it, the step exporting the states it crosses.
* ``long_prefill``: ``--long-prefill-token-threshold`` capped the chunk below ``B``.
* ``block_rounding``: the chunk had the whole budget ``B`` and vLLM's align-mode split rounded its
  end down to a block boundary (``B`` not a multiple of the block).
* ``unexplained``: none of the above matches (a vLLM whose split stops elsewhere); 0 in the
  tests and in the shared-trace rows of docs/hitrate-guide.md (2026-11-28), kept so that the
  reasons always sum to the total.

A chunk of ``B`` tokens from the frontier, and a prompt's last chunk, are never extra. What the
replay cannot tell apart is merged by construction: a chunk end rounded down from a shared or
capped budget is counted under the budget's reason, not ``block_rounding``; a mid-block start
whose chunk the budget or threshold already ends at the next boundary is counted under that cap.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field, replace
from typing import Any

from vllm_hybrid_npu.core.prefill_checkpoints import ALIGNMENT

#: attribute marking a scheduler class's ``_mamba_block_aligned_split`` that stands in for a
#: runtime registry entry (not a lab policy): :class:`SplitRecorder` reads the split through it
RUNTIME_SPLIT = "_vhn_runtime_split"

#: extra-step reasons, the order of reports (the module docstring gives the order they are tested)
REASONS: tuple[str, ...] = (
    "junction",
    "prompt_tail",
    "checkpoint_invalid",
    "mid_block_start",
    "block_rounding",
    "long_prefill",
    "shared_budget",
    "preemption",
    "policy_stop",
    "unexplained",
)


@dataclass(frozen=True)
class SplitDecision:
    """One call of vLLM's align-mode split (all in tokens).

    ``start``: the request's computed tokens, cache hit included; ``asked``: the tokens
    ``schedule()`` offered the split (after the token budget and the long-prefill threshold);
    ``upstream``: what vLLM's own ``Scheduler._mamba_block_aligned_split`` returned;
    ``result``: what the scheduler's method returned (a lab policy may shorten vLLM's);
    ``junction``: ``request.shared_prefix_boundary`` (0: none); ``num_tokens`` /
    ``num_prompt_tokens``: the request's at the call; ``tails``: the split's two prompt-tail
    stops for the request, ``(last_cache_position, tail_boundary)`` as the installed vLLM
    places them (:func:`tail_stops`), empty for vLLM 0.30's (computed from ``num_tokens``).
    """

    start: int
    asked: int
    upstream: int
    result: int
    junction: int
    num_tokens: int
    num_prompt_tokens: int
    tails: tuple[int, ...] = ()


@dataclass(frozen=True)
class SplitSettings:
    """The scheduler's constants :func:`chunk_reason` reads (tokens).

    ``block_size``: the Mamba/attention block of align mode (``cache_config.block_size``);
    ``hash_block_size``: the prefix-match unit; ``budget``: tokens per step
    (``max_num_scheduled_tokens``); ``long_prefill``: ``--long-prefill-token-threshold`` (0 = off);
    ``checkpoints``: the GDN specs declare a prefill checkpoint block (the exporter). Under
    vLLM >= 0.32 ``long_prefill`` is the step's effective threshold (0 when the request is alone,
    the fair share under ``--long-prefill-token-threshold-adaptive``): see
    :meth:`SplitRecorder.begin_step`.
    """

    block_size: int
    hash_block_size: int
    budget: int
    long_prefill: int = 0
    checkpoints: bool = False


def _budget_reason(asked: int, remaining: int, s: SplitSettings, rounded: bool) -> str:
    cap = min(s.budget, s.long_prefill) if s.long_prefill > 0 else s.budget
    if asked < min(remaining, cap):
        return "shared_budget"
    if s.long_prefill > 0 and cap < s.budget and asked == cap:
        return "long_prefill"
    return "block_rounding" if rounded else "unexplained"


def chunk_reason(start: int, end: int, num_tokens: int, num_prompt_tokens: int,
                 settings: SplitSettings, decision: SplitDecision | None = None) -> str:
    """Why a prefill chunk ``[start, end)`` ends at ``end`` (a name of :data:`REASONS`).

    Args:
        start, end: the chunk's token positions (``start`` = the request's computed tokens before
            the step, cache hit included); the chunk must stop short of the prefill's end.
        num_tokens: the request's tokens at the step (prompt + generated: a resumed request
            replays its output too); num_prompt_tokens: its prompt.
        settings: the scheduler's constants.
        decision: vLLM's split for this chunk (:class:`SplitDecision`), ``None`` where the
            scheduler did not split (no align mode: attention only, caching off, ``'all'`` mode):
            the chunk is then what the token budget gave.

    Returns:
        The reason; ``unexplained`` when no rule of the module docstring matches (a full-budget
        chunk asked about: it is never extra).
    """
    bs = settings.block_size
    remaining = num_tokens - start
    if decision is None:
        return _budget_reason(end - start, remaining, settings, rounded=False)
    requested = start + decision.asked
    upstream_end = start + decision.upstream
    if end < upstream_end:
        return "policy_stop"
    if upstream_end == requested:
        return _budget_reason(decision.asked, remaining, settings, rounded=False)
    prefill_end = max(num_prompt_tokens, num_tokens - 1)
    if requested < prefill_end and upstream_end == requested // bs * bs:
        return _budget_reason(decision.asked, remaining, settings, rounded=True)
    j = decision.junction
    if start < j < requested and upstream_end in (j, start + (j - start) // bs * bs):
        return "junction"
    tails = decision.tails or (
        num_tokens - num_tokens % bs,
        num_prompt_tokens // settings.hash_block_size * settings.hash_block_size)
    if upstream_end in tails:
        return ("checkpoint_invalid" if settings.checkpoints and requested >= prefill_end
                else "prompt_tail")
    if start % bs and upstream_end == (start // bs + 1) * bs:
        return "mid_block_start"
    if start < upstream_end == requested // ALIGNMENT * ALIGNMENT and requested < prefill_end:
        # the runtime's budget chunk end (core.budget_chunk_end): on the alignment, not the block
        return _budget_reason(decision.asked, remaining, settings, rounded=True)
    return "unexplained"


def tail_stops(scheduler: Any, request: Any) -> tuple[int, int]:
    """Where the installed vLLM's align-mode split puts a request's prompt-tail stops (tokens):
    ``(last_cache_position, tail_boundary)`` of ``Scheduler._mamba_block_aligned_split``.

    vLLM >= 0.32 places both with ``vllm.v1.kv_cache_interface.get_mamba_prefill_checkpoint_position``
    (called here, with vLLM 0.33's ``num_hash_lookahead_tokens`` where it takes one): the last
    boundary strictly before the last token, so a prompt on the block grid still stops one block
    short. vLLM 0.30 (which has the function, for its prefill checkpoint only) stops at the last
    boundary at or before the end (``num_tokens - num_tokens % block``), both one unit lower
    under EAGLE's block drop.
    """
    import vllm

    block = scheduler.cache_config.block_size
    unit = getattr(scheduler, "hash_block_size", None) or block
    drop = bool(getattr(scheduler, "use_eagle_block_drop", False))
    if tuple(int(x) for x in vllm.__version__.split(".")[:2]) < (0, 32):
        last = request.num_tokens - request.num_tokens % block
        tail = request.num_prompt_tokens // unit * unit
        if drop:
            last, tail = max(last - block, 0), max(tail - unit, 0) if tail else 0
        return last, tail
    from vllm.v1.kv_cache_interface import get_mamba_prefill_checkpoint_position as position

    kw = {}
    if "num_hash_lookahead_tokens" in inspect.signature(position).parameters:
        kw["num_hash_lookahead_tokens"] = getattr(scheduler, "num_hash_lookahead_tokens", 0)
    return (position(request.num_tokens, block, drop, **kw),
            position(request.num_prompt_tokens, unit, drop, **kw))


class SplitRecorder:
    """Records vLLM's align-mode split decisions of one scheduler, per request, for one step.

    Binds a wrapper over the instance's ``_mamba_block_aligned_split`` (the class and other
    schedulers are untouched); the wrapper calls the scheduler's own method, then vLLM's
    ``Scheduler._mamba_block_aligned_split`` where the class overrides it (a lab policy; not a
    class method marked :data:`RUNTIME_SPLIT`, a runtime entry's stand-in), and returns the
    former unchanged. Without align-mode splitting (``need_mamba_block_aligned_split``
    false) nothing is wrapped and :attr:`decisions` stays empty.
    """

    def __init__(self, scheduler: Any) -> None:
        from vllm.v1.core.sched.scheduler import Scheduler

        self.decisions: dict[str, SplitDecision] = {}
        self._scheduler = scheduler
        sc = scheduler.scheduler_config
        block = scheduler.cache_config.block_size
        self._configured = SplitSettings(
            block_size=block,
            hash_block_size=getattr(scheduler, "hash_block_size", None) or block,
            budget=getattr(scheduler, "max_num_scheduled_tokens", None) or sc.max_num_batched_tokens,
            long_prefill=sc.long_prefill_token_threshold or 0,
            checkpoints=bool(getattr(scheduler, "mamba_has_prefill_checkpoint_blocks", False)),
        )
        self.settings = self._configured
        if not getattr(scheduler, "need_mamba_block_aligned_split", False):
            return
        own = scheduler._mamba_block_aligned_split
        vllm_split = Scheduler._mamba_block_aligned_split
        cls_split = type(scheduler)._mamba_block_aligned_split
        # a lab policy's override is measured against vLLM's split; a runtime entry's stand-in
        # (RUNTIME_SPLIT set: tailsplit=off) is part of the installed split, as the entries bound
        # on the instance are
        overridden = cls_split is not vllm_split and not getattr(cls_split, RUNTIME_SPLIT, False)

        def split(request: Any, num_new_tokens: int, num_new_local_computed_tokens: int = 0,
                  num_external_computed_tokens: int = 0) -> int:
            args = (request, num_new_tokens, num_new_local_computed_tokens,
                    num_external_computed_tokens)
            result = own(*args)
            upstream = vllm_split(scheduler, *args) if overridden else result
            self.decisions[request.request_id] = SplitDecision(
                start=(request.num_computed_tokens + num_new_local_computed_tokens
                       + num_external_computed_tokens),
                asked=num_new_tokens, upstream=upstream, result=result,
                junction=getattr(request, "shared_prefix_boundary", 0) or 0,
                num_tokens=request.num_tokens, num_prompt_tokens=request.num_prompt_tokens,
                tails=tail_stops(scheduler, request))
            return result

        scheduler._mamba_block_aligned_split = split

    def begin_step(self) -> None:
        """Forget the previous step's decisions (call before each ``schedule()``) and set
        :attr:`settings` to the coming step's.

        vLLM >= 0.32's ``Scheduler.schedule`` (the scheduler has ``adaptive_long_prefill_threshold``)
        applies ``--long-prefill-token-threshold`` only when more than one request is running or
        waiting at the step's start, floored at ``max_num_batched_tokens // requests`` under
        ``--long-prefill-token-threshold-adaptive``; read here from the same counts
        (``get_request_counts``) before the step. vLLM 0.30 applies it always.
        """
        self.decisions.clear()
        s, sched = self._configured, self._scheduler
        if s.long_prefill <= 0 or not hasattr(sched, "adaptive_long_prefill_threshold"):
            return
        n = sum(sched.get_request_counts())
        threshold = s.long_prefill if n > 1 else 0
        if threshold and sched.adaptive_long_prefill_threshold:
            threshold = max(threshold, sched.scheduler_config.max_num_batched_tokens // n)
        self.settings = replace(s, long_prefill=threshold)

    def decision(self, request_id: str, start: int, scheduled: int) -> SplitDecision | None:
        """This step's split decision for the request when it is the chunk that was scheduled
        (same ``start``, ``scheduled`` tokens), else ``None``."""
        d = self.decisions.get(request_id)
        if d is None or d.start != start or d.result != scheduled:
            return None
        return d


@dataclass
class _Open:
    frontier: int
    chunks: int = 0
    extra: dict[str, int] = field(default_factory=dict)


class PrefillLedger:
    """Per request: prefill chunks and the extra ones by reason (see module docstring).

    Args:
        budget: tokens per step ``B`` (``--max-num-batched-tokens``), >= 1.

    Raises:
        ValueError: ``budget`` < 1.
    """

    def __init__(self, budget: int) -> None:
        if budget < 1:
            raise ValueError(f"budget must be >= 1 token, got {budget}")
        self.budget = budget
        self._open: dict[str, _Open] = {}

    def _steps(self, tokens: int) -> int:
        return -(-max(tokens, 0) // self.budget)

    def chunk(self, request_id: str, start: int, end: int, num_prompt_tokens: int,
              reason: Any) -> bool:
        """Count one step that computed prompt tokens ``[start, end)`` of the request.

        Args:
            start, end: token positions (``end`` may run past the prompt: a resumed request's
                replayed output); the request's first chunk starts at its cache hit.
            num_prompt_tokens: the prompt's tokens.
            reason: called with no argument for the chunk's reason (a name of
                :data:`REASONS`) when the chunk is extra and not a recomputation.

        Returns:
            True when the chunk is an extra step.
        """
        st = self._open.setdefault(request_id, _Open(frontier=start))
        st.frontier = max(st.frontier, start)
        after = max(st.frontier, min(end, num_prompt_tokens))
        st.chunks += 1
        extra = (self._steps(num_prompt_tokens - st.frontier)
                 == self._steps(num_prompt_tokens - after))
        if extra:
            why = "preemption" if start < st.frontier else reason()
            st.extra[why] = st.extra.get(why, 0) + 1
        st.frontier = after
        return extra

    def finish(self, request_id: str) -> tuple[int, dict[str, int]]:
        """Close the request: ``(prefill chunks, {reason: extra steps})`` (0 and ``{}`` for a
        request with no prefill chunk)."""
        st = self._open.pop(request_id, None)
        return (0, {}) if st is None else (st.chunks, st.extra)


def per_prompt(counts: dict[str, int], prompts: int) -> dict[str, float]:
    """``{reason: steps / prompts}`` for every name of :data:`REASONS` (0.0 where absent).

    Raises:
        ValueError: ``prompts`` < 1.
    """
    if prompts < 1:
        raise ValueError(f"prompts must be >= 1, got {prompts}")
    return {r: counts.get(r, 0) / prompts for r in REASONS}


#: column headers of :func:`format_reasons` (reason -> at most 8 characters)
LABELS: dict[str, str] = {
    "junction": "junction", "prompt_tail": "tail", "checkpoint_invalid": "ckpt-inv",
    "mid_block_start": "mid-blk", "block_rounding": "rounding", "long_prefill": "lpt",
    "shared_budget": "shared", "preemption": "preempt", "policy_stop": "policy",
    "unexplained": "unexpl",
}
#: reasons :func:`format_reasons` shows only where a row has them
_OPTIONAL = ("policy_stop", "unexplained")


def beyond_off(row: dict[str, Any], off: dict[str, Any]) -> float:
    """Extra prefill steps per prompt of replay dict ``row`` beyond caching off's (``off``: the
    same requests and arrivals replayed with prefix caching off, whose extra steps are the
    load's); negative when the row's hits lighten the load below caching off's."""
    return row["extra_prefill_steps_per_prompt"] - off["extra_prefill_steps_per_prompt"]


def format_reasons(rows: list[tuple[str, dict[str, Any]]], off: dict[str, Any] | None,
                   width: int = 21) -> list[str]:
    """The printed table of extra prefill steps per prompt by reason.

    Args:
        rows: ``(name, replay dict)`` pairs (dicts with ``extra_prefill_steps_per_prompt`` and
            ``extra_prefill_steps_by_reason``); caching off's row is added last when given.
        off: caching off's replay dict on the same requests, or ``None`` (no ``beyond off``
            column).
        width: characters of the name column.

    Returns:
        The table's lines: a header, one line per row.
    """
    shown = [r for r in REASONS if r not in _OPTIONAL
             or any(d.get("extra_prefill_steps_by_reason", {}).get(r) for _, d in rows)]
    all_rows = rows + ([("caching off", off)] if off is not None else [])
    head = (f"{'extra steps by reason':<{width}} {'extra':>6}"
            + (f" {'>off':>6}" if off is not None else "")
            + "".join(f" {LABELS[r]:>8}" for r in shown))
    lines = [head]
    for name, d in all_rows:
        by = d.get("extra_prefill_steps_by_reason", {})
        lines.append(f"{name:<{width}} {d['extra_prefill_steps_per_prompt']:>6.2f}"
                     + (f" {beyond_off(d, off):>6.2f}" if off is not None else "")
                     + "".join(f" {by.get(r, 0.0):>8.2f}" for r in shown))
    return lines
