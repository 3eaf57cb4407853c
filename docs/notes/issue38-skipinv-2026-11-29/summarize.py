"""The README's tables from this folder's cf6.py JSONs, the item3-cuda folder's cf5.py JSONs
(16 GiB + 256 GiB host: the block's unit, pmu 64 as installed, two_notail; the same settings and
lab code) and advise_nohost_rows.json (16 GiB, no host: the block's unit at every ret, pmu 64 as
installed at ret 0).

    python3 summarize.py            # markdown tables on stdout
"""
import glob, json, os

here = os.path.dirname(os.path.abspath(__file__))
item3 = os.path.join(here, "..", "issue38-item3-cuda-2026-11-29")


def load(path):
    try:
        d = json.load(open(path))
    except Exception:
        return None
    return d if isinstance(d, dict) and "token_hit_rate" in d else None


mine = {os.path.basename(f)[:-5]: load(f) for f in glob.glob(os.path.join(here, "*.json"))}
old = {os.path.basename(f)[:-5]: load(f) for f in glob.glob(os.path.join(item3, "*.json"))}
adv = json.load(open(os.path.join(here, "advise_nohost_rows.json")))
ADV = {(r["part"], r["policy"]): r for r in adv["rows"]}
OFF = {p: old[f"{p}_caching_off"]["extra_prefill_steps_per_prompt"] for p in ("fit", "check")}
RETS = [("ret 0 (`ckpt`)", "ckpt_ret0", "upstream:ckpt", "upstream:pmu=64,ckpt"),
        ("ret 1b, `ckpt=final`", "final_ret1b", "upstream:ret=1b,ckpt=final",
         "upstream:ret=1b,pmu=64,ckpt=final"),
        ("ret 2b, `ckpt=final`", "final_ret2b", "upstream:ret=2b,ckpt=final",
         "upstream:ret=2b,pmu=64,ckpt=final")]


def row(src, d):
    if d is None:
        return None
    return {"src": src, "hit": 100 * d["token_hit_rate"], "steps": d["prefill_steps_per_prompt"],
            "extra": d["extra_prefill_steps_per_prompt"],
            "why": d.get("extra_prefill_steps_by_reason") or {}, "raw": d}


def cols(part, host, r):
    _, tag, blk_pol, pmu_pol = r
    blk_old = "plain_ckpt_ret0" if tag == "ckpt_ret0" else f"plain_ckpt_{tag}"
    if host:
        return {"block's unit": row(f"item3 {part}_{blk_old}", old.get(f"{part}_{blk_old}")),
                "pmu64 as installed": row(f"item3 {part}_plain_pmu64_{tag}",
                                          old.get(f"{part}_plain_pmu64_{tag}")),
                "pmu64 skipinv": row(f"{part}_skipinv_host_{tag}", mine.get(f"{part}_skipinv_host_{tag}")),
                "`two_notail`": row(f"item3 {part}_two_notail_pmu64_{tag}",
                                    old.get(f"{part}_two_notail_pmu64_{tag}"))}
    inst = (row(f"advise {part} {pmu_pol}", ADV.get((part, pmu_pol))) if tag == "ckpt_ret0" else
            row(f"{part}_plain_nohost_pmu64_{tag}", mine.get(f"{part}_plain_nohost_pmu64_{tag}")))
    return {"block's unit": row(f"advise {part} {blk_pol}", ADV.get((part, blk_pol))),
            "pmu64 as installed": inst,
            "pmu64 skipinv": row(f"{part}_skipinv_nohost_{tag}", mine.get(f"{part}_skipinv_nohost_{tag}"))}


def beyond(part, x):
    return x["extra"] - OFF[part]


for host, title in ((True, "16 GiB device + 256 GiB host"), (False, "16 GiB device, no host tier")):
    names = list(cols("fit", host, RETS[0]))
    print(f"\n### {title}\n")
    print("Token hits / prefill steps per prompt / extra steps beyond caching off "
          "(**bold**: within the bound, caching off + 0.05)\n")
    print("| part | retention, ckpt | " + " | ".join(names) + " | skipinv - installed | skipinv - block's unit |")
    print("|---|---|" + "---|" * (len(names) + 2))
    for part in ("fit", "check"):
        for r in RETS:
            c = cols(part, host, r)
            cells = []
            for n in names:
                x = c[n]
                if x is None:
                    cells.append("-")
                    continue
                b = beyond(part, x)
                s = f"{b:+.3f}"
                cells.append(f"{x['hit']:.2f}% / {x['steps']:.3f} / " + (f"**{s}**" if b <= 0.05 + 1e-9 else s))
            s, i, k = c["pmu64 skipinv"], c["pmu64 as installed"], c["block's unit"]
            d1 = f"{s['hit'] - i['hit']:+.2f} pt, {s['steps'] - i['steps']:+.3f} steps" if s and i else "-"
            d2 = f"{s['hit'] - k['hit']:+.2f} pt, {s['steps'] - k['steps']:+.3f} steps" if s and k else "-"
            print(f"| {part} | {r[0]} | " + " | ".join(cells) + f" | {d1} | {d2} |")
    print("\nExtra prefill steps per prompt by reason: checkpoint_invalid / shared_budget / junction / "
          "mid_block_start / the rest\n")
    print("| part | ret | " + " | ".join(names) + " |")
    print("|---|---|" + "---|" * len(names))
    for part in ("fit", "check"):
        for r in RETS:
            c = cols(part, host, r)
            cells = []
            for n in names:
                x = c[n]
                if x is None:
                    cells.append("-")
                    continue
                w = x["why"]
                rest = sum(v for k, v in w.items() if k not in
                           ("checkpoint_invalid", "shared_budget", "junction", "mid_block_start"))
                cells.append(" / ".join(f"{w.get(k, 0):.3f}" for k in
                                        ("checkpoint_invalid", "shared_budget", "junction",
                                         "mid_block_start")) + f" / {rest:.3f}")
            print(f"| {part} | {r[1].replace('ckpt_', '').replace('final_', '')} | " + " | ".join(cells) + " |")

print("\n### skipinv's own counts (cf6.py observers)\n")
print("| run | flipped final chunks (cold / hit on block / hit mid-block) | whole / cut | "
      "first failing clause of vLLM's check (per request and chunk start) | GDN keys on flipped "
      "chunks' blocks (3 groups) | device / host hit tokens | wall |")
print("|---|---|---|---|---|---|---|")
for name in sorted(mine, key=lambda n: (("nohost" in n), n.startswith("check"), n)):
    d = mine[name]
    if d is None or "skipinv" not in d:
        continue
    s = d["skipinv"]
    fb = s.get("flipped_by_start", {})
    keys = {}
    for k, v in s.get("keys", {}).items():
        cls = k.split(":", 1)[1]
        keys[cls] = keys.get(cls, 0) + v
    wall = open(os.path.join(here, name + ".cmd")).read().strip().splitlines()[-1]
    print(f"| {name} | {s['flipped']} ({fb.get('cold', 0)} / {fb.get('hit_on_block', 0)} / "
          f"{fb.get('hit_mid_block', 0)}) | {s.get('split_whole', 0)} / {s.get('split_cut', 0)} | "
          + ", ".join(f"{k} {v}" for k, v in sorted(s["first_failing_clause"].items())) + " | "
          + (", ".join(f"{k} {v}" for k, v in sorted(keys.items())) or "none") + " | "
          f"{d['device_cached_prompt_tokens']:,} / {d['host_cached_prompt_tokens']:,} | {wall} |")
print(f"\n(Caching off: {OFF['fit']:.3f} extra steps per prompt on the fit part, {OFF['check']:.4f} "
      f"on the check part, all shared_budget; bound +0.05. Sources: item3 = "
      f"../issue38-item3-cuda-2026-11-29/NAME.json, advise = advise_nohost_rows.json.)")
