"""A second GDN checkpoint block per prompt, so the block boundary's state stays cached beside the
sub-block checkpoint: an opt-in (``VLLM_HYBRID_NPU_OPTIONS=second=on``).

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
(not in its block table; vLLM's worker block table is append-only and its columns are vLLM's).
The rules below run inside the Mamba managers' hooks (:mod:`.gdn_mamba_manager`, one per upstream
method):

* at the engine's start (:func:`decide`): on for the engine's KV-cache manager only where its
  exporter path writes several states per row (``gdn_prefill_checkpoint.junctions_off`` is
  None), else off, logged once;
* ``KVCacheManager.allocate_slots``: a prompt's final chunk tells the second block's managers
  the prompt's length for this call (:data:`HINT`);
* ``MambaManager.get_num_blocks_to_allocate`` / ``allocate_new_blocks`` (:func:`wants`,
  :func:`take`): where vLLM reserved ``cp`` and
  :func:`~vllm_hybrid_npu.core.prefill_checkpoints.second_checkpoint` answers ``q``, one block
  more is counted and taken;
* ``MambaManager._cache_partial_tail_block`` (:func:`cache`): ``E`` is cached at ``cp`` (and
  offered to a KV connector as vLLM offers the partial tail), the column keeps ``q``'s key
  (offered as a block boundary by vLLM's own ``cache_blocks``); where the column is not keyed at
  ``q``, vLLM's re-key runs and ``E`` is not used; a later call while the checkpoint is the same
  (vLLM's ``AsyncScheduler`` caches again once the step's output is in) leaves both alone;
* ``MambaManager.remove_skipped_blocks`` / ``pop_blocks_for_free`` (:func:`retire`,
  :func:`free`): ``E`` goes back to the pool (cached, evictable) when the column does, or with
  the request (finish, abort, preemption), placed after the column's block in the list vLLM
  frees in reverse;
* the engine's plan (:mod:`.gdn_step_checkpoints`, ``gdn-checkpoint-send``) lists ``q`` in
  column ``c``'s block and ``cp`` in ``E`` for the step's GDN metadata builders (``boundary`` and
  ``second`` in ``core.step_checkpoints``), which vLLM's CPU GDN function and vllm-ascend's three
  prefill paths (``ops.run_split``) write in one more round and CUDA's one pass stores at their
  chunk starts.

Where the step writes both: vLLM 0.30's CPU exporter path, CUDA's one pass on vLLM 0.30's V2
runner where the junction export runs (``VLLM_HYBRID_NPU_OPTIONS=junctions=on``, the default), and
vllm-ascend 0.30.0rc2's V1 runner where its junction export runs (not its V2 runner, decode
context parallel or a KV transfer connector: ``junctions_off``); the engine entry decides. The
NPU is replayed on CPU only (``tests/ascend``: vllm-ascend's scheduler patches and
``AscendMambaManager``, its GDN builder and forward on each prefill path). Not vLLM 0.32 / 0.33.
Default ``off`` (vLLM's re-key). Until: vLLM keeps the block boundary's state beside a sub-block
checkpoint (RFC #52959; vllm-project/vllm#54076 names the gap).
"""

from __future__ import annotations

import logging
from typing import Any

from vllm_hybrid_npu import envs
from vllm_hybrid_npu.core import prefill_checkpoints as core
from vllm_hybrid_npu.patches import gdn_prefill_checkpoint as gdn
from vllm_hybrid_npu.patches.gdn_junction import checkpoint_managers
from vllm_hybrid_npu.support import Stack

logger = logging.getLogger("vllm_hybrid_npu")

#: The option (``VLLM_HYBRID_NPU_OPTIONS`` key): ``off`` (vLLM's re-key, default) or ``on``.
KEY = "second"
VERSIONS = ("0.30.0",)
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
    """The option ``second`` (default ``off``).

    Raises:
        ValueError: from :func:`vllm_hybrid_npu.envs.options` (a value other than ``off`` or
            ``on``, or the variable malformed elsewhere; the message names it).
    """
    return envs.option(KEY)


def eligible(kv_cache_manager: Any) -> tuple:
    """The align-mode Mamba managers (vLLM 0.30's ``MambaManager`` or a subclass) of
    ``kv_cache_manager`` (vLLM's ``KVCacheManager``) whose prompts can take a second block: a
    prefill checkpoint declared, a prefix-match unit (the block pool's hash block) below the
    block, no speculative blocks, no EAGLE block drop, no fine-grained prefix cache."""
    return tuple(
        m for m in checkpoint_managers(kv_cache_manager)
        if m.block_pool.hash_block_size < m.block_size
        and not m.num_speculative_blocks and not getattr(m, "use_eagle", False)
        and not getattr(m, "drop_eagle_checkpoint_block", False)
        and not getattr(m, "fine_grained_prefix_cache", False))


def managers_of(kv_cache_manager: Any) -> tuple:
    """The managers of ``kv_cache_manager`` that take second blocks (:data:`MANAGERS`), decided
    once per KV-cache manager: by the engine at its start (:func:`decide`) or by the lab
    (``vllm_hybrid_npu_lab.exporter.apply_second_checkpoint``, which also binds the hooks that
    give the blocks back); where neither did (a KV-cache manager the hooks were bound on for
    another rule), none: the environment is read by :func:`decide` only."""
    found = vars(kv_cache_manager).get(MANAGERS)
    if found is None:
        found = vars(kv_cache_manager)[MANAGERS] = ()
    return found


def set_managers(kv_cache_manager: Any, found: tuple) -> None:
    """Record ``found`` (a tuple of Mamba managers, possibly empty) as ``kv_cache_manager``'s
    second-block managers (:data:`MANAGERS`), logged where any."""
    vars(kv_cache_manager)[MANAGERS] = found
    if found:
        logger.info("vllm-hybrid-npu: %s: a prompt whose GDN checkpoint lies inside its last "
                    "block also keeps the state at that block's start (a second block per "
                    "prompt, %d KV-cache groups)", envs.option_text(KEY, "on"), len(found))


def decide(scheduler: Any, stack: Stack) -> tuple:
    """The second block's managers of vLLM 0.30's ``scheduler`` (``Scheduler``), decided at its
    start from its configuration: with the option ``second=on``, :func:`eligible` where the exporter
    path on ``stack.target`` writes several checkpoints per row
    (``gdn_prefill_checkpoint.junctions_off`` is None: vLLM's CPU GDN function; CUDA's one pass
    on vLLM 0.30's V2 runner; vllm-ascend's V1 runner); elsewhere (CUDA's V1 runner, FlashInfer,
    ``FLA_USE_FAST_OPS=1``, context parallel, ``VLLM_HYBRID_NPU_OPTIONS=junctions=off``,
    vllm-ascend's V2 runner, a KV transfer connector or speculative decoding there) none,
    logged once."""
    kv = scheduler.kv_cache_manager
    if mode() != "on" or stack.vllm not in VERSIONS:
        set_managers(kv, ())
        return ()
    config = scheduler.vllm_config
    path, why = gdn.exporter_path(config, stack.target)
    why = gdn.junctions_off(config, path) if path else why
    if why is not None:
        gdn._log_once("second-off", "second block: %s, but none here: %s", envs.option_text(KEY, "on"), why)
        set_managers(kv, ())
        return ()
    found = eligible(kv)
    if not found and scheduler.use_eagle_block_drop:
        gdn._log_once("second-eagle", "second block: %s, but none here: EAGLE/MTP's block drop "
                      "(the checkpoint one unit lower is the one the drafter's hit needs)",
                      envs.option_text(KEY, "on"))
    set_managers(kv, found)
    return found


def wants(manager: Any, request_id: str) -> tuple[int, int, int] | None:
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


def take(manager: Any, request_id: str) -> None:
    """After upstream's ``allocate_new_blocks``: where :func:`wants` answers and the pool has a
    free block, take ``E`` for ``request_id`` (:data:`EXTRA`, state ``new``)."""
    if (want := wants(manager, request_id)) and manager.block_pool.get_num_free_blocks() > 0:
        block = manager.block_pool.get_new_blocks(1)[0]
        vars(manager).setdefault(EXTRA, {})[request_id] = [block, want[0], want[1], "new"]


def cache(manager: Any, request: Any, num_tokens: int) -> tuple[bool, Any]:
    """The second block's part of ``_cache_partial_tail_block(request, num_tokens, ...)``:
    ``(True, key)`` where it decided (``E`` keyed at ``cp``, the key vLLM's
    ``BlockPool.cache_partial_block`` returned; or a repeat call for the same checkpoint, None),
    ``(False, None)`` where vLLM's caching runs (no ``E``, ``E`` unused, or the column not keyed
    at ``q``: ``E`` marked unused, the worker writes as vLLM plans)."""
    extra = vars(manager).get(EXTRA, {}).get(request.request_id)
    if extra is None or extra[3] == "unused":
        return False, None
    if extra[3] != "new":
        # cached already: vLLM's AsyncScheduler caches again once the step's output is in
        # (_update_request_with_output), where vLLM's own re-key is a no-op but would move
        # the column's key from q to cp here
        return manager._checkpoints.get(request.request_id) == (extra[1], extra[2]), None
    block, cp, col, _ = extra
    slot = manager.req_to_blocks[request.request_id][col]
    if (num_tokens != request.num_prompt_tokens or slot.is_null
            or slot.block_hash_num_tokens != (col + 1) * manager.block_size):
        extra[3] = "unused"
        return False, None
    extra[3] = "keyed"
    key = manager.block_pool.cache_partial_block(
        request=request, block=block, num_tokens=cp, kv_cache_group_id=manager.kv_cache_group_id,
        block_size=manager.block_size)
    if key is not None:  # offered to a KV connector as vLLM offers a partial tail
        manager._pending_boundary_state_offloads.append(
            (request.request_id, manager.kv_cache_group_id, block, cp))
    return True, key


def retire(manager: Any, request_id: str) -> None:
    """After upstream's ``remove_skipped_blocks``: ``E`` back to the pool (cached, evictable)
    where its column went back."""
    extra = vars(manager).get(EXTRA, {}).get(request_id)
    if extra is not None:
        blocks = manager.req_to_blocks.get(request_id, [])
        if extra[2] >= len(blocks) or blocks[extra[2]].is_null:
            del vars(manager)[EXTRA][request_id]
            manager.block_pool.free_blocks([extra[0]])


def free(manager: Any, request_id: str, blocks: Any) -> Any:
    """Upstream's ``pop_blocks_for_free`` result ``blocks`` with ``E`` inserted after its
    column's block (vLLM frees the list in reverse), ``E`` dropped from :data:`EXTRA`."""
    extra = vars(manager).get(EXTRA, {}).pop(request_id, None)
    if extra is None:
        return blocks
    blocks = list(blocks)
    blocks.insert(min(extra[2] + 1, len(blocks)), extra[0])
    return blocks
