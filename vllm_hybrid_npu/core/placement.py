"""Checkpoint placement is vLLM's: the retired ``VLLM_HYBRID_NPU_CHECKPOINTS``.

Formerly ``VLLM_HYBRID_NPU_CHECKPOINTS=lean`` installed a scheduler of the plugin's own
(registry entry ``checkpoint-policy``, ``SchedulerConfig.get_scheduler_cls``) that added
align-mode chunk ends and chose which GDN/Mamba states to keep. The runtime no longer changes
scheduling on any target: vLLM's scheduler and its own flags place the checkpoints
(``vllm-hybrid-npu-lab advise`` proposes those flags for a workload), and ``lean`` and the other
placement policies live in the hit-rate lab as retired comparison rows
(``vllm_hybrid_npu_lab.scheduling``; an engine gets one only through ``--scheduler-cls``).

:func:`check_checkpoints_env` runs first in :func:`vllm_hybrid_npu.patches.apply_patches`, i.e.
when the plugin loads in each vLLM process (and before ``VLLM_HYBRID_NPU_PATCHES=none`` is
honoured: a setting that asks for a policy must not be silently ignored):

* unset or empty: nothing to do;
* ``upstream``: accepted, with a deprecation warning (it has always meant "vLLM's placement",
  which is now the only one; deployments that pinned it keep starting);
* anything else (``lean``, the earlier retired ``tail``/``adaptive``/``gdn``, a typo): a
  :class:`PlacementPolicyRetiredError` naming the variable.
"""

from __future__ import annotations

import logging

from vllm_hybrid_npu import envs

logger = logging.getLogger("vllm_hybrid_npu")

#: The retired variable (still declared in :mod:`vllm_hybrid_npu.envs`, so it is documented).
ENV_VAR = "VLLM_HYBRID_NPU_CHECKPOINTS"

#: Values still accepted (deprecated: they change nothing).
VALUES: tuple[str, ...] = ("upstream",)

#: Extra sentence for values retired with their own replacement.
_NOTES = {
    "gdn": "GDN states come from inside the prefill through vLLM's prefill-checkpoint interface, "
    "on by default (VLLM_HYBRID_NPU_PREFILL_CHECKPOINTS=auto|off)",
}


class PlacementPolicyRetiredError(ValueError):
    """``VLLM_HYBRID_NPU_CHECKPOINTS`` names a placement policy; the message says what replaces it."""


def retired_message(value: str) -> str:
    """The error text for ``VLLM_HYBRID_NPU_CHECKPOINTS=<value>`` (``value`` as the user set it).

    Names the variable, says placement is vLLM's, points at ``vllm-hybrid-npu-lab advise`` for
    vLLM's flags and at the lab for the retired policies; ``gdn`` also names
    ``VLLM_HYBRID_NPU_PREFILL_CHECKPOINTS``.
    """
    msg = (
        f"{ENV_VAR}={value!r} is not one of {', '.join(VALUES)}: checkpoint placement is vLLM's "
        "now, the plugin installs no scheduling policy on any target. Unset the variable; for "
        "vLLM's own placement flags (--long-prefill-token-threshold, "
        "--prefix-cache-retention-interval, ...) run `vllm-hybrid-npu-lab advise`; 'lean' and "
        "the other retired policies are replayed by the hit-rate lab "
        "(`vllm-hybrid-npu-lab hitrate --policy lean`; an engine can be given one with "
        "--scheduler-cls vllm_hybrid_npu_lab.scheduling.scheduler.LeanCheckpointScheduler)"
    )
    note = _NOTES.get(value.strip().lower())
    return f"{msg}. '{value.strip().lower()}' was retired: {note}" if note else msg


def check_checkpoints_env() -> str | None:
    """Validate ``$VLLM_HYBRID_NPU_CHECKPOINTS``.

    Returns:
        ``None`` when unset or empty; ``"upstream"`` when set to it (case-insensitive), after a
        deprecation warning on the plugin's logger.

    Raises:
        PlacementPolicyRetiredError: any other value (the message names the variable).
    """
    raw = envs.get(ENV_VAR)
    if not raw:
        return None
    if raw.lower() in VALUES:
        logger.warning(
            "%s=%s is deprecated and changes nothing: checkpoint placement is vLLM's on every "
            "target; unset it", ENV_VAR, raw)
        return raw.lower()
    raise PlacementPolicyRetiredError(retired_message(raw))
