"""The suite's random-draw machinery (the repository's ``conftest.py``): fresh seeds per run,
printed on failure, replayed by ``VLLM_HYBRID_NPU_TEST_SEED``. Runs pytest on a throw-away test
file with the real conftest (``pytester``, in-process)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"

DRAWING_TEST = """
import random

import pytest


@pytest.fixture(scope="module")
def module_draw(request, seed_for):
    return random.Random(seed_for(request, "prompts")).random()


def test_draws(rng, np_rng, module_draw):
    print("DRAWS", rng.random(), float(np_rng.random()), random.random(), module_draw)
    assert {fail}
"""


def _run(pytester, monkeypatch, fail: bool, seed: str | None):
    pytester.makeconftest(CONFTEST.read_text().replace('pytest_plugins = ["pytester"]', ""))
    pytester.makepyfile(test_draw=DRAWING_TEST.format(fail="False" if fail else "True"))
    if seed is None:
        monkeypatch.delenv("VLLM_HYBRID_NPU_TEST_SEED", raising=False)
    else:
        monkeypatch.setenv("VLLM_HYBRID_NPU_TEST_SEED", seed)
    result = pytester.runpytest_subprocess("-s", "-p", "no:cacheprovider")
    out = result.stdout.str()
    draws = re.search(r"DRAWS (.*)", out).group(1)
    session = re.search(r"session seed (\d+)", out).group(1)
    return result, out, draws, session


def test_failure_prints_the_seed_and_replay_reproduces_every_draw(pytester, monkeypatch):
    result, out, draws, session = _run(pytester, monkeypatch, fail=True, seed=None)
    result.assert_outcomes(failed=1)
    assert "random seed" in out and f"VLLM_HYBRID_NPU_TEST_SEED={session}" in out
    assert re.search(r"prompts = \d+ \(drawn for test_draw.py\)", out), out
    again, out2, draws2, session2 = _run(pytester, monkeypatch, fail=True, seed=session)
    assert session2 == session
    assert draws2 == draws  # fixture, numpy, global and module-scoped draws all replayed


def test_fresh_runs_draw_fresh(pytester, monkeypatch):
    runs = [_run(pytester, monkeypatch, fail=False, seed=None) for _ in range(2)]
    for result, out, _, _ in runs:
        result.assert_outcomes(passed=1)
        assert "random seed" not in out.split("session seed")[-1].split("\n", 1)[1]
    assert runs[0][3] != runs[1][3] and runs[0][2] != runs[1][2]


def test_bad_seed_is_a_usage_error(pytester, monkeypatch):
    pytester.makeconftest(CONFTEST.read_text().replace('pytest_plugins = ["pytester"]', ""))
    pytester.makepyfile(test_x="def test_x():\n    pass\n")
    monkeypatch.setenv("VLLM_HYBRID_NPU_TEST_SEED", "abc")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    assert result.ret != 0
    assert "VLLM_HYBRID_NPU_TEST_SEED='abc' is not an integer" in result.stderr.str() + result.stdout.str()
