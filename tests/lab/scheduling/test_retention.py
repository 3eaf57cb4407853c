"""The pure retention / eviction-order logic of the ``lean`` policy, against values worked out by
hand from the rules in ``vllm_hybrid_npu_lab/scheduling/retention.py``, plus random invariants."""

from __future__ import annotations


import pytest

from vllm_hybrid_npu_lab.scheduling.retention import (
    eviction_order,
    extra_stops,
    kept_boundaries,
    ladder_boundaries,
    window_boundaries,
)


def test_boundaries_by_hand():
    # 3100-token prompt, block 256: last boundary 12 * 256 = 3072
    assert window_boundaries(3100, 256, 1) == [3072]
    assert window_boundaries(3100, 256, 2) == [2816, 3072]
    assert window_boundaries(512, 256, 3) == [256, 512]  # no boundary at 0
    assert window_boundaries(200, 256, 2) == []  # shorter than a block
    assert ladder_boundaries(3072, 256) == [256, 512, 1024, 2048]
    assert ladder_boundaries(256, 256) == []
    assert kept_boundaries(3100, 3100, 256, 2, False) == [2816, 3072]
    assert kept_boundaries(3100, 3100, 256, 2, True) == [256, 512, 1024, 2048, 2816, 3072]
    # decode crossed 3328: the latest decode boundary is kept
    assert kept_boundaries(3100, 3400, 256, 2, False) == [2816, 3072, 3328]
    assert kept_boundaries(3100, 3300, 256, 1, False) == [3072]


def test_extra_stops_by_hand():
    # vLLM gives 3072 (its stop at the last boundary); lean stops first at 2816 (last - 1)
    assert extra_stops(0, 3072, 3100, 256, 2, False) == 2816
    assert extra_stops(2816, 256, 3100, 256, 2, False) == 256  # the stop is the chunk's end
    assert extra_stops(0, 3072, 3100, 256, 3, False) == 2560
    assert extra_stops(0, 3072, 3100, 256, 2, True) == 256  # ladder first
    assert extra_stops(1024, 2048, 3100, 256, 2, True) == 1024  # to 2048
    assert extra_stops(2048, 1024, 3100, 256, 2, True) == 768  # to 2816
    assert extra_stops(0, 200, 200, 256, 2, True) == 200  # shorter than a block
    assert extra_stops(3100, 1, 3100, 256, 2, True) == 1  # decode
    assert extra_stops(0, 0, 3100, 256, 2, True) == 0


def test_extra_stops_random_invariants(rng):
    for _ in range(3000):
        bs = rng.choice([16, 256, 1056, 2048])
        end = rng.randrange(1, 40 * bs)
        start = rng.randrange(0, end + 2)
        n = rng.randrange(0, 8 * bs)
        window = rng.randint(1, 4)
        ladder = rng.random() < 0.5
        got = extra_stops(start, n, end, bs, window, ladder)
        assert 0 <= got <= n and (got == 0) == (n == 0)
        if got < n:  # a cut lands on a kept boundary strictly inside the chunk and the prompt
            stop = start + got
            assert start < stop < min(start + n, end)
            assert stop in kept_boundaries(end, end, bs, window, ladder)


def test_eviction_order_by_hand():
    # 5 blocks, states after blocks 1 and 3: block 4 is an orphan; segments tail first
    orphans, seg = eviction_order(5, [1, 3])
    assert orphans == [4]
    assert seg == [("state", 3), ("attn", 3), ("attn", 2), ("state", 1), ("attn", 1), ("attn", 0)]
    # no state: every block is an orphan
    assert eviction_order(3, []) == ([2, 1, 0], [])
    # a low-value state leaves first and does not delimit a segment
    orphans, seg = eviction_order(6, [0, 2, 4], low_value=[0])
    assert orphans == [5]
    assert seg == [
        ("state", 0),
        ("state", 4), ("attn", 4), ("attn", 3),
        ("state", 2), ("attn", 2), ("attn", 1), ("attn", 0),
    ]
    # the top state is never low-value; states past the blocks are ignored
    assert eviction_order(2, [1, 7], low_value=[1])[1][0] == ("state", 1)


def test_eviction_order_random_covers_each_block_once(rng):
    for _ in range(500):
        n = rng.randint(0, 40)
        states = {rng.randrange(0, 45) for _ in range(rng.randint(0, 8))}
        low = {s for s in states if rng.random() < 0.4}
        orphans, seg = eviction_order(n, states, low)
        attn = orphans + [i for k, i in seg if k == "attn"]
        assert sorted(attn) == list(range(n))
        kept = {s for s in states if s < n}
        assert sorted(i for k, i in seg if k == "state") == sorted(kept)
        assert all(o > max(kept, default=-1) for o in orphans)
        # each segment: its state, then the attention blocks only it covers (tail first)
        pos = {x: j for j, x in enumerate(seg)}
        top = max(kept, default=None)
        heads = sorted((kept - low) | ({top} if top is not None else set()))
        for j, s in enumerate(heads):
            lower = heads[j - 1] if j else -1
            covered = [pos[("attn", i)] for i in range(s, lower, -1)]
            assert covered == sorted(covered) and pos[("state", s)] < covered[0]


def test_bad_input_names_the_value():
    with pytest.raises(ValueError, match="window"):
        window_boundaries(100, 16, 0)
    with pytest.raises(ValueError, match="block_size"):
        ladder_boundaries(100, 0)
    with pytest.raises(ValueError, match="num_tokens"):
        kept_boundaries(100, 50, 16, 1, False)
