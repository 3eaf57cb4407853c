"""The README's tables: this folder's cf7.py JSONs (`two_notail+skipinv`) against, at 16 GiB +
256 GiB host, the block's unit, `two_notail` and pmu=32 without the exporter (item3-cuda's cf5.py
JSONs) and `skipinv` (the skipinv folder's cf6.py JSONs). Caching off from item3-cuda.

    python3 summarize.py            # markdown tables on stdout
"""
import json, os

here = os.path.dirname(os.path.abspath(__file__))
item3 = os.path.join(here, "..", "issue38-item3-cuda-2026-11-29")
skip = os.path.join(here, "..", "issue38-skipinv-2026-11-29")


def load(d, name):
    try:
        x = json.load(open(os.path.join(d, name + ".json")))
    except Exception:
        return None
    return x if isinstance(x, dict) and "token_hit_rate" in x else None


OFF = {p: load(item3, f"{p}_caching_off")["extra_prefill_steps_per_prompt"] for p in ("fit", "check")}
BEST32 = {p: max(100 * load(item3, f"{p}_pmu32_{r}")["token_hit_rate"] for r in ("ret0", "ret1b", "ret2b"))
          for p in ("fit", "check")}
RETS = [("0", "ckpt_ret0", "plain_ckpt_ret0", "ret0"),
        ("1b", "final_ret1b", "plain_ckpt_final_ret1b", "ret1b"),
        ("2b", "final_ret2b", "plain_ckpt_final_ret2b", "ret2b")]


def cols(part, r):
    _, tag, blk, r32 = r
    return {"block's unit": load(item3, f"{part}_{blk}"),
            "pmu=32, no exporter": load(item3, f"{part}_pmu32_{r32}"),
            "`two_notail`": load(item3, f"{part}_two_notail_pmu64_{tag}"),
            "`skipinv`": load(skip, f"{part}_skipinv_host_{tag}"),
            "`two_notail+skipinv`": load(here, f"{part}_notail_skipinv_{tag}")}


def cell(part, d):
    if d is None:
        return "-"
    b = d["extra_prefill_steps_per_prompt"] - OFF[part]
    s = f"{b:+.3f}"
    if b <= 0.05 + 1e-9:
        s = f"**{s}**"
    return f"{100 * d['token_hit_rate']:.2f}% / {d['prefill_steps_per_prompt']:.3f} / {s}"


def why(d):
    if d is None:
        return "-"
    w = d.get("extra_prefill_steps_by_reason") or {}
    rest = sum(v for k, v in w.items() if k not in ("checkpoint_invalid", "shared_budget", "junction"))
    return " / ".join(f"{w.get(k, 0):.3f}" for k in ("checkpoint_invalid", "shared_budget", "junction")) + f" / {rest:.3f}"


names = list(cols("fit", RETS[0]))
print("Token hits / prefill steps per prompt / extra steps beyond caching off "
      f"(caching off: fit {OFF['fit']:.3f}, check {OFF['check']:.4f}; **bold**: within +0.05)\n")
print("| part | ret | " + " | ".join(names) + " |")
print("|---|---|" + "---|" * len(names))
for part in ("fit", "check"):
    for r in RETS:
        c = cols(part, r)
        print(f"| {part} | {r[0]} | " + " | ".join(cell(part, c[n]) for n in names) + " |")

print("\nExtra prefill steps per prompt by reason: `checkpoint_invalid` / `shared_budget` / "
      "`junction` / the rest\n")
print("| part | ret | " + " | ".join(names) + " |")
print("|---|---|" + "---|" * len(names))
for part in ("fit", "check"):
    for r in RETS:
        c = cols(part, r)
        print(f"| {part} | {r[0]} | " + " | ".join(why(c[n]) for n in names) + " |")

print(f"\nThe criterion for `two_notail+skipinv` (points of token hits; pmu=32 at its best: fit "
      f"{BEST32['fit']:.2f}%, check {BEST32['check']:.2f}%)\n")
print("| part | ret | - block's unit (same ret) | - pmu=32 at its best | - `two_notail` | - `skipinv` | beyond off | all met? |")
print("|---|---|---|---|---|---|---|---|")
for part in ("fit", "check"):
    for r in RETS:
        c = cols(part, r)
        x = c["`two_notail+skipinv`"]
        if x is None:
            print(f"| {part} | {r[0]} | not run | | | | | |")
            continue
        h = 100 * x["token_hit_rate"]
        d = {n: h - 100 * c[n]["token_hit_rate"] for n in ("block's unit", "`two_notail`", "`skipinv`")}
        d32 = h - BEST32[part]
        b = x["extra_prefill_steps_per_prompt"] - OFF[part]
        ok = d["block's unit"] >= 0 and d32 >= 0 and b <= 0.05 + 1e-9
        db, dn, ds = d["block's unit"], d["`two_notail`"], d["`skipinv`"]
        print(f"| {part} | {r[0]} | {db:+.2f} | {d32:+.2f} | {dn:+.2f} | {ds:+.2f} | {b:+.3f} | "
              f"{'yes' if ok else 'no'} |")

print("\ncf7's composition check, skipinv counts and host pages per run\n")
print("| run | composed | flipped (cold / on block / mid-block) | split whole / cut | extra_taken | skipped tails (attn / GDN) | GDN keys on flipped chunks | host hit tokens (device / host) | miss `no_state` / `evicted_host` |")
print("|---|---|---|---|---|---|---|---|---|")
for part in ("fit", "check"):
    for r in RETS:
        name = f"{part}_notail_skipinv_{r[1]}"
        x = load(here, name)
        if x is None:
            continue
        si, a, m = x["skipinv"], x["cf7"]["active"], x["miss_reasons"]
        fs = si.get("flipped_by_start", {})
        keys = {}
        for k, v in si.get("keys", {}).items():
            cls = k.split(":", 1)[1]
            keys[cls] = keys.get(cls, 0) + v
        print(f"| {name} | {a['composed']} | {si['flipped']} ({fs.get('cold', 0)} / {fs.get('hit_on_block', 0)} / "
              f"{fs.get('hit_mid_block', 0)}) | {si.get('split_whole', 0)} / {si.get('split_cut', 0)} | "
              f"{x.get('extra_taken')} | {x.get('skipped_attn_tail')} / {x.get('skipped_gdn_tail')} | "
              f"{', '.join(f'{k} {v}' for k, v in sorted(keys.items()))} | "
              f"{x['device_cached_prompt_tokens']:,} / {x['host_cached_prompt_tokens']:,} | "
              f"{m['no_state']:,} / {m['evicted_host']:,} |")
