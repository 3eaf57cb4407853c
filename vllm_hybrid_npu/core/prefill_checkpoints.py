"""Prefill checkpoints of GDN layers: which request of a step exports which state, where.

Pure logic (no vLLM import at module load): the rule is vLLM's own. Since vLLM 0.30,
``MambaSpec.num_prefill_checkpoint_blocks`` / ``prefill_checkpoint_alignment``
(``vllm/v1/kv_cache_interface.py``) let a Mamba layer promise that it writes, from inside a
prefill step, the state at the prompt's checkpoint position
(``get_mamba_prefill_checkpoint_position``) into one extra block; the scheduler then drops its
block-aligned split (``use_internal_checkpoint`` in ``Scheduler._mamba_block_aligned_split``) and
the Mamba manager reserves that block (``MambaManager._needs_internal_checkpoint``). The rows,
offsets and block-table columns here are computed exactly as vLLM 0.30's one exporting backend
computes them (Kimi's KDA metadata builder, ``vllm/models/kimi_k3/nvidia/kda_metadata.py``), so the
worker writes the block the manager reserved and nothing else.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

#: Token alignment the GDN exporters declare (``prefill_checkpoint_alignment``): the chunk of
#: vLLM's GDN chunked kernels (FLA ``chunk_gated_delta_rule``, ``chunk_gated_delta_rule_cpu``)
#: and of vllm-ascend's ``chunk_gated_delta_rule_fwd_h``; a checkpoint offset that is a multiple
#: of it falls on a chunk boundary of the step's own computation.
ALIGNMENT = 64


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """One request's prefill checkpoint in a step.

    Attributes:
        row: the request's row in the step's batch (vLLM orders decodes first).
        query_start: tokens of the request computed before this step.
        query_len: tokens of the request in this step.
        offset: tokens from the step's first token of the request to the checkpoint
            (a positive multiple of the alignment, ``< query_len``).
        column: block-table column the state is written to (``cdiv(seq_len, block) - 2``).
        position: the checkpoint position, tokens of the request (``query_start + offset``).
    """

    row: int
    query_start: int
    query_len: int
    offset: int
    column: int
    position: int


def plan_checkpoints(
    query_start_loc: Sequence[int],
    seq_lens: Sequence[int],
    first_row: int,
    block_size: int,
    hash_block_size: int,
    alignment: int,
    drop_eagle_block: bool,
    position_fn: Callable[[int, int, bool], int],
    valid_fn: Callable[..., bool],
) -> list[Checkpoint]:
    """The step's checkpoints, one per request whose checkpoint vLLM lets the backend export.

    Args:
        query_start_loc: int [R + 1] token offsets of the rows in the step (host values).
        seq_lens: int [R] tokens of each request after this step (host values; exact for
            prefill rows).
        first_row: the first row that can be a prefill (rows before it are decodes).
        block_size: the GDN KV-cache group's block size, tokens.
        hash_block_size: the prefix-match unit, tokens (``--prefix-match-unit``, else the block).
        alignment: the declared ``prefill_checkpoint_alignment``, tokens.
        drop_eagle_block: speculative decoding with EAGLE's block drop.
        position_fn: vLLM's ``get_mamba_prefill_checkpoint_position(num_tokens,
            hash_block_size, drop_eagle_block)``.
        valid_fn: vLLM's ``is_mamba_prefill_checkpoint_valid(query_start=, query_end=,
            checkpoint_position=, hash_block_size=, mamba_block_size=, checkpoint_alignment=)``.

    Returns:
        The checkpoints, by row.
    """
    out: list[Checkpoint] = []
    for row in range(first_row, len(seq_lens)):
        query_len = int(query_start_loc[row + 1]) - int(query_start_loc[row])
        if query_len <= 1:
            continue
        seq_len = int(seq_lens[row])
        start = seq_len - query_len
        position = position_fn(seq_len, hash_block_size, drop_eagle_block)
        if not valid_fn(
            query_start=start,
            query_end=seq_len,
            checkpoint_position=position,
            hash_block_size=hash_block_size,
            mamba_block_size=block_size,
            checkpoint_alignment=alignment,
        ):
            continue
        column = -(-seq_len // block_size) - 2
        out.append(Checkpoint(row, start, query_len, position - start, column, position))
    return out


def aligned_block_size(block_size: int, alignment: int = ALIGNMENT) -> int:
    """The smallest multiple of ``alignment`` at or above ``block_size`` (tokens).

    vLLM 0.30 aligns the hybrid block only to the attention kernel's block (Qwen3.5-35B-A3B at
    tp 1 with FlashAttention's 16-token kernel blocks: 1,056 = 16.5 x 64); a checkpoint on a block
    boundary is then on the 64-token grid of every other block only. vLLM 0.33's
    ``Platform._align_hybrid_block_size`` takes the lcm with the checkpoint alignment (1,056 ->
    1,088); this is the same rule for kernel blocks that divide ``alignment`` (16, 32, 64).

    Raises:
        ValueError: a non-positive size.
    """
    if block_size <= 0 or alignment <= 0:
        raise ValueError(f"block size {block_size} and alignment {alignment} must be positive")
    return -(-block_size // alignment) * alignment
