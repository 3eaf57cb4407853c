"""Per-target worker patches, selected by ``VLLM_HYBRID_NPU_PATCHES``.

``VLLM_HYBRID_NPU_PATCHES``:

* ``all`` (default): our align-mode path: configuration checks
  (:mod:`vllm_hybrid_npu.core.config_checks`), block tables sized by
  :mod:`vllm_hybrid_npu.core.block_tables`, ``preprocess_mamba`` routed to
  :mod:`vllm_hybrid_npu.core.state_copy`, copies through ``vllm_hybrid_npu.ops.batch_memcpy``,
  counted in :mod:`vllm_hybrid_npu.metrics`;
* ``kernel``: upstream's plan (vLLM / vllm-ascend ``preprocess_mamba``), only the copy itself
  (``do_mamba_copy_block``) is ours, and counted;
* ``none``: no worker patch (upstream's in-tree path; the counters stay absent).

The checkpoint policy of :mod:`vllm_hybrid_npu.scheduling` (``VLLM_HYBRID_NPU_CHECKPOINTS``,
default ``adaptive``) is installed in every mode; ``VLLM_HYBRID_NPU_CHECKPOINTS=upstream`` turns it
off, so ``none`` + ``upstream`` is vLLM / vllm-ascend unchanged.

Per-target modules: :mod:`vllm_hybrid_npu.patches.vllm_runner` (``cuda``, ``cpu``) and
:mod:`vllm_hybrid_npu.patches.ascend_runner` (``npu``). A target attribute missing on the running
vLLM / vllm-ascend version is logged and skipped, never fatal.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("vllm_hybrid_npu")

#: Environment variable choosing the patch set.
MODE_ENV = "VLLM_HYBRID_NPU_PATCHES"
MODES = ("all", "kernel", "none")


def patch_mode() -> str:
    """The patch set chosen by ``$VLLM_HYBRID_NPU_PATCHES`` (default ``all``).

    Raises:
        ValueError: the variable holds something other than ``all``, ``kernel`` or ``none``.
    """
    mode = os.environ.get(MODE_ENV, "all").strip().lower() or "all"
    if mode not in MODES:
        raise ValueError(f"{MODE_ENV}={mode!r} is not one of {', '.join(MODES)}")
    return mode


def apply_patches(target: str) -> list[str]:
    """Apply the patches for ``target`` (``"npu"``, ``"cuda"`` or ``"cpu"``).

    Returns:
        Names of the patches applied, in order (empty list when nothing applies, e.g.
        ``VLLM_HYBRID_NPU_PATCHES=none``).

    Raises:
        ValueError: unknown ``target`` or ``$VLLM_HYBRID_NPU_PATCHES`` value.
    """
    if target not in ("npu", "cuda", "cpu"):
        raise ValueError(f"unknown target {target!r}; expected npu, cuda or cpu")
    mode = patch_mode()
    # The checkpoint policy (scheduler side, ``VLLM_HYBRID_NPU_CHECKPOINTS``) has its own switch
    # and applies in every mode, so ``all`` vs ``none`` compares worker paths on one schedule.
    from vllm_hybrid_npu.scheduling import install_scheduler_policy

    scheduler = install_scheduler_policy()
    if mode == "none":
        return [f"mode={mode}", *scheduler]
    from vllm_hybrid_npu import metrics
    from vllm_hybrid_npu.patches import _common

    names: list[str] = []
    if mode == "all":
        _common.when_imported("vllm.config", lambda m: _common.wrap_config_checks(target))
        names.append("VllmConfig.try_verify_and_update_config")
        from vllm_hybrid_npu.patches import gdn_all_mode

        names += gdn_all_mode.apply(target)
    if target == "npu":
        from vllm_hybrid_npu.patches import ascend_runner

        names += ascend_runner.apply(mode)
    else:
        from vllm_hybrid_npu.patches import vllm_runner

        names += vllm_runner.apply(mode)
    if metrics.setup() is not None:
        names.append("metrics")
    return [f"mode={mode}", *names, *scheduler]
