"""The pure cut logic of the checkpoint policies, against positions worked out by hand."""

from __future__ import annotations

import random

import pytest

from vllm_hybrid_npu.scheduling.split import (
    POLICY_NAMES,
    checkpoint_positions,
    next_checkpoint_stop,
    policy_chunk_tokens,
)


def test_next_stop_by_hand():
    assert next_checkpoint_stop(0, 256, "upstream") is None
    assert next_checkpoint_stop(0, 256, "tail") == 256
    assert next_checkpoint_stop(255, 256, "tail") == 256
    assert next_checkpoint_stop(256, 256, "tail") == 512
    assert next_checkpoint_stop(700, 256, "tail") == 768
    # adaptive ladder: 1, 2, 4, 8 blocks
    assert next_checkpoint_stop(0, 256, "adaptive") == 256
    assert next_checkpoint_stop(256, 256, "adaptive") == 512
    assert next_checkpoint_stop(512, 256, "adaptive") == 1024
    assert next_checkpoint_stop(1024, 256, "adaptive") == 2048
    assert next_checkpoint_stop(1500, 256, "adaptive") == 2048


def test_bad_input_names_the_value():
    with pytest.raises(ValueError, match="'every'"):
        next_checkpoint_stop(0, 256, "every")
    with pytest.raises(ValueError, match="block_size"):
        policy_chunk_tokens(0, 10, 10, 0, "tail")
    with pytest.raises(ValueError, match="num_new_tokens"):
        policy_chunk_tokens(0, -1, 10, 256, "tail")


def test_chunk_cut_by_hand():
    # 3100-token prompt, upstream gives 3072 tokens (its stop at the last block boundary)
    assert policy_chunk_tokens(0, 3072, 3100, 256, "upstream") == 3072
    assert policy_chunk_tokens(0, 3072, 3100, 256, "tail") == 256
    assert policy_chunk_tokens(2816, 256, 3100, 256, "tail") == 256  # stop == end: unchanged
    assert policy_chunk_tokens(3072, 28, 3100, 256, "tail") == 28  # the tail chunk
    assert policy_chunk_tokens(1024, 2048, 3100, 256, "adaptive") == 1024  # to 2048
    assert policy_chunk_tokens(2048, 1024, 3100, 256, "adaptive") == 1024  # 4096 > last boundary
    # prompt shorter than one block: never split
    for p in POLICY_NAMES:
        assert policy_chunk_tokens(0, 200, 200, 256, p) == 200
    # after a cache hit in mid-block (start 300): next boundary 512
    assert policy_chunk_tokens(300, 1000, 1300, 256, "tail") == 212
    # decode (start >= prefill end) is never touched
    assert policy_chunk_tokens(3100, 1, 3100, 256, "tail") == 1
    assert policy_chunk_tokens(0, 0, 3100, 256, "tail") == 0


def test_step_ends_by_hand():
    # 3100 tokens, block 256, budget 4096: upstream = last boundary then tail
    assert checkpoint_positions(3100, 256, "upstream", 4096) == [3072, 3100]
    assert checkpoint_positions(3100, 256, "tail", 4096) == [256 * k for k in range(1, 13)] + [3100]
    assert checkpoint_positions(3100, 256, "adaptive", 4096) == [256, 512, 1024, 2048, 3072, 3100]
    # block-aligned prompt: one step upstream
    assert checkpoint_positions(1024, 256, "upstream", 4096) == [1024]
    assert checkpoint_positions(1024, 256, "adaptive", 4096) == [256, 512, 1024]
    # budget smaller than the prompt: upstream chunks at the budget (block-aligned)
    assert checkpoint_positions(5000, 256, "upstream", 2048) == [2048, 4096, 4864, 5000]


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_random_chunks_invariants(policy):
    rng = random.Random()
    for _ in range(2000):
        bs = rng.choice([16, 256, 528, 1056, 2048])
        prefill_end = rng.randrange(1, 20 * bs)
        start = rng.randrange(0, prefill_end + 2)
        n = rng.randrange(0, 8 * bs)
        got = policy_chunk_tokens(start, n, prefill_end, bs, policy)
        assert 0 <= got <= n
        assert (got == 0) == (n == 0)
        if got < n:  # a cut: ends on a block boundary strictly inside the chunk, in the prefill
            end = start + got
            assert end % bs == 0 and start < end < min(start + n, prefill_end)
            if policy == "tail":  # the first boundary after start
                assert end == (start // bs + 1) * bs
            if policy == "adaptive":  # a power-of-two number of blocks below the last boundary
                k = end // bs
                assert k & (k - 1) == 0 and end < prefill_end // bs * bs
