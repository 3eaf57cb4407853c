"""benchmarks/pool.py on synthetic per-call JSONs whose medians are computed by hand in the
comments: pooled medians with each call's beside them, ratios to ``off``, compile calls and
units not first in their call left out and flagged, one GPU model per pool."""

from __future__ import annotations

import json

import pytest

from benchmarks import pool

IDENT = {"host": "h1", "boot_id": "b1", "device": "NVIDIA H100 80GB HBM3", "gpu_uuid": "GPU-1"}


def _unit(row, call, position, cold, hit, floor, gaps_ms, steps, length=8192, ident=IDENT):
    t, times = 0.0, [0.0]
    for g in gaps_ms:
        t += g / 1e3
        times.append(t)
    return {"row": row, "prompt_tokens": length, "call": call, "position": position, "identity": ident,
            "engine": {"compile_s": 0.0},
            "samples": {"cold": {"ttft_ms": cold, "steps_to_first": steps},
                        "repeat": {"ttft_ms": hit}, "floor": {"ttft_ms": floor},
                        "conc1": {"token_times": [times]}}}


def _write(tmp_path, units, name):
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({"call": units[0]["call"], "identity": units[0]["identity"],
                                "device": units[0]["identity"]["device"],
                                "units": {f"{u['row']}@{u['prompt_tokens']}": u for u in units}}))
    return path


def _protocol(tmp_path):
    """Calls 1 (off) and 2 (exporter) compile; 3-10 alternate off / exporter, one row each."""
    files = [_write(tmp_path, [_unit("off", 1, 1, [90, 91], [90], [], [5, 5], [1])], "c1"),
             _write(tmp_path, [_unit("exporter", 2, 1, [95, 96], [40], [20], [6, 6], [1])], "c2")]
    off_cold = {3: [30, 32, 34], 5: [36, 38, 40], 7: [31, 33, 35], 9: [37, 39, 41]}
    exp_cold = {4: [33, 35, 37], 6: [39, 41, 43], 8: [34, 36, 38], 10: [40, 42, 44]}
    for c, cold in off_cold.items():
        files.append(_write(tmp_path, [_unit("off", c, 1, cold, [cold[1]], [], [2, 4], [1, 1, 1])], f"c{c}"))
    for c, cold in exp_cold.items():
        files.append(_write(tmp_path, [_unit("exporter", c, 1, cold, [20 + c], [10 + c], [3, 5], [1, 1, 2])],
                            f"c{c}"))
    return files


def test_pooled_medians_and_per_call_medians(tmp_path):
    doc = pool.pool(pool.read_units(_protocol(tmp_path)))
    rows = {r["row"]: r for r in doc["rows"]}
    off, exp = rows["off"], rows["exporter"]
    assert list(off) == [*pool.ROW_FIELDS, "per_call"]
    # off: 12 pooled cold samples 30..41 less {37..}: sorted 30 31 32 33 34 35 36 37 38 39 40 41
    # -> median (35 + 36) / 2 = 35.5; per call 32, 38, 33, 39
    assert off["cold_ttft_ms"] == 35.5
    assert [c["cold_ttft_ms"] for c in off["per_call"]] == [32, 38, 33, 39]
    assert off["call"] == [3, 5, 7, 9] and off["position"] == [1, 1, 1, 1]
    # exporter: 33..44 (12 values, 33 34 35 36 37 38 39 40 41 42 43 44): (38 + 39) / 2 = 38.5
    assert exp["cold_ttft_ms"] == 38.5
    assert exp["cold_ttft_vs_off"] == pytest.approx(38.5 / 35.5)
    # hits 24, 26, 28, 30 -> 27; floors 14, 16, 18, 20 -> 17; off has no floor
    assert exp["hit_ttft_ms"] == 27 and exp["floor_ttft_ms"] == 17 and off["floor_ttft_ms"] is None
    # ITL: off gaps 2, 4 per call -> pooled median of (2,4,2,4,2,4,2,4) = 3; exporter 3, 5 -> 4
    assert off["itl_ms"] == pytest.approx(3.0) and exp["itl_ms"] == pytest.approx(4.0)
    assert [c["itl_ms"] for c in exp["per_call"]] == [pytest.approx(4.0)] * 4
    # steps: off all 1; exporter (1, 1, 2) x 4 -> 1
    assert off["steps_per_cold_prompt"] == 1 and exp["steps_per_cold_prompt"] == 1
    assert not doc["flags"]


def test_compile_calls_are_not_pooled(tmp_path):
    doc = pool.pool(pool.read_units(_protocol(tmp_path)))
    excluded = {(e["call"], e["row"]): e["reason"] for e in doc["excluded"]}
    assert set(excluded) == {(1, "off"), (2, "exporter")}
    assert all("compile call" in r for r in excluded.values())
    assert all(1 not in r["call"] and 2 not in r["call"] for r in doc["rows"])
    # a call named compile explicitly is left out too (here: 3, the first timed off call)
    doc = pool.pool(pool.read_units(_protocol(tmp_path)), compile_calls={3})
    off = next(r for r in doc["rows"] if r["row"] == "off")
    assert off["call"] == [5, 7, 9]
    assert any("3 calls pooled" in f["flag"] for f in doc["flags"])


def test_units_not_first_in_their_call_are_flagged_and_left_out(tmp_path):
    files = _protocol(tmp_path)
    # call 11 ran exporter first, then off second: off@11 is not first in its call
    files.append(_write(tmp_path, [_unit("exporter", 11, 1, [50], [20], [10], [3], [1]),
                                   _unit("off", 11, 2, [99, 99, 99], [99], [], [9], [1])], "c11"))
    doc = pool.pool(pool.read_units(files))
    off = next(r for r in doc["rows"] if r["row"] == "off")
    assert 11 not in off["call"] and off["cold_ttft_ms"] == 35.5
    assert {"row": "off", "prompt_tokens": 8192, "call": 11, "flag": "not first in its call (position 2)"} in doc["flags"]
    doc = pool.pool(pool.read_units(files), allow_not_first=True)
    off = next(r for r in doc["rows"] if r["row"] == "off")
    assert off["call"][-1] == 11 and off["position"][-1] == 2
    assert any(f["call"] == 11 and "not first" in f["flag"] for f in doc["flags"])


def test_one_gpu_model_per_pool(tmp_path):
    files = _protocol(tmp_path)
    h200 = {**IDENT, "device": "NVIDIA H200", "gpu_uuid": "GPU-9", "boot_id": "b9"}
    files.append(_write(tmp_path, [_unit("off", 12, 1, [20], [20], [], [1], [1], ident=h200)], "c12"))
    with pytest.raises(ValueError, match="several GPU models"):
        pool.pool(pool.read_units(files))
    doc = pool.pool(pool.read_units(files), device="NVIDIA H100 80GB HBM3")
    assert all(12 not in r["call"] for r in doc["rows"])


def test_one_tensor_parallel_size_per_pool(tmp_path):
    """Issue 31: units of a ``--tp 2`` engine (``engine.tensor_parallel_size``) are not pooled with
    tp-1 units (older JSONs, which record no size, count as tp 1)."""
    files = _protocol(tmp_path)
    assert pool.pool(pool.read_units(files))["tp"] == 1
    unit = _unit("off", 12, 1, [20], [20], [], [1], [1])
    unit["engine"]["tensor_parallel_size"] = 2
    files.append(_write(tmp_path, [unit], "c12"))
    with pytest.raises(ValueError, match=r"tensor-parallel sizes \[1, 2\]"):
        pool.pool(pool.read_units(files))
    assert pool.pool(pool.read_units(files[-1:]), min_calls=1)["tp"] == 2


def test_cli_writes_json_and_markdown(tmp_path):
    out, md = tmp_path / "pooled.json", tmp_path / "table.md"
    assert pool.main([*map(str, _protocol(tmp_path)), "--out", str(out), "--markdown", str(md)]) == 0
    doc = json.loads(out.read_text())
    assert doc["command"].startswith("python -m benchmarks.pool") and doc["date"]
    table = md.read_text()
    assert "| exporter | 8,192 | 38.5 (35.0, 41.0, 36.0, 42.0) | 1.085 |" in table
    assert "call 1 off (compile call" in table


def test_a_call_without_a_number_is_refused(tmp_path):
    u = _unit("off", 1, 1, [1], [1], [], [1], [1])
    del u["call"]
    path = tmp_path / "x.json"
    path.write_text(json.dumps({"units": {"off@8192": u}}))
    with pytest.raises(ValueError, match="--call N"):
        pool.read_units([path])


def _prof(host_sched, gpu_fwd, wall, old_kernel_column=False):
    phases = {"schedule": {"host_ms": host_sched, "gpu_ms": 0.0, "calls": 1.0},
              "forward": {"host_ms": 5.0, "gpu_ms": gpu_fwd, "calls": 1.0}}
    run = {"steps": 1, "step_wall_ms": [wall], "gpu_kernel_ms": gpu_fwd, "phases": phases}
    if not old_kernel_column:  # the harness since issue 37: kernels, and memory ops apart
        run["gpu_memory_ms"] = 0.0
    return {"cold": run, "repeat": run, "decode": run, "decode_step": phases}


def test_step_profile_decomposition_pools_warm_calls(tmp_path):
    files = []
    # row a: call 1 compiles (left out), calls 3 and 5: schedule host 0.2 / 0.4 -> median 0.3
    for call, sched, gpu, wall in ((1, 9.0, 9.0, 99.0), (3, 0.2, 30.0, 40.0), (5, 0.4, 32.0, 42.0)):
        u = _unit("off-plugin", call, 1, [1], [1], [], [1], [1])
        u["step_profile"] = _prof(sched, gpu, wall)
        files.append(_write(tmp_path, [u], f"a{call}"))
    # row b: one call only (compile only: kept, marked)
    u = _unit("off-b1088", 2, 1, [1], [1], [], [1], [1])
    u["step_profile"] = _prof(0.7, 31.0, 41.0)
    files.append(_write(tmp_path, [u], "b2"))
    units = pool.read_units(files)
    rows = {r["row"]: r for r in pool.profile_rows(units, "cold")}
    a, b = rows["off-plugin"], rows["off-b1088"]
    assert a["calls"] == [3, 5] and not a["compile_only"]
    assert a["phases"]["schedule"]["host_ms"] == pytest.approx(0.3)
    assert a["phases"]["forward"]["gpu_ms"] == pytest.approx(31.0) and a["step_wall_ms"] == pytest.approx(41.0)
    assert b["compile_only"] and b["calls"] == [2]
    dec = {r["row"]: r for r in pool.profile_rows(units, "decode_step")}
    assert dec["off-plugin"]["phases"]["schedule"]["host_ms"] == pytest.approx(0.3)
    md = pool.profile_markdown(list(rows.values()), "cold")
    assert "| off-plugin | 8,192 | 3, 5 | 41.00 | 31.00 | 0.30 / 0.00 |" in md and "(compile only)" in md


def test_a_kernel_column_that_summed_ranges_is_not_shown(tmp_path):
    """Units written before issue 37 (no ``gpu_memory_ms``) summed every device-side profiler
    event into ``gpu_kernel_ms``, user ranges included: their column is not kernel time and
    is left out of the median; the other phases' numbers stay."""
    files = []
    for call, old in ((1, False), (3, True), (5, False), (7, True)):
        u = _unit("off", call, 1, [1], [1], [], [1], [1])
        u["step_profile"] = _prof(0.2, 30.0 + call, 40.0, old_kernel_column=old)
        files.append(_write(tmp_path, [u], f"k{call}"))
    (row,) = pool.profile_rows(pool.read_units(files), "cold")
    assert row["calls"] == [3, 5, 7] and row["gpu_kernel_ms"] == 35.0  # call 5's alone
    assert row["phases"]["forward"]["gpu_ms"] == 35.0  # median of 33, 35, 37
    (row,) = pool.profile_rows(pool.read_units(files[:2] + files[3:]), "cold")  # 1 compiles
    assert row["gpu_kernel_ms"] is None
    assert "| off | 8,192 | 3, 7 | 40.00 | - |" in pool.profile_markdown([row], "cold")


def test_rows_not_alternated_are_flagged(tmp_path):
    files = _protocol(tmp_path)
    # call 12 runs exporter right after call 10 (exporter; 11 is missing): not alternated
    files.append(_write(tmp_path, [_unit("exporter", 12, 1, [40], [20], [10], [3], [1])], "c12"))
    doc = pool.pool(pool.read_units(files))
    flags = [f for f in doc["flags"] if "alternated" in f["flag"]]
    assert flags == [{"row": "exporter", "prompt_tokens": None, "call": 12,
                      "flag": "same row as call 10 before it (protocol: rows alternated)"}]
    assert not [f for f in pool.pool(pool.read_units(_protocol(tmp_path)))["flags"] if "alternated" in f["flag"]]


def _decode_unit(row, call, sched_ms, walls=None, execute=None):
    u = _unit(row, call, 1, [1], [1], [], [1], [1])
    u["step_profile"] = {"decode_step": {"schedule": {"host_ms": sched_ms, "host_incl_ms": sched_ms,
                                                      "gpu_ms": None, "calls": 1.0}}}
    if walls is not None:  # the harness since issue 37: each decode step measured
        u["step_profile"]["decode_each"] = {"step_wall_ms": walls, "execute_model_ms": execute}
    return u


def test_decode_steps_side_by_side_with_ratios_to_off(tmp_path):
    """Issue 37: host time per decode step of off, vllm-align and the exporter side by side.
    off (calls 3, 5; 1 compiles): walls medians 5 and 7 -> 6; execute_model 2 and 2 -> 2;
    schedule 0.2, 0.4 -> 0.3. exporter (4, 6): walls 6.6, 7.8 -> 7.2 (1.2x); execute_model 2.5,
    3.5 -> 3 (1.5x); schedule 0.3 (1.0x). vllm-align (8, 10): written before decode_each, so no
    step wall or execute_model; schedule 0.6 (2.0x)."""
    units = [_decode_unit("off", 1, 9.0, [99.0], [99.0]),
             _decode_unit("off", 3, 0.2, [4.0, 5.0, 6.0], [1.0, 2.0, 3.0]),
             _decode_unit("off", 5, 0.4, [6.0, 7.0, 8.0], [2.0, 2.0, 2.0]),
             _decode_unit("exporter", 2, 9.0, [99.0], [99.0]),
             _decode_unit("exporter", 4, 0.3, [6.0, 6.6, 7.2], [2.5, 2.5, 2.5]),
             _decode_unit("exporter", 6, 0.3, [7.2, 7.8, 8.4], [3.5, 3.5, 3.5]),
             _decode_unit("vllm-align", 7, 9.0), _decode_unit("vllm-align", 8, 0.6),
             _decode_unit("vllm-align", 10, 0.6)]
    files = [_write(tmp_path, [u], f"d{u['call']}") for u in units]
    rows = pool.profile_rows(pool.read_units(files), "decode_step")
    md = pool.decode_markdown(rows).splitlines()
    lines = [x for x in md if x.startswith("| ") and "8,192" in x]
    assert [x.split(" | ")[0] for x in lines] == ["| off", "| exporter", "| vllm-align"]
    assert lines[0].startswith("| off | 8,192 | 3, 5 | 6.00 (1.000) | 2.00 (1.000) | 0.30 (1.000) | - (-) |")
    assert lines[1].startswith("| exporter | 8,192 | 4, 6 | 7.20 (1.200) | 3.00 (1.500) | 0.30 (1.000) |")
    assert lines[2].startswith("| vllm-align | 8,192 | 8, 10 | - (-) | - (-) | 0.60 (2.000) |")
    # without an off row there is nothing to divide by
    md = pool.decode_markdown([r for r in rows if r["row"] != "off"])
    assert "| exporter | 8,192 | 4, 6 | 7.20 (-) | 3.00 (-) | 0.30 (-) |" in md


def test_cli_profile_prints_the_decode_table(tmp_path, capsys):
    files = [_write(tmp_path, [_decode_unit(row, c, 0.5, [2.0], [1.0])], f"p{c}")
             for c, row in enumerate(["off", "exporter"] * 3, start=1)]
    out = tmp_path / "pooled.json"
    assert pool.main([*map(str, files), "--out", str(out), "--profile", "--min-calls", "2"]) == 0
    doc = json.loads(out.read_text())
    dec = {r["row"]: r for r in doc["step_profile"]["decode_step"]}
    assert dec["exporter"]["calls"] == [4, 6] and dec["exporter"]["execute_model_incl_ms"] == 1.0
    printed = capsys.readouterr().out
    assert "Decode steps, host ms per step" in printed
    assert "| exporter | 8,192 | 4, 6 | 2.00 (1.000) | 1.00 (1.000) |" in printed


def test_one_depth_per_pool(tmp_path, rng):
    """Units of models of different depths (``engine.num_hidden_layers``; older JSONs: the
    file's ``--layers``) are not pooled together."""
    files = _protocol(tmp_path)
    assert pool.pool(pool.read_units(files))["layers"] is None  # these fakes record no depth
    n = rng.choice([4, 12, 24, 40])
    for f, layers in zip(files, [8, n] + [8] * (len(files) - 2)):
        doc = json.loads(f.read_text())
        doc["args"] = {"layers": layers}  # a JSON of before the engine recorded its depth
        f.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=f"{min(8, n)}, {max(8, n)} decoder layers"):
        pool.pool(pool.read_units(files))
    doc = json.loads(files[1].read_text())
    for u in doc["units"].values():
        u["engine"]["num_hidden_layers"] = 8  # the engine's record wins over the flag
    files[1].write_text(json.dumps(doc))
    assert pool.pool(pool.read_units(files))["layers"] == 8


def test_rows_carry_the_block_and_the_tensor_parallel_size(tmp_path):
    """Issue 39: each pooled row names the block vLLM chose for its engine and the engine's
    tensor-parallel size; pooled calls that disagree on the block leave it None and are flagged.
    Calls 1 and 2 compile (not pooled): off pools calls 3 and 5 (cold 33, 35: median 34)."""
    files = []
    for call, row, block in ((1, "off", 1056), (2, "exporter", 1088), (3, "off", 1056), (4, "exporter", 1088),
                             (5, "off", 1056), (6, "exporter", 1120)):
        u = _unit(row, call, 1, [30 + call], [30], [20], [2], [1])
        u["engine"].update(block_size=block, tensor_parallel_size=2)
        files.append(_write(tmp_path, [u], f"c{call}"))
    doc = pool.pool(pool.read_units(files), min_calls=1)
    rows = {r["row"]: r for r in doc["rows"]}
    assert rows["off"]["block_size"] == 1056 and rows["off"]["tp"] == 2 == rows["exporter"]["tp"]
    assert rows["exporter"]["block_size"] is None
    assert [f["flag"] for f in doc["flags"] if f["row"] == "exporter"] == ["block sizes [1088, 1120] across the pooled calls"]
    table = pool.markdown(doc)
    assert "| off | 8,192 | 34.0 (33.0, 35.0) | 1.000 | 1 | 1056 |" in table, table


def test_cold_ttft_at_a_matched_host_probe(tmp_path):
    """``--phase-times`` JSONs (issue 37, session O): each row's cold TTFTs fitted on their host
    probes, at the median probe of both rows. Hand-computed: off's points lie on
    TTFT = 0.01 * probe + 20 (probes 1000..1500 -> 30..35 ms), the exporter's on
    TTFT = 0.02 * probe + 12 (probes 900, 1000, 1100, 1200 -> 30, 32, 34, 36). All ten probes
    sorted: 900 1000 1000 1100 1100 1200 1200 1300 1400 1500 -> median (1100 + 1200) / 2 = 1150;
    off at 1150: 31.5 ms; exporter: 35.0 ms; ratio 35 / 31.5 = 1.1111."""
    def unit(row, call, pairs):
        u = _unit(row, call, 1, [t for t, _ in pairs], [t for t, _ in pairs], [], [1, 1], [1] * len(pairs))
        u["samples"]["cold"]["phase_times"] = [{"phase_ms": {}, "host_probe_us": p} for _, p in pairs]
        return u

    files = [_write(tmp_path, [unit("off", 1, [(99.0, 1000.0)] * 3)], "c1"),  # compile: not pooled
             _write(tmp_path, [unit("exporter", 2, [(99.0, 1000.0)] * 3)], "c2"),
             _write(tmp_path, [unit("off", 3, [(30.0, 1000.0), (31.0, 1100.0), (32.0, 1200.0)])], "c3"),
             _write(tmp_path, [unit("exporter", 4, [(30.0, 900.0), (32.0, 1000.0)])], "c4"),
             _write(tmp_path, [unit("off", 5, [(33.0, 1300.0), (34.0, 1400.0), (35.0, 1500.0)])], "c5"),
             _write(tmp_path, [unit("exporter", 6, [(34.0, 1100.0), (36.0, 1200.0)])], "c6")]
    doc = pool.pool(pool.read_units(files), min_calls=2)
    rows = {r["row"]: r for r in doc["rows"]}
    off, exp = rows["off"], rows["exporter"]
    assert off["probe_us"] == exp["probe_us"] == 1150.0
    assert off["cold_ttft_at_probe_ms"] == pytest.approx(31.5)
    assert exp["cold_ttft_at_probe_ms"] == pytest.approx(35.0)
    assert exp["cold_ttft_at_probe_vs_off"] == pytest.approx(35.0 / 31.5)
    assert off["host_probe_us"] == 1250.0 and exp["host_probe_us"] == 1050.0
    assert [c["host_probe_us"] for c in off["per_call"]] == [1100.0, 1400.0]
    assert [c["host_probe_us"] for c in exp["per_call"]] == [950.0, 1150.0]
    # the raw columns are the protocol's, untouched: exporter 30 32 34 36 -> 33; off 30..35 -> 32.5
    assert exp["cold_ttft_ms"] == 33.0 and off["cold_ttft_ms"] == 32.5
    assert "at 1150 us: 35.0 ms, / off 1.111" in pool.markdown(doc)


def test_probe_fit_needs_three_points_and_a_spread():
    assert pool.fit_at([(1.0, 5.0), (2.0, 6.0)], 5.5) is None
    assert pool.fit_at([(1.0, 5.0), (2.0, 5.0), (3.0, 5.0)], 5.0) is None
    assert pool.fit_at([(1.0, 0.0), (3.0, 2.0), (2.0, 1.0)], 4.0) == pytest.approx(5.0)
