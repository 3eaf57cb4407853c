"""The engine-core process keeps the KV-cache block size it resolved (vLLM 0.30 / 0.32 on CPU).

``EngineCore._initialize_kv_caches`` sets ``cache_config.block_size`` to the block the KV cache
was built with (the hybrid block in align mode: 384 or 256 tokens for the tiny Qwen3-Next on CPU)
before the scheduler is built. In a separate engine-core process (``vllm serve``, an ``LLM`` with
V1 multiprocessing), ``EngineCoreProc.__init__`` then leaves ``_perform_handshakes``, which re-runs
``vllm_config.__post_init__()``; on CPU that calls ``CpuPlatform.check_and_update_config``, which
sets ``block_size = 128`` for every configuration without ``--block-size``
(``vllm/platforms/cpu.py``, 0.30.0 and 0.32.0). ``Scheduler._mamba_block_aligned_split`` reads
``cache_config.block_size`` on every prefill chunk: it then ends chunks on 128-token boundaries
instead of the hybrid block's, one more prefill step for a prompt whose last chunk starts on its
checkpoint or whose hit is followed by less than a block (docs/patches.md, "The engine core's
block size on CPU"). The in-process engine (the e2e tests,
``VLLM_ENABLE_V1_MULTIPROCESSING=0``) shares the object vLLM set and is not affected, nor are
platforms whose ``check_and_update_config`` keeps a set block size (CUDA; vllm-ascend sets 128
only where it is None).

Entries (target ``cpu``): ``engine-core-block-size-record`` remembers the block
``_initialize_kv_caches`` set; ``engine-core-block-size`` (and ``-dp``, data-parallel engines)
puts it back when the engine core's busy loop starts (the plugin loads inside
``EngineCoreProc.__init__``, too late to wrap it), where the handshake changed it, with a warning
that names the cause. Until: vLLM's CPU platform keeps a resolved block size, or the scheduler reads its own.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from vllm_hybrid_npu.patches.registry import Patch
from vllm_hybrid_npu.support import Stack

logger = logging.getLogger("vllm_hybrid_npu")

#: Attribute the recording entry sets on the engine core: the block size vLLM resolved (tokens).
RESOLVED = "_vhn_resolved_block_size"
VERSIONS = ("0.30.0", "0.32.0")
UNTIL = "vLLM's CPU platform keeps a resolved block size, or the scheduler reads its own"


def _make_record(upstream: Any, stack: Stack) -> Any:
    @functools.wraps(upstream)
    def _initialize_kv_caches(self, vllm_config, *args, **kwargs):
        out = upstream(self, vllm_config, *args, **kwargs)
        setattr(self, RESOLVED, vllm_config.cache_config.block_size)
        return out

    return _initialize_kv_caches


def restore(engine_core: Any) -> bool:
    """Put back the block size :data:`RESOLVED` on ``engine_core``'s ``cache_config`` where it
    differs (logged once per process as a warning naming the cause); True when it did."""
    cache = getattr(getattr(engine_core, "vllm_config", None), "cache_config", None)
    resolved = getattr(engine_core, RESOLVED, None)
    if cache is None or not resolved or cache.block_size == resolved:
        return False
    logger.warning(
        "vllm-hybrid-npu: the engine core's block size was reset from %d to %d tokens after its "
        "handshake (EngineCoreProc._perform_handshakes re-runs the CPU platform's "
        "check_and_update_config); restored %d, the block its KV cache and scheduler use, which "
        "Scheduler._mamba_block_aligned_split aligns prefill chunks to", resolved, cache.block_size,
        resolved)
    cache.block_size = resolved
    return True


def _make_restore(upstream: Any, stack: Stack) -> Any:
    @functools.wraps(upstream)
    def run_busy_loop(self, *args, **kwargs):
        restore(self)  # after __init__ (whose handshake reset it), before the first step
        return upstream(self, *args, **kwargs)

    return run_busy_loop


PATCHES = [
    Patch(name="engine-core-block-size-record", module="vllm.v1.engine.core",
          qualname="EngineCore._initialize_kv_caches", targets=("cpu",), vllm=VERSIONS,
          make=_make_record, behaviour_changing=False,
          why="remembers the KV-cache block size vLLM resolved (for the next entries)", until=UNTIL,
          signature=("self", "vllm_config")),
    *(Patch(name=name, module="vllm.v1.engine.core", qualname=f"{cls}.run_busy_loop",
            targets=("cpu",), vllm=VERSIONS, make=_make_restore, behaviour_changing=True,
            why="restores that block size, which the handshake reset to the CPU default (128), "
                "before the first step: align mode's chunk ends stay on the hybrid block",
            until=UNTIL, signature=("self",))
      for name, cls in (("engine-core-block-size", "EngineCoreProc"),
                        ("engine-core-block-size-dp", "DPEngineCoreProc"))),
]
