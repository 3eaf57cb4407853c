"""One row per NAME.json here: token hits, prefill steps per prompt, extra steps beyond caching
off's (that part's NAME = PART_caching_off), the step bound (caching off + 0.05), the extra steps
by reason, host pages stored/evicted, partial-tail offers by path, wall.

    python3 summarize.py [-v]     # -v: also each run's host pages by class (cf5.py's docstring)
"""
import glob, json, os, sys
here = os.path.dirname(os.path.abspath(__file__))
runs = {}
for f in sorted(glob.glob(os.path.join(here, "*.json"))):
    name = os.path.basename(f)[:-5]
    try:
        runs[name] = json.load(open(f))
    except Exception:
        continue
off = {d["part"]: d["extra_prefill_steps_per_prompt"] for n, d in runs.items()
       if n.endswith("_caching_off")}
SHORT = {"checkpoint_invalid": "ckpt-inv", "shared_budget": "shared", "mid_block_start": "mid-blk",
         "junction": "junction", "block_rounding": "rounding", "prompt_tail": "tail",
         "long_prefill": "lpt", "preemption": "preempt", "policy_stop": "policy", "unexplained": "unexpl"}
print("| part | name | mode | policy | token hits | steps/prompt | extra | beyond off | within bound "
      "(off + 0.05) | extra by reason | host pages stored / evicted (first evicting req) | "
      "device / host hit tok | tail offers by path (GDN entries) | tail keys skipped | wall |")
print("|" + "---|" * 15)
order = ["fit", "check", "rest"]
for name, d in sorted(runs.items(), key=lambda kv: (order.index(kv[1]["part"]), kv[0])):
    ex = d["extra_prefill_steps_per_prompt"]
    o = off.get(d["part"])
    beyond = None if o is None else ex - o
    within = "-" if beyond is None or name.endswith("_caching_off") else ("yes" if beyond <= 0.05 + 1e-12 else "no")
    reasons = ", ".join(f"{SHORT.get(k, k)} {v:.3f}" for k, v in
                        (d.get("extra_prefill_steps_by_reason") or {}).items() if v)
    tails = ", ".join(f"{k.split(':')[-1]} ({k.split(':')[0]}) {v}" for k, v in
                      (d.get("tail_offers_by_path") or {}).items())
    skipped = (f"{d.get('skipped_attn_tail', 0)} attn + {d.get('skipped_gdn_tail', 0)} GDN"
               if d["mode"] == "two_notail" else "")
    wall = open(os.path.join(here, name + ".cmd")).read().strip().splitlines()[-1]
    cells = [d["part"], name, d["mode"], d["policy"], f"{100 * d['token_hit_rate']:.2f}%",
             f"{d['prefill_steps_per_prompt']:.3f}", f"{ex:.3f}",
             "-" if beyond is None else f"{beyond:+.3f}", within, reasons,
             f"{d['host_store_keys']} / {d['host_evicted_keys']} ({d['host_first_evict_req']})",
             f"{d['device_cached_prompt_tokens']:,} / {d['host_cached_prompt_tokens']:,}",
             tails, skipped, wall]
    print("| " + " | ".join(str(c) for c in cells) + " |")
if "-v" in sys.argv:
    for name, d in sorted(runs.items()):
        if d.get("host_pages"):
            print(name, json.dumps(d["host_pages"]))
