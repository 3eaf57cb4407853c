"""Count the GDN states each setting offers the host tier, by where they sit in the prompt.

Diagnostic for the notes of this folder (not part of the lab): replays the check part under one
policy with MambaManager.cache_blocks wrapped (this process only) and records, for every state
block offered to the OffloadingConnector (`_pending_boundary_state_offloads`, one per GDN group),
its boundary in tokens; and SimulatedOffloadWorker.submit wrapped to count the blocks stored per
KV-cache group. Prints JSON.

usage: PYTHONPATH=/work/wt-h15 python count_states.py TRACE POLICY [--block-size B] [--limit N]
       [--host-cache-gib G]
"""
import argparse
import collections
import json


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("policy")
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--host-cache-gib", type=float, default=256)
    ap.add_argument("--kv-cache-gib", type=float, default=16)
    ap.add_argument("--tokens-per-s", type=float, default=104566)
    a = ap.parse_args()

    from vllm.v1.core.single_type_kv_cache_manager import MambaManager

    from vllm_hybrid_npu_lab import host_tier
    from vllm_hybrid_npu_lab.model import build_setup
    from vllm_hybrid_npu_lab.policies import get_policy, setup_kwargs
    from vllm_hybrid_npu_lab.presets import resolve_model
    from vllm_hybrid_npu_lab.replay import replay
    from vllm_hybrid_npu_lab.trace import read_trace

    offered = []  # (request id, group, boundary tokens, prompt tokens)
    orig_cache = MambaManager.cache_blocks

    def cache_blocks(self, request, num_tokens, *args, **kw):
        pend = getattr(self, "_pending_boundary_state_offloads", None)
        n0 = len(pend) if pend is not None else 0
        out = orig_cache(self, request, num_tokens, *args, **kw)
        pend = getattr(self, "_pending_boundary_state_offloads", None)
        if pend is not None:
            for rid, gid, _blk, ntok in pend[n0:]:
                offered.append((rid, gid, ntok, request.num_prompt_tokens))
        return out

    MambaManager.cache_blocks = cache_blocks
    stored = collections.Counter()
    orig_submit = host_tier.SimulatedOffloadWorker.submit

    def submit(self, meta, now):
        if meta is not None:
            for entry in meta.store_jobs.values():
                sizes = getattr(entry.src_spec, "group_sizes", None)
                if sizes is not None:
                    for g, n in enumerate(sizes):
                        stored[g] += int(n)
        return orig_submit(self, meta, now)

    host_tier.SimulatedOffloadWorker.submit = submit

    _, cfg = resolve_model("qwen3.5-35b-a3b")
    reqs = read_trace(a.trace, a.limit)
    pol = get_policy(a.policy)
    setup = build_setup(cfg, kv_cache_bytes=int(a.kv_cache_gib * (1 << 30)),
                        host_cache_bytes=int(a.host_cache_gib * (1 << 30)),
                        block_size=a.block_size,
                        max_model_len=max(r.input_length + r.output_length for r in reqs),
                        **setup_kwargs(pol))
    res = replay(reqs, setup, pol.scheduler_class(), tokens_per_s=a.tokens_per_s)
    B = setup.block_size
    ret = getattr(setup.vllm_config.cache_config, "prefix_cache_retention_interval", None)
    # one row per (request, boundary): group 0 of the GDN groups only (all GDN groups offer alike)
    g0 = min((g for _, g, _, _ in offered), default=None)
    kinds = collections.Counter()
    per_req = collections.Counter()
    for rid, g, ntok, nprompt in offered:
        if g != g0:
            continue
        per_req[rid] += 1
        last = (nprompt - 1) // B * B
        if ntok == last:
            kinds["last_block_boundary"] += 1
        elif ntok > nprompt:
            kinds["past_prompt"] += 1
        elif ret and ntok % ret == 0:
            kinds["retention_multiple"] += 1
        else:
            kinds["other"] += 1
    examples = collections.defaultdict(list)
    for rid, g, ntok, nprompt in offered:
        if g == g0 and len(examples) < 12 or rid in examples:
            if g == g0:
                examples[rid].append((ntok // B, nprompt))
    print(json.dumps({
        "policy": a.policy, "block_size": B, "retention_interval_tokens": ret,
        "requests": len(reqs), "token_hit_rate": res.token_hit_rate,
        "states_offered_per_gdn_group": sum(kinds.values()), "by_position": dict(kinds),
        "requests_offering": len(per_req),
        "blocks_stored_per_group": dict(stored),
        "group_block_bytes": host_tier.group_block_bytes(setup.kv_cache_config),
        "examples_blocks_offered_and_prompt_tokens": {k: v for k, v in examples.items()},
    }, indent=1))


if __name__ == "__main__":
    main()
