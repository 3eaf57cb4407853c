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


#: The MTP head's own tensors besides its decoder layers, as named in the real Qwen3-Next /
#: Qwen3.5 checkpoints (``mtp.*``): ``fc`` maps ``[embedding, hidden]`` (2 x hidden) to hidden.
MTP_HEAD_TENSORS = ("mtp.fc.weight", "mtp.norm.weight", "mtp.pre_fc_norm_embedding.weight",
                    "mtp.pre_fc_norm_hidden.weight")


@pytest.mark.parametrize("arch", make_model.ARCHS)
def test_mtp_head_has_checkpoint_names_and_leaves_main_model_alone(tmp_path, arch, seed):
    """``--mtp-layers 1``: ``mtp.layers.0.*`` are exactly the tensor names and shapes of the main
    model's full-attention layer (``model.layers.3.*``, the layer type of the real MTP layer),
    plus the four head tensors; ``config.json`` names the layer count under the key vLLM reads
    (``num_nextn_predict_layers`` for Qwen3-Next, ``mtp_num_hidden_layers`` for Qwen3.5); every
    other tensor and config entry is what the build without a head writes."""
    from safetensors.torch import load_file

    plain = make_model.build_model(tmp_path / "plain", arch=arch, seed=seed)
    head = make_model.build_model(tmp_path / "mtp", arch=arch, seed=seed, mtp_layers=1)
    w0, w1 = load_file(plain / "model.safetensors"), load_file(head / "model.safetensors")
    cfg0 = json.loads((plain / "config.json").read_text())
    cfg1 = json.loads((head / "config.json").read_text())
    key = {"qwen3_next": "num_nextn_predict_layers", "qwen3_5": "mtp_num_hidden_layers"}[arch]

    assert cfg1.pop(key) == 1 and key not in cfg0
    assert cfg1 == cfg0
    assert not any(k.startswith("mtp.") for k in w0)
    assert {k: v for k, v in w1.items() if not k.startswith("mtp.")}.keys() == w0.keys()
    assert all(w1[k].equal(w0[k]) for k in w0)  # same draw for the main model

    full = cfg0["layer_types"].index("full_attention")
    layer = {k[len(f"model.layers.{full}."):]: v for k, v in w0.items()
             if k.startswith(f"model.layers.{full}.")}
    mtp = {k: v for k, v in w1.items() if k.startswith("mtp.")}
    assert mtp.keys() == {f"mtp.layers.0.{k}" for k in layer} | set(MTP_HEAD_TENSORS)
    assert "mtp.layers.0.self_attn.q_proj.weight" in mtp  # attention, not GDN
    for k, v in layer.items():
        assert mtp[f"mtp.layers.0.{k}"].shape == v.shape, k
    h = cfg0["hidden_size"]
    assert mtp["mtp.fc.weight"].shape == (h, 2 * h)
    for k in MTP_HEAD_TENSORS[1:]:
        assert mtp[k].shape == (h,), k
    assert all(v.dtype == w0["lm_head.weight"].dtype for v in mtp.values())
    # separate draws: a loader that swaps two head tensors, or leaves one at its init, shows
    norms = [mtp[k] for k in MTP_HEAD_TENSORS[1:]]
    assert all(n.abs().sum() > 0 for n in norms)
    assert not any(a.equal(b) for i, a in enumerate(norms) for b in norms[i + 1:])
    assert not mtp["mtp.layers.0.self_attn.o_proj.weight"].equal(w0[f"model.layers.{full}.self_attn.o_proj.weight"])
    meta = json.loads((head / "vllm_hybrid_npu.json").read_text())
    assert meta["mtp_layers"] == 1 and "mtp_layers" not in json.loads((plain / "vllm_hybrid_npu.json").read_text())


def test_two_mtp_layers_same_seed_same_head(tmp_path, seed):
    """``--mtp-layers 2`` writes ``mtp.layers.0`` and ``mtp.layers.1`` (distinct draws); the same
    seed gives the same head."""
    from safetensors.torch import load_file

    a = load_file(make_model.build_model(tmp_path / "a", seed=seed, mtp_layers=2) / "model.safetensors")
    b = load_file(make_model.build_model(tmp_path / "b", seed=seed, mtp_layers=2) / "model.safetensors")
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    assert json.loads((tmp_path / "a" / "config.json").read_text())["num_nextn_predict_layers"] == 2
    q = "self_attn.q_proj.weight"
    assert f"mtp.layers.1.{q}" in a and f"mtp.layers.2.{q}" not in a
    assert not a[f"mtp.layers.0.{q}"].equal(a[f"mtp.layers.1.{q}"])


@pytest.mark.parametrize("bad", [-1, make_model.MAX_MTP_LAYERS + 1, 1.5, True, "1"])
def test_bad_mtp_layers_is_rejected(tmp_path, bad):
    with pytest.raises(ValueError, match="--mtp-layers"):
        make_model.build_model(tmp_path / "x", mtp_layers=bad)
    assert not (tmp_path / "x").exists()


def test_mtp_layers_flag_default_keeps_cache_names(tmp_path, monkeypatch):
    """The flag defaults to 0 and the cached default builds keep their names; a head gets its
    own cache entry (``-mtp<N>``), built by ``make-model --mtp-layers N``."""
    import argparse

    parser = argparse.ArgumentParser()
    make_model.add_arguments(parser)
    assert parser.parse_args([]).mtp_layers == 0
    assert make_model._default_name("qwen3_next", 0) == "tiny-qwen3_next-s0"
    assert make_model._default_name("qwen3_next", 0, "long") == "tiny-qwen3_next-s0-long"
    monkeypatch.setenv("VLLM_HYBRID_NPU_CACHE", str(tmp_path))
    assert make_model.run(parser.parse_args(["--mtp-layers", "1"])) == 0
    out = tmp_path / "models" / "tiny-qwen3_next-s0-mtp1"
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 1
    assert make_model.default_model_dir(mtp_layers=1) == out


def test_qwen3_next_routes_every_token_to_all_experts_unless_told(tmp_path, seed):
    """Default: num_experts_per_tok == num_experts (continuous routing, no bf16 near-tie can
    switch an expert); --experts-per-token 1: the same weights with top-1 routing."""
    import json

    from safetensors.torch import load_file

    dense = make_model.build_model(tmp_path / "dense", seed=seed)
    top1 = make_model.build_model(tmp_path / "top1", seed=seed, experts_per_token=1)
    cfg_dense = json.loads((dense / "config.json").read_text())
    cfg_top1 = json.loads((top1 / "config.json").read_text())
    assert cfg_dense["num_experts_per_tok"] == cfg_dense["num_experts"] == make_model.NUM_EXPERTS
    assert cfg_top1["num_experts_per_tok"] == 1
    a, b = load_file(dense / "model.safetensors"), load_file(top1 / "model.safetensors")
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)


@pytest.mark.parametrize("arch, k, n", [("qwen3_next", 0, None),
                                        ("qwen3_next", make_model.NUM_EXPERTS + 1, None),
                                        ("qwen3_next", 5, 4), ("qwen3_next", True, None),
                                        ("qwen3_next", None, 0), ("qwen3_5", 2, None),
                                        ("qwen3_5", None, 4)])
def test_bad_experts_are_rejected(tmp_path, arch, k, n):
    with pytest.raises(ValueError, match="--experts-per-token|--num-experts"):
        make_model.build_model(tmp_path / "x", arch=arch, experts_per_token=k, num_experts=n)


def test_format_1_routing_on_request(tmp_path):
    import json

    out = make_model.build_model(tmp_path / "f1", num_experts=4, experts_per_token=2)
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["num_experts"], cfg["num_experts_per_tok"]) == (4, 2)
