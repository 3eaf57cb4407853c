"""Where a prefill chunk is cut so that recurrent-state checkpoints land on block boundaries.

Pure, target-independent functions (no vLLM, no torch): positions and lengths are token counts
(``int``), ``block_size`` is the hybrid block size in tokens (the Mamba/GDN state is stored once
per block in align mode).

Background (vLLM 0.30.0 and 0.32.0, ``vllm/v1/core/sched/scheduler.py``,
``Scheduler._mamba_block_aligned_split``): in align mode a GDN/Mamba state is written only where
a scheduling step *ends*, and that step end must be a block boundary to be cacheable. Upstream
already ends a prefill at the prompt's last block boundary (``last_cache_position``), at a
detected shared-prefix junction and at the chunk-size limit. A prompt that fits one chunk
therefore leaves exactly one reusable state: at its last block boundary. A later request that
shares only a shorter prefix (a system prompt followed by a different user message) finds no
state at or below its shared prefix and misses; vLLM notices the junction then and checkpoints
it, so only the third request hits.

The policies here add more chunk ends (``checkpoint stops``) during prefill; they never lengthen
a chunk, so every upstream stop (junction, tail boundary, chunk limit, spec-decode lookahead)
is kept:

* ``upstream``: no extra stop.
* ``tail``: a stop at every block boundary of the prefill (chunks are whole blocks except the
  last one); every block-aligned prefix of the prompt gets a state on first sight.
* ``lean``: the stops of :func:`.retention.extra_stops` (the prompt's last two block
  boundaries, no ladder); its retention and eviction order are in :mod:`.retention` and
  :mod:`.lean`.
* ``adaptive``: stops at block boundaries that are a power-of-two number of blocks
  (1, 2, 4, 8, ... blocks) below the prompt's last block boundary: a prompt of ``n`` blocks takes
  about ``log2(n)`` extra steps instead of ``n``, and a later request sharing ``k >= 1`` blocks
  hits at least ``k/2`` of them (rounded down to a power of two) on its first repeat.
"""

from __future__ import annotations

POLICY_NAMES: tuple[str, ...] = ("upstream", "tail", "adaptive", "lean")

#: ``lean``'s stops (:mod:`.retention`): the prompt's last ``LEAN_WINDOW`` block boundaries
#: and, when ``LEAN_LADDER``, the adaptive ladder.
LEAN_WINDOW = 2
LEAN_LADDER = False


def _check(name: str, value: int, minimum: int) -> None:
    if not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def next_checkpoint_stop(start: int, block_size: int, policy: str) -> int | None:
    """The first checkpoint position strictly after ``start`` that ``policy`` asks for.

    Args:
        start: tokens already computed (the chunk's first position), >= 0.
        block_size: hybrid block size in tokens, >= 1.
        policy: one of :data:`POLICY_NAMES`.

    Returns:
        A block-aligned token position ``> start``, or ``None`` when the policy asks for none
        (``upstream``).

    Raises:
        ValueError: unknown ``policy`` or out-of-range arguments.
    """
    _check("start", start, 0)
    _check("block_size", block_size, 1)
    if policy == "upstream":
        return None
    if policy == "lean":
        raise ValueError("checkpoint policy 'lean' stops depend on the prompt end: use policy_chunk_tokens")
    if policy == "tail":
        return (start // block_size + 1) * block_size
    if policy == "adaptive":
        # smallest power-of-two number of blocks whose boundary lies after start
        blocks = 1
        while blocks * block_size <= start:
            blocks *= 2
        return blocks * block_size
    raise ValueError(
        f"checkpoint policy {policy!r} is unknown; expected one of {', '.join(POLICY_NAMES)}"
    )


def policy_chunk_tokens(
    start: int,
    num_new_tokens: int,
    prefill_end: int,
    block_size: int,
    policy: str,
) -> int:
    """Shorten a prefill chunk so that it ends at the policy's next checkpoint stop.

    Applied *after* vLLM's own align-mode split, to the number of tokens it chose; the result
    is never larger than ``num_new_tokens``, so the chunk limit, the prompt's last block
    boundary, the shared-prefix junction and the spec-decode adjustments upstream made stay
    in force. Decode steps (``start >= prefill_end``) and chunks without a stop strictly inside
    them are returned unchanged, so a prompt shorter than one block is never split.

    Args:
        start: tokens already computed for the request, cache hits included (upstream's
            ``request.num_computed_tokens + num_new_local_computed_tokens +
            num_external_computed_tokens``).
        num_new_tokens: tokens upstream schedules in this step (>= 0).
        prefill_end: end of the prefill in tokens (upstream's
            ``max(request.num_prompt_tokens, request.num_tokens - 1)``).
        block_size: hybrid block size in tokens (>= 1).
        policy: one of :data:`POLICY_NAMES`.

    Returns:
        The number of tokens to schedule, ``0 < result <= num_new_tokens`` when
        ``num_new_tokens > 0`` (0 stays 0).

    Raises:
        ValueError: unknown ``policy`` or negative arguments.
    """
    _check("num_new_tokens", num_new_tokens, 0)
    _check("prefill_end", prefill_end, 0)
    if policy == "lean":
        from vllm_hybrid_npu.scheduling.retention import extra_stops

        _check("block_size", block_size, 1)
        return extra_stops(start, num_new_tokens, prefill_end, block_size, LEAN_WINDOW, LEAN_LADDER)
    stop = next_checkpoint_stop(start, block_size, policy)
    if stop is None or num_new_tokens == 0 or start >= prefill_end:
        return num_new_tokens
    end = start + num_new_tokens
    # The adaptive ladder stops below the prompt's last block boundary: upstream stops there.
    if policy == "adaptive" and stop >= prefill_end // block_size * block_size:
        return num_new_tokens
    if start < stop < min(end, prefill_end):
        return stop - start
    return num_new_tokens


def checkpoint_positions(prompt_len: int, block_size: int, policy: str, chunk_limit: int) -> list[int]:
    """Step ends of a cold prefill of ``prompt_len`` tokens, as upstream + ``policy`` cut it.

    A model of upstream's split for one request alone in the batch with no cache hit and no
    junction (vLLM 0.30/0.32 ``_mamba_block_aligned_split``: chunks limited to ``chunk_limit``
    tokens and rounded down to a block boundary, a stop at the prompt's last block boundary),
    followed by :func:`policy_chunk_tokens`. Used for documentation and tests of the number of
    prefill steps a policy costs; the engine itself uses vLLM's split.

    Returns:
        The increasing list of step end positions (tokens); the last one is ``prompt_len``.
    """
    _check("prompt_len", prompt_len, 1)
    _check("chunk_limit", chunk_limit, block_size)
    ends: list[int] = []
    start = 0
    last_boundary = prompt_len // block_size * block_size
    while start < prompt_len:
        end = min(prompt_len, start + chunk_limit)
        if end < prompt_len:
            end = max(end // block_size * block_size, start + 1)
        if start < last_boundary < end:
            end = last_boundary
        n = policy_chunk_tokens(start, end - start, prompt_len, block_size, policy)
        start += n
        ends.append(start)
    return ends
