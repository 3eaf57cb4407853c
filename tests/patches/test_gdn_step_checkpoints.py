"""The engine's explicit checkpoints (:mod:`vllm_hybrid_npu.patches.gdn_step_checkpoints`):
planned where the KV-cache manager placed their blocks, sent on the ``SchedulerOutput``, held by
the model runner for the GDN metadata builders, which read no block-table column for them.

Hand-counted, block 384 (0 is vLLM's null block):

* :func:`core.step_checkpoints` per chunk: a row started mid-block lists the boundary it crosses
  in the initial state's block and any block past it; a sharer from 0 lists its junction block
  and its own checkpoint; a chunk with no block between its start and its checkpoint lists
  nothing (vLLM's one checkpoint, which the worker plans itself); a second block lists the block
  boundary and the sub-block checkpoint;
* :func:`plan` on a scheduler's records: requests of one scheduled token are not looked at; a
  second block cached this step is listed and marked sent, one taken but not cached is marked
  unused; nothing where nothing is listed;
* the runner entries: the list is held for the step only, rows by the runner's batch order (the
  V1 ``input_batch``; the V2 runner's order recorded by ``prepare_attn``);
* the builder (vLLM 0.30 on CUDA, V2 runner): the rows' checkpoints from the list, their blocks
  the list's ids whatever the device table holds;
* the mid-block stop stands aside where CUDA's one pass writes the crossed boundary.
"""

from __future__ import annotations

import types

import pytest

torch = pytest.importorskip("torch")

from vllm_hybrid_npu.core import prefill_checkpoints as core  # noqa: E402
from vllm_hybrid_npu.patches import gdn_prefill_checkpoint as gpc  # noqa: E402
from vllm_hybrid_npu.patches import gdn_second_checkpoint as second  # noqa: E402
from vllm_hybrid_npu.patches import gdn_step_checkpoints as P  # noqa: E402
from vllm_hybrid_npu.support import Stack  # noqa: E402
from vllm_hybrid_npu.envs import OPTIONS_ENV  # noqa: E402

B = 384
CUDA = Stack("cuda", "0.30.0")


@pytest.fixture(autouse=True)
def _cuda_junctions_on(monkeypatch):
    """CUDA's junction export (the option ``junctions``, default on): on in every test
    here, whatever the caller's environment says."""
    monkeypatch.setenv(OPTIONS_ENV, "junctions=on")


def test_step_checkpoints_by_hand():
    # (start, end, the manager's checkpoint, block ids by column) -> the list
    assert core.step_checkpoints(1024, 1753, B, (1536, 3), [0, 0, 7, 9, 11, 0]) == (
        (1152, 7, "crossed"), (1536, 9, "prompt"))
    assert core.step_checkpoints(1000, 1152, B, None, [0, 0, 5]) == ()  # inside one block
    assert core.step_checkpoints(0, 1500, B, (1152, 2), [0, 21, 22, 23]) == (
        (768, 21, "junction"), (1152, 22, "prompt"))
    # a budget chunk from 1024 past 1152 and 1536, no checkpoint of its own: the initial state's
    # block takes 1152, the manager's block in column 4 the chunk's last boundary 1920
    assert core.step_checkpoints(1024, 2000, B, None, [41, 42, 43, 0, 44, 45]) == (
        (1152, 43, "crossed"), (1920, 44, "junction"))
    assert core.step_checkpoints(0, 1100, B, (768, 1), [0, 6, 12]) == ()  # vLLM's own only
    # a second block: q = 1536 stays in column 3 (block 21), cp = 1664 goes to block 50
    assert core.step_checkpoints(0, 1700, B, (1664, 3), [0, 0, 0, 21, 22], (50, 1664)) == (
        (1536, 21, "boundary"), (1664, 50, "second"))


def _block(i):
    return types.SimpleNamespace(block_id=i, is_null=i == 0)


def _manager(group, rows, checkpoints, extras=None):
    m = types.SimpleNamespace(block_size=B, kv_cache_group_id=group,
                              req_to_blocks={r: [_block(i) for i in ids] for r, ids in rows.items()},
                              _checkpoints=dict(checkpoints))
    if extras is not None:
        vars(m)[second.EXTRA] = extras
    return m


def test_plan_reads_the_managers_records():
    rows = {"dec": [31, 32, 33], "hit": [0, 0, 7, 9, 11], "cold": [0, 6, 12], "sec": [0, 0, 0, 21, 22],
            "late": [0, 0, 0, 24, 25]}
    e, late = _block(50), _block(51)
    extras = {"sec": [e, 1664, 3, "keyed"], "late": [late, 1664, 3, "new"]}
    managers = (_manager(1, rows, {"hit": (1536, 3), "cold": (768, 1), "late": (1664, 3)}, extras),
                _manager(3, {"hit": [0, 0, 8, 10, 12]}, {"hit": (1536, 3)}))
    # num_computed_tokens after vLLM's _update_after_schedule: each chunk's end
    computed = {"dec": 1001, "hit": 1753, "cold": 1100, "sec": 1700, "late": 1700}
    sched = types.SimpleNamespace(requests={r: types.SimpleNamespace(num_computed_tokens=n)
                                            for r, n in computed.items()})
    out = types.SimpleNamespace(num_scheduled_tokens={"dec": 1, "hit": 729, "cold": 1100,
                                                      "sec": 1700, "late": 1700})
    payload = P.plan(sched, out, managers)
    assert payload == {
        1: {"hit": ((1152, 7, "crossed"), (1536, 9, "prompt")),
            "sec": ((1536, 21, "boundary"), (1664, 50, "second"))},
        3: {"hit": ((1152, 8, "crossed"), (1536, 10, "prompt"))}}
    assert extras["sec"][3] == "sent" and extras["late"][3] == "unused"
    assert P.plan(sched, types.SimpleNamespace(num_scheduled_tokens={"dec": 1}), managers) == {}


def test_send_and_receive_hold_the_list_for_one_step(monkeypatch):
    seen = []
    send = P._make_send(lambda self, out: None, CUDA)
    sched = types.SimpleNamespace(requests={"a": types.SimpleNamespace(num_computed_tokens=1753)})
    vars(sched)[P.MANAGERS] = (_manager(0, {"a": [0, 0, 7, 9, 11]}, {"a": (1536, 3)}),)
    out = types.SimpleNamespace(num_scheduled_tokens={"a": 729})
    send(sched, out)
    assert getattr(out, P.ATTR) == {0: {"a": ((1152, 7, "crossed"), (1536, 9, "prompt"))}}
    vars(sched)[P.MANAGERS] = ()  # an engine whose path writes one checkpoint per row
    quiet = types.SimpleNamespace(num_scheduled_tokens={"a": 729})
    send(sched, quiet)
    assert not hasattr(quiet, P.ATTR)

    builder = object()
    runner = types.SimpleNamespace(
        attn_groups=[[types.SimpleNamespace(metadata_builders=[object()])],
                     [types.SimpleNamespace(metadata_builders=[builder])]],
        input_batch=types.SimpleNamespace(req_ids=["b", "a"]))
    out = types.SimpleNamespace(**{P.ATTR: {1: {"a": ((1152, 7, "crossed"),)}}})
    receive = P._make_receive(lambda self, so: seen.append(gpc._step_checkpoints(builder, 2)), CUDA)
    receive(runner, out)
    assert seen == [{1: ((1152, 7, "crossed"),)}]  # batch row 1 is request "a"
    assert gpc.STEP.get() is None and gpc._step_checkpoints(builder, 2) == {}  # the step is over
    # the V2 runner: its batch order from prepare_attn; prefill context parallel: none
    v2 = types.SimpleNamespace(pcp_manager=None, **vars(runner))
    P._make_v2_rows(lambda self, batch: None, CUDA)(v2, types.SimpleNamespace(req_ids=["a", "b"]))
    seen.clear()
    receive(v2, out)
    assert seen == [{0: ((1152, 7, "crossed"),)}]
    v2.pcp_manager = object()
    P._make_v2_rows(lambda self, batch: None, CUDA)(v2, types.SimpleNamespace(req_ids=["a", "b"]))
    seen.clear()
    receive(v2, out)
    assert seen == [{}]


def test_builder_plans_the_engines_checkpoints(monkeypatch):
    from vllm_hybrid_npu.ops import gdn_checkpoint as ops
    from vllm_hybrid_npu.patches import registry

    monkeypatch.delenv(gpc.ENV_VAR, raising=False)
    monkeypatch.delenv("FLA_USE_FAST_OPS", raising=False)
    monkeypatch.setattr(registry.REPORT, "stack", CUDA)
    monkeypatch.setattr(gpc, "exporter_path", lambda config, target: ("triton", ""))
    monkeypatch.setattr(ops, "_SHARED", [None, None])
    # a decode; a second sharer from 0 (junction 768, own checkpoint 1152); a budget chunk from
    # 1024 to 2000 crossing 1152 (initial state's block 43) with its last boundary 1920 (block 44)
    device = torch.tensor([[31, 32, 33, 0, 0, 0], [0, 21, 22, 23, 0, 0], [41, 42, 43, 0, 44, 45]],
                          dtype=torch.int32)
    spec = types.SimpleNamespace(block_size=B, num_prefill_checkpoint_blocks=1,
                                 prefill_checkpoint_alignment=core.ALIGNMENT)  # core.declare's
    config = types.SimpleNamespace(
        speculative_config=None, use_v2_model_runner=True, kv_transfer_config=None,
        cache_config=types.SimpleNamespace(prefix_match_unit=None),
        parallel_config=types.SimpleNamespace(decode_context_parallel_size=1))
    builder = types.SimpleNamespace(kv_cache_spec=spec, vllm_config=config)
    common = types.SimpleNamespace(
        num_reqs=3, query_start_loc_cpu=torch.tensor([0, 1, 1501, 2477], dtype=torch.int32),
        seq_lens_cpu_upper_bound=torch.tensor([1000, 1500, 2000], dtype=torch.int32),
        block_table_tensor=device)
    metadata = types.SimpleNamespace(num_prefills=2, num_decodes=1, spec_sequence_masks=None)
    runner = types.SimpleNamespace(attn_groups=[[types.SimpleNamespace(metadata_builders=[builder])]],
                                   input_batch=types.SimpleNamespace(req_ids=["d", "s", "b"]))
    payload = {0: {"s": ((768, 21, "junction"), (1152, 22, "prompt")),
                   "b": ((1152, 43, "crossed"), (1920, 44, "junction"))}}
    token = gpc.STEP.set((runner, payload))
    try:
        ck = gpc.build_checkpoints(builder, common, metadata, CUDA, lambda b, d: None)
        device.zero_()  # the device table changes, the plan and its blocks do not
        ops._SHARED[:] = [None, None]
        again = gpc.build_checkpoints(builder, common, metadata, CUDA, lambda b, d: None)
    finally:
        gpc.STEP.reset(token)
    assert ck.method == "fused"
    assert (ck.plan.rows, ck.plan.offsets) == ((1, 1, 2, 2), (768, 1152, 128, 896))
    assert ck.slots.tolist() == [21, 22, 43, 44] == again.slots.tolist() and again.plan == ck.plan
    assert ck.plan.conv_end == (769, 1153, 1629, 2397)
    chunk_map = ck.chunk_map.tolist()
    assert [c for c, i in enumerate(chunk_map) if i >= 0] == [12, 18, 24 + 2, 24 + 14]
    # without the list: vLLM's one checkpoint (row 1's 1152 in its column 2), nothing else
    ops._SHARED[:] = [None, None]
    device[1, 2] = 22
    plain = gpc.build_checkpoints(builder, common, metadata, CUDA, lambda b, d: None)
    assert (plain.plan.rows, plain.plan.offsets, plain.slots.tolist()) == ((1,), (1152,), [22])
    # a second GDN KV-cache group in the same step (the V2 runner builds each group): the
    # group's own blocks, from its list and its table; the plan and its device tensors shared
    other = types.SimpleNamespace(kv_cache_spec=spec, vllm_config=config)
    other_table = device + 100
    runner.attn_groups.append([types.SimpleNamespace(metadata_builders=[other])])
    payload[1] = {"s": ((768, 71, "junction"), (1152, 72, "prompt")),
                  "b": ((1152, 73, "crossed"), (1920, 74, "junction"))}
    token = gpc.STEP.set((runner, payload))
    try:
        first = gpc.build_checkpoints(builder, common, metadata, CUDA, lambda b, d: None)
        second = gpc.build_checkpoints(other, types.SimpleNamespace(
            **{**vars(common), "block_table_tensor": other_table}), metadata, CUDA, lambda b, d: None)
    finally:
        gpc.STEP.reset(token)
    assert first.slots.tolist() == [21, 22, 43, 44] and second.slots.tolist() == [71, 72, 73, 74]
    assert second.plan is first.plan and second.conv_end is first.conv_end
    # a step without lists: each group's checkpoint from its own table
    again = gpc.build_checkpoints(other, types.SimpleNamespace(
        **{**vars(common), "block_table_tensor": other_table}), metadata, CUDA, lambda b, d: None)
    assert again.plan == plain.plan and again.slots.tolist() == [122]


def test_mid_block_stop_stands_aside_where_cuda_writes_the_boundary(monkeypatch):
    """The mid-block stop (``gdn-chunk-end``'s inner layer) on CUDA where the engine plans several checkpoints per
    row (vLLM 0.30, V2 runner): a chunk started mid-block on the 64-token grid runs on (the step
    writes the boundary it crosses); one started off that grid (a prefix-match unit below 64)
    still stops at the boundary (the one pass stores states at chunk starts only)."""
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
