"""The plugin on a real vLLM engine (CPU): vLLM's align-mode path with our copy launcher
(``VLLM_HYBRID_NPU_OPTIONS=copy=ours``; on CPU the registry keeps vLLM's CPU kernel by default)
against upstream unchanged (``VLLM_HYBRID_NPU_PATCHES=none``) and against prefix caching off, on tiny random Qwen3-Next /
Qwen3.5 checkpoints; the load line of a real ``vllm serve``.

Each patch mode runs in its own process (patches are process-global); inside it the engines of
the configurations run one after another (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so the runner is
inspectable). Workload: 4 concurrent prompts (one shorter than the block size, three longer,
two sharing a prefix), generated twice (the second round hits the prefix cache), chunked prefill
forced to 128 tokens (< the block size, so states cross steps inside a block), 6 greedy tokens.

Prompts are drawn fresh from the run's seed (printed on failure; ``VLLM_HYBRID_NPU_TEST_SEED``
replays it, see conftest.py). Comparisons of the *same schedule* (mode ``ours`` vs ``upstream``,
both with vLLM's own schedule) are exact: tokens, cached counts and logprobs. Comparisons across *different* schedules
(caching on vs off, a cache hit vs the computed round) are not bit-exact by
construction: vLLM 0.30.0's CPU GDN prefill kernel is bf16 only and a 128-token budget shared by
4 requests splits prompts off the 64-token grid, so the last bits differ and a greedy token at a
near-tie of the random-weight model can flip (measured: 9 of 40 requests diverge, every time at
a near-tie; docs/testing.md). Those use :func:`greedy_compare.compare_greedy` with
:data:`greedy_compare.CHUNKING_BOUND`, on the top 20 logprobs (the tiny model's distribution is
flat: a near-tied token can sit below the top 5).
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys

import pytest
from greedy_compare import CHUNKING_BOUND, Sequence, compare_greedy
from engines import COLLECTION_ENV  # e2e/engines.py

WORKLOAD = r"""
import gc, json, os, random, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from vllm import LLM, SamplingParams

MAX_LEN = 1024
results = {}
unit = None  # tokens: the align-mode block size of the first engine; sizes the prompts of all
for name, cfg in json.loads(sys.argv[1]).items():
    kw = {"mamba_cache_mode": "align"} if cfg["pc"] else {}
    os.environ["VLLM_HYBRID_NPU_PREFILL_CHECKPOINTS"] = cfg.get("exporter", "auto")
    base = dict(gpu_memory_utilization=0.05, enforce_eager=True, seed=0)
    base.update(json.loads(os.environ.get("VLLM_HYBRID_NPU_E2E_ENGINE_ARGS") or "{}"))  # target's
    llm = LLM(model=cfg["model"], enable_prefix_caching=cfg["pc"], kv_cache_memory_bytes=cfg["kv"],
              max_model_len=MAX_LEN, max_num_seqs=4, max_num_batched_tokens=cfg.get("mnbt", 128),
              disable_log_stats=False, **base, **kw)
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    bss = [g.kv_cache_spec.block_size for g in runner.kv_cache_config.kv_cache_groups]
    kinds = [type(g.kv_cache_spec).__name__ for g in runner.kv_cache_config.kv_cache_groups]
    unit = unit or bss[0]
    bs = unit
    rng = random.Random(cfg["seed"])
    long = [rng.randrange(10, 2000) for _ in range(2 * bs + 40)]
    prompts = [long[: bs // 3], long, long[: bs + 5] + [7] * 30,
               [rng.randrange(10, 2000) for _ in range(bs + bs // 2)]]
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=20)
    rounds, stale = [], []
    for _ in range(2):
        res = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        rounds.append([[list(r.outputs[0].token_ids), r.num_cached_tokens,
                        [[[t, lp.logprob] for t, lp in pos.items()] for pos in r.outputs[0].logprobs]]
                       for r in res])
        stale.append(sorted(set(runner.mamba_state_idx) - set(runner.requests)))
    # one more step after the last finish: finished requests leave runner.requests and must
    # leave the state-column map with them
    llm.generate([{"prompt_token_ids": prompts[0][:5]}], SamplingParams(max_tokens=1), use_tqdm=False)
    stale.append(sorted(set(runner.mamba_state_idx) - set(runner.requests)))
    pre = [m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions"]
    results[name] = {
        "bs": bs, "bss": bss, "kinds": kinds,
        "rounds": rounds, "stale": stale, "preemptions": pre[0] if pre else None,
        "lens": [len(p) for p in prompts],
    }
    llm.llm_engine.engine_core.shutdown()  # e2e/engines.py says why
    del llm, runner
    gc.collect()
from vllm.v1.worker import mamba_utils
from vllm_hybrid_npu.patches.registry import is_ours
results["_launcher_ours"] = is_ours(mamba_utils.batch_memcpy)
print("RESULT " + json.dumps(results))
"""

KV_NORMAL = 12_000_000  # bytes: ~60 blocks of 384 tokens (~90 of 256) for the tiny models; no preemption
KV_TINY = 2_400_000  # bytes: ~18 blocks: 4 concurrent requests preempt each other (exporter off there:
# its third state block per request would not fit a request of the model's max length)


#: ``ours``: the plugin with our copy launcher forced on CPU and vLLM's own schedule (the plugin
#: installs no scheduler, so both modes run the same schedule); ``upstream``: nothing patched.
MODES = {
    "ours": {"VLLM_HYBRID_NPU_OPTIONS": "copy=ours"},
    "upstream": {"VLLM_HYBRID_NPU_PATCHES": "none"},
}


def _run(mode: str, configs: dict) -> dict:
    drop = ("VLLM_PLUGINS", "VLLM_HYBRID_NPU_PATCHES", "VLLM_HYBRID_NPU_OPTIONS",
            "VLLM_HYBRID_NPU_CHECKPOINTS")
    env = {k: v for k, v in COLLECTION_ENV.items() if k not in drop}  # not what earlier engines set
    env.update(MODES[mode])
    env.update(json.loads(os.environ.get("VLLM_HYBRID_NPU_E2E_WORKER_ENV") or "{}"))  # target's
    proc = subprocess.run(
        [sys.executable, "-c", WORKLOAD, json.dumps(configs)],
        env=env, capture_output=True, text=True, timeout=900,
    )
    if proc.returncode != 0:
        err = "\n".join(
            l for l in proc.stderr.splitlines() if "leaked" not in l and "nanobind" not in l
        )
        raise AssertionError(f"workload ({mode}) failed:\n{err[-6000:]}")
    line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def _configs(model: str, seed: int, with_tiny: bool) -> dict:
    c = {"pc": {"model": model, "pc": True, "kv": KV_NORMAL, "seed": seed},
         # Reference: prefix caching off, prompts unchunked. (With caching off AND 128-token
         # chunks, vLLM 0.30.0 CPU's own GDN path gives a request batched with other requests'
         # chunks different greedy tokens than the same request alone; align mode does not.)
         "off": {"model": model, "pc": False, "kv": KV_NORMAL, "seed": seed, "mnbt": 2048}}
    if with_tiny:
        c["tiny"] = {"model": model, "pc": True, "kv": KV_TINY, "seed": seed, "exporter": "off"}
    return c


@pytest.fixture(scope="module")
def next_runs(tiny_model_dir, request, seed_for):
    model = str(tiny_model_dir("qwen3_next"))
    seed = seed_for(request, "prompts")
    ours = _run("ours", _configs(model, seed, with_tiny=True))
    upstream_cfg = _configs(model, seed, with_tiny=True)
    del upstream_cfg["off"]
    upstream = _run("upstream", upstream_cfg)
    return ours, upstream


def _tokens(run):
    return [[toks for toks, _, _ in rnd] for rnd in run["rounds"]]


def _cached(run):
    return [[c for _, c, _ in rnd] for rnd in run["rounds"]]


def _seqs(run, rnd):
    """Round ``rnd``'s requests as :class:`greedy_compare.Sequence` (tokens + top logprobs)."""
    return [Sequence.from_json([toks, lps]) for toks, _, lps in run["rounds"][rnd]]


def _assert_close(ref, got, what):
    c = compare_greedy(ref, got, bound=CHUNKING_BOUND)
    assert c.ok, f"{what}: {c.errors}; {c.summary()}"
    print(f"{what}: {c.summary()}")


def test_prompts_shorter_and_longer_than_the_block(next_runs):
    ours, _ = next_runs
    run = ours["pc"]
    assert run["lens"][0] < run["bs"] < min(run["lens"][1:])


def test_ours_equals_upstream_tokens_and_cached_counts(next_runs):
    ours, upstream = next_runs
    assert ours["_launcher_ours"] is True and upstream["_launcher_ours"] is False
    for name in ("pc", "tiny"):  # the same schedule: bit-exact, logprobs included
        assert _tokens(ours[name]) == _tokens(upstream[name]), name
        assert _cached(ours[name]) == _cached(upstream[name]), name
        assert ours[name]["rounds"] == upstream[name]["rounds"], f"{name}: logprobs differ"


#: Where vLLM's own align-mode path (``VLLM_HYBRID_NPU_PATCHES=none``) breaks the rule on a fresh
#: draw, ours must break it at exactly the same places and the test ends as an expected failure
#: naming the draw: an upstream divergence, not caused by the plugin (ours vs upstream is asserted
#: exact in ``test_ours_equals_upstream_tokens_and_cached_counts``). On the format-1 checkpoint
#: (top-2 of 4 experts) this happened in a few of 10 runs: MoE routing near-ties switched by the
#: chunkings' last bits (docs/testing.md, "MoE routing near-ties"); the checkpoint now routes to
#: all experts, where no such draw is known.
UPSTREAM_DIVERGENCE = ("vLLM 0.30.0 CPU's own align-mode path diverges on this draw (replay with "
                       "the session seed the summary prints; ours identical to it)")


def _close_or_upstream_divergence(ref_ours, got_ours, ref_up, got_up, what) -> str | None:
    """Assert ours within the bound, unless upstream's same comparison fails: then assert ours
    fails identically and return the divergence (str)."""
    up = compare_greedy(ref_up, got_up, bound=CHUNKING_BOUND)
    if up.ok:
        _assert_close(ref_ours, got_ours, what)
        return None
    mine = compare_greedy(ref_ours, got_ours, bound=CHUNKING_BOUND)
    assert mine.errors == up.errors, (
        f"{what}: ours diverges differently from upstream: {mine.errors} vs {up.errors}")
    return f"{what}: {up.errors}"


def test_cache_hits_reproduce_the_computed_outputs(next_runs):
    """Round 2 (prefix cache hits, states restored from copied block states) gives round 1's
    tokens (computed), in the same engine, up to bf16 near-ties: a wrong or missing state copy
    changes the distribution far beyond the bound."""
    ours, upstream = next_runs
    found = []
    for name in ("pc", "tiny"):
        d = _close_or_upstream_divergence(_seqs(ours[name], 0), _seqs(ours[name], 1),
                                          _seqs(upstream[name], 0), _seqs(upstream[name], 1),
                                          f"{name}: hit round vs computed round")
        if d:
            found.append(d)
    if found:
        pytest.xfail(UPSTREAM_DIVERGENCE + ": " + "; ".join(found))


def test_prefix_caching_on_equals_off(next_runs):
    """Caching on (align mode; ours and upstream's path), with and without preemption, ==
    caching off, up to bf16 near-ties (different chunkings). Upstream divergences: see
    :data:`UPSTREAM_DIVERGENCE`."""
    ours, upstream = next_runs
    found = []
    for name in ("pc", "tiny"):
        for rnd in (0, 1):
            off = _seqs(ours["off"], rnd)
            d = _close_or_upstream_divergence(off, _seqs(ours[name], rnd), off,
                                              _seqs(upstream[name], rnd),
                                              f"{name} round {rnd}: on vs off")
            if d:
                found.append(d)
    if found:
        pytest.xfail(UPSTREAM_DIVERGENCE + ": " + "; ".join(found))


def test_second_round_hits_the_cache_in_whole_blocks(next_runs):
    ours, _ = next_runs
    run = ours["pc"]
    bs = run["bs"]
    first, second = _cached(run)
    assert first[0] == first[1] == first[3] == 0  # nothing computed before them
    assert second[0] == 0  # shorter than one block: nothing cacheable
    for i in (1, 2, 3):
        assert second[i] > 0 and second[i] % bs == 0, (i, second)


def test_preemption_happened_and_resumed_correctly(next_runs):
    ours, upstream = next_runs
    assert ours["tiny"]["preemptions"] > 0
    assert upstream["tiny"]["preemptions"] > 0


def test_no_stale_state_columns(next_runs):
    ours, _ = next_runs
    for name in ("pc", "tiny"):
        assert ours[name]["stale"] == [[], [], []], name


def _qwen35_loadable() -> str | None:
    try:
        importlib.import_module("vllm.model_executor.models.qwen3_5")
    except Exception as exc:  # environment defect, not a feature gap
        return f"{type(exc).__name__}: {exc}"
    return None


def test_qwen3_5_ours_equals_caching_off(tiny_model_dir, seed):
    why = _qwen35_loadable()
    if why:
        pytest.skip(f"vLLM cannot import its Qwen3.5 model in this environment ({why})")
    model = str(tiny_model_dir("qwen3_5"))
    runs = _run("ours", _configs(model, seed, with_tiny=False))
    for rnd in (0, 1):
        _assert_close(_seqs(runs["off"], rnd), _seqs(runs["pc"], rnd), f"Qwen3.5 round {rnd}: on vs off")
    assert runs["pc"]["stale"] == [[], [], []]


def test_served_log_line(tiny_model_dir, serve_args):
    """``vllm serve --enable-prefix-caching --mamba-cache-mode align``: every process's load line
    lists what applied, and the configuration wrapper applied in the API-server process."""
    import requests

    from vllm_hybrid_npu.tools.server import PREFIX_CACHING_ARGS, VllmServer

    model = tiny_model_dir("qwen3_next")
    with VllmServer(model, [*PREFIX_CACHING_ARGS, *serve_args, "--max-num-batched-tokens", "256"]) as srv:
        prompt = [11 + (i * 7) % 1900 for i in range(1000)]  # > 2 blocks of 384 tokens
        for _ in range(2):
            r = requests.post(srv.base_url + "/v1/completions", json={
                "model": "model", "prompt": prompt, "max_tokens": 4, "temperature": 0}, timeout=300)
            r.raise_for_status()
        log = srv.log_text()
    lines = [l for l in log.splitlines() if "vllm-hybrid-npu" in l and " loaded: " in l]
    assert lines and all(" applied=[" in l and " failed=[]" in l for l in lines), lines
    assert any("config-checks" in l.split(" pending=")[0] for l in lines), lines
