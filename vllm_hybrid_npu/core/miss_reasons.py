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
    ``N`` is a multiple of ``U``); plus, with a hash block finer than the cache block
    (``--prefix-match-unit``), hash blocks in ``[max(A, H), R)`` past the last cache entry that
    were computed before but never got an entry of their own: vLLM registers entries only at
    full cache blocks and at each prompt's last hash boundary, so a shared prefix that ends
    inside a cache block is not reachable even though its tokens were computed.
``drafter_drop``
    under EAGLE/MTP speculative decoding, ``[max(A, H), min(A + D, R))``: vLLM's attention lookup
    matched ``A + D`` tokens and dropped the last drop unit ``D`` so that the drafter has the KV
    past the hit (``FullAttentionManager.find_longest_cache_hit``, ``drop_eagle_block``: ``D`` =
    ``min(alignment, block)``, the hash block where fine-grained hits are on, else the cache
    block, vLLM 0.30-0.33), so ``A`` (``H`` where vLLM reports no longer attention prefix) is the
    post-drop attention prefix and the next ``D`` tokens were cached. A repeat of a cached prompt
    misses its last ``D`` reachable tokens for that reason alone; a sharer of a cached prefix the
    last unit of the shared part. With ``A = H = 0`` nothing tells a prefix of exactly one unit
    that the drop took from a miss: it counts as ``evicted`` or ``new``.
``no_state``
    ``min(A, R) - H``: attention blocks cached, but no GDN/Mamba state (conv + SSM state) at
    any boundary past ``H`` (align mode keeps a state only at some block boundaries).
``evicted``
    tokens in ``[max(A, H), R)`` up to the last hash block that had a cache entry before
    (recorded with :meth:`MissTracker.on_cached`) and has none now (this entry or an earlier
    block of the chain was evicted from the device).
``evicted_host``
    the same, when a KV offloading connector (host tier) is configured: the block fell out of
    the device and of the host tier (the connector did not serve it).
``new``
    hash blocks in ``[max(A, H), R)`` past the last former cache entry that were never computed
    before (as far as the bounded memory of :class:`SeenBlocks` reaches: a block cached longer
    ago than its capacity counts as ``new``).

The six counts add up to ``N - H`` exactly; ``drafter_drop`` is 0 without a drafter.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence

#: Miss reasons, in the order the classification assigns them.
REASONS: tuple[str, ...] = ("partial_block", "drafter_drop", "no_state", "evicted", "evicted_host",
                             "new")

#: Default number of block hashes :class:`SeenBlocks` remembers when no capacity is given.
DEFAULT_SEEN_CAPACITY = 1 << 18

#: What :class:`SeenBlocks` knows of a hash block: never computed, computed without a cache
#: entry of its own (inside a cache block, not a prompt's last hash boundary), had an entry.
NEVER, COMPUTED, ENTRY = 0, 1, 2


def classify_miss(
    num_tokens: int,
    hit_tokens: int,
    cached_prefix_tokens: int,
    hash_block_size: int,
    seen: Callable[[int], int] | Sequence[int],
    host_tier: bool = False,
    drop_tokens: int = 0,
) -> dict[str, int]:
    """Split the ``num_tokens - hit_tokens`` missed prompt tokens of one request by reason.

    Args:
        num_tokens: tokens of the request at its first lookup (prompt tokens), int >= 0.
        hit_tokens: tokens served from the cache (device + KV connector), 0 <= hit <= num_tokens.
        cached_prefix_tokens: longest prefix an attention group holds on the device (tokens);
            values below ``hit_tokens`` are taken as ``hit_tokens``.
        hash_block_size: tokens per hash block (``U``), int > 0.
        seen: ``seen(j)`` (or ``seen[j]``) for hash block ``j`` (0-based, tokens
            ``[j*U, (j+1)*U)``): :data:`ENTRY` (or True) when it had a device cache entry
            before, :data:`COMPUTED` when it was computed but never had an entry of its own,
            :data:`NEVER` (or False) otherwise; only asked for blocks in
            ``[max(A, H) // U, R // U)``.
        host_tier: a KV offloading connector (host tier) is configured: blocks seen before are
            ``evicted_host`` instead of ``evicted``.
        drop_tokens: the drafter's drop unit ``D`` (tokens, a multiple of ``hash_block_size``;
            :func:`drafter_drop_tokens`), 0 without EAGLE/MTP's block drop.

    Returns:
        ``{reason: tokens}`` for every reason in :data:`REASONS` (ints >= 0) summing to
        ``num_tokens - hit_tokens``.

    Raises:
        ValueError: ``hash_block_size`` <= 0, ``hit_tokens`` outside ``[0, num_tokens]``, or
            ``drop_tokens`` negative or not a multiple of ``hash_block_size``.
    """
    if hash_block_size <= 0:
        raise ValueError(f"hash_block_size must be > 0 tokens, got {hash_block_size}")
    if not 0 <= hit_tokens <= num_tokens:
        raise ValueError(f"hit_tokens={hit_tokens} outside [0, num_tokens={num_tokens}]")
    _check_drop(drop_tokens, hash_block_size)
    u = hash_block_size
    out = dict.fromkeys(REASONS, 0)
    reach = max(((num_tokens - 1) // u) * u, 0) if num_tokens > 0 else 0
    lo = max(reach, hit_tokens)
    out["partial_block"] = num_tokens - lo
    if hit_tokens >= reach:
        return out
    attn = min(max(cached_prefix_tokens, hit_tokens), reach)
    out["no_state"] = attn - hit_tokens
    # the drafter's drop: the attention group matched [0, A + D) and dropped [A, A + D)
    a = max(cached_prefix_tokens, hit_tokens)
    if drop_tokens and a > 0:
        past = max(min(a + drop_tokens, reach), attn)
        out["drafter_drop"], attn = past - attn, past
    state = seen if callable(seen) else seen.__getitem__
    if attn >= reach:
        return out
    # [attn, reach) in hash blocks; attn may sit inside a hash block only if H did (a connector
    # hit that is not block-aligned): that block's tokens past attn go with the block's verdict.
    first, last = attn // u, (reach - 1) // u
    verdicts = [_verdict(state(j)) for j in range(first, last + 1)]
    # an entry at block k covered every block <= k of its chain: all of them were reachable
    k = max((i for i, v in enumerate(verdicts) if v >= ENTRY), default=-1)
    evicted_key = "evicted_host" if host_tier else "evicted"
    for i, v in enumerate(verdicts):
        lo = max((first + i) * u, attn)
        n = min((first + i + 1) * u, reach) - lo
        if i <= k:
            out[evicted_key] += n
        elif v >= COMPUTED:
            out["partial_block"] += n
        else:
            out["new"] += n
    return out


def drafter_drop_tokens(block_drop: bool, block_size: int, hash_block_size: int,
                        partial_hash_hits: bool) -> int:
    """The drafter's drop unit ``D`` (tokens) of :func:`classify_miss`: 0 without EAGLE/MTP's
    block drop (``block_drop``: vLLM's ``Scheduler.use_eagle_block_drop``); else
    ``hash_block_size`` where the coordinator's fine-grained hits are on
    (``partial_hash_hits``: ``KVCacheCoordinator.enable_partial_hash_hits``, a
    ``--prefix-match-unit`` below the block) and ``block_size`` (the scheduler's block, tokens)
    otherwise, as vLLM 0.30-0.33's ``find_longest_cache_hit`` sizes its ``eagle_margin``.

    Raises:
        ValueError: ``block_size`` not a positive multiple of ``hash_block_size`` (> 0).
    """
    if hash_block_size <= 0 or block_size <= 0 or block_size % hash_block_size:
        raise ValueError(f"block_size={block_size} must be a positive multiple of "
                         f"hash_block_size={hash_block_size}")
    if not block_drop:
        return 0
    return hash_block_size if partial_hash_hits and block_size > hash_block_size else block_size


def _check_drop(drop_tokens: int, hash_block_size: int) -> None:
    if drop_tokens < 0 or drop_tokens % hash_block_size:
        raise ValueError(f"drop_tokens={drop_tokens} must be a multiple >= 0 of "
                         f"hash_block_size={hash_block_size}")


def _verdict(v: int | bool) -> int:
    if v is True:
        return ENTRY
    if v is False or v is None:
        return NEVER
    return int(v)


class SeenBlocks:
    """Bounded memory of block hashes that were cached on the device (oldest forgotten first).

    Keys are vLLM's ``BlockHash`` values (bytes) or anything hashable, each with what is known of
    it (:data:`COMPUTED` or :data:`ENTRY`; an ENTRY stays ENTRY). ``capacity`` (blocks, int > 0)
    bounds the memory: about 100 bytes per remembered block with 32-byte hashes.

    Raises:
        ValueError: ``capacity`` <= 0.
    """

    def __init__(self, capacity: int = DEFAULT_SEEN_CAPACITY) -> None:
        if capacity <= 0:
            raise ValueError(f"SeenBlocks capacity must be > 0 blocks, got {capacity}")
        self.capacity = int(capacity)
        self._d: dict[Hashable, int] = {}

    def add(self, hashes: Iterable[Hashable], state: int = ENTRY) -> None:
        """Remember ``hashes`` as ``state`` (re-adding one makes it the newest; the stronger
        state wins)."""
        d = self._d
        for h in hashes:
            old = d.pop(h, NEVER)
            d[h] = max(old, state)
        extra = len(d) - self.capacity
        if extra > 0:
            it = iter(d)
            for old in [next(it) for _ in range(extra)]:
                del d[old]

    def __contains__(self, h: Hashable) -> bool:
        return h in self._d

    def state(self, h: Hashable) -> int:
        """:data:`NEVER`, :data:`COMPUTED` or :data:`ENTRY` for hash ``h``."""
        return self._d.get(h, NEVER)

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
        hash_block_size: tokens per hash block (int > 0; ``--prefix-match-unit`` or the block
            size).
        block_size: tokens per cache block (int, a multiple of ``hash_block_size``).
        host_tier: whether a KV offloading connector is configured (bool).
        drop_tokens: the drafter's drop unit (tokens, :func:`drafter_drop_tokens`; 0: none).
        seen: the :class:`SeenBlocks` memory.
        totals: ``{reason: tokens}`` since creation (ints); also ``"requests"`` and
            ``"prompt_tokens"`` (classified requests and their tokens) and ``"hit_tokens"``.

    Raises:
        ValueError: ``hash_block_size`` <= 0, ``capacity`` <= 0, ``block_size`` not a
            positive multiple of ``hash_block_size``, or ``drop_tokens`` not a multiple >= 0 of
            it.
    """

    def __init__(
        self,
        hash_block_size: int,
        host_tier: bool = False,
        capacity: int = DEFAULT_SEEN_CAPACITY,
        block_size: int | None = None,
        drop_tokens: int = 0,
    ) -> None:
        if hash_block_size <= 0:
            raise ValueError(f"hash_block_size must be > 0 tokens, got {hash_block_size}")
        if block_size is not None and (block_size <= 0 or block_size % hash_block_size):
            raise ValueError(
                f"block_size={block_size} must be a positive multiple of "
                f"hash_block_size={hash_block_size} (--prefix-match-unit)"
            )
        self.hash_block_size = int(hash_block_size)
        self.block_size = int(block_size) if block_size else self.hash_block_size
        self.host_tier = bool(host_tier)
        _check_drop(drop_tokens, self.hash_block_size)
        self.drop_tokens = int(drop_tokens)
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
        get = self.seen._d.get
        nh = len(block_hashes)
        counts = classify_miss(
            int(num_tokens),
            hit,
            int(cached_prefix_tokens),
            self.hash_block_size,
            lambda j: get(block_hashes[j], NEVER) if j < nh else NEVER,
            self.host_tier,
            self.drop_tokens,
        )
        for acc in (self.totals, self._pending):
            for k, v in counts.items():
                acc[k] += v
            acc["requests"] += 1
            acc["prompt_tokens"] += int(num_tokens)
            acc["hit_tokens"] += hit
        return counts

    def on_cached(
        self,
        block_hashes: Sequence[Hashable],
        num_computed_tokens: int,
        block_size: int | None = None,
        num_prompt_tokens: int | None = None,
    ) -> None:
        """Remember what a request that releases its blocks left in the device cache.

        Args:
            block_hashes: the request's hash-block hashes.
            num_computed_tokens: tokens computed (int); only full hash blocks count.
            block_size: cache block size (tokens, a multiple of ``hash_block_size``); None means
                :attr:`block_size`. vLLM registers a cache entry at each full cache block and
                (when it ends inside a cache block) at the prompt's last hash boundary; the
                other computed hash blocks are remembered as computed without an entry.
            num_prompt_tokens: the request's prompt tokens (for its last hash boundary); None
                when unknown (no tail entry).
        """
        u = self.hash_block_size
        n = min(max(int(num_computed_tokens), 0) // u, len(block_hashes))
        if not n:
            return
        scale = max(int(block_size or self.block_size) // u, 1)
        if scale == 1:
            self.seen.add(block_hashes[:n], ENTRY)
            return
        self.seen.add(block_hashes[:n], COMPUTED)
        self.seen.add([block_hashes[i] for i in range(scale - 1, n, scale)], ENTRY)
        if num_prompt_tokens:
            tail = int(num_prompt_tokens) // u
            if 0 < tail <= n and tail % scale:
                self.seen.add([block_hashes[tail - 1]], ENTRY)

    def drain(self) -> dict[str, int]:
        """Counts since the previous :meth:`drain` (same keys as :attr:`totals`); resets them."""
        out, self._pending = self._pending, self._zero()
        return out
