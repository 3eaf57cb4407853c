"""GDN prefill checkpoints on the real engine: no split, the split's hits, the split's states.

Engines (in-process, tiny random Qwen3-Next, align mode, prefix caching on): ``exporter`` (the
plugin's default: the GDN layers export the prompt's checkpoint state from inside the prefill,
:mod:`vllm_hybrid_npu.patches.gdn_prefill_checkpoint`) and ``split`` (the same with
``VLLM_HYBRID_NPU_PREFILL_CHECKPOINTS=off``: vLLM's own block-aligned split). One engine at a time
(``engines.shutdown_engine``).

What is checked, on prompt lengths drawn fresh around block and 64-token boundaries (seed printed
on failure):

* a cold prompt's prefill takes exactly one engine step that computes tokens (caching off takes one; vLLM's split
  two wherever the prompt does not end on its last block boundary, shown by the ``split`` engine);
* the blocks the exporter writes are exactly the blocks vLLM's scheduler (``MambaManager``)
  caches at the checkpoint, one per GDN KV-cache group: plan and scheduler in lockstep (on vLLM
  0.33 the plan is vLLM's own, ``compute_mamba_prefill_checkpoints``);
* its repeat hits the prompt's last block boundary strictly inside it (``(L - 1) // B * B``
  tokens, vLLM's cacheable prefix; the split misses entirely for prompts of exactly ``k`` blocks)
  and, with ``--prefix-match-unit 64`` (vLLM 0.33: a cache-hit alignment of 64 tokens, not the
  block), its last 64-token boundary, with the split's state bytes there too;
* the declared alignment: 64 (vLLM 0.30 / 0.32), vLLM 0.33's grid (the block, or
  ``lcm(--prefix-match-unit, 64)``);
* outputs: a cold prompt's tokens equal the same prompt computed cold again under a fresh
  ``cache_salt`` (same schedule: exact on every target); a hit's tokens equal the cold copy's
  (exact on CPU, where a hit resumes on the kernels' 64-token grid; the tolerance rule of
  ``greedy_compare`` elsewhere);
* the SSM and conv state bytes cached at the checkpoint equal the bytes vLLM's split caches at
  the same position (both engines run vLLM's own kernels);
* a hit inside a block (``--prefix-match-unit 64``) whose last chunk runs past the block's
  boundary, kept there by dense retention or a shared-prefix junction: the block vLLM caches
  there holds that boundary's state, the split's bytes, whether the step writes it (CPU) or the
  chunk stops at the boundary (the other paths, forced here);
* batches that mix several cold prompts, a hit and running decodes; chunked prefill over several
  steps; preemption and resume (a KV cache of 20 pages, vLLM's
  ``scheduler_reserve_full_isl`` off so that prefills outgrow it): outputs equal each prompt
  computed alone, and the repeats hit whole blocks up to the checkpoint;
* a shared-prefix junction's row preempted in the step after its junction step (a KV cache
  counted so that its final chunk cannot be allocated beside a decoder's pages): vLLM preempts
  exactly that row; resumed, it hits the junction block its first chunk wrote, which no later
  step writes; no page stays held; the bytes cached at the junction, and at the junction the
  resumed row itself exports, equal the split's; a third sharer afterwards hits the junction;
* a decoding request preempted and, resumed (prompt and output tokens recomputed), finding a
  shared-prefix junction inside its prompt (its own blocks evicted, a running sharer's attention
  blocks held; pages counted): one prefill step where vLLM's split takes more, the junction and
  checkpoint blocks cached where that step wrote them, with the split's bytes; outputs and a
  third sharer's hit as after the split;
* the option ``ckpt`` (vLLM 0.30) under chunked prefill and a retention
  interval above 0: with ``all`` a non-final chunk's checkpoint is cached and a prompt sharing
  exactly that prefix hits it; with ``final`` it is not (that prompt hits the highest chunk end
  on the retention grid below it), the prompt's own checkpoint still is; the same prefill steps,
  and outputs equal to caching off's, in both modes.
"""

from __future__ import annotations

import contextlib
import math
import os
import uuid

import pytest
from engines import (  # e2e/engines.py
    block_hashes, cached_mamba_blocks, count_scheduled_steps, exporter_outside_stack,
    host_tier_unsupported, mamba_groups, metric_counter, shutdown_engine,
)
from engines import engine_core as _core
from greedy_compare import Sequence, assert_same  # e2e/greedy_compare.py

from vllm_hybrid_npu.envs import OPTIONS_ENV, with_option
from vllm_hybrid_npu.patches.gdn_prefill_checkpoint import ENV_VAR, VLLM_PLAN

# Where the exporter does not apply (a stack outside its support-matrix rows) both engines
# would run vLLM's own split and every comparison here would hold trivially.
_OUTSIDE = exporter_outside_stack()
pytestmark = pytest.mark.skipif(_OUTSIDE is not None, reason=f"exporter not applied: {_OUTSIDE}")

KV_BYTES = 256 << 20


def _engine(model, engine_args, mode: str, env: dict[str, str] | None = None, **extra):
    """An in-process engine: ``exporter`` (the plugin's default), ``split`` (vLLM's own split) or
    ``off`` (prefix caching off). ``env``: more environment variables, set before the engine is
    built and undone by ``_close`` (the engine core runs in this process and reads them here)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    mp.setenv(ENV_VAR, "auto" if mode == "exporter" else "off")
    for name, value in (env or {}).items():
        mp.setenv(name, value)
    from vllm import LLM

    # eager on every target: what is tested is the GDN path, a splitting op that runs eager
    # under CUDA graphs too; it saves the ~3 minutes of compilation per engine on a fresh GPU
    caching = {"enable_prefix_caching": False} if mode == "off" else \
        {"enable_prefix_caching": True, "mamba_cache_mode": "align"}
    llm = LLM(model=str(model), **caching,
              **{**engine_args, "kv_cache_memory_bytes": KV_BYTES, "max_num_seqs": 4,
                 "enforce_eager": True, **extra})
    llm._vhn_steps = count_scheduled_steps(llm)  # type: ignore[attr-defined]
    llm._vhn_mp = mp  # type: ignore[attr-defined]
    if mode == "exporter":
        _ON["junctions"] = _crossing_written(llm)
    return llm


#: ``junctions``: whether the last exporter engine exports junction states (``_crossing_written``)
_ON: dict[str, bool] = {}


def _close(llm):
    if getattr(llm, "_vhn_closed", False):
        return
    llm._vhn_closed = True
    shutdown_engine(llm)
    llm._vhn_mp.undo()


_BLOCK: dict[str, int] = {}


def _block_of(tiny_model_dir, engine_args) -> int:
    """The block (tokens) of the exporter engine at ``KV_BYTES``, recorded with its page count
    (``_BLOCK["pages"]``) by the module's ``exporter`` fixture. A test that runs without it (a
    single test id, ``-k``) starts and closes such an engine here to read both (they were read
    from the fixture only: ``KeyError: 'exporter'``)."""
    if "exporter" not in _BLOCK:
        _close(_record_geometry(_engine(tiny_model_dir("qwen3_next"), engine_args, "exporter")))
    return _BLOCK["exporter"]


def _record_geometry(llm):
    _BLOCK["exporter"] = _block(llm)
    _BLOCK["pages"] = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config.num_blocks
    return llm


@pytest.fixture(scope="module")
def exporter(tiny_model_dir, engine_args):
    llm = _record_geometry(_engine(tiny_model_dir("qwen3_next"), engine_args, "exporter"))
    yield llm
    _close(llm)


def _block(llm) -> int:
    return llm.llm_engine.engine_core.engine_core.vllm_config.cache_config.block_size


def _gen(llm, prompts, max_tokens=1, salt=None, ignore_eos=False):
    from vllm import SamplingParams

    # top 20: a flat distribution ties many tokens; top 5 can miss the other run's pick
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=20, ignore_eos=ignore_eos)
    items = [{"prompt_token_ids": p, **({"cache_salt": salt} if salt else {})} for p in prompts]
    n0 = len(llm._vhn_steps)
    outs = llm.generate(items, sp, use_tqdm=False)
    return outs, len(llm._vhn_steps) - n0


_assert_same = assert_same  # the near-tie rule across schedules (greedy_compare.TIE_NATS)


def _prompt(rng, n):
    return [rng.randrange(100, 900) for _ in range(n)]


def _lengths(rng, block):
    k = rng.randrange(2, 5)
    j = rng.randrange(block // 64 * k + 1, block // 64 * (k + 1))
    return [k * block - 1, k * block, k * block + 1, j * 64 - 1, j * 64 + 1]


def _declared_alignment(llm) -> int:
    """The ``prefill_checkpoint_alignment`` the GDN specs must declare: 64 where ours plans
    (vLLM 0.30 / 0.32); where vLLM plans (0.33), its grid (``get_mamba_prefill_checkpoint_grid``):
    ``lcm(--prefix-match-unit, 64)``, else the block."""
    unit = _core(llm).vllm_config.cache_config.prefix_match_unit
    if _stack_vllm() not in VLLM_PLAN:
        return 64
    return math.lcm(unit, 64) if unit else _block(llm)


def _stack_vllm() -> str | None:
    from vllm_hybrid_npu.support import detect_stack

    return detect_stack().vllm


def _assert_declared(llm) -> None:
    from vllm.v1.kv_cache_interface import MambaSpec

    specs = [g.kv_cache_spec for g in _core(llm).scheduler.kv_cache_config.kv_cache_groups
             if isinstance(g.kv_cache_spec, MambaSpec)]
    assert specs and all(s.num_prefill_checkpoint_blocks == 1 for s in specs)
    assert all(s.prefill_checkpoint_alignment == _declared_alignment(llm) for s in specs), specs
    assert _block(llm) % 64 == 0


def test_checkpoint_declared_and_block_on_grid(exporter):
    _assert_declared(exporter)


@contextlib.contextmanager
def _planned_blocks():
    """The checkpoint blocks the exporter writes while open: every ``slots`` of the step
    metadata it builds (``ops.build_metadata``: the blocks its writes go to, one per checkpoint
    and GDN KV-cache group; on vLLM 0.33 from vLLM's own plan), and of the metadata the V2 runner
    (CUDA) derives for the GDN groups other than the first (``ops.regather``; without it those
    groups' blocks went unseen on vLLM 0.33 on an H200, 2026-11-28)."""
    seen: set[int] = set()
    with _spy_slots(seen.update):
        yield seen


@contextlib.contextmanager
def _spy_slots(record):
    """While open, ``record(slots)`` with the block ids (a list) of every step metadata
    ``ops.build_metadata`` and ``ops.regather`` build (what they return is theirs)."""
    from vllm_hybrid_npu.ops import gdn_checkpoint as ops

    mp = pytest.MonkeyPatch()
    for name in ("build_metadata", "regather"):
        def spy(*args, _real=getattr(ops, name), **kwargs):
            md = _real(*args, **kwargs)
            record(md.slots.tolist())
            return md

        mp.setattr(ops, name, spy)
    try:
        yield
    finally:
        mp.undo()


def _cold_written_where_cached(llm, prompt, position):
    """Run ``prompt`` cold (one request) and check that the blocks the exporter wrote are
    exactly the blocks vLLM's scheduler cached at ``position`` (one per Mamba group): the plan and
    ``MambaManager`` in lockstep. Returns the output and the engine steps."""
    before = block_hashes(llm)
    with _planned_blocks() as planned:
        (out,), steps = _gen(llm, [prompt])
    cached = cached_mamba_blocks(llm, position, before)
    assert sorted(planned) == sorted(cached.values()), (len(prompt), position, planned, cached)
    return out, steps


def test_cold_prompt_one_step_repeat_hits_last_boundary(exporter, rng, exact_across_schedules):
    block = _block(exporter)
    for n in _lengths(rng, block):
        prompt = _prompt(rng, n)
        cold, steps = _cold_written_where_cached(exporter, prompt, (n - 1) // block * block)
        assert steps == 1, f"{n}-token cold prompt took {steps} steps (caching off takes 1)"
        assert cold.num_cached_tokens == 0
        (again,), _ = _gen(exporter, [prompt], salt=uuid.uuid4().hex)
        _assert_same([Sequence.from_output(again.outputs[0])],
                     [Sequence.from_output(cold.outputs[0])], exact=True, cross_schedule=False)
        (hit,), steps = _gen(exporter, [prompt])
        assert hit.num_cached_tokens == (n - 1) // block * block, (n, block)
        assert steps == 1
        _assert_same([Sequence.from_output(cold.outputs[0])],
                        [Sequence.from_output(hit.outputs[0])], exact=exact_across_schedules)


def test_mixed_batch_cold_hit_and_decodes(exporter, rng, exact_across_schedules):
    block = _block(exporter)
    warm = _prompt(rng, 2 * block + rng.randrange(1, block))
    _gen(exporter, [warm])
    colds = [_prompt(rng, rng.randrange(block + 65, 3 * block)) for _ in range(2)]
    hit_prompt = warm + _prompt(rng, rng.randrange(1, 64))
    # one request decoding while the others prefill: it is submitted first with more tokens
    outs, _ = _gen(exporter, [_prompt(rng, 100), *colds, hit_prompt], max_tokens=4)
    assert outs[3].num_cached_tokens == (len(warm) - 1) // block * block
    for prompt, out in zip(colds + [hit_prompt], outs[1:]):
        (ref,), _ = _gen(exporter, [prompt], max_tokens=4, salt=uuid.uuid4().hex)
        _assert_same([Sequence.from_output(ref.outputs[0])],
                        [Sequence.from_output(out.outputs[0])], exact=exact_across_schedules)
    for prompt in colds:  # each cold prompt's checkpoint was cached from inside the batch
        (rep,), _ = _gen(exporter, [prompt])
        assert rep.num_cached_tokens == (len(prompt) - 1) // block * block


def _aten_ops_by_site():
    """A ``TorchDispatchMode`` whose ``sites`` lists, for every aten op dispatched while it is
    open, the innermost Python frame outside torch that issued it (``path:line function``): an
    op counts as the plugin's only where a ``vllm_hybrid_npu`` frame issued it, not where our
    wrapper called a vLLM function that did."""
    import sys

    from torch.utils._python_dispatch import TorchDispatchMode

    class Sites(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.sites: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            f = sys._getframe(1)
            while f is not None and "/torch/" in f.f_code.co_filename:
                f = f.f_back
            self.sites.append(f"{f.f_code.co_filename}:{f.f_lineno} {f.f_code.co_name}" if f else "?")
            return func(*args, **(kwargs or {}))

    return Sites()


def test_decode_steps_do_no_checkpoint_work(exporter, rng):
    """Issue 37 item 3: an engine step with no prefill row (every request decoding; one of
    them the second sharer of a prefix, whose ``shared_prefix_boundary`` vLLM keeps for the
    request's life, one a prompt of its own) runs none of the exporter's planning: no junction
    rule (``JunctionRule.decide`` / ``crossed``), no exporter path or plan
    (``exporter_path``, ``core.plan_step``, the engine's ``core.step_checkpoints``), no step metadata (``ops.build_metadata``,
    ``with_checkpoints``, the CPU rounds), and no aten op issued from a ``vllm_hybrid_npu``
    frame. The decode tokens equal those of the same requests run again under a fresh
    ``cache_salt`` (same schedule)."""
    from vllm import SamplingParams

    from vllm_hybrid_npu.core import prefill_checkpoints as planner
    from vllm_hybrid_npu.ops import gdn_checkpoint as ops
    from vllm_hybrid_npu.patches import gdn_junction
    from vllm_hybrid_npu.patches import gdn_prefill_checkpoint as gdn

    block, engine, sched = _block(exporter), exporter.llm_engine, _core(exporter).scheduler
    if not _junction_exported():  # vLLM 0.33: other managers and plans, not counted here
        pytest.skip("shared-prefix junction entries not applied: the decode-step counts are those of "
                    "the junction rule's versions")
    shared = _prompt(rng, 2 * block + rng.randrange(1, block))
    _gen(exporter, [shared + _prompt(rng, rng.randrange(block, 2 * block))])  # first sharer
    prompts = [shared + _prompt(rng, rng.randrange(block, 2 * block)), _prompt(rng, rng.randrange(65, 2 * block))]
    max_tokens = rng.randrange(8, 25)
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    def run(salt=None):
        ids = [uuid.uuid4().hex for _ in prompts]
        for rid, p in zip(ids, prompts):
            engine.add_request(rid, {"prompt_token_ids": p, **({"cache_salt": salt} if salt else {})}, sp)
        while sched.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running):
            engine.step()
        # the scheduler's request ids are ours with a suffix (vLLM's input processor)
        junctions = {r.request_id.rsplit("-", 1)[0]: r.shared_prefix_boundary for r in sched.running}
        junctions = [junctions[i] for i in ids]
        calls: dict[str, int] = {}
        mp = pytest.MonkeyPatch()
        spied = [(gdn_junction.JunctionRule, "decide"), (gdn_junction.JunctionRule, "crossed"),
                 (gdn, "exporter_path"), (gdn, "with_checkpoints"), (gdn, "_cpu_rounds"),
                 (gdn, "_step_checkpoints"), (planner, "plan_step"), (planner, "step_checkpoints"),
                 (ops, "build_metadata")]
        for owner, name in spied:
            def spy(*a, _real=getattr(owner, name), _name=name, **k):
                calls[_name] = calls.get(_name, 0) + 1
                return _real(*a, **k)

            mp.setattr(owner, name, spy)
        ops_seen, tokens, n0 = _aten_ops_by_site(), {}, len(exporter._vhn_steps)
        try:
            while engine.has_unfinished_requests():
                running = len(sched.running)
                with ops_seen:
                    outs = engine.step()
                assert exporter._vhn_steps[-1] == running, "premise: a decode-only step"
                tokens.update({o.request_id: list(o.outputs[0].token_ids) for o in outs if o.finished})
        finally:
            mp.undo()
        ours = [s for s in ops_seen.sites if "vllm_hybrid_npu/" in s]
        return [tokens[i] for i in ids], junctions, calls, ours, len(exporter._vhn_steps) - n0

    tokens, junctions, calls, ours, steps = run()
    # premise: the second sharer decodes with its junction (vLLM's split would have stopped there)
    assert steps >= max_tokens - 1 and junctions == [len(shared) // block * block, 0], (steps, junctions)
    assert calls == {} and ours == [], (calls, ours[:10])
    again, *_ = run(salt=uuid.uuid4().hex)
    assert again == tokens


def _checkpoint_states(llm, position, before):
    """[(layer name, conv bytes, SSM bytes)] of the states cached at ``position`` tokens since the
    block pool's hashes were ``before`` (``engines.block_hashes``), one block per Mamba KV-cache
    group."""
    import torch

    groups = mamba_groups(llm)
    ctx = _core(llm).model_executor.driver_worker.worker.model_runner.vllm_config \
        .compilation_config.static_forward_context
    out = []
    for group, block_id in sorted(cached_mamba_blocks(llm, position, before).items()):
        for name in groups[group]:
            conv, ssm = ctx[name].kv_cache[0][block_id], ctx[name].kv_cache[1][block_id]
            out.append((name, conv.clone().view(torch.uint8), ssm.clone().view(torch.uint8)))
    return out


@pytest.mark.parametrize("ssm_dtype", ["auto", "float32"])
def test_exported_state_bytes_equal_split(tiny_model_dir, engine_args, exporter, rng, ssm_dtype):
    """The SSM cache in the target's own dtype (``auto``: the model's bf16 on CUDA and on a CPU
    without AVX-512-BF16, float32 with it) and in float32 (Qwen3.5's configs ask for it; on CUDA
    the one-pass kernel casts its float32 running state to either, elsewhere it is the same
    path). Each case ends with its engines closed (the module's own is closed by the first: run
    after the tests that use it)."""
    extra = {} if ssm_dtype == "auto" else {"mamba_ssm_cache_dtype": ssm_dtype}
    if ssm_dtype == "auto":
        llm = exporter
    else:
        _close(exporter)
        llm = _engine(tiny_model_dir("qwen3_next"), engine_args, "exporter", **extra)
    block = _block(llm)
    # off the block grid: a prompt ending on it has no stop before its end on vLLM 0.30 (one step,
    # nothing to compare; drawn 768 at block 256, seed 1387287503 on the no-AVX-512 kind)
    lengths = [n for n in range(2 * block + 64, 4 * block) if n % block]
    prompts = [_prompt(rng, rng.choice(lengths)) for _ in range(3)]
    got = []
    try:
        for p in prompts:
            before = block_hashes(llm)
            _gen(llm, [p])
            got.append(_checkpoint_states(llm, (len(p) - 1) // block * block, before))
    finally:
        _close(llm)
    split = _engine(tiny_model_dir("qwen3_next"), engine_args, "split", **extra)
    try:
        assert _block(split) == block
        for n, p in enumerate(prompts):
            before = block_hashes(split)
            _, steps = _gen(split, [p])
            assert steps == 2, f"vLLM's split took {steps} steps for a {len(p)}-token prompt"
            ref = _checkpoint_states(split, (len(p) - 1) // block * block, before)
            for (name, conv, ssm), (name_s, conv_s, ssm_s) in zip(got[n], ref):
                where = f"SSM cache {ssm_dtype}, prompt {n} ({len(p)} tokens), {name}"
                assert name == name_s
                assert torch_equal(ssm, ssm_s), f"{where}: SSM state"
                assert torch_equal(conv, conv_s), f"{where}: conv"
    finally:
        _close(split)


def _junction_exported() -> bool:
    """The junction entries applied (vLLM 0.30 / 0.32 / 0.33, ``gdn_junction.VERSIONS``) and, on the
    last exporter engine started here, on (``_crossing_written``: the CPU path; CUDA's one pass on
    the V2 runner)."""
    from vllm_hybrid_npu.patches import gdn_junction

    return gdn_junction.rule_applied() and _ON.get("junctions", True)


def _budget_exported() -> bool:
    """:func:`_junction_exported` with the token-budget rule too (vLLM 0.30,
    ``gdn_junction.BUDGET_VERSIONS``)."""
    from vllm_hybrid_npu.patches import gdn_junction

    return gdn_junction.budget_applied() and _ON.get("junctions", True)


def test_shared_prefix_junction_exported_inside_the_step(tiny_model_dir, engine_args, rng,
                                                         exact_across_schedules):
    """Prompts sharing a prefix ``S`` off the block grid (``2B < |S| < 3B``), each with a tail of
    its own (at least ``B``: its prompt checkpoint lies past the junction's column). The first
    sharer caches its prompt checkpoint only; the second finds attention blocks up to
    ``jf = |S| // B * B`` and no GDN state there (vLLM's shared-prefix junction). Where the
    junction entries apply (vLLM 0.30, 0.32 and 0.33, the CPU exporter path): the second sharer takes caching
    off's one prefill step, the step writes the state at ``jf`` into the block vLLM caches there
    (``_planned_blocks``: plan and ``MambaManager`` in lockstep, with the prompt's own checkpoint),
    the third hits ``jf`` in one step, as after vLLM's split; elsewhere vLLM's stop at ``jf`` stays
    (two steps). A second sharer in one batch with another prefix's third sharer and a cold
    prompt, the same; and two second sharers of two more prefixes in one batch (two junctions in
    one step: ``2B < |S| < 3B`` and ``4B < |S| < 5B``, the rows drawn so that both junctions and
    both rows' own checkpoints lie on four distinct boundaries), the same, every block the step
    wrote one vLLM cached. The conv and SSM bytes cached at ``jf`` equal those vLLM's split caches there
    (second sharers sent alone); outputs equal cold copies under a fresh ``cache_salt`` (exact on
    CPU). Own engines (exporter, then vLLM's split)."""
    states, hits = {}, {}
    llm = _engine(tiny_model_dir("qwen3_next"), engine_args, "exporter")
    try:
        block, exported = _block(llm), _junction_exported()
        # prefixes 0-3: 2B < |S| < 3B; 4: 4B < |S| < 5B. Prefixes 3 and 4's second sharers run in
        # one batch, drawn so that the junctions (2B, 4B) and their own checkpoints (3B: at most 4B
        # tokens; 5B: at most 6B) lie on four distinct boundaries, in at most 10B tokens
        shared = [_prompt(rng, k * block + rng.randrange(1, block)) for k in (2, 2, 2, 2, 4)]
        jf = [len(s) // block * block for s in shared]
        tails = [[_prompt(rng, rng.randrange(block, 2 * block)) for _ in range(3)] for _ in shared]
        for i, end in ((3, 4 * block), (4, 6 * block)):
            tails[i][1] = _prompt(rng, rng.randrange(block, end - len(shared[i]) + 1))
        budget = _core(llm).vllm_config.scheduler_config.max_num_batched_tokens
        pair = [shared[i] + tails[i][1] for i in (3, 4)]
        assert sum(map(len, pair)) <= budget, f"premise: the batched second sharers ({sum(map(len, pair))} tokens) fit the token budget {budget}"
        for i, (s, tail) in enumerate(zip(shared, tails)):
            first = s + tail[0]
            _, steps = _gen(llm, [first])
            assert steps == 1, f"first sharer ({len(first)} tokens) took {steps} steps"
            second = s + tail[1]
            before = block_hashes(llm)
            if i < 2:  # one sharer at a time
                with _planned_blocks() as planned:
                    (out,), steps = _gen(llm, [second])
                where = f"prefix {len(s)}, second sharer {len(second)} tokens, block {block}"
                assert out.num_cached_tokens == 0, where
                assert steps == (1 if exported else 2), f"{where}: {steps} steps (caching off: 1)"
                at_jf = cached_mamba_blocks(llm, jf[i], before)
                own = cached_mamba_blocks(llm, (len(second) - 1) // block * block, before)
                if exported:
                    assert sorted(planned) == sorted([*at_jf.values(), *own.values()]), (where, planned)
                states[i] = _checkpoint_states(llm, jf[i], before)
                (cold,), _ = _gen(llm, [second], salt=uuid.uuid4().hex)
                _assert_same([Sequence.from_output(cold.outputs[0])],
                             [Sequence.from_output(out.outputs[0])], exact=True, cross_schedule=False)
        # the last prefix's second sharer, in one batch with the first prefix's third sharer and a
        # cold prompt: its junction exported beside the others' work
        before = block_hashes(llm)
        # (the cold prompt's own checkpoint at 0 or B, off the junctions at 2B: one state cached there)
        batch = [shared[2] + tails[2][1], shared[0] + tails[0][2], _prompt(rng, rng.randrange(65, 2 * block))]
        outs, steps = _gen(llm, batch)
        assert outs[0].num_cached_tokens == 0 and outs[1].num_cached_tokens == jf[0], [o.num_cached_tokens for o in outs]
        if exported:
            assert steps == 1, f"mixed batch took {steps} steps"
        states[2] = _checkpoint_states(llm, jf[2], before)
        # two junctions in one step: prefixes 3 and 4's second sharers together
        before = block_hashes(llm)
        with _planned_blocks() as planned:
            pair_outs, steps = _gen(llm, pair)
        where = f"prefixes {len(shared[3])} and {len(shared[4])}, second sharers {[len(p) for p in pair]} tokens, block {block}"
        assert [o.num_cached_tokens for o in pair_outs] == [0, 0], where
        assert steps == (1 if exported else 2), f"{where}: {steps} steps (caching off: 1)"
        if exported:
            wrote = [b for p in (jf[3], jf[4], *((len(q) - 1) // block * block for q in pair))
                     for b in cached_mamba_blocks(llm, p, before).values()]
            assert sorted(planned) == sorted(wrote), (where, planned, wrote)
        states[3], states[4] = (_checkpoint_states(llm, jf[i], before) for i in (3, 4))
        for i, out in zip((3, 4), pair_outs):
            (cold,), _ = _gen(llm, [pair[i - 3]], salt=uuid.uuid4().hex)
            _assert_same([Sequence.from_output(cold.outputs[0])],
                         [Sequence.from_output(out.outputs[0])], exact=exact_across_schedules)
        for i in range(5):  # third sharers, one at a time (prefix 0's ran in the batch)
            (hit,), steps = _gen(llm, [shared[i] + tails[i][2]]) if i else ((outs[1],), 1)
            hits[i] = hit.num_cached_tokens
            assert hit.num_cached_tokens == jf[i] and steps == 1, (i, hit.num_cached_tokens, steps, jf[i])
            (cold,), _ = _gen(llm, [shared[i] + tails[i][2]], salt=uuid.uuid4().hex)
            _assert_same([Sequence.from_output(cold.outputs[0])], [Sequence.from_output(hit.outputs[0])],
                         exact=exact_across_schedules)
    finally:
        _close(llm)
    split = _engine(tiny_model_dir("qwen3_next"), engine_args, "split")
    try:
        for i, (s, tail) in enumerate(zip(shared, tails)):
            _gen(split, [s + tail[0]])
            before = block_hashes(split)
            _, steps = _gen(split, [s + tail[1]])
            assert steps >= 2, f"vLLM's split took {steps} steps for a second sharer"
            ref = _checkpoint_states(split, jf[i], before)
            for (name, conv, ssm), (name_s, conv_s, ssm_s) in zip(states[i], ref):
                assert name == name_s
                assert torch_equal(ssm, ssm_s), f"prefix {i} ({len(s)} tokens), {name}: SSM state at {jf[i]}"
                assert torch_equal(conv, conv_s), f"prefix {i} ({len(s)} tokens), {name}: conv at {jf[i]}"
            (hit,), _ = _gen(split, [s + tail[2]])
            assert hit.num_cached_tokens == hits[i], (i, hit.num_cached_tokens, hits[i])
    finally:
        _close(split)


def test_shared_prefix_junction_through_the_host_tier(tiny_model_dir, engine_args, rng,
                                                     exact_across_schedules):
    """A shared-prefix junction beside vLLM's OffloadingConnector (``kv_offloading_size`` 1 GiB, a
    device KV cache of 24 MiB; issue 38, "a junction beside the OffloadingConnector on a GPU"):
    the junction export stays on there on CUDA (``junctions_off`` turns it off beside a KV
    connector on vllm-ascend's paths only). Prompts share a prefix ``S`` off the block grid
    (``2B < |S| < 3B``), each with a tail of its own of ``B`` to ``2B`` tokens. The second sharer
    takes caching off's one prefill step (vLLM's split: two) and caches the GDN state at the
    junction ``jf = |S| // B * B``; a flood of other prompts cycling the device block pool three
    times evicts it from the device; the third sharer then hits ``jf`` through the host tier
    (external prefix-cache hits), and its output equals a cold copy's under a fresh
    ``cache_salt`` (exact on CPU; the tolerance rule on CUDA). Skips where the OffloadingConnector
    does not run (vLLM's CPU backend), with vLLM's error."""
    why = host_tier_unsupported()
    if why:
        pytest.skip(why)

    def external_hits(llm) -> float:
        return metric_counter(llm, "vllm:external_prefix_cache_hits")

    llm = _engine(tiny_model_dir("qwen3_next"), engine_args, "exporter", kv_offloading_size=1.0,
                  disable_log_stats=False, kv_cache_memory_bytes=24 << 20)
    try:
        block, exported = _block(llm), _junction_exported()
        shared = _prompt(rng, 2 * block + rng.randrange(1, block))
        jf = len(shared) // block * block
        tails = [_prompt(rng, rng.randrange(block, 2 * block)) for _ in range(3)]
        where = (f"prefix {len(shared)} tokens, tails {[len(t) for t in tails]}, block {block}, "
                 f"junction export {'on' if exported else 'off'}")
        _, steps = _gen(llm, [shared + tails[0]])
        assert steps == 1, f"{where}: first sharer took {steps} steps"
        before = block_hashes(llm)
        (second,), steps = _gen(llm, [shared + tails[1]])
        assert second.num_cached_tokens == 0, where
        assert steps == (1 if exported else 2), f"{where}: second sharer took {steps} steps (caching off: 1)"
        assert cached_mamba_blocks(llm, jf, before), f"{where}: no GDN state cached at the junction {jf}"
        num_blocks = _core(llm).vllm_config.cache_config.num_gpu_blocks
        flood = [_prompt(rng, 4 * block) for _ in range(-(-3 * num_blocks // 4))]
        for i in range(0, len(flood), 8):
            _gen(llm, flood[i:i + 8])
        ext0 = external_hits(llm)  # the third sharer's own (in tokens)
        (third,), _ = _gen(llm, [shared + tails[2]])
        ext = external_hits(llm) - ext0
        diag = f"{where}: {num_blocks} device blocks, {len(flood)} flood prompts, external hits {ext}"
        assert third.num_cached_tokens == jf, f"{diag}: third sharer cached {third.num_cached_tokens}, junction {jf}"
        assert 0 < ext <= jf, f"{diag}: the junction's hit did not come through the host tier"
        (cold,), _ = _gen(llm, [shared + tails[2]], salt=uuid.uuid4().hex)
        _assert_same([Sequence.from_output(cold.outputs[0])], [Sequence.from_output(third.outputs[0])],
                     exact=exact_across_schedules)
    finally:
        _close(llm)


def _budget_rule_applies() -> bool:
    """Whether the scheduler runs a prefill chunk to the token budget's end (issue 38 item 4):
    where the junction entries apply with the budget rule (vLLM 0.30, the CPU exporter path)."""
    return _budget_exported()


def _hand_counted_steps(short: int, long: int, block: int) -> tuple[int, int]:
    """Prefill steps of a ``short``-token prompt (``< block``) and a ``long``-token one sent
    together under a token budget of ``3 * block``, counted by hand: ``(caching off, vLLM's
    align-mode split)``. Caching off fills the budget: ``ceil((short + long) / 3B)``. The split
    floors a non-final chunk to the block (the long prompt's first chunk: ``2B``) and ends the
    chunk that reaches the prompt checkpoint ``(long - 1) // B * B`` there; the rest is one
    more chunk. For ``long`` off the block grid only: there that checkpoint is the split's last
    cacheable position (``Scheduler._mamba_block_aligned_split``'s ``num_tokens - num_tokens %
    block``), which on the grid is the prompt's end."""
    budget, cp = 3 * block, (long - 1) // block * block
    start, split = min((budget - short) // block * block, cp), 1
    while start < long:
        start, split = long if start >= cp else min(start + budget, cp), split + 1
    return -(-(short + long) // budget), split


def _cached_boundaries(llm, before, upto: int, block: int) -> dict[int, list]:
    """``{position: _checkpoint_states}`` of every block boundary ``<= upto`` (tokens) at which
    the engine cached a GDN state since ``before`` (every Mamba group, as
    ``cached_mamba_blocks`` requires)."""
    from vllm.v1.core.kv_cache_utils import get_group_id

    groups = mamba_groups(llm)
    pool = _core(llm).scheduler.kv_cache_manager.block_pool
    positions = {b.block_hash_num_tokens for b in pool.blocks
                 if b.block_hash is not None and before.get(b.block_id) != b.block_hash
                 and get_group_id(b.block_hash) in groups}
    return {p: _checkpoint_states(llm, p, before)
            for p in sorted(positions) if p % block == 0 and 0 < p <= upto}


@pytest.mark.parametrize("ssm_dtype,retention", [("auto", 0), ("float32", 0), ("float32", "dense")])
def test_shared_budget_chunks_take_caching_offs_steps(tiny_model_dir, engine_args, rng,
                                                      exact_across_schedules, ssm_dtype, retention):
    """Two cold prompts sent together under a token budget of ``3B``: a short one (final in the
    first step) and a long one whose first chunk takes the rest of the budget, off the block grid.
    vLLM's align mode floors that chunk to the block and ends a chunk at the long prompt's
    checkpoint: a step more than caching off for the lengths drawn (``_hand_counted_steps``; not
    for every length: 128 + 2193 at B=384 take 3 steps either way). Where the budget rule applies the chunks
    end where the budget ends (on the 64-token grid; the short prompt's length is drawn on it, so
    the long one's first chunk is caching off's) and the step writes the states at the block
    boundaries they cross: the batch takes caching off's prefill steps; a repeat of the long
    prompt hits what it hits after vLLM's split (its prompt checkpoint), in one step; the blocks
    the exporter writes are the ones the scheduler caches; the conv and SSM bytes cached there
    equal the split's (the SSM state within one bf16 rounding where the SSM cache is narrower than
    float32: ours stored the running state at the first chunk's end, the split at its block
    boundary, ``_within_one_rounding``); outputs, of the batch and of the repeat, equal the
    prompts computed alone (exact on CPU: every chunk starts on the 64-token grid). Own engines:
    exporter, vLLM's split, caching off; the SSM cache in the CPU's dtype and in float32.

    ``dense`` (``--prefix-cache-retention-interval None``: every GDN state left in a block of its
    own stays cached; float32 SSM cache), counted by hand up to the checkpoint ``cp``: the split's
    chunks end at ``(3k - 1) B`` (the budget ``3B`` less the short prompt, ``< B``, floored) until
    ``cp``; the budget rule's chunk ``k`` ends at ``3kB - short`` and leaves the state at its last
    boundary crossed, ``(3k - 1) B`` (the KV-cache manager's hint, ``JunctionRule.crossed``), and
    the next chunk, started there mid-block, the state at ``3kB`` in its initial state's block
    (the worker's crossing write). Every block the exporter's engine cached at those boundaries is
    one it wrote, and its bytes equal those of a split at every block boundary (a fourth engine,
    budget ``B``) exactly (a dropped hint leaves ``(3k - 1) B`` out; at retention 0 only ``cp`` is
    compared)."""
    extra = {} if ssm_dtype == "auto" else {"mamba_ssm_cache_dtype": ssm_dtype}
    if retention == "dense":
        extra["prefix_cache_retention_interval"] = None
    steps, outs, hits, states, llm = {}, {}, {}, {}, None
    for mode in ("exporter", "split", "off"):
        if llm is None:  # the first engine's block (the same for all three)
            llm = _engine(tiny_model_dir("qwen3_next"), engine_args, mode, **extra)
            block, dtype = _block(llm), _ssm_cache_dtype(llm)
            _close(llm)
            # a multiple of 64: the long prompt's first chunk (3B - short) is then on the 64-token
            # grid, as caching off's (else the floor to it can cost a step: seed 88, 220 + 2060)
            # (at least 128 tokens where the block allows it; CUDA's bf16 block of 192: 64)
            low = 2 if block // 64 > 3 else 1
            short = _prompt(rng, 64 * rng.randrange(low, max(low + 1, block // 64 - 1)))
            # a length where vLLM's split takes a step more than caching off, counted by hand
            # (``_hand_counted_steps``; seed of stop 43: 128 + 2193 at B=384 take 3 steps each),
            # off the block grid: on it the split's last cacheable position is the prompt's end,
            # so it stops nowhere at the checkpoint and caches no state there
            long = _prompt(rng, rng.choice([n for n in range(3 * block + 65, 8 * block - 64)
                                            if n % block and _hand_counted_steps(len(short), n, block)[1]
                                            > _hand_counted_steps(len(short), n, block)[0]]))
            where = f"prompts {len(short)} + {len(long)} tokens, budget {3 * block}, block {block}"
        llm = _engine(tiny_model_dir("qwen3_next"), engine_args, mode, **extra,
                      max_num_batched_tokens=3 * block, enable_chunked_prefill=True)
        cp = (len(long) - 1) // block * block
        try:
            before = block_hashes(llm) if mode != "off" else {}
            with _planned_blocks() as planned:
                outs[mode], steps[mode] = _gen(llm, [short, long])
            got = [outs[mode]]
            if mode != "off":
                states[mode] = _cached_boundaries(llm, before, cp, block) if retention == "dense" \
                    else {cp: _checkpoint_states(llm, cp, before)}
                if mode == "exporter" and _budget_rule_applies():
                    for p in states[mode]:
                        cached = cached_mamba_blocks(llm, p, before)
                        assert set(cached.values()) <= planned, (where, p, cached, planned)
                (rep,), rep_steps = _gen(llm, [long])
                hits[mode], got = rep.num_cached_tokens, [*got, [outs[mode][0], rep]]
                assert rep_steps == 1, f"{where}: the {mode} repeat took {rep_steps} steps"
            alone = [_gen(llm, [p], salt=uuid.uuid4().hex)[0][0] for p in (short, long)]
            for batch in got:
                _assert_same([Sequence.from_output(o.outputs[0]) for o in alone],
                             [Sequence.from_output(o.outputs[0]) for o in batch],
                             exact=exact_across_schedules)
        finally:
            _close(llm)
    assert steps["split"] > steps["off"], f"{where}: vLLM's split took {steps}: no extra step to remove"
    if _budget_rule_applies():
        assert steps["exporter"] == steps["off"], f"{where}: steps {steps}"
    assert hits["exporter"] == hits["split"] == cp, (where, hits)
    ref = states["split"]
    if retention == "dense":
        at_split = sorted({*range(2 * block, cp, 3 * block), cp})
        ends = range(3 * block - len(short), len(long), 3 * block)  # the budget rule's non-final ends
        at_rule = sorted({cp, *(e // block * block for e in ends),
                          *(e // block * block + block for e in ends if e // block * block + block <= cp)})
        assert list(ref) == at_split, f"{where}: vLLM's split cached GDN states at {list(ref)}"
        if _budget_rule_applies():
            assert list(states["exporter"]) == at_rule, f"{where}: exporter cached at {list(states['exporter'])}"
        llm = _engine(tiny_model_dir("qwen3_next"), engine_args, "split", **extra,
                      max_num_batched_tokens=block, enable_chunked_prefill=True)
        try:
            before = block_hashes(llm)
            _gen(llm, [long])
            ref = _cached_boundaries(llm, before, cp, block)
        finally:
            _close(llm)
        assert list(ref) == list(range(block, cp + 1, block)), f"{where}: budget B cached at {list(ref)}"
    for p in states["exporter"]:
        for (name, conv, ssm), (name_s, conv_s, ssm_s) in zip(states["exporter"][p], ref[p], strict=True):
            at = f"{where}, {name}, state at {p}"
            assert name == name_s and torch_equal(conv, conv_s), f"{at}: conv, {_byte_diff(conv, conv_s)}"
            if dtype.itemsize < 4:
                assert _within_one_rounding(ssm, ssm_s, dtype), f"{at}: SSM state, {_byte_diff(ssm, ssm_s)}"
            else:
                assert torch_equal(ssm, ssm_s), f"{at}: SSM state, {_byte_diff(ssm, ssm_s)}"


@contextlib.contextmanager
def _mid_block_stop_forced():
    """The paths that do not write the block a mid-block row crosses (CUDA, the NPU), on this
    engine: the mid-block stop (``gdn-chunk-end``'s inner layer) wrapped around the scheduler's split (it applies
    where a prefill checkpoint is declared, as here), and the crossing write dropped (the engine's
    plan, ``core.step_checkpoints``, lists rows that start on the block grid only). In-process
    engines only (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from vllm_hybrid_npu.core import prefill_checkpoints as core
    from vllm_hybrid_npu.patches import gdn_prefill_checkpoint as gpc
    from vllm_hybrid_npu.patches import registry

    real = core.step_checkpoints

    def on_grid_only(start, end, block, *args, **kwargs):
        return real(start, end, block, *args, **kwargs) if start % block == 0 else ()

    import dataclasses

    mp = pytest.MonkeyPatch()
    mp.setattr(core, "step_checkpoints", on_grid_only)
    # as on a path without the write: the entry stands aside where the target's path writes the
    # crossed boundary (CUDA on vLLM 0.30's V2 runner, the NPU), never on target ``cpu``
    mp.setattr(Scheduler, "_mamba_block_aligned_split", gpc._make_mid_block_stop(
        Scheduler._mamba_block_aligned_split, dataclasses.replace(registry.REPORT.stack, target="cpu")))
    try:
        yield
    finally:
        mp.undo()


@pytest.mark.parametrize("kept_by", ["retention", "junction"])
@pytest.mark.parametrize("how", ["write", "stop"])
def test_hit_inside_a_block_run_past_its_boundary(tiny_model_dir, engine_args, rng, exact_across_schedules,
                                                  how, kept_by):
    """``--prefix-match-unit 64``: a request that hits a 64-token checkpoint inside a block
    (``m``) and reaches its prompt's end in one chunk past the block's boundary ``b`` (vLLM's
    internal checkpoint lifts the mid-block stop). vLLM's ``MambaManager`` caches the block holding
    the hit's state (the initial state's, column ``m // B``) at ``b`` when something keeps that
    boundary: ``kept_by`` ``retention`` (``--prefix-cache-retention-interval None``: dense) or
    ``junction`` (the default retention 0; a donor prompt cached the attention blocks past ``b``,
    so the request's shared-prefix junction, its attention hit in ``[b, m + B)``, keeps the block
    ending at ``b``; a junction further on, whose block-floored stop clips the chunk past ``b``
    with no checkpoint, needs an attention hit inside a block without a GDN state there, which
    only independent evictions leave: unit-tested, ``test_gdn_checkpoint_vllm_plan.py``). The
    block must hold the state at ``b`` (without a fix it kept the state at ``m``, found by review
    2026-11-28).
    ``how``: ``write`` (the CPU path writes the boundary's state into it in the same step, as
    does CUDA's one pass on vLLM 0.30's V2 runner; on other CUDA configurations the stop below
    applies instead: ``_crossing_written``) or ``stop`` (the paths that cannot, forced here:
    the mid-block stop ends the chunk at ``b``, one step more, as vLLM's split).
    Checked: the hit; the steps (1 with the write, 2 with the stop); with the write every block cached at ``b`` was written by the
    exporter; its conv and SSM bytes equal those vLLM's split caches at ``b`` (exact on CPU: both
    ran tokens ``m..b`` from the same state in one chunk; on CUDA within one rounding, below);
    a third prompt sharing the first ``b``
    tokens hits ``b`` in both engines with the output it gets computed cold. Own engines
    (exporter, vLLM's split)."""
    states, hits, dtypes = {}, {}, {}
    retention = {"prefix_cache_retention_interval": None} if kept_by == "retention" else {}
    for mode in ("exporter", "split"):
        llm = _engine(tiny_model_dir("qwen3_next"), engine_args, mode, prefix_match_unit=64, **retention)
        forced = _mid_block_stop_forced() if mode == "exporter" and how == "stop" else contextlib.nullcontext()
        try:
            if mode == "exporter":
                stops = how == "stop" or not _crossing_written(llm)
                block = _block(llm)
                m = rng.randrange(1, 3) * block + 64 * rng.randrange(1, block // 64)
                b = (m // block + 1) * block
                # its checkpoint at m; off the 64-token grid (m + 64 not drawn): vLLM 0.30's split
                # runs a prompt ending on the grid to its end and stores no state at m (the second
                # prompt then hits the block boundary below m in the split engine)
                first = _prompt(rng, m + rng.randrange(1, 64))
                # past b + B: vLLM's checkpoint column then lies after the hit's (a shorter one
                # gets no internal checkpoint and stops at b: m 512, 1,118 tokens at B=384)
                second = first[:m] + _prompt(rng, rng.randrange(b + block + 1, b + 3 * block) - m)
                third = second[:b] + _prompt(rng, rng.randrange(65, block))
                j = rng.randrange(b, m + block, 64)  # the junction: block-floored from m, it is m
                # past b + B: its own replay boundary (its last block boundary) is not b
                donor = second[:j] + _prompt(rng, rng.randrange(b + block + 65, b + 2 * block) - j)
                where = (f"hit at {m}, second prompt {len(second)} tokens, block {block}, "
                         f"{kept_by}{f' at {j}' if kept_by == 'junction' else ''}")
            with forced:
                _gen(llm, [first])
                if kept_by == "junction":
                    _gen(llm, [donor])
                before = block_hashes(llm)
                with _planned_blocks() as planned:
                    (out,), steps = _gen(llm, [second])
                assert out.num_cached_tokens == m, (where, mode, out.num_cached_tokens)
                if mode == "exporter":
                    assert steps == (2 if stops else 1), f"{where}, {how}: {steps} steps"
                    if not stops:
                        cached = cached_mamba_blocks(llm, b, before)
                        assert set(cached.values()) <= planned, (where, cached, planned)
                states[mode], dtypes[mode] = _checkpoint_states(llm, b, before), _ssm_cache_dtype(llm)
                (hit,), _ = _gen(llm, [third])
                (cold,), _ = _gen(llm, [third], salt=uuid.uuid4().hex)
            hits[mode] = hit.num_cached_tokens
            _assert_same([Sequence.from_output(cold.outputs[0])], [Sequence.from_output(hit.outputs[0])],
                         exact=exact_across_schedules)
        finally:
            _close(llm)
    assert hits == {"exporter": b, "split": b}, (where, hits)
    import torch

    for (name, conv, ssm), (name_s, conv_s, ssm_s) in zip(states["exporter"], states["split"], strict=True):
        assert name == name_s
        if not exact_across_schedules:
            # CUDA: the hit's state at m came from each engine's own first prompt (the one pass,
            # the split's two calls), and the input projection runs on other batch shapes: an
            # H200 draw (2026-11-30, seed 476412346, hit at 448, block 192, dense retention) had
            # 1 of 32,768 SSM elements 3.8e-6 apart at b; the bound of
            # test_prefix_match_unit_64_plans_where_the_scheduler_caches
            dtype = dtypes["split"]
            assert _within_one_rounding(conv, conv_s, torch.bfloat16), f"{where}, {name}: conv at {b}, {_byte_diff(conv, conv_s)}"
            assert _within_one_rounding(ssm, ssm_s, dtype, torch.bfloat16), \
                f"{where}, {name}: SSM state at {b}, {_byte_diff(ssm, ssm_s)}"
            continue
        assert torch_equal(conv, conv_s), f"{where}, {name}: conv at {b}, {_byte_diff(conv, conv_s)}"
        assert torch_equal(ssm, ssm_s), f"{where}, {name}: SSM state at {b}, {_byte_diff(ssm, ssm_s)}"


def _crossing_written(llm) -> bool:
    """Whether ``llm``'s exporter path writes the block boundary a chunk started mid-block
    crosses, and shared-prefix junction states (``junctions_off``, as the engine's scheduler and
    builder decide it): the CPU path (every vLLM version), CUDA's one pass on vLLM 0.30's V2
    runner; not CUDA's V1 runner, nor with ``FLA_USE_FAST_OPS=1``."""
    from vllm_hybrid_npu.patches import gdn_prefill_checkpoint as gpc
    from vllm_hybrid_npu.patches import registry

    config = _core(llm).vllm_config
    return gpc.junctions_off(config, gpc.exporter_path(config, registry.REPORT.stack.target)[0]) is None


def _fused(llm) -> bool:
    """Whether ``llm``'s exporter writes by the one pass (CUDA's Triton/FLA path): several
    checkpoints in a row then come from one float32 running state, where the split's rounds (CPU,
    and vLLM's own split across steps) start each segment from the previous checkpoint read back
    in the SSM cache's dtype."""
    from vllm_hybrid_npu.patches import gdn_prefill_checkpoint as gpc
    from vllm_hybrid_npu.patches import registry

    config = _core(llm).vllm_config
    path = gpc.exporter_path(config, registry.REPORT.stack.target)[0]
    return path is not None and gpc.export_method(path) == "fused"


def _ssm_cache_dtype(llm):
    """The dtype of ``llm``'s SSM state cache (``auto`` resolved: bf16 on CUDA and on a CPU
    without AVX-512-BF16, float32 with it)."""
    groups = mamba_groups(llm)
    ctx = _core(llm).model_executor.driver_worker.worker.model_runner.vllm_config \
        .compilation_config.static_forward_context
    return ctx[next(iter(groups.values()))[0]].kv_cache[1].dtype


def _within_one_rounding(a, b, dtype, rounded=None) -> bool:
    """States ``a`` and ``b`` (bytes of ``dtype``) apart by no more than one extra rounding to
    ``rounded`` (default ``dtype``) carried through one block of tokens: finite, and every element
    within ``2 * eps(rounded)`` of the state's largest magnitude (bf16: 2^-6, 2 to 4 bf16 units in
    the last place there). The gated delta rule's transition contracts (gates in (0, 1],
    (I - beta k k^T) with beta in (0, 1)), so an error rounded in at a block boundary (or a bf16
    input rounded one unit apart) does not grow in norm by the checkpoint; per element that is not
    proven, hence the margin over the measured 1 unit."""
    import torch

    if a.shape != b.shape:
        return False
    x, y = a.reshape(-1).view(dtype).float(), b.reshape(-1).view(dtype).float()
    if not (torch.isfinite(x).all() and torch.isfinite(y).all()):
        return False
    return bool((x - y).abs().max() <= 2 * torch.finfo(rounded or dtype).eps * y.abs().max())


def _byte_diff(a, b) -> str:
    """How two states' bytes differ: elements of 2 and 4 bytes (bf16, float32 views) unequal, and
    the largest absolute difference in each view."""
    import torch

    out = []
    for dtype in (torch.bfloat16, torch.float32):
        if a.shape == b.shape and a.numel() % dtype.itemsize == 0:
            x, y = a.reshape(-1).view(dtype).float(), b.reshape(-1).view(dtype).float()
            out.append(f"{dtype}: {int((x != y).sum())} of {x.numel()} unequal, max |diff| "
                       f"{float((x - y).abs().nan_to_num(0).max()):.3g}")
    return "; ".join(out)


def torch_equal(a, b) -> bool:
    import torch

    return a.shape == b.shape and bool(torch.equal(a, b))


def test_chunked_prefill_checkpoint_in_final_chunk(tiny_model_dir, engine_args, rng):
    """Last: its own engine (the module's is closed by the state test)."""
    block = _block_of(tiny_model_dir, engine_args)
    budget = 2 * block
    long = _prompt(rng, 3 * budget + rng.randrange(65, block))
    llm = _engine(tiny_model_dir("qwen3_next"), engine_args, "exporter",
                  max_num_batched_tokens=budget, enable_chunked_prefill=True)
    try:
        (out,), steps = _gen(llm, [long])
        # chunks end on block boundaries (vLLM's align rule); the last one carries the checkpoint
        assert steps == -(-len(long) // budget), steps
        (rep,), _ = _gen(llm, [long])
        assert rep.num_cached_tokens == (len(long) - 1) // block * block
        (cold,), _ = _gen(llm, [long], salt=uuid.uuid4().hex)
        _assert_same([Sequence.from_output(cold.outputs[0])],
                     [Sequence.from_output(out.outputs[0])], exact=True, cross_schedule=False)
    finally:
        _close(llm)


def test_preemption_and_resume_with_the_exporter(tiny_model_dir, engine_args, rng, exact_across_schedules):
    """Own engine, after the module's. A KV cache of 20 pages and vLLM's
    ``scheduler_reserve_full_isl=False`` (admit on the first chunk, not the whole prompt): six
    prompts of one block and a few tokens, each prefilled in one step with its checkpoint (one
    block) exported from inside it, then decoding a block's worth of tokens across the second
    block boundary, outgrow it and vLLM preempts and resumes them (``vllm:num_preemptions``).
    The batch's outputs equal each prompt computed alone under a fresh ``cache_salt`` up to
    near-ties (``greedy_compare``'s chunking bound: six prompts batched are other kernel shapes
    than one alone, and vLLM's split diverges at the same near-ties on the same draws, measured
    2026-11-25 on three seeds). Repeats, one at a time, hit whole blocks, at most the prompt's
    checkpoint (``(L - 1) // B * B``) and at least one exactly that, and their outputs equal the
    alone ones (exact on CPU, or a near-tie within ``TIE_NATS``). The cold/hit and state-byte
    tests, not this one, catch a wrong exported state."""
    block = _block_of(tiny_model_dir, engine_args)
    pages = _BLOCK["pages"]
    kv = KV_BYTES * 20 // pages
    # one prefill step each (its checkpoint at one block exported from inside it), then the
    # decodes cross the second block boundary and need pages the others hold
    prompts = [_prompt(rng, rng.randrange(block + 8, block + 40)) for _ in range(6)]
    # tokens (EOS ignored: a near-tie at EOS would end one copy early): every prompt crosses
    # its second block boundary while decoding
    max_decode = block
    llm = _engine(tiny_model_dir("qwen3_next"), engine_args, "exporter", kv_cache_memory_bytes=kv,
                  max_model_len=3 * block - 64, max_num_seqs=6, max_num_batched_tokens=2 * block,
                  enable_chunked_prefill=True, scheduler_reserve_full_isl=False,
                  disable_log_stats=False)
    try:
        first, _ = _gen(llm, prompts, max_tokens=max_decode, ignore_eos=True)
        pre = [m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions"]
        assert pre and pre[0] > 0, f"no preemption with {kv} bytes of KV cache ({pages} pages at {KV_BYTES})"
        # repeats one at a time, the last submitted first (the blocks freed last are evicted
        # last in a cache this small): whole blocks, never past the checkpoint, and at least one
        # reaches the checkpoint its first run exported (possibly across a preemption)
        again = [_gen(llm, [p], max_tokens=max_decode, ignore_eos=True)[0][0] for p in reversed(prompts)][::-1]
        hits = [o.num_cached_tokens for o in again]
        ckpts = [(len(p) - 1) // block * block for p in prompts]
        for n, h, c in zip(map(len, prompts), hits, ckpts):
            assert h % block == 0 and h <= c, (n, h, block)
        assert any(h == c for h, c in zip(hits, ckpts)), f"no repeat reached its checkpoint: {hits} of {ckpts}"
        alone = [_gen(llm, [p], max_tokens=max_decode, salt=uuid.uuid4().hex, ignore_eos=True)[0][0] for p in prompts]
        ref = [Sequence.from_output(o.outputs[0]) for o in alone]
        # the batch (other kernel shapes than one prompt alone): up to near-ties; the repeats (one
        # prompt, resumed on a block boundary, as alone): exact where the target is
        _assert_same(ref, [Sequence.from_output(o.outputs[0]) for o in first], exact=False)
        _assert_same(ref, [Sequence.from_output(o.outputs[0]) for o in again], exact=exact_across_schedules)
    finally:
        _close(llm)


@contextlib.contextmanager
def _planned_blocks_per_step(llm):
    """``_planned_blocks`` by engine step: ``{step: blocks}``, the step numbered by the steps
    ``llm`` has scheduled so far (``count_scheduled_steps``: the metadata is built after the
    step's ``schedule``)."""
    seen: dict[int, set[int]] = {}
    with _spy_slots(lambda slots: seen.setdefault(len(llm._vhn_steps), set()).update(slots)):
        yield seen


@contextlib.contextmanager
def _scheduler_record(llm):
    """What vLLM's scheduler does to each request while open: ``preempted``, one ``(prompt,
    tokens computed)`` per ``Scheduler._preempt_request`` (before it resets them), and
    ``lookups``, one ``(prompt, request.num_preemptions, tokens hit, shared_prefix_boundary,
    [the hit's last block per KV-cache group])`` per prefix-cache lookup of a waiting request
    (``KVCacheManager.get_computed_blocks``, repeated each step a request waits). Spies on the
    engine's own objects; what they return is vLLM's."""
    sched = _core(llm).scheduler
    manager = sched.kv_cache_manager
    preempted, lookups = [], []
    mp = pytest.MonkeyPatch()

    def preempt(request, *args, _real=sched._preempt_request, **kwargs):
        preempted.append((tuple(request.prompt_token_ids), request.num_computed_tokens))
        return _real(request, *args, **kwargs)

    def lookup(request, *args, _real=manager.get_computed_blocks, **kwargs):
        blocks, hit, junction = out = _real(request, *args, **kwargs)
        lookups.append((tuple(request.prompt_token_ids), request.num_preemptions, hit, junction,
                        [g[-1].block_id if g else None for g in blocks.blocks]))
        return out

    mp.setattr(sched, "_preempt_request", preempt)
    mp.setattr(manager, "get_computed_blocks", lookup)
    try:
        yield preempted, lookups
    finally:
        mp.undo()


def test_shared_prefix_junction_preempted_after_its_junction_step(tiny_model_dir, engine_args, rng,
                                                                 exact_across_schedules):
    """A second sharer of a prefix ``S`` (``2B < |S| < 3B``, junction ``jf = 2B``) preempted in
    the step after its junction step, resumed from the junction block it wrote itself. Own
    engines (exporter with a small KV cache, then vLLM's split), after the module's; where the
    junction entries do not apply it skips (vLLM stops at ``jf``: the page counts below are
    those of the exporter's chunk).

    The first sharer caches attention blocks over ``S`` and no GDN state at ``jf`` (its
    checkpoint lies a block further). Then, under a token budget of ``b = 12`` blocks, vLLM's
    ``scheduler_reserve_full_isl`` off and a KV cache of ``2b + 7`` usable pages, a decoder ``D``
    (``(b - 4) B < d < (b - 3) B`` tokens, two output tokens) and the second sharer ``J``
    (``(b + 1) B < |J| < (b + 2) B``) are sent together. Step 1: ``D``'s prompt, and ``J``'s first
    chunk ``[0, c)``, ``c = bB - d`` (``3B < c < 4B``, on the 64-token grid: the budget's end),
    which runs past ``jf`` and exports the state there into the junction block (the chunk's own
    checkpoint at ``3B`` is written but not cached: retention 0 keeps the junction and the replay
    boundary). Step 2: ``D`` decodes (no page needed: EOS ignored, two tokens inside its last
    block) and ``J``'s final chunk needs more pages than ``D`` and ``J`` leave; ``J``, the last
    running request, is the one vLLM's FCFS policy preempts (itself: no page is allocated in that
    step). ``D`` ends. Nothing is allocated until ``J``'s lookup in step 3, so the lookup hits
    ``jf``, in the block ``J`` wrote in step 1, and ``J``, alone, resumes from it in one step
    (its attention blocks up to ``3B``, cached in step 1, make ``3B`` a junction of the resumed
    row, exported in the same way), then decodes inside its last block. Pages, counted for
    vLLM 0.30's align mode (per GDN group: the running state and each checkpoint a block; 3 GDN
    groups, one attention group): step 1 holds ``b + 16`` (``D``: ``b - 3`` attention pages, state
    and checkpoint; ``J``: 4, state, junction and chunk checkpoint); in step 2 ``D`` holds
    ``b``, ``J`` 7 and ``J``'s final chunk needs ``b + 4`` more (``b - 2`` attention pages, state
    and prompt checkpoint): ``2b + 11``. A cache of ``2b + 7`` (31) pages lies 3 from either end.

    Checked: vLLM preempted exactly ``J``, once, with ``c`` tokens computed
    (``Scheduler._preempt_request``), and counts it (``vllm:num_preemptions``); ``J``'s first
    lookup found the junction (no hit, attention to ``jf``); its lookup after the preemption hit
    ``jf``, in the blocks cached there, which the step with ``J``'s first chunk wrote and no later
    step wrote again, and found the junction ``3B``, whose blocks the resumed step wrote (the
    exporter's plan, ``_planned_blocks_per_step``); every page is back in
    the pool after the batch (the preempted row and its junction block hold none); the conv and
    SSM bytes cached at ``jf`` and at the resumed row's junction ``3B`` equal those vLLM's split
    caches there (its stops at the junctions); a third sharer sent afterwards hits ``jf`` in one
    step with the output it gets computed cold under a fresh ``cache_salt`` (exact on CPU); the
    batch's outputs equal each prompt computed alone up to near-ties (``greedy_compare``'s
    chunking bound, as the preemption test)."""
    block = _block_of(tiny_model_dir, engine_args)  # an engine has run: the entries are decided
    if not _budget_exported():
        pytest.skip("shared-prefix junction and token-budget entries not both applied (vLLM 0.30 "
                    "only): the preemption this test forces is counted on the budget-sized chunk")
    b, out_j = 12, 8
    budget, usable = b * block, 2 * b + 7
    kv = KV_BYTES * (usable + 1) // _BLOCK["pages"]  # and vLLM's null block
    shared = _prompt(rng, 2 * block + rng.randrange(1, block))
    jf = len(shared) // block * block
    first = shared + _prompt(rng, rng.randrange(block, 2 * block))  # its checkpoint past jf
    d = 64 * rng.randrange((b - 4) * block // 64 + 1, (b - 3) * block // 64)
    decoder = _prompt(rng, d)
    c = budget - d
    second = shared + _prompt(rng, rng.randrange((b + 1) * block + 1, (b + 2) * block - out_j)
                              - len(shared))
    third = shared + _prompt(rng, rng.randrange(block, 2 * block))
    where = (f"block {block}, prefix {len(shared)}, decoder {d} tokens, second sharer "
             f"{len(second)} (first chunk {c}), budget {budget}, {usable} pages")
    # premises of the page count, whatever the draws
    assert jf == 2 * block and 3 * block < c < 4 * block and c % 64 == 0, where
    assert 0 < d % block and d % block + 2 <= block, f"{where}: the decoder's tokens need a page"
    assert len(second) % block + out_j <= block, f"{where}: the second sharer's tokens need a page"
    assert len(second) - jf <= budget, f"{where}: the resumed sharer does not fit one step"
    assert (d - 1) // block * block not in (jf, 3 * block), f"{where}: the decoder caches at a junction"
    from vllm import SamplingParams

    # EOS ignored: the decoder must hold its pages through step 2 (an EOS first would end it)
    sp = [SamplingParams(max_tokens=n, temperature=0.0, logprobs=20, ignore_eos=True) for n in (2, out_j)]
    llm = _engine(tiny_model_dir("qwen3_next"), engine_args, "exporter", kv_cache_memory_bytes=kv,
                  max_model_len=(b + 3) * block, max_num_batched_tokens=budget,
                  enable_chunked_prefill=True, scheduler_reserve_full_isl=False,
                  disable_log_stats=False)
    try:
        pool = _core(llm).scheduler.kv_cache_manager.block_pool
        assert _block(llm) == block and pool.num_gpu_blocks == usable + 1, (where, pool.num_gpu_blocks)
        _gen(llm, [first])
        before = block_hashes(llm)
        n0 = len(llm._vhn_steps)
        with _scheduler_record(llm) as (preempted, lookups), _planned_blocks_per_step(llm) as planned:
            batch = llm.generate([{"prompt_token_ids": p} for p in (decoder, second)], sp, use_tqdm=False)
        steps = llm._vhn_steps[n0:]
        assert steps[0] == budget, f"{where}: step 1 scheduled {steps[0]} tokens (steps {steps})"
        names = {tuple(decoder): "decoder", tuple(second): "second"}
        seen = [(names.get(p, len(p)), n) for p, n in preempted]
        assert seen == [("second", c)], f"{where}: preempted {seen} (steps {steps})"
        metric = [m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions"]
        assert metric == [1], f"{where}: vllm:num_preemptions {metric}"
        mine = [(n, hit, junction, ids) for p, n, hit, junction, ids in lookups if p == tuple(second)]
        assert mine[0][:3] == (0, 0, jf), f"{where}: the second sharer's first lookup {mine[0]}"
        resumed = [m for m in mine if m[0] == 1]
        assert resumed and all(m[1:3] == (jf, 3 * block) for m in resumed), f"{where}: {resumed}"
        at_jf = cached_mamba_blocks(llm, jf, before)
        hit_ids = {g: resumed[0][3][g] for g in at_jf}
        assert hit_ids == at_jf, f"{where}: the resumed row hit {hit_ids}, cached at jf {at_jf}"
        # written in step 1 (D's prompt and J's first chunk; 2: D's decode, J preempted) and 3 (J
        # resumed), and by no later step (a block id written before may be a freed one, reused)
        for p, step in ((jf, 1), (3 * block, 3)):
            cached = set(cached_mamba_blocks(llm, p, before).values())
            later = [s - n0 for s, ids in sorted(planned.items()) if s - n0 > step and cached & ids]
            assert cached <= planned.get(n0 + step, set()) and not later, \
                f"{where}: the blocks cached at {p} ({cached}) not written in batch step {step}, or again in {later}"
        assert pool.get_num_free_blocks() == usable, f"{where}: {pool.get_num_free_blocks()} free"
        states = {p: _checkpoint_states(llm, p, before) for p in (jf, 3 * block)}
        (hit,), hit_steps = _gen(llm, [third])
        assert hit.num_cached_tokens == jf and hit_steps == 1, (where, hit.num_cached_tokens, hit_steps)
        (cold,), _ = _gen(llm, [third], salt=uuid.uuid4().hex)
        _assert_same([Sequence.from_output(cold.outputs[0])], [Sequence.from_output(hit.outputs[0])],
                     exact=exact_across_schedules)
        alone = [llm.generate([{"prompt_token_ids": p, "cache_salt": uuid.uuid4().hex}], s,
                              use_tqdm=False)[0] for p, s in zip((decoder, second), sp)]
        _assert_same([Sequence.from_output(o.outputs[0]) for o in alone],
                     [Sequence.from_output(o.outputs[0]) for o in batch], exact=False)
    finally:
        _close(llm)
    split = _engine(tiny_model_dir("qwen3_next"), engine_args, "split",
                    max_model_len=(b + 3) * block, max_num_batched_tokens=budget,
                    enable_chunked_prefill=True)
    try:
        ref = {}
        _gen(split, [first])
        for p, prompt in ((jf, second), (3 * block, second[:3 * block + 1])):
            before = block_hashes(split)
            _gen(split, [prompt])  # a junction stop at p: vLLM's split caches the state there
            ref[p] = _checkpoint_states(split, p, before)
    finally:
        _close(split)
    for p in states:
        for (name, conv, ssm), (name_s, conv_s, ssm_s) in zip(states[p], ref[p], strict=True):
            at = f"{where}, {name}, state at {p}"
            assert name == name_s and torch_equal(conv, conv_s), f"{at}: conv, {_byte_diff(conv, conv_s)}"
            assert torch_equal(ssm, ssm_s), f"{at}: SSM state, {_byte_diff(ssm, ssm_s)}"


@contextlib.contextmanager
def _scheduled_tokens(llm):
    """``[{prompt: tokens scheduled}]``, one dict per engine step ``llm`` schedules while open
    (prompt: the request's prompt token ids as a tuple; from the step's ``SchedulerOutput``)."""
    sched = _core(llm).scheduler
    steps: list[dict[tuple, int]] = []
    mp = pytest.MonkeyPatch()

    def schedule(*args, _real=sched.schedule, **kwargs):
        out = _real(*args, **kwargs)
        if out.total_num_scheduled_tokens:
            steps.append({tuple(sched.requests[r].prompt_token_ids): n
                          for r, n in out.num_scheduled_tokens.items()})
        return out

    mp.setattr(sched, "schedule", schedule)
    try:
        yield steps
    finally:
        mp.undo()


def test_resumed_decoder_with_a_junction_inside_its_prompt(tiny_model_dir, engine_args, rng,
                                                           exact_across_schedules):
    """A request ``R`` preempted while decoding and, resumed (its prompt and output tokens
    recomputed as one prefill, ``request.num_tokens > request.num_prompt_tokens``), finding a
    shared-prefix junction inside its prompt: attention blocks of a prefix ``S`` (``2B < |S| <
    3B``, ``jf = 2B``) that a running sharer holds, no GDN state there. Own engines (exporter,
    then vLLM's split, the same batch and KV cache in each), after the module's.

    The batch, in this order (vLLM 0.30's FCFS policy preempts the last running request): ``H =
    S + tail`` (``3B < |H| <= 4B - d - 4``: its checkpoint at ``3B`` holds its own tokens),
    ``k = 5`` short decoders ``D`` of ``B - c`` tokens, and ``R = S + tail`` (``3B < P <= 4B -
    2c``, ``2c`` output tokens; EOS ignored everywhere), all prefilled in step 1 (a budget of
    ``13B``); ``H``, ``D`` decode ``d = c + 4`` tokens. ``R``'s first lookup finds ``jf`` in
    ``H``'s blocks. No decode needs a page until step ``c + 2``, where each ``D`` crosses its
    first block boundary (one attention page and a state block per GDN group: 4 pages, its old
    state block freed the step after). Pages, counted for vLLM 0.30's align mode (3 GDN groups,
    one attention group; the null block apart): step 1 takes at most ``4k + 23`` (``H`` 4
    attention pages, state and checkpoint per group; each ``D`` 4; ``R`` 4 attention pages and
    state, checkpoint and junction per group; the split's less); from step 2 (the split's step
    4 for ``R``) ``H`` and ``R`` hold 7 each (4 attention pages, a state per group), each ``D``
    4: ``4k + 14``. A cache of ``8k + 8`` (48) usable pages leaves ``F = 4k - 6`` free before the
    crossing, which needs ``4k``: vLLM preempts ``R`` and the crossings take the ``F`` free pages
    and 6 of the 7 ``R`` frees, in its free order (the GDN groups' state blocks, then attention
    tail first): ``R``'s attention page past ``jf`` and every GDN state ``R`` cached (all freed
    before) are evicted, so its resumed lookup hits nothing and finds the junction at ``jf``,
    inside its prompt, whose attention blocks ``H`` holds. Resumed, ``R`` fits the budget
    (``P + c + 1`` tokens): its prompt checkpoint ``3B`` lies a column past ``jf``'s.

    Checked, premises first (each draw, both engines): vLLM preempted exactly ``R``, once, after
    it decoded (tokens computed past its prompt), and counts it (``vllm:num_preemptions``);
    ``R``'s lookups, first and resumed, hit nothing and found the junction ``jf``; every page is
    back in the pool after the batch. Then: the resumed ``R``'s prefill takes caching off's one
    step where the junction entries apply (vLLM's split: more, it stops at ``jf``), and the blocks
    cached at ``jf`` and ``3B`` are blocks that step wrote (the exporter's plan,
    ``_planned_blocks_per_step``); the conv and SSM bytes cached there equal those vLLM's split
    caches there in the same batch (at ``3B`` in a cache narrower than float32 on CUDA's one pass
    within one rounding, ``_within_one_rounding``: the split reads the state at ``jf`` back in
    the cache dtype before going on, the one pass does not); the batch's outputs equal the split's up to near-ties
    (``greedy_compare``'s chunking bound: other kernel shapes); a third sharer (``3B < |T| <= 4B``) afterwards hits
    what it hits after vLLM's split (``jf``), with the output it gets computed cold under a fresh
    ``cache_salt`` (exact on CPU)."""
    block = _block_of(tiny_model_dir, engine_args)  # an engine has run: the entries are decided
    if not _budget_exported():
        pytest.skip("shared-prefix junction and token-budget entries not both applied (vLLM 0.30 "
                    "only): the resumed row's blocks are counted on vLLM 0.30's align mode")
    k, usable = 5, 48
    kv = KV_BYTES * (usable + 1) // _BLOCK["pages"]  # and vLLM's null block
    c = rng.randrange(6, 11)
    d, m = c + 4, 2 * c
    jf = 2 * block
    shared = _prompt(rng, 2 * block + rng.randrange(1, block))
    holder = shared + _prompt(rng, rng.randrange(3 * block + 1, 4 * block - d - 3) - len(shared))
    decoders = [_prompt(rng, block - c) for _ in range(k)]
    resumed = shared + _prompt(rng, rng.randrange(3 * block + 1, 4 * block - m + 1) - len(shared))
    third = shared + _prompt(rng, rng.randrange(3 * block + 1, 4 * block + 1) - len(shared))
    prompts = [holder, *decoders, resumed]
    where = (f"block {block}, prefix {len(shared)}, holder {len(holder)}, decoders {k} x {block - c}, "
             f"resumed {len(resumed)} (+{m}), {usable} pages")
    # premises of the page count, whatever the draws
    assert len(shared) // block * block == jf and (len(resumed) - 1) // block == 3, where
    assert len(holder) + d < 4 * block and len(resumed) + m <= 4 * block, f"{where}: a decode needs a page"
    assert (len(holder) - 1) // block * block == 3 * block, f"{where}: the holder's checkpoint at jf"
    assert sum(map(len, prompts)) <= 13 * block and 4 * k + 23 <= usable == 8 * k + 8, where
    from vllm import SamplingParams

    sp = [SamplingParams(max_tokens=n, temperature=0.0, logprobs=20, ignore_eos=True)
          for n in (d,) * (k + 1) + (m,)]
    runs = {}
    for mode in ("exporter", "split"):
        llm = _engine(tiny_model_dir("qwen3_next"), engine_args, mode, kv_cache_memory_bytes=kv,
                      max_model_len=4 * block + 16, max_num_seqs=8, max_num_batched_tokens=13 * block,
                      enable_chunked_prefill=True, scheduler_reserve_full_isl=False,
                      disable_log_stats=False)
        try:
            pool = _core(llm).scheduler.kv_cache_manager.block_pool
            at = f"{where}, {mode}"
            assert _block(llm) == block and pool.num_gpu_blocks == usable + 1, (at, pool.num_gpu_blocks)
            before = block_hashes(llm)
            n0 = len(llm._vhn_steps)
            with (_scheduler_record(llm) as (preempted, lookups), _scheduled_tokens(llm) as steps,
                  _planned_blocks_per_step(llm) as planned):
                batch = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
            seen = [("resumed" if p == tuple(resumed) else len(p), n) for p, n in preempted]
            assert len(seen) == 1 and seen[0][0] == "resumed" and seen[0][1] > len(resumed), \
                f"{at}: preempted {seen} (tokens computed)"
            metric = [mt.value for mt in llm.get_metrics() if mt.name == "vllm:num_preemptions"]
            assert metric == [1], f"{at}: vllm:num_preemptions {metric}"
            mine = [(n, hit, junction) for p, n, hit, junction, _ in lookups if p == tuple(resumed)]
            assert mine[0] == (0, 0, jf) and (1, 0, jf) in mine, f"{at}: the resumed request's lookups {mine}"
            assert pool.get_num_free_blocks() == usable, f"{at}: {pool.get_num_free_blocks()} free"
            # the resumed row's prefill steps: those after the first in which it was not scheduled
            ran = [i for i, s in enumerate(steps) if tuple(resumed) in s]
            back = next(i for i, j in zip(ran, ran[1:] + [None]) if j != i + 1) + 1
            again = [i for i in ran if i > back and steps[i][tuple(resumed)] > 1]
            states = {p: _checkpoint_states(llm, p, before) for p in (jf, 3 * block)}
            if mode == "exporter":
                for p in (jf, 3 * block):  # written by the resumed row's first step
                    cached = set(cached_mamba_blocks(llm, p, before).values())
                    assert cached <= planned.get(n0 + again[0] + 1, set()), \
                        f"{at}: the blocks cached at {p} ({cached}) not written in the resumed step"
            (hit,), hit_steps = _gen(llm, [third])
            runs[mode] = dict(batch=batch, again=again, states=states, hit=hit, hit_steps=hit_steps,
                              dtype=_ssm_cache_dtype(llm), fused=_fused(llm))
            if mode == "exporter":
                (cold,), _ = _gen(llm, [third], salt=uuid.uuid4().hex)
                _assert_same([Sequence.from_output(cold.outputs[0])], [Sequence.from_output(hit.outputs[0])],
                             exact=exact_across_schedules)
        finally:
            _close(llm)
    ours, split = runs["exporter"], runs["split"]
    assert len(ours["again"]) == 1 and len(split["again"]) >= 2, \
        f"{where}: the resumed prefill took {len(ours['again'])} steps, vLLM's split {len(split['again'])} (caching off: 1)"
    assert ours["hit"].num_cached_tokens == split["hit"].num_cached_tokens == jf and ours["hit_steps"] == 1, \
        (where, ours["hit"].num_cached_tokens, split["hit"].num_cached_tokens, ours["hit_steps"])
    for p in (jf, 3 * block):
        # 3B follows jf in the resumed row: CUDA's one pass carries the float32 state past jf where
        # vLLM's split (and the CPU path's rounds) read it back in the cache dtype first
        rounded = p > jf and ours["fused"] and ours["dtype"].itemsize < 4
        for (name, conv, ssm), (name_s, conv_s, ssm_s) in zip(ours["states"][p], split["states"][p], strict=True):
            at = f"{where}, {name}, state at {p}"
            assert name == name_s and torch_equal(conv, conv_s), f"{at}: conv, {_byte_diff(conv, conv_s)}"
            assert (_within_one_rounding(ssm, ssm_s, ours["dtype"]) if rounded else torch_equal(ssm, ssm_s)), \
                f"{at}: SSM state, {_byte_diff(ssm, ssm_s)}"
    _assert_same([Sequence.from_output(o.outputs[0]) for o in split["batch"]],
                 [Sequence.from_output(o.outputs[0]) for o in ours["batch"]], exact=False)


@pytest.mark.parametrize("ssm_dtype", ["auto", "float32"])
def test_prefix_match_unit_64_plans_where_the_scheduler_caches(tiny_model_dir, engine_args, rng,
                                                                exact_across_schedules, ssm_dtype):
    """``--prefix-match-unit 64``: hits and the prompt's checkpoint land on 64-token boundaries
    inside the block (vLLM 0.33: ``cache_hit_alignment_tokens`` 64, not the block; the declared
    alignment ``lcm(64, 64)``). Own engines (exporter, then vLLM's split), last. Each cold prompt
    (over a block, its last 64-token boundary drawn anywhere in its last block) takes one step, the
    blocks the exporter writes are the blocks the scheduler caches at ``(L - 1) // 64 * 64``, the
    repeat hits exactly there with the cold copy's outputs, and the cached conv and SSM bytes equal
    those vLLM's split caches at the same position, in the target's own SSM cache dtype and in
    float32; in bf16, where the split also stopped at a block boundary before the checkpoint, the
    SSM state within that extra rounding (``_within_one_rounding``)."""
    got = []
    extra = {} if ssm_dtype == "auto" else {"mamba_ssm_cache_dtype": ssm_dtype}
    llm = _engine(tiny_model_dir("qwen3_next"), engine_args, "exporter", prefix_match_unit=64, **extra)
    try:
        _assert_declared(llm)
        block = _block(llm)
        # the third ends on the 64-token grid with its checkpoint inside a block: vLLM 0.30
        # registered its attention tail at the prompt's end, out of a resend's reach (resend-tail)
        lengths = [rng.randrange(block + 65, 3 * block) for _ in range(2)]
        lengths.append(rng.choice([n for n in range(block + 128, 3 * block, 64) if (n - 64) % block]))
        prompts = [_prompt(rng, n) for n in lengths]
        for p in prompts:
            position = (len(p) - 1) // 64 * 64
            before = block_hashes(llm)
            cold, steps = _cold_written_where_cached(llm, p, position)
            assert steps == 1, f"{len(p)}-token cold prompt took {steps} steps"
            got.append(_checkpoint_states(llm, position, before))
            (hit,), _ = _gen(llm, [p])
            assert hit.num_cached_tokens == position, (len(p), block)
            _assert_same([Sequence.from_output(cold.outputs[0])],
                         [Sequence.from_output(hit.outputs[0])], exact=exact_across_schedules)
        # a prompt on the grid (its checkpoint inside a block) that decodes a few tokens: the
        # resend still hits its checkpoint (decode steps must not re-key its attention tail)
        n = rng.choice([n for n in range(block + 128, 3 * block, 64) if (n - 64) % block])
        grid, out_tokens = _prompt(rng, n), rng.randrange(2, 7)
        _gen(llm, [grid], max_tokens=out_tokens, ignore_eos=True)
        (again,), _ = _gen(llm, [grid])
        assert again.num_cached_tokens == n - 64, (n, out_tokens, block, again.num_cached_tokens)
        from vllm_hybrid_npu.patches import registry

        if "resend-tail" in registry.REPORT.applied:  # vLLM 0.30 (0.32: both at the unit before)
            # a prompt on the grid within one block has no checkpoint: its end state and attention
            # tail stay at its end, which a longer prompt extending it hits (0.30's rule kept)
            short = _prompt(rng, rng.randrange(128, block, 64))
            _gen(llm, [short])
            (ext,), _ = _gen(llm, [short + _prompt(rng, rng.randrange(65, block))])
            assert ext.num_cached_tokens == len(short), (len(short), block)
    finally:
        _close(llm)
    split = _engine(tiny_model_dir("qwen3_next"), engine_args, "split", prefix_match_unit=64, **extra)
    try:
        import torch

        dtype = _ssm_cache_dtype(split)
        for n, p in enumerate(prompts):
            before = block_hashes(split)
            position = (len(p) - 1) // 64 * 64
            # a prompt ending on the grid: vLLM 0.30's split caches its end, not the position;
            # the state there is its first `position` tokens', as in a prompt one token longer
            _, steps = _gen(split, [p if len(p) % 64 else p[:position + 1]])
            assert steps > 1, f"vLLM's split took {steps} step for a {len(p)}-token prompt"
            ref = _checkpoint_states(split, position, before)
            # more than two steps: vLLM's split also stopped at a block boundary before the
            # checkpoint and stored the state there in the cache dtype, then went on from it; one
            # pass carries float32 to the checkpoint. In a bf16 cache that extra rounding shows:
            # vLLM 0.33 on an H200 (2026-11-28, seed 2090505745), a 505-token prompt at block 192
            # (split 3 steps): 85 of 32,768 SSM elements of layer 0 differed, by at most 1.2e-4;
            # the same draw in a float32 cache was byte-equal
            rounded = dtype != torch.float32 and steps > 2
            for (name, conv, ssm), (name_s, conv_s, ssm_s) in zip(got[n], ref):
                where = f"SSM cache {dtype}, prompt {n} ({len(p)} tokens, split {steps} steps), {name}"
                assert name == name_s
                if not exact_across_schedules:
                    # CUDA: the split's steps run the input projection on other batch shapes
                    # (M = its chunk, ours the whole prompt), whose GEMM may round a bf16 output
                    # apart: H200, 2026-11-29, seed 1166516797, a 384-token prompt at block 192:
                    # 1,065 of 2,304 conv elements apart, by at most 0.0312, in a float32 SSM
                    # cache 374 of 32,768 SSM elements by at most 4e-8; the same with the junction
                    # export off (the conv bound below not yet run on a GPU)
                    # the conv state holds the input projection's bf16 outputs as they are (vLLM's
                    # mamba_cache_dtype auto); a sum of bf16 products rounded in another order errs
                    # relative to its terms, not to an element they cancel to, hence the bound
                    # against the state's largest magnitude (one element of the seeded draw was
                    # more than a unit of its own apart); a token from another position differs
                    # by the activations' range
                    assert _within_one_rounding(conv, conv_s, torch.bfloat16), \
                        f"{where}: conv, {_byte_diff(conv, conv_s)}"
                    assert _within_one_rounding(ssm, ssm_s, dtype, torch.bfloat16), \
                        f"{where}: SSM state, {_byte_diff(ssm, ssm_s)}"
                    continue
                if rounded:
                    assert _within_one_rounding(ssm, ssm_s, dtype), f"{where}: SSM state, {_byte_diff(ssm, ssm_s)}"
                else:
                    assert torch_equal(ssm, ssm_s), f"{where}: SSM state, {_byte_diff(ssm, ssm_s)}"
                assert torch_equal(conv, conv_s), f"{where}: conv, {_byte_diff(conv, conv_s)}"
    finally:
        _close(split)


def _retention_entry_outside() -> str | None:
    """Why the registry entry ``gdn-manager-cache`` (which carries
    the option ``ckpt``; vLLM 0.30 only) does not apply to the installed stack,
    as the plugin's load decides, or None."""
    from vllm_hybrid_npu.patches.gdn_mamba_manager import PATCHES
    from vllm_hybrid_npu.patches.registry import stack_skip_reason
    from vllm_hybrid_npu.support import detect_stack

    entry = next(p for p in PATCHES if p.name == "gdn-manager-cache")
    return stack_skip_reason(entry, detect_stack())


_RETENTION_OUTSIDE = _retention_entry_outside()


def _grid_ends_below(d: dict[str, int], block: int) -> list[int]:
    """The chunk ends (tokens) below the non-final chunk ``j``'s checkpoint that lie on the
    retention grid: ``i * bB`` for ``i < j`` with ``i * b`` a multiple of ``rb``."""
    b, rb, j = d["b"], d["rb"], d["j"]
    return [i * b * block for i in range(1, j) if (i * b) % rb == 0]


def _chunk_checkpoint_draw(rng, block: int) -> dict[str, int]:
    """A cold prompt cut into ``k`` (2-4) full chunks of ``b`` blocks (the token budget, 2-3
    blocks) and a final chunk of ``B + 1`` to ``bB`` tokens (its checkpoint, ``(n - 1) // B``
    blocks, lies past the final chunk's start, so vLLM's ``is_mamba_prefill_checkpoint_valid``
    places it in that chunk); a retention interval of ``rb`` blocks (2-4; 1 would be dense: vLLM's
    ``reachable_block_mask`` returns None at or below the block); the non-final chunk ``j``
    (1-``k``) whose checkpoint a second prompt reaches, and that prompt's own tokens ``t``
    (fewer than a block: no whole block past the shared prefix). ``b``, ``rb``, ``k`` and ``j`` are
    drawn again until a chunk end below chunk ``j``'s checkpoint lies on the retention grid
    (``_grid_ends_below``), so that what ``final`` leaves the second prompt is a cached state, not
    a cold prefill."""
    while True:
        b, rb, k = rng.choice((2, 3)), rng.choice((2, 3, 4)), rng.choice((2, 3, 4))
        d = {"b": b, "rb": rb, "k": k, "j": rng.randrange(1, k + 1)}
        if _grid_ends_below(d, block):
            break
    return {**d, "n": k * b * block + rng.randrange(block + 1, b * block + 1), "t": rng.randrange(1, block)}


def _chunk_checkpoints_by_hand(d: dict[str, int], block: int, mode: str) -> list[int]:
    """Block boundaries (tokens) holding a cached GDN state after the cold prompt of ``d``, worked
    out from the block grid and the retention rule (not read off the code under test).

    Chunks end at ``i * bB`` (``i`` = 1..k: vLLM's align mode ends a non-final chunk on a block
    boundary and the budget is whole blocks), then at ``n``. A non-final chunk leaves its running
    state at ``i * bB``, cached where the retention grid has a boundary (a multiple of ``rb``
    blocks), and, with the exporter, its prefill checkpoint one block below its end
    (``get_mamba_prefill_checkpoint_position(i * bB)`` = ``(i * b - 1) B``), cached by vLLM 0.30 at
    any retention but 0 (``all``) and dropped with ``final``. The final chunk leaves the prompt's
    checkpoint ``(n - 1) // B * B`` (kept in both modes); its running state is cached as a
    non-final chunk's is: where ``n`` is a block boundary on the retention grid (the draw's final
    chunk may end on one), not where it ends inside a block."""
    b, rb, k, n = d["b"], d["rb"], d["k"], d["n"]
    ends = {i * b * block for i in range(1, k + 1) if (i * b) % rb == 0}
    if n % block == 0 and (n // block) % rb == 0:
        ends.add(n)
    chunk_checkpoints = {(i * b - 1) * block for i in range(1, k + 1)} if mode == "all" else set()
    return sorted(ends | chunk_checkpoints | {(n - 1) // block * block})


@pytest.mark.skipif(_RETENTION_OUTSIDE is not None,
                    reason=f"the option ckpt is vLLM 0.30's "
                           f"(gdn-manager-cache): {_RETENTION_OUTSIDE}")
def test_chunk_checkpoints_final_drops_non_final_chunk_checkpoints(tiny_model_dir, engine_args, rng,
                                                                   exact_across_schedules):
    """The option ``ckpt`` (``all``, the default, or ``final``; registry entry
    ``gdn-manager-cache``, which wraps vLLM 0.30's
    ``MambaManager._cache_partial_tail_block``) on the real engine: chunked prefill (token budget
    ``bB``) and a retention interval ``--prefix-cache-retention-interval rb * B > 0``, drawn with
    the prompt by ``_chunk_checkpoint_draw``. Own engines: exporter with ``all``, exporter with
    ``final``, caching off (same budget); the block from ``_block_of``.

    Per mode, a cold prompt of ``k + 1`` chunks, then a second prompt sharing exactly its first
    ``P = (j * b - 1) B`` tokens (the non-final chunk ``j``'s checkpoint) plus ``t`` tokens of its
    own, then an exact repeat of the cold prompt:

    * the GDN states vLLM's block pool caches for the cold prompt are those worked out by hand
      (``_chunk_checkpoints_by_hand``): with ``all`` the non-final chunks' checkpoints among them,
      with ``final`` not (vLLM's retention-0 branch: ``BlockPool._maybe_evict_cached_block``);
    * the second prompt's hit (``MambaManager.find_longest_cache_hit``: the longest prefix with a
      cached GDN state at its end): ``P`` with ``all``; with ``final`` the highest chunk end below
      ``P`` on the retention grid (``i * bB`` with ``i * b`` a multiple of ``rb``,
      ``MambaManager.reachable_block_mask``; the draw has one);
    * the repeat hits the prompt's own checkpoint ``(n - 1) // B * B`` in both modes;
    * the cold prompt takes ``k + 1`` prefill steps in both modes and with caching off, the repeat
      one; the schedule, and so the computation, does not change with the option;
    * greedy tokens (top 20 logprobs): the cold prompt's equal between ``all`` and ``final``
      exactly (same schedule); every output of either mode equals caching off's for the same
      prompt under the module's rule across schedules (``_assert_same``, exact on CPU: every
      chunk and hit starts on the 64-token grid)."""
    from vllm_hybrid_npu.patches import registry

    block = _block_of(tiny_model_dir, engine_args)
    d = _chunk_checkpoint_draw(rng, block)
    b, rb, k, n, j = d["b"], d["rb"], d["k"], d["n"], d["j"]
    budget, cp, shared = b * block, (n - 1) // block * block, (j * b - 1) * block
    prompt = _prompt(rng, n)
    sharer = prompt[:shared] + _prompt(rng, d["t"])
    want_hit = {"all": shared, "final": max(_grid_ends_below(d, block))}
    where = (f"block {block}, budget {budget} ({b} blocks), retention {rb * block} ({rb} blocks), "
             f"prompt {n} tokens ({k} full chunks), checkpoint {cp}, sharer {shared} + {d['t']} tokens "
             f"(chunk {j}'s checkpoint)")
    chunked = {"max_num_batched_tokens": budget, "enable_chunked_prefill": True}
    outs, steps, gen = {}, {}, 3
    for mode in ("all", "final", "off"):
        if mode == "off":
            llm = _engine(tiny_model_dir("qwen3_next"), engine_args, "off", **chunked)
        else:
            llm = _engine(tiny_model_dir("qwen3_next"), engine_args, "exporter",
                          env={OPTIONS_ENV: with_option(os.environ.get(OPTIONS_ENV, ""), "ckpt", mode)},
                          prefix_cache_retention_interval=rb * block, **chunked)
        try:
            assert _block(llm) == block or mode == "off", (where, mode, _block(llm))
            before = block_hashes(llm) if mode != "off" else {}
            (cold,), steps[mode] = _gen(llm, [prompt], max_tokens=gen, ignore_eos=True)
            steps[mode] -= gen - 1  # one step per further token (a single request; EOS ignored)
            assert steps[mode] == k + 1, f"{where}: {mode}: the cold prompt took {steps[mode]} prefill steps"
            if mode != "off":  # before the sharer, whose own checkpoint may be cached at P
                assert "gdn-manager-cache" in registry.REPORT.applied, registry.REPORT.skipped
                cached = list(_cached_boundaries(llm, before, n, block))
                assert cached == _chunk_checkpoints_by_hand(d, block, mode), \
                    f"{where}: {mode}: GDN states cached at {cached}"
            (other,), _ = _gen(llm, [sharer], max_tokens=gen, ignore_eos=True)
            outs[mode] = {"cold": cold, "sharer": other}
            if mode == "off":
                continue
            assert other.num_cached_tokens == want_hit[mode], \
                f"{where}: {mode}: the sharer hit {other.num_cached_tokens} tokens, not {want_hit[mode]}"
            (rep,), rep_steps = _gen(llm, [prompt], max_tokens=gen, ignore_eos=True)
            rep_steps -= gen - 1
            assert rep.num_cached_tokens == cp and rep_steps == 1, \
                f"{where}: {mode}: the repeat hit {rep.num_cached_tokens} tokens in {rep_steps} prefill steps"
            outs[mode]["repeat"] = rep
        finally:
            _close(llm)
    assert steps["all"] == steps["final"] == steps["off"], (where, steps)

    def seqs(mode, *names):
        return [Sequence.from_output(outs[mode][name].outputs[0]) for name in names]

    _assert_same(seqs("all", "cold"), seqs("final", "cold"), exact=True, cross_schedule=False)
    for mode in ("all", "final"):
        _assert_same(seqs("off", "cold", "sharer", "cold"), seqs(mode, "cold", "sharer", "repeat"),
                     exact=exact_across_schedules)


def _new_mamba_keys(llm, before) -> dict[int, set[int]]:
    """``{position (tokens): Mamba KV-cache groups}`` of every GDN block vLLM's block pool hashed
    since its hashes were ``before`` (``engines.block_hashes``)."""
    from vllm.v1.core.kv_cache_utils import get_group_id

    groups = mamba_groups(llm)
    out: dict[int, set[int]] = {}
    for block in _core(llm).scheduler.kv_cache_manager.block_pool.blocks:
        if block.block_hash is None or before.get(block.block_id) == block.block_hash:
            continue
        if (group := get_group_id(block.block_hash)) in groups:
            out.setdefault(block.block_hash_num_tokens, set()).add(group)
    return out


@contextlib.contextmanager
def _registry_with(key: str, value: str):
    """The plugin's registry re-applied in this process with the option ``key`` set to ``value``
    (an opt-in read at load), yielding the load report; on exit the option is undone and the
    registry re-applied without it."""
    from vllm_hybrid_npu.patches import apply_patches, registry

    mp = pytest.MonkeyPatch()
    mp.setenv(OPTIONS_ENV, with_option(os.environ.get(OPTIONS_ENV, ""), key, value))
    registry.unapply_all()
    try:
        yield apply_patches()
    finally:
        mp.undo()
        registry.unapply_all()
        apply_patches()


def _entries_outside(module: str, name: str | None = None) -> str | None:
    """Why the registry entry ``name`` of ``vllm_hybrid_npu.patches.<module>`` (default its first:
    an opt-in's entries share their stacks) is not for the installed stack, as the plugin's load
    decides, or None: ``sub_block_tail_split`` (``VLLM_HYBRID_NPU_OPTIONS=tailsplit=off``; vLLM
    0.30), ``gdn-manager-cache`` of ``gdn_mamba_manager`` (the second block's hooks, which run
    ``VLLM_HYBRID_NPU_OPTIONS=second=on``; vLLM 0.30)."""
    import importlib

    from vllm_hybrid_npu.patches.registry import stack_skip_reason
    from vllm_hybrid_npu.support import detect_stack

    entries = importlib.import_module(f"vllm_hybrid_npu.patches.{module}").PATCHES
    entry = entries[0] if name is None else next(p for p in entries if p.name == name)
    return stack_skip_reason(entry, detect_stack())


@pytest.mark.skipif(_entries_outside("sub_block_tail_split") is not None,
                    reason=f"{_entries_outside('sub_block_tail_split')}")
def test_sub_block_tail_split_off_runs_the_last_chunk_whole(tiny_model_dir, engine_args, rng,
                                                            exact_across_schedules):
    """``VLLM_HYBRID_NPU_OPTIONS=tailsplit=off`` (registry entry ``sub-block-tail-split-off``)
    on the real engine, ``--prefix-match-unit 64``, dense retention (so that vLLM keys every block
    boundary a chunk crosses). Own engine, last; the plugin's registry re-applied with the
    variable set (and again without it after). Prompts drawn fresh:

    * a cold prompt of ``L`` tokens, ``65 <= L < B``, off the 64-token grid: vLLM's split stops
      it at ``L // 64 * 64`` (its checkpoint fails the column clause: two steps,
      ``tests/patches/test_sub_block_tail_split.py``); here one step (caching off's), no
      checkpoint written, no GDN state cached at that position; an exact repeat then hits
      nothing, with the cold run's tokens (the same computation);
    * a prompt hitting a first prompt's checkpoint ``m`` inside block ``B..2B`` and ending at
      ``L2`` in ``[2B + 65, 3B)``, off the grid: vLLM's split stops at ``2B`` and then at
      ``L2 // 64 * 64`` (three steps); here one step where the path writes the crossed boundary
      (CPU; CUDA's one pass on vLLM 0.30's V2 runner), two where the mid-block stop (``gdn-chunk-end``)
      still stops at ``2B``; the hit is ``m``; no GDN state cached at ``(L2 - 1) // 64 * 64``;
      the blocks cached at ``2B`` were written by the step (where it runs past ``2B``); a third
      prompt sharing the first ``2B`` tokens hits ``2B`` with the tokens it gets computed cold
      (the state there is right);
    * every output equals the same prompt computed cold under a fresh ``cache_salt``
      (``_assert_same``: exact on CPU)."""
    from vllm_hybrid_npu.patches import registry
    from vllm_hybrid_npu.patches import sub_block_tail_split as T

    llm = None
    with _registry_with("tailsplit", "off") as report:
        try:
            assert T.ENTRY in report.applied or T.ENTRY in report.pending, report.line()
            llm = _engine(tiny_model_dir("qwen3_next"), engine_args, "exporter", prefix_match_unit=64,
                          prefix_cache_retention_interval=None)
            assert T.ENTRY in registry.REPORT.applied, registry.REPORT.line()
            block = _block(llm)
            n = rng.choice([x for x in range(65, block) if x % 64])
            m = block + 64 * rng.randrange(1, block // 64)
            n1 = m + rng.randrange(1, 64)
            n2 = rng.choice([x for x in range(2 * block + 65, 3 * block) if x % 64])
            where = f"block {block}, cold {n}, hit at {m} ({n1}-token first prompt), second {n2}"
            cold_p = _prompt(rng, n)
            before = block_hashes(llm)
            with _planned_blocks() as planned:
                (cold,), steps = _gen(llm, [cold_p])
            assert steps == 1 and not planned, (where, steps, planned)
            assert (n - 1) // 64 * 64 not in _new_mamba_keys(llm, before), (where, _new_mamba_keys(llm, before))
            (rep,), steps = _gen(llm, [cold_p])
            assert rep.num_cached_tokens == 0 and steps == 1, (where, rep.num_cached_tokens, steps)
            _assert_same([Sequence.from_output(cold.outputs[0])], [Sequence.from_output(rep.outputs[0])],
                         exact=True, cross_schedule=False)

            first = _prompt(rng, n1)
            _gen(llm, [first])
            second = first[:m] + _prompt(rng, n2 - m)
            before = block_hashes(llm)
            with _planned_blocks() as planned:
                (out,), steps = _gen(llm, [second])
            stops = not _crossing_written(llm)
            assert out.num_cached_tokens == m, (where, out.num_cached_tokens)
            assert steps == (2 if stops else 1), (where, steps, "stops at 2B" if stops else "")
            keys = _new_mamba_keys(llm, before)
            assert (n2 - 1) // 64 * 64 not in keys, (where, keys)
            if not stops:
                assert set(cached_mamba_blocks(llm, 2 * block, before).values()) <= planned, where
            third = second[:2 * block] + _prompt(rng, rng.randrange(65, block))
            (hit,), _ = _gen(llm, [third])
            assert hit.num_cached_tokens == 2 * block, (where, hit.num_cached_tokens)
            for p, o in ((second, out), (third, hit)):
                (c,), _ = _gen(llm, [p], salt=uuid.uuid4().hex)
                _assert_same([Sequence.from_output(c.outputs[0])], [Sequence.from_output(o.outputs[0])],
                             exact=exact_across_schedules)
        finally:
            if llm is not None:
                _close(llm)


def _free_blocks(llm) -> int:
    return _core(llm).scheduler.kv_cache_manager.block_pool.get_num_free_blocks()


@pytest.mark.skipif(_entries_outside("gdn_mamba_manager", "gdn-manager-cache") is not None,
                    reason=f"{_entries_outside('gdn_mamba_manager', 'gdn-manager-cache')}")
@pytest.mark.parametrize("ssm_dtype", ["auto", "float32"])
def test_second_checkpoint_keeps_the_block_boundary(tiny_model_dir, engine_args, rng,
                                                    exact_across_schedules, ssm_dtype):
    """``VLLM_HYBRID_NPU_OPTIONS=second=on`` (the ``gdn-manager-*`` hooks) on the real engine,
    ``--prefix-match-unit 64``, vLLM's default retention, the SSM cache in the target's own dtype
    and in float32. Own engines (ours, then vLLM's split), last; the registry re-applied with the
    variable set (and again without it after). A cold prompt of ``L`` tokens, ``L`` and its
    checkpoint ``cp = (L - 1) // 64 * 64`` off the grids (``L % 64``, ``cp % B``), two to four
    blocks, drawn fresh:

    * one prefill step (vLLM's split: three, stopping at ``q = cp // B * B`` and at ``cp``); the
      blocks the step writes are the blocks cached at ``q`` and at ``cp``, one each per GDN group
      (without the entries only ``cp``'s: ``test_prefix_match_unit_64_plans_where_the_scheduler_caches``);
    * their conv and SSM bytes equal those vLLM's split caches at ``q`` and ``cp`` (on CPU both
      run vLLM's GDN function up to ``q``, store the state in the cache dtype and go on from it:
      equal by construction; on CUDA, the V2 runner's one pass, within the bound of
      ``test_prefix_match_unit_64_plans_where_the_scheduler_caches``);
    * a second prompt sharing the first ``q + d`` tokens (``0 < d < cp - q``) hits ``q``; a repeat
      of the first hits ``cp``; outputs equal fresh-salt cold runs (``_assert_same``);
    * once every request finished, the block pool has as many free blocks as before (the second
      blocks went back)."""
    import torch

    from vllm_hybrid_npu.patches import registry
    from vllm_hybrid_npu.patches import gdn_second_checkpoint as S

    extra = {} if ssm_dtype == "auto" else {"mamba_ssm_cache_dtype": ssm_dtype}
    llm = None
    with _registry_with("second", "on") as report:
        try:
            assert not report.failed, report.line()
            llm = _engine(tiny_model_dir("qwen3_next"), engine_args, "exporter", prefix_match_unit=64, **extra)
            assert {"gdn-checkpoint-receive", "gdn-checkpoint-receive-v2"} & \
                set(registry.REPORT.applied), registry.REPORT.line()
            assert vars(_core(llm).scheduler.kv_cache_manager).get(S.MANAGERS), \
                "the engine turned the second block off (its exporter path writes one state per row)"
            block = _block(llm)
            n = rng.choice([x for x in range(2 * block + 65, 4 * block) if x % 64 and ((x - 1) // 64 * 64) % block])
            cp = (n - 1) // 64 * 64
            q = cp // block * block
            d = rng.randrange(1, cp - q)
            where = f"block {block}, prompt {n}, cp {cp}, q {q}, shared {q + d}, SSM cache {ssm_dtype}"
            free0 = _free_blocks(llm)
            first = _prompt(rng, n)
            before = block_hashes(llm)
            with _planned_blocks() as planned:
                (cold,), steps = _gen(llm, [first])
            assert steps == 1, (where, steps)
            at_q, at_cp = cached_mamba_blocks(llm, q, before), cached_mamba_blocks(llm, cp, before)
            assert sorted(planned) == sorted([*at_q.values(), *at_cp.values()]), (where, planned, at_q, at_cp)
            ours = {q: _checkpoint_states(llm, q, before), cp: _checkpoint_states(llm, cp, before)}
            second = first[:q + d] + _prompt(rng, rng.randrange(65, block))
            (hit,), _ = _gen(llm, [second])
            assert hit.num_cached_tokens == q, (where, hit.num_cached_tokens)
            (rep,), _ = _gen(llm, [first])
            assert rep.num_cached_tokens == cp, (where, rep.num_cached_tokens)
            for p, o in ((first, cold), (second, hit), (first, rep)):
                (c,), _ = _gen(llm, [p], salt=uuid.uuid4().hex)
                _assert_same([Sequence.from_output(c.outputs[0])], [Sequence.from_output(o.outputs[0])],
                             exact=exact_across_schedules)
            assert _free_blocks(llm) == free0, where
        finally:
            if llm is not None:
                _close(llm)
    split = _engine(tiny_model_dir("qwen3_next"), engine_args, "split", prefix_match_unit=64, **extra)
    try:
        before = block_hashes(split)
        _, steps = _gen(split, [first])
        assert steps == 3, f"{where}: vLLM's split took {steps} steps"
        dtype = _ssm_cache_dtype(split)
        for position, states in ours.items():
            for (name, conv, ssm), (name_s, conv_s, ssm_s) in zip(states, _checkpoint_states(split, position, before)):
                at = f"{where}, state at {position}, {name}"
                assert name == name_s
                if not exact_across_schedules:
                    # CUDA: the one pass carries float32 from q to cp where the split stored q in
                    # the cache dtype, and the input projection runs on other batch shapes: the
                    # bound of test_prefix_match_unit_64_plans_where_the_scheduler_caches
                    assert _within_one_rounding(conv, conv_s, torch.bfloat16), f"{at}: conv, {_byte_diff(conv, conv_s)}"
                    assert _within_one_rounding(ssm, ssm_s, dtype, torch.bfloat16), \
                        f"{at}: SSM state, {_byte_diff(ssm, ssm_s)}"
                    continue
                assert torch_equal(ssm, ssm_s), f"{at}: SSM state, {_byte_diff(ssm, ssm_s)}"
                assert torch_equal(conv, conv_s), f"{at}: conv, {_byte_diff(conv, conv_s)}"
    finally:
        _close(split)


@pytest.mark.skipif(_entries_outside("gdn_mamba_manager", "gdn-manager-cache") is not None,
                    reason=f"{_entries_outside('gdn_mamba_manager', 'gdn-manager-cache')}")
def test_second_checkpoint_through_the_host_tier(tiny_model_dir, engine_args, rng, exact_across_schedules):
    """``VLLM_HYBRID_NPU_OPTIONS=second=on`` beside vLLM's OffloadingConnector
    (``kv_offloading_size`` 1 GiB, a device KV cache of 24 MiB, ``--prefix-match-unit 64``; issue
    38 item 3: sub-block hits and host-tier hits add up). A cold prompt whose checkpoint ``cp``
    lies inside its last block (two to four blocks, drawn fresh) leaves the GDN state at that
    block's start ``q`` in its own block, offered to the host tier as a block boundary; a flood
    of other prompts cycling the device block pool three times evicts it from the device; a
    prompt sharing the first ``q + d`` tokens (``0 < d < cp - q``) then hits ``q`` through the
    host tier (external prefix-cache hits; without the second block the host finds no GDN state
    on the block grid there: the lab's ``second=on`` rows), with the output of a cold copy under a
    fresh ``cache_salt``. Skips where the OffloadingConnector does not run (vLLM's CPU backend),
    with vLLM's error."""
    why = host_tier_unsupported()
    if why:
        pytest.skip(why)
    from vllm_hybrid_npu.patches import gdn_second_checkpoint as S

    llm = None
    with _registry_with("second", "on"):
        try:
            llm = _engine(tiny_model_dir("qwen3_next"), engine_args, "exporter", kv_offloading_size=1.0,
                          disable_log_stats=False, kv_cache_memory_bytes=24 << 20, prefix_match_unit=64)
            assert vars(_core(llm).scheduler.kv_cache_manager).get(S.MANAGERS), "second block off here"
            block = _block(llm)
            n = rng.choice([x for x in range(2 * block + 65, 4 * block) if x % 64 and ((x - 1) // 64 * 64) % block])
            cp = (n - 1) // 64 * 64
            q = cp // block * block
            d = rng.randrange(1, cp - q)
            first = _prompt(rng, n)
            before = block_hashes(llm)
            _, steps = _gen(llm, [first])
            assert steps == 1 and cached_mamba_blocks(llm, q, before), (n, q, steps)
            num_blocks = _core(llm).vllm_config.cache_config.num_gpu_blocks
            flood = [_prompt(rng, 4 * block) for _ in range(-(-3 * num_blocks // 4))]
            for i in range(0, len(flood), 8):
                _gen(llm, flood[i:i + 8])
            ext0 = metric_counter(llm, "vllm:external_prefix_cache_hits")
            sharer = first[:q + d] + _prompt(rng, rng.randrange(65, block))
            (hit,), _ = _gen(llm, [sharer])
            ext = metric_counter(llm, "vllm:external_prefix_cache_hits") - ext0
            diag = (f"block {block}, prompt {n}, cp {cp}, q {q}, shared {q + d}: {num_blocks} device "
                    f"blocks, {len(flood)} flood prompts, external hits {ext}")
            assert hit.num_cached_tokens == q, f"{diag}: the sharer cached {hit.num_cached_tokens}"
            assert 0 < ext <= q, f"{diag}: the hit at q did not come through the host tier"
            (cold,), _ = _gen(llm, [sharer], salt=uuid.uuid4().hex)
            _assert_same([Sequence.from_output(cold.outputs[0])], [Sequence.from_output(hit.outputs[0])],
                         exact=exact_across_schedules)
        finally:
            if llm is not None:
                _close(llm)
