"""vllm-ascend's own runner code on CPU tensors, with the plugin applied (issue #12 item 4).

For each vllm-ascend release (0.30.0rc2 with vLLM 0.30.0, 0.23.0.post1 with vLLM 0.23.0) and
each SoC family (A2: Triton batch copies; 310P: vllm-ascend's tensor-copy path)
``tests/ascend/replay.py`` runs once in a subprocess and replays the mamba section of
``NPUModelRunner.execute_model`` over a random schedule (chunked prefill, decode, speculative
blocks, finished / preempted / resumed requests) under each KV-connector branch. See that module
and docs/ascend-replay.md for what is executed and what is stubbed.

The schedule comes from a fresh seed per session, printed in every failure; rerun one with
``VLLM_HYBRID_NPU_TEST_SEED=<seed>``. The sdists and vLLM 0.23's sources are fetched with pip and
cached (tests/ascend/upstream.py); a failed fetch fails the tests.

The launcher swap replayed is the plugin's own: ``vllm_hybrid_npu.patches.apply_patches("npu",
stack)`` before vllm-ascend's ``patch_mamba_utils`` is imported (its post-import hook swaps the
launchers). ``replay.py --launcher standin`` replays a local stand-in instead (harness check) and
``--launcher upstream`` vllm-ascend alone (its Triton kernel launch is then reported).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
from ascend.replay_run import SEED, run_replay  # tests/ascend/replay_run.py
CONFIGS = [("0.30.0rc2", "A2"), ("0.30.0rc2", "310P"), ("0.23.0.post1", "A2"),
           ("0.23.0.post1", "310P")]
CONNECTORS = {"0.30.0rc2": ("none", "plain", "layerwise", "multi"),
              "0.23.0.post1": ("none", "plain", "layerwise")}
#: vllm-ascend 0.30.0rc2 on 310P behind a layerwise connector: ``_collect_mamba_copy_meta_torch``
#: stages tensor pairs in ``_tensor_copy_pairs`` only, the connector takes the copy over
#: (``prepare_mamba_state_copy`` -> True, so no batched copy), ``do_mamba_copy_block_for_layer``
#: finds no ``_layer_copy_metadata`` and returns, ``finish_mamba_copy_by_layer`` drops the pairs:
#: upstream alone never copies the states there. The registry entry
#: ``ascend-310p-layerwise-copies`` fixes it; these cases fail when it is not applied.
UPSTREAM_310P_LAYERWISE_BUG = ("0.30.0rc2", "310P", ("layerwise", "multi"))


LAUNCHER = "plugin"
COPY_IMPL = {("0.30.0rc2", "A2"): "triton", ("0.30.0rc2", "310P"): "torch",
             ("0.23.0.post1", "A2"): "torch", ("0.23.0.post1", "310P"): "torch"}
_results: dict = {}


def replay(ascend: str, soc: str) -> dict:
    """Result of one replay subprocess (cached per session)."""
    key = (ascend, soc)
    if key not in _results:
        out = Path(os.environ.get("TMPDIR", "/tmp")) / f"vhn-replay-{os.getpid()}-{ascend}-{soc}.json"
        cmd = [sys.executable, str(HERE / "replay.py"), "--ascend", ascend, "--soc", soc,
               "--seed", str(SEED), "--launcher", LAUNCHER, "--out", str(out)]
        if soc == "A2":
            cmd.append("--sync-check")
        # bytes moved by our Triton kernel under the interpreter on 0.30.0rc2 (batched and
        # per-layer paths); ops' torch implementation elsewhere (same contract, a fraction of the
        # CPU time)
        cmd += ["--copy-impl", COPY_IMPL[key]]
        res = run_replay(cmd, out, timeout=900)
        _results[key] = res
    return _results[key]


def _case_params():
    for ascend, soc in CONFIGS:
        for conn in CONNECTORS[ascend]:
            for spec in (0, 2):
                yield pytest.param(ascend, soc, f"{conn}-spec{spec}",
                                   id=f"{ascend}-{soc}-{conn}-spec{spec}")


@pytest.mark.parametrize("ascend,soc,case", list(_case_params()))
def test_replayed_step_moves_exactly_the_planned_bytes(ascend, soc, case):
    """Per step: upstream's plan == the block tables' plan; every launch through our launcher
    (A2) or vllm-ascend's tensor copies (310P), none through vllm-ascend's Triton kernel; rows
    launched == plan (layerwise: each in its own layer's load); every state byte as expected
    after destinations were poisoned."""
    full = replay(ascend, soc)
    res = full["cases"][case]
    assert res["ok"], f"seed {SEED} (case seed {res['seed']}):\n{res['error']}"
    assert full["copy_impl"] == COPY_IMPL[(ascend, soc)]
    assert res["totals"]["copies"] > 0, f"seed {SEED}: no copy was planned in {case}"


@pytest.mark.parametrize("ascend,soc", CONFIGS)
def test_plugin_defers_to_upstream_and_swaps_only_the_launcher(ascend, soc):
    res = replay(ascend, soc)
    launchers, deferred = res["launchers"], res["deferred_to_upstream"]
    assert deferred == {"preprocess_mamba": True, "do_mamba_copy_block": True}, launchers
    if soc == "A2":
        assert res["triton_batch_memcpy"] is True
        assert not launchers["mamba_utils.batch_memcpy"].startswith("vllm_ascend."), launchers
        if ascend == "0.30.0rc2":
            assert not launchers["patch_mamba_utils._batch_memcpy_triton"].startswith("vllm_ascend.")
            assert launchers["mamba_utils.collect_mamba_copy_meta"].endswith(
                "_collect_mamba_copy_meta_with_layers")
    else:  # 310P: vllm-ascend's tensor path kept, no pointer launcher
        assert res["triton_batch_memcpy"] is False
        assert launchers["mamba_utils.batch_memcpy"].endswith("_batch_memcpy_unavailable")
        assert launchers["mamba_utils.do_mamba_copy_block"].endswith("_do_mamba_copy_block_torch")
        collector = launchers["mamba_utils.collect_mamba_copy_meta"]
        if ascend == "0.30.0rc2":  # ours: vllm-ascend's 310P collector, then pairs filed per layer
            assert collector.startswith("vllm_hybrid_npu."), collector
        else:
            assert collector.endswith("_collect_mamba_copy_meta_torch"), collector


@pytest.mark.parametrize("ascend,soc", CONFIGS)
def test_runner_lines_of_the_mamba_section_ran(ascend, soc):
    res = replay(ascend, soc)
    ran = set()
    for name, c in res["cases"].items():
        if ":" not in name:  # cpu pass (failed cases report the lines they reached)
            ran |= set(c["runner_lines"])
    missing = {k: v for k, v in res["key_lines"].items() if v not in ran}
    assert not missing, f"seed {SEED}: runner lines never executed: {missing}"
    if ascend == "0.30.0rc2":
        assert {"mamba_copy_connector.finish_mamba_state_copy", "prepare_mamba_state_copy"} <= set(
            res["key_lines"])


@pytest.mark.parametrize("ascend,soc", CONFIGS)
def test_schedule_covered_the_request_lifecycle(ascend, soc):
    cases = {k: v for k, v in replay(ascend, soc)["cases"].items() if ":" not in k and v["ok"]}
    tot = lambda key, sel=lambda n: True: sum(v["totals"][key] for n, v in cases.items() if sel(n))  # noqa: E731
    assert tot("finished") > 0 and tot("preempted") > 0 and tot("resumed") > 0, f"seed {SEED}"
    assert max(v["totals"]["accept_bias_max"] for n, v in cases.items() if n.endswith("spec2")) > 0, (
        f"seed {SEED}: no speculative step accepted a draft token")
    if soc == "A2" and ascend == "0.30.0rc2":
        for n in ("layerwise-spec0", "layerwise-spec2", "multi-spec0", "multi-spec2"):
            t = cases[n]["totals"]
            assert t["layerwise_steps"] == t["steps"] and t["per_layer_calls"] > 0, (n, t)


@pytest.mark.parametrize("ascend", ["0.30.0rc2", "0.23.0.post1"])
def test_state_copy_funcs_shape_per_release(ascend):
    """vLLM 0.30 passes the copy functions as a dict keyed by mamba type, 0.23 as a tuple; both
    replays ran (the 0.23 tuple case moves the same bytes, see the per-case test)."""
    res = replay(ascend, "A2")
    kinds = {c["copy_funcs_type"] for n, c in res["cases"].items() if c["ok"]}
    assert kinds == ({"dict"} if ascend == "0.30.0rc2" else {"tuple"})


@pytest.mark.parametrize("ascend", ["0.30.0rc2", "0.23.0.post1"])
def test_no_host_sync_upload_or_file_on_the_copy_launch(ascend):
    """The cases replayed again with the runner's staged buffers on the meta device and our
    Triton launch recorded: inside the installed launchers no host sync, no upload from host
    memory, no file; the launch receives device tensors and exactly the planned copies. A
    control launcher that validates values (``check_values=True``) is caught."""
    res = replay(ascend, "A2")
    sync = res["sync_check"]
    assert sync["violations"] == [], f"seed {SEED}: {sync['violations']}"
    meta = {n: c for n, c in res["cases"].items() if n.startswith("meta:")}
    assert meta and all(c["ok"] for c in meta.values()), {n: c.get("error") for n, c in meta.items()}
    planned = sum(c["totals"]["copies"] for c in meta.values())
    assert sync["kernel_launches"] == sync["launcher_calls"] > 0
    assert sync["copies_launched"] == planned
    control = res["sync_control"]
    assert any("host sync" in v for v in control["violations"]), control


@pytest.mark.parametrize("ascend,soc", CONFIGS)
def test_plugin_registry_applied_the_launcher_entries(ascend, soc):
    """The registry's load report after vllm-ascend's ``patch_mamba_utils`` ran: both launcher
    entries applied on A2, skipped with the 310P reason on 310P; nothing failed."""
    rep = replay(ascend, soc)["plugin_report"]
    assert rep["unsupported"] is None and rep["failed"] == {}, rep
    names = ("copy-kernel-ascend", "copy-kernel-ascend-vllm")
    fix = "ascend-310p-layerwise-copies"
    if soc == "A2":
        assert set(names) <= set(rep["applied"]), rep
        assert fix not in rep["applied"], rep
    else:
        assert all("310P" in rep["skipped"].get(n, "") for n in names), rep
        assert (fix in rep["applied"]) == (ascend == "0.30.0rc2"), rep


def test_upstream_alone_drops_310p_layerwise_copies():
    """The bug the ``ascend-310p-layerwise-copies`` entry fixes is real: vllm-ascend 0.30.0rc2
    without the plugin (``--launcher upstream``) on 310P copies nothing behind a layerwise
    connector, so the per-case byte check fails there, and only there."""
    ascend, soc, broken = UPSTREAM_310P_LAYERWISE_BUG
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"vhn-replay-{os.getpid()}-upstream-310p.json"
    cmd = [sys.executable, str(HERE / "replay.py"), "--ascend", ascend, "--soc", soc,
           "--seed", str(SEED), "--launcher", "upstream", "--out", str(out)]
    res = run_replay(cmd, out, timeout=900)
    cases = {n: c for n, c in res["cases"].items() if ":" not in n}
    bad = {n for n, c in cases.items() if not c["ok"]}
    assert bad == {n for n in cases if n.split("-")[0] in broken}, (SEED, bad)
