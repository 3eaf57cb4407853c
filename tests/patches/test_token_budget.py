"""The token budget in align mode (issue 30, item 3): the rounding decision on drawn numbers, the
block prediction against hand-computed pages, and the three ``token-budget*`` registry entries
on vLLM's real ``EngineArgs.create_engine_config`` (no engine: the configuration only).

Expected blocks come from the models' widths and vLLM's rule as the docs state it, computed by
hand here (Qwen3.5-35B-A3B at tp 1: conv state 8,192 x 3 bf16 = 49,152 bytes, SSM state 32 x 128
x 128 fp32 = 2,097,152 bytes, attention 2 KV heads x 256 x 2 (K, V) x 2 bytes = 2,048 bytes per
token: 1,048 tokens, FlashAttention's 16-token kernel blocks give 1,056, the exporter's 64-token
grid 1,088: the blocks the H100 logged on 2026-11-27, docs/cuda.md), not read off the code.
"""

from __future__ import annotations

import logging
import math

import pytest
import vllm

from vllm_hybrid_npu.core import token_budget as tb
from vllm_hybrid_npu.envs import OPTIONS_ENV

V030_032 = vllm.__version__.startswith(("0.30.", "0.32."))
ENTRIES = ("token-budget-default", "token-budget", "token-budget-check", "gdn-checkpoint-block-size")


# ------------------------------------------------------------------ pure decision


def test_the_issues_numbers():
    # docs/cuda.md section 0 (H200, 2026-11-26) and issue 30 (H100, 2026-11-27): 3 steps at
    # 16,384, 2 at 17,408, caching off 2
    assert tb.cold_prefill_steps(32768, 16384, 1088) == 3
    assert tb.cold_prefill_steps(32768, 17408, 1088) == 2
    assert tb.cold_prefill_steps(32768, 16384) == 2
    assert tb.round_up(16384, 1088) == 17408 == 16 * 1088
    # vllm serve's default on an H100 (8,192): a 16,384-token prompt in 7,616 + 7,616 + 1,152
    assert tb.cold_prefill_steps(16384, 8192, 1088) == 3 and tb.cold_prefill_steps(16384, 8192) == 2
    assert tb.cold_prefill_steps(16384, tb.round_up(8192, 1088), 1088) == 2
    assert tb.cold_prefill_steps(8192, 8192, 1088) == 1  # a prompt within the budget: one chunk


def test_rounded_budget_never_takes_more_steps_than_caching_off(rng):
    for _ in range(300):
        block = rng.choice([64, 128, 384, 576, 1056, 1088, 2112])
        budget = rng.randrange(block, 40 * block)
        prompt = rng.randrange(1, 6 * budget)
        off = math.ceil(prompt / budget)
        rounded = tb.round_up(budget, block)
        assert rounded % block == 0 and budget <= rounded < budget + block
        assert tb.cold_prefill_steps(prompt, rounded, block) <= off, (prompt, budget, block)
        # unrounded: every non-final chunk is the budget floored to blocks (c), the last one up
        # to the budget: 1 + ceil((L - B) / c) steps for L > B
        chunk = budget // block * block
        want = 1 if prompt <= budget else 1 + math.ceil((prompt - budget) / chunk)
        assert tb.cold_prefill_steps(prompt, budget, block) == want, (prompt, budget, block)


def test_chunks_end_on_block_boundaries_except_the_last(rng):
    """The step model against a direct walk of vLLM's rule (non-final chunk end floored to a
    block multiple)."""
    for _ in range(200):
        block = rng.choice([64, 384, 1088])
        budget = rng.randrange(block, 20 * block)
        prompt = rng.randrange(budget, 8 * budget)
        ends, start = [], 0
        while start < prompt:
            end = start + budget
            start = prompt if end >= prompt else end - end % block
            ends.append(start)
        assert all(e % block == 0 for e in ends[:-1]) and ends[-1] == prompt
        assert tb.cold_prefill_steps(prompt, budget, block) == len(ends)


def test_decide_raises_a_default_keeps_a_multiple_advises_on_a_users(rng):
    block = rng.choice([384, 1088])
    budget = block * rng.randrange(4, 30) + rng.randrange(1, block)
    d = tb.decide(budget, block, defaulted=True)
    assert d.action == "raise" and d.new_budget == (budget // block + 1) * block
    assert str(budget) in d.message and str(d.new_budget) in d.message
    mine = tb.decide(budget, block, defaulted=False)
    assert mine.action == "advise" and mine.new_budget == budget
    assert f"--max-num-batched-tokens {d.new_budget}" in mine.message
    even = tb.decide(block * 16, block, defaulted=True)
    assert even.action == "keep" and even.new_budget == block * 16
    capped = tb.decide(budget, block, defaulted=True, long_prefill_threshold=budget // 2)
    assert capped.action == "keep" and "long_prefill_token_threshold" in capped.message
    with pytest.raises(ValueError, match="budget 0"):
        tb.decide(0, block, defaulted=True)


def test_predict_block_hand_computed():
    conv, ssm32, ssm16 = 8192 * 3 * 2, 32 * 128 * 128 * 4, 32 * 128 * 128 * 2
    # Qwen3.5-35B-A3B (fp32 SSM) on an H100: vLLM 1,056 (caching off), the exporter 1,088
    assert tb.predict_block(2048, conv + ssm32, 16, 16) == 1056
    assert tb.predict_block(2048, conv + ssm32, 16, 16, grid=64) == 1088
    # bf16 SSM: 1,097,728 / 2,048 = 536 -> 544 (16) -> 576 (64)
    assert tb.predict_block(2048, conv + ssm16, 16, 16) == 544
    assert tb.predict_block(2048, conv + ssm16, 16, 16, grid=64) == 576
    # tiny Qwen3-Next on vLLM's CPU backend (block 128, kernel 32): 135,680 / 512 = 265 -> 384
    tiny = 768 * 3 * 2 + 2 * 128 * 128 * 4
    assert tb.predict_block(2 * 128 * 2, tiny, 32, 128, grid=64) == 384
    # --block-size 1,088 with caching off (the decomposition row off-b1088): the block stays
    assert tb.predict_block(2048, conv + ssm32, 16, 1088) == 1088


def test_check_budget_repairs_a_missed_prediction_within_the_buffers():
    # predicted 1,088 (budget 16,384 -> 17,408); the engine's real block 1,152: 15 x 1,152 =
    # 17,280 <= 17,408, so the scheduler runs 17,280
    assert tb.check_budget(17408, 17408, 16384, 1152) == (17280, None)
    assert tb.check_budget(17408, 17408, 16384, 1088) == (17408, None)
    budget, warn = tb.check_budget(17408, 17408, 16384, 6000)  # 18,000 > the buffers
    assert budget == 17408 and "--max-num-batched-tokens 18000" in warn


# ------------------------------------------------------------------ on vLLM's configuration


@pytest.fixture(scope="module")
def model():
    from vllm_hybrid_npu.tools.make_model import default_model_dir

    return str(default_model_dir("qwen3_next"))


def _build(model, **kw):
    """vLLM's configuration of the tiny Qwen3-Next with ``kw``, its SSM cache in float32 unless
    ``kw`` says otherwise: the blocks hand-computed here (384) hold on every CPU kind (with
    ``auto`` a CPU without AVX-512-BF16 resolves a bf16 SSM state: block 256, of which vLLM's
    default budget 4,096 is a multiple, and nothing is raised)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext
    kw.setdefault("mamba_ssm_cache_dtype", "float32")

    args = EngineArgs(model=model, max_model_len=8192, **kw)
    return args.create_engine_config(usage_context=UsageContext.LLM_CLASS)


def _default_budget(model):
    """vLLM's own default for this context, with no entry applied."""
    from vllm_hybrid_npu.patches import registry

    registry.unapply_all()
    return _build(model, enable_prefix_caching=False).scheduler_config.max_num_batched_tokens


pytestmark = pytest.mark.skipif(not V030_032, reason=f"token-budget entries are for vLLM 0.30/0.32, not {vllm.__version__}")


@pytest.fixture(autouse=True)
def chunks_end_on_the_block_grid(monkeypatch):
    """The rounding these tests exercise is for engines whose prefill chunks end on the block
    grid (CUDA, the NPU, a ``--prefix-match-unit``); on vLLM 0.30's CPU path the junction entries
    run chunks to the budget's end and the entries stand aside
    (:func:`test_budget_kept_where_chunks_end_at_the_budget`)."""
    from vllm_hybrid_npu.patches import gdn_junction

    monkeypatch.setattr(gdn_junction, "budget_rule_expected", lambda vllm_config, target: False)


@pytest.fixture
def log(monkeypatch, caplog):
    monkeypatch.setattr(logging.getLogger("vllm_hybrid_npu"), "propagate", True)
    caplog.set_level(logging.INFO, logger="vllm_hybrid_npu")
    return caplog


def test_default_budget_raised_to_the_blocks_multiple(model, apply_entries, log):
    default = _default_budget(model)
    report = apply_entries(*ENTRIES)
    assert not report.failed, report.line()
    cfg = _build(model, enable_prefix_caching=True, mamba_cache_mode="align")
    s = cfg.scheduler_config
    block = 384  # vLLM's CPU backend, tiny Qwen3-Next (hand-computed above; e2e checks the engine's)
    assert default % block, f"vLLM's CPU default {default} is a multiple of {block}: nothing to test"
    assert s.max_num_batched_tokens == -(-default // block) * block
    # what vLLM derives from the budget follows it
    assert s.encoder_cache_size == s.max_num_encoder_input_tokens == s.max_num_batched_tokens
    assert max(cfg.compilation_config.compile_ranges_endpoints) == s.max_num_batched_tokens
    line = next(r.getMessage() for r in log.records if "vLLM's default" in r.getMessage())
    assert f"{default} (vLLM's default) -> {s.max_num_batched_tokens}" in line
    assert "Cost:" in line and "VLLM_HYBRID_NPU_OPTIONS=budget=off" in line


@pytest.mark.parametrize("case", ["explicit", "scheduled-explicit", "caching-off", "no-exporter", "switch-off"])
def test_budget_left_alone(model, apply_entries, monkeypatch, log, case):
    default = _default_budget(model)
    if case == "no-exporter":
        monkeypatch.setenv("VLLM_HYBRID_NPU_PREFILL_CHECKPOINTS", "off")
    if case == "switch-off":
        monkeypatch.setenv(OPTIONS_ENV, "budget=off")
    report = apply_entries(*ENTRIES)
    kw = {"enable_prefix_caching": case != "caching-off"}
    if case != "caching-off":
        kw["mamba_cache_mode"] = "align"
    if case == "explicit":
        kw["max_num_batched_tokens"] = default
    if case == "scheduled-explicit":
        kw["max_num_scheduled_tokens"] = default
    cfg = _build(model, **kw)
    assert cfg.scheduler_config.max_num_batched_tokens == default, case
    assert not any("vLLM's default) ->" in r.getMessage() for r in log.records)
    if case in ("no-exporter", "switch-off"):
        skipped = {n: r for n, r in report.skipped.items() if n.startswith("token-budget")}
        assert len(skipped) == 3 and all(("=off" in r) for r in skipped.values()), report.line()


def test_a_users_budget_gets_advice_with_the_real_block(model, apply_entries, log):
    default = _default_budget(model)
    apply_entries(*ENTRIES)
    cfg = _build(model, enable_prefix_caching=True, mamba_cache_mode="align", max_num_batched_tokens=default)
    block = cfg.cache_config.block_size = 384  # the engine core sets the final block, then validates
    cfg.validate_block_size()
    assert cfg.scheduler_config.max_num_batched_tokens == default
    assert cfg.scheduler_config.max_num_scheduled_tokens in (None, default)
    advice = [r.getMessage() for r in log.records if "(yours) kept" in r.getMessage()]
    assert advice and f"--max-num-batched-tokens {-(-default // block) * block}" in advice[0]


def test_a_missed_prediction_is_repaired_when_the_block_is_final(model, apply_entries, log):
    apply_entries(*ENTRIES)
    cfg = _build(model, enable_prefix_caching=True, mamba_cache_mode="align")
    raised = cfg.scheduler_config.max_num_batched_tokens
    original = cfg._vllm_hybrid_npu_token_budget["original"]
    real = 320  # not the predicted 384: 13 x 320 = 4,160 fits the buffers
    want = -(-original // real) * real
    assert original < want <= raised, (original, want, raised)
    cfg.cache_config.block_size = real
    cfg.validate_block_size()
    assert cfg.scheduler_config.max_num_scheduled_tokens == want
    assert cfg.scheduler_config.max_num_batched_tokens == raised
    assert any(f"not the 384 predicted" in r.getMessage() for r in log.records)


def test_budget_kept_where_chunks_end_at_the_budget(model, apply_entries, monkeypatch, log):
    from vllm_hybrid_npu.patches import gdn_junction

    default = _default_budget(model)
    apply_entries(*ENTRIES)
    monkeypatch.setattr(gdn_junction, "budget_rule_expected", lambda vllm_config, target: True)
    cfg = _build(model, enable_prefix_caching=True, mamba_cache_mode="align")
    assert cfg.scheduler_config.max_num_batched_tokens == default
    cfg.cache_config.block_size = 384
    cfg.validate_block_size()
    assert cfg.scheduler_config.max_num_scheduled_tokens in (None, default)
    assert not [r for r in log.records if "(yours) kept" in r.getMessage() or "vLLM's default" in r.getMessage()]
