"""Miss reasons of :mod:`vllm_hybrid_npu.core.miss_reasons` on hand-computed cases."""

from __future__ import annotations

import random

import pytest

from vllm_hybrid_npu.core.miss_reasons import (
    COMPUTED,
    ENTRY,
    NEVER,
    REASONS,
    MissTracker,
    SeenBlocks,
    classify_miss,
    drafter_drop_tokens,
)

NONE_SEEN = lambda j: False  # noqa: E731
ALL_SEEN = lambda j: True  # noqa: E731


def _c(**kw):
    return {r: kw.get(r, 0) for r in REASONS}


def test_prompt_shorter_than_one_block_is_all_partial():
    # 100 tokens, 256-token blocks: no boundary before the last token.
    assert classify_miss(100, 0, 0, 256, ALL_SEEN) == _c(partial_block=100)


def test_exact_multiple_of_the_block_recomputes_the_last_block():
    # 512 tokens: a hit reaches at most 511 -> 256; block 1 (256 tokens) is past the reach.
    assert classify_miss(512, 256, 512, 256, ALL_SEEN) == _c(partial_block=256)
    # nothing cached: block 0 never seen -> new, block 1 partial
    assert classify_miss(512, 0, 0, 256, NONE_SEEN) == _c(new=256, partial_block=256)


def test_attention_cached_without_state_is_no_state():
    # 1000 tokens, U=100: reach 900. Hit 200 (state at 200), attention cached to 700.
    # no_state 500, blocks 7 and 8 (200 tokens): seen -> evicted, tail 100 partial.
    assert classify_miss(1000, 200, 700, 100, ALL_SEEN) == _c(
        partial_block=100, no_state=500, evicted=200
    )
    # attention beyond the reach is capped at the reach
    assert classify_miss(1000, 200, 1000, 100, NONE_SEEN) == _c(partial_block=100, no_state=700)


def test_evicted_vs_new_per_block_and_host_tier():
    seen = [True, True, False, True, False]
    # 501 tokens, U=100: reach 500, hit 0, attention 0: blocks 0..4. The entry at block 3
    # covered blocks 0..3 (hash chain): 400 evicted; block 4 never seen: new.
    got = classify_miss(501, 0, 0, 100, seen)
    assert got == _c(partial_block=1, evicted=400, new=100)
    got = classify_miss(501, 0, 0, 100, seen, host_tier=True)
    assert got == _c(partial_block=1, evicted_host=400, new=100)


def test_sub_block_prefix_without_an_entry_is_partial_block():
    # U=16 inside 64-token cache blocks, N=161: reach 160 (10 hash blocks). Hash blocks 0..3
    # had an entry (a full cache block), 4..6 were computed by an earlier prompt that ended
    # inside the next cache block (no entry there), 7..9 never seen.
    E, C, N0 = ENTRY, COMPUTED, NEVER
    got = classify_miss(161, 0, 0, 16, [E, C, C, E, C, C, C, N0, N0, N0])
    assert got == _c(evicted=64, partial_block=1 + 48, new=48)


def test_unaligned_connector_hit_splits_inside_a_block():
    # hit 150 (not block aligned), U=100, N=401: reach 400; tokens 150..200 go with block 1.
    assert classify_miss(401, 150, 0, 100, [False, True, False, False]) == _c(
        partial_block=1, evicted=50, new=200
    )


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="hash_block_size"):
        classify_miss(10, 0, 0, 0, NONE_SEEN)
    with pytest.raises(ValueError, match="hit_tokens"):
        classify_miss(10, 11, 0, 4, NONE_SEEN)


def test_counts_always_add_up_to_the_missed_tokens():
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    for _ in range(2000):
        u = rng.choice([1, 4, 16, 64, 256])
        n = rng.randrange(0, 3000)
        hit = rng.randrange(0, n + 1)
        attn = rng.randrange(0, n + 1)
        flags = [rng.choice((NEVER, COMPUTED, ENTRY)) for _ in range(n // u + 1)]
        got = classify_miss(n, hit, attn, u, flags, host_tier=rng.random() < 0.5)
        assert sum(got.values()) == n - hit, f"seed={seed}"
        assert min(got.values()) >= 0, f"seed={seed}"


def test_seen_blocks_forget_the_oldest():
    s = SeenBlocks(3)
    s.add([b"a", b"b", b"c"])
    s.add([b"a"])  # refresh a
    s.add([b"d"])  # forgets b
    assert b"b" not in s and all(h in s for h in (b"a", b"c", b"d")) and len(s) == 3
    with pytest.raises(ValueError, match="capacity"):
        SeenBlocks(0)


def test_tracker_sequence_new_then_evicted_then_no_state():
    t = MissTracker(hash_block_size=4)
    h = [b"h0", b"h1", b"h2"]  # a 12-token prompt's three blocks (13 tokens -> reach 12)
    assert t.on_admit(h, 13, 0, 0) == _c(new=12, partial_block=1)
    t.on_cached(h, 13)  # finished: its 3 full blocks were cached
    # all attention blocks and states gone (evicted), second request with the same prompt
    assert t.on_admit(h, 13, 0, 0) == _c(evicted=12, partial_block=1)
    # attention cached to 12, a state only at 4
    assert t.on_admit(h, 13, 4, 12) == _c(no_state=8, partial_block=1)
    assert t.totals["requests"] == 3 and t.totals["prompt_tokens"] == 39
    assert t.totals["hit_tokens"] == 4
    assert t.totals["new"] == 12 and t.totals["evicted"] == 12 and t.totals["no_state"] == 8
    d = t.drain()
    assert d == t.totals and t.drain()["requests"] == 0


def test_tracker_only_full_computed_blocks_are_cached():
    t = MissTracker(hash_block_size=4)
    h = [b"x0", b"x1", b"x2"]
    t.on_cached(h, 7)  # only block 0 full
    assert t.on_admit(h, 13, 0, 0) == _c(evicted=4, new=8, partial_block=1)


def test_tracker_fine_grained_entries_are_full_blocks_and_the_prompt_tail():
    # U=16, cache block 64. A 100-token prompt computed 105 tokens: 6 full hash blocks; entries:
    # block end (hash block 3) and the prompt's last hash boundary 96 (hash block 5).
    t = MissTracker(hash_block_size=16, block_size=64)
    h = [bytes([i]) for i in range(8)]
    t.on_cached(h, 105, num_prompt_tokens=100)
    assert [t.seen.state(x) for x in h] == [COMPUTED] * 3 + [ENTRY, COMPUTED, ENTRY, NEVER, NEVER]
    # the same prefix, 129 tokens: reach 128 (8 hash blocks): entry at 5 covers 0..5 -> 96
    # evicted; 6, 7 new; tail 1 partial.
    assert t.on_admit(h, 129, 0, 0) == _c(evicted=96, new=32, partial_block=1)
    # a prompt sharing only hash blocks 0..4 (80 tokens) then different: block 4 computed, no
    # entry covers 0..4 except... the block-end entry at 3 does: 64 evicted, 16 partial_block.
    h2 = h[:5] + [b"x", b"y", b"z"]
    assert t.on_admit(h2, 129, 0, 0) == _c(evicted=64, partial_block=16 + 1, new=48)
    with pytest.raises(ValueError, match="prefix-match-unit"):
        MissTracker(hash_block_size=16, block_size=40)


def test_drafter_drop_by_hand():
    # 1000 tokens, hash block 100: a hit reaches at most R = 900; EAGLE/MTP's drop unit D = 100.
    # A repeat of a cached prompt: the attention lookup matched 900 and dropped [800, 900), so
    # the post-drop attention prefix A and vLLM's hit H are 800.
    got = classify_miss(1000, 800, 800, 100, ALL_SEEN, drop_tokens=100)
    assert got == _c(partial_block=100, drafter_drop=100)
    # the same counts without the drop read those 100 tokens as evicted, which they are not
    assert classify_miss(1000, 800, 800, 100, ALL_SEEN) == _c(partial_block=100, evicted=100)
    # a sharer of a cached 500-token prefix: matched 500, dropped [400, 500), the rest never seen
    shared = [ENTRY] * 5 + [NEVER] * 5
    assert classify_miss(1000, 400, 400, 100, shared, drop_tokens=100) == _c(
        partial_block=100, drafter_drop=100, new=400)
    # ... with no GDN state below the drop: [0, 400) is no_state, as without the drop
    assert classify_miss(1000, 0, 400, 100, shared, drop_tokens=100) == _c(
        partial_block=100, no_state=400, drafter_drop=100, new=400)
    # a repeat whose [700, 900) was evicted: matched 700, dropped [600, 700); [700, 900) evicted
    assert classify_miss(1000, 600, 600, 100, ALL_SEEN, drop_tokens=100) == _c(
        partial_block=100, drafter_drop=100, evicted=200)
    # fine-grained hits off (D = the 300-token block, hash block 100): matched 900, dropped 300
    assert classify_miss(1000, 600, 600, 100, ALL_SEEN, drop_tokens=300) == _c(
        partial_block=100, drafter_drop=300)
    # vLLM reports A = 0 where the attention prefix is the hit itself (no uncached prefix)
    assert classify_miss(1000, 800, 0, 100, ALL_SEEN, drop_tokens=100) == _c(
        partial_block=100, drafter_drop=100)
    # A = H = 0: nothing is the drafter's (a dropped first unit is not told from a miss)
    assert classify_miss(1000, 0, 0, 100, NONE_SEEN, drop_tokens=100) == _c(new=900, partial_block=100)
    with pytest.raises(ValueError, match="drop_tokens"):
        classify_miss(1000, 0, 0, 100, NONE_SEEN, drop_tokens=150)


def test_drafter_drop_unit():
    assert drafter_drop_tokens(False, 384, 64, True) == 0
    assert drafter_drop_tokens(True, 384, 384, False) == 384
    assert drafter_drop_tokens(True, 384, 64, True) == 64  # --prefix-match-unit 64, fine-grained
    assert drafter_drop_tokens(True, 384, 64, False) == 384  # fine-grained hits disabled
    with pytest.raises(ValueError, match="multiple"):
        drafter_drop_tokens(True, 100, 64, True)


def test_counts_add_up_under_the_drafter_drop():
    # The drop re-labels at most one drop unit above the attention prefix as drafter_drop, taken
    # from what the same counts without the drop call evicted, new or partial_block; no_state and
    # the tail past R keep their counts.
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    for _ in range(2000):
        u = rng.choice([1, 4, 16, 64, 256])
        d = u * rng.choice([1, 1, 2, 6])
        n = rng.randrange(0, 3000)
        hit = rng.randrange(0, n + 1)
        attn = rng.randrange(0, n + 1)
        flags = [rng.choice((NEVER, COMPUTED, ENTRY)) for _ in range(n // u + 1)]
        host = rng.random() < 0.5
        got = classify_miss(n, hit, attn, u, flags, host_tier=host, drop_tokens=d)
        plain = classify_miss(n, hit, attn, u, flags, host_tier=host)
        where = f"seed={seed} n={n} hit={hit} attn={attn} u={u} d={d}"
        assert sum(got.values()) == n - hit, where
        assert min(got.values()) >= 0, where
        assert got["drafter_drop"] <= d and (max(attn, hit) > 0 or got["drafter_drop"] == 0), where
        assert got["no_state"] == plain["no_state"], where
        moved = {r: plain[r] - got[r] for r in ("partial_block", "evicted", "evicted_host", "new")}
        assert min(moved.values()) >= 0 and sum(moved.values()) == got["drafter_drop"], where
