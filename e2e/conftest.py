"""Shared fixtures of the engine-level tests: tiny hybrid checkpoints built locally, once per
session, by ``vllm_hybrid_npu.tools.make_model`` (cached under ``$VLLM_HYBRID_NPU_CACHE``), and
the *target* the engines run on.

Target (``$VLLM_HYBRID_NPU_E2E_TARGET``, default: ``cuda`` when vLLM's platform is CUDA, else
``cpu``) decides the engine arguments every test builds its engines with:

* ``cpu``: :data:`vllm_hybrid_npu.tools.server.CPU_SAFE_ENGINE_ARGS` (fixed KV budget, eager);
* ``cuda``: the same budget with CUDA graphs and ``torch.compile`` on (vLLM's defaults), vLLM's
  FLA/Triton GDN kernels (``gdn_prefill_backend="triton"`` where FlashInfer is not installed).

Tests read them through the fixtures ``engine_args`` (``vllm.LLM`` keyword arguments) and
``serve_args`` (``vllm serve`` flags); workloads run in subprocesses read the target's overrides
from ``$VLLM_HYBRID_NPU_E2E_ENGINE_ARGS`` (JSON, set here for the session) and extra environment
from ``$VLLM_HYBRID_NPU_E2E_WORKER_ENV``. Tests marked ``cuda`` skip when the target is not CUDA,
saying so.
"""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

TARGET_ENV = "VLLM_HYBRID_NPU_E2E_TARGET"
ENGINE_ARGS_ENV = "VLLM_HYBRID_NPU_E2E_ENGINE_ARGS"
WORKER_ENV_ENV = "VLLM_HYBRID_NPU_E2E_WORKER_ENV"
TARGETS = ("cpu", "cuda")


def e2e_target() -> str:
    """``$VLLM_HYBRID_NPU_E2E_TARGET`` if set, else ``cuda`` when vLLM runs on CUDA, else ``cpu``.

    Raises:
        pytest.UsageError: the variable names something other than ``cpu`` or ``cuda``.
    """
    forced = os.environ.get(TARGET_ENV, "").strip().lower()
    if forced:
        if forced not in TARGETS:
            raise pytest.UsageError(f"{TARGET_ENV}={forced!r} is not one of {', '.join(TARGETS)}")
        return forced
    try:
        from vllm.platforms import current_platform

        return "cuda" if current_platform.is_cuda() else "cpu"
    except Exception:
        return "cpu"


def target_overrides(target: str) -> dict[str, object]:
    """Engine arguments that differ from the CPU-safe set on ``target`` (``{}`` on CPU)."""
    if target == "cpu":
        return {}
    over: dict[str, object] = {
        "enforce_eager": False,
        "gpu_memory_utilization": 0.3,
        # CUDA graphs up to 16 sequences (the tests run at most 8 at a time): capture takes
        # seconds instead of vLLM's default sizes up to 512.
        "max_cudagraph_capture_size": 16,
        # A user-set block size makes vLLM 0.30 align the hybrid block size to a multiple of it
        # (``Platform._align_hybrid_block_size``): 64, the FLA chunk of the GDN kernels, so
        # align-mode chunk ends (block boundaries) fall on the kernels' 64-token grid, as the
        # CPU backend's 128-multiples do. Without it FlashAttention's 16-token kernel blocks give
        # 144 for the tiny model: a cold prompt is then split at a 144-multiple in align mode
        # and not with caching off, and bf16 rounds the two chunkings differently, so exact
        # comparisons would not hold by construction. test_cuda_engine.py keeps vLLM's default.
        "block_size": 64,
    }
    if importlib.util.find_spec("flashinfer") is None:
        # vLLM 0.30 picks FlashInfer's GDN prefill kernel by default; without FlashInfer its own
        # FLA/Triton kernels (the same ones the CPU-less CUDA build ships) are the path.
        over["gdn_prefill_backend"] = "triton"
    return over


def target_worker_env(target: str) -> dict[str, str]:
    """Extra environment of the subprocess workloads of ``test_worker_patches`` on ``target``.

    On CUDA, vLLM 0.30 runs hybrid models on its V2 GPU model runner, whose align-mode copies
    are one fused kernel (``preprocess_mamba_align_fused_kernel``) that the plugin leaves alone;
    the module compares our copy launcher with vLLM's (``mamba_utils.batch_memcpy``), which only
    the V1 runner calls, and inspects V1 runner attributes, so it runs the V1 runner."""
    return {"VLLM_USE_V2_MODEL_RUNNER": "0"} if target == "cuda" else {}


def pytest_configure(config):
    target = e2e_target()
    os.environ.setdefault(ENGINE_ARGS_ENV, json.dumps(target_overrides(target)))
    os.environ.setdefault(WORKER_ENV_ENV, json.dumps(target_worker_env(target)))
    config.addinivalue_line("markers", "cuda: needs the CUDA target (skips elsewhere, saying so)")


@pytest.fixture(scope="session")
def e2e_target_name() -> str:
    """The target of this session: ``"cpu"`` or ``"cuda"``."""
    return e2e_target()


@pytest.fixture(scope="session")
def exact_across_schedules(e2e_target_name) -> bool:
    """Whether greedy outputs of one prompt computed under *different* schedules (a prefix-cache
    hit vs a cold prefill, another batch around it) are compared token for token (``True``) or
    under :func:`greedy_compare.compare_greedy` with :data:`greedy_compare.CHUNKING_BOUND`.

    CPU: exact where both schedules split the prompt on the GDN kernels' 64-token grid (measured,
    docs/testing.md). CUDA: not established: besides the chunk grid, which GEMM and attention
    kernels (split-K, FlashAttention's KV splits) run depends on the batch shape, so the bits may
    differ; the tolerance rule applies until a CUDA run shows otherwise (docs/cuda.md).
    Comparisons of the *same* schedule stay exact on every target."""
    return e2e_target_name == "cpu"


@pytest.fixture(scope="session")
def engine_args(e2e_target_name) -> dict[str, object]:
    """``vllm.LLM`` keyword arguments of the target (tests add their own on top)."""
    from vllm_hybrid_npu.tools.server import CPU_SAFE_ENGINE_ARGS

    return {**CPU_SAFE_ENGINE_ARGS, **json.loads(os.environ[ENGINE_ARGS_ENV])}


@pytest.fixture(scope="session")
def serve_args(engine_args) -> tuple[str, ...]:
    """:func:`engine_args` as ``vllm serve`` flags."""
    from vllm_hybrid_npu.tools.server import engine_args_to_flags

    return engine_args_to_flags(engine_args)


@pytest.fixture(scope="session")
def tiny_model_dir():
    """A function ``(arch, gdn_memory="short") -> Path`` returning the cached tiny checkpoint of
    ``arch`` (``"qwen3_next"`` or ``"qwen3_5"``), built on first use. The exact output
    comparisons of test_gdn_engine.py use ``gdn_memory="long"``: with transformers' GDN decay the
    tiny model forgets a state within a few tokens, so a wrong state would not show in its
    outputs (docs/testing.md)."""
    from vllm_hybrid_npu.tools.make_model import default_model_dir

    return default_model_dir


def pytest_collection_modifyitems(config, items):
    target = None
    for item in items:
        if "/e2e/" in str(item.fspath):
            item.add_marker(pytest.mark.e2e)
            if item.get_closest_marker("cuda"):
                target = target or e2e_target()
                if target != "cuda":
                    item.add_marker(pytest.mark.skip(
                        reason=f"needs CUDA: the e2e target is {target} (no CUDA device / vLLM "
                               f"CUDA build here; {TARGET_ENV}=cuda forces it)"))


@pytest.fixture(autouse=True, scope="module")
def _plugin_patches_applied():
    """In-process engines run in this pytest process, whose registry the unit tests may have
    undone (``tests/patches`` unapply it) after vLLM's plugin loader applied it once: apply it
    for each e2e module as the plugin does in a fresh vLLM process (the current environment)."""
    from vllm_hybrid_npu.patches import apply_patches, registry

    registry.unapply_all()
    apply_patches()
    yield
