"""Contract of our NPU patches with the real vllm-ascend 0.30.0rc2 source (parsed, not imported:
vllm-ascend cannot be imported without CANN / torch-npu).

The sdist comes from the package registry with pip and is cached in
``$VLLM_HYBRID_NPU_CACHE/sdist`` (default ``~/.cache/vllm-hybrid-npu/sdist``), through the helper
the Ascend replay tests share (``tests/ascend/upstream.py``). Every class, method, attribute, call and signature that
:mod:`vllm_hybrid_npu.patches.ascend_runner` relies on is checked here.
"""

from __future__ import annotations

import ast
import sys
import tarfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ascend import upstream  # noqa: E402  (tests/ascend/upstream.py: pip download + cache)

VERSION = "0.30.0rc2"
ROOT = f"vllm_ascend-{VERSION}/"


@pytest.fixture(scope="module")
def src():
    """``relative path -> source text`` of every .py file of the vllm_ascend package."""
    path = upstream.sdist(VERSION)
    out = {}
    with tarfile.open(path) as tar:
        for m in tar.getmembers():
            if m.isfile() and m.name.startswith(ROOT + "vllm_ascend/") and m.name.endswith(".py"):
                out[m.name[len(ROOT):]] = tar.extractfile(m).read().decode("utf-8")
    assert out, f"no vllm_ascend sources in {path}"
    return out


def _tree(src, rel):
    assert rel in src, f"{rel} missing from vllm-ascend {VERSION}"
    return ast.parse(src[rel])


def _class(tree, name) -> ast.ClassDef:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    raise AssertionError(f"class {name} not found")


def _method(cls: ast.ClassDef, name) -> ast.FunctionDef:
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return node
    raise AssertionError(f"{cls.name}.{name} not found")


def _calls(node, dotted: str) -> list[ast.Call]:
    """Calls whose callee unparses to ``dotted`` (e.g. ``mamba_utils.preprocess_mamba``)."""
    return [n for n in ast.walk(node) if isinstance(n, ast.Call) and ast.unparse(n.func) == dotted]


def _params(fn: ast.FunctionDef) -> list[str]:
    return [a.arg for a in fn.args.posonlyargs + fn.args.args]


RUNNER = "vllm_ascend/worker/model_runner_v1.py"


def test_runner_is_a_gpu_model_runner_that_calls_super_init(src):
    tree = _tree(src, RUNNER)
    cls = _class(tree, "NPUModelRunner")
    assert [ast.unparse(b) for b in cls.bases] == ["GPUModelRunner"]
    init = _method(cls, "__init__")
    assert _params(init) == ["self", "vllm_config", "device"]
    assert _calls(init, "super().__init__"), "our GPUModelRunner.__init__ wrapper runs via super()"


def test_runner_uses_mamba_utils_through_the_module_attribute(src):
    tree = _tree(src, RUNNER)
    imports = [ast.unparse(n) for n in tree.body if isinstance(n, ast.ImportFrom)]
    assert "from vllm.v1.worker import mamba_utils" in imports
    cls = _class(tree, "NPUModelRunner")
    pre = _calls(cls, "mamba_utils.preprocess_mamba")
    copy = _calls(cls, "mamba_utils.do_mamba_copy_block")
    assert len(pre) == 1 and len(copy) == 1, "exactly one call site each"
    # preprocess(9 positional: scheduler_output, kv_cache_config, cache_config, mamba_state_idx,
    # input_batch, requests, forward_context, copy_funcs, copy_bufs), no align_ctx
    assert len(pre[0].args) == 9 and not pre[0].keywords
    assert ast.unparse(pre[0].args[0]) == "scheduler_output"
    assert ast.unparse(pre[0].args[4]) == "self.input_batch"
    assert len(copy[0].args) == 1
    # both in execute_model, the copy after the preprocess (we defer the copy to it)
    em = _method(cls, "execute_model")
    assert _calls(em, "mamba_utils.preprocess_mamba") and _calls(em, "mamba_utils.do_mamba_copy_block")
    assert pre[0].lineno < copy[0].lineno
    assert ast.unparse(copy[0].args[0]) == ast.unparse(pre[0].args[8])


def test_runner_sizes_block_tables_through_the_spec_method(src):
    cls = _class(_tree(src, RUNNER), "NPUModelRunner")
    fn = _method(cls, "may_reinitialize_input_batch")
    assert _params(fn) == ["self", "kv_cache_config", "kernel_block_sizes"]
    asks = [
        n for n in ast.walk(fn)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
        and n.func.attr == "max_num_blocks_per_req"
    ]
    assert asks and all(len(a.args) == 2 and ast.unparse(a.args[0]) == "self.vllm_config" for a in asks)
    builds = _calls(fn, "NPUInputBatch")
    assert builds and any(k.arg == "max_num_blocks_per_req" for k in builds[0].keywords)
    assert "self.vllm_config" in src[RUNNER]


def test_npu_input_batch_passes_widths_to_its_block_table(src):
    tree = _tree(src, "vllm_ascend/worker/npu_input_batch.py")
    cls = _class(tree, "NPUInputBatch")
    assert [ast.unparse(b) for b in cls.bases] == ["InputBatch"]
    init = _method(cls, "__init__")
    assert "max_num_blocks_per_req" in _params(init)
    mgbt = _calls(init, "MultiGroupBlockTable")
    assert mgbt and any(
        k.arg == "max_num_blocks" and ast.unparse(k.value) == "max_num_blocks_per_req"
        for k in mgbt[0].keywords
    )
    bt = _class(_tree(src, "vllm_ascend/worker/block_table.py"), "MultiGroupBlockTable")
    assert "max_num_blocks" in _params(_method(bt, "__init__"))


def test_ascend_replaces_mamba_utils_functions_at_worker_patch_time(src):
    rel = "vllm_ascend/patch/worker/patch_mamba_utils.py"
    tree = _tree(src, rel)
    assigned = {
        ast.unparse(t)
        for n in ast.walk(tree) if isinstance(n, ast.Assign) for t in n.targets
    }
    assert {"mamba_utils.preprocess_mamba", "mamba_utils.do_mamba_copy_block"} <= assigned
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "preprocess_mamba")
    assert _params(fn) == [
        "scheduler_output", "kv_cache_config", "cache_config", "mamba_state_idx", "input_batch",
        "requests", "forward_context", "mamba_state_copy_funcs", "copy_bufs",
    ]
    assert "import vllm_ascend.patch.worker.patch_mamba_utils" in src["vllm_ascend/patch/worker/__init__.py"]


def test_worker_patches_before_it_builds_the_runner(src):
    cls = _class(_tree(src, "vllm_ascend/worker/worker.py"), "NPUWorker")
    assert _calls(_method(cls, "__init__"), "adapt_patch"), "worker patches applied in NPUWorker.__init__"
    assert _calls(_method(cls, "init_device"), "NPUModelRunner"), "runner built later, in init_device"


def test_platform_device_type_is_npu(src):
    cls = _class(_tree(src, "vllm_ascend/platform.py"), "NPUPlatform")
    values = [
        ast.unparse(n.value) for n in cls.body
        if isinstance(n, ast.AnnAssign) and ast.unparse(n.target) == "device_type"
    ]
    assert values == ["'npu'"]


def test_no_mamba_prefix_caching_refusal_to_lift(src):
    """The guard of issue item 3 ("Prefix caching is not supported for Mamba yet") does not
    exist in vllm-ascend 0.30.0rc2, so there is nothing to lift."""
    hits = [rel for rel, text in src.items() if "not supported for Mamba" in text]
    assert hits == []
