"""The serving benchmark's harness (benchmarks/cuda_serving.py) end to end on the e2e target
with a tiny workload: every row runs in its own process and lands in the JSON, ``--resume``
keeps them. On CPU this checks the harness only (its numbers mean nothing; GPU-only columns are
reported as not measured); the table of record comes from the H100 (docs/cuda.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--cold", "1", "--cold-len", "600", "--sessions", "1", "--system-len", "500",
         "--user-len", "100", "--answer-len", "4", "--batch", "2", "--decode-prompt-len", "300",
         "--decode-len", "4", "--max-len", "2048", "--kv-cache-bytes", str(256 << 20)]


def _bench(out, model, seed, rows, *extra):
    cmd = [sys.executable, "-m", "benchmarks.cuda_serving", "--model-dir", model, "--rows", rows,
           "--seed", str(seed), "--out", str(out), *SMALL, *extra]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, json.loads(out.read_text())


def test_rows_land_in_the_json_and_resume_keeps_them(tmp_path, tiny_model_dir, seed, e2e_target_name):
    model = str(tiny_model_dir("qwen3_next"))
    out = tmp_path / "bench.json"
    stdout, doc = _bench(out, model, seed, "off,plugin")
    assert doc["seed"] == seed and sorted(doc["rows"]) == ["off", "plugin"], stdout
    for name, row in doc["rows"].items():
        assert "error" not in row, (name, row.get("error"))
    assert all(c == 0 for c in doc["rows"]["off"]["hit_cached"])
    assert all(c > 0 for c in doc["rows"]["plugin"]["hit_cached"])
    assert doc["summary"]["plugin"]["cold_ttft_ms/off"] > 0
    # a 600-token cold prompt: one step with caching off; align mode ends a chunk at its last
    # block boundary (block < 600 tokens on every target), so at least two
    assert doc["rows"]["off"]["cold_steps"] == [1], doc["rows"]["off"]["cold_steps"]
    assert all(n >= 2 for n in doc["rows"]["plugin"]["cold_steps"]), doc["rows"]["plugin"]["cold_steps"]
    if e2e_target_name == "cpu":
        assert doc["rows"]["plugin"]["copy_us_per_step"] is None and "gpu_note" in doc["rows"]["plugin"]
    stdout, again = _bench(out, model, seed, "off,plugin", "--resume")
    assert "keeping rows ['off', 'plugin']" in stdout
    assert again["rows"] == doc["rows"]
