"""The CUDA exporter against vLLM's own FLA chunk kernels (Triton), on a GPU.

:mod:`vllm_hybrid_npu.patches.gdn_prefill_checkpoint` exports a checkpoint's SSM state on CUDA in
the step's one FLA pass (method ``fused``): our chunk-state kernel
(:mod:`vllm_hybrid_npu.ops._triton_gdn`) runs in place of vLLM's ``chunk_gated_delta_rule_fwd_h``
with vLLM's autotuned launch configuration and also stores each checkpoint's float32 state, in the
SSM cache's dtype, into its block. On random variable-length batches (one row and many; random
initial states, lengths and checkpoint offsets; seed printed on failure):

* our kernel's ``h``, ``v_new`` and final state equal vLLM's kernel's bit for bit;
* vLLM's whole FLA forward with the export equals it without (outputs, final states) bit for bit,
  and each checkpoint block holds what vLLM's block-aligned split stores there (the final state
  of a pass over the row's head alone, cast to the cache dtype: float32 and bf16 caches); no
  other block changes;
* several checkpoints in a row (shared-prefix junctions before the prompt's own, planned with
  ``plan_step(..., junctions=...)``): each block holds vLLM's own pass's final state over the
  row's tokens up to it, in the cache dtype; outputs unchanged;
* a row of 128 chunks or more: our kernel at the long-row configuration (``step_config``) against
  vLLM's kernel at the pick its autotuner made on 64 tokens, bit for bit, and each checkpoint the
  state of vLLM's pass over the row's head;
* the conv checkpoints written by our Triton kernel equal the torch write's;
* the split (kept for ``FLA_USE_FAST_OPS=1``) equals vLLM's split in float32.

Needs CUDA and vLLM's CUDA build (the FLA kernels are Triton); skips elsewhere, saying so (the
same kernels run in the Triton interpreter on CPU in ``tests/ops/test_gdn_chunk_states.py``).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device (vLLM's FLA Triton kernels)", allow_module_level=True)
fla = pytest.importorskip("vllm.third_party.flash_linear_attention.ops.chunk")

from vllm_hybrid_npu.core.prefill_checkpoints import plan_step  # noqa: E402
from vllm_hybrid_npu.ops import gdn_checkpoint as ops  # noqa: E402
from vllm_hybrid_npu.patches import gdn_prefill_checkpoint as mod  # noqa: E402

HEADS = 8  # q/k heads == v heads: the kernel's GVA is not what is tested


def _batch(seed, rows=3):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda lo, hi: int(torch.randint(lo, hi, (1,), generator=gen, device="cuda"))  # noqa: E731
    lens = [64 * r(3, 12) + r(1, 64) for _ in range(rows)]
    offsets = [64 * r(1, ln // 64) for ln in lens]
    t, dev = sum(lens), "cuda"
    q = torch.randn(1, t, HEADS, 64, generator=gen, device=dev).to(torch.bfloat16)
    k = torch.nn.functional.normalize(torch.randn(1, t, HEADS, 64, generator=gen, device=dev), dim=-1)
    v = torch.randn(1, t, HEADS, 64, generator=gen, device=dev).to(torch.bfloat16)
    g = -torch.rand(1, t, HEADS, generator=gen, device=dev) * 0.1
    beta = torch.rand(1, t, HEADS, generator=gen, device=dev).to(torch.bfloat16)
    h0 = torch.randn(len(lens), HEADS, 64, 64, generator=gen, device=dev) * 0.1
    return lens, offsets, (q, k.to(torch.bfloat16), v, g, beta), h0


def _cu(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")


def _pass(inputs, h0, lens):
    from vllm.third_party.flash_linear_attention.ops.chunk import chunk_gated_delta_rule

    q, k, v, g, beta = (x.contiguous() for x in inputs)
    return chunk_gated_delta_rule(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0,
                                  output_final_state=True, cu_seqlens=_cu(lens),
                                  use_qk_l2norm_in_kernel=False)  # chunk metadata: FLA's own


def _exported_pass(md, cache, inputs, h0, lens):
    """vLLM's FLA forward (:func:`_pass`) with the exporter's state-function wrapper in place of
    ``chunk_gated_delta_rule_fwd_h`` inside a ``fused`` export scope of ``md`` and ``cache``;
    returns the scope and the pass's ``(o, final_state)``."""
    upstream = fla.chunk_gated_delta_rule_fwd_h
    fla.chunk_gated_delta_rule_fwd_h = mod._make_fla_h(upstream, None)
    try:
        with ops.exporting(md, cache, "fused") as scope:
            return scope, _pass(inputs, h0.clone(), lens)
    finally:
        fla.chunk_gated_delta_rule_fwd_h = upstream


def _pieces(inputs, lens, offsets, head):
    starts = [0, *torch.tensor(lens).cumsum(0).tolist()]
    idx = torch.cat([torch.arange(s, s + o, device="cuda") if head else
                     torch.arange(s + o, s + n, device="cuda")
                     for s, o, n in zip(starts, offsets, lens)])
    return tuple(x[:, idx] for x in inputs), [o if head else n - o for o, n in zip(offsets, lens)]


def _metadata(lens, offsets, method):
    qsl = [0, *torch.tensor(lens).cumsum(0).tolist()]
    plan = plan_step(qsl, offsets, [0] * len(lens), num_decodes=0)
    table = torch.arange(1, len(lens) + 1, dtype=torch.int32, device="cuda").view(-1, 1)
    to_device = lambda v, d: torch.tensor(v, dtype=d).to("cuda")  # noqa: E731
    return ops.build_metadata(plan, table, to_device, method,
                              mod._fla_kernel_meta(None, torch.device("cuda")))


def _rows(rows, seed):
    return 1 if rows == "one" else 2 + seed % 7  # 2-8 rows, drawn with the test's seed


@pytest.mark.parametrize("rows", ["one", "many"])
@pytest.mark.parametrize("h0_dtype", [torch.float32, torch.bfloat16])
def test_chunk_states_is_vllms_kernel(seed, h0_dtype, rows):
    from vllm.third_party.flash_linear_attention.ops import chunk_delta_h, index

    lens, offsets, (q, k, v, g, beta), h0 = _batch(seed, _rows(rows, seed))
    cu = _cu(lens)
    t, heads = k.shape[1], k.shape[2]
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    w = (torch.randn(1, t, heads, 64, generator=gen, device="cuda") * 0.1).to(torch.bfloat16)
    g = torch.rand(1, t, heads, generator=gen, device="cuda").mul(-0.05).cumsum(1)  # decaying
    host = cu.cpu()
    ci, co = (f(host, 64).to("cuda") for f in (index.prepare_chunk_indices, index.prepare_chunk_offsets))
    args = (k, w, v, g, None, h0.to(h0_dtype), True, 64, True, cu, ci, co, False)
    ref = chunk_delta_h.chunk_gated_delta_rule_fwd_h(*args)
    md = _metadata(lens, offsets, "fused")
    cache = torch.full((len(lens) + 1, heads, 64, 64), float("nan"), device="cuda")
    config = mod.fla_h_config(chunk_delta_h.chunk_gated_delta_rule_fwd_h, args,
                              ("test", h0_dtype, len(lens)))
    with ops.exporting(md, cache, "fused") as scope:
        got = scope.chunk_states(k, w, v, g, h0.to(h0_dtype), True, cu, config)
    where = f"seed {seed}: lens {lens} offsets {offsets} config {config}"
    for name, a, b in zip(("h", "v_new", "final"), got, ref):
        assert torch.equal(a, b), f"{where}: {name} differs by {(a.float() - b.float()).abs().max().item():.3g}"


def test_long_row_configuration_gives_vllms_bits(seed):
    """A step with a row of 128 chunks or more: the exporter launches our kernel with the
    long-row configuration (``step_config``) while vLLM's kernel keeps the pick its autotuner
    made on a 64-token prefill (as ``_warmup_prefill_kernels`` makes it in serving); ``h``,
    ``v_new`` and the final state are still vLLM's bit for bit. Skips on a GPU without a long-row
    configuration (vLLM's pick is used there)."""
    from vllm.third_party.flash_linear_attention.ops import chunk_delta_h, index

    cap = tuple(torch.cuda.get_device_capability())
    if cap not in mod.LONG_ROW_CONFIGS:
        pytest.skip(f"no long-row configuration for compute capability {cap}: vLLM's pick is used")
    gen = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda lo, hi: int(torch.randint(lo, hi, (1,), generator=gen, device="cuda"))  # noqa: E731
    lens = [64 * mod.LONG_ROW_CHUNKS + r(0, 64 * 16), 64 * r(1, 8) + r(1, 64)][: 1 + seed % 2]
    offsets = [64 * r(1, ln // 64) for ln in lens]
    t = sum(lens)
    k = torch.nn.functional.normalize(torch.randn(1, t, HEADS, 64, generator=gen, device="cuda"), dim=-1)
    k, v = k.to(torch.bfloat16), torch.randn(1, t, HEADS, 64, generator=gen, device="cuda").to(torch.bfloat16)
    w = (torch.randn(1, t, HEADS, 64, generator=gen, device="cuda") * 0.1).to(torch.bfloat16)
    g = torch.rand(1, t, HEADS, generator=gen, device="cuda").mul(-0.05 / 64).cumsum(1)
    h0 = torch.randn(len(lens), HEADS, 64, 64, generator=gen, device="cuda") * 0.1

    def args(k, w, v, g, h0, lens):
        host = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        ci, co = (f(host, 64).to("cuda") for f in (index.prepare_chunk_indices, index.prepare_chunk_offsets))
        return (k, w, v, g, None, h0, True, 64, True, host.to("cuda"), ci, co, False)

    fn = chunk_delta_h.chunk_gated_delta_rule_fwd_h
    fn(*args(k[:, :64], w[:, :64], v[:, :64], g[:, :64], h0[:1], [64]))  # vLLM's pick: 64 tokens
    key = ("long-row", len(lens))
    picked = mod.fla_h_config(fn, args(k[:, :64], w[:, :64], v[:, :64], g[:, :64], h0[:1], [64]), key)
    ref = fn(*args(k, w, v, g, h0, lens))
    md = _metadata(lens, offsets, "fused")
    config = mod.step_config(picked, md.plan, k.device, key)
    assert config == mod.LONG_ROW_CONFIGS[cap], f"seed {seed}: lens {lens}: {config} (vLLM's {picked})"
    cache = torch.full((len(lens) + 1, HEADS, 64, 64), float("nan"), device="cuda")
    with ops.exporting(md, cache, "fused") as scope:
        got = scope.chunk_states(k, w, v, g, h0, True, args(k, w, v, g, h0, lens)[9], config)
    where = f"seed {seed}: lens {lens} offsets {offsets} config {config}, vLLM's {picked}"
    for name, a, b in zip(("h", "v_new", "final"), got, ref):
        assert torch.equal(a, b), f"{where}: {name} differs by {(a.float() - b.float()).abs().max().item():.3g}"
    starts = [0, *torch.tensor(lens).cumsum(0).tolist()]
    idx = torch.cat([torch.arange(a, a + o, device="cuda") for a, o in zip(starts, offsets)])
    heads = fn(*args(k[:, idx], w[:, idx], v[:, idx], g[:, idx], h0, offsets))[2]  # the split's states
    assert torch.equal(cache[1:], heads), f"{where}: {(cache[1:] - heads).abs().max().item():.3g}"


@pytest.mark.parametrize("rows", ["one", "many"])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_fused_forward_is_vllms_and_stores_the_splits_state(seed, cache_dtype, rows):
    lens, offsets, inputs, h0 = _batch(seed, _rows(rows, seed))
    o_ref, final_ref = _pass(inputs, h0.clone(), lens)
    heads, head_lens = _pieces(inputs, lens, offsets, head=True)
    _, split_state = _pass(heads, h0.clone(), head_lens)  # what vLLM's split stores (before the cast)
    md = _metadata(lens, offsets, "fused")
    cache = torch.full((len(lens) + 3, *h0.shape[1:]), float("nan"), device="cuda", dtype=cache_dtype)
    scope, (o, final) = _exported_pass(md, cache, inputs, h0, lens)
    where = f"seed {seed}: lens {lens} offsets {offsets} cache {cache_dtype}"
    assert scope.exports == 1, where
    assert torch.equal(o, o_ref) and torch.equal(final, final_ref), f"{where}: outputs changed"
    got = cache[1:len(lens) + 1]
    assert torch.equal(got, split_state.to(cache_dtype)), (
        f"{where}: largest difference to the split's state {(got.float() - split_state).abs().max().item():.3g}")
    assert torch.isnan(cache[0].float()).all() and torch.isnan(cache[len(lens) + 1:].float()).all(), where


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_fused_forward_stores_every_checkpoint_of_a_row(seed, cache_dtype):
    """Several checkpoints per row (shared-prefix junctions before the prompt's own, issue 38
    item 2), planned as the builder plans them (``plan_step`` with ``junctions``) and written in
    the one pass: vLLM's whole FLA forward with the export equals it without, bit for bit; each
    checkpoint block holds the final state of vLLM's own pass over the row's tokens up to it, cast
    to the cache dtype (for the first checkpoint of a row the bytes vLLM's split stores; for a
    later one caching off's running state there: vLLM's split would start that segment from the
    earlier state read back in the cache dtype, which in a bf16 cache rounds once more); no other
    block changes."""
    lens, _, inputs, h0 = _batch(seed, _rows("many", seed))
    gen = torch.Generator().manual_seed(seed)
    cuts = [sorted(torch.randperm(n // 64 - 1, generator=gen)[:1 + int(torch.randint(0, 3, (1,), generator=gen))]
                   .add(1).mul(64).tolist()) for n in lens]
    qsl = [0, *torch.tensor(lens).cumsum(0).tolist()]
    junctions = {r: [(o, i) for i, o in enumerate(c[:-1])] for r, c in enumerate(cuts) if len(c) > 1}
    plan = plan_step(qsl, [c[-1] for c in cuts], [len(c) - 1 for c in cuts], num_decodes=0,
                     junctions=junctions)
    n = len(plan.rows)
    table = torch.zeros(len(lens), 4, dtype=torch.int32)
    for i, (row, col) in enumerate(zip(plan.rows, plan.cols)):
        table[row, col] = i + 1
    to_device = lambda v, d: torch.tensor(v, dtype=d).to("cuda")  # noqa: E731
    md = ops.build_metadata(plan, table.cuda(), to_device, "fused")
    o_ref, final_ref = _pass(inputs, h0.clone(), lens)
    cache = torch.full((n + 3, *h0.shape[1:]), float("nan"), device="cuda", dtype=cache_dtype)
    scope, (o, final) = _exported_pass(md, cache, inputs, h0, lens)
    where = f"seed {seed}: lens {lens} checkpoints {cuts} cache {cache_dtype}"
    assert scope.exports == 1 and plan.several_per_row == bool(junctions), where
    assert torch.equal(o, o_ref) and torch.equal(final, final_ref), f"{where}: outputs changed"
    for i, (row, off) in enumerate(zip(plan.rows, plan.offsets)):
        s = qsl[row]
        _, state = _pass(tuple(x[:, s:s + off] for x in inputs), h0[row:row + 1].clone(), [off])
        got = cache[i + 1]
        assert torch.equal(got, state[0].to(cache_dtype)), (
            f"{where}: checkpoint {i} (row {row}, {off} tokens): largest difference "
            f"{(got.float() - state[0]).abs().max().item():.3g}")
    assert torch.isnan(cache[0].float()).all() and torch.isnan(cache[n + 1:].float()).all(), where


@pytest.mark.parametrize("dim_first", [True, False])
def test_conv_kernel_is_the_torch_write(seed, dim_first):
    lens, offsets, _, _ = _batch(seed, _rows("many", seed))
    width, dim = 4, 8 * (1 + seed % 97)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    mixed = torch.randn(sum(lens), dim, generator=gen, device="cuda").to(torch.bfloat16)
    shape = (len(lens) + 3, dim, width - 1) if dim_first else (len(lens) + 3, width - 1, dim)
    caches = [torch.full(shape, float("nan"), device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    for cache, method in zip(caches, ("fused", "split")):
        ops.write_conv(cache, mixed, _metadata(lens, offsets, method), width, dim_first)
    assert torch.equal(caches[0].float().nan_to_num(7.0), caches[1].float().nan_to_num(7.0)), (
        f"seed {seed}: lens {lens} offsets {offsets}")


@pytest.mark.parametrize("rows", [3, 1])  # 1: the tail is a suffix, o written in place (core_attn_out)
def test_split_is_vllms_split_in_float32(seed, rows):
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import ChunkGatedDeltaRule

    lens, offsets, inputs, h0 = _batch(seed, rows)
    heads, head_lens = _pieces(inputs, lens, offsets, head=True)
    o_head, ref = _pass(heads, h0.clone(), head_lens)
    tails, tail_lens = _pieces(inputs, lens, offsets, head=False)
    o_tail, ref_final = _pass(tails, ref.clone(), tail_lens)
    md = _metadata(lens, offsets, "split")
    cache = torch.zeros(len(lens) + 1, *h0.shape[1:], device="cuda", dtype=torch.float32)
    wrapped = mod._make_fla_split(ChunkGatedDeltaRule.forward_native, None)
    with ops.exporting(md, cache, "split") as scope:
        o, final = wrapped(None, *inputs, h0.clone(), True, _cu(lens), None, None, False)
    where = f"seed {seed}: lens {lens} offsets {offsets}"
    assert scope.exports == 1 and md.plan.tails_are_suffix == (rows == 1), where
    assert torch.equal(cache[1:], ref), f"{where}: {(cache[1:] - ref).abs().max().item():.3g}"
    starts = [0, *torch.tensor(lens).cumsum(0).tolist()]
    hs = [0, *torch.tensor(head_lens).cumsum(0).tolist()]
    ts = [0, *torch.tensor(tail_lens).cumsum(0).tolist()]
    for i, (s, off, n) in enumerate(zip(starts, offsets, lens)):
        assert torch.equal(o[:, s:s + off], o_head[:, hs[i]:hs[i + 1]]), f"{where}: head {i}"
        assert torch.equal(o[:, s + off:s + n], o_tail[:, ts[i]:ts[i + 1]]), f"{where}: tail {i}"
    assert torch.equal(final, ref_final), where
