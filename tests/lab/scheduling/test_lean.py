"""The ``lean`` policy and the lab's ``gdn-checkpoints`` driven through vLLM's real Scheduler and
KV-cache manager (the hit-rate lab's replay, tiny hybrid: 3 GDN + 1 attention layer, block 256).

Expected hits and block orders are worked out by hand from the rules in
``vllm_hybrid_npu_lab/scheduling/retention.py``; trace blocks are 512 tokens.
"""

from __future__ import annotations

import json
import random

import pytest

from vllm_hybrid_npu_lab.model import build_setup
from vllm_hybrid_npu_lab.policies import get_policy, policy_unavailable
from vllm_hybrid_npu_lab.presets import TINY_HYBRID, resolve_model
from vllm_hybrid_npu_lab.replay import replay
from vllm_hybrid_npu_lab.trace import TraceRequest
from vllm_hybrid_npu_lab.scheduling.scheduler import scheduler_class

#: lean is a retired lab row written against vLLM 0.30 (Policy.vllm); skipped elsewhere, with why
_LEAN_UNAVAILABLE = policy_unavailable("lean")
pytestmark = pytest.mark.skipif(_LEAN_UNAVAILABLE is not None, reason=_LEAN_UNAVAILABLE or "")

BS = 256


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-hybrid-lean")
    (d / "config.json").write_text(json.dumps(TINY_HYBRID))
    return resolve_model(str(d))[1]


def _setup(cfg, reqs, policy="upstream", kv_bytes=64 << 20):
    pol = get_policy(policy)
    return build_setup(
        cfg,
        kv_cache_bytes=kv_bytes,
        max_model_len=max(r.input_length + r.output_length for r in reqs),
        block_size=BS,
        configure=pol.configure,
    )


def _reqs(rows, gap_ms=10_000.0):
    return [TraceRequest(gap_ms * i, n, out, tuple(h)) for i, (n, out, h) in enumerate(rows)]


def _run(cfg, rows, policy, **kw):
    reqs = _reqs(rows)
    setup = _setup(cfg, reqs, policy, **kw)
    return replay(reqs, setup, get_policy(policy).scheduler_class())


# 2000-token prompts sharing 3 trace blocks = 1536 tokens = 6 blocks; the prompt's last block
# boundary is 1792 (7 blocks), so the shared prefix ends exactly one block below it.
SHARED = [(2000, 4, [1, 2, 3, 10 + i]) for i in range(4)]


def test_lean_hits_a_prefix_ending_one_block_before_the_prompt_end(cfg):
    # lean keeps the state at the last boundary minus one block (1536): hit on first repeat
    assert _run(cfg, SHARED, "lean").cached_per_request == [0, 1536, 1536, 1536]
    assert _run(cfg, SHARED, "upstream").cached_per_request == [0, 0, 1536, 1536]


def test_lean_keeps_only_its_boundaries(cfg):
    # one 4000-token prompt (15 full blocks, last boundary 3840), 1 output token: lean keeps
    # the window {3584, 3840}: 2 states; the lab's retired tail keeps one per block boundary
    # crossed by a step end (15); upstream only the replay boundary (1); a window of 3 adds 3328, the ladder 256, 512,
    # 1024, 2048.
    rows = [(4000, 1, [1, 2, 3, 4, 5, 6, 7, 8])]
    assert _run(cfg, rows, "lean").cached_states == 2
    assert _run(cfg, rows, "tail").cached_states == 15
    assert _run(cfg, rows, "upstream").cached_states == 1
    assert _run(cfg, rows, "lean-w3").cached_states == 3
    assert _run(cfg, rows, "lean-ladder").cached_states == 6


def test_lean_keeps_the_decode_boundaries(cfg):
    # a 1000-token prompt with 300 output tokens crosses 1024 and 1280 in decode: both are kept
    # (each was the latest when decode crossed it), with the window {512, 768}: 4 states
    # (2 without decode states, 5 with a window of 3); upstream keeps the replay boundary only.
    row = (1000, 300, [50, 51])
    assert _run(cfg, [row], "lean").cached_states == 4
    assert _run(cfg, [row], "lean-nodecode").cached_states == 2
    assert _run(cfg, [row], "lean-w3").cached_states == 5
    assert _run(cfg, [row], "upstream").cached_states == 1


def _captured(policy):
    """The policy's scheduler class, recording each instance built (for queue inspection)."""
    base = get_policy(policy).scheduler_class()
    made = []

    class Capture(base):  # type: ignore[misc, valid-type]
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            made.append(self)

    return Capture, made


def _queue_positions(sched, request_tokens):
    """Free-queue order (front first) of the cached blocks, as (kind, block index) pairs."""
    from vllm.v1.core.kv_cache_utils import get_block_hash, get_group_id
    from vllm.v1.kv_cache_interface import MambaSpec

    groups = sched.kv_cache_manager.kv_cache_config.kv_cache_groups
    mamba = {i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, MambaSpec)}
    pool = sched.kv_cache_manager.block_pool
    out = []
    block = pool.free_block_queue.fake_free_list_head.next_free_block
    while block is not pool.free_block_queue.fake_free_list_tail:
        if block.block_hash is not None:
            key = block.block_hash
            idx = request_tokens[bytes(get_block_hash(key))]
            out.append(("state" if get_group_id(key) in mamba else "attn", idx))
        block = block.next_free_block
    return out


def _hash_index(cfg, row):
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    from vllm_hybrid_npu_lab.trace import prompt_token_ids

    tr = _reqs([row])[0]
    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    req = Request(
        request_id="x",
        prompt_token_ids=prompt_token_ids(tr),
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        block_hasher=get_request_block_hasher(BS, hash_fn),
    )
    return {bytes(h): i for i, h in enumerate(req.block_hashes)}


def _freed_order(cfg, policy, row):
    cls, made = _captured(policy)
    reqs = _reqs([row])
    replay(reqs, _setup(cfg, reqs, policy), cls)
    return _queue_positions(made[0], _hash_index(cfg, row))


def test_lean_frees_blocks_as_segments(cfg):
    # 2000-token prompt: blocks 0..6 full, last boundary 1792. lean keeps states at 1536 and
    # 1792 (blocks 5, 6). Freed order (front of the queue first): segment 6 (its state, attn 6),
    # then segment 5 (state 5, attn 5 .. 0). A state is 3 blocks (one per GDN group).
    row = (2000, 1, [60, 61, 62, 63])
    S, A = "state", "attn"
    assert _freed_order(cfg, "lean", row) == (
        [(S, 6)] * 3 + [(A, 6)] + [(S, 5)] * 3 + [(A, i) for i in range(5, -1, -1)]
    )
    # with the ladder (256, 512, 1024 = blocks 0, 1, 3, never hit: low value) those leave first
    assert _freed_order(cfg, "lean-ladder", row) == (
        [(S, 0)] * 3 + [(S, 1)] * 3 + [(S, 3)] * 3
        + [(S, 6)] * 3 + [(A, 6)] + [(S, 5)] * 3 + [(A, i) for i in range(5, -1, -1)]
    )
    # upstream (vLLM's order): GDN groups first, then attention, each tail first
    got = _freed_order(cfg, "upstream", row)
    assert got[-7:] == [(A, i) for i in range(6, -1, -1)]
    assert all(k == S for k, _ in got[:-7])


def test_lean_class_in_the_engine_registry():
    cls = scheduler_class("lean")
    assert cls.checkpoint_policy == "lean"
    assert cls.__name__ == "LeanCheckpointScheduler"


def test_with_speculative_decoding_lean_leaves_vllms_schedule_alone(cfg, caplog):
    """Any speculative_config: vLLM changes align mode itself (EAGLE/MTP block drop, MTP
    lookahead), which lean does not model, so lean must act exactly like upstream (same hits,
    same kept states) and say so; without it the same rows differ (the first repeat of SHARED
    hits only with lean, test above)."""
    from vllm.config import SpeculativeConfig

    rows = SHARED + [(4000, 1, [1, 2, 3, 4, 5, 6, 7, 8])]

    def run(policy):
        reqs = _reqs(rows)
        pol = get_policy(policy)

        def configure(vllm_config):
            if pol.configure is not None:
                pol.configure(vllm_config)
            vllm_config.speculative_config = SpeculativeConfig(
                method="ngram", num_speculative_tokens=2, prompt_lookup_min=1, prompt_lookup_max=3)

        setup = build_setup(cfg, kv_cache_bytes=64 << 20,
                            max_model_len=max(r.input_length + r.output_length for r in reqs),
                            block_size=BS, configure=configure)
        return replay(reqs, setup, pol.scheduler_class())

    with caplog.at_level("WARNING", logger="vllm_hybrid_npu"):
        lean = run("lean")
    up = run("upstream")
    assert lean.cached_per_request == up.cached_per_request
    assert lean.cached_states == up.cached_states
    assert "checkpoint policy lean not applied: speculative decoding (ngram)" in caplog.text
