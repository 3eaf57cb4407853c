"""The CUDA exporter's SSM state source: vLLM's FLA chunk kernel's per-chunk state ``h``.

:mod:`vllm_hybrid_npu.patches.gdn_prefill_checkpoint` copies ``h[chunk]`` of
``chunk_gated_delta_rule_fwd_h`` (the state at a 64-token chunk's start) into the checkpoint
block. Checked against vLLM's own kernels on random inputs (seed printed on failure): for
variable-length batches, the state after the first ``offset`` tokens of a sequence taken from
``h`` of one pass over the whole batch equals the final state of a second pass that stops at
``offset`` (what vLLM's block-aligned split stores), rounded to bf16 (``h`` is kept in the input
dtype, the final state in float32); in float32 the difference is that rounding's size.

Needs CUDA and vLLM's CUDA build (the FLA kernels are Triton); skips elsewhere, saying so.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device (vLLM's FLA Triton kernels)", allow_module_level=True)
fla = pytest.importorskip("vllm.third_party.flash_linear_attention.ops.chunk")


def _inputs(gen, lens, heads=4, hv=8, dk=64, dv=64):
    t = sum(lens)
    dev = "cuda"
    q = torch.randn(1, t, heads, dk, generator=gen, device=dev).to(torch.bfloat16)
    k = torch.nn.functional.normalize(torch.randn(1, t, heads, dk, generator=gen, device=dev), dim=-1)
    v = torch.randn(1, t, hv, dv, generator=gen, device=dev).to(torch.bfloat16)
    g = -torch.rand(1, t, hv, generator=gen, device=dev) * 0.1
    beta = torch.rand(1, t, hv, generator=gen, device=dev).to(torch.bfloat16)
    h0 = torch.randn(len(lens), hv, dv, dk, generator=gen, device=dev) * 0.1
    return q, k.to(torch.bfloat16), v, g, beta, h0


def _cu(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                        device="cuda")


def _final_states(q, k, v, g, beta, h0, lens):
    from vllm.third_party.flash_linear_attention.ops.chunk import chunk_gated_delta_rule

    _, final = chunk_gated_delta_rule(
        q=q.contiguous(), k=k.contiguous(), v=v.contiguous(), g=g.contiguous(),
        beta=beta.contiguous(),
        initial_state=h0, output_final_state=True, cu_seqlens=_cu(lens),
        use_qk_l2norm_in_kernel=False,
    )
    return final


def test_h_at_checkpoint_equals_split_final_state(seed):
    from vllm_hybrid_npu.patches import gdn_prefill_checkpoint as mod

    gen = torch.Generator(device="cuda").manual_seed(seed)
    n = 3
    lens = [int(64 * torch.randint(3, 12, (1,), generator=gen, device="cuda")) +
            int(torch.randint(1, 64, (1,), generator=gen, device="cuda")) for _ in range(n)]
    offsets = [64 * int(torch.randint(1, ln // 64, (1,), generator=gen, device="cuda"))
               for ln in lens]
    heads = 8  # q/k heads == v heads: the kernel's GVA is not what is tested
    q, k, v, g, beta, h0 = _inputs(gen, lens, heads=heads, hv=heads)
    # the split: each sequence stops at its offset
    starts = [0, *torch.tensor(lens).cumsum(0).tolist()]
    idx = torch.cat([torch.arange(s, s + o, device="cuda") for s, o in zip(starts, offsets)])
    ref = _final_states(q[:, idx], k[:, idx], v[:, idx], g[:, idx], beta[:, idx], h0.clone(),
                        offsets)
    # one pass, h captured through the patched fwd_h (chunk index of each checkpoint)
    chunk_start, acc = [], 0
    for ln in lens:
        chunk_start.append(acc)
        acc += -(-ln // 64)
    chunk_index = torch.tensor([c + o // 64 for c, o in zip(chunk_start, offsets)],
                               device="cuda")
    cache = torch.zeros(n + 1, *h0.shape[1:], device="cuda", dtype=torch.bfloat16)
    slots = torch.arange(1, n + 1, device="cuda")
    upstream = fla.chunk_gated_delta_rule_fwd_h
    fla.chunk_gated_delta_rule_fwd_h = mod._make_fwd_h(upstream, None)
    mod._fla_export.append((cache, slots, chunk_index))
    try:
        _final_states(q, k, v, g, beta, h0.clone(), lens)
    finally:
        mod._fla_export.pop()
        fla.chunk_gated_delta_rule_fwd_h = upstream
    got = cache[1:]
    assert torch.equal(got, ref.to(torch.bfloat16)), (
        f"seed {seed}: lens {lens} offsets {offsets}: largest difference "
        f"{(got.float() - ref).abs().max().item():.3g}"
    )
