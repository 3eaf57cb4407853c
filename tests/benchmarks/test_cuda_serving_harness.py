"""The serving benchmark's harness (benchmarks/cuda_serving.py) without vLLM: each defect of
issue 21 with a test that catches it on CPU (metrics on drawn timings, the sync count, the target
tolerance, the shared prefix, the warm-up's paths), the bookkeeping (``--resume`` by row and
prompt length), and process hygiene with a stand-in worker (``CUDA_SERVING_BENCH_FAKE``): a
row's process group ends on SIGTERM and at the call budget. The harness with vLLM runs in
e2e/test_cuda_serving_smoke.py."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import types
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks import cuda_serving as cs

ROOT = Path(__file__).resolve().parents[2]
IDENT = {"host": "h", "boot_id": "b", "device": "NVIDIA H100 80GB HBM3", "gpu_uuid": "GPU-1"}


# ---------------------------------------------------------------- defects: metrics


def test_itl_is_per_gap_and_a_stall_is_reported_not_averaged(rng):
    """Issue 21: ITL over first-to-last token absorbed one-off stalls (970 and 1,919 ms)."""
    gap = rng.uniform(0.005, 0.02)
    times = [[i * gap for i in range(64)] for _ in range(8)]
    stall = rng.choice([0.970, 1.919])
    times[3] = times[3][:20] + [t + stall for t in times[3][20:]]
    st = cs.token_stats(times)
    assert st["itl_ms"] == pytest.approx(1e3 * gap, rel=1e-6)
    assert st["itl_p90_ms"] == pytest.approx(1e3 * gap, rel=1e-6)
    assert st["stalls"] == 1 and st["stall_ms"][0] == pytest.approx(1e3 * (stall + gap), abs=0.1)
    # the span formula of the old harness moves by the stall: what the per-gap ITL avoids
    span = [(ts[-1] - ts[0]) / (len(ts) - 1) for ts in times]
    assert max(span) > 1.2 * gap


def test_decode_rate_excludes_the_prefill(rng):
    """Issue 21: decode tok/s divided by a wall time that included the whole prefill."""
    prefill = rng.uniform(1.0, 5.0)
    gap = rng.uniform(0.005, 0.02)
    n_req, n_tok = 16, 32
    times = [[prefill + r * 0.001 + i * gap for i in range(n_tok)] for r in range(n_req)]
    got = cs.decode_rate(times)
    start = max(ts[0] for ts in times)
    later = sum(1 for ts in times for t in ts if t > start)
    assert got["decode_tok_s"] == pytest.approx(later / (max(map(max, times)) - start))
    assert got["decode_tok_s"] == pytest.approx(n_req / gap, rel=0.15)
    wall_with_prefill = n_req * n_tok / max(map(max, times))  # the old formula
    assert wall_with_prefill < 0.5 * got["decode_tok_s"]


def test_only_torchs_sync_warning_counts_as_a_host_sync():
    """Issue 21: matching "synchroniz" also counted torch's other warnings."""
    msgs = ["called a synchronizing CUDA operation",
            "torch.cuda.synchronize() is called while sync debug mode is on",  # not a sync event
            "Synchronization of the stream is deprecated", "called a synchronizing CUDA operation"]
    assert cs.count_syncs(msgs) == 2
    assert sum("synchroniz" in m.lower() for m in msgs) == 4  # the old match


def test_targets_have_a_tolerance_and_say_when_a_ratio_is_within_noise(rng):
    """Issue 21: targets compared without tolerance."""
    def rows(cold_ratio, itl_ratio, hit):
        base = {"status": "measured", "prompt_tokens": 8192}
        off = {**base, "row": "off", "cold_ttft_ms": 100.0, "itl_ms": 10.0, "hit_ttft_ms": 100.0}
        exp = {**base, "row": "exporter", "cold_ttft_ms": 100.0 * cold_ratio,
               "itl_ms": 10.0 * itl_ratio, "hit_ttft_ms": hit}
        return [off, exp]

    got = {t["metric"]: t for t in cs.targets(rows(1.01, 1.10, 20.0))}
    assert got["cold_ttft_ms"]["met"] is True and got["itl_ms"]["met"] is False
    assert got["hit_ttft_ms"]["met"] is True
    near = cs.targets(rows(1.03 + cs.TOLERANCE / 2, 1.0, 20.0))
    cold = next(t for t in near if t["metric"] == "cold_ttft_ms")
    assert cold["met"] is None and "within noise" in cold["verdict"]
    # noisy samples widen the margin: a ratio 2 % over the limit is not called a miss
    noisy = {"exporter@8192": {"samples": {"cold": {"ttft_ms": [80, 90, 110, 125]},
                                           "repeat": {"ttft_ms": [20]}}},
             "off@8192": {"samples": {"cold": {"ttft_ms": [70, 100, 105, 130]}, "repeat": {"ttft_ms": [1]}}}}
    t = next(t for t in cs.targets(rows(1.05, 1.0, 20.0), noisy) if t["metric"] == "cold_ttft_ms")
    assert t["met"] is None and t["margin"] > 0.02
    # the cold target applies at 8k and 32k only; 2k rows get no cold verdict
    two_k = [{**r, "prompt_tokens": 2048} for r in rows(1.5, 1.0, 20.0)]
    assert not [t for t in cs.targets(two_k) if t["metric"] == "cold_ttft_ms"]


@pytest.mark.parametrize("block", [64, 384, 1056, 2112, 4160])
def test_concurrent_prompts_share_at_least_two_blocks(block):
    """Issue 21: the decode prompts shared less than one block, so the decode phase had no hits."""
    for length in (2048, 8192, 32768):
        if length < 3 * block:  # shares what it has; never the prompt's last token
            shared = cs.shared_prefix_len(length, block)
            assert shared % block == 0 and shared < length and length - shared <= block
            continue
        shared = cs.shared_prefix_len(length, block)
        assert shared % block == 0 and shared >= 2 * block and length - shared >= block


class _FakeDriver:
    """Records the calls of :func:`cs._measure_length` (tokens echo the prompt's tail)."""

    def __init__(self):
        self.calls, self.steps = [], 0

    def run(self, prompts, max_tokens, stagger_steps=0):
        self.calls.append({"prompts": [list(p) for p in prompts], "max_tokens": max_tokens,
                           "stagger": stagger_steps})
        self.steps += 1
        return [{"ttft_ms": 1.0, "steps_to_first": 1, "cached": 0, "prompt_len": len(p), "arrival": 0.0,
                 "times": [0.001 * i for i in range(max_tokens)], "tokens": list(range(7, 7 + max_tokens))}
                for p in prompts]


def test_warmup_runs_every_measured_path_first_with_other_tokens(rng):
    """Issue 21: the warm-up (two 600-token prompts, under one block) exercised no split, no cached
    state, no mixed batch. Now, at each length before timing: a cold prompt of that length, its
    repeat, a turn carrying the previous answer, the concurrent batch and a staggered (mixed) one,
    drawn from another stream than the timed prompts."""
    args = SimpleNamespace(answer_len=4, user_len=8, seed=rng.randrange(1 << 30), cold=2, sessions=1, clients=3,
                           step_profile=0)
    drv = _FakeDriver()
    cs._measure_length(args, drv, 1200, 384, 5000, cuda=False, torch=None)
    # the warm-up's calls: cold, repeat, turn 1, turn 2, concurrent 1 and 2, the mixed batch
    warm = drv.calls[:7]
    assert [len(c["prompts"][0]) for c in warm[:2]] == [1200, 1200] and warm[0]["prompts"] == warm[1]["prompts"]
    assert warm[3]["prompts"][0][:1200 + 4] == warm[2]["prompts"][0] + list(range(7, 11))  # carries the answer
    assert len(warm[4]["prompts"]) == 3 and len(warm[5]["prompts"]) == 3
    assert warm[6]["stagger"] > 0 and len(warm[6]["prompts"]) == 3
    timed = drv.calls[7:]
    warm_tokens = {tuple(p[:64]) for c in warm for p in c["prompts"]}
    assert not any(tuple(p[:64]) in warm_tokens for c in timed for p in c["prompts"])
    assert all(c["stagger"] == 0 for c in timed)


def test_estimate_defers_a_length_that_would_not_finish():
    assert cs.estimate_seconds({}, 2048, 120) == 120
    assert cs.estimate_seconds({2048: 40.0}, 8192, 120) == pytest.approx(1.3 * 40 * 4)


# ---------------------------------------------------------------- GPU memory check


def test_memory_check_names_the_holders():
    """Issue 21: a timed-out step's `vllm serve` held 31 GiB; the next call failed vLLM's check."""
    apps = cs.parse_compute_apps("4242, python3, 31744\n4243, /usr/bin/python3, 512\n")
    apps[0]["cmdline"] = "python3 -m vllm.entrypoints.cli.main serve /tmp/m"
    why = cs.memory_verdict(free_mib=48000, total_mib=81559, fraction=0.85, holders=apps)
    assert why and "pid 4242" in why and "vllm" in why and "31744 MiB" in why and "pid 4243" in why
    assert cs.memory_verdict(free_mib=80000, total_mib=81559, fraction=0.85, holders=[]) is None


# ---------------------------------------------------------------- resume


def _args(rng):
    return {k: rng.randrange(1, 9999) for k in cs.RESUME_KEYS}


@pytest.mark.parametrize("change", ["seed", "arg", "machine"])
def test_resume_refuses_another_run(rng, change):
    seed, args = rng.randrange(1 << 31), _args(rng)
    prev = {"seed": seed, "args": dict(args), "identity": dict(IDENT), "units": {"off@2048": {}}}
    ident = dict(IDENT)
    if change == "seed":
        seed += 1
    elif change == "arg":
        key = rng.choice(cs.RESUME_KEYS)
        args = {**args, key: args[key] + 1}
    else:
        ident["boot_id"] = "another boot"
    with pytest.raises(ValueError, match="--resume"):
        cs.resumable_units(prev, seed, args, ident)
    if change == "seed":
        assert cs.resumable_units(prev, seed - 1, args, ident) == {"off@2048": {}}


def _harness(tmp_path, fake, *extra, wait=True):
    env = {**os.environ, "CUDA_SERVING_BENCH_FAKE": fake, "PYTHONPATH": str(ROOT)}
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 8}))
    cmd = [sys.executable, "-m", "benchmarks.cuda_serving", "--model-dir", str(model), "--out",
           str(tmp_path / "b.json"), "--seed", "7", *extra]
    if not wait:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


def test_resume_runs_only_the_missing_units(tmp_path):
    p = _harness(tmp_path, "result", "--rows", "off,exporter", "--lengths", "2048")
    assert p.returncode == 0, p.stdout + p.stderr
    doc = json.loads((tmp_path / "b.json").read_text())
    assert sorted(doc["units"]) == ["exporter@2048", "off@2048"]
    p = _harness(tmp_path, "result", "--rows", "off,exporter", "--lengths", "2048,8192", "--resume")
    assert "keeping units ['exporter@2048', 'off@2048']" in p.stdout
    assert "lengths [8192]" in p.stdout and "lengths [2048" not in p.stdout
    doc2 = json.loads((tmp_path / "b.json").read_text())
    assert doc2["units"]["off@2048"] == doc["units"]["off@2048"]
    rows = {(r["row"], r["prompt_tokens"]): r for r in doc2["rows"]}
    assert rows[("exporter", 8192)]["cold_ttft_vs_off"] == pytest.approx(1.01, rel=0.05)
    assert {t["prompt_tokens"] for t in doc2["targets"] if t["metric"] == "cold_ttft_ms"} == {8192}


def test_a_unit_records_its_rows_position_and_targets_name_a_mismatch(tmp_path):
    # 2026-11-26 (docs/cuda.md section 0): a row started second in a call was 1-7 ms slower
    # on an H200 whichever row it was, so a ratio between rows of different positions says so
    p = _harness(tmp_path, "result", "--rows", "off,exporter", "--lengths", "8192")
    assert p.returncode == 0, p.stdout + p.stderr
    doc = json.loads((tmp_path / "b.json").read_text())
    assert (doc["units"]["off@8192"]["position"], doc["units"]["exporter@8192"]["position"]) == (1, 2)
    cold = next(t for t in doc["targets"] if t["metric"] == "cold_ttft_ms")
    assert cold["positions"] == [2, 1] and "same position" in cold["verdict"]
    # one row per call, resumed: both rows first in their calls, no mismatch
    (tmp_path / "b.json").unlink()
    for rows in ("exporter", "off,exporter"):
        p = _harness(tmp_path, "result", "--rows", rows, "--lengths", "8192", "--resume")
        assert p.returncode == 0, p.stdout + p.stderr
    doc = json.loads((tmp_path / "b.json").read_text())
    assert (doc["units"]["off@8192"]["position"], doc["units"]["exporter@8192"]["position"]) == (1, 1)
    cold = next(t for t in doc["targets"] if t["metric"] == "cold_ttft_ms")
    assert "positions" not in cold and "same position" not in cold["verdict"]


def test_tp_reaches_the_rows_engine_and_is_a_resume_key(tmp_path, rng):
    """Issue 31: ``--tp N`` goes to every row's worker (the stand-in records the size it got, as
    the real worker records ``tensor_parallel_size`` of vLLM's config), lands in the JSON's
    arguments, and ``--resume`` refuses units measured at another size."""
    tp = rng.choice([2, 4, 8])
    p = _harness(tmp_path, "result", "--rows", "off,exporter", "--lengths", "2048", "--tp", str(tp))
    assert p.returncode == 0, p.stdout + p.stderr
    doc = json.loads((tmp_path / "b.json").read_text())
    assert doc["args"]["tp"] == tp
    assert {u["engine"]["tensor_parallel_size"] for u in doc["units"].values()} == {tp}
    assert "| block |" in p.stdout  # the printed table shows the block size vLLM chose
    p = _harness(tmp_path, "result", "--rows", "off", "--lengths", "2048", "--tp", "1", "--resume")
    assert p.returncode != 0 and f"--tp {tp!r} vs 1" in p.stderr, p.stdout + p.stderr
    p = _harness(tmp_path, "result", "--rows", "off", "--lengths", "2048", "--tp", "0")
    assert p.returncode != 0 and "--tp 0" in p.stderr


def test_memory_check_covers_every_gpu_of_the_row(monkeypatch):
    """At ``--tp 2`` both GPUs need ``--gpu-mem`` free: a busy second GPU is named, a missing one
    too; the first GPU alone is checked at tp 1."""
    lines = ("NVIDIA H100 80GB HBM3, GPU-a, 00000000:19:00.0, 580.159.04, 81559, 80000\n"
             "NVIDIA H100 80GB HBM3, GPU-b, 00000000:3B:00.0, 580.159.04, 81559, 20000\n")
    monkeypatch.setattr(cs, "_run", lambda cmd, timeout=20: lines if "--query-gpu" in " ".join(cmd) else "")
    assert [g["uuid"] for g in cs.gpus_info()] == ["GPU-a", "GPU-b"]
    assert cs.check_gpu_memory(0.85, wait_s=0, gpus=1) is None
    why = cs.check_gpu_memory(0.85, wait_s=0, gpus=2)
    assert why and why.startswith("GPU 1: ") and "20000 MiB free" in why
    assert "only 2 GPU" in cs.check_gpu_memory(0.85, wait_s=0, gpus=4)


def test_runner_is_found_in_process_or_asked_of_the_workers():
    """tp 1 (vLLM's uniprocess executor): the runner in this process; tp > 1
    (``MultiprocExecutor``, no ``driver_worker``): none here, its module asked of the workers."""
    class Runner:
        pass

    uni = SimpleNamespace(driver_worker=SimpleNamespace(worker=SimpleNamespace(model_runner=Runner())))
    assert isinstance(cs.in_process_runner(uni), Runner)
    assert cs.runner_module(uni) == Runner.__module__

    class Multiproc:
        def collective_rpc(self, fn):
            return [fn(SimpleNamespace(model_runner=Runner())) for _ in range(2)]

    assert cs.in_process_runner(Multiproc()) is None
    assert cs.runner_module(Multiproc()) == Runner.__module__
    assert cs.PhaseTimer({"runner": None}).install().found == {}


def test_breakdown_times_class_and_module_functions_and_puts_them_back(rng, monkeypatch):
    """``--host-breakdown``'s phases named by path: a class's method and a module's function
    called inside a timed runner method get their own time (their cost, drawn fresh), the
    enclosing phase keeps the rest, and uninstall puts the class's and the module's attributes
    back (the same objects)."""
    clock = _Clock(0.0)
    mod = types.ModuleType("bench_fake_gdn")
    cost_fn, cost_m, own = (rng.randrange(1, 50) / 8 for _ in range(3))

    def helper():
        clock.t += cost_fn

    class Layer:
        def forward(self):
            clock.t += cost_m
            mod.helper()

    mod.helper, mod.Layer = helper, Layer
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    layer, forward = Layer(), Layer.__dict__["forward"]

    class Runner:
        def execute_model(self):
            clock.t += own
            layer.forward()

    phases = (("execute_model", "runner", ("execute_model",)),
              ("layer", f"{mod.__name__}:Layer", ("forward",)),
              ("helper", f"module {mod.__name__}", ("helper",)),
              ("absent", "module not_imported_here", ("x",)))
    timer = cs.PhaseTimer({"runner": Runner()}, clock=clock, phases=phases).install()
    assert set(timer.found) == {"execute_model", "layer", "helper"}
    timer.owners["runner"].execute_model()
    t = cs.phase_table(timer.host, None, steps=1)
    assert t["helper"]["host_ms"] == pytest.approx(1e3 * cost_fn)
    assert t["layer"]["host_ms"] == pytest.approx(1e3 * cost_m)
    assert t["layer"]["host_incl_ms"] == pytest.approx(1e3 * (cost_m + cost_fn))
    assert t["execute_model"]["host_ms"] == pytest.approx(1e3 * own)
    assert t["execute_model"]["host_incl_ms"] == pytest.approx(1e3 * (own + cost_m + cost_fn))
    timer.uninstall()
    assert mod.helper is helper and Layer.__dict__["forward"] is forward
    assert cs.resolve_owner(f"{mod.__name__}:Layer") is Layer and cs.resolve_owner("module x.y") is None


# ---------------------------------------------------------------- process hygiene


def _group_gone(pgid, within=20.0):
    end = time.time() + within
    while time.time() < end:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


def _worker_pgid(proc):
    for line in proc.stdout:
        m = re.search(r"row \S+: pid (\d+) \(own process group\)", line)
        if m:
            return int(m.group(1))
    raise AssertionError("the harness started no row")


def test_sigterm_ends_the_rows_process_group(tmp_path):
    """The harness ends on `timeout`'s SIGTERM; a row's group (a grandchild too) must not outlive it."""
    proc = _harness(tmp_path, "sleep", "--rows", "off", "--lengths", "2048", wait=False)
    try:
        pgid = _worker_pgid(proc)
        assert os.getpgid(pgid) == pgid and pgid != os.getpgid(proc.pid)  # a group of its own
        time.sleep(1.0)  # the fake worker starts its grandchild
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        assert _group_gone(pgid), "the row's process group outlived the harness"
        doc = json.loads((tmp_path / "b.json").read_text())
        assert doc["rows"][0]["status"] == "pending"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_call_budget_kills_a_hung_row_and_exits_in_time(tmp_path):
    """Each call stays under its limit: a hung row is killed at --call-budget, the rest waits."""
    t = time.time()
    proc = _harness(tmp_path, "sleep", "--rows", "off,exporter", "--lengths", "2048",
                    "--call-budget", "8", "--min-row-s", "6", wait=False)
    try:
        pgid = _worker_pgid(proc)
        proc.wait(timeout=40)
        assert time.time() - t < 8 + 15
        assert _group_gone(pgid)
        doc = json.loads((tmp_path / "b.json").read_text())
        st = {r["row"]: r for r in doc["rows"]}
        assert st["off"]["status"] == "error" and "before the engine was up" in st["off"]["reason"]
        assert st["exporter"]["status"] == "pending"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


# ---------------------------------------------------------------- call budget (fake clock; issue 30 item 6)


class _Clock:
    def __init__(self, t):
        self.t = t

    def __call__(self):
        return self.t


def test_call_budget_decisions_on_a_fake_clock(rng):
    """The budget logic without waiting: a row starts only with --min-row-s left, a length runs
    only when its estimate fits, the parent waits until the margin before the deadline."""
    start = rng.uniform(1e6, 2e6)
    clock = _Clock(start)
    budget = cs.CallBudget(start + 540, clock)
    assert budget.row_pending(150) is None
    clock.t = start + 400  # 140 s left
    why = budget.row_pending(150)
    assert why and "140 s left" in why and "--resume" in why
    # a worker: first length estimated at --first-length-s, later ones from the longest done
    clock.t = start + 300
    assert budget.length_deferred({}, 8192, 120) is None  # 120 <= 240
    assert budget.length_deferred({}, 8192, 241) is not None
    done = {8192: 60.0}
    est = 1.3 * 60.0 * 4  # 32,768 tokens: x4 the length
    clock.t = start + 540 - est + 1  # one second short
    why = budget.length_deferred(done, 32768, 120)
    assert why and f"estimated {est:.0f} s" in why
    clock.t = start + 540 - est - 1
    assert budget.length_deferred(done, 32768, 120) is None
    clock.t = start + 530
    assert budget.wait_s(5.0) == pytest.approx(5.0)
    clock.t = start + 600  # past the deadline: still at least a second to collect the worker
    assert budget.wait_s(5.0) == 1.0


def test_a_call_that_measures_nothing_says_so_and_fails(tmp_path, rng):
    """2026-11-27 (docs/cuda.md section 0d): warm calls given 180 s deferred every length on the
    old 120 s first-length guess, exited 0 and marked the longer length an error. Every length a
    worker defers is pending with the estimate, and a call that measured nothing exits 3."""
    budget = rng.randrange(60, 300)  # seconds of --call-budget; the row may start (--min-row-s 1)
    lengths = sorted(rng.sample(range(1024, 65536, 1024), 3))
    common = ("--rows", "off", "--lengths", ",".join(map(str, lengths)), "--call-budget", str(budget),
              "--min-row-s", "1")
    p = _harness(tmp_path, "result", *common, "--first-length-s", str(budget + 1))
    assert p.returncode == 3 and "NOTHING MEASURED" in p.stdout, p.stdout + p.stderr
    doc = json.loads((tmp_path / "b.json").read_text())
    assert doc["units"] == {}
    assert [(r["prompt_tokens"], r["status"]) for r in doc["rows"]] == [(n, "pending") for n in lengths]
    assert f"estimated {budget + 1} s" in doc["rows"][0]["reason"]
    assert all(f"{lengths[0]} tokens deferred" in r["reason"] for r in doc["rows"][1:])
    # the same call with an estimate that fits measures every length and passes
    (tmp_path / "b.json").unlink()
    p = _harness(tmp_path, "result", *common, "--first-length-s", "1")
    assert p.returncode == 0, p.stdout + p.stderr
    assert set(json.loads((tmp_path / "b.json").read_text())["units"]) == {f"off@{n}" for n in lengths}


# ---------------------------------------------------------------- floor unit, phases, identity (issue 30)


def test_floor_lengths_are_the_repeats_computed_tokens():
    # 8,192 tokens at block 1,088: 7,616 cached, 576 computed; 32,768: 32,640 cached, 128
    assert cs.floor_lengths([8192, 32768], [7616, 32640]) == [576, 128]
    assert cs.floor_lengths([8192, 8192], [0, None]) == []  # caching off: no floor


class _FloorDriver(_FakeDriver):
    """A repeat hits all but the prompt's last 100 tokens."""

    def run(self, prompts, max_tokens, stagger_steps=0):
        recs = super().run(prompts, max_tokens, stagger_steps)
        seen = {tuple(c["prompts"][0]) for c in self.calls[:-1]}
        for rec, p in zip(recs, prompts):
            rec["cached"] = len(p) - 100 if tuple(p) in seen else 0
        return recs


def test_floor_phase_runs_prompts_of_the_computed_tokens_without_context(rng):
    args = SimpleNamespace(answer_len=4, user_len=8, seed=rng.randrange(1 << 30), cold=3, sessions=0, clients=0,
                           step_profile=0, phases="cold,repeat,floor")
    drv = _FloorDriver()
    res = cs._measure_length(args, drv, 1200, 384, 5000, cuda=False, torch=None)
    floor = res["samples"]["floor"]
    assert floor["prompt_len"] == [100, 100, 100]
    prompts = [tuple(c["prompts"][0]) for c in drv.calls]
    floors = [c["prompts"][0] for c in drv.calls if len(c["prompts"][0]) == 100]
    # fresh tokens: no floor prompt is a prefix of (or equal to) any earlier prompt
    assert floors and all(tuple(f) not in {p[:100] for p in prompts if len(p) != 100} for f in floors)
    assert not res["samples"]["conc1"]["ttft_ms"] and not res["samples"]["turn1"]["ttft_ms"]
    row = cs.summarize_unit({"row": "exporter", "prompt_tokens": 1200, **res})
    assert row["floor_tokens"] == 100 and row["floor_ttft_ms"] == 1.0 and row["itl_ms"] is None


def test_concurrent_phase_alone_with_16_clients(rng):
    args = SimpleNamespace(answer_len=4, user_len=8, seed=rng.randrange(1 << 30), cold=5, sessions=2, clients=16,
                           step_profile=0, phases="conc")
    drv = _FakeDriver()
    res = cs._measure_length(args, drv, 1200, 384, 5000, cuda=False, torch=None)
    assert len(res["samples"]["conc1"]["ttft_ms"]) == 16 and len(res["samples"]["conc2"]["ttft_ms"]) == 16
    assert not res["samples"]["cold"]["ttft_ms"]
    row = cs.summarize_unit({"row": "off", "prompt_tokens": 1200, **res})
    assert row["clients"] == 16 and row["itl_ms"] == pytest.approx(1.0) and row["cold_ttft_ms"] is None


def test_decomposition_rows_differ_from_off_in_one_setting_each(monkeypatch):
    monkeypatch.delenv("VLLM_HYBRID_NPU_PATCHES", raising=False)
    off, plugin, block = cs.ROWS["off"], cs.ROWS["off-plugin"], cs.ROWS["off-b1088"]
    assert not off["caching"] and not plugin["caching"] and not block["caching"]
    assert cs.row_env("off")["VLLM_HYBRID_NPU_PATCHES"] == "none"
    assert "VLLM_HYBRID_NPU_PATCHES" not in cs.row_env("off-plugin")
    # every row's log reports the autotuned launch configurations (caching off's included)
    monkeypatch.delenv("TRITON_PRINT_AUTOTUNING", raising=False)
    assert {cs.row_env(r)["TRITON_PRINT_AUTOTUNING"] for r in cs.ROWS} == {"1"}
    monkeypatch.setenv("TRITON_PRINT_AUTOTUNING", "0")
    assert cs.row_env("off")["TRITON_PRINT_AUTOTUNING"] == "0"
    assert block["block_size"] == "off_block_size" and "block_size" not in plugin
    p = __import__("argparse").ArgumentParser()
    cs.add_arguments(p)
    assert p.parse_args([]).off_block_size == 1088


def test_base_row_imports_the_base_sites_plugin_and_names_what_is_missing(tmp_path, monkeypatch, rng):
    """``exporter-base`` differs from ``exporter`` only in where ``vllm_hybrid_npu`` comes from:
    a worker process with the site first imports that package (a marker drawn fresh), records
    the site's commit, and a missing or empty site is a skip reason naming the variable."""
    base, ours = cs.ROWS["exporter-base"], cs.ROWS["exporter"]
    assert {k: v for k, v in base.items() if k != "plugin_site"} == ours
    monkeypatch.delenv(cs.BASE_SITE_VAR, raising=False)
    assert cs.BASE_SITE_VAR in cs.row_skip_reason("exporter-base")
    assert cs.row_skip_reason("exporter") is None
    monkeypatch.setenv(cs.BASE_SITE_VAR, str(tmp_path))
    assert "holds no vllm_hybrid_npu" in cs.row_skip_reason("exporter-base")
    marker, commit = rng.randrange(1 << 30), f"{rng.randrange(1 << 40):010x}"
    (tmp_path / "vllm_hybrid_npu").mkdir()
    (tmp_path / "vllm_hybrid_npu" / "__init__.py").write_text(f"MARKER = {marker}\n")
    (tmp_path / "COMMIT").write_text(commit + "\n")
    assert cs.row_skip_reason("exporter-base") is None
    code = ("import json, sys; from benchmarks import cuda_serving as cs; "
            "info = cs.use_plugin_site('exporter-base'); import vllm_hybrid_npu as p; "
            "print(json.dumps([info, p.MARKER]))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=cs.row_env("exporter-base"),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    info, seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen == marker and info["commit"] == commit
    assert Path(info["file"]).resolve() == (tmp_path / "vllm_hybrid_npu" / "__init__.py").resolve()


def test_gpu_query_parsed_with_bus_id_and_driver():
    g = cs.parse_gpu_query("NVIDIA H100 80GB HBM3, GPU-3f0c, 00000000:19:00.0, 580.159.04, 81559, 80000\n")
    assert g == {"name": "NVIDIA H100 80GB HBM3", "uuid": "GPU-3f0c", "pci_bus_id": "00000000:19:00.0",
                 "driver": "580.159.04", "total_mib": 81559.0, "free_mib": 80000.0}
    assert cs.parse_gpu_query("") is None


class _Runner:
    def __init__(self, clock):
        self.clock = clock

    def execute_model(self, n):
        self.clock.t += 1.0
        self._prepare_inputs()
        self._build_attention_metadata()
        self._model_forward()
        return n

    def _prepare_inputs(self):
        self.clock.t += 0.25

    def _build_attention_metadata(self):
        self.clock.t += 0.5

    def _model_forward(self):
        self.clock.t += 4.0

    def sample_tokens(self):
        self.clock.t += 0.125


def test_phase_timer_separates_nested_phases_on_a_fake_clock():
    clock = _Clock(0.0)
    runner = _Runner(clock)
    timer = cs.PhaseTimer({"runner": runner}, clock=clock).install()
    assert timer.found["metadata_build"] == "runner._build_attention_metadata"
    for _ in range(2):
        runner.execute_model(1)
        runner.sample_tokens()
    t = cs.phase_table(timer.host, None, steps=2)
    assert t["execute_model"]["host_ms"] == pytest.approx(1000.0)  # own time only
    assert t["execute_model"]["host_incl_ms"] == pytest.approx(5750.0)
    assert t["metadata_build"]["host_ms"] == pytest.approx(500.0) and t["forward"]["host_ms"] == pytest.approx(4000.0)
    assert t["sample"]["host_ms"] == pytest.approx(125.0) and t["sample"]["gpu_ms"] is None
    # GPU: range times are inclusive; execute_model's own is the rest
    g = cs.phase_table(timer.host, {"execute_model": 9000.0, "prepare_inputs": 1000.0, "metadata_build": 2000.0,
                                    "forward": 5000.0, "sample": 400.0}, steps=2)
    assert g["execute_model"]["gpu_ms"] == pytest.approx(0.5) and g["forward"]["gpu_ms"] == pytest.approx(2.5)
    timer.uninstall()
    clock.t = 0.0
    runner.execute_model(1)
    assert "execute_model" not in vars(runner) and timer.host["execute_model"][2] == 2


def test_decode_steps_are_the_decode_run_less_the_repeat():
    rep = {"steps": 1, "phases": {"schedule": {"host_ms": 3.0, "host_incl_ms": 3.0, "gpu_ms": None, "calls": 1.0}}}
    dec = {"steps": 17, "phases": {"schedule": {"host_ms": 1.0, "host_incl_ms": 1.0, "gpu_ms": None, "calls": 1.0}}}
    got = cs.subtract_phases(dec, rep, 16)
    assert got["schedule"]["host_ms"] == pytest.approx((17 * 1.0 - 3.0) / 16)
    assert got["schedule"]["gpu_ms"] is None and got["schedule"]["calls"] == pytest.approx(1.0)


def test_calls_are_recorded_and_pool(tmp_path):
    """One row per call with --call: each unit carries its call, position and machine; pool.py
    leaves the first call of each row out (compile) and pools the rest."""
    from benchmarks import pool

    files = []
    for n, row in enumerate(["off", "exporter", "off", "exporter", "off", "exporter"], start=1):
        (tmp_path / f"c{n}").mkdir()
        p = _harness(tmp_path / f"c{n}", "result", "--rows", row, "--lengths", "8192", "--call", str(n))
        assert p.returncode == 0, p.stdout + p.stderr
        files.append(tmp_path / f"c{n}" / "b.json")
    doc = json.loads(files[0].read_text())
    u = doc["units"]["off@8192"]
    assert u["call"] == 1 and u["position"] == 1 and u["identity"]["boot_id"] and doc["call"] == 1
    assert "cpu" in doc and "gpu" in doc
    pooled = pool.pool(pool.read_units(files), min_calls=2)
    rows = {r["row"]: r for r in pooled["rows"]}
    assert rows["off"]["call"] == [3, 5] and rows["exporter"]["call"] == [4, 6]
    assert rows["exporter"]["cold_ttft_vs_off"] == pytest.approx(1.01, rel=0.05)
    assert rows["exporter"]["floor_ttft_ms"] is not None and rows["off"]["floor_ttft_ms"] is None


# ---------------------------------------------------------------- profiler columns (issue 37, item 4)


def _event(name, start, end, device, activity, annotation=False, thread=1):
    """A ``FunctionEvent`` as torch's kineto parser makes it (``use_device`` cuda)."""
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import FunctionEvent

    return FunctionEvent(id=0, name=name, thread=thread, start_us=start, end_us=end, use_device="cuda",
                         device_type=DeviceType.CUDA if device else DeviceType.CPU, is_user_annotation=annotation,
                         activity_type=activity, input_shapes=[], stack=[])


def _old_kernel_sum(events):
    """The harness's kernel column before issue 37: every CUDA event's self device time."""
    return sum(e.self_device_time_total for e in events if str(e.device_type).endswith("CUDA"))


def test_kernel_column_counts_kernels_not_ranges_hand_counted():
    """On an H100, call 11's "GPU kernels ms" was 88.78 ms of which 57.77 ms were the device-side
    copies of record_function ranges (the harness's bench.phase.* among them). Here: kernels
    30 + 10 + 20 = 60 us, memcpy 5 + memset 2 = 7, ranges 80 + 10 + 95 = 185, a sync 5; host
    events (an operator, the range's host side) nowhere."""
    events = [
        _event("aten::mm", 0, 50, False, "cpu_op"),
        _event("bench.phase.forward", 0, 200, False, "user_annotation", annotation=True),
        _event("gemm", 100, 130, True, "kernel"), _event("add", 140, 150, True, "kernel"),
        _event("gemm", 160, 180, True, "kernel"),
        _event("Memcpy HtoD", 90, 95, True, "gpu_memcpy"), _event("Memset", 96, 98, True, "gpu_memset"),
        _event("bench.phase.forward", 100, 180, True, "gpu_user_annotation", annotation=True),
        _event("vllm_hybrid_npu.export.ssm", 140, 150, True, "gpu_user_annotation", annotation=True),
        _event("bench.phase.execute_model", 90, 185, True, "gpu_user_annotation", annotation=True),
        _event("Context Sync", 185, 190, True, "cuda_sync"),
    ]
    got = cs.device_time_us(events)
    assert got == {"kernel": 60.0, "memory": 7.0, "ranges": 185.0, "other": 5.0}
    assert _old_kernel_sum(events) == 257  # what the column said before: 60 + 7 + 185 + 5


def test_kernel_column_on_drawn_events_and_without_activity_types(rng):
    """Drawn kernels and ranges; torch builds without ``activity_type`` (None) are told apart by
    ``is_user_annotation`` alone (kineto sets it for both annotation kinds); capitalised activity
    names of older kineto builds (``Kernel``, ``gpu_user_Annotation``) count the same."""
    t, kernels, ranges, events = 0, [], [], []
    for _ in range(rng.randrange(3, 30)):
        d = rng.randrange(1, 500)
        with_type = rng.random() < 0.5
        events.append(_event(f"k{t}", t, t + d, True, rng.choice(["kernel", "Kernel"]) if with_type else None))
        kernels.append(d)
        if rng.random() < 0.5:  # a range around this kernel and a gap after it
            gap = rng.randrange(1, 100)
            events.append(_event("bench.phase.x", t, t + d + gap, True,
                                 rng.choice(["gpu_user_annotation", "gpu_user_Annotation"]) if with_type else None,
                                 annotation=True))
            ranges.append(d + gap)
            t += gap
        t += d
    got = cs.device_time_us(events)
    assert got["kernel"] == sum(kernels) and got["ranges"] == sum(ranges) and got["memory"] == 0
    assert _old_kernel_sum(events) == sum(kernels) + sum(ranges)
    assert (_old_kernel_sum(events) == got["kernel"]) == (not ranges)


def _range_tree(rng, name):
    """A range on the host with two operators that launched kernels of drawn durations, and the
    range's device-side copy spanning them with a drawn idle gap, as torch's key_averages sees
    them (two entries under one key)."""
    from torch.autograd.profiler_util import EventList

    d1, d2, gap = rng.randrange(1, 1000), rng.randrange(1, 1000), rng.randrange(1, 1000)
    host = _event(name, 0, 100, False, "user_annotation", annotation=True)
    mm, add = _event("aten::mm", 10, 20, False, "cpu_op"), _event("aten::add", 30, 40, False, "cpu_op")
    mm.append_kernel("gemm", 0, d1)
    add.append_kernel("add", 0, d2)
    span = _event(name, 200, 200 + d1 + gap + d2, True, "gpu_user_annotation", annotation=True, thread=7)
    events = EventList([host, mm, add, _event("gemm", 200, 200 + d1, True, "kernel", thread=7),
                        _event("add", 200 + d1 + gap, 200 + d1 + gap + d2, True, "kernel", thread=7), span],
                       use_device="cuda")
    events._build_tree()
    return events.key_averages(), d1 + d2, d1 + d2 + gap


def test_range_time_is_its_kernels_not_its_span(rng):
    """A phase's (and the exporter's) GPU time: the kernels launched inside the range. torch's
    key_averages lists the range twice under one key: the host side (the kernels' sum) and the
    device-side span (idle gaps included). The harness took whichever came last for a phase and
    summed both for the export."""
    avg, kernels, span = _range_tree(rng, "bench.phase.forward")
    assert cs.range_device_us(avg, cs.PHASE_RANGE_PREFIX) == {"forward": kernels}
    assert cs.range_device_us(avg, cs.EXPORT_RANGE_PREFIX) == {}
    old_phase = {e.key[len(cs.PHASE_RANGE_PREFIX):]: e.device_time_total
                 for e in avg if e.key.startswith(cs.PHASE_RANGE_PREFIX)}
    assert old_phase == {"forward": span} and span > kernels
    avg, kernels, span = _range_tree(rng, cs.EXPORT_RANGE_PREFIX + ".ssm")
    assert sum(cs.range_device_us(avg, cs.EXPORT_RANGE_PREFIX).values()) == kernels
    assert sum(e.device_time_total for e in avg if e.key.startswith(cs.EXPORT_RANGE_PREFIX)) == kernels + span


# ---------------------------------------------------------------- step profile: execute_model per step (issue 37)


class _StepRunner:
    """A model runner whose ``execute_model`` advances a fake clock: a prefill of an unseen
    prompt costs ``cold`` s, of a seen one ``hit`` s, the i-th decode step ``decode[i]`` s."""

    def __init__(self, clock, cold, hit, decode):
        self.clock, self.cold, self.hit, self.decode = clock, cold, hit, decode

    def execute_model(self, cost):
        self.clock.t += cost


class _StepDriver:
    """Stands for :class:`cs.Driver` in :func:`cs.step_profile`: one engine step per token, each
    calling the runner's (wrapped) ``execute_model`` once, its wall that call plus ``overhead`` s."""

    def __init__(self, runner, overhead):
        self.runner, self.overhead = runner, overhead
        self.core = SimpleNamespace(model_executor=SimpleNamespace(
            driver_worker=SimpleNamespace(worker=SimpleNamespace(model_runner=runner))), scheduler=SimpleNamespace())
        self.engine = SimpleNamespace(output_processor=SimpleNamespace())
        self.steps, self.step_walls, self.seen = 0, [], set()

    def run(self, prompts, max_tokens, stagger_steps=0):
        (p,) = prompts
        hit = tuple(p) in self.seen
        self.seen.add(tuple(p))
        costs = [self.runner.hit if hit else self.runner.cold] + self.runner.decode[:max_tokens - 1]
        for cost in costs:
            t0 = self.runner.clock.t
            self.runner.execute_model(cost)
            self.runner.clock.t += self.overhead
            self.steps += 1
            self.step_walls.append((self.runner.clock.t - t0, 1))
        return [{"ttft_ms": 1.0, "cached": len(p) - 1 if hit else 0, "steps_to_first": 1}]


def test_step_profile_records_execute_model_of_each_step_and_the_decode_steps(rng):
    """Issue 37, item 3: align mode's host work per decode step against vllm-align and off needs
    ``execute_model``'s host time per step of the cold prompt, the repeat and the decode steps;
    the decode steps are measured one by one (``decode_each``) beside the decode-less-repeat
    subtraction. Costs drawn in whole microseconds on a fake clock (no profiler timing)."""
    import torch

    us = lambda: rng.randrange(1, 50_000) / 1e6  # noqa: E731
    clock = _Clock(rng.uniform(0, 1e5))
    decode = [us() for _ in range(cs.DECODE_PROFILE_TOKENS - 1)]
    runner = _StepRunner(clock, cold=us(), hit=us(), decode=decode)
    overhead = us()
    drv = _StepDriver(runner, overhead)
    draw = cs._draw(rng.randrange(1 << 30), 64, "stepprof")
    prof = cs.step_profile(drv, draw_prompts=draw, length=64, vocab=1000, rows=1, torch=torch, clock=clock)
    assert prof["phases_found"]["execute_model"] == "runner.execute_model"
    ms = lambda xs: [pytest.approx(1e3 * x, abs=1e-6) for x in xs]  # noqa: E731
    assert prof["cold"]["execute_model_ms"] == ms([runner.cold])
    assert prof["repeat"]["execute_model_ms"] == ms([runner.hit])
    assert prof["decode"]["execute_model_ms"] == ms([runner.hit, *decode])
    assert prof["decode_each"]["execute_model_ms"] == ms(decode)
    assert prof["decode_each"]["step_wall_ms"] == [pytest.approx(1e3 * (d + overhead), abs=2e-3) for d in decode]
    for run, costs in (("cold", [runner.cold]), ("decode", [runner.hit, *decode])):
        t = prof[run]["phases"]["execute_model"]
        assert t["host_incl_ms"] == pytest.approx(1e3 * sum(costs) / len(costs)) and t["calls"] == 1
        assert prof[run]["gpu_kernel_ms"] is None and prof[run]["gpu_memory_ms"] is None  # no CUDA
    # the subtraction gives the decode steps' mean: the hit's cost cancels
    sub = prof["decode_step"]["execute_model"]["host_incl_ms"]
    assert sub == pytest.approx(1e3 * sum(decode) / len(decode))
    assert "execute_model" not in vars(runner)  # the timer is off again


def test_decode_steps_start_after_the_first_token():
    run = {"steps_to_first": 2, "step_wall_ms": [9.0, 8.0, 1.5, 1.25], "execute_model_ms": [7.0, 6.0, 1.0, 0.75]}
    assert cs.decode_steps(run) == {"step_wall_ms": [1.5, 1.25], "execute_model_ms": [1.0, 0.75]}
    assert cs.decode_steps({"steps_to_first": 3, "step_wall_ms": [1.0]}) == {"step_wall_ms": [], "execute_model_ms": []}


# ---------------------------------------------------------------- a row at --layers N runs at depth N (issue 37)


def _depth(rng):
    return rng.choice([n for n in range(4, 49, 4) if n != cs.DEFAULT_LAYERS])


def test_the_default_model_folder_follows_arch_and_depth(tmp_path, monkeypatch, rng):
    """e2e/cuda_device.sh passed ``--model-dir $VHN/q35moe-8l`` whatever ``--layers`` said: a
    ``--layers 24`` run met the 8-layer folder. Without ``--model-dir`` the folder now follows
    arch and depth; a folder with a config gives its own, and a flag that differs is refused."""
    monkeypatch.setenv("VHN", str(tmp_path))
    n = _depth(rng)
    assert cs.resolve_model(None, None, None) == (str(tmp_path / "q35moe-8l"), "qwen3_5_moe", 8)
    assert cs.resolve_model(None, None, n) == (str(tmp_path / f"q35moe-{n}l"), "qwen3_5_moe", n)
    assert cs.resolve_model(None, "qwen3_next", n) == (str(tmp_path / f"qnext-{n}l"), "qwen3_next", n)
    with pytest.raises(ValueError, match="--arch 'qwen3'"):
        cs.resolve_model(None, "qwen3", None)
    folder = tmp_path / f"q35moe-{n}l"
    cs.build_model(folder, "qwen3_5_moe", n)
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["num_hidden_layers"] == n and cfg["architectures"] == ["Qwen3_5MoeForCausalLM"]
    assert cfg["layer_types"].count("full_attention") == n // 4  # every 4th, as the real model
    assert cs.resolve_model(str(folder), None, None) == (str(folder), "qwen3_5_moe", n)
    with pytest.raises(ValueError) as exc:
        cs.resolve_model(str(folder), None, 8)
    assert f"--model-dir {folder}" in str(exc.value) and f"layers {n}" in str(exc.value) and "--layers 8" in str(exc.value)
    with pytest.raises(ValueError, match="--arch 'qwen3_next'"):
        cs.resolve_model(str(folder), "qwen3_next", None)
    with pytest.raises(ValueError, match="--layers 8"):  # the config is kept, not overwritten
        cs.build_model(folder, "qwen3_5_moe", 8)
    assert json.loads((folder / "config.json").read_text())["num_hidden_layers"] == n
    # a checkpoint with weights: its config decides too (the old check skipped it)
    (folder / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="--layers 8"):
        cs.resolve_model(str(folder), None, 8)


def _bench_at_depth(tmp_path, out, *extra):
    env = {**os.environ, "CUDA_SERVING_BENCH_FAKE": "result", "PYTHONPATH": str(ROOT), "VHN": str(tmp_path)}
    cmd = [sys.executable, "-m", "benchmarks.cuda_serving", "--out", str(tmp_path / out), "--seed", "7",
           "--rows", "off", "--lengths", "2048", *extra]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_a_row_at_layers_n_serves_n_layers_and_pool_keeps_depths_apart(tmp_path, rng):
    """``--layers N`` without ``--model-dir``: the config in ``$VHN/q35moe-Nl`` has N layers, the
    unit records the depth its engine served (the stand-in worker reads the folder's config as
    vLLM does), the 8-layer folder is untouched; the 8-layer folder with ``--layers N`` is refused
    naming both flags; pool.py refuses to pool the two depths."""
    from benchmarks import pool

    n = _depth(rng)
    p = _bench_at_depth(tmp_path, "deep.json", "--layers", str(n), "--call", "1")
    assert p.returncode == 0, p.stdout + p.stderr
    deep = json.loads((tmp_path / "deep.json").read_text())
    assert deep["args"]["model_dir"] == str(tmp_path / f"q35moe-{n}l") and deep["args"]["layers"] == n
    assert deep["units"]["off@2048"]["engine"]["num_hidden_layers"] == n
    p = _bench_at_depth(tmp_path, "eight.json", "--call", "2")
    assert p.returncode == 0, p.stdout + p.stderr
    eight = json.loads((tmp_path / "eight.json").read_text())
    assert eight["units"]["off@2048"]["engine"]["num_hidden_layers"] == 8
    assert cs.model_config(tmp_path / f"q35moe-{n}l")["layers"] == n  # not overwritten
    p = _bench_at_depth(tmp_path, "bad.json", "--model-dir", str(tmp_path / "q35moe-8l"), "--layers", str(n))
    assert p.returncode == 2 and "--model-dir" in p.stderr and f"--layers {n}" in p.stderr, p.stderr
    assert not (tmp_path / "bad.json").exists()
    with pytest.raises(ValueError, match=f"{min(8, n)}, {max(8, n)} decoder layers"):
        pool.pool(pool.read_units([tmp_path / "deep.json", tmp_path / "eight.json"]))
    assert pool.pool(pool.read_units([tmp_path / "deep.json"]), min_calls=0)["layers"] == n


# ---------------------------------------------------------------- host events (issue 37, session M)


def test_host_events_count_collections_and_allocator_deltas(rng):
    """A span's garbage collections (each forced one counted, its pause timed by the clock) and
    the change of each allocator counter (a fake ``memory_stats`` whose counters move by drawn
    amounts between the span's two reads); no callback left behind."""
    import gc

    base = {k: rng.randrange(0, 1000) for k in cs.ALLOC_COUNTERS}
    moved = {k: rng.randrange(0, 50) for k in cs.ALLOC_COUNTERS}
    reads = iter([base, {k: base[k] + moved[k] for k in base}])
    ticks = iter(range(1000))
    n = rng.randrange(1, 4)
    callbacks = list(gc.callbacks)
    with cs.HostEvents(lambda: next(reads), clock=lambda: float(next(ticks)) / 1000) as ev:
        for _ in range(n):
            gc.collect()
    assert gc.callbacks == callbacks
    assert ev.result["gc_collections"] >= n  # a collection may also start on its own
    assert ev.result["gc_full_collections"] >= n  # gc.collect() walks the oldest generation
    assert ev.result["gc_pause_ms"] == pytest.approx(ev.result["gc_collections"] * 1.0)
    assert ev.result["gc_full_pause_ms"] == pytest.approx(ev.result["gc_full_collections"] * 1.0)
    assert {k: ev.result[k] for k in cs.ALLOC_COUNTERS} == moved
    without = cs.HostEvents(None)
    with without:
        pass
    assert set(without.result) == {"gc_collections", "gc_pause_ms", "gc_full_collections", "gc_full_pause_ms",
                                   "cpu_start", "cpu_end"}
    import os
    if hasattr(os, "sched_getaffinity"):  # Linux: the thread ran on a CPU it may run on
        assert {without.result["cpu_start"], without.result["cpu_end"]} <= set(os.sched_getaffinity(0))


def test_host_events_callback_removed_when_the_run_raises():
    import gc

    callbacks = list(gc.callbacks)
    with pytest.raises(RuntimeError), cs.HostEvents(None):
        raise RuntimeError("engine step failed")
    assert gc.callbacks == callbacks


def test_cold_samples_carry_each_runs_host_events(rng):
    class _EventDriver(_FakeDriver):
        def run(self, prompts, max_tokens, stagger_steps=0):
            recs = super().run(prompts, max_tokens, stagger_steps)
            for r in recs:
                r["host_events"] = {"gc_collections": len(self.calls)}
            return recs

    args = SimpleNamespace(answer_len=4, user_len=8, seed=rng.randrange(1 << 30), cold=3, sessions=0, clients=2,
                           step_profile=0, phases="cold,repeat,conc")
    res = cs._measure_length(args, _EventDriver(), 1200, 384, 5000, cuda=False, torch=None)
    cold = res["samples"]["cold"]["host_events"]
    assert [e["gc_collections"] for e in cold] == sorted({e["gc_collections"] for e in cold}) and len(cold) == 3
    assert res["samples"]["conc1"]["host_events"] is None


# ---------------------------------------------------------------- phase times per run (session O)


class _PhaseEngine:
    """An in-process ``LLMEngine`` stand-in for :class:`cs.Driver`: ``add_request`` and each
    engine step advance a fake clock by drawn costs (seconds): the scheduler's ``schedule``, the
    runner's ``execute_model`` (with ``prepare_attn`` inside it) and ``sample_tokens``, the output
    processor's ``process_outputs``; a request finishes after ``max_tokens`` steps."""

    def __init__(self, clock, costs):
        self.clock, self.costs = clock, costs
        runner = SimpleNamespace()
        runner.prepare_attn = lambda: self._spend("metadata_build")

        def execute_model():
            self._spend("execute_model")
            runner.prepare_attn()

        runner.execute_model = execute_model
        runner.sample_tokens = lambda: self._spend("sample")
        scheduler = SimpleNamespace(schedule=lambda: self._spend("schedule"))
        self.output_processor = SimpleNamespace(process_outputs=lambda: self._spend("output_processing"))

        def step_fn():
            scheduler.schedule()
            runner.execute_model()
            runner.sample_tokens()
            return None, True

        core = SimpleNamespace(step_fn=step_fn, scheduler=scheduler, model_executor=SimpleNamespace(
            driver_worker=SimpleNamespace(worker=SimpleNamespace(model_runner=runner))))
        self.engine_core = SimpleNamespace(engine_core=core)
        self.live: dict[str, list] = {}

    def _spend(self, phase):
        self.clock.t += self.costs[phase]

    def add_request(self, rid, prompt, sp):
        self._spend("add_request")
        self.live[rid] = [sp.max_tokens, 0, len(prompt["prompt_token_ids"])]

    def has_unfinished_requests(self):
        return bool(self.live)

    def step(self):
        self.engine_core.engine_core.step_fn()
        self.output_processor.process_outputs()
        outs = []
        for rid, st in list(self.live.items()):
            st[1] += 1
            done = st[1] >= st[0]
            outs.append(SimpleNamespace(request_id=rid, finished=done, num_cached_tokens=0,
                                        outputs=[SimpleNamespace(token_ids=list(range(st[1])))]))
            if done:
                del self.live[rid]
        return outs


def test_phase_times_give_each_cold_runs_own_phases(rng, monkeypatch):
    """``--phase-times`` (issue 37, session O): every timed cold, repeat and floor run carries its
    own host time per phase (own time: ``metadata_build`` out of ``execute_model``) and the wall
    of each engine step, on a fake clock with costs drawn per run; the timer is off again after
    the timed phases, and runs outside them carry none."""
    seed = rng.randrange(1 << 30)
    clock = _Clock(rng.uniform(0, 1e5))
    phases = ("add_request", "schedule", "execute_model", "metadata_build", "sample", "output_processing")
    engine = _PhaseEngine(clock, {p: 0.0 for p in phases})
    monkeypatch.setattr(cs.time, "perf_counter", clock)
    drv = cs.Driver(SimpleNamespace(llm_engine=engine))
    drawn = []
    real_run = cs.Driver.run

    def run(self, prompts, max_tokens, stagger_steps=0):
        costs = {p: rng.randrange(1, 10_000) / 1e6 for p in phases}  # whole us, per run
        engine.costs.update(costs)
        drawn.append((costs, max_tokens, self.phase_timer is not None))
        return real_run(self, prompts, max_tokens, stagger_steps)

    monkeypatch.setattr(cs.Driver, "run", run)
    args = SimpleNamespace(answer_len=3, user_len=8, seed=seed, cold=3, sessions=0, clients=2, step_profile=0,
                           phases="cold,repeat,floor,conc", phase_times=True)
    res = cs._measure_length(args, drv, 1200, 384, 5000, cuda=False, torch=None)
    timed = [d for d in drawn if d[2]]
    assert [d[2] for d in drawn[:len(drawn) - len(timed)]] == [False] * (len(drawn) - len(timed)), seed
    got = [pt for phase in ("cold", "repeat") for pt in res["samples"][phase]["phase_times"]]
    assert len(got) == 6 and res["samples"]["floor"]["phase_times"] == [], seed  # no hit: no floor prompt
    for (costs, n, _), pt in zip(timed, got):
        assert n == 1, seed
        for p in phases:
            assert pt["phase_ms"][p] == pytest.approx(1e3 * costs[p], abs=2e-3), (seed, p)
            assert pt["calls"][p] == 1, (seed, p)
        step = sum(costs[p] for p in phases if p != "add_request")
        assert pt["step_wall_ms"] == [pytest.approx(1e3 * step, abs=2e-3)], seed
        assert pt["host_probe_us"] == 0.0, seed  # the fake clock stands still in the probe
    assert "phase_times" not in res["samples"]["conc1"], seed
    assert drv.phase_timer is None and len(timed) == 8, seed  # 3 cold, 3 repeats, two concurrent runs


def test_numa_layout_and_thread_cpu_read_the_kernels_files(tmp_path, rng):
    """Placement (issue 37, session O): NUMA nodes' cpulists (ranges and singles, drawn) and the
    thread's last CPU, field 39 of its stat line, whose command name may hold spaces and ')'."""
    nodes, expect, nxt = {}, {}, 0
    for node in range(rng.randrange(1, 4)):
        parts, cpus = [], []
        for _ in range(rng.randrange(1, 4)):
            n = rng.randrange(1, 5)
            parts.append(f"{nxt}-{nxt + n - 1}" if n > 1 else str(nxt))
            cpus += range(nxt, nxt + n)
            nxt += n + rng.randrange(0, 3)
        d = tmp_path / f"sys/devices/system/node/node{node}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(",".join(parts) + "\n")
        expect[node] = cpus
    (tmp_path / "sys/devices/system/node/online").write_text("0\n")  # not a node folder
    assert cs.numa_layout(str(tmp_path))["nodes"] == expect
    assert cs.numa_layout(str(tmp_path / "none"))["nodes"] == {}
    cpu = rng.randrange(0, 512)
    rest = ["R"] + [str(rng.randrange(0, 1000)) for _ in range(49)]  # fields 3.. after the name
    rest[39 - 3] = str(cpu)
    (tmp_path / "proc/thread-self").mkdir(parents=True)
    (tmp_path / "proc/thread-self/stat").write_text("4242 (VLLM::E ngine) x) " + " ".join(rest) + "\n")
    assert cs.thread_cpu(str(tmp_path)) == cpu
    assert cs.thread_cpu(str(tmp_path / "none")) is None
    node = rng.randrange(0, 8)
    dev = tmp_path / "sys/bus/pci/devices/0000:9a:00.0"
    dev.mkdir(parents=True)
    (dev / "numa_node").write_text(f"{node}\n")
    assert cs.pci_numa_node("00000000:9A:00.0", str(tmp_path)) == node
    (dev / "numa_node").write_text("-1\n")
    assert cs.pci_numa_node("00000000:9A:00.0", str(tmp_path)) is None
    assert cs.pci_numa_node(None, str(tmp_path)) is None


def test_host_probe_is_the_fastest_repeat_of_its_loop(rng):
    """:func:`cs.host_probe_us`: each repeat's time is the clock's advance over its loop; the
    probe gives the smallest, in microseconds (drawn per repeat on a fake clock)."""
    durations = [rng.randrange(1, 10_000) / 1e6 for _ in range(rng.randrange(1, 6))]
    ticks, t = [], rng.uniform(0, 1e4)
    for d in durations:
        ticks += [t, t + d]
        t += d + rng.uniform(0, 1)
    it = iter(ticks)
    assert cs.host_probe_us(repeats=len(durations), iters=10, clock=lambda: next(it)) == \
        pytest.approx(1e6 * min(durations), abs=0.05)
    assert cs.host_probe_us(repeats=1, iters=2000) > 0  # the real clock moves
