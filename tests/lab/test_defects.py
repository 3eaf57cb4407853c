"""The lab defects of issue 20 item 3, one test each (each failed before its fix).

(1) the run's block size and infinite bound came from the last policy replayed; (2) with carried
answers the infinite bound was no upper bound; (3) ``--host-cache-gib`` reached vLLM as the total
over TP ranks; (4) ``free-states`` ignored the host tier; (5) the printed utilization was an input.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_hybrid_npu_lab.__main__ import main
from vllm_hybrid_npu_lab.model import build_setup
from vllm_hybrid_npu_lab.policies import get_policy, policy_unavailable, setup_kwargs
from vllm_hybrid_npu_lab.presets import resolve_model
from vllm_hybrid_npu_lab.replay import output_token, replay
from vllm_hybrid_npu_lab.trace import TraceRequest, answers, carried_prompts, infinite_bound_tokens

SHARED_TRACE = Path("/work/shared/data/mooncake_synthetic_trace.jsonl")
#: the retired ``lean`` row where this vLLM can replay it (vLLM 0.30; Policy.vllm)
_LEAN = [] if policy_unavailable("lean") else ["lean"]


@pytest.fixture(scope="module")
def cfg(tiny_model_dir):
    return resolve_model(str(tiny_model_dir))[1]


def _json(out: str) -> dict:
    return json.loads(out[out.index("\n{") + 1:] if not out.startswith("{") else out)


def _hitrate(capsys, *args) -> dict:
    assert main(["hitrate", *args, "--json", "--quiet"]) == 0
    return _json(capsys.readouterr().out)


def test_1_block_size_and_bound_do_not_depend_on_the_policy_order(tmp_path, tiny_model_dir,
                                                                    capsys, write_trace):
    trace = write_trace(tmp_path / "t.jsonl",
                        [(0, 1100, 4, [1, 2, 3]), (20_000, 1100, 4, [1, 2, 3]), (40_000, 1500, 4, [1, 2, 9])])
    common = ["--trace", str(trace), "--model", str(tiny_model_dir), "--kv-cache-gib", "0.05",
              "--tokens-per-s", "5000"]
    # the tiny hybrid's block: 16 tokens for vLLM, 64 with the exporter's grid
    a = _hitrate(capsys, *common, "--policy", "upstream", "upstream:ckpt")
    b = _hitrate(capsys, *common, "--policy", "upstream:ckpt", "upstream")
    assert a["policies"]["upstream"]["block_size"] != a["policies"]["upstream:ckpt"]["block_size"]
    assert a["block_size"] == b["block_size"] == a["policies"]["upstream"]["block_size"]
    assert a["infinite_bound"] == b["infinite_bound"]
    assert a["infinite"]["block_size"] == 16  # gcd of 16 and 64


# A's prompt (1,100 tokens) and answer (300 tokens: decode crosses 1,280); B carries both.
TURNS = [(0, 1100, 300, [1, 2, 3]), (20_000, 2000, 4, [1, 2, 7, 8])]


def test_2_infinite_bound_counts_carried_answers(tmp_path, cfg, tiny_model_dir, capsys, write_trace):
    reqs = [TraceRequest(float(ts), n, o, tuple(h)) for ts, n, o, h in TURNS]
    prompts, parents = carried_prompts(reqs, output_token)
    assert parents == [None, 0]
    pol = get_policy("upstream:ret=dense")
    setup = build_setup(cfg, kv_cache_bytes=64 << 20, block_size=256, max_model_len=2004,
                        **setup_kwargs(pol))
    res = replay(reqs, setup, pol.scheduler_class())
    assert res.cached_per_request == [0, 1280]  # the state decode kept at 1,280
    # prompts alone: 1,024 (the former bound, below the policy); with the answer: 1,280
    assert infinite_bound_tokens(prompts, 256)[0] == 1024
    assert infinite_bound_tokens(prompts, 256, answers(reqs, output_token))[0] == 1280
    trace = write_trace(tmp_path / "t.jsonl", TURNS)
    rep = _hitrate(capsys, "--trace", str(trace), "--model", str(tiny_model_dir), "--block-size",
                   "256", "--kv-cache-gib", "0.05", "--policy", "upstream:ret=dense", *_LEAN)
    assert all(rep["infinite_bound"] >= r["token_hit_rate"] for r in rep["policies"].values())


@pytest.mark.skipif(not SHARED_TRACE.is_file(), reason="the shared synthetic trace is not here")
def test_2_infinite_bound_is_above_every_policy_on_the_shared_trace(capsys, rng):
    # a random window of the shared trace, answers carried: the bound is above every row
    # (finer prefix-match units and the exporter's block included)
    limit = rng.randrange(30, 60)
    rep = _hitrate(capsys, "--trace", str(SHARED_TRACE), "--limit", str(limit), "--kv-cache-gib",
                   "64", "--policy", "upstream", "upstream:ret=dense", "upstream:ckpt",
                   "upstream:ret=dense,lpt=1b,pmu=32", "upstream:ret=1b,pmu=64,ckpt", *_LEAN)
    assert rep["carry_outputs"]
    for name, r in rep["policies"].items():
        assert r["token_hit_rate"] <= rep["infinite_bound"], (name, limit)
    assert rep["infinite"]["block_size"] == 32


def test_3_host_tier_is_per_worker_at_any_tp(cfg):
    # --host-cache-gib N per worker: vLLM's kv_offloading_size is the total over the TP ranks
    for tp in (1, 2):
        setup = build_setup(cfg, tp=tp, kv_cache_bytes=64 << 20, host_cache_bytes=1 << 30,
                            block_size=256, max_model_len=4096)
        assert setup.vllm_config.cache_config.kv_offloading_size == tp
        extra = setup.vllm_config.kv_transfer_config.kv_connector_extra_config
        assert extra["cpu_bytes_to_use"] == tp * (1 << 30)


def test_4_free_states_refuses_a_host_tier(cfg):
    pol = get_policy("free-states")
    reqs = [TraceRequest(0.0, 600, 2, (1, 2))]
    setup = build_setup(cfg, kv_cache_bytes=64 << 20, host_cache_bytes=16 << 20, block_size=256,
                        max_model_len=602)
    with pytest.raises(ValueError, match="--host-cache-gib"):
        replay(reqs, setup, pol.scheduler_class())


def test_5_utilization_is_measured(tmp_path, tiny_model_dir, capsys, write_trace):
    trace = write_trace(tmp_path / "t.jsonl", [(0, 1100, 40, [1, 2, 3]), (2_000, 1100, 40, [1, 2, 4])])
    common = ["--trace", str(trace), "--model", str(tiny_model_dir), "--kv-cache-gib", "0.05"]
    rep = _hitrate(capsys, *common)
    up = rep["policies"]["upstream"]
    assert rep["offered_load"] == pytest.approx(0.5)  # the input
    assert rep["utilization"] == up["busy_fraction"] != pytest.approx(0.5)
    assert main(["hitrate", *common, "--quiet"]) == 0
    text = capsys.readouterr().out
    assert f"utilization {up['busy_fraction']:.2f}" in text and "offered load 0.50, an input" in text
