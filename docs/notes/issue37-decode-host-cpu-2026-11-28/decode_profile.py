"""Per step of a decode-heavy generate on CPU (4 prompts of 200 tokens, 300 tokens each, vLLM 0.30, tiny Qwen3-Next): host time (cProfile tottime, profiler overhead included) in the plugin's frames and in vLLM's align-mode worker frames (v1/worker/mamba_utils.py). python THIS.py exporter|vllm-align|off"""
import cProfile, json, os, pstats, sys, time
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
mode = sys.argv[1]  # exporter | vllm-align | off
if mode == "vllm-align":
    os.environ["VLLM_HYBRID_NPU_PREFILL_CHECKPOINTS"] = "off"
from vllm import LLM, SamplingParams
from vllm_hybrid_npu.tools.make_model import default_model_dir
from vllm_hybrid_npu.tools.server import CPU_SAFE_ENGINE_ARGS
kw = dict(CPU_SAFE_ENGINE_ARGS)
kw.update(enable_prefix_caching=(mode != "off"), kv_cache_memory_bytes=256 << 20)
if mode != "off":
    kw["mamba_cache_mode"] = "align"
llm = LLM(model=str(default_model_dir("qwen3_next")), **kw)
core = llm.llm_engine.engine_core.engine_core
steps = []
sched = core.scheduler.schedule
def counted(*a, **k):
    out = sched(*a, **k); steps.append(out.total_num_scheduled_tokens); return out
core.scheduler.schedule = counted
import random
rng = random.Random(1)
prompts = [{"prompt_token_ids": [rng.randrange(100, 900) for _ in range(200)]} for _ in range(4)]
sp = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)
llm.generate(prompts[:1], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
steps.clear()
pr = cProfile.Profile()
t = time.perf_counter(); pr.enable()
llm.generate(prompts, sp, use_tqdm=False)
pr.disable(); wall = time.perf_counter() - t
st = pstats.Stats(pr)
ours = sum(v[2] for k, v in st.stats.items() if "vllm_hybrid_npu" in k[0])  # tottime
mamba = sum(v[2] for k, v in st.stats.items() if k[0].endswith("v1/worker/mamba_utils.py"))
calls = {f"{os.path.basename(k[0])}:{k[2]}": (v[1], round(v[2] * 1e3, 2)) for k, v in st.stats.items() if "vllm_hybrid_npu" in k[0] and v[2] > 0}
n = len([s for s in steps if s])
print(json.dumps({"mode": mode, "steps": n, "decode_steps": sum(1 for s in steps if 0 < s <= 4),
                  "wall_ms_per_step": round(wall * 1e3 / n, 3), "ours_us_per_step": round(ours * 1e6 / n, 1),
                  "vllm_mamba_utils_us_per_step": round(mamba * 1e6 / n, 1),
                  "ours_top": sorted(calls.items(), key=lambda kv: -kv[1][1])[:8]}))
