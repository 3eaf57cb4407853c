"""Counterfactual (diagnostic only, not the lab's or the runtime's behaviour): the exporter's
checkpoint of a NON-FINAL prefill chunk is not kept in the prefix cache at any retention interval.

vLLM 0.30 reserves and caches a prefill checkpoint in every chunk of a prompt that has the
exporter (`MambaManager.get_num_blocks_to_allocate` / the GDN metadata take the chunk's end,
`seq_len`, as the prefill end: `get_mamba_prefill_checkpoint_position(seq_len)`), so each chunk
also leaves a state one hash block below its end; `_cache_partial_tail_block` keeps it at every
retention interval except 0 (vLLM 0.32's rule, carried by the plugin's gdn-checkpoint-retention
entry). Here `MambaManager._cache_partial_tail_block` is wrapped (this process only, before the
lab binds the runtime's entry on top of it) so that a checkpoint that is neither the prompt's
(`get_mamba_prefill_checkpoint_position(num_prompt_tokens)`) nor the shared-prefix junction is
handled as retention 0 handles it (dropped: `_maybe_evict_cached_block`), unless
`--keep-on-retention` and it falls on a multiple of the retention interval. Then runs the lab's
`hitrate` CLI with the remaining arguments.

usage: PYTHONPATH=/work/wt-h15 python cf_drop_chunk_checkpoints.py [--keep-on-retention] HITRATE_ARGS...
"""
import sys

from vllm.v1.core.single_type_kv_cache_manager import MambaManager
from vllm.v1.kv_cache_interface import get_mamba_prefill_checkpoint_position

keep_on_ret = "--keep-on-retention" in sys.argv
argv = [a for a in sys.argv[1:] if a != "--keep-on-retention"]
orig = MambaManager._cache_partial_tail_block
counts = {"dropped": 0, "kept": 0}


def _cache_partial_tail_block(self, request, num_tokens, retention_interval):
    cp = self._checkpoints.get(request.request_id)
    if cp is not None and retention_interval:  # > 0 (None: dense, 0: vLLM's own rule)
        pos = cp[0]
        prompt_cp = get_mamba_prefill_checkpoint_position(
            request.num_prompt_tokens, self.block_pool.hash_block_size,
            self.drop_eagle_checkpoint_block)
        if (pos != prompt_cp and pos != request.shared_prefix_boundary
                and num_tokens < request.num_prompt_tokens
                and not (keep_on_ret and pos % retention_interval == 0)):
            counts["dropped"] += 1
            return orig(self, request, num_tokens, 0)
        counts["kept"] += 1
    return orig(self, request, num_tokens, retention_interval)


MambaManager._cache_partial_tail_block = _cache_partial_tail_block

from vllm_hybrid_npu_lab.__main__ import main  # noqa: E402

rc = main(["hitrate"] + argv)
print(f"cf_drop_chunk_checkpoints: keep_on_retention={keep_on_ret} {counts}", file=sys.stderr)
sys.exit(rc)
