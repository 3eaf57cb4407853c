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
* ``ckpt``: the runtime's GDN prefill-checkpoint exporter (``VLLM_HYBRID_NPU_PREFILL_CHECKPOINTS``
  ``auto``, the plugin's default on CPU and CUDA; off = ``off`` or plain vLLM): the GDN specs
  declare vLLM's own checkpoint block, the block is rounded up to the 64-token grid
  (:mod:`.exporter`). ``ckpt=final`` is the exporter with the runtime's
  ``VLLM_HYBRID_NPU_OPTIONS=ckpt=final`` (vLLM 0.30): a non-final prefill chunk's checkpoint
  is not kept at a retention interval above 0 (:data:`CKPT_FINAL`).
* ``tails=off``: the runtime's ``VLLM_HYBRID_NPU_OPTIONS=tails=off`` (vLLM 0.30): the
  host tier (``--kv-offloading-size``) keeps no partial tail (vLLM's own branch without them;
  :func:`vllm_hybrid_npu_lab.host_tier.tails_off_scheduler`); without a host tier it changes
  nothing. Not in the grid; ``advise`` replays it beside its exporter setting with a
  prefix-match unit and the most hits, where that has a host tier (``advise._optin_scan``).
* ``tailsplit=off``: the runtime's ``VLLM_HYBRID_NPU_OPTIONS=tailsplit=off`` (vLLM 0.30): with
  ``ckpt`` and ``pmu`` below the block, a prompt's last chunk that fails vLLM's checkpoint check by
  its column clause alone runs whole instead of stopping at its last prefix-match boundary, and
  that state is not cached (:func:`vllm_hybrid_npu_lab.exporter.tail_split_off_scheduler`);
  without ``ckpt`` or at the block's unit it changes nothing. Not in the grid; ``advise``
  replays it beside the same setting, alone and with ``tails=off``.
* ``second=on``: the runtime's ``VLLM_HYBRID_NPU_OPTIONS=second=on`` (vLLM 0.30): with ``ckpt``
  and ``pmu`` below the block, a prompt whose checkpoint lies inside its last block keeps the
  state at that block's start too, in a second block, cached and offered to the host tier
  (:func:`vllm_hybrid_npu_lab.exporter.second_checkpoint_scheduler`). The runtime has it where
  its step exports junction states (the replay binds it there only, as the engine decides:
  CUDA's one pass, also beside a host tier; the NPU without a KV connector), so ``advise``
  replays it in its opt-in scan there (``advise.second_available``).
* ``enable_mamba_fine_grained_prefix_cache`` (the junction checkpoint for EAGLE siblings) acts
  only with EAGLE/MTP and a finer prefix match unit; the lab replays an MTP drafter
  (``--speculative-tokens``) but not that option, so it is not in the grid.

:data:`UPSTREAM_GRID` lists the settings; each is registered as policy ``upstream:<setting>``
(``upstream`` itself is ``ret=0,lpt=0``). Any other setting name (``upstream:ret=2b,ckpt``) is
parsed and registered on first use (:func:`parse_setting`, :func:`ensure_registered`), so every
setting the advisor (:mod:`.advise`) reports can be replayed with ``hitrate --policy``. The CLI's
``upstream-best`` row is the advisor's search over these options per point, with the setting
named.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from vllm_hybrid_npu_lab.registry import POLICIES, Policy, register_policy


#: ``UpstreamSetting.ckpt`` value: the exporter with ``VLLM_HYBRID_NPU_OPTIONS=ckpt=final``
CKPT_FINAL = "final"


@dataclass(frozen=True)
class UpstreamSetting:
    """One upstream option setting. ``ret``: retention interval in blocks (``None`` = dense,
    0 = vLLM's default); ``lpt``: long-prefill threshold in blocks (0 = off); ``pmu``: prefix
    match unit in tokens (``None`` = the block size); ``ckpt``: ``False`` (vLLM's split),
    ``True`` (the exporter) or :data:`CKPT_FINAL` (the exporter keeping a non-final chunk's
    checkpoint only where vLLM's retention-0 rule would: the runtime's
    ``VLLM_HYBRID_NPU_OPTIONS=ckpt=final``); ``tails``: ``False`` for the runtime's
    ``VLLM_HYBRID_NPU_OPTIONS=tails=off`` (the host tier keeps no partial tail);
    ``tail_split``: ``False`` for the runtime's ``VLLM_HYBRID_NPU_OPTIONS=tailsplit=off`` (a
    prompt's last chunk failing vLLM's checkpoint check by its column clause alone runs whole);
    ``second``: ``True`` for the runtime's ``VLLM_HYBRID_NPU_OPTIONS=second=on`` (a prompt whose
    checkpoint lies inside its last block keeps that block's start too, in a second block; the
    runtime has it where its step exports junction states)."""

    ret: int | None = 0
    lpt: int = 0
    pmu: int | None = None
    ckpt: bool | str = False
    tails: bool = True
    tail_split: bool = True
    second: bool = False

    @property
    def optin(self) -> bool:
        """Whether the setting uses one of the runtime's opt-ins (``tails=off``,
        ``tailsplit=off``, ``second=on``): a plugin option, never part of vLLM's split at its
        best."""
        return not self.tails or not self.tail_split or self.second

    @property
    def chunk_checkpoints(self) -> str | None:
        """The runtime's option ``ckpt`` value of this setting (``all`` or
        ``final``), ``None`` without the exporter."""
        if not self.ckpt:
            return None
        return CKPT_FINAL if self.ckpt == CKPT_FINAL else "all"

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
        if self.ckpt:
            parts.append("ckpt=final" if self.ckpt == CKPT_FINAL else "ckpt")
        if not self.tails:
            parts.append("tails=off")
        if not self.tail_split:
            parts.append("tailsplit=off")
        if self.second:
            parts.append("second=on")
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


def parse_setting(name: str) -> UpstreamSetting:
    """The :class:`UpstreamSetting` of a policy name (``upstream``, ``upstream:ret=dense,lpt=1b``,
    ``upstream:ret=2b,pmu=64,ckpt``, ``upstream:ret=2b,ckpt=final``). Raises ``ValueError``
    naming ``--policy`` otherwise."""
    if name == "upstream":
        return UpstreamSetting()
    bad = ValueError(
        f"--policy {name!r}: not an upstream setting (upstream:ret=dense|<k>b,lpt=<k>b,"
        "pmu=<tokens>,ckpt|ckpt=final,tails=off,tailsplit=off,second=on)"
    )
    if not name.startswith("upstream:") or not name[len("upstream:"):]:
        raise bad
    kw: dict[str, Any] = {}
    for part in name[len("upstream:"):].split(","):
        key, _, value = part.partition("=")
        try:
            if key == "ckpt" and not value:
                kw["ckpt"] = True
            elif key == "ckpt" and value == CKPT_FINAL:
                kw["ckpt"] = CKPT_FINAL
            elif key == "ret" and value == "dense":
                kw["ret"] = None
            elif key in ("ret", "lpt") and value.endswith("b") and int(value[:-1]) >= 0:
                kw[key] = int(value[:-1])
            elif key == "tails" and value == "off":
                kw["tails"] = False
            elif key == "tailsplit" and value == "off":
                kw["tail_split"] = False
            elif key == "second" and value == "on":
                kw["second"] = True
            elif key == "pmu" and int(value) > 0:
                kw["pmu"] = int(value)
            else:
                raise bad
        except ValueError:
            raise bad from None
    setting = UpstreamSetting(**kw)
    if setting.name != name:
        raise ValueError(f"--policy {name!r}: write it as {setting.name!r}")
    return setting


def policy_of(setting: UpstreamSetting) -> Policy:
    """The lab policy replaying ``setting``."""
    if setting.name == "upstream":
        return POLICIES["upstream"]
    what = "vLLM's Scheduler with upstream options " + setting.name.split(":", 1)[1]
    if setting.ckpt:
        what += " (ckpt: the plugin's GDN prefill-checkpoint exporter"
        what += (", VLLM_HYBRID_NPU_OPTIONS=ckpt=final: a non-final chunk's checkpoint "
                 "not kept at retention > 0)" if setting.ckpt == CKPT_FINAL else ")")
    if not setting.tails:
        what += (" (tails=off: VLLM_HYBRID_NPU_OPTIONS=tails=off, the host tier keeps no "
                 "partial tail)")
    if not setting.tail_split:
        what += (" (tailsplit=off: VLLM_HYBRID_NPU_OPTIONS=tailsplit=off, a prompt's last chunk "
                 "failing vLLM's checkpoint check by its column clause alone runs whole)")
    if setting.second:
        what += (" (second=on: VLLM_HYBRID_NPU_OPTIONS=second=on, a prompt's checkpoint inside "
                 "its last block takes a second block, the block's start stays cached; the "
                 "runtime's paths that export junction states)")
    chunk = setting.chunk_checkpoints
    factory = functools.partial(_exporter_scheduler, chunk) if chunk else _upstream_scheduler
    if not setting.tails:
        factory = functools.partial(_tails_off_scheduler, factory)
    if not setting.tail_split:
        factory = functools.partial(_tail_split_off_scheduler, factory)
    if setting.second:
        factory = functools.partial(_second_checkpoint_scheduler, factory)
    why = []
    if chunk == CKPT_FINAL:
        why.append("ckpt=final is the runtime's VLLM_HYBRID_NPU_OPTIONS=ckpt=final, carried "
                   "by its vLLM 0.30 entry gdn-manager-cache (vLLM 0.32 keeps a chunk's "
                   "checkpoint on the retention grid itself)")
    if not setting.tails:
        why.append("tails=off is the runtime's VLLM_HYBRID_NPU_OPTIONS=tails=off, its "
                   "vLLM 0.30 entry host-tier-partial-tails-off")
    if not setting.tail_split:
        why.append("tailsplit=off is the runtime's VLLM_HYBRID_NPU_OPTIONS=tailsplit=off, its "
                   "vLLM 0.30 entry sub-block-tail-split-off")
    if setting.second:
        why.append("second=on is the runtime's VLLM_HYBRID_NPU_OPTIONS=second=on, its vLLM "
                   "0.30 entries gdn-manager-*")
    # the runtime options live in vLLM 0.30 registry entries
    versions = {"vllm": ("0.30.0",), "vllm_why": "; ".join(why)} if why else {}
    return Policy(name=setting.name, description=what, scheduler_class=factory, tune=setting.tune,
                  prefill_checkpoints=bool(setting.ckpt), **versions)


def ensure_registered(name: str) -> bool:
    """Register the upstream setting ``name`` if it parses and is not registered; return whether
    ``name`` is a registered policy afterwards."""
    if name in POLICIES:
        return True
    if not is_upstream(name):
        return False
    register_policy(policy_of(parse_setting(name)))
    return True


def grid_names() -> list[str]:
    """Policy names of :data:`UPSTREAM_GRID`, in order."""
    return [s.name for s in UPSTREAM_GRID]


def is_upstream(name: str) -> bool:
    """Whether ``name`` is an upstream setting (``upstream`` or ``upstream:...``)."""
    return name == "upstream" or name.startswith("upstream:")


def _upstream_scheduler() -> type:
    from vllm.v1.core.sched.scheduler import Scheduler

    return Scheduler


def _exporter_scheduler(chunk_checkpoints: str = "all") -> type:
    from vllm.v1.core.sched.scheduler import Scheduler

    from vllm_hybrid_npu_lab.exporter import exporter_scheduler

    return exporter_scheduler(Scheduler, chunk_checkpoints)


def _tails_off_scheduler(factory: Any) -> type:
    from vllm_hybrid_npu_lab.host_tier import tails_off_scheduler

    return tails_off_scheduler(factory())


def _tail_split_off_scheduler(factory: Any) -> type:
    from vllm_hybrid_npu_lab.exporter import tail_split_off_scheduler

    return tail_split_off_scheduler(factory())


def _second_checkpoint_scheduler(factory: Any) -> type:
    from vllm_hybrid_npu_lab.exporter import second_checkpoint_scheduler

    return second_checkpoint_scheduler(factory())


def optins_available() -> bool:
    """Whether ``tails=off`` and ``tailsplit=off`` can be replayed here: the installed vLLM is
    one the runtime's entries carrying them (``host-tier-partial-tails-off``,
    ``sub-block-tail-split-off``) apply to (vLLM 0.30)."""
    return policy_of(UpstreamSetting(pmu=64, ckpt=True, tails=False, tail_split=False)).unavailable() is None


def final_available() -> bool:
    """Whether ``ckpt=final`` can be replayed here: the installed vLLM is one the runtime's
    ``gdn-manager-cache`` entry (which carries the option) applies to (vLLM 0.30)."""
    from vllm_hybrid_npu_lab.exporter import retention_entry

    return retention_entry() is not None


#: registered besides the grid: the exporter alone (the plugin's default on CPU and CUDA)
EXTRA: tuple[UpstreamSetting, ...] = (UpstreamSetting(ckpt=True),)


def register() -> None:
    """Register every grid setting except ``upstream`` (registered by :mod:`.policies`) and
    :data:`EXTRA`."""
    for s in UPSTREAM_GRID + EXTRA:
        if s.name == "upstream" or s.name in POLICIES:  # "upstream": .policies registers it
            continue
        register_policy(policy_of(s))


register()
