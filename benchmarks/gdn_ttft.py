"""Cold-request time to first token: GDN in-step checkpoints vs upstream align mode (issue 8).

``python -m benchmarks.gdn_ttft [--model DIR] [--blocks 1 2 4 8] [--repeats 5]
[--json FILE]``

Two real vLLM engines on the same tiny model, alive at the same time (each with its own
engine-core process), fed alternately so that a shared, noisy CPU affects both alike:

* ``upstream``: ``--enable-prefix-caching --mamba-cache-mode align`` with vLLM's own
  ``Scheduler`` named explicitly (so no checkpoint policy of this plugin applies): a prompt of
  more than one block is prefilled in two steps (vLLM cuts it at the prompt's last block
  boundary to store a state there);
* ``gdn``: ``--mamba-cache-mode all`` with ``GdnCheckpointScheduler`` (what
  ``VLLM_HYBRID_NPU_CHECKPOINTS=gdn`` selects): one step, the GDN layers run in block segments
  and leave a state at every boundary.

For each repeat and prompt size (``n`` blocks of the *gdn* engine's block size plus half a block),
each engine gets a fresh random prompt (cold: asserted to have no prefix hit) with
``max_tokens=1``; the wall time of ``LLM.generate`` is the time to first token. The order of the
two engines alternates per repeat. Prints a table (median ms per engine, the ratio gdn /
upstream measured in the same run, the block size and prefill steps of each) and one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

UPSTREAM_SCHEDULER = "vllm.v1.core.sched.scheduler.Scheduler"
GDN_SCHEDULER = "vllm_hybrid_npu.scheduling.scheduler.GdnCheckpointScheduler"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model directory (default: tiny Qwen3-Next)")
    parser.add_argument("--blocks", type=int, nargs="+", default=[1, 2, 4, 8],
                        help="prompt sizes in blocks (each prompt gets half a block more)")
    parser.add_argument("--repeats", type=int, default=5, help="runs per size and engine")
    parser.add_argument("--json", default=None, help="also write the JSON result to this file")


def _steps(tokens: int, block: int, budget: int, mode: str) -> int:
    """Prefill steps of a cold prompt: ``all`` runs to the token budget; ``align`` also ends a
    step at the prompt's last block boundary (vLLM 0.30 ``_mamba_block_aligned_split``)."""
    if mode == "all":
        return -(-tokens // budget)
    last = tokens // block * block
    head = -(-last // budget) if last else 0
    return head + (1 if tokens > last else 0)


def run(args: argparse.Namespace) -> int:
    if args.repeats < 1 or any(b < 1 for b in args.blocks):
        raise SystemExit("--repeats and --blocks must be >= 1")
    from vllm import LLM, SamplingParams

    from vllm_hybrid_npu.tools.server import CPU_SAFE_ENGINE_ARGS

    model = args.model
    if model is None:
        from vllm_hybrid_npu.tools.make_model import default_model_dir

        model = str(default_model_dir("qwen3_next"))
    common = {**CPU_SAFE_ENGINE_ARGS, "kv_cache_memory_bytes": 256 << 20, "max_num_seqs": 4}
    engines = {
        "upstream": LLM(model=model, enable_prefix_caching=True, mamba_cache_mode="align",
                        scheduler_cls=UPSTREAM_SCHEDULER, **common),
        "gdn": LLM(model=model, enable_prefix_caching=True, mamba_cache_mode="all",
                   scheduler_cls=GDN_SCHEDULER, **common),
    }
    info = {}
    for name, llm in engines.items():
        cfg = llm.llm_engine.vllm_config
        info[name] = {"mode": cfg.cache_config.mamba_cache_mode,
                      "block_size": cfg.cache_config.block_size,
                      "max_num_batched_tokens": cfg.scheduler_config.max_num_batched_tokens}
    if info["gdn"]["mode"] != "all":
        raise SystemExit(f"gdn engine runs mamba_cache_mode={info['gdn']['mode']!r}, not 'all'")
    bs = info["gdn"]["block_size"]
    vocab = min(engines["gdn"].llm_engine.model_config.get_vocab_size(), 1000)
    sp = SamplingParams(max_tokens=1, temperature=0)
    rng = random.Random()

    def once(name: str, n_tokens: int) -> float:
        prompt = [rng.randrange(10, vocab) for _ in range(n_tokens)]
        t0 = time.perf_counter()
        out = engines[name].generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
        dt = time.perf_counter() - t0
        assert out.num_cached_tokens == 0, "benchmark prompt was not cold"
        return dt

    names = list(engines)
    for n in args.blocks:  # warm-up: first calls of a step shape pay one-off costs
        for name in names:
            once(name, n * bs + bs // 2)
    print("warm-up done", file=sys.stderr, flush=True)
    times: dict[tuple[int, str], list[float]] = {}
    for r in range(args.repeats):
        order = names if r % 2 == 0 else names[::-1]
        for n in args.blocks:
            for name in order:
                times.setdefault((n, name), []).append(once(name, n * bs + bs // 2))
        print(f"repeat {r + 1}/{args.repeats} done", file=sys.stderr, flush=True)

    rows = []
    for n in args.blocks:
        tokens = n * bs + bs // 2
        row = {"blocks": n, "prompt_tokens": tokens, "engines": {}}
        ref = statistics.median(times[(n, "upstream")])
        for name in names:
            med = statistics.median(times[(n, name)])
            e = info[name]
            row["engines"][name] = {
                "ttft_ms_median": round(med * 1e3, 2),
                "ttft_ms_min": round(min(times[(n, name)]) * 1e3, 2),
                "ttft_ms_all": [round(t * 1e3, 2) for t in times[(n, name)]],
                "ratio_to_upstream": round(med / ref, 3),
                "prefill_steps": _steps(tokens, e["block_size"], e["max_num_batched_tokens"],
                                        e["mode"]),
            }
        rows.append(row)
    result = {"model": model, "engines": info, "repeats": args.repeats, "rows": rows}
    print(f"engines: {json.dumps(info)}; {args.repeats} repeats, median TTFT")
    print(f"{'blocks':>6} {'tokens':>6} {'upstream ms':>12} {'steps':>5} {'gdn ms':>9} "
          f"{'steps':>5} {'gdn/up':>7}")
    for row in rows:
        u, g = row["engines"]["upstream"], row["engines"]["gdn"]
        print(f"{row['blocks']:>6} {row['prompt_tokens']:>6} {u['ttft_ms_median']:>12.1f} "
              f"{u['prefill_steps']:>5} {g['ttft_ms_median']:>9.1f} {g['prefill_steps']:>5} "
              f"{g['ratio_to_upstream']:>7.3f}")
    text = json.dumps(result)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gdn_ttft",
                                     description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
