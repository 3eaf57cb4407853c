"""The checkpoint-policy mixin every policy scheduler builds on (no policy module imported here).

:class:`CheckpointPolicyMixin` holds the two changes a checkpoint policy makes to vLLM's
``Scheduler`` (vLLM 0.30.0 and 0.32.0, ``vllm/v1/core/sched/scheduler.py``; see
:mod:`.scheduler` for the full description): the chunk-end override of
``_mamba_block_aligned_split`` and the dense-retention swap of ``prefix_cache_retention_interval``.
Policies with their own rules (:mod:`.lean`) subclass it and override
:meth:`CheckpointPolicyMixin._policy_stop` / :attr:`CheckpointPolicyMixin.dense_retention`;
:mod:`.scheduler` builds the concrete classes. Importing this module does not import vLLM.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from vllm_hybrid_npu_lab.scheduling.split import SplitRule, policy_chunk_tokens

logger = logging.getLogger("vllm_hybrid_npu")

#: The policy for GDN states captured inside the step (no extra chunk ends, dense retention in
#: ``'all'`` mode).
GDN_POLICY = "gdn"


def _has_mamba_align(kv_cache_config: Any, vllm_config: Any, modes=("align",)) -> bool:
    try:
        from vllm.v1.kv_cache_interface import MambaSpec
    except ImportError:  # pragma: no cover - every supported vLLM has it
        return False
    if getattr(vllm_config.cache_config, "mamba_cache_mode", None) not in modes:
        return False
    return any(isinstance(g.kv_cache_spec, MambaSpec) for g in kv_cache_config.kv_cache_groups)


def deferral_reason(vllm_config: Any) -> str | None:
    """Why a checkpoint policy must leave vLLM's schedule and retention alone for this
    configuration, or ``None``.

    Speculative decoding (any ``speculative_config``): vLLM 0.30's scheduler then changes align
    mode itself (``Scheduler.__init__``: ``use_eagle``, ``use_eagle_block_drop``,
    ``num_prefill_lookahead``; ``_mamba_block_aligned_split`` stops one block earlier with
    EAGLE/MTP, whose prefix-cache hits drop the last matched block, and multi-module MTP reads
    tokens ahead of a chunk end), and the policies' chunk ends and kept states were not
    verified with it (the CPU backend cannot decode speculatively; docs/cuda.md)."""
    spec = getattr(vllm_config, "speculative_config", None) if vllm_config is not None else None
    if spec is not None:
        method = getattr(spec, "method", None)
        return (f"speculative decoding ({method or 'configured'}) changes align mode's chunk ends "
                "and hits in vLLM's scheduler, and the policy is not verified with it")
    return None


def chunk_span(request: Any, local_computed: int = 0, external_computed: int = 0) -> tuple[int, int]:
    """``(start, prefill_end)`` of a chunk, in tokens, as vLLM 0.30/0.32's
    ``Scheduler._mamba_block_aligned_split`` computes them: the first token to schedule
    (computed + new local and external hits) and the end of the prefill (the prompt, or the
    replayed output of a resumed request)."""
    start = request.num_computed_tokens + local_computed + external_computed
    return start, max(request.num_prompt_tokens, request.num_tokens - 1)


def offloading_scheduler(scheduler: Any) -> Any:
    """The scheduler side of vLLM's ``OffloadingConnector`` (``--kv-offloading-size``) if the
    scheduler has one (vLLM 0.30: ``Scheduler.connector.connector_scheduler``, an
    ``OffloadingConnectorScheduler`` with ``config`` and ``_reachable_store_block_mask``),
    else ``None``."""
    conn = getattr(scheduler, "connector", None)
    cs = getattr(conn, "connector_scheduler", None)
    if cs is None or not hasattr(cs, "_reachable_store_block_mask") or not hasattr(cs, "config"):
        return None
    return cs


def _dense_offloading(scheduler: Any) -> None:
    """With dense retention, let the OffloadingConnector store every state the scheduler keeps.

    vLLM 0.30's ``OffloadingConnectorScheduler`` reads ``prefix_cache_retention_interval`` from
    ``CacheConfig`` (``SchedulerOffloadConfig.from_spec``), not from the scheduler's
    ``KVCacheConfig``: with the default 0 it would copy only the replay-boundary and junction
    states to the host tier, never the policy's extra checkpoints. Its ``config``
    (a ``NamedTuple``) gets ``retention_interval=None`` (dense), as for the scheduler."""
    cs = offloading_scheduler(scheduler)
    if cs is not None and getattr(cs.config, "retention_interval", None) == 0:
        cs.config = cs.config._replace(retention_interval=None)


class CheckpointPolicyMixin:
    """Mixin placed before vLLM's ``Scheduler`` (or ``AsyncScheduler``) in the MRO.

    Class attributes: ``checkpoint_policy`` (one of :data:`.split.POLICY_NAMES` or
    :data:`GDN_POLICY`, or the name of ``split_rule``); ``split_rule`` (a
    :class:`.split.SplitRule` whose chunk ends apply instead of the named policy's, or None; set
    by :func:`.scheduler.scheduler_class` for a rule it is given); ``dense_retention`` (True: when the ``KVCacheConfig``'s
    ``prefix_cache_retention_interval`` is vLLM's default 0, build the scheduler with a copy
    whose interval is ``None``, vLLM's dense retention; a policy that selects its own states,
    like ``lean``, sets it False). Use :func:`.scheduler.scheduler_class` to get a concrete class.
    """

    checkpoint_policy: str = "upstream"
    split_rule: SplitRule | None = None
    dense_retention: bool = True

    #: why this scheduler runs vLLM's own schedule although a policy is named (see
    #: :func:`deferral_reason`), or None; set in ``__init__``
    policy_deferred: str | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        vllm_config = kwargs.get("vllm_config", args[0] if args else None)
        kv_cache_config = kwargs.get("kv_cache_config", args[1] if len(args) > 1 else None)
        deferred = None
        if self.checkpoint_policy != "upstream":
            deferred = deferral_reason(vllm_config)
        swapped = False
        if (
            deferred is None
            and self.dense_retention
            and self.checkpoint_policy != "upstream"
            and vllm_config is not None
            and kv_cache_config is not None
            and getattr(kv_cache_config, "prefix_cache_retention_interval", None) == 0
            and _has_mamba_align(kv_cache_config, vllm_config, self._policy_modes())
        ):
            dense = dataclasses.replace(kv_cache_config, prefix_cache_retention_interval=None)
            if "kv_cache_config" in kwargs:
                kwargs["kv_cache_config"] = dense
            else:
                args = (args[0], dense, *args[2:])
            swapped = True
        super().__init__(*args, **kwargs)
        self.policy_deferred = deferred
        if deferred is not None:
            logger.warning(
                "checkpoint policy %s not applied: %s; this scheduler runs vLLM's own align-mode "
                "schedule and retention", self.checkpoint_policy, deferred)
        if swapped:
            _dense_offloading(self)

    def _policy_modes(self) -> tuple[str, ...]:
        """Mamba cache modes the policy acts in (``align``; ``all`` for :data:`GDN_POLICY`)."""
        return ("all",) if self.checkpoint_policy == GDN_POLICY else ("align",)

    def _policy_stop(self, start: int, num_new_tokens: int, prefill_end: int, block_size: int) -> int:
        """Tokens to schedule once the policy's next checkpoint stop is applied to vLLM's chunk
        of ``num_new_tokens`` starting at ``start`` (never more; see
        :func:`.split.policy_chunk_tokens` for the contract)."""
        rule = self.split_rule if self.split_rule is not None else self.checkpoint_policy
        return policy_chunk_tokens(start, num_new_tokens, prefill_end, block_size, rule)

    def _mamba_block_aligned_split(  # type: ignore[override]
        self,
        request: Any,
        num_new_tokens: int,
        num_new_local_computed_tokens: int = 0,
        num_external_computed_tokens: int = 0,
    ) -> int:
        """vLLM's split, then the policy's extra checkpoint stop (never a longer chunk).

        Mirrors/extends ``Scheduler._mamba_block_aligned_split`` of vLLM 0.30.0 and 0.32.0
        (``vllm/v1/core/sched/scheduler.py``). Returns tokens to schedule (int >= 0).
        """
        num = super()._mamba_block_aligned_split(  # type: ignore[misc]
            request, num_new_tokens, num_new_local_computed_tokens, num_external_computed_tokens
        )
        if self.checkpoint_policy in ("upstream", GDN_POLICY) or num <= 0 or self.policy_deferred:
            return num
        start, prefill_end = chunk_span(
            request, num_new_local_computed_tokens, num_external_computed_tokens
        )
        return self._policy_stop(start, num, prefill_end, self.cache_config.block_size)
