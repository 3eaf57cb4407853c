"""Placement is vLLM's (issue 20): the plugin installs no scheduler, and the retired
``VLLM_HYBRID_NPU_CHECKPOINTS`` is rejected (a policy value) or warned about (``upstream``).

The in-process cases call :func:`vllm_hybrid_npu.core.placement.check_checkpoints_env` and
:func:`vllm_hybrid_npu.patches.apply_patches` (which raises before it patches anything); the
plugin-load cases run vLLM's own ``load_general_plugins()`` in a fresh interpreter."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest

from vllm_hybrid_npu.core.placement import (
    ENV_VAR,
    PlacementPolicyRetiredError,
    check_checkpoints_env,
)

VAR = "VLLM_HYBRID_NPU_CHECKPOINTS"


def test_env_var_is_the_declared_one():
    from vllm_hybrid_npu.envs import ENV_VARS

    assert ENV_VAR == VAR and ENV_VARS[VAR].values == ("upstream",)


@pytest.mark.parametrize("value", ["lean", "LEAN", "tail", "adaptive", "everywhere"])
def test_policy_values_raise_naming_the_variable(value, monkeypatch):
    monkeypatch.setenv(VAR, value)
    with pytest.raises(PlacementPolicyRetiredError) as err:
        check_checkpoints_env()
    msg = str(err.value)
    assert f"{VAR}={value!r}" in msg
    assert "placement is vLLM's" in msg
    assert "vllm-hybrid-npu-lab advise" in msg  # where vLLM's flags come from
    assert "vllm_hybrid_npu_lab.scheduling.scheduler.LeanCheckpointScheduler" in msg  # the lab's rows
    assert isinstance(err.value, ValueError)  # what apply_patches documents for a bad variable


def test_gdn_names_the_prefill_checkpoints_variable(monkeypatch):
    monkeypatch.setenv(VAR, "gdn")
    with pytest.raises(PlacementPolicyRetiredError) as err:
        check_checkpoints_env()
    msg = str(err.value)
    assert f"{VAR}='gdn'" in msg and "'gdn' was retired" in msg
    assert "VLLM_HYBRID_NPU_PREFILL_CHECKPOINTS" in msg


def test_lean_message_does_not_mention_gdn(monkeypatch):
    monkeypatch.setenv(VAR, "lean")
    with pytest.raises(PlacementPolicyRetiredError) as err:
        check_checkpoints_env()
    assert "PREFILL_CHECKPOINTS" not in str(err.value)


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture
def plugin_warnings():
    """Warnings of the plugin's logger (it does not propagate once the plugin has loaded)."""
    handler = _Records()
    logger = logging.getLogger("vllm_hybrid_npu")
    logger.addHandler(handler)
    yield handler.messages
    logger.removeHandler(handler)


def test_unset_is_silent_and_upstream_is_deprecated(monkeypatch, plugin_warnings):
    monkeypatch.delenv(VAR, raising=False)
    assert check_checkpoints_env() is None
    monkeypatch.setenv(VAR, "")
    assert check_checkpoints_env() is None
    assert plugin_warnings == []
    monkeypatch.setenv(VAR, " Upstream ")
    assert check_checkpoints_env() == "upstream"
    assert len(plugin_warnings) == 1
    assert VAR in plugin_warnings[0] and "deprecated" in plugin_warnings[0]


@pytest.mark.parametrize("mode", ["auto", "none"])
def test_apply_patches_refuses_a_policy_before_patching(mode, monkeypatch):
    """Also with ``VLLM_HYBRID_NPU_PATCHES=none``: asking for a policy is never silently
    ignored. Nothing is applied (the check runs first)."""
    from vllm_hybrid_npu.patches import apply_patches, registry
    from vllm_hybrid_npu.support import Stack

    monkeypatch.setenv(VAR, "lean")
    monkeypatch.setenv("VLLM_HYBRID_NPU_PATCHES", mode)
    before = list(registry._replaced)
    with pytest.raises(PlacementPolicyRetiredError, match=VAR):
        apply_patches("cpu", Stack(target="cpu", vllm="0.30.0"))
    assert registry._replaced == before


def test_no_registry_entry_touches_the_scheduler_class():
    from vllm_hybrid_npu.patches import all_patches

    entries = all_patches()
    assert entries  # the registry was read
    assert "checkpoint-policy" not in {p.name for p in entries}
    assert not [p.name for p in entries if p.module == "vllm.config.scheduler"]


PROBE = r"""
import json
from vllm.plugins import load_general_plugins
load_general_plugins()
from vllm.config.scheduler import SchedulerConfig
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm_hybrid_npu import plugin
from vllm_hybrid_npu.patches import registry
print("RESULT " + json.dumps({
    "loaded": plugin._report is not None,
    "sync_is_vllms": SchedulerConfig.default_factory(async_scheduling=False).get_scheduler_cls() is Scheduler,
    "async_is_vllms": SchedulerConfig.default_factory(async_scheduling=True).get_scheduler_cls() is AsyncScheduler,
    "get_scheduler_cls_ours": registry.is_ours(vars(SchedulerConfig)["get_scheduler_cls"]),
}))
"""


def _load_plugin(value):
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_PLUGINS", VAR)}
    if value is not None:
        env[VAR] = value
    return subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize("value", [None, "upstream"])
def test_plugin_load_keeps_vllms_scheduler(value):
    proc = _load_plugin(value)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    out = json.loads(line[len("RESULT "):])
    assert out == {"loaded": True, "sync_is_vllms": True, "async_is_vllms": True,
                   "get_scheduler_cls_ours": False}
    deprecated = f"{VAR}=upstream is deprecated"
    assert (deprecated in proc.stderr + proc.stdout) is (value == "upstream")


def test_plugin_load_stops_on_lean():
    proc = _load_plugin("lean")
    assert proc.returncode != 0
    assert "RESULT " not in proc.stdout
    assert "PlacementPolicyRetiredError" in proc.stderr
    assert f"{VAR}='lean'" in proc.stderr and "vllm-hybrid-npu-lab advise" in proc.stderr
