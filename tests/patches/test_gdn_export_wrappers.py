"""The Triton/FLA path's export wrappers of :mod:`vllm_hybrid_npu.patches.gdn_prefill_checkpoint`,
run on CPU tensors (their indexing is device-independent; the FLA kernels themselves are checked
on CUDA by ``tests/ops/test_gdn_checkpoint_fla.py``).

* ``_forward_core`` (wraps vLLM 0.30/0.32 ``QwenGatedDeltaNetAttention._forward_core``): the
  conv state written into each checkpoint block is the ``width - 1`` input rows of the step's
  ``mixed_qkv`` before the checkpoint, in vLLM's conv-state layout (dim-first or not), cast to
  the cache dtype; no other block changes; the SSM target is handed to the FLA hook only during
  upstream's call.
* ``chunk_gated_delta_rule_fwd_h`` hook: the SSM state written is ``h[0, chunk_index]`` cast to
  the cache dtype; no other block changes.

Random shapes, positions and slots per test (seed printed on failure).
"""

from __future__ import annotations

import types

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm.forward_context")

from vllm_hybrid_npu.patches import gdn_prefill_checkpoint as mod  # noqa: E402

PREFIX = "model.layers.3.linear_attn"


def _plan(rng, tokens: int, width: int, blocks: int):
    n = rng.randint(1, 4)
    ends = sorted(rng.sample(range(width - 1, tokens + 1), n))
    slots = rng.sample(range(blocks), n)
    return mod.StepCheckpoints(
        slots=torch.tensor(slots, dtype=torch.int64),
        conv_end=torch.tensor(ends, dtype=torch.int64),
        chunk_index=torch.tensor([rng.randrange(8) for _ in range(n)], dtype=torch.int64),
    ), ends, slots


@pytest.mark.parametrize("dim_first", [True, False])
def test_forward_core_writes_the_conv_rows_before_each_checkpoint(monkeypatch, rng, seed, dim_first):
    width, dim, blocks = rng.choice([2, 3, 4]), rng.randint(5, 40), rng.randint(6, 12)
    tokens = rng.randint(width + 8, 300)
    plan, ends, slots = _plan(rng, tokens, width, blocks)
    cache_dtype = rng.choice([torch.float32, torch.bfloat16])
    shape = (blocks, dim, width - 1) if dim_first else (blocks, width - 1, dim)
    conv = torch.full(shape, float("nan"), dtype=cache_dtype)
    ssm = torch.empty(blocks, 2, 3, 3)
    mixed = torch.randn(tokens, dim, generator=torch.Generator().manual_seed(seed))
    md = types.SimpleNamespace()
    setattr(md, mod.PLAN_ATTR, plan)
    monkeypatch.setattr("vllm.forward_context.get_forward_context",
                        lambda: types.SimpleNamespace(attn_metadata={PREFIX: md}))
    monkeypatch.setattr("vllm.model_executor.layers.mamba.mamba_utils.is_conv_state_dim_first",
                        lambda: dim_first)
    seen = []

    def upstream(self, mixed_qkv, b, a, out):
        seen.append(mod._fla_export[-1])
        return "upstream-result"

    layer = types.SimpleNamespace(prefix=PREFIX, kv_cache=[conv, ssm],
                                  conv1d=types.SimpleNamespace(weight=torch.empty(dim, 1, width)))
    wrapped = mod._make_forward_core(upstream, None)
    for _ in range(2):  # a second layer of the same step reuses the plan's row index
        assert wrapped(layer, mixed, None, None, None) == "upstream-result", f"seed={seed}"
    assert not mod._fla_export, f"seed={seed}: the FLA hook's target outlived upstream's call"
    assert seen[0][0] is ssm and seen[0][1] is plan.slots and seen[0][2] is plan.chunk_index
    for end, slot in zip(ends, slots):
        want = mixed[end - (width - 1):end].to(cache_dtype)
        got = conv[slot].transpose(0, 1) if dim_first else conv[slot]
        assert torch.equal(got, want), f"seed={seed} end={end} slot={slot}"
    untouched = sorted(set(range(blocks)) - set(slots))
    assert torch.isnan(conv[untouched].float()).all(), f"seed={seed}: a block other than a checkpoint's changed"
    assert plan.conv_row_index(width) is plan.conv_row_index(width)


def test_fwd_h_hook_writes_the_chunk_state(rng, seed):
    blocks, chunks, heads, dv, dk = rng.randint(6, 12), rng.randint(2, 9), 3, 4, 5
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(1, chunks, heads, dv, dk, generator=gen).to(torch.bfloat16)
    n = rng.randint(1, min(4, chunks))
    slots = rng.sample(range(blocks), n)
    chunk_index = rng.sample(range(chunks), n)
    ssm_dtype = rng.choice([torch.float32, torch.bfloat16])
    ssm = torch.full((blocks, heads, dv, dk), float("nan"), dtype=ssm_dtype)
    upstream_out = (h, object(), object())
    hook = mod._make_fwd_h(lambda *a, **k: upstream_out, None)
    assert hook() is not None and not torch.isnan(ssm.float()).logical_not().any()  # no target: nothing
    mod._fla_export.append((ssm, torch.tensor(slots), torch.tensor(chunk_index)))
    try:
        assert hook() == upstream_out
    finally:
        mod._fla_export.pop()
    for s, c in zip(slots, chunk_index):
        assert torch.equal(ssm[s], h[0, c].to(ssm_dtype)), f"seed={seed} slot={s} chunk={c}"
    untouched = sorted(set(range(blocks)) - set(slots))
    assert torch.isnan(ssm[untouched].float()).all(), f"seed={seed}"
