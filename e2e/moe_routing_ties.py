"""Why the tiny Qwen3-Next routes every token to both its experts (make_model.NUM_EXPERTS).

Not a test: the measurement behind ``make_model``'s format 2. One in-process vLLM engine, prefix
caching off (``--align``: align mode), ``max_num_batched_tokens=128``, nothing patched
(``VLLM_HYBRID_NPU_PATCHES=none``). A prompt P of ``--len`` fresh tokens is generated (1 greedy
token, top 20 logprobs) alone, then next to a 1-token request still decoding: alone P is
prefilled as 128 + rest, batched as 127 + rest, so bf16 rounds the two differently in the last
bits. With format 1's top-2 of 4 experts a router whose 2nd and 3rd logits (nearly) tie sends
a token to another expert pair between the two runs: an O(1) change that the GDN/attention
states carry to the last position. Printed per model: the sampled token of each run, how many of the top 20
tokens the runs share, the largest logprob difference of a shared token, and how many
(position, layer) routings differ.

    PYTHONPATH=$PWD python e2e/moe_routing_ties.py [--seed N] [--len 200] [--align] [--draws N]

Builds (once, under ``$VLLM_HYBRID_NPU_CACHE``) format 1's checkpoint with
``make_model.build_model(..., num_experts=4, experts_per_token=2)`` (the same draw as format 1);
the default checkpoint has 2 experts and routes to both.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_HYBRID_NPU_PATCHES", "none")


def measure(model: str, prompts: list[list[int]], align: bool) -> list[dict]:
    """Run each prompt alone and batched on ``model``; per prompt: tokens, top-20 overlap, largest
    logprob difference of a shared token (nats), routing differences."""
    from engines import shutdown_engine
    from vllm import LLM, SamplingParams

    kw = dict(enable_prefix_caching=True, mamba_cache_mode="align") if align else dict(
        enable_prefix_caching=False)
    llm = LLM(model=model, max_model_len=1024, max_num_seqs=2, max_num_batched_tokens=128,
              kv_cache_memory_bytes=12_000_000, enforce_eager=True, seed=0, **kw)
    net = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner.model
    k = net.config.num_experts_per_tok
    cur, route = {}, {}
    net.register_forward_pre_hook(
        lambda m, a, kw_: cur.update(pos=kw_.get("positions", a[1] if len(a) > 1 else None)),
        with_kwargs=True)
    for name, mod in net.named_modules():
        if name.endswith("mlp.gate"):
            def hook(m, a, out, layer=int(name.split(".")[2])):
                logits = (out[0] if isinstance(out, tuple) else out).float()
                chosen = logits.topk(k, dim=-1).indices.sort(dim=-1).values
                for row, pos in enumerate(cur["pos"].tolist()):
                    if pos >= 8:  # P's positions only (the other request has fewer tokens)
                        route[(pos, layer)] = tuple(chosen[row].tolist())
            mod.register_forward_hook(hook)
    sp = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, logprobs=20)
    out = []
    for i, prompt in enumerate(prompts):
        runs = {}
        route.clear()
        runs["alone"] = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
        alone_route = dict(route)
        route.clear()
        # a different first token each time, so the partner request never hits a cached block
        runs["batched"] = llm.generate(
            [{"prompt_token_ids": [5 + i]}, {"prompt_token_ids": prompt}],
            [SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), sp], use_tqdm=False)[1]
        tops = {n: {t: lp.logprob for t, lp in r.outputs[0].logprobs[0].items()}
                for n, r in runs.items()}
        shared = set(tops["alone"]) & set(tops["batched"])
        out.append({
            "experts_per_token": k,
            "experts": net.config.num_experts,
            "tokens": {n: r.outputs[0].token_ids[0] for n, r in runs.items()},
            "top20_shared": len(shared),
            "max_shared_logprob_diff": max(
                (abs(tops["alone"][t] - tops["batched"][t]) for t in shared), default=float("nan")),
            "routings_differing": sum(1 for key, v in alone_route.items() if route.get(key, v) != v),
            "routings": len(alone_route),
        })
    shutdown_engine(llm)
    del llm
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=None, help="prompt seed (default: fresh, printed)")
    ap.add_argument("--len", type=int, default=200, help="prompt tokens")
    ap.add_argument("--align", action="store_true", help="prefix caching on, align mode")
    ap.add_argument("--draws", type=int, default=1, help="prompts (one line each with --draws 1)")
    args = ap.parse_args(argv)
    from vllm_hybrid_npu.tools.make_model import build_model, cache_root, default_model_dir

    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    rng = random.Random(seed)
    prompts = [[rng.randrange(10, 2000) for _ in range(args.len)] for _ in range(args.draws)]
    fmt1 = cache_root() / "models" / "tiny-qwen3_next-s0-format1"
    if not (fmt1 / "config.json").exists():
        build_model(fmt1, num_experts=4, experts_per_token=2)
    print(f"prompt seed {seed}, {args.draws} prompt(s) of {args.len} tokens, "
          f"{'align mode' if args.align else 'caching off'}")
    for model in (str(fmt1), str(default_model_dir("qwen3_next"))):
        rs = measure(model, prompts, args.align)
        if args.draws == 1:
            r = rs[0]
            print(f"top-{r['experts_per_token']} of {r['experts']}: tokens {r['tokens']}, top-20 shared "
                  f"{r['top20_shared']}, max |d logprob| of shared {r['max_shared_logprob_diff']:.3f} "
                  f"nats, routings differing {r['routings_differing']} of {r['routings']}", flush=True)
            continue
        far = [r for r in rs if r["top20_shared"] < 10 or r["max_shared_logprob_diff"] > 1.0]
        print(f"top-{rs[0]['experts_per_token']} of {rs[0]['experts']}: {len(far)} of {len(rs)} prompts with fewer than 10 "
              f"of the top 20 shared or a shared token > 1 nat apart; largest shared difference "
              f"{max(r['max_shared_logprob_diff'] for r in rs):.3f} nats; prompts with a routing "
              f"difference {sum(1 for r in rs if r['routings_differing'])}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
