"""Lab counterfactual for issue 38 item 4 (2026-11-28; not a runtime capability, not part of the
lab's reports): what the step bound would see if align mode's chunk-end stops went away because
the states they exist for were written inside the step.

    python docs/notes/issue38-counterfactual-2026-11-28/cf.py KV_GIB HOST_GIB MODE POLICY
    # MODE: plain (vLLM's split as installed), unrounded (a non-final chunk that vLLM rounded down
    #       to the block keeps the tokens schedule() offered), anywhere (every align-mode stop
    #       inside the offered chunk dropped: rounding, mid-block start, junction, prompt tail);
    # POLICY: a lab policy (upstream:ret=4b,ckpt = the 16 GiB advice) or "off" (caching off)

Replays the check part (requests 1,501-3,000) of ../shared/data/mooncake_synthetic_trace.jsonl
as `advise --limit 3000` does (same arrivals, budget, model) and prints one JSON line. Only the
chunking changes: the lab's KV-cache manager still caches a GDN state only where a chunk ends on
a block boundary, so `anywhere`'s hits are a floor (the in-step checkpoints it assumes are not
modelled).
"""
import argparse, json, sys, time
from vllm_hybrid_npu_lab import advise as A
from vllm_hybrid_npu_lab.host_tier import HostLink
from vllm_hybrid_npu_lab.presets import resolve_model
from vllm_hybrid_npu_lab.trace import read_trace
from vllm_hybrid_npu_lab.scheduling.policy_base import chunk_span


def check_part(kv_gib, host_gib):
    """``(args, cfg, check, common, timing)``: advise's options, model, the check part's requests,
    engine and timing arguments as ``advise --limit 3000`` has them (also for
    ``../issue38-budget-rule-2026-11-28/replay_rule.py``)."""
    p = argparse.ArgumentParser(); A.add_arguments(p)
    args = p.parse_args(["--trace", "../shared/data/mooncake_synthetic_trace.jsonl", "--limit", "3000",
                         "--kv-cache-gib", kv_gib, "--host-cache-gib", host_gib])
    model_name, cfg = resolve_model(args.model)
    requests = read_trace(args.trace, args.limit)
    n_fit = min(len(requests) - 1, max(1, round(len(requests) * args.fit_fraction)))
    check = requests[n_fit:]
    offered = A._rate(requests)
    rate = args.tokens_per_s or (offered / args.offered_load)
    common = dict(max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                  max_model_len=max(r.input_length + r.output_length for r in requests),
                  kernel_block_size=args.kernel_block_size)
    timing = dict(step_ms=args.step_ms, tokens_per_s=rate, carry_outputs=not args.no_carry,
                  link=HostLink(args.host_link_gbps, args.host_link_latency_us))
    return args, cfg, check, common, timing


def main():
    args, cfg, check, common, timing = check_part(sys.argv[1], sys.argv[2])
    mode, policy = sys.argv[3], sys.argv[4]
    rep = A.Replayer(check, cfg, kv_cache_gib=args.kv_cache_gib, tp=args.tp, common=common, timing=timing,
                     label="cf", quiet=True)
    stats = {"unrounded": 0}
    if mode in ("unrounded", "anywhere"):
        from vllm.v1.core.sched.scheduler import Scheduler
        orig = Scheduler._mamba_block_aligned_split
        def split(self, request, num_new_tokens, local=0, external=0):
            num = orig(self, request, num_new_tokens, local, external)
            start, end = chunk_span(request, local, external)
            B = self.cache_config.block_size
            if 0 < num < num_new_tokens and (mode == "anywhere" or (start + num_new_tokens < end and
                    start + num == (start + num_new_tokens) // B * B)):
                stats["unrounded"] += 1
                return num_new_tokens
            return num
        Scheduler._mamba_block_aligned_split = split
    t = time.time()
    if policy == "off":
        r = rep.caching_off()
    else:
        from vllm_hybrid_npu_lab.policies import get_policy, setup_kwargs
        from vllm_hybrid_npu_lab.model import build_setup
        from vllm_hybrid_npu_lab.replay import replay
        pol = get_policy(policy)
        setup = build_setup(cfg, tp=args.tp, kv_cache_bytes=int(args.kv_cache_gib * (1 << 30)),
                            host_cache_bytes=int(float(args.host_cache_gib) * (1 << 30)), **setup_kwargs(pol), **common)
        r = replay(check, setup, pol.scheduler_class(), **timing).to_dict()
    out = {k: r[k] for k in ("token_hit_rate", "prefill_steps_per_prompt", "extra_prefill_steps_per_prompt",
                             "extra_prefill_steps_by_reason", "block_size", "preemptions")}
    out.update(mode=mode, policy=policy, kv=sys.argv[1], host=sys.argv[2], wall_s=round(time.time() - t), **stats)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
