"""Scheduler-side counters on a real vLLM engine (tiny Qwen3-Next, align mode): the state
moves and bytes the scheduler hook counts from the schedule equal the copies the worker's
``preprocess_mamba`` actually makes (counted here by wrapping vLLM's ``collect_mamba_copy_meta``
in the same process), with chunked prefill inside a block, prefix-cache hits and preemption;
every missed prompt token gets exactly one reason.

Engine arguments and worker environment are the e2e target's (e2e/conftest.py): on CUDA the V1
GPU model runner, since vLLM 0.30's V2 runner copies states in its own fused kernel and never
calls ``collect_mamba_copy_meta``, the worker-side count this test compares with.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

WORKLOAD = r"""
import gc, json, os, random, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from vllm import LLM, SamplingParams
import vllm.v1.worker.mamba_utils as mu
from vllm_hybrid_npu.patches import vllm_v1_core_sched_scheduler as hook

worker = {"moves": 0, "bytes": 0}
orig = mu.collect_mamba_copy_meta
def counting(copy_bufs, kv_cache_config, funcs, group_ids, src, dst, bias, *a, **k):
    start = copy_bufs.offset
    orig(copy_bufs, kv_cache_config, funcs, group_ids, src, dst, bias, *a, **k)
    if copy_bufs.offset > start:
        worker["moves"] += 1
        worker["bytes"] += int(copy_bufs.sizes.np[start:copy_bufs.offset].sum())
mu.collect_mamba_copy_meta = counting

seed, model = int(sys.argv[1]), sys.argv[2]
out = {}
for name, kv in (("normal", 12_000_000), ("tiny", 2_400_000)):
    # the tiny budget (18 blocks) preempts with vLLM's own two state blocks per request; the
    # prefill-checkpoint exporter's third one would not fit a max-length request there
    os.environ["VLLM_HYBRID_NPU_PREFILL_CHECKPOINTS"] = "off" if name == "tiny" else "auto"
    worker.update(moves=0, bytes=0)
    base = dict(gpu_memory_utilization=0.05, enforce_eager=True, seed=0)
    base.update(json.loads(os.environ.get("VLLM_HYBRID_NPU_E2E_ENGINE_ARGS") or "{}"))  # target's
    llm = LLM(model=model, enable_prefix_caching=True, mamba_cache_mode="align",
              kv_cache_memory_bytes=kv, max_model_len=1024, max_num_seqs=4,
              max_num_batched_tokens=128, disable_log_stats=False, **base)
    core = llm.llm_engine.engine_core.engine_core
    bs = core.scheduler.kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
    rng = random.Random(seed)
    long = [rng.randrange(10, 2000) for _ in range(2 * bs + 40)]
    prompts = [long[: bs // 3], long, long[: bs + 5] + [7] * 30,
               [rng.randrange(10, 2000) for _ in range(bs + bs // 2)]]
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    cached = []
    for _ in range(2):
        res = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        cached += [[len(p), r.num_cached_tokens] for p, r in zip(prompts, res)]
    pre = [m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions"]
    out[name] = {"bs": bs, "worker": dict(worker), "sched": hook.totals(core.scheduler),
                 "cached": cached, "preemptions": pre[0] if pre else None}
    llm.llm_engine.engine_core.shutdown()  # e2e/engines.py says why
    del llm, core
    gc.collect()
print("RESULT " + json.dumps(out))
"""


def test_scheduler_counts_equal_the_worker_copies(tiny_model_dir):
    seed = random.randrange(1 << 30)
    model = str(tiny_model_dir("qwen3_next"))
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_PLUGINS", "VLLM_HYBRID_NPU_PATCHES")}
    env.update(json.loads(os.environ.get("VLLM_HYBRID_NPU_E2E_WORKER_ENV") or "{}"))  # target's
    proc = subprocess.run([sys.executable, "-c", WORKLOAD, str(seed), model], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"seed={seed}\n{proc.stderr[-6000:]}"
    runs = json.loads([l for l in proc.stdout.splitlines() if l.startswith("RESULT ")][-1][7:])
    assert runs["tiny"]["preemptions"] > 0, f"seed={seed}: the tiny KV budget must preempt"
    for name, r in runs.items():
        s, w = r["sched"], r["worker"]
        assert w["moves"] > 0, (name, seed)
        assert (s["state_copies"], s["state_copy_bytes"]) == (w["moves"], w["bytes"]), (name, seed, r)
        # every request classified once, every missed token once
        assert s["requests"] == len(r["cached"]), (name, seed)
        assert s["prompt_tokens"] == sum(n for n, _ in r["cached"]), (name, seed)
        assert s["hit_tokens"] == sum(c for _, c in r["cached"]), (name, seed)
        missed = sum(s[k] for k in ("partial_block", "drafter_drop", "no_state", "evicted",
                                    "evicted_host", "new"))
        assert missed == s["prompt_tokens"] - s["hit_tokens"], (name, seed)
        # the prompt shorter than one block (twice): nothing but partial_block for it
        bs = r["bs"]
        assert s["partial_block"] >= 2 * (bs // 3), (name, seed)
        assert s["evicted_host"] == 0 and s["drafter_drop"] == 0, (name, seed)  # no drafter
