"""Shared fixtures of the hit-rate lab tests: a tiny hybrid config.json and trace writers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_hybrid_npu_lab.policies import policy_unavailable
from vllm_hybrid_npu_lab.presets import TINY_HYBRID

#: The tiny hybrid of the lab (3 GDN layers + 1 full-attention layer). Attention page per
#: token and layer = 2 (K, V) x 1 head x 64 x 2 bytes = 256 bytes.
TINY_CONFIG = TINY_HYBRID
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


@pytest.fixture(autouse=True)
def _policy_replayable_here(request):
    """A test parametrized over ``policy`` skips a policy written against another vLLM (the
    retired runtime policies: vLLM 0.30 only), with the reason; the others run."""
    callspec = getattr(request.node, "callspec", None)
    name = callspec.params.get("policy") if callspec else None
    if isinstance(name, str):
        why = policy_unavailable(name)
        if why:
            pytest.skip(why)
