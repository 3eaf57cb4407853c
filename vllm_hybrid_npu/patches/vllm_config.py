"""Patches of ``vllm.config.vllm`` (vLLM 0.23.0, 0.30.0, 0.32.0): ``VllmConfig.try_verify_and_update_config``.

* ``config-checks``: runs :func:`vllm_hybrid_npu.core.config_checks.check_align_mode` on the
  user's settings first. vLLM's model hooks (``MambaModelConfig.verify_and_update_config``)
  otherwise turn ``--mamba-cache-mode align`` without prefix caching silently into ``none`` and
  only ``assert`` chunked prefill; here the user gets an error naming the flag, raised while the
  configuration is built (API server / ``LLM`` process), before any engine process exists.
It runs once per config (``model_config.config_updated`` false), then upstream's method.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from vllm_hybrid_npu.patches.registry import Patch
from vllm_hybrid_npu.support import Stack

VLLM_VERSIONS = ("0.23.0", "0.30.0", "0.32.0")


def _before(check: Callable[[Any], None]) -> Callable[[Any, Stack], Any]:
    def make(upstream: Any, stack: Stack) -> Any:
        @functools.wraps(upstream)
        def try_verify_and_update_config(self, *args, **kwargs):
            model_config = getattr(self, "model_config", None)
            if model_config is not None and not getattr(model_config, "config_updated", False):
                check(self)
            return upstream(self, *args, **kwargs)

        return try_verify_and_update_config

    return make


def _check_align(vllm_config: Any) -> None:
    from vllm_hybrid_npu.core.config_checks import check_align_mode

    check_align_mode(vllm_config)


PATCHES = [
    Patch(
        name="config-checks",
        module="vllm.config.vllm",
        qualname="VllmConfig.try_verify_and_update_config",
        targets=("npu", "cuda", "cpu"),
        vllm=VLLM_VERSIONS,
        signature=("self",),
        make=_before(_check_align),
        why=(
            "flag-naming errors for align mode (prefix caching off, chunked prefill off, "
            "chunked multimodal input off, prefill context parallelism) where vLLM silently "
            "resets the mode or asserts"
        ),
        until="vLLM validates align-mode flags itself",
    ),
]
