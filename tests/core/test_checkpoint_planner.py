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
    assert plan.token_index("head") == [*range(0, 328), *range(500, 564)]
    assert plan.token_index("tail") == [*range(328, 500), *range(564, 600)]


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
