"""The option ``ckpt`` (registry entry ``gdn-manager-cache``, vLLM 0.30):
which prefill checkpoints of a chunked cold prompt vLLM's real ``Scheduler`` and ``MambaManager``
keep in the prefix cache, with the GDN specs declaring the exporter's checkpoint block (the
lab's ``build_setup(prefill_checkpoints=True)``; only the forward pass is stood in).

Tiny hybrid (3 GDN + 1 attention layer), block ``B`` = 256, token budget 3 blocks, one output
token (no decode step). Expected boundaries are worked out by hand below from the prompt's
length and the retention interval, both drawn fresh (the seed is printed on failure).
"""

from __future__ import annotations

import json
import random

import pytest

pytest.importorskip("vllm")

from vllm_hybrid_npu.patches import gdn_prefill_checkpoint as gpc  # noqa: E402
from vllm_hybrid_npu.support import Stack  # noqa: E402
from vllm_hybrid_npu_lab.model import build_setup  # noqa: E402
from vllm_hybrid_npu_lab.presets import TINY_HYBRID, resolve_model  # noqa: E402
from vllm_hybrid_npu_lab.upstream_grid import UpstreamSetting  # noqa: E402
from vllm_hybrid_npu.envs import OPTIONS_ENV  # noqa: E402

B = 256
ENTRY = "gdn-manager-cache"


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-hybrid-chunk-ckpt")
    (d / "config.json").write_text(json.dumps(TINY_HYBRID))
    return resolve_model(str(d))[1]


@pytest.fixture
def entry(apply_entries, monkeypatch):
    """``entry(mode)``: the retention entry applied with the option ``ckpt``
    = ``mode``; skips where the installed vLLM is outside the entry's versions."""
    monkeypatch.delenv("VLLM_HYBRID_NPU_PREFILL_CHECKPOINTS", raising=False)

    def apply(mode):
        monkeypatch.setenv(OPTIONS_ENV, f"ckpt={mode}")
        report = apply_entries(ENTRY)
        if ENTRY in report.skipped:
            pytest.skip(f"{ENTRY}: {report.skipped[ENTRY]}")
        return report

    return apply


def _scheduler(cfg, ret):
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    setup = build_setup(cfg, kv_cache_bytes=64 << 20, max_model_len=1 << 14, block_size=B,
                        max_num_batched_tokens=3 * B, prefill_checkpoints=True,
                        tune=UpstreamSetting(ret=ret, ckpt=True).tune)
    assert setup.block_size == B and setup.hash_block_size == B
    vc = setup.vllm_config
    hash_fn = get_hash_fn_by_name(vc.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    sched = Scheduler(vllm_config=vc, kv_cache_config=setup.kv_cache_config,
                      structured_output_manager=StructuredOutputManager(vc),
                      block_size=setup.scheduler_block_size, hash_block_size=setup.hash_block_size,
                      log_stats=True)
    return sched, get_request_block_hasher(setup.hash_block_size, hash_fn)


def _run(sched, hasher, rid, tokens):
    """Add one request, step it to its end; returns (its chunks, per step and KV-cache group
    which block-table columns hold a block, the prefix-cache hit it started with in tokens)."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    req = Request(request_id=rid, prompt_token_ids=list(tokens),
                  sampling_params=SamplingParams(max_tokens=1, ignore_eos=True),
                  pooling_params=None, block_hasher=hasher)
    sched.add_request(req)
    chunks, tables, hit = [], [], None
    for _ in range(100):
        out = sched.schedule()
        ids = list(out.num_scheduled_tokens)
        if hit is None:  # schedule() advanced it past the first chunk already
            hit = req.num_computed_tokens - out.num_scheduled_tokens[rid]
        chunks.append(out.num_scheduled_tokens[rid])
        tables.append([[not b.is_null for b in blocks] for blocks in
                       sched.kv_cache_manager.get_blocks(rid).blocks])
        sampled = [[7] if sched.requests[r].num_computed_tokens >= sched.requests[r].num_tokens
                   else [] for r in ids]
        mro = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                sampled_token_ids=sampled)
        sched.update_from_output(out, mro)
        if req.is_finished():
            return chunks, tables, hit
    raise AssertionError("request did not finish")


def _cached_gdn_boundaries(sched) -> list[int]:
    """The boundaries (in blocks) where the first GDN group holds a cached state."""
    from vllm.v1.core.kv_cache_utils import get_group_id
    from vllm.v1.kv_cache_interface import MambaSpec

    groups = sched.kv_cache_manager.kv_cache_config.kv_cache_groups
    first = next(i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, MambaSpec))
    out = []
    for b in sched.kv_cache_manager.block_pool.blocks:
        if b.block_hash is not None and get_group_id(b.block_hash) == first:
            assert b.block_hash_num_tokens % B == 0
            out.append(b.block_hash_num_tokens // B)
    return sorted(out)


def _draw(seed):
    """A prompt of ``K`` full 3-block chunks (1-4) and a final chunk of 258-768 tokens (its
    checkpoint, ``(N - 1) // B`` blocks, lies past the final chunk's start), a retention
    interval ``r`` of 2-4 blocks, and the prompt's tokens."""
    rng = random.Random(seed)
    k, r = rng.randint(1, 4), rng.randint(2, 4)
    n = 3 * B * k + rng.randint(B + 2, 3 * B)
    return k, r, n, [rng.randrange(1000, 30000) for _ in range(n)]


def _by_hand(k, r, n, mode, ret):
    """Boundaries (blocks) holding a cached GDN state after the cold prompt, by hand.

    Chunks end at ``3j`` blocks (j = 1..k), then at ``n``. Each non-final chunk leaves its
    running state at ``3j`` (kept by vLLM's grid where ``3j`` is a multiple of ``r``; all at
    retention ``None``) and the exporter's checkpoint one block below its end, ``3j - 1``
    (vLLM 0.30 keeps it at any retention but 0; ``final`` drops it at ``r > 0``). The final
    chunk leaves the prompt's checkpoint ``(n - 1) // B`` (kept always: the entry's retention-0
    rule); its running state ends mid-block (not cached)."""
    cp = (n - 1) // B
    if ret == 0:
        return [cp]
    ends = [3 * j for j in range(1, k + 1) if ret is None or (3 * j) % r == 0]
    chunk_cps = [3 * j - 1 for j in range(1, k + 1)] if mode == "all" or ret is None else []
    return sorted(set(ends + chunk_cps + [cp]))


@pytest.mark.parametrize("ret_kind", ["grid", "zero", "dense"])
def test_final_keeps_only_the_rules_blocks_and_all_keeps_todays(cfg, entry, seed, ret_kind):
    k, r, n, tokens = _draw(seed)
    ret = {"grid": r, "zero": 0, "dense": None}[ret_kind]
    runs = {}
    for mode in ("all", "final"):
        entry(mode)
        sched, hasher = _scheduler(cfg, ret)
        chunks, tables, _ = _run(sched, hasher, "a", tokens)
        assert chunks == [3 * B] * k + [n - 3 * B * k], f"seed={seed}"
        got = _cached_gdn_boundaries(sched)
        assert got == _by_hand(k, r, n, mode, ret), f"seed={seed} mode={mode} k={k} r={r} n={n}"
        # the repeat hits the prompt's checkpoint in either mode
        _, _, hit = _run(sched, hasher, "b", tokens)
        assert hit == (n - 1) // B * B, f"seed={seed} mode={mode}"
        runs[mode] = (chunks, tables)
    # a dropped checkpoint is a hash only: the same chunks and the same columns reserved (the
    # block ids differ: a block freed without its hash is reused in another order)
    assert runs["all"] == runs["final"], f"seed={seed}"


def test_a_prompt_ending_past_a_dropped_checkpoint_hits_below_it(cfg, entry, seed):
    # A second prompt sharing the cold one's first 3j - 1 blocks and one more token, then its
    # own: with `all` it hits the first chunk's checkpoint (3j - 1) B; with `final` the highest
    # kept state below that, a chunk end 3i on the grid (i < j), else nothing.
    k, r, n, tokens = _draw(seed)
    j = random.Random(seed + 1).randint(1, k)
    rng = random.Random(seed + 2)
    other = tokens[:(3 * j - 1) * B + 1] + [rng.randrange(30001, 40000) for _ in range(B // 2)]
    for mode in ("all", "final"):
        entry(mode)
        sched, hasher = _scheduler(cfg, r)
        _run(sched, hasher, "a", tokens)
        _, _, hit = _run(sched, hasher, "b", other)
        kept = [3 * i for i in range(1, j) if (3 * i) % r == 0]
        want = 3 * j - 1 if mode == "all" else max(kept, default=0)
        assert hit == want * B, f"seed={seed} mode={mode} k={k} r={r} j={j}"


def test_bad_value_names_the_variable(apply_entries, monkeypatch):
    monkeypatch.setenv(OPTIONS_ENV, "ckpt=drop")
    with pytest.raises(ValueError, match=f"{OPTIONS_ENV}: ckpt='drop' is not one of all, final"):
        gpc.chunk_checkpoints()
    with pytest.raises(ValueError, match=OPTIONS_ENV):  # at load, where the entry applies
        apply_entries(ENTRY, stack=Stack("cpu", "0.30.0"))
    monkeypatch.setenv(OPTIONS_ENV, "ckpt=FINAL ")
    assert gpc.chunk_checkpoints() == "final"
    monkeypatch.delenv(OPTIONS_ENV, raising=False)
    assert gpc.chunk_checkpoints() == "all"


def test_left_out_on_vllm_032(apply_entries, monkeypatch):
    # vLLM 0.32 keeps a non-final chunk's checkpoint only on the retention grid itself (its
    # is_retained_checkpoint); the entry, and with it the option, stays 0.30's
    monkeypatch.setenv(OPTIONS_ENV, "ckpt=final")
    report = apply_entries(ENTRY, stack=Stack("cpu", "0.32.0"))
    assert report.skipped[ENTRY] == "not for vLLM 0.32.0 (for 0.30.0)"
