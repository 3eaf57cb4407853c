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

_report = None


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


def register():
    """Apply this process's patches once and log what happened.

    Called by vLLM for every process (API server, engine core, workers); later calls in the same
    process return the first call's report without patching again.

    Returns:
        The process's :class:`vllm_hybrid_npu.patches.registry.LoadReport` (its ``applied``
        list grows when a pending entry's module is imported later).

    Logs one INFO line: ``vllm-hybrid-npu <version> loaded: <stack> applied=[...]
    pending=[... (at import of M)] skipped=[name: reason; ...] failed=[...]``, or
    ``no patches: <reason>`` on a stack outside the support matrix. A pending entry logs its
    own line when it applies; a behaviour-changing entry that fails raises
    :class:`vllm_hybrid_npu.patches.registry.PatchError`.
    """
    global _report
    if _report is not None:
        return _report
    _ensure_log_handler()
    from vllm_hybrid_npu.patches import apply_patches

    _report = apply_patches(detect_target())
    logger.info(
        "vllm-hybrid-npu %s loaded: %s %s (pid %d)",
        __version__,
        _report.stack.describe() if _report.stack else "",
        _report.line(),
        os.getpid(),
    )
    return _report
