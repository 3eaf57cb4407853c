"""vLLM 0.32's resend boundary for a prompt's partial attention tail, carried to vLLM 0.30.

With a hash unit finer than the block (``--prefix-match-unit``), vLLM 0.30 registers a prompt's
partial attention tail block at ``num_prompt_tokens // unit * unit``
(``FullAttentionManager._cache_partial_tail_block``) while the Mamba prefill checkpoint sits at
``(num_prompt_tokens - 1) // unit * unit`` (``get_mamba_prefill_checkpoint_position``). For a
prompt whose length is a multiple of the unit (and not of the block) the two differ: the
attention entry lies at the prompt's end, which a resend (matching at most ``num_prompt_tokens -
1`` tokens) never reaches, and the checkpoint has no attention entry, so the resend hit 0 tokens
(docs/patches.md, ``resend-tail``). vLLM 0.32 registers the tail at ``(num_prompt_tokens - 1) //
unit * unit``.

Under EAGLE/MTP's block drop (an eagle attention group, ``use_eagle``) the attention lookup
matches one unit past the hit and drops it, and the Mamba checkpoint sits one unit lower
(``n - 2 * unit``): the tail at ``n - unit`` is what lands the resend on it (vLLM 0.30's tail at
``n``, or none for a prompt ending on a block boundary, left the resend 0 tokens).

The Mamba manager holds the checkpoint only while the prompt's last chunk is scheduled; each
decode step after it asks for none. A tail registered at ``n - unit`` is kept through those steps:
0.30's rule would register ``n`` in the same block, and ``BlockPool.cache_partial_block`` drops a
block's shorter entry, so after a single decode step the resend would hit 0.

The rule changes only requests whose Mamba manager holds a prefill checkpoint at that boundary
(engines declaring ``MambaSpec.num_prefill_checkpoint_blocks``: ours, or vLLM 0.30's own for
Kimi's KDA). Elsewhere 0.30 stores the Mamba state at the prompt's end (vLLM's split; a prompt of
at most one block; a last chunk starting in the checkpoint's block), and the end entry is what a
longer prompt hits, so 0.30's rule stays. vLLM's host tier (``simple_kv_offload``'s
``_find_fa_partial_tail_source``, 0.30 and 0.32) still looks for the tail at the prompt's end: such
a tail is not offloaded, and a hit from the host tier stops at the full block before it.
"""

from __future__ import annotations

import functools
from typing import Any

from vllm_hybrid_npu.patches.gdn_prefill_checkpoint import entry
from vllm_hybrid_npu.support import Stack

#: Attribute set on the KV-cache managers of each group (``single_type_managers``) once the
#: coordinator is built: the engine's Mamba managers that declare checkpoints (their
#: ``_checkpoints``: request id -> (position, block index)); empty where none declares.
FLAG = "_vhn_mamba_managers"


def _make_kv_cache_manager(upstream: Any, stack: Stack) -> Any:
    """Registry ``make`` of vLLM 0.30's ``KVCacheManager.__init__``: after it, every manager of
    the coordinator it built carries :data:`FLAG`. Marked here, not in the coordinator's
    ``__init__``: vllm-ascend 0.30.0rc2's ``get_kv_cache_coordinator`` builds
    ``AscendHybridKVCacheCoordinator``, whose ``__init__`` does not run
    ``HybridKVCacheCoordinator.__init__``; both are built by this one."""
    @functools.wraps(upstream)
    def __init__(self, *args, **kwargs):
        upstream(self, *args, **kwargs)
        mark(self.coordinator.single_type_managers)

    return __init__


def mark(managers: tuple) -> None:
    """Set :data:`FLAG` on each of a coordinator's ``managers``: those whose spec declares
    prefill checkpoints (``MambaSpec.num_prefill_checkpoint_blocks``)."""
    mambas = tuple(m for m in managers
                   if getattr(m.kv_cache_spec, "num_prefill_checkpoint_blocks", 0) > 0)
    for manager in managers:
        setattr(manager, FLAG, mambas)


def kept(block: Any, end: int) -> bool:
    """Whether ``block`` (a request's own attention block) holds the tail entry at ``end``
    tokens, the one the wrapper registers (vLLM 0.30 registers none there: only at the
    prompt's end, or whole blocks)."""
    return block.block_hash_num_tokens == end


def _make_tail(upstream: Any, stack: Stack) -> Any:
    @functools.wraps(upstream)
    def _cache_partial_tail_block(self, request, num_tokens):
        unit, n = self.block_pool.hash_block_size, request.num_prompt_tokens
        end, mambas = n - unit, getattr(self, FLAG, ())
        # elsewhere 0.30's and 0.32's boundaries agree, or the Mamba state is at the prompt's end
        # (an engine declaring no checkpoints: no Mamba manager marked)
        if n % unit or not mambas:
            return upstream(self, request, num_tokens)
        checkpoints = [getattr(m, "_checkpoints", {}).get(request.request_id) for m in mambas]
        # under EAGLE's drop the lookup matches one unit past the hit, so the tail at n - unit
        # serves the checkpoint one unit lower
        drop = unit if self.use_eagle else 0
        blocks = self.req_to_blocks[request.request_id]
        inside = 0 < end and end % self.block_size and end // self.block_size < len(blocks)
        if not any(c and c[0] == end - drop for c in checkpoints):
            # the Mamba manager drops the checkpoint after the prompt's last chunk (every decode
            # step asks for none); a tail this wrapper registered at `end` then stays: 0.30's at
            # `n` would re-key the same block away from `end` (BlockPool.cache_partial_block
            # drops a block's shorter entry), leaving the checkpoint without attention
            if inside and kept(blocks[end // self.block_size], end):
                return None
            return upstream(self, request, num_tokens)
        if inside and end <= num_tokens:
            self.block_pool.cache_partial_block(
                request=request, block=blocks[end // self.block_size], num_tokens=end,
                kv_cache_group_id=self.kv_cache_group_id, block_size=self.block_size)

    return _cache_partial_tail_block


_UNTIL = "vLLM 0.30 leaves the support matrix (vLLM 0.32 has the rule)"
PATCHES = [
    entry("resend-tail-declared", "vllm.v1.core.kv_cache_manager", "KVCacheManager.__init__",
          _make_kv_cache_manager, ("cpu", "cuda", "npu"),
          "marks the attention managers of an engine that declares prefill checkpoints, after "
          "its coordinator is built (vllm-ascend 0.30.0rc2's AscendHybridKVCacheCoordinator "
          "does not run HybridKVCacheCoordinator.__init__)", vllm=("0.30.0",), until=_UNTIL),
    entry("resend-tail", "vllm.v1.core.single_type_kv_cache_manager",
          "FullAttentionManager._cache_partial_tail_block", _make_tail, ("cpu", "cuda", "npu"),
          "vLLM 0.32's resend boundary: a prompt ending on the hash grid inside a block gets its "
          "attention tail at the Mamba checkpoint (0.30: at its end; its resend hit 0)",
          vllm=("0.30.0",), signature=("self", "request", "num_tokens"), until=_UNTIL),
]
