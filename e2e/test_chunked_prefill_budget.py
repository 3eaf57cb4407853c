"""No extra engine step for a chunked cold prefill in align mode (issue 30, item 3), on the real
engine (in-process, tiny random Qwen3-Next, one engine at a time).

vLLM's default token budget on the e2e target (the CPU backend's ``LLM`` default, 4,096) is not a
multiple of the hybrid block where vLLM stores float32 SSM states (block 384 on a CPU with
AVX-512-BF16), and in align mode vLLM ends every non-final chunk of a chunked prefill on a block
boundary. Checked, on a prompt length drawn fresh between ``B + c`` and ``2 B`` (``B`` the budget,
``c`` the budget floored to blocks: where the unrounded budget needs a third chunk and caching off
two):

* caching off's engine keeps vLLM's budget and takes two prefill steps;
* the exporter's engine with vLLM's default budget runs at the next block multiple (the
  ``token-budget`` entry; the scheduler's budget too) and takes the steps of caching off;
* the same engine with that default passed explicitly keeps it (never overridden) and takes
  ``1 + ceil((L - B) / c)`` steps: the extra step the entry removes (so this test fails without
  it);
* the repeat hits the prompt's last block boundary in both, and the rounded engine's tokens
  equal caching off's (exact on CPU, the near-tie rule elsewhere).

Where the junction entries run every prefill chunk to the budget's end (vLLM 0.30's CPU path,
issue 38 item 4) no chunk ends on the block grid: the entry leaves vLLM's default alone and both
caching engines take caching off's steps.

Where the default already is a block multiple (bf16 SSM states, block 256, on a CPU without
AVX-512: ``make test-no-avx512``) there is no step to save: the length is drawn between ``B`` and
``2 B``, and the test checks that the entry leaves the budget alone and that both caching engines
take caching off's two steps.
"""

from __future__ import annotations

import math
import os

import pytest
from engines import count_scheduled_steps, exporter_outside_stack, shutdown_engine  # e2e/engines.py
from greedy_compare import Sequence, compare_greedy, compare_outputs  # e2e/greedy_compare.py
from vllm_hybrid_npu.envs import OPTIONS_ENV, with_option

_OUTSIDE = exporter_outside_stack()
pytestmark = pytest.mark.skipif(_OUTSIDE is not None, reason=f"exporter not applied: {_OUTSIDE}")

KV_BYTES = 512 << 20
TIE_NATS = 0.1  # as e2e/test_prefill_checkpoints.py: a cross-schedule difference must be a near-tie


def _budget(model, engine_args) -> int:
    """vLLM's default token budget for ``LLM`` on this target (the configuration only)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext

    args = EngineArgs(model=str(model), **engine_args, enable_prefix_caching=False)
    return args.create_engine_config(usage_context=UsageContext.LLM_CLASS).scheduler_config.max_num_batched_tokens


def _run(model, engine_args, caching: bool, make_prompt, **extra):
    """One engine: ``(budget, scheduler budget, block, prompt, [(output, prefill steps)] of the
    prompt and its repeat)``; ``make_prompt(block)`` draws the prompt once the block is known."""
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    mp.setenv(OPTIONS_ENV, with_option(os.environ.get(OPTIONS_ENV, ""), "budget", None))  # default
    from vllm import LLM, SamplingParams

    kw = {**engine_args, "kv_cache_memory_bytes": KV_BYTES, **extra}
    if caching:
        kw.update(enable_prefix_caching=True, mamba_cache_mode="align")
    else:
        kw.update(enable_prefix_caching=False)
    llm = LLM(model=str(model), **kw)
    try:
        core = llm.llm_engine.engine_core.engine_core
        block = core.vllm_config.cache_config.block_size
        prompt = make_prompt(block)
        steps = count_scheduled_steps(llm)
        sp = SamplingParams(max_tokens=4, temperature=0.0, logprobs=5)
        outs = []
        for _ in range(2):
            n0 = len(steps)
            (out,) = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)
            # prefill steps: the steps until the prompt's uncached tokens are scheduled (the
            # decode steps after them schedule one token each)
            todo, n = len(prompt) - out.num_cached_tokens, 0
            for tokens in steps[n0:]:
                todo, n = todo - tokens, n + 1
                if todo <= 0:
                    break
            outs.append((out, n))
        sched = core.vllm_config.scheduler_config
        return sched.max_num_batched_tokens, core.scheduler.max_num_scheduled_tokens, block, prompt, outs
    finally:
        shutdown_engine(llm)
        mp.undo()


def _chunks_end_at_the_budget() -> bool:
    """Whether the junction entries run prefill chunks to the token budget's end here (vLLM
    0.30, the CPU exporter path; ``gdn_junction.BUDGET_VERSIONS``): then the ``token-budget``
    entries stand aside."""
    from vllm_hybrid_npu.patches import gdn_junction

    return gdn_junction.budget_applied()


def test_chunked_cold_prefill_takes_the_steps_of_caching_off(tiny_model_dir, engine_args, rng,
                                                             exact_across_schedules):
    model = tiny_model_dir("qwen3_next")
    budget = _budget(model, engine_args)
    max_len = int(engine_args.get("max_model_len", 8192))
    drawn = {}

    def make_prompt(block):
        chunk = budget // block * block
        # the unrounded budget's third chunk starts past B + c; with B a block multiple (c = B)
        # there is none, and any length in (B, 2 B] takes two steps everywhere
        lo = budget + (chunk if budget % block else 0)
        hi = min(2 * budget, max_len - 8)
        assert hi > lo, f"no prompt length in ({lo}, {hi}] (max_model_len {max_len})"
        drawn.update(block=block, chunk=chunk, length=rng.randrange(lo + 1, hi + 1))
        return [rng.randrange(100, 900) for _ in range(drawn["length"])]

    # first the engine with the budget passed explicitly: kept, and the prompt drawn for its block
    mine, mine_sched, block, prompt, ctl = _run(model, engine_args, True, make_prompt,
                                                max_num_batched_tokens=budget)
    length, chunk = drawn["length"], drawn["chunk"]
    off_budget, _, _, _, off = _run(model, engine_args, False, lambda b: prompt)
    rounded, scheduled, block_r, _, exp = _run(model, engine_args, True, lambda b: prompt)

    assert off_budget == budget
    assert off[0][1] == math.ceil(length / budget) == 2, (length, budget, off[0][1])
    assert block_r == block and scheduled == rounded
    assert exp[0][1] == off[0][1], f"{length} tokens: {exp[0][1]} steps at {rounded}, caching off {off[0][1]}"
    assert mine == mine_sched == budget  # an explicit budget is always kept
    if _chunks_end_at_the_budget():
        # the junction entries run each chunk to the budget's end (issue 38 item 4): nothing to
        # round, and the explicit budget takes caching off's steps too
        assert rounded == budget and ctl[0][1] == off[0][1], (rounded, ctl[0][1], off[0][1])
    else:
        # the default is raised to the next block multiple, and the scheduler runs it; an
        # explicit budget costs the step the entry saves (none where the default is a block
        # multiple: then the entry left it)
        assert rounded == -(-budget // block) * block, (rounded, budget, block)
        assert ctl[0][1] == 1 + math.ceil((length - budget) / chunk), (ctl[0][1], length, chunk)
        if budget % block:
            assert ctl[0][1] > off[0][1], (ctl[0][1], off[0][1], length, chunk)
        else:
            assert rounded == budget and ctl[0][1] == off[0][1], (rounded, ctl[0][1], off[0][1])
    # hits do not fall: the repeat hits the last block boundary inside the prompt
    want = (length - 1) // block * block
    assert exp[1][0].num_cached_tokens == ctl[1][0].num_cached_tokens == want
    assert off[1][0].num_cached_tokens == 0
    ref, got = [Sequence.from_output(off[0][0].outputs[0])], [Sequence.from_output(exp[0][0].outputs[0])]
    c = compare_outputs(ref, got, exact=exact_across_schedules)
    if not c.ok:
        tie = compare_greedy(ref, got, bound=TIE_NATS)
        assert tie.ok, "\n".join(c.errors + tie.errors) + "\n" + tie.summary()
