"""benchmarks/plan_host_time.py end to end, with this checkout as both rows: each worker's
steps write the blocks the engine listed (the worker asserts each group's slots against its
table), every call's samples land in the JSON, and the table's base row has ratio 1."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import plan_host_time as bench


def test_rows_run_and_report(tmp_path):
    out = tmp_path / "plan.json"
    root = str(Path(bench.__file__).resolve().parent.parent)
    assert bench.main(["--base-site", root, "--tokens", "8192", "--calls", "1", "--steps", "5",
                       "--warm", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [(c["row"], len(c["samples_us"])) for c in result["calls"]] == [("base", 5), ("head", 5)]
    assert all(c["package"].startswith(root) for c in result["calls"])
    base = [t for t in result["table"] if t["row"] == "base"]
    assert [t["ratio_to_base"] for t in base] == [1.0]


def test_base_site_must_hold_the_package(tmp_path, capsys):
    import pytest

    with pytest.raises(SystemExit):
        bench.main(["--base-site", str(tmp_path)])
    assert "--base-site" in capsys.readouterr().err
