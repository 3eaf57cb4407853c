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
  final states. A row with several checkpoints (a shared-prefix junction before the prompt's own,
  :attr:`StepPlan.rounds`) takes one call per segment: ``K`` checkpoints in a row, ``K + 1``
  calls ("rounds"), each from the previous round's checkpoint states as read back.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import itertools
from typing import Any, Callable, Iterator, Sequence

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
#: (int32 [k + 1] on the host and on the device), for each of the split's calls.
KernelMeta = Callable[[torch.Tensor, torch.Tensor], Any]


def part(k: int) -> str:
    """The name of the split's call ``k`` (round ``k`` of :attr:`StepPlan.rounds`): ``"head"``,
    ``"tail"``, then ``"round2"``, ``"round3"``, ...; the keys of :class:`CheckpointMetadata`'s
    per-call fields and the ``part`` a kernel wrapper's ``run`` gets."""
    return ("head", "tail")[k] if k < 2 else f"round{k}"


@dataclasses.dataclass
class CheckpointMetadata:
    """A step's prefill checkpoints for one GDN KV-cache group, on the caches' device.

    Attributes:
        plan: the host plan; ``method``: ``"split"`` or ``"fused"``.
        rows, cols: int64 [n] each checkpoint's block-table row and column (the plan's).
        slots: int64 [n] the checkpoint blocks (the engine's named blocks, or gathered on the
            device from the group's table: :func:`build_metadata`);
            ``conv_end``: int64 [n] their batch token indices; ``chunk_index``: int64 [n] their
            chunks among the prefill rows' 64-token chunks; ``ckpt_seq``: int64 [n] their rows
            among the prefill rows.
        chunk_map: (fused) int64 [plan.num_chunks], per chunk its checkpoint or -1; else None.
        chunk_starts: (fused) int64 [P], each prefill row's first chunk (FLA's chunk_offsets).
        index, bounds, kernel_meta: (split) per call (:func:`part`: ``"head"``, ``"tail"``,
            ``"round2"``, ...): int64 prefill-relative token indices (None when the tails are a
            suffix: slices then), int32 cu_seqlens, the backend's chunk metadata (``kernel_meta``
            empty where it needs none).
        carry, round_rows: (split) int64, per call but the last: the positions among its rows
            whose running states are checkpoints (:meth:`StepPlan.carried`), and per call but the
            first: its rows among the prefill rows (:meth:`StepPlan.round_rows`).
        order: (split, several checkpoints in a row) int64 [n], :meth:`StepPlan.round_order`;
            else None.
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
    carry: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    round_rows: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    order: torch.Tensor | None = None
    method: str = "split"
    _memo: dict = dataclasses.field(default_factory=dict, repr=False)
    _plan_memo: dict = dataclasses.field(default_factory=dict, repr=False)

    def conv_rows(self, width: int) -> torch.Tensor:
        """int64 [n * (width - 1)] batch indices of the ``width - 1`` input rows before each
        checkpoint, checkpoint-major; uploaded once per step, shared by the step's GDN KV-cache
        groups and their layers."""
        return self.plan_memo(f"conv-{width}", lambda: self.to_device(
            [e + d for e in self.plan.conv_end for d in range(1 - width, 0)], torch.int64))

    def memo(self, key: str, make: Callable[[], Any]) -> Any:
        """``make()`` once per step and ``key`` (structures every layer of the group shares;
        ``make`` may read the group's own metadata)."""
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]

    def plan_memo(self, key: str, make: Callable[[], Any]) -> Any:
        """``make()`` once per plan and ``key``, shared by the step's GDN KV-cache groups:
        ``make`` reads the plan alone."""
        if key not in self._plan_memo:
            self._plan_memo[key] = make()
        return self._plan_memo[key]


def build_metadata(plan: StepPlan, block_table: torch.Tensor, to_device: ToDevice,
                   method: str = "split", kernel_meta: KernelMeta | None = None,
                   named: torch.Tensor | None = None,
                   table_rows: Sequence[int] | None = None) -> CheckpointMetadata:
    """The device side of ``plan`` for ``method``: its integer fields in one upload (int64; the
    split's cu_seqlens cast to int32 on the device), shared by the step's GDN KV-cache groups with
    the layers' per-step structures (:data:`_SHARED`, :meth:`CheckpointMetadata.plan_memo`); for the
    split also, per call (one per :attr:`StepPlan.rounds`), its bounds, indices, carried rows and
    ``kernel_meta``'s chunk metadata (None: the backend needs none).

    The checkpoint blocks (``slots``): a checkpoint whose plan column is below ``block_table``'s
    width (int32 [R, columns], the group's) is read from that column of its row on the device
    (row ``table_rows[plan row]``; default the plan's row); one at or past it is the engine's
    named block, the next of ``named`` (int64 [m] on the device, in the plan's checkpoint order).
    A step whose blocks are all named gathers nothing; otherwise one ``index_select`` over the
    flattened table (and ``named``).

    Raises:
        ValueError: a method other than ``split`` or ``fused``; a fused checkpoint off the
            64-token chunk grid; ``named`` not holding one block per named checkpoint.
    """
    if method not in METHODS:
        raise ValueError(f"GDN checkpoint export method {method!r}: expected one of {METHODS}")
    rows, width = block_table.shape[0], block_table.shape[1]
    key = (plan, method, block_table.device, rows, width, None if table_rows is None else tuple(table_rows))
    memo = _SHARED[:]
    if memo[0] == key:  # uploaded by the step's first GDN KV-cache group
        shared = memo[1]
    else:
        shared = _upload(plan, method, to_device, kernel_meta, rows, width, table_rows)
        _SHARED[:] = [key, shared]
    m = shared["named"]
    if (0 if named is None else named.numel()) != m:
        raise ValueError(f"GDN checkpoints: {m} named blocks in the plan, "
                         f"{0 if named is None else named.numel()} given")
    if m == len(plan.rows):
        slots = named
    elif not m:
        slots = block_table.reshape(-1).index_select(0, shared["flat"]).to(torch.int64)
    else:
        slots = torch.cat([block_table.reshape(-1).to(torch.int64), named]).index_select(0, shared["flat"])
    return CheckpointMetadata(plan=plan, slots=slots, to_device=to_device, method=method,
                              **{k: v for k, v in shared.items() if k not in ("named", "flat")})


def regather(md: CheckpointMetadata, block_table: torch.Tensor) -> CheckpointMetadata:
    """``md`` for another GDN KV-cache group of the same step: the same plan and device tensors
    (and memo), its checkpoint blocks (``slots``, int64 [n]) gathered on the device from that
    group's ``block_table`` (int32 [R, columns]; on vLLM 0.33 one column per row, the blocks
    vLLM's own plan gathered). Used where the runner derives the other groups' metadata from the
    first group's (vLLM's V2 runner: ``GDNAttentionMetadataBuilder.update_block_table``)."""
    return dataclasses.replace(md, slots=block_table[md.rows, md.cols].long())


#: ``[key, fields]`` of the last plan uploaded: the step's other GDN KV-cache groups have the same
#: plan (their block tables differ) and reuse its device tensors and layer structures, so a step
#: uploads once. The tensors are never written, and the structures are the plan's alone, so a
#: later step with an equal plan may reuse them too.
_SHARED: list = [None, None]


def _upload(plan: StepPlan, method: str, to_device: ToDevice, kernel_meta: KernelMeta | None,
            rows: int, width: int, table_rows: Sequence[int] | None) -> dict:
    n, fused = len(plan.rows), method == "fused"
    # each checkpoint's index into the flattened table [rows * width], then the named blocks
    flat, named = [], 0
    for r, c in zip(plan.rows, plan.cols):
        if c >= width:
            flat.append(rows * width + named)
            named += 1
        else:
            flat.append((r if table_rows is None else table_rows[r]) * width + c)
    if fused and any(off % CHUNK for off in plan.offsets):
        raise ValueError(f"fused GDN checkpoint export: offsets {plan.offsets} are not all at a "
                         f"{CHUNK}-token chunk start (the declared alignment)")
    # every integer the step's export reads, in one upload: (field, part) -> values
    fields: dict[tuple[str, str], list[int]] = {
        (name, ""): list(getattr(plan, name))
        for name in ("rows", "cols", "conv_end", "chunk_index", "ckpt_seq")}
    if named < n:
        fields["flat", ""] = flat
    if fused:
        fields["chunk_map", ""], fields["chunk_starts", ""] = plan.chunk_map(), list(plan.chunk_starts)
    else:
        last = len(plan.rounds) - 1
        for k in range(last + 1):
            name = part(k)
            fields["bounds", name] = plan.round_bounds(k)
            if not plan.tails_are_suffix:
                fields["index", name] = plan.round_index(k)
            if k < last:
                fields["carry", name] = plan.carried(k)
            if k:
                fields["round_rows", name] = plan.round_rows(k)
        if last > 1:
            fields["order", ""] = plan.round_order()
    buf = to_device([v for values in fields.values() for v in values], torch.int64)
    dev, at = {}, 0
    for key, values in fields.items():
        dev[key], at = buf[at:at + len(values)], at + len(values)
    per_call = {f: {p: t for (g, p), t in dev.items() if g == f}
                for f in ("bounds", "index", "carry", "round_rows")}
    bounds = {p: (torch.tensor(fields["bounds", p], dtype=torch.int32), t.to(torch.int32))
              for p, t in per_call["bounds"].items()}
    return dict(
        **{name: dev[name, ""] for name in ("rows", "cols", "conv_end", "chunk_index", "ckpt_seq")},
        chunk_map=dev.get(("chunk_map", "")), chunk_starts=dev.get(("chunk_starts", "")),
        index={p: per_call["index"].get(p) for p in bounds},
        bounds={p: device for p, (_, device) in bounds.items()},
        kernel_meta={} if kernel_meta is None else {p: kernel_meta(*b) for p, b in bounds.items()},
        carry=per_call["carry"], round_rows=per_call["round_rows"], order=dev.get(("order", "")),
        named=named, flat=dev.get(("flat", "")), _plan_memo={})


def write_conv(conv_cache: torch.Tensor, mixed_qkv: torch.Tensor, md: CheckpointMetadata,
               width: int, dim_first: bool, rows: torch.Tensor | None = None) -> None:
    """Each checkpoint's conv state: the ``width - 1`` rows of ``mixed_qkv`` (the step's
    pre-convolution input [T, D]) before it, into its block of ``conv_cache`` ([blocks, D,
    width - 1 + k] when ``dim_first``, else [blocks, width - 1 + k, D]; ``k`` the speculative
    tokens, 0 without speculative decoding) in the cache dtype: one Triton launch where the method
    is ``fused`` (CUDA), else a gather and an index copy. Only the first ``width - 1`` time columns
    are written: a prefill's convolution reads and writes those, and leaves the other ``k`` as
    they were (vLLM's ``causal_conv1d_fn``, ``state_len = width - 1``). ``rows``: the split's
    batch indices of those input rows (int [n * (width - 1)], checkpoint-major) where the plan's
    token layout is not ``mixed_qkv``'s (a step with speculative decode rows); default
    ``md.conv_rows(width)``."""
    conv_cache = conv_cache[..., :width - 1] if dim_first else conv_cache[:, :width - 1]
    if md.method == "fused":
        if rows is not None:
            raise ValueError("write_conv: the fused method takes the plan's own token layout")
        from vllm_hybrid_npu.ops import _triton_gdn

        _triton_gdn.write_conv(conv_cache, mixed_qkv, md.conv_end, md.slots, width, dim_first,
                               kernels=None if mixed_qkv.is_cuda else _triton_gdn.interpreted())
        return
    with torch.profiler.record_function(PROFILE_RANGE + ".conv"):
        rows = mixed_qkv.index_select(0, md.conv_rows(width) if rows is None else rows)
        rows = rows.view(md.slots.numel(), width - 1, -1).to(conv_cache.dtype)
        conv_cache.index_copy_(0, md.slots, rows.transpose(1, 2) if dim_first else rows)


def run_split(run: Callable[..., tuple[torch.Tensor, torch.Tensor]], md: CheckpointMetadata,
              inputs: tuple[torch.Tensor, ...], initial_state: torch.Tensor,
              cache_dtype: torch.dtype, out: torch.Tensor | None = None):
    """A chunk kernel over the prefill rows, split at the checkpoints: one call per round of
    ``md.plan.rounds`` (two where no row has several checkpoints; ``K + 1`` for ``K`` in a row).
    ``run(inputs, initial_state, part) -> (o, final_state)`` is the backend's kernel on ``inputs``
    ([1, T, ...]: q, k, v, g, beta) laid out by the cu_seqlens of ``part`` (:func:`part`:
    ``"head"``, ``"tail"``, ``"round2"``, ...) from ``initial_state`` ([rows of that call, ...],
    the kernel's layout and dtype): round 0 from ``initial_state`` ([P, ...] per prefill row),
    round ``k + 1`` from the checkpoint states round ``k`` ended in, cast to ``cache_dtype`` and
    back (what vLLM's split's next step reads back from the SSM cache). With ``out`` (a
    contiguous [1, T, ...] tensor of ``v``'s shape and dtype) and tails that are a suffix (every
    round a slice), ``run(inputs, state, part, out_part)`` gets ``out``'s rows of that call (a
    contiguous view) and must write its output there (FLA's ``core_attn_out``): no concatenation
    copies ``o``. Returns ``o`` [1, T, ...] (``out`` where given) and ``final_state`` [P, ...] as
    one unsplit call returns them, and the checkpoint states [n, ...] (kernel layout, ``plan.rows``
    order) in ``cache_dtype``, the SSM cache's. Mirrors vLLM 0.30's align-mode split (one
    scheduler step per segment, ``Scheduler._mamba_block_aligned_split``) within one step."""
    plan = md.plan
    parts = [part(k) for k in range(len(plan.rounds))]
    if plan.tails_are_suffix:  # only the last prefill row has checkpoints: each round a slice
        # each round's tokens follow the previous round's (rows with no tokens after the last
        # one, a full graph's padding, add none)
        cuts = md.plan_memo("split-cuts", lambda: [0, *itertools.accumulate(
            plan.round_bounds(k)[-1] for k in range(len(plan.rounds)))])
    state, o_parts, finals, states = initial_state, [], [], []
    for k, name in enumerate(parts):
        if plan.tails_are_suffix:
            a, b = cuts[k], cuts[k + 1]
            xs = tuple(x[:, a:b] for x in inputs)
            o_k, final_k = run(xs, state, name) if out is None else run(xs, state, name, out[:, a:b])
        else:
            o_k, final_k = run(tuple(x.index_select(1, md.index[name]) for x in inputs), state, name)
        o_parts.append(o_k)
        finals.append(final_k)
        if k + 1 < len(parts):
            states.append(final_k.index_select(0, md.carry[name]).to(cache_dtype))
            state = states[-1].to(initial_state.dtype)  # as read back
    if plan.tails_are_suffix:
        o = out if out is not None else torch.cat(o_parts, dim=1)
    else:
        o = o_parts[0].new_empty((o_parts[0].shape[0], plan.num_prefill_tokens, *o_parts[0].shape[2:]))
        for name, o_k in zip(parts, o_parts):
            o.index_copy_(1, md.index[name], o_k)
    final = finals[0]
    for name, final_k in zip(parts[1:], finals[1:]):  # a row's last round holds its final state
        final = final.index_copy(0, md.round_rows[name], final_k.to(final.dtype))
    ckpt = states[0] if len(states) == 1 else torch.cat(states).index_select(0, md.order)
    return o, final, ckpt


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
