"""Block-table widths per KV-cache group against hand-computed tables, on real vLLM objects.

Shapes follow the real models (per TP rank): Qwen3-Next-80B-A3B has 48 layers, 36 GDN
("linear_attention") + 12 full attention in a 3:1 pattern; Qwen3.5 the same pattern. Hybrid block
sizes are those vLLM picks for them (attention page >= GDN state page): 544 and 1056 tokens.
"""

from __future__ import annotations

import types

import pytest
import torch
from vllm.config import CacheConfig, ParallelConfig, VllmConfig
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
)

from vllm_hybrid_npu.core.block_tables import (
    cp_world_size_of,
    max_num_blocks_per_group,
    spec_max_num_blocks,
)
from vllm_hybrid_npu.patches import _common


def gdn_spec(block_size: int, spec_blocks: int = 0, mode: str = "align") -> MambaSpec:
    # Qwen3-Next GDN per TP rank (TP=4): conv state (3, 2048) bf16, SSM state (8, 128, 128) f32.
    return MambaSpec(
        block_size=block_size,
        shapes=((3, 2048), (8, 128, 128)),
        dtypes=(torch.bfloat16, torch.float32),
        mamba_cache_mode=mode,
        num_speculative_blocks=spec_blocks,
    )


def attn_spec(block_size: int) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=256, dtype=torch.bfloat16)


def hybrid_config(block_size: int, spec_blocks: int = 0, mode: str = "align") -> KVCacheConfig:
    """3 GDN groups + 1 attention group (12 layers each), as vLLM groups the 3:1 pattern."""
    groups = [
        KVCacheGroupSpec([f"model.layers.{4 * i + g}.linear_attn" for i in range(12)], gdn_spec(block_size, spec_blocks, mode))
        for g in range(3)
    ]
    groups.append(
        KVCacheGroupSpec([f"model.layers.{4 * i + 3}.self_attn.attn" for i in range(12)], attn_spec(block_size))
    )
    return KVCacheConfig(num_blocks=1000, kv_cache_tensors=[], kv_cache_groups=groups)


def cache(pc: bool) -> CacheConfig:
    return CacheConfig(enable_prefix_caching=pc, mamba_cache_mode="align" if pc else "none")


# Hand-computed tables ------------------------------------------------------------------------
# Qwen3-Next, block 544, max_len 32768: 544 * 60 = 32640 < 32768 <= 32640 + 544 -> 61 blocks.
# Spec decode with 2 speculative tokens -> MambaSpec.num_speculative_blocks = 2.
# cp = 2: 1088 * 30 = 32640 < 32768 -> 31 attention blocks; GDN state is not sharded -> 61.
# Qwen3.5, block 1056, max_len 262144: 1056 * 248 = 261888 < 262144 -> 249 blocks.
# cp = 4 (DCP 2 x PCP 2): 4224 * 62 = 261888 < 262144 -> 63 attention blocks.
CASES = [
    # (block, max_len, spec_blocks, prefix caching, cp, expected [gdn, gdn, gdn, attention])
    (544, 32768, 0, True, 1, [61, 61, 61, 61]),
    (544, 32768, 2, True, 1, [63, 63, 63, 61]),
    (544, 32768, 0, False, 1, [1, 1, 1, 61]),
    (544, 32768, 2, False, 1, [3, 3, 3, 61]),
    (544, 32768, 0, True, 2, [61, 61, 61, 31]),
    (544, 32768, 2, True, 2, [63, 63, 63, 31]),
    (1056, 262144, 0, True, 1, [249, 249, 249, 249]),
    (1056, 262144, 1, True, 4, [250, 250, 250, 63]),
    (1056, 262144, 1, False, 4, [2, 2, 2, 63]),
    # a prompt length exactly on a block boundary: 2 * 544 = 1088 -> 2 blocks, no extra.
    (544, 1088, 0, True, 1, [2, 2, 2, 2]),
    (544, 1089, 0, True, 1, [3, 3, 3, 3]),
]


@pytest.mark.parametrize("block,max_len,spec_blocks,pc,cp,expected", CASES)
def test_hand_computed_tables(block, max_len, spec_blocks, pc, cp, expected):
    kvc = hybrid_config(block, spec_blocks, "align" if pc else "none")
    assert max_num_blocks_per_group(kvc, cache(pc), max_len, cp) == expected


def test_floor_is_respected():
    spec = attn_spec(544)
    assert spec_max_num_blocks(spec, max_len=544, enable_prefix_caching=True, floor=5) == 5


def test_bad_values_name_the_value():
    with pytest.raises(ValueError, match="max_len"):
        spec_max_num_blocks(attn_spec(16), max_len=0, enable_prefix_caching=True)
    with pytest.raises(ValueError, match="context-parallel"):
        spec_max_num_blocks(attn_spec(16), max_len=16, enable_prefix_caching=True, cp_world_size=0)


def _vllm_config(pc: bool, dcp: int = 1, pcp: int = 1) -> VllmConfig:
    return VllmConfig(
        cache_config=cache(pc),
        parallel_config=ParallelConfig(
            tensor_parallel_size=4,
            decode_context_parallel_size=dcp,
            prefill_context_parallel_size=pcp,
        ),
    )


def test_cp_world_size_is_dcp_times_pcp():
    # vLLM 0.30.0 refuses PCP in a whole VllmConfig on the V1 runner; the ParallelConfig alone
    # is real and is all the function reads.
    pc = ParallelConfig(tensor_parallel_size=4, decode_context_parallel_size=2, prefill_context_parallel_size=2)
    assert cp_world_size_of(types.SimpleNamespace(parallel_config=pc)) == 4
    assert cp_world_size_of(_vllm_config(True, dcp=2)) == 2
    assert cp_world_size_of(_vllm_config(True)) == 1


@pytest.mark.parametrize("block,max_len,spec_blocks,pc,cp,expected", [c for c in CASES if c[4] in (1, 2)])
def test_patched_spec_methods_answer_our_table_only_inside_the_override(
    block, max_len, spec_blocks, pc, cp, expected
):
    """What the runner asks (``spec.max_num_blocks_per_req``) inside ``may_reinitialize_input_batch``."""
    _common.patch_spec_methods()
    vc = _vllm_config(pc, dcp=cp)
    kvc = hybrid_config(block, spec_blocks, "align" if pc else "none")
    with _common.block_table_override(vc):
        got = [g.kv_cache_spec.max_num_blocks_per_req(vc, max_len) for g in kvc.kv_cache_groups]
    assert got == expected
    # Outside the override upstream's own answers are untouched; for these configurations they
    # agree with ours (vLLM 0.30.0 already sizes align-mode Mamba tables per position).
    outside = [g.kv_cache_spec.max_num_blocks_per_req(vc, max_len) for g in kvc.kv_cache_groups]
    assert outside == expected
