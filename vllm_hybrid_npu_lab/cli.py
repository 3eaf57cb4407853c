"""``vllm-hybrid-npu-lab hitrate``: replay a trace through vLLM's scheduler and report hit rates.

Prints a table (or one JSON object with ``--json``) with, per policy, the token hit rate
(cached prompt tokens / prompt tokens), the share of requests with any hit, prompt tokens
computed, cached GDN states (count and bytes) and the block size; beside them the attention
bound (the same KV budget on a model made of the same full-attention layers only, at the
attention backend's block size, replayed through the same real scheduler) and the
infinite-cache bound at the hybrid's block size. Several ``--kv-cache-gib`` or ``--block-size``
values make a sweep; ``--plot FILE.png`` draws it (matplotlib). Top-level imports stay light.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any

from vllm_hybrid_npu_lab.presets import DEFAULT_MODEL, DEFAULT_STEP_MS, DEFAULT_UTILIZATION  # noqa: E402,F401
from vllm_hybrid_npu_lab.replay import TARGET_HELP, TARGETS, add_speculative_argument, check_speculative


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``hitrate`` options to ``parser``."""
    from vllm_hybrid_npu_lab.policies import (
        DEFAULT_POLICY,
        POLICIES,
        UPSTREAM_BEST,
        load_policy_modules,
    )
    from vllm_hybrid_npu_lab.presets import PRESETS

    load_policy_modules()

    parser.add_argument("--trace", required=True, help="Mooncake-format JSONL trace")
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"preset ({', '.join(PRESETS)}) or a model directory with config.json "
        f"(default {DEFAULT_MODEL})",
    )
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    parser.add_argument(
        "--kv-cache-gib",
        type=float,
        nargs="+",
        default=[16.0],
        help="KV-cache memory per worker (one TP rank), GiB; several values = a sweep (default 16)",
    )
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument(
        "--block-size",
        type=int,
        nargs="+",
        default=None,
        help="block size(s) in tokens (default: what vLLM picks for the model and --tp); "
        "vLLM raises a hybrid's block size until the attention page holds a GDN state",
    )
    parser.add_argument(
        "--kernel-block-size",
        type=int,
        default=16,
        help="the attention backend's preferred block size (16 = FlashAttention on CUDA; "
        "vLLM's CPU backend uses 128); also the attention bound's block size",
    )
    parser.add_argument(
        "--policy",
        nargs="+",
        default=["upstream"],
        help=f"policies to replay: 'default' (= {DEFAULT_POLICY}, the documented default), "
        f"'{UPSTREAM_BEST}' (the advisor's search over vLLM's options on these requests, best "
        "setting reported; see 'advise'), any upstream setting 'upstream:ret=dense|<k>b,"
        f"lpt=<k>b,pmu=<tokens>,ckpt|ckpt=final', or registered names: {', '.join(sorted(POLICIES))}",
    )
    parser.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    parser.add_argument(
        "--step-ms", type=float, default=DEFAULT_STEP_MS,
        help=f"simulated fixed cost of one step, ms (default {DEFAULT_STEP_MS:g})",
    )
    parser.add_argument(
        "--tokens-per-s", type=float, nargs="+", default=None,
        help="simulated throughput, scheduled tokens/s; several values = a sweep (default: the "
        "trace's offered prompt tokens/s divided by --utilization)",
    )
    parser.add_argument(
        "--utilization", "--offered-load", dest="utilization", type=float,
        default=DEFAULT_UTILIZATION,
        help="offered prompt tokens/s over the simulated throughput when --tokens-per-s is not "
        f"given (an input; default {DEFAULT_UTILIZATION:g}); the engine's measured busy share "
        "is reported as the utilization",
    )
    parser.add_argument("--target", choices=TARGETS, default="cuda", help=TARGET_HELP)
    add_speculative_argument(parser)
    parser.add_argument(
        "--no-carry", action="store_true",
        help="do not carry an earlier turn's generated tokens into the prompt that extends it",
    )
    parser.add_argument(
        "--host-cache-gib", type=float, nargs="+", default=[0.0],
        help="host tier per worker, GiB (vLLM's OffloadingConnector, as --kv-offloading-size; "
        "0 = none); several values = a sweep (default 0)",
    )
    parser.add_argument(
        "--host-link-gbps", type=float, default=50.0,
        help="device<->host bandwidth per direction, GB/s (default 50: PCIe Gen5 x16 DMA; "
        "HCCS hosts are of the same order)",
    )
    parser.add_argument(
        "--host-link-latency-us", type=float, default=10.0,
        help="fixed cost of one host transfer job, microseconds (default 10)",
    )
    parser.add_argument(
        "--jobs", type=int, default=1,
        help="with upstream-best: replay the settings of one search step in this many processes "
        "(default 1)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--plot", metavar="FILE.png", default=None, help="draw the results")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")


def _validate(args: argparse.Namespace) -> None:
    from vllm_hybrid_npu_lab.host_tier import HostLink
    from vllm_hybrid_npu_lab.policies import UPSTREAM_BEST, get_policy

    for name in args.policy:
        if name != UPSTREAM_BEST:
            get_policy(name)
    check_speculative(args.speculative_tokens)
    if any(h < 0 for h in args.host_cache_gib):
        raise ValueError(f"--host-cache-gib must be >= 0, got {args.host_cache_gib}")
    HostLink(args.host_link_gbps, args.host_link_latency_us)
    if not 0 < args.utilization:
        raise ValueError(f"--utilization must be > 0, got {args.utilization}")
    if args.tokens_per_s and any(t <= 0 for t in args.tokens_per_s):
        raise ValueError(f"--tokens-per-s must be > 0, got {args.tokens_per_s}")
    if args.tp < 1:
        raise ValueError(f"--tp must be >= 1, got {args.tp}")
    if any(g <= 0 for g in args.kv_cache_gib):
        raise ValueError(f"--kv-cache-gib must be > 0, got {args.kv_cache_gib}")
    if args.block_size and any(b < 1 for b in args.block_size):
        raise ValueError(f"--block-size must be >= 1, got {args.block_size}")
    if args.block_size and len(args.block_size) > 1 and len(args.kv_cache_gib) > 1:
        raise ValueError("sweep either --kv-cache-gib or --block-size, not both")
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit must be >= 1, got {args.limit}")
    if args.jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {args.jobs}")
    if args.max_num_batched_tokens < 1 or args.max_num_seqs < 1:
        raise ValueError("--max-num-batched-tokens and --max-num-seqs must be >= 1")
    if args.step_ms < 0:
        raise ValueError(f"--step-ms must be >= 0, got {args.step_ms}")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ValueError(
                "--plot needs matplotlib: pip install matplotlib (or the project's test extra)"
            ) from None


def _expand_policies(names: list[str]) -> list[str]:
    """``--policy`` values -> registered names (``default`` resolved, ``upstream-best`` left out:
    it is the advisor's search, run per point by :func:`run_sweep`)."""
    from vllm_hybrid_npu_lab.policies import DEFAULT_POLICY, UPSTREAM_BEST

    out: list[str] = []
    for name in names:
        if name == UPSTREAM_BEST:
            continue
        name = DEFAULT_POLICY if name == "default" else name
        if name not in out:
            out.append(name)
    return out


def upstream_best(policies: dict[str, Any]) -> dict[str, Any] | None:
    """The best upstream setting among ``policies`` (name -> replay dict) by token hit rate,
    as a copy with ``setting`` (its name) added; ``None`` when no upstream setting was replayed.
    Ties go to the first replayed (``upstream`` first)."""
    from vllm_hybrid_npu_lab.upstream_grid import is_upstream

    best_name = None
    for name, r in policies.items():
        if is_upstream(name) and (
            best_name is None or r["token_hit_rate"] > policies[best_name]["token_hit_rate"]
        ):
            best_name = name
    if best_name is None:
        return None
    return {**policies[best_name], "setting": best_name}


def search_best(requests, cfg, *, gib, host, bs, common, timing, label, quiet, known,
                jobs=1) -> dict[str, Any]:
    """The ``upstream-best`` row with ``--policy upstream-best``: the advisor's search
    (:func:`vllm_hybrid_npu_lab.advise.search`) over vLLM's options and the exporter on these
    requests at this point (host tier fixed), as the best replay's dict with ``setting`` (its
    policy name) and ``search`` (every evaluated setting's token hit rate). Replays of upstream
    settings already in ``known`` are reused. With ``--block-size`` the search keeps that block."""
    from vllm_hybrid_npu_lab.advise import Candidate, Replayer, run_search
    from vllm_hybrid_npu_lab.upstream_grid import UpstreamSetting

    class Known(Replayer):
        def __call__(self, c: Candidate) -> dict[str, Any] | None:
            if c.policy in known:
                return known[c.policy]
            return super().__call__(c)

    replayer = Known(requests, cfg, kv_cache_gib=gib, tp=common["tp"],
                     common={k: v for k, v in common.items() if k != "tp"} | {"block_size": bs},
                     timing=timing, label=f"{label} upstream-best", quiet=quiet)

    result = run_search(replayer, Candidate(UpstreamSetting(), host), jobs=jobs,
                        axes=("ckpt", "ret+lpt", "pmu"))
    return {**result.result(result.best), "setting": result.best.policy,
            "search": {c.policy: r["token_hit_rate"] for c, r in result.evaluated.items() if r}}


def miss_reasons_of(policies: dict[str, Any], default: str) -> dict[str, Any] | None:
    """The report's ``miss_reasons``: ``{"policy": name, "reasons": {reason: tokens}}`` of the
    default policy's replay (else the first replayed policy), or ``None`` while the runtime has
    no miss classifier (``vllm_hybrid_npu.core.miss_reasons``, issue 15 item 5: the replay
    feeds its ``MissTracker`` when the module is importable)."""
    name = default if default in policies else next(iter(policies), None)
    if name is None or policies[name].get("miss_reasons") is None:
        return None
    return {"policy": name, "reasons": policies[name]["miss_reasons"]}


def run_sweep(args: argparse.Namespace) -> dict[str, Any]:
    """Run every (budget, host tier, block size, throughput) point of ``args``; return the report.

    The report is the first point's object (``model``, ``tp``, ``kv_cache_gib``,
    ``host_cache_gib``, ``block_size``, ``tokens_per_s``, ``step_ms``, ``attention_bound``,
    ``infinite_bound``, ``policies``: name -> replay numbers, ``upstream-best`` among them when
    an upstream setting was replayed (with ``setting``), plus ``attention``, ``caching_off``
    (the same requests and arrivals with prefix caching off, :data:`.policies.CACHING_OFF`) and
    ``infinite`` detail objects), with ``default_policy``, ``miss_reasons`` and ``runs`` listing
    every point. Every policy row and ``attention`` carry ``extra_prefill_steps_by_reason`` and
    ``extra_prefill_steps_beyond_off`` (extra prefill steps per prompt beyond caching off's).
    """
    from vllm_hybrid_npu_lab.host_tier import HostLink
    from vllm_hybrid_npu_lab.model import build_setup
    from vllm_hybrid_npu_lab.policies import (
        CACHING_OFF,
        DEFAULT_POLICY,
        UPSTREAM_BEST,
        get_policy,
        setup_kwargs,
    )
    from vllm_hybrid_npu_lab.presets import resolve_model
    from vllm_hybrid_npu_lab.replay import output_token, replay, stderr_progress
    from vllm_hybrid_npu_lab.step_reasons import beyond_off
    from vllm_hybrid_npu_lab.trace import answers, carried_prompts, infinite_bound_tokens, read_trace

    model_name, cfg = resolve_model(args.model)
    requests = read_trace(args.trace, args.limit)
    max_model_len = max(r.input_length + r.output_length for r in requests)
    span = (requests[-1].timestamp_ms - requests[0].timestamp_ms) / 1000.0
    offered = sum(r.input_length for r in requests) / span if span > 0 else 0.0
    if args.tokens_per_s:
        rates = list(args.tokens_per_s)
    else:
        rates = [offered / args.utilization if offered > 0 else 40000.0]
    prompts, _ = carried_prompts(requests, output_token, carry=not args.no_carry)
    outputs = answers(requests, output_token)
    searching = UPSTREAM_BEST in args.policy
    link = HostLink(args.host_link_gbps, args.host_link_latency_us)
    names = _expand_policies(args.policy)
    blocks = args.block_size or [None]
    runs = []
    attention: dict[tuple[float, float, float], Any] = {}
    off_runs: dict[tuple[float, float, int | None], Any] = {}
    infinite: dict[int, tuple[int, int]] = {}
    base_blocks: dict[tuple[float, int | None], int] = {}
    for rate in rates:
        for gib in args.kv_cache_gib:
            for host in args.host_cache_gib:
                for bs in blocks:
                    common = dict(
                        tp=args.tp,
                        max_num_batched_tokens=args.max_num_batched_tokens,
                        max_num_seqs=args.max_num_seqs,
                        max_model_len=max_model_len,
                        kernel_block_size=args.kernel_block_size,
                        speculative_tokens=args.speculative_tokens,
                        exporter_target=args.target,
                    )
                    label = (f"{model_name} tp{args.tp} {gib:g} GiB" + (f" +host {host:g}" if host else "")
                             + (f" bs{bs}" if bs else "") + (f" {rate:,.0f} tok/s" if len(rates) > 1 else ""))
                    timing = dict(step_ms=args.step_ms, tokens_per_s=rate,
                                  carry_outputs=not args.no_carry, link=link, target=args.target)
                    policies: dict[str, Any] = {}
                    for name in names:
                        pol = get_policy(name)
                        setup = build_setup(
                            cfg, block_size=bs, **setup_kwargs(pol),
                            kv_cache_bytes=int(gib * (1 << 30)), host_cache_bytes=int(host * (1 << 30)),
                            **common,
                        )
                        res = replay(
                            requests, setup, pol.scheduler_class(), **timing,
                            progress=None if args.quiet else stderr_progress(f"{label} {name}"),
                        )
                        policies[name] = res.to_dict()
                    if searching:
                        best = search_best(requests, cfg, gib=gib, host=host, bs=bs, common=common,
                                           timing=timing, label=label, quiet=args.quiet,
                                           known=policies, jobs=args.jobs)
                    else:
                        best = upstream_best(policies)
                    if best is not None:
                        policies[UPSTREAM_BEST] = best
                    if not policies:
                        raise ValueError("--policy: nothing to replay")
                    # the run's block size: vLLM's own for the model, --tp and --block-size,
                    # whatever the policies (each row has its own); the infinite bound at the
                    # finest hit unit of every row (gcd of their block sizes and prefix-match
                    # units), counting answers: no row can exceed it
                    if (gib, bs) not in base_blocks:
                        base_blocks[(gib, bs)] = build_setup(
                            cfg, block_size=bs, kv_cache_bytes=int(gib * (1 << 30)), **common
                        ).block_size
                    block_size = base_blocks[(gib, bs)]
                    unit = 0
                    for name, r in policies.items():
                        if name != CACHING_OFF:  # (no prefix cache: no hit unit)
                            unit = math.gcd(unit, r["block_size"],
                                            r.get("hash_block_size") or r["block_size"])
                    # The attention bound: the same bytes (device + host) on the full-attention
                    # layers alone, at the attention backend's block size, through the installed
                    # vLLM's own Scheduler. Independent of the hybrid's block size.
                    key = (rate, gib, host)
                    if key not in attention:
                        asetup = build_setup(cfg, block_size=None, attention_only=True,
                                             kv_cache_bytes=int((gib + host) * (1 << 30)), **common)
                        attention[key] = replay(
                            requests, asetup, get_policy("upstream").scheduler_class(), **timing,
                            progress=None if args.quiet else stderr_progress(f"{label} attention bound"),
                        )
                    ares = attention[key]
                    # Caching off under the same arrivals: its extra prefill steps are the load's
                    # (the token budget shared in a step); no host tier (nothing is cached).
                    okey = (rate, gib, bs)
                    if okey not in off_runs:
                        pol = get_policy(CACHING_OFF)
                        osetup = build_setup(cfg, block_size=bs, **setup_kwargs(pol),
                                             kv_cache_bytes=int(gib * (1 << 30)), **common)
                        off_runs[okey] = replay(
                            requests, osetup, pol.scheduler_class(), **timing,
                            progress=None if args.quiet else stderr_progress(f"{label} caching off"),
                        ).to_dict()
                    off = off_runs[okey]
                    for r in policies.values():
                        r["extra_prefill_steps_beyond_off"] = beyond_off(r, off)
                    adict = ares.to_dict()
                    adict["extra_prefill_steps_beyond_off"] = beyond_off(adict, off)
                    if unit not in infinite:
                        infinite[unit] = infinite_bound_tokens(prompts, unit, outputs)
                    cached, total = infinite[unit]
                    first = next(iter(policies.values()))
                    runs.append(
                        {
                            "model": model_name,
                            "tp": args.tp,
                            "kv_cache_gib": gib,
                            "host_cache_gib": host,
                            "block_size": block_size,
                            "tokens_per_s": rate,
                            "step_ms": args.step_ms,
                            "offered_prompt_tokens_per_s": offered,
                            # measured: the share of simulated time the engine ran a step (first
                            # row); the input ratio is offered_load
                            "utilization": first["busy_fraction"],
                            "offered_load": offered / rate,
                            "carry_outputs": not args.no_carry,
                            "target": args.target,
                            "speculative_tokens": args.speculative_tokens,
                            "num_requests": len(requests),
                            "attention_bound": ares.token_hit_rate,
                            "infinite_bound": cached / total,
                            "attention": adict,
                            "caching_off": off,
                            "infinite": {
                                "block_size": unit,
                                "cached_prompt_tokens": cached,
                                "prompt_tokens": total,
                            },
                            "policies": policies,
                        }
                    )
    report = dict(runs[0])
    report["default_policy"] = DEFAULT_POLICY
    report["miss_reasons"] = miss_reasons_of(report["policies"], DEFAULT_POLICY)
    report["runs"] = runs
    return report


def format_table(report: dict[str, Any]) -> str:
    """Return the human-readable table of every run in ``report``: hits per row, then the extra
    prefill steps per prompt by reason (:func:`vllm_hybrid_npu_lab.step_reasons.format_reasons`)
    with caching off's under the same arrivals."""
    from vllm_hybrid_npu_lab.step_reasons import format_reasons

    lines = []
    head = (
        f"{'run':<34} {'policy':<26} {'block':>6} {'tok hit':>8} {'host hit':>8} {'req hit':>8} "
        f"{'computed tok':>14} {'states':>7} {'state GiB':>9} {'load s':>7}"
    )
    for run in report["runs"]:
        tag = f"{run['model']} tp{run['tp']} {run['kv_cache_gib']:g}GiB"
        if run.get("host_cache_gib"):
            tag += f"+host{run['host_cache_gib']:g}"
        lines.append(head)
        for name, r in run["policies"].items():
            label = name if "setting" not in r else f"{name} ({r['setting']})"
            host_hit = r.get("host_cached_prompt_tokens", 0) / r["prompt_tokens"]
            lines.append(
                f"{tag:<34} {label:<26} {r['block_size']:>6} {r['token_hit_rate']:>8.2%} "
                f"{host_hit:>8.2%} {r['request_hit_rate']:>8.2%} {r['computed_prompt_tokens']:>14,} "
                f"{r['cached_states']:>7} {r['cached_state_bytes'] / 2**30:>9.2f} "
                f"{r.get('host', {}).get('load_s', 0.0):>7.2f}"
            )
        a = run["attention"]
        lines.append(
            f"{tag:<34} {'attention bound':<26} {a['block_size']:>6} {a['token_hit_rate']:>8.2%} "
            f"{'-':>8} {a['request_hit_rate']:>8.2%} {a['computed_prompt_tokens']:>14,} {'-':>7} {'-':>9} {'-':>7}"
        )
        inf = run["infinite"]
        lines.append(
            f"{tag:<34} {'infinite bound':<26} {inf['block_size']:>6} "
            f"{run['infinite_bound']:>8.2%} {'-':>8} {'-':>8} "
            f"{inf['prompt_tokens'] - inf['cached_prompt_tokens']:>14,} {'-':>7} {'-':>9} {'-':>7}"
        )
        reasons = [(name, r) for name, r in run["policies"].items()] + [("attention bound", a)]
        lines += format_reasons(reasons, run.get("caching_off"), width=34)
        first = next(iter(run["policies"].values()))
        lines.append(
            f"prompt tokens: {inf['prompt_tokens']:,} in {run['num_requests']} requests; offered "
            f"{run['offered_prompt_tokens_per_s']:,.0f} prompt tok/s against {run['tokens_per_s']:,.0f} "
            f"tok/s simulated (offered load {run['offered_load']:.2f}, an input; utilization "
            f"{run['utilization']:.2f}: measured share of simulated time the engine ran a step, "
            f"mean wait {first['mean_wait_s']:.2f} s); {first['carried_requests']} prompts carry an "
            "earlier turn's answer"
        )
    return "\n".join(lines)


def plot(report: dict[str, Any], path: str) -> None:
    """Draw token hit rate against KV budget (or block size, or per run) into ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["runs"]
    if len({r["kv_cache_gib"] for r in runs}) > 1:
        xs, xlabel = [r["kv_cache_gib"] for r in runs], "KV cache per worker (GiB)"
    elif len({r["block_size"] for r in runs}) > 1:
        xs, xlabel = [r["block_size"] for r in runs], "block size (tokens)"
    else:
        xs, xlabel = None, None
    fig, ax = plt.subplots(figsize=(7, 4.2))
    series = {name: [r["policies"][name]["token_hit_rate"] for r in runs] for name in runs[0]["policies"]}
    series["attention bound"] = [r["attention_bound"] for r in runs]
    series["infinite bound"] = [r["infinite_bound"] for r in runs]
    if xs is None:
        names = list(series)
        ax.bar(names, [100 * v[0] for v in series.values()], color=["C0", "C1", "C2", "C3"][: len(names)])
        for i, v in enumerate(series.values()):
            ax.text(i, 100 * v[0], f"{100 * v[0]:.1f}%", ha="center", va="bottom")
    else:
        for name, ys in series.items():
            style = "--" if "bound" in name else "-"
            ax.plot(xs, [100 * y for y in ys], style, marker="o", label=name)
        ax.set_xlabel(xlabel)
        ax.legend()
    r0 = runs[0]
    ax.set_ylabel("token hit rate (%)")
    ax.set_title(f"{r0['model']} tp{r0['tp']}, block {r0['block_size']}, {r0['num_requests']} requests")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    """Run ``hitrate``; return 0, or 2 after printing a clear error for bad input."""
    # vLLM logs to stdout by default; keep stdout for the table / JSON (effective when vLLM is
    # first imported here, as in the console script).
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    try:
        _validate(args)
        report = run_sweep(args)
    except ValueError as exc:
        print(f"vllm-hybrid-npu-lab hitrate: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_table(report))
    if args.plot:
        plot(report, args.plot)
        if not args.quiet:
            print(f"plot written to {args.plot}", file=sys.stderr)
    return 0
