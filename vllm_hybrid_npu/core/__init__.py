"""Target-independent logic (no model runner, no torch at import).

* :mod:`vllm_hybrid_npu.core.config_checks`: early, flag-naming align-mode configuration errors.
* :mod:`vllm_hybrid_npu.core.gdn_checkpoints`: the segment plan of GDN states captured inside
  the step (``VLLM_HYBRID_NPU_CHECKPOINTS=gdn``).
"""
