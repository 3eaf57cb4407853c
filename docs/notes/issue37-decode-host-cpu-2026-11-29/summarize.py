"""Tables of the README from decode_host.py's JSONs (one per row; the row is read from each).

    python docs/notes/issue37-decode-host-cpu-2026-11-29/summarize.py OUT.off.json[.gz] OUT.upstream.json ...

Per decode-only step without a block crossing ("plain"; ``--kind crossing`` for the others):
the medians of the time pass, the plugin's functions (cProfile: calls and own time per step),
vLLM's functions whose calls per step differ between rows (align mode's own work: ``off`` vs
``upstream``; what the plugin adds: ``upstream`` vs the plugin's rows), and the aten ops per step
(all, and issued by a ``vllm_hybrid_npu`` frame).
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
from pathlib import Path

OURS = "vllm_hybrid_npu/"
#: (file suffix, function) of the vLLM functions under the entries that run on a CPU decode step
WRAPPED = (("core/sched/scheduler.py", "schedule"), ("core/sched/scheduler.py", "make_stats"),
           ("core/sched/scheduler.py", "_mamba_block_aligned_split"),
           ("core/kv_cache_manager.py", "allocate_slots"),
           ("single_type_kv_cache_manager.py", "get_num_blocks_to_allocate"),
           ("single_type_kv_cache_manager.py", "allocate_new_blocks"),
           ("single_type_kv_cache_manager.py", "_cache_partial_tail_block"),
           ("backends/gdn_attn.py", "build"), ("cpu/gdn_attention.py", "_cpu_gdn_attention_nonspec"))


def load(paths):
    """``{label: doc}``: the row's name, or ``row@FILE-PREFIX`` (the file name up to its first
    dot) where two files hold one row (before and after a change)."""
    docs = [(Path(p), json.loads(gzip.open(p).read() if p.endswith(".gz") else Path(p).read_text()))
            for p in paths]
    rows = [d["info"]["row"] for _, d in docs]
    return {(r if rows.count(r) == 1 else f"{r}@{p.name.split('.')[0]}"): d
            for (p, d), r in zip(docs, rows)}


def per_step(doc, kind):
    prof = doc["cprofile"][kind]
    n = max(prof["steps"], 1)
    out: dict = {}
    for f, line, name, calls, own, cum in prof["functions"]:
        # the plugin's frames by file and name (their lines move between commits; the two
        # comprehensions of one function add up), vLLM's by file, line and name
        key = (f, 0, name) if f.startswith(OURS) else (f, line, name)
        c = out.get(key, (0.0, 0.0, 0.0))
        out[key] = (c[0] + calls / n, c[1] + 1e6 * own / n, c[2] + 1e6 * cum / n)
    return out, prof


def fmt(x, nd=2):
    return "-" if x is None else (f"{x:.{nd}f}" if isinstance(x, float) else str(x))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("json", nargs="+")
    p.add_argument("--kind", default="plain", choices=("plain", "crossing"))
    p.add_argument("--min-calls-diff", type=float, default=0.5)
    a = p.parse_args()
    docs = load(a.json)
    rows = list(docs)
    info = next(iter(docs.values()))["info"]
    print(f"block {info['block_size']}, {info['reqs']} requests decoding, layers {info['layer_types']}, "
          f"runner {info['runner']}, seeds {[d['info']['seed'] for d in docs.values()]}\n")

    print(f"### time pass, median per decode-only step ({a.kind}), ms (no profiler)\n")
    cols = ["wall", "schedule", "execute_model_incl", "execute_model", "prepare_inputs", "metadata_build",
            "forward", "sample", "update_from_output", "output_processing"]
    print("| row | steps | " + " | ".join(cols) + " |")
    print("|---|---|" + "---|" * len(cols))
    for r, d in docs.items():
        steps = [s for s in d["time"] if bool(s["crossing"]) == (a.kind == "crossing")]
        vals = [statistics.median(s.get(f"{c}_ms", 0.0) for s in steps) if steps else None for c in cols]
        print(f"| {r} | {len(steps)} | " + " | ".join(fmt(v, 3) for v in vals) + " |")

    print(f"\n### A/B: decode-only steps ({a.kind}) alternating the plugin's wrappers and vLLM's own "
          "functions in one engine, median ms (paired: step i with ours, i + 1 without)\n")
    cols_ab = ["wall", "schedule", "execute_model", "update_from_output"]
    print("| row | pairs | " + " | ".join(f"{c} ours | {c} vLLM's | diff (median of pairs)" for c in cols_ab) + " |")
    print("|---|---|" + "---|---|---|" * len(cols_ab))
    for r, d in docs.items():
        steps = {s["step"]: s for s in d.get("ab", []) if bool(s["crossing"]) == (a.kind == "crossing")}
        pairs = [(s, steps[i + 1]) for i, s in steps.items() if s["with"] == "ours" and i + 1 in steps]
        if not pairs:
            continue
        cells = []
        for c in cols_ab:
            k = f"{c}_ms"
            cells += [fmt(statistics.median(x[k] for x, _ in pairs), 3), fmt(statistics.median(y[k] for _, y in pairs), 3),
                      fmt(statistics.median(x[k] - y[k] for x, y in pairs), 4)]
        print(f"| {r} | {len(pairs)} | " + " | ".join(cells) + " |")

    tables = {r: per_step(d, a.kind) for r, d in docs.items()}
    print(f"\n### the plugin's functions per decode-only step ({a.kind}; cProfile: calls/step, own us/step)\n")
    ours = sorted({k for t, _ in tables.values() for k in t if k[0].startswith(OURS)},
                  key=lambda k: -max(tables[r][0].get(k, (0, 0, 0))[1] for r in rows))
    print("| function | " + " | ".join(f"{r} calls | {r} us" for r in rows) + " |")
    print("|---|" + "---|---|" * len(rows))
    for k in ours:
        cells = []
        for r in rows:
            c = tables[r][0].get(k)
            cells += ["-", "-"] if c is None else [fmt(c[0]), fmt(c[1], 1)]
        print(f"| `{k[0].removeprefix(OURS)}:{k[2]}` | " + " | ".join(cells) + " |")
    print("| **total** | " + " | ".join(
        f"{fmt(sum(c[0] for k, c in tables[r][0].items() if k[0].startswith(OURS)))} | "
        f"{fmt(sum(c[1] for k, c in tables[r][0].items() if k[0].startswith(OURS)), 1)}" for r in rows) + " |")
    print("| all Python frames (own us) | " + " | ".join(
        f"{fmt(sum(c[0] for c in tables[r][0].values()), 0)} | {fmt(sum(c[1] for c in tables[r][0].values()), 1)}"
        for r in rows) + " |")

    print(f"\n### the vLLM functions the plugin's entries wrap ({a.kind}): calls/step, own us/step "
          "(vLLM's own frames of that name in that file, every class; in every row that runs them)\n")
    print("| vLLM function | " + " | ".join(f"{r} calls | {r} us" for r in rows) + " |")
    print("|---|" + "---|---|" * len(rows))
    for suffix, name in WRAPPED:
        cells = []
        for r in rows:
            hits = [c for k, c in tables[r][0].items() if k[0].endswith(suffix) and k[2] == name]
            cells += [fmt(sum(c[0] for c in hits)), fmt(sum(c[1] for c in hits), 1)] if hits else ["-", "-"]
        print(f"| `{suffix}:{name}` | " + " | ".join(cells) + " |")

    print(f"\n### vLLM's functions whose calls per step differ between rows (|diff| >= {a.min_calls_diff})\n")
    keys = {k for t, _ in tables.values() for k in t if not k[0].startswith(OURS)}
    diff = []
    for k in keys:
        calls = [tables[r][0].get(k, (0.0, 0.0, 0.0))[0] for r in rows]
        if max(calls) - min(calls) >= a.min_calls_diff:
            diff.append((k, calls, [tables[r][0].get(k, (0.0, 0.0, 0.0))[1] for r in rows]))
    diff.sort(key=lambda x: -max(x[2]))
    print("| function | " + " | ".join(f"{r} calls | {r} us" for r in rows) + " |")
    print("|---|" + "---|---|" * len(rows))
    for k, calls, own in diff[:60]:
        print(f"| `{k[0]}:{k[1]} {k[2]}` | " + " | ".join(f"{fmt(c)} | {fmt(o, 1)}" for c, o in zip(calls, own)) + " |")
    print(f"\n({len(diff)} functions differ; first 60 by own time)")

    print(f"\n### aten ops per decode-only step ({a.kind}; TorchDispatchMode)\n")
    print("| row | steps | aten ops / step | ops issued by vllm_hybrid_npu / step | ours by op | ours by site |")
    print("|---|---|---|---|---|---|")
    for r, d in docs.items():
        o = d["torch_ops"][a.kind]
        n = max(o["steps"], 1)
        print(f"| {r} | {o['steps']} | {sum(o['all'].values()) / n:.1f} | {sum(o['ours'].values()) / n:.2f} | "
              f"{ {k: round(v / n, 2) for k, v in o['ours'].items()} } | { {k: round(v / n, 2) for k, v in o['ours_sites'].items()} } |")
    ref = docs.get("upstream") or docs[rows[0]]  # noqa: SIM401
    print("\naten op counts per step that differ from "
          f"{ref['info']['row']} (by op name):\n")
    ro = ref["torch_ops"][a.kind]
    rn = max(ro["steps"], 1)
    for r, d in docs.items():
        o = d["torch_ops"][a.kind]
        n = max(o["steps"], 1)
        names = set(o["all"]) | set(ro["all"])
        dd = {k: round(o["all"].get(k, 0) / n - ro["all"].get(k, 0) / rn, 2) for k in names}
        dd = {k: v for k, v in dd.items() if abs(v) >= 0.01}
        print(f"* {r}: {dict(sorted(dd.items(), key=lambda kv: -abs(kv[1])))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
