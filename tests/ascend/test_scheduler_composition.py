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
