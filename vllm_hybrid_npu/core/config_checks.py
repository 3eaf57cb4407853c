"""Early, flag-naming configuration errors for align mode.

Run on the user's settings before vLLM's own model-specific config hooks rewrite them (vLLM
0.30.0 / 0.32.0 ``VllmConfig.try_verify_and_update_config`` -> ``MambaModelConfig.
verify_and_update_config`` silently turns ``--mamba-cache-mode align`` into ``none`` when prefix
caching is off, and only ``assert``s chunked prefill). Raising here happens while the
configuration is being built in the API-server / ``LLM`` process, before any engine-core or
worker process exists, so a rejected configuration leaves no half-started engine behind.

What vLLM 0.30.0 itself supports for align mode (read from its source, not guessed):

* ``--enable-prefix-caching`` (else the mode is reset to ``none``), except with a KV-transfer
  connector (vllm-ascend 0.30.0rc2 uses align without prefix caching for PD disaggregation);
* chunked prefill (``MambaModelConfig.verify_and_update_config`` asserts it);
* chunked multimodal input (``VllmConfig`` asserts ``not disable_chunked_mm_input``);
* no prefill context parallelism (``HybridKVCacheCoordinator`` asserts ``pcp_world_size == 1``);
* ``--use-replayssm`` with align needs model runner V2 (vLLM raises this itself).
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("vllm_hybrid_npu")


class AlignModeConfigError(ValueError):
    """A configuration align mode cannot run with; the message names the flag to change."""


def model_has_mamba_layers(model_config: Any) -> bool:
    """True when the model has Mamba/GDN (recurrent-state) layers (hybrid or attention-free).

    Args:
        model_config: ``vllm.config.ModelConfig``.
    """
    return bool(
        getattr(model_config, "is_hybrid", False)
        or getattr(model_config, "is_attention_free", False)
        or getattr(model_config, "has_inner_state", False)
    )


def check_align_mode(vllm_config: Any) -> bool:
    """Validate an align-mode configuration; return whether align mode will be active.

    Args:
        vllm_config: ``vllm.config.VllmConfig`` as built from the user's flags (before vLLM's
            per-model config hooks ran).

    Returns:
        True when ``--mamba-cache-mode align`` applies to a model with Mamba/GDN layers; False
        when align mode is not requested, or requested for a model without such layers (then a
        warning is logged and nothing is changed).

    Raises:
        AlignModeConfigError: ``--mamba-cache-mode align`` without ``--enable-prefix-caching``
            (and without a KV-transfer connector); with ``--no-enable-chunked-prefill``; with
            ``--disable-chunked-mm-input``; with ``--prefill-context-parallel-size`` > 1.
    """
    cache = getattr(vllm_config, "cache_config", None)
    model = getattr(vllm_config, "model_config", None)
    if cache is None or model is None or getattr(cache, "mamba_cache_mode", "none") != "align":
        return False
    if not model_has_mamba_layers(model):
        logger.warning(
            "--mamba-cache-mode align has no effect: model %s has no Mamba/GDN layers",
            getattr(model, "model", "?"),
        )
        return False
    if not getattr(cache, "enable_prefix_caching", False) and not getattr(
        vllm_config, "kv_transfer_config", None
    ):
        raise AlignModeConfigError(
            "--mamba-cache-mode align caches the Mamba/GDN state for prefix caching and needs "
            "--enable-prefix-caching (got prefix caching disabled); add --enable-prefix-caching "
            "or drop --mamba-cache-mode align"
        )
    sched = getattr(vllm_config, "scheduler_config", None)
    if sched is not None and getattr(sched, "enable_chunked_prefill", True) is False:
        raise AlignModeConfigError(
            "--mamba-cache-mode align needs chunked prefill (vLLM schedules prompts in "
            "block-aligned chunks); remove --no-enable-chunked-prefill"
        )
    if sched is not None and getattr(sched, "disable_chunked_mm_input", False):
        raise AlignModeConfigError(
            "--mamba-cache-mode align needs chunked multimodal input; remove "
            "--disable-chunked-mm-input"
        )
    par = getattr(vllm_config, "parallel_config", None)
    pcp = int(getattr(par, "prefill_context_parallel_size", 1) or 1)
    if pcp > 1:
        raise AlignModeConfigError(
            f"--mamba-cache-mode align with hybrid models does not support prefill context "
            f"parallelism in vLLM (got --prefill-context-parallel-size {pcp}); use 1"
        )
    return True
