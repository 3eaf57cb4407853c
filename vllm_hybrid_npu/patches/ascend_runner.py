"""Patches of vllm-ascend's ``NPUModelRunner`` (vllm-ascend 0.30.0rc2 with vLLM 0.30.0).

Not verified on NPU (no NPU was available); the targets below are checked against the real
vllm-ascend 0.30.0rc2 source by ``tests/contract/test_vllm_ascend_contract.py``.

Targets:

* ``vllm_ascend.worker.model_runner_v1.NPUModelRunner`` (subclass of vLLM's ``GPUModelRunner``;
  its ``__init__`` calls ``super().__init__``, where our ``GPUModelRunner.__init__`` wrapper hands
  over to :func:`patch_runner_class`; nothing of vllm-ascend is imported before that).
* ``NPUModelRunner.may_reinitialize_input_batch(self, kv_cache_config, kernel_block_sizes)``:
  builds ``NPUInputBatch(..., max_num_blocks_per_req=...)`` (``vllm_ascend/worker/
  npu_input_batch.py``) from ``kv_cache_spec.max_num_blocks_per_req(vllm_config, max_len)``;
  wrapped in our block-table override like vLLM's.
* ``vllm.v1.worker.mamba_utils.preprocess_mamba`` / ``do_mamba_copy_block``: vllm-ascend's
  ``vllm_ascend/patch/worker/patch_mamba_utils.py`` replaces both when ``NPUWorker.__init__``
  runs ``adapt_patch()``; ``NPUModelRunner.execute_model`` then calls
  ``mamba_utils.preprocess_mamba(<9 positional args>)`` and, after the KV-transfer load,
  ``mamba_utils.do_mamba_copy_block(preprocess_bufs)``. We re-install ours when the runner is
  built (after ``adapt_patch``), with the copy deferred to that second call (exactly once per
  step).

Why: vllm-ascend runs vLLM's in-tree align path with its own Triton copies; this routes it to the
same plan and ``vllm_hybrid_npu.ops.batch_memcpy`` as CUDA and CPU. Not covered: vllm-ascend's
model runner v2 (``vllm_ascend/worker/v2``) and layer-wise KV-connector copies
(``prepare_mamba_state_copy``), which fall back to the batched copy.

When it can go: when vllm-ascend's in-tree align path is the one the user wants (switch
``VLLM_HYBRID_NPU_PATCHES=none`` gives exactly that today).
"""

from __future__ import annotations

import logging

from vllm_hybrid_npu.patches import _common

logger = logging.getLogger("vllm_hybrid_npu")

#: (module, class, attributes) our NPU patches rely on; the contract test checks each.
CONTRACT = {
    "module": "vllm_ascend.worker.model_runner_v1",
    "class": "NPUModelRunner",
    "methods": ("__init__", "may_reinitialize_input_batch", "execute_model"),
}

_patched: set[type] = set()


def patch_runner_class(cls: type, mode: str) -> list[str]:
    """Patch a vllm-ascend runner class (first instance) and (re)install our state copy.

    Args:
        cls: ``NPUModelRunner`` or a subclass.
        mode: ``"all"`` or ``"kernel"``.

    Returns:
        Patch names applied.
    """
    names = _common.install_state_copy(mode, defer_copy=True)
    if mode == "all" and cls not in _patched:
        for klass in cls.__mro__:
            if "may_reinitialize_input_batch" in vars(klass) and klass.__module__.startswith(
                "vllm_ascend"
            ):
                n = _common.wrap_may_reinitialize_input_batch(klass)
                if n:
                    names.append(n)
                break
        _patched.add(cls)
    logger.info("vllm-hybrid-npu: NPU runner %s patched: %s", cls.__name__, ", ".join(names))
    return names


def apply(mode: str) -> list[str]:
    """NPU target: the vLLM-runner patches (NPUModelRunner subclasses GPUModelRunner), with
    NPU specifics applied when the runner is built. Import-guarded: nothing of vllm-ascend is
    imported here."""
    import importlib.util

    from vllm_hybrid_npu.patches import vllm_runner

    names = vllm_runner.apply(mode)
    if importlib.util.find_spec("vllm_ascend") is None:
        logger.warning("vllm-hybrid-npu: target npu but vllm_ascend is not installed")
    else:
        names.append("NPUModelRunner (at runner creation)")
    return names
