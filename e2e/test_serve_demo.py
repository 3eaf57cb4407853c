"""The main job over HTTP: `vllm serve --enable-prefix-caching --mamba-cache-mode align` with the
plugin loaded, a shared prefix replayed, cached tokens reported, outputs equal to caching off."""

from __future__ import annotations

import pytest
from greedy_compare import Sequence, compare_outputs  # e2e/greedy_compare.py

from vllm_hybrid_npu.tools import demo
from vllm_hybrid_npu.tools.server import (
    PREFIX_CACHING_ARGS,
    VllmServer,
    block_size_from_metrics,
)


@pytest.fixture(scope="module")
def cached_server(tiny_model_dir, serve_args):
    model = tiny_model_dir("qwen3_next")
    server = VllmServer(
        model, [*PREFIX_CACHING_ARGS, "--enable-prompt-tokens-details", *serve_args]
    )
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def replay(cached_server):
    return demo.replay_conversations(cached_server.base_url, paragraphs=6, turns=2, max_tokens=8,
                                     top_logprobs=20)


def test_plugin_loaded_in_server_processes(cached_server, e2e_target_name):
    log = cached_server.log_text()
    lines = [l for l in log.splitlines() if "vllm-hybrid-npu" in l and f"loaded: target={e2e_target_name}" in l]
    # API server process and engine-core process each load the plugin once.
    assert len(lines) >= 2, log[-3000:]


def test_system_prompt_longer_than_block_size(cached_server, replay):
    block_size = block_size_from_metrics(cached_server.metrics())
    assert block_size is not None and block_size > 0
    assert min(r.prompt_tokens for r in replay) > block_size


def test_repeats_hit_the_prefix_cache(replay):
    n_conv = len(demo.CONVERSATIONS)
    first = replay[0]
    assert first.cached_tokens == 0, "nothing can be cached before the first request"
    # Every follow-up turn repeats its conversation's whole previous prompt.
    follow_ups = replay[n_conv:]
    assert follow_ups and all(r.cached_tokens > 0 for r in follow_ups)
    for r in replay:
        assert 0 <= r.cached_tokens < r.prompt_tokens


def test_outputs_equal_prefix_caching_off(tiny_model_dir, replay, serve_args, exact_across_schedules):
    """Token for token on CPU; under the near-tie rule where the target's kernels make a hit and
    a cold prefill differ in the last bits (e2e/conftest.py ``exact_across_schedules``)."""
    model = tiny_model_dir("qwen3_next")
    with VllmServer(model, ["--no-enable-prefix-caching", *serve_args]).start() as base:
        base_results = demo.replay_bodies(base.base_url, [r.body for r in replay])
    assert all(b.cached_tokens == 0 for b in base_results)
    assert all(len(r.output_token_ids) == 8 == len(r.output_logprobs) for r in replay)
    assert all(t in lp and len(lp) >= 20 for r in replay + base_results
               for t, lp in zip(r.output_token_ids, r.output_logprobs))
    c = compare_outputs([Sequence(b.output_token_ids, b.output_logprobs) for b in base_results],
                        [Sequence(r.output_token_ids, r.output_logprobs) for r in replay],
                        exact_across_schedules)
    assert c.ok, f"{c.errors}; {c.summary()}"


def _readme_demo_block() -> str:
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    return text.split(demo.README_BEGIN, 1)[1].split(demo.README_END, 1)[0]


def _without_pid(line: str) -> str:
    import re

    return re.sub(r" \(pid \d+\)\s*$", "", line.strip())


def test_readme_demo_block_matches_this_server(cached_server, e2e_target_name):
    """The README's demo output (written by ``vllm-hybrid-npu demo --readme README.md``, same
    server flags as this module's server) names the CPU it ran on and shows this code's plugin
    load line, and its block size where this CPU is of the same kind (AVX-512-BF16 or not);
    rerun that command when this fails. The README's block is a CPU-target run: on another
    target the block size and the applied patch list differ by design, so it is not compared."""
    if e2e_target_name != "cpu":
        pytest.skip(f"the README's demo block is the CPU target's run; this target is {e2e_target_name}")
    block = _readme_demo_block()
    size = next(l for l in block.splitlines() if l.startswith("block size (tokens, chosen by vLLM): "))
    machine = next(l for l in block.splitlines() if l.startswith("machine: "))[len("machine: "):]
    here = demo.machine_line()
    # vLLM's block size follows the SSM state dtype, float32 only with AVX-512-BF16: compare it
    # where the README's CPU has the same flag as this one (the README names its CPU)
    if machine.rsplit("AVX-512-BF16", 1)[1] == here.rsplit("AVX-512-BF16", 1)[1]:
        assert int(size.rsplit(":", 1)[1]) == block_size_from_metrics(cached_server.metrics())
    readme_plugin = next(l for l in block.splitlines() if l.startswith("plugin: "))[len("plugin: "):]
    live = [demo.plugin_line_text(l) for l in cached_server.log_text().splitlines()
            if "vllm-hybrid-npu" in l and "loaded" in l]
    assert live, "the server logged no plugin load line"
    assert _without_pid(readme_plugin) == _without_pid(live[0]), (
        "README's plugin line differs from the server's; run `vllm-hybrid-npu demo --readme README.md`")


def test_served_counters_explain_every_miss(cached_server, replay):
    """``/metrics`` (API-server process) carries the engine core's scheduler counts: every
    missed prompt token of the replay has one reason, state moves were counted, and the
    start-up line names the block size."""
    from importlib.metadata import entry_points

    from vllm_hybrid_npu.tools.server import counter_from_metrics, counters_by_label

    assert any(ep.name == "vllm_hybrid_npu" for ep in entry_points(group="vllm.stat_logger_plugins")), (
        "the vllm.stat_logger_plugins entry point is not installed: reinstall the package "
        "(pip install -e .) so vLLM loads vllm_hybrid_npu.metrics:HybridNpuStatLogger")
    text = cached_server.metrics()
    bs = block_size_from_metrics(text)
    miss = counters_by_label(text, "vllm_hybrid_npu:prefix_cache_miss_tokens_total", "reason")
    assert set(miss) == {"partial_block", "drafter_drop", "no_state", "evicted", "evicted_host", "new"}
    assert miss["drafter_drop"] == 0  # no drafter in this server
    assert sum(miss.values()) == sum(r.prompt_tokens - r.cached_tokens for r in replay)
    # ... and vLLM's own counters of the same lookups (no KV connector here)
    queries = counter_from_metrics(text, "vllm:prefix_cache_queries_total")
    hits = counter_from_metrics(text, "vllm:prefix_cache_hits_total")
    assert sum(miss.values()) == queries - hits
    # by definition: the tokens past the last block boundary a hit can reach, (N - 1) // bs * bs
    assert miss["partial_block"] == sum(
        r.prompt_tokens - max((r.prompt_tokens - 1) // bs * bs, r.cached_tokens) for r in replay
    )
    # the first request saw an empty cache: its reachable blocks are new
    assert miss["new"] >= (replay[0].prompt_tokens - 1) // bs * bs
    assert counter_from_metrics(text, "vllm_hybrid_npu:prefix_cache_classified_requests_total") == len(replay)
    copies = counter_from_metrics(text, "vllm_hybrid_npu:state_copies_total")
    nbytes = counter_from_metrics(text, "vllm_hybrid_npu:state_copy_bytes_total")
    assert copies and copies > 0 and nbytes > 0 and nbytes % copies == 0
    lines = [l for l in cached_server.log_text().splitlines() if "vllm-hybrid-npu: block size" in l]
    assert lines and f"block size {bs} tokens" in lines[0], lines


def test_served_prompts_take_one_prefill_step_each(cached_server, replay, e2e_target_name):
    """One request at a time, every prompt (a cold one, then hits followed by less than the token
    budget) is computed in one engine step, as caching off computes it: the engine core aligns
    prefill chunks to the hybrid block, not to the block size the CPU platform's handshake reset
    it to (``engine-core-block-size``: without it, hits here were cut at a 128-token boundary)."""
    from vllm_hybrid_npu.tools.server import counter_from_metrics

    steps = counter_from_metrics(cached_server.metrics(), demo.PREFILL_STEPS_METRIC)
    assert steps == len(replay), (steps, [(r.prompt_tokens, r.cached_tokens) for r in replay])
    if e2e_target_name == "cpu":
        assert "block size was reset from" in cached_server.log_text()
