"""Engine side: the align-mode Mamba managers' checkpoint blocks, one hook per upstream method.

vLLM 0.30's ``MambaManager`` reserves one prefill checkpoint block per chunk (the column of the
chunk's last hash boundary) and caches it in ``_cache_partial_tail_block``. The plugin's rules add
blocks beside it and change how it is kept; each rule is a plain function in its module, and
every upstream method is wrapped here once, whichever rules are on:

========================================  ==================================================
upstream method (vLLM 0.30)               rules, in the order they run
========================================  ==================================================
``Scheduler.__init__``                    decides once per engine: the junction rule
                                          (:func:`.gdn_junction.decide`), the second block's
                                          managers (:func:`.gdn_second_checkpoint.decide`)
``KVCacheManager.allocate_slots``         hands the Mamba managers, for this call only, a
                                          junction or crossed boundary
                                          (:func:`.gdn_junction.allocation_checkpoint`) and a
                                          final chunk's prompt length (second block)
``MambaManager.get_num_blocks_to_allocate``  one block more for each handed checkpoint
``MambaManager.allocate_new_blocks``      the junction's block in its column
                                          (:func:`.gdn_junction.place`), then the second block
                                          beside the request's blocks
                                          (:func:`.gdn_second_checkpoint.take`)
``MambaManager._cache_partial_tail_block``  the second block keyed at the checkpoint
                                          (:func:`.gdn_second_checkpoint.cache`); otherwise
                                          vLLM's caching with the retention rule
                                          (:func:`.gdn_prefill_checkpoint.retention`)
``MambaManager.remove_skipped_blocks``    the second block back to the pool with its column
``MambaManager.pop_blocks_for_free``      the second block freed with the request
========================================  ==================================================

A rule that is off for this engine leaves its part a dictionary lookup: the junction rule is
None (:data:`.gdn_junction.RULE`), the second block's managers are empty
(:data:`.gdn_second_checkpoint.MANAGERS`: ``VLLM_HYBRID_NPU_OPTIONS=second=off``, or a path
that writes one state per row). The blocks these hooks reserve are listed to the worker by the
engine's plan (:mod:`.gdn_step_checkpoints`). The hooks wrap vLLM's classes, so vllm-ascend
0.30.0rc2's ``AscendMambaManager`` (a subclass, ``patch/platform/patch_mamba_manager.py``) runs
them under its own ``get_num_blocks_to_allocate``. The first four hooks apply on vLLM 0.30 and
0.32 / 0.33 (:data:`JUNCTION_VERSIONS`), where the second block is off
(:func:`.gdn_second_checkpoint.decide`); the caching, retiring and freeing hooks on 0.30 only
(0.32 and 0.33 cache the prompt checkpoint at retention interval 0 themselves).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from vllm_hybrid_npu.patches import gdn_junction as junction
from vllm_hybrid_npu.patches import gdn_prefill_checkpoint as gdn
from vllm_hybrid_npu.patches import gdn_second_checkpoint as second
from vllm_hybrid_npu.support import Stack

VERSIONS = ("0.30.0",)
#: The junction rule's hooks (``gdn-manager-engine``, ``-allocate``, ``-count``, ``-blocks``):
#: also vLLM 0.32 and 0.33, whose ``MambaManager`` and ``KVCacheManager.allocate_slots`` keep 0.30's
#: contracts for them (:data:`.gdn_junction.VERSIONS`); the second block's hooks stay on 0.30.
JUNCTION_VERSIONS = junction.VERSIONS
TARGETS = ("cpu", "cuda", "npu")
SCHEDULER = "vllm.v1.core.sched.scheduler"
KV_MANAGER = "vllm.v1.core.kv_cache_manager"
SINGLE_TYPE = junction.SINGLE_TYPE

logger = logging.getLogger("vllm_hybrid_npu")


def decisions(scheduler: Any, stack: Stack) -> dict[str, str]:
    """What the configuration of vLLM 0.30's / 0.32's / 0.33's ``scheduler`` decided for the engine's GDN
    checkpoints, after :func:`.gdn_junction.decide` and :func:`.gdn_second_checkpoint.decide`
    ran on it: ``{"exporter", "junctions", "budget_chunks", "second", "drafter_drop"}``, each
    ``"on"`` (the exporter: its path), or ``"off"`` / ``"off (why)"``. Reads the decisions the
    engine took (the rules on the scheduler and its KV-cache manager), decides nothing."""
    config = scheduler.vllm_config
    path, why = gdn.exporter_path(config, stack.target)
    rule = getattr(scheduler, junction.RULE, None)
    off = why if path is None else gdn.junctions_off(config, path)  # one state per row: why
    if rule is not None:
        junctions = "on"
    elif off is not None:
        junctions = f"off ({off})"
    elif junction.speculative(scheduler) and (drop_why := junction.drop_off(
            scheduler, junction.drop_read(stack))) is not None:
        under = "EAGLE/MTP's block drop" if scheduler.use_eagle_block_drop else "speculative decoding"
        junctions = f"off ({under}: {drop_why})"
    else:
        junctions = "off"
    found = second.managers_of(scheduler.kv_cache_manager)
    return {"exporter": path or f"off ({why})", "junctions": junctions,
            "budget_chunks": ("on" if rule is not None and rule.budget and rule.hash_block == rule.block
                              else "off"),
            "second": f"on ({len(found)} KV-cache groups)" if found else
            f"off ({second.KEY}=off)" if second.mode() != "on" else
            f"off ({second.KEY}=on, but {off})" if off is not None else
            f"off ({second.KEY}=on, no KV-cache group eligible here)",
            "drafter_drop": "on" if scheduler.use_eagle_block_drop else "off"}


def _make_engine(upstream: Any, stack: Stack) -> Any:
    """Registry ``make`` of vLLM 0.30's / 0.32's / 0.33's ``Scheduler.__init__``: after it, this engine's junction
    rule and second-block managers, decided once from its configuration, and one line naming
    every decision (:func:`decisions`)."""
    @functools.wraps(upstream)
    def __init__(self, vllm_config, *args, **kwargs):
        upstream(self, vllm_config, *args, **kwargs)
        junction.decide(self, stack)
        second.decide(self, stack)
        logger.info("vllm-hybrid-npu: decided from this engine's configuration: %s",
                    ", ".join(f"{k}={v}" for k, v in decisions(self, stack).items()))

    return __init__


def _make_allocate(upstream: Any, stack: Stack) -> Any:
    """Registry ``make`` of vLLM 0.30's / 0.32's / 0.33's ``KVCacheManager.allocate_slots``: for a prefill chunk
    ``[start, end)`` (tokens: the request's computed tokens, plus the new local and external hit,
    plus ``num_new_tokens``), the junction rule's checkpoint for the junction managers
    (:data:`.gdn_junction.HINT`) and, for a prompt's final chunk, ``(start, prompt tokens)`` for
    the second block's managers (:data:`.gdn_second_checkpoint.HINT`), for this call only. A
    chunk at or past the prompt's end (every decode step) goes to upstream at once."""
    @functools.wraps(upstream)
    def allocate_slots(self, request, num_new_tokens, num_new_computed_tokens=0,
                       new_computed_blocks=None, num_lookahead_tokens=0,
                       num_external_computed_tokens=0, *args, **kwargs):
        call = (request, num_new_tokens, num_new_computed_tokens, new_computed_blocks,
                num_lookahead_tokens, num_external_computed_tokens, *args)
        start = request.num_computed_tokens + num_new_computed_tokens + num_external_computed_tokens
        prompt = request.num_prompt_tokens
        if num_new_tokens <= 0 or start >= prompt:
            return upstream(self, *call, **kwargs)
        end = start + num_new_tokens
        rule = getattr(self, junction.RULE, None)
        position = junction.allocation_checkpoint(rule, request, start, end) if rule else 0
        last = second.managers_of(self) if end == prompt else ()
        if not position and not last:
            return upstream(self, *call, **kwargs)
        rid, first = request.request_id, rule.managers if position else ()
        for manager in first:
            vars(manager).setdefault(junction.HINT, {})[rid] = position
        for manager in last:
            vars(manager).setdefault(second.HINT, {})[rid] = (start, prompt)
        try:
            return upstream(self, *call, **kwargs)
        finally:
            for manager in first:
                vars(manager)[junction.HINT].pop(rid, None)
            for manager in last:
                vars(manager)[second.HINT].pop(rid, None)

    return allocate_slots


def _make_count(upstream: Any, stack: Stack) -> Any:
    """Registry ``make`` of vLLM 0.30's / 0.32's / 0.33's ``MambaManager.get_num_blocks_to_allocate``: upstream's
    count, one more for a handed junction or crossed boundary, one more for a second block
    (not in vLLM's admission estimate, ``apply_admission_cap``, nor past the pool: vLLM's
    "not this step")."""
    @functools.wraps(upstream)
    def get_num_blocks_to_allocate(self, request_id, *args, **kwargs):
        n = upstream(self, request_id, *args, **kwargs)
        if vars(self).get(junction.HINT, {}).get(request_id):
            n += 1
        if (second.wants(self, request_id) and not kwargs.get("apply_admission_cap")
                and n <= self.block_pool.num_gpu_blocks):
            n += 1
        return n

    return get_num_blocks_to_allocate


def _make_blocks(upstream: Any, stack: Stack) -> Any:
    """Registry ``make`` of vLLM 0.30's / 0.32's / 0.33's ``MambaManager.allocate_new_blocks``: upstream's new
    blocks, the handed junction's block put in its column, then the second block taken."""
    @functools.wraps(upstream)
    def allocate_new_blocks(self, request_id, *args, **kwargs):
        position = vars(self).get(junction.HINT, {}).get(request_id)
        if position:
            blocks = self.req_to_blocks[request_id]
            before, col = len(blocks), position // self.block_size - 1
            prior = blocks[col] if 0 <= col < before else None  # a speculative block vLLM may move
            out = upstream(self, request_id, *args, **kwargs)
            junction.place(self, request_id, position, before, out, prior)
        else:
            out = upstream(self, request_id, *args, **kwargs)
        second.take(self, request_id)
        return out

    return allocate_new_blocks


def _make_cache(upstream: Any, stack: Stack) -> Any:
    """Registry ``make`` of vLLM 0.30's ``MambaManager._cache_partial_tail_block``: a second block
    taken in this allocation is keyed at the checkpoint (:func:`.gdn_second_checkpoint.cache`);
    otherwise upstream runs with the retention interval of
    :func:`.gdn_prefill_checkpoint.retention`."""
    @functools.wraps(upstream)
    def _cache_partial_tail_block(self, request, num_tokens, retention_interval):
        done, key = second.cache(self, request, num_tokens)
        if done:
            return key
        return upstream(self, request, num_tokens, gdn.retention(self, request, retention_interval))

    return _cache_partial_tail_block


def _make_retire(upstream: Any, stack: Stack) -> Any:
    @functools.wraps(upstream)
    def remove_skipped_blocks(self, request_id, *args, **kwargs):
        upstream(self, request_id, *args, **kwargs)
        second.retire(self, request_id)

    return remove_skipped_blocks


def _make_free(upstream: Any, stack: Stack) -> Any:
    @functools.wraps(upstream)
    def pop_blocks_for_free(self, request_id):
        return second.free(self, request_id, upstream(self, request_id))

    return pop_blocks_for_free


def _wanted(stack: Stack) -> str | None:
    """:func:`.gdn_prefill_checkpoint.wanted`, after reading the rules' options (``ckpt``,
    ``second``: a bad value raises ValueError naming ``VLLM_HYBRID_NPU_OPTIONS`` at load)."""
    gdn.chunk_checkpoints()
    second.mode()
    return gdn.wanted(stack)


def entry(name: str, module: str, qualname: str, make: Any, why: str, signature: tuple,
          vllm: tuple = VERSIONS) -> Any:
    """A behaviour-changing ``gdn-manager-*`` entry (every target; vLLM ``vllm``)."""
    return gdn.entry(name, module, qualname, make, TARGETS, why, vllm=vllm, wanted=_wanted,
                     signature=signature,
                     until="vLLM's MambaManager reserves and keeps junction, crossed-boundary and "
                           "block-boundary states itself (RFC #52959, vllm-project/vllm#54076)")


MANAGER_ID = ("self", "request_id")
PATCHES = [
    entry("gdn-manager-engine", SCHEDULER, "Scheduler.__init__", _make_engine,
          "decides once per engine, from its configuration, the junction rule and the second "
          "block's managers (none where the exporter path writes one state per row)",
          ("self", "vllm_config", "kv_cache_config"), JUNCTION_VERSIONS),
    entry("gdn-manager-allocate", KV_MANAGER, "KVCacheManager.allocate_slots", _make_allocate,
          "hands the align-mode Mamba managers this chunk's junction or crossed boundary "
          "(core.junction_checkpoint, core.crossed_checkpoint) and a final chunk's prompt length "
          "(core.second_checkpoint), for that call",
          ("self", "request", "num_new_tokens", "num_new_computed_tokens", "new_computed_blocks",
           "num_lookahead_tokens", "num_external_computed_tokens"), JUNCTION_VERSIONS),
    entry("gdn-manager-count", SINGLE_TYPE, "MambaManager.get_num_blocks_to_allocate",
          _make_count, "one block more for each handed checkpoint", MANAGER_ID, JUNCTION_VERSIONS),
    entry("gdn-manager-blocks", SINGLE_TYPE, "MambaManager.allocate_new_blocks", _make_blocks,
          "the junction's block in the column vLLM's split would have cached it in "
          "(jf // block - 1); the second block beside the request's blocks", MANAGER_ID,
          JUNCTION_VERSIONS),
    entry("gdn-manager-cache", SINGLE_TYPE, "MambaManager._cache_partial_tail_block", _make_cache,
          "the second block keyed at the checkpoint, the column keeping the block boundary's key; "
          "the prompt's checkpoint cached at retention interval 0 (vLLM 0.32's fix carried); "
          "with VLLM_HYBRID_NPU_OPTIONS=ckpt=final a non-final chunk's checkpoint not kept "
          "at retention > 0",
          ("self", "request", "num_tokens", "retention_interval")),
    entry("gdn-manager-retire", SINGLE_TYPE, "MambaManager.remove_skipped_blocks", _make_retire,
          "the second block back to the pool (cached) when its column goes", MANAGER_ID),
    entry("gdn-manager-free", SINGLE_TYPE, "MambaManager.pop_blocks_for_free", _make_free,
          "the second block freed with the request (finish, abort, preemption)", MANAGER_ID),
]
