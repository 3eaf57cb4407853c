"""Patches of the workers' ``compile_or_warm_up_model``: compile our copy kernel at start-up.

Targets: ``vllm.v1.worker.gpu_worker.Worker.compile_or_warm_up_model`` (vLLM 0.30.0, 0.32.0,
CUDA) and ``vllm_ascend.worker.worker.NPUWorker.compile_or_warm_up_model`` (vllm-ascend
0.30.0rc2, 0.23.0.post1). After upstream's warm-up, :func:`vllm_hybrid_npu.ops.warm_up` launches
every variant of our kernel once on the worker's device, so the first align-mode step that copies
a state does not pay Triton's JIT compile (hundreds of milliseconds) inside ``execute_model``.
Applied only in a process where one of the copy-kernel entries applied (the probe reads this
process's load report).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from vllm_hybrid_npu.patches import registry
from vllm_hybrid_npu.patches.registry import Patch
from vllm_hybrid_npu.support import Stack

logger = logging.getLogger("vllm_hybrid_npu")

COPY_ENTRIES = ("copy-kernel", "copy-kernel-ascend")


def _probe(upstream: Any, stack: Stack) -> str | None:
    if not any(n in registry.REPORT.applied for n in COPY_ENTRIES):
        return "our copy kernel is not in use in this process"
    return None


def _make(upstream: Any, stack: Stack) -> Any:
    @functools.wraps(upstream)
    def compile_or_warm_up_model(self, *args, **kwargs):
        out = upstream(self, *args, **kwargs)
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
        probe=_probe,
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
        probe=_probe,
        make=_make,
        why=_WHY,
        until=_UNTIL,
    ),
]
