"""Benchmarks of vllm-hybrid-npu (run as modules, e.g. ``python -m vllm_hybrid_npu.bench.state_copy``)."""
