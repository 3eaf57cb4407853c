"""The one-pass export's kernels (:mod:`vllm_hybrid_npu.ops._triton_gdn`) in the Triton
interpreter on CPU tensors (the same kernels run compiled on CUDA in
``tests/ops/test_gdn_checkpoint_fla.py``, against vLLM's own FLA kernel bit for bit).

The interpreter stores bfloat16 as raw 16-bit integers and its ``tl.dot`` multiplies those as
integers, and it truncates float32 to bfloat16 where the GPU rounds to nearest even: so here the
inputs are float32 or float16 (numpy's own types), never bfloat16. On random variable-length
batches (seed printed on failure):

* ``h``, ``v_new`` and the final state follow the chunked gated delta rule (a float64 reference of
  the same chunk arithmetic; float32 inputs: relative error at most 1.3e-7 over 30 draws on
  2026-11-28, asserted under 1e-5);
* each checkpoint block holds the running state at its chunk start, in the cache's dtype: equal to
  ``h`` there (float32 inputs: ``h`` is float32) and to the final state of a run of the row's
  head alone (what vLLM's split stores); several checkpoints in one row; a cache whose blocks are
  padded (vLLM's page padding: a block stride larger than the state); every other block untouched;
* the outputs with checkpoints are the outputs without, bit for bit;
* float16 inputs with a float32 cache: the checkpoint rounded to float16 is ``h`` there.
* an empty row among the rows changes nothing for the others and keeps its initial state;
* a step's plan with several checkpoints per row (shared-prefix junctions before the prompt's
  own, decode rows first: ``core.plan_step`` -> ``ops.build_metadata`` fused ->
  ``ExportScope.chunk_states`` and ``ops.write_conv``): each SSM block is the final state of the
  row's head run alone, in the cache dtype, each conv block the input rows before it (issue 38
  item 2, the CUDA path's junctions).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from vllm_hybrid_npu.ops import _triton_gdn as tg  # noqa: E402

CHUNK = tg.CHUNK


@pytest.fixture(scope="module")
def kernels():
    return tg.interpreted()


def _draw(rng, gen, dtype, long_first=False):
    """Rows of 1 to 296 tokens (shorter than a chunk, whole chunks, a partial last chunk); with
    ``long_first`` the first row has at least two chunks (room for a checkpoint)."""
    heads, hg = 2, rng.choice([1, 2])
    kd, vd = rng.choice([64, 128]), rng.choice([32, 64, 96])
    lens = [rng.choice([rng.randint(1, CHUNK), CHUNK * rng.randint(1, 4), rng.randint(CHUNK + 1, 4 * CHUNK + 40)])
            for _ in range(rng.randint(1, 3))]
    if long_first:
        lens[0] = rng.choice([CHUNK * rng.randint(2, 4), rng.randint(CHUNK + 1, 4 * CHUNK + 40)])
    t = sum(lens)
    k = torch.nn.functional.normalize(torch.randn(1, t, hg, kd, generator=gen), dim=-1).to(dtype)
    w = (torch.randn(1, t, heads, kd, generator=gen) * 0.1).to(dtype)
    u = torch.randn(1, t, heads, vd, generator=gen).to(dtype)
    g = -torch.rand(1, t, heads, generator=gen) * 0.1
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    for s, e in zip(cu, cu[1:]):  # chunk-local cumulative gates, as FLA's chunk_local_cumsum gives
        for c in range(s, e, CHUNK):
            g[0, c:min(c + CHUNK, e)] = g[0, c:min(c + CHUNK, e)].cumsum(0)
    h0 = None if rng.random() < 0.25 else torch.randn(len(lens), heads, vd, kd, generator=gen) * 0.1
    return lens, cu, (k, w, u, g), h0


def _chunks(lens):
    return [-(-n // CHUNK) for n in lens]


def _run(kernels, inputs, h0, cu, lens, checkpoints=(), cache=None, bv=32):
    """Our kernel; ``checkpoints``: (global chunk, slot) pairs."""
    nch = _chunks(lens)
    offsets = torch.tensor([0, *torch.tensor(nch).cumsum(0).tolist()][:-1], dtype=torch.int64)
    cmap = torch.full((sum(nch),), -1, dtype=torch.int64)
    for i, (c, _) in enumerate(checkpoints):
        cmap[c] = i
    slots = torch.tensor([s for _, s in checkpoints] or [0], dtype=torch.int64)
    if cache is None:
        cache = torch.zeros(1, inputs[2].shape[-2], inputs[2].shape[-1], inputs[0].shape[-1])
    return tg.chunk_states(*inputs, h0, True, torch.tensor(cu, dtype=torch.int32), offsets,
                           sum(nch), cmap, slots, cache, bv=bv, kernels=kernels)


def _reference(inputs, h0, cu):
    """float64: the chunk recurrence of vLLM's FLA kernel (state at each chunk start, then
    v_new = u - w h^T, the gates' decay, h += (k^T v_new_gated)^T)."""
    k, w, u, g = (x[0].double() for x in inputs)
    heads, vd, kd = u.shape[1], u.shape[2], k.shape[2]
    rep = heads // k.shape[1]
    hs, v_new, finals = [], torch.empty_like(u), []
    for n, (s, e) in enumerate(zip(cu, cu[1:])):
        b = torch.zeros(heads, vd, kd, dtype=torch.float64) if h0 is None else h0[n].double()
        for c in range(s, e, CHUNK):
            d = min(c + CHUNK, e)
            hs.append(b.clone())
            kk = k[c:d].repeat_interleave(rep, dim=1)
            vn = u[c:d] - torch.einsum("thk,hvk->thv", w[c:d], b)
            v_new[c:d] = vn
            gl, gg = g[d - 1], g[c:d]
            vn = vn * torch.exp(gl - gg)[:, :, None]
            b = b * torch.exp(gl)[:, None, None] + torch.einsum("thk,thv->hvk", kk, vn)
        finals.append(b)
    return torch.stack(hs), v_new, torch.stack(finals)


def _rel(a, b):
    return ((a.double() - b).norm() / b.norm().clamp_min(1e-30)).item()


def test_states_follow_the_chunked_delta_rule(kernels, rng, torch_gen, seed):
    lens, cu, inputs, h0 = _draw(rng, torch_gen, torch.float32)
    h, v_new, final = _run(kernels, inputs, h0, cu, lens)
    rh, rv, rf = _reference(inputs, h0, cu)
    where = f"seed={seed} lens={lens} shapes={[tuple(x.shape) for x in inputs]}"
    assert h.shape == (1, sum(_chunks(lens)), *rh.shape[1:]) and h.dtype == torch.float32, where
    for name, got, ref in (("h", h[0], rh), ("v_new", v_new[0], rv), ("final", final, rf)):
        assert torch.isfinite(got).all() and _rel(got, ref) < 1e-5, f"{where}: {name} {_rel(got, ref):.3g}"


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_checkpoints_are_the_running_state(kernels, rng, torch_gen, seed, cache_dtype):
    lens, cu, inputs, h0 = _draw(rng, torch_gen, torch.float32, long_first=True)
    nch, first = _chunks(lens), [0, *torch.tensor(_chunks(lens)).cumsum(0).tolist()]
    # per row 0-2 checkpoints at chunk starts after its first chunk (offsets > 0, < its length);
    # the first row at least one
    picks = [(r, c) for r, n in enumerate(nch)
             for c in sorted(rng.sample(range(1, n), min(n - 1, rng.randint(int(r == 0), 2))))]
    blocks = rng.randint(len(picks) + 2, 2 * len(picks) + 4)
    slots = rng.sample(range(blocks), len(picks))
    heads, vd, kd = inputs[2].shape[-2], inputs[2].shape[-1], inputs[0].shape[-1]
    pad = rng.choice([0, 7])  # vLLM pads a hybrid page: the block stride can exceed the state
    raw = torch.full((blocks, heads * vd * kd + pad), float("nan"), dtype=cache_dtype)
    cache = raw[:, :heads * vd * kd].view(blocks, heads, vd, kd)
    checkpoints = [(first[r] + c, s) for (r, c), s in zip(picks, slots)]
    h, v_new, final = _run(kernels, inputs, h0, cu, lens, checkpoints, cache)
    where = f"seed={seed} lens={lens} checkpoints(row, chunk)={picks} slots={slots}"
    plain = _run(kernels, inputs, h0, cu, lens)
    assert all(torch.equal(a, b) for a, b in zip((h, v_new, final), plain)), f"{where}: outputs changed"
    for (row, c), (gc, slot) in zip(picks, checkpoints):
        assert torch.equal(cache[slot], h[0, gc].to(cache_dtype)), f"{where}: slot {slot} is not h"
        s = cu[row]
        head = tuple(x[:, s:s + c * CHUNK] for x in inputs)
        _, _, alone = _run(kernels, head, None if h0 is None else h0[row:row + 1], [0, c * CHUNK], [c * CHUNK])
        assert torch.equal(cache[slot], alone[0].to(cache_dtype)), f"{where}: slot {slot} is not the head's state"
    untouched = sorted(set(range(blocks)) - set(slots))
    assert torch.isnan(raw[untouched].float()).all() and torch.isnan(raw[:, heads * vd * kd:].float()).all(), \
        f"{where}: a byte outside the checkpoint states changed"


def test_float16_inputs_checkpoint_rounds_to_h(kernels, rng, torch_gen, seed):
    lens, cu, inputs, h0 = _draw(rng, torch_gen, torch.float16, long_first=True)
    c = rng.randint(1, _chunks(lens)[0] - 1)
    heads, vd, kd = inputs[2].shape[-2], inputs[2].shape[-1], inputs[0].shape[-1]
    cache = torch.full((3, heads, vd, kd), float("nan"))
    h, _, _ = _run(kernels, inputs, h0, cu, lens, [(c, 1)], cache)
    assert h.dtype == torch.float16 and torch.equal(cache[1].half(), h[0, c]), f"seed={seed} lens={lens} c={c}"
    assert torch.isnan(cache[[0, 2]]).all()


def test_an_empty_row_changes_nothing(kernels, rng, torch_gen, seed):
    """A row of no tokens (``cu_seqlens`` repeating a value; no chunk of its own, its chunk
    offset the next row's first chunk, or the end) among the rows, with a checkpoint in another
    row: every other row's ``h``, ``v_new``, final state and checkpoint are those of the run
    without it, and the empty row's final state is its initial state (zeros without one)."""
    lens, cu, inputs, h0 = _draw(rng, torch_gen, torch.float32, long_first=True)
    at = rng.randint(0, len(lens))  # where the empty row goes: first, between rows, or last
    lens_e = lens[:at] + [0] + lens[at:]
    cu_e = cu[:at + 1] + cu[at:]
    h0_e = None if h0 is None else torch.cat([h0[:at], torch.randn(1, *h0.shape[1:], generator=torch_gen),
                                                h0[at:]])
    where = f"seed={seed} lens={lens_e}"
    cache, cache_e = (torch.full((3, *inputs[2].shape[-2:], inputs[0].shape[-1]), float("nan"))
                      for _ in range(2))
    chunk = 1  # the first row has at least two chunks: its second chunk's start state into slot 2
    h, v_new, final = _run(kernels, inputs, h0, cu, lens, [(chunk, 2)], cache)
    h_e, v_e, final_e = _run(kernels, inputs, h0_e, cu_e, lens_e, [(chunk, 2)], cache_e)
    assert torch.equal(h_e, h) and torch.equal(v_e, v_new), where
    keep = [i for i in range(len(lens_e)) if i != at]
    assert torch.equal(final_e[keep], final), where
    empty = torch.zeros_like(final[0]) if h0_e is None else h0_e[at]
    assert torch.equal(final_e[at], empty), where
    assert torch.equal(cache_e[2], cache[2]) and torch.isnan(cache_e[:2]).all(), where


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_plan_with_several_checkpoints_per_row(kernels, rng, torch_gen, seed, cache_dtype):
    """The fused export as the CUDA path runs it for a step with shared-prefix junctions (issue 38
    item 2): ``core.plan_step`` with junctions (decode rows first, then prefill rows with up to
    three checkpoints each: junctions and the prompt's own), ``ops.build_metadata`` (method
    ``fused``: ``chunk_map`` one checkpoint per chunk start, the blocks gathered from a block
    table), ``ExportScope.chunk_states`` and ``ops.write_conv`` through the interpreter. Each
    checkpoint's SSM block holds the final state of a run of the row's tokens up to it alone (what
    a pass that stops there stores, cast to the cache dtype; exact by construction: the same
    recurrence), every conv block the ``width - 1`` input rows before it; the outputs are the run
    without checkpoints; every other block is untouched; one export counted."""
    from vllm_hybrid_npu.core.prefill_checkpoints import plan_step
    from vllm_hybrid_npu.ops import gdn_checkpoint as ops

    lens = [0]
    while _chunks(lens)[0] < 3:  # room for a junction and the prompt's own in the first row
        lens, cu, inputs, h0 = _draw(rng, torch_gen, torch.float32, long_first=True)
    decodes = rng.randint(0, 2)
    qsl = [*range(decodes + 1), *(decodes + c for c in cu[1:])]
    # per prefill row 0-3 checkpoints at chunk starts after its first chunk (the first row >= 2
    # where it has room): the last the prompt's own (offsets, cols), the others junctions
    picks = {r: sorted(rng.sample(range(1, n), min(n - 1, rng.randint(2 if r == 0 else 0, 3))))
             for r, n in enumerate(_chunks(lens))}
    offsets, cols, junctions, width = [0] * decodes, [-1] * decodes, {}, rng.choice([2, 4])
    for r, chunks in picks.items():
        offsets.append(chunks[-1] * CHUNK if chunks else 0)
        cols.append(len(chunks) - 1 if chunks else -1)
        if len(chunks) > 1:
            junctions[decodes + r] = [(c * CHUNK, i) for i, c in enumerate(chunks[:-1])]
    plan = plan_step(qsl, offsets, cols, decodes, junctions=junctions)
    n = len(plan.rows)
    blocks = n + rng.randint(2, 6)
    table = torch.zeros(decodes + len(lens), 3, dtype=torch.int32)
    slots = rng.sample(range(blocks), n)
    for i, (row, col) in enumerate(zip(plan.rows, plan.cols)):
        table[row, col] = slots[i]
    md = ops.build_metadata(plan, table, lambda v, d: torch.tensor(v, dtype=d), "fused")
    where = f"seed={seed} decodes={decodes} lens={lens} checkpoints(row, chunk)={picks} slots={slots}"
    assert md.slots.tolist() == slots and plan.several_per_row, where
    heads, vd, kd = inputs[2].shape[-2], inputs[2].shape[-1], inputs[0].shape[-1]
    ssm = torch.full((blocks, heads, vd, kd), float("nan"), dtype=cache_dtype)
    with ops.exporting(md, ssm, "fused") as scope:
        got = scope.chunk_states(*inputs, h0, True, torch.tensor(cu, dtype=torch.int32), {"bv": 32})
    assert scope.exports == 1, where
    plain = _run(kernels, inputs, h0, cu, lens)
    assert all(torch.equal(a, b) for a, b in zip(got, plain)), f"{where}: outputs changed"
    for i, (row, off) in enumerate(zip(plan.ckpt_seq, plan.offsets)):
        s = cu[row]
        head = tuple(x[:, s:s + off] for x in inputs)
        _, _, alone = _run(kernels, head, None if h0 is None else h0[row:row + 1], [0, off], [off])
        assert torch.equal(ssm[slots[i]], alone[0].to(cache_dtype)), f"{where}: checkpoint {i} at {off} of row {row}"
    untouched = sorted(set(range(blocks)) - set(slots))
    assert torch.isnan(ssm[untouched]).all(), f"{where}: a block outside the checkpoints changed"
    dim = rng.choice([8, 24, 40])
    mixed = torch.randn(qsl[-1], dim, generator=torch_gen).half()
    for dim_first in (True, False):
        shape = (blocks, dim, width - 1) if dim_first else (blocks, width - 1, dim)
        conv = torch.full(shape, float("nan"))
        ops.write_conv(conv, mixed, md, width, dim_first)
        for i, end in enumerate(plan.conv_end):
            want = mixed[end - width + 1:end].float()
            assert torch.equal(conv[slots[i]], want.T if dim_first else want), f"{where}: conv {i}"
        assert torch.isnan(conv[untouched]).all(), where
