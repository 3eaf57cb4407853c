"""Mooncake FAST'25 traces: reading, prompt token ids, and the infinite-cache bound.

A trace line is ``{"timestamp": ms, "input_length": tokens, "output_length": tokens,
"hash_ids": [int, ...]}``; each hash id stands for one 512-token block of prompt (equal ids =
equal tokens) and the last block is cut to ``input_length``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

#: tokens per trace hash id (Mooncake FAST'25 release)
TRACE_BLOCK = 512


@dataclass(frozen=True)
class TraceRequest:
    """One trace request: arrival in ms, prompt/output lengths in tokens, prompt block hash ids."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def read_trace(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """Read the first ``limit`` (all if None) requests of a Mooncake-format JSONL trace.

    Raises ``ValueError`` naming ``--trace`` and the line for a missing file, bad JSON, missing
    fields, too few hash ids for ``input_length`` or decreasing timestamps.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--trace {str(path)!r}: no such file")
    out: list[TraceRequest] = []
    last_ts = float("-inf")
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and len(out) >= limit:
                break
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                req = TraceRequest(
                    float(d["timestamp"]),
                    int(d["input_length"]),
                    int(d["output_length"]),
                    tuple(int(h) for h in d["hash_ids"]),
                )
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"--trace {str(path)!r} line {lineno}: {exc!r}") from exc
            if req.input_length < 1 or req.output_length < 1:
                raise ValueError(
                    f"--trace {str(path)!r} line {lineno}: input_length and output_length must be >= 1"
                )
            if len(req.hash_ids) * TRACE_BLOCK < req.input_length:
                raise ValueError(
                    f"--trace {str(path)!r} line {lineno}: {len(req.hash_ids)} hash ids cover "
                    f"fewer than input_length={req.input_length} tokens"
                )
            if req.timestamp_ms < last_ts:
                raise ValueError(f"--trace {str(path)!r} line {lineno}: timestamps must not decrease")
            last_ts = req.timestamp_ms
            out.append(req)
    if not out:
        raise ValueError(f"--trace {str(path)!r}: no requests")
    return out


def prompt_token_ids(req: TraceRequest) -> list[int]:
    """Return the ``input_length`` prompt token ids of ``req`` (list of int).

    Hash id ``h`` becomes the run ``h*512, h*512+1, ..., h*512+511``: equal ids give equal
    tokens, different ids give disjoint tokens, so two prompts share exactly the prefix their
    hash ids share. Token ids are not bounded by a vocabulary: the scheduler never looks them up.
    """
    n = req.input_length
    out: list[int] = []
    for h in req.hash_ids:
        base = h * TRACE_BLOCK
        take = min(TRACE_BLOCK, n - len(out))
        out.extend(range(base, base + take))
        if len(out) >= n:
            break
    return out


def infinite_bound(requests: list[TraceRequest], block_size: int) -> tuple[int, int]:
    """Return ``(cached prompt tokens, prompt tokens)`` with an infinite cache at ``block_size``.

    A request hits the longest block-aligned prefix (a multiple of ``block_size`` tokens) that an
    earlier request's prompt also held as full blocks, capped like vLLM at ``input_length - 1``
    (the last prompt token is always computed). Prefix identity is exact: a prefix of ``L``
    tokens is determined by the hash ids of its first ``ceil(L / 512)`` trace blocks.
    Computed analytically, without vLLM. Raises ``ValueError`` for ``block_size < 1``.
    """
    if block_size < 1:
        raise ValueError(f"--block-size must be >= 1, got {block_size}")
    seen: set[tuple[int, ...]] = set()
    cached = total = 0
    for req in requests:
        total += req.input_length
        n_blocks = req.input_length // block_size
        keys = [
            req.hash_ids[: -(-((k + 1) * block_size) // TRACE_BLOCK)] for k in range(n_blocks)
        ]
        max_hit_blocks = (req.input_length - 1) // block_size
        hit = 0
        while hit < max_hit_blocks and keys[hit] in seen:
            hit += 1
        cached += hit * block_size
        seen.update(keys)
    return cached, total
