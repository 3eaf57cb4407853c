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
import os
import sys
from typing import Any

DEFAULT_MODEL = "qwen3.5-35b-a3b"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``hitrate`` options to ``parser``."""
    from vllm_hybrid_npu_lab.policies import POLICIES, load_policy_modules
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
        help=f"policies to replay (registered: {', '.join(POLICIES)})",
    )
    parser.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    parser.add_argument("--step-ms", type=float, default=5.0, help="simulated cost of one step, ms")
    parser.add_argument(
        "--tokens-per-s", type=float, default=40000.0, help="simulated throughput, tokens/s"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--plot", metavar="FILE.png", default=None, help="draw the results")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")


def _validate(args: argparse.Namespace) -> None:
    from vllm_hybrid_npu_lab.policies import get_policy

    for name in args.policy:
        get_policy(name)
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
    if args.max_num_batched_tokens < 1 or args.max_num_seqs < 1:
        raise ValueError("--max-num-batched-tokens and --max-num-seqs must be >= 1")
    if args.tokens_per_s <= 0 or args.step_ms < 0:
        raise ValueError("--tokens-per-s must be > 0 and --step-ms >= 0")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ValueError(
                "--plot needs matplotlib: pip install matplotlib (or the project's test extra)"
            ) from None


def run_sweep(args: argparse.Namespace) -> dict[str, Any]:
    """Run every (budget, block size) point of ``args`` and return the report dict.

    The report is the first point's object (``model``, ``tp``, ``kv_cache_gib``, ``block_size``,
    ``attention_bound``, ``infinite_bound``, ``policies``: name -> replay numbers, plus
    ``attention`` and ``infinite`` detail objects) with ``runs`` listing every point.
    """
    from vllm_hybrid_npu_lab.model import build_setup
    from vllm_hybrid_npu_lab.policies import get_policy
    from vllm_hybrid_npu_lab.presets import resolve_model
    from vllm_hybrid_npu_lab.replay import replay, stderr_progress
    from vllm_hybrid_npu_lab.trace import infinite_bound, read_trace

    model_name, cfg = resolve_model(args.model)
    requests = read_trace(args.trace, args.limit)
    max_model_len = max(r.input_length + r.output_length for r in requests)
    blocks = args.block_size or [None]
    runs = []
    attention: dict[float, Any] = {}
    for gib in args.kv_cache_gib:
        for bs in blocks:
            common = dict(
                tp=args.tp,
                kv_cache_bytes=int(gib * (1 << 30)),
                max_num_batched_tokens=args.max_num_batched_tokens,
                max_num_seqs=args.max_num_seqs,
                max_model_len=max_model_len,
                kernel_block_size=args.kernel_block_size,
            )
            label = f"{model_name} tp{args.tp} {gib:g} GiB" + (f" bs{bs}" if bs else "")
            policies: dict[str, Any] = {}
            block_size = None
            for name in args.policy:
                pol = get_policy(name)
                setup = build_setup(cfg, block_size=bs, configure=pol.configure, **common)
                block_size = setup.block_size
                res = replay(
                    requests,
                    setup,
                    pol.scheduler_class(),
                    step_ms=args.step_ms,
                    tokens_per_s=args.tokens_per_s,
                    progress=None if args.quiet else stderr_progress(f"{label} {name}"),
                )
                policies[name] = res.to_dict()
            # The attention bound: the same budget on the full-attention layers alone, at the
            # attention backend's block size, through the installed vLLM's own Scheduler.
            # It does not depend on the hybrid's block size: replayed once per budget.
            if gib not in attention:
                asetup = build_setup(cfg, block_size=None, attention_only=True, **common)
                attention[gib] = replay(
                    requests,
                    asetup,
                    get_policy("upstream").scheduler_class(),
                    step_ms=args.step_ms,
                    tokens_per_s=args.tokens_per_s,
                    progress=None if args.quiet else stderr_progress(f"{label} attention bound"),
                )
            ares = attention[gib]
            cached, total = infinite_bound(requests, block_size)
            runs.append(
                {
                    "model": model_name,
                    "tp": args.tp,
                    "kv_cache_gib": gib,
                    "block_size": block_size,
                    "num_requests": len(requests),
                    "attention_bound": ares.token_hit_rate,
                    "infinite_bound": cached / total,
                    "attention": ares.to_dict(),
                    "infinite": {
                        "block_size": block_size,
                        "cached_prompt_tokens": cached,
                        "prompt_tokens": total,
                    },
                    "policies": policies,
                }
            )
    report = dict(runs[0])
    report["runs"] = runs
    return report


def format_table(report: dict[str, Any]) -> str:
    """Return the human-readable table of every run in ``report``."""
    lines = []
    head = (
        f"{'run':<34} {'policy':<16} {'block':>6} {'tok hit':>8} {'req hit':>8} "
        f"{'computed tok':>14} {'states':>7} {'state GiB':>9}"
    )
    for run in report["runs"]:
        tag = f"{run['model']} tp{run['tp']} {run['kv_cache_gib']:g}GiB"
        lines.append(head)
        for name, r in run["policies"].items():
            lines.append(
                f"{tag:<34} {name:<16} {r['block_size']:>6} {r['token_hit_rate']:>8.2%} "
                f"{r['request_hit_rate']:>8.2%} {r['computed_prompt_tokens']:>14,} "
                f"{r['cached_states']:>7} {r['cached_state_bytes'] / 2**30:>9.2f}"
            )
        a = run["attention"]
        lines.append(
            f"{tag:<34} {'attention bound':<16} {a['block_size']:>6} {a['token_hit_rate']:>8.2%} "
            f"{a['request_hit_rate']:>8.2%} {a['computed_prompt_tokens']:>14,} {'-':>7} {'-':>9}"
        )
        inf = run["infinite"]
        lines.append(
            f"{tag:<34} {'infinite bound':<16} {inf['block_size']:>6} "
            f"{run['infinite_bound']:>8.2%} {'-':>8} "
            f"{inf['prompt_tokens'] - inf['cached_prompt_tokens']:>14,} {'-':>7} {'-':>9}"
        )
        lines.append(f"prompt tokens: {inf['prompt_tokens']:,} in {run['num_requests']} requests")
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
