"""Host tier, carried answers and the upstream option grid of the hit-rate lab, on the tiny hybrid.

The tiny hybrid (3 GDN + 1 attention layer, block 256 tokens): one block of any group is 256
tokens x 256 bytes = 65,536 bytes (the GDN state page is padded to the attention page), so a
state at one boundary is 3 blocks (one per GDN group). Trace blocks are 512 tokens. Requests
arrive 10 simulated seconds apart, so each runs alone. Expected hits are worked out by hand in
the comments (align mode: a prefill stops at the prompt's last block boundary, where vLLM keeps
the state; ``lean`` also keeps the state at every boundary decode crosses).
"""

from __future__ import annotations

import random

import pytest

from vllm_hybrid_npu_lab.host_tier import HostLink
from vllm_hybrid_npu_lab.model import build_setup
from vllm_hybrid_npu_lab.policies import DEFAULT_POLICY, get_policy, policy_unavailable
from vllm_hybrid_npu_lab.presets import resolve_model
from vllm_hybrid_npu_lab.replay import output_token, replay
from vllm_hybrid_npu_lab.trace import TraceRequest, carried_prompts, conversation_parents

BLOCK_BYTES = 256 * 256  # one block of any group


@pytest.fixture(scope="module")
def cfg(tiny_model_dir):
    return resolve_model(str(tiny_model_dir))[1]


def _reqs(rows):
    return [TraceRequest(10_000.0 * i, n, out, tuple(h)) for i, (n, out, h) in enumerate(rows)]


def _run(cfg, reqs, policy="upstream", *, kv_bytes=64 << 20, host_bytes=0, link=None, carry=True):
    pol = get_policy(policy)
    setup = build_setup(
        cfg,
        kv_cache_bytes=kv_bytes,
        host_cache_bytes=host_bytes,
        max_model_len=max(r.input_length + r.output_length for r in reqs),
        block_size=256,
        configure=pol.configure,
        tune=pol.tune,
    )
    return replay(reqs, setup, pol.scheduler_class(), link=link, carry_outputs=carry)


# A (1,100 tokens: state kept at its last boundary 1,024), A again, B (3,000 distinct tokens: 12
# attention blocks), A again. The device pool holds 24 blocks: B's 12 attention blocks + its
# running GDN blocks + A's 4 cached attention blocks + A's 3-block state do not fit, and vLLM
# frees a request's GDN groups before its attention group, so LRU takes A's state first.
EVICT = [(1100, 4, [1, 2, 3]), (1100, 4, [1, 2, 3]), (3000, 4, [5, 6, 7, 8, 9, 10]), (1100, 4, [1, 2, 3])]
DEVICE_24_BLOCKS = 24 * BLOCK_BYTES


def test_host_tier_serves_what_the_device_evicted(cfg):
    reqs = _reqs(EVICT)
    device = _run(cfg, reqs, kv_bytes=DEVICE_24_BLOCKS)
    assert device.num_blocks == 24
    assert device.cached_per_request == [0, 1024, 0, 0]
    assert device.host_cached_prompt_tokens == 0 and device.host == {}
    gbps, lat = random.choice([(10.0, 0.0), (50.0, 10.0), (25.0, 3.0)])
    tiered = _run(cfg, reqs, kv_bytes=DEVICE_24_BLOCKS, host_bytes=64 << 20, link=HostLink(gbps, lat))
    # the last A loads its 1,024-token prefix from the host: 4 attention blocks + the state at
    # 1,024 (3 blocks), one load job of 7 blocks
    assert tiered.cached_per_request == [0, 1024, 0, 1024]
    assert tiered.host_per_request == [0, 0, 0, 1024]
    assert tiered.host_cached_prompt_tokens == 1024
    assert tiered.device_cached_prompt_tokens == 1024
    assert tiered.host["load_jobs"] == 1
    assert tiered.host["load_bytes"] == 7 * BLOCK_BYTES
    assert tiered.host["load_s"] == pytest.approx(lat * 1e-6 + 7 * BLOCK_BYTES / (gbps * 1e9))
    assert tiered.host["store_bytes"] > 0


def test_host_tier_gives_nothing_when_the_device_keeps_everything(cfg):
    reqs = _reqs(EVICT)
    tiered = _run(cfg, reqs, host_bytes=64 << 20)
    assert tiered.cached_per_request == [0, 1024, 0, 1024]
    assert tiered.host_cached_prompt_tokens == 0 and tiered.host["load_jobs"] == 0


def test_host_link_rejects_bad_values():
    with pytest.raises(ValueError, match="--host-link-gbps"):
        HostLink(0.0, 1.0)
    with pytest.raises(ValueError, match="--host-link-latency-us"):
        HostLink(1.0, -1.0)


# A: 1,100-token prompt, 300 generated tokens (decode crosses 1,280); C extends A's two full
# trace blocks [1, 2] with 2,000 tokens: a chat's next turn.
TURNS = [(1100, 300, [1, 2, 3]), (2000, 4, [1, 2, 7, 8])]


def test_carried_prompt_is_history_plus_answer():
    reqs = _reqs(TURNS)
    assert conversation_parents(reqs) == [None, 0]
    prompts, parents = carried_prompts(reqs, output_token)
    assert parents == [None, 0]
    assert len(prompts[1]) == 2000
    assert prompts[1][:1100] == prompts[0]
    assert prompts[1][1100:1400] == [output_token(0, k) for k in range(300)]
    # its own tokens from 1,400 on: trace block 2 (id 7) covers 1,024..1,535
    assert prompts[1][1400] == 7 * 512 + (1400 - 1024)
    plain, none = carried_prompts(reqs, output_token, carry=False)
    assert none == [None, None] and plain[1][1100] == 7 * 512 + 76


@pytest.mark.parametrize("policy", ["lean", "upstream:ret=dense"])
def test_state_kept_in_decode_hits_the_next_turn(cfg, policy):
    reqs = _reqs(TURNS)
    carried = _run(cfg, reqs, policy)
    plain = _run(cfg, reqs, policy, carry=False)
    # without the answer in the next prompt the shared prefix is 1,024 tokens (two trace
    # blocks, A's last prompt boundary): both hit 1,024
    assert plain.cached_per_request == [0, 1024]
    assert carried.carried_requests == 1
    # lean keeps the state where decode crossed 1,280 (1,100 + 180 generated tokens); vLLM's
    # dense retention keeps every state a step end wrote, decode's included
    assert carried.cached_per_request == [0, 1280]


def test_tail_is_upstream_with_dense_retention_and_one_block_threshold(cfg):
    why = policy_unavailable("tail")
    if why:
        pytest.skip(why)
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    rows, next_id = [], 100
    prefixes = [[rng.randrange(5) for _ in range(3)] for _ in range(3)]
    for _ in range(8):
        ids = rng.choice(prefixes)[: rng.randint(1, 3)] + list(range(next_id, next_id + 2))
        next_id += 2
        rows.append((rng.randint((len(ids) - 1) * 512 + 1, len(ids) * 512), rng.randint(1, 300), ids))
    reqs = _reqs(rows)
    tail = _run(cfg, reqs, "tail")
    flags = _run(cfg, reqs, "upstream:ret=dense,lpt=1b")
    assert tail.cached_per_request == flags.cached_per_request, f"seed {seed}"
    assert tail.computed_prompt_tokens == flags.computed_prompt_tokens, f"seed {seed}"


def test_upstream_best_names_the_best_setting():
    from vllm_hybrid_npu_lab.cli import upstream_best

    policies = {
        "upstream": {"token_hit_rate": 0.1},
        "upstream:ret=dense": {"token_hit_rate": 0.3},
        "lean": {"token_hit_rate": 0.9},
        "upstream:lpt=1b": {"token_hit_rate": 0.2},
    }
    best = upstream_best(policies)
    assert best == {"token_hit_rate": 0.3, "setting": "upstream:ret=dense"}
    assert upstream_best({"lean": {"token_hit_rate": 0.5}}) is None


def test_prefix_match_unit_must_divide_the_block(cfg):
    from vllm_hybrid_npu_lab.upstream_grid import UpstreamSetting

    reqs = _reqs(TURNS)
    with pytest.raises(ValueError, match="--prefix-match-unit 96"):
        build_setup(cfg, kv_cache_bytes=64 << 20, max_model_len=2100, block_size=256,
                    tune=UpstreamSetting(0, 0, 96).tune)
    assert reqs


def test_default_policy_is_selectable():
    assert get_policy("default") is get_policy(DEFAULT_POLICY)


def test_miss_reasons_account_for_every_missed_token(cfg):
    import importlib.util

    reqs = _reqs(EVICT)
    res = _run(cfg, reqs, kv_bytes=DEVICE_24_BLOCKS)
    if importlib.util.find_spec("vllm_hybrid_npu.core.miss_reasons") is None:
        # hook for issue 15 item 5: no classifier in this runtime yet
        assert res.miss_reasons is None
        return
    from vllm_hybrid_npu.core.miss_reasons import REASONS

    m = res.miss_reasons
    assert m["prompt_tokens"] == res.prompt_tokens == 3 * 1100 + 3000
    assert m["hit_tokens"] == res.cached_prompt_tokens
    assert sum(m[r] for r in REASONS) == res.prompt_tokens - res.cached_prompt_tokens
    # the last A: its attention blocks (1,024 tokens) survived B, its state did not
    assert m["no_state"] == 1024


# A (2,000 tokens: last boundary 1,792), B evicts A from the device, C shares A's first three
# trace blocks (1,536 tokens = one block below A's last boundary).
HOST_WINDOW = [(2000, 4, [1, 2, 3, 4]), (3000, 4, [5, 6, 7, 8, 9, 10]), (2000, 4, [1, 2, 3, 11])]


@pytest.mark.parametrize(
    "policy, hit",
    [
        ("upstream", 0),  # the connector copies only the replay-boundary state (1,792)
        ("lean", 1536),  # lean's window state (1,536) reaches the host through the hook
        ("tail", 1536),  # dense retention: every boundary, the connector too
        ("adaptive", 1024),  # the ladder's states: 256, 512, 1,024 (and 1,792)
    ],
)
def test_policy_states_reach_the_host_tier(cfg, policy, hit):
    reqs = _reqs(HOST_WINDOW)
    device = _run(cfg, reqs, policy, kv_bytes=DEVICE_24_BLOCKS)
    assert device.cached_per_request == [0, 0, 0]
    tiered = _run(cfg, reqs, policy, kv_bytes=DEVICE_24_BLOCKS, host_bytes=64 << 20)
    assert tiered.cached_per_request == [0, 0, hit]
    assert tiered.host_per_request == [0, 0, hit]


def _off_block_trace(rng):
    """``A`` of ``256 k + r`` tokens (``r`` in 65..255: its last 64-token boundary is not a
    multiple of the 256-token block; ``r`` not a multiple of 64: a prompt ending on the 64-token
    grid is run to its end by vLLM's split, which then stores no state at ``64 (x // 64)``, the
    most its repeat can hit with its last token recomputed; stop 44's CI draw, ``r = 192``), two
    3,000-token prompts that flush the 24-block device, then ``A`` again; returns the requests and
    ``x = len(A) - 1``."""
    n = 256 * rng.randint(1, 3) + rng.choice([r for r in range(65, 256) if r % 64])
    ids = rng.sample(range(100, 100_000), 14)
    rows = [(n, 4, ids[:2]), (3000, 4, ids[2:8]), (3000, 4, ids[8:14]), (n, 4, ids[:2])]
    return _reqs(rows), n - 1


def test_exporter_checkpoint_off_the_block_is_held_by_the_host_out_of_the_connectors_reach(cfg, rng):
    """Issue 33: with ``--prefix-match-unit 64`` below the 256-token block, vLLM's split stops a
    cold prompt at its last block boundary ``256 (x // 256)`` and at its last 64-token boundary
    ``64 (x // 64)``; both states reach the host tier and the repeat loads ``64 (x // 64)`` (the
    OffloadingConnector finds a partial tail within one block past a full-block hit). The
    exporter writes one checkpoint, at ``64 (x // 64)``: the host holds it (every group's entry),
    but holds no GDN state at the block boundary beneath, so the connector's full-block lookup
    stops at 0 and never reaches it. At the block's own unit both write the state at the last
    block boundary and the repeat hits it alike (the same block: only the checkpoint's position
    differs from the split's stops). Same on vLLM 0.30 and 0.32 (vLLM's connector)."""
    from vllm_hybrid_npu_lab.host_breakdown import breakdown

    reqs, x = _off_block_trace(rng)
    block, tail = x // 256 * 256, x // 64 * 64
    kw = dict(kv_cache_gib=DEVICE_24_BLOCKS / 2**30, host_cache_gib=1 / 16, block_size=256,
              tokens_per_s=5000.0)
    split = breakdown(reqs, cfg, "upstream:pmu=64", **kw)["rows"][3]
    ckpt = breakdown(reqs, cfg, "upstream:pmu=64,ckpt", **kw)["rows"][3]
    assert split["held"] == [block, tail] and (split["hit"], split["host_hit"]) == (tail, tail)
    assert split["held_not_loaded"] == 0
    import vllm

    if vllm.__version__.startswith("0.34."):
        # vLLM 0.34's connector anchors its partial-tail search at the full-attention prefix
        # (OffloadingConnectorScheduler._lookup_partial_tail_hit: "a recurrent group holds state
        # only at a producer's tail"), not at the complete hit: the checkpoint is in its reach
        assert ckpt["held"] == [tail] and (ckpt["hit"], ckpt["host_hit"]) == (tail, tail), ckpt
        assert ckpt["held_not_loaded"] == 0, ckpt
    else:
        assert ckpt["held"] == [tail] and (ckpt["hit"], ckpt["host_hit"]) == (0, 0)
        assert ckpt["held_not_loaded"] == tail
        # the lab's miss reasons: the host did not serve what the device had cached before
        assert ckpt["miss"] == {"evicted_host": tail, "partial_block": x + 1 - tail}
    for pol in ("upstream", "upstream:ckpt"):
        row = breakdown(reqs, cfg, pol, **kw)["rows"][3]
        assert row["held"] == [block] and row["hit"] == row["host_hit"] == block, pol


def test_host_breakdown_cli(tmp_path, tiny_model_dir, capsys, write_trace, rng):
    import json

    from vllm_hybrid_npu_lab.host_breakdown import main

    reqs, x = _off_block_trace(rng)
    trace = write_trace(tmp_path / "t.jsonl",
                        [(r.timestamp_ms, r.input_length, r.output_length, list(r.hash_ids))
                         for r in reqs])
    args = ["--trace", str(trace), "--model", str(tiny_model_dir), "--kv-cache-gib",
            str(DEVICE_24_BLOCKS / 2**30), "--host-cache-gib", "0.0625", "--block-size", "256",
            "--tokens-per-s", "5000", "--policy", "upstream:pmu=64"]
    assert main(args + ["--json"]) == 0
    out = capsys.readouterr().out
    rep = json.loads(out[out.index("\n[") + 1:] if not out.startswith("[") else out)
    assert rep[0]["rows"][3]["hit"] == x // 64 * 64 and rep[0]["hash_block_size"] == 64
    assert main(args + ["--requests", "4"]) == 0
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| `")]
    assert len(table) == 1 and f"| {x // 64 * 64:,} ({x // 64 * 64:,}) |" in table[0]
    assert main(args[:-2] + ["--kv-cache-gib", "0"]) == 2
    assert "--kv-cache-gib" in capsys.readouterr().err


def test_tails_off_keeps_no_partial_tail_on_the_host(cfg, rng):
    """The runtime's ``VLLM_HYBRID_NPU_OPTIONS=tails=off`` (the lab's ``tails=off``,
    vLLM 0.30), on the trace above. vLLM's split at ``--prefix-match-unit 64`` leaves states at
    ``256 (x // 256)`` and ``64 (x // 64)``; with the tails kept the host holds both and the repeat
    loads the tail (the test above). With ``tails=off`` the host holds only the block boundary,
    and the repeat hits it through the host tier: ``256 (x // 256)`` tokens. The exporter's one
    checkpoint at ``64 (x // 64)`` is itself a tail: with ``tails=off`` the host holds nothing
    of it and the repeat hits 0, as with the tails kept (out of the connector's reach). A replay
    without ``tails=off`` after them keeps vLLM's tails (the class is restored)."""
    from vllm_hybrid_npu_lab.host_breakdown import breakdown
    from vllm_hybrid_npu_lab.upstream_grid import parse_setting, policy_of

    if policy_of(parse_setting("upstream:pmu=64,tails=off")).unavailable():
        pytest.skip("tails=off: the runtime entry is vLLM 0.30's")
    reqs, x = _off_block_trace(rng)
    block, tail = x // 256 * 256, x // 64 * 64
    kw = dict(kv_cache_gib=DEVICE_24_BLOCKS / 2**30, host_cache_gib=1 / 16, block_size=256,
              tokens_per_s=5000.0)
    split = breakdown(reqs, cfg, "upstream:pmu=64,tails=off", **kw)["rows"][3]
    assert split["held"] == [block] and (split["hit"], split["host_hit"]) == (block, block), (x, split)
    ckpt = breakdown(reqs, cfg, "upstream:pmu=64,ckpt,tails=off", **kw)["rows"][3]
    assert ckpt["held"] == [] and (ckpt["hit"], ckpt["host_hit"]) == (0, 0), (x, ckpt)
    again = breakdown(reqs, cfg, "upstream:pmu=64", **kw)["rows"][3]
    assert again["held"] == [block, tail] and again["hit"] == tail, (x, again)
