"""Shared fixtures of the hit-rate lab tests: a tiny hybrid config.json and trace writers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

#: A tiny Qwen3-Next-style hybrid: 3 GDN layers + 1 full-attention layer. Attention page per
#: token and layer = 2 (K, V) x 1 head x 64 x 2 bytes = 256 bytes.
TINY_CONFIG = {
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
ATTN_BYTES_PER_TOKEN = 2 * 1 * 64 * 2


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tiny-hybrid")
    (d / "config.json").write_text(json.dumps(TINY_CONFIG))
    return d


def _write_trace(path: Path, rows: list[tuple[float, int, int, list[int]]]) -> Path:
    """Write ``(timestamp_ms, input_length, output_length, hash_ids)`` rows as a JSONL trace."""
    with path.open("w") as f:
        for ts, n, out, h in rows:
            f.write(
                json.dumps(
                    {"timestamp": ts, "input_length": n, "output_length": out, "hash_ids": h}
                )
                + "\n"
            )
    return path


@pytest.fixture
def write_trace():
    """The trace writer: ``write_trace(path, rows) -> path``."""
    return _write_trace


@pytest.fixture(scope="session")
def attn_bytes_per_token() -> int:
    """Attention KV bytes per token of the tiny model's single attention layer."""
    return ATTN_BYTES_PER_TOKEN
