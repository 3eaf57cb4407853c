"""The pure cut logic of the lab's checkpoint policies (the runtime's until 2026-11-25) and of the split-rule extension point,
against positions worked out by hand."""

from __future__ import annotations

import random

import pytest

from vllm_hybrid_npu_lab.scheduling.split import (
    POLICY_NAMES,
    RETIRED_POLICIES,
    SplitRule,
    checkpoint_positions,
    policy_chunk_tokens,
    split_rule,
)


def test_named_policies_are_upstream_and_lean():
    assert POLICY_NAMES == ("upstream", "lean")
    assert split_rule("upstream") is None
    assert split_rule("lean").name == "lean"


@pytest.mark.parametrize("name", ["tail", "adaptive"])
def test_retired_names_raise_and_say_why(name):
    with pytest.raises(ValueError, match=f"'{name}' was retired"):
        policy_chunk_tokens(0, 3072, 3100, 256, name)
    with pytest.raises(ValueError, match=f"'{name}'"):
        checkpoint_positions(3100, 256, name, 4096)
    assert set(RETIRED_POLICIES) == {"tail", "adaptive", "gdn"}


def test_bad_input_names_the_value():
    with pytest.raises(ValueError, match="'every'"):
        policy_chunk_tokens(0, 10, 10, 256, "every")
    with pytest.raises(ValueError, match="block_size"):
        policy_chunk_tokens(0, 10, 10, 0, "lean")
    with pytest.raises(ValueError, match="num_new_tokens"):
        policy_chunk_tokens(0, -1, 10, 256, "upstream")


def test_chunk_cut_by_hand():
    # 3100-token prompt, block 256, upstream gives 3072 tokens (its stop at the last boundary)
    assert policy_chunk_tokens(0, 3072, 3100, 256, "upstream") == 3072
    # lean: the prompt's last 2 boundaries are 2816 and 3072; vLLM stops at 3072 itself
    assert policy_chunk_tokens(0, 3072, 3100, 256, "lean") == 2816
    assert policy_chunk_tokens(2816, 256, 3100, 256, "lean") == 256
    assert policy_chunk_tokens(3072, 28, 3100, 256, "lean") == 28  # the prompt's partial block
    # prompt shorter than one block: never split
    for p in POLICY_NAMES:
        assert policy_chunk_tokens(0, 200, 200, 256, p) == 200
    # decode (start >= prefill end) and empty chunks are never touched
    assert policy_chunk_tokens(3100, 1, 3100, 256, "lean") == 1
    assert policy_chunk_tokens(0, 0, 3100, 256, "lean") == 0


def test_step_ends_by_hand():
    # 3100 tokens, block 256, budget 4096: upstream = last boundary then the partial block
    assert checkpoint_positions(3100, 256, "upstream", 4096) == [3072, 3100]
    assert checkpoint_positions(3100, 256, "lean", 4096) == [2816, 3072, 3100]
    # block-aligned prompt: one step upstream
    assert checkpoint_positions(1024, 256, "upstream", 4096) == [1024]
    assert checkpoint_positions(1024, 256, "lean", 4096) == [768, 1024]
    # budget smaller than the prompt: upstream chunks at the budget (block-aligned)
    assert checkpoint_positions(5000, 256, "upstream", 2048) == [2048, 4096, 4864, 5000]


def test_split_rule_extension_point():
    calls = []

    def halve(start, n, end, bs):
        calls.append((start, n, end, bs))
        return max(1, n // 2)

    rule = SplitRule("halve", halve)
    assert split_rule(rule) is rule
    assert policy_chunk_tokens(0, 1000, 3000, 256, rule) == 500
    # decode, empty chunks: the rule is not asked
    assert policy_chunk_tokens(3000, 1, 3000, 256, rule) == 1
    assert policy_chunk_tokens(0, 0, 3000, 256, rule) == 0
    assert calls == [(0, 1000, 3000, 256)]
    # a rule that lengthens the chunk (or returns 0) is an error naming the rule
    with pytest.raises(ValueError, match="'grow'"):
        policy_chunk_tokens(0, 10, 3000, 256, SplitRule("grow", lambda s, n, e, b: n + 1))
    with pytest.raises(ValueError, match="'zero'"):
        policy_chunk_tokens(0, 10, 3000, 256, SplitRule("zero", lambda s, n, e, b: 0))


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_random_chunks_invariants(policy):
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    for _ in range(2000):
        bs = rng.choice([16, 256, 528, 1056, 2048])
        prefill_end = rng.randrange(1, 20 * bs)
        start = rng.randrange(0, prefill_end + 2)
        n = rng.randrange(0, 8 * bs)
        got = policy_chunk_tokens(start, n, prefill_end, bs, policy)
        assert 0 <= got <= n, f"seed {seed}"
        assert (got == 0) == (n == 0), f"seed {seed}"
        if got < n:  # a cut: ends on a block boundary strictly inside the chunk, in the prefill
            end = start + got
            assert end % bs == 0 and start < end < min(start + n, prefill_end), f"seed {seed}"
            if policy == "lean":  # the boundary one block below the prompt's last one
                assert end == prefill_end // bs * bs - bs, f"seed {seed}"
