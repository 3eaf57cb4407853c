"""Per prompt, with a host tier: what the host held, what was hit, why the rest missed (issue 33).

``python -m vllm_hybrid_npu_lab.host_breakdown (--demo | --trace FILE) [--model M]
[--kv-cache-gib X] [--host-cache-gib H] [--policy NAME ...] [--block-size N] [--requests I,J,...]
[--tokens-per-s T] [--json]``

Each policy's replay (:func:`vllm_hybrid_npu_lab.replay.replay`, unchanged) reports per prompt:

* ``hit`` and ``host_hit``: prompt tokens found cached at first scheduling, and the part vLLM's
  OffloadingConnector loaded from the host tier;
* ``held``: the boundaries of the prompt's prefix (tokens) at which the host tier held an entry of
  *every* KV-cache group when the prompt was first scheduled (:func:`host_boundaries`): a GDN state
  there and the attention block ending there, what a host hit at that boundary needs;
* ``held_not_loaded``: tokens between the hit and the furthest boundary the host held below the
  prompt's last token (0 when the connector loaded all it could see);
* ``miss``: the lab's miss reasons (``vllm_hybrid_npu.core.miss_reasons``) of the prompt.

``--demo`` replays :func:`exporter_host_trace`, built to show where the exporter's host-tier hits
differ from vLLM's split (docs/hitrate-lab.md, "The exporter with a host tier").
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from vllm_hybrid_npu_lab.trace import TraceRequest

#: the demonstration's policies: vLLM's split and the exporter, at the block and at a 32-token
#: prefix-match unit
DEMO_POLICIES = ("upstream", "upstream:ckpt", "upstream:pmu=32", "upstream:pmu=32,ckpt")


def host_boundaries(scheduler: Any, request: Any) -> list[int]:
    """Boundaries (tokens) of ``request``'s prompt at which the host tier holds every group.

    A boundary is a multiple of the connector's hash block (``--prefix-match-unit`` or the block)
    below the prompt's last token; it counts when the host tier's manager answers ``HIT`` for the
    key of every KV-cache group there (``make_offload_key(block hash, group)``, as vLLM 0.30 /
    0.32's ``OffloadingConnectorScheduler`` keys its entries). The lookup has no side effect (the
    CPU manager's ``lookup`` only reads its policy's table).

    Args:
        scheduler: a vLLM ``Scheduler`` built with the OffloadingConnector (else the answer is
            ``[]``).
        request: a ``Request`` the connector has seen (``add_request``).

    Returns:
        The boundaries in increasing order (list of int, tokens).
    """
    from vllm.v1.kv_offload.base import LookupResult, make_offload_key

    cs = getattr(getattr(scheduler, "connector", None), "connector_scheduler", None)
    status = getattr(cs, "_req_status", {}).get(request.request_id) if cs is not None else None
    if status is None:
        return []
    unit = cs.config.tokens_per_hash
    groups = [g.group_idx for g in cs.config.kv_group_configs]
    hashes = request.block_hashes[: (request.num_prompt_tokens - 1) // unit]
    return [
        (j + 1) * unit for j, h in enumerate(hashes)
        if all(cs.manager.lookup(make_offload_key(h, g), status.req_context) is LookupResult.HIT
               for g in groups)
    ]


def exporter_host_trace() -> list[TraceRequest]:
    """The demonstration trace (for Qwen3.5-35B-A3B at tp 1: vLLM's block 1,056 tokens, the
    exporter's 1,088), requests 60 s apart, 4 answer tokens each:

    1. ``A``: 17,000 tokens (34 trace blocks). Its last boundary is 16 x 1,056 = 16,896 on vLLM's
       block, 15 x 1,088 = 16,320 on the exporter's.
    2. ``B``: 17,500 tokens (35 blocks): 16,896 on vLLM's block, 16 x 1,088 = 17,408 on the
       exporter's.
    3. ``C``: 5,000 tokens (10 blocks): its last 32-token boundary 4,992 is a multiple of 64 (the
       exporter writes its checkpoint there) but not of 1,056 or 1,088.
    4. - 7. four distinct 30,000-token prompts: 120,000 tokens, more than a 2 GiB device cache
       holds (99 blocks of 1,056 tokens), so the device keeps nothing of 1-3.
    8. - 10. ``A``, ``B``, ``C`` again: whatever they hit comes from the host tier.
    """
    ids = iter(range(1_000_000, 2_000_000))
    a, b, c = ([next(ids) for _ in range(k)] for k in (34, 35, 10))
    rows = [(17_000, a), (17_500, b), (5_000, c)]
    rows += [(30_000, [next(ids) for _ in range(59)]) for _ in range(4)]
    rows += [(17_000, a), (17_500, b), (5_000, c)]
    return [TraceRequest(60_000.0 * i, n, 4, tuple(h)) for i, (n, h) in enumerate(rows)]


def breakdown(requests: list[TraceRequest], cfg: dict[str, Any], policy: str, *,
              kv_cache_gib: float, host_cache_gib: float, block_size: int | None = None,
              tokens_per_s: float = 20_000.0, carry: bool = True) -> dict[str, Any]:
    """Replay ``requests`` under ``policy`` and return its per-prompt rows.

    Args:
        requests: the trace.
        cfg: the model's text config (:func:`vllm_hybrid_npu_lab.presets.resolve_model`).
        policy: a lab policy name (``upstream:...``).
        kv_cache_gib, host_cache_gib: device KV cache and host tier per worker, GiB.
        block_size: ``--block-size`` (tokens; None: vLLM's pick for the setting).
        tokens_per_s: simulated throughput, scheduled tokens/s.
        carry: carry an earlier turn's answer into the next prompt.

    Returns:
        ``{"policy", "block_size", "hash_block_size", "token_hit_rate", "rows": [...]}``, a row
        per request: ``request`` (1-based), ``prompt_tokens``, ``hit``, ``host_hit``, ``held``,
        ``held_not_loaded``, ``miss`` (reason -> tokens).

    Raises:
        ValueError: from vLLM's config checks, naming the flag (e.g. ``--kv-cache-gib``).
    """
    from vllm_hybrid_npu_lab.model import build_setup
    from vllm_hybrid_npu_lab.policies import get_policy, setup_kwargs
    from vllm_hybrid_npu_lab.replay import replay

    pol = get_policy(policy)
    setup = build_setup(cfg, kv_cache_bytes=int(kv_cache_gib * (1 << 30)),
                        host_cache_bytes=int(host_cache_gib * (1 << 30)), block_size=block_size,
                        max_model_len=max(r.input_length + r.output_length for r in requests),
                        **setup_kwargs(pol))
    held: dict[str, list[int]] = {}
    res = replay(requests, setup, pol.scheduler_class(), tokens_per_s=tokens_per_s,
                 carry_outputs=carry,
                 on_admit=lambda sched, req: held.__setitem__(req.request_id,
                                                              host_boundaries(sched, req)))
    unit = setup.hash_block_size
    rows = []
    for i, r in enumerate(requests):
        hit = res.cached_per_request[i]
        reach = (r.input_length - 1) // unit * unit
        h = held.get(str(i), [])
        rows.append({
            "request": i + 1,
            "prompt_tokens": r.input_length,
            "hit": hit,
            "host_hit": res.host_per_request[i],
            "held": h,
            "held_not_loaded": max(0, max((b for b in h if b <= reach), default=0) - hit),
            "miss": {k: v for k, v in (res.miss_per_request[i] if res.miss_per_request else {}
                                      ).items() if v},
        })
    return {"policy": policy, "block_size": setup.block_size, "hash_block_size": unit,
            "token_hit_rate": res.token_hit_rate, "rows": rows}


def _held(h: list[int]) -> str:
    if not h:
        return "-"
    if len(h) <= 4:
        return ", ".join(f"{b:,}" for b in h)
    return f"{len(h)} boundaries, {h[0]:,} ... {h[-1]:,}"


def markdown(reports: list[dict[str, Any]], requests: list[int] | None = None) -> str:
    """The reports as one markdown table (rows of ``requests``, 1-based; all when None)."""
    lines = ["| policy (block) | request | prompt tokens | host held (all groups) | hit "
             "(from host) | held, not loaded | miss reasons |", "|---|---|---|---|---|---|---|"]
    for rep in reports:
        for row in rep["rows"]:
            if requests is not None and row["request"] not in requests:
                continue
            miss = ", ".join(f"{k} {v:,}" for k, v in row["miss"].items())
            lines.append(f"| `{rep['policy']}` ({rep['block_size']:,}) | {row['request']} | "
                         f"{row['prompt_tokens']:,} | {_held(row['held'])} | {row['hit']:,} "
                         f"({row['host_hit']:,}) | {row['held_not_loaded']:,} | {miss or '-'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point (see module docstring); 2 after a clear error for bad input."""
    from vllm_hybrid_npu_lab.presets import DEFAULT_MODEL, resolve_model
    from vllm_hybrid_npu_lab.trace import read_trace

    p = argparse.ArgumentParser(prog="python -m vllm_hybrid_npu_lab.host_breakdown")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--demo", action="store_true", help="replay exporter_host_trace()")
    src.add_argument("--trace", help="Mooncake-format JSONL trace")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"preset or model dir (default {DEFAULT_MODEL})")
    p.add_argument("--kv-cache-gib", type=float, default=2.0, help="device KV cache per worker, GiB (default 2)")
    p.add_argument("--host-cache-gib", type=float, default=8.0, help="host tier per worker, GiB (default 8)")
    p.add_argument("--policy", nargs="+", default=list(DEMO_POLICIES), help="lab policies (default: "
                   + " ".join(DEMO_POLICIES) + ")")
    p.add_argument("--block-size", type=int, default=None, help="block size, tokens (default: vLLM's)")
    p.add_argument("--requests", default=None, help="rows to print, 1-based, comma-separated (default all)")
    p.add_argument("--tokens-per-s", type=float, default=20_000.0,
                   help="simulated throughput, scheduled tokens/s (default 20000)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a markdown table")
    args = p.parse_args(argv)
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    try:
        if not args.kv_cache_gib > 0:
            raise ValueError(f"--kv-cache-gib must be > 0, got {args.kv_cache_gib}")
        if not args.host_cache_gib > 0:
            raise ValueError(f"--host-cache-gib must be > 0, got {args.host_cache_gib}")
        if not args.tokens_per_s > 0:
            raise ValueError(f"--tokens-per-s must be > 0, got {args.tokens_per_s}")
        try:
            rows = None if args.requests is None else [int(x) for x in args.requests.split(",")]
        except ValueError:
            raise ValueError(f"--requests {args.requests!r}: comma-separated request numbers") from None
        requests = exporter_host_trace() if args.demo else read_trace(args.trace)
        _, cfg = resolve_model(args.model)
        reports = [breakdown(requests, cfg, pol, kv_cache_gib=args.kv_cache_gib,
                             host_cache_gib=args.host_cache_gib, block_size=args.block_size,
                             tokens_per_s=args.tokens_per_s) for pol in args.policy]
    except ValueError as exc:
        print(f"host_breakdown: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(reports, indent=1) if args.json else markdown(reports, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
