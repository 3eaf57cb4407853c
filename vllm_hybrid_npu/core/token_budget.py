"""The token budget in align mode: no extra engine step for a chunked cold prefill.

Pure logic (no vLLM import at module load). In align mode vLLM ends every chunk of a chunked
prefill but the last on a block boundary (``Scheduler._mamba_block_aligned_split``, vLLM 0.30.0
and 0.32.0: ``aligned_end = end // block_size * block_size``), so with a token budget
(``--max-num-batched-tokens``) that is not a multiple of the hybrid block each non-final chunk
loses the budget's remainder: vLLM's default budget of 16,384 tokens and Qwen3.5-35B-A3B's block
of 1,088 (H100, FlashAttention, with the prefill-checkpoint exporter) give chunks of 15 x 1,088 =
16,320 tokens, so a 32,768-token prompt takes 16,320 + 16,320 + 128, three steps where caching
off takes two (docs/patches.md#token-budget). A budget rounded up to the next block multiple
(17,408) gives two.

The hybrid block is fixed only in the worker, after the model is built
(``Platform.update_block_size_for_backend``, after ``Worker.load_model``), while the model
runner sizes its persistent input buffers, the profiling run and the compile ranges from
``max_num_batched_tokens`` before that. So the budget is raised while the configuration is
built, from the block :func:`predict_block` computes with vLLM's own rule
(``Platform._align_hybrid_block_size``), and checked against the real block once it is known
(:func:`check_budget`); see :mod:`vllm_hybrid_npu.patches.vllm_config`.
"""

from __future__ import annotations

import dataclasses

from vllm_hybrid_npu.core.prefill_checkpoints import aligned_block_size


def round_up(budget: int, block: int) -> int:
    """The smallest multiple of ``block`` at or above ``budget`` (tokens).

    Raises:
        ValueError: a non-positive budget or block (the message names both).
    """
    if budget <= 0 or block <= 0:
        raise ValueError(f"token budget {budget} and block {block} must be positive")
    return -(-budget // block) * block


def cold_prefill_steps(prompt_tokens: int, budget: int, block: int | None = None) -> int:
    """Engine steps of one cold prompt alone until its first token (tokens in, steps out).

    ``block`` None: caching off (chunks of ``budget`` tokens). Else align mode with the
    prefill-checkpoint exporter: every chunk but the last ends on a block boundary (vLLM's
    ``_mamba_block_aligned_split``: the chunk's end rounded down to a block multiple when that
    still advances, else, for a block wider than the budget, the chunk as it is); the last chunk
    needs no boundary (the exporter writes the checkpoint from inside it). vLLM's own split
    without the exporter stops once more at the prompt's last block boundary; not modelled here.

    Raises:
        ValueError: a non-positive prompt, budget or block.
    """
    if prompt_tokens <= 0 or budget <= 0 or (block is not None and block <= 0):
        raise ValueError(f"prompt {prompt_tokens}, budget {budget}, block {block}: must be positive")
    start, steps = 0, 0
    while start < prompt_tokens:
        end = min(start + budget, prompt_tokens)
        if block is not None and end < prompt_tokens:
            aligned = end // block * block
            if aligned > start or block <= budget:
                end = aligned
            if start % block and end > (start // block + 1) * block:
                end = (start // block + 1) * block
        start, steps = end, steps + 1
    return steps


def predict_block(
    attn_page_per_token: int,
    mamba_page: int,
    min_kernel_block: int,
    block_size: int,
    grid: int | None = None,
) -> int:
    """The hybrid block (tokens) vLLM 0.30.0 / 0.32.0 will choose, from what the configuration
    holds before the model exists, with the exporter's rounding to ``grid`` on top.

    Mirrors ``Platform._align_hybrid_block_size`` (``vllm/platforms/interface.py``, align and
    none modes): kernel alignment ``A = max(min_kernel_block, block_size)``, attention block
    ``A * cdiv(mamba_page, A * attn_page_per_token)``, the larger of that and ``block_size``;
    then, where the GDN prefill-checkpoint exporter applies, the plugin's
    ``gdn-checkpoint-block-size`` entry rounds it up to a multiple of ``grid`` (64,
    :func:`vllm_hybrid_npu.core.prefill_checkpoints.aligned_block_size`).

    Args:
        attn_page_per_token: bytes of one token of one attention layer's KV cache.
        mamba_page: bytes of one layer's recurrent state (conv + SSM).
        min_kernel_block: the attention backend's smallest kernel block (tokens; FlashAttention
            16, vLLM's CPU backend 32).
        block_size: the configured block (tokens) at that point: the user's ``--block-size``,
            the backend's preferred block, or the CPU platform's 128.
        grid: the exporter's alignment, or None where it does not apply.

    Raises:
        ValueError: a non-positive argument.
    """
    if min(attn_page_per_token, mamba_page, min_kernel_block, block_size) <= 0:
        raise ValueError("page sizes, kernel block and block size must be positive")
    align = max(min_kernel_block, block_size)
    attn_block = align * -(-mamba_page // (align * attn_page_per_token))
    block = max(block_size, attn_block)
    return aligned_block_size(block, grid) if grid else block


@dataclasses.dataclass(frozen=True)
class Decision:
    """What :func:`decide` makes of a token budget.

    Attributes:
        action: ``"raise"`` (the budget becomes ``new_budget``), ``"keep"`` (already a block
            multiple, or raising would not help) or ``"advise"`` (the user's budget stays; the
            message says which budget would save the step).
        budget: the budget found (tokens).
        new_budget: the budget after the decision (tokens; ``budget`` unless raised).
        block: the hybrid block the decision used (tokens).
        message: one line for the log: what changed or would change, and why.
    """

    action: str
    budget: int
    new_budget: int
    block: int
    message: str


def decide(budget: int, block: int, defaulted: bool, long_prefill_threshold: int = 0,
           owner: str = "yours") -> Decision:
    """Round the token budget up to a multiple of the hybrid block where that saves a step.

    Args:
        budget: ``max_num_batched_tokens`` (tokens).
        block: the hybrid block (tokens).
        defaulted: True when the budget is vLLM's default (the user set neither
            ``--max-num-batched-tokens`` nor ``--max-num-scheduled-tokens``); an explicit
            budget is never changed (``"advise"``).
        long_prefill_threshold: vLLM's ``long_prefill_token_threshold`` (0: off); a positive
            threshold below the rounded budget caps each long prefill's chunk anyway, so the
            budget is kept.
        owner: whose budget an ``"advise"`` message names (``"yours"``, or vLLM's default that
            could not be raised at start-up).

    Raises:
        ValueError: a non-positive budget or block.
    """
    target = round_up(budget, block)
    if target == budget:
        return Decision("keep", budget, budget, block,
                        f"token budget {budget} is a multiple of the hybrid block {block}")
    example = 2 * budget
    before, after = cold_prefill_steps(example, budget, block), cold_prefill_steps(example, target, block)
    off = cold_prefill_steps(example, budget)
    why = (f"in align mode vLLM ends every non-final prefill chunk on a block boundary, so a "
           f"budget of {budget} tokens makes chunks of {budget // block * block} "
           f"({budget // block} blocks of {block}): a cold {example}-token prompt takes "
           f"{before} steps where caching off takes {off}; at {target} it takes {after}")
    if 0 < long_prefill_threshold < target:
        return Decision("keep", budget, budget, block,
                        f"token budget {budget} kept: long_prefill_token_threshold "
                        f"{long_prefill_threshold} caps each prefill chunk below {target}")
    if not defaulted:
        return Decision("advise", budget, budget, block,
                        f"--max-num-batched-tokens {budget} ({owner}) kept; "
                        f"--max-num-batched-tokens {target} would save a step: {why}")
    return Decision("raise", budget, target, block,
                    f"max_num_batched_tokens {budget} (vLLM's default) -> {target} "
                    f"({target // block} blocks of {block}, +{target - budget} tokens): {why}")


def check_budget(scheduled: int, batched: int, original: int, block: int) -> tuple[int, str | None]:
    """Once the real hybrid block is known: the scheduler's budget to use, and a warning.

    A raised budget whose predicted block was wrong is brought to the real block's multiple
    within the runner's buffers: ``max_num_scheduled_tokens`` may be below
    ``max_num_batched_tokens`` (vLLM's own contract), never above it.

    Args:
        scheduled: ``max_num_scheduled_tokens`` now (tokens).
        batched: ``max_num_batched_tokens`` (the runner's buffers; tokens).
        original: vLLM's default budget before the raise (tokens).
        block: the real hybrid block (tokens).

    Returns:
        ``(scheduled budget, None)`` when it is (now) a block multiple at or above
        ``original``, else ``(scheduled, warning naming the budget to set)``.

    Raises:
        ValueError: a non-positive argument.
    """
    if min(scheduled, batched, original, block) <= 0:
        raise ValueError("budgets and block must be positive")
    if scheduled % block == 0 and scheduled >= original:
        return scheduled, None
    want = round_up(original, block)
    if want <= batched:
        return want, None
    return scheduled, (f"token budget {scheduled} is not a multiple of the hybrid block {block} "
                       f"(predicted otherwise at start-up); --max-num-batched-tokens {want} "
                       f"saves the extra prefill step")
