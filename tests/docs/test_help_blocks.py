"""Every ``### `COMMAND --help` `` block in docs/ equals what the real parser prints, and every
subcommand of the two console scripts and every ``benchmarks`` script has such a block."""

from __future__ import annotations

import difflib
import importlib

import pytest
from _sync import ROOT, sync

BLOCKS = [b for p in sorted((ROOT / "docs").glob("*.md")) for b in sync.help_blocks(p)]


@pytest.mark.parametrize("block", BLOCKS, ids=[b.what.strip("`") for b in BLOCKS])
def test_help_block_matches_the_parser(block):
    diff = "".join(difflib.unified_diff(block.current.splitlines(True), block.expected.splitlines(True),
                                        "docs", "parser"))
    assert not block.stale, (
        f"{block.path.name}: {block.what} differs from the parser's output; "
        f"run `python docs/sync.py --write`\n{diff}"
    )


def _documented() -> set[str]:
    return {b.what.strip("`")[: -len(" --help")] for b in BLOCKS}


def test_every_command_has_a_help_block():
    from vllm_hybrid_npu.cli import SUBCOMMANDS
    from vllm_hybrid_npu_lab.__main__ import SUBCOMMANDS as LAB_SUBCOMMANDS

    want = {f"vllm-hybrid-npu {s}" for s in SUBCOMMANDS}
    want |= {f"vllm-hybrid-npu-lab {s}" for s in LAB_SUBCOMMANDS}
    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        if path.stem != "__init__" and hasattr(importlib.import_module(f"benchmarks.{path.stem}"), "main"):
            want.add(f"python -m benchmarks.{path.stem}")
    missing = sorted(want - _documented())
    assert not missing, f"no `--help` block in docs/ for: {missing}"


def test_renderer_uses_the_live_parser(monkeypatch):
    """The comparison is not against a frozen string: a new option shows up in the render."""
    from vllm_hybrid_npu.tools import make_model

    orig = make_model.add_arguments

    def with_extra(parser):
        orig(parser)
        parser.add_argument("--extra-option-for-this-test", help="xyzzy")

    monkeypatch.setattr(make_model, "add_arguments", with_extra)
    assert "--extra-option-for-this-test" in sync.render_help("vllm-hybrid-npu make-model")
