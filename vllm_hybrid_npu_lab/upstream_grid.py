"""Upstream vLLM at its best: a grid of vLLM 0.30's own prefix-caching options, as lab policies.

Every setting is the installed vLLM's unmodified ``Scheduler`` in align mode with options a user
can pass to ``vllm serve`` (vLLM 0.30, ``vllm/config/cache.py`` / ``vllm/config/scheduler.py``):

* ``ret``: ``--prefix-cache-retention-interval`` (``CacheConfig.prefix_cache_retention_interval``):
  ``0`` (default) keeps Mamba states only at the replay boundary and shared-prefix junctions,
  ``None`` ("dense", settable in Python / JSON config) keeps every state a step end produced,
  ``k`` blocks also keeps periodic states every ``k`` blocks.
* ``lpt``: ``--long-prefill-token-threshold`` (``SchedulerConfig.long_prefill_token_threshold``):
  a long prefill is cut into chunks of at most this many tokens; in align mode each chunk end is
  a block boundary with a state. ``lpt = 1 block`` with ``ret = dense`` is exactly the
  plugin's former ``tail`` policy.
* ``pmu``: ``--prefix-match-unit`` (``CacheConfig.prefix_match_unit``), tokens; must divide the
  block size (vLLM raises otherwise): finer hit boundaries inside a block (a partial-tail entry
  at the prompt's last hash boundary).
* block size: vLLM raises a hybrid's ``--block-size`` to the smallest multiple of the kernel
  block whose attention page holds a GDN state (``_align_hybrid_block_size``); a larger one only
  coarsens hits, a smaller one is not allowed, so the grid keeps vLLM's.
* ``enable_mamba_fine_grained_prefix_cache`` (the junction checkpoint for EAGLE siblings) acts
  only with EAGLE/MTP and a finer prefix match unit; the lab replays no speculative decoding,
  so it is not in the grid.

:data:`UPSTREAM_GRID` lists the settings; each is registered as policy ``upstream:<setting>``
(``upstream`` itself is ``ret=0,lpt=0``). The CLI's ``upstream-best`` row is the best setting
of the grid per point (budget, host tier), with the setting named.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_hybrid_npu_lab.registry import POLICIES, Policy, register_policy


@dataclass(frozen=True)
class UpstreamSetting:
    """One upstream option setting. ``ret``: retention interval in blocks (``None`` = dense,
    0 = vLLM's default); ``lpt``: long-prefill threshold in blocks (0 = off); ``pmu``: prefix
    match unit in tokens (``None`` = the block size)."""

    ret: int | None = 0
    lpt: int = 0
    pmu: int | None = None

    @property
    def name(self) -> str:
        """The policy name, e.g. ``upstream:ret=dense,lpt=1b``; ``upstream`` for the defaults."""
        parts = []
        if self.ret != 0:
            parts.append("ret=dense" if self.ret is None else f"ret={self.ret}b")
        if self.lpt:
            parts.append(f"lpt={self.lpt}b")
        if self.pmu is not None:
            parts.append(f"pmu={self.pmu}")
        return "upstream:" + ",".join(parts) if parts else "upstream"

    def tune(self, vllm_config: Any, block_size: int) -> None:
        """Apply the setting to ``vllm_config`` for ``block_size`` (tokens).

        Raises ``ValueError`` when ``pmu`` does not divide the block size (as vLLM would)."""
        cc = vllm_config.cache_config
        cc.prefix_cache_retention_interval = None if self.ret is None else self.ret * block_size
        vllm_config.scheduler_config.long_prefill_token_threshold = self.lpt * block_size
        if self.pmu is not None:
            if block_size % self.pmu:
                raise ValueError(
                    f"--prefix-match-unit {self.pmu} does not divide the block size {block_size}"
                )
            cc.prefix_match_unit = self.pmu


#: The grid the ``upstream-best`` row is taken over (``upstream`` first).
UPSTREAM_GRID: tuple[UpstreamSetting, ...] = tuple(
    [UpstreamSetting(ret, lpt) for ret in (0, None, 4) for lpt in (0, 1, 4)]
    + [UpstreamSetting(0, 0, 32), UpstreamSetting(None, 1, 32)]
)


def grid_names() -> list[str]:
    """Policy names of :data:`UPSTREAM_GRID`, in order."""
    return [s.name for s in UPSTREAM_GRID]


def is_upstream(name: str) -> bool:
    """Whether ``name`` is an upstream setting (``upstream`` or ``upstream:...``)."""
    return name == "upstream" or name.startswith("upstream:")


def _upstream_scheduler() -> type:
    from vllm.v1.core.sched.scheduler import Scheduler

    return Scheduler


def register() -> None:
    """Register every grid setting except ``upstream`` (registered by :mod:`.policies`)."""
    for s in UPSTREAM_GRID:
        if s.name == "upstream" or s.name in POLICIES:  # "upstream": .policies registers it
            continue
        register_policy(
            Policy(
                name=s.name,
                description=f"vLLM's Scheduler with upstream options {s.name.split(':', 1)[1]}",
                scheduler_class=_upstream_scheduler,
                tune=s.tune,
            )
        )


register()
