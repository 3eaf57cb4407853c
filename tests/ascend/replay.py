"""Replay the mamba section of vllm-ascend's ``NPUModelRunner.execute_model`` on CPU tensors.

Run as a subprocess (one per vllm-ascend release and SoC family; vllm-ascend patches vLLM's
``mamba_utils`` module in place, so configurations cannot share a process)::

    python tests/ascend/replay.py --ascend 0.30.0rc2 --soc A2 --seed 123 --launcher plugin \
        --out result.json

What runs (see docs/ascend-replay.md for the line numbers):

* vllm-ascend's ``vllm_ascend/patch/worker/patch_mamba_utils.py``, imported for real (it patches
  vLLM's ``vllm.v1.worker.mamba_utils``), then the plugin (``--launcher plugin``:
  ``vllm_hybrid_npu.patches.apply_patches("npu")``; ``standin``: a local stand-in of the launcher
  swap; ``upstream``: nothing, vllm-ascend alone).
* The statements of ``NPUModelRunner.execute_model`` that make up its mamba section, taken from
  vllm-ascend's ``vllm_ascend/worker/model_runner_v1.py`` by AST and executed with their own file
  name and line numbers (traced: the JSON lists the runner lines that ran); around them what the
  rest of ``execute_model`` does to them: the KV connector's ``bind_connector_metadata`` /
  ``start_load_kv`` (``maybe_get_kv_connector_output``), then the model forward's
  ``wait_for_layer_load`` of each layer in order.
* ``NPUModelRunner._get_ascend_mamba_state_copy_funcs`` (0.30, from the same file) and vLLM's own
  ``GPUModelRunner._get_mamba_bufs`` / ``_get_mamba_state_copy_funcs`` / ``_make_buffer``
  (imported), vLLM's ``MambaBuffers`` / ``CpuGpuBuffer``, the real Qwen3-Next model class's state
  copy functions, vllm-ascend's real ``AscendStoreConnector`` / ``AscendMultiConnector`` methods
  (objects built without ``__init__``; a fake pool worker stands in for the network transfer).

Stand-ins (the runner's own objects that need a model and scheduler around them): the input batch
(``req_ids``, ``num_accepted_tokens_cpu``), the cached request states (``block_ids``,
``num_computed_tokens``) and the scheduler output (the fields the section reads), built by a small
random scheduler with chunked prefill, decode, speculative tokens, finished, preempted and
resumed requests. Request lengths and schedules come from ``--seed``.

Checks per step (each failure is reported with the seed): the copy plan upstream's
``preprocess_mamba`` staged equals an independent plan computed from the block tables; every
launcher call went through ``vllm_hybrid_npu.ops.batch_memcpy`` (pointer paths) or vllm-ascend's
tensor copies (310P), never through vllm-ascend's Triton kernel; the rows launched equal the plan;
after the step every state tensor equals the expectation (destinations were poisoned first, so a
missed byte shows).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import random
import sys
import traceback
import types
from contextlib import contextmanager
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE.parent))  # tests/ -> ``ascend`` package
from ascend import ascend_env, upstream  # noqa: E402

from vllm_hybrid_npu.envs import OPTIONS_ENV, with_option  # noqa: E402

BLOCK_SIZE = 16
NUM_BLOCKS = 600
CONV_SHAPE = (3, 64)  # (conv_kernel - 1, conv_dim), SD layout, bf16
SSM_SHAPE = (2, 16, 16)  # (num_v_heads, head_k_dim, head_v_dim), float32
#: layer order of the model forward: 2 GDN : 1 attention, two mamba KV-cache groups
LAYERS = [
    "model.layers.0.linear_attn", "model.layers.1.linear_attn", "model.layers.2.self_attn.attn",
    "model.layers.3.linear_attn", "model.layers.4.linear_attn", "model.layers.5.self_attn.attn",
]
ATTN_GROUP = ["model.layers.2.self_attn.attn", "model.layers.5.self_attn.attn"]
MAMBA_GROUPS = [["model.layers.0.linear_attn", "model.layers.3.linear_attn"],
                ["model.layers.1.linear_attn", "model.layers.4.linear_attn"]]
POISON = 0xA5
CONNECTORS = ("none", "plain", "layerwise", "multi")


# --------------------------------------------------------------------------- runner source


class RunnerSource:
    """The mamba-section statements of ``NPUModelRunner.execute_model`` compiled from the file."""

    def __init__(self, path: Path):
        self.path = str(path)
        self.ascend_root = path.parents[2]
        src = path.read_text()
        tree = ast.parse(src)
        cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "NPUModelRunner")
        self.methods = {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}
        em = self.methods["execute_model"]

        def calls(node, dotted):
            return any(isinstance(c, ast.Call) and ast.unparse(c.func) == dotted for c in ast.walk(node))

        def is_align_if(node):
            return (isinstance(node, ast.If)
                    and ast.unparse(node.test) == "self.cache_config.mamba_cache_mode == 'align'")

        found: dict[str, list] = {"preprocess": [], "copy": [], "finish": []}
        for parent in ast.walk(em):
            for field in ("body", "orelse"):
                stmts = getattr(parent, field, None)
                if not isinstance(stmts, list):
                    continue
                for i, st in enumerate(stmts):
                    if is_align_if(st) and calls(st, "mamba_utils.preprocess_mamba"):
                        found["preprocess"].append([st])
                    elif is_align_if(st) and calls(st, "mamba_utils.do_mamba_copy_block"):
                        prev = stmts[i - 1] if i else None
                        block = [st]
                        if (isinstance(prev, ast.Assign)
                                and ast.unparse(prev) == "mamba_copy_connector = None"):
                            block = [prev, st]
                        found["copy"].append(block)
                    elif isinstance(st, ast.If) and calls(st, "mamba_copy_connector.finish_mamba_state_copy"):
                        found["finish"].append([st])
        for k in ("preprocess", "copy"):
            if len(found[k]) != 1:
                raise RuntimeError(f"{path}: expected one mamba {k} block in execute_model, "
                                   f"found {len(found[k])}")
        self.blocks = {k: self._compile(v[0]) for k, v in found.items() if v}
        #: runner lines that must run in the replay (over all cases of a configuration)
        self.key_lines = {}
        for blocks in found.values():
            for st in (blocks[0] if blocks else []):
                for n in ast.walk(st):
                    text = ast.unparse(n.func) if isinstance(n, ast.Call) else (
                        ast.unparse(n) if isinstance(n, ast.Assign) else "")
                    for key in ("mamba_utils.preprocess_mamba", "mamba_utils.do_mamba_copy_block",
                                "mamba_copy_connector = connector", "prepare_mamba_state_copy",
                                "mamba_copy_connector.finish_mamba_state_copy",
                                "mamba_utils.stage_postprocess_inputs_to_gpu"):
                        if text == key:
                            self.key_lines[key] = n.lineno
        self.spans = {k: (v[0][0].lineno, v[0][-1].end_lineno) for k, v in found.items() if v}
        self.has_layerwise_branch = "finish" in self.blocks

    def _compile(self, stmts):
        mod = ast.Module(body=stmts, type_ignores=[])
        return compile(mod, self.path, "exec")

    def method(self, name: str, namespace: dict):
        """Compile method ``name`` of ``NPUModelRunner`` into a function over ``namespace``."""
        fn = self.methods[name]
        mod = ast.Module(body=[fn], type_ignores=[])
        ns = dict(namespace)
        exec(compile(mod, self.path, "exec"), ns)
        return ns[name]


@contextmanager
def trace_lines(path: str, sink: set, on: bool = True):
    """Record the line numbers executed in code objects compiled from ``path``."""
    if not on:
        yield
        return

    def local(frame, event, arg):
        if event == "line":
            sink.add(frame.f_lineno)
        return local

    def glob(frame, event, arg):
        if frame.f_code.co_filename == path:
            if event == "call":
                sink.add(frame.f_lineno)
            return local
        return None

    old = sys.gettrace()
    sys.settrace(glob)
    try:
        yield
    finally:
        sys.settrace(old)


# --------------------------------------------------------------------------- scheduler stand-in


class Req:
    def __init__(self, rid: str, prompt: int, max_out: int):
        self.rid, self.prompt, self.max_out = rid, prompt, max_out
        self.computed = 0
        self.out = 0
        self.block_ids: list[list[int]] = []  # per KV-cache group (attention group first)
        self.accepted = 1  # num_accepted_tokens of the last step (decode with drafts)
        self.cached_blocks: int = 0


class Sim:
    """A small random scheduler: chunked prefill under a token budget, decode (with drafts when
    ``num_spec`` > 0), finished, preempted and resumed requests. Only what the runner's mamba
    section reads is produced."""

    def __init__(self, rng: random.Random, num_spec: int, spec_blocks: int):
        self.rng, self.num_spec, self.spec_blocks = rng, num_spec, spec_blocks
        self.next_block = [1] * (1 + len(MAMBA_GROUPS))  # block 0 is vLLM's null block
        self.running: list[Req] = []
        self.preempted: list[Req] = []
        self.n = 0
        self.t = 0  # steps taken
        self.accepted_all = False
        self.finished_ids: set[str] = set()
        self.preempted_ids: set[str] = set()

    def _alloc(self, g: int) -> int:
        b = self.next_block[g]
        self.next_block[g] += 1
        if b >= NUM_BLOCKS:
            raise RuntimeError("replay ran out of blocks; lower the step count")
        return b

    def _grow(self, r: Req, tokens: int) -> None:
        need = -(-tokens // BLOCK_SIZE)
        for g in range(1 + len(MAMBA_GROUPS)):
            extra = self.spec_blocks if g else 0
            while len(r.block_ids[g]) < need + extra:
                r.block_ids[g].append(self._alloc(g))

    def step(self):
        """One scheduling step: ``(batch, scheduled, spec_tokens, finished, preempted, resumed)``."""
        rng = self.rng
        finished, preempted, resumed = set(self.finished_ids), set(self.preempted_ids), set()
        self.finished_ids, self.preempted_ids = set(), set()
        while len(self.running) < 4 and rng.random() < 0.7:
            self.n += 1
            r = Req(f"req-{self.n}", rng.randint(1, 7 * BLOCK_SIZE), rng.randint(1, 6))
            r.block_ids = [[] for _ in range(1 + len(MAMBA_GROUPS))]
            self.running.append(r)
        self.t += 1
        if self.preempted and (self.t == 5 or rng.random() < 0.6):
            r = self.preempted.pop(0)
            # resumed with a prefix-cache hit of whole blocks (possibly none)
            hit = rng.randint(0, r.computed // BLOCK_SIZE) * BLOCK_SIZE
            r.computed = min(hit, r.prompt - 1) // BLOCK_SIZE * BLOCK_SIZE
            r.block_ids = [[] for _ in range(1 + len(MAMBA_GROUPS))]
            r.accepted = 1
            self.running.append(r)
            resumed.add(r.rid)
        budget = rng.choice([BLOCK_SIZE * 2, BLOCK_SIZE * 4, 1024])
        batch, scheduled, spec = [], {}, {}
        for r in list(self.running):
            if r.computed < r.prompt:
                n = min(r.prompt - r.computed, budget)
                if n <= 0:
                    continue
                drafts = 0
            else:
                drafts = self.num_spec
                n = 1 + drafts
                if budget < n:
                    continue
            budget -= n
            batch.append(r)
            scheduled[r.rid] = n
            if drafts:
                spec[r.rid] = [0] * drafts
            self._grow(r, r.computed + n)
        return batch, scheduled, spec, finished, preempted, resumed

    def after(self, batch, scheduled, spec):
        """Advance the requests of a finished step; pick finishes and preemptions for the next."""
        rng = self.rng
        for r in batch:
            n = scheduled[r.rid]
            if r.rid in spec:
                # the first speculative step of a case accepts every draft (a non-zero accept
                # bias is then certain to reach preprocess), later ones a random count
                if self.accepted_all:
                    r.accepted = rng.randint(1, 1 + len(spec[r.rid]))
                else:
                    r.accepted = 1 + len(spec[r.rid])
                    r.max_out = max(r.max_out, r.out + r.accepted + 1)  # next step sees it
                    self.accepted_all = True
                r.computed += n - len(spec[r.rid]) + r.accepted - 1
                r.out += r.accepted
            else:
                r.computed += n
                r.accepted = 1
                if r.computed >= r.prompt:
                    r.out += 1
            # the model's forward wrote the running state (and, with drafts, one state per draft
            # token into the speculative blocks): those blocks now hold live data
        for r in list(self.running):
            if r.out >= r.max_out:
                self.running.remove(r)
                self.finished_ids.add(r.rid)
            elif r.computed >= BLOCK_SIZE and (rng.random() < 0.12 or (self.t == 3 and not self.preempted_ids)):
                self.running.remove(r)
                self.preempted.append(r)
                self.preempted_ids.add(r.rid)


# --------------------------------------------------------------------------- replay


class Recorder:
    """Which launcher moved which rows, in which layer's ``wait_for_layer_load``."""

    def __init__(self):
        self.calls: list[dict] = []
        self.layer: str | None = None
        self.upstream_kernel_launches = 0


def byte_rows(src, dst, sizes):
    return [(int(s), int(d), int(n)) for s, d, n in zip(src.tolist(), dst.tolist(), sizes.tolist())]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ascend", required=True, choices=sorted(upstream.ASCEND_RELEASES))
    ap.add_argument("--soc", required=True, choices=sorted(ascend_env.BUILD_INFO))
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--launcher", default="plugin", choices=("plugin", "standin", "upstream"))
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--copy-impl", default="triton", choices=("triton", "torch"),
                    help="what moves the bytes on CPU: our Triton kernel under the interpreter "
                         "(default) or ops' torch implementation")
    ap.add_argument("--sync-check", action="store_true",
                    help="then replay the cases again with the runner's staged buffers on the meta "
                         "device and the copy launchers monitored for host syncs, uploads, files")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    result = {"ascend": args.ascend, "soc": args.soc, "seed": args.seed, "launcher": args.launcher,
              "cases": {}, "error": None}
    try:
        run(args, result)
    except BaseException:  # reported to the test, which fails with it
        result["error"] = traceback.format_exc()
    Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    return 0


def run(args, result) -> None:
    vllm_version = upstream.ASCEND_RELEASES[args.ascend]
    vllm_root = str(upstream.vllm_python(vllm_version)) if vllm_version != "0.30.0" else None
    ascend_root = upstream.vllm_ascend_src(args.ascend)
    sys.path.insert(0, str(REPO))
    ascend_env.setup(str(ascend_root), args.soc, vllm_root)

    import torch

    import vllm
    from vllm.v1.worker import mamba_utils

    result["vllm"] = vllm.__version__ if hasattr(vllm, "__version__") else "?"
    result["vllm_file"] = vllm.__file__

    import vllm_hybrid_npu.ops as ops
    from vllm_hybrid_npu.ops import memcpy as ops_memcpy

    rec = Recorder()
    plugin_report = None
    report = None
    if args.launcher == "plugin":
        from vllm_hybrid_npu import patches
        from vllm_hybrid_npu.support import Stack

        # the stack vllm-ascend's process would detect (its distributions are not installed here)
        report = patches.apply_patches("npu", Stack(target="npu", vllm=vllm_version,
                                                    vllm_ascend=args.ascend))

    pmu_name = "vllm_ascend.patch.worker.patch_mamba_utils"
    import importlib

    pmu = importlib.import_module(pmu_name)
    triton_ok = pmu._can_launch_triton_batch_memcpy()
    result["triton_batch_memcpy"] = triton_ok

    if args.launcher == "standin":
        install_standin(pmu, mamba_utils, ops)
    if report is not None:  # after the import: the registry's post-import hook has run
        result["plugin_report"] = {"applied": list(report.applied), "pending": dict(report.pending),
                                   "skipped": dict(report.skipped), "failed": dict(report.failed),
                                   "unsupported": report.unsupported}

    # instrumentation: upstream's Triton kernel must never launch; our launcher's rows recorded
    class UpstreamKernel:
        def __getitem__(self, grid):
            def launch(*a, **k):
                rec.upstream_kernel_launches += 1
                raise RuntimeError("vllm-ascend's batch_memcpy_kernel was launched")
            return launch

    pmu.batch_memcpy_kernel = UpstreamKernel()
    if getattr(mamba_utils, "batch_memcpy_kernel", None) is not None:
        mamba_utils.batch_memcpy_kernel = UpstreamKernel()

    # the bytes are moved by our Triton kernel itself, under the Triton interpreter (CPU tensors);
    # ``--copy-impl torch`` uses ops' torch implementation instead (faster, same contract)
    os.environ[OPTIONS_ENV] = with_option(os.environ.get(OPTIONS_ENV, ""), "copy-impl", args.copy_impl)
    if args.copy_impl == "triton":
        os.environ["TRITON_INTERPRET"] = "1"  # read by ops (not by vLLM: imported already)
    ops.refresh_settings()
    result["copy_impl"] = args.copy_impl
    from vllm_hybrid_npu.ops import _triton_copy

    real_launch, real_torch_copy = _triton_copy.launch, ops_memcpy.batch_memcpy_torch

    def recording_launch(kernel, src, dst, sizes, *a, **k):
        if src.device.type == "cpu":
            rec.calls.append({"layer": rec.layer, "rows": byte_rows(src, dst, sizes),
                              "impl": "triton"})
        return real_launch(kernel, src, dst, sizes, *a, **k)

    def recording_copy(src, dst, sizes):
        rec.calls.append({"layer": rec.layer, "rows": byte_rows(src, dst, sizes), "impl": "torch"})
        return real_torch_copy(src, dst, sizes)

    _triton_copy.launch = recording_launch
    ops_memcpy.batch_memcpy_torch = recording_copy
    result["launchers"] = {
        "patch_mamba_utils._batch_memcpy_triton": qualname(getattr(pmu, "_batch_memcpy_triton", None)),
        "mamba_utils.batch_memcpy": qualname(mamba_utils.batch_memcpy),
        "mamba_utils.do_mamba_copy_block": qualname(mamba_utils.do_mamba_copy_block),
        "mamba_utils.preprocess_mamba": qualname(mamba_utils.preprocess_mamba),
        "mamba_utils.collect_mamba_copy_meta": qualname(mamba_utils.collect_mamba_copy_meta),
    }
    result["deferred_to_upstream"] = {
        "preprocess_mamba": mamba_utils.preprocess_mamba is pmu.preprocess_mamba,
        "do_mamba_copy_block": mamba_utils.do_mamba_copy_block is getattr(
            pmu, "_do_mamba_copy_block_npu" if triton_ok else "_do_mamba_copy_block_torch",
            mamba_utils.do_mamba_copy_block),
    }

    runner_src = RunnerSource(ascend_root / "vllm_ascend/worker/model_runner_v1.py")
    result["runner_spans"] = runner_src.spans
    result["key_lines"] = runner_src.key_lines
    connectors = CONNECTORS if runner_src.has_layerwise_branch else ("none", "plain", "layerwise")
    rng_master = random.Random(args.seed)
    plan = [(c, b, rng_master.randrange(2**31)) for c in connectors for b in (0, 2)]
    run_cases(args, result, "cpu", "", plan, runner_src, rec, mamba_utils, pmu, torch, triton_ok)
    if args.sync_check and triton_ok:
        # the same cases with the staged buffers on the meta device, launchers monitored
        # the device path: ops picks its Triton launch for device tensors (not the CPU choice)
        import vllm_hybrid_npu.ops as ops_mod

        os.environ[OPTIONS_ENV] = with_option(os.environ.get(OPTIONS_ENV, ""), "copy-impl", "auto")
        ops_mod.refresh_settings()
        report, monitored = install_sync_monitor(pmu, mamba_utils, torch)
        result["sync_check"] = report
        run_cases(args, result, "meta", "meta:", plan, runner_src, rec, mamba_utils, pmu, torch,
                  triton_ok)
        # control: a launcher that validates values (one device-to-host sync) must be caught
        control = {"launcher_calls": 0, "kernel_launches": 0, "copies_launched": 0, "violations": []}
        report_ref = dict(report)
        report.clear()
        report.update(control)
        import vllm_hybrid_npu.ops as ops

        def syncing(src_ptrs, dst_ptrs, sizes):
            ops.batch_memcpy(src_ptrs, dst_ptrs, sizes.to(torch.int64), check_values=True)

        saved = (getattr(pmu, "_batch_memcpy_triton", None), mamba_utils.batch_memcpy)
        if saved[0] is not None:
            pmu._batch_memcpy_triton = monitored(syncing)
        mamba_utils.batch_memcpy = monitored(syncing)
        run_cases(args, result, "meta", "control:", plan[:1], runner_src, rec, mamba_utils, pmu,
                  torch, triton_ok)
        result["sync_control"] = dict(report)
        report.clear()
        report.update(report_ref)
        if saved[0] is not None:
            pmu._batch_memcpy_triton = saved[0]
        mamba_utils.batch_memcpy = saved[1]


def run_cases(args, result, device, prefix, plan, runner_src, rec, mamba_utils, pmu, torch,
              triton_ok):
    for connector, spec_blocks, case_seed in plan:
        name = f"{prefix}{connector}-spec{spec_blocks}"
        lines: set[int] = set()
        try:
            # a draw whose 10 steps never move a request into a new block exercises no copy:
            # redraw (the next case seeds, at most 8; the seed used is reported)
            for _ in range(8):
                out = replay_case(args, device, runner_src, rec, mamba_utils, pmu, torch,
                                  connector, spec_blocks, case_seed, triton_ok, lines)
                if out["totals"]["copies"] > 0:
                    break
                case_seed += 1
            result["cases"][name] = {"ok": True, "seed": case_seed, **out}
        except Exception:
            result["cases"][name] = {"ok": False, "seed": case_seed,
                                     "runner_lines": sorted(l for l in lines if l > 0),
                                     "error": traceback.format_exc()[-6000:]}


def qualname(fn):
    if fn is None:
        return None
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def install_standin(pmu, mamba_utils, ops):
    """Local stand-in of the plugin's launcher swap (issue #12 items 1-3): after vllm-ascend's
    ``patch_mamba_utils`` ran, its copy launchers call ``ops.batch_memcpy``; 310P keeps its
    tensor path. Used to validate the harness before the plugin's own hook exists."""
    import torch

    if not pmu._can_launch_triton_batch_memcpy():
        return

    def launcher(src_ptrs, dst_ptrs, sizes):
        ops.batch_memcpy(src_ptrs, dst_ptrs, sizes.to(torch.int64), check_values=False)

    launcher.__qualname__ = "standin_launcher"
    if hasattr(pmu, "_batch_memcpy_triton"):
        old = pmu._batch_memcpy_triton
        pmu._batch_memcpy_triton = launcher
        if mamba_utils.batch_memcpy is old:
            mamba_utils.batch_memcpy = launcher


# --------------------------------------------------------------------------- host-sync check


def install_sync_monitor(pmu, mamba_utils, torch) -> dict:
    """``--sync-check``: the runner's staged buffers live on the meta device (a device whose
    memory the host cannot read), our Triton launch is recorded instead of compiled (the device
    launch), and every call of the installed copy launchers runs under a monitor that records
    host syncs (``aten._local_scalar_dense``: ``.item()``, ``bool()``, ``int()``; ``.tolist()``,
    ``.cpu()``, ``.numpy()``; copies from a device tensor to the host), host-to-device uploads
    (a CPU tensor copied to the device: pageable, since vLLM's CPU-side buffers are not pinned
    here) and files opened / replaced. Returns the live report dict and the wrapper."""
    import builtins
    import io

    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from vllm_hybrid_npu.ops import _triton_copy

    report = {"launcher_calls": 0, "kernel_launches": 0, "copies_launched": 0, "violations": []}

    class FakeKernel:  # stands for the compiled kernel: a device launch reads nothing on the host
        def __getitem__(self, grid):
            def launch(src_ptrs, dst_ptrs, sizes, n_copies, tiles, **kw):
                report["kernel_launches"] += 1
                report["copies_launched"] += int(n_copies)
                for t in (src_ptrs, dst_ptrs, sizes):
                    if t.device.type != "meta":
                        report["violations"].append(f"kernel argument on {t.device}")
                return None
            return launch

    _triton_copy.batch_memcpy_kernel = FakeKernel()
    _triton_copy.FAST_LAUNCH = False

    class Funcs(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            name = getattr(func, "__name__", str(func))
            if name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__index__",
                        "__float__"):
                report["violations"].append(f"host sync: Tensor.{name}")
            return func(*args, **(kwargs or {}))

    class Dispatch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            name = str(func)
            if "_local_scalar_dense" in name:
                report["violations"].append(f"host sync: {name}")
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            if "copy_" in name or "_to_copy" in name:
                devs = {t.device.type for t in tensors}
                out_dev = kwargs.get("device")
                if "copy_" in name and len(tensors) >= 2:
                    dst, src = tensors[0], tensors[1]
                    if src.device.type == "cpu" and dst.device.type != "cpu":
                        report["violations"].append(f"upload from host memory: {name}")
                    if src.device.type != "cpu" and dst.device.type == "cpu":
                        report["violations"].append(f"download to host: {name}")
                elif out_dev is not None and "cpu" in devs and torch.device(out_dev).type != "cpu":
                    report["violations"].append(f"upload from host memory: {name}")
            return func(*args, **kwargs)

    real_open, real_io_open, real_replace, real_rename = builtins.open, io.open, os.replace, os.rename

    def monitored(fn):
        def wrapper(*a, **k):
            report["launcher_calls"] += 1

            def no_file(*x, **y):
                report["violations"].append(f"file access: {x[:1]}")
                return real_open(*x, **y)

            builtins.open = io.open = no_file
            os.replace = os.rename = no_file
            try:
                with Funcs(), Dispatch():
                    return fn(*a, **k)
            finally:
                builtins.open, io.open, os.replace, os.rename = (real_open, real_io_open,
                                                                 real_replace, real_rename)
        wrapper.__wrapped__ = fn
        return wrapper

    if getattr(pmu, "_batch_memcpy_triton", None) is not None:
        pmu._batch_memcpy_triton = monitored(pmu._batch_memcpy_triton)
    mamba_utils.batch_memcpy = monitored(mamba_utils.batch_memcpy)
    return report, monitored


# --------------------------------------------------------------------------- connectors


class FakePoolWorker:
    """Stands in for AscendStore's ``KVPoolWorker`` (the network / pool transfer)."""

    def __init__(self, rec: Recorder):
        self.rec = rec
        self.loaded: list[str] = []

    def prepare_layerwise_step(self, metadata):
        self.loaded.clear()

    def start_load_kv(self, metadata):
        pass

    def wait_for_layer_load(self, *a):
        self.loaded.append(self.rec.layer)


#: connector methods replayed from vllm-ascend's source (module imports need torch-npu dtypes)
STORE_FILE = "vllm_ascend/distributed/kv_transfer/kv_pool/ascend_store/ascend_store_connector.py"
MULTI_FILE = "vllm_ascend/distributed/kv_transfer/ascend_multi_connector.py"
STORE_METHODS = ("wait_for_layer_load", "prepare_mamba_state_copy", "finish_mamba_state_copy")
MULTI_METHODS = STORE_METHODS + ("_configure_layerwise_reuse_completion",
                                 "_wait_for_external_slot_release")


def class_from_source(path: Path, class_name: str, methods, namespace: dict,
                      required=("wait_for_layer_load",)) -> type:
    """A class carrying the named methods of ``class_name`` in ``path`` (those the release has;
    ``required`` ones must exist), compiled from the file (own file name and line numbers) over
    ``namespace`` as module globals."""
    tree = ast.parse(path.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name)
    defs = {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}
    missing = [m for m in required if m not in defs]
    if missing:
        raise RuntimeError(f"{path}: {class_name} has no {missing}")
    methods = [m for m in methods if m in defs]
    ns = dict(namespace)
    exec(compile(ast.Module(body=[defs[m] for m in methods], type_ignores=[]), str(path), "exec"), ns)
    return type(class_name, (), {m: ns[m] for m in methods})


def make_connector(kind: str, rec: Recorder, ascend_root: Path, mamba_utils):
    """vllm-ascend's ``AscendStoreConnector`` (``plain``: ``use_layerwise`` off; ``layerwise``: on)
    or an ``AscendMultiConnector`` wrapping a layerwise one (``multi``), their mamba-copy methods
    compiled from the release's source; the attributes ``__init__`` sets for a worker are set as it
    sets them (``ascend_store_connector.py`` ``__init__``: ``use_layerwise``,
    ``requires_mamba_state_copy_after_layer_load = use_layerwise``, ``_mamba_copy_bufs``,
    ``_mamba_state``; ``ascend_multi_connector.py`` ``__init__``'s tail). A fake pool worker stands
    in for the KV transfer."""
    if kind == "none":
        return None
    g = {"mamba_utils": mamba_utils, "Any": object}
    layerwise = kind in ("layerwise", "multi")
    # 0.23.0.post1's AscendStoreConnector has no mamba-copy methods (its runner does not ask)
    Store = class_from_source(ascend_root / STORE_FILE, "AscendStoreConnector", STORE_METHODS, g)
    store = Store()
    store.use_layerwise = layerwise
    store._current_step_has_real_forward = False
    store._mamba_copy_bufs = None
    store._mamba_state = None
    store.requires_mamba_state_copy_after_layer_load = store.use_layerwise
    store.connector_worker = FakePoolWorker(rec)
    store.is_producer = False
    if kind != "multi":
        return store
    Multi = class_from_source(ascend_root / MULTI_FILE, "AscendMultiConnector", MULTI_METHODS, g,
                              required=MULTI_METHODS)
    multi = Multi()
    multi._connectors = [store]
    multi._configure_layerwise_reuse_completion()
    multi._mamba_copy_bufs = None
    multi._mamba_state = None
    multi.requires_mamba_state_copy_after_layer_load = any(
        getattr(c, "requires_mamba_state_copy_after_layer_load", False) for c in multi._connectors)
    return multi


def connector_step_begin(conn) -> None:
    """What ``maybe_get_kv_connector_output`` does to the connector before the forward, as far as
    the mamba copy is concerned: ``AscendStoreConnector.bind_connector_metadata`` clears
    ``_mamba_copy_bufs`` and prepares the layerwise step (layerwise), ``start_load_kv`` clears it
    (not layerwise)."""
    for c in getattr(conn, "_connectors", [conn]):
        c._mamba_copy_bufs = None
        if c.use_layerwise:
            c.connector_worker.prepare_layerwise_step(None)


# --------------------------------------------------------------------------- one case


def replay_case(args, device_name, runner_src, rec, mamba_utils, pmu, torch, connector, spec_blocks, seed,
                triton_ok, lines):
    from vllm.config import CacheConfig
    from vllm.distributed.kv_transfer import kv_transfer_state
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group
    from vllm.model_executor.models.qwen3_next import Qwen3NextForCausalLM
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
    )
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    rng = random.Random(seed)
    num_spec = 2 if spec_blocks else 0
    mspec = MambaSpec(block_size=BLOCK_SIZE, shapes=(CONV_SHAPE, SSM_SHAPE),
                      dtypes=(torch.bfloat16, torch.float32),
                      mamba_type=MambaAttentionBackendEnum.GDN_ATTN, mamba_cache_mode="align",
                      num_speculative_blocks=spec_blocks)
    aspec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=64,
                              dtype=torch.bfloat16)
    groups = [KVCacheGroupSpec(ATTN_GROUP, aspec)] + [KVCacheGroupSpec(g, mspec) for g in MAMBA_GROUPS]
    kv_cache_config = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=groups)
    cache_config = CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True,
                               mamba_cache_mode="align")

    # state tensors as vllm-ascend's 310P runner allocates them: per layer one raw int8 buffer,
    # the conv state [num_blocks, *conv] then the SSM state [num_blocks, *ssm], contiguous
    forward_context = {}
    states: dict[str, list] = {}
    for layer in [l for g in MAMBA_GROUPS for l in g]:
        conv_bytes = NUM_BLOCKS * CONV_SHAPE[0] * CONV_SHAPE[1] * 2
        ssm_bytes = NUM_BLOCKS * SSM_SHAPE[0] * SSM_SHAPE[1] * SSM_SHAPE[2] * 4
        raw = torch.randint(-128, 128, (conv_bytes + ssm_bytes,), dtype=torch.int8)
        conv = raw[:conv_bytes].view(torch.bfloat16).view(NUM_BLOCKS, *CONV_SHAPE)
        ssm = raw[conv_bytes:].view(torch.float32).view(NUM_BLOCKS, *SSM_SHAPE)
        states[layer] = [conv, ssm]
        forward_context[layer] = types.SimpleNamespace(kv_cache=[conv, ssm], raw=raw)
    for layer in ATTN_GROUP:
        forward_context[layer] = types.SimpleNamespace(kv_cache=torch.zeros(1))

    class Model:
        get_mamba_state_copy_func = Qwen3NextForCausalLM.get_mamba_state_copy_func
        if hasattr(Qwen3NextForCausalLM, "get_mamba_state_copy_funcs"):
            get_mamba_state_copy_funcs = Qwen3NextForCausalLM.get_mamba_state_copy_funcs

    device = torch.device(device_name)

    class Runner:  # vLLM's own methods over the runner attributes they read
        _get_mamba_bufs = GPUModelRunner._get_mamba_bufs
        _make_buffer = GPUModelRunner._make_buffer
        if hasattr(GPUModelRunner, "_get_mamba_state_copy_funcs"):
            _get_mamba_state_copy_funcs = GPUModelRunner._get_mamba_state_copy_funcs

    runner = Runner()
    runner.cache_config = cache_config
    runner.kv_cache_config = kv_cache_config
    runner.model = Model()
    runner.model_config = types.SimpleNamespace(is_hybrid=True)
    runner.speculative_config = types.SimpleNamespace(num_speculative_tokens=num_spec) if num_spec else None
    runner.max_num_reqs = 16
    runner.device = device
    runner.pin_memory = False
    runner._mamba_bufs = None
    runner._mamba_state_copy_funcs = None
    runner.mamba_state_idx = {}
    runner.requests = {}
    runner.compilation_config = types.SimpleNamespace(static_forward_context=forward_context)
    from vllm.v1.utils import CpuGpuBuffer

    runner.num_accepted_tokens = CpuGpuBuffer(runner.max_num_reqs, dtype=torch.int64, device=device,
                                              pin_memory=False)
    if "_get_ascend_mamba_state_copy_funcs" in runner_src.methods:
        Runner._get_ascend_mamba_state_copy_funcs = runner_src.method(
            "_get_ascend_mamba_state_copy_funcs", {})

    conn = make_connector(connector, rec, runner_src.ascend_root, mamba_utils)
    kv_transfer_state._KV_CONNECTOR_AGENT = conn
    import numpy as np

    sim = Sim(rng, num_spec, spec_blocks)
    totals = {"steps": 0, "copies": 0, "bytes": 0, "launcher_calls": 0, "per_layer_calls": 0,
              "tensor_copies": 0, "resumed": 0, "preempted": 0, "finished": 0,
              "accept_bias_max": 0}
    for step in range(args.steps):
        batch, scheduled, spec, finished, preempted, resumed = sim.step()
        totals["resumed"] += len(resumed)
        totals["preempted"] += len(preempted)
        totals["finished"] += len(finished)
        if not batch:
            sim.after(batch, scheduled, spec)
            continue
        totals["steps"] += 1
        for r in batch:
            runner.requests[r.rid] = types.SimpleNamespace(
                block_ids=tuple(list(b) for b in r.block_ids), num_computed_tokens=r.computed)
        for rid in finished:
            runner.requests.pop(rid, None)
        input_batch = types.SimpleNamespace(
            req_ids=[r.rid for r in batch], num_reqs=len(batch),
            num_accepted_tokens_cpu=np.array([r.accepted for r in batch] + [1] * 16, dtype=np.int64))
        runner.input_batch = input_batch
        so = types.SimpleNamespace(
            finished_req_ids=finished, preempted_req_ids=preempted,
            scheduled_cached_reqs=types.SimpleNamespace(resumed_req_ids=resumed),
            num_scheduled_tokens=scheduled, scheduled_spec_decode_tokens=spec,
            total_num_scheduled_tokens=sum(scheduled.values()))

        expected_rows = independent_plan(runner, batch, scheduled, states,
                                         finished | preempted | resumed)
        totals["accept_bias_max"] = max([totals["accept_bias_max"]] + [r.accepted - 1 for r in batch])
        # poison every destination, then snapshot the expectation
        for s, d, n in expected_rows:
            poison(d, n)
        before = {l: forward_context[l].raw.clone() for l in states}
        expect = {l: before[l].clone() for l in states}
        apply_rows(expected_rows, states, forward_context, before, expect)

        ns = {"self": runner, "scheduler_output": so, "num_reqs": len(batch),
              "deferred_state_corrections_fn": None, "mamba_utils": mamba_utils,
              "has_kv_transfer_group": has_kv_transfer_group,
              "get_kv_transfer_group": get_kv_transfer_group}
        n_calls = len(rec.calls)
        with trace_lines(runner_src.path, lines, on=device_name == "cpu"):
            exec(runner_src.blocks["preprocess"], ns)
        bufs = ns["preprocess_bufs"]
        plan = upstream_plan(bufs, triton_ok)
        if sorted(plan) != sorted(expected_rows):
            raise AssertionError(f"step {step}: upstream preprocess_mamba planned {sorted(plan)}, "
                                 f"the block tables say {sorted(expected_rows)}")
        if conn is not None:
            connector_step_begin(conn)
        with trace_lines(runner_src.path, lines, on=device_name == "cpu"):
            exec(runner_src.blocks["copy"], ns)
            rec.layer = None
            # the model forward: each layer waits for its own KV load (vLLM's
            # wait_for_kv_layer_from_connector), attention and GDN layers alike
            if conn is not None:
                for layer in LAYERS:
                    rec.layer = layer
                    conn.wait_for_layer_load(layer)
                rec.layer = None
            if "finish" in runner_src.blocks:
                exec(runner_src.blocks["finish"], ns)
        layerwise = ns.get("mamba_copy_connector") is not None
        calls = rec.calls[n_calls:]
        launched = [row for c in calls for row in c["rows"]]
        if device_name == "meta":
            pass  # rows live on the meta device; the sync report counts the copies launched
        elif triton_ok:
            impls = {c["impl"] for c in calls}
            if calls and impls != {args.copy_impl}:
                raise AssertionError(f"step {step}: copies ran through {impls}, not {args.copy_impl}")
            if sorted(launched) != sorted(plan):
                raise AssertionError(f"step {step}: launched rows {sorted(launched)} != plan {sorted(plan)}")
            if layerwise:
                for c in calls:
                    if c["layer"] is None:
                        raise AssertionError(f"step {step}: a copy ran outside wait_for_layer_load")
                    for s, d, n in c["rows"]:
                        owner = owner_layer(s, forward_context, states)
                        if owner != c["layer"]:
                            raise AssertionError(f"step {step}: copy of {owner} ran in {c['layer']}'s load")
                totals["per_layer_calls"] += len(calls)
        elif calls:
            raise AssertionError(f"step {step}: 310P tensor path but ops.batch_memcpy ran {len(calls)} times")
        else:
            totals["tensor_copies"] += len(plan)
        if rec.upstream_kernel_launches:
            raise AssertionError("vllm-ascend's Triton batch_memcpy_kernel was launched")
        if device_name == "cpu":
            for l in states:
                got = forward_context[l].raw
                if not torch.equal(got, expect[l]):
                    bad = (got != expect[l]).nonzero().flatten()
                    raise AssertionError(
                        f"step {step}: layer {l}: {bad.numel()} bytes differ from the expected state "
                        f"(first at byte {int(bad[0])}; {'layerwise' if layerwise else 'batched'} path; "
                        f"{len(plan)} copies planned, {len(launched)} launched)")
        totals["copies"] += len(plan)
        totals["bytes"] += sum(n for _, _, n in plan)
        totals["launcher_calls"] += len(calls)
        totals.setdefault("layerwise_steps", 0)
        totals["layerwise_steps"] += int(layerwise)
        sim.after(batch, scheduled, spec)
    kv_transfer_state._KV_CONNECTOR_AGENT = None
    spans = runner_src.spans
    ran = sorted(l for l in lines if l > 0)
    funcs = (runner._get_ascend_mamba_state_copy_funcs()
             if hasattr(runner, "_get_ascend_mamba_state_copy_funcs")
             else runner.model.get_mamba_state_copy_func())
    return {"totals": totals, "runner_lines": ran, "copy_funcs_type": type(funcs).__name__,
            "runner_lines_in_spans": {k: [l for l in ran if a <= l <= b] for k, (a, b) in spans.items()}}


def upstream_plan(bufs, triton_ok):
    """The copies upstream's preprocess staged: pointer rows, or the 310P tensor pairs."""
    n = bufs.offset
    if triton_ok:
        return [(int(s), int(d), int(z)) for s, d, z in
                zip(bufs.src_ptrs.np[:n], bufs.dst_ptrs.np[:n], bufs.sizes.np[:n])]
    pairs = getattr(bufs, "_tensor_copy_pairs", [])
    return [(s.data_ptr(), d.data_ptr(), s.numel() * s.element_size()) for s, d in pairs]


def independent_plan(runner, batch, scheduled, states, forgotten):
    """Copies align mode needs this step, from the block tables alone (no upstream code):
    a request whose running state moves to a new block (``cdiv(computed + scheduled, bs) - 1``)
    copies, per mamba layer, the conv state of its previous running block from token offset
    ``accepted - 1`` on and the SSM state of block ``prev + accepted - 1``. The previous running
    block of a finished / preempted / resumed request is forgotten (``forgotten``)."""
    rows = []
    for r in batch:
        prev = None if r.rid in forgotten else runner.mamba_state_idx.get(r.rid)
        if prev is None:
            prev = (r.computed - 1) // BLOCK_SIZE
        curr = -(-(r.computed + scheduled[r.rid]) // BLOCK_SIZE) - 1
        bias = r.accepted - 1
        if prev == -1 or prev == curr:
            continue
        for gi, layers in enumerate(MAMBA_GROUPS):
            ids = r.block_ids[1 + gi]
            for layer in layers:
                conv, ssm = states[layer]
                row = conv[0, 0].numel()
                cs = conv.data_ptr() + (ids[prev] * CONV_SHAPE[0] + bias) * row * 2
                rows.append((cs, conv.data_ptr() + ids[curr] * conv[0].numel() * 2,
                             (CONV_SHAPE[0] - bias) * row * 2))
                blk = ssm[0].numel() * 4
                rows.append((ssm.data_ptr() + ids[prev + bias] * blk,
                             ssm.data_ptr() + ids[curr] * blk, blk))
    return rows


def _locate(addr, forward_context, states):
    for l in states:
        raw = forward_context[l].raw
        off = addr - raw.data_ptr()
        if 0 <= off < raw.numel():
            return l, off
    raise AssertionError(f"address {addr:#x} is in no state tensor")


def owner_layer(addr, forward_context, states):
    return _locate(addr, forward_context, states)[0]


_POISON_CTX = {}


def poison(addr, n):
    _POISON_CTX.setdefault("pending", []).append((addr, n))


def apply_rows(rows, states, forward_context, before, expect):
    """Poison destinations in the live tensors and in ``before``; copy sources into ``expect``."""
    for addr, n in _POISON_CTX.pop("pending", []):
        l, off = _locate(addr, forward_context, states)
        forward_context[l].raw[off:off + n] = POISON - 256
        before[l][off:off + n] = POISON - 256
        expect[l][off:off + n] = POISON - 256
    for s, d, n in rows:
        ls, so = _locate(s, forward_context, states)
        ld, do = _locate(d, forward_context, states)
        expect[ld][do:do + n] = before[ls][so:so + n]


if __name__ == "__main__":
    sys.exit(main())
