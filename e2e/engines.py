"""Ending an in-process vLLM engine so that the next one in the same process starts clean.

vLLM 0.30.0's ``LLM`` has no ``close()``, and ``del llm`` does not shut its engine core down
(``LLMEngine`` only registers a finalizer for torch.compile's caches). What stays behind, read
off vLLM 0.30.0:

* the worker's KV connector: ``vllm.distributed.kv_transfer.kv_transfer_state`` keeps it in a
  module global (``_KV_CONNECTOR_AGENT``) that ``ensure_kv_transfer_initialized`` never replaces
  once set; ``GPUModelRunner.initialize_kv_cache`` of the *next* engine then hands its KV caches
  to the old connector (``register_kv_caches``), even when the next engine configures none.
  Seen on the H100 (2026-11-23): the ``OffloadingConnector`` of test_cuda_engine's host-tier
  engine received test_first_repeat's caches and failed vLLM's ``group_kernel_blocks`` assertion
  (``cache.shape[0] % num_blocks``, the old engine's ``num_blocks``); reproduced on CPU by
  ``e2e/test_engine_teardown.py``;
* ``gc.freeze()`` of ``EngineCore.__init__`` (weights and KV caches invisible to the collector)
  and the distributed state, both undone only by ``EngineCore.shutdown``.

:func:`shutdown_engine` calls vLLM's own ``EngineCore.shutdown`` (through the in-process
client), which shuts the worker down (``ensure_kv_transfer_shutdown``), unfreezes the collector
and runs ``cleanup_dist_env_and_memory``.
"""

from __future__ import annotations

import gc
import os

#: ``os.environ`` of this pytest process when the e2e modules were collected (they import this
#: module), before any in-process engine ran. vLLM 0.30's CPU platform writes process-wide
#: settings into ``os.environ`` when an engine starts (``LD_PRELOAD`` of torch's libgomp,
#: ``VLLM_SSM_CONV_STATE_LAYOUT``, ``TORCHINDUCTOR_*``, ...: ``CpuPlatform.check_and_update_config``);
#: a subprocess workload started from this copy does not depend on which test ran before it.
#: Seen 2026-11-26: ``e2e/test_worker_patches.py``'s workload died with glibc's "double free or
#: corruption" when started after ``e2e/test_prefill_checkpoints.py``. Cause, found later that
#: day: torch inductor's on-disk cache held AVX2 kernels compiled by an earlier ``make
#: test-no-avx512`` run (its key names no vector ISA), rebuilt for AVX-512 here and writing past
#: their buffers in vLLM's ``compiled_random_sample``; ``TORCHINDUCTOR_CPP_DYNAMIC_THREADS=1``,
#: one of vLLM's variables, selected the poisoned entry. Fixed where it arose
#: (``e2e/cpu_kinds/no_avx512/sitecustomize.py`` gives those processes their own caches;
#: ``tests/test_cpu_kinds.py``); the isolation stays.
COLLECTION_ENV = dict(os.environ)


def shutdown_engine(llm) -> None:
    """Shut down the engine core of ``llm`` (a ``vllm.LLM`` built with
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` or not) and collect its memory. The caller drops its
    own references (``del llm``) afterwards.

    Raises:
        AssertionError: a KV connector is still registered in this process afterwards.
    """
    from vllm.distributed.kv_transfer.kv_transfer_state import has_kv_transfer_group

    llm.llm_engine.engine_core.shutdown()
    gc.collect()
    assert not has_kv_transfer_group(), "a KV connector outlived its engine's shutdown"


def count_scheduled_steps(llm) -> list[int]:
    """Wrap the scheduler of ``llm`` (in-process engine core, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
    so that every engine step that schedules tokens appends its token count to the returned list
    (async scheduling on CUDA adds steps that schedule none; they are not counted)."""
    core = llm.llm_engine.engine_core.engine_core
    steps: list[int] = []
    schedule = core.scheduler.schedule

    def counted(*args, **kwargs):
        out = schedule(*args, **kwargs)
        if out.total_num_scheduled_tokens:
            steps.append(out.total_num_scheduled_tokens)
        return out

    core.scheduler.schedule = counted
    return steps


def exporter_outside_stack() -> str | None:
    """Why the plugin's GDN prefill-checkpoint exporter does not apply to the installed vLLM on
    the e2e target (the registry entry ``gdn-checkpoint-spec``'s versions and the support
    matrix's row, as the plugin's load decides), or None when it applies (with
    ``VLLM_HYBRID_NPU_PREFILL_CHECKPOINTS`` not ``off``). It applies on vLLM 0.30.0, 0.32.0 and,
    since issue 32, 0.33.0 (through 0.33's own plan); e.g. vLLM 0.29 is outside the matrix."""
    from vllm_hybrid_npu.patches.gdn_prefill_checkpoint import PATCHES
    from vllm_hybrid_npu.patches.registry import stack_skip_reason
    from vllm_hybrid_npu.support import detect_stack, unsupported_reason

    stack = detect_stack()
    entry = next(p for p in PATCHES if p.name == "gdn-checkpoint-spec")
    return unsupported_reason(stack) or stack_skip_reason(entry, stack)


def host_tier_unsupported() -> str | None:
    """Why vLLM's OffloadingConnector (``kv_offloading_size``, the host tier) cannot run on this
    platform (a str, vLLM's own error), or None where it can (CUDA-alike and XPU GPUs)."""
    from vllm.platforms import current_platform

    if current_platform.is_cuda_alike() or current_platform.is_xpu():
        return None
    return ("vLLM's OffloadingConnector does not run on the CPU backend: on CPU (vLLM 0.30.0, "
            "2026-11-27) every worker fails in register_kv_caches with \"Exception: CPU Offloading is "
            "currently only supported on CUDA-alike and XPU GPUs\" (CPUOffloadingSpec.get_worker, "
            "vllm/v1/kv_offload/cpu/spec.py; the same guard in 0.32.0), and the engine with "
            "\"RuntimeError: Worker failed with error 'CPU Offloading is currently only supported on "
            "CUDA-alike and XPU GPUs'\"")


def metric_counter(llm, name: str) -> float:
    """The value of vLLM's counter ``name`` (e.g. ``vllm:external_prefix_cache_hits``, tokens)
    summed over its label sets, from ``LLM.get_metrics()`` (the engine built with
    ``disable_log_stats=False``)."""
    return sum(m.value for m in llm.get_metrics() if m.name == name and hasattr(m, "value"))


def tp_skip_reason(target: str, tp: int = 2) -> str | None:
    """Why tensor parallel ``tp`` cannot run on ``target`` here (None: it can). CPU: always runs
    (vLLM's CPU backend runs tp > 1 in worker processes). CUDA: fewer than ``tp`` GPUs."""
    if target != "cuda":
        return None
    import torch

    n = torch.cuda.device_count()
    return None if n >= tp else f"tensor parallel {tp} needs {tp} GPUs: {n} visible"


def threads_bind(tp: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``tp`` CPU workers: this process's allowed CPUs split into
    ``tp`` contiguous parts (``"0|1"`` on 2 CPUs, ``"0,1|2,3"`` on 4).

    Raises:
        pytest.skip.Exception: fewer allowed CPUs than workers.
    """
    import pytest

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < tp:
        pytest.skip(f"tensor parallel {tp} on CPU binds one CPU per worker at least: {len(cpus)} allowed")
    per = len(cpus) // tp
    return "|".join(",".join(map(str, cpus[i * per:(i + 1) * per])) for i in range(tp))


def engine_core(llm):
    """The in-process ``EngineCore`` of an ``LLM`` (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)."""
    return llm.llm_engine.engine_core.engine_core


def block_hashes(llm) -> dict[int, object]:
    """``{block id: block hash}`` of every hashed block in the engine's block pool (a snapshot
    for :func:`cached_mamba_blocks`'s ``before``)."""
    pool = engine_core(llm).scheduler.kv_cache_manager.block_pool
    return {b.block_id: b.block_hash for b in pool.blocks if b.block_hash is not None}


def mamba_groups(llm) -> dict[int, list[str]]:
    """``{KV-cache group index: layer names}`` of the engine's Mamba (GDN) KV-cache groups."""
    from vllm.v1.kv_cache_interface import MambaSpec

    groups = engine_core(llm).scheduler.kv_cache_manager.kv_cache_config.kv_cache_groups
    return {i: list(g.layer_names) for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, MambaSpec)}


def cached_mamba_blocks(llm, position: int, before: dict) -> dict[int, int]:
    """Mamba KV-cache group -> the block vLLM's block pool cached at ``position`` tokens since its
    hashes were ``before`` (:func:`block_hashes`; keyed by block hash + group).

    Raises:
        AssertionError: a Mamba group has no such block, or more than one.
    """
    from vllm.v1.core.kv_cache_utils import get_group_id

    groups = mamba_groups(llm)
    found: dict[int, list[int]] = {}
    for block in engine_core(llm).scheduler.kv_cache_manager.block_pool.blocks:
        if block.block_hash is None or block.block_hash_num_tokens != position:
            continue
        if before.get(block.block_id) == block.block_hash:
            continue
        group = get_group_id(block.block_hash)
        if group in groups:
            found.setdefault(group, []).append(block.block_id)
    assert set(found) == set(groups) and all(len(v) == 1 for v in found.values()), (position, found)
    return {group: ids[0] for group, ids in found.items()}
