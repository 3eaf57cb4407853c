"""Align mode on the CUDA target with vLLM's defaults there (V2 GPU model runner, CUDA graphs and
``torch.compile`` on, FLA/Triton GDN kernels), and vLLM's CPU-offloading KV connector
(``--kv-offloading-size``) in align mode. Skips where the e2e target is not CUDA.

In-process engines (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) on the tiny random Qwen3-Next, one after
the other: prefix caching off; align mode with the plugin (its default on CUDA); align mode with a
1 GiB host tier and a GPU KV cache small enough that a flood of other prompts evicts the first
ones from the GPU. Prompts are drawn fresh (``seed_for``: the seed is printed on failure).
"""

from __future__ import annotations

import gc
import random

import pytest

pytestmark = pytest.mark.cuda

def _gen(llm, prompts, max_tokens=6):
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": list(p)} for p in prompts], sp, use_tqdm=False)


def _counter(llm, name):
    return sum(m.value for m in llm.get_metrics() if m.name == name and hasattr(m, "value"))


@pytest.fixture(scope="module")
def runs(tiny_model_dir, engine_args, request, seed_for):
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM

    model = str(tiny_model_dir("qwen3_next"))
    out = {}
    rng = random.Random(seed_for(request, "prompts"))
    prompts = None
    for name, kw in [
        ("off", dict(enable_prefix_caching=False)),
        ("align", dict(enable_prefix_caching=True, mamba_cache_mode="align")),
        ("offload", dict(enable_prefix_caching=True, mamba_cache_mode="align", kv_offloading_size=1.0,
                         kv_cache_memory_bytes=24 << 20)),
    ]:
        llm = LLM(model=model, **{**engine_args, "disable_log_stats": False, **kw})
        cfg = llm.llm_engine.vllm_config
        bs = cfg.cache_config.block_size
        if prompts is None:
            draw = lambda n: [rng.randrange(10, 2000) for _ in range(n)]  # noqa: E731
            shared = draw(3 * bs + bs // 2)
            prompts = {
                "repeat": [shared + draw(bs // 3) for _ in range(3)],
                "flood": [draw(4 * bs) for _ in range(24)],
            }
        r = {"bs": bs, "cudagraph_mode": str(cfg.compilation_config.cudagraph_mode),
             "runner": type(llm.llm_engine.engine_core.engine_core.model_executor.driver_worker
                            .worker.model_runner).__module__}
        first = _gen(llm, prompts["repeat"][:1])
        r["repeat"] = first + _gen(llm, prompts["repeat"][1:])
        r["again"] = _gen(llm, prompts["repeat"][:1])
        if name == "offload":
            ext0 = _counter(llm, "vllm:external_prefix_cache_hits")
            for i in range(0, len(prompts["flood"]), 4):  # evicts the repeats from the GPU tier
                _gen(llm, prompts["flood"][i:i + 4], 1)
            r["after_flood"] = _gen(llm, prompts["repeat"][:1])
            r["external_hits"] = _counter(llm, "vllm:external_prefix_cache_hits") - ext0
        out[name] = r
        del llm
        gc.collect()
    yield prompts, out
    mp.undo()


def _toks(outs):
    return [list(o.outputs[0].token_ids) for o in outs]


def test_cuda_defaults_in_use(runs):
    _, out = runs
    for name, r in out.items():
        assert r["cudagraph_mode"] != "CUDAGraphMode.NONE", (name, r["cudagraph_mode"])
    assert "worker.gpu." in out["align"]["runner"] + ".", out["align"]["runner"]  # V2 runner


def test_align_hits_shared_prefix_and_equals_off(runs):
    prompts, out = runs
    bs = out["align"]["bs"]
    cached = [o.num_cached_tokens for o in out["align"]["repeat"]]
    assert cached[0] == 0 and all(c > 0 and c % bs == 0 for c in cached[1:]), (cached)
    assert _toks(out["align"]["repeat"]) == _toks(out["off"]["repeat"])
    assert _toks(out["align"]["again"]) == _toks(out["off"]["again"])
    assert out["align"]["again"][0].num_cached_tokens > 0


def test_kv_offloading_host_tier_hits_and_equal_outputs(runs):
    _, out = runs
    off = out["offload"]
    assert off["external_hits"] > 0, (off["external_hits"])
    assert off["after_flood"][0].num_cached_tokens > 0
    assert _toks(off["after_flood"]) == _toks(out["off"]["again"])
    assert _toks(off["repeat"]) == _toks(out["off"]["repeat"])
