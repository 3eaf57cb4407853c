"""The warm-up entry's wrapper: compiles our kernel after upstream's warm-up when our launcher is
installed, and not for vLLM's V2 model runner (which never calls the launcher)."""

from __future__ import annotations

import logging
import types

import pytest
import torch

from vllm_hybrid_npu.patches import registry, worker_warmup
from vllm_hybrid_npu.support import Stack


@pytest.fixture
def launcher_installed(monkeypatch):
    """Our launcher in ``vllm.v1.worker.mamba_utils`` (as the copy-kernel entry leaves it)."""
    from vllm.v1.worker import mamba_utils

    monkeypatch.setattr(mamba_utils, "batch_memcpy", registry.mark(lambda s, d, n: None),
                        raising=False)  # vLLM 0.34 has none (its V2 runner's fused kernels copy)


def _wrapped(calls):
    def upstream(self):
        calls.append("upstream")
        return "compile-times"

    return worker_warmup._make(upstream, Stack("cuda", "0.30.0"))


def test_v1_runner_warms_our_kernel_after_upstream(launcher_installed, monkeypatch, caplog):
    calls = []
    monkeypatch.setattr("vllm_hybrid_npu.ops.warm_up",
                        lambda device: calls.append(("warm_up", str(device))) or 4)
    worker = types.SimpleNamespace(device=torch.device("cpu"), use_v2_model_runner=False)
    with caplog.at_level(logging.INFO, logger="vllm_hybrid_npu"):
        assert _wrapped(calls)(worker) == "compile-times"
    assert calls == ["upstream", ("warm_up", "cpu")]
    assert "copy kernel warmed up on cpu (4 launches)" in caplog.text


def test_v2_runner_is_told_and_not_warmed(launcher_installed, monkeypatch, caplog):
    calls = []
    monkeypatch.setattr("vllm_hybrid_npu.ops.warm_up", lambda device: calls.append("warm_up"))
    worker = types.SimpleNamespace(device=torch.device("cpu"), use_v2_model_runner=True)
    with caplog.at_level(logging.INFO, logger="vllm_hybrid_npu"):
        _wrapped(calls)(worker)
    assert calls == ["upstream"]
    assert "V2 model runner" in caplog.text


def test_nothing_without_our_launcher(monkeypatch):
    from vllm.v1.worker import mamba_utils

    monkeypatch.setattr(mamba_utils, "batch_memcpy", lambda s, d, n: None,  # not ours
                        raising=False)
    calls = []
    monkeypatch.setattr("vllm_hybrid_npu.ops.warm_up", lambda device: calls.append("warm_up"))
    _wrapped(calls)(types.SimpleNamespace(device=torch.device("cpu"), use_v2_model_runner=False))
    assert calls == ["upstream"]


def test_warm_up_really_copies_under_the_interpreter(monkeypatch):
    """ops.warm_up itself: every variant launched and checked (CPU, Triton interpreter)."""
    from vllm_hybrid_npu.ops import memcpy

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    memcpy.refresh_settings()
    try:
        assert memcpy.warm_up("cpu") == 4
    finally:
        monkeypatch.delenv("TRITON_INTERPRET")
        memcpy.refresh_settings()
