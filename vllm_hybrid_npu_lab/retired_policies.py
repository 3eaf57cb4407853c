"""Lab-only checkpoint policies ``tail`` and ``adaptive``, retired from the runtime (issues 13, 15).

Both were ``VLLM_HYBRID_NPU_CHECKPOINTS`` values until 2026-11-23; the lab's numbers
(docs/hitrate-lab.md, 2026-11-23) retired them: ``tail`` gives exactly the hits of vLLM's own
``--long-prefill-token-threshold <block size> --prefix-cache-retention-interval None`` (the lab's
``upstream:ret=dense,lpt=1b``), and ``adaptive`` is below upstream's best setting at every lab
point; ``lean`` replaced both (itself a retired lab row since 2026-11-25: placement is vLLM's). The lab keeps them so that
the published numbers can be replayed (``vllm-hybrid-npu-lab hitrate --policy tail adaptive``).

They are built on the lab's extension point: a
:class:`vllm_hybrid_npu_lab.scheduling.split.SplitRule` passed to
:func:`vllm_hybrid_npu_lab.scheduling.scheduler.scheduler_class` gives a scheduler class on
:class:`~vllm_hybrid_npu_lab.scheduling.policy_base.CheckpointPolicyMixin` (vLLM's split
first, then the rule's extra chunk end; dense state retention when vLLM's
``prefix_cache_retention_interval`` is its default 0). Pure functions, no vLLM import; positions
and lengths in tokens, ``block_size`` the hybrid block size in tokens.

* ``tail``: a stop at every block boundary of the prefill (chunks are whole blocks except the
  last one); every block-aligned prefix of the prompt gets a state on first sight.
* ``adaptive``: stops at block boundaries that are a power-of-two number of blocks
  (1, 2, 4, 8, ... blocks) below the prompt's last block boundary: a prompt of ``n`` blocks takes
  about ``log2(n)`` extra steps instead of ``n``, and a later request sharing ``k >= 1`` blocks
  hits at least ``k/2`` of them (rounded down to a power of two) on its first repeat.
"""

from __future__ import annotations

from vllm_hybrid_npu_lab.scheduling.split import SplitRule

#: The retired policies' names, in the lab's registration order.
RETIRED_NAMES: tuple[str, ...] = ("tail", "adaptive")


def _check(name: str, value: int, minimum: int) -> None:
    if not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def next_checkpoint_stop(start: int, block_size: int, policy: str) -> int:
    """The first checkpoint position strictly after ``start`` that ``policy`` asks for.

    Args:
        start: tokens already computed (the chunk's first position), >= 0.
        block_size: hybrid block size in tokens, >= 1.
        policy: ``tail`` (the next block boundary) or ``adaptive`` (the next boundary at a
            power-of-two number of blocks).

    Returns:
        A block-aligned token position ``> start``.

    Raises:
        ValueError: another ``policy`` or out-of-range arguments.
    """
    _check("start", start, 0)
    _check("block_size", block_size, 1)
    if policy == "tail":
        return (start // block_size + 1) * block_size
    if policy == "adaptive":
        blocks = 1  # smallest power-of-two number of blocks whose boundary lies after start
        while blocks * block_size <= start:
            blocks *= 2
        return blocks * block_size
    raise ValueError(f"policy {policy!r}: expected one of {', '.join(RETIRED_NAMES)}")


def tail_chunk_tokens(start: int, num_new_tokens: int, prefill_end: int, block_size: int) -> int:
    """``tail``'s chunk: up to the next block boundary when it lies strictly inside the chunk
    and the prefill, else unchanged (the :class:`SplitRule` contract: a prefill chunk,
    ``0 < result <= num_new_tokens``)."""
    stop = next_checkpoint_stop(start, block_size, "tail")
    if start < stop < min(start + num_new_tokens, prefill_end):
        return stop - start
    return num_new_tokens


def adaptive_chunk_tokens(start: int, num_new_tokens: int, prefill_end: int, block_size: int) -> int:
    """``adaptive``'s chunk: up to the next power-of-two-blocks boundary when it lies strictly
    inside the chunk and below the prompt's last block boundary (vLLM stops there itself), else
    unchanged (the :class:`SplitRule` contract)."""
    stop = next_checkpoint_stop(start, block_size, "adaptive")
    if stop >= prefill_end // block_size * block_size:
        return num_new_tokens
    if start < stop < min(start + num_new_tokens, prefill_end):
        return stop - start
    return num_new_tokens


TAIL = SplitRule(
    "tail", tail_chunk_tokens,
    "state checkpoint at every block boundary of the prefill, dense state retention",
)
ADAPTIVE = SplitRule(
    "adaptive", adaptive_chunk_tokens,
    "checkpoints at 1, 2, 4, 8... blocks and the prompt's last block boundary, dense state "
    "retention",
)

#: name -> rule, for :mod:`.engine_policies` and tests.
RULES: dict[str, SplitRule] = {"tail": TAIL, "adaptive": ADAPTIVE}
