"""Model presets: the KV-cache-relevant ``config.json`` values of public hybrid checkpoints.

Only the fields that decide the KV-cache specs are kept (layer pattern, attention heads, head
size, GDN head counts/dims, conv kernel, dtypes). Sources (public ``config.json`` values):

* ``qwen3.5-35b-a3b`` -- Qwen/Qwen3.5-35B-A3B (``text_config`` of
  https://huggingface.co/Qwen/Qwen3.5-35B-A3B/blob/main/config.json). The same values are the
  defaults of ``transformers``' ``Qwen3_5MoeTextConfig`` (5.x, ``@auto_docstring(checkpoint=
  "Qwen/Qwen3.5-35B-A3B")``); ``mamba_ssm_dtype: float32`` as in the Qwen3.5 configs.
* ``qwen3-next-80b-a3b`` -- Qwen/Qwen3-Next-80B-A3B-Instruct
  (https://huggingface.co/Qwen/Qwen3-Next-80B-A3B-Instruct/blob/main/config.json); equal to the
  defaults of ``transformers``' ``Qwen3NextConfig`` (checkpoint ``Qwen3-Next-80B-A3B-Instruct``).
  Its config has no ``mamba_ssm_dtype``, so vLLM keeps the SSM state in the model dtype.
* ``qwen3.5-9b`` -- Qwen/Qwen3.5-9B, dense MLP (``text_config`` of
  https://huggingface.co/Qwen/Qwen3.5-9B/blob/main/config.json); these values are also the
  defaults of ``transformers``' ``Qwen3_5TextConfig``.

The files themselves could not be downloaded here (no internet): the values were read from the
``transformers`` 5.x configuration defaults named above and cross-checked against third-party
copies of these ``config.json`` files quoted in public repositories (a test fixture of the real
Qwen3.5-9B config; a ``qwen3_5_moe`` 40-layer config with 2 KV heads and 32 GDN value heads;
the Qwen3-Coder-Next config, same dimensions as Qwen3-Next-80B-A3B). Not checked against the
Hugging Face files byte for byte.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

_GDN_COMMON: dict[str, Any] = {
    "head_dim": 256,
    "full_attention_interval": 4,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "dtype": "bfloat16",
}

#: A tiny hybrid (3 GDN layers + 1 full-attention layer, small heads) for tests and quick looks at
#: the replay; not a real model and not a preset. Attention page per token and layer:
#: 2 (K, V) x 1 KV head x 64 x 2 bytes = 256 bytes.
TINY_HYBRID: dict[str, Any] = {
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "hidden_size": 128,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 2,
    "dtype": "bfloat16",
}

#: preset name -> KV-relevant text-config fields (see module docstring for sources)
PRESETS: dict[str, dict[str, Any]] = {
    "qwen3.5-35b-a3b": {
        **_GDN_COMMON,
        "source": "https://huggingface.co/Qwen/Qwen3.5-35B-A3B/blob/main/config.json",
        "num_hidden_layers": 40,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "mamba_ssm_dtype": "float32",
    },
    "qwen3-next-80b-a3b": {
        **_GDN_COMMON,
        "source": "https://huggingface.co/Qwen/Qwen3-Next-80B-A3B-Instruct/blob/main/config.json",
        "num_hidden_layers": 48,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
    },
    "qwen3.5-9b": {
        **_GDN_COMMON,
        "source": "https://huggingface.co/Qwen/Qwen3.5-9B/blob/main/config.json",
        "num_hidden_layers": 32,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "mamba_ssm_dtype": "float32",
    },
}

_REQUIRED = (
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "linear_conv_kernel_dim",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
)


def layer_types(cfg: dict[str, Any]) -> list[str]:
    """Return the per-layer type list (``"linear_attention"`` or ``"full_attention"``).

    Uses ``layer_types`` when present, else ``full_attention_interval`` (default 4) the way
    ``transformers``' ``Qwen3NextConfig.__post_init__`` derives it: layer ``i`` is full attention
    when ``(i + 1) % interval == 0``.
    """
    if cfg.get("layer_types"):
        return list(cfg["layer_types"])
    interval = int(cfg.get("full_attention_interval", 4))
    n = int(cfg["num_hidden_layers"])
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]


def resolve_model(model: str) -> tuple[str, dict[str, Any]]:
    """Return ``(display name, text config dict)`` for a preset name or a local model directory.

    A directory must hold a ``config.json`` of a Qwen3-Next/Qwen3.5 style hybrid (GDN
    ``linear_attention`` + ``full_attention`` layers); a ``text_config`` sub-dict is used when
    present. Raises ``ValueError`` naming ``--model`` for an unknown preset, a missing file or a
    config without the GDN fields.
    """
    if model in PRESETS:
        return model, dict(PRESETS[model])
    path = Path(model)
    cfg_file = path / "config.json" if path.is_dir() else path
    if not cfg_file.is_file():
        raise ValueError(
            f"--model {model!r}: neither a preset ({', '.join(PRESETS)}) nor a directory with a "
            "config.json"
        )
    raw = json.loads(cfg_file.read_text())
    cfg = dict(raw.get("text_config") or raw)
    if "dtype" not in cfg:
        cfg["dtype"] = cfg.get("torch_dtype") or raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"
    missing = [k for k in _REQUIRED if k not in cfg]
    if missing:
        raise ValueError(
            f"--model {model!r}: config.json lacks {', '.join(missing)}; only Qwen3-Next/Qwen3.5 "
            "style hybrids (GDN linear_attention + full_attention layers) are supported"
        )
    if "head_dim" not in cfg:
        cfg["head_dim"] = cfg["hidden_size"] // cfg["num_attention_heads"]
    cfg["source"] = str(cfg_file)
    return str(path), cfg


#: the lab's default model preset (``--model``)
DEFAULT_MODEL = "qwen3.5-35b-a3b"
#: fixed cost of one engine step (ms): the order of a decode step's launch + sampling overhead
DEFAULT_STEP_MS = 5.0
#: offered prompt load / simulated throughput when --tokens-per-s is not given
DEFAULT_UTILIZATION = 0.5
