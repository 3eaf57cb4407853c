"""``vllm-hybrid-npu make-model``: a tiny random-weight hybrid checkpoint that vLLM serves.

Writes a Hugging Face model directory (``config.json``, ``model.safetensors``, ``tokenizer.json``,
``tokenizer_config.json`` with a ChatML chat template, ``generation_config.json``) for one of:

* ``qwen3_next``: ``Qwen3NextForCausalLM`` (GDN "linear_attention" layers + gated full attention,
  sparse MoE MLP), the architecture of Qwen3-Next-80B-A3B.
* ``qwen3_5``: ``Qwen3_5ForCausalLM`` (text-only Qwen3.5: the same GDN/attention layer pattern
  with a dense MLP).

Both use 4 decoder layers (3 GDN + 1 full attention, the 3:1 pattern of the real models).
``--mtp-layers N`` (default 0) adds a multi-token-prediction (MTP) head of ``N`` full-attention
layers under the ``mtp.*`` names of the real checkpoints, which vLLM's ``Qwen3NextMTP`` /
``Qwen3_5MTP`` draft models load for ``speculative_config={"method": "mtp"}``. The
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
#: 2: Qwen3-Next has 2 routed experts and routes every token to both.
FORMAT_VERSION = 2

#: Routed experts of the tiny Qwen3-Next; by default every token goes to all of them.
#: Format 1 had top-2 of 4: the router's bf16 logits tie or nearly tie at about 1 % of
#: (position, layer) pairs, so the last-bit differences between two chunk schedules (align mode's
#: chunk ends, another request sharing the step's token budget) switched a token to another
#: expert pair, an O(1) change of its hidden state, seen as greedy outputs whose top-20 logprobs
#: share almost nothing (the "divergences" of docs/testing.md, series F, and the pinned
#: preempted draw; vLLM's own path as much as ours). Routing to all experts makes the routing
#: weights continuous in the logits; *two* experts also keep the sum of the expert outputs
#: order-independent (a + b == b + a in floating point), which vLLM's CPU MoE kernel needs for
#: two schedules on the 64-token grid to stay bit-identical: with all 4 of 4 they differed by
#: up to 7e-5 nat (docs/testing.md, "MoE routing near-ties"; ``e2e/moe_routing_ties.py``).
NUM_EXPERTS = 2

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


#: Decoder layer pattern of the tiny models: 3 GDN layers, then 1 full attention layer.
LAYER_TYPES = ("linear_attention",) * 3 + ("full_attention",)

#: ``config.json`` key holding the number of MTP layers, per ``--arch``: the key of the real
#: checkpoints, which vLLM 0.30 reads (``vllm/config/speculative.py``: ``num_nextn_predict_layers``
#: for ``qwen3_next``, ``mtp_num_hidden_layers`` for ``qwen3_5``/``qwen3_5_text``;
#: ``vllm/model_executor/models/qwen3_next_mtp.py`` and ``qwen3_5_mtp.py`` size the head from it).
MTP_CONFIG_KEY = {"qwen3_next": "num_nextn_predict_layers", "qwen3_5": "mtp_num_hidden_layers"}

#: Largest ``--mtp-layers`` accepted (the real models ship 1).
MAX_MTP_LAYERS = 4


def _hf_model(arch: str, eos_id: int, pad_id: int, layer_types: tuple[str, ...] = LAYER_TYPES,
              experts_per_token: int | None = None, num_experts: int | None = None):
    """Build the randomly initialised ``transformers`` model for ``arch`` with one decoder layer
    per entry of ``layer_types`` (Qwen3-Next: ``num_experts`` routed experts, default
    :data:`NUM_EXPERTS`, ``experts_per_token`` of them per token, default all; the weights drawn
    depend on ``num_experts`` only)."""
    common = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=256,
        num_hidden_layers=len(layer_types),
        layer_types=list(layer_types),
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
            num_experts=num_experts or NUM_EXPERTS,
            num_experts_per_tok=experts_per_token or num_experts or NUM_EXPERTS,
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


def _mtp_weights(arch: str, eos_id: int, pad_id: int, num_layers: int, hidden_size: int,
                 initializer_range: float, work_dir: Path) -> dict:
    """Random MTP-head tensors for ``arch``, named as in the real Qwen3-Next / Qwen3.5 checkpoints.

    The head of those checkpoints (what vLLM's ``Qwen3NextMultiTokenPredictor`` /
    ``Qwen3_5MultiTokenPredictor`` load after mapping ``mtp.`` to ``model.``) is:

    * ``mtp.pre_fc_norm_embedding.weight``, ``mtp.pre_fc_norm_hidden.weight``: RMSNorm weights,
      ``[hidden_size]``, of the embedding of the next token and of the target's last hidden state;
    * ``mtp.fc.weight``: ``[hidden_size, 2 * hidden_size]``, bias-free, projecting their
      concatenation ``[embedding, hidden]`` back to ``hidden_size``;
    * ``mtp.layers.{i}.*``, ``i < num_layers``: full-attention decoder layers with the tensor
      names and shapes of the main model's full-attention layers (``model.layers.{j}.*``);
    * ``mtp.norm.weight``: the final RMSNorm, ``[hidden_size]``.

    The embedding and LM head are shared with the main model (no ``mtp.`` copies).

    The layers are drawn by ``transformers``' own initialisation of an ``arch`` model whose
    ``num_layers`` layers are all full attention (saved through ``save_pretrained`` into
    ``work_dir`` so that the names are those ``transformers`` writes, e.g. unfused experts);
    ``mtp.fc.weight`` and the three head norms from N(0, ``initializer_range``), as
    ``transformers`` draws linear layers. (Its zero-centred RMSNorms, ``x * (1 + w)``, start at
    ``w = 0``; drawing the head norms instead lets a test tell each of them from the others and
    from a norm left unloaded.) All draws come from torch's global generator, after the main
    model's.

    Returns:
        ``{name: tensor}`` (bfloat16, CPU).
    """
    import torch
    from safetensors.torch import load_file

    donor = _hf_model(arch, eos_id, pad_id, ("full_attention",) * num_layers).to(torch.bfloat16)
    donor.save_pretrained(work_dir, safe_serialization=True)
    donor_weights = load_file(work_dir / "model.safetensors")
    out = {}
    for name, tensor in donor_weights.items():
        if name.startswith("model.layers."):
            out["mtp." + name[len("model."):]] = tensor
    shapes = {"fc": (hidden_size, 2 * hidden_size), "pre_fc_norm_embedding": (hidden_size,),
              "pre_fc_norm_hidden": (hidden_size,), "norm": (hidden_size,)}
    for name, shape in shapes.items():
        out[f"mtp.{name}.weight"] = torch.empty(shape).normal_(0.0, initializer_range).to(torch.bfloat16)
    return out


def build_model(out_dir: str | os.PathLike, arch: str = "qwen3_next", seed: int = 0,
                gdn_memory: str = "short", mtp_layers: int = 0,
                experts_per_token: int | None = None, num_experts: int | None = None) -> Path:
    """Write a tiny random hybrid checkpoint and its tokenizer to ``out_dir``.

    Args:
        out_dir: target directory; created, and replaced atomically if it exists.
        arch: ``"qwen3_next"`` or ``"qwen3_5"``.
        seed: seed of the weight initialisation (same seed, same weights).
        gdn_memory: ``"short"`` (transformers' GDN decay) or ``"long"`` (:data:`GDN_MEMORY`).
        mtp_layers: number of MTP-head layers (:func:`_mtp_weights`), 0 for none. With
            ``mtp_layers > 0`` the main model's tensors are the same draw as with 0 (the head is
            drawn after them) and ``config.json`` gets ``MTP_CONFIG_KEY[arch]: mtp_layers``.
        experts_per_token: Qwen3-Next only: routed experts per token, 1 to ``num_experts``
            (``None``: all, the default; fewer brings back discrete routing choices, see
            :data:`NUM_EXPERTS`). Same weights whatever the value.
        num_experts: Qwen3-Next only: routed experts (``None``: :data:`NUM_EXPERTS`; 4 with
            ``experts_per_token=2`` rebuilds format 1's checkpoint).

    Returns:
        ``out_dir`` as a :class:`~pathlib.Path`.

    Raises:
        ValueError: ``arch`` is not one of :data:`ARCHS`, ``gdn_memory`` not one of
            :data:`GDN_MEMORY`, ``mtp_layers`` not an integer in ``[0, MAX_MTP_LAYERS]``, or
            ``experts_per_token``/``num_experts`` given for Qwen3.5 (no routed experts), or
            ``num_experts`` below 1 or ``experts_per_token`` outside ``[1, num_experts]``.
    """
    if arch not in ARCHS:
        raise ValueError(f"--arch {arch!r} is not one of {', '.join(ARCHS)}")
    if gdn_memory not in GDN_MEMORY:
        raise ValueError(f"--gdn-memory {gdn_memory!r} is not one of {', '.join(GDN_MEMORY)}")
    if isinstance(mtp_layers, bool) or not isinstance(mtp_layers, int) or not (
            0 <= mtp_layers <= MAX_MTP_LAYERS):
        raise ValueError(f"--mtp-layers {mtp_layers!r} is not an integer in [0, {MAX_MTP_LAYERS}]")
    if (experts_per_token is not None or num_experts is not None) and arch != "qwen3_next":
        raise ValueError(f"--experts-per-token/--num-experts: --arch {arch} has no routed experts")
    if num_experts is not None and (isinstance(num_experts, bool) or not isinstance(num_experts, int)
                                    or num_experts < 1):
        raise ValueError(f"--num-experts {num_experts!r} is not an integer >= 1")
    experts = num_experts or NUM_EXPERTS
    if experts_per_token is not None and (
            isinstance(experts_per_token, bool) or not isinstance(experts_per_token, int)
            or not 1 <= experts_per_token <= experts):
        raise ValueError(f"--experts-per-token {experts_per_token!r} is not an integer in "
                         f"[1, {experts}]")
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
        model = _hf_model(arch, eos_id, pad_id, experts_per_token=experts_per_token,
                          num_experts=num_experts)
        _set_gdn_memory(model, gdn_memory)
        model = model.to(torch.bfloat16)
        model.config.dtype = "bfloat16"
        if mtp_layers:
            setattr(model.config, MTP_CONFIG_KEY[arch], mtp_layers)
        model.save_pretrained(tmp, safe_serialization=True)
        meta = {"arch": arch, "seed": seed, "gdn_memory": gdn_memory, "format": FORMAT_VERSION}
        if arch == "qwen3_next":
            meta["experts"] = experts
            meta["experts_per_token"] = experts_per_token or experts
        if mtp_layers:
            from safetensors.torch import load_file, save_file

            donor_dir = Path(tempfile.mkdtemp(prefix=".mtp.", dir=tmp))
            head = _mtp_weights(arch, eos_id, pad_id, mtp_layers, model.config.hidden_size,
                                model.config.initializer_range, donor_dir)
            shutil.rmtree(donor_dir)
            weights = load_file(tmp / "model.safetensors")
            weights.update(head)
            save_file(weights, tmp / "model.safetensors", metadata={"format": "pt"})
            meta["mtp_layers"] = mtp_layers
        (tmp / "vllm_hybrid_npu.json").write_text(json.dumps(meta))
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


def _default_name(arch: str, seed: int, gdn_memory: str = "short", mtp_layers: int = 0) -> str:
    return (f"tiny-{arch}-s{seed}" + ("" if gdn_memory == "short" else f"-{gdn_memory}")
            + (f"-mtp{mtp_layers}" if mtp_layers else ""))


def default_model_dir(arch: str = "qwen3_next", seed: int = 0, gdn_memory: str = "short",
                      mtp_layers: int = 0) -> Path:
    """Return the cached default build for ``arch``/``seed``/``gdn_memory``/``mtp_layers``,
    building it on first use (``mtp_layers=0`` keeps the names of builds without an MTP head)."""
    out = cache_root() / "models" / _default_name(arch, seed, gdn_memory, mtp_layers)
    marker = out / "vllm_hybrid_npu.json"
    if marker.exists():
        meta = json.loads(marker.read_text())
        if meta.get("format") == FORMAT_VERSION and meta.get("mtp_layers", 0) == mtp_layers:
            return out
    return build_model(out, arch=arch, seed=seed, gdn_memory=gdn_memory, mtp_layers=mtp_layers)


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
    parser.add_argument("--mtp-layers", type=int, default=0,
                        help="layers of a random MTP head written under the checkpoints' mtp.* "
                        "names, for speculative decoding with method 'mtp' (default 0: none)")
    parser.add_argument("--experts-per-token", type=int, default=None,
                        help="qwen3_next: routed experts per token (default: all of them; fewer "
                        "makes the router's choice discrete, so bf16 near-ties switch experts "
                        "between schedules); needs --out")
    parser.add_argument("--num-experts", type=int, default=None,
                        help=f"qwen3_next: routed experts (default {NUM_EXPERTS}; 4 with "
                        "--experts-per-token 2 is format 1's checkpoint); needs --out")


def run(args: argparse.Namespace) -> int:
    mtp_layers = getattr(args, "mtp_layers", 0)
    experts = getattr(args, "experts_per_token", None)
    num_experts = getattr(args, "num_experts", None)
    if experts is not None or num_experts is not None:
        if args.out is None:
            raise SystemExit("--experts-per-token/--num-experts need --out (the cached default "
                             "builds have the default experts)")
        print(build_model(args.out, args.arch, args.seed, args.gdn_memory, mtp_layers, experts,
                          num_experts))
        return 0
    if args.out is None:
        out = build_model(
            cache_root() / "models" / _default_name(args.arch, args.seed, args.gdn_memory, mtp_layers),
            args.arch, args.seed, args.gdn_memory, mtp_layers)
    else:
        out = build_model(args.out, args.arch, args.seed, args.gdn_memory, mtp_layers)
    print(out)
    return 0
