"""Host time of the worker's GDN checkpoint plan per prefill step, against a base commit.

``python -m benchmarks.plan_host_time --base-site DIR [--tokens 8192 32768] [--block 1088]
[--budget 16384] [--groups 3] [--calls 4] [--steps 200] [--json FILE]``

What it times: ``gdn_prefill_checkpoint.build_checkpoints`` (the GDN metadata builder's share
of the plugin: the plan, the uploads of its integers and the gather of each group's checkpoint
blocks), once for each of ``--groups`` GDN KV-cache groups of a step, as vLLM 0.30's V2 runner
calls it (``build_attn_metadata``: one ``build`` per group), on CPU tensors. The step is the
CUDA serving benchmark's cold prompt (``benchmarks/cuda_serving.py``: Qwen3.5-35B-A3B width,
block 1,088 tokens (the exporter's), a 16,384-token budget, two clients): a prompt of ``--tokens`` in
budget-sized chunks, each chunk's crossed block boundaries and its own checkpoint listed by the
engine (``gdn_step_checkpoints.plan``: a fresh payload each step), beside one decode row; the
exporter's Triton path (``fused``).

Rows, each call its own process, alternated (``--calls`` a row, pooled medians):

* ``base``: the package at ``--base-site`` first on ``sys.path`` (``pip install --no-deps
  --target DIR`` of another commit, or a checkout's root);
* ``head``: this checkout's package.

Prints a table (median microseconds per step and per group build; ratio head / base of the same
run) and writes one JSON object (``--json``) with every call's samples. A CPU tensor op costs
less host time than a CUDA one (no launch, no pinned staging), so the ratio, not the
microseconds, is what carries to a GPU; the GPU number is the CUDA benchmark's
(``--host-breakdown``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROWS = ("base", "head")
ROOT = Path(__file__).resolve().parent.parent

WORKER = r"""
import json, sys, time, types
cfg = json.loads(sys.argv[1])
import torch
import vllm_hybrid_npu
from vllm_hybrid_npu.core import prefill_checkpoints as core
from vllm_hybrid_npu.patches import gdn_prefill_checkpoint as gpc
from vllm_hybrid_npu.support import Stack

torch.set_num_threads(1)
stack = Stack("cuda", "0.30.0")
block, groups, budget = cfg["block"], cfg["groups"], cfg["budget"]
spec = types.SimpleNamespace(block_size=block, num_prefill_checkpoint_blocks=1,
                             prefill_checkpoint_alignment=core.ALIGNMENT)
config = types.SimpleNamespace(
    speculative_config=None, use_v2_model_runner=True, kv_transfer_config=None,
    cache_config=types.SimpleNamespace(prefix_match_unit=None),
    parallel_config=types.SimpleNamespace(decode_context_parallel_size=1))
class Builder:  # identity equality, as vLLM's builders (a SimpleNamespace compares fields)
    kv_cache_spec, vllm_config = spec, config

builders = []
for g in range(groups):
    b = Builder()
    vars(b)["_vhn_exporter_path"] = {stack: "triton"}
    builders.append(b)
width = -(-cfg["tokens"] // block) + 2
tables = [torch.arange(2 * width, dtype=torch.int32).view(2, width) + 1000 * g for g in range(groups)]
runner = types.SimpleNamespace(
    attn_groups=[[types.SimpleNamespace(metadata_builders=[b])] for b in builders],
    input_batch=types.SimpleNamespace(req_ids=["d", "p"]))
metadata = types.SimpleNamespace(num_prefills=1, num_decodes=1, spec_sequence_masks=None)
kernel_meta = lambda b, d: None

def steps(prompt):
    # (start, end) of each budget-sized chunk of the cold prompt (the decode row takes one
    # token; a chunk ends on the 64-token grid, where the one pass stores states)
    start = 0
    while start < prompt:
        n = min((budget - 1) // 64 * 64, prompt - start)
        yield start, start + n
        start += n

def step_lists(start, end):
    # the engine's list: each block boundary the chunk crosses, then its own checkpoint
    out = []
    for p in range((start // block + 1) * block, end, block):
        out.append((p, "crossed"))
    if out:
        out[-1] = (out[-1][0], "prompt")
    return out

samples, per_group = [], []
prompt = cfg["tokens"]
for i in range(cfg["warm"] + cfg["steps"]):
    ctx = 37 + i  # a fresh plan each step (the decode row's length)
    for start, end in steps(prompt):
        entries = step_lists(start, end)
        payload = {g: {"p": tuple((p, tables[g][1, p // block - 1].item(), k) for p, k in entries)}
                   for g in range(groups)} if entries else {}
        common = types.SimpleNamespace(
            num_reqs=2, query_start_loc_cpu=torch.tensor([0, 1, 1 + end - start], dtype=torch.int32),
            seq_lens_cpu_upper_bound=torch.tensor([ctx, end], dtype=torch.int32))
        token = gpc.STEP.set((runner, payload)) if payload else None
        try:
            t0 = time.perf_counter_ns()
            for g in range(groups):
                common.block_table_tensor = tables[g]
                ck = gpc.build_checkpoints(builders[g], common, metadata, stack, kernel_meta)
            t1 = time.perf_counter_ns()
        finally:
            if token is not None:
                gpc.STEP.reset(token)
        want = [tables[-1][1, p // block - 1].item() for p, _ in entries]
        assert (ck.slots.tolist() if ck is not None else []) == want, (ck, want)
        if i >= cfg["warm"]:
            samples.append((t1 - t0) / 1000)
print("RESULT " + json.dumps({"row": cfg["row"], "package": vllm_hybrid_npu.__file__,
                              "samples_us": samples}))
"""


def run_call(row: str, base_site: str, cfg: dict) -> dict:
    """One call of ``row`` in its own process; returns the worker's RESULT object."""
    env = dict(os.environ)
    path = [base_site] if row == "base" else [str(ROOT)]
    env["PYTHONPATH"] = os.pathsep.join(path + [env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    out = subprocess.run([sys.executable, "-c", WORKER, json.dumps({**cfg, "row": row})],
                         env=env, capture_output=True, text=True, check=False, cwd="/")
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    if out.returncode or not lines:
        raise RuntimeError(f"row {row}: worker failed (rc {out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.plan_host_time",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-site", required=True,
                    help="directory whose vllm_hybrid_npu is the base row's (a checkout or a pip --target)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768], help="cold prompt lengths")
    ap.add_argument("--block", type=int, default=1088, help="GDN block size, tokens")
    ap.add_argument("--budget", type=int, default=16384, help="max_num_batched_tokens")
    ap.add_argument("--groups", type=int, default=3, help="GDN KV-cache groups")
    ap.add_argument("--calls", type=int, default=4, help="calls a row, alternated")
    ap.add_argument("--steps", type=int, default=200, help="timed prompts a call")
    ap.add_argument("--warm", type=int, default=50, help="untimed prompts first")
    ap.add_argument("--json", help="write every sample here")
    args = ap.parse_args(argv)
    if not (Path(args.base_site) / "vllm_hybrid_npu").is_dir():
        ap.error(f"--base-site {args.base_site}: no vllm_hybrid_npu package there")
    result = {"args": vars(args), "calls": []}
    for tokens in args.tokens:
        cfg = dict(tokens=tokens, block=args.block, budget=args.budget, groups=args.groups,
                   steps=args.steps, warm=args.warm)
        for call in range(args.calls):
            for row in ROWS:
                out = run_call(row, args.base_site, cfg)
                result["calls"].append({"tokens": tokens, "call": call, **out})
    print(f"{'tokens':>7} {'row':>5} {'us/step':>9} {'us/group':>9} {'head/base':>9}")
    table = []
    for tokens in args.tokens:
        med = {}
        for row in ROWS:
            pooled = [s for c in result["calls"] if c["tokens"] == tokens and c["row"] == row
                      for s in c["samples_us"]]
            med[row] = statistics.median(pooled)
        for row in ROWS:
            ratio = med[row] / med["base"]
            table.append({"tokens": tokens, "row": row, "median_us_per_step": med[row],
                          "ratio_to_base": ratio})
            print(f"{tokens:>7} {row:>5} {med[row]:>9.1f} {med[row] / args.groups:>9.1f} {ratio:>9.3f}")
    result["table"] = table
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
