"""Mooncake FAST'25 traces: reading, prompt token ids, and the infinite-cache bound.

A trace line is ``{"timestamp": ms, "input_length": tokens, "output_length": tokens,
"hash_ids": [int, ...]}``; each hash id stands for one 512-token block of prompt (equal ids =
equal tokens) and the last block is cut to ``input_length``.
"""

from __future__ import annotations

import json
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

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


def conversation_parents(requests: list[TraceRequest]) -> list[int | None]:
    """For each request, the earlier request whose prompt it extends (a chat's previous turn).

    Request ``j`` extends an earlier request ``i`` when ``i`` has at least one full trace block,
    ``j``'s hash ids start with the hash ids of ``i``'s full blocks (``i``'s last, partial block
    differs in ``j`` because ``j`` continues past ``i``'s end: a Mooncake hash id covers a whole
    512-token block) and ``j`` is longer than ``i``'s prompt plus output. Among several such
    ``i`` the one with the most full blocks wins, the latest on ties.

    Returns:
        A list of request indices or ``None``, one per request, in trace order.
    """
    by_prefix: dict[tuple[int, ...], int] = {}
    out: list[int | None] = []
    for j, req in enumerate(requests):
        parent = None
        # longest earlier prefix of full blocks first
        for k in range(min(len(req.hash_ids), req.input_length // TRACE_BLOCK), 0, -1):
            i = by_prefix.get(req.hash_ids[:k])
            if i is not None and requests[i].input_length + requests[i].output_length < req.input_length:
                parent = i
                break
        out.append(parent)
        full = req.input_length // TRACE_BLOCK
        if full:
            by_prefix[req.hash_ids[:full]] = j
    return out


def carried_prompts(
    requests: list[TraceRequest],
    output_token: Callable[[int, int], int],
    carry: bool = True,
) -> tuple[list[list[int]], list[int | None]]:
    """Prompt token ids of every request, with a previous turn's answer carried into the next.

    Without ``carry`` every prompt is :func:`prompt_token_ids`. With it, a request ``j`` whose
    :func:`conversation_parents` entry is ``i`` gets ``i``'s (carried) prompt, then ``i``'s
    ``output_length`` generated tokens ``output_token(i, 0 .. output_length - 1)``, then its own
    tokens from that position on, cut to ``input_length``: what a chat sends for the next turn
    (history + the model's answer + the new message). Lengths are unchanged.

    Returns:
        ``(prompts, parents)``: token id lists and the parent index (or ``None``) per request.
    """
    parents = conversation_parents(requests) if carry else [None] * len(requests)
    prompts: list[list[int]] = []
    for j, req in enumerate(requests):
        own = prompt_token_ids(req)
        i = parents[j]
        if i is not None:
            head = prompts[i] + [output_token(i, k) for k in range(requests[i].output_length)]
            own = head + own[len(head):]
        prompts.append(own)
    return prompts, parents


def infinite_bound_tokens(
    prompts: list[list[int]],
    block_size: int,
    outputs: list[list[int]] | None = None,
) -> tuple[int, int]:
    """:func:`infinite_bound` over explicit prompt token ids (carried prompts included).

    A request hits the longest block-aligned prefix that an earlier request held as full blocks
    (a chain of per-block digests, like vLLM's block hashes), capped at ``len - 1`` tokens.
    ``outputs[i]``: request ``i``'s generated token ids; an engine caches the blocks its answer
    fills too, and a later turn that carries the answer (:func:`carried_prompts`) can hit them,
    so with carried answers the bound counts each request's prompt followed by its answer (without
    ``outputs`` it counts prompts only, which is no upper bound once answers are carried).
    Returns ``(cached prompt tokens, prompt tokens)``; ``ValueError`` for ``block_size < 1``.
    """
    if block_size < 1:
        raise ValueError(f"--block-size must be >= 1, got {block_size}")
    seen: set[bytes] = set()
    cached = total = 0
    for i, tokens in enumerate(prompts):
        total += len(tokens)
        seq = tokens + list(outputs[i]) if outputs is not None else tokens
        keys = []
        parent = b""
        for b in range(len(seq) // block_size):
            chunk = seq[b * block_size:(b + 1) * block_size]
            parent = hashlib.sha256(parent + repr(chunk).encode()).digest()
            keys.append(parent)
        max_hit = (len(tokens) - 1) // block_size
        hit = 0
        while hit < max_hit and keys[hit] in seen:
            hit += 1
        cached += hit * block_size
        seen.update(keys)
    return cached, total


def answers(requests: list[TraceRequest], output_token: Callable[[int, int], int]) -> list[list[int]]:
    """Every request's generated token ids (``output_token(i, 0 .. output_length - 1)``): the
    ``outputs`` of :func:`infinite_bound_tokens`."""
    return [[output_token(i, k) for k in range(r.output_length)] for i, r in enumerate(requests)]
