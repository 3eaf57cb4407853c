"""``vllm-hybrid-npu make-model``: a tiny random-weight hybrid checkpoint that vLLM serves.

Writes a Hugging Face model directory (``config.json``, ``model.safetensors``, ``tokenizer.json``,
``tokenizer_config.json`` with a ChatML chat template, ``generation_config.json``) for one of:

* ``qwen3_next``: ``Qwen3NextForCausalLM`` (GDN "linear_attention" layers + gated full attention,
  sparse MoE MLP), the architecture of Qwen3-Next-80B-A3B.
* ``qwen3_5``: ``Qwen3_5ForCausalLM`` (text-only Qwen3.5: the same GDN/attention layer pattern
  with a dense MLP).

Both use 4 decoder layers (3 GDN + 1 full attention, the 3:1 pattern of the real models). The
weights are drawn by ``transformers``' own initialisation from a fixed seed; the tokenizer is a
byte-level BPE trained locally, with the ``tokenizers`` library, on text embedded in this module,
so nothing is downloaded. Dimensions respect what vLLM's CPU GDN kernels need: GDN key/value head
dimensions of 128 and equal key/value GDN head counts.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path

ARCHS = ("qwen3_next", "qwen3_5")

#: ``--gdn-memory``: how fast the GDN layers forget. ``short``: transformers' initialisation (decay
#: rate ``A`` drawn from U(0.01, 16) per value head, so a state keeps little beyond the last few
#: tokens); ``long``: ``A`` from U(0.001, 0.01) (per-token decay ``exp(-A * softplus(.))`` close to 1),
#: so the state handed over at a block boundary still shapes the outputs hundreds of tokens later
#: (what makes output comparisons see a wrong state; measured in docs/testing.md).
GDN_MEMORY = {"short": None, "long": (0.001, 0.01)}

#: Bumped whenever the generated checkpoint changes, so cached default builds are rebuilt.
FORMAT_VERSION = 1

VOCAB_SIZE = 2048  # tokens; the model's vocabulary (>= the tokenizer's)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Text the tokenizer is trained on: plain English about the subject at hand, so that ordinary
# prompts tokenize into a realistic mix of multi-byte tokens.
_CORPUS = """
A language model reads a prompt as a sequence of tokens and predicts the next token. Serving
engines keep the keys and values of attention layers in a paged cache made of fixed-size blocks,
so that requests which share a prefix, such as a long system prompt, can reuse the blocks computed
for an earlier request instead of computing them again. This is called automatic prefix caching.
Hybrid models mix full attention layers with recurrent layers such as Gated DeltaNet or Mamba.
A recurrent layer does not keep one entry per token: it keeps a single state that summarises the
whole prefix, a convolution state and a state space model state. To reuse a prefix, the engine
must have stored the recurrent state exactly at the position where the shared prefix ends.
In align mode the state is stored only at block boundaries, one state per block, and the blocks of
hybrid models are large, often between five hundred and two thousand tokens.
The assistant answers questions about weather, travel, cooking, programming, history, music,
mathematics and science. It writes short, helpful and polite answers. Users ask how to bake bread,
how to sort a list in Python, why the sky is blue, what the capital of a country is, and how to
plan a trip by train across the mountains in winter. The quick brown fox jumps over the lazy dog.
Numbers such as 0 1 2 3 4 5 6 7 8 9 10 100 1000 2048 and dates such as 2026-11-22 also appear.
"""


def _train_tokenizer(out_dir: Path) -> int:
    """Train a byte-level BPE tokenizer on :data:`_CORPUS`; write it to ``out_dir``.

    Returns:
        The tokenizer's vocabulary size (tokens), special tokens included.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1024,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": None,
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "unk_token": None,
                "model_max_length": 32768,
                "clean_up_tokenization_spaces": False,
                "chat_template": CHAT_TEMPLATE,
            },
            indent=2,
        )
    )
    return tok.get_vocab_size()


def _hf_model(arch: str, eos_id: int, pad_id: int):
    """Build the randomly initialised ``transformers`` model for ``arch``."""
    common = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=256,
        num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=128,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        bos_token_id=None,
        # Wider than transformers' default 0.02 so greedy logits have clear maxima.
        initializer_range=0.1,
    )
    if arch == "qwen3_next":
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

        config = Qwen3NextConfig(
            intermediate_size=512,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=128,
            shared_expert_intermediate_size=128,
            decoder_sparse_step=1,
            **common,
        )
        config.architectures = ["Qwen3NextForCausalLM"]
        return Qwen3NextForCausalLM(config)
    if arch == "qwen3_5":
        from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig

        config = Qwen3_5TextConfig(intermediate_size=512, **common)
        config.architectures = ["Qwen3_5ForCausalLM"]
        return Qwen3_5ForCausalLM(config)
    raise ValueError(f"--arch {arch!r} is not one of {', '.join(ARCHS)}")


def _set_gdn_memory(model, memory: str) -> None:
    """Redraw every GDN layer's ``A_log`` for ``memory`` (:data:`GDN_MEMORY`)."""
    import torch

    bounds = GDN_MEMORY[memory]
    if bounds is None:
        return
    for name, param in model.named_parameters():
        if name.endswith("linear_attn.A_log"):
            with torch.no_grad():
                param.copy_(torch.empty_like(param).uniform_(*bounds).log_())


def build_model(out_dir: str | os.PathLike, arch: str = "qwen3_next", seed: int = 0,
                gdn_memory: str = "short") -> Path:
    """Write a tiny random hybrid checkpoint and its tokenizer to ``out_dir``.

    Args:
        out_dir: target directory; created, and replaced atomically if it exists.
        arch: ``"qwen3_next"`` or ``"qwen3_5"``.
        seed: seed of the weight initialisation (same seed, same weights).
        gdn_memory: ``"short"`` (transformers' GDN decay) or ``"long"`` (:data:`GDN_MEMORY`).

    Returns:
        ``out_dir`` as a :class:`~pathlib.Path`.

    Raises:
        ValueError: ``arch`` is not one of :data:`ARCHS`, or ``gdn_memory`` not one of
            :data:`GDN_MEMORY`.
    """
    if arch not in ARCHS:
        raise ValueError(f"--arch {arch!r} is not one of {', '.join(ARCHS)}")
    if gdn_memory not in GDN_MEMORY:
        raise ValueError(f"--gdn-memory {gdn_memory!r} is not one of {', '.join(GDN_MEMORY)}")
    import torch

    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        _train_tokenizer(tmp)
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(tmp / "tokenizer.json"))
        eos_id, pad_id = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
        torch.manual_seed(seed)
        model = _hf_model(arch, eos_id, pad_id)
        _set_gdn_memory(model, gdn_memory)
        model = model.to(torch.bfloat16)
        model.config.dtype = "bfloat16"
        model.save_pretrained(tmp, safe_serialization=True)
        (tmp / "vllm_hybrid_npu.json").write_text(
            json.dumps({"arch": arch, "seed": seed, "gdn_memory": gdn_memory, "format": FORMAT_VERSION})
        )
        if out.exists():
            shutil.rmtree(out)
        tmp.chmod(0o755)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def cache_root() -> Path:
    """Directory of cached default builds: ``$VLLM_HYBRID_NPU_CACHE`` or
    ``~/.cache/vllm-hybrid-npu``."""
    env = os.environ.get("VLLM_HYBRID_NPU_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "vllm-hybrid-npu"


def _default_name(arch: str, seed: int, gdn_memory: str = "short") -> str:
    return f"tiny-{arch}-s{seed}" + ("" if gdn_memory == "short" else f"-{gdn_memory}")


def default_model_dir(arch: str = "qwen3_next", seed: int = 0, gdn_memory: str = "short") -> Path:
    """Return the cached default build for ``arch``/``seed``/``gdn_memory``, building it on
    first use."""
    out = cache_root() / "models" / _default_name(arch, seed, gdn_memory)
    marker = out / "vllm_hybrid_npu.json"
    if marker.exists():
        meta = json.loads(marker.read_text())
        if meta.get("format") == FORMAT_VERSION:
            return out
    return build_model(out, arch=arch, seed=seed, gdn_memory=gdn_memory)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--arch", choices=ARCHS, default="qwen3_next", help="model architecture")
    parser.add_argument(
        "--out",
        default=None,
        help="output directory (default: the cached directory `demo` uses, under "
        "$VLLM_HYBRID_NPU_CACHE or ~/.cache/vllm-hybrid-npu)",
    )
    parser.add_argument("--seed", type=int, default=0, help="weight initialisation seed")
    parser.add_argument("--gdn-memory", choices=tuple(GDN_MEMORY), default="short",
                        help="GDN decay: 'short' (transformers' init) or 'long' (states remembered "
                        "for hundreds of tokens, so output comparisons see a wrong state)")


def run(args: argparse.Namespace) -> int:
    if args.out is None:
        out = build_model(cache_root() / "models" / _default_name(args.arch, args.seed, args.gdn_memory),
                          args.arch, args.seed, args.gdn_memory)
    else:
        out = build_model(args.out, args.arch, args.seed, args.gdn_memory)
    print(out)
    return 0
