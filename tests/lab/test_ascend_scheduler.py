"""The lab's model of vllm-ascend 0.30.0rc2's scheduler changes (``--target npu``): a KV
consumer's chunk stays whole after a computed prefix, one block more for a synchronous external
hit (:mod:`vllm_hybrid_npu_lab.ascend_scheduler`). Hand-counted replays on the tiny hybrid (3 GDN
+ 1 attention layer, block 256; trace blocks of 512 tokens), requests 10 simulated seconds apart.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import vllm

from vllm_hybrid_npu.support import base_version

from vllm_hybrid_npu_lab import ascend_scheduler as A
from vllm_hybrid_npu_lab.model import build_setup
from vllm_hybrid_npu_lab.policies import get_policy
from vllm_hybrid_npu_lab.presets import resolve_model
from vllm_hybrid_npu_lab.replay import replay
from vllm_hybrid_npu_lab.trace import TraceRequest

#: whether the model binds on the installed vLLM (its own version list)
BOUND = base_version(vllm.__version__) in A.VLLM_VERSIONS


@pytest.fixture(scope="module")
def cfg(tiny_model_dir):
    return resolve_model(str(tiny_model_dir))[1]


def test_consumer_rule_by_role_and_computed_prefix(rng):
    for _ in range(200):
        role = rng.choice([None, "kv_producer", "kv_consumer", "kv_both"])
        kv = None if role is None else SimpleNamespace(is_kv_consumer=role in ("kv_consumer", "kv_both"))
        computed, local, external = (rng.choice([0, 0, rng.randrange(1, 5000)]) for _ in range(3))
        req = SimpleNamespace(num_computed_tokens=computed)
        want = role in ("kv_consumer", "kv_both") and computed + local + external > 0
        assert A.consumer_keeps_whole(kv, req, local, external) is want, (role, computed, local, external)


def test_external_hit_block_counts_one_where_computed_tokens_pass_the_local_hits(rng):
    for _ in range(200):
        bs = rng.choice([256, 528, 1088])
        hits = rng.randrange(0, 6)
        total = rng.choice([hits * bs, hits * bs + rng.randrange(1, 3 * bs), rng.randrange(0, hits * bs + 1)])
        main = total + rng.choice([0, rng.randrange(1, 2000)])
        want = 1 if total > hits * bs and main > total else 0
        assert A.external_hit_block([object()] * hits, bs, total, main) == want, (bs, hits, total, main)


def _run(cfg, rows, *, target, host_bytes):
    pol = get_policy("upstream")
    reqs = [TraceRequest(10_000.0 * i, n, 4, tuple(h)) for i, (n, h) in enumerate(rows)]
    setup = build_setup(cfg, kv_cache_bytes=64 << 20, host_cache_bytes=host_bytes, block_size=256,
                        max_model_len=4096, configure=pol.configure, tune=pol.tune)
    return replay(reqs, setup, pol.scheduler_class(), carry_outputs=False, target=target)


@pytest.mark.skipif(not BOUND, reason="vllm-ascend 0.30.0rc2 runs on vLLM 0.30 only; on other "
                    "versions the NPU target binds no model of its scheduler")
def test_npu_beside_a_host_tier_keeps_a_hit_requests_chunk_whole(cfg, rng):
    # vLLM's split, block 256. A: 1,100 cold tokens (trace blocks 1, 2, 3): stop at 1,024, then
    # the rest: 2 steps, the state at 1,024 cached. B: the same first 1,024 tokens (blocks 1, 2),
    # then its own, n in (1,792, 2,048): it hits 1,024; vLLM stops at its last block boundary
    # 1,792 and computes the rest: 2 steps, the state at 1,792 cached. C = B again: hits 1,792,
    # 1 step. Beside a host tier (the OffloadingConnector, role kv_both: a KV consumer)
    # vllm-ascend runs B's chunk whole from 1,024 (1 step, no state at 1,792), so C hits 1,024
    # and also runs whole. Without a host tier the NPU replays as vLLM's split.
    n = rng.randint(1793, 2047)
    rows = [(1100, [1, 2, 3]), (n, [1, 2, 4, 5]), (n, [1, 2, 4, 5])]
    cuda = _run(cfg, rows, target="cuda", host_bytes=64 << 20)
    assert cuda.cached_per_request == [0, 1024, 1792], n
    assert cuda.prefill_steps_per_prompt == pytest.approx(5 / 3), n
    assert cuda.ascend_model == {}, n
    npu = _run(cfg, rows, target="npu", host_bytes=64 << 20)
    assert npu.cached_per_request == [0, 1024, 1024], n
    assert npu.prefill_steps_per_prompt == pytest.approx(4 / 3), n
    assert npu.ascend_model["kept_whole"] == 2, n  # B's chunk and C's
    assert npu.ascend_model["extra_blocks"] > 0, n  # every later step of a running request
    alone = _run(cfg, rows, target="npu", host_bytes=0)
    assert alone.cached_per_request == [0, 1024, 1792], n
    assert alone.prefill_steps_per_prompt == pytest.approx(5 / 3), n
    assert alone.ascend_model["kept_whole"] == 0, n


@pytest.mark.skipif(BOUND, reason="on vLLM 0.30 the model is bound (the test above)")
def test_npu_target_binds_nothing_outside_vllm_030(cfg):
    res = _run(cfg, [(1100, [1, 2, 3]), (1100, [1, 2, 3])], target="npu", host_bytes=64 << 20)
    assert res.ascend_model == {}
