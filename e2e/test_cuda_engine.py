"""Align mode on the CUDA target with vLLM's defaults there (V2 GPU model runner, CUDA graphs and
``torch.compile`` on, FLA/Triton GDN kernels, vLLM's own block size), and vLLM's CPU-offloading
KV connector (``--kv-offloading-size``) in align mode, both with the plugin's GDN prefill-checkpoint
exporter (its default there): a cold prompt takes the engine steps of caching off, and the
checkpoint state it exported goes through the host tier and back. Skips where the e2e target is
not CUDA.

In-process engines (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) on the tiny random Qwen3-Next, one after
the other, each ended with :func:`engines.shutdown_engine`: prefix caching off; align mode with
the plugin (its default on CUDA); align mode with a 1 GiB host tier and a GPU KV cache small
enough that a flood of other prompts evicts the first ones from the GPU. Prompts are drawn fresh
(``seed_for``: the seed is printed on failure).

Why outputs are compared under :func:`greedy_compare.compare_greedy` here and not token for
token: this module keeps vLLM's default block size (the e2e target's ``block_size=64`` is
dropped), 144 tokens for the tiny model with FlashAttention's 16-token kernel blocks. Align mode
ends every prefill chunk but the last at a block boundary (vLLM 0.30
``Scheduler._mamba_block_aligned_split``: "never run past the last cacheable block boundary"),
so a cold prompt of 3.5 blocks is computed as 432 + 120 tokens with caching on and in one chunk
with it off; 432 is off the GDN kernels' 64-token chunk grid, and bf16 rounds the two chunkings
differently. The H100 run of 2026-11-23 compared tokens exactly and failed at the first token
of a cold request (docs/cuda.md). The bound is :data:`greedy_compare.CHUNKING_BOUND`, measured
on vLLM's CPU kernels; ``e2e/measure_on_off.py cold-align`` measures it on CUDA.
"""

from __future__ import annotations

import random

import pytest
from engines import count_scheduled_steps, metric_counter, shutdown_engine  # e2e/engines.py
from greedy_compare import CHUNKING_BOUND, Sequence, compare_greedy  # e2e/greedy_compare.py

pytestmark = pytest.mark.cuda

TOP_LOGPROBS = 20


def _gen(llm, prompts, max_tokens=6):
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True,
                        logprobs=TOP_LOGPROBS)
    return llm.generate([{"prompt_token_ids": list(p)} for p in prompts], sp, use_tqdm=False)


@pytest.fixture(scope="module")
def runs(tiny_model_dir, engine_args, request, seed_for):
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM

    model = str(tiny_model_dir("qwen3_next"))
    base = {k: v for k, v in engine_args.items() if k != "block_size"}  # vLLM's default
    out = {}
    rng = random.Random(seed_for(request, "prompts"))
    draw = lambda n: [rng.randrange(10, 2000) for _ in range(n)]  # noqa: E731
    prompts = None
    for name, kw in [
        ("off", dict(enable_prefix_caching=False)),
        ("align", dict(enable_prefix_caching=True, mamba_cache_mode="align")),
        ("offload", dict(enable_prefix_caching=True, mamba_cache_mode="align", kv_offloading_size=1.0,
                         kv_cache_memory_bytes=24 << 20)),
    ]:
        llm = LLM(model=model, **{**base, "disable_log_stats": False, **kw})
        steps = count_scheduled_steps(llm)
        cfg = llm.llm_engine.vllm_config
        bs = cfg.cache_config.block_size
        if prompts is None:
            shared = draw(3 * bs + bs // 2)
            prompts = {"repeat": [shared + draw(bs // 3) for _ in range(3)]}
        r = {"bs": bs, "num_gpu_blocks": cfg.cache_config.num_gpu_blocks,
             "cudagraph_mode": str(cfg.compilation_config.cudagraph_mode),
             "runner": type(llm.llm_engine.engine_core.engine_core.model_executor.driver_worker
                            .worker.model_runner).__module__}
        sched = type(llm.llm_engine.engine_core.engine_core.scheduler)
        r["scheduler"] = f"{sched.__module__}.{sched.__qualname__}"
        r["checkpoint_blocks"] = _checkpoint_blocks(llm)
        first = _gen(llm, prompts["repeat"][:1])
        r["first_request_steps"] = len(steps)  # its prefill steps + 5 decode steps
        r["repeat"] = first + _gen(llm, prompts["repeat"][1:])
        r["again"] = _gen(llm, prompts["repeat"][:1])
        if name == "offload":
            ext0 = metric_counter(llm, "vllm:external_prefix_cache_hits")
            # 4-block prompts cycling the GPU block pool three times evict the repeats from it
            n_flood = -(-3 * r["num_gpu_blocks"] // 4)
            r["flood_cached"] = []
            for i in range(0, n_flood, 8):
                res = _gen(llm, [draw(4 * bs) for _ in range(min(8, n_flood - i))], 1)
                r["flood_cached"] += [o.num_cached_tokens for o in res]
            r["after_flood"] = _gen(llm, prompts["repeat"][:1])
            r["external_hits"] = metric_counter(llm, "vllm:external_prefix_cache_hits") - ext0
            r["external_queries"] = metric_counter(llm, "vllm:external_prefix_cache_queries")
        out[name] = r
        shutdown_engine(llm)
        del llm
    yield prompts, out
    mp.undo()


def _checkpoint_blocks(llm) -> list[int]:
    """``num_prefill_checkpoint_blocks`` of each Mamba KV-cache group (vLLM's MambaSpec)."""
    from vllm.v1.kv_cache_interface import MambaSpec

    groups = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config.kv_cache_groups
    return [getattr(g.kv_cache_spec, "num_prefill_checkpoint_blocks", 0)
            for g in groups if isinstance(g.kv_cache_spec, MambaSpec)]


def _seqs(outs):
    return [Sequence.from_output(o.outputs[0]) for o in outs]


def _diag(r):
    return {k: v for k, v in r.items() if not isinstance(v, list) or k == "flood_cached"}


def test_cuda_defaults_in_use(runs):
    _, out = runs
    for name, r in out.items():
        assert r["cudagraph_mode"] != "CUDAGraphMode.NONE", (name, r["cudagraph_mode"])
    assert "worker.gpu." in out["align"]["runner"] + ".", out["align"]["runner"]  # V2 runner


def test_scheduler_is_vllms(runs):
    """Placement is vLLM's (issue 20): with no plugin variable set every engine, align mode and
    the host tier included, runs vLLM's own scheduler class."""
    _, out = runs
    vllms = {"vllm.v1.core.sched.scheduler.Scheduler",
             "vllm.v1.core.sched.async_scheduler.AsyncScheduler"}
    for name, r in out.items():
        assert r["scheduler"] in vllms, (name, r["scheduler"])


def test_align_hits_shared_prefix_and_equals_off(runs):
    prompts, out = runs
    bs = out["align"]["bs"]
    cached = [o.num_cached_tokens for o in out["align"]["repeat"]]
    assert cached[0] == 0 and all(c > 0 and c % bs == 0 for c in cached[1:]), (cached, bs)
    assert out["align"]["again"][0].num_cached_tokens > 0
    ref = _seqs(out["off"]["repeat"] + out["off"]["again"])
    got = _seqs(out["align"]["repeat"] + out["align"]["again"])
    c = compare_greedy(ref, got, bound=CHUNKING_BOUND)
    assert c.ok, (c.errors, c.summary(), f"block size {bs}")


def test_exporter_applies_and_cold_prompt_takes_the_steps_of_caching_off(runs):
    # the plugin's default on CUDA with the Triton/FLA GDN backend: the GDN layers declare a
    # prefill checkpoint (vLLM keeps the cold prompt in one step), with the host tier too
    _, out = runs
    for name in ("align", "offload"):
        r = out[name]
        assert r["checkpoint_blocks"] and all(n == 1 for n in r["checkpoint_blocks"]), (name, _diag(r))
        assert r["first_request_steps"] == out["off"]["first_request_steps"], (name, _diag(r), _diag(out["off"]))


def test_kv_offloading_host_tier_hits_and_equal_outputs(runs):
    _, out = runs
    off = out["offload"]
    diag = _diag(off)
    assert off["after_flood"][0].num_cached_tokens > 0, diag
    assert off["external_hits"] > 0, diag
    c = compare_greedy(_seqs(out["off"]["repeat"] + out["off"]["again"]),
                       _seqs(off["repeat"] + off["after_flood"]), bound=CHUNKING_BOUND)
    assert c.ok, (c.errors, c.summary(), diag)
