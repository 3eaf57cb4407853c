"""GDN prefill checkpoints under EAGLE/MTP speculative decoding, engine side (vLLM 0.30).

vLLM 0.30 rewrites ``qwen3_next_mtp`` to method ``mtp`` (``use_eagle()`` true): every KV-cache
group becomes an eagle group, the full-attention lookup drops one prefix-match unit ``h`` from the
hit, and with a prefill checkpoint declared the Mamba manager reserves the prompt's checkpoint one
unit lower (``get_mamba_prefill_checkpoint_position(N, h, drop=True)``). On vLLM's real
``Scheduler`` and KV-cache manager (tiny hybrid, block ``B = 256``, the exporter's checkpoint
declared, a stub with ``SpeculativeConfig``'s predicates for ``mtp``, no model), with the plugin's
engine entries applied and the CPU path writing under speculative decoding (``SPEC_DECODE_PATHS``;
its worker's part: tests/patches/test_cpu_spec_checkpoints.py), prompt lengths drawn fresh,
``h`` = ``B`` and 64, expected numbers by hand:

* a cold prompt of ``N`` tokens (``N`` within the 2,048-token budget, its checkpoint valid) takes
  one prefill step, as caching off does;
* the engine's list for that step names, in each GDN KV-cache group, the drafter-drop position
  ``cp = (N - 1) // h * h - h`` with the block in column ``cdiv(N, B) - 2`` (kind ``prompt``);
* a repeat hits ``cp``: at least the same engine's hit without speculative decoding minus ``h``,
  never 0 where that hit is 2 units or more; the Mamba block the lookup returns at column
  ``(hit - 1) // B`` is keyed at the hit's length;
* 1, 2 and 3 speculative tokens give the same checkpoints and hits (align mode ignores
  lookahead);
* drafters vLLM does not treat as EAGLE are refused with a reason, and so are EAGLE/MTP on the
  CUDA path (its worker does not write under speculative decoding), on a vLLM other than 0.30 and
  on the NPU with a vllm-ascend other than 0.30.0rc2 (whose speculative GDN forward the NPU paths
  were read against; their worker's part: tests/ascend/test_gdn_checkpoint_replay.py); decode rows
  with draft tokens are not planned.
"""

from __future__ import annotations

import dataclasses
import json
import types

import pytest

pytest.importorskip("vllm")

from vllm_hybrid_npu.patches import gdn_mamba_manager as M  # noqa: E402
from vllm_hybrid_npu.patches import gdn_prefill_checkpoint as G  # noqa: E402
from vllm_hybrid_npu.patches import gdn_step_checkpoints as P  # noqa: E402

B, BUDGET = 256, 2048
#: the plugin's engine-side entries on the CPU target (the worker's wait for the runner's module)
ENTRIES = tuple(p.name for p in M.PATCHES) + (
    "gdn-checkpoint-send", "gdn-chunk-end", "resend-tail-declared", "resend-tail")


def _cpu_stack():
    from vllm_hybrid_npu.support import Stack, detect_stack

    return Stack(target="cpu", vllm=detect_stack().vllm)


def _outside() -> str | None:
    from vllm_hybrid_npu.patches.registry import stack_skip_reason

    # a hook of vLLM 0.30 alone (the junction hooks apply on 0.32 too)
    return stack_skip_reason(next(p for p in M.PATCHES if p.name == "gdn-manager-cache"), _cpu_stack())


pytestmark = pytest.mark.skipif(_outside() is not None, reason=f"MTP checkpoints: {_outside()}")


def spec_stub(k: int, method: str = "mtp", eagle: bool = True):
    """The lab's stand-in for vLLM 0.30's ``SpeculativeConfig`` (``mtp_config``) with ``method``
    and whether vLLM treats it as an EAGLE drafter (``use_eagle``, the block drop)."""
    from vllm_hybrid_npu_lab.model import mtp_config

    stub = mtp_config(k)
    stub.method, stub.use_eagle, stub.use_eagle_block_drop = method, lambda: eagle, lambda: eagle
    return stub


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory):
    from vllm_hybrid_npu_lab.presets import TINY_HYBRID, resolve_model

    d = tmp_path_factory.mktemp("tiny-hybrid-mtp")
    (d / "config.json").write_text(json.dumps(TINY_HYBRID))
    return resolve_model(str(d))[1]


@pytest.fixture
def engine_entries(apply_entries, monkeypatch):
    """The engine entries applied for the CPU target, its path counted as writing under
    speculative decoding (``SPEC_DECODE_PATHS``)."""
    assert "cpu" in G.SPEC_DECODE_PATHS
    # the engine's rules run no kernel: the AMX refusal (the worker's conv kernel) stands aside
    monkeypatch.setattr(G, "cpu_amx_tiles", lambda: False)
    report = apply_entries(*ENTRIES, stack=_cpu_stack())
    assert not report.failed, report.line()
    assert set(ENTRIES) <= set(report.applied) | set(report.pending), report.line()
    return report


class Engine:
    """vLLM's real ``Scheduler`` for the tiny hybrid (block 256, prefix-match unit ``unit``, the
    exporter's checkpoint declared), with ``k`` MTP tokens (0: no speculative decoding)."""

    def __init__(self, cfg, unit: int, k: int, budget: int = BUDGET):
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import MambaSpec
        from vllm.v1.structured_output import StructuredOutputManager

        from vllm_hybrid_npu_lab.model import build_setup
        from vllm_hybrid_npu_lab.upstream_grid import UpstreamSetting

        setup = build_setup(cfg, kv_cache_bytes=64 << 20, max_model_len=4096, block_size=B,
                            prefill_checkpoints=True, max_num_batched_tokens=budget,
                            tune=UpstreamSetting(pmu=None if unit == B else unit, ckpt=True).tune)
        vc = setup.vllm_config
        if k:  # as vLLM builds it: the config, and MambaBase.get_kv_cache_spec's spec blocks
            object.__setattr__(vc, "speculative_config", spec_stub(k))
            for g in setup.kv_cache_config.kv_cache_groups:
                if isinstance(g.kv_cache_spec, MambaSpec):
                    g.kv_cache_spec = dataclasses.replace(g.kv_cache_spec, num_speculative_blocks=k)
        self.sched = Scheduler(vllm_config=vc, kv_cache_config=setup.kv_cache_config,
                               structured_output_manager=StructuredOutputManager(vc),
                               block_size=setup.scheduler_block_size,
                               hash_block_size=setup.hash_block_size, log_stats=False)
        assert (self.sched.cache_config.block_size, self.sched.hash_block_size) == (B, unit)
        assert self.sched.use_eagle_block_drop == bool(k)
        hash_fn = get_hash_fn_by_name(vc.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.hasher = get_request_block_hasher(setup.hash_block_size, hash_fn)
        self.n, self.outputs, self.reserved, self.seen, self.unlisted = 0, [], [], set(), []

    @property
    def mamba(self):
        from vllm.v1.core.single_type_kv_cache_manager import MambaManager

        return [m for m in self.sched.kv_cache_manager.coordinator.single_type_managers
                if isinstance(m, MambaManager)]

    def request(self, prompt, rid):
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        return Request(request_id=rid, prompt_token_ids=list(prompt),
                       sampling_params=SamplingParams(max_tokens=1, ignore_eos=True),
                       pooling_params=None, block_hasher=self.hasher)

    def run(self, prompt):
        """``prompt`` to its one output token: ``(hit tokens, prefill steps)``. Records per step
        each Mamba group's ``(checkpoint record, block ids by column)`` (:attr:`reserved`)."""
        from vllm.v1.outputs import ModelRunnerOutput

        self.n += 1
        req = self.request(prompt, f"r{self.n}")
        self.sched.add_request(req)
        hit, steps, self.reserved = None, 0, []
        while self.sched.has_unfinished_requests():
            out = self.sched.schedule()
            self.outputs.append(out)
            if hit is None:
                hit = out.scheduled_new_reqs[0].num_computed_tokens
            steps += 1
            self.reserved.append({m.kv_cache_group_id: (
                m._checkpoints.get(req.request_id),
                [b.block_id for b in m.req_to_blocks[req.request_id]]) for m in self.mamba})
            done = req.num_computed_tokens >= req.num_tokens
            self.sched.update_from_output(out, ModelRunnerOutput(
                req_ids=[req.request_id], req_id_to_index={req.request_id: 0},
                sampled_token_ids=[[7] if done else []]))
        return hit, steps

    def run_together(self, prompts):
        """``prompts`` (``{request id: tokens}``, added in that order) to one output token each,
        sharing the token budget: per request ``(hit tokens, prefill steps)``. After each
        ``schedule()`` every Mamba block newly cached (``(block id, key length)`` not seen
        before) must be one the step's explicit list names at that position for that request,
        or the block ending at that request's chunk end (its running state); a violation is
        recorded in :attr:`unlisted`."""
        from vllm.v1.outputs import ModelRunnerOutput

        reqs = {rid: self.request(p, rid) for rid, p in prompts.items()}
        for req in reqs.values():
            self.sched.add_request(req)
        hits, steps = {}, dict.fromkeys(reqs, 0)
        while self.sched.has_unfinished_requests():
            out = self.sched.schedule()
            self.outputs.append(out)
            for new in out.scheduled_new_reqs:
                hits[new.req_id] = new.num_computed_tokens
            sent = getattr(out, P.ATTR, None) or {}
            for rid in out.num_scheduled_tokens:
                steps[rid] += 1
                end = reqs[rid].num_computed_tokens  # schedule() advanced it by n already
                for m in self.mamba:
                    ids = [b.block_id for b in m.req_to_blocks[rid]]
                    listed = {(pos, bid) for pos, bid, _ in sent.get(m.kv_cache_group_id, {}).get(rid, ())}
                    if end % B == 0:
                        listed.add((end, ids[end // B - 1]))
                    for b in m.req_to_blocks[rid]:
                        if b.is_null or b.block_hash is None:
                            continue
                        key = (b.block_id, b.block_hash_num_tokens)
                        if key not in self.seen and (key[1], key[0]) not in listed:
                            self.unlisted.append((rid, end, key, sorted(listed)))
                        self.seen.add(key)
            ids = list(out.num_scheduled_tokens)
            self.sched.update_from_output(out, ModelRunnerOutput(
                req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                sampled_token_ids=[[7] if reqs[r].num_computed_tokens >= reqs[r].num_tokens
                                   else [] for r in ids]))
        return {rid: (hits[rid], steps[rid]) for rid in reqs}

    def lookup(self, prompt):
        """The coordinator's hit for ``prompt`` now (read-only) and, per Mamba group, the key
        length (tokens) of the block it returns at column ``(hit - 1) // B``."""
        req = self.request(prompt, "probe")
        co = self.sched.kv_cache_manager.coordinator
        blocks, hit, _ = co.find_longest_cache_hit(req.block_hashes, req.num_tokens - 1)
        keys = {m.kv_cache_group_id: blocks[m.kv_cache_group_id][(hit - 1) // B].block_hash_num_tokens
                for m in self.mamba} if hit else {}
        return hit, keys


def _cdiv(a, b):
    return -(-a // b)


def _draws(rng, unit):
    """Prompt lengths (tokens) within the budget whose drafter-drop checkpoint vLLM reserves
    (``is_mamba_prefill_checkpoint_valid`` from 0: the checkpoint at least one unit in, its
    column ``cdiv(N, B) - 2`` at least 0): one off the block grid, one on it and, below the
    block, one on the unit's grid off the block's."""
    low = 2 * B + 1 if unit == B else B + 1  # h = B: cp = (N-1)//B*B - B >= B needs N > 2B
    off = rng.choice([n for n in range(low, BUDGET + 1) if n % B])
    on = B * rng.randrange(_cdiv(low, B), BUDGET // B + 1)
    if unit == B:
        return off, on
    return off, on, rng.choice([n for n in range(_cdiv(low, unit) * unit, BUDGET + 1, unit) if n % B])


def _prompt(rng, n):
    return [rng.randrange(1, 30000) for _ in range(n)]


@pytest.mark.parametrize("unit", [B, 64])
def test_cold_prompt_lists_the_drafter_drop_checkpoint(tiny_config, engine_entries, rng, unit):
    for n in _draws(rng, unit):
        cp, col = (n - 1) // unit * unit - unit, _cdiv(n, B) - 2  # by hand: one unit below
        prompt = _prompt(rng, n)
        plain = Engine(tiny_config, unit, 0)
        plain.run(prompt)
        base, _ = plain.run(prompt)  # the same engine's repeat without speculative decoding
        mtp = Engine(tiny_config, unit, 1)
        where = dict(n=n, unit=unit, cp=cp, col=col, no_spec_hit=base)
        hit, steps = mtp.run(prompt)
        assert (hit, steps) == (0, 1), where  # caching off: one step within the budget
        sent = getattr(mtp.outputs[0], P.ATTR, None)
        assert sent is not None and set(sent) == {m.kv_cache_group_id for m in mtp.mamba}, where
        for group, (record, ids) in mtp.reserved[0].items():
            assert record == (cp, col), where  # vLLM's manager reserved it there
            assert sent[group] == {"r1": ((cp, ids[col], "prompt"),)}, where
            assert ids[col] != 0, where
        seen, keys = mtp.lookup(prompt)
        hit, steps = mtp.run(prompt)
        where.update(repeat_hit=hit)
        print(where)
        assert seen == hit == cp, where
        assert hit >= base - unit and (hit > 0 or base < 2 * unit), where
        assert set(keys.values()) == {hit}, (where, keys)  # the state at the hit's length


def test_speculative_tokens_give_the_same_checkpoints(tiny_config, engine_entries, rng):
    unit = rng.choice([B, 64])
    n = rng.choice(_draws(rng, unit))
    prompt, rows = _prompt(rng, n), []
    for k in (1, 2, 3):
        eng = Engine(tiny_config, unit, k)
        eng.run(prompt)
        sent = getattr(eng.outputs[0], P.ATTR)
        # positions, kinds and the block's column (ids differ with the spec blocks taken)
        columns = {g: [(p, eng.reserved[0][g][1].index(b), kind) for p, b, kind in v["r1"]]
                   for g, v in sent.items()}
        rows.append((columns, eng.run(prompt)))
    print(dict(n=n, unit=unit, rows=rows))
    assert rows[0] == rows[1] == rows[2], dict(n=n, unit=unit, rows=rows)


def test_exporter_path_under_speculative_decoding(tiny_config, monkeypatch):
    """An EAGLE/MTP drafter: the CPU path and vllm-ascend 0.30.0rc2's NPU paths (their workers
    write under speculative decoding on vLLM 0.30); refused with the reason logged on the CUDA
    path (before its backend is probed), on another vLLM, on the NPU with another vllm-ascend and
    with the CPU path taken off ``SPEC_DECODE_PATHS``; a drafter vLLM does not treat as EAGLE
    (ngram): refused with its method named."""
    from vllm_hybrid_npu.patches import registry
    from vllm_hybrid_npu.support import Stack
    from vllm_hybrid_npu_lab.model import build_setup
    from vllm_hybrid_npu_lab.upstream_grid import UpstreamSetting

    vc = build_setup(tiny_config, kv_cache_bytes=64 << 20, max_model_len=4096, block_size=B,
                     prefill_checkpoints=True, max_num_batched_tokens=BUDGET,
                     tune=UpstreamSetting(pmu=None, ckpt=True).tune).vllm_config
    monkeypatch.setattr(registry.REPORT, "stack", Stack("cpu", "0.30.0"))
    monkeypatch.setattr(G, "cpu_amx_tiles", lambda: False)
    assert G.exporter_path(vc, "cpu") == ("cpu", "")
    object.__setattr__(vc, "speculative_config", spec_stub(1))
    assert G.exporter_path(vc, "cpu") == ("cpu", "")
    monkeypatch.setattr(G, "cpu_amx_tiles", lambda: True)  # vLLM's C++ conv on the wide state
    path, why = G.exporter_path(vc, "cpu")
    assert path is None and "AMX" in why
    monkeypatch.setattr(G, "cpu_amx_tiles", lambda: False)
    why = G.speculative_off(vc, "triton")
    assert why is not None and "EAGLE/MTP" in why and "triton" in why, why
    # CUDA is refused before its backend is probed
    monkeypatch.setattr(G, "_path", lambda *a: pytest.fail("probed a backend under MTP"))
    got, why = G.exporter_path(vc, "cuda")
    assert got is None and "EAGLE/MTP" in why and "triton" in why, why
    # the NPU paths: on vLLM 0.30.0 with vllm-ascend 0.30.0rc2; the NPU's backend is probed
    npu_paths = ("ascend", "ascend-fla-npu", "ascend-fused", "ascend-chunk")
    monkeypatch.setattr(registry.REPORT, "stack", Stack("npu", "0.30.0", "0.30.0rc2"))
    assert all(G.speculative_off(vc, path) is None for path in npu_paths)
    monkeypatch.setattr(G, "_path", lambda config, target: ("ascend-chunk", ""))
    assert G.exporter_path(vc, "npu") == ("ascend-chunk", "")
    for stack, named in ((Stack("npu", "0.30.0", "0.30.0rc1"), "vllm-ascend 0.30.0rc1"),
                         (Stack("npu", "0.32.0", "0.30.0rc2"), "vLLM 0.32.0")):
        monkeypatch.setattr(registry.REPORT, "stack", stack)
        for path in npu_paths:
            why = G.speculative_off(vc, path)
            assert why is not None and "EAGLE/MTP" in why and named in why and path in why, why
        got, why = G.exporter_path(vc, "npu")
        assert got is None and named in why, why
    monkeypatch.undo()
    monkeypatch.setattr(registry.REPORT, "stack", Stack("cpu", "0.30.0"))
    monkeypatch.setattr(G, "cpu_amx_tiles", lambda: False)
    monkeypatch.setattr(registry.REPORT, "stack", Stack("cpu", "0.32.0"))
    path, why = G.exporter_path(vc, "cpu")
    assert path is None and "vLLM 0.32.0" in why
    monkeypatch.setattr(registry.REPORT, "stack", Stack("cpu", "0.30.0"))
    monkeypatch.setattr(G, "SPEC_DECODE_PATHS", frozenset())
    path, why = G.exporter_path(vc, "cpu")
    assert path is None and "EAGLE/MTP" in why and "cpu" in why
    monkeypatch.setattr(G, "SPEC_DECODE_PATHS", frozenset({"cpu"}))
    object.__setattr__(vc, "speculative_config", spec_stub(3, "ngram", eagle=False))
    path, why = G.exporter_path(vc, "cpu")
    assert path is None and "'ngram'" in why


@pytest.mark.parametrize("unit,k", [(B, 0), (64, 0), (B, 2), (64, 2)],
                         ids=["block", "unit64", "mtp", "mtp-unit64"])
def test_one_line_names_what_the_configuration_decided(tiny_config, engine_entries, caplog, unit, k):
    """The engine logs one line of its decisions at its start: the exporter path, junction
    states on (budget-sized chunks only where the prefix-match unit is the block), with or
    without MTP's block drop (vLLM 0.30: the rule takes the drop's positions), but not under the
    drop with a prefix-match unit below the block (named); the second block off by default."""
    import logging

    with caplog.at_level(logging.INFO, logger="vllm_hybrid_npu"):
        Engine(tiny_config, unit, k)
    lines = [r.getMessage() for r in caplog.records if "decided from this engine's configuration" in r.getMessage()]
    assert len(lines) == 1, lines
    want = {"exporter": "cpu",
            "junctions": "on" if unit == B or not k else
                         "off (EAGLE/MTP's block drop: a prefix-match unit below the block)",
            "budget_chunks": "on" if unit == B else "off",
            "second": "off (second=off)", "drafter_drop": "on" if k else "off"}
    assert lines[0].endswith(", ".join(f"{key}={v}" for key, v in want.items())), lines[0]


def test_plan_skips_decode_rows_with_drafts():
    """A speculative decode row schedules 1 + k tokens across a block boundary (1023 -> 1026,
    block 256): not a prefill chunk, nothing listed; a cold 1,100-token chunk under the drop
    lists its checkpoint 960 (unit 64) in column 3 alone."""
    def block(i):
        return types.SimpleNamespace(block_id=i, is_null=i == 0)

    manager = types.SimpleNamespace(
        block_size=B, kv_cache_group_id=0, drop_eagle_checkpoint_block=True,
        req_to_blocks={"dec": [block(i) for i in (0, 0, 0, 14, 15, 16)],
                       "cold": [block(i) for i in (0, 0, 0, 21, 22, 23)]},
        _checkpoints={"cold": (960, 3)})
    sched = types.SimpleNamespace(requests={"dec": types.SimpleNamespace(num_computed_tokens=1026),
                                            "cold": types.SimpleNamespace(num_computed_tokens=1100)})
    out = types.SimpleNamespace(num_scheduled_tokens={"dec": 3, "cold": 1100},
                                scheduled_spec_decode_tokens={"dec": [5, 6]})
    assert P.plan(sched, out, (manager,)) == {0: {"cold": ((960, 21, "prompt"),)}}


def _budget_and_junction_under_the_drop(cfg, rng, seed, check: bool = True) -> dict:
    """The scenario of :func:`test_budget_chunks_and_junctions_under_the_drop` (raises
    AssertionError naming the draw where an expectation fails). Without ``check`` it asserts
    nothing and returns the draw with the cold run and the shared run (``"cold"``, ``"shared"``:
    ``{request id: (hit tokens, prefill steps)}``)."""
    k = rng.choice((1, 2, 3))
    # a budget on the 64-token grid off the block's, so X's second chunk starts mid-block
    budget = rng.choice([m for m in range(4 * B + 64, 6 * B, 64) if m % B])
    b1 = (budget // B + 1) * B  # the block boundary X's second chunk crosses first
    # X: two chunks, the second final; on the 64-token grid, so the repeat's share is too
    n_x = 64 * rng.randrange(_cdiv(b1 + 3 * B + 1, 64), (2 * budget - 64) // 64 + 1)
    pd_x = (n_x - 1) // B * B - B  # by hand: the no-drop repeat hit (n - 1) // B * B less a block
    r = budget - (n_x - pd_x)  # what X's repeat leaves Y in their shared step (> 2B)
    # Y: its first chunk [0, r) holds its junction a (the post-drop attention hit on X's first
    # s tokens: a + B matched, a kept) below that chunk's checkpoint column; its drop checkpoint
    # pd_y at or past r (no chunk ends past it); it ends within its second step
    a = B * rng.randrange(1, _cdiv(r, B) - 1)
    s = rng.randrange(a + B, a + 2 * B)
    n_y = rng.randrange(_cdiv(r, B) * B + B + 1, r + budget + 1)
    pd_y = (n_y - 1) // B * B - B
    x = _prompt(rng, n_x)
    y = x[:s] + [rng.randrange(30000, 40000) for _ in range(n_y - s)]
    z = x[:s] + [rng.randrange(40000, 50000) for _ in range(rng.randrange(1, B + 1))]
    where = dict(seed=seed, k=k, budget=budget, n_x=n_x, pd_x=pd_x, r=r, a=a, s=s, n_y=n_y,
                 pd_y=pd_y, n_z=len(z))
    eng = Engine(cfg, B, k, budget=budget)
    assert eng.sched.use_eagle_block_drop, where
    # cold X alone: caching off's steps, ceil(n_x / budget) = 2 (budget < n_x <= 2 * budget)
    got = eng.run_together({"x": x})
    where["cold"] = got
    assert not check or got == {"x": (0, 2)}, where
    assert not check or not eng.unlisted, (where, eng.unlisted)
    # X's repeat and Y together, sharing the budget: the repeat hits pd_x, one step; Y hits no
    # GDN state (retention 0 keeps X's pd_x alone, above a) and takes caching off's two steps
    # (n_x - pd_x + n_y <= 2 * budget): [0, r) past its junction a, then [r, n_y)
    got = eng.run_together({"x2": x, "y": y})
    where["shared"] = got
    if not check:
        return where
    assert got == {"x2": (pd_x, 1), "y": (0, 2)}, where
    assert not eng.unlisted, (where, eng.unlisted)
    # a second sharer hits Y's junction state at a exactly; Y's repeat hits pd_y
    got = eng.run_together({"z": z, "y2": y})
    where["after"] = got
    assert (got["z"][0], got["y2"][0]) == (a, pd_y), where
    assert not eng.unlisted, (where, eng.unlisted)
    print(where)
    return where


def test_budget_chunks_and_junctions_under_the_drop(tiny_config, engine_entries, rng, seed):
    """Under MTP's block drop (``k`` drawn, block and prefix-match unit 256, a token budget on
    the 64-token grid off the block's drawn, vLLM's default retention interval 0), on vLLM's
    real scheduler, counted by hand: a cold prompt X takes caching off's steps (two chunks, the
    second started mid-block); X's repeat hits ``(n - 1) // B * B - B`` (the no-speculation
    hit less the drop) while a sharer Y of X's first tokens, sharing those steps' budget, takes
    caching off's steps past its junction; a second sharer hits that junction, Y's repeat its
    drop checkpoint; every Mamba block cached is one the engine's list names at that position
    (or the block ending at the chunk's end)."""
    _budget_and_junction_under_the_drop(tiny_config, rng, seed)


def test_no_drop_positions_are_caught(tiny_config, engine_entries, rng, seed, monkeypatch):
    """Control: the rule with the no-drop positions (``eagle_drop`` False) under the drop loses
    the repeat's hit of the scenario above: X's chunks keep the no-drop positions, not
    ``(n - 1) // B * B - B``, where the repeat's dropped lookup lands, so the repeat hits less."""
    import dataclasses

    from vllm_hybrid_npu.patches import gdn_junction as J

    real = J.junction_rule
    monkeypatch.setattr(J, "junction_rule", lambda *a, **kw: (
        None if (rule := real(*a, **kw)) is None else dataclasses.replace(rule, eagle_drop=False)))
    where = _budget_and_junction_under_the_drop(tiny_config, rng, seed, check=False)
    assert where["shared"]["x2"][0] < where["pd_x"], where
