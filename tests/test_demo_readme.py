"""``vllm-hybrid-npu demo --readme PATH`` rewrites only the marked block of the README."""

from __future__ import annotations

import pytest

from vllm_hybrid_npu.tools import demo


def test_block_rewritten_with_command_and_date(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{demo.README_BEGIN}\nold stuff\n{demo.README_END}\noutro\n")
    demo.write_readme_block(str(readme), "line 1\nline 2", "vllm-hybrid-npu demo --readme README.md",
                            date="2026-11-23")
    text = readme.read_text()
    assert text.startswith("intro\n" + demo.README_BEGIN + "\n`vllm-hybrid-npu demo --readme README.md` (vLLM ")
    assert ", 2026-11-23):\n\n```\nline 1\nline 2\n```\n" + demo.README_END + "\noutro\n" in text
    assert "old stuff" not in text


def test_missing_markers_name_the_flag(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("no markers\n")
    with pytest.raises(ValueError, match="--readme"):
        demo.write_readme_block(str(readme), "x", "cmd")


def test_project_readme_has_the_markers():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert text.count(demo.README_BEGIN) == 1 and text.count(demo.README_END) == 1


def test_baselines_take_the_budget_the_plugin_raised():
    from vllm_hybrid_npu.tools.demo import raised_budget

    # the token-budget entry's INFO line (core.token_budget.decide's "raise" message), as the
    # server logs it; the last one counts (the engine core logs after the API server)
    line = ("INFO 11-28 04:44:02 [vllm_config.py:221] vllm-hybrid-npu: max_num_batched_tokens 2048 "
            "(vLLM's default) -> 2304 (6 blocks of 384, +256 tokens): in align mode ...")
    assert raised_budget(line) == 2304
    assert raised_budget(line + "\n" + line.replace("2304", "2560")) == 2560
    assert raised_budget("vllm-hybrid-npu: token budget 4096 is a multiple of the hybrid block 256") is None
