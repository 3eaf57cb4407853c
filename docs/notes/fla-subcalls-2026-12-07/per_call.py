"""Median host time (ms) of each call of a timed function, in call order, per cold prompt
(``each_ms`` of ``--phase-times --host-breakdown``), for each row and length, over the warm calls.

Usage: python per_call.py [--compile-calls 4,5] h57c-d*.json > per-call.md
"""
import argparse
import json
import statistics

p = argparse.ArgumentParser()
p.add_argument("files", nargs="+")
p.add_argument("--compile-calls", default="")
a = p.parse_args()
skip = {int(c) for c in a.compile_calls.split(",") if c}
rows = {}
for f in a.files:
    d = json.load(open(f))
    if d.get("call") in skip:
        continue
    for key, u in d.get("units", {}).items():
        rows.setdefault(key, []).extend(pt for pt in u["samples"]["cold"].get("phase_times") or [] if pt)
names = sorted({n for pts in rows.values() for pt in pts for n in pt.get("each_ms", {})})
for length in sorted({k.split("@")[1] for k in rows}, key=int):
    print(f"### {int(length):,} tokens\n\n| function | row | each call, in order (median ms) |\n|---|---|---|")
    for n in names:
        for row in sorted({k.split("@")[0] for k in rows}):
            calls = [pt["each_ms"][n] for pt in rows.get(f"{row}@{length}", []) if pt["each_ms"].get(n)]
            if calls:
                m = max(map(len, calls))
                med = [statistics.median([c[i] for c in calls if len(c) > i]) for i in range(m)]
                print(f"| {n} | {row} | {' '.join(f'{x:.3f}' for x in med)} |")
    print()
