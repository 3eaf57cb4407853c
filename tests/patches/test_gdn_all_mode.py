"""Configuration side of GDN in-step checkpoints (issue 8): ``VLLM_HYBRID_NPU_CHECKPOINTS=gdn``
turns align mode into vLLM's ``'all'`` mode for GDN models on CPU, ``--mamba-cache-mode all``
is no longer reverted to align, the block size stays a multiple of the GDN chunk, and what the
path cannot run is refused with the flag named.

Real vLLM 0.30 configurations of the tiny local Qwen3-Next (``EngineArgs.create_engine_config``,
no engine started); the plugin is loaded by vLLM itself (``load_general_plugins``).
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from vllm_hybrid_npu.patches.gdn_all_mode import (
    GDN_CHUNK_SIZE,
    GdnAllModeConfigError,
    all_mode_available,
    maybe_switch_to_all,
)

needs_all_mode = pytest.mark.skipif(
    not all_mode_available(), reason="this vLLM has no --mamba-cache-mode all (vLLM 0.32 removed it)"
)


@pytest.fixture(autouse=True)
def _gdn_entries(apply_entries, monkeypatch):
    """The entries this module exercises, applied as the registry applies them under
    ``VLLM_HYBRID_NPU_CHECKPOINTS=gdn`` (the gate is read when they are applied)."""
    import vllm.config  # noqa: F401  (the entries apply at once, not at a later import)

    from vllm_hybrid_npu.support import Stack

    monkeypatch.setenv("VLLM_HYBRID_NPU_CHECKPOINTS", "gdn")
    names = ("config-checks", "gdn-switch", "gdn-support", "gdn-chunk-size")
    stack = Stack("cpu", "0.30.0") if all_mode_available() else None
    report = apply_entries(*names, stack=stack)
    monkeypatch.delenv("VLLM_HYBRID_NPU_CHECKPOINTS")
    return report


def _config(tiny_model_dir, **kw):
    from vllm.engine.arg_utils import EngineArgs

    from vllm_hybrid_npu.tools.server import CPU_SAFE_ENGINE_ARGS

    args = {**CPU_SAFE_ENGINE_ARGS, "enable_prefix_caching": True, **kw}
    return EngineArgs(model=str(tiny_model_dir("qwen3_next")), **args).create_engine_config()


@pytest.fixture
def tiny_model_dir():
    from vllm_hybrid_npu.tools.make_model import default_model_dir

    return default_model_dir


@pytest.mark.skipif(all_mode_available(), reason="vLLM has 'all' mode (0.30): switch tested below")
def test_gdn_policy_without_all_mode_stays_align(tiny_model_dir, monkeypatch, caplog):
    monkeypatch.setenv("VLLM_HYBRID_NPU_CHECKPOINTS", "gdn")
    with caplog.at_level(logging.WARNING, logger="vllm_hybrid_npu"):
        cfg = _config(tiny_model_dir, mamba_cache_mode="align")
    assert cfg.cache_config.mamba_cache_mode == "align"


@needs_all_mode
def test_gdn_policy_switches_align_to_all(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("VLLM_HYBRID_NPU_CHECKPOINTS", "gdn")
    cfg = _config(tiny_model_dir, mamba_cache_mode="align")
    assert cfg.cache_config.mamba_cache_mode == "all"
    assert cfg.cache_config.block_size % GDN_CHUNK_SIZE == 0


def test_other_policies_keep_align(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("VLLM_HYBRID_NPU_CHECKPOINTS", "lean")
    cfg = _config(tiny_model_dir, mamba_cache_mode="align")
    assert cfg.cache_config.mamba_cache_mode == "align"


@needs_all_mode
def test_explicit_all_mode_is_kept_for_gdn_model(tiny_model_dir, monkeypatch):
    # upstream falls back to align ("without support for prefix caching with Mamba cache 'all'")
    monkeypatch.setenv("VLLM_HYBRID_NPU_CHECKPOINTS", "upstream")
    cfg = _config(tiny_model_dir, mamba_cache_mode="all")
    assert cfg.cache_config.mamba_cache_mode == "all"
    # aligned to the 64-token GDN chunk, not to Mamba1's 2048 default
    assert cfg.cache_config.block_size % GDN_CHUNK_SIZE == 0
    assert cfg.cache_config.block_size < 2048


@needs_all_mode
def test_all_mode_with_speculative_decoding_is_refused(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("VLLM_HYBRID_NPU_CHECKPOINTS", "gdn")
    # vLLM's pydantic VllmConfig re-raises our GdnAllModeConfigError as a ValidationError (also a
    # ValueError) carrying the message
    with pytest.raises(ValueError, match="does not support --speculative-config"):
        _config(tiny_model_dir, mamba_cache_mode="align",
                speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                    "prompt_lookup_max": 3})


@needs_all_mode
def test_all_mode_with_speculative_decoding_is_refused_before_any_change(monkeypatch):
    monkeypatch.setenv("VLLM_HYBRID_NPU_CHECKPOINTS", "gdn")
    cfg = _stub()
    cfg.speculative_config = object()
    with pytest.raises(GdnAllModeConfigError, match="--speculative-config"):
        maybe_switch_to_all(cfg, "cpu")
    assert cfg.cache_config.mamba_cache_mode == "align"


def _stub(mode="align", arch="Qwen3NextForCausalLM", caching=True):
    return SimpleNamespace(
        cache_config=SimpleNamespace(enable_prefix_caching=caching, mamba_cache_mode=mode),
        model_config=SimpleNamespace(architecture=arch, hf_config=SimpleNamespace(architectures=[arch])),
        speculative_config=None,
    )


@pytest.mark.parametrize("target", ["cuda", "npu"])
def test_gdn_policy_on_target_without_implementation_stays_align(target, monkeypatch, caplog):
    monkeypatch.setenv("VLLM_HYBRID_NPU_CHECKPOINTS", "gdn")
    cfg = _stub()
    with caplog.at_level(logging.WARNING, logger="vllm_hybrid_npu"):
        assert maybe_switch_to_all(cfg, target) is False
    assert cfg.cache_config.mamba_cache_mode == "align"
    assert f"not {target}" in caplog.text


@needs_all_mode
def test_gdn_policy_leaves_other_models_and_caching_off_alone(monkeypatch):
    monkeypatch.setenv("VLLM_HYBRID_NPU_CHECKPOINTS", "gdn")
    for cfg in (_stub(arch="MambaForCausalLM"), _stub(caching=False)):
        assert maybe_switch_to_all(cfg, "cpu") is False
        assert cfg.cache_config.mamba_cache_mode == "align"
    cfg = _stub()
    assert maybe_switch_to_all(cfg, "cpu") is True
    assert cfg.cache_config.mamba_cache_mode == "all"
