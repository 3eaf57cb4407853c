"""Where a GDN step saves recurrent states when every block boundary gets one (issue 8).

Pure, target-independent planning (no vLLM, no torch): positions are token counts (``int``),
``block_size`` is the hybrid block size in tokens, a *column* is an index into a request's
Mamba/GDN block-table row.

Convention (vLLM 0.30.0 ``mamba_cache_mode="all"``, read from
``vllm/v1/attention/backends/mamba_attn.py``, ``_compute_prefix_caching_block_indices``): the
state slot in column ``j`` holds the recurrent state (conv state and SSM state) after the tokens
of block ``j``, i.e. after ``min((j + 1) * block_size, num_tokens)`` tokens. A request that has
computed ``c`` tokens therefore resumes from column ``(c - 1) // block_size`` (nothing if
``c == 0``), and a step that ends at token ``e`` leaves its state in column ``(e - 1) //
block_size``. When a step crosses block boundaries, the state at each boundary ``k *
block_size`` belongs in column ``k - 1``: that is what makes every block of a prompt, and every
boundary crossed during decode, a prefix-cache hit candidate with no extra scheduling step.

A kernel that only returns a sequence's final state (vLLM's CPU ``chunk_gated_delta_rule_cpu``,
the FLA chunk kernel's ``output_final_state``) produces those states if the step is run in
*segments* that end on the boundaries, each segment starting from the state the previous one
left: :func:`plan_segments` says which tokens go in which segment, which column each segment
reads its initial state from and which column it writes. Segment ``s`` of every request runs in
one batched kernel call (*round* ``s``); decodes have one segment.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Segment:
    """One contiguous run of a request's scheduled tokens that ends on a block boundary or at
    the end of the step.

    Attributes:
        request: row of the request in the batch (0-based).
        start: first token of the segment, as an index into the batch's flattened tokens.
        end: one past the last token (batch token index); ``end - start >= 1`` tokens.
        src_col: block-table column holding the state the segment starts from, ``None`` when the
            request has no computed tokens before it (start from zeros).
        dst_col: block-table column the segment's final state is written to.
        boundary: True when the segment ends exactly on a block boundary (its state is a
            cacheable checkpoint of the whole prefix), False for a step's partial tail.
    """

    request: int
    start: int
    end: int
    src_col: int | None
    dst_col: int
    boundary: bool

    @property
    def has_initial_state(self) -> bool:
        """Whether the segment continues a state (``src_col is not None``)."""
        return self.src_col is not None

    @property
    def needs_copy(self) -> bool:
        """Whether the start state must be copied from ``src_col`` into ``dst_col`` first
        (kernels update the state slot in place)."""
        return self.src_col is not None and self.src_col != self.dst_col


def _check_int(name: str, value: int, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def plan_request(
    request: int, token_start: int, num_computed: int, num_scheduled: int, block_size: int
) -> list[Segment]:
    """Segments of one request's step (see the module docstring for the column convention).

    Args:
        request: the request's row in the batch.
        token_start: batch token index of the request's first scheduled token.
        num_computed: tokens already computed (state in column ``(num_computed - 1) //
            block_size``); a prefix-cache hit counts as computed.
        num_scheduled: tokens this step (0 gives no segment: a padded row).
        block_size: tokens per block (the GDN state is stored once per block).

    Returns:
        Segments in token order; consecutive segments chain (segment ``i + 1``'s ``src_col`` is
        segment ``i``'s ``dst_col``).

    Raises:
        ValueError: a negative count or a ``block_size`` below 1.
    """
    _check_int("request", request, 0)
    _check_int("token_start", token_start, 0)
    _check_int("num_computed", num_computed, 0)
    _check_int("num_scheduled", num_scheduled, 0)
    _check_int("block_size", block_size, 1)
    segments = []
    pos = num_computed
    end = num_computed + num_scheduled
    while pos < end:
        next_boundary = (pos // block_size + 1) * block_size
        seg_end = min(next_boundary, end)
        segments.append(
            Segment(
                request=request,
                start=token_start + (pos - num_computed),
                end=token_start + (seg_end - num_computed),
                src_col=(pos - 1) // block_size if pos > 0 else None,
                dst_col=(seg_end - 1) // block_size,
                boundary=seg_end % block_size == 0,
            )
        )
        pos = seg_end
    return segments


def plan_segments(
    query_start_loc: list[int], num_computed: list[int], block_size: int
) -> list[list[Segment]]:
    """Rounds of segments for a batch: round ``s`` holds the ``s``-th segment of every request
    that has one, in batch order (so decodes, which come first in vLLM's GDN batches, stay
    first).

    Args:
        query_start_loc: ``R + 1`` non-decreasing batch token offsets (vLLM's
            ``query_start_loc``), tokens.
        num_computed: ``R`` tokens already computed per request.
        block_size: tokens per block.

    Returns:
        A list of rounds; each round is a non-empty list of :class:`Segment`. A batch where no
        request crosses a block boundary gives one round (the step runs as upstream's).

    Raises:
        ValueError: lengths disagree, offsets decrease, or a count is negative.
    """
    if len(query_start_loc) != len(num_computed) + 1:
        raise ValueError(
            f"query_start_loc has {len(query_start_loc)} entries; expected len(num_computed) + 1"
            f" = {len(num_computed) + 1}"
        )
    rounds: list[list[Segment]] = []
    for r, computed in enumerate(num_computed):
        start, stop = int(query_start_loc[r]), int(query_start_loc[r + 1])
        if stop < start:
            raise ValueError(f"query_start_loc decreases at request {r}: {start} -> {stop}")
        for s, seg in enumerate(plan_request(r, start, int(computed), stop - start, block_size)):
            if s == len(rounds):
                rounds.append([])
            rounds[s].append(seg)
    return rounds


def boundary_positions(num_computed: int, num_scheduled: int, block_size: int) -> list[int]:
    """Block boundaries strictly inside or at the end of a step, in tokens from the sequence
    start: ``k * block_size`` with ``num_computed < k * block_size <= num_computed +
    num_scheduled``. These are the prefix lengths whose states the step leaves behind."""
    _check_int("num_computed", num_computed, 0)
    _check_int("num_scheduled", num_scheduled, 0)
    _check_int("block_size", block_size, 1)
    first = num_computed // block_size + 1
    last = (num_computed + num_scheduled) // block_size
    return [k * block_size for k in range(first, last + 1)]
