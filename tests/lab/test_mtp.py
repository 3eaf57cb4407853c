"""The lab under an MTP drafter (``--speculative-tokens``, issue 58 item 4), on hand-derived cases.

vLLM 0.30's real ``Scheduler`` on the tiny hybrid (3 GDN + 1 attention layer), block ``B = 256``
(prefix-match unit = block), a 64 MiB pool (no eviction), budget 8,192. One prompt of ``n``
tokens (``n`` drawn in (1024, 2048), off the block grid), sent twice 10 s apart, no answer
carried. The rules, read from vLLM and the runtime, not from the lab:

* no drafter: vLLM's split ends the cold prompt's chunk at its last block boundary below ``n``,
  where align mode caches the GDN state, so the repeat hits ``h0 = (n - 1) // B * B``; with the
  plugin's checkpoint (``upstream:ckpt``) the hit is the same (the hit is in hash blocks) and the
  cold prompt takes one step;
* an MTP drafter (``qwen3_next_mtp`` -> ``mtp``, an EAGLE drafter) drops one prefix-match unit
  of the hit: with vLLM's split the repeat hits ``h0 - B`` (at most the no-drafter hit);
* the runtime declares the plugin's checkpoint under MTP on the CPU path (vLLM 0.30, not on a
  CPU with AMX tiles) and on vllm-ascend 0.30.0rc2's paths (the stack the lab's ``npu`` target
  models: its ``speculative_off``); there the checkpoint is reserved one unit lower,
  ``cp = (n - 1) // B * B - B``: the repeat hits ``cp`` (>= the no-drafter plugin hit minus one
  unit) and a cold prompt still takes one step; on CUDA the runtime refuses, so
  ``upstream:ckpt`` replays as vLLM's split.
"""

from __future__ import annotations

import pytest
import vllm

from vllm_hybrid_npu.patches import gdn_prefill_checkpoint as G
from vllm_hybrid_npu_lab.__main__ import main
from vllm_hybrid_npu_lab.model import build_setup
from vllm_hybrid_npu_lab.policies import get_policy, setup_kwargs
from vllm_hybrid_npu_lab.presets import resolve_model
from vllm_hybrid_npu_lab.replay import replay
from vllm_hybrid_npu_lab.trace import TraceRequest

B = 256
ON_030 = vllm.__version__.split("+")[0] in G.SPEC_DECODE_VLLM


@pytest.fixture(scope="module")
def cfg(tiny_model_dir):
    return resolve_model(str(tiny_model_dir))[1]


@pytest.fixture
def no_amx(monkeypatch):
    """A CPU deployment without AMX tiles, whatever this host has (the runtime's refusal there
    is tested below)."""
    monkeypatch.setattr(G, "cpu_amx_tiles", lambda: False)


def _twice(cfg, n, policy, k, target):
    """``(setup, result)`` of the prompt of ``n`` tokens sent twice, with ``k`` MTP tokens."""
    reqs = [TraceRequest(10_000.0 * i, n, 4, (1, 2, 3, 4)) for i in range(2)]
    pol = get_policy(policy)
    setup = build_setup(cfg, kv_cache_bytes=64 << 20, block_size=B, max_num_batched_tokens=8192,
                        max_model_len=4096, speculative_tokens=k, exporter_target=target,
                        **setup_kwargs(pol))
    return setup, replay(reqs, setup, pol.scheduler_class(), carry_outputs=False, target=target)


def _n(rng):
    n = rng.randint(1025, 2047)
    return n + 1 if n % B == 0 else n


@pytest.mark.skipif(not ON_030, reason="the CPU path declares checkpoints under MTP on vLLM 0.30")
def test_mtp_on_cuda_drops_a_unit_and_keeps_vllms_split(cfg, rng, no_amx):
    n = _n(rng)
    h0 = (n - 1) // B * B
    for policy in ("upstream", "upstream:ckpt"):
        _, plain = _twice(cfg, n, policy, 0, "cuda")
        assert plain.cached_per_request == [0, h0], (n, policy)
    setup, mtp = _twice(cfg, n, "upstream:ckpt", 2, "cuda")
    assert not setup.prefill_checkpoints and "split kept" in setup.speculative_off, n
    assert mtp.cached_per_request == [0, h0 - B], n  # one unit below, <= the no-drafter hit
    _, split = _twice(cfg, n, "upstream", 2, "cuda")
    assert split.to_dict() | {"wall_s": 0} == mtp.to_dict() | {"wall_s": 0}  # refused: the same


@pytest.mark.skipif(not ON_030, reason="the CPU path declares checkpoints under MTP on vLLM 0.30")
@pytest.mark.parametrize("target", ["cpu", "npu"])
def test_mtp_keeps_the_plugins_checkpoint_one_unit_lower(cfg, rng, no_amx, target):
    n = _n(rng)
    _, plugin = _twice(cfg, n, "upstream:ckpt", 0, target)
    assert plugin.prefill_steps_per_prompt == 1, n
    for k in (1, 2):
        setup, mtp = _twice(cfg, n, "upstream:ckpt", k, target)
        assert setup.prefill_checkpoints and setup.speculative_off is None
        assert setup.speculative_tokens == k
        cp = (n - 1) // B * B - B
        assert mtp.cached_per_request == [0, cp], (n, k)
        assert cp >= plugin.cached_per_request[1] - B
        assert mtp.prefill_steps_per_prompt == 1, (n, k)  # the cold prompt still one step


@pytest.mark.skipif(ON_030, reason="on vLLM 0.30 the drafter is replayed (the tests above)")
def test_speculative_tokens_outside_vllm_030_name_the_flag(cfg):
    with pytest.raises(ValueError, match="--speculative-tokens 2: the lab replays an MTP drafter"):
        build_setup(cfg, kv_cache_bytes=64 << 20, block_size=B, max_model_len=4096,
                    speculative_tokens=2, exporter_target="cpu", prefill_checkpoints=True)


@pytest.mark.skipif(not ON_030, reason="the lab replays an MTP drafter on vLLM 0.30 only")
def test_cpu_with_amx_tiles_is_refused(cfg, monkeypatch):
    monkeypatch.setattr(G, "cpu_amx_tiles", lambda: True)
    setup = build_setup(cfg, kv_cache_bytes=64 << 20, block_size=B, max_model_len=4096,
                        speculative_tokens=2, exporter_target="cpu", prefill_checkpoints=True)
    assert not setup.prefill_checkpoints and "AMX" in setup.speculative_off
    plain = build_setup(cfg, kv_cache_bytes=64 << 20, block_size=B, max_model_len=4096,
                        exporter_target="cpu", prefill_checkpoints=True)
    assert plain.prefill_checkpoints and plain.speculative_off is None  # no drafter: no check


@pytest.mark.parametrize("command", ["hitrate", "advise"])
def test_negative_speculative_tokens_names_the_flag(command, tmp_path, tiny_model_dir, capsys,
                                                     write_trace):
    trace = write_trace(tmp_path / "t.jsonl", [(0, 600, 2, [1, 2]), (5000, 600, 2, [1, 3])])
    extra = ["--kv-cache-gib", "0.0625"] if command == "advise" else []
    rc = main([command, "--trace", str(trace), "--model", str(tiny_model_dir), *extra,
               "--speculative-tokens", "-1", "--quiet"])
    assert rc == 2
    assert "--speculative-tokens" in capsys.readouterr().err


@pytest.mark.skipif(not ON_030, reason="the CPU path declares checkpoints under MTP on vLLM 0.30")
def test_hitrate_cli_replays_the_drafter(tmp_path, tiny_model_dir, capsys, write_trace, rng,
                                          no_amx):
    import json

    n = _n(rng)
    trace = write_trace(tmp_path / "t.jsonl", [(0, n, 2, [1, 2, 3, 4]),
                                               (10_000, n, 2, [1, 2, 3, 4])])
    hits = {}
    for k in (0, 2):
        assert main(["hitrate", "--trace", str(trace), "--model", str(tiny_model_dir),
                     "--block-size", str(B), "--kv-cache-gib", "0.0625", "--no-carry",
                     "--target", "npu", "--speculative-tokens", str(k), "--json", "--quiet"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["speculative_tokens"] == k
        hits[k] = report["policies"]["upstream"]["cached_prompt_tokens"]
    assert hits == {0: (n - 1) // B * B, 2: (n - 1) // B * B - B}, n


def test_cpu_target_exports_junctions_beside_a_host_tier_too(monkeypatch):
    # the runtime's junctions_off for its CPU path: None, with or without a KV connector (the
    # NPU's paths turn them off beside one)
    from vllm_hybrid_npu.envs import OPTIONS_ENV
    from vllm_hybrid_npu_lab.replay import junctions_modelled

    monkeypatch.delenv(OPTIONS_ENV, raising=False)
    assert junctions_modelled("cpu", False) and junctions_modelled("cpu", True)
    assert not junctions_modelled("npu", True)
