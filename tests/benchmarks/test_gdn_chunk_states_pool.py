"""``benchmarks/gdn_chunk_states.py --pool``: calls' medians pooled by their median, ratios to vLLM's
pooled row of the same length, kind and launch configuration (hand-counted)."""

from __future__ import annotations

import json

from benchmarks.gdn_chunk_states import pool


def _row(tokens, kernel, gpu, host, kind="config", cfg=(32, 4, 3)):
    return {"tokens": tokens, "kind": kind, "bv": cfg[0], "num_warps": cfg[1], "num_stages": cfg[2],
            "kernel": kernel, "gpu_us": gpu, "host_us": host}


def test_pool_takes_the_median_of_the_calls_and_divides_by_vllms(tmp_path):
    calls = [
        [_row(8192, "vllm", 200.0, 80.0), _row(8192, "ours", 260.0, 70.0), _row(8192, "vllm", 900.0, 90.0, cfg=(64, 2, 3))],
        [_row(8192, "vllm", 220.0, 60.0), _row(8192, "ours", 300.0, 90.0), _row(8192, "vllm", 700.0, 70.0, cfg=(64, 2, 3))],
        [_row(8192, "vllm", 210.0, 100.0), _row(8192, "ours", 280.0, 50.0), _row(8192, "vllm", 800.0, 80.0, cfg=(64, 2, 3))],
    ]
    paths = []
    for i, rows in enumerate(calls):
        p = tmp_path / f"c{i}.json"
        p.write_text(json.dumps({"call": i + 4, "device": "H200", "rows": rows}))
        paths.append(str(p))
    doc = pool(paths)
    got = {(r["kernel"], r["bv"]): r for r in doc["rows"]}
    # medians: vllm 210 / 80, ours 280 / 70; the other configuration's vLLM row is its own reference
    assert got[("vllm", 32)]["gpu_us"] == 210.0 and got[("vllm", 32)]["host_us"] == 80.0
    assert got[("ours", 32)]["gpu_us"] == 280.0 and got[("ours", 32)]["host_us"] == 70.0
    assert got[("ours", 32)]["gpu_vs_vllm"] == round(280 / 210, 3)
    assert got[("ours", 32)]["host_vs_vllm"] == round(70 / 80, 3)
    assert got[("vllm", 64)]["gpu_us"] == 800.0 and got[("vllm", 64)]["gpu_vs_vllm"] == 1.0
    assert all(r["calls"] == 3 for r in doc["rows"]) and doc["calls"] == [4, 5, 6]
