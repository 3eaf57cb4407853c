"""GDN states at every block boundary inside the step (issue 8), on the real engine (CPU).

Two in-process vLLM 0.30 engines on the tiny random Qwen3-Next (``--gdn-memory long``: a state
handed over at a hit shapes the outputs hundreds of tokens later), one after the other:

* *off*: prefix caching off (upstream's GDN path, one pass per prompt);
* *gdn*: ``--enable-prefix-caching --mamba-cache-mode all`` with the plugin's GDN 'all'-mode path
  (:mod:`vllm_hybrid_npu.patches.gdn_all_mode`) and its scheduler
  (``GdnCheckpointScheduler``: dense state retention, no extra chunk ends), what
  ``VLLM_HYBRID_NPU_CHECKPOINTS=gdn`` selects.

The prompts are drawn fresh for every run (from the run's seed, printed on failure and replayed
by ``VLLM_HYBRID_NPU_TEST_SEED``: conftest.py); *off* computes the reference outputs first, then
*gdn* must reproduce them token for token while hitting the prefix cache. Exact by construction:
both engines split every prompt at 64-token multiples only (block boundaries and the 4096-token
budget), where vLLM's CPU GDN kernel is bit-exact (tests/ops/test_gdn_split.py). Cached token counts
are vLLM's ``RequestOutput.num_cached_tokens``.
"""

from __future__ import annotations

import random

import pytest
from engines import shutdown_engine  # e2e/engines.py

from vllm_hybrid_npu.patches.gdn_all_mode import all_mode_available

pytestmark = pytest.mark.skipif(
    not all_mode_available(), reason="this vLLM has no --mamba-cache-mode all (vLLM 0.32 removed it)"
)

#: A 4096-token step budget: a multiple of the 64-token GDN chunk, so a prompt longer than one step
#: is cut at a chunk multiple in both engines; the batch below fits one step in both. (vLLM's CPU
#: GDN kernel is bit-exact across splits at 64-token multiples only: tests/ops/test_gdn_split.py;
#: a split elsewhere rounds differently in bf16 and can flip a near-tied greedy token of the
#: random-weight model, in either engine.)
ENGINE = dict(kv_cache_memory_bytes=256 << 20, max_num_seqs=4, max_num_batched_tokens=4096)


def _engine(tiny_model_dir, engine_args, **kw):
    from vllm import LLM

    # long GDN memory: a wrong state handed over at a hit would show in the outputs
    return LLM(model=str(tiny_model_dir("qwen3_next", gdn_memory="long")),
               **{**engine_args, **ENGINE, **kw})


def _gen(llm, prompts, max_tokens):
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": list(p)} for p in prompts], sp, use_tqdm=False)


def _hit_bound(prompt, block):
    """Most a repeat of ``prompt`` can hit: whole blocks, and vLLM computes at least the last
    prompt token (so a block-multiple prompt hits one block less)."""
    return (len(prompt) - 1) // block * block


def _tokens(outs):
    return [list(o.outputs[0].token_ids) for o in outs]


class Scenario:
    """Random prompts drawn from ``seed``; ``block`` is the engine's block size (tokens)."""

    def __init__(self, block: int, seed: int):
        rng = random.Random(seed)
        self.block = block
        draw = lambda n: [rng.randrange(10, 1000) for _ in range(n)]  # noqa: E731
        # shared prefix ending inside block 8; each prompt's own tail runs past block 8's end
        self.prefix = draw(7 * block + block * 3 // 4)
        self.repeats = [self.prefix + draw(block // 2) for _ in range(3)]
        # sent together in one batch (several prefills in one step, rounds of several segments)
        self.batch = [self.prefix[: block * 2 + 10] + draw(block * k // 2 + 7) for k in (1, 2, 3)]
        # longer than the 4096-token step budget: prefill spans steps, the second mid-block
        self.long = draw(4096 + block + block // 3)
        self.short = draw(block // 2)


@pytest.fixture(scope="module")
def runs(tiny_model_dir, request, seed_for, engine_args, e2e_target_name):
    if e2e_target_name != "cpu":
        pytest.skip("the GDN 'all'-mode patches exist for the CPU target only (registry: gdn-*)")
    from vllm_hybrid_npu.patches import apply_patches, registry

    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # the registry as the plugin applies it in a process started with
    # VLLM_HYBRID_NPU_CHECKPOINTS=gdn (whatever an earlier test of this process applied)
    mp.setenv("VLLM_HYBRID_NPU_CHECKPOINTS", "gdn")
    registry.unapply_all()
    report = apply_patches("cpu")
    assert not report.failed and "gdn-switch" in report.applied + list(report.pending), report.line()
    results = {}
    for name, kw in [
        ("off", dict(enable_prefix_caching=False)),
        (
            "gdn",
            dict(
                enable_prefix_caching=True,
                mamba_cache_mode="all",
                scheduler_cls="vllm_hybrid_npu.scheduling.scheduler.GdnCheckpointScheduler",
            ),
        ),
    ]:
        llm = _engine(tiny_model_dir, engine_args, **kw)
        cfg = llm.llm_engine.vllm_config.cache_config
        if name == "off":
            sc = Scenario(cfg.block_size, seed_for(request, "prompts"))
        else:
            assert cfg.block_size == sc.block, "block size differs between the two engines"
        sched = llm.llm_engine.engine_core.engine_core.scheduler
        r = {"mode": cfg.mamba_cache_mode, "scheduler": type(sched).__name__,
             "retention": sched.kv_cache_config.prefix_cache_retention_interval}
        r["repeats"] = [_gen(llm, [p], 3)[0] for p in sc.repeats]
        r["batch"] = _gen(llm, sc.batch, 4)
        r["batch_again"] = [_gen(llm, [p], 4)[0] for p in sc.batch]
        r["long"] = [_gen(llm, [sc.long], 3)[0] for _ in range(2)]
        r["short"] = [_gen(llm, [sc.short], 3)[0] for _ in range(2)]
        results[name] = r
        shutdown_engine(llm)
        del llm
    yield sc, results["off"], results["gdn"]
    registry.unapply_all()
    mp.undo()
    apply_patches()  # the registry as the plugin applies it with the restored environment


def test_gdn_engine_runs_all_mode_with_dense_retention(runs):
    _, off, gdn = runs
    assert off["mode"] == "none"
    assert gdn["mode"] == "all"  # not fallen back to align
    assert gdn["scheduler"] == "GdnCheckpointScheduler"
    assert gdn["retention"] is None


def test_shared_prefix_hits_on_first_repeat_outputs_equal_caching_off(runs):
    sc, off, gdn = runs
    expected = len(sc.prefix) // sc.block * sc.block
    assert [o.num_cached_tokens for o in gdn["repeats"]] == [0, expected, expected]
    assert _tokens(gdn["repeats"]) == _tokens(off["repeats"])


def test_batched_prefills_hit_and_equal_caching_off(runs):
    sc, off, gdn = runs
    # cold batch: the three share 2 blocks + 10 tokens of the repeats' prefix, cached above
    assert [o.num_cached_tokens for o in gdn["batch"]] == [2 * sc.block] * 3
    assert _tokens(gdn["batch"]) == _tokens(off["batch"])
    # again, one by one: every block-aligned prefix of each prompt was stored by the batch
    again = [_hit_bound(p, sc.block) for p in sc.batch]
    assert [o.num_cached_tokens for o in gdn["batch_again"]] == again
    assert _tokens(gdn["batch_again"]) == _tokens(off["batch_again"])


def test_prefill_over_several_steps_hits_whole_prompt(runs):
    sc, off, gdn = runs
    first, second = gdn["long"]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == _hit_bound(sc.long, sc.block)
    assert _tokens(gdn["long"]) == _tokens(off["long"])


def test_prompt_shorter_than_one_block(runs):
    _, off, gdn = runs
    assert [o.num_cached_tokens for o in gdn["short"]] == [0, 0]
    assert _tokens(gdn["short"]) == _tokens(off["short"])
