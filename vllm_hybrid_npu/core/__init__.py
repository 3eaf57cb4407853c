"""Target-independent logic (no model runner, no torch at import).

* :mod:`vllm_hybrid_npu.core.config_checks`: early, flag-naming align-mode configuration errors.
* :mod:`vllm_hybrid_npu.core.prefill_checkpoints`: which request of a step exports its GDN
  prefill checkpoint, at which offset, into which block-table column (vLLM's rule).
* :mod:`vllm_hybrid_npu.core.token_budget`: align mode's chunk ends on block boundaries and the
  token budget that takes the steps of caching off (the ``token-budget*`` entries).
"""
