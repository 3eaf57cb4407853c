"""Trace reading, prompt token ids and the infinite-cache bound, checked by hand."""

from __future__ import annotations

import pytest

from vllm_hybrid_npu_lab.trace import (
    TRACE_BLOCK,
    TraceRequest,
    infinite_bound,
    prompt_token_ids,
    read_trace,
)


def test_prompt_token_ids_share_exactly_the_shared_hash_prefix():
    a = prompt_token_ids(TraceRequest(0, 1300, 1, (7, 8, 9)))
    b = prompt_token_ids(TraceRequest(0, 1100, 1, (7, 8, 5)))
    assert len(a) == 1300 and len(b) == 1100
    assert a[:1024] == b[:1024]
    assert set(a[1024:]).isdisjoint(b[1024:])
    assert a[:3] == [7 * TRACE_BLOCK, 7 * TRACE_BLOCK + 1, 7 * TRACE_BLOCK + 2]


def test_read_trace_limit_and_errors(tmp_path, write_trace):
    p = write_trace(tmp_path / "t.jsonl", [(0, 600, 2, [1, 2]), (5, 10, 1, [3]), (9, 10, 1, [4])])
    assert [r.input_length for r in read_trace(p, limit=2)] == [600, 10]
    with pytest.raises(ValueError, match="--trace"):
        read_trace(tmp_path / "missing.jsonl")
    bad = write_trace(tmp_path / "bad.jsonl", [(0, 1100, 1, [1, 2])])  # 2 ids < 1100 tokens
    with pytest.raises(ValueError, match="line 1.*hash ids"):
        read_trace(bad)
    back = write_trace(tmp_path / "back.jsonl", [(5, 10, 1, [1]), (4, 10, 1, [2])])
    with pytest.raises(ValueError, match="line 2.*timestamps"):
        read_trace(back)


def test_infinite_bound_by_hand():
    reqs = [
        TraceRequest(0, 1500, 1, (1, 2, 3)),  # cold
        TraceRequest(1, 1500, 1, (1, 2, 4)),  # shares 1024 tokens with the first
        TraceRequest(2, 700, 1, (1, 9)),  # shares 512 tokens
        TraceRequest(3, 1500, 1, (1, 2, 3)),  # exact repeat of the first
    ]
    # block 256: 1024 + 512 + min(1536 seen, cap (1500-1)//256*256 = 1280) = 2816
    assert infinite_bound(reqs, 256) == (1024 + 512 + 1280, 5200)
    # block 1024: 1024 + 0 (512 < one block) + cap (1499//1024)*1024 = 1024
    assert infinite_bound(reqs, 1024) == (1024 + 0 + 1024, 5200)
    # block 512 (the trace granularity): 1024 + 512 + 1024 (cap 1499//512*512 = 1024)
    assert infinite_bound(reqs, 512) == (1024 + 512 + 1024, 5200)
    with pytest.raises(ValueError, match="--block-size"):
        infinite_bound(reqs, 0)
