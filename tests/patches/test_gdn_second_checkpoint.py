"""``VLLM_HYBRID_NPU_OPTIONS=second=on`` (:mod:`vllm_hybrid_npu.patches.gdn_second_checkpoint`,
vLLM 0.30, the CPU path and CUDA's one pass): a prompt whose GDN checkpoint ``cp`` lies inside its last block
keeps the state at that block's start ``q`` too, in a second block outside the block table.

On vLLM's real ``Scheduler`` and KV-cache manager (tiny hybrid, block 256, ``--prefix-match-unit
64``, the exporter's checkpoint declared), requests run one at a time (one sampled token each),
lengths drawn fresh, hand-counted:

* a cold prompt of ``L`` tokens, ``cp = (L - 1) // 64 * 64`` off the block grid: one prefill step
  either way; vLLM keys the checkpoint column ``c = cdiv(L, 256) - 2`` at ``cp`` and nothing at
  ``q = cp // 256 * 256``; with ``on`` the column keeps ``q`` and the second block ``E`` is keyed
  at ``cp``, and the step's ``SchedulerOutput`` names ``E`` and ``cp`` for each GDN KV-cache group;
* a prompt sharing the first one's first ``q + d`` tokens (``d < cp - q``) hits ``q`` with
  ``on``, less without; a repeat hits ``cp`` either way;
* ``E`` goes back to the pool with its request (no block leaks: every block free once all
  requests finished) and stays cached there;
* no second block for a checkpoint on the block grid, a non-final chunk (a prompt over the token
  budget) or a hit that leaves ``q`` behind.
(The engine, with the bytes the step writes: ``e2e/test_prefill_checkpoints.py::test_second_checkpoint_keeps_the_block_boundary``.)
"""

from __future__ import annotations

import json
import random

import pytest

pytest.importorskip("vllm")

from vllm_hybrid_npu.patches import gdn_mamba_manager as M  # noqa: E402
from vllm_hybrid_npu.patches import gdn_second_checkpoint as S  # noqa: E402
from vllm_hybrid_npu.patches import gdn_step_checkpoints as P  # noqa: E402
from vllm_hybrid_npu.envs import OPTIONS_ENV  # noqa: E402

B, UNIT = 256, 64
#: the Mamba managers' hooks, which run the second block's rules
SECOND = tuple(p.name for p in M.PATCHES if "cpu" in p.targets)
#: those hooks and the engine's plan that sends the block (and the runner's receive)
ENTRIES = SECOND + ("gdn-checkpoint-send", "gdn-checkpoint-receive")


def _cpu_stack():
    """This machine's stack as the CPU target (whose entries these tests drive; CUDA's differ by
    the V2 runner's receive entry only)."""
    from vllm_hybrid_npu.support import Stack, detect_stack

    stack = detect_stack()
    return Stack(target="cpu", vllm=stack.vllm)


def _outside() -> str | None:
    from vllm_hybrid_npu.patches.registry import stack_skip_reason

    # a hook of vLLM 0.30 alone (the junction hooks apply on 0.32 too)
    return stack_skip_reason(next(p for p in M.PATCHES if p.name == "gdn-manager-cache"), _cpu_stack())


pytestmark = pytest.mark.skipif(_outside() is not None, reason=f"the option second: {_outside()}")


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory):
    from vllm_hybrid_npu_lab.presets import TINY_HYBRID, resolve_model

    d = tmp_path_factory.mktemp("tiny-hybrid-second")
    (d / "config.json").write_text(json.dumps(TINY_HYBRID))
    return resolve_model(str(d))[1]


class Engine:
    """vLLM's real ``Scheduler`` for the tiny hybrid (block 256, ``--prefix-match-unit 64``, the
    exporter's checkpoint declared), run one request at a time."""

    def __init__(self, cfg, budget=2048, scheduler="sync"):
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        from vllm_hybrid_npu_lab.model import build_setup
        from vllm_hybrid_npu_lab.upstream_grid import UpstreamSetting

        setup = build_setup(cfg, kv_cache_bytes=64 << 20, max_model_len=4096, block_size=B,
                            prefill_checkpoints=True, max_num_batched_tokens=budget,
                            tune=UpstreamSetting(pmu=UNIT, ckpt=True).tune)
        if scheduler == "async":  # CUDA's default: caches again when the output comes in
            from vllm.v1.core.sched.async_scheduler import AsyncScheduler as Scheduler
        self.sched = Scheduler(vllm_config=setup.vllm_config, kv_cache_config=setup.kv_cache_config,
                               structured_output_manager=StructuredOutputManager(setup.vllm_config),
                               block_size=setup.scheduler_block_size,
                               hash_block_size=setup.hash_block_size, log_stats=False)
        assert self.sched.cache_config.block_size == B and self.sched.hash_block_size == UNIT
        hash_fn = get_hash_fn_by_name(setup.vllm_config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.hasher = get_request_block_hasher(setup.hash_block_size, hash_fn)
        self.n = 0
        self.outputs = []

    @property
    def mamba(self):
        from vllm.v1.core.single_type_kv_cache_manager import MambaManager

        return [m for m in self.sched.kv_cache_manager.coordinator.single_type_managers
                if isinstance(m, MambaManager)]

    def run(self, prompt):
        """Schedule ``prompt`` (token ids) to its first output token; returns ``(hit tokens,
        prefill steps, the request)``; the request then finishes (max_tokens 1)."""
        from vllm.sampling_params import SamplingParams
        from vllm.v1.outputs import ModelRunnerOutput
        from vllm.v1.request import Request

        self.n += 1
        req = Request(request_id=f"r{self.n}", prompt_token_ids=list(prompt),
                      sampling_params=SamplingParams(max_tokens=1, ignore_eos=True),
                      pooling_params=None, block_hasher=self.hasher)
        self.sched.add_request(req)
        hit, steps = None, 0
        while self.sched.has_unfinished_requests():
            out = self.sched.schedule()
            self.outputs.append(out)
            if hit is None:
                hit = out.scheduled_new_reqs[0].num_computed_tokens
            steps += 1
            done = req.num_computed_tokens >= req.num_tokens
            self.snapshot = {m.kv_cache_group_id: (list(m.req_to_blocks[req.request_id]),
                                                    dict(vars(m).get(S.EXTRA, {})))
                             for m in self.mamba}
            self.sched.update_from_output(out, ModelRunnerOutput(
                req_ids=[req.request_id], req_id_to_index={req.request_id: 0},
                sampled_token_ids=[[7] if done else []]))
        return hit, steps, req


def _prompt(rng, n):
    return [rng.randrange(1, 30000) for _ in range(n)]


def _keys(block):
    return block.block_hash_num_tokens if block.block_hash is not None else None


@pytest.mark.parametrize("scheduler", ["sync", "async"])
@pytest.mark.parametrize("on", [False, True])
def test_second_block_keeps_the_block_boundary(tiny_config, apply_entries, monkeypatch, seed, on,
                                               scheduler):
    rng = random.Random(seed)
    # a cold prompt whose checkpoint lies inside its last block (cp % 256 != 0), 3-4 blocks
    n = rng.choice([x for x in range(2 * B + 65, 4 * B) if ((x - 1) // UNIT * UNIT) % B and x % B])
    cp = (n - 1) // UNIT * UNIT
    q, c = cp // B * B, -(-n // B) - 2
    d = rng.randrange(1, cp - q)  # a second prompt shares q + d tokens, not cp
    where = dict(seed=seed, on=on, n=n, cp=cp, q=q, d=d, scheduler=scheduler)
    monkeypatch.setenv(OPTIONS_ENV, "second=on" if on else "second=off")
    report = apply_entries(*ENTRIES, stack=_cpu_stack())
    # the worker's entry waits for the model runner's module (not imported by a scheduler);
    # the hooks apply either way, the engine decides at its start whether the rule runs
    assert set(SECOND) <= set(report.applied) | set(report.pending), report.line()
    assert not report.failed, report.line()
    eng = Engine(tiny_config, scheduler=scheduler)
    assert bool(vars(eng.sched.kv_cache_manager)[S.MANAGERS]) == on, where
    free0 = eng.sched.kv_cache_manager.block_pool.get_num_free_blocks()
    first = _prompt(rng, n)
    hit, steps, _ = eng.run(first)
    assert (hit, steps) == (0, 1), where
    payload = getattr(eng.outputs[0], P.ATTR, None)
    for m in eng.mamba:
        blocks, extra = eng.snapshot[m.kv_cache_group_id]
        assert _keys(blocks[c]) == (q if on else cp), where
        if on:
            (block, at, col, state), = extra.values()
            assert (at, col, state, _keys(block)) == (cp, c, "sent", cp), where
            # the engine's plan: q in the column's block, cp in the second block
            assert payload[m.kv_cache_group_id] == {"r1": (
                (q, blocks[c].block_id, "boundary"), (cp, block.block_id, "second"))}, where
            assert block.ref_cnt == 0 and block.block_hash is not None, where  # freed, cached
        else:
            assert not extra and payload is None, where
    assert eng.sched.kv_cache_manager.block_pool.get_num_free_blocks() == free0, where
    hit, steps, _ = eng.run(first[:q + d] + _prompt(rng, rng.randrange(65, 2 * B)))
    assert hit == (q if on else 0), where  # vLLM: no GDN state at q (its one state is at cp)
    hit, steps, _ = eng.run(first)
    assert (hit, steps) == (cp, 1), where
    assert eng.sched.kv_cache_manager.block_pool.get_num_free_blocks() == free0, where


def test_no_second_block_where_the_column_holds_it(tiny_config, apply_entries, monkeypatch, seed):
    """A checkpoint on the block grid, a non-final chunk, a hit past ``q``: vLLM's blocks only."""
    rng = random.Random(seed)
    monkeypatch.setenv(OPTIONS_ENV, "second=on")
    apply_entries(*ENTRIES, stack=_cpu_stack())
    on_grid = rng.choice([x for x in range(2 * B + 1, 2 * B + UNIT + 1)])  # cp = 512
    long_n = rng.randrange(1100, 1500)  # over a 1,024-token budget: a non-final first chunk
    eng = Engine(tiny_config, budget=1024)
    free0 = eng.sched.kv_cache_manager.block_pool.get_num_free_blocks()
    where = dict(seed=seed, on_grid=on_grid, long_n=long_n)
    _, steps, _ = eng.run(_prompt(rng, on_grid))
    assert steps == 1 and getattr(eng.outputs[-1], P.ATTR, None) is None, where
    before = len(eng.outputs)
    eng.run(_prompt(rng, long_n))
    sent = [getattr(o, P.ATTR, None) for o in eng.outputs[before:]]
    # the final chunk (from 1,024) takes one where its checkpoint lies inside its last block
    cp = (long_n - 1) // UNIT * UNIT
    final = cp % B and cp // B * B > 1024
    assert sent[0] is None and (sent[-1] is not None) == bool(final), (where, sent)
    # a prompt hitting past q (the first's checkpoint 832, its block's start 768): its rest
    # cannot write 768 (already computed); its own checkpoint fails vLLM's column clause
    first = _prompt(rng, 3 * B + 100)
    eng.run(first)
    before = len(eng.outputs)
    hit, _, _ = eng.run(first[:832] + _prompt(rng, rng.randrange(129, 190)))
    assert hit == 832, where
    assert all(getattr(o, P.ATTR, None) is None for o in eng.outputs[before:]), where
    assert eng.sched.kv_cache_manager.block_pool.get_num_free_blocks() == free0, where


def test_mode_names_the_variable(monkeypatch):
    monkeypatch.setenv(OPTIONS_ENV, "second=yes")
    with pytest.raises(ValueError, match=OPTIONS_ENV):
        S.mode()
    monkeypatch.delenv(OPTIONS_ENV, raising=False)
    assert S.mode() == "off"


def test_worker_plans_both_checkpoints_by_hand(monkeypatch):
    """``gdn_prefill_checkpoint._with_explicit`` with the engine's lists of second blocks: a decode
    row, a cold 700-token row whose checkpoint 640 went to the second block 41 (its column 1,
    block 11, keyed at 512) and a row with a junction at 256 (block 21) starting at 0 with 900
    tokens, second block 42 for its checkpoint 896 (block 23 at 768): the rows' checkpoints by
    hand, the ``j``-th of a row's list in column ``width + j``; then the blocks the checkpoints
    are written to (``ops.build_metadata``): the engine's, uploaded once for every KV-cache group
    the engine listed alike (``_named_blocks``), each group its own."""
    import torch

    from vllm_hybrid_npu.core import prefill_checkpoints as core
    from vllm_hybrid_npu.ops import gdn_checkpoint as ops
    from vllm_hybrid_npu.patches import gdn_prefill_checkpoint as gdn

    table = torch.tensor([[5, 0, 0, 0], [0, 11, 12, 0], [21, 0, 23, 24]], dtype=torch.int32)
    seq_lens, qlens = [57, 700, 900], [1, 700, 900]
    sent = {1: ((512, 11, "boundary"), (640, 41, "second")),
            2: ((256, 21, "junction"), (768, 23, "boundary"), (896, 42, "second"))}
    offsets, cols, junctions = gdn._with_explicit(sent, seq_lens, qlens, [0, 640, 896], [-1, 1, 2], 4)
    assert (offsets, cols) == ([0, 640, 896], [-1, 5, 6])
    assert junctions == {1: [(512, 4)], 2: [(256, 4), (768, 5)]}
    plan = core.plan_step([0, 1, 701, 1601], offsets, cols, 1, junctions=junctions)
    assert [(r, o, c) for r, o, c in zip(plan.rows, plan.offsets, plan.cols)] == \
        [(1, 512, 4), (1, 640, 5), (2, 256, 4), (2, 768, 5), (2, 896, 6)]
    # two KV-cache groups listed alike (other blocks in group 3), one listing other positions:
    # one upload (vLLM's async_tensor_h2d on a device: pinned) of both alike groups' blocks
    other = {1: ((512, 61, "boundary"), (640, 62, "second")),
             2: ((256, 63, "junction"), (768, 64, "boundary"), (896, 65, "second"))}
    payload = {0: {"a": sent[1], "b": sent[2]}, 3: {"a": other[1], "b": other[2]},
               5: {"a": ((576, 71, "prompt"),), "b": sent[2]}}
    rids = ["d", "a", "b"]
    up_calls = []
    up = lambda values, dtype: up_calls.append((list(values), dtype)) or torch.tensor(values, dtype=dtype)
    monkeypatch.setattr(gdn, "_NAMED", [None, {}])
    named0 = gdn._named_blocks((payload, 0, rids), plan, 4, None, up)
    named3 = gdn._named_blocks((payload, 3, rids), plan, 4, None, up)
    assert up_calls == [([11, 41, 21, 23, 42, 61, 62, 63, 64, 65], torch.int64)]
    monkeypatch.setattr(ops, "_SHARED", [None, None])
    md0 = ops.build_metadata(plan, table, up, "split", named=named0)
    md3 = ops.build_metadata(plan, table, up, "split", named=named3)
    assert md0.slots.tolist() == [11, 41, 21, 23, 42] and md3.slots.tolist() == [61, 62, 63, 64, 65]
    assert md3.conv_end is md0.conv_end  # the plan's tensors, uploaded once for the step
    # a row whose own plan is not the engine's (offset 576): the engine's list is written (the
    # blocks its KV-cache manager keys), nothing at 576
    offsets, cols, junctions = gdn._with_explicit({1: sent[1]}, seq_lens, qlens, [0, 576, 0],
                                                  [-1, 1, -1], 4)
    assert (offsets, cols, junctions) == ([0, 640, 0], [-1, 5, -1], {1: [(512, 4)]})
    # rows the table decides beside a named row: row 2's own checkpoint 896 in its column 3
    plan = core.plan_step([0, 1, 701, 1601], [0, 640, 896], [-1, 5, 3], 1, junctions=junctions)
    named = gdn._named_blocks(({0: {"a": sent[1]}}, 0, rids), plan, 4, None, up)
    md = ops.build_metadata(plan, table, up, "split", named=named)
    assert md.slots.tolist() == [11, 41, 24]
    with pytest.raises(ValueError, match="named blocks"):
        ops.build_metadata(plan, table, up, "split")
    # a listed position outside the row's chunk (a stale list): refused
    with pytest.raises(RuntimeError, match="outside the row's chunk"):
        gdn._with_explicit({1: ((700, 11, "junction"),)}, seq_lens, qlens, [0, 0, 0], [-1, -1, -1], 4)


def test_payload_survives_the_multiprocess_executor():
    """vLLM's multiprocess executor pickles the ``SchedulerOutput`` (``MessageQueue.enqueue``); the
    attribute the scheduler entry sets (plain ints and strings) survives, and a scheduler output
    without it reads as no payload."""
    import pickle

    from vllm.v1.core.sched.output import SchedulerOutput

    out = SchedulerOutput.make_empty()
    assert getattr(pickle.loads(pickle.dumps(out)), P.ATTR, None) is None
    payload = {1: {"r7": ((512, 11, "boundary"), (640, 41, "second"))}}
    setattr(out, P.ATTR, payload)
    assert getattr(pickle.loads(pickle.dumps(out, pickle.HIGHEST_PROTOCOL)), P.ATTR) == payload


def test_engine_without_the_path_takes_no_second_block(tiny_config, apply_entries, monkeypatch, seed):
    """``gdn-manager-engine``: the scheduler of an engine whose exporter path cannot write both
    states (here CUDA's V1 model runner: ``junctions_off`` says why) turns the second block off
    for its KV-cache manager: vLLM's keys, no payload, even with the variable on."""
    from vllm_hybrid_npu.support import Stack

    rng = random.Random(seed)
    monkeypatch.setenv(OPTIONS_ENV, "second=on")
    monkeypatch.delenv("FLA_USE_FAST_OPS", raising=False)
    cuda = [p.name for p in M.PATCHES if "cuda" in p.targets] + ["gdn-checkpoint-send"]
    report = apply_entries(*cuda, stack=Stack("cuda", _cpu_stack().vllm))
    assert set(report.applied) == set(cuda), report.line()
    eng = Engine(tiny_config)
    assert not eng.sched.vllm_config.use_v2_model_runner
    assert vars(eng.sched.kv_cache_manager)[S.MANAGERS] == ()
    n = rng.choice([x for x in range(2 * B + 65, 4 * B) if ((x - 1) // UNIT * UNIT) % B and x % B])
    cp = (n - 1) // UNIT * UNIT
    eng.run(_prompt(rng, n))
    assert getattr(eng.outputs[0], P.ATTR, None) is None, (seed, n)
    for m in eng.mamba:
        blocks, extra = eng.snapshot[m.kv_cache_group_id]
        assert _keys(blocks[-(-n // B) - 2]) == cp and not extra, (seed, n)
