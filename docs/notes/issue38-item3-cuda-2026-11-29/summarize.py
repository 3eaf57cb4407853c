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
        d = json.load(open(f))
    except Exception:
        continue
    if isinstance(d, dict) and "part" in d:  # cf5.py's lines (anchor_hitrate.json is hitrate's)
        runs[name] = d
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

if "-t" in sys.argv:  # the README's tables
    RETS = [("ret 0 (`ckpt`)", "ckpt_ret0", "ret0"), ("ret 1b, `ckpt=final`", "final_ret1b", "ret1b"),
            ("ret 2b, `ckpt=final`", "final_ret2b", "ret2b")]
    COLS = [("block's unit", lambda p, r: f"{p}_plain_{'ckpt_ret0' if r[1] == 'ckpt_ret0' else 'ckpt_' + r[1]}"),
            ("pmu64 as installed", lambda p, r: f"{p}_plain_pmu64_{r[1]}"),
            ("`two`", lambda p, r: f"{p}_two_pmu64_{r[1]}"),
            ("`two_coldcp`", lambda p, r: f"{p}_two_coldcp_pmu64_{r[1]}"),
            ("`two_notail`", lambda p, r: f"{p}_two_notail_pmu64_{r[1]}"),
            ("pmu=32, no exporter", lambda p, r: f"{p}_pmu32_{r[2]}")]
    g = lambda n: runs.get(n)
    hit = lambda d: 100 * d["token_hit_rate"]
    bo = lambda d: d["extra_prefill_steps_per_prompt"] - off[d["part"]]
    print("\n**Token hits / prefill steps per prompt / extra steps beyond caching off's** "
          "(bold: within the step bound, caching off + 0.05)\n")
    print("| part | retention, ckpt | " + " | ".join(c[0] for c in COLS) + " |")
    print("|---|---|" + "---|" * len(COLS))
    for p in ("fit", "check"):
        for r in RETS:
            cells = []
            for _, f in COLS:
                d = g(f(p, r))
                if d is None:
                    cells.append("-"); continue
                b = bo(d)
                s = f"{b:+.3f}"
                cells.append(f"{hit(d):.2f}% / {d['prefill_steps_per_prompt']:.2f} / "
                             + (f"**{s}**" if b <= 0.05 + 1e-12 else s))
            print(f"| {p} | {r[0]} | " + " | ".join(cells) + " |")
    print("\n**Extra prefill steps per prompt by reason** (ckpt-inv / shared / junction / other; "
          "caching off: shared only)\n")
    print("| part | retention | " + " | ".join(c[0] for c in COLS) + " |")
    print("|---|---|" + "---|" * len(COLS))
    for p in ("fit", "check"):
        for r in RETS:
            cells = []
            for _, f in COLS:
                d = g(f(p, r))
                if d is None:
                    cells.append("-"); continue
                x = d["extra_prefill_steps_by_reason"]
                other = sum(v for k, v in x.items() if k not in ("checkpoint_invalid", "shared_budget", "junction"))
                cells.append(f"{x['checkpoint_invalid']:.3f} / {x['shared_budget']:.3f} / "
                             f"{x['junction']:.3f} / {other:.3f}")
            print(f"| {p} | {r[2]} | " + " | ".join(cells) + " |")
    print("\n**The done-when, row by row** (points of token hits; pmu=32's best: its most hits over "
          "the three retentions on that part)\n")
    print("| part | ret | mode | ≥ block's unit, same ret? | ≥ pmu=32, same ret? | ≥ pmu=32 at its best? "
          "| beyond off (bound +0.05) |")
    print("|---|---|---|---|---|---|---|")
    for p in ("fit", "check"):
        best32 = max((g(f"{p}_pmu32_{r[2]}") for r in RETS if g(f"{p}_pmu32_{r[2]}")), key=hit, default=None)
        for m in ("plain_pmu64", "two_coldcp_pmu64", "two_notail_pmu64"):
            for r in RETS:
                d = g(f"{p}_{m}_{r[1]}")
                blk = g(COLS[0][1](p, r)); p32 = g(f"{p}_pmu32_{r[2]}")
                if d is None or blk is None or p32 is None or best32 is None:
                    continue
                yn = lambda a, b: f"{'yes' if a >= b else 'no'}, {a - b:+.2f}"
                b = bo(d)
                print(f"| {p} | {r[2]} | {m.replace('_pmu64', '')} | {yn(hit(d), hit(blk))} | "
                      f"{yn(hit(d), hit(p32))} | {yn(hit(d), hit(best32))} ({best32['policy']}) | "
                      f"{b:+.3f} ({'within' if b <= 0.05 + 1e-12 else 'over'}) |")
    print("\n**Host pages (stored / evicted) and partial-tail offers by path** "
          "(GDN hand-off entries off the block grid, one per GDN group; `two_notail`: keys dropped)\n")
    print("| run | stored / evicted (first evicting req) | attn_tail stored | gdn_tail stored | "
          "vLLM CoW `allocate_new_blocks` | vLLM `cache_blocks` | cf5 `two` second block | notail keys dropped (attn + GDN) |")
    print("|---|---|---|---|---|---|---|---|")
    for name, d in sorted(runs.items(), key=lambda kv: (order.index(kv[1]["part"]), kv[0])):
        if "pmu64" not in name or name.startswith("diag_"):
            continue
        t = d.get("tail_offers_by_path") or {}
        hp = d.get("host_pages") or {}
        pick = lambda s: sum(v for k, v in t.items() if k.endswith(s))
        print(f"| {name} | {d['host_store_keys']} / {d['host_evicted_keys']} ({d['host_first_evict_req']}) | "
              f"{hp.get('stored_attn_tail', 0)} | {hp.get('stored_gdn_tail', 0)} | "
              f"{pick('py:allocate_new_blocks')} | {pick(':cache_blocks')} | "
              f"{pick('cf5.py:_cache_partial_tail_block')} | "
              + (f"{d.get('skipped_attn_tail', 0)} + {d.get('skipped_gdn_tail', 0)}" if d['mode'] == 'two_notail' else "-")
              + " |")
