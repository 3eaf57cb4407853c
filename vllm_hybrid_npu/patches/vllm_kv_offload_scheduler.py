"""vLLM's host tier (the OffloadingConnector) without partial tails: an opt-in
(``VLLM_HYBRID_NPU_OPTIONS=tails=off``).

With a prefix-match unit below the block (``--prefix-match-unit``), vLLM 0.30's OffloadingConnector
also stores a request's *partial tail* on the host tier: at a boundary off the block grid, one
attention page and each GDN group's state (``OffloadingConnectorScheduler.
_build_partial_tail_store_jobs``), and looks such tails up (``_lookup``), wherever its scheduler
config says ``SchedulerOffloadConfig.supports_partial_tail``. Each tail takes host pages a
block-grid chunk could hold. On the shared trace with a host tier the tails crowd block-grid
pages out: in the lab's replays token hits rise when no tail is kept, with the exporter at
``--prefix-match-unit 64`` and at ``--prefix-match-unit 32`` without it; at the block's unit (no
tails) nothing changes.

vLLM already has that branch: it builds the config with ``supports_partial_tail`` False for
EAGLE/MTP draft groups, decode context parallel, windowed groups and chunks of several blocks.
This entry takes the same branch on request, nothing else: ``SchedulerOffloadConfig.from_spec``
(vLLM 0.30.0's ``vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py``) returns
its config with ``supports_partial_tail=False``; block-grid chunks, the GDN states at block
boundaries (``_build_aligned_boundary_store_jobs``), lookups and eviction stay vLLM's. The default
``on`` is vLLM's behaviour (entry skipped). On the NPU, vllm-ascend 0.30.0rc2 registers its
``AscendOffloadingConnector`` under vLLM's name ``OffloadingConnector``: a subclass with vLLM's
scheduler side (its own worker only), so the entry applies there as well. Whether it pays
depends on the traffic: the lab's ``tails=off`` key replays it (``vllm-hybrid-npu-lab hitrate
--policy upstream:...,tails=off``; numbers in ``docs/hitrate-guide.md``).
Until: vLLM's host tier weighs partial tails against block-grid pages itself.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from vllm_hybrid_npu import envs
from vllm_hybrid_npu.patches.registry import Patch
from vllm_hybrid_npu.support import Stack

logger = logging.getLogger("vllm_hybrid_npu")

#: The option (``VLLM_HYBRID_NPU_OPTIONS`` key): ``on`` (vLLM's partial tails on the host tier,
#: default) or ``off``.
TAILS_KEY = "tails"
ENTRY = "host-tier-partial-tails-off"
MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler"
VERSIONS = ("0.30.0",)


def partial_tails() -> str:
    """The option ``tails`` (default ``on``).

    Raises:
        ValueError: a value other than ``on`` or ``off`` (the message names the variable).
    """
    return envs.option(TAILS_KEY)


def without_partial_tails(config: Any) -> Any:
    """``config`` (vLLM 0.30's ``SchedulerOffloadConfig``, a NamedTuple) with
    ``supports_partial_tail`` False: the OffloadingConnector neither stores nor looks up a
    partial tail. Returned unchanged where vLLM already chose no tails."""
    if not config.supports_partial_tail:
        return config
    return config._replace(supports_partial_tail=False)


def _make_from_spec(upstream: Any, stack: Stack) -> Any:
    """Registry ``make`` of ``SchedulerOffloadConfig.from_spec`` (a classmethod: ``upstream`` is
    the classmethod object): vLLM's config, then :func:`without_partial_tails`."""
    fn = upstream.__func__

    @functools.wraps(fn)
    def from_spec(cls, spec, vllm_config, kv_cache_config):
        config = fn(cls, spec, vllm_config, kv_cache_config)
        if config.supports_partial_tail:
            logger.info("vllm-hybrid-npu: %s: the host tier (OffloadingConnector) stores and "
                        "looks up no partial tail (block-grid chunks and GDN states at block "
                        "boundaries as vLLM's)", envs.option_text(TAILS_KEY, "off"))
        return without_partial_tails(config)

    return classmethod(from_spec)


def _wanted(stack: Stack) -> str | None:
    """Skip reason unless :func:`partial_tails` is ``off`` (a bad value raises ValueError)."""
    return None if partial_tails() == "off" else f"{envs.option_text(TAILS_KEY, 'on')} (vLLM's partial tails)"


def _probe(upstream: Any, stack: Stack) -> str | None:
    """Skip reason where the installed config has no ``supports_partial_tail`` field."""
    import sys

    owner = sys.modules[MODULE].SchedulerOffloadConfig
    if "supports_partial_tail" not in getattr(owner, "_fields", ()):
        return "SchedulerOffloadConfig has no supports_partial_tail field"
    return None


PATCHES = [
    Patch(
        name=ENTRY,
        module=MODULE,
        qualname="SchedulerOffloadConfig.from_spec",
        targets=("cpu", "cuda", "npu"),
        vllm=VERSIONS,
        why=f"opt-in ({envs.option_text(TAILS_KEY, 'off')}): the host tier keeps no partial tail "
        "(vLLM's own branch "
        "without them), leaving its pages to block-grid chunks; with --prefix-match-unit below "
        "the block the lab measured more hits (docs/hitrate-guide.md)",
        until="vLLM's host tier weighs partial tails against block-grid pages",
        make=_make_from_spec,
        wanted=_wanted,
        probe=_probe,
        signature=("cls", "spec", "vllm_config", "kv_cache_config"),
        behaviour_changing=True,
    ),
]
