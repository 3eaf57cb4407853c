"""GDN in-step checkpoints (issue 8): the segment plan, and the round runner against a reference.

The runner test replaces vLLM's CPU GDN function by a small exact recurrence with the same
contract (reads and writes conv/SSM states in place at the metadata's state indices; zeros for
prefills without an initial state), runs a random batch through
:func:`vllm_hybrid_npu.patches.gdn_all_mode.run_rounds`, and checks every output token and the
state left in every block against a token-by-token computation of each whole sequence.
"""

from __future__ import annotations

import dataclasses
import random
from types import SimpleNamespace

import pytest
import torch

from vllm_hybrid_npu.core.gdn_checkpoints import (
    boundary_positions,
    plan_request,
    plan_segments,
)
from vllm_hybrid_npu.patches.gdn_all_mode import GdnRound, GdnStepPlan, run_rounds


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


def _plan_from_segments(rounds, tables, num_decodes):
    out = []
    for segs in rounds:
        token_index, offsets, states, initial, src, dst = [], [0], [], [], [], []
        for s in segs:
            token_index += range(s.start, s.end)
            offsets.append(offsets[-1] + s.end - s.start)
            states.append(tables[s.request][s.dst_col])
            initial.append(s.has_initial_state)
            if s.needs_copy:
                src.append(tables[s.request][s.src_col])
                dst.append(tables[s.request][s.dst_col])
        out.append(
            GdnRound(
                token_index=torch.tensor(token_index),
                query_start_loc=torch.tensor(offsets, dtype=torch.int32),
                state_indices=torch.tensor(states, dtype=torch.int32),
                has_initial_state=torch.tensor(initial),
                num_decodes=sum(s.request < num_decodes for s in segs),
                copy_src=torch.tensor(src, dtype=torch.int64),
                copy_dst=torch.tensor(dst, dtype=torch.int64),
            )
        )
    return GdnStepPlan(rounds=out, num_tokens=0, final_state_indices=None)


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
def test_run_rounds_matches_whole_sequence_reference(trial):
    rng = random.Random()  # fresh draw every run
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
    plan = _plan_from_segments(plan_segments(qsl, computed, block), tables, num_decodes)
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
