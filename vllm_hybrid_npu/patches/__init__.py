"""Per-target worker patches, selected by ``VLLM_HYBRID_NPU_PATCHES``.

Filled in by the worker-patches work (block tables sized per KV-cache group, preprocess_mamba
routed to ours, the Mamba prefix-caching guard lifted).
"""

from __future__ import annotations


def apply_patches(target: str) -> list[str]:
    """Apply the patches for ``target`` (``"npu"``, ``"cuda"`` or ``"cpu"``).

    Returns:
        Names of the patches applied, in order (empty list when nothing applies).
    """
    return []
