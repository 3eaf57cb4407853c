"""Issue 19, Ascend: vllm-ascend 0.30.0rc2's GDN forward replayed on CPU exports the split's bytes.

``tests/ascend/gdn_replay.py`` (one subprocess per case; see its docstring for what is
vllm-ascend's real code and what is a torch reference of a kernel's contract) runs the real
``AscendGDNAttentionMetadataBuilder.build`` and ``AscendGatedDeltaNetAttention._forward_core``
with the plugin's registry applied for ``npu`` and compares, on random batches, the conv and SSM
blocks the plugin exports from the AscendC op's ``h`` with the running state of vLLM's split (a
first step stopping at the checkpoint). A second case gives ``fla_npu`` its fused prefill op:
vllm-ascend then chooses it, and the plugin must declare nothing and say why.

Fresh seed per session, printed in every failure; rerun with ``VLLM_HYBRID_NPU_TEST_SEED=<seed>``.
The vllm-ascend sdist is fetched with pip and cached (``tests/ascend/upstream.py``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
from ascend.replay_run import SEED, run_replay  # tests/ascend/replay_run.py
DRAWS = 3
_results: dict = {}


def replay(fla_fused: bool) -> dict:
    if fla_fused not in _results:
        out = Path(os.environ.get("TMPDIR", "/tmp")) / f"vhn-gdn-replay-{os.getpid()}-{fla_fused}.json"
        cmd = [sys.executable, str(HERE / "gdn_replay.py"), "--seed", str(SEED),
               "--draws", str(DRAWS), "--out", str(out)]
        if fla_fused:
            cmd.append("--fla-fused")
        res = run_replay(cmd, out, timeout=600)
        _results[fla_fused] = res
    return _results[fla_fused]


def test_entries_applied_on_the_chunk_path():
    res = replay(False)
    assert not res["failed"], res["failed"]
    for name in ("gdn-checkpoint-ascend-plan", "gdn-checkpoint-ascend-forward",
                 "gdn-checkpoint-spec", "gdn-checkpoint-block-size"):
        assert name in res["applied"], (name, res["applied"], res["skipped"])
    assert res["vllm_ascend_choice"] == {"fla_fused_op": False, "host_metadata_builder": False}
    assert res["paths"]["default"] == ["ascend-chunk", ""]


def test_references_match_the_recurrence():
    ref = replay(False)["reference_check"]
    assert ref["max_abs_diff_output"] < 1e-4 and ref["max_abs_diff_final_state"] < 1e-4, ref


@pytest.mark.parametrize("i", range(DRAWS))
def test_exported_bytes_equal_the_split(i):
    d = replay(False)["draws"][i]
    where = f"seed {SEED}, draw {i}: block {d['block_size']}, rows (context, query) {d['rows']}"
    assert d["checkpoints"], where
    for c in d["checkpoints"]:
        assert c["block_differed_before"], (where, c)
        assert c["conv_equal"] and c["ssm_equal"], (where, c)
    assert d["untouched_equal"] and d["outputs_equal"], where
    assert d["control_off_by_one_chunk_caught"], where


def test_fused_prefill_op_declares_nothing():
    res = replay(True)
    assert res["vllm_ascend_choice"]["fla_fused_op"], res["vllm_ascend_choice"]
    reason = res["skipped"].get("gdn-checkpoint-ascend-forward", "")
    assert "fla_npu" in reason and "no per-chunk state" in reason, res["skipped"]
    path, why = res["paths"]["default"]
    assert path is None and "fla_npu" in why


def test_other_npu_conditions_declare_nothing():
    paths = replay(False)["paths"]
    for case, word in (("pcp2", "prefill context parallel"), ("ssm_float32", "float32"),
                       ("fused_cann_op", "npu_chunk_gated_delta_rule")):
        path, why = paths[case]
        assert path is None and word in why, (case, paths[case])
