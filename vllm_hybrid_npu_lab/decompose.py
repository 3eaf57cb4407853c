"""Where the hybrid's hit rate goes: a replay instrumented to split the gap to the attention bound.

``python -m vllm_hybrid_npu_lab.decompose --trace FILE [--model M] [--tp N] [--kv-cache-gib X]
[--limit N] [--policy NAME ...] [--sample-every STEPS]`` (prints one JSON object)

For each policy the replay (:func:`vllm_hybrid_npu_lab.replay.replay`, unchanged) runs a
subclass of the policy's scheduler that only *observes*:

* per request, at the ``KVCacheManager.get_computed_blocks`` call that admitted it (vLLM 0.30,
  ``vllm/v1/core/kv_cache_manager.py``): the hit (tokens) and the full-attention group's own
  longest hit (hit + ``shared_prefix_boundary`` gap: attention blocks were cached further, but no
  GDN state existed at or past the hit's end). The difference, summed, is **state-miss tokens**:
  prefix the attention KV held that the hybrid could not use for lack of a state.
* every ``--sample-every`` steps, the block pool (``BlockPool.blocks``, one page set per block):
  blocks held by running requests per group kind (attention / GDN state), free blocks holding a
  cached attention block or a cached state, and of the cached attention blocks those that are
  **orphans** (no cached state in every GDN group at the end of a fully cached attention chain
  through them, so they can never be part of a hit) and cached states that are **dead** (their
  attention prefix is not fully cached). Averages over the samples are reported as shares of
  the pool.

The chains are rebuilt from the requests' block hashes (hash block size = the hybrid block
size, as vLLM resolves it for these presets; ``ValueError`` otherwise).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter, defaultdict
from typing import Any


def instrument(base: type, sample_every: int = 20) -> tuple[type, dict[str, Any]]:
    """Return ``(subclass of base, stats dict)``; the subclass records what the module doc says.

    ``stats`` is filled during the replay: ``probe`` (request id -> ``(hit, attention_hit)``
    tokens at admission), ``samples`` (list of per-sample dicts of block counts).
    """
    stats: dict[str, Any] = {"probe": {}, "samples": [], "parent": {}}

    class Instrumented(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            from vllm.v1.kv_cache_interface import MambaSpec

            mgr = self.kv_cache_manager
            groups = mgr.kv_cache_config.kv_cache_groups
            self._mamba_gids = [
                i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, MambaSpec)
            ]
            self._attn_gids = [i for i in range(len(groups)) if i not in self._mamba_gids]
            self._steps = 0
            self._decompose_parent = stats["parent"]
            orig = mgr.get_computed_blocks
            pending: dict[str, tuple[int, int]] = {}
            self._pending = pending

            def get_computed_blocks(request: Any):  # type: ignore[no-untyped-def]
                blocks, hit, boundary = orig(request)
                pending[request.request_id] = (hit, max(hit, boundary))
                return blocks, hit, boundary

            mgr.get_computed_blocks = get_computed_blocks

        def add_request(self, request: Any) -> None:
            parent = stats["parent"]
            prev = None
            for h in request.block_hashes:
                parent.setdefault(bytes(h), prev)
                prev = bytes(h)
            super().add_request(request)

        def schedule(self):  # type: ignore[no-untyped-def]
            out = super().schedule()
            for new in out.scheduled_new_reqs:
                if new.req_id in self._pending and new.req_id not in stats["probe"]:
                    stats["probe"][new.req_id] = self._pending[new.req_id]
            self._pending.clear()
            self._steps += 1
            if self._mamba_gids and self._steps % sample_every == 0:
                stats["samples"].append(_sample(self))
            return out

    return Instrumented, stats


def _sample(sched: Any) -> dict[str, int]:
    """Block counts of the pool now (see the module doc); one pass over ``BlockPool.blocks``."""
    from vllm.v1.core.kv_cache_utils import get_block_hash, get_group_id

    pool = sched.kv_cache_manager.block_pool
    mamba = set(sched._mamba_gids)
    attn = set(sched._attn_gids)
    # running blocks per kind (distinct block ids with ref_cnt > 0)
    running = {"attn": set(), "state": set()}
    for gid, mgr in enumerate(sched.kv_cache_manager.coordinator.single_type_managers):
        kind = "state" if gid in mamba else "attn"
        for blocks in mgr.req_to_blocks.values():
            for b in blocks:
                if not b.is_null and b.ref_cnt > 0:
                    running[kind].add(b.block_id)
    cached_attn: set[bytes] = set()
    state_groups: dict[bytes, set[int]] = defaultdict(set)
    free_attn_blocks: dict[bytes, int] = {}
    free_state_blocks = 0
    for block in pool.blocks:
        if block.is_null:
            continue
        keys = set(pool.cached_block_hashes_by_block.get(block.block_id, ()))
        if block.block_hash is not None:
            keys.add(block.block_hash)
        for key in keys:
            gid = get_group_id(key)
            h = bytes(get_block_hash(key))
            if gid in attn:
                cached_attn.add(h)
                if block.ref_cnt == 0:
                    free_attn_blocks[h] = block.block_id
            elif gid in mamba:
                state_groups[h].add(gid)
        if block.ref_cnt == 0 and keys and any(get_group_id(k) in mamba for k in keys):
            free_state_blocks += 1
    parent = sched._decompose_parent
    useful: set[bytes] = set()
    live_states = dead_states = 0
    for h, gids in state_groups.items():
        if gids != mamba:
            dead_states += 1
            continue
        chain = []
        cur: bytes | None = h
        ok = True
        while cur is not None:
            if cur not in cached_attn:
                ok = False
                break
            chain.append(cur)
            cur = parent.get(cur)
        if ok:
            live_states += 1
            useful.update(chain)
        else:
            dead_states += 1
    orphan_free = sum(1 for h in free_attn_blocks if h not in useful)
    free_total = pool.get_num_free_blocks()
    return {
        "pool": pool.num_gpu_blocks - 1,
        "running_attn": len(running["attn"]),
        "running_state": len(running["state"]),
        "free_cached_attn": len(free_attn_blocks),
        "free_cached_attn_orphan": orphan_free,
        "free_cached_state": free_state_blocks,
        "states_live": live_states,
        "states_dead": dead_states,
        "free_total": free_total,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Replay every ``--policy`` instrumented; return ``{policy: numbers}`` (see module doc)."""
    from vllm_hybrid_npu_lab.model import build_setup
    from vllm_hybrid_npu_lab.policies import get_policy
    from vllm_hybrid_npu_lab.presets import resolve_model
    from vllm_hybrid_npu_lab.replay import replay
    from vllm_hybrid_npu_lab.trace import read_trace

    _, cfg = resolve_model(args.model)
    requests = read_trace(args.trace, args.limit)
    max_model_len = max(r.input_length + r.output_length for r in requests)
    report: dict[str, Any] = {}
    for name in args.policy:
        pol = get_policy(name)
        setup = build_setup(
            cfg,
            tp=args.tp,
            kv_cache_bytes=int(args.kv_cache_gib * (1 << 30)),
            max_model_len=max_model_len,
            configure=pol.configure,
        )
        if setup.hash_block_size != setup.block_size:
            raise ValueError("decompose needs hash block size == block size")
        cls, stats = instrument(pol.scheduler_class(), args.sample_every)
        res = replay(requests, setup, cls)
        probes = stats["probe"].values()
        hit = sum(p[0] for p in probes)
        att = sum(p[1] for p in probes)
        samples = stats["samples"]
        avg = {
            k: sum(s[k] for s in samples) / max(1, len(samples))
            for k in (samples[0] if samples else {})
        }
        report[name] = {
            "token_hit_rate": res.token_hit_rate,
            "prompt_tokens": res.prompt_tokens,
            "hit_tokens": hit,
            "attention_group_hit_tokens": att,
            "state_miss_tokens": att - hit,
            "computed_prompt_tokens": res.computed_prompt_tokens,
            "preemptions": res.preemptions,
            "cached_states_end": res.cached_states,
            "pool_blocks": setup.num_blocks,
            "avg": avg,
            "samples": len(samples),
            "hit_blocks": dict(sorted(Counter(p[0] // setup.block_size for p in probes if p[0]).items())),
            "attention_hit_blocks": dict(sorted(Counter(p[1] // setup.block_size for p in probes if p[1]).items())),
        }
        print(f"{name}: {json.dumps(report[name])}", file=sys.stderr, flush=True)
    return report


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point (see module doc); prints JSON."""
    p = argparse.ArgumentParser(prog="python -m vllm_hybrid_npu_lab.decompose")
    p.add_argument("--trace", required=True)
    p.add_argument("--model", default="qwen3.5-35b-a3b")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--kv-cache-gib", type=float, default=16.0)
    p.add_argument("--limit", type=int, default=1500)
    p.add_argument("--policy", nargs="+", default=["upstream", "lean"])
    p.add_argument("--sample-every", type=int, default=20)
    args = p.parse_args(argv)
    # vLLM logs to stdout by default; keep stdout for the JSON (as the hitrate CLI does)
    import os

    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    print(json.dumps(run(args), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
