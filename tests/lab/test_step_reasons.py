"""Extra prefill steps by reason (issue 38 item 1), on hand-counted cases.

Replays go through vLLM's real Scheduler on the tiny hybrid (3 GDN + 1 attention layer) with the
block size given; trace blocks are 512 tokens (equal hash ids = equal 512 tokens). Each case
says where vLLM 0.30 ends every chunk (``Scheduler._mamba_block_aligned_split``): ``B`` is the
token budget (``--max-num-batched-tokens``), the fewest steps of a prompt ``ceil(uncached / B)``.
"""

from __future__ import annotations

import pytest
import vllm

from vllm_hybrid_npu_lab.model import build_setup
from vllm_hybrid_npu_lab.policies import CACHING_OFF, get_policy, setup_kwargs
from vllm_hybrid_npu_lab.presets import resolve_model
from vllm_hybrid_npu_lab.replay import replay
from vllm_hybrid_npu_lab.step_reasons import (
    REASONS,
    PrefillLedger,
    SplitDecision,
    SplitSettings,
    chunk_reason,
    format_reasons,
)
from vllm_hybrid_npu_lab.trace import TraceRequest
from vllm_hybrid_npu.envs import OPTIONS_ENV

#: the installed vLLM's (major, minor)
VLLM = tuple(int(x) for x in vllm.__version__.split(".")[:2])
BIG = 64 << 20  # bytes: no eviction, no preemption in these traces


@pytest.fixture(scope="module")
def cfg(tiny_model_dir):
    return resolve_model(str(tiny_model_dir))[1]


def _replay(cfg, rows, policy="upstream", *, block_size=256, budget=8192, together=False,
            target="cuda"):
    """Replay ``rows`` = [(input_length, hash_ids)] (4 output tokens each), 10 s apart (each
    alone) or all at t = 0 (``together``), prompts as their hash ids say (no answer carried into
    a longer prompt); returns the result and the extra steps by reason (counts over all prompts,
    only the reasons that occur)."""
    reqs = [TraceRequest(0.0 if together else 10_000.0 * i, n, 4, tuple(h))
            for i, (n, h) in enumerate(rows)]
    pol = get_policy(policy)
    setup = build_setup(cfg, kv_cache_bytes=BIG, block_size=block_size,
                        max_num_batched_tokens=budget, max_model_len=4096, **setup_kwargs(pol))
    res = replay(reqs, setup, pol.scheduler_class(), carry_outputs=False, target=target)
    n = len(rows)
    by = {r: round(v * n, 9) for r, v in res.extra_prefill_steps_by_reason.items() if v}
    assert set(res.extra_prefill_steps_by_reason) == set(REASONS)
    assert sum(by.values()) == pytest.approx(res.extra_prefill_steps_per_prompt * n)
    return res, by


def test_cold_prompt_split_at_its_tail_is_one_prompt_tail_step(cfg, rng):
    # Block 256, one cold prompt of p tokens, 2*256 < p < 5*256, not on the grid: vLLM ends the
    # first chunk at the last block boundary (p // 256 * 256) and computes the rest in a second
    # step; B = 8192 needs one. The exporter's checkpoint is valid there (start 0, checkpoint at
    # (p - 1) // 256 * 256 on the 64-token grid): one step. Caching off never splits.
    p = rng.choice([n for n in range(513, 1280) if n % 256])
    res, by = _replay(cfg, [(p, [1, 2, 3])])
    assert res.prefill_steps_per_prompt == 2 and by == {"prompt_tail": 1}
    ckpt, by = _replay(cfg, [(p, [1, 2, 3])], "upstream:ckpt")
    assert ckpt.prefill_steps_per_prompt == 1 and by == {}
    off, by = _replay(cfg, [(p, [1, 2, 3])], CACHING_OFF)
    assert off.prefill_steps_per_prompt == 1 and by == {}


def test_prefix_shared_off_the_block_grid_costs_one_junction_step(cfg, rng):
    # Block 384; A and B share their first two trace blocks (1024 tokens, off the 384 grid) and
    # differ after; lengths in (1152, 1536). A (cold): stop at its last boundary 1152, then the
    # rest: 1 prompt_tail. B: no GDN state at or below 1024 (A left one at 1152 only), so it
    # misses; vLLM stops at the junction floored to the block (768), then at B's last boundary
    # (1152), then the rest: 3 steps for 1 needed, 1 junction + 1 prompt_tail.
    a, b = rng.randint(1153, 1535), rng.randint(1153, 1535)
    res, by = _replay(cfg, [(a, [1, 2, 3]), (b, [1, 2, 4])], block_size=384)
    assert res.cached_per_request == [0, 0]
    assert by == {"prompt_tail": 2, "junction": 1}


@pytest.mark.skipif(VLLM != (0, 30), reason="the lab models the junction export of the paths that "
                    "have it on vLLM 0.30 only (CUDA's V2 runner, vllm-ascend 0.30.0rc2)")
def test_both_targets_export_the_junction_inside_the_step(cfg, rng, monkeypatch):
    # Block 384, the exporter declared; A, B and C share their first two trace blocks (1024
    # tokens, off the 384 grid), lengths in (1152, 1536). A: one step (its checkpoint at 1152 is
    # valid). B: attention hits to 1024 and no GDN state there: the junction, floored to 768.
    # vllm-ascend's paths (target npu) and CUDA's one pass on the V2 runner (target cuda, the
    # runtime's VLLM_HYBRID_NPU_OPTIONS=junctions=on, the default): the runtime's junction entries,
    # one step, the state at 768 exported into the block vLLM caches there. With
    # VLLM_HYBRID_NPU_OPTIONS=junctions=off CUDA keeps vLLM's stop: [0, 768), then the rest (its
    # checkpoint at 1152 valid from 768): one junction step. Either way C hits 768 and takes one
    # step.
    from vllm_hybrid_npu.patches import gdn_prefill_checkpoint as gpc

    rows = [(rng.randint(1153, 1535), [1, 2, k]) for k in (3, 4, 5)]
    monkeypatch.delenv(OPTIONS_ENV, raising=False)
    for target in ("cuda", "npu"):
        res, by = _replay(cfg, rows, "upstream:ckpt", block_size=384, target=target)
        assert res.cached_per_request == [0, 0, 768] and by == {}, (target, rows)
        assert res.prefill_steps_per_prompt == 1, target
    monkeypatch.setenv(OPTIONS_ENV, "junctions=off")
    cuda, by = _replay(cfg, rows, "upstream:ckpt", block_size=384)
    assert cuda.cached_per_request == [0, 0, 768] and by == {"junction": 1}, rows
    assert cuda.prefill_steps_per_prompt == 4 / 3
    npu, by = _replay(cfg, rows, "upstream:ckpt", block_size=384, target="npu")
    assert by == {} and npu.prefill_steps_per_prompt == 1  # the NPU's paths: not that variable
    # vLLM's split without the exporter: the same on both targets (no checkpoint declared; no
    # KV connector, so vllm-ascend's consumer rule is off, and its one block more per Mamba count
    # never binds in a 64 MiB pool: only its counter differs)
    plain = [_replay(cfg, rows, block_size=384, target=t)[0].to_dict() | {"wall_s": 0} for t in ("cuda", "npu")]
    assert plain[1].pop("ascend_model")["kept_whole"] == 0 and plain[0].pop("ascend_model") == {}
    assert plain[0] == plain[1]
    with pytest.raises(ValueError, match="target 'gpu'"):
        _replay(cfg, rows[:1], target="gpu")


def test_prompts_arriving_together_under_a_small_budget_share_it(cfg, rng):
    # Block 256, the exporter declared (its checkpoint is valid for a cold chunk reaching the
    # prompt's end: no tail stop, on vLLM 0.30 and on >= 0.32, whose split without it stops a
    # cold prompt on the grid one block short), two cold 1024-token prompts at t = 0, budget B
    # in [1280, 2047]: step 1 gives A its 1024 and B what is left, B - 1024, rounded down to the
    # block (>= 256 tokens); step 2 gives B the rest (<= 768 < B - 1 decode token). B takes 2
    # steps for 1: one shared_budget step. Caching off pays the same (no rounding there:
    # B - 1024 then 2048 - B).
    budget = rng.randint(1280, 2047)
    rows = [(1024, [1, 2]), (1024, [3, 4])]
    res, by = _replay(cfg, rows, "upstream:ckpt", budget=budget, together=True)
    assert by == {"shared_budget": 1} and res.prefill_steps_per_prompt == 1.5
    off, by_off = _replay(cfg, rows, CACHING_OFF, budget=budget, together=True)
    assert by_off == {"shared_budget": 1}
    # alone, the same prompts take one step each
    _, by = _replay(cfg, rows, "upstream:ckpt", budget=budget)
    assert by == {}


def test_cold_prompt_on_the_grid_stops_where_the_installed_vllm_puts_its_tail(cfg, rng):
    # Block 256, one cold prompt of k whole blocks, B = 8192. vLLM 0.30's split stops at the
    # last boundary at or before the end: the prompt's end, one step. vLLM >= 0.32 places the
    # stop with get_mamba_prefill_checkpoint_position, strictly before the last token: one
    # block short, two steps, one prompt_tail.
    k = rng.randint(2, 6)
    res, by = _replay(cfg, [(256 * k, list(range(1, k // 2 + 2)))])
    if VLLM < (0, 32):
        assert res.prefill_steps_per_prompt == 1 and by == {}
    else:
        assert res.prefill_steps_per_prompt == 2 and by == {"prompt_tail": 1}


def test_block_rounding_and_tail_on_a_budget_off_the_block(cfg):
    # Block 384, B = 1000, one cold 2000-token prompt (2 steps needed). Chunks: [0, 768) (1000
    # rounded down: block_rounding, 1232 left still needs 2), [768, 1536) (1768 rounded down;
    # 464 left needs 1: on schedule), [1536, 1920) (the last boundary: prompt_tail, 80 left
    # still needs 1), [1920, 2000). Caching off: [0, 1000), [1000, 2000): none extra.
    res, by = _replay(cfg, [(2000, [1, 2, 3, 4])], block_size=384, budget=1000)
    assert res.prefill_steps_per_prompt == 4 and by == {"block_rounding": 1, "prompt_tail": 1}
    off, by = _replay(cfg, [(2000, [1, 2, 3, 4])], CACHING_OFF, block_size=384, budget=1000)
    assert off.prefill_steps_per_prompt == 2 and by == {}


def test_fine_grained_hit_starts_mid_block(cfg):
    # Block 256, --prefix-match-unit 64. A (1100, cold): stops at its last block boundary 1024
    # and at its last 64-token boundary 1088 (the partial-tail entry), then 12 tokens: 2
    # prompt_tail. B (1600 tokens, A's 1100 followed by more) hits 1088, mid-block: stop at the
    # next boundary 1280 (mid_block_start), at B's last boundary 1536 (prompt_tail), then 64.
    res, by = _replay(cfg, [(1100, [1, 2, 3]), (1600, [1, 2, 3, 4])], "upstream:pmu=64")
    assert res.cached_per_request == [0, 1088]
    assert by == {"prompt_tail": 3, "mid_block_start": 1}


def test_exporter_hit_inside_a_block_stops_at_the_next_boundary(cfg, rng, monkeypatch):
    # Block 256, --prefix-match-unit 64, the exporter declared. A (a tokens, cold, 1025..1279
    # off the 64-token grid): one step, its checkpoint at m = (a - 1) // 64 * 64 (valid from
    # start 0). B (1,600 tokens, A's a followed by more: hash block 3 covers 1024..1535) hits m,
    # inside the block [1024, 1280) unless m = 1024. vLLM lifts its stop at the next boundary
    # 1280 under the prefill checkpoint; the runtime's gdn-chunk-end's mid-block stop (CUDA with
    # its junction export off: one checkpoint per row) puts it back: [m, 1280)
    # (mid_block_start), then [1280, 1600) with its checkpoint at 1536 (valid from 1280): 2 steps
    # where vLLM's own chunking takes 1. With the export on (the default, vLLM 0.30) the one pass
    # writes the crossed boundary from m, a 64-token start: one step.
    from vllm_hybrid_npu.patches import gdn_prefill_checkpoint as gpc
    from vllm_hybrid_npu_lab import exporter

    a = rng.choice([n for n in range(1025, 1280) if n % 64 and (n - 1) // 64 * 64 > 1024])
    m = (a - 1) // 64 * 64
    rows = [(a, [1, 2, 3]), (1600, [1, 2, 3, 4])]
    monkeypatch.delenv(OPTIONS_ENV, raising=False)
    res, by = _replay(cfg, rows, "upstream:pmu=64,ckpt")
    assert res.cached_per_request == [0, m]
    # vLLM 0.34: no gdn-chunk-end for it (outside its row), so the lab binds none: vLLM's chunking
    stop = exporter._entry("gdn-chunk-end") is not None
    if VLLM == (0, 30) or not stop:
        assert res.prefill_steps_per_prompt == 1 and by == {}, a
    else:  # the junction entries are 0.30's: the stop stays
        assert res.prefill_steps_per_prompt == 3 / 2 and by == {"mid_block_start": 1}, a
    monkeypatch.setenv(OPTIONS_ENV, "junctions=off")
    res, by = _replay(cfg, rows, "upstream:pmu=64,ckpt")
    assert res.cached_per_request == [0, m]
    if stop:
        assert res.prefill_steps_per_prompt == 3 / 2 and by == {"mid_block_start": 1}, a
    else:
        assert res.prefill_steps_per_prompt == 1 and by == {}, a
    # without the entry (vLLM's chunking under the checkpoint): B in one step, nothing extra
    monkeypatch.setattr(exporter, "apply_mid_block_stop", lambda scheduler: False)
    res, by = _replay(cfg, rows, "upstream:pmu=64,ckpt")
    assert res.cached_per_request == [0, m]
    assert res.prefill_steps_per_prompt == 1 and by == {}, a


def test_checkpoint_off_its_grid_is_checkpoint_invalid(cfg, rng):
    # Block 256, exporter declared, unit 32. A cold prompt whose checkpoint (p - 1) // 32 * 32
    # is an odd multiple of 32 is off the exporter's 64-token alignment: not valid, vLLM splits
    # at 1024 (last block boundary), then at the last 32-token boundary (from 1024 the
    # checkpoint's column is the start's: still not valid), then the rest: 2 checkpoint_invalid.
    # The same prompt with unit 64 has a valid checkpoint: one step. Without the exporter the
    # same two stops are prompt_tail.
    # (p off the 32-token grid: a prompt ending on it has no stop at its last 32-token boundary,
    # which is its end, on vLLM 0.30; drawn p = 1088 took 2 steps there)
    p = rng.choice([n for n in range(1058, 1280) if (n - 1) // 32 % 2 and (n - 1) % 32 and n % 32])
    res, by = _replay(cfg, [(p, [1, 2, 3])], "upstream:pmu=32,ckpt")
    assert res.prefill_steps_per_prompt == 3 and by == {"checkpoint_invalid": 2}
    _, by = _replay(cfg, [(p, [1, 2, 3])], "upstream:pmu=64,ckpt")
    assert by == {}
    _, by = _replay(cfg, [(p, [1, 2, 3])], "upstream:pmu=32")
    assert by == {"prompt_tail": 2}


def test_tailsplit_off_keeps_a_column_only_invalid_final_chunk_whole(cfg, rng):
    # The runtime's VLLM_HYBRID_NPU_OPTIONS=tailsplit=off (the lab's tailsplit=off, vLLM 0.30).
    # Block 256, unit 64, exporter declared. A cold prompt of p tokens, 64 < p < 256, off the
    # 64-token grid: its checkpoint (p - 1) // 64 * 64 is on the grid and inside the prompt, but
    # its column cdiv(p, 256) - 2 = -1 is not past the initial state's (-1): not valid, so vLLM
    # stops at the prompt's last 64-token boundary p // 64 * 64 and caches the state there (2
    # steps, 1 checkpoint_invalid); the same prompt again hits there. With tailsplit=off the
    # chunk runs whole (1 step, caching off's) and that state is not cached: the repeat hits 0.
    # The pmu=32 prompt of the test above fails the alignment clause as well: unchanged (2).
    from vllm_hybrid_npu_lab.upstream_grid import parse_setting, policy_of

    if policy_of(parse_setting("upstream:pmu=64,ckpt,tailsplit=off")).unavailable():
        pytest.skip("tailsplit=off: the runtime entry is vLLM 0.30's")
    p = rng.choice([n for n in range(65, 256) if n % 64])
    rows = [(p, [1]), (p, [1])]
    res, by = _replay(cfg, rows, "upstream:pmu=64,ckpt")
    assert res.cached_per_request == [0, p // 64 * 64], p
    assert res.prefill_steps_per_prompt == 1.5 and by == {"checkpoint_invalid": 1}, (p, by)
    res, by = _replay(cfg, rows, "upstream:pmu=64,ckpt,tailsplit=off")
    assert res.cached_per_request == [0, 0], p
    assert res.prefill_steps_per_prompt == 1 and by == {}, (p, by)
    q = rng.choice([n for n in range(1058, 1280) if (n - 1) // 32 % 2 and (n - 1) % 32 and n % 32])
    res, by = _replay(cfg, [(q, [1, 2, 3])], "upstream:pmu=32,ckpt,tailsplit=off")
    assert res.prefill_steps_per_prompt == 3 and by == {"checkpoint_invalid": 2}, q


@pytest.mark.parametrize("target", ["cuda", "npu"])
def test_second_on_keeps_the_block_boundary_for_a_sharer(cfg, rng, target, monkeypatch):
    # The runtime's VLLM_HYBRID_NPU_OPTIONS=second=on (the lab's second=on, vLLM 0.30). Block
    # 256, unit 64, exporter declared, retention 0. A cold prompt of p tokens, 577 <= p <= 640
    # (trace blocks 1, 2): its checkpoint 576 lies inside block 2; vLLM reserves it column 1,
    # which it keys at 512 and then re-keys at 576, so a second prompt sharing only trace block 1
    # (512 tokens) finds no GDN state at 512 and hits 0. With second=on the column keeps 512 and
    # a second block takes 576: the sharer hits 512. The sharer has 769-1,023 tokens: without
    # second=on the junction at 512 is exported inside its one step (the CUDA target's junction
    # entries), with it its chunk from 512 reserves its own checkpoint (column 2 past 1): one
    # step per prompt either way. The same on the NPU target (vllm-ascend's V1 runner, no KV
    # connector). Where the step exports no junction state (CUDA with
    # VLLM_HYBRID_NPU_OPTIONS=junctions=off) the engine takes no second block: as without it.
    from vllm_hybrid_npu_lab.upstream_grid import parse_setting, policy_of

    if policy_of(parse_setting("upstream:pmu=64,ckpt,second=on")).unavailable():
        pytest.skip("second=on: the runtime entries are vLLM 0.30's")
    p, m = rng.randrange(577, 641), rng.randrange(769, 1024)
    rows = [(p, [1, 2]), (m, [1, 3])]
    res, by = _replay(cfg, rows, "upstream:pmu=64,ckpt", target=target)
    assert res.cached_per_request == [0, 0] and res.prefill_steps_per_prompt == 1, (p, m, by)
    res, by = _replay(cfg, rows, "upstream:pmu=64,ckpt,second=on", target=target)
    assert res.cached_per_request == [0, 512] and res.prefill_steps_per_prompt == 1, (p, m, by)
    assert parse_setting("upstream:pmu=64,ckpt,second=on").optin
    if target == "cuda":
        monkeypatch.setenv(OPTIONS_ENV, "junctions=off")
        res, by = _replay(cfg, rows, "upstream:pmu=64,ckpt,second=on", target=target)
        assert res.cached_per_request == [0, 0], (p, m, by)


def test_tailsplit_off_reads_its_reasons_through_the_runtime_entries(cfg, rng):
    # Found in review (2026-11-30): the lab's tailsplit=off stands in for the runtime's entry by a
    # subclass method, which the reasons took for a lab policy and measured against bare vLLM, so
    # a cut by the runtime's mid-block stop read as policy_stop. Block 256, unit 32, exporter,
    # target cuda: a cold prompt of p1 tokens (289 <= p1 < 320, off the 32-token grid) has its
    # checkpoint 288, an odd multiple of 32: off the 64-token alignment, so not valid (and not by
    # the column alone: tailsplit=off changes nothing); a second prompt of n2 tokens (768 < n2 <
    # 1024, its checkpoint (n2 - 1) // 32 * 32 an odd multiple of 32, so 64-aligned from 288)
    # sharing it hits 288: a valid checkpoint, so vLLM lifts its mid-block stop, and CUDA's
    # runtime stop (a start off the 64-token grid) ends the chunk at 512 again. The same schedule
    # with and without tailsplit=off, so the same reasons, none of them policy_stop.
    from vllm_hybrid_npu_lab.upstream_grid import parse_setting, policy_of

    if policy_of(parse_setting("upstream:pmu=32,ckpt,tailsplit=off")).unavailable():
        pytest.skip("tailsplit=off: the runtime entry is vLLM 0.30's")
    p1 = rng.choice([n for n in range(289, 320) if n % 32])
    n2 = rng.choice([n for n in range(769, 1024) if (n - 1) // 32 % 2])
    rows = [(p1, [1]), (n2, [1, 5])]
    plain, by = _replay(cfg, rows, "upstream:pmu=32,ckpt")
    off, by_off = _replay(cfg, rows, "upstream:pmu=32,ckpt,tailsplit=off")
    assert plain.cached_per_request == off.cached_per_request == [0, 288], (p1, n2)
    assert "mid_block_start" in by and "policy_stop" not in by_off and by_off == by, (p1, n2, by, by_off)


def test_long_prefill_threshold_steps(cfg, rng):
    # Block 256, --long-prefill-token-threshold 1 block, two cold prompts of k whole blocks (no
    # block shared) arriving together: chunks of 256 each, k steps where B = 8192 needs 1:
    # 2 (k - 1) long_prefill steps (vLLM >= 0.32 applies the threshold when more than one
    # request runs or waits: two do until both finish their prefill together).
    k = rng.randint(2, 6)
    n = k // 2 + 1
    rows = [(256 * k, list(range(1, n + 1))), (256 * k, list(range(n + 1, 2 * n + 1)))]
    res, by = _replay(cfg, rows, "upstream:lpt=1b", together=True)
    assert res.prefill_steps_per_prompt == k and by == {"long_prefill": 2 * (k - 1)}
    # Alone: vLLM 0.30 caps the lone prompt too (k steps, k - 1 long_prefill); vLLM >= 0.32 lets
    # it use the whole budget ("nobody to starve"), so it takes what it takes without the
    # threshold.
    res, by = _replay(cfg, rows[:1], "upstream:lpt=1b")
    if VLLM < (0, 32):
        assert res.prefill_steps_per_prompt == k and by == {"long_prefill": k - 1}
    else:
        plain, by_plain = _replay(cfg, rows[:1])
        assert res.prefill_steps_per_prompt == plain.prefill_steps_per_prompt and by == by_plain


def test_tail_stops_where_the_installed_vllm_puts_them(rng):
    # block 256, unit 64, no EAGLE; a prompt of n tokens (no output yet). vLLM 0.30: the last
    # block boundary at or before n and the last 64-token one; >= 0.32: strictly before n.
    from types import SimpleNamespace

    from vllm_hybrid_npu_lab.step_reasons import tail_stops

    n = rng.randint(2, 12) * 256
    sched = SimpleNamespace(cache_config=SimpleNamespace(block_size=256), hash_block_size=64,
                            use_eagle_block_drop=False, num_hash_lookahead_tokens=0)
    req = SimpleNamespace(num_tokens=n, num_prompt_tokens=n)
    want = (n, n) if VLLM < (0, 32) else (n - 256, n - 64)
    assert tail_stops(sched, req) == want
    req = SimpleNamespace(num_tokens=n + 100, num_prompt_tokens=n + 100)
    assert tail_stops(sched, req) == (n, n + 64)


S = SplitSettings(block_size=384, hash_block_size=384, budget=1000)


@pytest.mark.parametrize("start,end,num_tokens,decision,settings,reason", [
    # the split left vLLM's chunk as asked; the budget had been shared (600 < 1000, < 1500 left)
    (0, 600, 2000, SplitDecision(0, 600, 600, 600, 0, 2000, 2000), S, "shared_budget"),
    # the same chunk rounded down from the shared 600 to 384: still the load's
    (0, 384, 2000, SplitDecision(0, 600, 384, 384, 0, 2000, 2000), S, "shared_budget"),
    # the whole budget rounded down to the block
    (0, 768, 2000, SplitDecision(0, 1000, 768, 768, 0, 2000, 2000), S, "block_rounding"),
    # a threshold of 2 blocks (768 < 1000): the chunk ends at the threshold
    (0, 768, 2000, SplitDecision(0, 768, 768, 768, 0, 2000, 2000),
     SplitSettings(384, 384, 1000, long_prefill=768), "long_prefill"),
    # junction 700 floored to the block: 384 (strictly inside [0, 768), the rounded end)
    (0, 384, 2000, SplitDecision(0, 1000, 384, 384, 700, 2000, 2000), S, "junction"),
    # junction 1000 floored is 768, the rounded end itself: not inside, so vLLM's end is the
    # rounding (of a budget shared down to 1000 of 1100)
    (0, 768, 2000, SplitDecision(0, 1000, 768, 768, 1000, 2000, 2000),
     SplitSettings(384, 384, 1100), "shared_budget"),
    # a fine-grained junction stop at the junction itself
    (0, 700, 2000, SplitDecision(0, 1000, 700, 700, 700, 2000, 2000), S, "junction"),
    # the last chunk stopped at the last boundary 1920; with the exporter declared: invalid
    (1536, 1920, 2000, SplitDecision(1536, 464, 384, 384, 0, 2000, 2000), S, "prompt_tail"),
    (1536, 1920, 2000, SplitDecision(1536, 464, 384, 384, 0, 2000, 2000),
     SplitSettings(384, 384, 1000, checkpoints=True), "checkpoint_invalid"),
    # vLLM >= 0.32's tail of a 1536-token prompt on the grid: one block short (1152, recorded in
    # the decision); read off 0.30's formula (1536) the same stop would be unexplained
    (768, 1152, 1536, SplitDecision(768, 768, 384, 384, 0, 1536, 1536, tails=(1152, 1152)), S,
     "prompt_tail"),
    (768, 1152, 1536, SplitDecision(768, 768, 384, 384, 0, 1536, 1536), S, "unexplained"),
    # the runtime's budget chunk end (target npu): the shared 700 floored to the 64-token
    # alignment (640), not the block; the whole budget 1000 floored to 960
    (0, 640, 2000, SplitDecision(0, 700, 640, 640, 0, 2000, 2000), S, "shared_budget"),
    (0, 960, 2000, SplitDecision(0, 1000, 960, 960, 0, 2000, 2000), S, "block_rounding"),
    # a start mid-block (448) stopped at the next boundary 768
    (448, 768, 2000, SplitDecision(448, 1000, 320, 320, 0, 2000, 2000), S, "mid_block_start"),
    # a lab policy shortened vLLM's 768 to 384
    (0, 384, 2000, SplitDecision(0, 1000, 768, 384, 0, 2000, 2000), S, "policy_stop"),
    # no split (caching off): the budget shared, or the threshold
    (0, 300, 2000, None, S, "shared_budget"),
    (0, 500, 2000, None, SplitSettings(384, 384, 1000, long_prefill=500), "long_prefill"),
    # an end none of vLLM's stops explains
    (0, 500, 2000, SplitDecision(0, 1000, 500, 500, 0, 2000, 2000), S, "unexplained"),
])
def test_chunk_reason_reads_the_split(start, end, num_tokens, decision, settings, reason):
    assert chunk_reason(start, end, num_tokens, num_tokens, settings, decision) == reason


def test_ledger_counts_the_extra_chunks_and_recomputation(rng):
    # B = 1000, a 2500-token prompt, no hit: 3 steps needed.
    led = PrefillLedger(1000)
    reasons = []
    ask = lambda: reasons.append("x") or "block_rounding"  # noqa: E731
    # [0, 400): 2100 left still needs 3 -> extra; [400, 1400): 1100 left needs 2, [1400, 2400):
    # 100 left needs 1, [2400, 2500): done -> on schedule
    chunks = ((0, 400), (400, 1400), (1400, 2400), (2400, 2500))
    assert [led.chunk("a", s, e, 2500, ask) for s, e in chunks] == [True, False, False, False]
    assert led.finish("a") == (4, {"block_rounding": 1}) and reasons == ["x"]
    # preempted after [0, 1000), resumed from its hit 0: [0, 1000) again recomputes (extra,
    # preemption, reason not asked), [1000, 2000), [2000, 2500): 4 steps for 3
    steps = [(0, 1000), (0, 1000), (1000, 2000), (2000, 2500)]
    assert [led.chunk("b", s, e, 2500, ask) for s, e in steps] == [False, True, False, False]
    assert led.finish("b") == (4, {"preemption": 1}) and reasons == ["x"]
    # resumed past what it had computed (a hit at 1600 after [0, 1000)): counted from there
    assert [led.chunk("c", s, e, 2500, ask) for s, e in ((0, 1000), (1600, 2500))] \
        == [False, False]
    assert led.finish("c") == (2, {}) and led.finish("never") == (0, {})
    # any chunking of a prompt: the extras are chunks - ceil(uncached / B)
    p, hit = rng.randint(1, 9000), 0
    hit = rng.randint(0, p - 1)
    ends, pos = [], hit
    while pos < p:
        pos = min(p, pos + rng.randint(1, 1000))
        ends.append(pos)
    starts = [hit] + ends[:-1]
    extra = sum(led.chunk("d", s, e, p, lambda: "shared_budget") for s, e in zip(starts, ends))
    assert extra == len(ends) - -(-(p - hit) // 1000)
    assert led.finish("d")[1] == ({"shared_budget": extra} if extra else {})


def test_format_reasons_columns(rng):
    k = rng.randint(1, 9)
    row = {"extra_prefill_steps_per_prompt": 0.5 + k,
           "extra_prefill_steps_by_reason": {"prompt_tail": k, "shared_budget": 0.5}}
    off = {"extra_prefill_steps_per_prompt": 0.25,
           "extra_prefill_steps_by_reason": {"shared_budget": 0.25}}
    head, line, off_line = format_reasons([("upstream", row)], off, width=10)
    assert head.split()[:4] == ["extra", "steps", "by", "reason"]
    assert "policy" not in head and "unexpl" not in head  # shown only where a row has them
    cols = head.split()[4:]
    vals = dict(zip(cols, line.split()[1:]))
    assert vals["extra"] == f"{0.5 + k:.2f}" and vals[">off"] == f"{0.25 + k:.2f}"
    assert vals["tail"] == f"{k:.2f}" and vals["shared"] == "0.50"
    assert off_line.split()[:4] == ["caching", "off", "0.25", "0.00"]
