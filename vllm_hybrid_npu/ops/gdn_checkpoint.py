"""GDN prefill checkpoints on the device: one export for every backend (torch only, no vLLM).

:class:`CheckpointMetadata` is a step's :class:`~vllm_hybrid_npu.core.prefill_checkpoints.StepPlan`
on the caches' device, built once per step and GDN KV-cache group by the metadata builder (its
integer fields in one upload through the caller's ``to_device``, from pinned memory; nothing here
syncs the host). A layer's forward writes the conv states (:func:`write_conv`) and opens an
:func:`exporting` scope; its backend's chunk-kernel wrapper finds it with :func:`current` and
writes the SSM states by one of two methods:

* **fused** (:meth:`ExportScope.chunk_states`, CUDA): one pass. Our chunk-state kernel
  (:mod:`vllm_hybrid_npu.ops._triton_gdn`, vLLM's FLA recurrence with the same arithmetic) stores
  the float32 running state at each checkpoint's chunk start, cast to the SSM cache's dtype,
  straight into the checkpoint block: the bytes vLLM's split stores, in every cache dtype, with no
  second kernel call; the step's outputs and final states are those of the unsplit call.
* **split** (:meth:`ExportScope.split`, :func:`run_split`: CPU, Ascend): the heads and unsplit rows
  in one kernel call, the tails in a second from the heads' final states; the checkpoint is the
  head's final state in the cache dtype (the bytes vLLM's split stores) and the tails start from
  what the split's next step reads back. Exact in every cache dtype; for kernels that return only
  final states.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any, Callable, Iterator

import torch

from vllm_hybrid_npu.core.prefill_checkpoints import StepPlan

#: Export methods (module docstring).
METHODS = ("split", "fused")
#: Tokens per chunk of the FLA chunk kernels: the fused export's checkpoints start a chunk.
CHUNK = 64
#: Profiler range prefix of the export (``benchmarks/cuda_serving.py`` sums their GPU time).
PROFILE_RANGE = "vllm_hybrid_npu.export"
#: ``to_device(values, dtype) -> tensor``: an asynchronous upload from pinned host memory.
ToDevice = Callable[[list, torch.dtype], torch.Tensor]
#: ``kernel_meta(bounds_host, bounds_device) -> backend chunk metadata`` of one cu_seqlens
#: (int32 [k + 1] on the host and on the device), for the split's two calls.
KernelMeta = Callable[[torch.Tensor, torch.Tensor], Any]


@dataclasses.dataclass
class CheckpointMetadata:
    """A step's prefill checkpoints for one GDN KV-cache group, on the caches' device.

    Attributes:
        plan: the host plan; ``method``: ``"split"`` or ``"fused"``.
        rows, cols: int64 [n] each checkpoint's block-table row and column.
        slots: int64 [n] the checkpoint blocks (gathered on the device from the group's table);
            ``conv_end``: int64 [n] their batch token indices; ``chunk_index``: int64 [n] their
            chunks among the prefill rows' 64-token chunks; ``ckpt_seq``: int64 [n] their rows
            among the prefill rows.
        chunk_map: (fused) int64 [plan.num_chunks], per chunk its checkpoint or -1; else None.
        chunk_starts: (fused) int64 [P], each prefill row's first chunk (FLA's chunk_offsets).
        index, bounds, kernel_meta: (split) per call (``"head"``, ``"tail"``): int64
            prefill-relative token indices (None when the tails are a suffix: slices then), int32
            cu_seqlens, the backend's chunk metadata (``kernel_meta`` empty where it needs none).
    """

    plan: StepPlan
    rows: torch.Tensor
    cols: torch.Tensor
    slots: torch.Tensor
    conv_end: torch.Tensor
    chunk_index: torch.Tensor
    ckpt_seq: torch.Tensor
    chunk_map: torch.Tensor | None
    chunk_starts: torch.Tensor | None
    index: dict[str, torch.Tensor | None]
    bounds: dict[str, torch.Tensor]
    kernel_meta: dict[str, Any]
    to_device: ToDevice
    method: str = "split"
    _memo: dict = dataclasses.field(default_factory=dict, repr=False)

    def conv_rows(self, width: int) -> torch.Tensor:
        """int64 [n * (width - 1)] batch indices of the ``width - 1`` input rows before each
        checkpoint, checkpoint-major; uploaded once per step, shared by the group's layers."""
        return self.memo(f"conv-{width}", lambda: self.to_device(
            [e + d for e in self.plan.conv_end for d in range(1 - width, 0)], torch.int64))

    def memo(self, key: str, make: Callable[[], Any]) -> Any:
        """``make()`` once per step and ``key`` (structures every layer of the group shares)."""
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]


def build_metadata(plan: StepPlan, block_table: torch.Tensor, to_device: ToDevice,
                   method: str = "split", kernel_meta: KernelMeta | None = None) -> CheckpointMetadata:
    """The device side of ``plan`` for ``method``: its int64 fields in one upload (shared by the
    step's GDN KV-cache groups: :data:`_SHARED`), the checkpoint blocks gathered on the device from
    ``block_table`` (int32 [R, columns], the group's); for the split also its calls' bounds and
    indices and ``kernel_meta``'s chunk metadata (None: the backend needs none). Raises
    ValueError for a method other than ``split`` or ``fused``, and for a fused checkpoint off the
    64-token chunk grid."""
    if method not in METHODS:
        raise ValueError(f"GDN checkpoint export method {method!r}: expected one of {METHODS}")
    key = (plan, method, str(block_table.device))
    if _SHARED[0] != key:  # the step's first GDN KV-cache group: plan the upload
        _SHARED[:] = [key, _upload(plan, method, to_device, kernel_meta)]
    shared = _SHARED[1]
    return CheckpointMetadata(plan=plan, slots=block_table[shared["rows"], shared["cols"]].to(torch.int64),
                              to_device=to_device, method=method, **shared)


def regather(md: CheckpointMetadata, block_table: torch.Tensor) -> CheckpointMetadata:
    """``md`` for another GDN KV-cache group of the same step: the same plan and device tensors
    (and memo), its checkpoint blocks (``slots``, int64 [n]) gathered on the device from that
    group's ``block_table`` (int32 [R, columns]; on vLLM 0.33 one column per row, the blocks
    vLLM's own plan gathered). Used where the runner derives the other groups' metadata from the
    first group's (vLLM's V2 runner: ``GDNAttentionMetadataBuilder.update_block_table``)."""
    return dataclasses.replace(md, slots=block_table[md.rows, md.cols].long())


#: ``[key, fields]`` of the last plan uploaded: the step's other GDN KV-cache groups have the same
#: plan (their block tables differ) and reuse its device tensors, so a step uploads once. The
#: tensors are never written, so a later step with an equal plan may reuse them too.
_SHARED: list = [None, None]


def _upload(plan: StepPlan, method: str, to_device: ToDevice, kernel_meta: KernelMeta | None) -> dict:
    n, fused = len(plan.rows), method == "fused"
    if fused and any(off % CHUNK for off in plan.offsets):
        raise ValueError(f"fused GDN checkpoint export: offsets {plan.offsets} are not all at a "
                         f"{CHUNK}-token chunk start (the declared alignment)")
    fields = (plan.rows, plan.cols, plan.conv_end, plan.chunk_index, plan.ckpt_seq)
    extra = [*plan.chunk_map(), *plan.chunk_starts] if fused else []
    buf = to_device([v for f in fields for v in f] + extra, torch.int64)
    rows, cols, conv_end, chunk_index, ckpt_seq = (buf[i * n:(i + 1) * n] for i in range(len(fields)))
    bounds = {} if fused else {part: (torch.tensor(v, dtype=torch.int32), to_device(list(v), torch.int32))
                               for part, v in (("head", plan.head_bounds), ("tail", plan.tail_bounds))}
    return dict(
        rows=rows, cols=cols, conv_end=conv_end, chunk_index=chunk_index, ckpt_seq=ckpt_seq,
        chunk_map=buf[len(fields) * n:][:plan.num_chunks] if fused else None,
        chunk_starts=buf[len(fields) * n + plan.num_chunks:] if fused else None,
        index={part: None if plan.tails_are_suffix else to_device(plan.token_index(part), torch.int64)
               for part in bounds},
        bounds={part: device for part, (_, device) in bounds.items()},
        kernel_meta={} if kernel_meta is None else {p: kernel_meta(*b) for p, b in bounds.items()})


def write_conv(conv_cache: torch.Tensor, mixed_qkv: torch.Tensor, md: CheckpointMetadata,
               width: int, dim_first: bool) -> None:
    """Each checkpoint's conv state: the ``width - 1`` rows of ``mixed_qkv`` (the step's
    pre-convolution input [T, D]) before it, into its block of ``conv_cache`` ([blocks, D,
    width - 1] when ``dim_first``, else [blocks, width - 1, D]) in the cache dtype: one Triton
    launch where the method is ``fused`` (CUDA), else a gather and an index copy."""
    if md.method == "fused":
        from vllm_hybrid_npu.ops import _triton_gdn

        _triton_gdn.write_conv(conv_cache, mixed_qkv, md.conv_end, md.slots, width, dim_first,
                               kernels=None if mixed_qkv.is_cuda else _triton_gdn.interpreted())
        return
    with torch.profiler.record_function(PROFILE_RANGE + ".conv"):
        rows = mixed_qkv.index_select(0, md.conv_rows(width))
        rows = rows.view(md.slots.numel(), width - 1, -1).to(conv_cache.dtype)
        conv_cache.index_copy_(0, md.slots, rows.transpose(1, 2) if dim_first else rows)


def run_split(run: Callable[..., tuple[torch.Tensor, torch.Tensor]], md: CheckpointMetadata,
              inputs: tuple[torch.Tensor, ...], initial_state: torch.Tensor,
              cache_dtype: torch.dtype, out: torch.Tensor | None = None):
    """A chunk kernel over the prefill rows, split at the checkpoints: ``run(inputs, initial_state,
    part) -> (o, final_state)`` is the backend's kernel on ``inputs`` ([1, T, ...]: q, k, v, g,
    beta) laid out by the cu_seqlens of ``part`` (``"head"`` / ``"tail"``) from ``initial_state``
    ([P, ...] per prefill row, the kernel's layout and dtype). With ``out`` (a contiguous [1, T,
    ...] tensor of ``v``'s shape and dtype) and tails that are a suffix, ``run(inputs, state, part,
    out_part)`` gets ``out``'s rows of that part (a contiguous view) and must write its output there
    (FLA's ``core_attn_out``): no concatenation copies ``o``. Returns ``o`` [1, T, ...] (``out``
    where given) and ``final_state`` [P, ...] as one unsplit call returns them, and the checkpoint
    states [n, ...] (kernel layout) in ``cache_dtype``, the SSM cache's."""
    plan = md.plan
    if plan.several_per_row:
        raise ValueError("the split exports one checkpoint per row; this step plans several in a "
                         "row (a shared-prefix junction): not on this path")
    if plan.tails_are_suffix:
        cut = plan.head_bounds[-1]
        heads, tails = tuple(x[:, :cut] for x in inputs), tuple(x[:, cut:] for x in inputs)
        parts = () if out is None else (out[:, :cut], out[:, cut:])
    else:
        heads = tuple(x.index_select(1, md.index["head"]) for x in inputs)
        tails = tuple(x.index_select(1, md.index["tail"]) for x in inputs)
        parts = ()
    o_head, final = run(heads, initial_state, "head", *parts[:1])
    ckpt = final.index_select(0, md.ckpt_seq).to(cache_dtype)
    o_tail, tail_final = run(tails, ckpt.to(initial_state.dtype), "tail", *parts[1:])  # as read back
    if plan.tails_are_suffix:
        o = out if parts else torch.cat([o_head, o_tail], dim=1)
    else:
        o = o_head.new_empty((o_head.shape[0], plan.num_prefill_tokens, *o_head.shape[2:]))
        o.index_copy_(1, md.index["head"], o_head)
        o.index_copy_(1, md.index["tail"], o_tail)
    return o, final.index_copy(0, md.ckpt_seq, tail_final.to(final.dtype)), ckpt


@dataclasses.dataclass
class ExportScope:
    """One GDN layer's forward with checkpoints: the step's ``metadata``, the layer's
    ``ssm_cache`` [blocks, ...], the ``method``, and ``exports`` (kernel calls that exported)."""

    metadata: CheckpointMetadata
    ssm_cache: torch.Tensor
    method: str
    exports: int = 0

    def write(self, states: torch.Tensor) -> None:
        """One kernel call's checkpoint states ([n, *block shape], the cache's layout) into their
        blocks of ``ssm_cache`` ([blocks, *block shape]) in its dtype, counted in ``exports``."""
        with torch.profiler.record_function(PROFILE_RANGE + ".ssm"):
            self.ssm_cache.index_copy_(0, self.metadata.slots, states.to(self.ssm_cache.dtype))
        self.exports += 1

    def chunk_states(self, k: torch.Tensor, w: torch.Tensor, u: torch.Tensor, g: torch.Tensor,
                     initial_state: torch.Tensor | None, output_final_state: bool,
                     cu_seqlens: torch.Tensor, config: dict):
        """The fused export: vLLM's FLA ``chunk_gated_delta_rule_fwd_h`` on these arguments (its
        shapes, ``cu_seqlens`` [P + 1] of the step's prefill rows; ``config`` the launch's ``bv``,
        ``num_warps``, ``num_stages``) by our kernel, which also writes each checkpoint's state into
        ``ssm_cache`` ([blocks, H, V, K]) in its dtype; counted in ``exports``. The chunk layout is
        the plan's. Returns ``(h, v_new, final_state)`` as vLLM's function does (the Triton
        interpreter runs it on CPU tensors)."""
        from vllm_hybrid_npu.ops import _triton_gdn

        md = self.metadata
        out = _triton_gdn.chunk_states(
            k, w, u, g, initial_state, output_final_state, cu_seqlens, md.chunk_starts,
            md.plan.num_chunks, md.chunk_map, md.slots, self.ssm_cache, **config,
            kernels=None if k.is_cuda else _triton_gdn.interpreted())
        self.exports += 1
        return out

    def split(self, run: Callable, inputs: tuple, initial_state: torch.Tensor,
              transpose: bool = False, out: torch.Tensor | None = None):
        """A kernel wrapper's export: :func:`run_split` with ``run`` (and ``out``) in the SSM
        cache's dtype, its checkpoints written (``transpose``: kernel state ``[.., K, V]``, cache
        ``[.., V, K]``); returns ``(o, final_state)`` as one unsplit kernel call does."""
        o, final, ckpt = run_split(run, self.metadata, inputs, initial_state,
                                   self.ssm_cache.dtype, out)
        self.write(ckpt.transpose(-1, -2) if transpose else ckpt)
        return o, final


_SCOPE: contextvars.ContextVar[ExportScope | None] = contextvars.ContextVar(
    "vllm_hybrid_npu_gdn_export", default=None)


@contextlib.contextmanager
def exporting(md: CheckpointMetadata, ssm_cache: torch.Tensor, method: str) -> Iterator[ExportScope]:
    """The scope of one layer's forward that exports checkpoints by ``method`` (see
    :func:`current`); raises ValueError where ``method`` is not ``split`` or ``fused``."""
    if method not in METHODS:
        raise ValueError(f"GDN checkpoint export method {method!r}: expected one of {METHODS}")
    token = _SCOPE.set(scope := ExportScope(md, ssm_cache, method))
    try:
        yield scope
    finally:
        _SCOPE.reset(token)


def current(method: str) -> ExportScope | None:
    """The open scope if it exports by ``method``, else None (the kernel runs unchanged)."""
    scope = _SCOPE.get()
    return scope if scope is not None and scope.method == method else None
