"""Each row here that ../issue38-item3-final-2026-11-29 also ran (same NAME, same command but
cf4.py at main 01d6107): token hits, prefill steps per prompt and the junction / ckpt-inv /
shared reasons, old -> new.   python3 compare_old.py
"""
import glob, json, os
here = os.path.dirname(os.path.abspath(__file__))
old = os.path.join(here, "..", "issue38-item3-final-2026-11-29")
print("| run | token hits | steps/prompt | junction | ckpt-inv | shared | mid-blk | host pages stored |")
print("|---|---|---|---|---|---|---|---|")
for f in sorted(glob.glob(os.path.join(here, "*.json"))):
    n = os.path.basename(f)
    o = os.path.join(old, n)
    if n.startswith("diag_") or not os.path.exists(o):
        continue
    d, e = json.load(open(f)), json.load(open(o))
    if "part" not in d:
        continue
    r = lambda x, k: x["extra_prefill_steps_by_reason"][k]
    a = lambda k: f"{r(e, k):.3f} -> {r(d, k):.3f}"
    print(f"| {n[:-5]} | {100 * e['token_hit_rate']:.2f}% -> {100 * d['token_hit_rate']:.2f}% | "
          f"{e['prefill_steps_per_prompt']:.3f} -> {d['prefill_steps_per_prompt']:.3f} | {a('junction')} | "
          f"{a('checkpoint_invalid')} | {a('shared_budget')} | {a('mid_block_start')} | "
          f"{e['host_store_keys']} -> {d['host_store_keys']} |")
