"""Our batch-memcpy kernel through triton-ascend's compiler, up to the CANN stage.

``triton-ascend==3.2.0`` (the release vllm-ascend 0.30.0rc2 runs on) replaces the ``triton``
package, so it is installed into its own cached ``pip --target`` directory
(:func:`ascend.upstream.triton_ascend`) and the compile runs in a subprocess with that directory
first on ``PYTHONPATH``. Without CANN, triton-ascend still runs its front end (Python AST ->
Triton IR, the common TTIR passes) and its Ascend adapter (``triton-adapter-opt``: TTIR ->
annotation / unstructured / HIVM / HFusion / Linalg), then fails in the ``npubin`` stage (``ConvertLinalgRToBinary``),
which needs CANN's ``bishengir-compile``. The test asserts exactly that: both earlier stages produced
their IR and the failure is the ``npubin`` stage asking for the Ascend toolkit.

Compiled as the plugin launches it on NPU (:func:`vllm_hybrid_npu.ops._triton_copy.target_config`
for ``"npu"``: ``NPU_BLOCK_BYTES``, no 16-byte path, contiguous tiles, no eviction hints), for
int64 sizes (our API) and int32 sizes (what vLLM's ``MambaCopyBuffers`` stage), each with 16-byte
aligned and unaligned address tensors (a layerwise per-layer slice ``gpu[start:end]`` is aligned
only for some ``start``): the specialisation must not depend on that alignment, otherwise the
first step with a new alignment compiles (seconds on NPU) inside ``execute_model`` whatever was
warmed up.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ascend import upstream  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
KERNEL = REPO / "vllm_hybrid_npu" / "ops" / "_triton_copy.py"

SCRIPT = r'''
import importlib.util, json, sys, traceback
spec = importlib.util.spec_from_file_location("_triton_copy", sys.argv[1])
m = importlib.util.module_from_spec(spec); sys.modules["_triton_copy"] = m; spec.loader.exec_module(m)
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.compiler.compiler import make_backend
from triton.compiler.errors import MLIRCompilationError

target = GPUTarget("npu", "Ascend910B1", 0)
backend = make_backend(target)
# the stage functions add_stages calls, looked up in the backend module's globals at call time
g = type(backend).add_stages.__globals__
stages = {}
def record(name, fn):
    def wrapped(*a, **k):
        res = fn(*a, **k)
        stages[name] = str(res)
        return res
    return wrapped
g["make_ttir"] = record("ttir", g["make_ttir"])
g["ttir_to_linalg"] = record("ttadapter", g["ttir_to_linalg"])

class Addr:
    def __init__(self, p): self.p = p
    def data_ptr(self): return self.p

k = m.batch_memcpy_kernel
cfg = m.LaunchConfig(40, 40 * m.NPU_ITEMS_PER_CORE, m.NPU_BLOCK_BYTES, None, wide16=False)
consts = {kk: v for kk, v in m._launch_kwargs(cfg, False).items() if kk != "num_warps"}
out = {"triton": triton.__version__, "triton_file": triton.__file__, "cases": {}, "constants": consts}
for sizes in ("i64", "i32"):
    for aligned in (True, False):
        stages.clear()
        sig = {"src_ptrs": "*i64", "dst_ptrs": "*i64", "sizes": "*" + sizes,
               "n_copies": "i32", "tiles_per_copy": "i32"}
        base = 1 << 20 if aligned else (1 << 20) + 8
        values = [Addr(base), Addr(base), Addr(base), 7, 3] + [consts[p.name] for p in k.params[5:]]
        attrs = backend.get_attrs_descriptor(k.params, values)
        case = {"stages": {}, "error_stage": None, "error": None,
                "divisibility_16": [i for i in attrs.arg_properties.get("tt.divisibility", []) if i < 5]}
        try:
            triton.compile(ASTSource(k, sig, consts, attrs), target=target, options={})
            case["error"] = "compiled without CANN?"
        except MLIRCompilationError as e:
            case["error_stage"] = e.stage_name
            case["error"] = str(e)[-1500:]
        except BaseException:
            case["error"] = traceback.format_exc()[-3000:]
        case["stages"] = dict(stages)
        out["cases"][f"sizes-{sizes}-{'aligned' if aligned else 'unaligned'}"] = case
print("RESULT " + json.dumps(out))
'''


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    target = upstream.triton_ascend()
    cache = tmp_path_factory.mktemp("triton-cache")
    env = {**os.environ, "PYTHONPATH": str(target), "TRITON_CACHE_DIR": str(cache),
           "TRITON_ALWAYS_COMPILE": "1"}
    for var in ("ASCEND_HOME_PATH", "TRITON_NPU_COMPILER_PATH", "TRITON_INTERPRET"):
        env.pop(var, None)
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(KERNEL)], env=env,
                          capture_output=True, text=True, timeout=300, cwd=str(cache))
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (
        f"triton-ascend compile script failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n"
        f"{proc.stderr[-5000:]}")
    out = json.loads(lines[-1][len("RESULT "):])
    assert out["triton_file"].startswith(str(target)), out["triton_file"]
    return out


CASES = ["sizes-i64-aligned", "sizes-i64-unaligned", "sizes-i32-aligned", "sizes-i32-unaligned"]


@pytest.mark.parametrize("case", CASES)
def test_front_end_and_ascend_adapter_pass_then_cann_stage_fails(compiled, case):
    assert compiled["triton"].startswith(upstream.TRITON_ASCEND_VERSION)
    c = compiled["cases"][case]
    assert "ttir" in c["stages"], f"front end produced no Triton IR: {c['error']}"
    ttir = c["stages"]["ttir"]
    assert "tt.func" in ttir and "batch_memcpy_kernel" in ttir
    assert "ttadapter" in c["stages"], f"Ascend adapter failed: {c['error']}"
    linalg = c["stages"]["ttadapter"]
    # the adapter lowered every Triton op: nothing of the tt dialect is left
    assert "tt.load" not in linalg and "tt.store" not in linalg and "func.func" in linalg
    # the failure is the CANN stage (triton-ascend names its ``npubin`` stage, linalg -> binary
    # through bishengir-compile, ConvertLinalgRToBinary): the Ascend toolkit is missing
    assert c["error_stage"] == "ConvertLinalgRToBinary", c["error"]
    # one variant whatever the address tensors' alignment, so a warm-up at load covers every
    # call of the step path (per-layer slices gpu[start:end] are 16-byte aligned or not)
    assert c["divisibility_16"] == [], "address tensors must not be specialised on alignment"
    assert "ASCEND_HOME_PATH" in c["error"] or "bishengir" in c["error"], c["error"]


def test_no_unsigned_element_type_wider_than_a_byte():
    """triton-ascend 3.2's support tables mark uint16/uint32/uint64 unsupported on Atlas A2/A3
    (``tl.cast``; ``tl.load`` / ``tl.store`` list no unsigned type but uint8's byte width): our
    kernel's loads and stores go through signed pointer types of 2, 4 and 8 bytes."""
    src = KERNEL.read_text()
    for bad in ("tl.uint16", "tl.uint32", "tl.uint64"):
        assert bad not in src, f"{bad} in {KERNEL.name}"
