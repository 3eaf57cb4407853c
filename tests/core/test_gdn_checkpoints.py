"""GDN in-step checkpoints (issue 8): the segment plan, and the round runner against a reference.

The runner test replaces vLLM's CPU GDN function by a small exact recurrence with the same
contract (reads and writes conv/SSM states in place at the metadata's state indices; zeros for
prefills without an initial state), runs a random batch through
:func:`vllm_hybrid_npu.patches.gdn_all_mode.run_rounds`, and checks every output token and the
state left in every block against a token-by-token computation of each whole sequence.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from vllm_hybrid_npu.core.gdn_checkpoints import (
    boundary_positions,
    plan_request,
    plan_segments,
)
from vllm_hybrid_npu.patches.gdn_all_mode import run_rounds

try:  # the issue-13 layout may move build_plan next to plan_segments
    from vllm_hybrid_npu.core.gdn_checkpoints import build_plan
except ImportError:
    from vllm_hybrid_npu.patches.gdn_all_mode import build_plan


def test_plan_request_cold_prompt_crossing_two_boundaries():
    # 600 tokens from scratch, block 256: [0,256) -> col 0, [256,512) -> col 1, [512,600) -> col 2
    segs = plan_request(request=3, token_start=10, num_computed=0, num_scheduled=600, block_size=256)
    assert [(s.start, s.end, s.src_col, s.dst_col, s.boundary) for s in segs] == [
        (10, 266, None, 0, True),
        (266, 522, 0, 1, True),
        (522, 610, 1, 2, False),
    ]
    assert [s.needs_copy for s in segs] == [False, True, True]
    assert all(s.request == 3 for s in segs)


def test_plan_request_after_prefix_hit_reads_cached_block_writes_next():
    # a hit of 512 tokens: the state after 512 tokens is in col 1 (cached, shared), the step
    # must start from it and never write it
    segs = plan_request(0, 0, num_computed=512, num_scheduled=100, block_size=256)
    assert [(s.src_col, s.dst_col, s.needs_copy) for s in segs] == [(1, 2, True)]


def test_plan_request_mid_block_continuation_and_decode():
    # chunk continuing mid-block: first segment completes the block in place (col 1 -> col 1)
    segs = plan_request(0, 0, num_computed=300, num_scheduled=300, block_size=256)
    assert [(s.end - s.start, s.src_col, s.dst_col, s.needs_copy) for s in segs] == [
        (212, 1, 1, False),
        (88, 1, 2, True),
    ]
    # decode of the token that starts a new block: state moves col 1 -> col 2
    (d,) = plan_request(0, 0, num_computed=512, num_scheduled=1, block_size=256)
    assert (d.src_col, d.dst_col, d.boundary) == (1, 2, False)
    # decode of the token that completes a block: written in place, ends on the boundary
    (d,) = plan_request(0, 0, num_computed=511, num_scheduled=1, block_size=256)
    assert (d.src_col, d.dst_col, d.boundary) == (1, 1, True)
    assert plan_request(0, 0, num_computed=7, num_scheduled=0, block_size=256) == []


def test_plan_segments_rounds_keep_batch_order_and_cover_every_token():
    qsl = [0, 1, 2, 602, 700]
    computed = [300, 255, 0, 256]
    rounds = plan_segments(qsl, computed, 256)
    assert [[s.request for s in r] for r in rounds] == [[0, 1, 2, 3], [2], [2]]
    tokens = sorted(t for r in rounds for s in r for t in range(s.start, s.end))
    assert tokens == list(range(700))


@pytest.mark.parametrize(
    "bad", [dict(query_start_loc=[0, 4], num_computed=[0, 0]), dict(query_start_loc=[5, 4], num_computed=[0])]
)
def test_plan_segments_rejects_bad_input(bad):
    with pytest.raises(ValueError, match="query_start_loc"):
        plan_segments(block_size=16, **bad)


def test_plan_request_rejects_bad_block_size():
    with pytest.raises(ValueError, match="block_size"):
        plan_request(0, 0, 0, 10, 0)


def test_boundary_positions():
    assert boundary_positions(0, 600, 256) == [256, 512]
    assert boundary_positions(256, 256, 256) == [512]
    assert boundary_positions(300, 10, 256) == []


# ----------------------------------------------------------------- round runner vs reference
W = 4  # conv width: conv state keeps W - 1 inputs
D = 3  # feature size


def _step(ssm, conv, x):
    """Exact toy recurrence with the GDN state structure: conv window + decaying SSM state."""
    window = torch.cat([conv, x[None]], dim=0)  # [W, D]
    y = window.sum(dim=0)
    ssm = 0.5 * ssm + torch.outer(y, x)
    out = ssm.sum(dim=1) + y
    return ssm, window[1:], out


def _fake_upstream(layer, md, mixed_qkv, b, a, out):
    """Contract of vLLM 0.30 ``_cpu_gdn_attention_nonspec``: states in place at the indices."""
    conv_state, ssm_state = layer.kv_cache
    qsl = md.non_spec_query_start_loc.tolist()
    slots = md.non_spec_state_indices_tensor.tolist()
    init = md.has_initial_state.tolist()
    for r, slot in enumerate(slots):
        has_init = r < md.num_decodes or init[r]
        ssm = ssm_state[slot].clone() if has_init else torch.zeros_like(ssm_state[slot])
        conv = conv_state[slot].clone() if has_init else torch.zeros_like(conv_state[slot])
        for t in range(qsl[r], qsl[r + 1]):
            ssm, conv, out[t] = _step(ssm, conv, mixed_qkv[t])
        ssm_state[slot], conv_state[slot] = ssm, conv


def _common_metadata(qsl, computed, tables, pad_rows=0):
    """vLLM's own ``CommonAttentionMetadata`` for a batch (CPU tensors), optionally with
    ``pad_rows`` padded rows past ``num_reqs`` (as vLLM's CUDA-graph padding leaves them)."""
    from vllm.v1.attention.backends.utils import CommonAttentionMetadata

    n = len(computed)
    qsl_t = torch.tensor(list(qsl) + [qsl[-1]] * pad_rows, dtype=torch.int32)
    seq_lens = torch.tensor(
        [c + qsl[r + 1] - qsl[r] for r, c in enumerate(computed)] + [0] * pad_rows, dtype=torch.int32
    )
    width = max(len(t) for t in tables)
    table = torch.tensor([list(t) + [0] * (width - len(t)) for t in tables] + [[0] * width] * pad_rows,
                         dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=qsl_t, query_start_loc_cpu=qsl_t.clone(), seq_lens=seq_lens, num_reqs=n,
        num_actual_tokens=int(qsl[-1]), max_query_len=max(b - a for a, b in zip(qsl, qsl[1:])),
        max_seq_len=int(seq_lens.max()), block_table_tensor=table,
        slot_mapping=torch.zeros(int(qsl[-1]), dtype=torch.int64),
    )


def _round_lists(rnd):
    return dict(
        token_index=rnd.token_index.tolist(), query_start_loc=rnd.query_start_loc.tolist(),
        state_indices=rnd.state_indices.tolist(), has_initial_state=rnd.has_initial_state.tolist(),
        num_decodes=rnd.num_decodes, copy_src=rnd.copy_src.tolist(), copy_dst=rnd.copy_dst.tolist(),
    )


def test_build_plan_hand_worked_batch():
    """Block size 4. Row 0: a decode at position 4 (computed 4, state in column 0 = block 10;
    the token starts block 1, so its state moves to column 1 = block 11). Row 1: a prefill
    continuing at position 2 with 7 tokens (positions 2..8): segments [2,4) in place in column 0
    (block 20), [4,8) from column 0 into column 1 (block 21), [8,9) from column 1 into column 2
    (block 22). Row 2: a cold prefill of 3 tokens: one segment into column 0 (block 30), from
    zeros. Batch tokens: row 0 = 0, row 1 = 1..7, row 2 = 8..10."""
    md = _common_metadata([0, 1, 8, 11], [4, 2, 0], [[10, 11, 12], [20, 21, 22], [30, 31, 32]])
    plan = build_plan(md, block_size=4, num_decodes=1)
    assert [_round_lists(r) for r in plan.rounds] == [
        dict(token_index=[0, 1, 2, 8, 9, 10], query_start_loc=[0, 1, 3, 6], state_indices=[11, 20, 30],
             has_initial_state=[True, True, False], num_decodes=1, copy_src=[10], copy_dst=[11]),
        dict(token_index=[3, 4, 5, 6], query_start_loc=[0, 4], state_indices=[21],
             has_initial_state=[True], num_decodes=0, copy_src=[20], copy_dst=[21]),
        dict(token_index=[7], query_start_loc=[0, 1], state_indices=[22],
             has_initial_state=[True], num_decodes=0, copy_src=[21], copy_dst=[22]),
    ]
    assert plan.num_tokens == 11
    assert plan.final_state_indices.tolist() == [11, 22, 30]
    r0 = plan.rounds[0]
    # dtypes upstream's CPU GDN function and tensor indexing expect
    assert (r0.token_index.dtype, r0.query_start_loc.dtype, r0.state_indices.dtype,
            r0.has_initial_state.dtype, r0.copy_src.dtype, r0.copy_dst.dtype,
            plan.final_state_indices.dtype) == (torch.int64, torch.int32, torch.int32, torch.bool,
                                                torch.int64, torch.int64, torch.int32)


def test_build_plan_no_boundary_crossed_is_one_round_in_place():
    """Block size 8, nothing crosses a boundary: one round, states written where they are read
    (column (c - 1) // 8 stays the column of the step's end), no copy. Row 0: decode at 9 (col 1,
    block 6); row 1: prefill 3 -> 7 (col 0, block 2)."""
    md = _common_metadata([0, 1, 5], [9, 3], [[5, 6], [2, 7]])
    plan = build_plan(md, block_size=8, num_decodes=1)
    assert [_round_lists(r) for r in plan.rounds] == [
        dict(token_index=[0, 1, 2, 3, 4], query_start_loc=[0, 1, 5], state_indices=[6, 2],
             has_initial_state=[True, True], num_decodes=1, copy_src=[], copy_dst=[]),
    ]
    assert plan.final_state_indices.tolist() == [6, 2]


def test_build_plan_ignores_padded_rows_and_keeps_idle_rows_in_column_0():
    """Rows past ``num_reqs`` (padding) are not planned; a request with no token this step
    (qsl equal on both sides) ends in its column 0."""
    md = _common_metadata([0, 0, 2], [5, 0], [[40, 41], [50, 51]], pad_rows=2)
    plan = build_plan(md, block_size=4, num_decodes=0)
    # row 1: 2 cold tokens into column 0 (block 50); row 0 has no tokens
    assert [_round_lists(r) for r in plan.rounds] == [
        dict(token_index=[0, 1], query_start_loc=[0, 2], state_indices=[50],
             has_initial_state=[False], num_decodes=0, copy_src=[], copy_dst=[]),
    ]
    assert plan.final_state_indices.tolist() == [40, 50]
    assert plan.num_tokens == 2


def test_build_plan_column_outside_block_table_raises():
    # 9 tokens from scratch at block size 4 need columns 0, 1, 2; the table has 2
    md = _common_metadata([0, 9], [0], [[1, 2]])
    with pytest.raises(IndexError):
        build_plan(md, block_size=4, num_decodes=0)


@dataclasses.dataclass
class _Md:
    num_decodes: int
    num_decode_tokens: int
    num_prefills: int
    num_prefill_tokens: int
    num_actual_tokens: int
    has_initial_state: object = None
    non_spec_query_start_loc: object = None
    non_spec_state_indices_tensor: object = None


@pytest.mark.parametrize("trial", range(4))
def test_run_rounds_matches_whole_sequence_reference(trial, rng):
    block = rng.choice([4, 8, 16])
    num_decodes = rng.randint(0, 3)
    num_prefills = rng.randint(1, 4)
    seqs, computed, scheduled = [], [], []
    for r in range(num_decodes + num_prefills):
        if r < num_decodes:
            c, q = rng.randint(1, 5 * block), 1
        else:
            c = rng.choice([0, rng.randint(1, 3) * block, rng.randint(1, 4 * block)])
            q = rng.randint(2, 5 * block)
        computed.append(c)
        scheduled.append(q)
        seqs.append(torch.randn(c + q, D, dtype=torch.float64))
    # block tables: distinct random block ids per (request, column); block 0 unused
    num_cols = max(c + q for c, q in zip(computed, scheduled)) // block + 1
    ids = rng.sample(range(1, 1 + len(seqs) * num_cols), len(seqs) * num_cols)
    tables = [ids[r * num_cols : (r + 1) * num_cols] for r in range(len(seqs))]
    pool = 1 + len(seqs) * num_cols
    conv_state = torch.full((pool, W - 1, D), float("nan"), dtype=torch.float64)
    ssm_state = torch.full((pool, D, D), float("nan"), dtype=torch.float64)
    # reference: every sequence token by token, state after each token
    ref_out, ref_states = [], []
    for seq in seqs:
        ssm, conv = torch.zeros(D, D, dtype=torch.float64), torch.zeros(W - 1, D, dtype=torch.float64)
        outs, states = [], []
        for x in seq:
            ssm, conv, o = _step(ssm, conv, x)
            outs.append(o)
            states.append((ssm.clone(), conv.clone()))
        ref_out.append(torch.stack(outs))
        ref_states.append(states)
    # the state each request resumes from sits where the convention puts it
    for r, c in enumerate(computed):
        if c:
            ssm_state[tables[r][(c - 1) // block]], conv_state[tables[r][(c - 1) // block]] = ref_states[r][c - 1]
    qsl = [0]
    for q in scheduled:
        qsl.append(qsl[-1] + q)
    mixed = torch.cat([seq[c:] for seq, c in zip(seqs, computed)])
    plan = build_plan(_common_metadata(qsl, computed, tables), block, num_decodes)
    layer = SimpleNamespace(kv_cache=(conv_state, ssm_state))
    md = _Md(num_decodes, num_decodes, num_prefills, qsl[-1] - num_decodes, qsl[-1])
    out = torch.full((qsl[-1], D), float("nan"), dtype=torch.float64)
    run_rounds(_fake_upstream, layer, md, plan, mixed, mixed, mixed, out)

    for r, (c, q) in enumerate(zip(computed, scheduled)):
        torch.testing.assert_close(out[qsl[r] : qsl[r + 1]], ref_out[r][c:], rtol=0, atol=0)
        # every boundary crossed and the step's end: state in its column
        ends = boundary_positions(c, q, block) + [c + q]
        for pos in ends:
            blk = tables[r][(pos - 1) // block]
            ssm_ref, conv_ref = ref_states[r][pos - 1]
            torch.testing.assert_close(ssm_state[blk], ssm_ref, rtol=0, atol=0)
            torch.testing.assert_close(conv_state[blk], conv_ref, rtol=0, atol=0)
        # the block the request resumed from is left as it was when it is not written again
        if c and (c - 1) // block != (c + q - 1) // block and c % block == 0:
            blk = tables[r][(c - 1) // block]
            torch.testing.assert_close(ssm_state[blk], ref_states[r][c - 1][0], rtol=0, atol=0)
