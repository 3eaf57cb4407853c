"""Cached prompt tokens of shared-prefix repeats and of a follow-up turn, per checkpoint policy.

``python -m vllm_hybrid_npu_lab.repro_hits [--policy upstream|tail|adaptive|lean|gdn] [--model DIR]``

One in-process vLLM engine (align mode, prefix caching on, tiny Qwen3-Next by default). Prints
one ``RESULT`` line per case and a final JSON object:

* ``repeats``: for suffix lengths 10 and 100, four prompts = the same 3,000-token random prefix +
  a distinct random suffix, sent one after another; their ``RequestOutput.num_cached_tokens``.
* ``follow_up``: a first turn of 2,040 (12 output tokens) or 1,800 (300 output tokens) prompt
  tokens, then a second turn = first prompt + its output + 50 new tokens; the second turn's
  cached tokens.

``--policy upstream`` names vLLM's own ``Scheduler`` with ``scheduler_cls``; ``lean`` passes the
lab's ``LeanCheckpointScheduler`` (:mod:`vllm_hybrid_npu_lab.scheduling`; the runtime's
``VLLM_HYBRID_NPU_CHECKPOINTS=lean`` until 2026-11-25, placement is vLLM's since); ``tail`` / ``adaptive`` (retired from the runtime on
2026-11-23, lab only) pass the class built from :mod:`.retired_policies`' split rule (an in-process
engine takes a class as ``scheduler_cls``). (``gdn``, 'all' mode for GDN, was retired on
2026-11-25: the runtime's prefill-checkpoint exporter replaces it and runs by default.)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default="upstream", choices=["upstream", "tail", "adaptive", "lean"])
    parser.add_argument("--model", default=None, help="model directory (default: tiny Qwen3-Next)")
    parser.add_argument("--engine-args", default="{}",
                        help='extra LLM(...) keyword arguments as JSON, e.g. '
                        '\'{"prefix_cache_retention_interval": null}\'')
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams

    from vllm_hybrid_npu.tools.server import CPU_SAFE_ENGINE_ARGS

    model = args.model
    if model is None:
        from vllm_hybrid_npu.tools.make_model import default_model_dir

        model = str(default_model_dir("qwen3_next"))
    kw = json.loads(args.engine_args)
    if not isinstance(kw, dict):
        raise SystemExit("--engine-args must be a JSON object")
    if args.policy == "upstream":
        kw["scheduler_cls"] = "vllm.v1.core.sched.scheduler.Scheduler"
    else:
        from vllm_hybrid_npu_lab.retired_policies import RULES
        from vllm_hybrid_npu_lab.scheduling.scheduler import scheduler_class

        kw["scheduler_cls"] = scheduler_class(RULES.get(args.policy, args.policy))
    mode = "align"
    llm = LLM(model=model, enable_prefix_caching=True, mamba_cache_mode=mode,
              **{**CPU_SAFE_ENGINE_ARGS, "kv_cache_memory_bytes": 256 << 20, **kw})
    result = {"policy": args.policy,
              "mamba_cache_mode": llm.llm_engine.vllm_config.cache_config.mamba_cache_mode,
              "block_size": llm.llm_engine.vllm_config.cache_config.block_size,
              "repeats": {}, "follow_up": {}}
    sp = SamplingParams(max_tokens=4, temperature=0)
    for trial, suffix in enumerate([10, 100]):
        rng = random.Random(trial + 1)
        prefix = [rng.randrange(10, 1000) for _ in range(3000)]
        prompts = [prefix + [rng.randrange(10, 1000) for _ in range(suffix)] for _ in range(4)]
        cached = [llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0].num_cached_tokens
                  for p in prompts]
        result["repeats"][f"suffix_{suffix}"] = cached
        print("RESULT", args.policy, "suffix", suffix, "cached", cached, flush=True)
    for n1, n_out in [(2040, 12), (1800, 300)]:
        rng = random.Random(n1)
        turn1 = [rng.randrange(10, 1000) for _ in range(n1)]
        out1 = llm.generate([{"prompt_token_ids": turn1}],
                            SamplingParams(max_tokens=n_out, temperature=0, ignore_eos=True),
                            use_tqdm=False)[0]
        turn2 = turn1 + list(out1.outputs[0].token_ids) + [rng.randrange(10, 1000) for _ in range(50)]
        out2 = llm.generate([{"prompt_token_ids": turn2}],
                            SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)[0]
        result["follow_up"][f"{n1}+{n_out}"] = out2.num_cached_tokens
        print("RESULT", args.policy, "follow-up", n1, n_out, "cached", out2.num_cached_tokens,
              flush=True)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
