"""``vllm-hybrid-npu-lab advise``, the exporter replay (``upstream:ckpt``) and the search behind
``upstream-best``, on the tiny hybrid (3 GDN + 1 attention layer)."""

from __future__ import annotations

import collections
import dataclasses
import itertools
import json

import pytest

from vllm_hybrid_npu_lab.__main__ import main
from vllm_hybrid_npu_lab.advise import AXES, Candidate, axis_values, search, serve_flags
from vllm_hybrid_npu_lab.model import build_setup
from vllm_hybrid_npu_lab.policies import get_policy, setup_kwargs
from vllm_hybrid_npu_lab.presets import resolve_model
from vllm_hybrid_npu_lab.replay import replay
from vllm_hybrid_npu_lab.trace import TraceRequest
from vllm_hybrid_npu_lab.upstream_grid import UpstreamSetting, final_available, parse_setting, policy_of
from vllm_hybrid_npu import envs
from vllm_hybrid_npu.envs import OPTIONS_ENV


@pytest.fixture(scope="module")
def cfg(tiny_model_dir):
    return resolve_model(str(tiny_model_dir))[1]


def _json(out: str) -> dict:
    # vLLM may have logged to stdout before the CLI sent its logs to stderr
    return json.loads(out[out.index("\n{") + 1:] if not out.startswith("{") else out)


def _reqs(rows):
    return [TraceRequest(10_000.0 * i, n, out, tuple(h)) for i, (n, out, h) in enumerate(rows)]


def _run(cfg, reqs, policy, block_size=None):
    pol = get_policy(policy)
    setup = build_setup(cfg, kv_cache_bytes=64 << 20, block_size=block_size,
                        max_model_len=max(r.input_length + r.output_length for r in reqs),
                        **setup_kwargs(pol))
    return setup, replay(reqs, setup, pol.scheduler_class())


# A cold 1,100-token prompt, its exact repeat, then a prompt sharing A's first 1,024 tokens.
REPEAT = [(1100, 4, [1, 2, 3]), (1100, 4, [1, 2, 3]), (1500, 4, [1, 2, 9])]


def test_exporter_replay_declares_the_checkpoint_and_keeps_it(cfg, monkeypatch):
    setup, ckpt = _run(cfg, _reqs(REPEAT), "upstream:ckpt", block_size=200)
    # the block is rounded up to the runtime's 64-token grid; the spec declares one block
    assert setup.block_size == 256 and setup.prefill_checkpoints
    mamba = [g.kv_cache_spec for g in setup.kv_cache_config.kv_cache_groups
             if type(g.kv_cache_spec).__name__ == "MambaSpec"]
    assert mamba and all(s.num_prefill_checkpoint_blocks == 1
                         and s.prefill_checkpoint_alignment == 64 for s in mamba)
    _, split = _run(cfg, _reqs(REPEAT), "upstream", block_size=256)
    # vLLM's split costs the cold prompts one step each; the exporter's hits are the same
    assert ckpt.cached_per_request == split.cached_per_request == [0, 1024, 1024]
    assert ckpt.steps < split.steps
    assert ckpt.extra_prefill_steps_per_prompt < split.extra_prefill_steps_per_prompt
    # without the runtime's retention entry (vLLM 0.30) the repeat of the cold prompt misses
    import vllm_hybrid_npu_lab.exporter as exporter

    if exporter.retention_entry() is not None:
        monkeypatch.setattr(exporter, "apply_retention_fix", lambda sched, chunk="all": 0)
        _, nofix = _run(cfg, _reqs(REPEAT), "upstream:ckpt", block_size=256)
        assert nofix.cached_per_request[1] == 0


def test_exporter_takes_the_runtime_registry_entry():
    from vllm_hybrid_npu.patches.gdn_mamba_manager import PATCHES

    from vllm_hybrid_npu_lab.exporter import RETENTION_ENTRY, retention_entry

    entry = next(p for p in PATCHES if p.name == RETENTION_ENTRY)
    got = retention_entry()
    assert got is None or got is entry


def test_runtime_never_imports_the_lab():
    import pathlib
    import re

    import vllm_hybrid_npu

    root = pathlib.Path(vllm_hybrid_npu.__file__).parent
    imp = re.compile(r"^\s*(from|import)\s+vllm_hybrid_npu_lab\b", re.M)
    offenders = [str(p) for p in root.rglob("*.py") if imp.search(p.read_text())]
    assert offenders == []


def test_setting_names_parse_back():
    for ret, lpt, pmu, ckpt in itertools.product((0, None, 2), (0, 1), (None, 64),
                                                 (False, True, "final")):
        s = UpstreamSetting(ret, lpt, pmu, ckpt)
        assert parse_setting(s.name) == s
        if ckpt == "final" and not final_available():  # the runtime's option: vLLM 0.30 only
            with pytest.raises(ValueError, match="--policy .*VLLM_HYBRID_NPU_OPTIONS=ckpt=final"):
                get_policy(s.name)
            continue
        assert get_policy(s.name).prefill_checkpoints == bool(ckpt)
    assert UpstreamSetting(2, ckpt="final").name == "upstream:ret=2b,ckpt=final"
    with pytest.raises(ValueError, match="--policy"):
        parse_setting("upstream:ret=2b,ckpt=drop")
    for bad in ("upstream:", "upstream:ret=x", "upstream:foo", "upstream:pmu=0", "lean:ret=1b"):
        with pytest.raises(ValueError, match="--policy"):
            parse_setting(bad)
    with pytest.raises(ValueError, match="write it as 'upstream:ret=1b,ckpt'"):
        parse_setting("upstream:ckpt,ret=1b")


def test_serve_flags_are_vllms_units():
    c = Candidate(UpstreamSetting(ret=None, lpt=2, pmu=64, ckpt=True), host_gib=128)
    flags, env = serve_flags(c, block_size=1088, kv_cache_gib=16, tp=2)
    line = " ".join(flags)
    assert "--prefix-cache-retention-interval None" in line
    assert "--long-prefill-token-threshold 2176" in line and "--prefix-match-unit 64" in line
    # vLLM's --kv-offloading-size is the total over TP ranks; --kv-cache-memory-bytes per worker
    assert "--kv-offloading-size 256" in line and f"--kv-cache-memory-bytes {16 << 30}" in line
    assert "--tensor-parallel-size 2" in line and env == ["VLLM_HYBRID_NPU_PREFILL_CHECKPOINTS=auto"]
    flags, env = serve_flags(Candidate(), 1056, 16, 1)
    assert "--prefix-cache-retention-interval" not in flags and env[0].endswith("=off")
    _, env = serve_flags(Candidate(UpstreamSetting(ret=2, ckpt="final")), 1088, 16, 1)
    assert env == ["VLLM_HYBRID_NPU_PREFILL_CHECKPOINTS=auto", "VLLM_HYBRID_NPU_OPTIONS=ckpt=final"]


def test_final_scan_sits_beside_the_exporters_best_and_is_bounded():
    # ckpt=final gains only at a smaller interval than the exporter's best (2 blocks against
    # 4), one axis away from it each: the descent alone never reaches it; the scan replays
    # final at 1, 2, 4, 8 blocks beside the exporter's best, nothing else
    def evaluate(c: Candidate):
        s = c.setting
        if s.ckpt == "final":
            return {"token_hit_rate": {1: 0.30, 2: 0.45, 4: 0.20, 8: 0.10}.get(s.ret, 0.0)}
        base = {0: 0.1, None: 0.05, 1: 0.25, 2: 0.3, 4: 0.4, 8: 0.35}.get(s.ret, 0.0)
        return {"token_hit_rate": base + (0.01 if s.ckpt else 0.0) - 0.01 * (s.lpt + (s.pmu or 0) / 64)}

    plain = search(evaluate, Candidate(), 0.0)
    assert (plain.best.setting.ret, plain.best.setting.ckpt) == (4, True)
    assert not any(c.setting.ckpt == "final" for c in plain.evaluated)
    res = search(evaluate, Candidate(), 0.0, final=True)
    assert res.best.setting == UpstreamSetting(ret=2, ckpt="final")
    added = [c for c in res.evaluated if c not in plain.evaluated]
    assert sorted(c.setting.ret for c in added) == [1, 2, 4, 8]
    assert all(c.setting == UpstreamSetting(ret=c.setting.ret, ckpt="final") for c in added)
    assert res.cost()["final"] == 4
    # no exporter: no scan
    assert not any(c.setting.ckpt for c in search(evaluate, Candidate(), 0.0, exporter=False,
                                                  final=True).evaluated)


def test_optin_scan_sits_beside_the_best_sub_block_exporter_and_never_counts_as_vllms(rng):
    # the runtime's opt-ins (tailsplit=off; where the seed has a host tier also tails=off and
    # both) act only with a prefix-match unit below the block, tails=off only with a host tier;
    # the descent never varies them. The scan replays them beside the exporter setting with a pmu
    # and the most hits (whatever its steps), nothing else; the advice takes the best of them
    # where they win (their lifts drawn fresh, in any order); vLLM's split at its best never does
    # (a tails=off setting without the exporter scoring highest of all, handed in, stays out)
    from vllm_hybrid_npu_lab.advise import StepBound, choose

    # every opt-in lifts the pmu setting (0.05 under the block's unit as installed) above it
    lift = {k: rng.uniform(0.06, 0.2) for k in ((True, False), (False, True), (False, False))}
    lift[(True, True)] = 0.0

    second = rng.uniform(-0.05, 0.1)  # second=on's lift, either sign

    def evaluate(c: Candidate):
        s = c.setting
        hits = 0.3 + (0.02 if s.ckpt else 0.0) + 0.01 * c.host_gib / 8 - 0.01 * s.lpt
        if s.pmu:
            tails = s.tails or not c.host_gib  # tails=off does nothing without a host tier
            hits += lift[(tails, s.tail_split)] - 0.05 + (second if s.second else 0.0)
        return {"token_hit_rate": hits, "prefill_steps_per_prompt": 1.0,
                "extra_prefill_steps_per_prompt": 0.0}

    bound = StepBound(0.0, 0.05)
    plain = search(evaluate, Candidate(), 8.0, bound=bound)
    assert not any(c.setting.optin for c in plain.evaluated)
    res = search(evaluate, Candidate(), 8.0, bound=bound, optins=True)
    added = [c for c in res.evaluated if c not in plain.evaluated]
    assert len(added) == 3 == res.cost()["optins"] and all(c.setting.optin for c in added)
    exp = [c for c in plain.evaluated if c.setting.ckpt and c.setting.pmu]
    seed = max(exp, key=lambda c: plain.evaluated[c]["token_hit_rate"])
    assert seed.host_gib == 8.0  # the host tier adds hits here: the most hits has it
    want = {seed.with_("tail_split", False), seed.with_("tails", False),
            seed.with_("tails", False).with_("tail_split", False)}
    assert set(added) == want, (added, seed)
    top = max(added, key=lambda c: lift[(c.setting.tails, c.setting.tail_split)])
    assert choose(res) == top, (lift, choose(res))
    trap = Candidate(UpstreamSetting(pmu=32, tails=False))
    merged = res.merged({trap: {"token_hit_rate": 0.99, "prefill_steps_per_prompt": 1.0,
                                "extra_prefill_steps_per_prompt": 0.0}})
    assert merged.best_split() is not None and not merged.best_split().setting.optin
    # with second=on (the CUDA target): each of the three again with it, and the seed with it
    # alone; the advice the best of the seven
    both = search(evaluate, Candidate(), 8.0, bound=bound, optins=True, second=True)
    added2 = [c for c in both.evaluated if c not in plain.evaluated]
    assert set(added2) == want | {c.with_("second", True) for c in want | {seed}}, added2
    assert choose(both) == max(added2, key=lambda c: both.evaluated[c]["token_hit_rate"])
    # without a host tier only tailsplit=off; without the exporter nothing
    nohost = search(evaluate, Candidate(), 0.0, bound=bound, optins=True)
    assert nohost.cost()["optins"] == 1
    assert search(evaluate, Candidate(), 8.0, bound=bound, exporter=False, optins=True).cost()["optins"] == 0


def test_optin_settings_parse_back_and_name_their_env(monkeypatch):
    s = UpstreamSetting(ret=1, pmu=64, ckpt="final", tails=False, tail_split=False, second=True)
    assert s.name == "upstream:ret=1b,pmu=64,ckpt=final,tails=off,tailsplit=off,second=on"
    assert parse_setting(s.name) == s
    with pytest.raises(ValueError, match="--policy"):
        parse_setting("upstream:pmu=64,ckpt,tailsplit=on")
    with pytest.raises(ValueError, match="--policy"):
        parse_setting("upstream:pmu=64,ckpt,second=off")
    _, env = serve_flags(Candidate(s, host_gib=256), 1088, 16, 1)
    assert env[-1] == "VLLM_HYBRID_NPU_OPTIONS=ckpt=final,tails=off,tailsplit=off,second=on"
    # the runtime reads that line as the lab's keys and values (one vocabulary)
    monkeypatch.setenv(*env[-1].split("=", 1))
    assert envs.options() == {"ckpt": "final", "tails": "off", "tailsplit": "off", "second": "on"}
    # a replay of CUDA with vLLM's stops (junctions=off in the lab's environment) advises them too
    monkeypatch.setenv(OPTIONS_ENV, "junctions=off")
    _, env = serve_flags(Candidate(s, host_gib=256), 1088, 16, 1)
    assert env[-1].endswith(",second=on,junctions=off"), env


def test_search_is_a_local_optimum_on_every_axis(rng):
    # a random objective with interactions; the search must end where no single option change
    # helps, evaluate every candidate once, and never end below where it started
    weights = {(axis, v): rng.random() for axis in AXES for v in axis_values(axis, 8.0)}
    pair = {(a, b): rng.random() for a in axis_values("ret", 8.0) for b in axis_values("lpt", 8.0)}
    # values past the ranges (the open-ended axes' extensions) score low
    weights = collections.defaultdict(float, weights)
    pair = collections.defaultdict(float, pair)
    calls: list[Candidate] = []

    def evaluate(c: Candidate):
        calls.append(c)
        if c.setting.pmu == 32 and rng.random() < 0:  # never: keeps the draw count fixed
            return None
        score = sum(weights[(a, c.get(a))] for a in AXES) + pair[(c.setting.ret, c.setting.lpt)]
        return {"token_hit_rate": score}

    start = Candidate(UpstreamSetting(), 8.0)
    res = search(evaluate, start, 8.0, max_passes=10)
    assert len(calls) == len(set(calls))
    best = res.result(res.best)["token_hit_rate"]
    assert best >= res.result(start)["token_hit_rate"]
    for axis in AXES:
        for v in axis_values(axis, 8.0):
            r = evaluate(res.best.with_(axis, v))
            assert r["token_hit_rate"] <= best + 1e-12, (axis, v)


def test_search_extends_an_open_ended_axis_while_its_largest_value_wins():
    # hit rate rising with the retention interval up to 32 blocks, then falling
    def evaluate(c: Candidate):
        r = c.setting.ret
        return {"token_hit_rate": -1.0 if r is None else -abs(r - 32) / 100}

    res = search(evaluate, Candidate(), 0.0, axes=("ret",))
    assert res.best.setting.ret == 32
    joint = search(evaluate, Candidate(), 0.0, axes=("ret+lpt",))
    assert joint.best.setting.ret == 32 and Candidate(UpstreamSetting(ret=64)) in joint.evaluated
    assert Candidate(UpstreamSetting(ret=64)) in res.evaluated
    assert Candidate(UpstreamSetting(ret=128)) not in res.evaluated


def test_search_finds_a_joint_optimum_one_axis_at_a_time_misses():
    # retention alone helps a little; a long-prefill threshold helps only with retention on
    def evaluate(c: Candidate):
        s = c.setting
        gain = 0.2 if s.ret == 2 else (0.1 if s.ret == 8 else 0.0)
        if s.ret == 8 and s.lpt == 1:
            gain = 0.5
        return {"token_hit_rate": gain}

    assert search(evaluate, Candidate(), 0.0, axes=("ret", "lpt")).best.setting.ret == 2
    best = search(evaluate, Candidate(), 0.0).best.setting
    assert (best.ret, best.lpt) == (8, 1)


def test_search_keeps_defaults_on_ties_and_skips_invalid():
    def evaluate(c: Candidate):
        if c.setting.pmu == 64:
            return None  # e.g. a prefix-match unit that does not divide the block
        return {"token_hit_rate": 0.5}

    res = search(evaluate, Candidate(), 0.0)
    assert res.best == Candidate() and res.passes == 1
    assert res.evaluated[Candidate(UpstreamSetting(pmu=64))] is None


def test_advise_json_and_its_policy_replays_the_same(tmp_path, tiny_model_dir, capsys, write_trace):
    rows = [(10_000 * i, 1100 + 40 * (i % 3), 4, [1, 2, 3 + i % 3]) for i in range(8)]
    trace = write_trace(tmp_path / "t.jsonl", rows)
    args = ["advise", "--trace", str(trace), "--model", str(tiny_model_dir), "--kv-cache-gib",
            "0.05", "--json", "--quiet", "--tokens-per-s", "5000", "--max-passes", "1"]
    assert main(args) == 0
    rep = _json(capsys.readouterr().out)
    for key in ("flags", "policy", "token_hit_rate", "upstream_default", "attention_bound",
                "infinite_bound", "extra_prefill_steps_per_prompt", "env"):
        assert key in rep
    assert all(isinstance(f, str) for f in rep["flags"])
    assert rep["fit"]["requests"] == [1, 4] and rep["check"]["requests"] == [5, 8]
    assert rep["infinite_bound"] >= max(rep["token_hit_rate"], rep["upstream_default"],
                                        rep["attention_bound"])
    # caching off on the check part, the requests 10 s apart (each alone): no extra step, so
    # every row's extra steps are beyond it; the reasons sum to each row's extra steps
    assert rep["caching_off"]["extra_prefill_steps_per_prompt"] == 0
    for name in ("advised", "default", "attention", "caching_off"):
        r = rep[name]
        assert r["extra_prefill_steps_beyond_off"] == r["extra_prefill_steps_per_prompt"]
        assert sum(r["extra_prefill_steps_by_reason"].values()) == pytest.approx(
            r["extra_prefill_steps_per_prompt"])
    assert rep["check"]["replays"] == rep["search_cost"]["check_replays"]
    # the check part replayed with hitrate --policy <policy> gives the advised numbers
    check = write_trace(tmp_path / "check.jsonl", rows[4:])
    assert main(["hitrate", "--trace", str(check), "--model", str(tiny_model_dir),
                 "--kv-cache-gib", "0.05", "--json", "--quiet", "--tokens-per-s", "5000",
                 "--policy", rep["policy"], "upstream"]) == 0
    hit = _json(capsys.readouterr().out)
    assert hit["policies"][rep["policy"]]["token_hit_rate"] == rep["token_hit_rate"]
    assert hit["policies"]["upstream"]["token_hit_rate"] == rep["upstream_default"]
    assert main(args[:-4] + ["--fit-fraction", "1"]) == 2
    assert "--fit-fraction" in capsys.readouterr().err


def test_upstream_best_is_the_advisors_search(tmp_path, tiny_model_dir, capsys, write_trace):
    from vllm_hybrid_npu_lab.advise import Replayer
    from vllm_hybrid_npu_lab.trace import read_trace

    rows = [(10_000 * i, 1100, 4, [1, 2, 3]) for i in range(3)]
    trace = write_trace(tmp_path / "t.jsonl", rows)
    assert main(["hitrate", "--trace", str(trace), "--model", str(tiny_model_dir), "--kv-cache-gib",
                 "0.05", "--json", "--quiet", "--tokens-per-s", "5000", "--policy",
                 "upstream-best"]) == 0
    rep = _json(capsys.readouterr().out)
    best = rep["policies"]["upstream-best"]
    # the search goes beyond the former 11-setting grid: the exporter, 1- and 2-block retention
    from vllm_hybrid_npu_lab.upstream_grid import grid_names

    assert {"upstream:ckpt", "upstream:ret=1b", "upstream:ret=2b"} <= set(best["search"])
    assert not set(best["search"]) <= set(grid_names())
    assert best["token_hit_rate"] == max(best["search"].values())
    # the same search run directly gives the same winner
    cfg = resolve_model(str(tiny_model_dir))[1]
    reqs = read_trace(trace)
    rep_ = Replayer(reqs, cfg, kv_cache_gib=0.05, tp=1, quiet=True,
                    common=dict(max_model_len=1104, kernel_block_size=16),
                    timing=dict(tokens_per_s=5000.0))
    res = search(rep_, Candidate(), 0.0, axes=("ckpt", "ret", "lpt", "pmu"))
    assert res.best.policy == best["setting"]


def test_audit_searches_the_check_part_and_reports_the_share(tmp_path, tiny_model_dir, capsys,
                                                             write_trace, rng):
    """``--audit``: the fit part is all distinct prompts (no setting hits there, the advice is
    the fewest prefill steps); the check part has prompts that hit: a 4-block prompt, one sharing
    only its first two 512-token blocks, then its exact repeat. The audit's best must follow the
    advice's rule on the check part (the most hits among the settings meeting the step bound
    there, else the fewest extra steps beyond caching off's), the unconstrained best must be the
    most hits of all, its shares must be those rates' ratios, and its best setting replayed with
    ``hitrate --policy`` must give the rate it reports."""
    ids = iter(rng.sample(range(1000, 100_000), 200))
    rows, t = [], 0
    for _ in range(4):  # fit: distinct prompts
        rows.append((t, 2000, 4, [next(ids) for _ in range(4)]))
        t += 10_000
    for _ in range(3):  # check
        a = [next(ids) for _ in range(4)]
        rows.append((t, 2000, 4, a))
        rows.append((t + 10_000, 1800, 4, a[:2] + [next(ids), next(ids)]))
        rows.append((t + 20_000, 2000, 4, a))
        t += 30_000
    trace = write_trace(tmp_path / "t.jsonl", rows)
    common = ["--model", str(tiny_model_dir), "--kv-cache-gib", "0.05", "--json", "--quiet",
              "--tokens-per-s", "5000"]
    assert main(["advise", "--trace", str(trace), "--fit-fraction", str(4 / len(rows)),
                 "--max-passes", "2", "--starts", "2", "--audit", *common]) == 0
    rep = _json(capsys.readouterr().out)
    au = rep["audit"]
    # nothing hits on the fit part: every eligible setting ties in hits, the advice is the
    # fewest prefill steps per prompt among them (no threshold: no extra step on the fit part)
    assert rep["fit"]["token_hit_rate"] == 0.0
    assert rep["step_bound"]["advised_eligible"] and rep["fit"]["advised"]["eligible"]
    assert rep["fit"]["prefill_steps_per_prompt"] == min(
        r["prefill_steps_per_prompt"] for r in rep["fit"]["searched"] if r["eligible"])
    best = au["best_token_hit_rate"]
    assert best > 0.0, au  # something hits on the check part
    limit = au["step_bound"]["limit"]
    assert limit == pytest.approx(rep["caching_off"]["extra_prefill_steps_per_prompt"] + 0.05)
    searched = au["searched"]
    assert searched and all(r["eligible"] is (r["extra_prefill_steps_per_prompt"] <= limit + 1e-9)
                            for r in searched)
    # the best is the advice's rule on the check part: the most hits among the settings within
    # the bound; where none is (each part's second prompt stops at its shared-prefix junction,
    # which costs steps in align mode whatever the setting), the fewest extra steps beyond off
    ok = [r for r in searched if r["eligible"]]
    assert au["best_meets_step_bound"] is bool(ok) and au["eligible_settings"] == len(ok)
    if ok:
        assert best == max(r["token_hit_rate"] for r in ok)
    else:
        assert au["best_extra_prefill_steps_beyond_off"] == min(
            r["extra_prefill_steps_beyond_off"] for r in searched)
    assert au["advised_meets_step_bound"] is rep["advised"]["meets_step_bound"]
    ub = au["unconstrained_best"]
    assert ub["token_hit_rate"] == max(r["token_hit_rate"] for r in searched) >= best
    assert au["advised_over_best"] == pytest.approx(rep["token_hit_rate"] / best)
    assert au["default_over_best"] == pytest.approx(rep["upstream_default"] / best)
    assert au["advised_over_unconstrained_best"] == pytest.approx(
        rep["token_hit_rate"] / ub["token_hit_rate"])
    assert au["met"] is (au["advised_over_best"] >= au["target"])
    # the check part's advised and default replays are not replayed again by the audit
    assert 0 < au["new_replays"] < au["replays"] == au["search"]["replays"]
    assert rep["search_cost"]["audit_replays"] == au["new_replays"]
    check = write_trace(tmp_path / "check.jsonl", rows[4:])
    assert main(["hitrate", "--trace", str(check), "--policy", au["best_policy"], *common]) == 0
    hit = _json(capsys.readouterr().out)
    assert hit["policies"][au["best_policy"]]["token_hit_rate"] == best


# --------------------------------------------------------------------------------- issue 33
def _memo(evaluate):
    """``evaluate`` with its replays kept (two searches over one trace share them)."""
    seen: dict = {}

    def run(c: Candidate):
        if c not in seen:
            seen[c] = evaluate(c)
        return seen[c]

    return run


def test_grid_finds_the_pair_one_axis_at_a_time_misses(cfg, rng):
    """Exporter x prefix-match unit with a host tier, replayed (issue 33).

    The tiny hybrid at kernel block 96: vLLM's block is 96 tokens, the exporter's 128 (its
    64-token grid). ``n1`` prompts of ``x + 1`` tokens with ``x`` in [512, 542], one of ``y + 1``
    tokens with ``y`` in [576, 606], three 3,000-token fillers that flush the device, then the same
    prompts again: every hit comes from the 1/16 GiB host tier. By hand (hits of the repeats):

    * vLLM's defaults: the last block boundary, 480 and 576;
    * the exporter (block 128): its checkpoint at 512 for both: 512 (n1 + 1), more than the
      defaults when n1 >= 3;
    * ``--prefix-match-unit 32`` without the exporter: vLLM's split stops at the last block
      boundary and the last 32-token boundary (480 + 512, 576), both states reach the host and
      its connector finds the partial tail one block past the full block: 512 and 576;
    * ``--prefix-match-unit 32`` with the exporter: one checkpoint at the last 32-token boundary:
      512 is a block boundary (a full-block hit), 576 is not and the host holds no GDN state at
      512 beneath it, so the connector cannot reach it: 512 and 0.

    One axis at a time from the defaults takes the exporter (more hits), then finds every unit
    worse with it: it ends below the grid's pick, ``--prefix-match-unit 32`` without the exporter.
    """
    import vllm

    from vllm_hybrid_npu_lab.advise import Replayer

    if vllm.__version__.startswith("0.34."):
        pytest.skip("vLLM 0.34's connector anchors its partial-tail search at the full-attention "
                    "prefix (_lookup_partial_tail_hit): the exporter's off-block checkpoint is in "
                    "its reach, so this premise (issue 33) does not hold there; the exporter is "
                    "outside 0.34's support-matrix row")
    n1 = rng.choice([3, 4, 5])
    ids = iter(rng.sample(range(100, 100_000), 40))
    prompts = [(rng.randint(513, 543), [next(ids), next(ids)]) for _ in range(n1)]
    prompts.append((rng.randint(577, 607), [next(ids), next(ids)]))
    rows = [(n, rng.randint(1, 8), h) for n, h in prompts]  # answers cross no block boundary
    rows += [(3000, 4, [next(ids) for _ in range(6)]) for _ in range(3)]
    rows += [(n, rng.randint(1, 8), h) for n, h in prompts]
    reqs = _reqs(rows)
    host = 1 / 16
    replayer = Replayer(reqs, cfg, kv_cache_gib=48 * 128 * 256 / 2**30, tp=1, quiet=True,
                        common=dict(max_model_len=3010, kernel_block_size=96),
                        timing=dict(tokens_per_s=5000.0))
    evaluate = _memo(replayer)
    start = Candidate(UpstreamSetting(), host)

    def hits(**kw):
        return evaluate(Candidate(UpstreamSetting(**kw), host))["cached_prompt_tokens"]

    assert hits() == 480 * n1 + 576
    assert hits(ckpt=True) == 512 * (n1 + 1)
    assert hits(pmu=32) == 512 * n1 + 576
    assert hits(pmu=32, ckpt=True) == 512 * n1
    one_at_a_time = search(evaluate, start, host, grid_axes=())  # the search before issue 33
    assert one_at_a_time.best == Candidate(UpstreamSetting(ckpt=True), host)
    # one start keeps the test short; the grid alone finds the pair
    grid = search(evaluate, start, host, starts=1)
    assert grid.best == Candidate(UpstreamSetting(pmu=32), host)
    assert grid.result(grid.best)["cached_prompt_tokens"] == 512 * n1 + 576
    assert len(grid.grid) == 18 and grid.cost()["grid_axes"] == ["ckpt", "pmu", "host"]


def _steps_result(rows):
    """A SearchResult over made-up replays ``(setting, host, rate, steps)``."""
    from vllm_hybrid_npu_lab.advise import SearchResult

    evaluated = {Candidate(s, h): {"token_hit_rate": r, "prefill_steps_per_prompt": st}
                 for s, h, r, st in rows}
    best = max(evaluated, key=lambda c: evaluated[c]["token_hit_rate"])
    return SearchResult(best=best, start=Candidate(), evaluated=evaluated, passes=1)


def test_advice_takes_the_fewest_steps_within_the_hit_tolerance(rng):
    from vllm_hybrid_npu_lab.advise import choose

    top = rng.uniform(0.1, 0.9)
    steps = sorted(rng.uniform(1.0, 9.0) for _ in range(4))
    res = _steps_result([
        (UpstreamSetting(), 0.0, top * 0.9, steps[0]),  # fewest steps, 10% fewer hits: out
        (UpstreamSetting(ret=8, lpt=1), 0.0, top, steps[3]),  # the most hits, the most steps
        (UpstreamSetting(ckpt=True), 0.0, top * 0.995, steps[1]),  # within 1%: the advice
        (UpstreamSetting(pmu=64, ckpt=True), 0.0, top * 0.999, steps[2]),
    ])
    assert choose(res, 0.01) == Candidate(UpstreamSetting(ckpt=True))
    assert choose(res, 0.0) == Candidate(UpstreamSetting(ret=8, lpt=1))
    assert choose(res, 0.2) == Candidate()
    # equal steps: the more hits win, then the fewer options changed from the defaults
    tie = _steps_result([
        (UpstreamSetting(ret=2, ckpt=True), 0.0, top, 1.0),
        (UpstreamSetting(ckpt=True), 0.0, top, 1.0),
        (UpstreamSetting(pmu=32, ckpt=True), 0.0, top * 0.999, 1.0),
    ])
    assert choose(tie, 0.01) == Candidate(UpstreamSetting(ckpt=True))
    with pytest.raises(ValueError, match="--hit-tolerance"):
        choose(res, 1.0)


def test_advise_weighs_steps_when_settings_tie_in_hits(tmp_path, tiny_model_dir, capsys,
                                                       write_trace, rng):
    """Kernel block 128: vLLM's block and the exporter's are both 128 tokens. Each part: cold
    prompts of ``128 k + r`` tokens (``r`` in 1..32, so no prefix-match unit reaches past the last
    block boundary) and their exact repeats. Every setting hits the same (each repeat
    ``128 k``), but vLLM's split ends each cold prompt's step at the last block boundary: 2 prefill
    steps, a repeat 1; the exporter takes 1 and 1. Advised: the exporter, 1.0 against 1.5 steps
    per prompt on both parts (hand-counted), both figures printed."""
    ids = iter(rng.sample(range(100, 100_000), 40))
    rows, t, hit = [], 0, {}
    for part in range(2):
        for _ in range(2):
            n = 128 * rng.randint(5, 7) + rng.randint(1, 32)
            h = [next(ids), next(ids)]
            for _ in range(2):  # cold, then its repeat
                rows.append((t, n, 4, h))
                t += 10_000
            hit[part] = hit.get(part, 0) + (n - 1) // 128 * 128
    trace = write_trace(tmp_path / "t.jsonl", rows)
    common = ["advise", "--trace", str(trace), "--model", str(tiny_model_dir), "--kv-cache-gib",
              "0.05", "--tokens-per-s", "5000", "--kernel-block-size", "128", "--quiet",
              "--starts", "1", "--max-passes", "1"]
    assert main(common + ["--json"]) == 0
    rep = _json(capsys.readouterr().out)
    assert rep["policy"] == "upstream:ckpt" and rep["block_size"] == 128
    assert rep["fit"]["most_hits"]["policy"] == "upstream"  # ties in hits keep the defaults
    assert rep["fit"]["most_hits"]["token_hit_rate"] == rep["fit"]["token_hit_rate"]
    prompt_tokens = sum(r[1] for r in rows[4:])
    assert rep["advised"]["cached_prompt_tokens"] == rep["default"]["cached_prompt_tokens"] == hit[1]
    assert rep["advised"]["prompt_tokens"] == prompt_tokens
    assert rep["fit"]["prefill_steps_per_prompt"] == rep["advised"]["prefill_steps_per_prompt"] == 1.0
    assert rep["fit"]["upstream_default_prefill_steps_per_prompt"] == 1.5
    assert rep["default"]["prefill_steps_per_prompt"] == 1.5
    cost = rep["search_cost"]
    # the fit part's replays: the search's and caching off's (the step bound's reference)
    assert cost["fit_replays"] == rep["fit"]["replays"] + 1 == rep["fit"]["search"]["replays"] + 1
    assert cost["total_replays"] == cost["fit_replays"] + cost["check_replays"]
    # the step bound, hand-counted: each prompt alone (10 s apart), so caching off takes no
    # extra step; the exporter none (eligible), vLLM's split one per cold prompt: 0.5 per prompt
    sb = rep["step_bound"]
    assert sb["caching_off_extra"] == 0.0 and sb["limit"] == pytest.approx(0.05)
    assert sb["advised_eligible"] and sb["any_eligible"]
    assert rep["fit"]["advised"]["extra_prefill_steps_beyond_off"] == 0.0
    assert rep["fit"]["default"]["extra_prefill_steps_beyond_off"] == 0.5
    assert rep["fit"]["default"]["extra_prefill_steps_by_reason"]["prompt_tail"] == 0.5
    assert not rep["fit"]["default"]["eligible"]
    assert rep["default"]["extra_prefill_steps_beyond_off"] == 0.5
    assert not rep["default"]["meets_step_bound"] and rep["advised"]["meets_step_bound"]
    # vLLM's split at its best: every setting without the exporter ties in hits and is over the
    # bound, so the first evaluated, vLLM's defaults (not replayed again on the check part)
    assert rep["best_without_exporter"]["policy"] == rep["fit"]["best_without_exporter"]["policy"]
    assert rep["best_without_exporter"]["policy"] == "upstream"
    # the text report prints both figures and the cost
    assert main(common) == 0
    text = capsys.readouterr().out
    assert "1.00" in text and "1.50" in text and "prefill steps/prompt" in text
    assert f"cost: {cost['total_replays']} replays" in text
    assert "step bound: extra prefill steps/prompt at most caching off's + 0.05" in text
    assert "vLLM defaults" in text  # the bound never hides vLLM's defaults' row
    # without the exporter nothing meets the bound: the advice is the fewest extra steps beyond
    # caching off's (0.5, vLLM's split of each cold prompt, for vLLM's defaults and every other
    # setting without a threshold; ties: hits, all equal, then vLLM's defaults), said plainly
    assert main(common + ["--json", "--no-exporter"]) == 0
    rep = _json(capsys.readouterr().out)
    sb = rep["step_bound"]
    assert not sb["any_eligible"] and sb["eligible_settings"] == 0
    assert rep["policy"] == "upstream" and rep["fit"]["advised"]["extra_prefill_steps_beyond_off"] == 0.5
    assert min(r["extra_prefill_steps_beyond_off"] for r in rep["fit"]["searched"]) == 0.5
    assert sum(sb["failed_by_reason"].values()) == rep["fit"]["replays"]
    assert sb["failed_by_reason"]["prompt_tail"] >= 1
    assert main(common + ["--no-exporter"]) == 0
    text = capsys.readouterr().out
    assert "NONE meets the bound" in text and "fit part: extra steps" in text
    # no bound: the most hits whatever the steps (ties: fewest steps, the exporter)
    assert main(common + ["--json", "--max-extra-steps-over-off", "inf"]) == 0
    rep = _json(capsys.readouterr().out)
    assert rep["step_bound"]["margin"] is None and rep["policy"] == "upstream:ckpt"
    assert rep["step_bound"]["eligible_settings"] == rep["fit"]["replays"]
    for bad in (["--hit-tolerance", "1"], ["--hit-tolerance", "-0.1"], ["--starts", "0"],
                ["--max-extra-steps-over-off", "-0.01"], ["--max-extra-steps-over-off", "nan"]):
        assert main(common + bad) == 2
        assert bad[0] in capsys.readouterr().err


# --------------------------------------------------------------------------------- issue 38
def _bound_result(rows, off_extra, margin=0.05):
    """A SearchResult over made-up replays ``(setting, rate, prefill steps, extra steps)`` (steps
    per prompt) with the step bound ``off_extra + margin``; the first row is vLLM's defaults."""
    from vllm_hybrid_npu_lab.advise import SearchResult, StepBound

    evaluated = {Candidate(s): {"token_hit_rate": r, "prefill_steps_per_prompt": st,
                                "extra_prefill_steps_per_prompt": ex} for s, r, st, ex in rows}
    best = max(evaluated, key=lambda c: evaluated[c]["token_hit_rate"])
    return SearchResult(best=best, start=Candidate(rows[0][0]), evaluated=evaluated, passes=1,
                        bound=StepBound(off_extra, margin))


def test_step_bound_is_caching_offs_extra_steps_plus_the_margin(rng):
    """Extra steps per prompt are counts over prompts: with ``n`` prompts (a multiple of 20),
    caching off's ``k`` extra steps and the margin 0.05 (``n / 20`` steps), ``k + n / 20`` extra
    steps are at the bound (eligible), one more is over it; fewer than caching off's (hits lighten
    the load) is eligible; an infinite margin admits anything."""
    import math

    from vllm_hybrid_npu_lab.advise import StepBound

    n = 20 * rng.randint(5, 150)
    k = rng.randint(0, n // 2)
    b = StepBound(k / n, 0.05)
    at = {"extra_prefill_steps_per_prompt": (k + n // 20) / n}
    over = {"extra_prefill_steps_per_prompt": (k + n // 20 + 1) / n}
    under = {"extra_prefill_steps_per_prompt": max(k - 1, 0) / n}
    assert b.eligible(at) and not b.eligible(over) and b.eligible(under)
    # exactly at the bound (1 step in 20 prompts over none), and a rounding error above it
    # (4 steps in 20 prompts over 3: 0.05000000000000002 in binary floating point)
    assert StepBound(0.0, 0.05).eligible({"extra_prefill_steps_per_prompt": 1 / 20})
    assert StepBound(3 / 20, 0.05).eligible({"extra_prefill_steps_per_prompt": 4 / 20})
    assert not StepBound(3 / 20, 0.05).eligible({"extra_prefill_steps_per_prompt": 5 / 20})
    assert b.beyond(over) == pytest.approx((n // 20 + 1) / n)
    assert b.limit == pytest.approx(k / n + 0.05)
    assert b.to_dict() == {"margin": 0.05, "caching_off_extra": k / n, "limit": b.limit}
    free = StepBound(k / n, math.inf)
    assert free.eligible({"extra_prefill_steps_per_prompt": 1e6})
    assert free.to_dict() == {"margin": None, "caching_off_extra": k / n, "limit": None}


def test_advice_is_the_most_hits_within_the_step_bound(rng):
    """Made-up fit-part replays, caching off at ``off`` extra steps per prompt, margin 0.05:

    * ``ret=8b,lpt=1b``: the most hits, 5 extra steps beyond off (its threshold): over;
    * ``ret=4b,ckpt``: 0.9 x those hits, 0.04 beyond off: within, the most hits within;
    * ``ckpt``: 0.8 x, 0.00 beyond off, fewer prefill steps: within;
    * ``ret=dense,ckpt``: 0.95 x, 0.06 beyond off: over by 0.01;
    * vLLM's defaults: 0.7 x, 0.6 beyond off (vLLM's split of cold prompts): over.

    Advised: ``ret=4b,ckpt``; the most hits stays ``ret=8b,lpt=1b``; within a 15% tolerance of
    the eligible best the fewest prefill steps, ``ckpt``; no bound: ``ret=8b,lpt=1b``."""
    import math

    from vllm_hybrid_npu_lab.advise import choose

    top, off = rng.uniform(0.05, 0.9), rng.uniform(0.0, 1.0)
    rows = [
        (UpstreamSetting(), 0.7 * top, 3.4, off + 0.6),
        (UpstreamSetting(ret=8, lpt=1), top, 8.0, off + 5.0),
        (UpstreamSetting(ret=4, ckpt=True), 0.9 * top, 2.8, off + 0.04),
        (UpstreamSetting(ckpt=True), 0.8 * top, 2.7, off),
        (UpstreamSetting(ret=None, ckpt=True), 0.95 * top, 2.8, off + 0.06),
    ]
    res = _bound_result(rows, off)
    assert [res.eligible(Candidate(r[0])) for r in rows] == [False, False, True, True, False]
    assert res.n_eligible == 2
    assert res.best == Candidate(UpstreamSetting(ret=8, lpt=1))
    assert choose(res) == Candidate(UpstreamSetting(ret=4, ckpt=True))
    assert choose(res, 0.15) == Candidate(UpstreamSetting(ckpt=True))
    assert choose(_bound_result(rows, off, math.inf)) == Candidate(UpstreamSetting(ret=8, lpt=1))
    # vLLM's split at its best: no setting without the exporter is within the bound, so the most
    # hits without it; one within the bound (fewer hits) comes first
    assert res.best_split() == Candidate(UpstreamSetting(ret=8, lpt=1))
    within = rows + [(UpstreamSetting(ret=2), 0.5 * top, 2.8, off + 0.01)]
    assert _bound_result(within, off).best_split() == Candidate(UpstreamSetting(ret=2))
    # a tie in hits within the bound: the fewer prefill steps
    tie = rows + [(UpstreamSetting(ret=2, ckpt=True), 0.9 * top, 2.75, off + 0.03)]
    assert choose(_bound_result(tie, off)) == Candidate(UpstreamSetting(ret=2, ckpt=True))


def test_advice_when_no_setting_meets_the_step_bound(rng):
    """Every made-up setting is over the bound (as without the exporter, where vLLM's split of
    cold prompts alone is 0.5-0.6 steps per prompt): the advice is the fewest extra steps beyond
    caching off's, ``ret=2b`` and ``ret=4b`` tie at 0.5 beyond off, ``ret=2b`` has more hits;
    vLLM's defaults 0.6, the threshold 5."""
    from vllm_hybrid_npu_lab.advise import choose

    top, off = rng.uniform(0.05, 0.9), rng.uniform(0.0, 1.0)
    rows = [
        (UpstreamSetting(), 0.7 * top, 3.4, off + 0.6),
        (UpstreamSetting(ret=8, lpt=1), top, 8.0, off + 5.0),
        (UpstreamSetting(ret=4), 0.8 * top, 3.3, off + 0.5),
        (UpstreamSetting(ret=2), 0.85 * top, 3.3, off + 0.5),
    ]
    res = _bound_result(rows, off)
    assert res.n_eligible == 0
    assert choose(res) == Candidate(UpstreamSetting(ret=2))
    assert res.beyond_off(choose(res)) == pytest.approx(0.5)


def test_failure_reasons_name_each_failed_settings_largest_reason_beyond_off():
    """Caching off: 0.2 shared-budget steps per prompt. Over the bound: two thresholds (lpt 5
    and 2), a split (tail 0.6, shared 0.3: 0.1 beyond off's), a setting whose only excess is the
    shared budget (0.35, 0.15 beyond off's); within: the exporter (shared 0.22). By count, then
    in the table's order: lpt 2, tail 1, shared 1."""
    from vllm_hybrid_npu_lab.advise import SearchResult, StepBound, failure_reasons

    off = {"extra_prefill_steps_per_prompt": 0.2,
           "extra_prefill_steps_by_reason": {"shared_budget": 0.2}}
    rows = {
        UpstreamSetting(ret=2, lpt=1): {"long_prefill": 5.0, "shared_budget": 0.3},
        UpstreamSetting(ret=8, lpt=2): {"long_prefill": 2.0, "shared_budget": 0.25},
        UpstreamSetting(): {"prompt_tail": 0.6, "shared_budget": 0.3},
        UpstreamSetting(pmu=64): {"shared_budget": 0.35},
        UpstreamSetting(ckpt=True): {"shared_budget": 0.22},
    }
    evaluated = {Candidate(s): {"token_hit_rate": 0.1, "prefill_steps_per_prompt": 3.0,
                                "extra_prefill_steps_per_prompt": sum(by.values()),
                                "extra_prefill_steps_by_reason": by} for s, by in rows.items()}
    res = SearchResult(best=Candidate(), start=Candidate(), evaluated=evaluated, passes=1,
                       bound=StepBound(0.2, 0.05))
    got = failure_reasons(res, off)
    assert got == {"long_prefill": 2, "prompt_tail": 1, "shared_budget": 1}
    assert list(got) == ["long_prefill", "prompt_tail", "shared_budget"]
    assert failure_reasons(dataclasses.replace(res, bound=None), off) == {}


def test_search_with_a_step_bound_finds_the_best_eligible_and_the_unconstrained_best(rng):
    """A made-up objective: hits ``base[ret] + 0.1 min(lpt, 4) + (0.01 with the exporter, 0.02
    without)`` (``base`` drawn per retention value, 0 past the range); extra steps beyond caching
    off's: 0.5 without the exporter (vLLM's split), 0.3 with a prefix-match unit, 1 per threshold
    block. Eligible: the exporter, no threshold, no unit. By hand: the advice is the exporter at
    the best ``ret`` (``r*``, argmax of ``base``) and no threshold; the most hits, found by the
    extra descent by hits alone from the grid's most hits (vLLM's defaults: the exporter-free
    settings tie, grid order), is ``r*`` with a 4-block threshold, no exporter; so is vLLM's
    split at its best (the third descent, the exporter kept off, from the same setting)."""
    from vllm_hybrid_npu_lab.advise import RET_VALUES, StepBound, choose

    base = collections.defaultdict(float, {r: rng.uniform(0.1, 1.0) for r in RET_VALUES})
    off = rng.uniform(0.0, 1.0)

    def evaluate(c: Candidate):
        s = c.setting
        extra = off + (0.0 if s.ckpt else 0.5) + (0.3 if s.pmu else 0.0) + s.lpt
        return {"token_hit_rate": base[s.ret] + 0.1 * min(s.lpt, 4) + (0.01 if s.ckpt else 0.02),
                "prefill_steps_per_prompt": 2.0 + extra, "extra_prefill_steps_per_prompt": extra}

    r_star = max(RET_VALUES, key=lambda r: base[r])
    res = search(evaluate, Candidate(), 0.0, starts=1, bound=StepBound(off, 0.05))
    assert res.starts == [Candidate(UpstreamSetting(ckpt=True)), Candidate(), Candidate()]
    assert choose(res) == Candidate(UpstreamSetting(ret=r_star, ckpt=True))
    assert res.best == Candidate(UpstreamSetting(ret=r_star, lpt=4))
    assert res.eligible(choose(res)) and not res.eligible(res.best)
    assert res.best_split() == res.best
    # without a bound: one descent, from the grid's most hits, to the same most hits
    free = search(evaluate, Candidate(), 0.0, starts=1)
    assert free.starts == [Candidate()] and free.best == res.best
    assert free.n_eligible == free.replays  # every setting eligible without a bound


def test_second_replayed_where_the_targets_runtime_has_it(monkeypatch):
    # VLLM_HYBRID_NPU_OPTIONS=second=on: the runtime writes the second checkpoint where its
    # step exports junction states: CUDA's one pass (vLLM 0.30's V2 runner), beside a host tier
    # too; vllm-ascend's V1 runner without a KV connector (a host tier's turns it off there)
    from vllm_hybrid_npu_lab.advise import second_available

    monkeypatch.delenv(OPTIONS_ENV, raising=False)
    runtime = policy_of(UpstreamSetting(pmu=64, ckpt=True, second=True)).unavailable() is None
    assert second_available("cuda", True) == second_available("cuda", False) == runtime
    assert second_available("npu", False) == runtime and not second_available("npu", True)
    monkeypatch.setenv(OPTIONS_ENV, "junctions=off")
    assert not second_available("cuda", True) and not second_available("cuda", False)


def test_mid_block_stop_bound_over_a_cpu_chunk_end(monkeypatch):
    """The lab's CUDA mid-block stop where the runtime's ``gdn-chunk-end`` is applied process-wide:
    for CUDA or the NPU the class's split has the stop (nothing bound); for the CPU target it has
    the junction layer only, so the stop alone is bound on the instance (found in review)."""
    import types

    from vllm_hybrid_npu.patches import registry
    from vllm_hybrid_npu.support import Stack

    from vllm_hybrid_npu_lab import exporter

    if exporter._entry(exporter.MID_BLOCK_STOP_ENTRY) is None:
        pytest.skip("gdn-chunk-end is not for the installed vLLM")

    class Sched:
        def _mamba_block_aligned_split(self, request, n, local=0, external=0):
            return n

    report = registry.LoadReport()
    report.applied.append(exporter.MID_BLOCK_STOP_ENTRY)
    monkeypatch.setattr(registry, "REPORT", report)
    vllm = __import__("vllm").__version__.split("+")[0]
    for target, bound in (("cuda", False), ("npu", False), ("cpu", True)):
        report.stack = Stack(target, vllm)
        sched = Sched()
        sched.kv_cache_manager = types.SimpleNamespace()
        assert exporter.apply_mid_block_stop(sched) is bound, target
        assert ("_mamba_block_aligned_split" in vars(sched)) is bound, target
