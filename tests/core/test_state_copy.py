"""The align-mode state-copy plan and the copy itself.

Plans are checked against hand-worked block arithmetic; the byte ranges against vLLM 0.30.0's
own in-tree ``preprocess_mamba`` run on the same inputs (differential); the copy against the
source bytes with poisoned destinations. Real vLLM objects: ``SchedulerOutput``,
``CachedRequestState``, ``KVCacheConfig``/``MambaSpec``, ``MambaCopyBuffers``, the GDN state-copy
functions. Two stand-ins, because preprocess reads only two attributes of each: the input batch
(``req_ids``, ``num_accepted_tokens_cpu``) and the GDN layer (``kv_cache``: its state tensors).
"""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from vllm.model_executor.layers.mamba.mamba_utils import MambaStateCopyFuncCalculator
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
)
from vllm.v1.utils import CpuGpuBuffer
from vllm.v1.worker import mamba_utils
from vllm.v1.worker.gpu_input_batch import CachedRequestState

from vllm_hybrid_npu import metrics
from vllm_hybrid_npu.core import state_copy
from vllm_hybrid_npu.core.state_copy import StateCopy, plan_state_copies
from vllm_hybrid_npu.patches import _common

BS = 16  # tokens per block in these tests


# ---------------------------------------------------------------- plan (hand-worked)
def test_new_request_prefill_has_nothing_to_copy():
    col: dict[str, int] = {}
    # 0 computed, 40 scheduled: last token 40 is in block cdiv(40,16)-1 = 2; no previous state.
    assert plan_state_copies(["a"], [0], {"a": 40}, [1], col, (), BS) == []
    assert col == {"a": 2}


def test_decode_inside_a_block_then_across_its_boundary():
    col = {"a": 2}
    # computed 47 + 1 = 48 tokens -> still block 2 (tokens 32..47): no copy.
    assert plan_state_copies(["a"], [47], {"a": 1}, [1], col, (), BS) == []
    assert col == {"a": 2}
    # computed 48 + 1 = 49 -> block 3: copy the state from column 2 to column 3.
    assert plan_state_copies(["a"], [48], {"a": 1}, [1], col, (), BS) == [StateCopy(0, "a", 2, 3, 0)]
    assert col == {"a": 3}


def test_prefix_hit_copies_the_cached_boundary_state():
    col: dict[str, int] = {}
    # 32 tokens hit the cache (blocks 0, 1): the state at token 32 is in column (32-1)//16 = 1;
    # 9 new tokens end in block cdiv(41,16)-1 = 2.
    assert plan_state_copies(["b"], [32], {"b": 9}, [1], col, (), BS) == [StateCopy(0, "b", 1, 2, 0)]


def test_chunked_prefill_crossing_blocks_within_one_request():
    col: dict[str, int] = {}
    plan = []
    computed = 0
    for chunk in (10, 10, 10, 10):  # 40 tokens in chunks of 10
        plan += plan_state_copies(["c"], [computed], {"c": chunk}, [1], col, (), BS)
        computed += chunk
    # chunk ends 10 (block 0), 20 (block 1), 30 (block 1), 40 (block 2): moves 0->1, 1->2.
    assert [(p.src_col, p.dst_col) for p in plan] == [(0, 1), (1, 2)]


def test_spec_decode_accept_bias_and_speculative_blocks():
    col = {"d": 2}
    # 3 tokens accepted last step -> bias 2; 47 computed + 3 scheduled (1 + 2 drafts) = 50 ->
    # block 3; speculative blocks follow the running block and do not move it.
    plan = plan_state_copies(["d"], [47], {"d": 3}, [3], col, (), BS, num_speculative_blocks=2)
    assert plan == [StateCopy(0, "d", 2, 3, 2)]


def test_finished_preempted_resumed_and_unscheduled_leave_no_stale_column():
    col = {"gone": 9, "pre": 7, "res": 5, "idle": 1}
    out = plan_state_copies(
        ["res", "idle"], [20, 33], {"res": 1}, [1, 1], col, {"gone", "pre", "res"}, BS
    )
    # resumed request: re-derived from 20 computed tokens -> column (20-1)//16 = 1, 21 -> block 1.
    assert out == []
    assert col == {"res": 1}


def test_dropped_request_ids_from_a_real_scheduler_output():
    so = SchedulerOutput.make_empty()
    so.finished_req_ids = {"f"}
    so.preempted_req_ids = {"p"}
    so.scheduled_cached_reqs.resumed_req_ids = {"r"}
    assert state_copy.dropped_request_ids(so) == {"f", "p", "r"}


# ---------------------------------------------------------------- bytes (real tensors)
CONV_SHAPE = (3, 64)  # (conv_kernel - 1, conv dim): SD layout
SSM_SHAPE = (2, 16, 16)
NUM_BLOCKS = 12


def _gdn_spec() -> MambaSpec:
    return MambaSpec(
        block_size=BS,
        shapes=(CONV_SHAPE, SSM_SHAPE),
        dtypes=(torch.bfloat16, torch.float32),
        mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
        mamba_cache_mode="align",
    )


@pytest.fixture
def setup(monkeypatch, torch_gen):
    gdn = _gdn_spec()
    layers = ["l0.linear_attn", "l1.linear_attn"]
    kvc = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec([layers[0]], gdn),
            KVCacheGroupSpec([layers[1]], gdn),
            KVCacheGroupSpec(["l2.attn"], FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype=torch.bfloat16)),
        ],
    )
    g = torch_gen  # the test's fresh seed (conftest.py; printed if it fails)
    fc = {}
    for name in layers:
        conv = torch.randn((NUM_BLOCKS, *CONV_SHAPE), generator=g).to(torch.bfloat16)
        ssm = torch.randn((NUM_BLOCKS, *SSM_SHAPE), generator=g)
        fc[name] = types.SimpleNamespace(kv_cache=(conv, ssm))
    copy_funcs = {gdn.mamba_type: MambaStateCopyFuncCalculator.gated_delta_net_state_copy_func()}

    def make_buffer(*size, dtype):
        return CpuGpuBuffer(*size, dtype=dtype, device=torch.device("cpu"), pin_memory=False, with_numpy=True)

    bufs = mamba_utils.MambaCopyBuffers.create(8, kvc, copy_funcs, make_buffer)
    return types.SimpleNamespace(kvc=kvc, fc=fc, copy_funcs=copy_funcs, bufs=bufs, layers=layers)


def _requests():
    def req(rid, computed, ids0, ids1):
        return CachedRequestState(
            req_id=rid, prompt_token_ids=[1] * 60, mm_features=[], sampling_params=None,
            generator=None, block_ids=(ids0, ids1, list(range(4))), num_computed_tokens=computed,
            output_token_ids=[],
        )

    # "a": decode crossing 32 -> block 2 (prev column 1); "b": prefix hit of 16 tokens + 20 new
    # (prev column 0 -> running column 2); "c": inside block 0, nothing to copy.
    return {
        "a": req("a", 32, [0, 1, 2, 3], [4, 5, 6, 7]),
        "b": req("b", 16, [8, 9, 10, 11], [11, 10, 9, 8]),
        "c": req("c", 3, [0, 11, 1, 2], [3, 2, 5, 4]),
    }


def _scheduler_output():
    so = SchedulerOutput.make_empty()
    so.num_scheduled_tokens = {"a": 1, "b": 20, "c": 4}
    return so


def _batch():
    return types.SimpleNamespace(req_ids=["a", "b", "c"], num_accepted_tokens_cpu=np.ones(8, dtype=np.int32))


def test_ranges_equal_vllm_in_tree_preprocess(setup, monkeypatch):
    """Differential: the byte ranges we stage == the ones vLLM 0.30.0's own code stages."""
    s = setup
    recorded = {}

    def record(copy_bufs):
        n = copy_bufs.offset
        recorded["ranges"] = sorted(
            zip(copy_bufs.src_ptrs.np[:n].tolist(), copy_bufs.dst_ptrs.np[:n].tolist(), copy_bufs.sizes.np[:n].tolist())
        )

    upstream = _common.original(mamba_utils, "preprocess_mamba")
    monkeypatch.setattr(mamba_utils, "do_mamba_copy_block", record)
    monkeypatch.setattr(mamba_utils, "collect_mamba_copy_meta", _common.original(mamba_utils, "collect_mamba_copy_meta"))
    up_idx: dict[str, int] = {}
    up_batch = _batch()
    cache_config = types.SimpleNamespace(enable_prefix_caching=True)
    upstream(_scheduler_output(), s.kvc, cache_config, up_idx, up_batch, _requests(), s.fc, s.copy_funcs, s.bufs)

    monkeypatch.setattr(state_copy, "DEFER_COPY", True)
    our_idx: dict[str, int] = {}
    our_batch = _batch()
    state_copy.preprocess_mamba(_scheduler_output(), s.kvc, cache_config, our_idx, our_batch, _requests(), s.fc, s.copy_funcs, s.bufs)
    src, dst, sizes = getattr(s.bufs, state_copy.PENDING_ATTR)
    assert sorted(zip(src, dst, sizes)) == recorded["ranges"]
    assert our_idx == up_idx == {"a": 2, "b": 2, "c": 0}
    assert (our_batch.num_accepted_tokens_cpu == up_batch.num_accepted_tokens_cpu).all()
    # 2 moving requests x 2 GDN layers x (conv, SSM) = 8 ranges
    assert len(sizes) == 8


def test_copy_moves_exact_bytes_and_touches_nothing_else(setup, monkeypatch):
    s = setup
    monkeypatch.setattr(state_copy, "DEFER_COPY", False)
    reqs = _requests()
    # Poison every destination block first.
    moves = {"a": (1, 2), "b": (0, 2)}
    for li, name in enumerate(s.layers):
        for st in s.fc[name].kv_cache:
            for rid, (_, dst_col) in moves.items():
                st[reqs[rid].block_ids[li][dst_col]].fill_(-7)
    before = [[st.clone() for st in s.fc[n].kv_cache] for n in s.layers]
    c0, b0 = metrics.totals()
    state_copy.preprocess_mamba(_scheduler_output(), s.kvc, None, {}, _batch(), reqs, s.fc, s.copy_funcs, s.bufs)
    expected_bytes = 0
    for li, name in enumerate(s.layers):
        for si, st in enumerate(s.fc[name].kv_cache):
            touched = set()
            for rid, (src_col, dst_col) in moves.items():
                ids = reqs[rid].block_ids[li]
                assert torch.equal(st[ids[dst_col]], before[li][si][ids[src_col]])
                touched.add(ids[dst_col])
                expected_bytes += st[0].numel() * st.element_size()
            for blk in set(range(NUM_BLOCKS)) - touched:
                assert torch.equal(st[blk], before[li][si][blk]), (name, si, blk)
    c1, b1 = metrics.totals()
    assert (c1 - c0, b1 - b0) == (8, expected_bytes)
    # exactly once: the staged ranges were consumed
    assert s.bufs.offset == 0 and state_copy.do_mamba_copy_block(s.bufs) == (0, 0)


def test_accepted_state_is_selected_with_spec_decode(setup, monkeypatch):
    """Temporal state comes from column src + bias; the SD conv window shifts by bias tokens."""
    s = setup
    monkeypatch.setattr(state_copy, "DEFER_COPY", False)
    reqs = _requests()
    batch = _batch()
    batch.num_accepted_tokens_cpu[0] = 2  # request "a" accepted 2 tokens -> bias 1
    before = [[st.clone() for st in s.fc[n].kv_cache] for n in s.layers]
    so = _scheduler_output()
    so.num_scheduled_tokens = {"a": 1}
    batch.req_ids = ["a"]
    idx = {"a": 1}
    state_copy.preprocess_mamba(so, s.kvc, None, idx, batch, reqs, s.fc, s.copy_funcs, s.bufs)
    assert batch.num_accepted_tokens_cpu[0] == 1
    for li, name in enumerate(s.layers):
        conv, ssm = s.fc[name].kv_cache
        ids = reqs["a"].block_ids[li]
        assert torch.equal(ssm[ids[2]], before[li][1][ids[1 + 1]])
        width = CONV_SHAPE[0]
        assert torch.equal(conv[ids[2]][: width - 1], before[li][0][ids[1]][1:])


def test_dim_first_conv_layout_shifts_each_row(monkeypatch):
    """DS conv layout (num_blocks, dim, width) with accepted drafts: vLLM leaves this case to
    its fused kernel; ours emits one byte range per dim row. Checked against a torch slice."""
    from vllm.model_executor.layers.mamba.mamba_utils import get_conv_copy_spec

    monkeypatch.setattr(state_copy, "_conv_dim_first", lambda: True)
    dim, width, bias = 24, 4, 2
    conv = torch.randn(6, dim, width).to(torch.bfloat16)
    block_ids = [3, 1, 4]
    conv[block_ids[2]].fill_(-5)  # poison the destination
    want = conv[block_ids[1], :, bias:].clone()
    untouched = conv[block_ids[2], :, width - bias:].clone()
    ranges = state_copy._state_ranges(conv, get_conv_copy_spec, block_ids, 1, block_ids[2], bias)
    assert len(ranges) == dim
    src, dst, sizes = (list(x) for x in zip(*ranges))
    state_copy.execute_copies(src, dst, sizes, conv.device)
    assert torch.equal(conv[block_ids[2], :, : width - bias], want)
    assert torch.equal(conv[block_ids[2], :, width - bias:], untouched)
