"""The main job over HTTP: `vllm serve --enable-prefix-caching --mamba-cache-mode align` with the
plugin loaded, a shared prefix replayed, cached tokens reported, outputs equal to caching off."""

from __future__ import annotations

import pytest

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
    return demo.replay_conversations(cached_server.base_url, paragraphs=6, turns=2, max_tokens=8)


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


def test_outputs_equal_prefix_caching_off(tiny_model_dir, replay, serve_args):
    model = tiny_model_dir("qwen3_next")
    with VllmServer(model, ["--no-enable-prefix-caching", *serve_args]).start() as base:
        base_results = demo.replay_bodies(base.base_url, [r.body for r in replay])
    assert all(b.cached_tokens == 0 for b in base_results)
    assert [r.output_token_ids for r in replay] == [b.output_token_ids for b in base_results]
    assert all(len(r.output_token_ids) == 8 for r in replay)
