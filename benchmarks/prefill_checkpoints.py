"""Cold prompts on vLLM's CPU engine: caching off vs vLLM's align-mode split vs the exporter.

``python -m benchmarks.prefill_checkpoints [--model DIR] [--blocks 1 2 4] [--repeats 5]
[--json FILE]``

Rows, each in its own process (one in-process vLLM engine, enforce-eager, the CPU-safe engine
arguments of :data:`vllm_hybrid_npu.tools.server.CPU_SAFE_ENGINE_ARGS`):

* ``off``: ``enable_prefix_caching=False``;
* ``split``: align mode, ``VLLM_HYBRID_NPU_PREFILL_CHECKPOINTS=off`` (vLLM's block-aligned split);
* ``exporter``: align mode, the plugin's default (GDN prefill checkpoints exported in the step).

Per row, for each prompt size (``n`` blocks of the block size vLLM chose plus half a block, so the
prompt does not end on a boundary) and repeat, a fresh random prompt (cold) is generated with
``max_tokens=1``; its time to first token is the wall time of that ``LLM.generate`` call (ms).
Counted per cold prompt: engine steps that computed tokens (scheduler outputs with scheduled
tokens) and the time spent in vLLM's CPU GDN function (``_cpu_gdn_attention_nonspec``, all GDN
layers; with the exporter that includes its second round and state copy), so the exporter's cost
shows as GDN time over caching off's. Prompts are drawn from ``--seed`` (printed), the same for
every row.

Prints a table (medians, ratios to ``off`` of the same run) and writes one JSON object
(``--json``) with every sample. The numbers are this machine's: a 2-core CPU shared with
other work; ratios within a run are what to read.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

ROWS = ("off", "split", "exporter")

WORKER = r"""
import json, os, random, sys, time
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
cfg = json.loads(sys.argv[1])
os.environ["VLLM_HYBRID_NPU_PREFILL_CHECKPOINTS"] = "off" if cfg["row"] == "split" else "auto"
from vllm import LLM, SamplingParams
from vllm_hybrid_npu.tools.server import CPU_SAFE_ENGINE_ARGS
import vllm.model_executor.layers.mamba.ops.cpu.gdn_attention as gdn

kw = dict(CPU_SAFE_ENGINE_ARGS, enforce_eager=True)
if cfg["row"] == "off":
    kw["enable_prefix_caching"] = False
else:
    kw.update(enable_prefix_caching=True, mamba_cache_mode="align")
llm = LLM(model=cfg["model"], **kw)
core = llm.llm_engine.engine_core.engine_core
block = core.vllm_config.cache_config.block_size
steps = [0]
schedule = core.scheduler.schedule
def counted(*a, **k):
    out = schedule(*a, **k)
    steps[0] += bool(out.total_num_scheduled_tokens)
    return out
core.scheduler.schedule = counted
gdn_s = [0.0]
inner = gdn._cpu_gdn_attention_nonspec
def timed(*a, **k):
    t = time.perf_counter()
    try:
        return inner(*a, **k)
    finally:
        gdn_s[0] += time.perf_counter() - t
gdn._cpu_gdn_attention_nonspec = timed
sp = SamplingParams(max_tokens=1, temperature=0)
llm.generate([{"prompt_token_ids": [5] * (block + 7)}], sp, use_tqdm=False)  # warm-up
samples = []
for n in cfg["blocks"]:
    for r in range(cfg["repeats"]):
        rng = random.Random(f"{cfg['seed']}:{n}:{r}")
        prompt = [rng.randrange(100, 900) for _ in range(n * block + block // 2)]
        s0, g0 = steps[0], gdn_s[0]
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)
        samples.append({"blocks": n, "tokens": len(prompt), "ttft_ms": (time.perf_counter() - t) * 1e3,
                        "steps": steps[0] - s0, "gdn_ms": (gdn_s[0] - g0) * 1e3})
print("RESULT " + json.dumps({"row": cfg["row"], "block_size": block, "samples": samples}))
"""


def run_row(row: str, model: str, blocks: list[int], repeats: int, seed: int) -> dict:
    """One row in its own process; returns its ``{"row", "block_size", "samples"}``.

    Raises:
        RuntimeError: the row's process failed (its stderr tail in the message)."""
    cfg = json.dumps({"row": row, "model": model, "blocks": blocks, "repeats": repeats, "seed": seed})
    proc = subprocess.run([sys.executable, "-c", WORKER, cfg], capture_output=True, text=True,
                          timeout=3600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"row {row} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def summarize(rows: dict[str, dict]) -> list[dict]:
    """Per (row, size): medians of TTFT (ms), steps and GDN time (ms), and ratios to ``off``."""
    out = []
    sizes = sorted({s["blocks"] for r in rows.values() for s in r["samples"]})
    for n in sizes:
        med = {}
        for name, r in rows.items():
            xs = [s for s in r["samples"] if s["blocks"] == n]
            med[name] = {k: statistics.median(s[k] for s in xs) for k in ("ttft_ms", "steps", "gdn_ms")}
            med[name]["tokens"] = xs[0]["tokens"]
        for name in rows:
            m = med[name]
            base = med.get("off")
            out.append({
                "row": name, "blocks": n, "prompt_tokens": m["tokens"], "cold_ttft_ms": m["ttft_ms"],
                "cold_ttft_vs_off": m["ttft_ms"] / base["ttft_ms"] if base else None,
                "steps_per_cold_prompt": m["steps"], "gdn_ms": m["gdn_ms"],
                "gdn_ms_over_off": m["gdn_ms"] - base["gdn_ms"] if base else None,
            })
    return out


def table(summary: list[dict]) -> str:
    head = (f"{'row':<9} {'blocks':>6} {'tokens':>6} {'TTFT ms':>8} {'/off':>6} {'steps':>5} "
            f"{'GDN ms':>7} {'GDN-off':>8}")
    lines = [head, "-" * len(head)]
    for s in summary:
        ratio = f"{s['cold_ttft_vs_off']:.2f}" if s["cold_ttft_vs_off"] is not None else "-"
        over = f"{s['gdn_ms_over_off']:+.1f}" if s["gdn_ms_over_off"] is not None else "-"
        lines.append(f"{s['row']:<9} {s['blocks']:>6} {s['prompt_tokens']:>6} {s['cold_ttft_ms']:>8.1f} "
                     f"{ratio:>6} {s['steps_per_cold_prompt']:>5.0f} {s['gdn_ms']:>7.1f} {over:>8}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.prefill_checkpoints",
                                description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model directory (default: tiny Qwen3-Next)")
    p.add_argument("--blocks", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--rows", nargs="+", default=list(ROWS), choices=ROWS)
    p.add_argument("--seed", type=int, default=None, help="prompt seed (default: fresh, printed)")
    p.add_argument("--json", default=None, metavar="FILE")
    args = p.parse_args(argv)
    if min(args.blocks) < 1 or args.repeats < 1:
        p.error("--blocks and --repeats take positive integers")
    if args.model is None:
        from vllm_hybrid_npu.tools.make_model import default_model_dir

        args.model = str(default_model_dir("qwen3_next"))
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    print(f"seed {seed}", file=sys.stderr)
    rows = {}
    for row in args.rows:
        t = time.time()
        rows[row] = run_row(row, args.model, args.blocks, args.repeats, seed)
        print(f"row {row}: {time.time() - t:.0f} s, block {rows[row]['block_size']}", file=sys.stderr)
    summary = summarize(rows)
    print(table(summary))
    report = {"seed": seed, "model": args.model, "rows": summary, "raw": rows,
              "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv)}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
