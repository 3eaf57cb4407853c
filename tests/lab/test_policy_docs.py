"""Policy names in docs/ vs the lab's code: the policy table of docs/first-repeat-hits.md lists
exactly the lab's named scheduling policies (:mod:`vllm_hybrid_npu_lab.scheduling`, the runtime's
until 2026-11-25), every policy scheduler class the docs name exists (and
docs/configuration.md's ``--scheduler-cls`` row names them all), and docs/hitrate-lab.md's
"Registered:" table is the lab's registry. (Moved from tests/docs/ with the policies.)"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CLASS = re.compile(r"\b([A-Z]\w*Checkpoint(?:Async)?Scheduler)\b")


def _policy_table() -> list[str]:
    text = (ROOT / "docs" / "first-repeat-hits.md").read_text()
    m = re.search(r"^\| policy \|.*\n\|[-| ]+\|\n((?:\|.*\n)+)", text, re.M)
    assert m, "docs/first-repeat-hits.md has no '| policy | ...' table"
    return [re.match(r"\| `([^`]+)`", row).group(1) for row in m.group(1).splitlines()]


def test_policy_table_lists_every_scheduling_policy():
    from vllm_hybrid_npu_lab.scheduling.split import POLICY_NAMES

    assert sorted(_policy_table()) == sorted(POLICY_NAMES)


def test_scheduler_classes_named_in_docs_exist():
    from vllm_hybrid_npu_lab.scheduling.scheduler import SCHEDULER_CLASS_NAMES

    named = {}
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for m in CLASS.finditer(path.read_text()):
            named.setdefault(m.group(1), path.name)
    unknown = {c: where for c, where in named.items() if c not in SCHEDULER_CLASS_NAMES}
    assert not unknown, f"docs name scheduler classes the code does not define: {unknown}"


def test_scheduler_cls_row_names_every_policy_scheduler():
    from vllm_hybrid_npu_lab.scheduling.scheduler import SCHEDULER_CLASS_NAMES

    text = (ROOT / "docs" / "configuration.md").read_text()
    row = next(line for line in text.splitlines() if line.startswith("| `--scheduler-cls`"))
    missing = sorted(set(SCHEDULER_CLASS_NAMES) - set(CLASS.findall(row)))
    assert not missing, f"docs/configuration.md's --scheduler-cls row lacks {missing}"


def test_lab_policy_table_lists_the_registry():
    """docs/hitrate-lab.md's "Registered:" table names exactly the lab's registered policies."""
    from vllm_hybrid_npu_lab.policies import POLICIES, load_policy_modules

    load_policy_modules()
    text = (ROOT / "docs" / "hitrate-lab.md").read_text()
    m = re.search(r"Registered:\s*\n\s*\n(\|.*\n\|[-| ]+\|\n(?:\|.*\n)+)", text)
    assert m, "docs/hitrate-lab.md has no table after 'Registered:'"
    named = set()
    for row in m.group(1).splitlines()[2:]:
        first = row.strip().strip("|").split("|")[0]
        named |= set(re.findall(r"`([^`]+)`", first))
    # a documented family such as ``upstream:ret=…,lpt=…,pmu=…`` covers every registered
    # ``upstream:<some of those keys>=<value>,...``
    families = {n for n in named if "…" in n}

    def covered_by(name: str, fam: str) -> bool:
        head, _, params = fam.partition(":")
        keys = {p.split("=")[0] for p in params.split(",")}
        got_head, _, got_params = name.partition(":")
        return got_head == head and bool(got_params) and {
            p.split("=")[0] for p in got_params.split(",")} <= keys

    registered = set(POLICIES)
    missing = sorted(n for n in registered - named if not any(covered_by(n, f) for f in families))
    unknown = sorted(n for n in named - registered if n not in families)
    empty = sorted(f for f in families if not any(covered_by(n, f) for n in registered))
    assert not missing and not unknown and not empty, (
        f"missing from the table: {missing}; not registered: {unknown}; families matching "
        f"nothing: {empty}")
