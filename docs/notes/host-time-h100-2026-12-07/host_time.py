"""Host time of the cold prompts' engine steps from --phase-times (per prompt, ms), per row."""
import json, statistics as st, sys, glob
rows = {}
for f in sorted(glob.glob("h57-d*.json")):
    d = json.load(open(f))
    call = d["call"]
    if call in (4, 5, 6):
        continue
    for key, u in d["units"].items():
        row, n = key.split("@")
        for pt in u["samples"]["cold"]["phase_times"]:
            rows.setdefault((row, int(n)), []).append((call, pt))
PH = ("schedule", "prepare_inputs", "metadata_build", "execute_model", "update_from_output", "output_processing")
out = {}
for (row, n), runs in sorted(rows.items(), key=lambda x: (x[0][1], x[0][0])):
    for label, keep in (("all", lambda p: True), ("probe<1000us", lambda p: p["host_probe_us"] < 1000)):
        sel = [pt for c, pt in runs if keep(pt)]
        em = [pt["phase_ms"]["execute_model"] for pt in sel]
        host = [sum(pt["phase_ms"][k] for k in PH) for pt in sel]
        out[(row, n, label)] = (len(sel), st.median(em), st.median(host), len({c for c, pt in runs if keep(pt)}))
print("| prompt | runs | row | n runs (calls) | execute_model ms, median | + off's | step phases ms, median | + off's |")
print("|---|---|---|---|---|---|---|---|")
for (row, n, label), (k, em, host, calls) in out.items():
    off = out[("off", n, label)]
    print(f"| {n:,} | {label} | {row} | {k} ({calls}) | {em:.2f} | {em - off[1]:+.2f} | {host:.2f} | {host - off[2]:+.2f} |")
