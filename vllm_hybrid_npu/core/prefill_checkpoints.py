"""GDN prefill checkpoints: which row of a step exports which state, and how its kernel call splits.

Pure logic (no vLLM or torch import). A Mamba layer whose ``MambaSpec`` declares
``num_prefill_checkpoint_blocks = 1`` and a ``prefill_checkpoint_alignment`` (vLLM >= 0.30,
``vllm/v1/kv_cache_interface.py``) writes, from inside a prefill step, the state at the prompt's
checkpoint into the block at column ``cdiv(seq_len, block) - 2``; vLLM's scheduler then drops its
block-aligned split. A backend must decline exactly where the scheduler and ``MambaManager``
decline, or a reserved block is cached unwritten: :func:`checkpoint_offsets` is vLLM 0.30 / 0.32's
rule, shaped as vLLM 0.33's ``compute_mamba_prefill_checkpoints`` (per row an offset and a column,
``0`` / ``-1`` for none), and :func:`plan_step` turns those into a :class:`StepPlan`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

#: ``prefill_checkpoint_alignment`` the GDN exporters declare, tokens: the chunk of vLLM's and
#: vllm-ascend's GDN chunk kernels (a checkpoint on a chunk boundary, after >= width - 1 rows).
ALIGNMENT = 64


def declare(spec: Any, alignment: int = ALIGNMENT) -> Any:
    """``spec`` (a GDN ``MambaSpec``) with one prefill checkpoint block at ``alignment`` tokens
    (vLLM 0.33: its grid, ``get_mamba_prefill_checkpoint_grid``): the declaration the runtime's
    ``get_kv_cache_spec`` entry makes and the lab replays."""
    return dataclasses.replace(spec, num_prefill_checkpoint_blocks=1,
                               prefill_checkpoint_alignment=alignment)


def aligned_block_size(block_size: int, alignment: int = ALIGNMENT) -> int:
    """The smallest multiple of ``alignment`` at or above ``block_size`` (tokens): vLLM 0.33's
    ``Platform._align_hybrid_block_size`` rule (lcm with the checkpoint alignment, 1,056 -> 1,088)
    for kernel blocks that divide ``alignment``; vLLM 0.30 aligns to the kernel block only.
    Raises ValueError for a non-positive size."""
    if block_size <= 0 or alignment <= 0:
        raise ValueError(f"block size {block_size} and alignment {alignment} must be positive")
    return -(-block_size // alignment) * alignment


def round_hybrid_block(cache_config: Any, realign: Callable[[], None]) -> tuple[int, int] | None:
    """Round ``cache_config.block_size`` up to the checkpoint grid, then ``realign()`` (vLLM's
    ``Platform._align_hybrid_block_size`` again, for the page padding of the new block); returns
    ``(old, new)`` block sizes in tokens when it changed, else None."""
    block = cache_config.block_size
    if not block or block % ALIGNMENT == 0:
        return None
    cache_config.block_size = aligned_block_size(block)
    realign()
    return block, cache_config.block_size


def checkpoint_offsets(seq_lens: Sequence[int], query_lens: Sequence[int], *,
                       hash_block_size: int, block_size: int, alignment: int,
                       drop_eagle_block: bool, position_fn: Callable[[int, int, bool], int],
                       valid_fn: Callable[..., bool]) -> tuple[list[int], list[int]]:
    """Per-row checkpoint offset and block-table column, as vLLM 0.30 / 0.32 place them, from
    each row's tokens after this step (``seq_lens``, exact for prefill rows) and in it
    (``query_lens``), the prefix-match unit, the group's block and the declared alignment (tokens),
    EAGLE's block drop, and vLLM's ``get_mamba_prefill_checkpoint_position`` (``position_fn``) and
    ``is_mamba_prefill_checkpoint_valid`` (``valid_fn``). Returns ``(offsets, cols)``: tokens from
    the row's first token in the step to its checkpoint and the column its state is written to;
    ``0`` / ``-1`` for none (always for 1-token rows)."""
    offsets, cols = [], []
    for seq_len, query_len in zip(seq_lens, query_lens):
        start = seq_len - query_len
        position = position_fn(seq_len, hash_block_size, drop_eagle_block)
        ok = query_len > 1 and valid_fn(
            query_start=start, query_end=seq_len, checkpoint_position=position,
            hash_block_size=hash_block_size, mamba_block_size=block_size,
            checkpoint_alignment=alignment)
        offsets.append(position - start if ok else 0)
        cols.append(-(-seq_len // block_size) - 2 if ok else -1)
    return offsets, cols


def only_column_clause_fails(query_start: int, query_end: int, checkpoint_position: int,
                             hash_block_size: int, mamba_block_size: int,
                             checkpoint_alignment: int | None) -> bool:
    """Whether a prefill query ``[query_start, query_end)`` (tokens) fails vLLM 0.30's
    ``is_mamba_prefill_checkpoint_valid`` (``vllm/v1/kv_cache_interface.py``) by its column clause
    alone: the checkpoint's block-table column ``cdiv(query_end, B) - 2`` is not past the initial
    state's ``(query_start - 1) // B`` (``B`` = ``mamba_block_size``), while the start lies on the
    prefix-match unit (``hash_block_size``), the checkpoint is at least one unit past the start,
    strictly inside the query and on the alignment grid from the start. That is a query spanning at
    most one block column past its start: a cold prompt of at most one block, or a hit leaving at
    most about a block. Only with a prefix-match unit below the block (at the block's own unit the
    other clauses imply the column clause). False where ``checkpoint_alignment`` is None (no
    checkpoint declared)."""
    if checkpoint_alignment is None or checkpoint_alignment <= 0 or mamba_block_size <= 0:
        return False
    initial_state_col = (query_start - 1) // mamba_block_size
    checkpoint_col = -(-query_end // mamba_block_size) - 2
    return (checkpoint_col <= initial_state_col
            and query_start % hash_block_size == 0
            and query_start + hash_block_size <= checkpoint_position
            and query_start < checkpoint_position < query_end
            and (checkpoint_position - query_start) % checkpoint_alignment == 0)


def junction_checkpoint(start: int, end: int, num_prompt_tokens: int, junction: int, block: int,
                        checkpoint_position: int) -> tuple[str, int]:
    """Whether a prefill chunk ``[start, end)`` (tokens) can run past the request's shared-prefix
    junction (vLLM's ``request.shared_prefix_boundary``: attention blocks cached up to there, no
    GDN state) with the junction's state exported from inside the step, where vLLM 0.30 / 0.32's
    ``Scheduler._mamba_block_aligned_split`` ends the chunk at the junction floored to the block
    (``start + (junction - start) // block * block``, ``jf``) so that align mode caches the state
    there. The scheduler's and the KV-cache manager's wrappers both ask this, with the prompt
    checkpoint the manager reserves in the same chunk (``checkpoint_position``, 0 for none; its
    block-table column is ``cdiv(end, block) - 2``), so they decide in lockstep.

    Returns ``("export", jf)`` (a block at column ``jf // block - 1`` takes the state at ``jf``),
    ``("covered", jf)`` (the prompt checkpoint is at ``jf``: its block takes that state) or
    ``("", 0)``: no junction, a chunk start off the block grid (the running state is not at a block
    boundary), ``jf`` not strictly inside the chunk or past the prompt, or ``jf``'s column not
    below the prompt checkpoint's (or the running state's) column."""
    if junction <= 0 or block <= 0 or start % block:
        return "", 0
    jf = start + (junction - start) // block * block
    if not start < jf < end or jf > num_prompt_tokens:
        return "", 0
    if checkpoint_position == jf:
        return "covered", jf
    limit = -(-end // block) - (2 if checkpoint_position else 1)
    return ("export", jf) if jf // block - 1 < limit else ("", 0)


def budget_chunk_end(start: int, end: int, prefill_end: int, alignment: int = ALIGNMENT) -> int:
    """The end (tokens) of a prefill chunk offered ``[start, end)`` by the token budget when the
    step exports the GDN state at every block boundary the chunk crosses: a non-final chunk
    (``end < prefill_end``) ends on the checkpoint alignment grid, not on the block, so the next
    chunk starts where the exporter can cut (``start`` must be on that grid;
    vLLM 0.30's ``Scheduler._mamba_block_aligned_split`` floors it to the block, and stops a chunk
    starting mid-block at the next block boundary); the final chunk keeps ``end``. Returns
    ``start`` when nothing is left."""
    if end >= prefill_end:
        return end
    return max(start, end // alignment * alignment)


def mid_block_chunk(start: int, num_new_tokens: int, block: int) -> int:
    """The tokens of a chunk that starts at ``start`` (tokens computed) and would compute
    ``num_new_tokens``, cut at the next block boundary where it starts mid-block and runs past it
    (else ``num_new_tokens``): the invariant of vLLM's align mode (slot ``p`` holds the state after
    ``(p + 1) * block`` tokens), which ``Scheduler._mamba_block_aligned_split`` (vLLM 0.30-0.33)
    lifts for a final chunk with an internal checkpoint, leaving the initial state's block cached
    at that boundary with the state at ``start``, for paths that write one checkpoint per row."""
    if start % block == 0:
        return num_new_tokens
    return min(num_new_tokens, (start // block + 1) * block - start)


def crossed_checkpoint(start: int, end: int, num_prompt_tokens: int, block: int,
                       alignment: int = ALIGNMENT, drop: bool = False) -> int:
    """For a prefill chunk ``[start, end)`` (tokens) starting off the block grid: the position
    whose GDN state needs a block of its own in column ``position // block - 1``, or 0. vLLM
    0.30's align mode never runs such a chunk past its next block boundary ``b1 = (start //
    block + 1) * block`` and reserves it no checkpoint (``is_mamba_prefill_checkpoint_valid``
    wants a start on the grid); run past ``b1``, the state at ``b1`` goes into the initial
    state's block (column ``start // block``: :func:`junction_columns` finds it) and this one into
    a new block: for the prompt's last chunk its checkpoint ``(end - 1) // block * block`` (where
    vLLM 0.30 places it), for an earlier chunk ending off the grid its last block boundary (where
    vLLM's split would have ended it). 0 when that is not past ``b1``, a start on the grid (vLLM
    reserves those itself), or an offset off the alignment.

    ``drop``: EAGLE/MTP's block drop (vLLM's ``Scheduler.use_eagle_block_drop``, with the
    prefix-match unit at the block). A later request's attention lookup then matches one block
    past its hit and drops it, so its Mamba lookup needs the state exactly one block below
    the no-drop position: for the last chunk :func:`drop_checkpoint` (vLLM's
    ``get_mamba_prefill_checkpoint_position(end, block, True)``), for an earlier chunk its last
    block boundary minus one block, on the grid or not (what a request sharing the chunk's
    tokens hits while this one is in flight). Where that is ``b1`` the initial state's block
    holds it."""
    if start % block == 0:
        return 0
    if end >= num_prompt_tokens:
        position = drop_checkpoint(end, block) if drop else (end - 1) // block * block
    elif drop:
        position = end // block * block - block
    else:
        position = end // block * block if end % block else 0
    b1 = (start // block + 1) * block
    return position if position > b1 and (position - start) % alignment == 0 else 0


def drop_checkpoint(num_prompt_tokens: int, block: int) -> int:
    """The prompt checkpoint under EAGLE/MTP's block drop (tokens): ``(num_prompt_tokens - 1) //
    block * block - block`` (at least 0), vLLM 0.30's ``get_mamba_prefill_checkpoint_position(
    num_prompt_tokens, block, drop_eagle_block=True)`` with the prefix-match unit at the block:
    the hit length of a repeat (its attention lookup matches ``(n - 1) // block`` blocks and
    drops the last), whose Mamba lookup wants the state at exactly that length."""
    return max((num_prompt_tokens - 1) // block * block - block, 0)


def drop_chunk_end(start: int, end: int, num_prompt_tokens: int, block: int,
                   alignment: int = ALIGNMENT) -> int:
    """The end (tokens) of a non-final prefill chunk ``[start, end)`` (``start`` and ``end`` on
    the ``alignment`` grid, the prefix-match unit at the block) under EAGLE/MTP's block drop:
    :func:`drop_checkpoint` ``p`` where the chunk would run past ``p`` without keeping its state,
    else ``end``. No later chunk can write ``p`` once a chunk ended past it, so a repeat of the
    prompt would hit one block lower. The chunk keeps ``p`` where vLLM 0.30's ``MambaManager``
    reserves it (a start on the block grid: ``get_mamba_prefill_checkpoint_position(end, block,
    True) == p``, an end in ``(p + block, p + 2 * block]``), or, from a start off the grid, where
    :func:`crossed_checkpoint` hands it or it is ``b1`` (the initial state's block). Otherwise
    the chunk ends at ``p`` itself, whose running state fills the block ending at ``p`` (``p``
    is on the block grid). A final chunk (``end >= num_prompt_tokens``) keeps ``end``.

    Only ``p`` is guarded. For a prompt on the block grid (``n % block == 0``) whose final chunk
    under vLLM's own split would start past ``n - 3 * block``, that split stops at ``n - block``
    instead (``Scheduler._mamba_block_aligned_split``'s last cacheable position, where a longer
    prompt sharing all ``n`` tokens lands after its drop) and caches no state at ``p = n - 2 *
    block``: with this rule a repeat hits ``p`` where vLLM's finds none there, and such a longer
    prompt hits ``p`` where vLLM's hits ``n - block``."""
    p = drop_checkpoint(num_prompt_tokens, block)
    if end >= num_prompt_tokens or not start < p < end:
        return end
    if start % block == 0:
        kept = {drop_checkpoint(end, block)}
    else:
        kept = {crossed_checkpoint(start, end, num_prompt_tokens, block, alignment, drop=True),
                (start // block + 1) * block}
    return end if p in kept else p


def second_checkpoint(start: int, end: int, num_prompt_tokens: int, checkpoint_position: int,
                      block: int, alignment: int = ALIGNMENT) -> int:
    """The block boundary ``q`` (tokens) whose GDN state a prompt's final chunk ``[start, end)``
    also exports, beside its sub-block checkpoint ``checkpoint_position`` (``cp``, reserved by
    vLLM 0.30's ``MambaManager`` in the block-table column ``cdiv(end, block) - 2``), or 0.

    With a prefix-match unit below the block, ``cp`` lies inside the prompt's last block and its
    column is the one vLLM's full-block pass keys at ``q = cp // block * block``
    (``(column + 1) * block``); ``MambaManager._cache_partial_tail_block`` then re-keys that block
    at ``cp``, so the state at ``q``, which the host tier's lookup on the block grid and a later
    prompt sharing ``q`` tokens need, is not cached. A second block
    (:mod:`vllm_hybrid_npu.patches.gdn_second_checkpoint`) takes ``cp`` and the column keeps ``q``.

    ``q`` when: the chunk ends at the prompt's end (``end == num_prompt_tokens``), ``cp`` is off
    the block grid, ``q`` lies strictly inside the chunk and on the ``alignment`` grid from
    ``start`` (where the exporter can cut). 0 otherwise (``cp`` 0: no checkpoint reserved)."""
    if checkpoint_position <= 0 or block <= 0 or end != num_prompt_tokens or checkpoint_position % block == 0:
        return 0
    q = checkpoint_position // block * block
    return q if start < q < checkpoint_position < end and (q - start) % alignment == 0 else 0


def junction_columns(start: int, seq_len: int, block: int, checkpoint_col: int,
                     table_row: Sequence[int]) -> list[tuple[int, int]]:
    """The junction checkpoints of one prefill row as the worker finds them: ``(offset, column)``
    for every block-table column in ``[start // block, limit)`` holding a real block (id != 0,
    vLLM's null block), ``limit`` the prompt checkpoint's column ``checkpoint_col`` (or, with none,
    -1, the running state's column ``cdiv(seq_len, block) - 1``). In align mode vLLM leaves those
    columns null; the KV-cache manager entry of :func:`junction_checkpoint` puts a block in the
    junction's column. ``offset`` is from the row's first token in the step (``start``, tokens).
    A row starting off the block grid (a chunk run past its next block boundary)
    starts at the initial state's column ``start // block``: its block (the running state's so
    far, vLLM's own) takes the state at that boundary, as a chunk vLLM ended there would leave it;
    :func:`crossed_checkpoint` says where the other block is."""
    limit = checkpoint_col if checkpoint_col >= 0 else -(-seq_len // block) - 1
    return [((c + 1) * block - start, c) for c in range(start // block, limit) if table_row[c]]


#: Kinds of the checkpoints :func:`step_checkpoints` lists (tokens from the prompt's start):
#: ``junction`` a shared-prefix junction's block; ``crossed`` the block boundary a chunk started
#: mid-block crosses (into the initial state's block); ``prompt`` the chunk's own checkpoint the
#: Mamba manager reserved (under EAGLE/MTP's block drop one prefix-match unit lower, where the
#: drafter's dropped hit lands); ``boundary`` / ``second`` the block boundary kept in that
#: checkpoint's column and the sub-block checkpoint moved into a second block.
KINDS = ("junction", "crossed", "prompt", "boundary", "second")


def step_checkpoints(start: int, end: int, block: int, checkpoint: tuple[int, int] | None,
                     block_ids: Sequence[int], second: tuple[int, int] | None = None,
                     eagle_drop: bool = False) -> tuple[tuple[int, int, str], ...]:
    """Every GDN checkpoint one prefill chunk ``[start, end)`` (tokens) writes beyond vLLM's own
    one-per-row plan, as the engine sends it to the worker: ``(position, block id, kind)``
    (:data:`KINDS`; position in tokens from the prompt's start, ascending), or ``()`` where the
    chunk writes only vLLM's (the worker then plans that one itself).

    ``checkpoint`` is the ``(position, column)`` the Mamba manager reserved for the chunk (vLLM's
    ``MambaManager._checkpoints``; None: none), ``block_ids`` the request's block ids by column
    (the engine's ``req_to_blocks``; 0 is vLLM's null block), ``second`` the ``(block id,
    position)`` of a second checkpoint block (:mod:`vllm_hybrid_npu.patches.gdn_second_checkpoint`).
    The columns looked at are :func:`junction_columns`'s; where any is found, or with ``second``,
    the chunk's own checkpoint is listed too, so the worker writes the whole list and checks its
    own plan against it. With ``eagle_drop`` (the manager's ``drop_eagle_checkpoint_block``:
    EAGLE/MTP's block drop, under which vLLM's manager reserves the checkpoint one prefix-match
    unit below the no-drop position, where the drafter's dropped hit lands) the chunk's own
    checkpoint is listed even alone: the block the manager keys comes from the engine, not from
    the worker's re-derivation of the drop."""
    col = checkpoint[1] if checkpoint is not None else -1
    out = [(start + off, int(block_ids[c]), "crossed" if c == start // block and start % block
            else "junction") for off, c in junction_columns(start, end, block, col, block_ids)]
    if second is not None and checkpoint is not None:
        out += [((col + 1) * block, int(block_ids[col]), "boundary"), (second[1], second[0], "second")]
    elif (out or eagle_drop) and checkpoint is not None:
        out.append((checkpoint[0], int(block_ids[col]), "prompt"))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """The prefill checkpoints of one step for one GDN KV-cache group (host values, tokens).

    Per checkpoint (ascending batch row): ``rows`` its batch row, ``offsets`` tokens from the row's
    first token in the step (> 0), ``cols`` its block-table column, ``conv_end`` its batch token
    index (the conv state is the ``width - 1`` input rows before it), ``chunk_index`` its chunk
    among the prefill rows' 64-token chunks (in a chunk kernel's per-chunk states ``h``),
    ``ckpt_seq`` its row's index among the prefill rows; ``chunk_starts`` each prefill row's first
    chunk and ``num_chunks`` the chunks of all prefill rows (each row's tokens in ``chunk``-token
    chunks, the last one partial; FLA's ``chunk_offsets`` and ``len(chunk_indices)``).

    The split of the prefill rows (token indices relative to the first prefill token, batch index
    ``prefill_start``, after ``num_decodes`` decode rows): ``head_spans`` / ``head_bounds`` (spans,
    cu_seqlens [P + 1]) of the first kernel call, every prefill row with each checkpointed row cut
    at its first checkpoint; ``tail_spans`` / ``tail_bounds`` of the second, the checkpointed rows'
    rest. With several checkpoints in a row (a shared-prefix junction before the prompt's own),
    ``rounds`` cuts at every one: round ``k`` holds each row's ``k``-th segment as ``(row among the
    prefill rows, start, end)``, row order (round 0: ``head_spans``), and ``round_of`` says per
    checkpoint which round ends at it (its state is the row's running state after that round).
    """

    rows: tuple[int, ...]
    offsets: tuple[int, ...]
    cols: tuple[int, ...]
    conv_end: tuple[int, ...]
    chunk_index: tuple[int, ...]
    num_decodes: int
    prefill_start: int
    head_bounds: tuple[int, ...]
    head_spans: tuple[tuple[int, int], ...]
    tail_bounds: tuple[int, ...]
    tail_spans: tuple[tuple[int, int], ...]
    ckpt_seq: tuple[int, ...]
    num_prefill_tokens: int
    chunk_starts: tuple[int, ...]
    num_chunks: int
    rounds: tuple[tuple[tuple[int, int, int], ...], ...]
    round_of: tuple[int, ...]

    @property
    def several_per_row(self) -> bool:
        """Some row has more than one checkpoint (the two-call split cannot export it)."""
        return len(self.rounds) > 2

    @property
    def tails_are_suffix(self) -> bool:
        """One tail, ending the step's prefill tokens: the two calls take slices, no gather."""
        return len(self.tail_spans) == 1 and self.tail_spans[0][1] == self.num_prefill_tokens

    def chunk_map(self) -> list[int]:
        """Per chunk of the prefill rows (``num_chunks``): the checkpoint (index into ``rows``)
        whose state is that chunk's start state, or -1."""
        out = [-1] * self.num_chunks
        for i, chunk in enumerate(self.chunk_index):
            out[chunk] = i
        return out

    # the split in rounds (len(rounds) kernel calls; two where no row has several checkpoints)
    def round_bounds(self, k: int) -> list[int]:
        """cu_seqlens (tokens, [rows of round ``k`` + 1]) of round ``k``'s kernel call; round 0's
        are ``head_bounds``, round 1's ``tail_bounds`` where no row has several checkpoints."""
        out = [0]
        for _, s, e in self.rounds[k]:
            out.append(out[-1] + e - s)
        return out

    def round_index(self, k: int) -> list[int]:
        """Prefill-relative token indices of round ``k``'s call, in call order."""
        return [t for _, s, e in self.rounds[k] for t in range(s, e)]

    def round_rows(self, k: int) -> list[int]:
        """Round ``k``'s rows (indices among the prefill rows), in call order."""
        return [q for q, _, _ in self.rounds[k]]

    def carried(self, k: int) -> list[int]:
        """Positions among round ``k``'s rows of the rows a checkpoint ends there (``round_of
        == k``): their running states are round ``k + 1``'s initial states, in its row order."""
        after = set(self.round_rows(k + 1)) if k + 1 < len(self.rounds) else set()
        return [i for i, q in enumerate(self.round_rows(k)) if q in after]

    def round_order(self) -> list[int]:
        """Per checkpoint (``rows`` order) its position among the checkpoint states of all
        rounds laid end to end (round 0's, then round 1's, ...: each in row order)."""
        firsts, pos = [0], [0] * len(self.rows)
        for k in range(len(self.rounds) - 1):
            firsts.append(firsts[-1] + self.round_of.count(k))
        seen = [0] * len(self.rounds)
        for i, k in enumerate(self.round_of):
            pos[i], seen[k] = firsts[k] + seen[k], seen[k] + 1
        return pos


def plan_step(query_start_loc: Sequence[int], offsets: Sequence[int], cols: Sequence[int],
              num_decodes: int, chunk: int = ALIGNMENT,
              junctions: Mapping[int, Sequence[tuple[int, int]]] | None = None) -> StepPlan | None:
    """The step's :class:`StepPlan` (or None without checkpoints) from the rows' batch token
    offsets ``query_start_loc`` (int [R + 1], host), the per-row ``offsets`` and ``cols`` of
    :func:`checkpoint_offsets` (or vLLM 0.33's ``compute_mamba_prefill_checkpoints``), the leading
    decode rows, the chunk kernel's ``chunk`` (tokens, for :attr:`StepPlan.chunk_index`) and the
    rows' shared-prefix junction checkpoints (``junctions``: row -> ``[(offset, column)]``, from
    :func:`junction_columns`). A row's checkpoints are ordered by offset. Raises ValueError for a
    checkpoint on a decode row, an offset outside ``(0, query_len)`` or two at one offset."""
    junctions = junctions or {}
    if not any(offsets) and not any(junctions.values()):
        return None
    base = int(query_start_loc[num_decodes])
    checkpoints, head_spans, tail_spans, head_bounds, tail_bounds = [], [], [], [0], [0]
    rounds: list[list[tuple[int, int, int]]] = [[]]
    chunks_before, chunk_starts = 0, []
    for row, off in enumerate(map(int, offsets)):
        start, end = int(query_start_loc[row]), int(query_start_loc[row + 1])
        own = sorted([*([(off, int(cols[row]))] if off else []), *junctions.get(row, ())])
        if row < num_decodes:
            if own:
                raise ValueError(f"row {row} is a decode row and cannot have a checkpoint")
            continue
        s, e = start - base, end - base
        cuts = [o for o, _ in own]
        if any(not 0 < o < end - start for o in cuts) or len(set(cuts)) < len(cuts):
            raise ValueError(f"row {row}: checkpoint offsets {cuts}: outside (0, {end - start}) or repeated")
        for k, (o, col) in enumerate(own):
            # row, offset, column, conv end, chunk index, row among the prefill rows, round it ends
            checkpoints.append((row, o, col, start + o, chunks_before + o // chunk, row - num_decodes, k))
        edges = [0, *cuts, end - start]
        for k, (a, b) in enumerate(zip(edges, edges[1:])):
            if k == len(rounds):
                rounds.append([])
            rounds[k].append((row - num_decodes, s + a, s + b))
        first = cuts[0] if cuts else 0
        if first:
            tail_spans.append((s + first, e))
            tail_bounds.append(tail_bounds[-1] + e - s - first)
        head_spans.append((s, s + first if first else e))
        head_bounds.append(head_bounds[-1] + (first or e - s))
        chunk_starts.append(chunks_before)
        chunks_before += -(-(e - s) // chunk)
    rows, offs, ckcols, conv_end, chunk_index, ckpt_seq, round_of = zip(*checkpoints)  # >= 1
    return StepPlan(
        rows=rows, offsets=offs, cols=ckcols, conv_end=conv_end, chunk_index=chunk_index,
        num_decodes=num_decodes, prefill_start=base, head_bounds=tuple(head_bounds),
        head_spans=tuple(head_spans), tail_bounds=tuple(tail_bounds), tail_spans=tuple(tail_spans),
        ckpt_seq=ckpt_seq, num_prefill_tokens=int(query_start_loc[len(offsets)]) - base,
        chunk_starts=tuple(chunk_starts), num_chunks=chunks_before,
        rounds=tuple(tuple(r) for r in rounds), round_of=round_of)
