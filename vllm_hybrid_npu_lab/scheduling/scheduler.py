"""vLLM scheduler subclasses that apply a checkpoint policy (see :mod:`.split`).

What a policy changes, and nothing else (vLLM 0.30.0 and 0.32.0,
``vllm/v1/core/sched/scheduler.py``):

1. ``Scheduler._mamba_block_aligned_split(request, num_new_tokens,
   num_new_local_computed_tokens=0, num_external_computed_tokens=0) -> int``: the one method
   that cuts prefill chunks in align mode. The override calls vLLM's own method first and then
   only shortens its result with :func:`.split.policy_chunk_tokens` (same signature, same
   return value contract: tokens to schedule). vLLM's stops (prompt tail boundary, the
   shared-prefix junction checkpoint, chunk limit, EAGLE block drop) are therefore kept; the
   running-request and waiting-request paths of ``schedule()`` both call this method.
2. Retention of the states those chunk ends produce. vLLM 0.30/0.32 default to
   ``prefix_cache_retention_interval=0`` (``CacheConfig``): Mamba keeps a state only at the
   prompt's replay boundary and at shared-prefix junctions
   (``MambaManager.reachable_block_mask``), which would drop the extra checkpoints and every
   block boundary crossed during decode (the multi-turn loss). When that field is 0 the policy
   schedulers are built with a copy of the ``KVCacheConfig`` whose
   ``prefix_cache_retention_interval`` is ``None`` (vLLM's own dense retention, as
   ``--prefix-cache-retention-interval`` would give if it could be set to None); a positive
   user value is left as it is.

Both changes apply only when vLLM splits for Mamba (``need_mamba_block_aligned_split``: hybrid
model, ``mamba_cache_mode == "align"``); otherwise the class behaves exactly as its base.

Policy ``gdn`` (:data:`GDN_POLICY`, the lab's ``gdn-lean`` base): states are captured
inside the step in ``'all'`` mode (the lab's ``engine_policies.all_mode``), so there is no
split to change; only change 2 applies, to a hybrid model in ``'all'`` mode (without it vLLM
would keep only the replay boundary and junction states and drop the per-block states the step
just wrote).
"""

from __future__ import annotations

from vllm_hybrid_npu_lab.scheduling.lean import LeanRetentionMixin
from vllm_hybrid_npu_lab.scheduling.policy_base import (  # noqa: F401 (re-exported)
    GDN_POLICY,
    CheckpointPolicyMixin,
    _has_mamba_align,
    chunk_span,
)
from vllm_hybrid_npu_lab.scheduling.split import POLICY_NAMES, SplitRule, unknown_policy_message

_CLASS_CACHE: dict[tuple[str | SplitRule, type], type] = {}


def scheduler_class(policy: str | SplitRule, base: type | None = None) -> type:
    """The scheduler class applying ``policy`` on top of ``base``.

    Args:
        policy: one of :data:`.split.POLICY_NAMES` or :data:`GDN_POLICY` (``"upstream"``
            returns ``base`` itself); or a :class:`.split.SplitRule` (the extension point: a
            class ``<Name>Checkpoint<Base>`` on :class:`.policy_base.CheckpointPolicyMixin`
            whose chunk ends are the rule's, with dense retention; the lab builds its lab-only
            policies ``tail`` and ``adaptive`` this way).
        base: vLLM's ``Scheduler`` (default) or ``AsyncScheduler``, or any subclass of
            ``Scheduler`` that keeps ``_mamba_block_aligned_split``.

    Returns:
        A subclass ``<Policy><Base>`` (cached: the same class for the same arguments).

    Raises:
        ValueError: unknown policy name (a retired one, ``tail``/``adaptive``, says what replaces
        it) or a rule named ``upstream``/``gdn``/``lean``; TypeError: ``base`` has no
        ``_mamba_block_aligned_split`` (a vLLM without align-mode splitting).
    """
    names = (*POLICY_NAMES, GDN_POLICY)
    if isinstance(policy, SplitRule):
        if policy.name.lower() in names:
            raise ValueError(
                f"split rule {policy.name!r} shadows the built-in policy of that name; name it "
                "differently"
            )
    elif policy not in names:
        raise ValueError(unknown_policy_message("checkpoint policy", policy, names))
    if base is None:
        from vllm.v1.core.sched.scheduler import Scheduler

        base = Scheduler
    if policy == "upstream":
        return base
    if not hasattr(base, "_mamba_block_aligned_split"):
        raise TypeError(
            f"{base.__module__}.{base.__qualname__} has no _mamba_block_aligned_split; this "
            "vLLM is not supported by the checkpoint policies (vLLM 0.30/0.32 are)"
        )
    key = (policy, base)
    cls = _CLASS_CACHE.get(key)
    if cls is None:
        attrs: dict = {"__module__": __name__}
        if isinstance(policy, SplitRule):
            title = "".join(p.capitalize() for p in policy.name.replace("_", "-").split("-"))
            mixin: type = CheckpointPolicyMixin
            attrs.update(checkpoint_policy=policy.name, split_rule=policy)
        else:
            title = policy.capitalize()
            mixin = LeanRetentionMixin if policy == "lean" else CheckpointPolicyMixin
            attrs["checkpoint_policy"] = policy
        name = f"{title}Checkpoint{base.__name__}"
        attrs["__qualname__"] = name
        cls = type(name, (mixin, base), attrs)
        _CLASS_CACHE[key] = cls
    return cls


#: Module attributes resolvable by ``--scheduler-cls vllm_hybrid_npu_lab.scheduling.scheduler.<NAME>``
#: (how an engine the lab builds, or a user's ``vllm serve``, gets a retired policy)
#: (built on first access, so importing this module does not import vLLM).
SCHEDULER_CLASS_NAMES: dict[str, tuple[str, str]] = {
    "LeanCheckpointScheduler": ("lean", "Scheduler"),
    "LeanCheckpointAsyncScheduler": ("lean", "AsyncScheduler"),
}


def __getattr__(name: str) -> type:
    spec = SCHEDULER_CLASS_NAMES.get(name)
    if spec is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    policy, base_name = spec
    if base_name == "AsyncScheduler":
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler as base
    else:
        from vllm.v1.core.sched.scheduler import Scheduler as base
    return scheduler_class(policy, base)
