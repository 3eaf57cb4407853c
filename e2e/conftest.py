"""Shared fixtures of the engine-level tests: tiny hybrid checkpoints built locally, once per
session, by ``vllm_hybrid_npu.tools.make_model`` (cached under ``$VLLM_HYBRID_NPU_CACHE``)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir():
    """A function ``(arch, gdn_memory="short") -> Path`` returning the cached tiny checkpoint of
    ``arch`` (``"qwen3_next"`` or ``"qwen3_5"``), built on first use. The exact output
    comparisons of test_gdn_engine.py use ``gdn_memory="long"``: with transformers' GDN decay the
    tiny model forgets a state within a few tokens, so a wrong state would not show in its
    outputs (docs/testing.md)."""
    from vllm_hybrid_npu.tools.make_model import default_model_dir

    return default_model_dir


def pytest_collection_modifyitems(items):
    for item in items:
        if "/e2e/" in str(item.fspath):
            item.add_marker(pytest.mark.e2e)
