"""Fixtures of the patch tests: apply named registry entries in this process, undo them after."""

from __future__ import annotations

import pytest


@pytest.fixture
def apply_entries():
    """``apply_entries(*names, stack=None)``: apply the registry entries named (all others are
    left out) for ``stack`` (default: this machine's), return the load report; every patch of
    the process is undone at teardown (entries applied by an earlier plugin load included)."""
    from vllm_hybrid_npu.patches import all_patches, registry
    from vllm_hybrid_npu.support import detect_stack

    registry.unapply_all()

    def apply(*names, stack=None):
        chosen = [p for p in all_patches() if p.name in names]
        assert {p.name for p in chosen} == set(names), f"unknown entries in {names}"
        return registry.apply_all(chosen, stack or detect_stack())

    yield apply
    registry.unapply_all()


@pytest.fixture
def seed():
    """A fresh random seed per test (``$VLLM_HYBRID_NPU_TEST_SEED`` replays one), printed so a
    failure's output names it."""
    import os
    import random

    value = int(os.environ.get("VLLM_HYBRID_NPU_TEST_SEED") or random.SystemRandom().randrange(2**31))
    print(f"seed={value} (replay: VLLM_HYBRID_NPU_TEST_SEED={value})")
    return value
