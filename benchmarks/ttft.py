"""Time to first token of cold requests, upstream vs the checkpoint policies.

``python -m benchmarks.ttft [--model DIR] [--blocks 1 2 ... 8]
[--repeats 5] [--policies upstream lean [tail adaptive]] [--json FILE]``

One real vLLM engine (in-process engine core, align mode, prefix caching on, enforce-eager)
serves every run. For each repeat, each prompt size (``n`` blocks plus half a block, so that the
prompt is not block-aligned) and each policy, in an interleaved order (policies rotated per
repeat, because the CPU is shared with other work), a fresh random prompt (cold: no prefix hit)
is generated with ``max_tokens=1``; the wall time of that ``LLM.generate`` call is its time to
first token. Between runs the engine's scheduler is switched to the policy's chunk ends (the
engine runs a scheduler class built by ``scheduler_class`` from a :class:`SplitRule` that
delegates to the policy of the run; ``upstream`` returns vLLM's own split unchanged): the
policies differ only in ``_mamba_block_aligned_split`` and in state retention, and retention does
not touch a cold request's prefill, so one engine serves all policies fairly. Policies:
``upstream`` (vLLM's placement, the only one the runtime has since 2026-11-25) and the lab's
retired comparison rows ``lean`` (:mod:`vllm_hybrid_npu_lab.scheduling`), ``tail`` and
``adaptive`` (``vllm_hybrid_npu_lab/retired_policies.py``); the scheduler classes are the lab's,
installed with ``scheduler_cls`` (the runtime installs none).

Prints a table (median TTFT per policy in ms, the ratio to upstream measured in the same run,
the prefill steps each policy takes) and writes/prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model directory (default: tiny Qwen3-Next)")
    parser.add_argument("--arch", default="qwen3_next", help="tiny model arch when --model is unset")
    parser.add_argument("--blocks", type=int, nargs="+", default=list(range(1, 9)),
                        help="prompt sizes in blocks (each prompt gets half a block more)")
    parser.add_argument("--repeats", type=int, default=5, help="runs per size and policy")
    parser.add_argument("--policies", nargs="+", default=["upstream", "lean"],
                        help="upstream, or the lab's retired lean / tail / adaptive")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="engine token budget per step (default: vLLM's)")
    parser.add_argument("--json", default=None, help="also write the JSON result to this file")


def run(args: argparse.Namespace) -> int:
    from vllm_hybrid_npu_lab.scheduling.split import (
        POLICY_NAMES,
        SplitRule,
        checkpoint_positions,
        policy_chunk_tokens,
    )

    from vllm_hybrid_npu_lab.retired_policies import RULES

    known = (*POLICY_NAMES, *RULES)
    for p in args.policies:
        if p not in known:
            raise SystemExit(f"--policies: unknown policy {p!r}; expected {', '.join(known)}")
    rules = {p: RULES.get(p, p) for p in args.policies}  # name or SplitRule
    current = ["upstream"]

    def run_policy(start: int, n: int, prefill_end: int, block_size: int) -> int:
        return policy_chunk_tokens(start, n, prefill_end, block_size, rules[current[0]])
    if args.repeats < 1 or any(b < 1 for b in args.blocks):
        raise SystemExit("--repeats and --blocks must be >= 1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams

    from vllm_hybrid_npu.tools.server import CPU_SAFE_ENGINE_ARGS

    from vllm_hybrid_npu_lab.scheduling.scheduler import CheckpointPolicyMixin, scheduler_class

    model = args.model
    if model is None:
        from vllm_hybrid_npu.tools.make_model import default_model_dir

        model = str(default_model_dir(args.arch))
    kw = {}
    if args.max_num_batched_tokens:
        kw["max_num_batched_tokens"] = args.max_num_batched_tokens
    llm = LLM(model=model, enable_prefix_caching=True, mamba_cache_mode="align",
              scheduler_cls=scheduler_class(SplitRule("ttft-bench", run_policy)),
              **{**CPU_SAFE_ENGINE_ARGS, "kv_cache_memory_bytes": 256 << 20, "max_num_seqs": 4,
                 **kw})
    core = llm.llm_engine.engine_core.engine_core
    sched = core.scheduler
    assert isinstance(sched, CheckpointPolicyMixin)
    bs = llm.llm_engine.vllm_config.cache_config.block_size
    chunk_limit = llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    vocab = min(llm.llm_engine.model_config.get_vocab_size(), 1000)
    sp = SamplingParams(max_tokens=1, temperature=0)
    rng = random.Random(1234)

    def once(n_tokens: int) -> float:
        prompt = [rng.randrange(10, vocab) for _ in range(n_tokens)]
        t0 = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
        dt = time.perf_counter() - t0
        assert out.num_cached_tokens == 0, "benchmark prompt was not cold"
        return dt

    # warm-up: one discarded pass over every size and policy (first calls of a step shape pay
    # one-off costs on CPU)
    for n in args.blocks:
        for p in args.policies:
            current[0] = p
            once(n * bs + bs // 2)
    print("warm-up done", file=sys.stderr, flush=True)
    times: dict[tuple[int, str], list[float]] = {}
    for r in range(args.repeats):
        order = args.policies[r % len(args.policies):] + args.policies[: r % len(args.policies)]
        for n in args.blocks:
            for p in order:
                current[0] = p
                times.setdefault((n, p), []).append(once(n * bs + bs // 2))
        print(f"repeat {r + 1}/{args.repeats} done", file=sys.stderr, flush=True)

    rows = []
    for n in args.blocks:
        tokens = n * bs + bs // 2
        row = {"blocks": n, "prompt_tokens": tokens, "policies": {}}
        ref = statistics.median(times[(n, args.policies[0])])
        for p in args.policies:
            med = statistics.median(times[(n, p)])
            row["policies"][p] = {
                "ttft_ms_median": round(med * 1e3, 2),
                "ttft_ms_all": [round(t * 1e3, 2) for t in times[(n, p)]],
                "ratio_to_" + args.policies[0]: round(med / ref, 3),
                "prefill_steps": len(checkpoint_positions(tokens, bs, rules[p], chunk_limit)),
            }
        rows.append(row)
    result = {"model": model, "block_size": bs, "max_num_batched_tokens": chunk_limit,
              "repeats": args.repeats, "reference": args.policies[0], "rows": rows}

    head = f"{'blocks':>6} {'tokens':>6} " + " ".join(
        f"{p + ' ms':>14} {'x' + args.policies[0][:2]:>6} {'steps':>5}" for p in args.policies)
    print(f"block size {bs} tokens, token budget {chunk_limit}, {args.repeats} repeats, median TTFT")
    print(head)
    for row in rows:
        cells = " ".join(
            f"{row['policies'][p]['ttft_ms_median']:>14.1f} "
            f"{row['policies'][p]['ratio_to_' + args.policies[0]]:>6.3f} "
            f"{row['policies'][p]['prefill_steps']:>5d}" for p in args.policies)
        print(f"{row['blocks']:>6} {row['prompt_tokens']:>6} {cells}")
    text = json.dumps(result)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ttft",
                                     description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
