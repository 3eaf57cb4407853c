"""The junction rule (:mod:`vllm_hybrid_npu.patches.gdn_junction`: its split entry, and its part
in the Mamba managers' hooks, :mod:`vllm_hybrid_npu.patches.gdn_mamba_manager`) around stand-in
upstream functions, hand-counted (the real scheduler and managers: ``e2e/test_prefill_checkpoints.py``,
``test_shared_prefix_junction_exported_inside_the_step``).

* the scheduler's split: upstream's chunk, or upstream's without the junction stop where the rule
  exports (the request's junction restored either way);
* ``allocate_slots``: the junction handed to the Mamba managers for that call only;
* the Mamba manager: one block more counted, and put in the junction's column (after a
  copy-on-write block of a new request too); a column that is not free keeps upstream's blocks;
* the token budget's chunk (issue 38 item 4): the split keeps the budget's end (floored to the
  64-token grid) where vLLM floors a non-final chunk to the block or stops a chunk started
  mid-block at its next boundary; ``allocate_slots`` hands the managers the position such a
  chunk leaves in a block of its own;
* the worker (``gdn_prefill_checkpoint._junctions``): the blocks a row crosses, by hand, the
  initial state's block of a row started mid-block included;
* the mid-block stop (``gdn-chunk-end``'s inner layer, the paths without that write): a chunk started mid-block
  ends at its next boundary.
"""

from __future__ import annotations

import types

import pytest

pytest.importorskip("vllm.v1.kv_cache_interface")

from vllm_hybrid_npu.patches import gdn_junction as mod  # noqa: E402
from vllm_hybrid_npu.patches import gdn_mamba_manager as M  # noqa: E402
from vllm_hybrid_npu.envs import OPTIONS_ENV  # noqa: E402

B = 384


class Block:
    def __init__(self, block_id):
        self.block_id, self.is_null = block_id, block_id == 0

    def __repr__(self):
        return f"B{self.block_id}"


NULL = Block(0)


def _rule(*managers):
    return mod.JunctionRule(block=B, hash_block=B, alignment=64, eagle_drop=False, managers=managers)


def _request(prompt=1500, junction=768, computed=0, outputs=0):
    return types.SimpleNamespace(request_id="r", num_prompt_tokens=prompt, num_computed_tokens=computed,
                                 shared_prefix_boundary=junction, num_tokens=prompt + outputs)


def test_split_runs_past_an_exported_junction():
    seen = []

    def upstream(self, request, n, local=0, external=0):  # vLLM: stops at the junction
        seen.append(request.shared_prefix_boundary)
        j = request.shared_prefix_boundary
        return j - request.num_computed_tokens - local if j and j < n else n

    sched = types.SimpleNamespace(**{mod.RULE: _rule()})
    split = mod._make_split(upstream, None)
    req = _request()
    assert split(sched, req, 1500) == 1500 and seen == [768, 0] and req.shared_prefix_boundary == 768
    # 1,000 tokens: the prompt checkpoint (960 at a 64-token unit) shares the junction's column
    sched = types.SimpleNamespace(**{mod.RULE: dataclass_replace(_rule(), hash_block=64)})
    assert split(sched, _request(prompt=1000), 1000) == 768
    # no rule (a path without the export): upstream's stop, upstream called once
    seen.clear()
    assert split(types.SimpleNamespace(**{mod.RULE: None}), _request(), 1500) == 768 and seen == [768]


def dataclass_replace(rule, **kw):
    import dataclasses

    return dataclasses.replace(rule, **kw)


def test_allocate_slots_hands_the_junction_for_one_call():
    mamba = types.SimpleNamespace()
    kvm = types.SimpleNamespace(**{mod.RULE: _rule(mamba)})
    during = []

    def upstream(self, request, n, new_computed=0, blocks=None, lookahead=0, external=0, *a, **k):
        during.append(dict(vars(mamba).get(mod.HINT, {})))
        if k.get("boom"):
            raise RuntimeError("boom")
        return "blocks"

    alloc = M._make_allocate(upstream, None)
    assert alloc(kvm, _request(), 1500) == "blocks" and during[-1] == {"r": 768}
    assert vars(mamba)[mod.HINT] == {}
    with pytest.raises(RuntimeError):
        alloc(kvm, _request(), 1500, boom=True)
    assert during[-1] == {"r": 768} and vars(mamba)[mod.HINT] == {}
    alloc(kvm, _request(), 700)  # the chunk ends before the junction
    alloc(kvm, _request(junction=0), 1500)
    assert during[-2:] == [{}, {}]


def _manager(blocks, hint):
    pool = types.SimpleNamespace(get_new_blocks=lambda n: [Block(99)])
    m = types.SimpleNamespace(block_size=B, req_to_blocks={"r": blocks}, block_pool=pool)
    vars(m)[mod.HINT] = hint
    return m


def test_manager_puts_the_junction_block_in_its_column():
    def upstream(self, rid, num_tokens, main):  # vLLM 0.30 align mode: nulls, checkpoint, running
        before = len(self.req_to_blocks[rid])
        self.req_to_blocks[rid] += [NULL, NULL, Block(5), Block(6)]
        return self.req_to_blocks[rid][before:]

    m = _manager([], {"r": 768})
    out = M._make_blocks(upstream, None)(m, "r", 1500, 1500)
    assert [b.block_id for b in m.req_to_blocks["r"]] == [0, 99, 5, 6] == [b.block_id for b in out]
    count = M._make_count(lambda self, rid, *a, **k: 3, None)
    assert count(m, "r", 1500) == 4 and count(_manager([], {}), "r", 1500) == 3

    def with_cow(self, rid, num_tokens, main):  # a new request's partial hit: a CoW block first
        self.req_to_blocks[rid] += [NULL, NULL, Block(5), Block(6)]
        return [Block(7), *self.req_to_blocks[rid][1:]]

    m = _manager([Block(3)], {"r": 768})  # one hit column before the step
    out = M._make_blocks(with_cow, None)(m, "r", 1500, 1500)
    assert [b.block_id for b in m.req_to_blocks["r"]] == [3, 99, 0, 5, 6]
    assert [b.block_id for b in out] == [7, 99, 0, 5, 6]


def test_manager_keeps_a_column_that_is_not_free():
    def upstream(self, rid, num_tokens, main):
        before = len(self.req_to_blocks[rid])
        self.req_to_blocks[rid] += [NULL, Block(4), Block(5), Block(6)]
        return self.req_to_blocks[rid][before:]

    m = _manager([], {"r": 768})
    out = M._make_blocks(upstream, None)(m, "r", 1500, 1500)
    assert [b.block_id for b in out] == [0, 4, 5, 6]


def test_manager_takes_a_column_vllm_freed_of_a_speculative_block():
    """MTP (2 speculative blocks, block 384), by hand: a request with 8 columns before the call
    (nulls, a checkpoint block in column 4, the running state's in 5, speculative blocks in 6
    and 7). The next chunk's ``allocate_new_blocks`` moves the speculative blocks of columns 6
    and 7, which the running state passed, to the end and nulls them; a crossed checkpoint at
    2,688 (column 6) takes a new block there, not returned (the worker's table is append-only;
    the engine's list names the block). A column that was null before the call (never a
    speculative block) is not taken below ``before``, nor one vLLM left holding its block."""
    def relocating(self, rid, num_tokens, main):
        blocks = self.req_to_blocks[rid]
        moved = [blocks[6], blocks[7]]
        blocks[6] = blocks[7] = NULL
        blocks += [Block(8), *moved]  # the new running block, then the spec blocks moved
        return blocks[8:]

    start = [NULL, NULL, NULL, NULL, Block(4), Block(5), Block(16), Block(17)]
    m = _manager(list(start), {"r": 2688})
    m.num_speculative_blocks = 2
    out = M._make_blocks(relocating, None)(m, "r", 3000, 3000)
    assert [b.block_id for b in m.req_to_blocks["r"]] == [0, 0, 0, 0, 4, 5, 99, 0, 8, 16, 17]
    assert [b.block_id for b in out] == [8, 16, 17]
    # column 3 (1,536): null before the call, below before: not taken
    m = _manager(list(start), {"r": 1536})
    m.num_speculative_blocks = 2
    out = M._make_blocks(relocating, None)(m, "r", 3000, 3000)
    assert [b.block_id for b in m.req_to_blocks["r"]] == [0, 0, 0, 0, 4, 5, 0, 0, 8, 16, 17]

    def keeping(self, rid, num_tokens, main):  # vLLM kept column 6's block (a checkpoint there)
        self.req_to_blocks[rid] += [Block(8)]
        return self.req_to_blocks[rid][8:]

    m = _manager(list(start), {"r": 2688})
    m.num_speculative_blocks = 2
    M._make_blocks(keeping, None)(m, "r", 3000, 3000)
    assert [b.block_id for b in m.req_to_blocks["r"]] == [0, 0, 0, 0, 4, 5, 16, 17, 8]


def _vllm_split(self, request, n, local=0, external=0):
    """vLLM 0.30's align-mode chunking without junctions, block ``B``: a non-final chunk floored
    to the block, a chunk starting mid-block stopped at its next boundary."""
    start = request.num_computed_tokens + local + external
    end = start + n
    if end < request.num_prompt_tokens:
        end = end // B * B
    if start % B:
        end = min(end, (start // B + 1) * B)
    return max(end - start, 0)


def test_split_keeps_the_budgets_chunk():
    sched = types.SimpleNamespace(**{mod.RULE: _rule()})
    split = mod._make_split(_vllm_split, None)
    # prompt 3,000: offered 0-1,304 (vLLM: 1,152) -> 1,280; offered 1,280-3,000 (vLLM: to 1,536)
    # -> all 1,720; offered 1,280-2,580 (vLLM: 256) -> 2,560, 1,280 tokens
    assert split(sched, _request(prompt=3000, junction=0), 1304) == 1280
    assert split(sched, _request(prompt=3000, junction=0, computed=1280), 1720) == 1720
    assert split(sched, _request(prompt=3000, junction=0, computed=1280), 1300) == 1280
    # offered 1,280-1,380 mid-block: vLLM floors to 1,152, below the start (nothing); ours 64;
    # offered 50: nothing either way
    assert split(sched, _request(prompt=3000, junction=0, computed=1280), 100) == 64
    assert split(sched, _request(prompt=3000, junction=0, computed=1280), 50) == 0
    # vLLM's chunk kept: a prefix-match unit below the block, a request replaying its outputs, a
    # start off the 64-token grid, no rule
    fine = types.SimpleNamespace(**{mod.RULE: dataclass_replace(_rule(), hash_block=64)})
    assert split(fine, _request(prompt=3000, junction=0), 1304) == 1152
    assert split(sched, _request(prompt=3000, junction=0, outputs=5), 1304) == 1152
    assert split(sched, _request(prompt=3000, junction=0, computed=1300), 1700) == 236
    assert split(types.SimpleNamespace(**{mod.RULE: None}), _request(prompt=3000, junction=0), 1304) == 1152
    # a junction inside the budget's chunk: run past it only where the rule exports it (a start on
    # the grid), else vLLM's chunk
    assert split(sched, _request(prompt=3000, junction=2000, computed=1280), 1720) == 256
    # under EAGLE/MTP's block drop (drop checkpoint 2,999 // 384 * 384 - 384 = 2,304): offered
    # 0-2,600 the chunk would end at 2,560, where vLLM's manager keeps 2,559 // 384 * 384 - 384
    # = 1,920, so it ends at 2,304; offered 0-2,800 -> 2,752 (kept: 2,304); 1,280-2,600 mid-block
    # -> 2,304 too (it would hand 1,920); the final chunk keeps its end
    drop = types.SimpleNamespace(**{mod.RULE: dataclass_replace(_rule(), eagle_drop=True)})
    assert split(drop, _request(prompt=3000, junction=0), 2600) == 2304
    assert split(drop, _request(prompt=3000, junction=0), 2800) == 2752
    assert split(drop, _request(prompt=3000, junction=0, computed=1280), 1320) == 1024
    assert split(drop, _request(prompt=3000, junction=0, computed=1280), 1720) == 1720


def test_allocate_slots_hands_the_crossed_checkpoint():
    mamba = types.SimpleNamespace()
    kvm = types.SimpleNamespace(**{mod.RULE: _rule(mamba)})
    during = []

    def upstream(self, request, n, *a, **k):
        during.append(dict(vars(mamba).get(mod.HINT, {})))

    alloc = M._make_allocate(upstream, None)
    # from 1,280 (mid-block): to the prompt's end 3,000 -> its checkpoint 2,688; to 2,580 -> the
    # last boundary 2,304; to 1,580 (past 1,536 only, whose state the initial block takes) -> none;
    # from 1,152 (on the grid: vLLM's own reservation) -> none
    for computed, n, want in ((1280, 1720, {"r": 2688}), (1280, 1300, {"r": 2304}),
                              (1280, 300, {}), (1152, 1848, {})):
        alloc(kvm, _request(prompt=3000, junction=0, computed=computed), n)
        assert during[-1] == want, (computed, n, during[-1])
        assert vars(mamba).get(mod.HINT, {}) == {}
    # under EAGLE/MTP's block drop one block lower: 2,304 and 1,920
    vars(kvm)[mod.RULE] = dataclass_replace(_rule(mamba), eagle_drop=True)
    for computed, n, want in ((1280, 1720, {"r": 2304}), (1280, 1300, {"r": 1920}),
                              (1280, 300, {}), (1152, 1848, {})):
        alloc(kvm, _request(prompt=3000, junction=0, computed=computed), n)
        assert during[-1] == want, (computed, n, during[-1])


class _CountingRule:
    """A :class:`mod.JunctionRule` that counts the calls of its ``decide`` and ``crossed``."""

    def __init__(self, rule):
        self.rule, self.managers, self.calls = rule, rule.managers, []

    def decide(self, *a):
        self.calls.append("decide")
        return self.rule.decide(*a)

    def crossed(self, *a):
        self.calls.append("crossed")
        return self.rule.crossed(*a)


def _past_the_prompt(rng):
    """A request with a shared-prefix junction inside its prompt and output tokens, and a chunk
    ``(request, start, n)`` starting at or past the prompt's end: a decode token (``n`` 1), or a
    resumed request's replay of its outputs (part of it a prefix hit, ``hit`` tokens)."""
    block = 64 * rng.randint(1, 18)
    prompt = rng.randint(2 * block + 1, 6 * block)
    outputs = rng.randint(1, 2 * block)
    junction = block * rng.randint(1, (prompt - 1) // block)
    req = _request(prompt=prompt, junction=junction, outputs=outputs)
    start = rng.randint(prompt, prompt + outputs - 1)
    hit = rng.randint(0, start) if rng.random() < 0.5 else 0
    req.num_computed_tokens = start - hit
    n = 1 if rng.random() < 0.5 else rng.randint(1, prompt + outputs - start)
    return block, req, start, n, hit


def test_allocate_slots_past_the_prompt_asks_no_rule(rng, seed):
    """Issue 37 item 3: a decode step's allocation (a chunk at or past the prompt's end, here
    also a replay of outputs) goes to upstream with its arguments as given, asking the rule
    nothing and handing the managers no junction, even for a request with a junction (vLLM keeps
    ``shared_prefix_boundary`` for the request's life)."""
    mamba = types.SimpleNamespace()
    got = []

    def upstream(self, *a, **k):
        got.append((a, k, dict(vars(mamba).get(mod.HINT, {}))))
        return "blocks"

    alloc = M._make_allocate(upstream, None)
    for _ in range(200):
        block, req, start, n, hit = _past_the_prompt(rng)
        rule = _CountingRule(mod.JunctionRule(block=block, hash_block=block, alignment=64,
                                              eagle_drop=False, managers=(mamba,)))
        kvm = types.SimpleNamespace(**{mod.RULE: rule})
        blocks, lookahead = object(), rng.randint(0, 3)
        assert alloc(kvm, req, n, hit, blocks, lookahead, 0, delay_cache_blocks=True) == "blocks"
        where = (block, req, start, n)
        assert rule.calls == [], where
        assert got[-1] == ((req, n, hit, blocks, lookahead, 0), {"delay_cache_blocks": True}, {}), where
        assert mod.HINT not in vars(mamba), where


def test_rule_hands_nothing_past_the_prompt(rng, seed):
    """The premise of the early return above: on every chunk at or past the prompt's end the
    real rule (vLLM 0.30's checkpoint position and validity) exports no junction and places no
    crossed checkpoint, at a prefix-match unit of the block and of 64 tokens."""
    for _ in range(500):
        block, req, start, n, _ = _past_the_prompt(rng)
        for unit in (block, 64):
            rule = mod.JunctionRule(block=block, hash_block=unit, alignment=64, eagle_drop=False, managers=())
            where = (block, unit, req, start, n)
            assert rule.decide(req, start, start + n) == ("", 0), where
            assert rule.crossed(req, start, start + n) == 0, where


def test_manager_without_a_junction_is_upstream_alone(rng, seed):
    """The Mamba manager's wrappers on an allocation without a junction (every decode step's):
    upstream's count and blocks as they are, the request's block list not read."""
    class Untouched(dict):
        def __getitem__(self, key):
            raise AssertionError(f"req_to_blocks[{key!r}] read")

    n, out = rng.randint(0, 9), [Block(rng.randint(1, 99))]
    for hint in (None, {}, {"other": 64 * rng.randint(1, 9)}):
        m = types.SimpleNamespace(block_size=B, req_to_blocks=Untouched())
        if hint is not None:
            vars(m)[mod.HINT] = hint
        assert M._make_count(lambda self, rid, *a, **k: n, None)(m, "r", 1500, [], 0, 0, 1500) == n
        assert M._make_blocks(lambda self, rid, *a, **k: out, None)(m, "r", 1500, 1500) is out


def test_budget_rule_expected_from_the_configuration(monkeypatch):
    from vllm_hybrid_npu.patches import registry

    def config(pmu=None, caching=True, dtype="torch.bfloat16"):
        hf = types.SimpleNamespace(architectures=["Qwen3NextForCausalLM"])
        return types.SimpleNamespace(
            cache_config=types.SimpleNamespace(enable_prefix_caching=caching, mamba_cache_mode="align",
                                               prefix_match_unit=pmu),
            model_config=types.SimpleNamespace(hf_config=hf, dtype=dtype), speculative_config=None)

    report = registry.LoadReport()
    monkeypatch.setattr(registry, "REPORT", report)
    monkeypatch.delenv("VLLM_HYBRID_NPU_PREFILL_CHECKPOINTS", raising=False)
    report.pending["gdn-chunk-end"] = "vllm.v1.core.sched.scheduler"
    assert mod.budget_rule_expected(config(), "cpu")
    # under EAGLE/MTP's block drop too: the budget rule's vLLM is one the rule takes the drop on
    from vllm_hybrid_npu.patches import gdn_prefill_checkpoint as gpc
    from vllm_hybrid_npu_lab.model import mtp_config

    from vllm_hybrid_npu.support import Stack

    monkeypatch.setattr(gpc, "cpu_amx_tiles", lambda: False)
    dropped = config()
    dropped.speculative_config = mtp_config(1)
    assert dropped.speculative_config.use_eagle_block_drop()
    report.stack = Stack("cpu", "0.30.0")  # the CPU path writes under EAGLE/MTP on 0.30 only
    assert mod.budget_rule_expected(dropped, "cpu")
    report.stack = None
    # where vllm-ascend's path exports, not under the drop (DROP_TARGETS)
    real = gpc.exporter_path
    monkeypatch.setattr(gpc, "exporter_path", lambda c, target: ("ascend-chunk", "")
                        if target == "npu" else real(c, target))
    assert mod.budget_rule_expected(config(), "npu") and not mod.budget_rule_expected(dropped, "npu")
    monkeypatch.setattr(gpc, "exporter_path", real)
    # a prefix-match unit, caching off, a float32 model (no CPU exporter), another target
    assert not mod.budget_rule_expected(config(pmu=64), "cpu")
    assert not mod.budget_rule_expected(config(caching=False), "cpu")
    assert not mod.budget_rule_expected(config(dtype="torch.float32"), "cpu")
    assert not mod.budget_rule_expected(config(), "npu")
    # the entry applied counts; skipped (another vLLM) or the exporter switched off does not
    report.pending.clear()
    report.applied.append("gdn-chunk-end")
    assert mod.budget_rule_expected(config(), "cpu")
    report.applied.clear()
    report.skipped["gdn-chunk-end"] = "nothing to do on CPU with vLLM 0.32.0"
    assert not mod.budget_rule_expected(config(), "cpu")
    # applied on another vLLM (CUDA 0.32: the mid-block stop alone): no rule
    from vllm_hybrid_npu.support import Stack

    report.applied.append("gdn-chunk-end")
    report.stack = Stack("cuda", "0.32.0")
    assert not mod.budget_rule_expected(config(), "cpu")
    report.stack = None
    monkeypatch.setenv("VLLM_HYBRID_NPU_PREFILL_CHECKPOINTS", "off")
    assert not mod.budget_rule_expected(config(), "cpu")


def test_engine_lists_the_blocks_a_row_crosses_by_hand():
    """The engine's plan (``core.step_checkpoints``, block 384, hand-made rows of a request's
    block ids, 0 = vLLM's null block): a prefill chunk lists ``(position, block id, kind)`` for
    every real block from the column of its start up to its checkpoint's (or, with none, its
    running state's), and then its own checkpoint; the initial state's block of a row started
    mid-block takes the next boundary's state (vLLM's own internal checkpoint after a hit inside
    a block, ``--prefix-match-unit 64``, and the budget rule)."""
    from vllm_hybrid_npu.core.prefill_checkpoints import step_checkpoints

    rows = [  # (start, end, the manager's checkpoint, block ids)
        (1024, 1753, (1536, 3), [0, 0, 7, 9, 11, 0]),    # hit at 1024, one chunk past 1152
        (1000, 1152, None, [0, 0, 5, 0, 0, 0]),          # to its next boundary: nothing crossed
        (768, 2000, (1536, 3), [0, 0, 13, 15, 17, 0]),   # from 768 (the grid), a junction at 1152
        (1024, 2000, None, [0, 0, 4, 0, 8, 10]),         # budget chunk past 1152 and 1536
        (0, 1100, (768, 1), [0, 6, 12, 0, 0, 0]),        # cold, checkpoint 768: column 0 null
    ]
    assert [step_checkpoints(s, e, B, cp, ids) for s, e, cp, ids in rows] == [
        ((1152, 7, "crossed"), (1536, 9, "prompt")), (),
        ((1152, 13, "junction"), (1536, 15, "prompt")),
        ((1152, 4, "crossed"), (1920, 8, "junction")), ()]


def test_mid_block_stop_ends_the_chunk_at_the_boundary():
    """The mid-block stop (``gdn-chunk-end``'s inner layer on CUDA, the NPU) around a stand-in of vLLM's split that
    lifts the mid-block stop (returns the whole chunk), block 384: a chunk from 1024 ends at 1152
    (128 tokens); from 768 (on the grid), or one ending before the boundary, upstream's; on the NPU
    a KV consumer's, upstream's; where no prefill checkpoint is declared (the scheduler's
    ``mamba_has_prefill_checkpoint_blocks``), upstream's."""
    from vllm_hybrid_npu.patches import gdn_prefill_checkpoint as gpc

    def upstream(self, request, n, local=0, external=0):
        return n

    from vllm_hybrid_npu.support import Stack

    stop = gpc._make_mid_block_stop(upstream, Stack("cuda", "0.30.0"))
    sched = types.SimpleNamespace(cache_config=types.SimpleNamespace(block_size=B),
                                  vllm_config=types.SimpleNamespace(kv_transfer_config=None),
                                  mamba_has_prefill_checkpoint_blocks=True)
    assert stop(sched, _request(prompt=2000, computed=1024), 976) == 128
    assert stop(sched, _request(prompt=2000, computed=1000), 976, 24) == 128  # a local hit to 1024
    assert stop(sched, _request(prompt=2000, computed=768), 1232) == 1232
    assert stop(sched, _request(prompt=1100, computed=1024), 76) == 76
    # vllm-ascend keeps a KV consumer's chunk whole once it has computed tokens (its own wrapper)
    npu = gpc._make_mid_block_stop(upstream, Stack("npu", "0.30.0", "0.30.0rc2"))
    sched.vllm_config.kv_transfer_config = types.SimpleNamespace(is_kv_consumer=True)
    assert npu(sched, _request(prompt=2000, computed=1024), 976) == 976
    assert stop(sched, _request(prompt=2000, computed=1024), 976) == 128
    sched.mamba_has_prefill_checkpoint_blocks = False  # no checkpoint declared: vLLM's stop stands
    assert stop(sched, _request(prompt=2000, computed=1024), 976) == 976


def test_junction_paths_by_configuration(monkeypatch):
    """Which exporter paths export junction states (``junctions_off``): the CPU path and
    vllm-ascend's (``ascend`` in the engine core); on vllm-ascend's not with its V2 model runner,
    decode context parallel or a KV transfer connector; CUDA's one pass (``triton``) only on vLLM
    0.30.0's V2 runner (which receives the engine's list), not with ``FLA_USE_FAST_OPS=1``,
    decode or prefill context parallel or micro-batching, and with a KV connector as on CPU."""
    from vllm_hybrid_npu.patches import gdn_prefill_checkpoint as gpc
    from vllm_hybrid_npu.patches import registry
    from vllm_hybrid_npu.support import Stack

    def config(v2=False, dcp=1, kv=None, pcp=1, ubatch=False):
        return types.SimpleNamespace(use_v2_model_runner=v2, kv_transfer_config=kv,
                                     parallel_config=types.SimpleNamespace(
                                         decode_context_parallel_size=dcp,
                                         prefill_context_parallel_size=pcp, use_ubatching=ubatch))

    monkeypatch.delenv("FLA_USE_FAST_OPS", raising=False)
    monkeypatch.setattr(registry.REPORT, "stack", Stack("cuda", "0.30.0"))
    monkeypatch.delenv(OPTIONS_ENV, raising=False)  # default: on (run on an H200)
    assert gpc.junctions_off(config(v2=True), "triton") is None
    monkeypatch.setenv(OPTIONS_ENV, "junctions=off")
    assert f"{OPTIONS_ENV}=junctions=off" in gpc.junctions_off(config(v2=True), "triton")
    monkeypatch.setenv(OPTIONS_ENV, "junctions=yes")
    with pytest.raises(ValueError, match=OPTIONS_ENV):
        gpc.junctions_off(config(v2=True), "triton")
    monkeypatch.setenv(OPTIONS_ENV, "junctions=on")
    for path in ("cpu", "ascend", "ascend-fla-npu", "ascend-fused", "ascend-chunk"):
        assert gpc.junctions_off(config(), path) is None, path
    assert "one checkpoint per row" in gpc.junctions_off(config(), None)
    for path in ("ascend", "ascend-chunk"):
        assert "V2 model runner" in gpc.junctions_off(config(v2=True), path)
        assert "decode context parallel" in gpc.junctions_off(config(dcp=2), path)
        assert "KV transfer" in gpc.junctions_off(config(kv=object()), path)
    assert gpc.junctions_off(config(v2=True, dcp=2, kv=object()), "cpu") is None  # CPU: unchanged
    for version, reason in (("0.30.0", None), ("0.32.0", "CUDA on vLLM 0.32.0"), ("0.33.0", "CUDA on vLLM 0.33.0")):
        monkeypatch.setattr(registry.REPORT, "stack", Stack("cuda", version))
        got = gpc.junctions_off(config(v2=True), "triton")
        assert got is None if reason is None else reason in got, (version, got)
    monkeypatch.setattr(registry.REPORT, "stack", Stack("cuda", "0.30.0"))
    assert "V1 GPU model runner" in gpc.junctions_off(config(), "triton")
    assert "decode context parallel" in gpc.junctions_off(config(v2=True, dcp=2), "triton")
    assert "prefill context parallel" in gpc.junctions_off(config(v2=True, pcp=2), "triton")
    assert "micro-batching" in gpc.junctions_off(config(v2=True, ubatch=True), "triton")
    assert gpc.junctions_off(config(v2=True, kv=object()), "triton") is None
    monkeypatch.setenv("FLA_USE_FAST_OPS", "1")
    assert "FLA_USE_FAST_OPS" in gpc.junctions_off(config(v2=True), "triton")


def test_rule_takes_mamba_manager_subclasses(monkeypatch):
    """``_rule`` hands the rule to vLLM's ``MambaManager`` and its subclasses (vllm-ascend's
    ``AscendMambaManager``, whose module rebinds the name) in align mode with checkpoint blocks;
    not to another class named ``MambaManager``, nor to one outside align mode."""
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager

    from vllm_hybrid_npu.support import Stack

    monkeypatch.delenv("VLLM_HYBRID_NPU_PREFILL_CHECKPOINTS", raising=False)

    class AscendMambaManager(MambaManager):  # as vllm_ascend/patch/platform/patch_mamba_manager.py
        pass

    impostor = type("MambaManager", (), {"__module__": "elsewhere"})

    def manager(cls, mode="align"):
        m = object.__new__(cls)
        m.mamba_cache_mode, m.has_prefill_checkpoint_blocks = mode, True
        return m

    ours, vllms, other, no_align = (manager(AscendMambaManager), manager(MambaManager),
                                    manager(impostor), manager(AscendMambaManager, "all"))
    hf = types.SimpleNamespace(architectures=["Qwen3NextForCausalLM"])
    config = types.SimpleNamespace(
        cache_config=types.SimpleNamespace(enable_prefix_caching=True, mamba_cache_mode="align"),
        model_config=types.SimpleNamespace(hf_config=hf, dtype="torch.bfloat16"),
        speculative_config=None)
    coordinator = types.SimpleNamespace(single_type_managers=[other, ours, no_align, vllms])
    sched = types.SimpleNamespace(
        kv_cache_manager=types.SimpleNamespace(coordinator=coordinator), vllm_config=config,
        mamba_has_prefill_checkpoint_blocks=True, use_eagle_block_drop=False,
        mamba_fine_grained_prefix_cache=False, cache_config=types.SimpleNamespace(block_size=B),
        hash_block_size=B, mamba_prefill_checkpoint_alignment=64)
    rule = mod.decide(sched, Stack("cpu", "0.30.0"))
    assert rule is not None and rule.managers == (ours, vllms)
    assert mod.is_mamba_manager(ours) and not mod.is_mamba_manager(other)
    # vLLM 0.33 with an EAGLE/MTP drafter's lookahead block hashes (its block drop then off):
    # the checkpoint positions read the lookahead, the rule's do not, so there is no rule
    fields = {k: v for k, v in vars(sched).items() if k != mod.RULE}
    assert mod.junction_rule(types.SimpleNamespace(**fields, num_hash_lookahead_tokens=2)) is None
    assert mod.junction_rule(types.SimpleNamespace(**fields, num_hash_lookahead_tokens=0)) is not None
    # EAGLE/MTP's block drop: the rule takes the drop's positions where it was read against the
    # drop (vLLM 0.30, DROP_VERSIONS: drop=True); elsewhere (drop=False, the default: vLLM 0.32)
    # there is no rule
    dropped = {**fields, "use_eagle_block_drop": True}
    rule = mod.junction_rule(types.SimpleNamespace(**dropped), drop=True)
    assert rule is not None and rule.eagle_drop and not mod.junction_rule(types.SimpleNamespace(**fields)).eagle_drop
    assert mod.junction_rule(types.SimpleNamespace(**dropped)) is None
    # a prefix-match unit below the block under the drop: no rule (not checked on the scheduler)
    assert mod.junction_rule(types.SimpleNamespace(**{**dropped, "hash_block_size": 64}), drop=True) is None
    assert mod.junction_rule(types.SimpleNamespace(**{**fields, "hash_block_size": 64})) is not None
    assert mod.decide(types.SimpleNamespace(**dropped), Stack("cpu", "0.30.0")).eagle_drop
    assert mod.decide(types.SimpleNamespace(**dropped), Stack("cpu", "0.32.0")) is None
    # vllm-ascend's paths (an exporter path there): not replayed with several checkpoints a row
    # beside speculative rows, so no rule under the drop; without it the rule stands
    from vllm_hybrid_npu.patches import gdn_prefill_checkpoint as gpc

    monkeypatch.setattr(gpc, "exporter_path", lambda config, target: ("ascend-chunk", ""))
    assert mod.decide(types.SimpleNamespace(**dropped), Stack("npu", "0.30.0")) is None
    assert mod.decide(types.SimpleNamespace(**fields), Stack("npu", "0.30.0")) is not None
    # speculative decoding without the drop (disable_eagle_block_drop, or a drafter that is not
    # EAGLE's): speculative decode rows beside several checkpoints a row all the same, so the
    # rule stands only where that was checked (the CPU path on vLLM 0.30)
    spec = types.SimpleNamespace(**{**vars(config), "speculative_config": object()})
    undropped = {**fields, "vllm_config": spec}
    assert mod.decide(types.SimpleNamespace(**undropped), Stack("npu", "0.30.0")) is None
    # (there vllm-ascend's path itself writes one checkpoint a row: junctions_off says so, and
    # the engine's decision line names it for the junctions and the second block)
    assert "speculative" in gpc.junctions_off(spec, "ascend-chunk")
    assert gpc.junctions_off(config, "ascend-chunk") is None
    monkeypatch.setenv(OPTIONS_ENV, "second=on")
    npu_sched = types.SimpleNamespace(**undropped)
    mod.decide(npu_sched, Stack("npu", "0.30.0"))
    said = M.decisions(npu_sched, Stack("npu", "0.30.0"))
    assert "speculative" in said["junctions"] and "speculative" in said["second"], said
    monkeypatch.delenv(OPTIONS_ENV)
    monkeypatch.setattr(gpc, "exporter_path", lambda config, target: ("cpu", ""))
    rule = mod.decide(types.SimpleNamespace(**undropped), Stack("cpu", "0.30.0"))
    assert rule is not None and not rule.eagle_drop
    assert mod.junction_rule(types.SimpleNamespace(**undropped)) is None
    assert mod.junction_rule(types.SimpleNamespace(**undropped), drop=True) is not None
    # without the drop a prefix-match unit below the block keeps the rule (the drop's reason)
    assert mod.junction_rule(types.SimpleNamespace(**{**undropped, "hash_block_size": 64}),
                             drop=True) is not None
    assert mod.drop_read(Stack("cpu", "0.30.0")) and not mod.drop_read(Stack("npu", "0.30.0"))
    assert mod.DROP_VERSIONS == ("0.30.0",)
    # budget_rule_expected reads the drop by target only: every vLLM with budget-sized chunks
    # is one the rule takes the drop on
    assert set(mod.BUDGET_VERSIONS) <= set(mod.DROP_VERSIONS)


def test_mid_block_stop_stands_aside_where_the_step_writes_the_boundary(monkeypatch):
    """On vllm-ascend's paths (``junctions_off`` None) the step writes the state at the boundary
    a mid-block chunk crosses (the initial state's block, ``_junctions``), so the stop returns
    upstream's chunk, as on the CPU path (which has no stop); decided once per scheduler. With a
    KV connector (junctions off there) or on CUDA's path with its junction export off it stops at
    the boundary; with it on (the default) CUDA's stop stands aside for a start on the 64-token
    grid and stops one off it."""
    from vllm_hybrid_npu.patches import gdn_prefill_checkpoint as gpc
    from vllm_hybrid_npu.support import Stack

    path = {"npu": "ascend-chunk", "cuda": "triton"}
    monkeypatch.setattr(gpc, "exporter_path", lambda config, target: (path[target], ""))
    monkeypatch.setenv(OPTIONS_ENV, "junctions=off")

    def scheduler(kv=None):
        return types.SimpleNamespace(cache_config=types.SimpleNamespace(block_size=B),
                                     vllm_config=types.SimpleNamespace(kv_transfer_config=kv),
                                     mamba_has_prefill_checkpoint_blocks=True)

    def stop(target):
        return gpc._make_mid_block_stop(lambda self, request, n, local=0, external=0: n,
                                        Stack(target, "0.30.0", "0.30.0rc2" if target == "npu" else None))

    sched = scheduler()
    assert stop("npu")(sched, _request(prompt=2000, computed=1024), 976) == 976
    assert vars(sched)[gpc.CROSSING_WRITTEN] == {"npu": True}
    # a stop built for a path without the write, around the same scheduler (as the e2e tests force
    # it), decides for its own target: it stops (a memo shared across targets let it run on, seen
    # on CUDA with the junction export on, 2026-11-29)
    assert stop("cpu")(sched, _request(prompt=2000, computed=1024), 976) == 128
    kv = types.SimpleNamespace(is_kv_consumer=False)
    assert stop("npu")(scheduler(kv), _request(prompt=2000, computed=1024), 976) == 128
    assert stop("cuda")(scheduler(), _request(prompt=2000, computed=1024), 976) == 128
    # CUDA's junction export on (the default) on vLLM 0.30's V2 runner: the one pass writes the
    # crossed boundary at a 64-token chunk start only
    from vllm_hybrid_npu.patches import registry

    monkeypatch.delenv(OPTIONS_ENV, raising=False)
    monkeypatch.delenv("FLA_USE_FAST_OPS", raising=False)
    monkeypatch.setattr(registry.REPORT, "stack", Stack("cuda", "0.30.0"))

    def v2():
        sched = scheduler()
        sched.vllm_config.use_v2_model_runner = True
        sched.vllm_config.parallel_config = types.SimpleNamespace(
            decode_context_parallel_size=1, prefill_context_parallel_size=1, use_ubatching=False)
        return sched

    assert stop("cuda")(v2(), _request(prompt=2000, computed=1024), 976) == 976
    assert stop("cuda")(v2(), _request(prompt=2000, computed=1056), 944) == 1152 - 1056


def test_hooks_take_no_second_block_the_engine_did_not_decide(monkeypatch):
    """The Mamba managers' hooks bound for the junction rule alone (the lab's junction replay; a
    KV-cache manager whose engine did not decide the second block) take no second block, even with
    ``VLLM_HYBRID_NPU_OPTIONS=second=on``: only the engine's decision (``gdn-manager-engine``)
    or the lab's ``apply_second_checkpoint``, which also binds the hooks that give it back, turn it
    on (found in review: blocks taken here were never returned)."""
    from vllm_hybrid_npu.patches import gdn_second_checkpoint as S

    monkeypatch.setenv(OPTIONS_ENV, "second=on")
    mamba = types.SimpleNamespace()
    kvm = types.SimpleNamespace(**{mod.RULE: _rule(mamba)})
    during = []

    def upstream(self, request, n, *a, **k):
        during.append((dict(vars(mamba).get(mod.HINT, {})), dict(vars(mamba).get(S.HINT, {}))))

    M._make_allocate(upstream, None)(kvm, _request(), 1500)  # the prompt's final chunk
    assert during == [({"r": 768}, {})] and vars(kvm)[S.MANAGERS] == ()


def test_rule_reads_the_final_chunk_reservation_and_the_budget_switch(rng, seed):
    """vLLM 0.32's differences, as the rule reads them: under ``final_only`` (sparse retention: the
    manager reserves the prompt checkpoint only on the chunk reaching the prefill end; vLLM 0.32's
    default retention interval 0) a non-final
    chunk is decided with no prompt checkpoint, which leaves the junction's column below the
    chunk's last one (``limit = cdiv(end, B) - 1``), and the final chunk as before; with
    ``budget`` off neither the budget's end nor a crossed boundary is handed out. Drawn: junctions
    in ``(2B, 3B)``, chunks from 0 ending past ``jf + B``."""
    for _ in range(200):
        junction = 2 * B + rng.randrange(1, B)
        prompt = junction + B + rng.randrange(1, 3 * B)
        end = rng.randrange(3 * B + 1, prompt + 1)
        req = _request(prompt=prompt, junction=junction)
        dense, sparse = _rule(), mod.JunctionRule(block=B, hash_block=B, alignment=64, eagle_drop=False,
                                                  managers=(), final_only=True, budget=False)
        where = (junction, prompt, end)
        got = sparse.decide(req, 0, end)
        assert got == ("export", 2 * B), where
        if end == prompt:
            assert got == dense.decide(req, 0, end), where
        assert sparse.budget_end(req, 0, end) == 0 and sparse.crossed(req, 0 + 64, end) == 0, where


def test_exact_junction_stop_by_version_attribute():
    """The rule defers to vLLM where its split stops at the junction itself: vLLM 0.30's
    ``mamba_fine_grained_prefix_cache``, vLLM 0.32's ``mamba_shared_prefix_checkpoint``."""
    ns = types.SimpleNamespace
    assert not mod.exact_junction_stop(ns())
    assert not mod.exact_junction_stop(ns(mamba_fine_grained_prefix_cache=False))
    assert mod.exact_junction_stop(ns(mamba_fine_grained_prefix_cache=True))
    assert mod.exact_junction_stop(ns(mamba_shared_prefix_checkpoint=True))
    assert not mod.exact_junction_stop(ns(mamba_shared_prefix_checkpoint=False))


def test_final_chunk_reservation_read_from_the_installed_manager():
    """:func:`mod.reserves_final_chunk_only`: the installed ``MambaManager`` takes
    ``prefill_end`` (vLLM 0.32) and the coordinator's retention interval is 0 (semantic boundaries
    only: the coordinator passes ``prefill_end``); vLLM 0.30's manager takes no ``prefill_end``
    and reserves on every chunk."""
    import inspect

    from vllm.v1.core import single_type_kv_cache_manager as single

    takes = "prefill_end" in inspect.signature(single.MambaManager.get_num_blocks_to_allocate).parameters
    for retention, sparse in ((0, True), (None, False), (1024, False)):
        kv = types.SimpleNamespace(coordinator=types.SimpleNamespace(retention_interval=retention))
        assert mod.reserves_final_chunk_only(kv) == (takes and sparse), (retention, takes)
    assert not mod.reserves_final_chunk_only(types.SimpleNamespace(coordinator=types.SimpleNamespace()))
