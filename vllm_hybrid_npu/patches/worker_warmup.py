"""Patches of the workers' ``compile_or_warm_up_model``: compile our copy kernel at start-up.

Targets: ``vllm.v1.worker.gpu_worker.Worker.compile_or_warm_up_model`` (vLLM 0.30.0, 0.32.0,
CUDA) and ``vllm_ascend.worker.worker.NPUWorker.compile_or_warm_up_model`` (vllm-ascend
0.30.0rc2, 0.23.0.post1). After upstream's warm-up, :func:`vllm_hybrid_npu.ops.warm_up` launches
every variant of our kernel once on the worker's device, so the first align-mode step that copies
a state does not pay Triton's JIT compile (hundreds of milliseconds) inside ``execute_model``.
The wrapper decides when it runs (worker start, after upstream's warm-up), not when it is
applied: it warms up only if one of our launchers is installed in ``mamba_utils`` /
vllm-ascend's ``patch_mamba_utils`` by then (the copy-kernel entries apply at the import of
modules the worker loads after ``gpu_worker``), and not for vLLM's V2 model runner
(``Worker.use_v2_model_runner``: vLLM 0.30's default for these models on CUDA), which copies
align-mode states in its own fused kernel and never calls the launcher; it then logs that our
kernel is off that path.
"""

from __future__ import annotations

import functools
import logging
import sys
from typing import Any

from vllm_hybrid_npu.patches import registry
from vllm_hybrid_npu.patches.registry import Patch
from vllm_hybrid_npu.support import Stack

logger = logging.getLogger("vllm_hybrid_npu")

LAUNCHERS = (
    ("vllm.v1.worker.mamba_utils", "batch_memcpy"),
    ("vllm_ascend.patch.worker.patch_mamba_utils", "_batch_memcpy_triton"),
)


def our_launcher_installed() -> bool:
    """Whether one of the launchers the copy-kernel entries replace is ours in this process."""
    return any(
        registry.is_ours(getattr(sys.modules.get(mod), attr, None)) for mod, attr in LAUNCHERS
    )


def _make(upstream: Any, stack: Stack) -> Any:
    @functools.wraps(upstream)
    def compile_or_warm_up_model(self, *args, **kwargs):
        out = upstream(self, *args, **kwargs)
        if not our_launcher_installed():
            return out
        if getattr(self, "use_v2_model_runner", False):
            logger.info(
                "vllm-hybrid-npu: vLLM's V2 model runner copies align-mode states in its own fused "
                "kernel; our copy kernel is installed but not on its path (VLLM_USE_V2_MODEL_RUNNER=0 "
                "selects the V1 runner, which calls it)"
            )
            return out
        from vllm_hybrid_npu.ops import warm_up

        device = getattr(self, "device", None)
        if device is not None:
            n = warm_up(device)
            logger.info("vllm-hybrid-npu: copy kernel warmed up on %s (%d launches)", device, n)
        return out

    return compile_or_warm_up_model


_WHY = "compile our copy kernel at start-up instead of inside the first execute_model"
_UNTIL = "our copy kernel goes (see copy-kernel)"

PATCHES = [
    Patch(
        name="copy-kernel-warmup",
        module="vllm.v1.worker.gpu_worker",
        qualname="Worker.compile_or_warm_up_model",
        targets=("cuda",),
        vllm=("0.30.0", "0.32.0"),
        signature=("self",),
        make=_make,
        why=_WHY,
        until=_UNTIL,
    ),
    Patch(
        name="copy-kernel-warmup-ascend",
        module="vllm_ascend.worker.worker",
        qualname="NPUWorker.compile_or_warm_up_model",
        targets=("npu",),
        vllm=("0.30.0", "0.23.0"),
        vllm_ascend=("0.30.0rc2", "0.23.0.post1"),
        signature=("self",),
        make=_make,
        why=_WHY,
        until=_UNTIL,
    ),
]
