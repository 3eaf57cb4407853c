"""One row per NAME.json here: token hits, steps/prompt, host pages stored/evicted, wall.

    python3 summarize.py [-v]     # -v: also each run's host pages by class (cf4.py's docstring)
"""
import glob, json, os, sys
here = os.path.dirname(os.path.abspath(__file__))
rows = []
for f in sorted(glob.glob(os.path.join(here, "*.json"))):
    name = os.path.basename(f)[:-5]
    try:
        d = json.load(open(f))
    except Exception:
        continue
    wall = open(f[:-5] + ".cmd").read().strip().splitlines()[-1]
    mr = d["miss_reasons"] or {}
    rows.append((d["part"], name, d["mode"], d["policy"], d["host"], 100 * d["token_hit_rate"],
                 d["prefill_steps_per_prompt"], d["extra_prefill_steps_per_prompt"],
                 d["host_store_keys"], d["host_evicted_keys"], d["host_first_evict_req"],
                 d.get("host_store_gib"), mr.get("evicted_host"), mr.get("no_state"), mr.get("partial_block"),
                 d["device_cached_prompt_tokens"], d["host_cached_prompt_tokens"], wall))
print("| part | name | mode | policy | host GiB | token hits | steps/prompt | extra | host pages stored | "
      "evicted | first evict (req) | host store GiB | evicted_host tok | no_state | partial_block | "
      "device hits | host hits | wall |")
print("|" + "---|" * 18)
for r in sorted(rows, key=lambda r: (["fit", "check", "rest"].index(r[0]), r[1])):
    print("| " + " | ".join(f"{x:.2f}%" if i == 5 else f"{x:.3f}" if isinstance(x, float) else str(x)
                            for i, x in enumerate(r)) + " |")
if "-v" in sys.argv:
    for f in sorted(glob.glob(os.path.join(here, "*.json"))):
        d = json.load(open(f))
        if d.get("host_pages"):
            print(os.path.basename(f), json.dumps(d["host_pages"]))
