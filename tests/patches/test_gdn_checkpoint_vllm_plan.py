"""The exporter on vLLM 0.33, where vLLM plans the prefill checkpoints and ours writes the states.

vLLM 0.33's ``compute_mamba_prefill_checkpoints`` places a prompt's checkpoint with the
scheduler's ``num_hash_lookahead_tokens`` (EAGLE / MTP lookahead hashes) and on the cache-hit
alignment (``cache_hit_alignment_tokens``: the hash block where fine-grained hits are on, else the
scheduler's block), exactly as its scheduler and ``MambaManager`` reserve and cache the block.
The rule of vLLM 0.30 / 0.32 that ``core.checkpoint_offsets`` carries has neither:

* by hand, a cold prompt of ``k`` blocks and ``r`` tokens (``1 <= r < L``) with a lookahead of
  ``L`` tokens checkpoints at ``(k - 1)`` blocks under 0.33's rule and at ``k`` blocks under the
  old one, into the same column ``k - 1``; with a 64-token hash block but block-aligned hits
  (fine-grained hits off) at ``k`` blocks under 0.33's and at its last 64-token boundary under the
  old one, again the same column: the old planner writes a state that the scheduler caches under
  another position;
* the exporter's plan on a ``vllm=0.33.0`` stack is vLLM's (the builder's ``checkpoint``
  metadata from vLLM's real ``MambaPrefillCheckpointBuilder``) on random batches with a random
  lookahead and alignment: offsets and blocks; the same batch through the old planner (a
  ``vllm=0.32.0`` stack) gives another plan, so the check fails with it;
* vLLM's V2 runner hands the other GDN groups the first group's metadata re-gathered by vLLM's
  ``update_block_table``: the ``gdn-checkpoint-regather`` entry gives them their own blocks;
* the spec and alignment entries stand aside where vLLM declares itself (FlashInfer).

Random batches per test (seed printed on failure); skipped on vLLM < 0.33.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import types

import pytest

torch = pytest.importorskip("torch")
cp = pytest.importorskip("vllm.model_executor.layers.mamba.checkpoint")
if "num_hash_lookahead_tokens" not in inspect.signature(cp.compute_mamba_prefill_checkpoints).parameters:
    pytest.skip("vLLM < 0.33: no lookahead in its checkpoint planner", allow_module_level=True)

from vllm.v1 import kv_cache_interface as kv  # noqa: E402

from vllm_hybrid_npu.core import prefill_checkpoints as core  # noqa: E402
from vllm_hybrid_npu.patches import gdn_prefill_checkpoint as mod  # noqa: E402
from vllm_hybrid_npu.support import Stack  # noqa: E402

V033, V032 = Stack("cpu", "0.33.0"), Stack("cpu", "0.32.0")


def _old(seq_lens, query_lens, *, hash_block, block):
    """vLLM 0.30 / 0.32's rule as the exporter applied it there (``core.checkpoint_offsets``)."""
    return core.checkpoint_offsets(
        seq_lens, query_lens, hash_block_size=hash_block, block_size=block,
        alignment=core.ALIGNMENT, drop_eagle_block=False,
        position_fn=kv.get_mamba_prefill_checkpoint_position,
        valid_fn=kv.is_mamba_prefill_checkpoint_valid)


def _vllm(seq_lens, query_lens, *, hash_block, block, hit_alignment, lookahead):
    return cp.compute_mamba_prefill_checkpoints(
        seq_lens, query_lens, hash_block_size=hash_block, mamba_block_size=block,
        checkpoint_alignment=hit_alignment if hash_block == block else 64, drop_eagle_block=False,
        cache_hit_alignment_tokens=hit_alignment, num_hash_lookahead_tokens=lookahead)


def test_old_rule_disagrees_with_vllm_033_by_hand(rng):
    block = rng.choice([256, 384, 512, 1088])
    k = rng.randrange(2, 6)
    # lookahead L: the last L tokens stay uncached, so the boundary inside them is not a checkpoint
    lookahead = rng.randrange(2, 5)
    n = k * block + rng.randrange(1, lookahead)
    args = dict(hash_block=block, block=block)
    assert _vllm([n], [n], **args, hit_alignment=block, lookahead=lookahead) == \
        ([(k - 1) * block], [k - 1])
    assert _old([n], [n], **args) == ([k * block], [k - 1])
    # prefix-match unit 64 with block-aligned hits (fine-grained hits off: DCP, a manager without
    # sub-block lookups): vLLM 0.33 checkpoints on the block, the old rule on the 64-token grid
    n = k * block + rng.randrange(65, block)
    assert _vllm([n], [n], hash_block=64, block=block, hit_alignment=block, lookahead=0) == \
        ([k * block], [k - 1])
    assert _old([n], [n], hash_block=64, block=block) == ([(n - 1) // 64 * 64], [k - 1])


@dataclasses.dataclass(frozen=True)
class Spec:  # the MambaSpec fields the planner and the builder read
    block_size: int
    dtypes: tuple = (torch.bfloat16, torch.bfloat16)
    num_prefill_checkpoint_blocks: int = 0
    prefill_checkpoint_alignment: int | None = None


def _config(hash_block, hit_alignment, lookahead, prefix_match_unit):
    cache = types.SimpleNamespace(
        mamba_cache_mode="align", enable_prefix_caching=True, hash_block_size=hash_block,
        cache_hit_alignment_tokens=hit_alignment, prefix_match_unit=prefix_match_unit)
    model = types.SimpleNamespace(hf_config=types.SimpleNamespace(
        architectures=["Qwen3NextForCausalLM"]), dtype=torch.bfloat16)
    return types.SimpleNamespace(cache_config=cache, model_config=model, speculative_config=None,
                                 num_hash_lookahead_tokens=lookahead)


def _batch(rng, block, lookahead, hash_block):
    """(seq_lens, query_lens, decodes): decode rows first, then one cold row whose checkpoint the
    lookahead moves, then random cold, chunked (from a block boundary) and resumed rows; with a
    hash block below the block, last, a row resumed from a hit inside a block (on the hash grid)
    that runs past two block boundaries, as vLLM schedules one with an internal checkpoint."""
    decodes = rng.randrange(0, 3)
    seq = [rng.randrange(10, 6 * block) for _ in range(decodes)]
    qlen = [1] * decodes
    n = rng.randrange(2, 5) * block + rng.randrange(1, max(2, lookahead))
    seq.append(n)
    qlen.append(n)
    for _ in range(rng.randrange(1, 4)):
        end = rng.randrange(block + 2, 6 * block)
        start = rng.choice([0, rng.randrange(0, end // block) * block, rng.randrange(0, end - 1)])
        seq.append(end)
        qlen.append(end - start)
    if hash_block < block:
        first = rng.randrange(0, 3)
        start = first * block + hash_block * rng.randrange(1, block // hash_block)
        end = rng.randrange((first + 2) * block + 65, (first + 4) * block)
        seq.append(end)
        qlen.append(end - start)
    return seq, qlen, decodes


def _step(rng, seq, qlen, block, config, offsets):
    n = len(seq)
    qsl = [0]
    for q in qlen:
        qsl.append(qsl[-1] + q)
    cols = max(-(-s // block) for s in seq) + 1
    table = torch.tensor(rng.sample(range(1, 10_000), n * cols), dtype=torch.int32).view(n, cols)
    for r, (s, q) in enumerate(zip(seq, qlen)):  # align mode: vLLM's null block (0) but in the
        # initial state's column, the running state's and the checkpoint's (``offsets``: vLLM's)
        real = {(s - q - 1) // block, -(-s // block) - 1} | ({-(-s // block) - 2} if offsets[r] else set())
        table[r, [c for c in range(cols) if c not in real]] = 0
    common = types.SimpleNamespace(
        num_reqs=n, query_start_loc_cpu=torch.tensor(qsl, dtype=torch.int32),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens_cpu_upper_bound=torch.tensor(seq, dtype=torch.int32), block_table_tensor=table)
    return common, table, qsl


def test_plan_on_vllm_033_is_vllms_and_not_the_old_rules(rng, seed, monkeypatch):
    monkeypatch.delenv(mod.ENV_VAR, raising=False)
    block = rng.choice([256, 384, 512])
    fine = rng.random() < 0.5  # fine-grained hits: hash block and cache-hit alignment 64
    hash_block, hit_alignment = (64, 64) if fine else (rng.choice([64, block]), block)
    lookahead = rng.randrange(2, 5)
    config = _config(hash_block, hit_alignment, lookahead, hash_block if hash_block != block else None)
    # the declaration the spec entry makes on 0.33: alignment = vLLM's grid
    spec = core.declare(Spec(block), 64 if hash_block != block else block)
    seq, qlen, decodes = _batch(rng, block, lookahead, hash_block)
    want = cp.compute_mamba_prefill_checkpoints(
        seq, qlen, hash_block_size=hash_block, mamba_block_size=block,
        checkpoint_alignment=spec.prefill_checkpoint_alignment, drop_eagle_block=False,
        cache_hit_alignment_tokens=hit_alignment, num_hash_lookahead_tokens=lookahead)
    common, table, qsl = _step(rng, seq, qlen, block, config, want[0])
    planned = cp.MambaPrefillCheckpointBuilder(config, spec).build(common, list(range(len(seq))))
    assert planned is not None, f"seed={seed}: the cold row has a checkpoint"
    metadata = types.SimpleNamespace(num_prefills=len(seq) - decodes, num_decodes=decodes,
                                     spec_sequence_masks=None, checkpoint=planned)
    builder = types.SimpleNamespace(kv_cache_spec=spec, vllm_config=config)

    # the engine's list (core.step_checkpoints, from the request's blocks and the checkpoint its
    # manager reserved where vLLM plans one), held for the step as the runner entry holds it
    rows = table.tolist()
    sent = {r: core.step_checkpoints(
        seq[r] - qlen[r], seq[r], block,
        (seq[r] - qlen[r] + off, -(-seq[r] // block) - 2) if off else None, rows[r])
        for r, off in enumerate(want[0]) if qlen[r] > 1}

    def plan_of(stack):
        with _engine_list(builder, sent):
            ck = mod.build_checkpoints(builder, common, metadata, stack, lambda b, d: None)
        return (ck.plan.rows, ck.plan.offsets, ck.slots.tolist()) if ck else None

    # by hand: column cdiv(seq_len, block) - 2 of each checkpointed row, and before it, where a
    # prefill row starts mid-block and runs past its next boundary before that column (or, with
    # no checkpoint, the running state's), the initial state's block (column start // block)
    # with the state at that boundary
    ckpts = []
    for r, off in enumerate(want[0]):
        start, limit = seq[r] - qlen[r], -(-seq[r] // block) - (2 if off else 1)
        if qlen[r] > 1 and start % block and start // block < limit:
            ckpts.append((r, block - start % block, int(table[r, start // block])))
        if off:
            ckpts.append((r, off, int(table[r, -(-seq[r] // block) - 2])))
    expected = tuple(zip(*ckpts))
    expected = (expected[0], expected[1], list(expected[2]))
    assert plan_of(V033) == expected, f"seed={seed}"
    assert plan_of(V032) != expected, f"seed={seed}: the old planner agreed on {seq}, {qlen}"


@contextlib.contextmanager
def _engine_list(builder, lists):
    """The engine's explicit checkpoints ``lists`` (``{batch row: ((position, block id, kind),
    ...)}``) held for the step, as ``gdn-checkpoint-receive`` holds them for a V1 runner whose one
    KV-cache group's builder is ``builder``."""
    rows = max(lists, default=-1) + 1
    runner = types.SimpleNamespace(
        attn_groups=[[types.SimpleNamespace(metadata_builders=[builder])]],
        input_batch=types.SimpleNamespace(req_ids=[f"r{i}" for i in range(rows)]))
    token = mod.STEP.set((runner, {0: {f"r{r}": v for r, v in lists.items() if v}}))
    try:
        yield
    finally:
        mod.STEP.reset(token)


def _regather_case(rng):
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata

    n, width = rng.randrange(2, 6), rng.randrange(3, 8)
    offsets = [rng.choice([0, 64 * rng.randrange(1, 4)]) for _ in range(n)]
    offsets[-1] = 64
    qsl = [0]
    for off in offsets:
        qsl.append(qsl[-1] + off + rng.randrange(1, 200))
    cols = [rng.randrange(width) for _ in range(n)]
    tables = [torch.tensor(rng.sample(range(g * 1000, g * 1000 + 1000), n * width),
                           dtype=torch.int32).view(n, width) for g in range(2)]  # disjoint
    rows_t, cols_t = torch.arange(n), torch.tensor(cols)
    planned = cp.MambaPrefillCheckpointMetadata(
        torch.tensor(offsets, dtype=torch.int32), tables[0][rows_t, cols_t], offsets=offsets,
        request_rows=rows_t, block_cols=cols_t)
    plan = core.plan_step(qsl, offsets, [0] * n, 0)
    ours = mod.ops.build_metadata(plan, planned.state_indices[:, None],
                                  lambda v, d: torch.tensor(v, dtype=d))
    md = mod.with_checkpoints(GDNAttentionMetadata(
        n, qsl[-1], 0, 0, 0, 0, qsl[-1], checkpoint=planned,
        non_spec_state_indices_tensor=tables[0][:, 0]), ours)
    return md, tables, plan, cols


def test_regather_gives_each_group_its_own_blocks(rng, seed):
    """vLLM's real ``update_block_table`` (a builder of the V2 runner on CUDA, made here without
    its ``__init__``): the metadata of group 0 re-gathered for group 1's block table."""
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder as B

    md, tables, plan, cols = _regather_case(rng)
    builder = object.__new__(B)
    builder.vllm_config = types.SimpleNamespace(
        cache_config=types.SimpleNamespace(mamba_cache_mode="align"))
    builder.mamba_aligned_state_indices, builder.num_spec = tables[1], 0
    builder.use_full_cuda_graph = False
    by_hand = [int(tables[1][r, cols[r]]) for r in plan.rows]
    stale = B.update_block_table(builder, md, tables[1], None)
    assert getattr(stale, mod.FIELD).slots.tolist() != by_hand, f"seed={seed}"  # without the entry
    out = mod._make_regather(B.update_block_table, V033)(builder, md, tables[1], None)
    assert out.checkpoint.state_indices[list(plan.rows)].tolist() == by_hand, f"seed={seed}"
    assert getattr(out, mod.FIELD).slots.tolist() == by_hand, f"seed={seed}"
    assert getattr(out, mod.FIELD).plan is plan


def test_spec_and_alignment_stand_aside_where_vllm_declares(monkeypatch):
    monkeypatch.delenv(mod.ENV_VAR, raising=False)
    declared = types.SimpleNamespace(num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=384)
    spec = mod._make_spec(lambda self, cfg: declared, V033)
    assert spec(None, None) is declared  # vLLM's own declaration (FlashInfer), untouched
    layer = types.SimpleNamespace(vllm_config=_config(384, 384, 0, None))
    align = mod._make_alignment(lambda self: None, V033)
    assert align(layer) == 64  # ours exports (CPU): the layer reports the checkpoint alignment
    assert mod._make_alignment(lambda self: 128, V033)(layer) == 128  # vLLM's own
    monkeypatch.setenv(mod.ENV_VAR, "off")
    assert align(layer) is None


def test_no_field_where_vllm_exports_itself(rng, seed, monkeypatch):
    """vLLM 0.33 with its own export (FlashInfer on CUDA: ``exporter_path`` is None, the spec
    entry stood aside): the builder attaches nothing, even with vLLM's plan in the metadata, so
    the layer wrapper calls upstream alone."""
    monkeypatch.delenv(mod.ENV_VAR, raising=False)
    block = 384
    config = _config(block, block, 0, None)
    spec = core.declare(Spec(block), block)
    seq, qlen = [900, 1000], [1, 1000]
    want = cp.compute_mamba_prefill_checkpoints(
        seq, qlen, hash_block_size=block, mamba_block_size=block,
        checkpoint_alignment=spec.prefill_checkpoint_alignment, drop_eagle_block=False,
        cache_hit_alignment_tokens=block, num_hash_lookahead_tokens=0)
    common, _, _ = _step(rng, seq, qlen, block, config, want[0])
    planned = cp.MambaPrefillCheckpointBuilder(config, spec).build(common, [0, 1])
    assert planned is not None, f"seed={seed}"
    metadata = types.SimpleNamespace(num_prefills=1, num_decodes=1, spec_sequence_masks=None,
                                     checkpoint=planned)
    for path, attached in ((None, False), ("cpu", True)):
        monkeypatch.setattr(mod, "exporter_path", lambda c, t, _p=path: (_p, "" if _p else "flashinfer"))
        builder = types.SimpleNamespace(kv_cache_spec=spec, vllm_config=config)
        ck = mod.build_checkpoints(builder, common, metadata, V033, lambda b, d: None)
        assert (ck is not None) == attached, f"seed={seed}, path {path}"


def test_crossing_row_written_where_vllm_plans_nothing(monkeypatch):
    """vLLM 0.33's builder plans nothing for a step whose rows have no checkpoint (its
    ``checkpoint`` is None), e.g. a row from a hit at 512 that a shared-prefix junction stop
    clips at 896, past the boundary 768 (block 384, prefix-match unit 64). By hand: the engine's
    list names the state at 768 (offset 256) in that row's initial state's block, column 1, and
    the CPU path writes it; a decode row and a row on the block grid add nothing; without the
    list the worker plans nothing (it reads no block-table column for it)."""
    monkeypatch.delenv(mod.ENV_VAR, raising=False)
    block = 384
    config = _config(64, 64, 0, 64)
    spec = core.declare(Spec(block), 64)
    seq, qlen = [700, 896, 1152], [1, 384, 384]
    common, _, _ = _step(types.SimpleNamespace(sample=lambda r, k: list(range(1, k + 1))), seq, qlen,
                         block, config, [0, 0, 0])
    table = common.block_table_tensor
    metadata = types.SimpleNamespace(num_prefills=2, num_decodes=1, spec_sequence_masks=None,
                                     checkpoint=None)
    builder = types.SimpleNamespace(kv_cache_spec=spec, vllm_config=config)
    assert mod.build_checkpoints(builder, common, metadata, V033, lambda b, d: None) is None
    rows = table.tolist()  # the engine's list: the crossed boundary in the initial state's block
    sent = {r: core.step_checkpoints(s - q, s, block, None, rows[r])
            for r, (s, q) in enumerate(zip(seq, qlen)) if q > 1}
    assert sent == {1: ((768, rows[1][1], "crossed"),), 2: ()}
    with _engine_list(builder, sent):
        ck = mod.build_checkpoints(builder, common, metadata, V033, lambda b, d: None)
    assert ck is not None and (ck.plan.rows, ck.plan.offsets) == ((1,), (256,))
    assert ck.slots.tolist() == [int(table[1, 1])] and int(table[1, 1]) != 0
