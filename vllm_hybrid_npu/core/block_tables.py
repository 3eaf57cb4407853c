"""Block-table sizing: how many block-table columns each KV-cache group needs per request.

Mirrors the per-spec ``KVCacheSpec.max_num_blocks_per_req(vllm_config, max_len)`` of vLLM 0.30.0 /
0.32.0 (``vllm/v1/kv_cache_interface.py``) that ``GPUModelRunner.may_reinitialize_input_batch``
(vLLM) and ``NPUModelRunner.may_reinitialize_input_batch`` (vllm-ascend 0.30.0rc2) ask when they
(re)build the input batch, with the rule of this project written out once for every target:

* attention groups: ``cdiv(max_len, block_size * cp)`` where ``cp`` is the context-parallel world
  size (DCP x PCP): each rank holds ``1/cp`` of the tokens of a block;
* Mamba/GDN groups with prefix caching on (align mode keeps one state slot per block, the block
  table is indexed by token position over the whole sequence): ``cdiv(max_len, block_size)``
  (the state is replicated, not sharded, over CP ranks), plus ``num_speculative_blocks``;
* Mamba/GDN groups without prefix caching: 1 running state slot plus ``num_speculative_blocks``;
* never fewer than the runner's own answer (``floor``), so a group type we do not know, or an
  upstream rule that needs more, keeps working.
"""

from __future__ import annotations

from typing import Any, Callable


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints."""
    return -(-a // b)


def _kind(spec: Any) -> str:
    from vllm.v1.kv_cache_interface import AttentionSpec, MambaSpec

    try:
        from vllm.v1.kv_cache_interface import EncoderOnlyAttentionSpec
    except ImportError:  # pragma: no cover - present in 0.30 and 0.32
        EncoderOnlyAttentionSpec = ()  # type: ignore[assignment]
    if EncoderOnlyAttentionSpec and isinstance(spec, EncoderOnlyAttentionSpec):
        return "encoder_only"
    if isinstance(spec, MambaSpec):
        return "mamba"
    if isinstance(spec, AttentionSpec):
        return "attention"
    return "other"


def spec_max_num_blocks(
    spec: Any,
    *,
    max_len: int,
    enable_prefix_caching: bool,
    cp_world_size: int = 1,
    floor: int = 1,
) -> int:
    """Block-table columns (blocks per request) one KV-cache spec needs.

    Args:
        spec: a ``vllm.v1.kv_cache_interface.KVCacheSpec`` (``AttentionSpec`` subclass,
            ``MambaSpec`` or ``UniformTypeKVCacheSpecs``; others get ``floor``).
        max_len: tokens; the longest sequence (``max(max_model_len, max_encoder_len)``).
        enable_prefix_caching: ``CacheConfig.enable_prefix_caching``.
        cp_world_size: decode-context-parallel x prefill-context-parallel world size (>= 1).
        floor: blocks; the least the runner needs (its own answer); the result is never below.

    Returns:
        int, number of blocks (columns of the block table, in KV-cache blocks, before any
        kernel-block split the runner applies).

    Raises:
        ValueError: ``max_len`` < 1 or ``cp_world_size`` < 1.
    """
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1 token, got {max_len}")
    if cp_world_size < 1:
        raise ValueError(f"context-parallel world size must be >= 1, got {cp_world_size}")
    sub_specs = getattr(spec, "kv_cache_specs", None)
    if isinstance(sub_specs, dict) and sub_specs:  # UniformTypeKVCacheSpecs
        return max(
            spec_max_num_blocks(
                s,
                max_len=max_len,
                enable_prefix_caching=enable_prefix_caching,
                cp_world_size=cp_world_size,
                floor=floor,
            )
            for s in sub_specs.values()
        )
    kind = _kind(spec)
    if kind == "mamba":
        spec_blocks = int(getattr(spec, "num_speculative_blocks", 0) or 0)
        if enable_prefix_caching:
            ours = cdiv(max_len, spec.block_size) + spec_blocks
        else:
            ours = 1 + spec_blocks
    elif kind == "attention":
        ours = cdiv(max_len, spec.block_size * cp_world_size)
    else:
        ours = floor
    return max(ours, floor)


def cp_world_size_of(vllm_config: Any) -> int:
    """DCP x PCP world size of ``vllm_config.parallel_config`` (1 when the fields are absent)."""
    pc = getattr(vllm_config, "parallel_config", None)
    dcp = int(getattr(pc, "decode_context_parallel_size", 1) or 1)
    pcp = int(getattr(pc, "prefill_context_parallel_size", 1) or 1)
    return dcp * pcp


def max_num_blocks_per_group(
    kv_cache_config: Any,
    cache_config: Any,
    max_len: int,
    cp_world_size: int = 1,
    floor: Callable[[Any], int] | None = None,
) -> list[int]:
    """Block-table width of every KV-cache group that has a block table.

    Encoder-only attention groups have no block table in the runners (vLLM 0.30.0/0.32.0
    ``GPUModelRunner.may_reinitialize_input_batch`` and vllm-ascend 0.30.0rc2
    ``NPUModelRunner.may_reinitialize_input_batch`` skip them), so they are skipped here too:
    the list lines up with the runner's ``block_sizes`` list.

    Args:
        kv_cache_config: ``vllm.v1.kv_cache_interface.KVCacheConfig``.
        cache_config: ``vllm.config.CacheConfig`` (``enable_prefix_caching`` is read).
        max_len: tokens, ``max(max_model_len, max_encoder_len)``.
        cp_world_size: DCP x PCP world size.
        floor: ``spec -> int`` giving the runner's own minimum per spec (e.g. the upstream
            ``spec.max_num_blocks_per_req(vllm_config, max_len)``); 1 when omitted.

    Returns:
        list[int], blocks per request, one entry per non-encoder-only KV-cache group, in group
        order.
    """
    enable_pc = bool(getattr(cache_config, "enable_prefix_caching", False))
    out = []
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        if _kind(spec) == "encoder_only":
            continue
        out.append(
            spec_max_num_blocks(
                spec,
                max_len=max_len,
                enable_prefix_caching=enable_pc,
                cp_world_size=cp_world_size,
                floor=floor(spec) if floor is not None else 1,
            )
        )
    return out
