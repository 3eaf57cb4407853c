"""Every table of measurements in README.md and docs/*.md sits in a section that names the
command and the date that produced it (the project's rule: docs carry the command and date
behind every number). ``python docs/sync.py --numbers`` lists the offenders."""

from __future__ import annotations

import textwrap

from _sync import ROOT, sync


def test_numeric_tables_name_their_command_and_date():
    bad = [t for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
           for t in sync.numeric_tables(p) if not t.ok]
    assert not bad, "\n".join(map(str, bad))


def test_the_check_sees_a_bare_table_and_accepts_a_sourced_one(tmp_path):
    bare = textwrap.dedent("""\
        ## Speed

        | size | ms |
        |---|---|
        | 1 | 2.5 |
        | 2 | 4.75 |
        """)
    sourced = bare.replace("## Speed\n", "## Speed\n\nRun on 2026-11-23:\n\n```\npython -m benchmarks.ttft\n```\n")
    names = tmp_path / "names.md"
    names.write_text("| flag | meaning |\n|---|---|\n| `--tp 2` | two ranks |\n")
    (tmp_path / "bare.md").write_text(bare)
    (tmp_path / "sourced.md").write_text(sourced)
    (b,) = sync.numeric_tables(tmp_path / "bare.md")
    assert (b.has_command, b.has_date) == (False, False)
    (s,) = sync.numeric_tables(tmp_path / "sourced.md")
    assert s.ok
    assert sync.numeric_tables(names) == []
