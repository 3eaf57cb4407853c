"""Two in-process engines one after the other: the first one's KV connector must not receive
the second one's KV caches (see e2e/engines.py for what vLLM 0.30 leaves behind on ``del llm``).

Engine A has :class:`recording_connector.RecordingConnector` and a small KV budget; engine B has
no connector and a larger budget. The control ends A with ``del`` only and shows vLLM's
behaviour that made the H100 run fail (B's caches registered with A's connector); the test ends
A with :func:`engines.shutdown_engine` and requires that B's caches reach no connector.
"""

from __future__ import annotations

import gc

import pytest
import recording_connector  # e2e/recording_connector.py
from engines import shutdown_engine  # e2e/engines.py


def _engine(model, engine_args, kv_bytes, connector):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kw = {}
    if connector:
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="RecordingConnector", kv_connector_module_path="recording_connector",
            kv_role="kv_both")
    return LLM(model=model, enable_prefix_caching=True, mamba_cache_mode="align",
               **{**engine_args, "kv_cache_memory_bytes": kv_bytes}, **kw)


@pytest.fixture
def model(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    return str(tiny_model_dir("qwen3_next"))


def _a_then_b(model, engine_args, end_a):
    recording_connector.CALLS.clear()
    a = _engine(model, engine_args, 24 << 20, connector=True)
    a_blocks = a.llm_engine.vllm_config.cache_config.num_gpu_blocks
    assert len(recording_connector.CALLS) == 1 and recording_connector.CALLS[0][1] == a_blocks
    end_a(a)
    del a
    gc.collect()
    b = _engine(model, engine_args, 256 << 20, connector=False)
    b_blocks = b.llm_engine.vllm_config.cache_config.num_gpu_blocks
    calls = list(recording_connector.CALLS[1:])
    shutdown_engine(b)
    del b
    assert b_blocks > a_blocks
    return calls, b_blocks


def test_del_alone_hands_the_next_engines_caches_to_the_old_connector(model, engine_args):
    calls, b_blocks = _a_then_b(model, engine_args, end_a=lambda a: None)
    try:
        assert len(calls) == 1, calls
        assert {shape[0] for shape in calls[0][2].values()} == {b_blocks}, calls
    finally:
        from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown

        ensure_kv_transfer_shutdown()  # the control's leftover must not reach other tests


def test_shutdown_engine_leaves_no_connector_behind(model, engine_args):
    calls, _ = _a_then_b(model, engine_args, end_a=shutdown_engine)
    assert calls == []
