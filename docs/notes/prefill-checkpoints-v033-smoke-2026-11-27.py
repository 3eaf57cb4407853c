"""Session script of issue 32 (2026-11-27): one in-process engine per mode on the tiny random Qwen3-Next,
one prompt (seed 1) sent twice; prints the steps, the hits and the declared spec. Usage (vLLM 0.33.0
smoke venv, VLLM_TARGET_DEVICE=cpu): python THIS exporter|split TOKENS [PREFIX_MATCH_UNIT]"""
import os, sys, json
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
mode, n, pmu = sys.argv[1], int(sys.argv[2]), (int(sys.argv[3]) if len(sys.argv) > 3 else None)
os.environ["VLLM_HYBRID_NPU_PREFILL_CHECKPOINTS"] = "auto" if mode == "exporter" else "off"
from vllm import LLM, SamplingParams
from vllm_hybrid_npu.tools.make_model import default_model_dir
from vllm_hybrid_npu.tools.server import CPU_SAFE_ENGINE_ARGS
import random
extra = {"prefix_match_unit": pmu} if pmu else {}
llm = LLM(model=str(default_model_dir("qwen3_next")), enable_prefix_caching=True,
          **{**CPU_SAFE_ENGINE_ARGS, "kv_cache_memory_bytes": 256 << 20, **extra})
core = llm.llm_engine.engine_core.engine_core
steps = []
sched = core.scheduler.schedule
def counted(*a, **k):
    out = sched(*a, **k)
    if out.total_num_scheduled_tokens: steps.append(out.total_num_scheduled_tokens)
    return out
core.scheduler.schedule = counted
rng = random.Random(1)
prompt = [rng.randrange(100, 900) for _ in range(n)]
sp = SamplingParams(max_tokens=1, temperature=0.0)
res = []
for _ in range(2):
    s0 = len(steps)
    (o,) = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)
    res.append({"steps": len(steps) - s0, "hit": o.num_cached_tokens, "token": o.outputs[0].token_ids[0]})
spec = [g.kv_cache_spec for g in core.scheduler.kv_cache_config.kv_cache_groups if hasattr(g.kv_cache_spec, "num_prefill_checkpoint_blocks")][0]
print("RESULT", json.dumps({"mode": mode, "n": n, "pmu": pmu, "block": core.vllm_config.cache_config.block_size,
      "declared": [spec.num_prefill_checkpoint_blocks, spec.prefill_checkpoint_alignment],
      "cache_hit_alignment": core.vllm_config.cache_config.cache_hit_alignment_tokens, "runs": res}))
