"""``vllm-hybrid-npu-lab advise``: which ``vllm serve`` flags for my traffic?

Searches vLLM's own prefix-caching options (and the plugin's GDN prefill-checkpoint exporter)
with vLLM's real scheduler on the first part of a trace (the *fit* part), replays the winner and
vLLM's defaults on the rest (the *check* part, not seen by the search), and prints the flags, the
hit rates expected on the check part, the extra prefill steps per prompt, the attention bound and
the infinite bound beside them.

The options (:class:`Candidate`; values in blocks of the setting's own block size, see
:mod:`.upstream_grid`):

* ``ckpt``: the exporter off / on (``VLLM_HYBRID_NPU_PREFILL_CHECKPOINTS``; on rounds the block up
  to the 64-token grid);
* ``ret``: ``--prefix-cache-retention-interval``: 0 (vLLM's default), ``None`` (dense), 1, 2, 4, 8
  blocks, then 16, 32, ... while the largest keeps winning;
* ``lpt``: ``--long-prefill-token-threshold``: 0 (off), 1, 2, 4 blocks (then 8, ... likewise);
* ``pmu``: ``--prefix-match-unit``: the block (default), 64, 32 tokens (where it divides the
  block);
* ``host``: the host tier (``--kv-offloading-size``) off, half, or the given size (only with
  ``--host-cache-gib``).

Search (:func:`search`, issue 33), in two phases, every replay memoized:

1. **Grid**: every combination of ``ckpt`` x ``pmu`` x ``host`` (:data:`GRID_AXES`) at vLLM's
   defaults for the other axes (18 settings with a host tier, 6 without; a prefix-match unit that
   does not divide the setting's block is skipped without a replay). These axes interact: the
   exporter moves the block to the 64-token grid (which units divide it), and with a host tier
   vLLM's OffloadingConnector cannot reach the exporter's checkpoint when the unit is finer than
   the block (docs/hitrate-lab.md, "The exporter with a host tier"), so one axis at a time
   misses pairs (the search before issue 33 fixed the exporter first, then tried the unit with it).
2. **Coordinate descent** from each of the best ``starts`` grid settings (default 3) over all
   axes (:data:`AXES`): each axis in turn is set to its best value with the others fixed, a move
   is taken only when it raises the fit part's token hit rate (with a step bound: its rank,
   eligible before ineligible, then hits; ties keep the current value);
   ``ret+lpt`` (retention interval and long-prefill threshold) is scanned jointly (a threshold
   leaves states at chunk ends and the interval decides which stay, so one without the other
   misleads), and an axis whose best retention interval or threshold is the largest tried is
   extended (twice as many blocks) until it stops winning; passes repeat until one changes nothing
   (at most ``max_passes``).

:attr:`SearchResult.best` is the evaluated setting with the most fit-part hits, whatever its
steps. The advice (:func:`choose`) keeps the plugin's promise, prefix caching at caching off's
prompt cost (issue 38): caching off is replayed on the fit part under the same arrivals, and a
setting is *eligible* only if its extra prefill steps per prompt are at most caching off's plus a
margin (:class:`StepBound`; ``--max-extra-steps-over-off``, default 0.05 steps per prompt,
``inf`` for no bound). Among the eligible settings the advice is the most token hits (ties: fewer
prefill steps per prompt, then fewer options changed from vLLM's defaults; ``--hit-tolerance``
widens "the most" to a share of it); if none is eligible, the fewest extra steps beyond caching
off's (ties: hits), said plainly with the reasons the others failed (:func:`failure_reasons`).
With a bound the search ranks settings by (eligible, hits), descends from the best ``starts``
grid settings by that rank, once more by hits alone from the grid's most hits (the
unconstrained best, printed beside the advice) and once more by hits alone with the exporter
off (vLLM's split at its best, replayed on the check part beside the advice). The report states
the bound, every searched setting's extra steps beyond caching off's and whether it was eligible,
and the search's cost in replays. ``--audit`` runs the same search on the check part and compares the advice with the
best eligible setting found there (and prints the unconstrained best and vLLM's split at its
best there). Where the installed vLLM has the runtime's option ``ckpt``
(vLLM 0.30), each search also replays ``ckpt=final`` beside the best exporter setting at 1, 2, 4
and 8 blocks of retention (:func:`_final_scan`: 4 replays, more only while 8 blocks wins and is
doubled), and the runtime's two opt-ins for a prefix-match unit below the block beside the
exporter setting with one and the most hits (``tailsplit=off``, and with a host tier ``tails=off`` and both:
:func:`_optin_scan`, at most 3 replays; on ``--target cuda`` each also with ``second=on``, and the
seed with it alone: at most 7); they compete for the advice, never for vLLM's split at
its best. ``--jobs`` replays the
settings of one step (the grid, one axis's values) in parallel processes. The same search without
a bound is the ``upstream-best`` row of ``hitrate`` (its best by hits, on the replayed requests,
the host tier fixed by ``--host-cache-gib``).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import re
import sys
from typing import Any, Callable

from vllm_hybrid_npu.envs import OPTIONS_ENV
from vllm_hybrid_npu_lab.replay import TARGET_HELP, TARGETS, add_speculative_argument, check_speculative
from vllm_hybrid_npu_lab.upstream_grid import (CKPT_FINAL, UpstreamSetting, final_available,
                                                optins_available, policy_of)

#: option axes in search order
#: ``ret+lpt`` is one axis: the two options act together (a long-prefill threshold leaves states
#: at chunk ends, the retention interval decides which of them stay), so they are scanned jointly
AXES = ("host", "ckpt", "ret+lpt", "pmu")
CKPT_VALUES = (False, True)
RET_VALUES: tuple[int | None, ...] = (0, None, 1, 2, 4, 8)
LPT_VALUES = (0, 1, 2, 4)
PMU_VALUES: tuple[int | None, ...] = (None, 64, 32)
#: axes in blocks whose range is extended (doubling) while their largest value keeps winning
OPEN_ENDED = ("ret", "lpt")
#: default share of the (limited) trace the search sees; the rest is the check part
DEFAULT_FIT_FRACTION = 0.5
DEFAULT_MAX_PASSES = 2
#: axes whose every combination the search replays before descending (issue 33)
GRID_AXES = ("ckpt", "pmu", "host")
#: grid settings the coordinate descent starts from (the best by fit-part hits)
DEFAULT_STARTS = 3
#: relative hit tolerance of the advice: eligible settings with at least (1 - this) x the most
#: fit-part token hit rate among the eligible ones compete on prefill steps per prompt (0: the
#: most hits; issue 38 made 0 the default, the step bound now limits the steps)
DEFAULT_HIT_TOLERANCE = 0.0
#: the step bound's default margin (issue 38): extra prefill steps per prompt at most caching
#: off's on the same requests and arrivals plus this many (steps per prompt)
DEFAULT_MAX_EXTRA_STEPS_OVER_OFF = 0.05
#: slack of the bound's comparison (steps per prompt): extra steps per prompt are counts over
#: prompts, so a setting exactly at the bound may land a rounding error above it
_BOUND_EPS = 1e-9


@dataclasses.dataclass(frozen=True)
class StepBound:
    """The step bound of issue 38: the plugin's promise is prefix caching at caching off's prompt
    cost, so a setting is *eligible* only if its extra prefill steps per prompt (a replay's
    ``extra_prefill_steps_per_prompt``: steps that computed prompt tokens beyond the fewest its
    uncached tokens need under the token budget) are at most caching off's on the same requests
    and arrivals plus ``margin``.

    Attributes:
        off_extra: caching off's extra prefill steps per prompt on the same requests and arrivals
            (steps per prompt; the load's: the token budget shared in a step).
        margin: steps per prompt allowed beyond ``off_extra`` (>= 0; ``math.inf``: no bound,
            every setting eligible).
    """

    off_extra: float
    margin: float = DEFAULT_MAX_EXTRA_STEPS_OVER_OFF

    def beyond(self, r: dict[str, Any]) -> float:
        """Extra prefill steps per prompt of replay dict ``r`` beyond caching off's (steps per
        prompt; negative when its hits lighten the load below caching off's)."""
        return r["extra_prefill_steps_per_prompt"] - self.off_extra

    def eligible(self, r: dict[str, Any]) -> bool:
        """Whether replay dict ``r`` meets the bound (always, with an infinite margin)."""
        return math.isinf(self.margin) or self.beyond(r) <= self.margin + _BOUND_EPS

    @property
    def limit(self) -> float:
        """The largest eligible extra prefill steps per prompt (``off_extra + margin``)."""
        return self.off_extra + self.margin

    def to_dict(self) -> dict[str, Any]:
        """``margin`` (``None`` for no bound: JSON has no infinity), ``caching_off_extra``,
        ``limit`` (``None`` for no bound)."""
        inf = math.isinf(self.margin)
        return {"margin": None if inf else self.margin, "caching_off_extra": self.off_extra,
                "limit": None if inf else self.limit}


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One point of the search: an upstream setting and the host tier per worker (GiB)."""

    setting: UpstreamSetting = UpstreamSetting()
    host_gib: float = 0.0

    @property
    def policy(self) -> str:
        """The lab policy name (``hitrate --policy``)."""
        return self.setting.name

    @property
    def label(self) -> str:
        return self.policy + (f" +host {self.host_gib:g}" if self.host_gib else "")

    def get(self, axis: str) -> Any:
        if axis == "host":
            return self.host_gib
        if "+" in axis:
            return tuple(getattr(self.setting, a) for a in axis.split("+"))
        return getattr(self.setting, axis)

    def changes(self, other: "Candidate") -> int:
        """How many options (``ret``, ``lpt``, ``pmu``, ``ckpt``, ``tails``, ``tail_split``,
        ``second``, ``host``) differ from ``other``."""
        a, b = self.setting, other.setting
        return (sum(getattr(a, f) != getattr(b, f)
                    for f in ("ret", "lpt", "pmu", "ckpt", "tails", "tail_split", "second"))
                + (self.host_gib != other.host_gib))

    def with_(self, axis: str, value: Any) -> "Candidate":
        if axis == "host":
            return dataclasses.replace(self, host_gib=value)
        if "+" in axis:
            kw = dict(zip(axis.split("+"), value))
        else:
            kw = {axis: value}
        return dataclasses.replace(self, setting=dataclasses.replace(self.setting, **kw))


def axis_values(axis: str, host_gib: float, exporter: bool = True) -> tuple:
    """The values :func:`search` tries on ``axis``."""
    if axis == "host":
        return (0.0, host_gib / 2, host_gib) if host_gib > 0 else (0.0,)
    if axis == "ckpt":
        return CKPT_VALUES if exporter else (False,)
    if "+" in axis:
        return tuple(itertools.product(*(axis_values(a, host_gib, exporter) for a in axis.split("+"))))
    return {"ret": RET_VALUES, "lpt": LPT_VALUES, "pmu": PMU_VALUES}[axis]


def _is_blocks(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _extensions(axis: str, best: Any, tried: set) -> list:
    """Values past the range of an open-ended axis: where the best value's retention interval or
    long-prefill threshold is the largest tried (with the other coordinates), twice it."""
    parts = axis.split("+")
    if not any(p in OPEN_ENDED for p in parts):
        return []
    best_t = best if "+" in axis else (best,)
    out = []
    for i, p in enumerate(parts):
        if p not in OPEN_ENDED or not _is_blocks(best_t[i]) or best_t[i] == 0:
            continue
        same = [t if "+" in axis else (t,) for t in tried]
        top = max((t[i] for t in same if _is_blocks(t[i])
                   and all(t[j] == best_t[j] for j in range(len(parts)) if j != i)), default=0)
        if best_t[i] == top:
            new = list(best_t)
            new[i] = 2 * top
            out.append(tuple(new) if "+" in axis else new[0])
    return out


@dataclasses.dataclass
class SearchResult:
    """``best``: the evaluated setting with the highest token hit rate, whatever its steps (ties:
    the fewest options changed from ``start``, then the one evaluated first); ``start``: vLLM's
    defaults (with the host tier given); ``evaluated``: candidate -> its replay dict, in
    evaluation order (``None`` when vLLM rejects the combination, e.g. a prefix-match unit that
    does not divide the block); ``passes``: the most coordinate-descent passes any descent ran;
    ``grid``: the grid phase's candidates; ``starts``: the grid settings the descents started
    from; ``endpoints``: where each ended; ``bound``: the step bound the search ranked by
    (``None``: none, every setting eligible)."""

    best: Candidate
    start: Candidate
    evaluated: dict[Candidate, dict[str, Any] | None]
    passes: int
    grid: list[Candidate] = dataclasses.field(default_factory=list)
    starts: list[Candidate] = dataclasses.field(default_factory=list)
    endpoints: list[Candidate] = dataclasses.field(default_factory=list)
    grid_axes: tuple[str, ...] = ()
    bound: StepBound | None = None

    def result(self, cand: Candidate) -> dict[str, Any]:
        r = self.evaluated[cand]
        assert r is not None
        return r

    def eligible(self, cand: Candidate) -> bool:
        """Whether the evaluated, valid ``cand`` meets :attr:`bound` (True without a bound)."""
        return self.bound is None or self.bound.eligible(self.result(cand))

    def beyond_off(self, cand: Candidate) -> float | None:
        """``cand``'s extra prefill steps per prompt beyond caching off's (``None`` without a
        bound)."""
        return None if self.bound is None else self.bound.beyond(self.result(cand))

    @property
    def valid(self) -> list[Candidate]:
        """The evaluated settings vLLM accepted, in evaluation order."""
        return [c for c, r in self.evaluated.items() if r is not None]

    @property
    def n_eligible(self) -> int:
        """Valid evaluated settings that meet :attr:`bound`."""
        return sum(self.eligible(c) for c in self.valid)

    def best_split(self) -> Candidate | None:
        """vLLM's split at its best: the most token hits among the evaluated settings without the
        exporter and without the runtime's opt-ins (``tails=off``, ``tailsplit=off``) that meet
        :attr:`bound` or, when none does, among all of those (ties: the first evaluated);
        ``None`` when none was evaluated."""
        split = [c for c in self.valid if not c.setting.ckpt and not c.setting.optin]
        return _first_most_hits([c for c in split if self.eligible(c)] or split, self.evaluated)

    @property
    def replays(self) -> int:
        """Settings replayed (valid ones; the search's cost)."""
        return sum(r is not None for r in self.evaluated.values())

    @property
    def invalid(self) -> int:
        """Settings vLLM rejected without a replay."""
        return sum(r is None for r in self.evaluated.values())

    def table(self) -> list[dict[str, Any]]:
        """Every valid evaluated candidate: ``policy``, ``host_cache_gib``, ``token_hit_rate``,
        where the replay has them ``prefill_steps_per_prompt``,
        ``extra_prefill_steps_per_prompt`` and ``extra_prefill_steps_by_reason`` (steps per
        prompt), and with a bound ``extra_prefill_steps_beyond_off`` and ``eligible``."""
        keys = ("prefill_steps_per_prompt", "extra_prefill_steps_per_prompt",
                "extra_prefill_steps_by_reason")
        return [
            {"policy": c.policy, "host_cache_gib": c.host_gib, "token_hit_rate": r["token_hit_rate"],
             **{k: r[k] for k in keys if k in r},
             **({"extra_prefill_steps_beyond_off": self.bound.beyond(r),
                 "eligible": self.bound.eligible(r)} if self.bound is not None else {})}
            for c, r in self.evaluated.items() if r is not None
        ]

    def cost(self) -> dict[str, Any]:
        """The search's cost and shape: ``replays``, ``invalid`` (settings vLLM rejected),
        ``grid`` (grid settings, invalid included), ``grid_axes``, ``starts`` and ``endpoints``
        (labels), ``passes``, ``final`` (``ckpt=final`` settings replayed, :func:`_final_scan`),
        ``optins`` (settings with a runtime opt-in replayed, :func:`_optin_scan`)."""
        return {"replays": self.replays, "invalid": self.invalid, "grid": len(self.grid),
                "grid_axes": list(self.grid_axes), "starts": [c.label for c in self.starts],
                "endpoints": [c.label for c in self.endpoints], "passes": self.passes,
                "final": sum(c.setting.ckpt == CKPT_FINAL for c in self.evaluated),
                "optins": sum(c.setting.optin for c in self.evaluated)}

    def merged(self, known: dict[Candidate, dict[str, Any] | None]) -> "SearchResult":
        """A copy whose :attr:`evaluated` also holds the ``known`` replays the search did not
        visit (after its own), with :attr:`best` recomputed over them all."""
        evaluated = dict(self.evaluated)
        for c, r in known.items():
            evaluated.setdefault(c, r)
        return dataclasses.replace(self, evaluated=evaluated,
                                   best=_most_hits(evaluated, self.start))


def _first_most_hits(cands: list[Candidate],
                     evaluated: dict[Candidate, dict[str, Any] | None]) -> Candidate | None:
    """The most token hits among ``cands`` (valid ones); among equals the first in ``cands``;
    ``None`` when ``cands`` is empty."""
    return max(cands, key=lambda c: evaluated[c]["token_hit_rate"], default=None)


def _most_hits(evaluated: dict[Candidate, dict[str, Any] | None], start: Candidate) -> Candidate:
    """The most token hits; among equals the fewest options changed from ``start``, then the
    first evaluated."""
    rated = [(i, c, r["token_hit_rate"]) for i, (c, r) in enumerate(evaluated.items())
             if r is not None]
    return min(rated, key=lambda icr: (-icr[2], icr[1].changes(start), icr[0]))[1]


def search(
    evaluate: Callable[[Candidate], dict[str, Any] | None],
    start: Candidate,
    host_gib: float = 0.0,
    *,
    axes: tuple[str, ...] = AXES,
    grid_axes: tuple[str, ...] = GRID_AXES,
    starts: int = DEFAULT_STARTS,
    exporter: bool = True,
    max_passes: int = DEFAULT_MAX_PASSES,
    map_fn: Callable | None = None,
    known: dict[Candidate, dict[str, Any] | None] | None = None,
    bound: StepBound | None = None,
    final: bool = False,
    optins: bool = False,
    second: bool = False,
) -> SearchResult:
    """Grid over ``grid_axes``, then coordinate descent over ``axes`` from the best ``starts``
    grid settings (see module docstring), then, with ``final``, the ``ckpt=final`` scan
    (:func:`_final_scan`).

    With a step ``bound``, settings are ranked by (meets the bound, token hit rate): an eligible
    setting beats every ineligible one, hits decide within each class; the descents start from
    the best ``starts`` grid settings by that rank, one more descends by hits alone from the
    grid's most hits where that is not among them (the unconstrained best, for comparison), and,
    where the exporter may be on, one more by hits alone with the exporter kept off from the
    grid's most hits without it (vLLM's split at its best, :meth:`SearchResult.best_split`).

    Args:
        evaluate: replays a candidate, returns a dict with ``token_hit_rate`` or ``None`` when
            the combination is invalid; called at most once per candidate.
        start: vLLM's defaults (must be valid); the grid varies its ``grid_axes``.
        host_gib: the largest host tier to try (the ``host`` axis; 0 = no host axis).
        axes: axes of the descent, in order; a grid axis not in ``axes`` is not varied at all.
        grid_axes: axes whose every combination is replayed first (() = plain coordinate
            descent from ``start``, the search before issue 33).
        starts: grid settings (best first) to descend from, >= 1.
        exporter: whether ``ckpt`` may be on.
        max_passes: passes at most per descent (>= 1).
        map_fn: ``map``-like function evaluating a batch of candidates (e.g. a process pool's
            ``map``); default the builtin ``map``.
        known: replays already made on the same requests (candidate -> replay dict), taken
            instead of replaying them again (they count in :attr:`SearchResult.evaluated`).
        bound: the step bound (:class:`StepBound`, caching off's extra steps on the same
            requests); the replay dicts then need ``extra_prefill_steps_per_prompt``. ``None``:
            hits alone (``upstream-best``).
        final: also scan ``ckpt=final`` (the runtime's option,
            ``VLLM_HYBRID_NPU_OPTIONS=ckpt=final``, vLLM 0.30) beside the best exporter setting
            (:func:`_final_scan`; at most
            :data:`RET_VALUES`' positive intervals, 4, plus doublings of the largest while it
            wins); only where ``exporter``.
        optins: also replay the runtime's opt-ins for a prefix-match unit below the block
            (``tailsplit=off``; with a host tier also ``tails=off`` and both; vLLM 0.30) beside
            the exporter setting with such a unit and the most hits (:func:`_optin_scan`); only
            where ``exporter``.
        second: with ``optins``, each of those also with ``second=on`` (the runtime's
            ``VLLM_HYBRID_NPU_OPTIONS=second=on``), and the seed with it alone: where the
            target's runtime has it (:func:`second_available`).

    Raises:
        ValueError: ``start`` is not valid, ``starts`` < 1 (names ``--starts``) or
            ``max_passes`` < 1 (names ``--max-passes``).
    """
    if starts < 1:
        raise ValueError(f"--starts must be >= 1, got {starts}")
    if max_passes < 1:
        raise ValueError(f"--max-passes must be >= 1, got {max_passes}")
    evaluated: dict[Candidate, dict[str, Any] | None] = {}
    known = dict(known or {})

    def replay_all(cands: list[Candidate]) -> list[dict[str, Any] | None]:
        for c in dict.fromkeys(cands):
            if c not in evaluated and c in known:
                evaluated[c] = known[c]
        todo = [c for c in dict.fromkeys(cands) if c not in evaluated]
        for c, r in zip(todo, (map_fn or map)(evaluate, todo)):
            evaluated[c] = r
        return [evaluated[c] for c in cands]

    def rank(r: dict[str, Any] | None, constrained: bool = True) -> tuple[bool, float] | None:
        if r is None:
            return None
        ok = bound is None or not constrained or bound.eligible(r)
        return (ok, r["token_hit_rate"])

    def score_all(cands: list[Candidate]) -> list[tuple[bool, float] | None]:
        return [rank(r) for r in replay_all(cands)]

    def hits_all(cands: list[Candidate]) -> list[tuple[bool, float] | None]:
        return [rank(r, constrained=False) for r in replay_all(cands)]

    if score_all([start])[0] is None:
        raise ValueError(f"the starting setting {start.label} is not valid")
    gaxes = [a for a in grid_axes if a in axes]
    grid = [start]
    for values in itertools.product(*(axis_values(a, host_gib, exporter) for a in gaxes)):
        cand = start
        for axis, value in zip(gaxes, values):
            cand = cand.with_(axis, value)
        grid.append(cand)
    grid = list(dict.fromkeys(grid))
    score_all(grid)
    valid = [c for c in grid if evaluated[c] is not None]
    # best first (eligible ones first with a bound); sorted() is stable, reverse too, so ties
    # keep grid order (vLLM's defaults first)
    seeds = sorted(valid, key=lambda c: rank(evaluated[c]), reverse=True)[:starts]
    runs = [(seed, score_all, exporter) for seed in seeds]

    if bound is not None:
        # the unconstrained best too: one descent by hits alone from the grid's most hits
        top = _first_most_hits(valid, evaluated)
        if top not in seeds:
            runs.append((top, hits_all, exporter))
        # and vLLM's split at its best (the comparison the plugin answers to): one descent by
        # hits alone, the exporter kept off, from the grid's most hits without it
        split = _first_most_hits([c for c in valid if not c.setting.ckpt], evaluated)
        if exporter and split is not None and (split, hits_all, False) not in runs:
            runs.append((split, hits_all, False))

    endpoints = []
    passes = 0
    for seed, scorer, ckpt_allowed in runs:
        end, ran = _descend(scorer, seed, axes, host_gib, ckpt_allowed, max_passes)
        endpoints.append(end)
        passes = max(passes, ran)
    if final and exporter:
        _final_scan(score_all, [c for c in evaluated if evaluated[c] is not None], rank, evaluated)
    if optins and exporter:
        _optin_scan(score_all, [c for c in evaluated if evaluated[c] is not None], evaluated, second)
    return SearchResult(best=_most_hits(evaluated, start), start=start, evaluated=evaluated,
                        passes=passes, grid=grid, starts=[seed for seed, _, _ in runs],
                        endpoints=endpoints, grid_axes=tuple(gaxes), bound=bound)


def _final_scan(score_all: Callable[[list[Candidate]], list[Any]], valid: list[Candidate],
                rank: Callable, evaluated: dict) -> Candidate | None:
    """``ckpt=final`` beside the exporter's best: from the best evaluated exporter setting by
    ``rank`` (the search's own: eligible first, then hits), the same setting with ``ckpt=final``
    at each positive retention interval of :data:`RET_VALUES` (1, 2, 4, 8 blocks), and twice the
    largest while it scores best (:func:`_extensions`). ``final`` changes nothing at retention 0
    or dense (it only drops a non-final chunk's checkpoint at an interval above 0), so those are
    not replayed. Coordinate descent alone would not find it: ``final`` gains at a smaller
    interval than ``ckpt``'s best (issue 38: ``ret=2b,ckpt=final`` against ``ret=4b,ckpt`` at
    16 + 256 GiB), each one axis away. Returns the scan's best (None without an exporter
    setting); the replays land in ``evaluated``."""
    exp = [c for c in valid if c.setting.ckpt is True]
    if not exp:
        return None
    seed = max(exp, key=lambda c: rank(evaluated[c]))  # max() keeps the first of equals
    cur = seed.with_("ckpt", CKPT_FINAL)
    values = [r for r in RET_VALUES if r]
    tried: set = set()
    best, best_score = None, None
    while values:
        cands = [cur.with_("ret", v) for v in values]
        tried.update(values)
        for cand, sc in zip(cands, score_all(cands)):
            if sc is not None and (best_score is None or sc > best_score):
                best, best_score = cand, sc
        if best is None:
            break
        values = [v for v in _extensions("ret", best.setting.ret, tried) if v not in tried]
    return best


def second_available(target: str, connector: bool) -> bool:
    """Whether ``second=on`` is replayed for ``target`` (``cuda``, ``npu``) with a host tier
    (``connector``: its KV connector) or without: the runtime applies
    ``VLLM_HYBRID_NPU_OPTIONS=second=on`` there (the installed vLLM is 0.30) and its step
    writes the second checkpoint where it exports junction states
    (:func:`vllm_hybrid_npu_lab.replay.junctions_modelled`: CUDA's one pass on the V2 runner,
    also beside a host tier; vllm-ascend's V1 runner without a KV connector). Raises ValueError
    for a bad ``junctions`` option."""
    from vllm_hybrid_npu_lab.replay import junctions_modelled

    return (junctions_modelled(target, connector)
            and policy_of(UpstreamSetting(pmu=64, ckpt=True, second=True)).unavailable() is None)


def _optin_scan(score_all: Callable[[list[Candidate]], list[Any]], valid: list[Candidate],
                evaluated: dict, second: bool = False) -> Candidate | None:
    """The runtime's opt-ins for a prefix-match unit below the block, beside the exporter's most
    hits with one: from the evaluated exporter setting with ``pmu`` set and the most token hits
    (whatever its steps: ``tailsplit=off`` exists to cut them), the same with ``tailsplit=off``
    (``VLLM_HYBRID_NPU_OPTIONS=tailsplit=off``: fewer steps, one sub-block state fewer per
    short final chunk) and, where that setting has a host tier, with ``tails=off``
    (``VLLM_HYBRID_NPU_OPTIONS=tails=off``: the host's pages to block-grid chunks) and
    with both. At the block's unit neither changes anything (no partial tail; the column clause
    fails alone only below the block), nor ``tails=off`` without a host tier, so those are not
    replayed; coordinate descent never varies them. With ``second``, each of those again with
    ``second=on`` and the seed with it alone (``VLLM_HYBRID_NPU_OPTIONS=second=on``: the block
    boundary below a sub-block checkpoint kept too). Returns the scan's best by ``score_all``
    (None without such a setting); the replays land in ``evaluated``."""
    exp = [c for c in valid if c.setting.ckpt and c.setting.pmu is not None and not c.setting.optin]
    if not exp:
        return None
    seed = _first_most_hits(exp, evaluated)
    cands = [seed.with_("tail_split", False)]
    if seed.host_gib:
        cands += [seed.with_("tails", False), seed.with_("tails", False).with_("tail_split", False)]
    if second:
        cands += [c.with_("second", True) for c in [seed, *cands]]
    best, best_score = None, None
    for cand, sc in zip(cands, score_all(cands)):
        if sc is not None and (best_score is None or sc > best_score):
            best, best_score = cand, sc
    return best


def _descend(score_all: Callable[[list[Candidate]], list[Any]], cur: Candidate,
             axes: tuple[str, ...], host_gib: float, exporter: bool,
             max_passes: int) -> tuple[Candidate, int]:
    """Coordinate descent from ``cur`` (``score_all``: candidates -> comparable scores, ``None``
    for an invalid one; a move needs a strictly higher score): returns the end point and the
    passes run."""
    passes = 0
    for passes in range(1, max_passes + 1):
        changed = False
        for axis in axes:
            best, best_score = cur, score_all([cur])[0]
            values = list(axis_values(axis, host_gib, exporter))
            tried: set = set()
            while values:
                cands = [cur.with_(axis, v) for v in values]
                tried.update(values)
                for cand, sc in zip(cands, score_all(cands)):
                    if sc is not None and sc > best_score:
                        best, best_score = cand, sc
                values = [v for v in _extensions(axis, best.get(axis), tried) if v not in tried]
            if best != cur:
                cur, changed = best, True
        if not changed:
            break
    return cur, passes


def choose(result: SearchResult, tolerance: float = DEFAULT_HIT_TOLERANCE) -> Candidate:
    """The advised setting (issue 38's rule).

    The eligible settings are the evaluated ones that meet ``result.bound`` (all of them without
    a bound). If any is eligible: among the eligible settings whose token hit rate is at least
    ``(1 - tolerance)`` x the most any eligible one got, the one with the fewest prefill steps
    per prompt (``prefill_steps_per_prompt`` of its replay); ties: the higher hit rate, then
    fewer options changed from ``result.start`` (vLLM's defaults), then evaluation order. With
    ``tolerance`` 0 (the default) that is the most hits among the eligible settings. If none is
    eligible: the fewest extra prefill steps per prompt beyond caching off's; ties: the higher
    hit rate, then fewer options changed, then evaluation order.

    Args:
        result: a search's result; its replay dicts need ``token_hit_rate``,
            ``prefill_steps_per_prompt`` and, with a bound, ``extra_prefill_steps_per_prompt``.
        tolerance: relative hit tolerance in [0, 1) (0: the most hits, steps break ties only).

    Raises:
        ValueError: ``tolerance`` outside [0, 1) (the message names ``--hit-tolerance``).
        KeyError: a replay dict without ``prefill_steps_per_prompt``.
    """
    if not 0 <= tolerance < 1:
        raise ValueError(f"--hit-tolerance must be in [0, 1), got {tolerance}")
    valid = [(i, c, result.result(c)) for i, c in enumerate(result.evaluated)
             if result.evaluated[c] is not None]
    ok = [icr for icr in valid if result.eligible(icr[1])]
    if not ok:
        assert result.bound is not None
        bound = result.bound
        return min(valid, key=lambda icr: (bound.beyond(icr[2]), -icr[2]["token_hit_rate"],
                                           icr[1].changes(result.start), icr[0]))[1]
    floor = max(r["token_hit_rate"] for _, _, r in ok) * (1 - tolerance)
    near = [icr for icr in ok if icr[2]["token_hit_rate"] >= floor]
    return min(near, key=lambda icr: (icr[2]["prefill_steps_per_prompt"],
                                      -icr[2]["token_hit_rate"],
                                      icr[1].changes(result.start), icr[0]))[1]


def failure_reasons(result: SearchResult, off: dict[str, Any]) -> dict[str, int]:
    """Why the settings over ``result.bound`` failed: reason -> how many of them have it as their
    largest reason beyond caching off's (each reason's extra prefill steps per prompt minus
    caching off's of the same reason; ``off``: caching off's replay dict on the same requests).
    Empty without a bound or when every setting meets it; sorted by count, most first."""
    from vllm_hybrid_npu_lab.step_reasons import REASONS

    if result.bound is None:
        return {}
    off_by = off.get("extra_prefill_steps_by_reason", {})
    count: dict[str, int] = {}
    for c in result.valid:
        if result.eligible(c):
            continue
        by = result.result(c).get("extra_prefill_steps_by_reason", {})
        top = max(REASONS, key=lambda k: by.get(k, 0.0) - off_by.get(k, 0.0))
        count[top] = count.get(top, 0) + 1
    return dict(sorted(count.items(), key=lambda kv: (-kv[1], REASONS.index(kv[0]))))


def serve_flags(cand: Candidate, block_size: int, kv_cache_gib: float, tp: int) -> tuple[list[str], list[str]]:
    """``(flags, env)`` of ``vllm serve`` for ``cand`` at its block size (tokens).

    ``flags``: vLLM's own options (retention interval and long-prefill threshold in tokens of
    ``block_size``; ``--kv-offloading-size`` is vLLM's total over the TP ranks, so ``tp`` x the
    per-worker host tier; ``--kv-cache-memory-bytes`` is per worker); ``env``: the plugin's
    exporter switch (meaningful with vllm-hybrid-npu installed; ``auto`` is its default).
    """
    s = cand.setting
    flags = ["--enable-prefix-caching", "--mamba-cache-mode", "align",
             "--kv-cache-memory-bytes", str(int(kv_cache_gib * (1 << 30)))]
    if tp > 1:
        flags += ["--tensor-parallel-size", str(tp)]
    if s.ret is None:
        flags += ["--prefix-cache-retention-interval", "None"]
    elif s.ret:
        flags += ["--prefix-cache-retention-interval", str(s.ret * block_size)]
    if s.lpt:
        flags += ["--long-prefill-token-threshold", str(s.lpt * block_size)]
    if s.pmu is not None:
        flags += ["--prefix-match-unit", str(s.pmu)]
    if cand.host_gib:
        flags += ["--kv-offloading-size", f"{tp * cand.host_gib:g}"]
    env = [f"VLLM_HYBRID_NPU_PREFILL_CHECKPOINTS={'auto' if s.ckpt else 'off'}"]
    options = []
    if s.chunk_checkpoints == CKPT_FINAL:
        options.append(f"ckpt={CKPT_FINAL}")
    if not s.tails:
        options.append("tails=off")
    if not s.tail_split:
        options.append("tailsplit=off")
    if s.second:
        options.append("second=on")
    from vllm_hybrid_npu.patches.gdn_prefill_checkpoint import cuda_junctions_off

    if cuda_junctions_off():  # the replay modelled CUDA with vLLM's stops: so must the server
        options.append("junctions=off")
    if options:
        env.append(f"{OPTIONS_ENV}={','.join(options)}")
    return flags, env


class Replayer:
    """Replays candidates on a fixed list of requests (one budget, one model, one load)."""

    def __init__(self, requests, cfg, *, kv_cache_gib: float, tp: int, common: dict,
                 timing: dict, label: str = "", quiet: bool = False, live: bool = True) -> None:
        self.requests = requests
        self.cfg = cfg
        self.gib = kv_cache_gib
        self.tp = tp
        self.common = common
        self.timing = timing
        self.label = label
        self.quiet = quiet
        #: a progress line while replaying (off in pool workers: lines would interleave)
        self.live = live
        self.count = 0

    def __call__(self, cand: Candidate) -> dict[str, Any] | None:
        from vllm_hybrid_npu_lab.model import build_setup
        from vllm_hybrid_npu_lab.policies import get_policy, setup_kwargs
        from vllm_hybrid_npu_lab.replay import replay, stderr_progress

        pol = get_policy(cand.policy)
        try:
            setup = build_setup(
                self.cfg, tp=self.tp, kv_cache_bytes=int(self.gib * (1 << 30)),
                host_cache_bytes=int(cand.host_gib * (1 << 30)), **setup_kwargs(pol), **self.common,
            )
        except ValueError as exc:
            if "--prefix-match-unit" in str(exc):
                return None
            raise
        self.count += 1
        live = not self.quiet and self.live
        res = replay(self.requests, setup, pol.scheduler_class(), **self.timing,
                     progress=stderr_progress(f"{self.label} {cand.label}") if live else None)
        if not self.quiet and not live:
            print(f"{self.label} {cand.label}: token hit {res.token_hit_rate:.2%} "
                  f"({res.wall_s:.0f} s)", file=sys.stderr, flush=True)
        return res.to_dict()

    def caching_off(self) -> dict[str, Any]:
        """These requests under the same arrivals with prefix caching off
        (:data:`vllm_hybrid_npu_lab.policies.CACHING_OFF`; no host tier: nothing is cached): the
        reference of the extra prefill steps, whose ``shared_budget`` part every setting pays."""
        from vllm_hybrid_npu_lab.model import build_setup
        from vllm_hybrid_npu_lab.policies import CACHING_OFF, get_policy, setup_kwargs
        from vllm_hybrid_npu_lab.replay import replay, stderr_progress

        pol = get_policy(CACHING_OFF)
        setup = build_setup(self.cfg, tp=self.tp, kv_cache_bytes=int(self.gib * (1 << 30)),
                            **setup_kwargs(pol), **self.common)
        return replay(self.requests, setup, pol.scheduler_class(), **self.timing,
                      progress=None if self.quiet else stderr_progress(f"{self.label} caching off")
                      ).to_dict()

    def attention_bound(self, host_gib: float) -> dict[str, Any]:
        """The attention-only model at the same bytes (device + host), vLLM's defaults."""
        from vllm_hybrid_npu_lab.model import build_setup
        from vllm_hybrid_npu_lab.policies import get_policy
        from vllm_hybrid_npu_lab.replay import replay, stderr_progress

        setup = build_setup(self.cfg, tp=self.tp, attention_only=True,
                            kv_cache_bytes=int((self.gib + host_gib) * (1 << 30)), **self.common)
        return replay(self.requests, setup, get_policy("upstream").scheduler_class(), **self.timing,
                      progress=None if self.quiet else stderr_progress(f"{self.label} attention bound")
                      ).to_dict()


def infinite_bound_of(requests, rows: list[dict[str, Any]], carry: bool) -> dict[str, Any]:
    """The infinite-cache bound over ``requests`` at the finest hit unit of ``rows`` (the gcd of
    their block sizes and prefix-match units): no row can hit a token it does not count.
    Answers are counted with carry-over on (:func:`vllm_hybrid_npu_lab.trace.infinite_bound_tokens`)."""
    from vllm_hybrid_npu_lab.replay import output_token
    from vllm_hybrid_npu_lab.trace import answers, carried_prompts, infinite_bound_tokens

    unit = 0
    for r in rows:
        unit = math.gcd(unit, r["block_size"])
        unit = math.gcd(unit, r.get("hash_block_size") or r["block_size"])
    prompts, _ = carried_prompts(requests, output_token, carry=carry)
    cached, total = infinite_bound_tokens(prompts, unit, answers(requests, output_token))
    return {"unit": unit, "cached_prompt_tokens": cached, "prompt_tokens": total,
            "token_hit_rate": cached / total}


_POOL_REPLAYER: Replayer | None = None


def _pool_evaluate(cand: Candidate) -> dict[str, Any] | None:
    assert _POOL_REPLAYER is not None
    return _POOL_REPLAYER(cand)


def run_search(replayer: Callable[[Candidate], dict[str, Any] | None], start: Candidate,
               host_gib: float = 0.0, *, jobs: int = 1, **kw: Any) -> SearchResult:
    """:func:`search` with ``replayer`` as the evaluation, in ``jobs`` forked processes when
    ``jobs > 1`` (the settings of one search step replay side by side)."""
    if jobs <= 1:
        return search(replayer, start, host_gib, **kw)
    import multiprocessing

    global _POOL_REPLAYER
    if isinstance(replayer, Replayer):
        replayer.live = False
    _POOL_REPLAYER = replayer  # inherited by the forked workers
    try:
        with multiprocessing.get_context("fork").Pool(jobs) as pool:
            return search(replayer, start, host_gib, **kw,
                          map_fn=lambda _f, cands: pool.map(_pool_evaluate, cands, chunksize=1))
    finally:
        _POOL_REPLAYER = None


# ------------------------------------------------------------------------------------------ CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``advise`` options to ``parser``."""
    from vllm_hybrid_npu_lab.presets import (
        DEFAULT_MODEL,
        DEFAULT_STEP_MS,
        DEFAULT_UTILIZATION,
        PRESETS,
    )

    parser.add_argument("--trace", required=True, help="Mooncake-format JSONL trace")
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help=f"preset ({', '.join(PRESETS)}) or a model directory with config.json "
                        f"(default {DEFAULT_MODEL})")
    parser.add_argument("--kv-cache-gib", type=float, required=True,
                        help="KV-cache memory per worker (one TP rank), GiB")
    parser.add_argument("--host-cache-gib", type=float, default=0.0,
                        help="host tier per worker, GiB, at most (0 = none; the search tries off, "
                        "half and all of it)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    parser.add_argument("--limit", type=int, default=None, help="use only the first N requests")
    parser.add_argument("--fit-fraction", type=float, default=DEFAULT_FIT_FRACTION,
                        help="share of the requests the search sees (the first ones); the rest "
                        f"checks the winner (default {DEFAULT_FIT_FRACTION:g})")
    parser.add_argument("--max-passes", type=int, default=DEFAULT_MAX_PASSES,
                        help=f"coordinate-descent passes at most (default {DEFAULT_MAX_PASSES})")
    parser.add_argument("--starts", type=int, default=DEFAULT_STARTS,
                        help="descend from this many of the best settings of the grid (every "
                        "exporter x prefix-match unit x host tier combination; those meeting the "
                        "step bound first), and once more by hits alone from the grid's most hits "
                        f"when it is not among them (default {DEFAULT_STARTS})")
    parser.add_argument("--max-extra-steps-over-off", type=float,
                        default=DEFAULT_MAX_EXTRA_STEPS_OVER_OFF, metavar="STEPS",
                        help="the step bound: a setting is eligible only if its extra prefill "
                        "steps per prompt on the fit part are at most caching off's (replayed on "
                        "the same requests and arrivals) plus this many; the advice is the most "
                        "fit-part hits among the eligible settings, or, if none is eligible, the "
                        "fewest extra steps beyond caching off's (default "
                        f"{DEFAULT_MAX_EXTRA_STEPS_OVER_OFF:g}; inf = no bound: the most hits "
                        "whatever the steps)")
    parser.add_argument("--hit-tolerance", type=float, default=DEFAULT_HIT_TOLERANCE,
                        help="advise the fewest prefill steps per prompt among the eligible "
                        "settings whose fit-part token hit rate is within this share of the most "
                        f"an eligible one got (relative; default {DEFAULT_HIT_TOLERANCE:g}: the "
                        "most hits)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="replay the settings of one search step in this many processes "
                        "(default 1; the machine's cores at most)")
    parser.add_argument("--no-exporter", action="store_true",
                        help="search vLLM's own options only, never the plugin's GDN "
                        "prefill-checkpoint exporter (models an engine where no checkpoint is "
                        "declared, so vLLM splits every cold prompt at its last block boundary: "
                        "plain vLLM on Triton/FLA or on vLLM before 0.33, "
                        "VLLM_HYBRID_NPU_PREFILL_CHECKPOINTS=off, speculative decoding (but EAGLE/MTP on vLLM "
                        "0.30's CPU path and vllm-ascend 0.30.0rc2's paths), "
                        "vllm-ascend with PCP > 1 or on 310P; vLLM 0.33's FlashInfer GDN prefill "
                        "declares and exports its own, like the exporter). The "
                        "plugin exports on vLLM's CPU GDN function, CUDA's Triton/FLA kernels and "
                        "vllm-ascend 0.30.0rc2's three prefill paths (those replayed on CPU, not "
                        "run on an NPU)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--kernel-block-size", type=int, default=16,
                        help="the attention backend's preferred block size (16 = FlashAttention "
                        "on CUDA; 128 on NPU); also the attention bound's block size")
    parser.add_argument("--step-ms", type=float, default=DEFAULT_STEP_MS,
                        help=f"simulated fixed cost of one step, ms (default {DEFAULT_STEP_MS:g})")
    parser.add_argument("--tokens-per-s", type=float, default=None,
                        help="simulated throughput, scheduled tokens/s (default: the trace's "
                        "offered prompt tokens/s divided by --offered-load)")
    parser.add_argument("--offered-load", type=float, default=DEFAULT_UTILIZATION,
                        help="offered prompt tokens/s over the simulated throughput when "
                        f"--tokens-per-s is not given (default {DEFAULT_UTILIZATION:g})")
    parser.add_argument("--target", choices=TARGETS, default="cuda", help=TARGET_HELP)
    add_speculative_argument(parser)
    parser.add_argument("--no-carry", action="store_true",
                        help="do not carry an earlier turn's answer into the next prompt")
    parser.add_argument("--host-link-gbps", type=float, default=50.0,
                        help="device<->host bandwidth per direction, GB/s (default 50)")
    parser.add_argument("--host-link-latency-us", type=float, default=10.0,
                        help="fixed cost of one host transfer job, microseconds (default 10)")
    parser.add_argument("--audit", action="store_true",
                        help="also search the check part itself (in-sample; about doubles the "
                             "time) and report the advised setting's share of the best setting "
                             "found there among those meeting the step bound on the check part "
                             "(the issue-20 yardstick, target 0.95), and the unconstrained best")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--plot", metavar="FILE.png", default=None, help="draw the search and the check")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")


def _validate(args: argparse.Namespace) -> None:
    from vllm_hybrid_npu_lab.host_tier import HostLink

    check_speculative(args.speculative_tokens)
    if not args.kv_cache_gib > 0:
        raise ValueError(f"--kv-cache-gib must be > 0, got {args.kv_cache_gib}")
    if args.host_cache_gib < 0:
        raise ValueError(f"--host-cache-gib must be >= 0, got {args.host_cache_gib}")
    if args.tp < 1:
        raise ValueError(f"--tp must be >= 1, got {args.tp}")
    if args.limit is not None and args.limit < 2:
        raise ValueError(f"--limit must be >= 2 (a fit and a check part), got {args.limit}")
    if not 0 < args.fit_fraction < 1:
        raise ValueError(f"--fit-fraction must be in (0, 1), got {args.fit_fraction}")
    if args.jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {args.jobs}")
    if args.max_passes < 1:
        raise ValueError(f"--max-passes must be >= 1, got {args.max_passes}")
    if args.starts < 1:
        raise ValueError(f"--starts must be >= 1, got {args.starts}")
    if not 0 <= args.hit_tolerance < 1:
        raise ValueError(f"--hit-tolerance must be in [0, 1), got {args.hit_tolerance}")
    if not args.max_extra_steps_over_off >= 0:  # NaN fails too
        raise ValueError("--max-extra-steps-over-off must be >= 0 (inf: no bound), got "
                         f"{args.max_extra_steps_over_off}")
    if args.tokens_per_s is not None and not args.tokens_per_s > 0:
        raise ValueError(f"--tokens-per-s must be > 0, got {args.tokens_per_s}")
    if not args.offered_load > 0:
        raise ValueError(f"--offered-load must be > 0, got {args.offered_load}")
    if args.step_ms < 0:
        raise ValueError(f"--step-ms must be >= 0, got {args.step_ms}")
    HostLink(args.host_link_gbps, args.host_link_latency_us)
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ValueError("--plot needs matplotlib: pip install matplotlib") from None


def _rate(requests) -> float:
    span = (requests[-1].timestamp_ms - requests[0].timestamp_ms) / 1000.0
    return sum(r.input_length for r in requests) / span if span > 0 else 0.0


def advise(args: argparse.Namespace) -> dict[str, Any]:
    """Run the search and the check; return the report (see ``docs/hitrate-guide.md``)."""
    from vllm_hybrid_npu_lab.host_tier import HostLink
    from vllm_hybrid_npu_lab.presets import resolve_model
    from vllm_hybrid_npu_lab.trace import read_trace

    model_name, cfg = resolve_model(args.model)
    requests = read_trace(args.trace, args.limit)
    if len(requests) < 2:
        raise ValueError(f"--trace {args.trace!r}: needs at least 2 requests (fit and check)")
    n_fit = min(len(requests) - 1, max(1, round(len(requests) * args.fit_fraction)))
    fit, check = requests[:n_fit], requests[n_fit:]
    offered = _rate(requests)
    rate = args.tokens_per_s or (offered / args.offered_load if offered > 0 else 40000.0)
    common = dict(
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        max_model_len=max(r.input_length + r.output_length for r in requests),
        kernel_block_size=args.kernel_block_size,
        speculative_tokens=args.speculative_tokens,
        exporter_target=args.target,
    )
    timing = dict(step_ms=args.step_ms, tokens_per_s=rate, carry_outputs=not args.no_carry,
                  link=HostLink(args.host_link_gbps, args.host_link_latency_us), target=args.target)
    tag = f"{model_name} tp{args.tp} {args.kv_cache_gib:g} GiB" + (
        f" +host {args.host_cache_gib:g}" if args.host_cache_gib else "")
    fit_replayer = Replayer(fit, cfg, kv_cache_gib=args.kv_cache_gib, tp=args.tp, common=common,
                            timing=timing, label=f"{tag} fit", quiet=args.quiet)
    start = Candidate(UpstreamSetting(), args.host_cache_gib)
    # the step bound's reference: caching off on the fit part, same arrivals
    fit_off = fit_replayer.caching_off()
    margin = args.max_extra_steps_over_off
    bound = StepBound(fit_off["extra_prefill_steps_per_prompt"], margin)
    result = run_search(fit_replayer, start, args.host_cache_gib, jobs=args.jobs,
                        exporter=not args.no_exporter, max_passes=args.max_passes,
                        starts=args.starts, bound=bound, final=final_available(),
                        optins=optins_available(),
                        second=second_available(args.target, bool(args.host_cache_gib)))
    most = result.best  # the most fit-part hits, whatever the steps
    best = choose(result, args.hit_tolerance)  # the advice: most hits within the step bound
    check_replayer = Replayer(check, cfg, kv_cache_gib=args.kv_cache_gib, tp=args.tp,
                              common=common, timing=timing, label=f"{tag} check", quiet=args.quiet)
    advised = check_replayer(best)
    default = advised if best == start else check_replayer(start)
    most_check = {best: advised, start: default}.get(most) or check_replayer(most)
    # vLLM's split at its best on the fit part (none with --no-exporter: the advice is one)
    split = None if args.no_exporter else result.best_split()
    split_check = (None if split is None else
                   {best: advised, start: default, most: most_check}.get(split)
                   or check_replayer(split))
    attention = check_replayer.attention_bound(args.host_cache_gib)
    off = check_replayer.caching_off()
    check_bound = StepBound(off["extra_prefill_steps_per_prompt"], margin)
    # every row the report prints, the attention bound's 16-token blocks included (over the
    # advised and default rows alone it could come out below the attention bound)
    infinite = infinite_bound_of(check, [advised, default, most_check, attention]
                                 + ([split_check] if split_check else []),
                                 carry=not args.no_carry)
    block = advised["block_size"]
    flags, env = serve_flags(best, block, args.kv_cache_gib, args.tp)
    replay_cmd = (f"vllm-hybrid-npu-lab hitrate --trace CHECK_PART --model {args.model} "
                  f"--tp {args.tp} --kv-cache-gib {args.kv_cache_gib:g} --policy {best.policy}"
                  + (f" --host-cache-gib {best.host_gib:g}" if best.host_gib else "")
                  + f" --tokens-per-s {rate:.0f}" + (" --no-carry" if args.no_carry else "")
                  + (f" --target {args.target}" if args.target != "cuda" else "")
                  + (f" --speculative-tokens {args.speculative_tokens}"
                     if args.speculative_tokens else ""))
    check_replays = check_replayer.count  # advised, defaults, most-hits and split rows (distinct)

    audit = None
    if args.audit:
        audit = audit_check(check_replayer, start, best, advised, default, args,
                            known={best: advised, start: default, most: most_check,
                                   **({split: split_check} if split is not None else {})},
                            bound=check_bound)

    def row(r: dict[str, Any]) -> dict[str, Any]:
        return {**{k: r[k] for k in ("token_hit_rate", "request_hit_rate", "block_size",
                                     "prefill_steps_per_prompt", "extra_prefill_steps_per_prompt",
                                     "extra_prefill_steps_by_reason",
                                     "host_cached_prompt_tokens", "prompt_tokens",
                                     "cached_prompt_tokens", "busy_fraction", "preemptions")},
                "extra_prefill_steps_beyond_off": check_bound.beyond(r),
                "meets_step_bound": check_bound.eligible(r)}

    def fit_row(c: Candidate) -> dict[str, Any]:
        r = result.result(c)
        return {"policy": c.policy, "host_cache_gib": c.host_gib,
                "token_hit_rate": r["token_hit_rate"],
                "prefill_steps_per_prompt": r["prefill_steps_per_prompt"],
                "extra_prefill_steps_per_prompt": r["extra_prefill_steps_per_prompt"],
                "extra_prefill_steps_by_reason": r["extra_prefill_steps_by_reason"],
                "extra_prefill_steps_beyond_off": bound.beyond(r),
                "eligible": bound.eligible(r)}

    source = str(cfg.get("source", ""))
    m = re.match(r"https://huggingface\.co/([^/]+/[^/]+)/", source)
    cost = {
        "fit_replays": result.replays + 1,  # + caching off (the step bound's reference)
        "check_replays": check_replays + 2,  # + the attention bound and caching off
        "audit_replays": audit["new_replays"] if audit else 0,
    }
    cost["total_replays"] = sum(cost.values())
    return {
        "model": model_name,
        "serve_model": m.group(1) if m else args.model,
        "tp": args.tp,
        "kv_cache_gib": args.kv_cache_gib,
        "host_cache_gib": best.host_gib,
        "host_cache_gib_max": args.host_cache_gib,
        "flags": flags,
        "env": env,
        "policy": best.policy,
        "block_size": block,
        "replay_command": replay_cmd,
        "hit_tolerance": args.hit_tolerance,
        "step_bound": {
            **bound.to_dict(),
            "any_eligible": result.n_eligible > 0,
            "eligible_settings": result.n_eligible,
            "searched_settings": result.replays,
            "advised_eligible": result.eligible(best),
            "failed_by_reason": failure_reasons(result, fit_off),
            "check": check_bound.to_dict(),
        },
        "token_hit_rate": advised["token_hit_rate"],
        "request_hit_rate": advised["request_hit_rate"],
        "prefill_steps_per_prompt": advised["prefill_steps_per_prompt"],
        "extra_prefill_steps_per_prompt": advised["extra_prefill_steps_per_prompt"],
        "extra_prefill_steps_beyond_off": check_bound.beyond(advised),
        "upstream_default": default["token_hit_rate"],
        "upstream_default_request_hit_rate": default["request_hit_rate"],
        "attention_bound": attention["token_hit_rate"],
        "infinite_bound": infinite["token_hit_rate"],
        "infinite": infinite,
        "advised": row(advised),
        "default": row(default),
        "most_hits": None if most == best else {"policy": most.policy,
                                                 "host_cache_gib": most.host_gib,
                                                 **row(most_check)},
        "best_without_exporter": None if split is None else {
            "policy": split.policy, "host_cache_gib": split.host_gib, **row(split_check)},
        "attention": row(attention),
        "caching_off": row(off),
        "fit": {
            "requests": [1, n_fit],
            "token_hit_rate": result.result(best)["token_hit_rate"],
            "prefill_steps_per_prompt": result.result(best)["prefill_steps_per_prompt"],
            "extra_prefill_steps_per_prompt": result.result(best)["extra_prefill_steps_per_prompt"],
            "extra_prefill_steps_beyond_off": bound.beyond(result.result(best)),
            "advised": fit_row(best),
            "upstream_default": result.result(start)["token_hit_rate"],
            "upstream_default_prefill_steps_per_prompt":
                result.result(start)["prefill_steps_per_prompt"],
            "default": fit_row(start),
            "most_hits": fit_row(most),
            "best_without_exporter": None if split is None else fit_row(split),
            "caching_off": {k: fit_off[k] for k in ("prefill_steps_per_prompt",
                                                    "extra_prefill_steps_per_prompt",
                                                    "extra_prefill_steps_by_reason")},
            "passes": result.passes,
            "replays": result.replays,  # settings searched (caching off not counted)
            "search": result.cost(),
            "searched": result.table(),
        },
        "check": {"requests": [n_fit + 1, len(requests)], "replays": check_replays + 2},
        "search_cost": cost,
        "audit": audit,
        "tokens_per_s": rate,
        "offered_prompt_tokens_per_s": offered,
        "step_ms": args.step_ms,
        "carry_outputs": not args.no_carry,
        "target": args.target,
        "speculative_tokens": args.speculative_tokens,
        "num_requests": len(requests),
    }


#: the share of the best setting found on the check part that the advised one must reach
#: (issue 20's done-when: within 5%)
AUDIT_TARGET = 0.95


def audit_check(check_replayer: "Replayer", start: Candidate, advised_cand: Candidate,
                advised: dict[str, Any], default: dict[str, Any],
                args: argparse.Namespace,
                known: dict[Candidate, dict[str, Any] | None] | None = None,
                bound: StepBound | None = None) -> dict[str, Any]:
    """Search the check part itself (the same search, in-sample) and compare.

    The settings compared are this search's and the ``known`` check-part replays (the advised
    setting, vLLM's defaults, the most fit hits: a search need not revisit them). The *best* is
    what :func:`choose` (with ``args.hit_tolerance``) picks among them under ``bound`` (the step
    bound with caching off's extra steps on the check part): the most hits among the settings
    that meet it or, if none does, the fewest extra steps beyond caching off's. The
    *unconstrained best* is the most hits whatever the steps.

    Returns a dict (rates are token hit rates on the check part; steps per prompt):
    ``best_policy`` (str), ``best_host_cache_gib`` (float), ``best_token_hit_rate``,
    ``best_prefill_steps_per_prompt``, ``best_extra_prefill_steps_beyond_off``,
    ``best_meets_step_bound`` (bool: False when no setting meets it on the check part),
    ``eligible_settings`` (int), ``advised_over_best`` and ``default_over_best`` (1.0 when every
    rate is 0), ``advised_extra_prefill_steps_beyond_off``, ``advised_meets_step_bound`` (bool),
    ``advised_at_least_default`` (bool), ``unconstrained_best`` (``policy``,
    ``host_cache_gib``, ``token_hit_rate``, ``prefill_steps_per_prompt``,
    ``extra_prefill_steps_beyond_off``, ``meets_step_bound``), ``advised_over_unconstrained_best``,
    ``best_without_exporter`` (the most hits among the settings without the exporter that meet
    the bound, or, when none does, among all without it; same keys; ``None`` when none was
    replayed), ``target`` (:data:`AUDIT_TARGET`), ``met`` (bool: ``advised_over_best`` >=
    target), ``replays`` (settings the search evaluated, ``known`` ones included),
    ``new_replays`` (replays it ran), ``search`` (its :meth:`SearchResult.cost`) and ``searched``
    (its table).
    """
    known = dict(known or {})
    res = run_search(check_replayer, start, args.host_cache_gib, jobs=args.jobs,
                     exporter=not args.no_exporter, max_passes=args.max_passes,
                     starts=args.starts, known=known, bound=bound, final=final_available(),
                     optins=optins_available(),
                     second=second_available(args.target, bool(args.host_cache_gib)))
    replays = res.replays
    new_replays = replays - sum(1 for c, r in known.items() if r is not None and c in res.evaluated)
    every = res.merged({advised_cand: advised, start: default, **known})
    best = choose(every, args.hit_tolerance)
    best_r = every.result(best)
    top = every.best
    beyond = every.beyond_off

    def share(rate: float, of: float) -> float:
        return rate / of if of > 0 else 1.0

    def summary(c: Candidate) -> dict[str, Any]:
        r = every.result(c)
        return {"policy": c.policy, "host_cache_gib": c.host_gib,
                "token_hit_rate": r["token_hit_rate"],
                "prefill_steps_per_prompt": r["prefill_steps_per_prompt"],
                "extra_prefill_steps_beyond_off": beyond(c), "meets_step_bound": every.eligible(c)}

    split_best = every.best_split()
    best_rate = best_r["token_hit_rate"]
    ratio = share(advised["token_hit_rate"], best_rate)
    return {
        "best_policy": best.policy,
        "best_host_cache_gib": best.host_gib,
        "best_token_hit_rate": best_rate,
        "best_prefill_steps_per_prompt": best_r["prefill_steps_per_prompt"],
        "best_extra_prefill_steps_beyond_off": beyond(best),
        "best_meets_step_bound": every.eligible(best),
        "eligible_settings": every.n_eligible,
        "step_bound": bound.to_dict() if bound is not None else None,
        "advised_over_best": ratio,
        "default_over_best": share(default["token_hit_rate"], best_rate),
        "advised_extra_prefill_steps_beyond_off": beyond(advised_cand),
        "advised_meets_step_bound": every.eligible(advised_cand),
        "advised_at_least_default": advised["token_hit_rate"] >= default["token_hit_rate"],
        "unconstrained_best": summary(top),
        "advised_over_unconstrained_best": share(advised["token_hit_rate"],
                                                 every.result(top)["token_hit_rate"]),
        "best_without_exporter": summary(split_best) if split_best is not None else None,
        "target": AUDIT_TARGET,
        "met": ratio >= AUDIT_TARGET,
        "replays": replays,
        "new_replays": new_replays,
        "search": res.cost(),
        "searched": res.table(),
    }


def _name(r: dict[str, Any]) -> str:
    return r["policy"] + (f" +host {r['host_cache_gib']:g}" if r.get("host_cache_gib") else "")


def _versus_bound(beyond: float, bound: dict[str, Any]) -> str:
    """``+0.06 beyond off, over by 0.01`` style text for a row and the bound's dict."""
    txt = f"{beyond:+.2f} beyond off"
    if bound["margin"] is None:
        return txt
    over = beyond - bound["margin"]
    return txt + (f", over by {over:.2f}" if over > _BOUND_EPS else ", within")


def format_report(rep: dict[str, Any]) -> str:
    """Human-readable advice (hits and prefill steps per prompt side by side, the step bound and
    which settings meet it, the extra steps by reason with caching off's, the search's cost)."""
    from vllm_hybrid_npu_lab.step_reasons import LABELS, format_reasons

    fit, check = rep["fit"], rep["check"]
    host = f" + {rep['host_cache_gib_max']:g} GiB host" if rep["host_cache_gib_max"] else ""
    sc = fit["search"]
    cost = rep["search_cost"]
    grid = " x ".join({"ckpt": "exporter", "pmu": "prefix-match unit", "host": "host tier"}[a]
                      for a in sc["grid_axes"])
    most = fit["most_hits"]
    tol = rep["hit_tolerance"]
    sb = rep["step_bound"]
    adv = fit["advised"]
    if sb["margin"] is None:
        bound_line = (f"step bound: none (--max-extra-steps-over-off inf); caching off's extra "
                      f"prefill steps/prompt on the fit part {sb['caching_off_extra']:.2f}")
    else:
        bound_line = (f"step bound: extra prefill steps/prompt at most caching off's + "
                      f"{sb['margin']:g} (fit part: {sb['caching_off_extra']:.2f} + {sb['margin']:g}"
                      f" = {sb['limit']:.2f}); {sb['eligible_settings']} of "
                      f"{sb['searched_settings']} searched settings meet it")
    if sb["any_eligible"]:
        how = ("the most hits among them" if tol == 0 else
               f"the fewest prefill steps within {tol:.0%} of the most hits among them")
    else:
        how = ("NONE meets the bound: advised the fewest extra steps beyond caching off's "
               "(see the reasons below)")
    lines = [
        f"{rep['model']} tp{rep['tp']}, {rep['kv_cache_gib']:g} GiB KV per worker{host}"
        + (f", MTP drafter with {rep['speculative_tokens']} speculative tokens"
           if rep.get("speculative_tokens") else "") + "; "
        f"searched {fit['replays']} settings on requests {fit['requests'][0]}-{fit['requests'][1]} "
        f"(every {grid} combination: {sc['grid']}, then coordinate descent from "
        f"{len(sc['starts'])} of them"
        + (f", then ckpt=final beside the exporter's best: {sc['final']}" if sc.get("final") else "")
        + (f", then the runtime's opt-ins beside its best with a prefix-match unit: {sc['optins']}"
           if sc.get("optins") else "")
        + "), checked on requests "
        f"{check['requests'][0]}-{check['requests'][1]}",
        bound_line,
        f"fit part: advised ({how}) {adv['token_hit_rate']:.2%} at "
        f"{adv['prefill_steps_per_prompt']:.2f} prefill steps/prompt "
        f"({_versus_bound(adv['extra_prefill_steps_beyond_off'], sb)}); most hits "
        f"{most['token_hit_rate']:.2%} at {most['prefill_steps_per_prompt']:.2f} "
        f"({_name(most)}, {_versus_bound(most['extra_prefill_steps_beyond_off'], sb)}); "
        f"vLLM's defaults {fit['default']['token_hit_rate']:.2%} at "
        f"{fit['default']['prefill_steps_per_prompt']:.2f} "
        f"({_versus_bound(fit['default']['extra_prefill_steps_beyond_off'], sb)})",
    ]
    if sb["failed_by_reason"]:
        lines.append("over the bound, by the reason with the most extra steps beyond caching "
                     "off's: " + ", ".join(f"{LABELS[k]} {n}"
                                           for k, n in sb["failed_by_reason"].items()))
    if not sb["any_eligible"] or sb["failed_by_reason"]:
        fit_rows = [("advised", adv)]
        if (most["policy"], most["host_cache_gib"]) != (adv["policy"], adv["host_cache_gib"]):
            fit_rows.append(("most fit hits", most))
        for name, r in (("vLLM defaults", fit["default"]),
                        ("best w/o exporter", fit.get("best_without_exporter"))):
            if r and all((r["policy"], r["host_cache_gib"]) != (x["policy"], x["host_cache_gib"])
                         for _, x in fit_rows):
                fit_rows.append((name, r))
        lines.append("")
        lines += [line.replace("extra steps by reason", "fit part: extra steps")
                  for line in format_reasons(fit_rows, fit["caching_off"])]
    lines += [
        "",
        f"vllm serve {rep.get('serve_model', 'MODEL')} " + " ".join(rep["flags"]),
        "  with vllm-hybrid-npu installed: " + " ".join(rep["env"]),
        f"  lab policy: {rep['policy']}" + (f" with --host-cache-gib {rep['host_cache_gib']:g}"
                                             if rep["host_cache_gib"] else "")
        + f" (block {rep['block_size']} tokens)",
        "",
        f"check part            {'tok hit':>8} {'req hit':>8} {'prefill steps/prompt':>21} "
        f"{'extra':>6}",
    ]
    rows = [("advised", rep["advised"]), ("vLLM defaults", rep["default"])]
    mh = rep.get("most_hits")
    shown = {(rep["policy"], rep["host_cache_gib"]), ("upstream", rep["host_cache_gib_max"])}
    if mh and (mh["policy"], mh["host_cache_gib"]) not in shown:
        rows.insert(1, ("most fit hits", mh))  # (unless it is vLLM's defaults' row)
        shown.add((mh["policy"], mh["host_cache_gib"]))
    sp = rep.get("best_without_exporter")
    if sp and (sp["policy"], sp["host_cache_gib"]) not in shown:
        rows.insert(len(rows) - 1, ("best w/o exporter", sp))  # vLLM's split at its best (fit)
    for name, r in rows:
        lines.append(f"{name:<21} {r['token_hit_rate']:>8.2%} {r['request_hit_rate']:>8.2%} "
                     f"{r['prefill_steps_per_prompt']:>21.2f} "
                     f"{r['extra_prefill_steps_per_prompt']:>6.2f}")
    a = rep["attention"]
    lines.append(f"{'attention bound':<21} {a['token_hit_rate']:>8.2%} {a['request_hit_rate']:>8.2%} "
                 f"{'-':>21} {'-':>6}")
    lines.append(f"{'infinite bound':<21} {rep['infinite_bound']:>8.2%} {'-':>8} {'-':>21} "
                 f"{'-':>6}  (at {rep['infinite']['unit']}-token units)")
    if "caching_off" in rep:
        lines.append("")
        lines += format_reasons(rows + [("attention bound", a)], rep["caching_off"])
        cb = sb.get("check")
        if cb and cb["margin"] is not None:
            lines.append(f"step bound on the check part: caching off's {cb['caching_off_extra']:.2f}"
                         f" + {cb['margin']:g} = {cb['limit']:.2f}: " + "; ".join(
                             f"{name} {_versus_bound(r['extra_prefill_steps_beyond_off'], cb)}"
                             for name, r in rows))
        lines.append("")
    au = rep.get("audit")
    if au:
        ub, wx = au["unconstrained_best"], au.get("best_without_exporter")
        host = f" +host {au['best_host_cache_gib']:g}" if au["best_host_cache_gib"] else ""
        which = ("best meeting the step bound" if au["best_meets_step_bound"] else
                 "NO setting meets the step bound there; best by the advice's rule (fewest extra "
                 "steps beyond off)")
        cb = au.get("step_bound") or {"margin": None}
        lines.append(
            f"audit (the same search on the check part, {au['replays']} settings, "
            f"{au['eligible_settings']} meeting the step bound): {which} "
            f"{au['best_token_hit_rate']:.2%} at {au['best_prefill_steps_per_prompt']:.2f} "
            f"prefill steps/prompt ({au['best_policy']}{host}, "
            f"{_versus_bound(au['best_extra_prefill_steps_beyond_off'], cb)}); "
            f"advised / best {au['advised_over_best']:.3f} "
            f"({'met' if au['met'] else 'missed'}: target {au['target']:.2f}), "
            f"vLLM defaults / best {au['default_over_best']:.3f}")
        lines.append(
            f"  unconstrained best {ub['token_hit_rate']:.2%} at "
            f"{ub['prefill_steps_per_prompt']:.2f} ({_name(ub)}, "
            f"{_versus_bound(ub['extra_prefill_steps_beyond_off'], cb)}): advised / it "
            f"{au['advised_over_unconstrained_best']:.3f}"
            + (f"; best without the exporter {wx['token_hit_rate']:.2%} ({_name(wx)}, "
               f"{_versus_bound(wx['extra_prefill_steps_beyond_off'], cb)})" if wx else ""))
    lines.append(f"cost: {cost['total_replays']} replays ({cost['fit_replays']} fit, "
                 f"{cost['check_replays']} check" + (f", {cost['audit_replays']} audit"
                                                     if cost["audit_replays"] else "") + ")")
    lines.append("")
    lines.append("replay: " + rep["replay_command"])
    return "\n".join(lines)


def plot(rep: dict[str, Any], path: str) -> None:
    """Bars: every searched setting on the fit part (green where it meets the step bound); the
    check part's rows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    searched = sorted(rep["fit"]["searched"], key=lambda r: r["token_hit_rate"])
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, max(3.5, 0.22 * len(searched) + 1)),
                                 gridspec_kw={"width_ratios": [3, 2]})
    names = [r["policy"].replace("upstream:", "") + (f" +host {r['host_cache_gib']:g}"
                                                    if r["host_cache_gib"] else "") for r in searched]
    a1.barh(names, [100 * r["token_hit_rate"] for r in searched],
            color=["C2" if r.get("eligible", True) else "C0" for r in searched])
    a1.set_xlabel("token hit rate, fit part (%; green: meets the step bound)")
    a1.tick_params(axis="y", labelsize=7)
    rows = {"advised": rep["token_hit_rate"], "vLLM defaults": rep["upstream_default"],
            "attention bound": rep["attention_bound"], "infinite bound": rep["infinite_bound"]}
    a2.bar(list(rows), [100 * v for v in rows.values()], color=["C2", "C1", "C7", "C7"])
    for i, v in enumerate(rows.values()):
        a2.text(i, 100 * v, f"{100 * v:.1f}%", ha="center", va="bottom", fontsize=8)
    a2.set_ylabel("token hit rate, check part (%)")
    a2.tick_params(axis="x", labelsize=8, rotation=20)
    fig.suptitle(f"{rep['model']} tp{rep['tp']} {rep['kv_cache_gib']:g} GiB"
                 + (f" + {rep['host_cache_gib_max']:g} GiB host" if rep["host_cache_gib_max"] else "")
                 + f": advised {rep['policy']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    """Run ``advise``; return 0, or 2 after printing a clear error for bad input."""
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    try:
        _validate(args)
        rep = advise(args)
    except ValueError as exc:
        print(f"vllm-hybrid-npu-lab advise: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(rep, indent=2) if args.json else format_report(rep))
    if args.plot:
        plot(rep, args.plot)
        if not args.quiet:
            print(f"plot written to {args.plot}", file=sys.stderr)
    return 0
