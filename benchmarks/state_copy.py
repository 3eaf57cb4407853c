"""Benchmark of the state-copy op (``vllm_hybrid_npu.ops.batch_memcpy``) on a CUDA or NPU device.

Run: ``python -m benchmarks.state_copy [--vllm-mamba-utils PATH] [--json-out PATH]``.

1. Measures the device's copy bandwidth: one large ``Tensor.copy_`` (default 1 GiB), counting
   bytes read plus bytes written.
2. For workloads shaped like real GDN state copies in align mode (per GDN layer and request one
   SSM state ``[num_v_heads, k_dim, v_dim]`` - fp32 for Qwen3.5, bf16 for Qwen3-Next as vLLM
   allocates them by default, plus Qwen3-Next with an fp32 SSM cache - and one bf16 conv state
   ``[conv_dim, kernel - 1]``, tp = 1; see :data:`MODELS`), 1, 8 and 64 requests, plus
   conv-state-only batches, times each implementation and prints time, GB/s (read + write),
   the ratio to the bandwidth of step 1 (``ratio``, the figure issue 4's targets use) and the
   ratio to one contiguous ``copy_`` of the same total bytes (``/copy_``):

   * ``ours``: ``batch_memcpy(impl="triton", check_values=False)`` (the production call);
   * ``torch``: ``batch_memcpy(impl="torch")`` (the fallback: a ``copy_`` per copy);
   * ``vllm``: vLLM's in-tree ``batch_memcpy`` - from ``vllm.v1.worker.mamba_utils`` when vLLM
     is importable, or extracted (``batch_memcpy_kernel`` + ``batch_memcpy``, by AST) from the
     file given with ``--vllm-mamba-utils`` (for machines without vLLM);
   * ``ascend-hoisted``: the same extraction from ``--ascend-variant PATH``, a file holding
     vllm-ascend's hoisted-cast ``batch_memcpy`` (optional).

Per workload and in the same run, graph-timed like the kernels: ``copy_ same bytes`` (one
contiguous ``Tensor.copy_`` of the batch's total bytes: what the device achieves for that many
bytes in one launch; ``--no-contiguous-ref`` skips it), ``empty launch (1 program)`` (an empty
Triton kernel, 256 launches per graph: the launch-latency floor) and ``ours, all sizes 0`` (our
kernel on the same address tensors with every size 0, >= 64 launches per graph: its fixed cost).

Timing: each batch exists in K copies over different cache blocks (K x batch >= 512 MiB where
memory allows, so repeated calls do not hit in L2). ``graph``: K calls captured in one CUDA
graph, median replay time / K (device time without launch gaps). ``eager``: K calls issued from
Python between two events, median / K (includes launch cost when the host is the bottleneck).
The torch fallback syncs to read addresses, so it is timed eagerly only. Before timing, each
implementation's output of one batch is checked against its source bytes (destinations
poisoned first).

``--sweep`` additionally times launch-parameter variants of our kernel (block bytes, warps,
programs per SM, items per SM) on the Qwen3.5 workloads.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import datetime
import importlib.util
import json
import math
import statistics
import sys
import tempfile
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class GdnModel:
    """GDN state geometry of a model (public config.json values, tp = 1).

    ``ssm_dtype_bytes``: bytes per SSM-state element as vLLM 0.30 allocates it: the model's
    ``mamba_ssm_dtype`` when its config has one (Qwen3.5: float32, applied in
    ``vllm/model_executor/models/config.py``), else ``--mamba-ssm-cache-dtype auto`` = the model
    dtype (Qwen3-Next: bfloat16).
    """

    name: str
    gdn_layers: int
    num_k_heads: int
    num_v_heads: int
    k_dim: int
    v_dim: int
    conv_kernel: int
    ssm_dtype_bytes: int = 4

    @property
    def ssm_bytes(self) -> int:  # [num_v_heads, k_dim, v_dim]
        return self.num_v_heads * self.k_dim * self.v_dim * self.ssm_dtype_bytes

    @property
    def conv_dim(self) -> int:  # q, k (num_k_heads * k_dim each) and v (num_v_heads * v_dim)
        return 2 * self.num_k_heads * self.k_dim + self.num_v_heads * self.v_dim

    @property
    def conv_bytes(self) -> int:  # bf16 [conv_dim, kernel - 1]
        return self.conv_dim * (self.conv_kernel - 1) * 2


#: Qwen3.5-35B-A3B: num_hidden_layers 40, full_attention_interval 4 -> 30 linear-attention
#: layers, mamba_ssm_dtype float32; Qwen3-Next-80B-A3B: 48 layers, interval 4 -> 36, no
#: mamba_ssm_dtype (vLLM's default SSM cache dtype is then the model's, bfloat16; the
#: ``-fp32ssm`` entry is the same model run with ``--mamba-ssm-cache-dtype float32``). Both:
#: linear_num_key_heads 16, linear_num_value_heads 32, linear_key_head_dim 128,
#: linear_value_head_dim 128, linear_conv_kernel_dim 4.
MODELS = {
    "qwen3.5-35b-a3b": GdnModel("Qwen3.5-35B-A3B", 30, 16, 32, 128, 128, 4, 4),
    "qwen3-next-80b-a3b": GdnModel("Qwen3-Next-80B-A3B", 36, 16, 32, 128, 128, 4, 2),
    "qwen3-next-80b-a3b-fp32ssm": GdnModel("Qwen3-Next-80B-A3B (fp32 SSM)", 36, 16, 32, 128, 128, 4, 4),
}


def load_extracted_batch_memcpy(path: str, label: str):
    """``batch_memcpy`` from a source file, executing only that function and its kernel.

    Parses ``path``, keeps the ``batch_memcpy_kernel`` and ``batch_memcpy`` definitions (with
    their decorators), writes them with torch/triton imports to a temporary module and imports
    it (``triton.jit`` needs a real source file). Nothing else of the file runs.
    """
    tree = ast.parse(Path(path).read_text())
    keep = [n for n in tree.body
            if isinstance(n, ast.FunctionDef) and n.name in ("batch_memcpy_kernel", "batch_memcpy")]
    names = {n.name for n in keep}
    if names != {"batch_memcpy_kernel", "batch_memcpy"}:
        raise ValueError(f"{path}: batch_memcpy_kernel/batch_memcpy not found (found {sorted(names)})")
    src = "import torch\nimport triton\nimport triton.language as tl\n\n\n"
    src += "\n\n\n".join(ast.unparse(n) for n in keep) + "\n"
    tmp = Path(tempfile.mkdtemp(prefix="bench_state_copy_")) / f"extracted_{label}.py"
    tmp.write_text(src)
    spec = importlib.util.spec_from_file_location(f"_extracted_{label}", tmp)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod.batch_memcpy


class Workload:
    """K sets of (src_ptrs, dst_ptrs, sizes) over state pools on the device."""

    def __init__(self, torch, device, model: GdnModel, requests: int, conv_only: bool,
                 min_footprint: int, max_sets: int):
        self.model, self.requests, self.conv_only = model, requests, conv_only
        per_req = model.conv_bytes + (0 if conv_only else model.ssm_bytes)
        self.copied = per_req * model.gdn_layers * requests  # bytes copied per call
        self.ncopies = model.gdn_layers * requests * (1 if conv_only else 2)
        self.sets = max(2, min(max_sets, math.ceil(min_footprint / self.copied)))
        nb = 2 * requests * self.sets  # blocks per layer: a source and a destination per copy
        L = model.gdn_layers
        self.conv = torch.empty((L, nb, model.conv_dim, model.conv_kernel - 1),
                                dtype=torch.bfloat16, device=device)
        ssm_dtype = {4: torch.float32, 2: torch.bfloat16}[model.ssm_dtype_bytes]
        self.ssm = None if conv_only else torch.empty(
            (L, nb, model.num_v_heads, model.k_dim, model.v_dim), dtype=ssm_dtype, device=device)
        for pool in (self.conv, self.ssm):
            if pool is not None:
                pool.view(torch.uint8).random_(0, 256)
        self.batches = []
        for k in range(self.sets):
            src, dst, size = [], [], []
            for r in range(self.requests):
                sb, db = 2 * (k * requests + r), 2 * (k * requests + r) + 1
                for layer in range(L):  # vLLM's order: per layer, conv state then SSM state
                    for pool, nbytes in ((self.conv, model.conv_bytes), (self.ssm, model.ssm_bytes)):
                        if pool is None:
                            continue
                        base = pool.data_ptr() + layer * nb * nbytes
                        src.append(base + sb * nbytes)
                        dst.append(base + db * nbytes)
                        size.append(nbytes)
            mk = lambda v: torch.tensor(v, dtype=torch.int64, device=device)  # noqa: E731
            self.batches.append((mk(src), mk(dst), mk(size)))

    def check(self, torch, fn) -> bool:
        """Poison set 0's destinations, run ``fn`` on it, compare with the sources."""
        nb = 2 * self.requests * self.sets
        views = []
        for pool in (self.conv, self.ssm):
            if pool is None:
                continue
            blocks = pool.view(pool.shape[0], nb, -1).view(torch.uint8)
            srcs = blocks[:, 0:2 * self.requests:2]
            dsts = blocks[:, 1:2 * self.requests:2]
            dsts.copy_(srcs)
            dsts.bitwise_not_()  # every destination byte differs from what must arrive
            views.append((srcs, dsts))
        fn(*self.batches[0])
        torch.cuda.synchronize() if self.conv.device.type == "cuda" else None
        return all(torch.equal(s, d) for s, d in views)

    def free(self):
        self.conv = self.ssm = None
        self.batches = []


def _median_ms(torch, fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def time_graph(torch, fn, batches, reps: int) -> float:
    """Seconds per call: all batches captured in one CUDA graph, median replay / len(batches)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for b in batches:
            fn(*b)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for b in batches:
            fn(*b)
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    return _median_ms(torch, g.replay, reps) / 1e3 / len(batches)


def time_eager(torch, fn, batches, reps: int) -> float:
    """Seconds per call: the batches issued eagerly between two events, median / len(batches)."""
    for b in batches:
        fn(*b)
    torch.cuda.synchronize()

    def run():
        for b in batches:
            fn(*b)

    return _median_ms(torch, run, reps) / 1e3 / len(batches)


def measure_bandwidth(torch, device, nbytes: int, reps: int = 20) -> float:
    """Device copy bandwidth in bytes/s (read + write) of one ``nbytes`` ``copy_``."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 256)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    ms = _median_ms(torch, lambda: b.copy_(a), reps)
    del a, b
    return 2 * nbytes / (ms / 1e3)


def host_overhead(torch, impls, batch, emit_note, calls: int = 300) -> None:
    """Print host microseconds per call: ``calls`` back-to-back calls, then one sync."""
    import time

    for name, fn in impls.items():
        if name == "torch":
            continue
        for _ in range(20):
            fn(*batch)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn(*batch)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        emit_note(f"# host time per call, {name}: {(t1 - t0) / calls * 1e6:.1f} us "
                  f"({batch[0].numel()} copies)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.state_copy",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODELS), help="comma list of " + ", ".join(MODELS))
    p.add_argument("--requests", default="1,8,64", help="comma list of request counts")
    p.add_argument("--vllm-mamba-utils", metavar="PATH",
                   help="vLLM's vllm/v1/worker/mamba_utils.py to take batch_memcpy from (when vLLM is not importable)")
    p.add_argument("--ascend-variant", metavar="PATH",
                   help="file with vllm-ascend's hoisted-cast batch_memcpy_kernel/batch_memcpy (optional)")
    p.add_argument("--bandwidth-bytes", type=int, default=1 << 30, help="size of the reference copy")
    p.add_argument("--min-footprint", type=int, default=512 << 20,
                   help="bytes copied over the K rotating sets of one workload (defeats L2)")
    p.add_argument("--reps", type=int, default=15, help="timed repetitions (median)")
    p.add_argument("--no-torch", action="store_true", help="skip the torch fallback")
    p.add_argument("--sweep", action="store_true", help="also time launch-parameter variants of our kernel")
    p.add_argument("--json-out", metavar="PATH", help="write all rows and metadata as JSON")
    p.add_argument("--contiguous-ref", action="store_true", default=True,
                   help="time one contiguous copy_ of each workload's byte count (default; the flag "
                        "is kept for old command lines)")
    p.add_argument("--no-contiguous-ref", dest="contiguous_ref", action="store_false",
                   help="skip the same-size copy_ reference")
    p.add_argument("--host-overhead", action="store_true",
                   help="also print each implementation's host time per call (smallest conv batch)")
    args = p.parse_args(argv)

    import torch
    import triton

    from vllm_hybrid_npu.ops import _triton_copy, batch_memcpy

    @triton.jit
    def _empty_kernel(x):  # the launch-latency floor: one program, no work
        pass

    if not torch.cuda.is_available():
        print("no CUDA device: this benchmark times device copies (NPU timing not implemented)",
              file=sys.stderr)
        return 2
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    for m in models:
        if m not in MODELS:
            p.error(f"--models: unknown model {m!r}; known: {', '.join(MODELS)}")
    try:
        requests = [int(r) for r in args.requests.split(",")]
    except ValueError:
        p.error(f"--requests: {args.requests!r} is not a comma list of integers")
    device = torch.device("cuda", torch.cuda.current_device())
    props = torch.cuda.get_device_properties(device)

    impls: dict[str, object] = {}  # vLLM's first: later rows report their speedup over it
    vllm_src = "none"
    if importlib.util.find_spec("vllm") is not None:
        from vllm.v1.worker.mamba_utils import batch_memcpy as vllm_bm

        impls["vllm"] = vllm_bm
        vllm_src = "vllm.v1.worker.mamba_utils (importable)"
    elif args.vllm_mamba_utils:
        impls["vllm"] = load_extracted_batch_memcpy(args.vllm_mamba_utils, "vllm")
        vllm_src = f"extracted from {args.vllm_mamba_utils}"
    if args.ascend_variant:
        impls["ascend-hoisted"] = load_extracted_batch_memcpy(args.ascend_variant, "ascend")
    impls["ours"] = lambda s, d, n: batch_memcpy(s, d, n, impl="triton", check_values=False)
    if not args.no_torch:
        impls["torch"] = lambda s, d, n: batch_memcpy(s, d, n, impl="torch", check_values=False)

    probe = torch.empty(16, device=device)
    bw = measure_bandwidth(torch, device, args.bandwidth_bytes)
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": props.name, "sms": props.multi_processor_count,
        "torch": torch.__version__, "triton": triton.__version__,
        "vllm_kernel": vllm_src, "bandwidth_bytes": args.bandwidth_bytes,
        "bandwidth_GBps": bw / 1e9, "command": " ".join(["python -m benchmarks.state_copy"] + (argv if argv is not None else sys.argv[1:])),
        "our_config": dataclasses.asdict(_triton_copy.target_config("cuda", device.index)),
    }
    print(f"# {meta['date']} {props.name} ({props.multi_processor_count} SMs), torch {torch.__version__}, "
          f"triton {triton.__version__}; vLLM kernel: {vllm_src}")
    print(f"# device copy bandwidth (read+write, {args.bandwidth_bytes >> 20} MiB copy_): {bw / 1e9:.0f} GB/s")
    rows = []
    hdr = (f"{'model':<20} {'batch':<9} {'req':>4} {'copies':>6} {'MiB':>8} {'impl':<28} {'mode':<6} "
           f"{'us':>9} {'GB/s':>7} {'ratio':>6} {'/copy_':>6} {'x vllm':>7}")
    print(hdr)

    def emit(row):
        rows.append(row)
        vs = f"{row['speedup_vs_vllm']:.2f}" if row.get("speedup_vs_vllm") else ""
        vc = f"{row['vs_same_copy']:.2f}" if row.get("vs_same_copy") else ""
        print(f"{row['model'][:20]:<20} {row['batch']:<9} {row['requests']:>4} {row['copies']:>6} "
              f"{row['moved_bytes'] / 2**20:>8.1f} {row['impl']:<28} {row['mode']:<6} "
              f"{row['seconds'] * 1e6:>9.2f} {row['GBps']:>7.0f} {row['ratio']:>6.2f} {vc:>6} {vs:>7}",
              flush=True)

    sweep_cfgs = []
    if args.sweep:
        sms = props.multi_processor_count
        for bb, nw, pps, ips, mt in [(16384, 4, 16, 16, 16384), (16384, 4, 16, 8, 16384),
                                     (16384, 4, 16, 32, 16384), (16384, 4, 32, 32, 16384),
                                     (16384, 4, 16, 16, 32768), (16384, 4, 8, 8, 16384),
                                     (32768, 8, 16, 16, 32768), (16384, 4, 16, 64, 16384)]:
            cfg = dataclasses.replace(_triton_copy.target_config("cuda", device.index),
                                      max_programs=sms * pps, target_items=sms * ips,
                                      block_bytes=bb, num_warps=nw, min_tile_bytes=mt)
            name = f"ours[b{bb // 1024}k,w{nw},p{pps},i{ips},m{mt // 1024}k]"
            sweep_cfgs.append((name, cfg))

    for mkey in models:
        model = MODELS[mkey]
        for conv_only in (False, True):
            for r in requests:
                wl = Workload(torch, device, model, r, conv_only, args.min_footprint, 256)
                base = {"model": model.name, "batch": "conv-only" if conv_only else "ssm+conv",
                        "requests": r, "copies": wl.ncopies, "moved_bytes": 2 * wl.copied,
                        "sets": wl.sets}
                cands = dict(impls)
                if args.sweep:
                    for name, cfg in sweep_cfgs:
                        cands[name] = (lambda c: lambda s, d, n: _triton_copy.launch(
                            _triton_copy.batch_memcpy_kernel, s, d, n, c))(cfg)
                results = {}
                # Same-run references for this size, graph-timed like the kernels:
                # * one contiguous copy_ of the batch's total bytes (K rotating buffer pairs): what
                #   the device achieves for this many bytes in one launch;
                # * an empty Triton kernel, one program: the launch-latency floor;
                # * our kernel on the same address tensors with every size 0: its fixed cost
                #   (same grid, address loads, no bytes).
                same_copy = None
                if args.contiguous_ref:
                    bufs = [(torch.empty(wl.copied, dtype=torch.uint8, device=device).random_(0, 256),
                             torch.empty(wl.copied, dtype=torch.uint8, device=device))
                            for _ in range(wl.sets)]
                    same_copy = time_graph(torch, lambda i: bufs[i][1].copy_(bufs[i][0]),
                                           [(i,) for i in range(len(bufs))], args.reps)
                    del bufs
                    gbps = 2 * wl.copied / same_copy / 1e9
                    emit({**base, "impl": "copy_ same bytes", "mode": "graph", "seconds": same_copy,
                          "GBps": gbps, "ratio": gbps * 1e9 / bw, "vs_same_copy": 1.0})
                t = time_graph(torch, lambda: _empty_kernel[(1,)](probe), [()] * 256, args.reps)
                emit({**base, "impl": "empty launch (1 program)", "mode": "graph", "seconds": t,
                      "GBps": 0.0, "ratio": 0.0})
                zero = [(s, d, torch.zeros_like(n)) for s, d, n in wl.batches]
                zero = (zero * (64 // len(zero) + 1))[:max(64, len(zero))]
                t = time_graph(torch, impls["ours"], zero, args.reps)
                emit({**base, "impl": "ours, all sizes 0", "mode": "graph", "seconds": t,
                      "GBps": 0.0, "ratio": 0.0})
                del zero
                for name, fn in cands.items():
                    if not wl.check(torch, fn):
                        print(f"!! {name}: WRONG BYTES on {base}", flush=True)
                        rows.append({**base, "impl": name, "mode": "check", "error": "wrong bytes"})
                        continue
                    modes = ["eager"] if name == "torch" else ["graph", "eager"]
                    if name.startswith("ours["):
                        modes = ["graph"]
                    for mode in modes:
                        reps = 3 if name == "torch" else args.reps
                        t = (time_graph if mode == "graph" else time_eager)(torch, fn, wl.batches, reps)
                        results[(name, mode)] = t
                        gbps = 2 * wl.copied / t / 1e9
                        row = {**base, "impl": name, "mode": mode, "seconds": t, "GBps": gbps,
                               "ratio": gbps * 1e9 / bw}
                        if same_copy:
                            row["vs_same_copy"] = same_copy / t
                        ref = results.get(("vllm", mode))
                        if name != "vllm" and ref:
                            row["speedup_vs_vllm"] = ref / t
                        emit(row)
                if args.host_overhead and r == requests[0] and conv_only:
                    cfg0 = _triton_copy.target_config("cuda", device.index)
                    launch_only = {"ours (kernel launch only)": lambda s, d, n: _triton_copy.launch(
                        _triton_copy.batch_memcpy_kernel, s, d, n, cfg0)}
                    host_overhead(torch, {**impls, **launch_only}, wl.batches[0], emit_note=print)
                wl.free()
                torch.cuda.empty_cache()
    meta["fast_launch"] = _triton_copy.FAST_LAUNCH
    print(f"# direct compiled-kernel launch in use: {_triton_copy.FAST_LAUNCH}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        print(f"# wrote {args.json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
