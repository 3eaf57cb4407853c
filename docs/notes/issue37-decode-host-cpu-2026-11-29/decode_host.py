"""Issue 37 item 3 on CPU: what runs on the host in a decode-only engine step, per row of
benchmarks/cuda_serving.py (``off``, ``upstream``, ``vllm-align``, ``exporter``; the rows' engine
arguments and environment are the harness's: :data:`benchmarks.cuda_serving.ROWS`, ``row_env``).

    PYTHONPATH=$PWD python docs/notes/issue37-decode-host-cpu-2026-11-29/decode_host.py ROW \
        --out OUT.json [--model DIR] [--reqs 4] [--tokens 300] [--torch-tokens 40] [--seed N]

One engine per call (the row's environment is set before vLLM is imported: the script re-runs
itself in a child with ``row_env(ROW)``). The workload per pass: a primer prompt (a shared prefix
of 2 blocks + 88 tokens, then a block + 44 tokens of its own, ``max_tokens`` 1), then ``--reqs`` requests
submitted together, each the shared prefix and a suffix of its own (``block // 2 + 10 i`` tokens):
with prefix caching the first one scheduled hits the primer's attention blocks up to the 2-block
junction and no GDN state there, as the second user of a system prompt does (vLLM sets
``request.shared_prefix_boundary`` and keeps it for the request's life); the others wait one step
(vLLM lets no request use a Mamba block cached in the same step) and hit the state written at the
junction. So one decoding request carries a junction in every row with prefix caching (measured:
``request_steps_with_junction`` / steps = 1.0). They decode ``--tokens`` tokens each (greedy,
``ignore_eos``). Token ids are
drawn from ``--seed`` (printed; a fresh one unless given), every pass a new prefix. A step is
*decode-only* where, before it, nothing waits and every running request has computed its prompt,
and after it every running request computed exactly one token more; it is a *crossing* step where
a request's computed tokens were a multiple of the block (align mode moves its state to a new
block and both managers allocate one).

Passes, after a warm-up pass, each on fresh prompts: ``time`` (no profiler; per step the wall
of ``engine.step()`` and the host time of the harness's step phases,
:class:`benchmarks.cuda_serving.PhaseTimer`), ``ab`` (rows with the plugin: decode-only steps
alternate between the plugin's wrappers and vLLM's own functions, every registry entry's previous
object put back for odd steps; on a decode-only step our wrappers only forward, so both halves
schedule alike; the wall and the host time of ``schedule`` / ``execute_model`` /
``update_from_output`` per step), ``cprofile`` (one ``cProfile.Profile`` per step, the
decode-only ones summed: calls and own time of every Python function; own times include the
profiler's overhead) and ``ops`` (``--torch-tokens`` tokens under a ``TorchDispatchMode``: the
aten ops of each decode-only step, each attributed to the innermost Python frame outside torch,
so an op counts as ours only where a ``vllm_hybrid_npu`` frame issued it, not where our wrapper
called vLLM's function that did; ``torch.profiler``'s event parsing failed on this stack with a
``UnicodeDecodeError``). Writes ``OUT.json`` (times in ms and s rounded to 0.1 us): the engine's
configuration, the per-step lists and the per-function tables (``summarize.py`` prints the
README's tables from several).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

OURS = "vllm_hybrid_npu/"


def _short(path: str) -> str:
    for marker in ("site-packages/", str(ROOT) + "/"):
        if marker in path:
            return path.split(marker, 1)[1]
    return path


def _child(args) -> int:
    import cProfile
    import pstats

    import torch
    from vllm import LLM, SamplingParams

    from benchmarks.cuda_serving import ROWS, PhaseTimer, in_process_runner

    spec = ROWS[args.row]
    kw = dict(enable_prefix_caching=spec["caching"])
    if spec["caching"]:
        kw["mamba_cache_mode"] = "align"
    llm = LLM(model=args.model, max_model_len=2048, max_num_seqs=8, enforce_eager=True, seed=0,
              kv_cache_memory_bytes=256 << 20, **kw)
    engine = llm.llm_engine
    core = engine.engine_core.engine_core
    sched = core.scheduler
    runner = in_process_runner(core.model_executor)
    cfg = engine.vllm_config
    block = cfg.cache_config.block_size
    vocab = cfg.model_config.get_vocab_size()
    rng = random.Random(args.seed)
    sp_one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, detokenize=False)
    n_req = [0]

    def add(tokens: list[int], max_tokens: int) -> None:
        sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, detokenize=False)
        engine.add_request(f"r{n_req[0]}", {"prompt_token_ids": tokens}, sp if max_tokens > 1 else sp_one)
        n_req[0] += 1

    def draw(n: int) -> list[int]:
        return [rng.randrange(10, vocab - 10) for _ in range(n)]

    def run_pass(max_tokens: int, on_step) -> None:
        prefix = draw(2 * block + 88)
        # the primer: its attention blocks cached; its GDN state at 3 blocks only (none at 2)
        add(prefix + draw(block + 44), 1)
        while engine.has_unfinished_requests():
            engine.step()
        for i in range(args.reqs):
            add(prefix + draw(block // 2 + 10 * i), max_tokens)
        i = 0
        while engine.has_unfinished_requests():
            running = list(sched.running)
            before = {r.request_id: r.num_computed_tokens for r in running}
            pre = not sched.waiting and running and all(
                r.num_computed_tokens >= r.num_prompt_tokens for r in running)
            crossing = sum(1 for r in running if r.num_computed_tokens % block == 0)
            junctions = sum(1 for r in running if getattr(r, "shared_prefix_boundary", 0))

            def step():
                return engine.step()

            on_step(i, step, lambda: bool(pre) and all(
                r.num_computed_tokens == before[r.request_id] + 1 for r in running), crossing, junctions)
            i += 1

    info = {"row": args.row, "seed": args.seed, "block_size": block, "reqs": args.reqs,
            "tokens": args.tokens, "torch_tokens": args.torch_tokens,
            "async_scheduling": getattr(cfg.scheduler_config, "async_scheduling", None),
            "runner": type(runner).__module__ + "." + type(runner).__name__,
            "num_hidden_layers": cfg.model_config.hf_text_config.num_hidden_layers,
            "layer_types": list(getattr(cfg.model_config.hf_text_config, "layer_types", []) or []),
            "kv_cache_groups": [type(g.kv_cache_spec).__name__ for g in core.scheduler.kv_cache_config.kv_cache_groups],
            "torch": torch.__version__, "env": {k: v for k, v in os.environ.items() if k.startswith("VLLM_HYBRID_NPU")}}
    print("DECODE_HOST " + json.dumps(info), flush=True)

    # warm-up
    run_pass(8, lambda i, step, is_decode, c, j: step())

    # time pass
    owners = {"scheduler": sched, "runner": runner, "output_processor": engine.output_processor}
    timer = PhaseTimer(owners).install()
    timed = []

    def on_time(i, step, is_decode, crossing, junctions):
        timer.reset()
        t = time.perf_counter()
        step()
        wall = time.perf_counter() - t
        if is_decode():
            timed.append({"step": i, "crossing": crossing, "junctions": junctions, "wall_ms": 1e3 * wall,
                          **{f"{p}_ms": 1e3 * v[1] for p, v in timer.host.items()},
                          "execute_model_incl_ms": 1e3 * timer.host.get("execute_model", [0.0])[0]})

    try:
        run_pass(args.tokens, on_time)
    finally:
        timer.uninstall()

    # A/B pass (rows with the plugin): decode-only steps alternate between the plugin's wrappers
    # and vLLM's own functions (every registry entry's previous object put back for the step; on
    # a decode-only step each of our wrappers only forwards, so the schedule is the same), each
    # step's wall and the host time of schedule / execute_model / update_from_output (resolved
    # through the class at each call, so the swap reaches them)
    from vllm_hybrid_npu.patches import registry

    swaps = []
    for owner, attr, previous, name in list(registry._replaced):
        current = vars(owner).get(attr) if isinstance(owner, type) else getattr(owner, attr)
        swaps.append((owner, attr, previous, current, name))

    def put(which: str) -> None:
        for owner, attr, previous, current, _ in swaps:
            obj = previous if which == "vllm" else current
            if obj is registry._ABSENT:
                delattr(owner, attr)
            else:
                setattr(owner, attr, obj)

    ab_times: dict[str, float] = {}

    def dyn(owner, name):
        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return getattr(type(owner), name)(owner, *a, **k)
            finally:
                ab_times[name] = ab_times.get(name, 0.0) + time.perf_counter() - t0
        setattr(owner, name, timed)

    ab = []
    if swaps:
        for owner, name in ((sched, "schedule"), (runner, "execute_model"), (sched, "update_from_output")):
            dyn(owner, name)

        def on_ab(i, step, is_decode, crossing, junctions):
            which = "vllm" if i % 2 else "ours"
            put(which)
            ab_times.clear()
            t = time.perf_counter()
            try:
                step()
            finally:
                wall = time.perf_counter() - t
                put("ours")
            if is_decode():
                ab.append({"step": i, "with": which, "crossing": crossing, "wall_ms": 1e3 * wall,
                           **{f"{k}_ms": 1e3 * v for k, v in ab_times.items()}})

        try:
            run_pass(args.tokens, on_ab)
        finally:
            for owner, name in ((sched, "schedule"), (runner, "execute_model"), (sched, "update_from_output")):
                vars(owner).pop(name, None)

    # cProfile pass
    acc: dict[str, pstats.Stats | None] = {"plain": None, "crossing": None}
    count = {"plain": 0, "crossing": 0}
    junction_steps = {"plain": 0, "crossing": 0}

    def on_prof(i, step, is_decode, crossing, junctions):
        pr = cProfile.Profile()
        pr.enable()
        step()
        pr.disable()
        if is_decode():
            kind = "crossing" if crossing else "plain"
            count[kind] += 1
            junction_steps[kind] += junctions
            if acc[kind] is None:
                acc[kind] = pstats.Stats(pr)
            else:
                acc[kind].add(pr)

    run_pass(args.tokens, on_prof)
    prof = {}
    for kind, st in acc.items():
        rows = []
        if st is not None:
            for (path, line, name), (cc, nc, tt, ct, _callers) in st.stats.items():
                rows.append([_short(path), line, name, nc, round(tt, 7), round(ct, 7)])  # s, to 0.1 us
        prof[kind] = {"steps": count[kind], "request_steps_with_junction": junction_steps[kind],
                      "functions": sorted(rows, key=lambda r: -r[4])}

    # aten ops pass: a TorchDispatchMode sees every aten op dispatched (torch.profiler's event
    # parsing fails on this stack: UnicodeDecodeError in _parse_kineto_results)
    from torch.utils._python_dispatch import TorchDispatchMode

    here = os.path.abspath(__file__)

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.step: list = []

        def __torch_dispatch__(self, func, types, args_=(), kwargs=None):
            f = sys._getframe(1)
            while f is not None and ("/torch/" in f.f_code.co_filename
                                     or f.f_code.co_filename == here):
                f = f.f_back
            site = f"{_short(f.f_code.co_filename)}:{f.f_lineno} {f.f_code.co_name}" if f else "?"
            self.step.append((str(func.overloadpacket.__name__), site))
            return func(*args_, **(kwargs or {}))

    ops: dict[str, dict] = {k: {"steps": 0, "all": {}, "ours": {}, "ours_sites": {}, "sites": {}}
                            for k in ("plain", "crossing")}

    def on_ops(i, step, is_decode, crossing, junctions):
        mode = Ops()
        with mode:
            step()
        if not is_decode():
            return
        o = ops["crossing" if crossing else "plain"]
        o["steps"] += 1
        for name, site in mode.step:
            o["all"][name] = o["all"].get(name, 0) + 1
            o["sites"][site] = o["sites"].get(site, 0) + 1
            if site.startswith(OURS):
                o["ours"][name] = o["ours"].get(name, 0) + 1
                o["ours_sites"][site] = o["ours_sites"].get(site, 0) + 1

    run_pass(args.torch_tokens, on_ops)
    out = {"info": info, "time": timed, "ab": ab, "swapped": [x[4] for x in swaps], "cprofile": prof, "torch_ops": ops}
    for rec in (*timed, *ab):  # ms, to 0.1 us
        rec.update({k: round(v, 4) for k, v in rec.items() if isinstance(v, float)})
    Path(args.out).write_text(json.dumps(out))
    print(f"DECODE_HOST wrote {args.out}: {len(timed)} timed decode steps, cProfile {count}, "
          f"torch {ops['plain']['steps']}+{ops['crossing']['steps']} steps", flush=True)
    from e2e.engines import shutdown_engine

    shutdown_engine(llm)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("row", choices=("off", "upstream", "vllm-align", "exporter"))
    p.add_argument("--out", required=True)
    p.add_argument("--model", default=None, help="default: the e2e fixtures' tiny Qwen3-Next")
    p.add_argument("--reqs", type=int, default=4)
    p.add_argument("--tokens", type=int, default=300)
    p.add_argument("--torch-tokens", type=int, default=40)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.model is None:
        from vllm_hybrid_npu.tools.make_model import default_model_dir

        args.model = str(default_model_dir("qwen3_next"))
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(1 << 31)
    if args.child:
        return _child(args)
    from benchmarks.cuda_serving import row_env

    print(f"decode_host {args.row}: seed {args.seed}", flush=True)
    cmd = [sys.executable, __file__, args.row, "--out", args.out, "--model", args.model, "--reqs",
           str(args.reqs), "--tokens", str(args.tokens), "--torch-tokens", str(args.torch_tokens),
           "--seed", str(args.seed), "--child"]
    env = row_env(args.row)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.call(cmd, cwd=ROOT, env=env)


if __name__ == "__main__":
    sys.exit(main())
