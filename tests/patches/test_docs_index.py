"""docs/patches.md holds the registry's generated table, and docs/compatibility.md one row per
support-matrix entry."""

from __future__ import annotations

import re
from pathlib import Path

from vllm_hybrid_npu.patches import index_markdown
from vllm_hybrid_npu.support import SUPPORT_MATRIX

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_patches_md_table_is_the_registry():
    text = (DOCS / "patches.md").read_text()
    m = re.search(r"<!-- registry:begin -->\n(.*?)<!-- registry:end -->", text, re.S)
    assert m, "docs/patches.md lacks the registry markers"
    assert m.group(1) == index_markdown(), (
        "docs/patches.md is out of date: regenerate the table with "
        "python -c 'from vllm_hybrid_npu.patches import index_markdown; print(index_markdown())'"
    )


def test_compatibility_md_lists_the_support_matrix():
    text = (DOCS / "compatibility.md").read_text()
    m = re.search(r"<!-- matrix:begin -->\n(.*?)<!-- matrix:end -->", text, re.S)
    assert m, "docs/compatibility.md lacks the matrix markers"
    rows = [r for r in m.group(1).splitlines()
            if r.startswith("| ") and not r.startswith(("| target", "| ---"))]
    got = {tuple(c.strip().strip("`") for c in r.strip("|").split("|")[:3]) for r in rows}
    want = {(r.target, r.vllm, r.vllm_ascend or "-") for r in SUPPORT_MATRIX}
    assert got == want
