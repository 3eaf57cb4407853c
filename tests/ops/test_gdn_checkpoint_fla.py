"""The CUDA exporter's two methods against vLLM's own FLA chunk kernels (Triton).

:mod:`vllm_hybrid_npu.patches.gdn_prefill_checkpoint` obtains a checkpoint's SSM state on CUDA
either from ``h`` of ``chunk_gated_delta_rule_fwd_h`` (the state at a 64-token chunk start, kept
in the input dtype: the method where the SSM cache is bf16) or by splitting the kernel call at the
checkpoints (:func:`vllm_hybrid_npu.ops.gdn_checkpoint.run_split`: every other cache dtype, e.g.
Qwen3.5's float32). On random variable-length batches (seed printed on failure) both are compared
with what vLLM's block-aligned split computes: the final state of a pass that stops at each
checkpoint (bf16-rounded for ``h``; exact in float32 for the split), and, for the split, the
outputs and final states of the heads alone and of the tails alone from those checkpoints.

Needs CUDA and vLLM's CUDA build (the FLA kernels are Triton); skips elsewhere, saying so.
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
                                  use_qk_l2norm_in_kernel=False)


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


def test_h_at_checkpoint_equals_split_final_state(seed):
    lens, offsets, inputs, h0 = _batch(seed)
    heads, head_lens = _pieces(inputs, lens, offsets, head=True)
    _, ref = _pass(heads, h0.clone(), head_lens)
    cache = torch.zeros(len(lens) + 1, *h0.shape[1:], device="cuda", dtype=torch.bfloat16)
    upstream = fla.chunk_gated_delta_rule_fwd_h
    fla.chunk_gated_delta_rule_fwd_h = mod._make_fla_h(upstream, None)
    try:
        with ops.exporting(_metadata(lens, offsets, "h"), cache, "h") as scope:
            _pass(inputs, h0.clone(), lens)
    finally:
        fla.chunk_gated_delta_rule_fwd_h = upstream
    got = cache[1:]
    assert scope.exports == 1 and torch.equal(got, ref.to(torch.bfloat16)), (
        f"seed {seed}: lens {lens} offsets {offsets}: largest difference "
        f"{(got.float() - ref).abs().max().item():.3g}")


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
