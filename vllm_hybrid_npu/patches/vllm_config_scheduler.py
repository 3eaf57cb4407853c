"""Patch of ``vllm.config.scheduler`` (vLLM 0.23.0, 0.30.0, 0.32.0): ``SchedulerConfig.get_scheduler_cls``.

``checkpoint-policy``: when ``VLLM_HYBRID_NPU_CHECKPOINTS`` names a scheduling policy (not
``upstream``, the default where a policy is not proven on the target: see
:func:`vllm_hybrid_npu.scheduling.selected_policy`), the scheduler class vLLM would build
(``Scheduler``, ``AsyncScheduler``, or a platform's choice such as vllm-ascend's) is wrapped by
:func:`vllm_hybrid_npu.scheduling.scheduler.scheduler_class`, which only shortens align-mode
prefill chunks and keeps the states those chunk ends produce. An explicit ``--scheduler-cls``
wins (logged). ``EngineCore.__init__`` calls ``get_scheduler_cls`` after
``load_general_plugins()``, so the plugin's load is early enough in every process.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from vllm_hybrid_npu.patches.registry import Patch
from vllm_hybrid_npu.support import Stack

logger = logging.getLogger("vllm_hybrid_npu")


def _wanted(stack: Stack) -> str | None:
    from vllm_hybrid_npu.scheduling import ENV_VAR, policy_is_default, selected_policy

    if selected_policy(stack.target) == "upstream":
        default = " (the default on this target)" if policy_is_default() else ""
        return f"{ENV_VAR}=upstream{default}"
    return None


def _make(upstream: Any, stack: Stack) -> Any:
    from vllm_hybrid_npu.scheduling import ENV_VAR, selected_policy
    from vllm_hybrid_npu.scheduling.scheduler import scheduler_class

    policy = selected_policy(stack.target)

    @functools.wraps(upstream)
    def get_scheduler_cls(self):
        # vLLM's scheduler module is imported here, not when vllm.config.scheduler executes
        # (that import would be circular); scheduler_class raises TypeError, naming the
        # variable, on a vLLM without the align-mode split
        base = upstream(self)
        if self.scheduler_cls is not None:
            logger.warning(
                "%s=%s not applied: scheduler class %s was chosen explicitly",
                ENV_VAR, policy, self.scheduler_cls,
            )
            return base
        return scheduler_class(policy, base)

    return get_scheduler_cls


PATCHES = [
    Patch(
        name="checkpoint-policy",
        module="vllm.config.scheduler",
        qualname="SchedulerConfig.get_scheduler_cls",
        targets=("npu", "cuda", "cpu"),
        vllm=("0.23.0", "0.30.0", "0.32.0"),
        signature=("self",),
        wanted=_wanted,
        make=_make,
        behaviour_changing=True,
        why=(
            "checkpoint placement: extra align-mode chunk ends (and the retention of their "
            "states) so a later request sharing a shorter prefix hits on its first repeat"
        ),
        until="vLLM places align-mode checkpoints for first repeats itself",
    ),
]
