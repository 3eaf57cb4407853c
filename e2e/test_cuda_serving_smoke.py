"""The serving benchmark's harness (benchmarks/cuda_serving.py) end to end on the e2e target with
a tiny workload: the rows run in their own processes and land in the JSON's ``rows`` (one per row
and prompt length), the row logs keep vLLM's own lines, ``--resume`` keeps the units. On CPU this
checks the harness only (its numbers mean nothing; GPU-only columns are "not measured"); the
table of record comes from the H100 (docs/cuda.md).

What is tested is the harness's behaviour, not the machine's speed (issue 30, item 6: on a loaded
2-core EPYC the ``vllm-align`` row came back ``pending``, killed at the default 540-s call
budget): the call budget here is a day and no row or length is deferred; the budget logic itself
is tested on a fake clock (tests/benchmarks, ``CallBudget``). The subprocess timeout only stops a
hang."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from engines import threads_bind, tp_skip_reason  # e2e/engines.py

ROOT = Path(__file__).resolve().parents[1]
# 1,200 tokens: three of the CPU backend's 384-token hybrid blocks (the concurrent clients share two)
SMALL = ["--lengths", "1200", "--cold", "2", "--sessions", "1", "--clients", "2", "--answer-len", "4",
         "--user-len", "64", "--max-len", "2048", "--kv-cache-bytes", str(256 << 20),
         # a budget no machine misses: the harness's behaviour is tested, not the machine's speed
         "--call-budget", "86400", "--min-row-s", "0", "--first-length-s", "0", "--call", "1"]
SCHEMA = ("row", "prompt_tokens", "cold_ttft_ms", "cold_ttft_vs_off", "hit_ttft_ms", "floor_ttft_ms", "itl_ms",
          "steps_per_cold_prompt", "hit_rate", "decode_tok_s", "prefill_tok_s", "syncs_per_step",
          "copy_us_per_step", "export_us_per_step")


def _bench(out, model, seed, rows, *extra, env=None):
    cmd = [sys.executable, "-m", "benchmarks.cuda_serving", "--model-dir", model, "--rows", rows,
           "--seed", str(seed), "--out", str(out), *SMALL, *extra]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600,  # a hang guard
                          env=None if env is None else {**os.environ, **env})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, json.loads(out.read_text())


def test_rows_land_in_the_json_and_resume_keeps_them(tmp_path, tiny_model_dir, seed, e2e_target_name):
    model = str(tiny_model_dir("qwen3_next"))
    out = tmp_path / "bench.json"
    stdout, doc = _bench(out, model, seed, "off,vllm-align,exporter,flashinfer")
    assert doc["seed"] == seed, stdout
    rows = {(r["row"], r["prompt_tokens"]): r for r in doc["rows"]}
    for name in ("off", "vllm-align", "exporter"):
        r = rows[(name, 1200)]
        assert r["status"] == "measured", (name, r)
        assert all(k in r for k in SCHEMA), sorted(set(SCHEMA) - set(r))
        # the row's log has vLLM's own lines (its stdout and stderr), not only the harness's
        log = (tmp_path / f"bench.{name}.log").read_text()
        assert "non-default args" in log, log[-2000:]
    if e2e_target_name == "cpu":  # flashinfer is CUDA-only: skipped, saying why
        assert rows[("flashinfer", 1200)]["status"] == "skipped" and rows[("flashinfer", 1200)]["reason"]
        assert rows[("exporter", 1200)]["syncs_per_step"] is None
    off, split, exp = rows[("off", 1200)], rows[("vllm-align", 1200)], rows[("exporter", 1200)]
    # one step per cold prompt with caching off and with the exporter; vLLM's split adds one
    assert off["steps_per_cold_prompt"] == 1 and exp["steps_per_cold_prompt"] == 1, (off, exp)
    assert split["steps_per_cold_prompt"] == 2, split
    assert off["cold_ttft_vs_off"] == 1.0 and exp["cold_ttft_vs_off"] > 0
    units = doc["units"]
    assert all(c == 0 for c in units["off@1200"]["samples"]["repeat"]["cached"])
    for name in ("vllm-align", "exporter"):
        s = units[f"{name}@1200"]["samples"]
        assert all(c > 0 for c in s["repeat"]["cached"]), (name, s["repeat"])
        # the concurrent phase's second turns (decoding together) hit
        assert all(c > 0 for c in s["conc2"]["cached"]), (name, s["conc2"])
        # the floor unit: a prompt of each repeat's computed tokens, no context
        want = sorted(n - c for n, c in zip(s["repeat"]["prompt_len"], s["repeat"]["cached"]))
        assert sorted(s["floor"]["prompt_len"]) == want and all(c == 0 for c in s["floor"]["cached"]), s["floor"]
        assert rows[(name, 1200)]["floor_ttft_ms"] > 0
    assert not units["off@1200"]["samples"]["floor"]["ttft_ms"]  # caching off: no hit, no floor
    assert all(u["call"] == 1 and u["position"] for u in units.values())
    # each unit records the depth vLLM served: the checkpoint's own (no --layers given; issue 37)
    layers = json.loads((Path(model) / "config.json").read_text())["num_hidden_layers"]
    assert doc["args"]["layers"] == layers and doc["args"]["arch"] == "qwen3_next", doc["args"]
    assert all(u["engine"]["num_hidden_layers"] == layers for u in units.values()), layers
    stdout, again = _bench(out, model, seed, "off,vllm-align,exporter,flashinfer", "--resume")
    assert "keeping units ['exporter@1200', 'off@1200', 'vllm-align@1200']" in stdout, stdout
    assert again["units"] == doc["units"]


def test_step_profile_lands_per_phase_in_the_json(tmp_path, tiny_model_dir, seed, e2e_target_name):
    """``--step-profile``: host (and on CUDA GPU) time per engine step of each phase, for a cold
    prompt, its repeat and the decode steps, in the unit's ``step_profile`` (issue 30, item 2)."""
    model = str(tiny_model_dir("qwen3_next"))
    out = tmp_path / "prof.json"
    _, doc = _bench(out, model, seed, "exporter", "--step-profile", "3", "--phases", "cold,repeat,floor")
    prof = doc["units"]["exporter@1200"]["step_profile"]
    # the CPU runner's own methods (vLLM 0.30's V1-style CPUModelRunner); the V2 GPU runner's elsewhere
    want = {"schedule", "execute_model", "prepare_inputs", "metadata_build", "sample", "update_from_output",
            "output_processing"} | ({"forward"} if e2e_target_name == "cpu" else set())
    assert want <= set(prof["phases_found"]), prof["phases_found"]
    cold, rep, dec = prof["cold"], prof["repeat"], prof["decode"]
    assert cold["cached"] == 0 and rep["cached"] > 0 and cold["steps"] == 1 == rep["steps"]
    assert dec["steps"] == rep["steps"] + 16  # 17 tokens: the hit's step, then 16 decode steps
    for run in (cold, rep, dec):
        ph = run["phases"]
        assert want <= set(ph), sorted(ph)
        assert all(ph[p]["host_ms"] >= 0 and ph[p]["calls"] > 0 for p in want)
        # execute_model's inclusive time holds the phases timed inside it
        inner = sum(ph[p]["host_ms"] for p in ("prepare_inputs", "metadata_build", "forward") if p in ph)
        assert ph["execute_model"]["host_incl_ms"] >= inner - 1e-6
        assert (run["gpu_kernel_ms"] is None) == (e2e_target_name == "cpu")
        assert (run["gpu_memory_ms"] is None) == (e2e_target_name == "cpu")
        assert all((ph[p]["gpu_ms"] is None) == (e2e_target_name == "cpu") for p in want)
        # execute_model's host time of each call (issue 37): one per executed step on CPU (CUDA's
        # async scheduling may call it apart from the step that returns the tokens)
        assert run["execute_model_ms"] and all(x > 0 for x in run["execute_model_ms"])
        if e2e_target_name == "cpu":
            assert len(run["execute_model_ms"]) == run["steps"]
    assert set(prof["decode_step"]) >= want
    assert prof["decode_step"]["schedule"]["calls"] >= 1
    each = prof["decode_each"]  # the decode steps after the hit's step, measured one by one
    assert each["execute_model_ms"] and each["step_wall_ms"], each
    if e2e_target_name == "cpu":  # 16 decode steps, each step's wall holding its execute_model
        assert len(each["execute_model_ms"]) == 16 == len(each["step_wall_ms"]), each
        assert all(w >= x for w, x in zip(each["step_wall_ms"], each["execute_model_ms"])), each


def test_tensor_parallel_2_row(tmp_path, tiny_model_dir, seed, e2e_target_name):
    """``--tp 2`` (issue 31): the exporter row's engine runs at tensor_parallel_size 2 (vLLM's
    ``MultiprocExecutor``, its runner asked of the workers), the unit records the size and the
    block vLLM chose (printed in the table), a cold prompt takes one step and its repeat hits
    ``(L - 1) // B * B``. On CPU each worker's threads are bound (``VLLM_CPU_OMP_THREADS_BIND``);
    on CUDA it needs two GPUs."""
    why = tp_skip_reason(e2e_target_name, 2)
    if why:
        pytest.skip(why)
    env = {"VLLM_CPU_OMP_THREADS_BIND": threads_bind(2)} if e2e_target_name == "cpu" else {}
    out = tmp_path / "tp2.json"
    stdout, doc = _bench(out, str(tiny_model_dir("qwen3_next")), seed, "exporter", "--tp", "2",
                         "--phases", "cold,repeat", env=env)
    assert doc["args"]["tp"] == 2
    unit = doc["units"]["exporter@1200"]
    engine = unit["engine"]
    assert engine["tensor_parallel_size"] == 2 and engine["executor"] == "MultiprocExecutor", engine
    assert engine["runner"], engine
    row = next(r for r in doc["rows"] if r["row"] == "exporter")
    block = row["block_size"]
    assert block == engine["block_size"] and f"| exporter | 1200 | {block} |" in stdout, stdout
    assert row["steps_per_cold_prompt"] == 1, row
    assert unit["samples"]["repeat"]["cached"] == [(1200 - 1) // block * block] * 2, unit["samples"]["repeat"]
    # the kernels run in the workers: no column of this process's profiler
    assert row["copy_us_per_step"] is None and row["export_us_per_step"] is None
