"""Pool the per-call JSONs of ``benchmarks/cuda_serving.py`` into the table of record (issue 30).

The protocol that can't flatter (docs/cuda.md, runbook): one row per device call, every row first
in its call, rows alternated, at least four calls per row after the compile calls, all calls on
one GPU model. Each call writes its own JSON (``--out``, ``--call N``); this tool reads them and
writes

* ``rows[]``: one object per (row, prompt length) with exactly ``row, prompt_tokens,
  cold_ttft_ms, cold_ttft_vs_off, hit_ttft_ms, floor_ttft_ms, itl_ms, steps_per_cold_prompt,
  block_size, tp, position, call`` and ``per_call`` (each pooled call's own medians). The ms columns are medians
  of all the calls' samples pooled (cold prompts, repeats, floor prompts; ITL over the single
  inter-token gaps of the concurrent clients' first turns); ``cold_ttft_vs_off`` is the pooled
  cold TTFT over the ``off`` row's at the same length; ``position`` and ``call`` list the pooled
  calls' positions and numbers; ``block_size`` is the block (tokens) vLLM chose for the row's
  engine (``engine.block_size``), None where the pooled calls disagree (flagged) or did not
  record it, ``tp`` the engine's tensor-parallel size; where the calls ran with the harness's
  ``--phase-times``, also ``host_probe_us`` (the pooled median of the host-speed probe before
  each cold prompt, and per call), ``probe_us`` (the median over every row at that length) and
  ``cold_ttft_at_probe_ms`` / ``cold_ttft_at_probe_vs_off`` (the row's cold TTFTs fitted on
  their probes by least squares, at ``probe_us``: a diagnosis for hosts whose speed changes
  between calls, issue 37's session O; not a column of the protocol);
* ``calls[]``: every unit read, with its call, machine, position and whether it was pooled;
* ``flags[]``: what breaks the protocol: a unit not first in its call (not pooled unless
  ``--allow-not-first``), a row with fewer than ``--min-calls`` pooled calls, two consecutive
  pooled calls of one machine running the same row (rows not alternated);
* ``excluded[]``: units not pooled and why: compile calls (the first call of a row on a machine,
  where vLLM compiles and captures CUDA graphs; ``--compile-calls`` names more), units not first
  in their call.

Several GPU models in the inputs are refused (``--device`` picks one), and so are several
tensor-parallel sizes (``--tp`` of the harness: one table per size) and several model depths
(``--layers``: one table per depth); several machines of one
model are pooled and listed (``machines``). ``--markdown`` writes the table for
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

#: the fields of a pooled row, in order (``per_call`` follows)
ROW_FIELDS = ("row", "prompt_tokens", "cold_ttft_ms", "cold_ttft_vs_off", "hit_ttft_ms",
              "floor_ttft_ms", "itl_ms", "steps_per_cold_prompt", "block_size", "tp", "position", "call")
#: the per-call medians beside the pooled ones
CALL_FIELDS = ("call", "position", "cold_ttft_ms", "hit_ttft_ms", "floor_ttft_ms", "itl_ms",
               "steps_per_cold_prompt")
MIN_CALLS = 4


def median(xs) -> float | None:
    """Median of the non-None values (mean of the middle two for an even count); None if empty."""
    v = sorted(x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x)))
    if not v:
        return None
    mid = len(v) // 2
    return float(v[mid]) if len(v) % 2 else (v[mid - 1] + v[mid]) / 2.0


def _phase(unit: dict, name: str) -> dict:
    return (unit.get("samples") or {}).get(name) or {}


def _gaps_ms(unit: dict) -> list[float]:
    """Single inter-token gaps (ms) of the concurrent clients' first turns (``conc1``)."""
    times = _phase(unit, "conc1").get("token_times") or []
    return [1e3 * (b - a) for ts in times if ts for a, b in zip(ts, ts[1:])]


def unit_samples(unit: dict) -> dict[str, list[float]]:
    """The samples a unit contributes to each pooled column."""
    return {"cold_ttft_ms": list(_phase(unit, "cold").get("ttft_ms") or []),
            "hit_ttft_ms": list(_phase(unit, "repeat").get("ttft_ms") or []),
            "floor_ttft_ms": list(_phase(unit, "floor").get("ttft_ms") or []),
            "itl_ms": _gaps_ms(unit),
            "steps_per_cold_prompt": list(_phase(unit, "cold").get("steps_to_first") or [])}


def cold_probes(unit: dict) -> list[tuple[float, float]]:
    """``(cold TTFT ms, host probe us)`` of each cold prompt whose run carries the harness's
    host-speed probe (``--phase-times``: ``samples.cold.phase_times[i].host_probe_us``)."""
    cold = _phase(unit, "cold")
    out = []
    for t, pt in zip(cold.get("ttft_ms") or [], cold.get("phase_times") or []):
        probe = (pt or {}).get("host_probe_us")
        if probe is not None and t is not None and not math.isnan(t):
            out.append((float(t), float(probe)))
    return out


def fit_at(points: list[tuple[float, float]], x: float) -> float | None:
    """The least-squares line ``y = a * probe + b`` through ``points`` (``(y, probe)``) at
    ``probe = x``; None for fewer than three points or probes all equal."""
    if len(points) < 3:
        return None
    ys, xs = [p[0] for p in points], [p[1] for p in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((v - mx) ** 2 for v in xs)
    if sxx <= 0:
        return None
    a = sum((u - mx) * (v - my) for u, v in zip(xs, ys)) / sxx
    return my + a * (x - mx)


def _machine(ident: dict | None) -> str:
    ident = ident or {}
    return f"{ident.get('host')}/{ident.get('boot_id')}/{ident.get('gpu_uuid')}"


def read_units(paths: list[Path]) -> list[dict]:
    """Every unit of every file, flattened: ``{"file", "row", "prompt_tokens", "call",
    "position", "device", "machine", "compile_s", "tp", "layers", "unit"}`` (``tp``: the engine's
    tensor-parallel size, 1 for JSONs written before the harness recorded it; ``layers``: the
    decoder layers vLLM served, ``engine.num_hidden_layers``, else the file's ``--layers``, which
    the harness checked against the config it wrote, else None). A unit's own ``call`` and
    ``identity`` (written by the harness since issue 30) win over its file's.

    Raises:
        ValueError: a file without units, or a unit with no call number (``--call`` was not
            given to the harness), naming the file.
    """
    out = []
    for path in paths:
        doc = json.loads(Path(path).read_text())
        if not doc.get("units"):
            raise ValueError(f"{path}: no units (not a benchmarks/cuda_serving.py JSON, or nothing measured)")
        for key, u in doc["units"].items():
            call = u.get("call", doc.get("call"))
            if call is None:
                raise ValueError(f"{path}: unit {key} has no call number: run the harness with --call N")
            ident = u.get("identity") or doc.get("identity") or {}
            engine = u.get("engine") or {}
            layers = engine.get("num_hidden_layers") or (doc.get("args") or {}).get("layers")
            out.append({"file": str(path), "row": u["row"], "prompt_tokens": int(u["prompt_tokens"]),
                        "call": int(call), "position": u.get("position"),
                        "device": ident.get("device") or doc.get("device"), "machine": _machine(ident),
                        "compile_s": engine.get("compile_s"), "tp": int(engine.get("tensor_parallel_size") or 1),
                        "layers": None if layers is None else int(layers), "unit": u})
    return out


def pool(units: list[dict], compile_calls: set[int] = frozenset(), allow_not_first: bool = False,
         min_calls: int = MIN_CALLS, device: str | None = None) -> dict:
    """Pool units (:func:`read_units`) by the protocol; see the module docstring.

    Raises:
        ValueError: the units come from more than one GPU model and ``device`` names none of
            them, or ``device`` matches no unit, or they come from engines of several
            tensor-parallel sizes or models of several depths (``layers``; unknown counts as
            one more).
    """
    devices = sorted({u["device"] for u in units})
    if device is not None:
        units = [u for u in units if u["device"] == device]
        if not units:
            raise ValueError(f"--device {device!r}: no unit from it (found {devices})")
    elif len(devices) > 1:
        raise ValueError(f"units from several GPU models {devices}: pool one at a time (--device)")
    sizes = sorted({u.get("tp", 1) for u in units})
    if len(sizes) > 1:
        raise ValueError(f"units from engines of tensor-parallel sizes {sizes}: pool one size at a time")
    depths = sorted({u.get("layers") for u in units}, key=lambda n: (n is None, n or 0))
    if len(depths) > 1:
        raise ValueError(f"units from models of {', '.join(str(n or 'unknown') for n in depths)} decoder "
                         f"layers (--layers): pool one depth at a time")
    units = sorted(units, key=lambda u: (u["call"], u["position"] or 0))
    first_call: dict[tuple[str, str], int] = {}
    for u in units:
        first_call.setdefault((u["machine"], u["row"]), u["call"])
    calls, excluded, flags = [], [], []
    pooled: dict[tuple[str, int], list[dict]] = {}
    for u in units:
        why = None
        if u["call"] in compile_calls:
            why = "compile call (--compile-calls)"
        elif first_call[(u["machine"], u["row"])] == u["call"]:
            why = "compile call (first call of this row on its machine)"
        not_first = u["position"] != 1
        if not_first:
            flags.append({"row": u["row"], "prompt_tokens": u["prompt_tokens"], "call": u["call"],
                          "flag": f"not first in its call (position {u['position']})"})
            if why is None and not allow_not_first:
                why = f"not first in its call (position {u['position']})"
        calls.append({"call": u["call"], "row": u["row"], "prompt_tokens": u["prompt_tokens"],
                      "file": u["file"], "machine": u["machine"], "position": u["position"],
                      "compile_s": u["compile_s"], "pooled": why is None})
        if why:
            excluded.append({"row": u["row"], "prompt_tokens": u["prompt_tokens"], "call": u["call"],
                             "reason": why})
            continue
        pooled.setdefault((u["row"], u["prompt_tokens"]), []).append(u)
    # rows alternated: two consecutive pooled calls of one machine running the same row
    by_call: dict[tuple[str, int], set[str]] = {}
    for c in calls:
        if c["pooled"]:
            by_call.setdefault((c["machine"], c["call"]), set()).add(c["row"])
    seq = sorted(by_call)
    for (m1, c1), (m2, c2) in zip(seq, seq[1:]):
        if m1 == m2 and by_call[(m1, c1)] == by_call[(m2, c2)]:
            flags.append({"row": ",".join(sorted(by_call[(m2, c2)])), "prompt_tokens": None, "call": c2,
                          "flag": f"same row as call {c1} before it (protocol: rows alternated)"})
    rows = []
    for (row, length), us in pooled.items():
        per_call, samples = [], {k: [] for k in CALL_FIELDS[2:]}
        for u in us:
            s = unit_samples(u["unit"])
            for k in samples:
                samples[k] += s[k]
            per_call.append({"call": u["call"], "position": u["position"],
                             **{k: median(s[k]) for k in CALL_FIELDS[2:]}})
            probes = cold_probes(u["unit"])
            if probes:
                per_call[-1]["host_probe_us"] = median([p for _, p in probes])
        r = {"row": row, "prompt_tokens": length, "cold_ttft_ms": median(samples["cold_ttft_ms"]),
             "cold_ttft_vs_off": None, "hit_ttft_ms": median(samples["hit_ttft_ms"]),
             "floor_ttft_ms": median(samples["floor_ttft_ms"]), "itl_ms": median(samples["itl_ms"]),
             "steps_per_cold_prompt": median(samples["steps_per_cold_prompt"]),
             "block_size": None, "tp": us[0].get("tp", 1),
             "position": [u["position"] for u in us], "call": [u["call"] for u in us],
             "per_call": per_call, "probes": [pt for u in us for pt in cold_probes(u["unit"])]}
        blocks = sorted({(u["unit"].get("engine") or {}).get("block_size") for u in us}, key=str)
        if len(blocks) == 1:
            r["block_size"] = blocks[0]
        else:
            flags.append({"row": row, "prompt_tokens": length, "call": r["call"],
                          "flag": f"block sizes {blocks} across the pooled calls"})
        rows.append(r)
        if len(us) < min_calls:
            flags.append({"row": row, "prompt_tokens": length, "call": r["call"],
                          "flag": f"{len(us)} calls pooled (protocol: at least {min_calls})"})
    off = {r["prompt_tokens"]: r for r in rows if r["row"] == "off"}
    for r in rows:
        ref = off.get(r["prompt_tokens"])
        if ref and ref["cold_ttft_ms"] and r["cold_ttft_ms"] is not None:
            r["cold_ttft_vs_off"] = r["cold_ttft_ms"] / ref["cold_ttft_ms"]
    # at a matched host speed (a diagnosis beside the protocol's columns): each row's cold TTFT
    # fitted on its prompts' host-speed probes, at the median probe of every row's prompts
    for length in {r["prompt_tokens"] for r in rows}:
        at = [r for r in rows if r["prompt_tokens"] == length]
        x = median([p for r in at for _, p in r["probes"]])
        if x is None:  # no --phase-times: the rows keep exactly ROW_FIELDS and per_call
            continue
        for r in at:
            r["host_probe_us"] = median([p for _, p in r["probes"]])
            r["cold_ttft_at_probe_ms"] = fit_at(r["probes"], x)
            r["probe_us"] = x
        ref = off.get(length)
        for r in at:
            base = ref.get("cold_ttft_at_probe_ms") if ref else None
            r["cold_ttft_at_probe_vs_off"] = (r["cold_ttft_at_probe_ms"] / base
                                              if base and r["cold_ttft_at_probe_ms"] is not None else None)
    for r in rows:
        del r["probes"]
    rows.sort(key=lambda r: (r["prompt_tokens"], r["row"] != "off", r["row"]))
    return {"device": units[0]["device"] if units else device, "tp": sizes[0] if sizes else None,
            "layers": depths[0] if depths else None,
            "machines": sorted({u["machine"] for u in units}), "rows": rows, "calls": calls,
            "excluded": excluded, "flags": flags}


def _ms(x, fmt="{:.2f}"):
    """A table cell: ``x`` formatted, "-" for None."""
    return "-" if x is None else fmt.format(x)


def markdown(doc: dict) -> str:
    """The pooled table (docs/benchmarks.md): pooled medians with each call's median beside."""

    def f(x, fmt="{:.1f}"):
        return _ms(x, fmt)

    off = {r["prompt_tokens"]: r for r in doc["rows"] if r["row"] == "off"}
    lines = ["| row | prompt | cold TTFT ms, pooled (per call) | / off | steps | block | hit TTFT ms | "
             "floor ms | hit / floor | ITL ms (per call) | ITL / off | calls (positions) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        pc = ", ".join(f(c["cold_ttft_ms"]) for c in r["per_call"])
        pi = ", ".join(f(c["itl_ms"], "{:.2f}") for c in r["per_call"])
        ref = off.get(r["prompt_tokens"])
        itl_off = (r["itl_ms"] / ref["itl_ms"]) if ref and ref["itl_ms"] and r["itl_ms"] is not None else None
        hf = (r["hit_ttft_ms"] / r["floor_ttft_ms"]) if r["hit_ttft_ms"] and r["floor_ttft_ms"] else None
        calls = ", ".join(f"{c} ({p})" for c, p in zip(r["call"], r["position"]))
        lines.append(f"| {r['row']} | {r['prompt_tokens']:,} | {f(r['cold_ttft_ms'])} ({pc}) | "
                     f"{f(r['cold_ttft_vs_off'], '{:.3f}')} | {f(r['steps_per_cold_prompt'], '{:.0f}')} | "
                     f"{f(r.get('block_size'), '{:d}')} | {f(r['hit_ttft_ms'])} | {f(r['floor_ttft_ms'])} | {f(hf, '{:.2f}')} | "
                     f"{f(r['itl_ms'], '{:.2f}')} ({pi}) | {f(itl_off, '{:.3f}')} | {calls} |")
    probed = [r for r in doc["rows"] if r.get("host_probe_us") is not None]
    if probed:
        lines.append("\nHost-speed probe (`--phase-times`; us, median of each call's cold prompts) and the "
                     "cold TTFT fitted at the length's median probe (a diagnosis, not the protocol's column):")
        for r in probed:
            pc = ", ".join(f(c.get("host_probe_us"), "{:.0f}") for c in r["per_call"])
            lines.append(f"- {r['row']} @{r['prompt_tokens']:,}: probe {f(r['host_probe_us'], '{:.0f}')} ({pc}); "
                         f"at {f(r.get('probe_us'), '{:.0f}')} us: {f(r.get('cold_ttft_at_probe_ms'))} ms, "
                         f"/ off {f(r.get('cold_ttft_at_probe_vs_off'), '{:.3f}')}")
    for fl in doc["flags"]:
        at = f" @{fl['prompt_tokens']}" if fl["prompt_tokens"] else ""
        lines.append(f"\nFlag: {fl['row']}{at}, call {fl['call']}: {fl['flag']}")
    ex = sorted({(e["call"], e["row"], e["reason"]) for e in doc["excluded"]})
    if ex:
        lines.append("\nNot pooled: " + "; ".join(f"call {c} {r} ({why})" for c, r, why in ex))
    return "\n".join(lines) + "\n"


#: the step-profile phases in table order (benchmarks/cuda_serving.py ``STEP_PHASES``)
PROFILE_PHASES = ("schedule", "prepare_inputs", "metadata_build", "forward", "execute_model", "sample",
                  "update_from_output", "output_processing")


def kernel_ms(prof_run: dict) -> float | None:
    """A step-profile run's GPU kernel ms per step, or None where it is not kernel time: units
    without ``gpu_memory_ms`` were written before issue 37, when the column summed every
    device-side profiler event, the device-side copies of ``record_function`` ranges (the
    harness's ``bench.phase.*`` among them) and memory copies included."""
    return prof_run.get("gpu_kernel_ms") if "gpu_memory_ms" in prof_run else None


def profile_rows(units: list[dict], run: str = "cold", compile_calls: set[int] = frozenset()) -> list[dict]:
    """The step-profile decomposition (``--step-profile`` units): per (row, prompt length), the
    median over the pooled calls of ``run``'s (``cold``, ``repeat`` or ``decode_step``) ms per
    executed step: per phase host (own, and inclusive of the phases inside: ``host_incl_ms``)
    and GPU time, the step wall (no profiler), the host time of ``execute_model`` with the
    phases inside it (``execute_model_incl_ms``) and the GPU kernel time (:func:`kernel_ms`;
    None for units whose column was not kernel time, and for ``decode_step``).

    ``cold`` and ``repeat``: each call's mean over the run's steps. ``decode_step``: the phases
    are the decode run less the repeat (the harness's ``decode_step``); the step wall and
    ``execute_model`` are each call's median over its decode steps, measured one by one (the
    harness's ``decode_each``; None for units written before it). Compile calls (first call of
    a row on its machine, or ``compile_calls``) are left out, as in :func:`pool`; a row whose
    every call compiled keeps them (marked ``compile_only``)."""
    first: dict[tuple[str, str], int] = {}
    for u in sorted(units, key=lambda u: u["call"]):
        first.setdefault((u["machine"], u["row"]), u["call"])
    groups: dict[tuple[str, int], list[dict]] = {}
    for u in units:
        if (u["unit"].get("step_profile") or {}).get(run) is not None:
            groups.setdefault((u["row"], u["prompt_tokens"]), []).append(u)
    decode = run == "decode_step"
    out = []
    for (row, length), us in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        warm = [u for u in us if u["call"] not in compile_calls and first[(u["machine"], u["row"])] != u["call"]]
        use = warm or us
        profs = [u["unit"]["step_profile"][run] for u in use]
        tables = profs if decode else [p.get("phases", p) for p in profs]
        if decode:
            each = [u["unit"]["step_profile"].get("decode_each") or {} for u in use]
            wall = median([median(e.get("step_wall_ms") or []) for e in each])
            execute = median([median(e.get("execute_model_ms") or []) for e in each])
        else:
            wall = median([sum(p.get("step_wall_ms") or [0]) / max(len(p.get("step_wall_ms") or []), 1)
                           for p in profs])
            execute = median([(t.get("execute_model") or {}).get("host_incl_ms") for t in tables])
        r = {"row": row, "prompt_tokens": length, "calls": [u["call"] for u in use], "compile_only": not warm,
             "step_wall_ms": wall, "execute_model_incl_ms": execute,
             "gpu_kernel_ms": None if decode else median([kernel_ms(p) for p in profs]), "phases": {}}
        for ph in PROFILE_PHASES:
            cells = [c for c in (t.get(ph) for t in tables) if c]
            if cells:
                r["phases"][ph] = {k: median([c.get(k) for c in cells]) for k in ("host_ms", "host_incl_ms", "gpu_ms")}
        out.append(r)
    return out


def profile_markdown(rows: list[dict], run: str) -> str:
    """A table of :func:`profile_rows`: one line per row, ``host / GPU`` ms per step per phase
    (a phase's own host time), then ``execute_model``'s host time with the phases inside it."""
    head = ("| row | prompt | calls | step wall ms | GPU kernels ms | " + " | ".join(PROFILE_PHASES)
            + " | execute_model incl. host ms |")
    lines = [f"Step profile, run `{run}`, ms per executed step (host, no profiler / GPU, profiler):", "",
             head, "|---" * (6 + len(PROFILE_PHASES)) + "|"]
    for r in rows:
        cells = [f"{_ms(r['phases'][p]['host_ms'])} / {_ms(r['phases'][p]['gpu_ms'])}" if p in r["phases"] else "-"
                 for p in PROFILE_PHASES]
        calls = ", ".join(map(str, r["calls"])) + (" (compile only)" if r["compile_only"] else "")
        lines.append(f"| {r['row']} | {r['prompt_tokens']:,} | {calls} | {_ms(r['step_wall_ms'])} | "
                     f"{_ms(r['gpu_kernel_ms'])} | " + " | ".join(cells) + f" | {_ms(r['execute_model_incl_ms'])} |")
    return "\n".join(lines) + "\n"


def decode_markdown(rows: list[dict]) -> str:
    """Host time per decode step of the rows side by side (:func:`profile_rows` of
    ``decode_step``), each with its ratio to the ``off`` row at the same prompt length in
    parentheses ("-" where ``off`` has no value): the step wall and ``execute_model`` (with the
    phases inside it; medians over the decode steps, each measured), then each phase's own host
    time (decode run less repeat)."""
    off = {r["prompt_tokens"]: r for r in rows if r["row"] == "off"}

    def cell(r, value_of):
        v, ref = value_of(r), off.get(r["prompt_tokens"])
        b = value_of(ref) if ref else None
        return f"{_ms(v)} ({_ms(v / b if v is not None and b else None, '{:.3f}')})"

    head = ("| row | prompt | calls | step wall ms | execute_model incl. ms | "
            + " | ".join(PROFILE_PHASES) + " |")
    lines = ["Decode steps, host ms per step (no profiler), ratio to `off` at the same length in "
             "parentheses; step wall and execute_model: median over the decode steps; phases: own "
             "time, decode run less repeat:", "", head, "|---" * (5 + len(PROFILE_PHASES)) + "|"]
    for r in sorted(rows, key=lambda r: (r["prompt_tokens"], r["row"] != "off", r["row"])):
        phases = [cell(r, lambda x, p=p: (x["phases"].get(p) or {}).get("host_ms")) for p in PROFILE_PHASES]
        calls = ", ".join(map(str, r["calls"])) + (" (compile only)" if r["compile_only"] else "")
        lines.append(f"| {r['row']} | {r['prompt_tokens']:,} | {calls} | {cell(r, lambda x: x['step_wall_ms'])} | "
                     f"{cell(r, lambda x: x['execute_model_incl_ms'])} | " + " | ".join(phases) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pool", description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+", help="per-call JSONs of benchmarks/cuda_serving.py")
    p.add_argument("--out", required=True, help="pooled JSON")
    p.add_argument("--markdown", help="write the table here too")
    p.add_argument("--compile-calls", default="", help="comma list of call numbers that compiled")
    p.add_argument("--device", default=None, help="pool only units of this GPU model")
    p.add_argument("--allow-not-first", action="store_true",
                   help="pool units that were not first in their call (still flagged)")
    p.add_argument("--min-calls", type=int, default=MIN_CALLS)
    p.add_argument("--profile", action="store_true",
                   help="also the step-profile decomposition (units run with --step-profile): "
                        "cold, repeat and decode_step tables, into the JSON's step_profile and the "
                        "markdown, and the rows' host time per decode step side by side with "
                        "ratios to off")
    args = p.parse_args(argv)
    try:
        compile_calls = {int(x) for x in args.compile_calls.split(",") if x.strip()}
    except ValueError:
        p.error(f"--compile-calls {args.compile_calls!r}: comma list of integers")
    try:
        units = read_units([Path(f) for f in args.files])
        doc = pool(units, compile_calls, args.allow_not_first, args.min_calls, args.device)
    except ValueError as exc:
        p.error(str(exc))
    profiles = {}
    if args.profile:
        mine = [u for u in units if u["device"] == doc["device"]]
        profiles = {run: profile_rows(mine, run, compile_calls) for run in ("cold", "repeat", "decode_step")}
        doc["step_profile"] = profiles
    doc = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "command": "python -m benchmarks.pool " + " ".join(sys.argv[1:] if argv is None else argv),
           **doc}
    Path(args.out).write_text(json.dumps(doc, indent=1))
    table = markdown(doc) + "".join("\n" + profile_markdown(rows, run) for run, rows in profiles.items())
    if profiles:
        table += "\n" + decode_markdown(profiles["decode_step"])
    if args.markdown:
        Path(args.markdown).write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
