"""The ``lean`` policy's rules (``vllm_hybrid_npu_lab.scheduling.retention``), on cases worked out by
hand from the policy's definition (docs/first-repeat-hits.md, "The policies": chunk ends at the
prompt's last 2 block boundaries, at most one extra step; states kept: those 2, the boundaries
crossed in decode, vLLM's junctions; freed blocks leave the cache as segments, each kept state
before the attention blocks only it makes usable, orphaned attention blocks first).

Block size 256 tokens throughout; a boundary is a multiple of 256; the prompt's last boundary is
``floor(prompt / 256) * 256``. Every expected value is derived in the comment above it, not
read off the code. (The engine-level counterparts are in tests/lab/scheduling/test_lean.py.)
"""

from __future__ import annotations

import pytest

from vllm_hybrid_npu_lab.scheduling.retention import (
    eviction_order,
    extra_stops,
    kept_boundaries,
    ladder_boundaries,
    window_boundaries,
)

BS = 256
WINDOW = 2  # lean's window per the docs; the code's constant is checked below


def test_lean_window_is_the_documented_two():
    from vllm_hybrid_npu_lab.scheduling.split import LEAN_WINDOW

    assert LEAN_WINDOW == WINDOW


@pytest.mark.parametrize(
    "prompt, window, want",
    [
        # 2000 // 256 = 7 -> last boundary 1792; the one before it 1536
        (2000, 2, [1536, 1792]),
        # 4000 // 256 = 15 -> 3840, and 3584
        (4000, 2, [3584, 3840]),
        # a prompt of exactly 2 blocks: last boundary is the prompt end, 512, and 256
        (512, 2, [256, 512]),
        # 300 tokens: only boundary 256 lies inside; the window's other slot would be 0 (none)
        (300, 2, [256]),
        # shorter than a block: no boundary at all
        (100, 2, []),
        # window 3 on 2000 tokens: 1280, 1536, 1792
        (2000, 3, [1280, 1536, 1792]),
        # window 1: vLLM's own replay boundary only
        (2000, 1, [1792]),
    ],
)
def test_window_boundaries(prompt, window, want):
    assert window_boundaries(prompt, BS, window) == want


@pytest.mark.parametrize(
    "last, want",
    [
        # 1, 2, 4 blocks below 7 blocks; 8 blocks (2048) is past 1792
        (1792, [256, 512, 1024]),
        # strictly below: 1024 itself is not a ladder stop
        (1024, [256, 512]),
        (256, []),
        (0, []),
    ],
)
def test_ladder_boundaries(last, want):
    assert ladder_boundaries(last, BS) == want


def test_kept_boundaries_add_the_latest_decode_boundary():
    # 1000-token prompt: last boundary 768, window {512, 768}. While decoding, the latest
    # boundary crossed is kept too: at 1100 tokens that is 1024, at 1300 tokens 1280 (so over
    # the whole decode both 1024 and 1280 were kept, 4 states with the window).
    assert kept_boundaries(1000, 1000, BS, WINDOW, False) == [512, 768]
    assert kept_boundaries(1000, 1023, BS, WINDOW, False) == [512, 768]
    assert kept_boundaries(1000, 1100, BS, WINDOW, False) == [512, 768, 1024]
    assert kept_boundaries(1000, 1300, BS, WINDOW, False) == [512, 768, 1280]
    # 4000-token prompt, 1 output token: 4001 // 256 * 256 = 3840 is the prompt's own last
    # boundary, nothing new: 2 states
    assert kept_boundaries(4000, 4001, BS, WINDOW, False) == [3584, 3840]
    # with the ladder on a 2000-token prompt: {256, 512, 1024} + {1536, 1792}
    assert kept_boundaries(2000, 2000, BS, WINDOW, True) == [256, 512, 1024, 1536, 1792]


def test_kept_boundaries_rejects_fewer_tokens_than_the_prompt():
    with pytest.raises(ValueError, match="num_tokens"):
        kept_boundaries(1000, 999, BS, WINDOW, False)


def test_extra_stops_cost_at_most_one_step():
    # A cold 2000-token prompt; vLLM's align split ends the first chunk at the last boundary,
    # 1792. lean adds a stop at 1536 (the window's other boundary): chunks 0-1536, 1536-1792,
    # 1792-2000, one step more than upstream's 0-1792, 1792-2000.
    assert extra_stops(0, 1792, 2000, BS, WINDOW, False) == 1536
    assert extra_stops(1536, 256, 2000, BS, WINDOW, False) == 256  # 1536 is the start, not inside
    assert extra_stops(1792, 208, 2000, BS, WINDOW, False) == 208  # the tail: no stop left
    # a chunk that ends before the stop (token budget 1000) is left alone
    assert extra_stops(0, 1000, 2000, BS, WINDOW, False) == 1000
    # decode (start at or past the prompt end) and empty chunks are never cut
    assert extra_stops(2000, 1, 2000, BS, WINDOW, False) == 1
    assert extra_stops(0, 0, 2000, BS, WINDOW, False) == 0


def test_extra_stops_with_the_ladder_walk_it_up():
    # ladder below 1792: 256, 512, 1024, plus the window stop 1536: chunks end at each in turn
    ends, start = [], 0
    while start < 1792:
        start += extra_stops(start, 1792 - start, 2000, BS, WINDOW, True)
        ends.append(start)
    assert ends == [256, 512, 1024, 1536, 1792]


def test_eviction_order_segments_and_orphans():
    # 2000-token prompt: blocks 0..6, states kept at blocks 5 and 6 (boundaries 1536, 1792).
    # Block 6's state makes only attention block 6 usable beyond what block 5's covers:
    # segment (state 6, attn 6) leaves first, then (state 5, attn 5 .. 0). No orphans: block 6
    # is the last block.
    orphans, segments = eviction_order(7, [5, 6])
    assert orphans == []
    assert segments == [("state", 6), ("attn", 6), ("state", 5)] + [("attn", i) for i in range(5, -1, -1)]
    # 8 blocks with the only state at block 5: attention blocks 7 and 6 are orphans (no state
    # at or past them, no hit can use them), tail first
    orphans, segments = eviction_order(8, [5])
    assert orphans == [7, 6]
    assert segments == [("state", 5)] + [("attn", i) for i in range(5, -1, -1)]


def test_eviction_order_low_value_states_leave_first():
    # the ladder states of a 2000-token prompt (blocks 0, 1, 3 = 256, 512, 1024) never hit:
    # they leave first, shallowest first, and do not split the segments of the others
    orphans, segments = eviction_order(7, [0, 1, 3, 5, 6], low_value=[0, 1, 3])
    assert orphans == []
    assert segments == ([("state", 0), ("state", 1), ("state", 3), ("state", 6), ("attn", 6),
                         ("state", 5)] + [("attn", i) for i in range(5, -1, -1)])


def test_eviction_order_without_usable_state():
    # a state index past the request's blocks is ignored: every block is an orphan
    assert eviction_order(3, [10]) == ([2, 1, 0], [])
    assert eviction_order(0, []) == ([], [])
