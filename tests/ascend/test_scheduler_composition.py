"""vllm-ascend 0.30.0rc2's scheduler patches + the lab's checkpoint policy ``lean`` (issue #12 item 4).


``tests/ascend/sched_replay.py`` imports vllm-ascend's ``patch_mamba_block_aligned_split`` (the
split wrapper) and ``patch_balance_schedule`` (``BalanceScheduler``) for real, applies the
plugin's registry (which leaves the scheduler class alone: placement is vLLM's since 2026-11-25,
issue 20), takes the scheduler class from vLLM's ``SchedulerConfig.get_scheduler_cls``, wraps it
in the lab's ``lean`` (``vllm_hybrid_npu_lab.scheduling``, a retired comparison row: a checkpoint
stop one block below the prompt's last block boundary, sparse retention and segment-ordered
eviction; until 2026-11-25 the runtime's ``VLLM_HYBRID_NPU_CHECKPOINTS=lean``) and replays four requests
sharing a random prefix through vLLM's real scheduler and KV-cache manager (the lab's replay).
Balance scheduling on (vllm-ascend's copied ``schedule()`` runs) and off (``super().schedule``).
Fresh seed per session, printed on failure (``VLLM_HYBRID_NPU_TEST_SEED`` reruns one).

The junction entries (issue 38, ``sched_replay.py --mode junction``): vllm-ascend's split wrapper,
``BalanceScheduler`` and ``AscendMambaManager`` with the plugin's junction split and Mamba
managers' hooks (``gdn-chunk-end``, ``gdn-manager-*``), in both orders (vllm-ascend's patches first, the registry first), and a control with vLLM's junction
stop: the second request sharing a prefix runs past its junction in one step, the block in the
junction's column reserved, and the third hits the junction.

The sub-block tail split (issue 38 item 3, ``sched_replay.py --mode tailsplit``): the plugin's
``sub-block-tail-split-off`` entry with the same vllm-ascend patches, in both orders, at
``--prefix-match-unit 64``: vllm-ascend's split wrapper calls vLLM's, which reads the rebound
name, so a cold prompt within one block, off the 64-token grid, runs in one chunk and its repeat
hits nothing; the control (the variable ``on``) keeps vLLM's stop at its last 64-token boundary,
which its repeat hits.

The second checkpoint block (issue 38 item 3, ``sched_replay.py --mode second``): the plugin's
second block (its rules in the ``gdn-manager-*`` hooks) with the same vllm-ascend patches, in both orders, at
``--prefix-match-unit 64``, block 256: a cold prompt whose checkpoint (576) lies inside its last
block keeps the block boundary 512 in its column and 576 in a second block, so a sharer of 512
tokens hits 512 (vLLM's re-key: 0) and the prompt's repeat hits 576; every block back in the
pool at the end. The control (the variable ``off``) keeps vLLM's re-key.

The resend tail (``sched_replay.py --mode resend``): ``resend-tail-declared`` and ``resend-tail``
with the same vllm-ascend patches, in both orders, at ``--prefix-match-unit 64``, block 256, on
vllm-ascend's ``AscendHybridKVCacheCoordinator`` (its ``__init__`` does not run vLLM's): prompts
ending on the 64-token grid with the checkpoint ``n - 64`` inside a block, each decoding at least
two tokens, then each resent; the resend hits the checkpoint. Two controls hit 0: the managers
marked in ``HybridKVCacheCoordinator.__init__`` (where the entry was, never run there), and the
tail wrapper without its decode-step keep (0.30's tail at ``n`` re-keys the block).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
from ascend.replay_run import SEED, run_replay  # tests/ascend/replay_run.py


@pytest.fixture(scope="module", params=["on", "off"], ids=["balance-on", "balance-off"])
def composed(request, tmp_path_factory):
    out = tmp_path_factory.mktemp("sched") / "r.json"
    cmd = [sys.executable, str(HERE / "sched_replay.py"), "--seed", str(SEED), "--policy", "lean",
           "--balance", request.param, "--out", str(out)]
    res = run_replay(cmd, out, timeout=600)
    res["balance_flag"] = request.param
    return res


def test_policy_class_wraps_balance_scheduler_and_ascend_split(composed):
    assert composed["failed"] == {}
    # the plugin left vLLM's choice alone (vllm-ascend's rebinding: BalanceScheduler)
    assert composed["vllm_class"] == "vllm_ascend.patch.platform.patch_balance_schedule.BalanceScheduler"
    mro = composed["mro"]
    lean = next(i for i, c in enumerate(mro)
                if c.startswith("vllm_hybrid_npu_lab.") and c.endswith(".LeanRetentionMixin"))
    policy = next(i for i, c in enumerate(mro)
                  if c.startswith("vllm_hybrid_npu_lab.") and c.endswith(".CheckpointPolicyMixin"))
    assert lean < policy, mro
    balance = mro.index("vllm_ascend.patch.platform.patch_balance_schedule.BalanceScheduler")
    vllm = mro.index("vllm.v1.core.sched.scheduler.Scheduler")
    assert policy < balance < vllm, mro
    assert composed["rebound"] and composed["split_is_ascend_wrapper"]
    # every split the scheduler asked for went through vllm-ascend's wrapper, twice: once for the
    # policy's split, once more when the lab's replay (step_reasons.SplitRecorder) asks vLLM's
    # split (vllm-ascend's wrapper there) what it would have returned, to name the policy's stops
    assert composed["ascend_split_calls"] == 2 * len(composed["splits"]) > 0
    assert composed["balance_enabled"] is (composed["balance_flag"] == "on")


def test_requests_scheduled_with_the_policy_chunk_ends(composed):
    bs = composed["block_size"]
    rows = composed["rows"]
    ids = {s[0] for s in composed["splits"]}
    assert ids == {str(i) for i in range(len(rows))}, f"seed {SEED}: not every request prefilled"
    policy_stops = 0
    for rid, start, asked, got, prefill_end in composed["splits"]:
        assert 0 <= got <= asked, (rid, start, asked, got)
        stop = prefill_end // bs * bs - bs  # lean's window: the boundary below the last one
        if start < stop:
            # lean: no chunk crosses its stop
            assert start + got <= stop, f"seed {SEED}: chunk {start}+{got} crosses {stop}"
            if start + asked > stop and start + got == stop:
                policy_stops += 1  # a stop upstream would not make on first sight
    assert policy_stops > 0, f"seed {SEED}: no checkpoint stop of the policy appeared"
    # every prompt's last boundary is one block past the shared prefix, so lean's window keeps a
    # state at the shared prefix's end: the first repeat hits the whole shared prefix
    shared_tokens = [len(h) - 1 for _, _, h in rows][0] * 512
    assert composed["cached_per_request"][0] == 0
    assert composed["cached_per_request"][1] == shared_tokens, (SEED, composed["cached_per_request"])


def _sched_replay(tmp_path_factory, mode: str, **flags: str) -> dict:
    """``sched_replay.py --mode MODE`` with ``--flag value`` for each of ``flags`` (``_`` as
    ``-``), the session's seed; its JSON result."""
    out = tmp_path_factory.mktemp(mode) / "r.json"
    cmd = [sys.executable, str(HERE / "sched_replay.py"), "--seed", str(SEED), "--mode", mode,
           *(x for k, v in flags.items() for x in (f"--{k.replace('_', '-')}", v)), "--out", str(out)]
    return run_replay(cmd, out, timeout=600)


# ------------------------------------------------------------------ junction entries (issue 38)
@pytest.fixture(scope="module", params=[("ascend-first", "on"), ("registry-first", "on"),
                                        ("ascend-first", "off")],
                ids=["ascend-first", "registry-first", "control-stop"])
def junction(request, tmp_path_factory):
    """``sched_replay.py --mode junction``: the plugin's junction entries with vllm-ascend's
    scheduler-side platform patches, in either order; the control keeps vLLM's junction stop."""
    order, on = request.param
    res = _sched_replay(tmp_path_factory, "junction", order=order, junctions=on)
    res["order"], res["on"] = order, on == "on"
    return res


def test_junction_entries_compose_with_vllm_ascend(junction):
    assert junction["failed"] == {}
    for name in ("gdn-chunk-end", "gdn-manager-allocate", "gdn-manager-count",
                 "gdn-manager-blocks"):
        assert name in junction["applied"], name
    ascend, vllm = junction["managers_classes"]
    assert ascend == "vllm_ascend.patch.platform.patch_mamba_manager.AscendMambaManager"
    assert vllm == "vllm.v1.core.single_type_kv_cache_manager.MambaManager"
    # the manager wrappers sit on one class: the one the module's name bound when they applied
    # (vllm-ascend's subclass after its patch, else vLLM's, under AscendMambaManager's super())
    owner = "AscendMambaManager" if junction["order"] == "ascend-first" else "MambaManager"
    assert junction["wrapped_by"] == {"get_num_blocks_to_allocate": [owner],
                                      "allocate_new_blocks": [owner]}
    # one registry entry (gdn-chunk-end), two layers: the junction rule around the mid-block stop
    ours = ["vllm_hybrid_npu/patches/gdn_junction.py:_make_split",
            "vllm_hybrid_npu/patches/gdn_prefill_checkpoint.py:_make_mid_block_stop"]
    theirs = ["vllm_ascend/patch/platform/patch_mamba_block_aligned_split.py"]
    chain = ours + theirs if junction["order"] == "ascend-first" else theirs + ours
    assert junction["split_chain"] == chain + ["vllm/v1/core/sched/scheduler.py"]
    if junction["on"]:  # the rule took vllm-ascend's managers (an exact type-name match did not)
        assert junction["rule_managers"] and all(m == ascend for m in junction["rule_managers"])
    else:
        assert "rule_managers" not in junction


def test_shared_prefix_junction_runs_inside_the_step(junction):
    bs, junction_at, rows = junction["block_size"], junction["junction"], junction["rows"]
    where = f"seed {SEED}, {junction['order']}, junctions {'on' if junction['on'] else 'off'}"
    # premises by construction: the shared prefix ends on the block grid, each prompt one block
    # and some tokens past it (its checkpoint, the last boundary, is not the junction)
    assert junction_at % bs == 0 and all(junction_at + bs < n < junction_at + 2 * bs for n, _, _ in rows)
    chunks, cached = junction["chunks"], junction["cached_per_request"]
    assert chunks["0"] == [[0, rows[0][0]]], where  # cold: one step (the checkpoint declared)
    if junction["on"]:
        # the second sharer runs past the junction in one step, its state's block reserved in
        # the junction's column (in every GDN group)
        assert chunks["1"] == [[0, rows[1][0]]], where
        assert all(junction_at // bs - 1 in cols for cols in junction["mamba_columns"]["1"]), where
    else:  # vLLM's stop at the junction: one more step
        assert chunks["1"] == [[0, junction_at], [junction_at, rows[1][0] - junction_at]], where
    # the third hits the junction's state either way
    assert cached[1] == 0 and cached[2] == junction_at, (where, cached)
    assert chunks["2"] == [[junction_at, rows[2][0] - junction_at]], where


# ------------------------------------------------------------- sub-block tail split (issue 38)
@pytest.fixture(scope="module", params=[("ascend-first", "off"), ("registry-first", "off"),
                                        ("ascend-first", "on")],
                ids=["ascend-first", "registry-first", "control-split"])
def tailsplit(request, tmp_path_factory):
    """``sched_replay.py --mode tailsplit``: the option ``tailsplit`` with
    vllm-ascend's scheduler-side platform patches, in either order; the control keeps vLLM's
    split (``on``)."""
    order, split = request.param
    res = _sched_replay(tmp_path_factory, "tailsplit", order=order, tail_split=split)
    res["order"], res["off"] = order, split == "off"
    return res


def test_tail_split_off_runs_through_vllm_ascends_split(tailsplit):
    assert tailsplit["failed"] == {}
    p, where = tailsplit["prompt"], f"seed {SEED}, {tailsplit['order']}"
    assert (tailsplit["block_size"], tailsplit["hash_block_size"]) == (256, 64)
    assert "vllm_ascend/patch/platform/patch_mamba_block_aligned_split.py" in tailsplit["split_chain"]
    assert tailsplit["manager_valid_vllms"]  # the KV-cache manager keeps vLLM's answer
    chunks, cached = tailsplit["chunks"], tailsplit["cached_per_request"]
    if tailsplit["off"]:
        assert "sub-block-tail-split-off" in tailsplit["applied"] and tailsplit["scheduler_valid_ours"]
        assert chunks["0"] == [[0, p]] and cached == [0, 0], (where, p, chunks, cached)
    else:
        assert "sub-block-tail-split-off" not in tailsplit["applied"]
        assert not tailsplit["scheduler_valid_ours"]
        tail = p // 64 * 64
        assert chunks["0"] == [[0, tail], [tail, p - tail]] and cached == [0, tail], (where, p, chunks, cached)


# ------------------------------------------------------- second checkpoint block (issue 38)
@pytest.fixture(scope="module", params=[("ascend-first", "on"), ("registry-first", "on"),
                                        ("ascend-first", "off")],
                ids=["ascend-first", "registry-first", "control-rekey"])
def second(request, tmp_path_factory):
    """``sched_replay.py --mode second``: the option ``second`` with
    vllm-ascend's scheduler-side platform patches, in either order; the control keeps vLLM's
    re-key (``off``)."""
    order, on = request.param
    res = _sched_replay(tmp_path_factory, "second", order=order, second=on)
    res["order"], res["on"] = order, on == "on"
    return res


def test_second_checkpoint_block_with_vllm_ascends_manager(second):
    assert second["failed"] == {}
    p, m, _ = second["prompts"]
    where = f"seed {SEED}, {second['order']}, second {'on' if second['on'] else 'off'}: {p}, {m}"
    assert (second["block_size"], second["hash_block_size"]) == (256, 64)
    assert 576 < p <= 640 and 768 < m < 1024, where  # premises: checkpoints 576 and 768..960
    ascend, vllm = second["managers_classes"]
    assert ascend == "vllm_ascend.patch.platform.patch_mamba_manager.AscendMambaManager"
    names = {"engine", "allocate", "count", "blocks", "cache", "retire", "free"}
    # the Mamba managers' hooks apply either way; the engine decides whether the rule runs
    applied = {n.rsplit("-", 1)[1] for n in second["applied"] if n.startswith("gdn-manager-")}
    assert applied == names, (where, second["applied"])
    assert "gdn-checkpoint-send" in second["applied"], second["applied"]
    chunks, cached = second["chunks"], second["cached_per_request"]
    # one step per prompt either way (the sharer's junction at 512 is exported inside its step
    # without the second block); the repeat hits the prompt's checkpoint either way
    hit = 512 if second["on"] else 0
    assert chunks == {"0": [[0, p]], "1": [[hit, m - hit]], "2": [[576, p - 576]]}, (where, chunks)
    # the engine's plan, per step with a list: {request: [(position, kind), ...]}, alike in every
    # GDN group (one per group)
    cp_b = (m - 1) // 64 * 64
    sent = [{rid: [(e[0], e[2]) for e in v] for g in pay.values() for rid, v in g.items()}
            for pay in second["payloads"]]
    assert second["planned_groups"] and all(
        len(pay) == second["planned_groups"] for pay in second["payloads"]), where
    if second["on"]:
        owner = "AscendMambaManager" if second["order"] == "ascend-first" else "MambaManager"
        assert set(map(tuple, second["wrapped_by"].values())) == {(owner,)}, second["wrapped_by"]
        # the engine entry took vllm-ascend's managers (one per GDN KV-cache group)
        assert second["engine_managers"] and set(second["engine_managers"]) == {ascend}, where
        assert cached == [0, 512, 576], where
        # each prompt's final chunk whose checkpoint lies inside its last block, off the block
        # grid, took one second block per GDN group, listed once with the block boundary: the
        # first (576), the sharer where (m - 1) // 64 * 64 is not 768; the repeat's chunk (from
        # 576) none
        want = [{"0": [(512, "boundary"), (576, "second")]}]
        want += [{"1": [(768, "boundary"), (cp_b, "second")]}] if cp_b % 256 else []
        assert sent == want, (where, second["payloads"])
    else:
        assert second["engine_managers"] == [], where
        assert cached == [0, 0, 576], where  # vLLM's re-key: nothing at 512
        # the sharer's junction at 512 in its own block, beside its checkpoint
        assert sent == [{"1": [(512, "junction"), (cp_b, "prompt")]}], (where, second["payloads"])
    # nothing leaked: every block but the null block back in the pool (cached ones evictable)
    assert second["free_blocks"] == second["pool_blocks"] - 1 and second["extra_left"] == 0, where


# ------------------------------------------------------------------------------ resend tail
@pytest.fixture(scope="module", params=[("ascend-first", "none"), ("registry-first", "none"),
                                        ("ascend-first", "coordinator"), ("ascend-first", "keep")],
                ids=["ascend-first", "registry-first", "control-coordinator", "control-keep"])
def resend(request, tmp_path_factory):
    """``sched_replay.py --mode resend``: the resend-tail entries with vllm-ascend's
    scheduler-side platform patches, in either order; the controls mark the managers in
    ``HybridKVCacheCoordinator.__init__`` (``coordinator``) or drop the decode-step keep
    (``keep``)."""
    order, control = request.param
    res = _sched_replay(tmp_path_factory, "resend", order=order, control=control)
    res["order"], res["control"] = order, control
    return res


def test_resend_of_a_grid_prompt_hits_its_checkpoint_on_vllm_ascends_coordinator(resend):
    """Hits in tokens: each prompt's first send 0, its resend the Mamba checkpoint
    ``(n - 1) // 64 * 64`` (``n`` the prompt's tokens, 64 the prefix-match unit); 0 in the
    controls."""
    assert resend["failed"] == {}
    assert {"resend-tail-declared", "resend-tail"} <= set(resend["applied"]), resend["applied"]
    assert resend["coordinator"] == (
        "vllm_ascend.patch.platform.patch_kv_cache_coordinator.AscendHybridKVCacheCoordinator")
    bs, unit, rows = resend["block_size"], resend["hash_block_size"], resend["rows"]
    where = f"seed {SEED}, {resend['order']}, control {resend['control']}: rows {rows}"
    assert (bs, unit) == (256, 64), where
    # premises by construction: on the unit grid, the checkpoint n - 64 inside a block past the
    # first, at least one decode step after the prefill
    assert all(n % unit == 0 and (n - unit) % bs and n > bs and out >= 2 for n, out in rows), where
    marked, cached = resend["marked"], resend["cached_per_request"]
    if resend["control"] == "coordinator":
        # vllm-ascend's coordinator never ran HybridKVCacheCoordinator.__init__: nothing marked
        assert marked == [0] * len(marked), where
        assert cached == [0] * 2 * len(rows), (where, cached)
        return
    # every manager carries the engine's GDN managers: every group but the one attention group
    assert marked == [len(marked) - 1] * len(marked), (where, marked)
    if resend["control"] == "keep":  # the first decode step re-keys the tail to n
        assert cached == [0] * 2 * len(rows), (where, cached)
        return
    want = [hit for n, _ in rows for hit in (0, (n - 1) // 64 * 64)]
    assert cached == want, (where, cached)
