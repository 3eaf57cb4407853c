"""Policy names in docs/ vs the code's: the policy table of docs/first-repeat-hits.md lists
exactly the scheduling policies, and every policy scheduler class the docs name exists (and
docs/configuration.md's ``--scheduler-cls`` row names them all)."""

from __future__ import annotations

import re

from _sync import ROOT

CLASS = re.compile(r"\b([A-Z]\w*Checkpoint(?:Async)?Scheduler)\b")


def _policy_table() -> list[str]:
    text = (ROOT / "docs" / "first-repeat-hits.md").read_text()
    m = re.search(r"^\| policy \|.*\n\|[-| ]+\|\n((?:\|.*\n)+)", text, re.M)
    assert m, "docs/first-repeat-hits.md has no '| policy | ...' table"
    return [re.match(r"\| `([^`]+)`", row).group(1) for row in m.group(1).splitlines()]


def test_policy_table_lists_every_scheduling_policy():
    from vllm_hybrid_npu.scheduling.split import POLICY_NAMES

    assert sorted(_policy_table()) == sorted(POLICY_NAMES)


def test_scheduler_classes_named_in_docs_exist():
    from vllm_hybrid_npu.scheduling.scheduler import SCHEDULER_CLASS_NAMES

    named = {}
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for m in CLASS.finditer(path.read_text()):
            named.setdefault(m.group(1), path.name)
    unknown = {c: where for c, where in named.items() if c not in SCHEDULER_CLASS_NAMES}
    assert not unknown, f"docs name scheduler classes the code does not define: {unknown}"


def test_scheduler_cls_row_names_every_policy_scheduler():
    from vllm_hybrid_npu.scheduling.scheduler import SCHEDULER_CLASS_NAMES

    text = (ROOT / "docs" / "configuration.md").read_text()
    row = next(line for line in text.splitlines() if line.startswith("| `--scheduler-cls`"))
    missing = sorted(set(SCHEDULER_CLASS_NAMES) - set(CLASS.findall(row)))
    assert not missing, f"docs/configuration.md's --scheduler-cls row lacks {missing}"
