"""Which path exports GDN prefill checkpoints under vllm-ascend 0.30.0rc2, or why none does.

The decision half of :mod:`vllm_hybrid_npu.patches.vllm_ascend_gdn` (read that module's docstring
for vllm-ascend's three prefill paths), kept apart so that
:func:`vllm_hybrid_npu.patches.gdn_prefill_checkpoint.exporter_path` can delegate its ``npu``
branch here without an import cycle (``tests/test_import_graph.py``): this module imports neither.
"""

from __future__ import annotations

import sys
from typing import Any

from vllm_hybrid_npu.patches.registry import REPORT, is_ours

ASCEND_GDN = "vllm_ascend.ops.gdn"
QWEN_GDN = "vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn"
ASCEND_VERSIONS = ("0.30.0rc2",)
#: path name in the spec's log line
PATH = "ascend-chunk"


def _pcp_size(vllm_config: Any) -> int:
    return int(getattr(getattr(vllm_config, "parallel_config", None),
                       "prefill_context_parallel_size", 1) or 1)


def _ssm_dtype_reason(vllm_config: Any) -> str | None:
    import torch

    cache = vllm_config.cache_config
    name = getattr(cache, "mamba_ssm_cache_dtype", "auto") or "auto"
    if name == "auto":
        dtype = getattr(vllm_config.model_config, "dtype", None)
    else:
        dtype = getattr(torch, str(name), None)
    if dtype != torch.bfloat16:
        return (f"SSM cache dtype {dtype} (vllm-ascend's chunk op keeps the per-chunk state h in "
                "bfloat16; the split would store it unrounded)")
    return None


def _profile():
    from vllm_ascend.device.hardware_profile import HardwareCapability, get_current_hardware_profile

    return get_current_hardware_profile(), HardwareCapability


def fused_prefill_reason(in_worker: bool, probe_device: bool) -> str | None:
    """Which fused prefill op vllm-ascend's GDN forward chooses over its chunk path, or None.

    Args:
        in_worker: vllm-ascend's GDN module (and so ``fla_npu``) is imported in this process;
            else only the hardware profile is read (no ``fla_npu`` import outside the worker).
        probe_device: also run vllm-ascend's own ``_probe_fused_chunk`` (a smoke call of
            ``torch_npu.npu_chunk_gated_delta_rule`` on the current NPU, cached on the class);
            only in the worker, once the device is set.
    """
    profile, cap = _profile()
    if profile.supports(cap.GDN_COMPATIBILITY):
        return "310P: vllm-ascend's 310P GDN forward (_310p/ops/fla/gdn_310.py) exposes no h"
    if in_worker and profile.supports(cap.FLA_GDN_PREFILL):
        try:
            from fla_npu.ops.ascendc import chunk_gated_delta_rule_fwd  # noqa: F401
        except ImportError:
            pass
        else:
            return ("vllm-ascend prefills GDN with fla_npu's fused op "
                    "(fla_npu.ops.ascendc.chunk_gated_delta_rule_fwd: no per-chunk state h)")
    if probe_device:
        from vllm_ascend.ops.gdn import AscendGatedDeltaNetAttention

        if AscendGatedDeltaNetAttention._probe_fused_chunk():
            return ("vllm-ascend prefills GDN with the fused CANN op "
                    "torch_npu.npu_chunk_gated_delta_rule (no per-chunk state h)")
    return None


def npu_exporter_path(vllm_config: Any) -> tuple[str | None, str]:
    """The NPU branch of :func:`gdn_prefill_checkpoint.exporter_path` (same return).

    In the worker (vllm-ascend's GDN module imported: the spec is declared there) every
    condition is checked, the device probe of the fused CANN op included. Before that (engine
    configuration, e.g. the hybrid block rounding) only what the configuration and the installed
    packages tell: the fused ops' availability on the device is decided at the spec.
    """
    stack = REPORT.stack
    version = getattr(stack, "vllm_ascend", None)
    if version not in ASCEND_VERSIONS:
        return None, (f"no GDN exporter for vllm-ascend {version} (read against "
                      f"{', '.join(ASCEND_VERSIONS)}; vLLM's split kept)")
    if _pcp_size(vllm_config) > 1:
        return None, "prefill context parallel on (vllm-ascend recomputes h across ranks)"
    reason = _ssm_dtype_reason(vllm_config)
    if reason:
        return None, reason
    in_worker = ASCEND_GDN in sys.modules
    reason = fused_prefill_reason(in_worker, probe_device=in_worker)
    if reason:
        return None, reason
    if in_worker:
        qwen = sys.modules.get(QWEN_GDN)
        core = getattr(getattr(qwen, "QwenGatedDeltaNetAttention", None), "_forward_core", None)
        if core is None or not is_ours(core):
            return None, ("vLLM's QwenGatedDeltaNetAttention._forward_core is not vllm-ascend's "
                          "chunk-path forward wrapped by the plugin")
    return PATH, ""
