"""The GDN prefill-checkpoint planner (``vllm_hybrid_npu.core.prefill_checkpoints``), hand-computed.

* :func:`checkpoint_offsets` with vLLM's own ``get_mamba_prefill_checkpoint_position`` and
  ``is_mamba_prefill_checkpoint_valid``: offsets and block columns worked out by hand from vLLM's
  rule (position = the last prefix-match boundary strictly inside the prompt; column
  ``cdiv(seq_len, block) - 2``), cold, chunked and resumed rows, decodes;
* :func:`plan_step`: the checkpoints, the conv row ends, the chunk indices into ``h`` and the
  split of the prefill rows of a mixed batch, worked out by hand;
* the block rounding and the spec declaration the runtime and the lab share.
"""

from __future__ import annotations

import dataclasses
import types

import pytest

from vllm_hybrid_npu.core import prefill_checkpoints as pc

kv = pytest.importorskip("vllm.v1.kv_cache_interface")


def _offsets(seq_lens, query_lens, block=384, hash_block=384, alignment=64):
    return pc.checkpoint_offsets(
        seq_lens, query_lens, hash_block_size=hash_block, block_size=block, alignment=alignment,
        drop_eagle_block=False, position_fn=kv.get_mamba_prefill_checkpoint_position,
        valid_fn=kv.is_mamba_prefill_checkpoint_valid)


def test_offsets_follow_vllms_rule_by_hand():
    # block 384: a cold 2,000-token prompt checkpoints at 1,920 (5 blocks), column 6 - 2 = 4;
    # a cold 1,152 (3 blocks) at 768, column 1; 300 tokens has no boundary strictly inside;
    # the chunk 768..2,000 of a chunked prefill at offset 1,152; a resume at 1,920 has the
    # checkpoint at its own start (none); one at 1,536 at offset 384; a decode row none.
    seq = [2000, 1152, 300, 2000, 2000, 2000, 57]
    qlen = [2000, 1152, 300, 1232, 80, 464, 1]
    assert _offsets(seq, qlen) == ([1920, 768, 0, 1152, 0, 384, 0], [4, 1, -1, 4, -1, 4, -1])


def test_offsets_respect_alignment_and_prefix_match_unit():
    # prefix-match unit 32 on a 1,024-token block: a cold 1,100 checkpoints at 1,088 (34 x 32),
    # a multiple of 64 -> valid; a cold 1,070 at 1,056 = 16.5 x 64 -> refused by the alignment
    assert _offsets([1100, 1070], [1100, 1070], block=1024, hash_block=32) == ([1088, 0], [0, -1])


def test_plan_of_a_mixed_batch_by_hand():
    # 2 decodes, then A (200 tokens, no checkpoint), B (300, offset 128), C (100, offset 64)
    qsl = [0, 1, 2, 202, 502, 602]
    plan = pc.plan_step(qsl, [0, 0, 0, 128, 64], [-1, -1, -1, 5, 7], num_decodes=2)
    assert plan.rows == (3, 4) and plan.offsets == (128, 64) and plan.cols == (5, 7)
    assert plan.conv_end == (330, 566)
    # chunks of 64: A has 4 (0-3), B starts at 4 (checkpoint in 4 + 2), C at 4 + 5 = 9 (9 + 1)
    assert plan.chunk_index == (6, 10)
    assert plan.prefill_start == 2 and plan.num_prefill_tokens == 600
    assert plan.head_spans == ((0, 200), (200, 328), (500, 564))
    assert plan.head_bounds == (0, 200, 328, 392)
    assert plan.tail_spans == ((328, 500), (564, 600)) and plan.tail_bounds == (0, 172, 208)
    assert plan.ckpt_seq == (1, 2)
    assert not plan.tails_are_suffix
    assert plan.round_index(0) == [*range(0, 328), *range(500, 564)]
    assert plan.round_index(1) == [*range(328, 500), *range(564, 600)]


def test_plan_with_one_tail_at_the_end_is_a_suffix():
    plan = pc.plan_step([0, 1, 201, 301], [0, 0, 64], [-1, -1, 3], num_decodes=1)
    assert plan.tails_are_suffix and plan.head_bounds == (0, 200, 264)
    assert plan.tail_spans == ((264, 300),) and plan.chunk_index == (4 + 1,)


def test_plan_without_checkpoints_and_bad_offsets():
    assert pc.plan_step([0, 5, 10], [0, 0], [-1, -1], num_decodes=0) is None
    with pytest.raises(ValueError, match="decode row"):
        pc.plan_step([0, 1, 200], [64, 0], [2, -1], num_decodes=1)
    with pytest.raises(ValueError, match="outside"):
        pc.plan_step([0, 100], [100], [1], num_decodes=0)


def test_block_rounding_and_declaration():
    assert [pc.aligned_block_size(b) for b in (1056, 1088, 16, 144)] == [1088, 1088, 64, 192]
    with pytest.raises(ValueError):
        pc.aligned_block_size(0)
    calls = []
    cache = types.SimpleNamespace(block_size=1056)
    assert pc.round_hybrid_block(cache, lambda: calls.append(cache.block_size)) == (1056, 1088)
    assert calls == [1088] and pc.round_hybrid_block(cache, calls.append) is None

    @dataclasses.dataclass(frozen=True)
    class Spec:
        block_size: int
        num_prefill_checkpoint_blocks: int = 0
        prefill_checkpoint_alignment: int | None = None

    assert pc.declare(Spec(1088)) == Spec(1088, 1, 64)


def test_junction_rule_by_hand():
    # block 384; a cold second sharer of a 1,000-token prefix: the attention hit (the junction)
    # is 768, vLLM floors it to the block (768: column 1); a 1,500-token prompt's checkpoint is
    # at 1,152 (column 4 - 2 = 2): export at 768
    assert pc.junction_checkpoint(0, 1500, 1500, 768, 384, 1152) == ("export", 768)
    # the same with a junction off the grid (prefix-match unit 64: 896) -> floored to 768
    assert pc.junction_checkpoint(0, 1500, 1500, 896, 384, 1152) == ("export", 768)
    # 1,100 tokens: checkpoint at 768 = the junction: the prompt's own block takes it
    assert pc.junction_checkpoint(0, 1100, 1100, 768, 384, 768) == ("covered", 768)
    # a 1,000-token chunk: checkpoint 768 (column 1) is the junction's column too -> covered;
    # with a finer unit its checkpoint is 960 (column 1): the junction's column -> declined
    assert pc.junction_checkpoint(0, 1000, 1000, 768, 384, 768) == ("covered", 768)
    assert pc.junction_checkpoint(0, 1000, 1000, 768, 384, 960) == ("", 0)
    # no prompt checkpoint in the chunk: below the running column (cdiv(800, 384) - 1 = 2), where
    # a block-floored junction inside the chunk always is
    assert pc.junction_checkpoint(0, 800, 800, 768, 384, 0) == ("export", 768)
    # a chunk starting off the block grid, a junction at or before the start, past the chunk's
    # end, past the prompt (a resumed request replaying its output tokens), none
    assert pc.junction_checkpoint(448, 1500, 1500, 1152, 384, 1152) == ("", 0)
    assert pc.junction_checkpoint(768, 2000, 2000, 768, 384, 1920) == ("", 0)
    assert pc.junction_checkpoint(0, 700, 2000, 768, 384, 0) == ("", 0)
    assert pc.junction_checkpoint(0, 2000, 700, 768, 384, 1920) == ("", 0)
    assert pc.junction_checkpoint(0, 1500, 1500, 0, 384, 1152) == ("", 0)
    # a chunk starting at 384 (after a hit): the junction 1,000 floors to 384 + 512 // 384 * 384
    assert pc.junction_checkpoint(384, 1900, 1900, 1000, 384, 1536) == ("export", 768)


def test_junction_rule_under_the_drafter_drop_by_hand():
    # block 384 under EAGLE/MTP's block drop: a sharer of a 1,000-token prefix matches 768 in the
    # attention lookup and drops a block, so its junction (the post-drop hit) is 384; a
    # 1,500-token prompt's checkpoint is 1,499 // 384 * 384 - 384 = 768 (vLLM's function), in
    # column cdiv(1500, 384) - 2 = 2: export 384 (column 0)
    assert kv.get_mamba_prefill_checkpoint_position(1500, 384, True) == 768
    assert pc.junction_checkpoint(0, 1500, 1500, 384, 384, 768) == ("export", 384)
    # a sharer of 1,200 tokens (1,152 matched, 768 kept) in a 1,300-token prompt: its checkpoint
    # 1,299 // 384 * 384 - 384 = 768 is the junction, the prompt's block takes it; read with
    # the no-drop checkpoint (1,152) the rule would export 768 into a block of its own
    assert kv.get_mamba_prefill_checkpoint_position(1300, 384, True) == 768
    assert pc.junction_checkpoint(0, 1300, 1300, 768, 384, 768) == ("covered", 768)
    assert pc.junction_checkpoint(0, 1300, 1300, 768, 384, 1152) == ("export", 768)


def test_junction_columns_by_hand():
    # a row from 0 to 1,500 at block 384, its checkpoint in column 2: columns 0 and 1 are the
    # candidates; column 1 holds block 17 -> a junction at 768; null blocks (id 0) are none
    assert pc.junction_columns(0, 1500, 384, 2, [0, 17, 9, 5]) == [(768, 1)]
    assert pc.junction_columns(0, 1500, 384, 2, [0, 0, 9, 5]) == []
    # no checkpoint: up to the running column (cdiv(1200, 384) - 1 = 3); a row starting at 384
    assert pc.junction_columns(0, 1200, 384, -1, [0, 4, 6, 8]) == [(768, 1), (1152, 2)]
    assert pc.junction_columns(384, 1500, 384, 2, [11, 12, 9, 5]) == [(384, 1)]
    # a start off the block grid (a chunk run on past its next boundary, 768): the initial
    # state's column 1 takes the state there, 320 tokens in; with a checkpoint in column 2 or none
    assert pc.junction_columns(448, 1500, 384, 2, [11, 12, 9, 5]) == [(320, 1)]
    assert pc.junction_columns(448, 1500, 384, -1, [11, 12, 0, 5]) == [(320, 1)]
    assert pc.junction_columns(448, 1500, 384, -1, [11, 12, 7, 5]) == [(320, 1), (704, 2)]
    # a mid-block row that ends at or before that boundary (vLLM's own chunk): nothing
    assert pc.junction_columns(448, 768, 384, -1, [11, 12]) == []
    assert pc.junction_columns(448, 700, 384, -1, [11, 12]) == []


def test_plan_with_a_junction_by_hand():
    # a decode, then A (1,500 tokens: junction at 768 in column 1, checkpoint at 1,152 in column 2)
    # and B (300 tokens, checkpoint at 128 in column 0)
    qsl = [0, 1, 1501, 1801]
    plan = pc.plan_step(qsl, [0, 1152, 128], [-1, 2, 0], num_decodes=1, junctions={1: [(768, 1)]})
    assert plan.rows == (1, 1, 2) and plan.offsets == (768, 1152, 128) and plan.cols == (1, 2, 0)
    assert plan.conv_end == (769, 1153, 1629)
    # chunks of 64: A has 24 (0-23), B starts at 24: 768 // 64 = 12, 1152 // 64 = 18, 24 + 2
    assert plan.chunk_index == (12, 18, 26) and plan.chunk_starts == (0, 24) and plan.num_chunks == 29
    # rounds: A's three segments, B's two; the junction ends round 0, A's checkpoint round 1
    assert plan.rounds == (((0, 0, 768), (1, 1500, 1628)), ((0, 768, 1152), (1, 1628, 1800)),
                           ((0, 1152, 1500),))
    assert plan.round_of == (0, 1, 0) and plan.ckpt_seq == (0, 0, 1) and plan.several_per_row
    # the two-call split's view: heads up to each row's first checkpoint
    assert plan.head_spans == ((0, 768), (1500, 1628)) and plan.tail_spans == ((768, 1500), (1628, 1800))
    # the split in three calls: cu_seqlens 768 + 128, 384 + 172, 348; the rows a checkpoint ends
    # (A and B after round 0, A after round 1); laid end to end the states are A@768, B@128
    # (round 0), A@1152 (round 1): checkpoint 1 (A@1152) third, checkpoint 2 (B) second
    assert [plan.round_bounds(k) for k in range(3)] == [[0, 768, 896], [0, 384, 556], [0, 348]]
    assert plan.round_index(2) == [*range(1152, 1500)] and plan.round_index(0)[767:769] == [767, 1500]
    assert [plan.round_rows(k) for k in range(3)] == [[0, 1], [0, 1], [0]]
    assert plan.carried(0) == [0, 1] and plan.carried(1) == [0] and plan.carried(2) == []
    assert plan.round_order() == [0, 2, 1]
    with pytest.raises(ValueError, match="repeated"):
        pc.plan_step(qsl, [0, 768, 0], [-1, 1, -1], num_decodes=1, junctions={1: [(768, 1)]})
    # a junction alone (no prompt checkpoint in the row) makes a plan too
    alone = pc.plan_step(qsl, [0, 0, 0], [-1, -1, -1], num_decodes=1, junctions={1: [(768, 1)]})
    assert alone.rows == (1,) and alone.rounds[1] == ((0, 768, 1500),) and not alone.several_per_row


def test_budget_chunk_end_by_hand():
    # block 384, alignment 64: a non-final chunk offered 0-1,304 ends at 1,280 (vLLM's split:
    # 1,152); one offered to the prompt's end keeps it; one offered less than 64 tokens: nothing
    assert pc.budget_chunk_end(0, 1304, 3000) == 1280
    assert pc.budget_chunk_end(1280, 3000, 3000) == 3000
    assert pc.budget_chunk_end(1280, 1300, 3000) == 1280
    assert pc.budget_chunk_end(1280, 2000, 3000, alignment=128) == 1920


def test_mid_block_chunk_by_hand():
    # block 384: 976 tokens from 1,024 end at 1,152 (128); from 1,000, 100 tokens stay (1,100 <
    # 1,152); 152 tokens from 1,000 end exactly there; a start on the grid keeps its chunk
    assert pc.mid_block_chunk(1024, 976, 384) == 128
    assert pc.mid_block_chunk(1000, 100, 384) == 100
    assert pc.mid_block_chunk(1000, 152, 384) == 152
    assert pc.mid_block_chunk(768, 1232, 384) == 1232


def test_crossed_checkpoint_by_hand():
    # block 384. A final chunk 1,280-3,000: past 1,536 (b1) its prompt checkpoint 2,688
    # (2,999 // 384 * 384) takes a block of its own; 1,280-1,600: checkpoint 1,536 = b1 (the
    # initial state's block holds it): none; a start on the grid: vLLM's own
    assert pc.crossed_checkpoint(1280, 3000, 3000, 384) == 2688
    assert pc.crossed_checkpoint(1280, 1600, 1600, 384) == 0
    assert pc.crossed_checkpoint(1152, 3000, 3000, 384) == 0
    # a non-final chunk 1,280-2,560 (of 3,000): its last boundary 2,304; ending on the grid
    # (1,280-2,688): none (the running state is that boundary's); ending before b1: none
    assert pc.crossed_checkpoint(1280, 2560, 3000, 384) == 2304
    assert pc.crossed_checkpoint(1280, 2688, 3000, 384) == 0
    assert pc.crossed_checkpoint(1280, 1500, 3000, 384) == 0
    # off the alignment from the start (a start at 1,300): none
    assert pc.crossed_checkpoint(1300, 3000, 3000, 384) == 0


def test_crossed_checkpoint_under_the_drafter_drop_by_hand():
    # block 384, a 3,000-token prompt under EAGLE/MTP's block drop: a repeat's attention lookup
    # matches 2,999 // 384 = 7 blocks (2,688) and drops one, so it wants the state at 2,304
    assert pc.drop_checkpoint(3000, 384) == 2304
    assert pc.drop_checkpoint(3072, 384) == 2304  # 3,071 // 384 = 7 blocks too
    assert pc.drop_checkpoint(400, 384) == 0
    # a final chunk 1,280-3,000 (b1 1,536): 2,304 in a block of its own (no drop: 2,688);
    # 1,280-2,000: 1,920 - 384 = 1,536 = b1, which the initial state's block holds: none
    assert pc.crossed_checkpoint(1280, 3000, 3000, 384, drop=True) == 2304
    assert pc.crossed_checkpoint(1280, 2000, 2000, 384, drop=True) == 0
    # a non-final chunk 1,280-2,560 of 3,000: its last boundary 2,304 less one block, 1,920
    # (a request sharing those tokens meanwhile hits 2,304 - 384); ending on the grid at 2,688
    # (the running state holds 2,688): 2,304; ending at 2,000: 1,536 = b1, none
    assert pc.crossed_checkpoint(1280, 2560, 3000, 384, drop=True) == 1920
    assert pc.crossed_checkpoint(1280, 2688, 3000, 384, drop=True) == 2304
    assert pc.crossed_checkpoint(1280, 2000, 3000, 384, drop=True) == 0
    # a start on the grid (vLLM's manager reserves it) or off the alignment: none
    assert pc.crossed_checkpoint(1152, 3000, 3000, 384, drop=True) == 0
    assert pc.crossed_checkpoint(1300, 3000, 3000, 384, drop=True) == 0


def test_drop_chunk_end_by_hand():
    # block 384, a 3,000-token prompt, drop checkpoint 2,304 (no drop: 2,688). From 0 (on the
    # grid) vLLM's manager reserves (end - 1) // 384 * 384 - 384: at end 2,560 that is 1,920,
    # at 2,688 also 1,920 (2,687 // 384 = 6), so the chunk ends at 2,304; at 2,752: 2,304, kept
    assert pc.drop_chunk_end(0, 2560, 3000, 384) == 2304
    assert pc.drop_chunk_end(0, 2688, 3000, 384) == 2304
    assert pc.drop_chunk_end(0, 2752, 3000, 384) == 2752
    # ending at or below 2,304, or the final chunk: unchanged
    assert pc.drop_chunk_end(0, 2304, 3000, 384) == 2304
    assert pc.drop_chunk_end(0, 2240, 3000, 384) == 2240
    assert pc.drop_chunk_end(0, 3000, 3000, 384) == 3000
    # from 1,280 (off the grid, b1 1,536): ending at 2,560 it hands 1,920, so it ends at 2,304;
    # ending at 2,688 it hands 2,304 itself; from 2,048 (b1 2,304) the initial state's block
    # holds 2,304; from 2,304 or past it nothing is left to keep
    assert pc.drop_chunk_end(1280, 2560, 3000, 384) == 2304
    assert pc.drop_chunk_end(1280, 2688, 3000, 384) == 2688
    assert pc.drop_chunk_end(2048, 2560, 3000, 384) == 2560
    assert pc.drop_chunk_end(2304, 2560, 3000, 384) == 2560


def test_second_checkpoint_by_hand():
    # block 256, prefix-match unit 64. A cold 700-token prompt: vLLM 0.30 reserves its checkpoint
    # at 640 (699 // 64 * 64) in column cdiv(700, 256) - 2 = 1, which its full-block pass keys at
    # 512; the second block takes 640 and the column keeps 512
    assert pc.second_checkpoint(0, 700, 700, 640, 256) == 512
    # the checkpoint on the block grid (a 520-token prompt: 512): the column holds it already
    assert pc.second_checkpoint(0, 520, 520, 512, 256) == 0
    # no checkpoint reserved; a non-final chunk (0-640 of 700); a hit at 576 (512 not inside)
    assert pc.second_checkpoint(0, 700, 700, 0, 256) == 0
    assert pc.second_checkpoint(0, 640, 700, 576, 256) == 0
    assert pc.second_checkpoint(512, 700, 700, 640, 256) == 0
    assert pc.second_checkpoint(576, 700, 700, 640, 256) == 0
    # a hit at 320 (inside block 1): 512 is 192 tokens on, on the 64-token grid
    assert pc.second_checkpoint(320, 700, 700, 640, 256) == 512
    # a start at 32 (a 32-token unit): 512 - 32 is off the 64-token grid, the exporter cannot cut
    assert pc.second_checkpoint(32, 700, 700, 640, 256) == 0
    assert pc.second_checkpoint(32, 700, 700, 640, 256, alignment=32) == 512
