"""vLLM plugin entry point (``vllm.general_plugins``).

vLLM calls :func:`register` through ``vllm.plugins.load_general_plugins()`` in every process that
builds an engine or a worker (API server, engine core, workers), before the model runner is
created. ``VLLM_PLUGINS`` (a comma-separated allow-list of plugin names) excludes this plugin when
it does not name ``vllm_hybrid_npu``.
"""

from __future__ import annotations

import logging
import os

from vllm_hybrid_npu import __version__
from vllm_hybrid_npu.target import detect_target

logger = logging.getLogger("vllm_hybrid_npu")

#: Name under which the entry point is registered (what ``VLLM_PLUGINS`` lists).
PLUGIN_NAME = "vllm_hybrid_npu"

_applied: list[str] | None = None


def _ensure_log_handler() -> None:
    # vLLM configures only its own "vllm" logger tree; give ours a handler of the same format so
    # the load line is visible in `vllm serve` output without the user configuring logging.
    if logger.handlers or logging.getLogger().handlers:
        return
    try:
        from vllm.logger import init_logger  # noqa: F401  (makes vLLM set up its handlers)

        vllm_logger = logging.getLogger("vllm")
        for handler in vllm_logger.handlers:
            logger.addHandler(handler)
    except Exception:
        pass
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [%(name)s] %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def register() -> list[str]:
    """Apply this process's patches once and log what was applied.

    Called by vLLM for every process; later calls in the same process return the first call's
    result without patching again.

    Returns:
        The names of the patches applied in this process (list of str; empty when
        ``VLLM_HYBRID_NPU_PATCHES=none``).

    Logs one INFO line: ``vllm-hybrid-npu <version> loaded: target=<npu|cuda|cpu>
    patches=[...]`` (also in vLLM's own log format, under the logger ``vllm_hybrid_npu``).
    """
    global _applied
    if _applied is not None:
        return _applied
    _ensure_log_handler()
    target = detect_target()
    from vllm_hybrid_npu.patches import apply_patches

    _applied = apply_patches(target)
    logger.info(
        "vllm-hybrid-npu %s loaded: target=%s patches=[%s] (pid %d)",
        __version__,
        target,
        ", ".join(_applied),
        os.getpid(),
    )
    return _applied
