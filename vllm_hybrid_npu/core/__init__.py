"""Target-independent logic of the worker patches.

Nothing here imports a model runner (vLLM's ``GPUModelRunner``/``CPUModelRunner`` or
vllm-ascend's ``NPUModelRunner``): the functions take vLLM's configuration objects
(``KVCacheConfig``, ``CacheConfig``, ``VllmConfig``) and plain Python values, so the same code
decides block-table widths and state copies on NPU, CUDA and CPU.

* :mod:`vllm_hybrid_npu.core.block_tables`: block-table width per KV-cache group.
* :mod:`vllm_hybrid_npu.core.state_copy`: the align-mode state-copy plan and its execution.
* :mod:`vllm_hybrid_npu.core.config_checks`: early, flag-naming configuration errors.
"""
