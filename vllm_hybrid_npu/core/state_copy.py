"""Align-mode state copies: which Mamba/GDN state moves where before a forward, and the copy.

In align mode (``--enable-prefix-caching --mamba-cache-mode align``) a request's running
recurrent state (conv state + SSM state of every Mamba/GDN layer) lives in the block-table column
of the block that holds its last scheduled token, so that a block, once full, keeps the state at
its boundary for later prefix cache hits. When a step moves a request into a new block, the state
of the previous step must first be copied into the new column. This module is our version of that
step; it mirrors ``preprocess_mamba`` / ``collect_mamba_copy_meta`` / ``do_mamba_copy_block`` of
``vllm/v1/worker/mamba_utils.py`` (vLLM 0.30.0 and 0.32.0, identical there) and vllm-ascend
0.30.0rc2's ``vllm_ascend/patch/worker/patch_mamba_utils.py::preprocess_mamba``, split into:

* :func:`plan_state_copies`: pure Python, from per-request token counts and the previous state
  column of each request (no tensors);
* :func:`copy_ranges`: the plan turned into byte ranges (source address, destination address,
  byte count) over the real state tensors, using the model's own state-copy functions
  (``get_conv_copy_spec`` / ``get_temporal_copy_spec`` of
  ``vllm/model_executor/layers/mamba/mamba_utils.py``);
* :func:`execute_copies`: one ``vllm_hybrid_npu.ops.batch_memcpy`` launch for all ranges, counted
  in :mod:`vllm_hybrid_npu.metrics`;
* :func:`preprocess_mamba` and :func:`do_mamba_copy_block`: drop-in replacements, with the
  upstream signatures, that the per-target patches install.

Imports no model runner: the runner's objects (input batch, request states, forward context) are
passed in.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Iterable, Mapping, MutableMapping, Sequence
from typing import Any

logger = logging.getLogger("vllm_hybrid_npu")

#: Attribute under which staged byte ranges ride on vLLM's ``MambaCopyBuffers`` object between
#: :func:`preprocess_mamba` and :func:`do_mamba_copy_block` (a tuple of three int lists).
PENDING_ATTR = "_vllm_hybrid_npu_pending"

#: When True (set by the NPU patch), :func:`preprocess_mamba` only stages the copies and the
#: runner's own later ``mamba_utils.do_mamba_copy_block(...)`` call performs them (vllm-ascend
#: 0.30.0rc2 ``NPUModelRunner.execute_model`` calls it after the KV-transfer load); when False
#: (vLLM's GPU/CPU runner), :func:`preprocess_mamba` copies at once, as upstream's does.
DEFER_COPY = False


@dataclasses.dataclass(frozen=True)
class StateCopy:
    """One request's state move for this step.

    Attributes:
        req_index: row of the request in the input batch (int).
        req_id: request id (str).
        src_col: block-table column (block index within the request) holding the previous
            step's state.
        dst_col: block-table column that holds this step's running state.
        accept_bias: accepted speculative tokens of the previous step minus 1 (0 without spec
            decode): selects the state of the last accepted token (temporal state: column
            ``src_col + accept_bias``; conv state: window shifted by ``accept_bias`` tokens).
    """

    req_index: int
    req_id: str
    src_col: int
    dst_col: int
    accept_bias: int


def dropped_request_ids(scheduler_output: Any) -> set[str]:
    """Requests whose remembered state column is stale after this scheduler output.

    Finished, preempted and resumed requests (resumed ones may come back with a smaller block
    allocation after a forced preemption) must be re-derived from ``num_computed_tokens``.
    Mirrors ``cleanup_mamba_state_idx`` of ``vllm/v1/worker/mamba_utils.py`` (vLLM 0.30.0).

    Args:
        scheduler_output: ``vllm.v1.core.sched.output.SchedulerOutput``.

    Returns:
        set of request ids (str).
    """
    finished = getattr(scheduler_output, "finished_req_ids", None) or ()
    preempted = getattr(scheduler_output, "preempted_req_ids", None) or ()
    cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
    resumed = getattr(cached, "resumed_req_ids", None) or ()
    return set(itertools.chain(finished, preempted, resumed))


def plan_state_copies(
    req_ids: Sequence[str],
    num_computed_tokens: Sequence[int],
    num_scheduled_tokens: Mapping[str, int],
    num_accepted_tokens: Sequence[int],
    state_col: MutableMapping[str, int],
    dropped: Iterable[str],
    block_size: int,
    num_speculative_blocks: int = 0,
) -> list[StateCopy]:
    """Decide this step's state copies and update each request's running state column.

    For every scheduled request the running state goes to column
    ``cdiv(num_computed + num_scheduled, block_size) - 1`` (the block of the last scheduled
    token; speculative blocks follow it). The previous column is the remembered one, or, for a
    new / resumed / preempted request, ``(num_computed - 1) // block_size`` (``-1`` = no state
    yet: nothing to copy). A copy is planned when the previous column exists and differs.

    Args:
        req_ids: request ids in input-batch row order.
        num_computed_tokens: tokens already computed per row (same order), before this step.
        num_scheduled_tokens: tokens scheduled this step per request id (incl. draft tokens);
            rows with 0 or absent are skipped and forgotten.
        num_accepted_tokens: tokens accepted in the previous step per row (1 without spec
            decode).
        state_col: request id -> running state column; read and updated in place.
        dropped: request ids to forget first (see :func:`dropped_request_ids`).
        block_size: tokens per block of the Mamba/GDN KV-cache groups.
        num_speculative_blocks: ``MambaSpec.num_speculative_blocks``.

    Returns:
        list of :class:`StateCopy`, in row order. The caller resets the accepted-token count of
        each copied row to 1 (the copy already selected the accepted state).

    Raises:
        ValueError: ``block_size`` < 1 or lengths of the row sequences differ.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1 token, got {block_size}")
    if not (len(req_ids) <= len(num_computed_tokens) and len(req_ids) <= len(num_accepted_tokens)):
        raise ValueError("num_computed_tokens / num_accepted_tokens shorter than req_ids")
    for req_id in dropped:
        state_col.pop(req_id, None)
    plan: list[StateCopy] = []
    for i, req_id in enumerate(req_ids):
        n_sched = int(num_scheduled_tokens.get(req_id, 0))
        n_comp = int(num_computed_tokens[i])
        if n_sched <= 0:
            state_col.pop(req_id, None)
            continue
        prev = state_col.get(req_id)
        if prev is None:
            prev = (n_comp - 1) // block_size
        curr = -(-(n_comp + n_sched) // block_size) - 1
        state_col[req_id] = curr
        if prev >= 0 and prev != curr:
            plan.append(StateCopy(i, req_id, prev, curr, int(num_accepted_tokens[i]) - 1))
    # num_speculative_blocks does not move the running column (the speculative blocks follow
    # it); it is part of the signature so callers pass the spec's full scheduling parameters.
    del num_speculative_blocks
    return plan


def _is_vllm_conv_copy(copy_func: Any) -> bool:
    try:
        from vllm.model_executor.layers.mamba.mamba_utils import get_conv_copy_spec
    except ImportError:  # pragma: no cover
        return False
    return copy_func is get_conv_copy_spec


def _conv_dim_first() -> bool:
    try:
        from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
    except ImportError:  # pragma: no cover - older vLLM: only the SD layout exists
        return False
    return bool(is_conv_state_dim_first())


def _state_ranges(
    state: Any,
    copy_func: Any,
    block_ids: Sequence[int],
    src_col: int,
    dst_block_id: int,
    accept_bias: int,
) -> list[tuple[int, int, int]]:
    elem = state.element_size()
    if accept_bias > 0 and _is_vllm_conv_copy(copy_func) and _conv_dim_first():
        # DS conv layout (num_blocks, dim, width): the window shift is one strided range per
        # dim row; vLLM does this in its fused kernel, we emit the rows as byte ranges.
        src = state[block_ids[src_col]]
        dst = state[dst_block_id]
        dim, width = src.shape[-2], src.shape[-1]
        if src.stride(-1) != 1:
            raise ValueError("DS conv state rows must be contiguous along the token axis")
        row_bytes = src.stride(-2) * elem
        n = (width - accept_bias) * elem
        s0 = src.data_ptr() + accept_bias * elem
        d0 = dst.data_ptr()
        return [(s0 + r * row_bytes, d0 + r * row_bytes, n) for r in range(dim)]
    spec = copy_func(state, list(block_ids), src_col, accept_bias + 1)
    return [(int(spec.start_addr), state[dst_block_id].data_ptr(), int(spec.num_elements) * elem)]


def _layer_mamba_spec(group: Any, layer_name: str) -> Any:
    spec = group.kv_cache_spec
    sub = getattr(spec, "kv_cache_specs", None)
    if isinstance(sub, dict):
        spec = sub[layer_name]
    return spec


def copy_ranges(
    plan: Sequence[StateCopy],
    block_ids_of: Mapping[str, Sequence[Sequence[int]]] | Any,
    kv_cache_config: Any,
    mamba_group_ids: Sequence[int],
    copy_funcs: Mapping[Any, Sequence[Any]],
    forward_context: Mapping[str, Any],
) -> tuple[list[int], list[int], list[int]]:
    """Turn a copy plan into byte ranges over the real state tensors.

    For each planned copy, each Mamba/GDN KV-cache group and each layer of it, each state of
    the layer (conv state, SSM state, in the order of ``layer.kv_cache``) gives one range (or,
    for the DS conv layout with ``accept_bias > 0``, one per dim row). Mirrors
    ``collect_mamba_copy_meta`` of ``vllm/v1/worker/mamba_utils.py`` (vLLM 0.30.0).

    Args:
        plan: from :func:`plan_state_copies`.
        block_ids_of: request id -> per-KV-cache-group block id lists (the request's block
            table rows; ``CachedRequestState.block_ids``), or a mapping to objects with a
            ``block_ids`` attribute.
        kv_cache_config: ``vllm.v1.kv_cache_interface.KVCacheConfig``.
        mamba_group_ids: indices of the Mamba/GDN KV-cache groups.
        copy_funcs: ``mamba_type -> (copy func per state)`` (``MambaStateCopyFuncsByType``).
        forward_context: layer name -> layer with ``kv_cache`` (tuple of state tensors, each
            ``[num_blocks, ...]``), i.e. ``compilation_config.static_forward_context``.

    Returns:
        ``(src_addrs, dst_addrs, num_bytes)``: three equally long lists of int (byte addresses
        on the state tensors' device; byte counts).
    """
    src: list[int] = []
    dst: list[int] = []
    sizes: list[int] = []
    for c in plan:
        entry = block_ids_of[c.req_id]
        all_block_ids = getattr(entry, "block_ids", entry)
        for gid in mamba_group_ids:
            block_ids = all_block_ids[gid]
            dst_block_id = block_ids[c.dst_col]
            group = kv_cache_config.kv_cache_groups[gid]
            for layer_name in group.layer_names:
                funcs = copy_funcs[_layer_mamba_spec(group, layer_name).mamba_type]
                states = forward_context[layer_name].kv_cache
                for state, func in zip(states, funcs):
                    for s, d, n in _state_ranges(
                        state, func, block_ids, c.src_col, dst_block_id, c.accept_bias
                    ):
                        src.append(s)
                        dst.append(d)
                        sizes.append(n)
    return src, dst, sizes


def _as_i64(addr: int) -> int:
    """A uint64 address as the int64 with the same bit pattern."""
    addr = int(addr)
    return addr - (1 << 64) if addr >= (1 << 63) else addr


_batch_memcpy_impl = None


def resolve_batch_memcpy():
    """The copy kernel: ``vllm_hybrid_npu.ops.batch_memcpy(src_ptrs, dst_ptrs, sizes)`` (int64
    tensors ``[N]`` of byte addresses / byte counts on the device), imported at the first copy
    so that importing the patches stays light."""
    global _batch_memcpy_impl
    if _batch_memcpy_impl is None:
        from vllm_hybrid_npu.ops import batch_memcpy

        _batch_memcpy_impl = batch_memcpy
    return _batch_memcpy_impl


def execute_copies(
    src: Sequence[int], dst: Sequence[int], sizes: Sequence[int], device: Any
) -> tuple[int, int]:
    """Copy ``sizes[i]`` bytes from ``src[i]`` to ``dst[i]`` for all i in one kernel launch.

    Args:
        src, dst: byte addresses (int) on ``device``.
        sizes: byte counts (int, >= 0).
        device: ``torch.device`` of the state tensors (where the pointer tensors are built).

    Returns:
        ``(num_copies, num_bytes)`` copied (ints), also added to the
        ``vllm_hybrid_npu:state_copies_total`` / ``vllm_hybrid_npu:state_copy_bytes_total``
        counters.
    """
    n = len(sizes)
    if n == 0:
        return 0, 0
    import torch

    src_t = torch.tensor([_as_i64(a) for a in src], dtype=torch.int64, device=device)
    dst_t = torch.tensor([_as_i64(a) for a in dst], dtype=torch.int64, device=device)
    size_t = torch.tensor([int(s) for s in sizes], dtype=torch.int64, device=device)
    resolve_batch_memcpy()(src_t, dst_t, size_t)
    num_bytes = int(sum(int(s) for s in sizes))
    from vllm_hybrid_npu import metrics

    metrics.record_state_copies(n, num_bytes)
    return n, num_bytes


def preprocess_mamba(
    scheduler_output: Any,
    kv_cache_config: Any,
    cache_config: Any,
    mamba_state_idx: MutableMapping[str, int],
    input_batch: Any,
    requests: Mapping[str, Any],
    forward_context: Mapping[str, Any],
    mamba_state_copy_funcs: Mapping[Any, Sequence[Any]],
    copy_bufs: Any,
    align_ctx: Any = None,
) -> None:
    """Our replacement of ``vllm.v1.worker.mamba_utils.preprocess_mamba`` (same signature).

    Upstream: ``vllm/v1/worker/mamba_utils.py::preprocess_mamba`` (vLLM 0.30.0, 0.32.0) and
    ``vllm_ascend/patch/worker/patch_mamba_utils.py::preprocess_mamba`` (vllm-ascend
    0.30.0rc2, which has no ``align_ctx``). Plans the copies with :func:`plan_state_copies`,
    resets the accepted-token count of copied rows to 1, stages the byte ranges on
    ``copy_bufs`` and, unless :data:`DEFER_COPY`, copies them at once through
    :func:`do_mamba_copy_block`. ``align_ctx`` (vLLM's fused spec-decode pre-copy context) is
    accepted and not used: the same copies go through our path; vLLM's fused postprocess reads
    ``mamba_state_idx``, which is kept exactly as upstream keeps it.

    Args: as upstream; ``copy_bufs`` is vLLM's ``MambaCopyBuffers`` (``mamba_group_ids``,
        ``mamba_spec`` are read; ``offset`` is set to the number of staged ranges).
    """
    mamba_spec = copy_bufs.mamba_spec
    req_ids = list(input_batch.req_ids)
    num_reqs = len(req_ids)
    accepted = input_batch.num_accepted_tokens_cpu
    plan = plan_state_copies(
        req_ids,
        [requests[r].num_computed_tokens for r in req_ids],
        scheduler_output.num_scheduled_tokens,
        [int(accepted[i]) for i in range(num_reqs)],
        mamba_state_idx,
        dropped_request_ids(scheduler_output),
        mamba_spec.block_size,
        getattr(mamba_spec, "num_speculative_blocks", 0),
    )
    for c in plan:
        accepted[c.req_index] = 1
    ranges = copy_ranges(
        plan,
        requests,
        kv_cache_config,
        copy_bufs.mamba_group_ids,
        mamba_state_copy_funcs,
        forward_context,
    )
    setattr(copy_bufs, PENDING_ATTR, ranges)
    copy_bufs.offset = len(ranges[2])
    if not DEFER_COPY:
        do_mamba_copy_block(copy_bufs)


def do_mamba_copy_block(copy_bufs: Any) -> tuple[int, int]:
    """Our replacement of ``vllm.v1.worker.mamba_utils.do_mamba_copy_block(copy_bufs)``.

    Upstream: ``vllm/v1/worker/mamba_utils.py::do_mamba_copy_block`` (vLLM 0.30.0, 0.32.0) and
    vllm-ascend 0.30.0rc2's replacement of it in ``patch_mamba_utils.py``. Copies what was
    staged this step, exactly once: the ranges staged by our :func:`preprocess_mamba`, or, when
    only the kernel is ours (``VLLM_HYBRID_NPU_PATCHES=kernel``), the first ``offset`` entries of
    upstream's ``copy_bufs.src_ptrs/dst_ptrs/sizes`` host arrays. Resets ``offset`` to 0, so a
    second call in the same step copies nothing.

    Returns:
        ``(num_copies, num_bytes)``.
    """
    n = int(getattr(copy_bufs, "offset", 0) or 0)
    pending = getattr(copy_bufs, PENDING_ATTR, None)
    setattr(copy_bufs, PENDING_ATTR, None)
    copy_bufs.offset = 0
    if n == 0:
        return 0, 0
    if pending is not None:
        src, dst, sizes = pending
    else:
        src = [int(x) for x in copy_bufs.src_ptrs.np[:n]]
        dst = [int(x) for x in copy_bufs.dst_ptrs.np[:n]]
        sizes = [int(x) for x in copy_bufs.sizes.np[:n]]
    device = copy_bufs.src_ptrs.gpu.device
    return execute_copies(src, dst, sizes, device)
