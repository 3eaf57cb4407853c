"""The exporter's layer and kernel wrappers (:mod:`vllm_hybrid_npu.patches.gdn_prefill_checkpoint`),
run on CPU tensors around stand-in upstream functions (the FLA kernels themselves are checked on
CUDA by ``tests/ops/test_gdn_checkpoint_fla.py``; vllm-ascend's by ``tests/ascend``).

* ``make_forward`` (wraps ``_forward_core``): the conv checkpoints are the ``width - 1`` input rows
  before each checkpoint; upstream runs inside an export scope of the step's method and the
  layer's SSM cache; a forward in which no kernel exported raises; without checkpoints it is
  upstream's call alone;
* the FLA state-function wrapper (``chunk_gated_delta_rule_fwd_h``): in a ``fused`` scope our
  kernel (the Triton interpreter here) in place of upstream, its launch configuration read off
  vLLM's autotuner after one upstream call per key (and logged once per key), one export;
  elsewhere upstream's call alone;
  the FLA split wrapper (``forward_native``) returns what one unsplit call returns and writes the
  heads' final states;
* ``with_checkpoints``: the typed field on vLLM's GDN metadata, its other attributes kept.

Random shapes, positions and slots per test (seed printed on failure).
"""

from __future__ import annotations

import dataclasses
import types

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm.forward_context")

from vllm_hybrid_npu.core.prefill_checkpoints import plan_step  # noqa: E402
from vllm_hybrid_npu.ops import gdn_checkpoint as ops  # noqa: E402
from vllm_hybrid_npu.patches import gdn_prefill_checkpoint as mod  # noqa: E402

PREFIX = "model.layers.3.linear_attn"


def _has_triton() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None


def _metadata(rng, lens, min_offset, method="split"):
    unit = 64 if method == "fused" else 1  # the fused export's checkpoints start a 64-token chunk
    offsets = [rng.choice([0, unit * rng.randint(-(-min_offset // unit), (n - 1) // unit)]) for n in lens]
    offsets[rng.randrange(len(lens))] = -(-min_offset // unit) * unit  # at least one checkpoint
    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    plan = plan_step(qsl, offsets, [0] * len(lens), num_decodes=0)
    table = torch.tensor([[b] for b in rng.sample(range(20), len(lens))], dtype=torch.int32)
    return ops.build_metadata(plan, table, lambda v, d: torch.tensor(v, dtype=d), method), qsl


def _context(monkeypatch, ck):
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata

    md = mod.with_checkpoints(GDNAttentionMetadata(0, 0, 0, 0, 0, 0, 0), ck) if ck else None
    monkeypatch.setattr("vllm.forward_context.get_forward_context",
                        lambda: types.SimpleNamespace(attn_metadata={PREFIX: md}))


@pytest.mark.parametrize("dim_first", [True, False])
def test_forward_writes_conv_rows_and_opens_the_scope(monkeypatch, rng, seed, dim_first):
    width, dim = rng.choice([2, 3, 4]), rng.randint(5, 40)
    method = rng.choice(["split", "fused"] if _has_triton() else ["split"])
    ck, qsl = _metadata(rng, [rng.randint(66 if method == "fused" else width + 2, 150)
                              for _ in range(rng.randint(1, 4))], width, method=method)
    conv = torch.full((24, dim, width - 1) if dim_first else (24, width - 1, dim), float("nan"),
                      dtype=rng.choice([torch.float32, torch.bfloat16]))
    ssm = torch.empty(24, 2, 3, 3)
    # in the conv cache's dtype, as vLLM's are (the interpreter truncates float32 -> bf16)
    mixed = torch.randn(qsl[-1], dim, generator=torch.Generator().manual_seed(seed)).to(conv.dtype)
    _context(monkeypatch, ck)
    monkeypatch.setattr("vllm.model_executor.layers.mamba.mamba_utils.is_conv_state_dim_first",
                        lambda: dim_first)
    seen = []

    def upstream(self, mixed_qkv, b, a, out, export=True):
        scope = ops.current(ck.method)
        seen.append(scope)
        if export and scope is not None:
            scope.exports += 1
        return "upstream-result"

    layer = types.SimpleNamespace(prefix=PREFIX, kv_cache=[conv, ssm], conv_kernel_size=width)
    wrapped = mod.make_forward(upstream, None)
    assert wrapped(layer, mixed, None, None, None) == "upstream-result", f"seed={seed}"
    assert seen[0].ssm_cache is ssm and seen[0].metadata is ck and ops.current(ck.method) is None
    for end, slot in zip(ck.plan.conv_end, ck.slots.tolist()):
        got = conv[slot].transpose(0, 1) if dim_first else conv[slot]
        assert torch.equal(got, mixed[end - (width - 1):end].to(conv.dtype)), f"seed={seed}"
    untouched = sorted(set(range(24)) - set(ck.slots.tolist()))
    assert torch.isnan(conv[untouched].float()).all(), f"seed={seed}: another block changed"
    silent = mod.make_forward(lambda *a: upstream(*a, export=False), None)
    with pytest.raises(RuntimeError, match="0 kernel call"):
        silent(layer, mixed, None, None, None)
    _context(monkeypatch, None)
    assert wrapped(layer, mixed, None, None, None) == "upstream-result" and seen[-1] is None


def test_forward_without_checkpoints_is_upstream_alone(monkeypatch, rng, seed):
    """Issue 37 item 3: the layer wrapper on a step without checkpoints (every decode-only
    step; vLLM's metadata for the layer, for another layer only, or none: a profiling run) calls
    upstream with its arguments as given and returns its result, importing nothing and issuing
    no aten op (once per GDN layer and step where the layer runs eagerly)."""
    import builtins

    from torch.utils._python_dispatch import TorchDispatchMode
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata

    class CountOps(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            CountOps.n += 1
            return func(*args, **(kwargs or {}))

    got = []

    def upstream(self, mixed_qkv, b, a, out):
        got.append((self, mixed_qkv, b, a, out))
        return got[-1]

    wrapped = mod.make_forward(upstream, None)  # vLLM's forward_context bound here, not per call
    imports, counting = [], [False]
    real_import = builtins.__import__

    def counted_import(*a, **k):
        if counting[0]:
            imports.append(a[0])
        return real_import(*a, **k)

    monkeypatch.setattr(builtins, "__import__", counted_import)
    layer = types.SimpleNamespace(prefix=PREFIX, kv_cache=[torch.empty(4, 3, 2), torch.empty(4, 2, 3, 3)],
                                  conv_kernel_size=3)
    decode = GDNAttentionMetadata(0, 0, 0, 0, 0, 0, 0)
    for _ in range(rng.randint(5, 20)):
        raw = rng.choice([{PREFIX: decode}, {"model.layers.0.linear_attn": decode}, None])
        monkeypatch.setattr("vllm.forward_context.get_forward_context",
                            lambda raw=raw: types.SimpleNamespace(attn_metadata=raw))
        n = rng.randint(1, 9)
        args = (torch.randn(n, 6), torch.randn(n, 2), torch.randn(n, 2), torch.empty(n, 2, 3))
        with CountOps():
            counting[0] = True  # the wrapper's call only (the dispatch mode imports on entry)
            try:
                out = wrapped(layer, *args)
            finally:
                counting[0] = False
        assert out == (layer, *args) and all(x is y for x, y in zip(out, (layer, *args))), f"seed={seed}"
    assert imports == [] and CountOps.n == 0, (imports, CountOps.n)


def test_fla_state_wrapper_runs_ours_in_a_fused_scope(monkeypatch, rng, seed):
    pytest.importorskip("triton")
    from vllm_hybrid_npu.ops import _triton_gdn

    lens = [rng.randint(65, 200) for _ in range(rng.randint(1, 3))]
    ck, qsl = _metadata(rng, lens, 64, "fused")
    gen = torch.Generator().manual_seed(seed)
    t, heads, kd, vd = qsl[-1], 2, 64, 32
    k = torch.nn.functional.normalize(torch.randn(1, t, heads, kd, generator=gen), dim=-1)
    w, u = torch.randn(1, t, heads, kd, generator=gen) * 0.1, torch.randn(1, t, heads, vd, generator=gen)
    g = -torch.rand(1, t, heads, generator=gen) * 0.01
    h0 = torch.randn(len(lens), heads, vd, kd, generator=gen) * 0.1
    nch = [-(-n // 64) for n in lens]
    cu = torch.tensor(qsl, dtype=torch.int32)
    offsets = torch.tensor([0, *torch.tensor(nch).cumsum(0).tolist()][:-1])
    indices = torch.zeros(sum(nch), 2)  # only its length is read (FLA's chunk indices)
    calls = []

    def upstream(*args, **kwargs):
        calls.append(args)
        return "upstream-h"

    kernel = types.SimpleNamespace(fn=types.SimpleNamespace(best_config=types.SimpleNamespace(
        kwargs={"BV": 32}, num_warps=4, num_stages=3)))
    monkeypatch.setitem(__import__("sys").modules, mod.FLA_H, types.SimpleNamespace(
        chunk_gated_delta_rule_fwd_kernel_h_blockdim64=kernel))
    monkeypatch.setattr(mod, "_FLA_H_CONFIGS", {})
    logged = []
    monkeypatch.setattr(mod, "_log_once", lambda key, msg, *args: logged.append((key, args)))
    launches = []
    real = _triton_gdn.chunk_states
    monkeypatch.setattr(_triton_gdn, "chunk_states", lambda *a, **kw: launches.append(kw) or real(*a, **kw))
    hook = mod._make_fla_h(upstream, None)
    kwargs = dict(k=k, w=w, u=u, g=g, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                  chunk_indices=indices, chunk_offsets=offsets)
    assert hook(**kwargs) == "upstream-h" and len(calls) == 1  # no scope
    ssm = torch.full((20, heads, vd, kd), float("nan"))
    with ops.exporting(ck, ssm, "split"):
        assert hook(**kwargs) == "upstream-h" and len(calls) == 2  # not the fused method's
    with ops.exporting(ck, ssm, "fused") as scope:
        assert hook(**{**kwargs, "gk": g}) == "upstream-h"  # a call ours does not cover
        assert hook(**{**kwargs, "cu_seqlens": cu[:-1]}) == "upstream-h"  # not the plan's rows
        assert scope.exports == 0 and len(calls) == 4
        h, v_new, final = hook(**kwargs)
        assert len(calls) == 5 and calls[-1][:3] == (k, w, u)  # upstream once: its autotuner's pick
        hook(**kwargs)
    assert scope.exports == 2 and len(calls) == 5, f"seed={seed}: the configuration is read once per key"
    assert [(kw["bv"], kw["num_warps"], kw["num_stages"]) for kw in launches] == [(32, 4, 3)] * 2
    # the log names the launch the export took, once per key
    assert [args[0] for key, args in logged if key.startswith("fla-config")] == [
        {"bv": 32, "num_warps": 4, "num_stages": 3}], f"seed={seed}: {logged}"
    assert ck.chunk_starts.tolist() == offsets.tolist(), f"seed={seed}"
    # the reference with the launch the hook took (vLLM's autotuned pick, BV 32): with another BV
    # the interpreter's dots run on other tile shapes, whose float32 sums the CPU's BLAS may
    # order apart (an AMD EPYC without AVX-512, 2026-11-30: about 1e-6 apart at BV 64)
    ref = real(k, w, u, g, h0, True, cu, offsets, sum(nch), torch.full((sum(nch),), -1), ck.slots,
               torch.zeros(1, heads, vd, kd), bv=32, num_warps=4, num_stages=3,
               kernels=_triton_gdn.interpreted())
    assert all(torch.equal(a, b) for a, b in zip((h, v_new, final), ref)), f"seed={seed}"
    for s, c in zip(ck.slots.tolist(), ck.plan.chunk_index):
        assert torch.equal(ssm[s], h[0, c]), f"seed={seed} slot={s} chunk={c}"
    untouched = sorted(set(range(20)) - set(ck.slots.tolist()))
    assert torch.isnan(ssm[untouched]).all(), f"seed={seed}"


def _kernel(q, k, v, g, beta, state, cu):
    # a token-by-token linear recurrence in float64 (exact under splitting)
    S, o = state.double().clone(), torch.zeros(*v.shape, dtype=torch.float64)
    cu = [int(c) for c in cu]
    for n, (s, e) in enumerate(zip(cu, cu[1:])):
        for t in range(s, e):
            S[n] = S[n] * torch.exp(g[0, t].double())[:, None, None] + \
                torch.einsum("hk,hv->hkv", k[0, t].double(), v[0, t].double() * beta[0, t].double()[:, None])
            o[0, t] = torch.einsum("hk,hkv->hv", q[0, t].double(), S[n])
    return o, S


def test_step_config_takes_the_long_row_configuration_where_measured(monkeypatch, rng, seed):
    """``step_config``: vLLM's autotuned pick, except in a step whose longest prefill row has 128
    or more 64-token chunks, on a GPU of compute capability 9.0, where vLLM's space holds BV 32,
    4 warps, 3 stages: then that (logged once per key). Hand-made plans: rows of 10, 128 and 2
    chunks (the long row not first), and 127; then fresh draws of row lengths, whose expected
    choice is the rule itself (any row of 128 chunks or more)."""
    vllm_pick = {"bv": 64, "num_warps": 2, "num_stages": 2}
    long = {"bv": 32, "num_warps": 4, "num_stages": 3}
    space = frozenset({(32, 2, 2), (64, 2, 2), (32, 4, 3), (64, 4, 3)})
    monkeypatch.setattr(mod, "_FLA_H_SPACES", {"k": space, "no-long": space - {(32, 4, 3)}})
    cap = {"cuda": (9, 0)}
    monkeypatch.setattr(mod, "_capability", lambda device: cap.get(device.type))
    logged = []
    monkeypatch.setattr(mod, "_log_once", lambda key, msg, *args: logged.append(key))
    gpu, cpu = types.SimpleNamespace(type="cuda"), torch.device("cpu")

    def plan(chunks):
        starts = [0]
        for c in chunks[:-1]:
            starts.append(starts[-1] + c)
        return types.SimpleNamespace(chunk_starts=tuple(starts), num_chunks=sum(chunks))

    assert mod.step_config(vllm_pick, plan([10, 128, 2]), gpu, "k") == long
    assert mod.step_config(vllm_pick, plan([10, 127, 2]), gpu, "k") == vllm_pick
    assert mod.step_config(vllm_pick, plan([128]), cpu, "k") == vllm_pick  # no capability
    assert mod.step_config(vllm_pick, plan([128]), gpu, "no-long") == vllm_pick  # not in the space
    assert mod.step_config(vllm_pick, plan([128]), gpu, "unread") == vllm_pick  # no space read
    cap["cuda"] = (8, 0)
    assert mod.step_config(vllm_pick, plan([500]), gpu, "k") == vllm_pick  # not measured there
    cap["cuda"] = (9, 0)
    assert mod.step_config(long, plan([500]), gpu, "k") == long
    assert logged == ["fla-long-k"], f"seed={seed}: {logged}"  # once: only where it changed
    for _ in range(20):
        chunks = [rng.randint(1, 200) for _ in range(rng.randint(1, 5))]
        want = long if max(chunks) >= 128 else vllm_pick
        assert mod.step_config(vllm_pick, plan(chunks), gpu, "k") == want, f"seed={seed}: {chunks}"


@pytest.mark.parametrize("rows", ["one", "several"])
def test_fla_split_wrapper_equals_one_call(rng, seed, rows):
    # one row: the tail is a suffix, and FLA writes both calls' o into one buffer (core_attn_out)
    ck, qsl = _metadata(rng, [rng.randint(3, 30) for _ in range(1 if rows == "one" else rng.randint(2, 4))], 1)
    assert ck.plan.tails_are_suffix or rows == "several"
    gen = torch.Generator().manual_seed(seed)
    t, hd = qsl[-1], 2
    q, k, v = (torch.randn(1, t, hd, 3, generator=gen) for _ in range(3))
    g, beta = -torch.rand(1, t, hd, generator=gen), torch.rand(1, t, hd, generator=gen)
    state0 = torch.randn(len(qsl) - 1, hd, 3, 3, generator=gen, dtype=torch.float64)
    calls = []

    def forward_native(self, q, k, v, g, beta, initial_state, output_final_state, cu_seqlens=None,
                       chunk_indices=None, chunk_offsets=None, use_qk_l2norm_in_kernel=True,
                       core_attn_out=None):
        calls.append((cu_seqlens.tolist(), chunk_indices, chunk_offsets, core_attn_out))
        o, final = _kernel(q, k, v, g, beta, initial_state, cu_seqlens)
        # o in v's dtype, into core_attn_out where given: FLA's chunk_fwd_o (vLLM 0.30 / 0.32)
        buf = torch.empty_like(v) if core_attn_out is None else core_attn_out[: v.numel()].view(*v.shape)
        return buf.copy_(o), final

    ck.kernel_meta = {"head": ("ci-h", "co-h"), "tail": ("ci-t", "co-t")}
    wrapped = mod._make_fla_split(forward_native, None)
    ssm = torch.full((20, hd, 3, 3), float("nan"), dtype=torch.float64)
    args = (q, k, v, g, beta, state0, True, torch.tensor(qsl), None, None, False)
    with ops.exporting(ck, ssm, "split") as scope:
        o, final = wrapped(None, *args)
    o_ref, final_ref = _kernel(q, k, v, g, beta, state0, qsl)
    o_ref = o_ref.to(v.dtype)
    assert torch.equal(o, o_ref) and torch.equal(final, final_ref), f"seed={seed}"
    assert scope.exports == 1 and [c[1:3] for c in calls] == [("ci-h", "co-h"), ("ci-t", "co-t")]
    bufs = [c[3] for c in calls]
    if ck.plan.tails_are_suffix:  # the two calls' o are o's rows, no concatenation
        cut = ck.plan.head_bounds[-1]
        assert bufs[0].data_ptr() == o.data_ptr() and bufs[0].shape[1] == cut, f"seed={seed}"
        assert bufs[1].data_ptr() == o[:, cut:].data_ptr() and bufs[1].shape[1] == t - cut
    else:
        assert bufs == [None, None], f"seed={seed}"
    for i, (row, off) in enumerate(zip(ck.plan.rows, ck.plan.offsets)):
        s = qsl[row]
        _, alone = _kernel(*(x[:, s:s + off] for x in (q, k, v, g, beta)), state0[row:row + 1], [0, off])
        assert torch.equal(ssm[ck.slots[i]], alone[0]), f"seed={seed} row={row}"
    calls.clear()
    assert torch.equal(wrapped(None, *args)[0], o_ref) and len(calls) == 1  # no scope: one call


def test_with_checkpoints_is_a_typed_field():
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata

    md = GDNAttentionMetadata(1, 2, 3, 4, 0, 0, 9, chunk_indices="ci")
    md.non_spec_prefill_metadata = "vllm-ascend's"  # set outside the fields, as vllm-ascend does
    out = mod.with_checkpoints(md, "ck")
    assert isinstance(out, GDNAttentionMetadata) and out is not md
    assert getattr(out, mod.FIELD) == "ck" and getattr(md, mod.FIELD, None) is None
    assert out.num_prefills == 1 and out.num_actual_tokens == 9 and out.chunk_indices == "ci"
    assert out.non_spec_prefill_metadata == "vllm-ascend's"
    assert mod.FIELD in {f.name for f in dataclasses.fields(out)}


def test_regather_gives_each_group_its_own_blocks(rng, seed):
    """vLLM 0.32's V2 runner builds the GDN metadata of group 0 and hands the other groups
    ``update_block_table(metadata, their block table, ...)``, a ``dataclasses.replace`` copy: our
    field would carry group 0's checkpoint blocks. The entry re-gathers them from the group's
    own table (vLLM 0.32, our plan)."""
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata

    from vllm_hybrid_npu.support import Stack

    lens = [rng.randint(70, 300) for _ in range(rng.randint(1, 4))]
    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    offsets = [64 * rng.randint(1, (n - 1) // 64) for n in lens]
    cols = [rng.randint(0, 5) for _ in lens]
    plan = plan_step(qsl, offsets, cols, num_decodes=0)
    tables = [torch.randperm(1000, generator=torch.Generator().manual_seed(seed + g))[:6 * len(lens)]
              .view(len(lens), 6).to(torch.int32) for g in range(2)]
    ck = ops.build_metadata(plan, tables[0], lambda v, d: torch.tensor(v, dtype=d))
    md = mod.with_checkpoints(GDNAttentionMetadata(len(lens), qsl[-1], 0, 0, 0, 0, qsl[-1]), ck)
    upstream = lambda self, m, blk, slot: dataclasses.replace(m)  # noqa: E731 (0.32: a copy)
    wrapped = mod._make_regather(upstream, Stack("cuda", "0.32.0"))
    other = getattr(wrapped(None, md, tables[1], None), mod.FIELD)
    want = [tables[1][r, c].item() for r, c in zip(plan.rows, plan.cols)]
    assert other.slots.tolist() == want, f"seed={seed}"
    assert ck.slots.tolist() == [tables[0][r, c].item() for r, c in zip(plan.rows, plan.cols)]
    assert getattr(md, mod.FIELD) is ck and other.plan is ck.plan
