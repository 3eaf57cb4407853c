"""Session O (issue 37, H200, 2026-11-29): per call, the cold 8,192-token prompts' TTFT and host
time per step phase (``--phase-times``), host events and placement; across calls, how TTFT
follows host phases that do the same work in every row. Run from this folder:
``python summarize.py p37-o*.json > tables.md``."""
import json
import statistics as st
import sys

import numpy as np

COMPILE = {5, 6, 15}  # first call of each row on the machine


def rows(paths):
    for path in paths:
        doc = json.load(open(path))
        for key, unit in doc["units"].items():
            yield doc["call"], key.split("@")[0], unit


def main(paths):
    data = list(rows(paths))
    print("| call | row | cold TTFT ms, median (min-max) | add_request | schedule | prepare_inputs | "
          "execute_model own | sample | other phases | GC (full) | alloc retries / device allocs | "
          "driving thread's CPU |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    samples = []
    for call, row, unit in sorted(data, key=lambda x: x[0]):
        s = unit["samples"]["cold"]
        ph = [pt["phase_ms"] for pt in s["phase_times"]]
        med = lambda k: st.median(p.get(k, 0.0) for p in ph)  # noqa: E731
        other = st.median(sum(v for k, v in p.items() if k not in
                              ("add_request", "schedule", "prepare_inputs", "execute_model", "sample")) for p in ph)
        he = s["host_events"]
        gc = sum(h["gc_collections"] for h in he)
        gcf = sum(h["gc_full_collections"] for h in he)
        retries = sum(h.get("num_alloc_retries", 0) for h in he)
        allocs = sum(h.get("num_device_alloc", 0) for h in he)
        cpus = sorted({h["cpu_start"] for h in he} | {h["cpu_end"] for h in he})
        t = s["ttft_ms"]
        tag = " (compile)" if call in COMPILE else ""
        print(f"| {call}{tag} | {row} | {st.median(t):.1f} ({min(t):.1f}-{max(t):.1f}) | {med('add_request'):.2f} | "
              f"{med('schedule'):.2f} | {med('prepare_inputs'):.2f} | {med('execute_model'):.2f} | "
              f"{med('sample'):.2f} | {other:.2f} | {gc} ({gcf}) | {retries} / {allocs} | {cpus} |")
        if call not in COMPILE:
            samples += [(call, row, tt, p) for tt, p in zip(t, ph)]
    print()
    print("Warm calls, every cold prompt: correlation of TTFT with host phases "
          "(`prepare_inputs`: the V2 runner's input preparation, host work alike in the one-step `off` and exporter runs; `vllm-align` takes two steps, its phases are sums over both)")
    print()
    print("| row | prompts | corr(TTFT, prepare_inputs) | corr(TTFT, add_request) | corr(execute_model, the other phases) "
          "| fit TTFT = a * prepare_inputs + b | TTFT at prepare_inputs 0.5 / 0.6 ms |")
    print("|---|---|---|---|---|---|---|")
    for row in ("off", "exporter", "vllm-align"):
        r = [x for x in samples if x[1] == row]
        if len(r) < 3:
            continue
        t = np.array([x[2] for x in r])
        prep = np.array([x[3]["prepare_inputs"] for x in r])
        add = np.array([x[3]["add_request"] for x in r])
        ex = np.array([x[3]["execute_model"] for x in r])
        oth = np.array([sum(v for k, v in x[3].items() if k not in ("execute_model",)) for x in r])
        a, b = np.linalg.lstsq(np.vstack([prep, np.ones_like(prep)]).T, t, rcond=None)[0]
        print(f"| {row} | {len(r)} | {np.corrcoef(t, prep)[0, 1]:.2f} | {np.corrcoef(t, add)[0, 1]:.2f} | "
              f"{np.corrcoef(ex, oth)[0, 1]:.2f} | {a:.1f} * p + {b:.1f} | {a * 0.5 + b:.1f} / {a * 0.6 + b:.1f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
