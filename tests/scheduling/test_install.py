"""The registry's ``checkpoint-policy`` entry as the plugin applies it in every process. Each case
runs in a fresh interpreter (it patches vLLM's SchedulerConfig for the whole process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PROBE = r"""
import json
from vllm_hybrid_npu.patches import apply_patches
from vllm.config.scheduler import SchedulerConfig
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

first = [n for n in apply_patches("cpu").applied if n == "checkpoint-policy"]
second = [n for n in apply_patches("cpu").applied if n == "checkpoint-policy"]
sync_cls = SchedulerConfig.default_factory(async_scheduling=False).get_scheduler_cls()
async_cls = SchedulerConfig.default_factory(async_scheduling=True).get_scheduler_cls()
explicit = SchedulerConfig.default_factory(
    scheduler_cls="vllm.v1.core.sched.scheduler.Scheduler").get_scheduler_cls()
print(json.dumps({
    "first": first, "second": second,
    "sync": sync_cls.__name__, "sync_is_scheduler": issubclass(sync_cls, Scheduler),
    "sync_is_async": issubclass(sync_cls, AsyncScheduler),
    "async": async_cls.__name__, "async_is_async": issubclass(async_cls, AsyncScheduler),
    "policy": getattr(sync_cls, "checkpoint_policy", None),
    "explicit_is_scheduler": explicit is Scheduler,
}))
"""


def _probe(value):
    env = dict(os.environ)
    env.pop("VLLM_HYBRID_NPU_CHECKPOINTS", None)
    if value is not None:
        env["VLLM_HYBRID_NPU_CHECKPOINTS"] = value
    proc = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True,
                          timeout=300)
    return proc


def test_default_policy_installed_idempotently():
    from vllm_hybrid_npu.scheduling import DEFAULT_POLICY

    default = DEFAULT_POLICY["cpu"]
    if default == "upstream":
        pytest.skip("the CPU default is upstream: test_upstream_installs_nothing covers it")
    proc = _probe(None)  # variable unset: the default
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["first"] == out["second"] == ["checkpoint-policy"]
    assert out["policy"] == default
    assert out["sync_is_scheduler"] and not out["sync_is_async"]
    assert out["async_is_async"]  # async scheduling keeps AsyncScheduler as the base
    assert out["explicit_is_scheduler"]  # an explicit --scheduler-cls wins


def test_upstream_installs_nothing():
    proc = _probe("upstream")
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["first"] == out["second"] == []
    assert out["sync"] == "Scheduler" and out["async"] == "AsyncScheduler"
    assert out["policy"] is None


def test_bad_value_names_the_variable():
    env = dict(os.environ, VLLM_HYBRID_NPU_CHECKPOINTS="everywhere")
    proc = subprocess.run(
        [sys.executable, "-c",
         "from vllm_hybrid_npu.patches import apply_patches; apply_patches('cpu')"],
        env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "VLLM_HYBRID_NPU_CHECKPOINTS='everywhere'" in proc.stderr


def test_lean_installs_on_both_bases():
    proc = _probe("lean")
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["first"] == out["second"] == ["checkpoint-policy"]
    assert out["policy"] == "lean"
    assert out["sync"] == "LeanCheckpointScheduler" and not out["sync_is_async"]
    assert out["async"] == "LeanCheckpointAsyncScheduler" and out["async_is_async"]
    assert out["explicit_is_scheduler"]


def test_npu_default_is_upstream():
    """No checkpoint policy on NPU unless asked for: vllm-ascend's schedulers composed with a
    policy are not proven there (issue 12)."""
    from vllm_hybrid_npu.scheduling import DEFAULT_POLICY, selected_policy

    env = os.environ.pop("VLLM_HYBRID_NPU_CHECKPOINTS", None)
    try:
        assert DEFAULT_POLICY["npu"] == "upstream"
        assert selected_policy("npu") == "upstream"
    finally:
        if env is not None:
            os.environ["VLLM_HYBRID_NPU_CHECKPOINTS"] = env


def test_retired_policies_raise_with_what_replaces_them(monkeypatch):
    """``tail`` and ``adaptive`` were retired (2026-11-23), ``gdn`` on 2026-11-25: the error names
    the variable and says what replaces them."""
    from vllm_hybrid_npu.scheduling import selected_policy

    monkeypatch.setenv("VLLM_HYBRID_NPU_CHECKPOINTS", "tail")
    with pytest.raises(ValueError) as err:
        selected_policy("cpu")
    msg = str(err.value)
    assert "VLLM_HYBRID_NPU_CHECKPOINTS='tail'" in msg
    assert "--long-prefill-token-threshold <block size> --prefix-cache-retention-interval None" in msg
    monkeypatch.setenv("VLLM_HYBRID_NPU_CHECKPOINTS", "Adaptive")
    with pytest.raises(ValueError) as err:
        selected_policy("cpu")
    msg = str(err.value)
    assert "VLLM_HYBRID_NPU_CHECKPOINTS='Adaptive'" in msg and "'adaptive' was retired" in msg
    assert "vllm-hybrid-npu-lab hitrate --policy adaptive" in msg
    monkeypatch.setenv("VLLM_HYBRID_NPU_CHECKPOINTS", "gdn")
    with pytest.raises(ValueError) as err:
        selected_policy("cpu")
    assert "'gdn' was retired" in str(err.value)
    assert "VLLM_HYBRID_NPU_PREFILL_CHECKPOINTS" in str(err.value)
    for value in ("upstream", "lean"):
        monkeypatch.setenv("VLLM_HYBRID_NPU_CHECKPOINTS", value)
        assert selected_policy("cpu") == value
