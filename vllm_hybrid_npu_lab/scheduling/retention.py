"""Which GDN states a hybrid keeps, and in which order its blocks are evicted (policy ``lean``).

Pure, target-independent logic (no vLLM, no torch). Positions are token counts (``int``),
``block_size`` is the hybrid block size in tokens; block index ``i`` covers tokens
``[i * block_size, (i + 1) * block_size)`` and "a state at block ``i``" is the recurrent state
after token ``(i + 1) * block_size`` (what vLLM 0.30's ``MambaManager`` stores in the request's
block ``i`` in align mode).

Measured on the hit-rate lab (docs/first-repeat-hits.md, "Where the gap comes from"): with the
policies of :mod:`.split`, most cached attention blocks in the free pool were *orphans* (no
state at or past them, so no hit can use them) because (1) vLLM frees a finished request's GDN
groups before its attention group, so LRU evicts the states first, and (2) the state at the
prompt's last boundary is released to the free queue when decode moves on, long before the
request's attention blocks, and is evicted while the request still runs. Dense retention
(the retired ``tail``/``adaptive``, lab only since 2026-11-23) instead fills the pool with states
nobody reuses. The ``lean`` policy:

* **states kept**: the prompt's last ``window`` block boundaries (the last one is vLLM's replay
  boundary; the others cover later prompts that share all but the end of this one), the
  boundaries crossed during decode (a follow-up turn resumes at the latest), vLLM's
  shared-prefix junctions, and optionally the power-of-two ladder (1, 2, 4, ... blocks below the
  last boundary; the lab's ``lean-ladder`` lever); everything else stays request-local (vLLM's
  ``prefix_cache_retention_interval=0``). Ladder states never hit and decode states below the
  latest are *low value*: they leave the cache first among the request's blocks;
* **hold** (an option, off in ``lean``: it cost more pages than it saved in the lab): a kept
  state the request no longer needs for its own computation stays referenced by the request
  until the request is freed, instead of entering the LRU queue on its own;
* **eviction order** (:func:`eviction_order`): when a request is freed, its cached blocks enter
  the free queue as segments, each kept state directly before the attention blocks that only it
  makes usable, tail segment first, and attention blocks past the last kept state (orphans) at
  the very front of the queue.
"""

from __future__ import annotations

from typing import Iterable


def _check(name: str, value: int, minimum: int) -> None:
    if not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def ladder_boundaries(last_boundary: int, block_size: int) -> list[int]:
    """Boundaries of the power-of-two ladder below ``last_boundary`` (tokens): the chunk ends of
    the retired ``adaptive`` policy, used by ``lean`` only with ``ladder`` (the lab's
    ``lean-ladder`` lever).

    ``block_size * 2**k`` for ``k >= 0`` strictly below ``last_boundary``, increasing.
    """
    _check("last_boundary", last_boundary, 0)
    _check("block_size", block_size, 1)
    out, blocks = [], 1
    while blocks * block_size < last_boundary:
        out.append(blocks * block_size)
        blocks *= 2
    return out


def window_boundaries(num_prompt_tokens: int, block_size: int, window: int) -> list[int]:
    """The prompt's last ``window`` block boundaries that lie inside the prompt (tokens, > 0).

    The last one is ``num_prompt_tokens // block_size * block_size``; a prompt shorter than one
    block has none. Increasing order.

    Raises:
        ValueError: ``window < 1`` or other out-of-range arguments.
    """
    _check("num_prompt_tokens", num_prompt_tokens, 0)
    _check("block_size", block_size, 1)
    _check("window", window, 1)
    last = num_prompt_tokens // block_size * block_size
    return [b for b in range(last - (window - 1) * block_size, last + 1, block_size) if b > 0]


def kept_boundaries(
    num_prompt_tokens: int,
    num_tokens: int,
    block_size: int,
    window: int,
    ladder: bool,
) -> list[int]:
    """Token positions whose state ``lean`` keeps in the prefix cache (besides vLLM's junctions).

    Args:
        num_prompt_tokens: prompt length (tokens).
        num_tokens: prompt + output tokens so far; past the prompt, the latest boundary crossed
            in decode (``num_tokens // block_size * block_size``) is kept too (called as decode
            proceeds, this keeps every boundary decode crosses).
        block_size: hybrid block size (tokens).
        window: how many of the prompt's last boundaries to keep (>= 1).
        ladder: also keep the power-of-two ladder's boundaries (:func:`ladder_boundaries`).

    Returns:
        Sorted distinct positions, all multiples of ``block_size`` and > 0.
    """
    _check("num_tokens", num_tokens, num_prompt_tokens)
    out = set(window_boundaries(num_prompt_tokens, block_size, window))
    last = num_prompt_tokens // block_size * block_size
    if ladder:
        out.update(ladder_boundaries(last, block_size))
    decode = num_tokens // block_size * block_size
    if decode > last:
        out.add(decode)
    return sorted(out)


def extra_stops(
    start: int,
    num_new_tokens: int,
    prefill_end: int,
    block_size: int,
    window: int,
    ladder: bool,
) -> int:
    """Shorten a prefill chunk so that it ends at the next boundary whose state ``lean`` keeps.

    Same contract as :func:`.split.policy_chunk_tokens` (applied after vLLM's own align-mode
    split, never lengthens the chunk, decode and chunks without a stop inside are unchanged).
    The stops are the prompt's last ``window`` boundaries below the last one (vLLM already
    stops at the last) and, with ``ladder``, the power-of-two ladder.

    Returns:
        Tokens to schedule, ``0 < result <= num_new_tokens`` (0 stays 0).
    """
    _check("start", start, 0)
    _check("num_new_tokens", num_new_tokens, 0)
    _check("prefill_end", prefill_end, 0)
    if num_new_tokens == 0 or start >= prefill_end:
        return num_new_tokens
    end = min(start + num_new_tokens, prefill_end)
    last = prefill_end // block_size * block_size
    stops = window_boundaries(prefill_end, block_size, window)[:-1]
    if ladder:
        stops += ladder_boundaries(last, block_size)
    inside = [s for s in stops if start < s < end]
    return min(inside) - start if inside else num_new_tokens


def eviction_order(
    num_blocks: int, state_blocks: Iterable[int], low_value: Iterable[int] = ()
) -> tuple[list[int], list[tuple[str, int]]]:
    """Order in which a freed request's cached blocks should be evicted (first = first out).

    Args:
        num_blocks: the request's attention blocks (indices ``0 .. num_blocks - 1``).
        state_blocks: block indices holding a kept state (a state at block ``i`` makes attention
            blocks ``0 .. i`` usable); indices ``>= num_blocks`` are ignored.
        low_value: indices of ``state_blocks`` below the highest one whose state is unlikely to
            be reused (a ladder state never hit): listed first in ``segments``,
            shallowest first, and not used to delimit segments.

    Returns:
        ``(orphans, segments)``: ``orphans`` = attention block indices past the last state,
        tail first (to be evicted before anything else in the pool); ``segments`` = the rest as
        ``("state", i)`` / ``("attn", i)`` in eviction order: the ``low_value`` states, then the
        highest state, the attention blocks only it covers (tail first), the next state, ...,
        ending with block 0. Every index of ``0 .. num_blocks - 1`` appears once as ``"attn"``
        or in ``orphans``, every state once.
    """
    _check("num_blocks", num_blocks, 0)
    states = sorted({s for s in state_blocks if 0 <= s < num_blocks}, reverse=True)
    top = states[0] if states else -1
    orphans = list(range(num_blocks - 1, top, -1))
    low = sorted({s for s in low_value if s in states and s != top})
    segments: list[tuple[str, int]] = [("state", s) for s in low]
    states = [s for s in states if s not in low]
    for k, s in enumerate(states):
        low = states[k + 1] if k + 1 < len(states) else -1
        segments.append(("state", s))
        segments.extend(("attn", i) for i in range(s, low, -1))
    return orphans, segments
