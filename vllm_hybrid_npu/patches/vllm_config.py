"""Patches of vLLM's configuration building: ``VllmConfig.try_verify_and_update_config``
(``vllm.config.vllm``, vLLM 0.23.0, 0.30.0, 0.32.0, 0.33.0) and, on vLLM 0.33.0,
``EngineArgs.create_engine_config`` (``vllm.engine.arg_utils``).

* ``config-checks``: runs the align-mode checks of :mod:`vllm_hybrid_npu.core.config_checks` on
  the user's settings first, with the semantics of the installed vLLM:
  :func:`~vllm_hybrid_npu.core.config_checks.check_align_mode` (0.23.0 - 0.32.0) or
  :func:`~vllm_hybrid_npu.core.config_checks.check_align_mode_v033` (0.33.0). vLLM's model hooks
  (``MambaModelConfig.verify_and_update_config``) otherwise change the mode silently and only
  ``assert`` chunked prefill; here the user gets an error naming the flag, raised while the
  configuration is built (API server / ``LLM`` process), before any engine process exists.
  It runs once per config (``model_config.config_updated`` false), then upstream's method.
* ``config-checks-flag`` (vLLM 0.33.0 only): 0.33's ``EngineArgs.create_engine_config``
  deprecates ``--mamba-cache-mode`` and drops its value before ``VllmConfig`` is built, so only
  ``EngineArgs`` still holds what the user asked for. After upstream's method built the config,
  :func:`~vllm_hybrid_npu.core.config_checks.check_mamba_cache_mode_flag` rejects an explicit
  mode that contradicts prefix caching (naming both flags); the config is returned unchanged
  otherwise.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from vllm_hybrid_npu.patches.registry import Patch
from vllm_hybrid_npu.support import Stack

VLLM_VERSIONS = ("0.23.0", "0.30.0", "0.32.0", "0.33.0")
#: vLLM versions whose ``EngineArgs`` ignores ``--mamba-cache-mode`` (deprecated).
VLLM_VERSIONS_DEPRECATED_MODE_FLAG = ("0.33.0",)


def _align_check(stack: Stack) -> Callable[[Any], Any]:
    from vllm_hybrid_npu.core import config_checks

    if stack.vllm in VLLM_VERSIONS_DEPRECATED_MODE_FLAG:
        return config_checks.check_align_mode_v033
    return config_checks.check_align_mode


def _make_config_checks(upstream: Any, stack: Stack) -> Any:
    check = _align_check(stack)

    @functools.wraps(upstream)
    def try_verify_and_update_config(self, *args, **kwargs):
        model_config = getattr(self, "model_config", None)
        if model_config is not None and not getattr(model_config, "config_updated", False):
            check(self)
        return upstream(self, *args, **kwargs)

    return try_verify_and_update_config


def _make_flag_check(upstream: Any, stack: Stack) -> Any:
    from vllm_hybrid_npu.core.config_checks import check_mamba_cache_mode_flag

    @functools.wraps(upstream)
    def create_engine_config(self, *args, **kwargs):
        explicit_prefix_caching = getattr(self, "enable_prefix_caching", None)
        vllm_config = upstream(self, *args, **kwargs)
        check_mamba_cache_mode_flag(self, vllm_config, explicit_prefix_caching)
        return vllm_config

    return create_engine_config


PATCHES = [
    Patch(
        name="config-checks",
        module="vllm.config.vllm",
        qualname="VllmConfig.try_verify_and_update_config",
        targets=("npu", "cuda", "cpu"),
        vllm=VLLM_VERSIONS,
        signature=("self",),
        make=_make_config_checks,
        why=(
            "flag-naming errors for align mode (prefix caching off, chunked prefill off, "
            "chunked multimodal input off, prefill context parallelism) where vLLM silently "
            "resets the mode or asserts; on 0.33 align mode is prefix caching on a hybrid model"
        ),
        until="vLLM validates align-mode flags itself",
    ),
    Patch(
        name="config-checks-flag",
        module="vllm.engine.arg_utils",
        qualname="EngineArgs.create_engine_config",
        targets=("npu", "cuda", "cpu"),
        vllm=VLLM_VERSIONS_DEPRECATED_MODE_FLAG,
        signature=("self", "usage_context"),
        make=_make_flag_check,
        why=(
            "vLLM 0.33 ignores the deprecated --mamba-cache-mode (the mode follows prefix "
            "caching): an explicit align with prefix caching off, none with it on, or another "
            "mode is an error naming --mamba-cache-mode and the prefix-caching flag"
        ),
        until="vLLM removes --mamba-cache-mode",
    ),
]
