"""The lab-only ``tail`` and ``adaptive`` split rules (retired from the runtime on 2026-11-23),
against positions worked out by hand, through the split-rule extension point of ``vllm_hybrid_npu_lab.scheduling``."""

from __future__ import annotations

import random

import pytest

from vllm_hybrid_npu_lab.scheduling.split import checkpoint_positions, policy_chunk_tokens
from vllm_hybrid_npu_lab.retired_policies import ADAPTIVE, RULES, TAIL, next_checkpoint_stop


def test_next_stop_by_hand():
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
    with pytest.raises(ValueError, match="'lean'"):
        next_checkpoint_stop(0, 256, "lean")


def test_chunk_cut_by_hand():
    # 3100-token prompt, upstream gives 3072 tokens (its stop at the last block boundary)
    assert policy_chunk_tokens(0, 3072, 3100, 256, TAIL) == 256
    assert policy_chunk_tokens(2816, 256, 3100, 256, TAIL) == 256  # stop == end: unchanged
    assert policy_chunk_tokens(3072, 28, 3100, 256, TAIL) == 28  # the partial block
    assert policy_chunk_tokens(1024, 2048, 3100, 256, ADAPTIVE) == 1024  # to 2048
    assert policy_chunk_tokens(2048, 1024, 3100, 256, ADAPTIVE) == 1024  # 4096 > last boundary
    for rule in RULES.values():  # prompt shorter than one block: never split
        assert policy_chunk_tokens(0, 200, 200, 256, rule) == 200
    # after a cache hit in mid-block (start 300): next boundary 512
    assert policy_chunk_tokens(300, 1000, 1300, 256, TAIL) == 212
    # decode (start >= prefill end) is never touched
    assert policy_chunk_tokens(3100, 1, 3100, 256, TAIL) == 1
    assert policy_chunk_tokens(0, 0, 3100, 256, TAIL) == 0


def test_step_ends_by_hand():
    assert checkpoint_positions(3100, 256, TAIL, 4096) == [256 * k for k in range(1, 13)] + [3100]
    assert checkpoint_positions(3100, 256, ADAPTIVE, 4096) == [256, 512, 1024, 2048, 3072, 3100]
    assert checkpoint_positions(1024, 256, ADAPTIVE, 4096) == [256, 512, 1024]


@pytest.mark.parametrize("name", ["tail", "adaptive"])
def test_random_chunks_invariants(name):
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    for _ in range(2000):
        bs = rng.choice([16, 256, 528, 1056, 2048])
        prefill_end = rng.randrange(1, 20 * bs)
        start = rng.randrange(0, prefill_end + 2)
        n = rng.randrange(0, 8 * bs)
        got = policy_chunk_tokens(start, n, prefill_end, bs, RULES[name])
        assert 0 <= got <= n and (got == 0) == (n == 0), f"seed {seed}"
        if got < n:  # a cut: ends on a block boundary strictly inside the chunk, in the prefill
            end = start + got
            assert end % bs == 0 and start < end < min(start + n, prefill_end), f"seed {seed}"
            if name == "tail":  # the first boundary after start
                assert end == (start // bs + 1) * bs, f"seed {seed}"
            else:  # a power-of-two number of blocks below the last boundary
                k = end // bs
                assert k & (k - 1) == 0 and end < prefill_end // bs * bs, f"seed {seed}"


def test_a_policy_written_for_another_vllm_is_refused_by_name(monkeypatch):
    """The retired runtime policies hook vLLM 0.30's coordinator; on another vLLM they are
    refused with the policy, the versions and the installed one named (not replayed wrongly)."""
    import vllm

    from vllm_hybrid_npu.support import base_version
    from vllm_hybrid_npu_lab.policies import POLICIES, get_policy, load_policy_modules, policy_unavailable
    from vllm_hybrid_npu_lab.registry import Policy

    load_policy_modules()
    installed = base_version(vllm.__version__)
    other = Policy(name="old-rule", description="test", scheduler_class=object, vllm=("0.1.0",))
    here = Policy(name="this-rule", description="test", scheduler_class=object, vllm=(installed,))
    monkeypatch.setitem(POLICIES, other.name, other)
    monkeypatch.setitem(POLICIES, here.name, here)
    with pytest.raises(ValueError, match=rf"--policy 'old-rule': .*vLLM 0\.1\.0 \(installed: {installed}\)"):
        get_policy("old-rule")
    assert get_policy("this-rule") is here and policy_unavailable("this-rule") is None
    # the retired runtime policies name vLLM 0.30.0 only
    assert {POLICIES[n].vllm for n in ("lean", "tail", "adaptive", "gdn-lean")} == {("0.30.0",)}
    assert (policy_unavailable("lean") is None) == (installed == "0.30.0")
