"""Per cold prompt host time of each timed function (``--phase-times --host-breakdown``), median
over the warm calls' cold prompts of each row, and the exporter's difference to caching off.

Usage: python breakdown.py [--compile-calls 4,5] [--probe-below US] h57b-d*.json > breakdown.md
"""
import argparse
import json
import statistics
import sys

p = argparse.ArgumentParser()
p.add_argument("files", nargs="+")
p.add_argument("--compile-calls", default="")
p.add_argument("--probe-below", type=float, default=None,
               help="keep only prompts whose host-speed probe (us) was below this")
a = p.parse_args()
skip = {int(c) for c in a.compile_calls.split(",") if c}
runs = {}  # (row, length) -> [phase_times]
for f in a.files:
    d = json.load(open(f))
    if d.get("call") in skip:
        continue
    for key, u in d.get("units", {}).items():
        row, length = key.split("@")
        for pt in u["samples"]["cold"].get("phase_times") or []:
            if pt and (a.probe_below is None or pt.get("host_probe_us", 0) < a.probe_below):
                runs.setdefault((row, int(length)), []).append(pt)
rows = sorted({r for r, _ in runs})
lengths = sorted({n for _, n in runs})
print(f"files: {' '.join(a.files)}; compile calls left out: {sorted(skip)}; "
      f"probe below: {a.probe_below}\n")
for n in lengths:
    have = {r: runs.get((r, n), []) for r in rows}
    phases = sorted({k for pts in have.values() for pt in pts for k in pt.get("phase_incl_ms", {})})
    print(f"### {n:,} tokens (prompts: " + ", ".join(f"{r} {len(v)}" for r, v in have.items()) + ")\n")
    print("| function | " + " | ".join(f"{r} own ms" for r in rows) + " | "
          + " | ".join(f"{r} incl ms" for r in rows) + " | " + " | ".join(f"{r} calls" for r in rows) + " |")
    print("|---|" + "---|" * (3 * len(rows)))
    for ph in phases:
        def med(r, k):
            xs = [pt.get(k, {}).get(ph) for pt in have[r]]
            xs = [x for x in xs if x is not None]
            return statistics.median(xs) if xs else None
        fmt = lambda x: "-" if x is None else f"{x:.3f}"
        own = [med(r, "phase_ms") for r in rows]
        incl = [med(r, "phase_incl_ms") for r in rows]
        calls = [med(r, "calls") for r in rows]
        print(f"| {ph} | " + " | ".join(map(fmt, own)) + " | " + " | ".join(map(fmt, incl)) + " | "
              + " | ".join("-" if c is None else f"{c:g}" for c in calls) + " |")
    print()
