"""``vllm_hybrid_npu.patches.vllm_v1_engine_core`` around stand-ins, hand-counted: the block size
``EngineCore._initialize_kv_caches`` resolved is remembered and put back when the busy loop
starts where a later ``__post_init__`` (the CPU platform's ``check_and_update_config``: 128)
changed it; an unchanged block, or none remembered, is left alone."""

from __future__ import annotations

import types

from vllm_hybrid_npu.patches import vllm_v1_engine_core as mod


def _core():
    cache = types.SimpleNamespace(block_size=None)
    return types.SimpleNamespace(vllm_config=types.SimpleNamespace(cache_config=cache)), cache


def test_the_resolved_block_survives_the_handshake():
    core, cache = _core()

    def init_kv(self, vllm_config):
        vllm_config.cache_config.block_size = 384  # vLLM: min of the groups' block sizes
        return "kv-config"

    assert mod._make_record(init_kv, None)(core, core.vllm_config) == "kv-config"
    cache.block_size = 128  # EngineCoreProc._perform_handshakes -> __post_init__ on CPU
    seen = []
    loop = mod._make_restore(lambda self: seen.append(cache.block_size) or "ran", None)
    assert loop(core) == "ran" and seen == [384] and cache.block_size == 384


def test_nothing_to_restore():
    core, cache = _core()
    cache.block_size = 128
    assert not mod.restore(core) and cache.block_size == 128  # nothing remembered
    setattr(core, mod.RESOLVED, 128)
    assert not mod.restore(core) and cache.block_size == 128  # unchanged
