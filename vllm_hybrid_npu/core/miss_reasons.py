"""Why prompt tokens missed the prefix cache: one reason per missed token.

Pure Python (no torch, no vLLM import), target-independent: the engine-side hook
(:mod:`vllm_hybrid_npu.patches.v1_core_sched_scheduler`) and the hit-rate lab feed it plain
numbers and block hashes read off vLLM's own ``Request`` / ``SchedulerOutput``.

A prompt of ``N`` tokens (``request.num_tokens`` at its first prefix-cache lookup) is cut at the
hash-block size ``U`` (``hash_block_size``: vLLM's block size, or ``--prefix-match-unit`` when
set); vLLM looks up at most ``N - 1`` tokens (it must compute the last prompt token to get its
logits, ``KVCacheManager.get_computed_blocks`` in vLLM 0.30/0.32), so a hit can reach at most
``R = ((N - 1) // U) * U`` tokens. With ``H`` the tokens served from the cache (device hit +
tokens a KV connector loads; ``NewRequestData.num_computed_tokens`` at first scheduling) and
``A >= H`` the longest prefix that an attention KV-cache group alone holds on the device
(``request.shared_prefix_boundary`` of vLLM 0.30/0.32, the hybrid coordinator's
"uncached common prefix"; ``H`` when unknown), the ``N - H`` missed tokens split into:

``partial_block``
    ``N - max(R, H)``: tokens past the last hash-block boundary a hit can reach (a prompt or a
    shared prefix shorter than one block, the tail of every prompt, and a whole last block when
    ``N`` is a multiple of ``U``).
``no_state``
    ``min(A, R) - H``: attention blocks cached, but no GDN/Mamba state (conv + SSM state) at
    any boundary past ``H`` (align mode keeps a state only at some block boundaries).
``evicted``
    hash blocks in ``[max(A, H), R)`` that were cached on the device before (recorded with
    :meth:`MissTracker.on_cached`) and are gone now (this block or an earlier one of the chain).
``evicted_host``
    the same, when a KV offloading connector (host tier) is configured: the block fell out of
    the device and of the host tier (the connector did not serve it).
``new``
    hash blocks in ``[max(A, H), R)`` never cached before (as far as the bounded memory of
    :class:`SeenBlocks` reaches: a block cached longer ago than its capacity counts as ``new``).

The five counts add up to ``N - H`` exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence

#: Miss reasons, in the order the classification assigns them.
REASONS: tuple[str, ...] = ("partial_block", "no_state", "evicted", "evicted_host", "new")

#: Default number of block hashes :class:`SeenBlocks` remembers when no capacity is given.
DEFAULT_SEEN_CAPACITY = 1 << 18


def classify_miss(
    num_tokens: int,
    hit_tokens: int,
    cached_prefix_tokens: int,
    hash_block_size: int,
    seen: Callable[[int], bool] | Sequence[bool],
    host_tier: bool = False,
) -> dict[str, int]:
    """Split the ``num_tokens - hit_tokens`` missed prompt tokens of one request by reason.

    Args:
        num_tokens: tokens of the request at its first lookup (prompt tokens), int >= 0.
        hit_tokens: tokens served from the cache (device + KV connector), 0 <= hit <= num_tokens.
        cached_prefix_tokens: longest prefix an attention group holds on the device (tokens);
            values below ``hit_tokens`` are taken as ``hit_tokens``.
        hash_block_size: tokens per hash block (``U``), int > 0.
        seen: ``seen(j)`` (or ``seen[j]``) tells whether hash block ``j`` (0-based, covering
            tokens ``[j*U, (j+1)*U)``) was cached on the device before; only asked for blocks
            in ``[max(A, H) // U, R // U)``.
        host_tier: a KV offloading connector (host tier) is configured: blocks seen before are
            ``evicted_host`` instead of ``evicted``.

    Returns:
        ``{reason: tokens}`` for every reason in :data:`REASONS` (ints >= 0) summing to
        ``num_tokens - hit_tokens``.

    Raises:
        ValueError: ``hash_block_size`` <= 0, or ``hit_tokens`` outside ``[0, num_tokens]``.
    """
    if hash_block_size <= 0:
        raise ValueError(f"hash_block_size must be > 0 tokens, got {hash_block_size}")
    if not 0 <= hit_tokens <= num_tokens:
        raise ValueError(f"hit_tokens={hit_tokens} outside [0, num_tokens={num_tokens}]")
    u = hash_block_size
    out = dict.fromkeys(REASONS, 0)
    reach = max(((num_tokens - 1) // u) * u, 0) if num_tokens > 0 else 0
    lo = max(reach, hit_tokens)
    out["partial_block"] = num_tokens - lo
    if hit_tokens >= reach:
        return out
    attn = min(max(cached_prefix_tokens, hit_tokens), reach)
    out["no_state"] = attn - hit_tokens
    is_seen = seen if callable(seen) else seen.__getitem__
    evicted_key = "evicted_host" if host_tier else "evicted"
    # [attn, reach): attn may sit inside a hash block only if H did (a connector hit that is
    # not block-aligned): that block's tokens past attn go with the block's verdict.
    start = attn
    while start < reach:
        j = start // u
        end = min((j + 1) * u, reach)
        out[evicted_key if is_seen(j) else "new"] += end - start
        start = end
    return out


class SeenBlocks:
    """Bounded memory of block hashes that were cached on the device (oldest forgotten first).

    Keys are vLLM's ``BlockHash`` values (bytes) or anything hashable. ``capacity`` (blocks,
    int > 0) bounds the memory: about 100 bytes per remembered block with 32-byte hashes.

    Raises:
        ValueError: ``capacity`` <= 0.
    """

    def __init__(self, capacity: int = DEFAULT_SEEN_CAPACITY) -> None:
        if capacity <= 0:
            raise ValueError(f"SeenBlocks capacity must be > 0 blocks, got {capacity}")
        self.capacity = int(capacity)
        self._d: dict[Hashable, None] = {}

    def add(self, hashes: Iterable[Hashable]) -> None:
        """Remember ``hashes`` (re-adding one makes it the newest)."""
        d = self._d
        for h in hashes:
            if h in d:
                del d[h]
            d[h] = None
        extra = len(d) - self.capacity
        if extra > 0:
            it = iter(d)
            for old in [next(it) for _ in range(extra)]:
                del d[old]

    def __contains__(self, h: Hashable) -> bool:
        return h in self._d

    def __len__(self) -> int:
        return len(self._d)


class MissTracker:
    """Per-scheduler miss accounting: classify at admission, remember cached blocks at release.

    Use (engine hook and lab alike):

    * :meth:`on_admit` once per request, when it is first scheduled (not after a preemption),
      with the request's block hashes (``request.block_hashes``, one per hash block), its token
      count, the tokens served from the cache and the attention-only cached prefix;
    * :meth:`on_cached` when the request releases its blocks (finished or preempted), with its
      block hashes and computed tokens: its full blocks were cached and can be evicted later.

    Attributes:
        hash_block_size: tokens per hash block (int > 0).
        host_tier: whether a KV offloading connector is configured (bool).
        seen: the :class:`SeenBlocks` memory.
        totals: ``{reason: tokens}`` since creation (ints); also ``"requests"`` and
            ``"prompt_tokens"`` (classified requests and their tokens) and ``"hit_tokens"``.

    Raises:
        ValueError: ``hash_block_size`` <= 0 or ``capacity`` <= 0.
    """

    def __init__(
        self,
        hash_block_size: int,
        host_tier: bool = False,
        capacity: int = DEFAULT_SEEN_CAPACITY,
    ) -> None:
        if hash_block_size <= 0:
            raise ValueError(f"hash_block_size must be > 0 tokens, got {hash_block_size}")
        self.hash_block_size = int(hash_block_size)
        self.host_tier = bool(host_tier)
        self.seen = SeenBlocks(capacity)
        self.totals: dict[str, int] = self._zero()
        self._pending: dict[str, int] = self._zero()

    @staticmethod
    def _zero() -> dict[str, int]:
        return {**dict.fromkeys(REASONS, 0), "requests": 0, "prompt_tokens": 0, "hit_tokens": 0}

    def on_admit(
        self,
        block_hashes: Sequence[Hashable],
        num_tokens: int,
        hit_tokens: int,
        cached_prefix_tokens: int = 0,
    ) -> dict[str, int]:
        """Classify one request's missed tokens and add them to :attr:`totals`.

        Args:
            block_hashes: the request's hash-block hashes (at least ``num_tokens // U``; fewer
                make the missing blocks count as ``new``).
            num_tokens: tokens at lookup (int >= 0).
            hit_tokens: tokens served from the cache (int, clamped to ``[0, num_tokens]``).
            cached_prefix_tokens: attention-only cached prefix (tokens; 0 when unknown).

        Returns:
            ``{reason: tokens}`` of this request (see :func:`classify_miss`).
        """
        hit = min(max(int(hit_tokens), 0), int(num_tokens))
        seen = self.seen
        nh = len(block_hashes)
        counts = classify_miss(
            int(num_tokens),
            hit,
            int(cached_prefix_tokens),
            self.hash_block_size,
            lambda j: j < nh and block_hashes[j] in seen,
            self.host_tier,
        )
        for acc in (self.totals, self._pending):
            for k, v in counts.items():
                acc[k] += v
            acc["requests"] += 1
            acc["prompt_tokens"] += int(num_tokens)
            acc["hit_tokens"] += hit
        return counts

    def on_cached(self, block_hashes: Sequence[Hashable], num_computed_tokens: int) -> None:
        """Remember the full hash blocks of ``num_computed_tokens`` computed tokens as cached."""
        n = min(max(int(num_computed_tokens), 0) // self.hash_block_size, len(block_hashes))
        if n:
            self.seen.add(block_hashes[:n])

    def drain(self) -> dict[str, int]:
        """Counts since the previous :meth:`drain` (same keys as :attr:`totals`); resets them."""
        out, self._pending = self._pending, self._zero()
        return out
