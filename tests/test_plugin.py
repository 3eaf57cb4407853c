"""Registration through vLLM's plugin machinery, and target detection."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import entry_points

import pytest

from vllm_hybrid_npu import target
from vllm_hybrid_npu.envs import OPTIONS_ENV

PROBE = """
import json, vllm_hybrid_npu.plugin as p
from vllm.plugins import load_general_plugins
load_general_plugins()
load_general_plugins()
print("RESULT " + json.dumps(None if p._report is None else p._report.applied))
"""


def _probe(env_extra: dict[str, str]) -> tuple[object, str]:
    env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
    env.update(env_extra)
    proc = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):]), proc.stdout + proc.stderr


def test_entry_point_is_registered():
    eps = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "vllm_hybrid_npu"]
    assert len(eps) == 1
    from vllm_hybrid_npu.plugin import register

    assert eps[0].load() is register


def test_vllm_loads_plugin_once_and_logs_one_line():
    applied, out = _probe({})
    assert isinstance(applied, list)
    lines = [l for l in out.splitlines() if "vllm-hybrid-npu" in l and " loaded: " in l]
    assert len(lines) == 1, out[-2000:]
    from vllm_hybrid_npu import __version__
    from vllm_hybrid_npu.support import detect_stack

    vllm_version = detect_stack("cpu").vllm  # the installed distribution's metadata
    assert vllm_version in ("0.30.0", "0.32.0", "0.33.0", "0.34.0")
    assert f"vllm-hybrid-npu {__version__} loaded: target=cpu vllm={vllm_version} applied=[" in lines[0]
    if vllm_version in ("0.33.0", "0.34.0"):  # rows covering some entries (0.33: config checks,
        # step counters, the exporter; 0.34: config checks, step counters)
        assert f"outside the support matrix (its row target=cpu vllm={vllm_version} covers" in lines[0]
    assert " skipped=[" in lines[0] and " failed=[]" in lines[0]
    assert lines[0].startswith("INFO")


def test_vllm_plugins_can_exclude_it():
    applied, out = _probe({"VLLM_PLUGINS": "lora_filesystem_resolver"})
    assert applied is None
    assert "vllm-hybrid-npu" not in out


def test_detect_target_here_is_cpu(monkeypatch):
    monkeypatch.delenv(OPTIONS_ENV, raising=False)
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA; the CPU-only expectation does not apply")
    assert target.detect_target() == "cpu"


@pytest.mark.parametrize("name", target.TARGETS)
def test_detect_target_can_be_forced(monkeypatch, name):
    monkeypatch.setenv(OPTIONS_ENV, f"target={name.upper()}")
    assert target.detect_target() == name


def test_detect_target_rejects_unknown(monkeypatch):
    monkeypatch.setenv(OPTIONS_ENV, "target=tpu")
    with pytest.raises(ValueError,
                       match="VLLM_HYBRID_NPU_OPTIONS: target='tpu' is not one of npu, cuda, cpu"):
        target.detect_target()
