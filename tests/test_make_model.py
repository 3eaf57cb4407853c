"""The tiny checkpoints: real configs and tokenizers that load with transformers."""

from __future__ import annotations

import json

import pytest

from vllm_hybrid_npu.tools import make_model


@pytest.mark.parametrize("arch", make_model.ARCHS)
def test_build_model_writes_loadable_hybrid_checkpoint(tmp_path, arch):
    from transformers import AutoConfig, AutoTokenizer

    out = make_model.build_model(tmp_path / "m", arch=arch, seed=1)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["layer_types"].count("linear_attention") >= 1
    assert cfg["layer_types"].count("full_attention") >= 1
    # What vLLM's CPU GDN kernels need.
    assert cfg["linear_key_head_dim"] == cfg["linear_value_head_dim"] == 128
    assert cfg["linear_num_key_heads"] == cfg["linear_num_value_heads"]
    assert AutoConfig.from_pretrained(out).architectures == cfg["architectures"]
    tok = AutoTokenizer.from_pretrained(out)
    text = "How do I take my bicycle on the night train?"
    ids = tok(text)["input_ids"]
    assert 1 < len(ids) < len(text) and max(ids) < cfg["vocab_size"]
    assert tok.decode(ids) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert chat.endswith("<|im_start|>assistant\n")


def test_same_seed_same_weights_other_seed_other_weights(tmp_path):
    from safetensors.torch import load_file

    a = load_file(make_model.build_model(tmp_path / "a", seed=3) / "model.safetensors")
    b = load_file(make_model.build_model(tmp_path / "b", seed=3) / "model.safetensors")
    c = load_file(make_model.build_model(tmp_path / "c", seed=4) / "model.safetensors")
    assert a.keys() == b.keys() == c.keys()
    assert all(a[k].equal(b[k]) for k in a)
    assert any(not a[k].equal(c[k]) for k in a)


def test_unknown_arch_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="--arch 'llama'"):
        make_model.build_model(tmp_path / "x", arch="llama")


def test_long_gdn_memory_draws_slow_decays_only(tmp_path):
    """``--gdn-memory long``: every GDN layer's decay rate A = exp(A_log) lies in [0.001, 0.01]
    (per-token decay exp(-A * softplus(.)) close to 1); the default keeps transformers' draw
    from [0.01, 16]; other weights are the same draw."""
    from safetensors.torch import load_file

    short = load_file(make_model.build_model(tmp_path / "s", seed=2) / "model.safetensors")
    long = load_file(make_model.build_model(tmp_path / "l", seed=2, gdn_memory="long") / "model.safetensors")
    a_logs = [k for k in long if k.endswith("linear_attn.A_log")]
    assert len(a_logs) == 3  # 3 GDN layers
    for k in a_logs:
        a_long, a_short = long[k].float().exp(), short[k].float().exp()
        assert ((a_long >= 0.001 * 0.99) & (a_long <= 0.01 * 1.01)).all(), a_long
        assert ((a_short >= 0.01 * 0.99) & (a_short <= 16 * 1.01)).all(), a_short
    assert all(long[k].equal(short[k]) for k in long if k not in a_logs)


def test_unknown_gdn_memory_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="--gdn-memory 'forever'"):
        make_model.build_model(tmp_path / "x", gdn_memory="forever")
