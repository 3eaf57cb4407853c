"""Checkpoint policies: where align mode stores GDN/Mamba states during prefill (issue 7).

* :mod:`.split`: the pure cut logic (no vLLM import).
* :mod:`.scheduler`: vLLM ``Scheduler``/``AsyncScheduler`` subclasses applying a policy.
* :mod:`.retention` / :mod:`.lean`: policy ``lean`` (chunk ends at the prompt's last two block
  boundaries, only those states kept, kept states and their attention blocks evicted as
  segments, orphaned attention blocks first).
* :func:`selected_policy`: the policy of this process,
  ``VLLM_HYBRID_NPU_CHECKPOINTS=upstream|lean|gdn`` (default per target:
  :data:`DEFAULT_POLICY`); the patch registry's ``checkpoint-policy`` entry
  (:mod:`vllm_hybrid_npu.patches.vllm_config_scheduler`) installs it. ``gdn`` is not a scheduling policy: it selects GDN states captured
  inside the step (vLLM's ``'all'`` mode for GDN models,
  :mod:`vllm_hybrid_npu.patches.gdn_all_mode`), which needs no extra chunk ends; its scheduler
  only keeps the per-block states (dense retention). ``tail`` and ``adaptive`` were retired
  (2026-11-23, docs/hitrate-lab.md): ``tail`` gives exactly the hits of vLLM's own
  ``--long-prefill-token-threshold <block size> --prefix-cache-retention-interval None``,
  ``adaptive`` was below upstream's best setting at every lab point; both remain lab-only policies
  (``vllm_hybrid_npu_lab/retired_policies.py``), and the values raise ``ValueError`` here.

Keep top-level imports light: this package is imported by the plugin in every vLLM process.
"""

from __future__ import annotations

import logging

from vllm_hybrid_npu.scheduling.split import POLICY_NAMES, unknown_policy_message
from vllm_hybrid_npu import envs

logger = logging.getLogger("vllm_hybrid_npu")

#: Environment variable selecting the checkpoint policy.
ENV_VAR = "VLLM_HYBRID_NPU_CHECKPOINTS"

#: Values of :data:`ENV_VAR` whose states come from the worker (the step itself), not from
#: extra chunk ends.
WORKER_MODES: tuple[str, ...] = ()

#: Policy used when :data:`ENV_VAR` is unset or empty, per target. ``upstream`` (no scheduler
#: change) wherever a policy is not proven on that stack: on NPU until vllm-ascend's scheduler
#: patches composed with a policy are replayed on an NPU (issue 12); ``lean`` on CUDA and CPU,
#: the best policy against upstream at its best in the lab (docs/hitrate-lab.md, 2026-11-23).
DEFAULT_POLICY: dict[str, str] = {"npu": "upstream", "cuda": "upstream", "cpu": "upstream"}


def policy_is_default() -> bool:
    """True when :data:`ENV_VAR` is unset or empty (the per-target default applies)."""
    return not envs.get(ENV_VAR)


def selected_policy(target: str | None = None) -> str:
    """The policy named by ``VLLM_HYBRID_NPU_CHECKPOINTS``, else the default of ``target``.

    Args:
        target: ``npu``, ``cuda`` or ``cpu``; None detects it
            (:func:`vllm_hybrid_npu.target.detect_target`).

    Raises:
        ValueError: the variable names no known policy (the message names the variable; for the
            retired ``tail``/``adaptive`` it says what replaces them).
    """
    value = envs.get(ENV_VAR).lower()
    if not value:
        if target is None:
            from vllm_hybrid_npu.target import detect_target

            target = detect_target()
        return DEFAULT_POLICY[target]
    if value not in POLICY_NAMES + WORKER_MODES:
        raise ValueError(
            unknown_policy_message(ENV_VAR, envs.get(ENV_VAR), POLICY_NAMES + WORKER_MODES)
        )
    return value
