"""Scheduler-side counters (state moves, miss reasons) through vLLM's real Scheduler, and their
transport: ``SchedulerStats.vllm_hybrid_npu`` through vLLM's msgpack, into the stat logger's
Prometheus counters.

Tiny hybrid (3 GDN + 1 attention layer, lab preset), block size 256, align mode; only the forward
pass is stood in (as in the hit-rate lab). Expected numbers are worked out by hand below.
"""

from __future__ import annotations

import inspect
import json
import random

import pytest

pytest.importorskip("vllm")

from vllm_hybrid_npu import metrics  # noqa: E402
from vllm_hybrid_npu.core.miss_reasons import REASONS  # noqa: E402
from vllm_hybrid_npu.patches import vllm_v1_core_sched_scheduler as hook  # noqa: E402
from vllm_hybrid_npu_lab.model import build_setup  # noqa: E402
from vllm_hybrid_npu_lab.presets import TINY_HYBRID, resolve_model  # noqa: E402

BS = 256


def _state_bytes(sched) -> int:
    """One GDN state of the tiny model, by hand: key dim = value dim = 2 heads x 16 = 32;
    conv state (kernel 4 - 1 = 3) x (32 + 32 + 32) = 288 bf16 = 576 bytes; SSM state
    2 value heads x 16 x 16 = 512 elements in the SSM cache dtype (vLLM's CPU platform resets
    it to float32 for the GDN backend: 2048 bytes); 3 GDN layers."""
    ssm_itemsize = 4 if sched.cache_config.mamba_ssm_cache_dtype == "float32" else 2
    return 3 * (576 + 512 * ssm_itemsize)


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-hybrid-metrics")
    (d / "config.json").write_text(json.dumps(TINY_HYBRID))
    return resolve_model(str(d))[1]


@pytest.fixture
def patched():
    before = hook.applied()  # vLLM may have loaded the plugin in this process already
    hook.apply()
    assert hook.applied()
    yield
    if not before:
        hook.unapply()
        assert not hook.applied()


def _scheduler(cfg, max_num_batched_tokens, spec=None):
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    setup = build_setup(cfg, kv_cache_bytes=64 << 20, max_model_len=4096, block_size=BS,
                        max_num_batched_tokens=max_num_batched_tokens)
    assert setup.block_size == BS
    vc = setup.vllm_config
    if spec is not None:  # a speculative configuration, set as vLLM would before the scheduler
        spec(vc, setup.kv_cache_config)
    hash_fn = get_hash_fn_by_name(vc.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    sched = Scheduler(
        vllm_config=vc,
        kv_cache_config=setup.kv_cache_config,
        structured_output_manager=StructuredOutputManager(vc),
        block_size=setup.scheduler_block_size,
        hash_block_size=setup.hash_block_size,
        log_stats=True,
    )
    return sched, get_request_block_hasher(setup.hash_block_size, hash_fn)


def _run_one(sched, hasher, rid, tokens, max_tokens, stats_out):
    """Add one request and step until it finishes; collect every SchedulerStats."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    req = Request(request_id=rid, prompt_token_ids=list(tokens),
                  sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                  pooling_params=None, block_hasher=hasher)
    sched.add_request(req)
    chunks = []
    for _ in range(200):
        out = sched.schedule()
        ids = list(out.num_scheduled_tokens)
        chunks += [out.num_scheduled_tokens[r] for r in ids if r == rid]
        sampled = [[7] if sched.requests[r].num_computed_tokens >= sched.requests[r].num_tokens
                   else [] for r in ids]
        index = ({"req_id_to_index": {r: i for i, r in enumerate(ids)}}  # none on vLLM 0.34
                 if "req_id_to_index" in inspect.signature(ModelRunnerOutput).parameters else {})
        mro = ModelRunnerOutput(req_ids=ids, sampled_token_ids=sampled, **index)
        for eco in sched.update_from_output(out, mro).values():
            if eco.scheduler_stats is not None:
                stats_out.append(eco.scheduler_stats)
        if req.is_finished():
            return chunks
    raise AssertionError("request did not finish")


def _sum_stats(stats):
    tot: dict[str, int] = {}
    for s in stats:
        for k, v in (getattr(s, metrics.STATS_FIELD) or {}).items():
            tot[k] = tot.get(k, 0) + v
    return tot


def test_shared_prefix_misses_and_moves_by_hand(cfg, patched):
    # Four 2000-token prompts sharing their first 1536 tokens (6 blocks), one after another,
    # 3 output tokens each, 512-token step budget.
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    shared = [rng.randrange(1000, 30000) for _ in range(1536)]
    prompts = [shared + [rng.randrange(1000, 30000) for _ in range(464)] for _ in range(4)]
    sched, hasher = _scheduler(cfg, 512)
    stats = []
    chunks = [_run_one(sched, hasher, f"r{i}", p, 3, stats) for i, p in enumerate(prompts)]
    # Schedules (vLLM's, checked here so the hand counts below rest on them): 512-token chunks,
    # align mode stops at the prompt's last block boundary 1792 (and r1 at the junction 1536,
    # already a chunk end); r2, r3 hit 1536 (r1's junction state); then 2 decode steps each.
    assert chunks[0] == chunks[1] == [512, 512, 512, 256, 208, 1, 1], f"seed={seed}"
    assert chunks[2] == chunks[3] == [256, 208, 1, 1], f"seed={seed}"
    # Running-state columns (block of the last scheduled token, ceil(end / 256) - 1):
    #   r0: 1, 3, 5, 6, 7, then 7, 7 (decode to 2002) -> 4 moves; r1 the same -> 4;
    #   r2, r3: start at the hit state's column (1536 - 1) // 256 = 5, then 6, 7 -> 2 each. 12.
    t = hook.totals(sched)
    assert t["state_copies"] == 12, f"seed={seed}"
    assert t["state_copy_bytes"] == 12 * _state_bytes(sched), f"seed={seed}"
    # Misses, reach = (2000 - 1) // 256 * 256 = 1792, tail 208 tokens partial_block each:
    #   r0: nothing cached -> 7 blocks new (1792);
    #   r1: attention holds r0's 6 shared blocks, no state there -> no_state 1536, block 6 new;
    #   r2, r3: hit 1536 (r1's junction state), block 6 new (256).
    assert hook.miss_totals(sched) == {
        "partial_block": 4 * 208, "drafter_drop": 0, "no_state": 1536, "evicted": 0, "evicted_host": 0,
        "new": 1792 + 3 * 256,
    }, f"seed={seed}"
    assert t["requests"] == 4 and t["hit_tokens"] == 2 * 1536 and t["prompt_tokens"] == 8000
    # The same counts travelled in SchedulerStats, once each.
    got = _sum_stats(stats)
    assert got[metrics.KEY_STATE_COPIES] == 12
    assert got[metrics.KEY_STATE_COPY_BYTES] == 12 * _state_bytes(sched)
    assert got[metrics.KEY_REQUESTS] == 4
    assert {r: got.get(metrics.MISS_PREFIX + r, 0) for r in REASONS} == hook.miss_totals(sched)


def test_evicted_after_a_prefix_cache_reset(cfg, patched):
    # r0 (1000 tokens) finishes, the prefix cache is reset (every cached block evicted), r0's
    # prompt comes again: reach (999 // 256) * 256 = 768 -> 3 blocks evicted, 232 partial.
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    prompt = [rng.randrange(1000, 30000) for _ in range(1000)]
    sched, hasher = _scheduler(cfg, 4096)
    stats = []
    _run_one(sched, hasher, "a", prompt, 2, stats)
    assert sched.reset_prefix_cache()
    _run_one(sched, hasher, "b", prompt, 2, stats)
    assert hook.miss_totals(sched) == {
        "partial_block": 2 * 232, "drafter_drop": 0, "no_state": 0, "evicted": 768,
        "evicted_host": 0, "new": 768,
    }, f"seed={seed}"


def test_drafter_drop_is_its_own_miss_reason(cfg, patched):
    """Under EAGLE/MTP (the lab's stand-in for vLLM 0.30's ``SpeculativeConfig``, ``k``
    speculative tokens drawn, the Mamba groups' speculative blocks set as vLLM sets them), on
    vLLM's real scheduler (align mode, no exporter): an ``N``-token prompt, its exact repeat,
    then a sharer of its first ``S`` tokens (``2B <= S <= R - B``) with a fresh tail of ``B`` to
    ``2B`` tokens. By hand, with ``R = (N - 1) // B * B`` and the drop unit ``D = B`` (no
    prefix-match unit):

    * cold: ``R`` new, ``N - R`` partial;
    * repeat: hits ``R - D`` (vLLM's premise, asserted: its checkpoint sits one unit lower under
      the drop); misses ``N - R`` partial and ``D`` for the drafter, none evicted, though every
      block below ``R`` had a cache entry;
    * sharer (``N'`` tokens, ``R' = (N' - 1) // B * B``): the attention lookup matches the
      ``L = S // B * B`` tokens of whole shared blocks and drops the last block, so ``A = L - D``;
      no GDN state below ``R - B``, so it hits 0 (asserted) and misses ``A`` no_state, ``D`` for
      the drafter, ``R' - L`` new and ``N' - R'`` partial."""
    import dataclasses

    import vllm
    from vllm.v1.kv_cache_interface import MambaSpec

    from vllm_hybrid_npu_lab.model import mtp_config

    if not vllm.__version__.startswith("0.30."):
        pytest.skip(f"the stand-in SpeculativeConfig is vLLM 0.30's (installed: {vllm.__version__})")
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    k, n = rng.choice((1, 2, 3)), rng.randrange(5 * BS + 1, 8 * BS + 1)
    r = (n - 1) // BS * BS
    s = rng.randrange(2 * BS, r - BS + 1)
    prompt = [rng.randrange(1000, 30000) for _ in range(n)]
    sharer = prompt[:s] + [rng.randrange(30000, 40000) for _ in range(rng.randrange(BS, 2 * BS + 1))]
    n2, lf = len(sharer), s // BS * BS
    r2 = (n2 - 1) // BS * BS
    sched, hasher = _scheduler(cfg, 4096, spec=lambda vc, kvc: (
        object.__setattr__(vc, "speculative_config", mtp_config(k)),
        [setattr(g, "kv_cache_spec", dataclasses.replace(g.kv_cache_spec, num_speculative_blocks=k))
         for g in kvc.kv_cache_groups if isinstance(g.kv_cache_spec, MambaSpec)]))
    where = f"seed={seed}, k={k}, N={n}, R={r}, S={s}, N'={n2}"
    assert sched.use_eagle_block_drop, where
    stats = []
    want = dict.fromkeys(REASONS, 0)
    _run_one(sched, hasher, "a", prompt, 2, stats)
    want.update(new=r, partial_block=n - r)
    assert hook.miss_totals(sched) == want, where
    chunks = _run_one(sched, hasher, "b", prompt, 2, stats)
    assert n - sum(chunks[:-1]) == r - BS, f"{where}: premise: vLLM's repeat hit, chunks {chunks}"
    want.update(partial_block=2 * (n - r), drafter_drop=BS)
    assert hook.miss_totals(sched) == want, where
    chunks = _run_one(sched, hasher, "c", sharer, 2, stats)
    assert sum(chunks[:-1]) == n2, f"{where}: premise: the sharer hits nothing, chunks {chunks}"
    want.update(partial_block=want["partial_block"] + n2 - r2, no_state=lf - BS,
                drafter_drop=2 * BS, new=r + r2 - lf)
    assert hook.miss_totals(sched) == want, where


def test_scheduler_stats_field_survives_vllm_msgpack():
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.metrics.stats import SchedulerStats
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    assert metrics.declare_stats_field()
    s = SchedulerStats(num_running_reqs=2)
    counts = {metrics.KEY_STATE_COPIES: random.randrange(1, 100), "miss:new": 5}
    setattr(s, metrics.STATS_FIELD, counts)
    bufs = MsgpackEncoder().encode(EngineCoreOutputs(scheduler_stats=s))
    back = MsgpackDecoder(EngineCoreOutputs).decode(bufs).scheduler_stats
    assert getattr(back, metrics.STATS_FIELD) == counts and back.num_running_reqs == 2
    # absent -> None; upstream constructor, repr and replace unchanged
    plain = MsgpackDecoder(EngineCoreOutputs).decode(
        MsgpackEncoder().encode(EngineCoreOutputs(scheduler_stats=SchedulerStats()))
    ).scheduler_stats
    assert getattr(plain, metrics.STATS_FIELD) is None
    assert metrics.STATS_FIELD not in repr(s)


def test_stat_logger_serves_counts_on_the_default_registry():
    from prometheus_client import REGISTRY, generate_latest
    from prometheus_client.parser import text_string_to_metric_families
    from vllm.v1.metrics.stats import SchedulerStats

    def served(model):
        out = {}
        text = generate_latest(REGISTRY).decode()
        for fam in text_string_to_metric_families(text):
            for smp in fam.samples:
                if smp.name.startswith("vllm_hybrid_npu:") and smp.labels.get("model_name") == model:
                    out[(smp.name, smp.labels.get("engine"), smp.labels.get("reason"))] = smp.value
        return out

    class _Cfg:
        class model_config:  # noqa: N801
            served_model_name = f"m{random.randrange(1 << 30)}"

    model = _Cfg.model_config.served_model_name
    lg = metrics.HybridNpuStatLogger(_Cfg, [0, 1])
    before = served(model)
    assert before[("vllm_hybrid_npu:prefix_cache_miss_tokens_total", "1", "no_state")] == 0
    n, b = random.randrange(1, 50), random.randrange(1, 10**6)
    s = SchedulerStats()
    setattr(s, metrics.STATS_FIELD, {metrics.KEY_STATE_COPIES: n, metrics.KEY_STATE_COPY_BYTES: b,
                                     "miss:no_state": 11, metrics.KEY_REQUESTS: 1})
    lg.record(s, None, engine_idx=1)
    lg.record(s, None, engine_idx=1)
    lg.record(SchedulerStats(), None, engine_idx=0)  # no field: nothing
    lg.record(None, None, engine_idx=0)
    after = served(model)
    assert after[("vllm_hybrid_npu:state_copies_total", "1", None)] == 2 * n
    assert after[("vllm_hybrid_npu:state_copy_bytes_total", "1", None)] == 2 * b
    assert after[("vllm_hybrid_npu:prefix_cache_miss_tokens_total", "1", "no_state")] == 22
    assert after[("vllm_hybrid_npu:prefix_cache_classified_requests_total", "1", None)] == 2
    assert after[("vllm_hybrid_npu:state_copies_total", "0", None)] == 0
