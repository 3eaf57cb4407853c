"""Measure how far two schedules of the same greedy computation drift apart on the tiny model.

Not a test: the measurement behind :data:`greedy_compare.LOGPROB_BOUND` (docs/testing.md).
Runs vLLM 0.30.0 in-process on the tiny Qwen3-Next (``vllm-hybrid-npu make-model``), on
fresh random prompts, and compares per request with :func:`greedy_compare.compare_greedy` at
an unbounded tolerance, printing: requests identical, near-ties (position, logprob gaps), the
largest logprob difference of shared tokens, and the top-1 margin distribution.

Scenarios (the e2e tests' comparisons that are not bit-exact by construction):

* ``follow-up``: align mode, default checkpoint policy; turn 1 (8 blocks - 8 tokens, 12 tokens
  generated: the state at the 8-block boundary comes from the decode kernel), turn 2 = turn 1 +
  answer + a quarter block, generated with the prefix cache vs cold (fresh ``cache_salt``).
* ``control`` (power, not noise): the same last quarter block after two different 8-block
  prefixes, both cold: what a wrong or foreign state would do to the outputs.
* ``budget``: 4 concurrent prompts, caching on with a 128-token step budget shared by the 4
  (prompts chunked at non-64 splits) vs caching off unchunked (e2e/test_worker_patches.py).
* ``cold-align``: cold prompts, caching off vs align mode at vLLM's default block size
  (e2e/test_cuda_engine.py; on CUDA 144 tokens for the tiny model, off the 64-token grid).

Engines take the e2e target's arguments (``VLLM_HYBRID_NPU_E2E_TARGET``; e2e/conftest.py):
``VLLM_HYBRID_NPU_E2E_TARGET=cuda`` on the GPU machine measures the CUDA kernels' noise.

    PYTHONPATH=$PWD python e2e/measure_on_off.py follow-up --draws 30 --seed 1
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import e2e_target, target_overrides  # noqa: E402
from engines import shutdown_engine  # noqa: E402
from greedy_compare import Sequence, compare_greedy  # noqa: E402

TOP = 5
BLOCK_SIZE = None  # cold-align: a user block size (vLLM aligns the hybrid block to a multiple)


def _args(**kw):
    """The e2e target's engine arguments (``$VLLM_HYBRID_NPU_E2E_TARGET``, e2e/conftest.py)
    with ``kw`` on top."""
    from vllm_hybrid_npu.tools.server import CPU_SAFE_ENGINE_ARGS

    return {**CPU_SAFE_ENGINE_ARGS, **target_overrides(e2e_target()), **kw}


def _sp(n):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=TOP)


def _margins(seqs):
    out = []
    for s in seqs:
        for pos in s.logprobs:
            v = sorted(pos.values(), reverse=True)
            out.append(v[0] - v[1])
    return out


def follow_up(model, draws, rng, gen):
    from vllm import LLM

    llm = LLM(model=model, enable_prefix_caching=True, mamba_cache_mode="align",
              **_args(kv_cache_memory_bytes=256 << 20, max_num_seqs=4))
    bs = llm.llm_engine.vllm_config.cache_config.block_size
    hit, cold = [], []
    for _ in range(draws):
        turn1 = [rng.randrange(10, 1000) for _ in range(8 * bs - 8)]
        ans = llm.generate([{"prompt_token_ids": turn1}], _sp(12), use_tqdm=False)[0]
        turn2 = turn1 + list(ans.outputs[0].token_ids) + [rng.randrange(10, 1000) for _ in range(bs // 4)]
        h = llm.generate([{"prompt_token_ids": turn2}], _sp(gen), use_tqdm=False)[0]
        c = llm.generate([{"prompt_token_ids": turn2, "cache_salt": uuid.uuid4().hex}], _sp(gen),
                         use_tqdm=False)[0]
        assert h.num_cached_tokens > 0 and c.num_cached_tokens == 0
        hit.append(Sequence.from_output(h.outputs[0]))
        cold.append(Sequence.from_output(c.outputs[0]))
    return bs, cold, hit


def control(model, draws, rng, gen):
    """Power check, not noise: the same last quarter block after two *different* 8-block
    prefixes (the state a wrong or foreign block would hand over), both cold."""
    from vllm import LLM

    llm = LLM(model=model, enable_prefix_caching=True, mamba_cache_mode="align",
              **_args(kv_cache_memory_bytes=256 << 20, max_num_seqs=4))
    bs = llm.llm_engine.vllm_config.cache_config.block_size
    a, b = [], []
    for _ in range(draws):
        suffix = [rng.randrange(10, 1000) for _ in range(bs // 4)]
        outs = []
        for _ in range(2):
            prompt = [rng.randrange(10, 1000) for _ in range(8 * bs)] + suffix
            outs.append(llm.generate([{"prompt_token_ids": prompt, "cache_salt": uuid.uuid4().hex}],
                                     _sp(gen), use_tqdm=False)[0])
        a.append(Sequence.from_output(outs[0].outputs[0]))
        b.append(Sequence.from_output(outs[1].outputs[0]))
    return bs, a, b


def budget(model, draws, rng, gen):
    from vllm import LLM

    def engine(pc, mnbt):
        kw = {"mamba_cache_mode": "align"} if pc else {}
        return LLM(model=model, enable_prefix_caching=pc,
                   **_args(kv_cache_memory_bytes=12_000_000, max_model_len=1024, max_num_seqs=4,
                           max_num_batched_tokens=mnbt), **kw)

    results = {}
    bs = None
    workloads = None
    for name, pc, mnbt in (("on", True, 128), ("off", False, 2048)):
        llm = engine(pc, mnbt)
        bs = bs or llm.llm_engine.vllm_config.cache_config.block_size
        if workloads is None:
            workloads = []
            for _ in range(draws):
                long = [rng.randrange(10, 2000) for _ in range(2 * bs + 40)]
                workloads.append([long[: bs // 3], long, long[: bs + 5] + [7] * 30,
                                  [rng.randrange(10, 2000) for _ in range(bs + bs // 2)]])
        seqs = []
        for prompts in workloads:
            for _ in range(2 if pc else 1):  # round 2 of caching on hits the cache
                res = llm.generate([{"prompt_token_ids": p} for p in prompts], _sp(gen), use_tqdm=False)
            seqs += [Sequence.from_output(r.outputs[0]) for r in res]
        results[name] = seqs
        shutdown_engine(llm)
        del llm
    return bs, results["off"], results["on"]


def cold_align(model, draws, rng, gen):
    """Cold prompts of 3.5 blocks + a third, caching off vs align mode at vLLM's *default* block
    size (the target's ``block_size`` dropped; e2e/test_cuda_engine.py): align mode splits each
    prompt at its last block boundary, caching off does not."""
    from vllm import LLM

    results, bs, prompts = {}, None, None
    for name, kw in (("off", {"enable_prefix_caching": False}),
                     ("align", {"enable_prefix_caching": True, "mamba_cache_mode": "align"})):
        args = {k: v for k, v in _args().items() if k != "block_size"}
        if BLOCK_SIZE:
            args["block_size"] = BLOCK_SIZE
        llm = LLM(model=model, **{**args, **kw})
        bs = bs or llm.llm_engine.vllm_config.cache_config.block_size
        if prompts is None:
            prompts = [[rng.randrange(10, 2000) for _ in range(3 * bs + bs // 2 + bs // 3)]
                       for _ in range(draws)]
        results[name] = [Sequence.from_output(llm.generate([{"prompt_token_ids": p}], _sp(gen),
                                                           use_tqdm=False)[0].outputs[0])
                         for p in prompts]
        shutdown_engine(llm)
        del llm
    return bs, results["off"], results["align"]


def main(argv=None):
    global TOP, BLOCK_SIZE
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("scenario", choices=["follow-up", "budget", "control", "cold-align"])
    ap.add_argument("--draws", type=int, default=30)
    ap.add_argument("--gen", type=int, default=8, help="greedy tokens per request")
    ap.add_argument("--seed", type=int, default=None, help="prompt seed (default: fresh, printed)")
    ap.add_argument("--model", default=None, help="checkpoint (default: the cached tiny Qwen3-Next)")
    ap.add_argument("--json", default=None, help="also write the per-request data here")
    ap.add_argument("--top", type=int, default=TOP, help="top logprobs per position (vLLM allows 20)")
    ap.add_argument("--block-size", type=int, default=None,
                    help="cold-align: --block-size given to vLLM (default: vLLM's own choice)")
    args = ap.parse_args(argv)
    TOP = args.top
    BLOCK_SIZE = args.block_size
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    from vllm_hybrid_npu.tools.make_model import default_model_dir

    model = args.model or str(default_model_dir("qwen3_next"))
    fn = {"follow-up": follow_up, "budget": budget, "control": control,
          "cold-align": cold_align}[args.scenario]
    bs, ref, got = fn(model, args.draws, random.Random(seed), args.gen)
    c = compare_greedy(ref, got, bound=float("inf"))
    m = sorted(_margins(ref))
    q = lambda f: m[min(len(m) - 1, int(f * len(m)))]  # noqa: E731
    print(json.dumps({
        "scenario": args.scenario, "target": e2e_target(), "seed": seed, "block_size": bs, "requests": c.requests,
        "identical": c.identical, "near_ties": c.near_ties, "positions": c.positions,
        "max_chosen_logprob_diff": c.max_chosen_diff,
        "top1_margin_quantiles": {f: q(f) for f in (0.0, 0.01, 0.05, 0.5)},
    }))
    if args.json:
        Path(args.json).write_text(json.dumps({"ref": [s.to_json() for s in ref],
                                               "got": [s.to_json() for s in got]}))


if __name__ == "__main__":
    main()
