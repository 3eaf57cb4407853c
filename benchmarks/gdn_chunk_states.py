"""Our chunk-state kernel against vLLM's FLA state kernel, launch configuration by configuration, on a GPU.

``python -m benchmarks.gdn_chunk_states [--lengths 8192 32768] [--reps 15] [--first ours|vllm]
[--block 1088] [--call N] [--inner N] [--json FILE] [--device cuda|cpu] [--also [LABEL=]FILE ...] [--theirs [LABEL=]FILE ...] [--asm DIR] [--bits]``;
``python -m benchmarks.gdn_chunk_states --pool CALL.json ... [--json FILE]`` pools calls

Why: in issue 37's H200 session (docs/notes/issue37-h200-2026-11-28c/) the exporter's step
profile had our chunk-state kernel (:func:`vllm_hybrid_npu.ops._triton_gdn.chunk_states`) at
307 us a call against vLLM's ``chunk_gated_delta_rule_fwd_kernel_h_blockdim64`` at 169 us in
caching off's process, and vLLM's own ``merge_16x16_to_64x64_inverse_kernel`` slower in the
exporter's process too: our kernel, or the launch configuration each process's autotuner picked?
vLLM's autotuner keys that kernel on ``(H, K, V, BT)``, not the length, and our kernel takes the
configuration it picked (``fla_h_config``, for bit-equal states), so the two questions are
separated here, in one process:

* ``config`` rows: for every configuration of vLLM's autotuning space (``BV`` 32 / 64, 2 / 4
  warps, its stages), vLLM's kernel launched directly with it (its ``JITFunction``, the
  heuristics' values passed as vLLM's wrapper would) and ours with the same, once without a
  checkpoint (``chunk_map`` all -1) and once with the cold prompt's checkpoint at its last block
  boundary (``(T - 1) // block * block``, one block of a float32 SSM cache);
* ``LABEL`` rows (``--also LABEL=FILE``): other versions of our kernel module, no checkpoint;
  (``--theirs LABEL=FILE``): another vLLM version's ``chunk_delta_h.py`` loaded into this vLLM's
  FLA package, its kernel launched as vLLM's (0.32 / 0.33 load and store through pointer
  arithmetic where 0.30 uses block pointers, with the same arithmetic);
* ``autotuned`` rows: the calls a serving step makes: vLLM's ``chunk_gated_delta_rule_fwd_h``
  (its autotuner's pick) against our ``chunk_states`` with ``fla_h_config``'s mirror of it.

Shapes: one cold row of ``T`` tokens at Qwen3.5-35B-A3B's GDN width at tp 1 (32 value heads, 16
key heads, head dims 128), bf16 inputs, a float32 initial state, final state stored, as vLLM's
GDN layer calls it. GPU time per call: CUDA events around the one launch (microseconds); host
time: the Python call's wall time with an idle stream (microseconds, launch and allocation).
Each round launches every variant once, rotated so that each comes first equally often
(``--first`` picks who starts round 0: alternate it across calls); medians over ``--reps``
rounds, and ``ours / vllm`` ratios of the same run. Prints a table, writes ``--json``.

``--device cpu`` is a dry run of the same calls in Triton's interpreter (``TRITON_INTERPRET=1``,
short lengths: its times say nothing). Raises SystemExit without the device or without vLLM's FLA
module (vLLM 0.30's layout).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import sys
import time

HEADS, KEY_HEADS, DIM, CHUNK = 32, 16, 128, 64


def _jit(kernel):
    """The ``JITFunction`` under vLLM's ``heuristics(autotune(jit))`` decorators (an
    ``InterpretedFunction`` under ``TRITON_INTERPRET=1``)."""
    from triton.runtime.autotuner import Autotuner, Heuristics

    while isinstance(kernel, (Autotuner, Heuristics)):
        kernel = kernel.fn
    return kernel


def _inputs(t: int, seed: int, dev: str):
    import torch

    from vllm.third_party.flash_linear_attention.ops import index

    gen = torch.Generator(device=dev).manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=gen, device=dev)  # noqa: E731
    k = torch.nn.functional.normalize(rand(1, t, KEY_HEADS, DIM), dim=-1).to(torch.bfloat16)
    w = (rand(1, t, HEADS, DIM) * 0.05).to(torch.bfloat16)
    u = rand(1, t, HEADS, DIM).to(torch.bfloat16)
    # chunk-local cumulative log gates, as FLA's chunk_local_cumsum leaves them
    g = (-torch.rand(1, t, HEADS, generator=gen, device=dev) * 0.05)
    g = g.view(1, -1, CHUNK, HEADS).cumsum(2).view(1, t, HEADS) if t % CHUNK == 0 else g.cumsum(1)
    h0 = torch.zeros(1, HEADS, DIM, DIM, device=dev)
    cu = torch.tensor([0, t], dtype=torch.int32, device=dev)
    ci, co = (f(cu.cpu(), CHUNK).to(dev) for f in (index.prepare_chunk_indices,
                                                       index.prepare_chunk_offsets))
    return k, w, u, g, h0, cu, ci, co


def _median(xs):
    return round(statistics.median(xs), 2)


class _CpuEvent:
    """``torch.cuda.Event``'s two calls on the host clock (the dry run)."""

    def record(self):
        self.t = time.perf_counter()

    def elapsed_time(self, end):
        return (end.t - self.t) * 1e3


def _load(path: str, label: str, package: str = ""):
    """Another version of a kernel module (its source file), as a module of ``package`` (its
    relative imports resolve there)."""
    import importlib.util

    name = f"{package}.gdn_bench_{label}".lstrip(".").replace("-", "_")
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _launch_vllm(vjit, inputs, t: int, nt: int, bv: int, nw: int, ns: int, dev: str = "cuda"):
    """vLLM's state kernel (``vjit``, a ``JITFunction``) on ``inputs`` (:func:`_inputs`' tuple)
    at ``(bv, nw, ns)``, with the heuristics' values its wrapper passes, into fresh outputs.
    Returns ``(compiled kernel, {"h", "v_new", "final"})``; on ``dev == "cpu"`` the call is only
    bound to the kernel's signature (vLLM 0.30's block pointers do not run in the interpreter):
    ``(None, outputs unwritten)``."""
    import torch
    import triton

    k, w, u, g, h0, cu, _, co = inputs
    out = {"h": k.new_empty(1, nt, HEADS, DIM, DIM), "v_new": torch.empty_like(u),
           "final": k.new_empty(1, HEADS, DIM, DIM, dtype=torch.float32)}
    pos = (k, u, w, out["v_new"], g, None, out["h"], h0, out["final"], cu, co, t)
    kw = dict(H=HEADS, Hg=KEY_HEADS, K=DIM, V=DIM, BT=CHUNK, BV=bv, USE_G=True, USE_GK=False,
              USE_INITIAL_STATE=True, STORE_FINAL_STATE=True, SAVE_NEW_VALUE=True, IS_VARLEN=True,
              USE_EXP2=False)
    if dev == "cpu":
        inspect.signature(vjit.fn).bind(*pos, **kw)
        return None, out
    return vjit[(triton.cdiv(DIM, bv), HEADS)](*pos, **kw, num_warps=nw, num_stages=ns), out


def run(lengths, reps, first, block, seed, dev="cuda", also=(), inner=1, asm=None, their_files=()):
    import torch
    import triton

    from vllm.third_party.flash_linear_attention.ops import chunk_delta_h as fla

    from vllm_hybrid_npu.ops import _triton_gdn
    from vllm_hybrid_npu.patches import gdn_prefill_checkpoint as mod

    vjit = _jit(fla.chunk_gated_delta_rule_fwd_kernel_h_blockdim64)
    kernels = _triton_gdn.interpreted() if dev == "cpu" else None
    theirs = {}  # other vLLM versions' chunk_delta_h.py, in this vLLM's FLA package
    for spec in their_files or ():
        label, _, path = spec.rpartition("=")
        theirs[label or "vllm-other"] = _jit(_load(path, label or "vllm-other", fla.__package__)
                                             .chunk_gated_delta_rule_fwd_kernel_h_blockdim64)
    others = {}
    for spec in also or ():
        label, _, path = spec.rpartition("=")
        mod_ = _load(path, label or "before")
        others[label or "before"] = mod_.interpreted() if dev == "cpu" else mod_
    tuner = _jit_autotuner(fla.chunk_gated_delta_rule_fwd_kernel_h_blockdim64)
    space = [(c.kwargs["BV"], c.num_warps, c.num_stages) for c in tuner.configs]
    rows = []
    for t in lengths:
        inputs = _inputs(t, seed, dev)
        k, w, u, g, h0, cu, ci, co = inputs
        nt = ci.shape[0]
        cache = torch.zeros(4, HEADS, DIM, DIM, device=dev)
        none = torch.full((nt,), -1, dtype=torch.int64, device=dev)
        ckpt = none.clone()
        ckpt[((t - 1) // block * block) // CHUNK] = 0
        slots = torch.tensor([1], dtype=torch.int64, device=dev)

        def vllm_cfg(bv, nw, ns, vjit=vjit):
            _launch_vllm(vjit, inputs, t, nt, bv, nw, ns, dev)

        def ours_cfg(bv, nw, ns, cmap):
            _triton_gdn.chunk_states(k, w, u, g, h0, True, cu, co, nt, cmap, slots, cache,
                                     bv=bv, num_warps=nw, num_stages=ns, kernels=kernels)

        args = (k, w, u, g, None, h0, True, CHUNK, True, cu, ci, co, False)
        variants = {}
        for cfg in space:
            variants[("config", cfg, "vllm")] = lambda cfg=cfg: vllm_cfg(*cfg)
            for label, jit in theirs.items():
                variants[("config", cfg, label)] = lambda cfg=cfg, jit=jit: vllm_cfg(*cfg, vjit=jit)
            variants[("config", cfg, "ours")] = lambda cfg=cfg: ours_cfg(*cfg, none)
            variants[("config", cfg, "ours+ckpt")] = lambda cfg=cfg: ours_cfg(*cfg, ckpt)
            for label, other in others.items():
                variants[("config", cfg, label)] = lambda cfg=cfg, other=other: other.chunk_states(
                    k, w, u, g, h0, True, cu, co, nt, none, slots, cache, bv=cfg[0],
                    num_warps=cfg[1], num_stages=cfg[2], kernels=other)
        if dev == "cuda":  # the interpreter has neither vLLM 0.30's block pointers nor a benchmarker
            fla.chunk_gated_delta_rule_fwd_h(*args)  # the autotuner picks (first call of this key)
            picked = mod.fla_h_config(fla.chunk_gated_delta_rule_fwd_h, args, ("bench", t))
            auto = (picked["bv"], picked["num_warps"], picked["num_stages"])
            variants[("autotuned", auto, "vllm")] = lambda: fla.chunk_gated_delta_rule_fwd_h(*args)
            variants[("autotuned", auto, "ours+ckpt")] = lambda auto=auto: ours_cfg(*auto, ckpt)
        names = list(variants)
        if first == "ours":
            names.sort(key=lambda n: n[2] == "vllm")
        for f in variants.values():  # compile every variant before timing
            f()
        sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
        sync()
        gpu = {n: [] for n in names}
        host = {n: [] for n in names}
        event = (lambda: torch.cuda.Event(enable_timing=True)) if dev == "cuda" else _CpuEvent
        ev = [(event(), event()) for _ in names]
        for r in range(reps):
            order = names[r % len(names):] + names[:r % len(names)]
            for n, (a, b) in zip(order, ev):
                sync()
                t0 = time.perf_counter()
                a.record()
                for _ in range(inner):
                    variants[n]()
                b.record()
                host[n].append((time.perf_counter() - t0) * 1e6 / inner)
                sync()
                gpu[n].append(a.elapsed_time(b) * 1e3 / inner)
        for n in names:
            kind, cfg, who = n
            rows.append({"tokens": t, "kind": kind, "bv": cfg[0], "num_warps": cfg[1],
                         "num_stages": cfg[2], "kernel": who, "gpu_us": _median(gpu[n]),
                         "host_us": _median(host[n]), "reps": reps})
        if asm and dev == "cuda" and t == lengths[0]:  # both kernels' code at vLLM's pick
            bv, nw, ns = auto
            compiled = {label: _launch_vllm(jit, inputs, t, nt, bv, nw, ns)[0]
                        for label, jit in {"vllm": vjit, **theirs}.items()}
            mine = _triton_gdn.chunk_states_kernel[(triton.cdiv(DIM, bv), HEADS)](
                k, u, w, torch.empty_like(u), g, k.new_empty(1, nt, HEADS, DIM, DIM), h0,
                k.new_empty(1, HEADS, DIM, DIM, dtype=torch.float32), cu, co, ckpt, slots, cache,
                *cache.stride(), H=HEADS, Hg=KEY_HEADS, K=DIM, V=DIM, BT=CHUNK, BV=bv,
                USE_INITIAL_STATE=True, STORE_FINAL_STATE=True, num_warps=nw, num_stages=ns)
            os.makedirs(asm, exist_ok=True)
            for label, ck in (*compiled.items(), ("ours", mine)):
                print(f"asm {label}: config {auto} n_regs {getattr(ck, 'n_regs', '?')} "
                      f"n_spills {getattr(ck, 'n_spills', '?')} shared {getattr(ck, 'shared', '?')}")
                for ext in ("ttgir", "ptx"):
                    if ext in getattr(ck, "asm", {}):
                        with open(os.path.join(asm, f"{label}.{ext}"), "w") as f:
                            f.write(ck.asm[ext])
    ref = {(r["tokens"], r["kind"], r["bv"], r["num_warps"], r["num_stages"]): r
           for r in rows if r["kernel"] == "vllm"}
    for r in rows:
        base = ref[(r["tokens"], r["kind"], r["bv"], r["num_warps"], r["num_stages"])]
        r["gpu_vs_vllm"] = round(r["gpu_us"] / base["gpu_us"], 3)
        r["host_vs_vllm"] = round(r["host_us"] / base["host_us"], 3)
    return rows


def bits(lengths, seed, block, dev="cuda") -> list[dict]:
    """Whether the kernels' outputs depend on the launch configuration (``--bits``).

    For every configuration of vLLM's autotuning space, vLLM's kernel and ours (with the
    checkpoint) run on the same inputs as :func:`run`'s; each output, ``h`` [1, NT, H, V, K]
    bf16, ``v_new`` [1, T, H, V] bf16 and the final state [1, H, V, K] float32 (ours: also the
    checkpoint block), is compared with vLLM's kernel at the first configuration of the space
    (the checkpoint, float32 where ``h`` is bf16: with ours at the first configuration).
    Rows: ``tokens``, ``bv``, ``num_warps``, ``num_stages``, ``kernel``, and per output
    ``equal`` (bit for bit) and ``max_abs`` (the largest absolute difference, float). If every row
    is equal, the exporter may launch its kernel at a configuration other than vLLM's autotuned
    pick and still leave caching off's outputs bit for bit. On ``--device cpu`` vLLM's kernel
    does not run (the interpreter lacks its block pointers): ours only, against its own first
    configuration."""
    import torch

    from vllm.third_party.flash_linear_attention.ops import chunk_delta_h as fla

    from vllm_hybrid_npu.ops import _triton_gdn

    vjit = _jit(fla.chunk_gated_delta_rule_fwd_kernel_h_blockdim64)
    kernels = _triton_gdn.interpreted() if dev == "cpu" else None
    space = [(c.kwargs["BV"], c.num_warps, c.num_stages)
             for c in _jit_autotuner(fla.chunk_gated_delta_rule_fwd_kernel_h_blockdim64).configs]
    rows = []
    for t in lengths:
        inputs = _inputs(t, seed, dev)
        k, w, u, g, h0, cu, ci, co = inputs
        nt = ci.shape[0]
        ckpt = torch.full((nt,), -1, dtype=torch.int64, device=dev)
        ckpt[((t - 1) // block * block) // CHUNK] = 0
        slots = torch.tensor([1], dtype=torch.int64, device=dev)

        def vllm_out(bv, nw, ns):
            return _launch_vllm(vjit, inputs, t, nt, bv, nw, ns)[1]

        def ours_out(bv, nw, ns):
            cache = torch.full((4, HEADS, DIM, DIM), float("nan"), device=dev)
            h, vn, ht = _triton_gdn.chunk_states(k, w, u, g, h0, True, cu, co, nt, ckpt, slots,
                                                 cache, bv=bv, num_warps=nw, num_stages=ns,
                                                 kernels=kernels)
            return {"h": h, "v_new": vn, "final": ht, "checkpoint": cache[1]}

        runs = [("vllm", vllm_out)] if dev == "cuda" else []
        runs.append(("ours", ours_out))
        ref = None
        for cfg in space:
            for who, fn in runs:
                out = fn(*cfg)
                ref = ref or dict(out)
                if ref.get("checkpoint") is None:  # ours' first (float32)
                    ref["checkpoint"] = out.get("checkpoint")
                row = {"tokens": t, "bv": cfg[0], "num_warps": cfg[1], "num_stages": cfg[2],
                       "kernel": who}
                for name, x in out.items():
                    y = ref[name]
                    row[f"{name}_equal"] = bool(torch.equal(x, y))
                    row[f"{name}_max_abs"] = float((x.float() - y.float()).abs().max())
                rows.append(row)
    return rows


def _jit_autotuner(kernel):
    import triton

    while not isinstance(kernel, triton.runtime.autotuner.Autotuner):
        kernel = kernel.fn
    return kernel


def _table(rows: list[dict]) -> None:
    print(f"{'tokens':>6} {'kind':>9} {'BV':>3} {'w':>2} {'s':>2} {'kernel':>10} "
          f"{'GPU us':>9} {'/vllm':>6} {'host us':>8} {'/vllm':>6}")
    for r in rows:
        print(f"{r['tokens']:>6} {r['kind']:>9} {r['bv']:>3} {r['num_warps']:>2} {r['num_stages']:>2} "
              f"{r['kernel']:>10} {r['gpu_us']:>9} {r['gpu_vs_vllm']:>6} {r['host_us']:>8} "
              f"{r['host_vs_vllm']:>6}")


def pool(paths: list[str]) -> dict:
    """Calls' JSONs (one machine, one version) pooled: per (tokens, kind, configuration, kernel)
    the median of the calls' medians, its ratio to vLLM's pooled the same way, and the calls."""
    docs = [json.load(open(p)) for p in paths]
    key = lambda r: (r["tokens"], r["kind"], r["bv"], r["num_warps"], r["num_stages"])  # noqa: E731
    cells: dict = {}
    for d in docs:
        for r in d["rows"]:
            cells.setdefault((*key(r), r["kernel"]), []).append(r)
    rows = []
    for (t, kind, bv, nw, ns, who), rs in cells.items():
        rows.append({"tokens": t, "kind": kind, "bv": bv, "num_warps": nw, "num_stages": ns,
                     "kernel": who, "calls": len(rs),
                     "gpu_us": _median([r["gpu_us"] for r in rs]),
                     "host_us": _median([r["host_us"] for r in rs])})
    ref = {(r["tokens"], r["kind"], r["bv"], r["num_warps"], r["num_stages"]): r
           for r in rows if r["kernel"] == "vllm"}
    for r in rows:
        base = ref[key(r)]
        r["gpu_vs_vllm"] = round(r["gpu_us"] / base["gpu_us"], 3)
        r["host_vs_vllm"] = round(r["host_us"] / base["host_us"], 3)
    return {"calls": [d.get("call") for d in docs], "device": docs[0]["device"],
            "files": [os.path.basename(p) for p in paths], "rows": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--first", choices=("ours", "vllm"), default="vllm")
    ap.add_argument("--block", type=int, default=1088, help="block size in tokens (the checkpoint)")
    ap.add_argument("--seed", type=int, default=2136681357)
    ap.add_argument("--call", type=int, default=0, help="the device call's number, kept in the JSON")
    ap.add_argument("--json", default=None)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--also", nargs="*", default=(), metavar="[LABEL=]FILE",
                    help="other versions of vllm_hybrid_npu/ops/_triton_gdn.py: rows LABEL "
                         "(default 'before'), no checkpoint")
    ap.add_argument("--inner", type=int, default=1,
                    help="launches back to back between a round's two events (GPU time per launch "
                         "without the host's launch gap once the queue runs ahead)")
    ap.add_argument("--theirs", nargs="*", default=(), metavar="[LABEL=]FILE",
                    help="another vLLM version's chunk_delta_h.py (e.g. 0.32's pointer-arithmetic "
                         "kernel): rows LABEL (default 'vllm-other'), launched as vLLM's")
    ap.add_argument("--asm", default=None, metavar="DIR",
                    help="write the kernels' TTGIR and PTX (vLLM's, each --theirs, ours) at "
                         "vLLM's autotuned configuration (the first length) into DIR and print "
                         "registers and spills")
    ap.add_argument("--bits", action="store_true",
                    help="no timing: whether each kernel's outputs at every configuration of "
                         "vLLM's space equal vLLM's kernel's at the first one, bit for bit")
    ap.add_argument("--pool", nargs="*", default=None, metavar="JSON",
                    help="pool these calls' JSONs (no run): table and --json")
    a = ap.parse_args(argv)
    if a.pool:
        doc = pool(a.pool)
        _table(doc["rows"])
        _dump(a.json, doc)
        return 0
    if a.device == "cpu":
        import os

        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported
        import triton
        import vllm.triton_utils as tu

        tu.triton, tu.tl = triton, triton.language  # vLLM's CPU build swaps in placeholders
    try:
        import torch
        import vllm.third_party.flash_linear_attention.ops.chunk_delta_h  # noqa: F401
    except ImportError as e:
        raise SystemExit(f"gdn_chunk_states: needs vLLM's FLA module ({e})") from e
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gdn_chunk_states: needs a CUDA device (--device cpu: a dry run)")
    t0 = time.time()
    if a.bits:
        rows = bits(a.lengths, a.seed, a.block, a.device)
        for r in rows:
            print(" ".join(f"{key}={val}" for key, val in r.items()))
        _dump(a.json, {"device": torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu",
                       "call": a.call, "seed": a.seed, "command": " ".join(sys.argv), "bits": rows})
        return 0
    rows = run(a.lengths, a.reps, a.first, a.block, a.seed, a.device, a.also, a.inner, a.asm,
               a.theirs)
    _table(rows)
    device = torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu (interpreter)"
    _dump(a.json, {"device": device, "torch": torch.__version__, "vllm": __import__("vllm").__version__,
                   "call": a.call, "first": a.first, "seed": a.seed, "block": a.block,
                   "inner": a.inner, "also": list(a.also), "theirs": list(a.theirs), "wall_s": round(time.time() - t0, 1),
                   "command": " ".join(sys.argv), "rows": rows})
    return 0


def _dump(path: str | None, doc: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
