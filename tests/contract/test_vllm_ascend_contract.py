"""Contract of our NPU registry entries with the real vllm-ascend sources (0.30.0rc2 and
0.23.0.post1; parsed, not imported: vllm-ascend cannot be imported without CANN / torch-npu).

What the entries of :mod:`vllm_hybrid_npu.patches.vllm_ascend_mamba_utils` rely on, and what the
plugin defers to (the runner's own ``preprocess_mamba`` call, block tables sized per KV-cache
group), is checked in each release; ``tests/ascend`` executes that code.

The sdists come from the package registry with pip and are cached in
``$VLLM_HYBRID_NPU_CACHE/sdist`` (default ``~/.cache/vllm-hybrid-npu/sdist``) by
``tests/ascend/upstream.py`` (shared with the replay tests). Every class, method, attribute, call and signature that
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

VERSIONS = ("0.30.0rc2", "0.23.0.post1")


def sources(version: str) -> dict[str, str]:
    """``relative path -> source text`` of every .py file of vllm_ascend ``version``'s sdist
    (downloaded once into the cache)."""
    path = upstream.sdist(version)
    root = f"vllm_ascend-{version}/"
    out = {}
    with tarfile.open(path) as tar:
        for m in tar.getmembers():
            if m.isfile() and m.name.startswith(root + "vllm_ascend/") and m.name.endswith(".py"):
                out[m.name[len(root):]] = tar.extractfile(m).read().decode("utf-8")
    assert out, f"no vllm_ascend sources in {path}"
    return out


@pytest.fixture(scope="module", params=VERSIONS)
def src(request):
    out = sources(request.param)
    out["__version__"] = request.param
    return out


def _tree(src, rel):
    assert rel in src, f"{rel} missing from vllm-ascend {src['__version__']}"
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
PATCH = "vllm_ascend/patch/worker/patch_mamba_utils.py"


def _function(tree, name) -> ast.FunctionDef:
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    raise AssertionError(f"function {name} not found")


def _triton_branch(tree) -> ast.If:
    """The module-level ``if _can_launch_triton_batch_memcpy():`` of patch_mamba_utils."""
    for node in tree.body:
        if isinstance(node, ast.If) and ast.unparse(node.test) == "_can_launch_triton_batch_memcpy()":
            return node
    raise AssertionError("no module-level 'if _can_launch_triton_batch_memcpy():'")


def test_launcher_and_soc_gate_exist(src):
    tree = _tree(src, PATCH)
    assert _params(_function(tree, "_batch_memcpy_triton")) == ["src_ptrs", "dst_ptrs", "sizes"]
    assert _params(_function(tree, "_can_launch_triton_batch_memcpy")) == []


def test_triton_branch_installs_the_launcher_as_mamba_utils_batch_memcpy(src):
    branch = _triton_branch(_tree(src, PATCH))
    assigns = {ast.unparse(t): ast.unparse(n.value) for n in branch.body if isinstance(n, ast.Assign)
               for t in n.targets}
    assert assigns.get("mamba_utils.batch_memcpy") == "_batch_memcpy_triton"
    # the 310P branch keeps vllm-ascend's tensor-copy path, which our probes leave alone
    other = {ast.unparse(t): ast.unparse(n.value) for n in branch.orelse if isinstance(n, ast.Assign)
             for t in n.targets}
    assert other.get("mamba_utils.do_mamba_copy_block") == "_do_mamba_copy_block_torch"


def test_every_launch_goes_through_the_module_global(src):
    """Replacing ``patch_mamba_utils._batch_memcpy_triton`` reroutes every call (0.30.0rc2:
    batched and layerwise); ``batch_memcpy_kernel`` is launched nowhere else."""
    tree = _tree(src, PATCH)
    callers = {
        fn.name for fn in tree.body if isinstance(fn, ast.FunctionDef)
        and _calls(fn, "_batch_memcpy_triton")
    }
    if src["__version__"] == "0.30.0rc2":
        assert callers == {"_do_mamba_copy_block_npu", "do_mamba_copy_block_for_layer"}
    else:
        assert callers == set()  # 0.23: vLLM's do_mamba_copy_block calls mamba_utils.batch_memcpy
    launches = [n for n in ast.walk(tree) if isinstance(n, ast.Subscript)
                and ast.unparse(n.value) == "batch_memcpy_kernel"]
    assert len(launches) == 1 and launches[0] in list(ast.walk(_function(tree, "_batch_memcpy_triton")))


def test_runner_calls_preprocess_and_copy_through_the_module_attribute(src):
    """What the plugin defers to: vllm-ascend's runner already calls preprocess_mamba and the
    copy (the worker changes this project once shipped)."""
    tree = _tree(src, RUNNER)
    imports = [ast.unparse(n) for n in tree.body if isinstance(n, ast.ImportFrom)]
    assert "from vllm.v1.worker import mamba_utils" in imports
    cls = _class(tree, "NPUModelRunner")
    assert len(_calls(cls, "mamba_utils.preprocess_mamba")) == 1
    assert _calls(cls, "mamba_utils.do_mamba_copy_block")


def test_runner_already_sizes_block_tables_per_kv_cache_group(src):
    cls = _class(_tree(src, RUNNER), "NPUModelRunner")
    fn = _method(cls, "may_reinitialize_input_batch")
    text = ast.unparse(fn)
    if src["__version__"] == "0.30.0rc2":
        assert "max_num_blocks_per_req" in text
    else:  # inline in 0.23.0.post1: one width per KV-cache group
        assert "kv_cache_groups" in text and "max_num_blocks" in text


def test_worker_patches_before_it_builds_the_runner(src):
    cls = _class(_tree(src, "vllm_ascend/worker/worker.py"), "NPUWorker")
    assert _calls(_method(cls, "__init__"), "adapt_patch"), "worker patches applied in NPUWorker.__init__"
    assert "import vllm_ascend.patch.worker.patch_mamba_utils" in src["vllm_ascend/patch/worker/__init__.py"]


def test_platform_device_type_is_npu(src):
    cls = _class(_tree(src, "vllm_ascend/platform.py"), "NPUPlatform")
    values = [
        ast.unparse(n.value) for n in cls.body
        if isinstance(n, ast.AnnAssign) and ast.unparse(n.target) == "device_type"
    ]
    assert values == ["'npu'"]


def test_step_checkpoint_entries_find_what_they_wrap(src):
    """``gdn-checkpoint-receive-ascend`` wraps ``NPUModelRunner.execute_model`` (0.30.0rc2: it
    overrides vLLM's, whose wrapper it then never calls) and reads ``scheduler_output`` by that
    name; ``gdn_prefill_checkpoint._step_checkpoints`` finds the GDN builder in
    ``attn_groups[kv_cache_gid]``'s ``metadata_builders`` and the rows in ``input_batch.req_ids``
    (vLLM's names, which the runner keeps); ``gdn-checkpoint-send`` wraps
    ``Scheduler._update_after_schedule``: every override or rebinding of it in vllm-ascend calls
    the one it replaces."""
    if src["__version__"] != "0.30.0rc2":
        pytest.skip("the engine's explicit checkpoints are received on 0.30.0rc2 only")
    cls = _class(_tree(src, RUNNER), "NPUModelRunner")
    assert _params(_method(cls, "execute_model")) == ["self", "scheduler_output", "intermediate_tensors"]
    text = ast.unparse(cls)
    assert "self.attn_groups[kv_cache_gid]" in text and ".metadata_builders" in text
    assert "self.input_batch.req_ids" in text
    found = 0
    for rel, code in src.items():
        if rel.startswith("vllm_ascend/") and "_update_after_schedule" in code:
            for fn in ast.walk(ast.parse(code)):
                if isinstance(fn, ast.FunctionDef) and fn.name.endswith("_update_after_schedule") \
                        and not fn.name.startswith("_patch_"):
                    body = ast.unparse(fn)
                    found += 1
                    assert ("super()._update_after_schedule(" in body
                            or "original_update_after_schedule(" in body), (rel, fn.name)
    assert found >= 2  # dyntra_lb_scheduler's override and patch_pp_mtp's rebinding
