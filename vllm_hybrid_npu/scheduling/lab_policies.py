"""The checkpoint policies (``tail``, ``adaptive``) registered in the hit-rate lab.

Importing this module registers them in :data:`vllm_hybrid_npu.lab.policies.POLICIES` under the
names ``VLLM_HYBRID_NPU_CHECKPOINTS`` uses; ``upstream`` is the lab's own entry. Registration is
idempotent (a second import, or a name already registered by this module, is skipped).

Each policy's ``scheduler_class()`` is :func:`vllm_hybrid_npu.scheduling.scheduler.scheduler_class`
over vLLM's ``Scheduler``: the very class the plugin installs in the engine (there the base is
``AsyncScheduler`` when async scheduling is on; both share the split and retention code).
"""

from __future__ import annotations

from vllm_hybrid_npu.lab.policies import POLICIES, Policy, register_policy

DESCRIPTIONS = {
    "tail": "state checkpoint at every block boundary of the prefill, dense state retention",
    "adaptive": "checkpoints at 1, 2, 4, 8... blocks and the prompt's last block boundary, "
    "dense state retention",
}


def _factory(policy: str):
    def scheduler_class() -> type:
        from vllm_hybrid_npu.scheduling.scheduler import scheduler_class as make

        return make(policy)

    return scheduler_class


def register() -> list[str]:
    """Register ``tail`` and ``adaptive`` in the lab (skipping names already present).

    Returns:
        The names registered by this call.
    """
    done = []
    for name, desc in DESCRIPTIONS.items():
        if name in POLICIES:
            continue
        register_policy(Policy(name=name, description=desc, scheduler_class=_factory(name)))
        done.append(name)
    return done


register()
