"""The deployment the lab models (``build_setup(platform=...)``) does not depend on the machine it
runs on, and its ``"cpu"`` platform is vLLM's CPU platform.

Defect (found 2026-11-27, issue 31): ``VllmConfig`` runs the *host's* platform hook, and on a CPU
host with AVX-512-BF16 vLLM 0.30's CPU hook resets an ``auto`` SSM cache dtype to float32 (its
accelerated GDN kernels), so on this project's AMD EPYC the lab's ``"cuda"`` setups of bf16-state
models came out with float32 states: Qwen3-Next-80B-A3B at block 1,056 instead of 544 (the
hand computation of docs/hitrate-guide.md). The host's CPU kind is emulated here by patching
``torch.cpu._is_avx512_bf16_supported`` (what vLLM's hook asks), so each case runs on every host.

Expected numbers are computed by hand from the model dimensions (formulas in the tests), not read
off the lab or vLLM. The lab against a real CPU engine, at tp 1 and 2: e2e/test_tensor_parallel.py.
"""

from __future__ import annotations

import pytest

from vllm_hybrid_npu_lab.model import build_setup
from vllm_hybrid_npu_lab.presets import resolve_model

#: the KV-relevant fields of the e2e tiny Qwen3-Next (``vllm_hybrid_npu.tools.make_model``): 3 GDN
#: layers + 1 full-attention layer, 1 KV head of 128, GDN 2 key / 2 value heads of 128, conv 4
TINY_E2E = {
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    "num_hidden_layers": 4,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 128,
    "hidden_size": 256,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 2,
    "dtype": "bfloat16",
}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _gdn_state_bytes(k_heads, v_heads, k_dim, v_dim, conv, tp, ssm_bytes) -> int:
    """One GDN layer's state on one rank: conv state ((2 k + v) channels x (conv - 1) x bf16) +
    SSM state (v heads x k_dim x v_dim x ``ssm_bytes``), heads split over ``tp``."""
    channels = (2 * k_heads * k_dim + v_heads * v_dim) // tp
    return channels * (conv - 1) * 2 + (v_heads // tp) * k_dim * v_dim * ssm_bytes


def _hybrid_block(state: int, attn_per_token: int, kernel: int) -> int:
    """vLLM's rule: the smallest multiple of the kernel block whose attention page holds a state."""
    return kernel * _cdiv(state, kernel * attn_per_token)


@pytest.fixture(params=[True, False], ids=["host-avx512bf16", "host-no-avx512bf16"])
def host_kind(request, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: request.param)
    return request.param


@pytest.mark.parametrize("tp", [1, 2])
def test_cuda_setup_of_bf16_states_ignores_the_hosts_cpu_rules(host_kind, tp):
    """Qwen3-Next-80B-A3B (bf16 SSM states) on CUDA: 544 tokens at tp 1 and 2 whatever the host
    (2 KV heads of 256: 2,048 B per token at tp 1, one head per rank at tp 2)."""
    _, cfg = resolve_model("qwen3-next-80b-a3b")
    state = _gdn_state_bytes(16, 32, 128, 128, 4, tp, ssm_bytes=2)
    attn = 2 * (2 // tp) * 256 * 2
    want = _hybrid_block(state, attn, 16)
    assert want == 544  # docs/hitrate-guide.md's table
    setup = build_setup(cfg, tp=tp, kv_cache_bytes=16 << 30, max_model_len=4096)
    assert setup.block_size == want
    assert setup.vllm_config.cache_config.mamba_ssm_cache_dtype == "auto"
    # Qwen3.5's float32 states, asked by its config, stay float32
    _, cfg35 = resolve_model("qwen3.5-35b-a3b")
    s35 = build_setup(cfg35, tp=tp, kv_cache_bytes=16 << 30, max_model_len=4096)
    assert s35.block_size == _hybrid_block(_gdn_state_bytes(16, 32, 128, 128, 4, tp, 4), attn, 16) == 1056


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("checkpoints", [False, True], ids=["split", "exporter"])
def test_cpu_platform_is_vllms_cpu_platform(host_kind, tp, checkpoints):
    """The e2e tiny model on vLLM's CPU platform: 128-token kernel blocks, float32 SSM states
    where the CPU has AVX-512-BF16 (vLLM's accelerated GDN), bf16 elsewhere: blocks 384 / 256 at
    tp 1 / 2 with AVX-512-BF16, 256 / 128 without (all on the exporter's 64-token grid already).
    The KV heads (1) are replicated at tp 2: 512 B per token on every rank."""
    import vllm.platforms

    if not vllm.platforms.current_platform.is_cpu():
        pytest.skip("platform 'cpu' runs vLLM's CPU platform hook: needs vLLM's CPU build")
    ssm_bytes = 4 if host_kind else 2
    state = _gdn_state_bytes(2, 2, 128, 128, 4, tp, ssm_bytes)
    attn = 2 * max(1, 1 // tp) * 128 * 2
    want = _hybrid_block(state, attn, 128)
    assert want == {(True, 1): 384, (True, 2): 256, (False, 1): 256, (False, 2): 128}[(host_kind, tp)]
    kv = 256 << 20
    setup = build_setup(TINY_E2E, tp=tp, kv_cache_bytes=kv, max_model_len=4096, max_num_seqs=4,
                        prefill_checkpoints=checkpoints, platform="cpu")
    assert setup.block_size == want
    page = want * attn  # every layer's page: the attention page, the GDN state padded to it
    assert setup.state_bytes == 3 * page
    assert setup.num_blocks == kv // page  # one shared pool, one page per block
    # the CUDA platform from the same config: FlashAttention's 16-token kernel blocks, bf16
    cuda = build_setup(TINY_E2E, tp=tp, kv_cache_bytes=kv, max_model_len=4096, max_num_seqs=4)
    assert cuda.block_size == _hybrid_block(_gdn_state_bytes(2, 2, 128, 128, 4, tp, 2), attn, 16)


def test_unknown_platform_is_refused():
    with pytest.raises(ValueError, match="platform 'npu'"):
        build_setup(TINY_E2E, kv_cache_bytes=1 << 30, max_model_len=4096, platform="npu")
