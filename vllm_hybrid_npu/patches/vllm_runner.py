"""Patches of vLLM's own model runners (CUDA ``GPUModelRunner``, CPU ``CPUModelRunner``).

Targets (verified on CPU against vLLM 0.30.0, source-checked against vLLM 0.32.0):

* ``vllm.v1.worker.gpu_model_runner.GPUModelRunner.may_reinitialize_input_batch``
  (0.30.0: ``(self, kv_cache_config, kernel_block_sizes)``; 0.32.0: ``(self, kv_cache_config)``;
  wrapped with ``*args``): runs inside our block-table override so ``InputBatch`` /
  ``MultiGroupBlockTable`` get the widths of :mod:`vllm_hybrid_npu.core.block_tables`.
  ``CPUModelRunner`` (``vllm/v1/worker/cpu_model_runner.py``) subclasses ``GPUModelRunner`` and
  overrides neither this method nor ``execute_model``, so the CPU runner runs the same patched
  code.
* ``GPUModelRunner.__init__``: after upstream's init (and after any platform patch imported
  before the runner is built, e.g. vllm-ascend's ``patch_mamba_utils``), re-installs our
  ``mamba_utils.preprocess_mamba`` / ``do_mamba_copy_block`` and, for a vllm-ascend
  ``NPUModelRunner`` (a subclass), applies :mod:`vllm_hybrid_npu.patches.ascend_runner`.
* ``vllm.v1.worker.mamba_utils.preprocess_mamba`` and ``do_mamba_copy_block``: called by
  ``GPUModelRunner.execute_model`` once per step in align mode (0.30.0 and 0.32.0), now ours.

Why: one code path (plan + ``vllm_hybrid_npu.ops.batch_memcpy``) on every target, and block
tables sized by one rule. Not patched: the V2 model runner (``vllm/v1/worker/gpu/``,
``VLLM_USE_V2_MODEL_RUNNER=1``) and vLLM's spec-decode post-step selection
(``postprocess_mamba_align_gpu``), which stays upstream's.

When it can go: when upstream's in-tree align path runs on vllm-ascend unchanged and the user no
longer needs the A/B switch.
"""

from __future__ import annotations

import functools
import logging

from vllm_hybrid_npu.patches import _common

logger = logging.getLogger("vllm_hybrid_npu")


def apply(mode: str) -> list[str]:
    """Apply the vLLM-runner patches for ``mode`` (``"all"`` or ``"kernel"``).

    Each patch is applied right after vLLM imports its module (``vllm.v1.worker.mamba_utils``,
    ``vllm.v1.kv_cache_interface``, ``vllm.v1.worker.gpu_model_runner``), or at once if already
    imported; nothing is imported here, so the API-server process does not pull in the runner
    and a platform plugin (vllm-ascend) patches vLLM first. A target absent on the running
    version is logged and skipped.

    Returns:
        Names of the patches installed (applied now or at the module's import).
    """
    names = []

    def on_mamba_utils(_module):
        _common.install_state_copy(mode, defer_copy=False)

    _common.when_imported("vllm.v1.worker.mamba_utils", on_mamba_utils)
    names += (["mamba_utils.preprocess_mamba"] if mode == "all" else []) + [
        "mamba_utils.do_mamba_copy_block"
    ]
    if mode == "all":
        _common.when_imported("vllm.v1.kv_cache_interface", lambda m: _common.patch_spec_methods())
        names.append("KVCacheSpec.max_num_blocks_per_req")

    def on_runner(module):
        cls = getattr(module, "GPUModelRunner", None)
        if cls is None:
            logger.warning("vllm-hybrid-npu: GPUModelRunner absent; runner patches skipped")
            return
        if mode == "all":
            _common.wrap_may_reinitialize_input_batch(cls)
        _wrap_init(cls, mode)

    _common.when_imported("vllm.v1.worker.gpu_model_runner", on_runner)
    if mode == "all":
        names.append("GPUModelRunner.may_reinitialize_input_batch")
    names.append("GPUModelRunner.__init__")
    return names


def _wrap_init(cls: type, mode: str) -> bool:
    orig = vars(cls).get("__init__")
    if orig is None:
        return False
    if _common.is_ours(orig):
        return True

    @functools.wraps(orig)
    def __init__(self, *args, **kwargs):
        orig(self, *args, **kwargs)
        on_runner_created(self, mode)

    _common.replace_attr(cls, "__init__", _common._mark(__init__))
    return True


def on_runner_created(runner, mode: str) -> None:
    """Per-runner step after upstream ``__init__``: (re)install our state-copy routing and
    apply NPU runner patches when ``runner`` is a vllm-ascend runner."""
    if type(runner).__module__.startswith("vllm_ascend"):
        from vllm_hybrid_npu.patches import ascend_runner

        ascend_runner.patch_runner_class(type(runner), mode)
    else:
        _common.install_state_copy(mode, defer_copy=False)
