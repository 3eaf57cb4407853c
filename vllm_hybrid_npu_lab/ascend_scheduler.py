"""vllm-ascend 0.30.0rc2's own scheduler changes that move chunk ends and block counts, modelled
for the lab's ``--target npu`` replays (they apply to every setting, with or without the
plugin's exporter).

vllm-ascend patches vLLM's scheduler at import time on the NPU. Two of its patches change what a
replay of vLLM's scheduler computes beside a KV connector (read 2026-11-29 in
``vllm_ascend/patch/platform/patch_mamba_block_aligned_split.py`` and ``patch_mamba_manager.py``
of the vllm-ascend 0.30.0rc2 sdist; written anew here from that reading):

* **A KV consumer's chunk stays whole** (``Scheduler._mamba_block_aligned_split``): on an
  instance whose ``kv_transfer_config.is_kv_consumer`` holds (role ``kv_consumer`` or
  ``kv_both``: vLLM's OffloadingConnector, the lab's host tier, is ``kv_both``), a request with
  any prefix already computed (local hits, external hits or earlier chunks) is given its
  ``num_new_tokens`` unchanged: none of align mode's stops (the block-aligned split of a cold
  prompt's tail, a shared-prefix junction, the block below the budget's end, a mid-block start's
  next boundary). A cold prompt (nothing computed) takes vLLM's split as usual.
* **One block more where the computed tokens pass the local hit blocks** (``AscendMambaManager.
  get_num_blocks_to_allocate``): where a request's computed tokens exceed the step's local hit
  blocks and the step schedules tokens past them, the Mamba manager counts one block more than
  vLLM does. It is meant for a synchronous external hit (the block vLLM's
  ``allocate_new_computed_blocks`` takes for the external content), but as vLLM 0.30 calls the
  manager it also fires on every later chunk of a running request (its earlier chunks' tokens
  are computed, its local hit blocks for the step are none). Only the admission check reads the
  count.

Not modelled: the EAGLE/MTP block-drop suppression of the same patch (the lab replays no draft
model) and the sparse index-kpool branch (no such model in the presets).

The plugin's runtime composes with both on vllm-ascend's paths (its mid-block stop yields to a
KV consumer's whole window; its junction entries are off beside a KV connector,
``junctions_off``), so binding this model outermost on the replay's scheduler gives the chunking
the runtime gets on the NPU.
"""

from __future__ import annotations

import types
from typing import Any

#: the attribute a bound scheduler carries (its instance counters: chunks kept whole, blocks added)
MARK = "_vhn_ascend_model"
#: the vLLM versions vllm-ascend 0.30.0rc2 runs on: elsewhere (0.32, 0.33, whose managers take
#: other arguments) :func:`apply` binds nothing and the NPU target replays vLLM's scheduler
VLLM_VERSIONS = ("0.30.0",)


def consumer_keeps_whole(kv_transfer_config: Any, request: Any, num_new_local_computed_tokens: int,
                         num_external_computed_tokens: int) -> bool:
    """vllm-ascend 0.30.0rc2's rule: True where the instance is a KV consumer
    (``kv_transfer_config.is_kv_consumer``; None: no connector) and the request has a computed
    prefix (``request.num_computed_tokens`` plus the step's new local and external hits, in
    tokens, above 0), so its chunk is scheduled whole."""
    if kv_transfer_config is None or not getattr(kv_transfer_config, "is_kv_consumer", False):
        return False
    computed = (request.num_computed_tokens + num_new_local_computed_tokens
                + num_external_computed_tokens)
    return computed > 0


def external_hit_block(new_computed_blocks: Any, block_size: int, total_computed_tokens: int,
                       num_tokens_main_model: int) -> int:
    """The block vllm-ascend's Mamba manager adds to vLLM's count (0 or 1): 1 where the
    computed tokens reach past the local hit blocks (``len(new_computed_blocks) * block_size``
    tokens: the rest came from the connector) and the step schedules tokens past the computed
    ones (``num_tokens_main_model > total_computed_tokens``: the external content loads with
    them, synchronously)."""
    external = total_computed_tokens > len(new_computed_blocks) * block_size
    return int(external and num_tokens_main_model > total_computed_tokens)


def apply(scheduler: Any) -> dict[str, int]:
    """Bind the model on ``scheduler`` (a vLLM 0.30 ``Scheduler`` of a replay): its split wrapped
    outermost (:func:`consumer_keeps_whole`), and each align-mode Mamba manager's
    ``get_num_blocks_to_allocate`` (:func:`external_hit_block`), on the instances only (other
    replays in the process keep vLLM's classes). Returns the counters it keeps (also at
    ``scheduler._vhn_ascend_model``): ``kept_whole`` (chunks the consumer rule returned whole
    where the inner split would have cut them) and ``extra_blocks`` (blocks added to a count).
    Idempotent: a scheduler bound before is left as it is. Outside :data:`VLLM_VERSIONS` nothing
    is bound and the counters are empty."""
    import vllm

    from vllm_hybrid_npu.support import base_version

    if getattr(scheduler, MARK, None) is not None:
        return getattr(scheduler, MARK)
    if base_version(vllm.__version__) not in VLLM_VERSIONS:
        setattr(scheduler, MARK, {})
        return {}
    stats = {"kept_whole": 0, "extra_blocks": 0}
    kv = getattr(scheduler.vllm_config, "kv_transfer_config", None)
    inner = scheduler._mamba_block_aligned_split  # bound: the plugin's entries or vLLM's

    def split(self: Any, request: Any, num_new_tokens: int, num_new_local_computed_tokens: int = 0,
              num_external_computed_tokens: int = 0) -> int:
        if consumer_keeps_whole(kv, request, num_new_local_computed_tokens, num_external_computed_tokens):
            # vllm-ascend returns the chunk without asking the split; the inner split is asked
            # here only for the counter (on the NPU target the plugin's junction rule is off
            # beside a KV connector, so asking it records nothing)
            if inner(request, num_new_tokens, num_new_local_computed_tokens,
                     num_external_computed_tokens) != num_new_tokens:
                stats["kept_whole"] += 1
            return num_new_tokens
        return inner(request, num_new_tokens, num_new_local_computed_tokens, num_external_computed_tokens)

    scheduler._mamba_block_aligned_split = types.MethodType(split, scheduler)
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager

    for mgr in scheduler.kv_cache_manager.coordinator.single_type_managers:
        if not isinstance(mgr, MambaManager):
            continue
        count = mgr.get_num_blocks_to_allocate  # bound: the plugin's entries or vLLM's

        def get_num_blocks_to_allocate(self: Any, request_id: str, num_tokens: int,
                                       new_computed_blocks: Any, total_computed_tokens: int,
                                       num_local_computed_tokens: int | None = None,
                                       num_tokens_main_model: int | None = None,
                                       apply_admission_cap: bool = False, _count: Any = count) -> int:
            n = _count(request_id, num_tokens, new_computed_blocks, total_computed_tokens,
                       num_local_computed_tokens, num_tokens_main_model,
                       apply_admission_cap=apply_admission_cap)
            main = num_local_computed_tokens if num_tokens_main_model is None else num_tokens_main_model
            extra = external_hit_block(new_computed_blocks, self.block_size, total_computed_tokens, main)
            stats["extra_blocks"] += extra
            return n + extra

        mgr.get_num_blocks_to_allocate = types.MethodType(get_num_blocks_to_allocate, mgr)
    setattr(scheduler, MARK, stats)
    return stats
