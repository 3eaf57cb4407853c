"""Print one row per (file, policy) of the hitrate JSONs given: hits, steps, miss reasons (tokens)."""
import json, sys
R = ("partial_block", "no_state", "evicted", "evicted_host", "new")
print(f"{'file':<34} {'policy':<24} {'blk':>5} {'host':>5} {'tok hit':>7} {'dev':>6} {'hostH':>6} {'steps':>5} {'extra':>5} "
      + " ".join(f"{r[:9]:>9}" for r in R) + f" {'states':>6} {'nblk':>5}")
for f in sys.argv[1:]:
    d = json.load(open(f))
    for run in d["runs"]:
        for p, r in run["policies"].items():
            if p == "upstream-best":
                continue
            m = r["miss_reasons"]
            print(f"{f.split('/')[-1][:34]:<34} {p:<24} {r['block_size']:>5} {run['host_cache_gib']:>5g} "
                  f"{r['token_hit_rate']:>7.2%} {r['device_cached_prompt_tokens']/r['prompt_tokens']:>6.2%} "
                  f"{r['host_cached_prompt_tokens']/r['prompt_tokens']:>6.2%} "
                  f"{r['prefill_steps_per_prompt']:>5.2f} {r['extra_prefill_steps_per_prompt']:>5.2f} "
                  + " ".join(f"{m[k]:>9}" for k in R) + f" {r['cached_states']:>6} {r['num_blocks']:>5}")
