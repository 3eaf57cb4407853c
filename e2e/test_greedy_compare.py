"""The tolerance rule the e2e tests use across schedules (e2e/greedy_compare.py), on hand-made
sequences (no engine)."""

from __future__ import annotations

from greedy_compare import Sequence, compare_greedy, compare_outputs


def _seq(*positions):
    """positions: (chosen token, {token: logprob}) per generated token."""
    return Sequence([t for t, _ in positions], [lp for _, lp in positions])


A = (5, {5: -1.0, 6: -1.02, 7: -3.0})
B = (9, {9: -0.5, 3: -2.5})


def test_identical_and_small_noise_pass():
    c = compare_greedy([_seq(A, B)], [_seq((5, {5: -1.1, 6: -1.0 - 0.2, 7: -3.0}), B)], bound=0.25)
    assert c.ok and c.identical == 1 and c.near_ties == []
    assert abs(c.max_chosen_diff - 0.1) < 1e-9


def test_first_difference_at_a_near_tie_passes_and_stops_the_comparison():
    ref = _seq(A, B)
    got = _seq((6, {6: -1.0, 5: -1.01, 7: -3.0}), (1, {1: -0.1}))  # after the flip: anything
    c = compare_greedy([ref], [got], bound=0.25)
    assert c.ok and c.identical == 0 and [(r, p) for r, p, _, _ in c.near_ties] == [(0, 0)]


def test_flip_without_a_tie_fails():
    ref = _seq(B)
    got = _seq((3, {3: -0.5, 9: -2.5}))  # 9 vs 3 by 2 nats in each run
    c = compare_greedy([ref], [got], bound=0.25)
    assert not c.ok and "no near-tie" in c.errors[0]


def test_flip_to_a_token_outside_the_other_top_fails():
    c = compare_greedy([_seq(B)], [_seq((4, {4: -0.4, 8: -0.6}))], bound=5.0)
    assert not c.ok and "not in each other's top" in c.errors[0]


def test_same_token_with_a_different_distribution_fails():
    c = compare_greedy([_seq(B)], [_seq((9, {9: -1.5, 3: -1.6}))], bound=0.25)
    assert not c.ok and "|diff| 1.0000" in c.errors[0]


def test_length_mismatch_fails():
    c = compare_greedy([_seq(A, B)], [_seq(A)])
    assert not c.ok and "2 vs 1 tokens" in c.errors[0]


def test_compare_outputs_exact_rejects_a_near_tie_flip_the_rule_accepts():
    ref = _seq(A, B)
    got = _seq((6, {6: -1.0, 5: -1.01, 7: -3.0}), (1, {1: -0.1}))
    assert compare_outputs([ref], [got], exact=False, bound=0.25).ok
    c = compare_outputs([ref], [got], exact=True)
    assert not c.ok and "position 0" in c.errors[0]
    same = compare_outputs([ref], [_seq(A, B)], exact=True)
    assert same.ok and same.identical == 1
