"""Align-mode configuration errors are raised while the config is built (before any engine
process exists) and name the flag; real ``EngineArgs.create_engine_config`` of vLLM."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys

import pytest
from vllm.engine.arg_utils import EngineArgs

from vllm_hybrid_npu.core.config_checks import check_align_mode


@pytest.fixture(scope="module")
def hybrid_model(tmp_path_factory):
    from vllm_hybrid_npu.tools.make_model import default_model_dir

    return str(default_model_dir("qwen3_next"))


@pytest.fixture(scope="module")
def attention_only_model(tmp_path_factory, hybrid_model):
    """A config-only Llama checkpoint (no weights are needed to build the configuration)."""
    d = tmp_path_factory.mktemp("llama")
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 2,
        "num_hidden_layers": 1, "vocab_size": 2048, "max_position_embeddings": 1024,
        "torch_dtype": "bfloat16",
    }))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{hybrid_model}/{f}", d / f)
    return str(d)


@pytest.fixture(autouse=True)
def _checks_installed(apply_entries):
    report = apply_entries("config-checks")
    assert report.applied == ["config-checks"], report.line()


def _build(model, **kw):
    return EngineArgs(model=model, max_model_len=1024, **kw).create_engine_config()


def test_align_without_prefix_caching_names_the_flag(hybrid_model):
    with pytest.raises(ValueError, match="--mamba-cache-mode align .*--enable-prefix-caching"):
        _build(hybrid_model, enable_prefix_caching=False, mamba_cache_mode="align")


def test_align_without_chunked_prefill_names_the_flag(hybrid_model):
    with pytest.raises(ValueError, match="--no-enable-chunked-prefill"):
        _build(hybrid_model, enable_prefix_caching=True, mamba_cache_mode="align",
               enable_chunked_prefill=False)


def test_valid_align_config_passes(hybrid_model):
    cfg = _build(hybrid_model, enable_prefix_caching=True, mamba_cache_mode="align")
    assert cfg.cache_config.mamba_cache_mode == "align"
    assert check_align_mode(cfg) is True


def test_no_align_is_left_alone(hybrid_model):
    cfg = _build(hybrid_model, enable_prefix_caching=False)
    assert cfg.cache_config.mamba_cache_mode == "none"
    assert check_align_mode(cfg) is False


def test_align_on_attention_only_model_warns_and_changes_nothing(attention_only_model, monkeypatch, caplog):
    monkeypatch.setattr(logging.getLogger("vllm_hybrid_npu"), "propagate", True)
    with caplog.at_level(logging.WARNING, logger="vllm_hybrid_npu"):
        cfg = _build(attention_only_model, enable_prefix_caching=True, mamba_cache_mode="align")
    assert cfg.cache_config.enable_prefix_caching is True
    assert any("--mamba-cache-mode align has no effect" in r.getMessage() for r in caplog.records)


def test_rejected_config_leaves_no_engine_process(hybrid_model):
    """Through vLLM's plugin loading and ``LLM(...)`` (engine core in its own process by default):
    the error comes before any engine process is started."""
    probe = (
        "import psutil, sys\n"
        "from vllm import LLM\n"
        "try:\n"
        f"    LLM(model={hybrid_model!r}, enable_prefix_caching=False, mamba_cache_mode='align',"
        " max_model_len=1024, kv_cache_memory_bytes=64<<20, enforce_eager=True)\n"
        "except Exception as e:\n"
        "    print('ERROR', str(e).replace(chr(10), ' '))\n"
        "print('CHILDREN', len(psutil.Process().children(recursive=True)))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_PLUGINS", "VLLM_HYBRID_NPU_PATCHES")}
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, env=env)
    out = proc.stdout
    assert "ERROR" in out and "--enable-prefix-caching" in out, (out, proc.stderr[-3000:])
    assert "CHILDREN 0" in out, out
