"""Checkpoint policies: where align mode stores GDN/Mamba states during prefill (issue 7).

* :mod:`.split`: the pure cut logic (no vLLM import).
* :mod:`.scheduler`: vLLM ``Scheduler``/``AsyncScheduler`` subclasses applying a policy.
* :mod:`.retention` / :mod:`.lean`: policy ``lean`` (chunk ends at the prompt's last two block
  boundaries, only those states kept, kept states and their attention blocks evicted as
  segments, orphaned attention blocks first).
* :func:`install_scheduler_policy`: makes vLLM pick the policy scheduler in this process,
  selected by ``VLLM_HYBRID_NPU_CHECKPOINTS=upstream|tail|adaptive|lean|gdn`` (default
  :data:`DEFAULT_POLICY`). ``gdn`` is not a scheduling policy: it selects GDN states captured
  inside the step (vLLM's ``'all'`` mode for GDN models,
  :mod:`vllm_hybrid_npu.patches.gdn_all_mode`), which needs no extra chunk ends; its scheduler
  only keeps the per-block states (dense retention).
* :mod:`.bench_ttft`: time-to-first-token benchmark, upstream vs the policies.
* :mod:`.lab_policies`: the same policies registered in the hit-rate lab.

Keep top-level imports light: this package is imported by the plugin in every vLLM process.
"""

from __future__ import annotations

import logging
import os

from vllm_hybrid_npu.scheduling.split import POLICY_NAMES

logger = logging.getLogger("vllm_hybrid_npu")

#: Environment variable selecting the checkpoint policy.
ENV_VAR = "VLLM_HYBRID_NPU_CHECKPOINTS"

#: Values of :data:`ENV_VAR` whose states come from the worker (the step itself), not from
#: extra chunk ends.
WORKER_MODES: tuple[str, ...] = ("gdn",)

#: Policy used when :data:`ENV_VAR` is unset or empty (chosen by measurement, see
#: docs/first-repeat-hits.md).
DEFAULT_POLICY = "adaptive"

_installed: list[str] | None = None


def selected_policy() -> str:
    """The policy named by ``VLLM_HYBRID_NPU_CHECKPOINTS`` (default :data:`DEFAULT_POLICY`).

    Raises:
        ValueError: the variable names no known policy (the message names the variable).
    """
    value = os.environ.get(ENV_VAR, "").strip().lower() or DEFAULT_POLICY
    if value not in POLICY_NAMES + WORKER_MODES:
        raise ValueError(
            f"{ENV_VAR}={os.environ.get(ENV_VAR)!r} is not a checkpoint policy; expected one "
            f"of {', '.join(POLICY_NAMES + WORKER_MODES)}"
        )
    return value


def install_scheduler_policy() -> list[str]:
    """Make vLLM build the checkpoint-policy scheduler in this process.

    Wraps ``vllm.config.scheduler.SchedulerConfig.get_scheduler_cls`` (vLLM 0.30.0 and 0.32.0;
    ``EngineCore.__init__`` calls it after ``load_general_plugins()``, so the plugin's
    ``apply_patches`` running this is enough in every process). When the user set no
    ``--scheduler-cls`` the wrapper returns ``scheduler_class(policy, base)`` where ``base`` is
    what vLLM would have returned (``Scheduler``, or ``AsyncScheduler`` with async scheduling);
    an explicit ``--scheduler-cls`` is returned unchanged. The policy classes act only on hybrid
    models in align mode; every other engine is scheduled exactly as upstream.

    Idempotent: later calls return the first call's result without patching again.

    Returns:
        ``["scheduler:<policy>"]`` when installed, ``[]`` for ``upstream`` (nothing patched).

    Raises:
        ValueError: ``VLLM_HYBRID_NPU_CHECKPOINTS`` names no known policy.
        TypeError: the installed vLLM has no align-mode split to extend.
    """
    global _installed
    if _installed is not None:
        return list(_installed)
    policy = selected_policy()
    if policy == "upstream":
        _installed = []
        return []

    from vllm.config.scheduler import SchedulerConfig

    from vllm_hybrid_npu.scheduling.scheduler import scheduler_class

    scheduler_class(policy)  # fail early (TypeError) on an unsupported vLLM
    original = SchedulerConfig.get_scheduler_cls
    if not getattr(original, "_vllm_hybrid_npu_policy", None):

        def get_scheduler_cls(self):  # type: ignore[no-untyped-def]
            base = original(self)
            if self.scheduler_cls is not None:
                # an explicit class (--scheduler-cls, or one vllm-ascend selects for its
                # recompute / dyntra-LB / profiling-chunk / batch-job / SRF schedulers) wins
                logger.warning(
                    "%s=%s not applied: scheduler class %s was chosen explicitly",
                    ENV_VAR, policy, self.scheduler_cls,
                )
                return base
            return scheduler_class(policy, base)

        get_scheduler_cls._vllm_hybrid_npu_policy = policy  # type: ignore[attr-defined]
        get_scheduler_cls.__wrapped__ = original  # type: ignore[attr-defined]
        get_scheduler_cls.__doc__ = original.__doc__
        SchedulerConfig.get_scheduler_cls = get_scheduler_cls  # type: ignore[method-assign]
    _installed = [f"scheduler:{policy}"]
    return list(_installed)
