"""Where a prefill chunk is cut so that recurrent-state checkpoints land on block boundaries.

Pure, target-independent functions (no vLLM, no torch): positions and lengths are token counts
(``int``), ``block_size`` is the hybrid block size in tokens (the Mamba/GDN state is stored once
per block in align mode).

Background (vLLM 0.30.0 and 0.32.0, ``vllm/v1/core/sched/scheduler.py``,
``Scheduler._mamba_block_aligned_split``): in align mode a GDN/Mamba state is written only where
a scheduling step *ends*, and that step end must be a block boundary to be cacheable. Upstream
already ends a prefill at the prompt's last block boundary (``last_cache_position``), at a
detected shared-prefix junction and at the chunk-size limit. A prompt that fits one chunk
therefore leaves exactly one reusable state: at its last block boundary. A later request that
shares only a shorter prefix (a system prompt followed by a different user message) finds no
state at or below its shared prefix and misses; vLLM notices the junction then and checkpoints
it, so only the third request hits.

A policy adds more chunk ends (``checkpoint stops``) during prefill; it never lengthens a chunk,
so every upstream stop (junction, tail boundary, chunk limit, spec-decode lookahead) is kept.
The lab's engine policies (:data:`POLICY_NAMES`; the runtime's until 2026-11-25, when placement
became vLLM's and this module moved to the lab):

* ``upstream``: no extra stop.
* ``lean``: the stops of :func:`.retention.extra_stops` (the prompt's last two block
  boundaries, no ladder); its retention and eviction order are in :mod:`.retention` and
  :mod:`.lean`.

(``gdn``, retired on 2026-11-25, added no chunk end: its states were captured inside the step in
vLLM's ``'all'`` mode; the lab keeps only its ``gdn-lean`` variant, ``engine_policies.py``.)

Extension point: a :class:`SplitRule` (a name and a chunk-end function with the contract of
:func:`policy_chunk_tokens`) can be passed wherever a policy name is accepted here and to
:func:`.scheduler.scheduler_class`; ``lean`` is the rule :data:`LEAN_RULE`.
The hit-rate lab defines its lab-only policies this way (``vllm_hybrid_npu_lab/retired_policies.py``:
``tail`` and ``adaptive``, retired from the runtime on 2026-11-23, :data:`RETIRED_POLICIES`).
No value here is read from the environment: the runtime rejects ``VLLM_HYBRID_NPU_CHECKPOINTS``
other than ``upstream`` (:mod:`vllm_hybrid_npu.core.placement`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

#: The scheduling policies :func:`.scheduler.scheduler_class` builds by name (``gdn`` too, see
#: :data:`.policy_base.GDN_POLICY`).
POLICY_NAMES: tuple[str, ...] = ("upstream", "lean")

#: Policies no longer built by name -> why, and what replaces them (docs/hitrate-lab.md,
#: 2026-11-23). Named in the error a retired value gets.
RETIRED_POLICIES: dict[str, str] = {
    "tail": "'tail' was retired: it gives exactly the hits of vLLM's own flags "
    "--long-prefill-token-threshold <block size> --prefix-cache-retention-interval None "
    "(use those; lab only: vllm-hybrid-npu-lab hitrate --policy tail)",
    "gdn": "'gdn' was retired (2026-11-25): GDN states come from inside the prefill through "
    "vLLM's prefill-checkpoint interface, on by default (VLLM_HYBRID_NPU_PREFILL_CHECKPOINTS); "
    "vLLM 0.32 removed the 'all' mode it used",
    "adaptive": "'adaptive' was retired: it is below upstream's best setting at every lab point "
    "(lab only: vllm-hybrid-npu-lab hitrate --policy adaptive)",
}

#: ``lean``'s stops (:mod:`.retention`): the prompt's last ``LEAN_WINDOW`` block boundaries
#: and, when ``LEAN_LADDER``, the power-of-two ladder (a lab lever, ``lean-ladder``).
LEAN_WINDOW = 2
LEAN_LADDER = False


def unknown_policy_message(label: str, value: object, expected: tuple[str, ...]) -> str:
    """The error text for a policy value that is not in ``expected``.

    Args:
        label: what carried the value (``"checkpoint policy"``, a command-line option).
        value: the value as given.
        expected: the accepted names.

    Returns:
        ``"<label>=<value!r> is not a checkpoint policy; expected one of ..."``, followed by the
        retirement note of :data:`RETIRED_POLICIES` when ``value`` names a retired policy.
    """
    msg = f"{label}={value!r} is not a checkpoint policy; expected one of {', '.join(expected)}"
    note = RETIRED_POLICIES.get(str(value).strip().lower()) if isinstance(value, str) else None
    return f"{msg}. {note}" if note else msg


@dataclass(frozen=True)
class SplitRule:
    """A checkpoint policy's chunk-end rule (the extension point of this module).

    Attributes:
        name: the policy name (used in scheduler class names, ``<Name>Checkpoint<Base>``, and in
            errors); must not be ``upstream`` or ``gdn``.
        chunk_tokens: ``(start, num_new_tokens, prefill_end, block_size) -> int``, all in
            tokens: how many of the ``num_new_tokens`` vLLM scheduled from ``start`` to run in
            this step. Called only for a prefill chunk (``0 < num_new_tokens``,
            ``start < prefill_end``); must return ``0 < result <= num_new_tokens``
            (:func:`policy_chunk_tokens` raises ``ValueError`` otherwise). Pure, host-only.
        description: one line for reports.
    """

    name: str
    chunk_tokens: Callable[[int, int, int, int], int]
    description: str = ""


def _check(name: str, value: int, minimum: int) -> None:
    if not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def _lean_chunk_tokens(start: int, num_new_tokens: int, prefill_end: int, block_size: int) -> int:
    from vllm_hybrid_npu_lab.scheduling.retention import extra_stops

    return extra_stops(start, num_new_tokens, prefill_end, block_size, LEAN_WINDOW, LEAN_LADDER)


#: ``lean``'s chunk ends (:func:`.retention.extra_stops` with :data:`LEAN_WINDOW`).
LEAN_RULE = SplitRule(
    "lean", _lean_chunk_tokens, "chunk ends at the prompt's last 2 block boundaries"
)

#: Policy name -> its rule (``upstream`` has none: vLLM's split unchanged).
SPLIT_RULES: dict[str, SplitRule] = {"lean": LEAN_RULE}


def split_rule(policy: str | SplitRule) -> SplitRule | None:
    """The :class:`SplitRule` of ``policy``: ``None`` for ``upstream``, the rule itself for a
    :class:`SplitRule`, :data:`SPLIT_RULES` otherwise.

    Raises:
        ValueError: an unknown name (the message says why a retired one is gone).
    """
    if isinstance(policy, SplitRule):
        return policy
    if policy == "upstream":
        return None
    rule = SPLIT_RULES.get(policy)
    if rule is None:
        raise ValueError(unknown_policy_message("checkpoint policy", policy, POLICY_NAMES))
    return rule


def policy_chunk_tokens(
    start: int,
    num_new_tokens: int,
    prefill_end: int,
    block_size: int,
    policy: str | SplitRule,
) -> int:
    """Shorten a prefill chunk so that it ends at the policy's next checkpoint stop.

    Applied *after* vLLM's own align-mode split, to the number of tokens it chose; the result
    is never larger than ``num_new_tokens``, so the chunk limit, the prompt's last block
    boundary, the shared-prefix junction and the spec-decode adjustments upstream made stay
    in force. Decode steps (``start >= prefill_end``) and chunks without a stop strictly inside
    them are returned unchanged, so a prompt shorter than one block is never split.

    Args:
        start: tokens already computed for the request, cache hits included (upstream's
            ``request.num_computed_tokens + num_new_local_computed_tokens +
            num_external_computed_tokens``).
        num_new_tokens: tokens upstream schedules in this step (>= 0).
        prefill_end: end of the prefill in tokens (upstream's
            ``max(request.num_prompt_tokens, request.num_tokens - 1)``).
        block_size: hybrid block size in tokens (>= 1).
        policy: one of :data:`POLICY_NAMES`, or a :class:`SplitRule`.

    Returns:
        The number of tokens to schedule, ``0 < result <= num_new_tokens`` when
        ``num_new_tokens > 0`` (0 stays 0).

    Raises:
        ValueError: unknown ``policy``, negative arguments, or a rule returning a result out of
        ``(0, num_new_tokens]``.
    """
    _check("start", start, 0)
    _check("num_new_tokens", num_new_tokens, 0)
    _check("prefill_end", prefill_end, 0)
    _check("block_size", block_size, 1)
    rule = split_rule(policy)
    if rule is None or num_new_tokens == 0 or start >= prefill_end:
        return num_new_tokens
    n = rule.chunk_tokens(start, num_new_tokens, prefill_end, block_size)
    if not 0 < n <= num_new_tokens:
        raise ValueError(
            f"split rule {rule.name!r} returned {n!r} tokens for a chunk of {num_new_tokens} "
            f"from {start}; expected 0 < tokens <= {num_new_tokens}"
        )
    return n


def checkpoint_positions(
    prompt_len: int, block_size: int, policy: str | SplitRule, chunk_limit: int
) -> list[int]:
    """Step ends of a cold prefill of ``prompt_len`` tokens, as upstream + ``policy`` cut it.

    A model of upstream's split for one request alone in the batch with no cache hit and no
    junction (vLLM 0.30/0.32 ``_mamba_block_aligned_split``: chunks limited to ``chunk_limit``
    tokens and rounded down to a block boundary, a stop at the prompt's last block boundary),
    followed by :func:`policy_chunk_tokens`. Used for documentation and tests of the number of
    prefill steps a policy costs; the engine itself uses vLLM's split.

    Returns:
        The increasing list of step end positions (tokens); the last one is ``prompt_len``.
    """
    _check("prompt_len", prompt_len, 1)
    _check("chunk_limit", chunk_limit, block_size)
    ends: list[int] = []
    start = 0
    last_boundary = prompt_len // block_size * block_size
    while start < prompt_len:
        end = min(prompt_len, start + chunk_limit)
        if end < prompt_len:
            end = max(end // block_size * block_size, start + 1)
        if start < last_boundary < end:
            end = last_boundary
        n = policy_chunk_tokens(start, end - start, prompt_len, block_size, policy)
        start += n
        ends.append(start)
    return ends
