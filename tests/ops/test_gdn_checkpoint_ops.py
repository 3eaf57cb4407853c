"""``vllm_hybrid_npu.ops.gdn_checkpoint``: the split kernel call, the state writes, the scope.

:func:`run_split` is run around a reference chunk kernel (a token-by-token gated delta rule over
cu_seqlens, float64 arithmetic): with a float64 cache the split is the same sequence of float64
operations as one unsplit call, so outputs and final states are **equal**, and each checkpoint
equals the final state of the row's head run alone; with a bf16 cache the checkpoint is that state
rounded to bf16 and the tail's outputs equal a run of the tail alone from the rounded state (what
vLLM's split computes in its next step). Random batches (rows, lengths, checkpoints; the suffix
layout and the gathered one), seed printed on failure. The writes are checked on poisoned caches,
the conv write by both methods (``fused``: our Triton kernel, in the interpreter on CPU), also on a
conv state ``width - 1 + k`` wide (speculative decoding: only the first ``width - 1`` columns are
written) and, for a plan in another token layout than the input's, through a token map.

Rows with several checkpoints (a shared-prefix junction before the prompt's own; issue 38): the
split runs one call per round (``K + 1`` for ``K`` checkpoints in a row), each round from the
previous round's checkpoints as read back; compared with the same reference kernel run segment by
segment, row by row (vLLM's ``K + 1``-step split), exactly, in float64 and in bf16.
"""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from vllm_hybrid_npu.core.prefill_checkpoints import plan_step  # noqa: E402
from vllm_hybrid_npu.ops import gdn_checkpoint as ops  # noqa: E402

H, K, V = 2, 3, 4


def kernel(q, k, v, g, beta, state, cu):
    """Reference: o [1, T, H, V], final [N, H, K, V] float64 from state [N, H, K, V]."""
    S = state.double().clone()
    o = torch.zeros(1, q.shape[1], H, V, dtype=torch.float64)
    cu = [int(c) for c in cu]
    for n, (s, e) in enumerate(zip(cu, cu[1:])):
        for t in range(s, e):
            kt, qt = k[0, t].double(), q[0, t].double()
            S[n] = S[n] * torch.exp(g[0, t].double())[:, None, None]
            err = v[0, t].double() - torch.einsum("hk,hkv->hv", kt, S[n])
            S[n] = S[n] + torch.einsum("hk,hv->hkv", kt, err * beta[0, t].double()[:, None])
            o[0, t] = torch.einsum("hk,hkv->hv", qt, S[n])
    return o, S


def _batch(rng, gen, suffix):
    rows = rng.randint(1, 4)
    lens = [rng.randint(2, 40) for _ in range(rows)]
    offsets = [0] * rows
    ck = [rows - 1] if suffix else rng.sample(range(rows), rng.randint(1, rows))
    for r in ck:
        offsets[r] = rng.randint(1, lens[r] - 1)
    # zero-length rows after them (vllm-ascend keeps a full graph's padded rows among its prefill
    # rows, with no tokens): the tails stay a suffix
    zeros = rng.randint(0, 2)
    lens, offsets = lens + [0] * zeros, offsets + [0] * zeros
    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    plan = plan_step(qsl, offsets, list(range(rows + zeros)), num_decodes=0)
    t = qsl[-1]
    inputs = (torch.randn(1, t, H, K, generator=gen), torch.randn(1, t, H, K, generator=gen) * 0.3,
              torch.randn(1, t, H, V, generator=gen), -torch.rand(1, t, H, generator=gen) * 0.2,
              torch.rand(1, t, H, generator=gen))
    return plan, qsl, inputs


def _metadata(plan, blocks):
    table = torch.arange(blocks, dtype=torch.int32).view(1, -1).expand(len(plan.head_spans), -1)
    table = table + 100 * torch.arange(len(plan.head_spans), dtype=torch.int32)[:, None]
    return ops.build_metadata(plan, table, lambda v, d: torch.tensor(v, dtype=d))


def _run(md):
    bounds = {ops.part(k): md.plan.round_bounds(k) for k in range(len(md.plan.rounds))}
    return lambda inputs, state, part: kernel(*inputs, state, bounds[part])


@pytest.mark.parametrize("suffix", [True, False])
def test_split_equals_one_call_in_float64(rng, torch_gen, seed, suffix):
    for _ in range(4):
        plan, qsl, inputs = _batch(rng, torch_gen, suffix)
        md = _metadata(plan, 8)
        assert md.plan.tails_are_suffix or not suffix
        state0 = torch.randn(len(qsl) - 1, H, K, V, generator=torch_gen, dtype=torch.float64)
        o, final, ckpt = ops.run_split(_run(md), md, inputs, state0, torch.float64)
        o_ref, final_ref = kernel(*inputs, state0, qsl)
        where = f"seed={seed} qsl={qsl} offsets={plan.offsets} rows={plan.rows}"
        assert torch.equal(o, o_ref) and torch.equal(final, final_ref), where
        for i, row in enumerate(plan.rows):
            s = qsl[row]
            head = tuple(x[:, s:s + plan.offsets[i]] for x in inputs)
            _, alone = kernel(*head, state0[row:row + 1], [0, plan.offsets[i]])
            assert torch.equal(ckpt[i], alone[0]), where


def test_split_with_a_bf16_cache_is_vllms_split(rng, torch_gen, seed):
    plan, qsl, inputs = _batch(rng, torch_gen, suffix=rng.random() < 0.5)
    md = _metadata(plan, 8)
    state0 = (torch.randn(len(qsl) - 1, H, K, V, generator=torch_gen) * 0.5).to(torch.bfloat16)
    o, final, ckpt = ops.run_split(_run(md), md, inputs, state0, torch.bfloat16)
    o_ref, final_ref = kernel(*inputs, state0, qsl)
    assert ckpt.dtype == torch.bfloat16
    where = f"seed={seed} qsl={qsl} offsets={plan.offsets}"
    for i, row in enumerate(plan.rows):
        s, cut, e = qsl[row], qsl[row] + plan.offsets[i], qsl[row + 1]
        head = tuple(x[:, s:cut] for x in inputs)
        o_head, alone = kernel(*head, state0[row:row + 1], [0, cut - s])
        stored = alone.to(torch.bfloat16)  # what vLLM's split caches at the checkpoint
        assert torch.equal(ckpt[i], stored[0]), where
        o_tail, fin = kernel(*(x[:, cut:e] for x in inputs), stored, [0, e - cut])
        assert torch.equal(o[:, s:cut], o_head) and torch.equal(o[:, cut:e], o_tail), where
        assert torch.equal(final[row], fin[0]), where
    for row in set(range(len(qsl) - 1)) - set(plan.rows):
        assert torch.equal(o[:, qsl[row]:qsl[row + 1]], o_ref[:, qsl[row]:qsl[row + 1]]), where
        assert torch.equal(final[row], final_ref[row]), where


@pytest.mark.parametrize("method", ["split", "fused"])  # fused: the Triton kernel (interpreter)
@pytest.mark.parametrize("dim_first", [True, False])
def test_writes_touch_only_the_checkpoint_blocks(rng, torch_gen, seed, dim_first, method):
    if method == "fused":
        pytest.importorskip("triton")
    width, dim, blocks = rng.choice([2, 3, 4]), rng.randint(3, 20), rng.randint(8, 12)
    rows = rng.randint(1, 4)
    if method == "fused":  # its checkpoints start a 64-token chunk
        lens = [rng.randint(65, 200) for _ in range(rows)]
        offsets = [64 * rng.randint(0, (n - 1) // 64) for n in lens]
        offsets[rng.randrange(rows)] = 64
    else:
        lens = [rng.randint(width + 2, 40) for _ in range(rows)]
        offsets = [rng.choice([0, rng.randint(width, n - 1)]) for n in lens]
        offsets[rng.randrange(rows)] = width  # at least one checkpoint, the closest vLLM allows
    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    plan = plan_step(qsl, offsets, [0] * rows, num_decodes=0)
    # one distinct block per row (column 0 of its table row)
    table = torch.tensor([[b] for b in rng.sample(range(blocks), rows)], dtype=torch.int32)
    md = ops.build_metadata(plan, table, lambda v, d: torch.tensor(v, dtype=d), method)
    dtype = rng.choice([torch.float32, torch.bfloat16])
    # the model's dtype is the conv cache's (the interpreter would truncate a float32 -> bf16 cast)
    mixed = torch.randn(qsl[-1], dim, generator=torch_gen).to(dtype if method == "fused" else torch.float32)
    # under speculative decoding (k > 0) the conv state is width - 1 + k wide
    span = width - 1 + rng.randint(0, 3)
    conv = torch.full((blocks, dim, span) if dim_first else (blocks, span, dim),
                      float("nan"), dtype=dtype)
    ops.write_conv(conv, mixed, md, width, dim_first)
    slots = md.slots.tolist()
    assert slots == [table[r, 0].item() for r in plan.rows]
    time_first = conv.transpose(1, 2) if dim_first else conv  # [blocks, span, dim]
    for end, slot in zip(plan.conv_end, slots):
        got = time_first[slot, :width - 1]
        assert torch.equal(got, mixed[end - width + 1:end].to(dtype)), f"seed={seed}, span {span}"
    # the other k columns: a prefill leaves them as they were
    assert torch.isnan(time_first[:, width - 1:].float()).all(), f"seed={seed}, span {span}"
    assert md.conv_rows(width) is md.conv_rows(width)
    ssm = torch.full((blocks, H, V, K), float("nan"), dtype=dtype)
    states = torch.randn(len(slots), H, V, K, generator=torch_gen, dtype=torch.float64)
    scope = ops.ExportScope(md, ssm, "split")
    scope.write(states)
    assert scope.exports == 1
    for i, slot in enumerate(slots):
        assert torch.equal(ssm[slot], states[i].to(dtype)), f"seed={seed}"
    untouched = sorted(set(range(blocks)) - set(slots))
    assert torch.isnan(conv[untouched].float()).all() and torch.isnan(ssm[untouched].float()).all()


@pytest.mark.parametrize("dim_first", [True, False])
def test_conv_rows_through_a_token_map(rng, torch_gen, seed, dim_first):
    """A plan in another token layout than the step's input (the non-speculative rows of a step
    with speculative decode rows): ``rows``, the map's entries at the plan's conv rows, gives the
    bytes of the input laid out as the plan."""
    width, dim, blocks, rows = rng.choice([2, 3, 4]), rng.randint(3, 20), 8, rng.randint(1, 4)
    lens = [rng.randint(width + 2, 40) for _ in range(rows)]
    offsets = [rng.choice([0, rng.randint(width, n - 1)]) for n in lens]
    offsets[rng.randrange(rows)] = width
    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    plan = plan_step(qsl, offsets, [0] * rows, num_decodes=0)
    table = torch.tensor([[b] for b in rng.sample(range(blocks), rows)], dtype=torch.int32)
    md = ops.build_metadata(plan, table, lambda v, d: torch.tensor(v, dtype=d))
    # the step's input: the plan's tokens at the map's positions among others
    batch = qsl[-1] + rng.randint(1, 20)
    index = torch.randperm(batch, generator=torch_gen)[:qsl[-1]].sort().values
    mixed = torch.randn(batch, dim, generator=torch_gen)
    shape = (blocks, dim, width - 1) if dim_first else (blocks, width - 1, dim)
    got, want = torch.zeros(shape), torch.zeros(shape)
    ops.write_conv(got, mixed, md, width, dim_first, index.index_select(0, md.conv_rows(width)))
    ops.write_conv(want, mixed[index], md, width, dim_first)
    assert torch.equal(got, want) and got.abs().sum() > 0, f"seed={seed}"
    fused = dataclasses.replace(md, method="fused")
    with pytest.raises(ValueError, match="own token layout"):
        ops.write_conv(got, mixed, fused, width, dim_first, index)


def test_scope():
    md = object()
    assert ops.current("split") is None
    with ops.exporting(md, "cache", "fused") as scope:
        assert ops.current("fused") is scope and ops.current("split") is None
    assert ops.current("fused") is None
    with pytest.raises(ValueError, match="method"):
        with ops.exporting(md, "cache", "other"):
            pass


def test_fused_metadata_is_one_upload(monkeypatch):
    """Hand-counted: rows of 130, 64 (a decode-free batch), 200 and 5 tokens; checkpoints at 64
    in row 0 and 128 in row 2. Chunks of 64: 3, 1, 4, 1 -> starts 0, 3, 4, 8, 9 in all; the
    checkpoints start chunks 0 + 1 = 1 and 4 + 2 = 6. A second KV-cache group (another block
    table) of the same step uploads nothing; another plan uploads again."""
    monkeypatch.setattr(ops, "_SHARED", [None, None])
    qsl = [0, 130, 194, 394, 399]
    plan = plan_step(qsl, [64, 0, 128, 0], [2, 0, 5, 0], num_decodes=0)
    table = torch.arange(40, dtype=torch.int32).view(4, 10)
    uploads = []
    up = lambda v, d: uploads.append((v, d)) or torch.tensor(v, dtype=d)  # noqa: E731
    md = ops.build_metadata(plan, table, up, "fused")
    assert len(uploads) == 1 and uploads[0][1] == torch.int64  # the step's one upload
    other = ops.build_metadata(plan_step(qsl, [64, 0, 128, 0], [2, 0, 5, 0], num_decodes=0),
                               table + 100, up, "fused")
    assert len(uploads) == 1 and other.slots.tolist() == [102, 125] and other.chunk_map is md.chunk_map
    ops.build_metadata(plan_step(qsl, [0, 0, 128, 0], [0, 0, 5, 0], num_decodes=0), table, up, "fused")
    assert len(uploads) == 2
    assert md.chunk_map.tolist() == [-1, 0, -1, -1, -1, -1, 1, -1, -1]
    assert md.chunk_starts.tolist() == [0, 3, 4, 8] and plan.num_chunks == 9
    assert md.slots.tolist() == [2, 25] and md.conv_end.tolist() == [64, 322]
    assert md.bounds == {} and md.index == {} and md.kernel_meta == {}
    split = ops.build_metadata(plan, table, lambda v, d: torch.tensor(v, dtype=d), "split")
    assert split.chunk_map is None and split.bounds["head"].tolist() == [0, 64, 128, 256, 261]
    off_grid = plan_step(qsl, [65, 0, 0, 0], [2, 0, 0, 0], num_decodes=0)
    with pytest.raises(ValueError, match="64-token chunk"):
        ops.build_metadata(off_grid, table, lambda v, d: torch.tensor(v, dtype=d), "fused")


# ----------------------------------------------------------------- several checkpoints in a row
def _several(rng, gen, suffix):
    """A batch in which some row has two or three checkpoints (by construction: that row has at
    least 4 tokens and draws 2-3 distinct offsets); with ``suffix`` only the last row has any,
    else that row is not the last (so its tail ends before the step's last token: not a suffix).
    The last offset of a row is its prompt checkpoint, the others its junctions (``plan_step``'s
    ``junctions``); columns distinct. Returns ``(plan, qsl, inputs, cuts)``, ``cuts`` per row its
    sorted offsets."""
    rows = rng.randint(1 if suffix else 2, 4)
    lens = [rng.randint(2, 40) for _ in range(rows)]
    several = rows - 1 if suffix else rng.randrange(rows - 1)
    lens[several] = rng.randint(4, 40)
    cuts = [[] for _ in range(rows)]
    for r in range(rows):
        if r == several:
            cuts[r] = sorted(rng.sample(range(1, lens[r]), rng.randint(2, min(3, lens[r] - 1))))
        elif not suffix and rng.random() < 0.5:
            cuts[r] = sorted(rng.sample(range(1, lens[r]), rng.randint(1, min(3, lens[r] - 1))))
    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    offsets = [c[-1] if c else 0 for c in cuts]
    cols = [10 * r + len(c) for r, c in enumerate(cuts)]
    junctions = {r: [(o, 10 * r + j) for j, o in enumerate(c[:-1])] for r, c in enumerate(cuts) if len(c) > 1}
    plan = plan_step(qsl, offsets, cols, num_decodes=0, junctions=junctions)
    t = qsl[-1]
    inputs = (torch.randn(1, t, H, K, generator=gen), torch.randn(1, t, H, K, generator=gen) * 0.3,
              torch.randn(1, t, H, V, generator=gen), -torch.rand(1, t, H, generator=gen) * 0.2,
              torch.rand(1, t, H, generator=gen))
    return plan, qsl, inputs, cuts


def _segmented(inputs, state0, qsl, cuts, dtype):
    """vLLM's split row by row: each segment of a row a kernel call of its own from the state the
    previous one left, rounded to the cache ``dtype`` (what the next step reads back). Returns o
    [1, T, H, V], final [N, ...] and per row the rounded states at its cuts."""
    o = torch.zeros(1, qsl[-1], H, V, dtype=torch.float64)
    finals, stored = [], []
    for r, (s, e) in enumerate(zip(qsl, qsl[1:])):
        state, edges, row = state0[r:r + 1], [0, *cuts[r], e - s], []
        for a, b in zip(edges, edges[1:]):
            o_seg, state = kernel(*(x[:, s + a:s + b] for x in inputs), state, [0, b - a])
            o[:, s + a:s + b] = o_seg
            if b < e - s:
                state = state.to(dtype)
                row.append(state[0])
        finals.append(state[0])
        stored.append(row)
    return o, torch.stack(finals), stored


@pytest.mark.parametrize("suffix", [True, False])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["float64", "bf16"])
def test_rounds_equal_the_split_step_by_step(rng, torch_gen, seed, suffix, dtype):
    """``K + 1`` rounds: each call's cu_seqlens and initial states those of the round (round
    ``k + 1`` from round ``k``'s checkpoints as read back), the checkpoints (in ``plan.rows``
    order) the states vLLM's split stores at each cut, outputs and final states those of its last
    step; in float64 also those of one unsplit call."""
    for _ in range(3):
        plan, qsl, inputs, cuts = _several(rng, torch_gen, suffix)
        where = f"seed={seed} qsl={qsl} cuts={cuts}"
        assert plan.several_per_row and plan.tails_are_suffix == suffix, where
        md = _metadata(plan, 40)
        state0 = (torch.randn(len(qsl) - 1, H, K, V, generator=torch_gen) * 0.5).to(dtype)
        calls = []

        def run(xs, state, part):
            calls.append((part, state.clone()))
            return _run(md)(xs, state, part)

        o, final, ckpt = ops.run_split(run, md, inputs, state0, dtype)
        o_ref, final_ref, stored = _segmented(inputs, state0, qsl, cuts, dtype)
        k_max = max(len(c) for c in cuts)
        assert [p for p, _ in calls] == [ops.part(k) for k in range(k_max + 1)], where
        assert ckpt.dtype == dtype and ckpt.shape[0] == sum(len(c) for c in cuts), where
        # round k's rows and initial states: the rows with at least k cuts, from their k-th state
        for k, (_, state) in enumerate(calls):
            rows = [r for r, c in enumerate(cuts) if len(c) >= k]
            want = state0[rows] if k == 0 else torch.stack([stored[r][k - 1] for r in rows])
            assert torch.equal(state, want), (where, k)
            assert md.bounds[ops.part(k)].tolist() == plan.round_bounds(k), where
        i = 0
        for r, c in enumerate(cuts):  # plan.rows order: by row, then by offset
            for j in range(len(c)):
                assert plan.rows[i] == r and plan.offsets[i] == c[j], where
                assert torch.equal(ckpt[i], stored[r][j]), (where, r, j)
                i += 1
        assert torch.equal(o, o_ref) and torch.equal(final, final_ref), where
        if dtype == torch.float64:  # the split changes nothing in float64
            o_one, final_one = kernel(*inputs, state0, qsl)
            assert torch.equal(o, o_one) and torch.equal(final, final_one), where


def test_rounds_write_into_out_without_a_copy(rng, torch_gen, seed):
    """The suffix layout with ``out``: every round's call gets ``out``'s rows of its slice (a
    view, in round order, end to end) and ``o`` is ``out`` itself."""
    plan, qsl, inputs, cuts = _several(rng, torch_gen, suffix=True)
    md = _metadata(plan, 40)
    out = torch.empty(1, qsl[-1], H, V, dtype=torch.float64)
    seen = []

    def run(xs, state, part, o_part):
        o_k, final_k = _run(md)(xs, state, part)
        assert o_part.data_ptr() == out[:, sum(n for _, n in seen):].data_ptr(), f"seed={seed}"
        o_part.copy_(o_k)
        seen.append((part, o_k.shape[1]))
        return o_k, final_k

    state0 = torch.randn(len(qsl) - 1, H, K, V, generator=torch_gen, dtype=torch.float64)
    o, final, _ = ops.run_split(run, md, inputs, state0, torch.float64, out)
    assert o is out and sum(n for _, n in seen) == qsl[-1] and len(seen) == len(cuts[-1]) + 1
    o_ref, final_ref = kernel(*inputs, state0, qsl)
    assert torch.equal(o, o_ref) and torch.equal(final, final_ref), f"seed={seed}"


def test_split_metadata_is_one_upload(rng, torch_gen, monkeypatch):
    """The split's integers (checkpoint fields, per round its cu_seqlens, token indices, carried
    and continuing rows, the checkpoint order): one int64 upload per step; the cu_seqlens int32
    on the device, equal to the host copy ``kernel_meta`` gets."""
    monkeypatch.setattr(ops, "_SHARED", [None, None])
    for suffix in (True, False):
        plan, qsl, _, cuts = _several(rng, torch_gen, suffix)
        uploads, metas = [], []
        up = lambda v, d: uploads.append(d) or torch.tensor(v, dtype=d)  # noqa: E731
        md = ops.build_metadata(plan, torch.arange(400, dtype=torch.int32).view(4, 100)[:len(qsl) - 1],
                                up, "split", lambda h, d: metas.append((h, d)) or len(metas))
        assert uploads == [torch.int64], (qsl, cuts)
        assert len(metas) == len(plan.rounds) == max(len(c) for c in cuts) + 1
        for k, (host, dev) in enumerate(metas):
            assert host.dtype == dev.dtype == torch.int32 and torch.equal(host, dev)
            assert md.kernel_meta[ops.part(k)] == k + 1 and md.bounds[ops.part(k)] is dev
        assert all(v is None for v in md.index.values()) == suffix
