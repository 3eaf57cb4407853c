"""A second GDN checkpoint block per prompt, so the block boundary's state stays cached beside the
sub-block checkpoint: an opt-in (``VLLM_HYBRID_NPU_SECOND_CHECKPOINT=on``).

With a prefix-match unit below the block (``--prefix-match-unit 64``) the exporter writes a
prompt's checkpoint ``cp = (L - 1) // 64 * 64`` from inside the step. vLLM 0.30's ``MambaManager``
reserves it the block-table column ``c = cdiv(L, B) - 2``, which its full-block pass keys at
``q = (c + 1) * B = cp // B * B`` and ``_cache_partial_tail_block`` then re-keys at ``cp``. So
wherever ``cp`` is off the block grid, no GDN state stays cached at ``q``: a later prompt sharing
``q`` tokens (but not ``cp``) hits less, and vLLM's host tier (the OffloadingConnector looks GDN
states up on the block grid) finds nothing there: in the lab's replays a prefix-match unit of 64
with a host tier gets fewer hits than the block's unit (docs/gdn-checkpoints.md, "The host tier
with a prefix-match unit below the block").

``on`` gives such a prompt's final chunk one more block, ``E``, kept beside the request's blocks
(not in its block table; vLLM's worker block table is append-only and its columns are vLLM's):

* ``Scheduler.__init__`` (``gdn-second-checkpoint-engine``): on for the engine's KV-cache manager
  only where its exporter path writes several states per row
  (``gdn_prefill_checkpoint.junctions_off`` is None), else off, logged once;
* ``KVCacheManager.allocate_slots`` (``gdn-second-checkpoint-allocate``): tells the engine's
  align-mode Mamba managers the prompt's length for this call (a final chunk only);
* ``MambaManager.get_num_blocks_to_allocate`` / ``allocate_new_blocks`` (``-count``, ``-blocks``):
  where vLLM reserved ``cp`` and :func:`~vllm_hybrid_npu.core.prefill_checkpoints.second_checkpoint`
  answers ``q``, one block more is counted and taken;
* ``MambaManager._cache_partial_tail_block`` (``-cache``): ``E`` is cached at ``cp`` (and offered
  to a KV connector as vLLM offers the partial tail), the column keeps ``q``'s key (offered as a
  block boundary by vLLM's own ``cache_blocks``); where the column is not keyed at ``q``,
  vLLM's re-key runs and ``E`` is not used; a later call while the checkpoint is the same (vLLM's
  ``AsyncScheduler`` caches again once the step's output is in) leaves both alone;
* ``MambaManager.remove_skipped_blocks`` / ``pop_blocks_for_free`` (``-retire``, ``-free``): ``E``
  goes back to the pool (cached, evictable) when the column does, or with the request (finish,
  abort, preemption), placed after the column's block in the list vLLM frees in reverse;
* the engine's plan (:mod:`.gdn_step_checkpoints`, ``gdn-checkpoint-send``) lists ``q`` in
  column ``c``'s block and ``cp`` in ``E`` for the step's GDN metadata builders (``boundary`` and
  ``second`` in ``core.step_checkpoints``), which vLLM's CPU GDN function and vllm-ascend's three
  prefill paths (``ops.run_split``) write in one more round and CUDA's one pass stores at their
  chunk starts.

Where the step writes both: vLLM 0.30's CPU exporter path, CUDA's one pass on vLLM 0.30's V2
runner where the junction export runs (``VLLM_HYBRID_NPU_CUDA_JUNCTIONS=on``, the default), and
vllm-ascend 0.30.0rc2's V1 runner where its junction export runs (not its V2 runner, decode
context parallel or a KV transfer connector: ``junctions_off``); the engine entry decides. The
NPU is replayed on CPU only (``tests/ascend``: vllm-ascend's scheduler patches and
``AscendMambaManager``, its GDN builder and forward on each prefill path). Not vLLM 0.32 / 0.33.
Default ``off`` (vLLM's re-key). Until: vLLM keeps the block boundary's state beside a sub-block
checkpoint (RFC #52959; vllm-project/vllm#54076 names the gap).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from vllm_hybrid_npu import envs
from vllm_hybrid_npu.core import prefill_checkpoints as core
from vllm_hybrid_npu.patches import gdn_prefill_checkpoint as gdn
from vllm_hybrid_npu.patches.gdn_junction import SINGLE_TYPE, is_mamba_manager
from vllm_hybrid_npu.support import Stack

logger = logging.getLogger("vllm_hybrid_npu")

#: Environment variable: ``off`` (vLLM's re-key, default) or ``on``.
ENV = "VLLM_HYBRID_NPU_SECOND_CHECKPOINT"
MODES = ("off", "on")
VERSIONS = ("0.30.0",)
TARGETS = ("cpu", "cuda", "npu")
#: A Mamba manager's ``{request id: (chunk start, prompt tokens)}`` for the ``allocate_slots``
#: call in progress (a prompt's final chunk only).
HINT = "_vhn_second_hint"
#: A Mamba manager's ``{request id: [block E, cp, column, state]}``; state ``new`` (taken this
#: step), ``keyed`` (cached at cp), ``sent`` (on the step's output), ``unused`` (not written:
#: the column was not keyed at q, or the allocation cached nothing).
EXTRA = "_vhn_second_blocks"
#: A KV-cache manager's managers this applies to (a tuple, possibly empty), decided once.
MANAGERS = "_vhn_second_managers"



def mode() -> str:
    """``$VLLM_HYBRID_NPU_SECOND_CHECKPOINT`` (default ``off``).

    Raises:
        ValueError: a value other than ``off`` or ``on`` (the message names the variable).
    """
    return envs.choice(ENV, MODES, "off")


def _wanted(stack: Stack) -> str | None:
    if mode() != "on":
        return f"{ENV}=off (vLLM's re-key)"
    return gdn.wanted(stack)


def managers_of(kv_cache_manager: Any) -> tuple:
    """The align-mode Mamba managers (vLLM 0.30's ``MambaManager`` or a subclass) of
    ``kv_cache_manager`` (vLLM's ``KVCacheManager``) whose prompts can take a second block: a
    prefill checkpoint declared, a prefix-match unit (the block pool's hash block) below the
    block, no speculative blocks, no EAGLE block drop, no fine-grained prefix cache. Decided
    once per KV-cache manager (:data:`MANAGERS`): by the engine's scheduler at its start
    (``gdn-second-checkpoint-engine``: none where the step cannot write both states), else
    (the lab) here."""
    found = vars(kv_cache_manager).get(MANAGERS)
    if found is None:
        found = tuple(
            m for m in kv_cache_manager.coordinator.single_type_managers
            if is_mamba_manager(m) and m.mamba_cache_mode == "align"
            and getattr(m, "has_prefill_checkpoint_blocks", False)
            and m.block_pool.hash_block_size < m.block_size
            and not m.num_speculative_blocks and not getattr(m, "use_eagle", False)
            and not getattr(m, "drop_eagle_checkpoint_block", False)
            and not getattr(m, "fine_grained_prefix_cache", False))
        vars(kv_cache_manager)[MANAGERS] = found
        if found:
            logger.info("vllm-hybrid-npu: %s=on: a prompt whose GDN checkpoint lies inside its last "
                        "block also keeps the state at that block's start (a second block per "
                        "prompt, %d KV-cache groups)", ENV, len(found))
    return found


def _make_engine(upstream: Any, stack: Stack) -> Any:
    """Registry ``make`` of vLLM 0.30's ``Scheduler.__init__``: after it, the second block is
    on for this engine's KV-cache manager (:func:`managers_of`) only where the exporter path
    writes several checkpoints per row (``gdn_prefill_checkpoint.junctions_off`` is None: vLLM's
    CPU GDN function; CUDA's one pass on vLLM 0.30's V2 runner; vllm-ascend's V1 runner, ``ascend`` in the engine-core process);
    elsewhere (CUDA's V1 runner, FlashInfer, ``FLA_USE_FAST_OPS=1``, context parallel,
    ``VLLM_HYBRID_NPU_CUDA_JUNCTIONS=off``, vllm-ascend's V2 runner or a KV transfer connector)
    none, logged once."""
    @functools.wraps(upstream)
    def __init__(self, vllm_config, *args, **kwargs):
        upstream(self, vllm_config, *args, **kwargs)
        path, why = gdn.exporter_path(vllm_config, stack.target)
        why = gdn.junctions_off(vllm_config, path) if path else why
        if why is None:
            managers_of(self.kv_cache_manager)
        else:
            vars(self.kv_cache_manager)[MANAGERS] = ()
            gdn._log_once("second-off", "second block: %s=on, but none here: %s",
                          ENV, why)

    return __init__


def _make_allocate(upstream: Any, stack: Stack) -> Any:
    """Registry ``make`` of vLLM 0.30's ``KVCacheManager.allocate_slots``: for a prompt's final
    chunk (``start + num_new_tokens == num_prompt_tokens``, ``start`` its computed tokens plus the
    new local and external hit) each manager of :func:`managers_of` is told the prompt's length
    for this call only (:data:`HINT`)."""
    @functools.wraps(upstream)
    def allocate_slots(self, request, num_new_tokens, num_new_computed_tokens=0,
                       new_computed_blocks=None, num_lookahead_tokens=0,
                       num_external_computed_tokens=0, *args, **kwargs):
        call = (request, num_new_tokens, num_new_computed_tokens, new_computed_blocks,
                num_lookahead_tokens, num_external_computed_tokens, *args)
        start = request.num_computed_tokens + num_new_computed_tokens + num_external_computed_tokens
        if (num_new_tokens <= 0 or start + num_new_tokens != request.num_prompt_tokens
                or not (found := managers_of(self))):
            return upstream(self, *call, **kwargs)
        rid = request.request_id
        for manager in found:
            vars(manager).setdefault(HINT, {})[rid] = (start, request.num_prompt_tokens)
        try:
            return upstream(self, *call, **kwargs)
        finally:
            for manager in found:
                vars(manager)[HINT].pop(rid, None)

    return allocate_slots


def _wants(manager: Any, request_id: str) -> tuple[int, int, int] | None:
    """``(cp, column, q)`` where this allocation's chunk takes a second block, else None: the
    manager's hint (:data:`HINT`), the checkpoint vLLM recorded in this call
    (``MambaManager._checkpoints``), and :func:`core.second_checkpoint`."""
    hint = vars(manager).get(HINT, {}).get(request_id)
    checkpoint = manager._checkpoints.get(request_id) if hint else None
    if checkpoint is None or request_id in vars(manager).get(EXTRA, {}):
        return None
    (start, prompt), (cp, col) = hint, checkpoint
    q = core.second_checkpoint(start, prompt, prompt, cp, manager.block_size,
                               manager.kv_cache_spec.prefill_checkpoint_alignment)
    return (cp, col, q) if q and col == q // manager.block_size - 1 else None


def _make_count(upstream: Any, stack: Stack) -> Any:
    @functools.wraps(upstream)
    def get_num_blocks_to_allocate(self, request_id, *args, **kwargs):
        n = upstream(self, request_id, *args, **kwargs)
        if kwargs.get("apply_admission_cap") or n > self.block_pool.num_gpu_blocks:
            return n  # vLLM's admission estimate, or its "not this step"
        return n + 1 if _wants(self, request_id) else n

    return get_num_blocks_to_allocate


def _make_blocks(upstream: Any, stack: Stack) -> Any:
    @functools.wraps(upstream)
    def allocate_new_blocks(self, request_id, *args, **kwargs):
        out = upstream(self, request_id, *args, **kwargs)
        if (want := _wants(self, request_id)) and self.block_pool.get_num_free_blocks() > 0:
            block = self.block_pool.get_new_blocks(1)[0]
            vars(self).setdefault(EXTRA, {})[request_id] = [block, want[0], want[1], "new"]
        return out

    return allocate_new_blocks


def _make_cache(upstream: Any, stack: Stack) -> Any:
    @functools.wraps(upstream)
    def _cache_partial_tail_block(self, request, num_tokens, retention_interval):
        extra = vars(self).get(EXTRA, {}).get(request.request_id)
        if extra is None or extra[3] == "unused":
            return upstream(self, request, num_tokens, retention_interval)
        if extra[3] != "new":
            # cached already: vLLM's AsyncScheduler caches again once the step's output is in
            # (_update_request_with_output), where vLLM's own re-key is a no-op but would move
            # the column's key from q to cp here
            return None if self._checkpoints.get(request.request_id) == (extra[1], extra[2]) \
                else upstream(self, request, num_tokens, retention_interval)
        block, cp, col, _ = extra
        slot = self.req_to_blocks[request.request_id][col]
        if (num_tokens != request.num_prompt_tokens or slot.is_null
                or slot.block_hash_num_tokens != (col + 1) * self.block_size):
            extra[3] = "unused"  # vLLM re-keys the column at cp; the worker writes as vLLM plans
            return upstream(self, request, num_tokens, retention_interval)
        extra[3] = "keyed"
        key = self.block_pool.cache_partial_block(
            request=request, block=block, num_tokens=cp, kv_cache_group_id=self.kv_cache_group_id,
            block_size=self.block_size)
        if key is not None:  # offered to a KV connector as vLLM offers a partial tail
            self._pending_boundary_state_offloads.append(
                (request.request_id, self.kv_cache_group_id, block, cp))
        return key

    return _cache_partial_tail_block


def _make_retire(upstream: Any, stack: Stack) -> Any:
    @functools.wraps(upstream)
    def remove_skipped_blocks(self, request_id, *args, **kwargs):
        upstream(self, request_id, *args, **kwargs)
        extra = vars(self).get(EXTRA, {}).get(request_id)
        if extra is not None:
            blocks = self.req_to_blocks.get(request_id, [])
            if extra[2] >= len(blocks) or blocks[extra[2]].is_null:  # the column went back
                del vars(self)[EXTRA][request_id]
                self.block_pool.free_blocks([extra[0]])

    return remove_skipped_blocks


def _make_free(upstream: Any, stack: Stack) -> Any:
    @functools.wraps(upstream)
    def pop_blocks_for_free(self, request_id):
        blocks = upstream(self, request_id)
        extra = vars(self).get(EXTRA, {}).pop(request_id, None)
        if extra is None:
            return blocks
        blocks = list(blocks)  # freed in reverse: E just before the column's block
        blocks.insert(min(extra[2] + 1, len(blocks)), extra[0])
        return blocks

    return pop_blocks_for_free


def entry(name: str, module: str, qualname: str, make: Any, why: str, signature: tuple,
          targets: tuple = TARGETS, **kw: Any) -> Any:
    """A behaviour-changing ``gdn-second-checkpoint-*`` entry (vLLM 0.30; gated by
    :data:`ENV` and ``gdn_prefill_checkpoint.wanted``)."""
    return gdn.entry(name, module, qualname, make, targets, why, vllm=VERSIONS, wanted=_wanted,
                     signature=signature, **kw,
                     until="vLLM keeps the block boundary's state beside a sub-block checkpoint "
                           "(RFC #52959, vllm-project/vllm#54076)")


PATCHES = [
    entry("gdn-second-checkpoint-engine", "vllm.v1.core.sched.scheduler", "Scheduler.__init__",
          _make_engine, f"opt-in ({ENV}=on): decides once per engine whether its exporter path "
          "writes both states (gdn_prefill_checkpoint.junctions_off), else no second block",
          ("self", "vllm_config", "kv_cache_config")),
    entry("gdn-second-checkpoint-allocate", "vllm.v1.core.kv_cache_manager",
          "KVCacheManager.allocate_slots", _make_allocate,
          f"opt-in ({ENV}=on): a prompt's final chunk tells the align-mode Mamba managers its "
          "prompt length for this call",
          ("self", "request", "num_new_tokens", "num_new_computed_tokens", "new_computed_blocks",
           "num_lookahead_tokens", "num_external_computed_tokens")),
    entry("gdn-second-checkpoint-count", SINGLE_TYPE, "MambaManager.get_num_blocks_to_allocate",
          _make_count, "one block more where the checkpoint lies inside the prompt's last block "
          "(core.second_checkpoint)", ("self", "request_id")),
    entry("gdn-second-checkpoint-blocks", SINGLE_TYPE, "MambaManager.allocate_new_blocks",
          _make_blocks, "that block, kept beside the request's blocks (not in its block table)",
          ("self", "request_id")),
    entry("gdn-second-checkpoint-cache", SINGLE_TYPE, "MambaManager._cache_partial_tail_block",
          _make_cache, "the second block cached at the checkpoint; the column keeps the block "
          "boundary's key (vLLM re-keys it at the checkpoint)",
          ("self", "request", "num_tokens", "retention_interval")),
    entry("gdn-second-checkpoint-retire", SINGLE_TYPE, "MambaManager.remove_skipped_blocks",
          _make_retire, "the second block back to the pool (cached) when its column goes",
          ("self", "request_id")),
    entry("gdn-second-checkpoint-free", SINGLE_TYPE, "MambaManager.pop_blocks_for_free",
          _make_free, "the second block freed with the request (finish, abort, preemption)",
          ("self", "request_id")),
]
