"""Hit-rate lab: replay request traces through vLLM's own scheduler and KV-cache manager.

Modules: :mod:`.trace` (Mooncake-format traces, token ids, the infinite-cache bound),
:mod:`.presets` (public model dimensions), :mod:`.model` (vLLM configs and KV-cache specs),
:mod:`.policies` (the policy registry), :mod:`.replay` (the replay loop), :mod:`.cli`
(``vllm-hybrid-npu-lab hitrate``). Heavy imports (vLLM, torch) happen inside functions.
"""
