"""``apply_patches`` and the ``VLLM_HYBRID_NPU_PATCHES`` switch, through vLLM's plugin loading in
fresh processes (patches are process-global)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from vllm_hybrid_npu import patches

PROBE = """
import json
from vllm.plugins import load_general_plugins
load_general_plugins()
from vllm.v1.worker import mamba_utils, gpu_model_runner
from vllm.v1.kv_cache_interface import MambaSpec, AttentionSpec
from vllm.config import VllmConfig
from vllm_hybrid_npu.patches import _common
import vllm_hybrid_npu.plugin as p
print("RESULT " + json.dumps({
    "applied": p._applied,
    "preprocess": _common.is_ours(mamba_utils.preprocess_mamba),
    "copy": _common.is_ours(mamba_utils.do_mamba_copy_block),
    "reinit": _common.is_ours(gpu_model_runner.GPUModelRunner.may_reinitialize_input_batch),
    "mamba_spec": _common.is_ours(MambaSpec.max_num_blocks_per_req),
    "attn_spec": _common.is_ours(AttentionSpec.max_num_blocks_per_req),
    "config": _common.is_ours(VllmConfig.try_verify_and_update_config),
}))
"""


def _probe(mode: str | None, checkpoints: str | None = None):
    drop = ("VLLM_PLUGINS", patches.MODE_ENV, "VLLM_HYBRID_NPU_CHECKPOINTS")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    if mode is not None:
        env[patches.MODE_ENV] = mode
    if checkpoints is not None:
        env["VLLM_HYBRID_NPU_CHECKPOINTS"] = checkpoints
    proc = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def test_default_is_all_and_everything_is_routed():
    r = _probe(None)
    assert r["applied"][0] == "mode=all"
    assert "metrics" in r["applied"]
    assert all(r[k] for k in ("preprocess", "copy", "reinit", "mamba_spec", "attn_spec", "config"))


def test_kernel_mode_routes_only_the_copy():
    r = _probe("kernel")
    assert r["applied"][0] == "mode=kernel"
    assert r["copy"] is True
    assert not any(r[k] for k in ("preprocess", "reinit", "mamba_spec", "attn_spec", "config"))


def test_none_mode_with_upstream_checkpoints_patches_nothing():
    r = _probe("none", checkpoints="upstream")
    assert r["applied"] == ["mode=none"]
    assert not any(r[k] for k in ("preprocess", "copy", "reinit", "mamba_spec", "attn_spec", "config"))


def test_checkpoint_policy_is_installed_in_every_mode():
    from vllm_hybrid_npu.scheduling import DEFAULT_POLICY

    for mode in ("all", "none"):
        r = _probe(mode)
        assert r["applied"][0] == f"mode={mode}"
        assert r["applied"][-1] == f"scheduler:{DEFAULT_POLICY}"
    r = _probe("none")
    assert not any(r[k] for k in ("preprocess", "copy", "reinit", "mamba_spec", "attn_spec", "config"))


def test_bad_mode_names_the_variable(monkeypatch):
    monkeypatch.setenv(patches.MODE_ENV, "some")
    with pytest.raises(ValueError, match="VLLM_HYBRID_NPU_PATCHES='some'"):
        patches.apply_patches("cpu")


def test_bad_target_is_refused():
    with pytest.raises(ValueError, match="unknown target 'tpu'"):
        patches.apply_patches("tpu")


def test_patching_twice_wraps_once():
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_hybrid_npu.patches import _common, vllm_runner

    vllm_runner.apply("all")
    first = GPUModelRunner.may_reinitialize_input_batch
    vllm_runner.apply("all")
    assert GPUModelRunner.may_reinitialize_input_batch is first
    inner = _common.original(GPUModelRunner, "may_reinitialize_input_batch")
    assert not _common.is_ours(inner)
