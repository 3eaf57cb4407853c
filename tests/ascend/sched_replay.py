"""vllm-ascend 0.30.0rc2's scheduler patches composed with the plugin's checkpoint policy, on CPU.

Run as a subprocess (vllm-ascend's platform patches rebind vLLM's ``Scheduler`` in place)::

    python tests/ascend/sched_replay.py --seed 123 --policy lean --balance on --out r.json

What runs: vllm-ascend's ``vllm_ascend/patch/platform/patch_mamba_block_aligned_split.py`` (wraps
``Scheduler._mamba_block_aligned_split``) and ``patch_balance_schedule.py`` (rebinds
``vllm.v1.core.sched.scheduler.Scheduler`` to ``BalanceScheduler``, whose ``schedule()`` is
vllm-ascend's copy of vLLM's when balance scheduling is enabled), imported for real; then the
plugin's registry (``vllm_hybrid_npu.patches.apply_patches("npu", stack)``; it installs no
scheduler since placement became vLLM's, issue 20); then the scheduler class vLLM's own
``SchedulerConfig.get_scheduler_cls`` returns (what ``EngineCore`` calls) is wrapped by the lab's
policy (``vllm_hybrid_npu_lab.scheduling.scheduler.scheduler_class``, as the runtime's retired
``checkpoint-policy`` entry did until 2026-11-25) and runs a few requests of a tiny hybrid (GDN + attention, align mode)
through the hit-rate lab's replay (vLLM's real ``Scheduler`` and KV-cache manager; only the
forward pass is stood in). Balance scheduling needs a DP group for its all-gather; with one rank
and no group ``balance_gather`` returns at once (its own early return), the copied
``schedule()`` still runs.

Recorded: the class and MRO, every call of the composed ``_mamba_block_aligned_split``
(request, chunk start, tokens, prefill end), whether vllm-ascend's wrapper ran, the hits per
request.

``--mode junction --order ascend-first|registry-first`` (issue 38): the plugin's junction
split and Mamba managers' hooks (``gdn-chunk-end``, ``gdn-manager-*``, now for the NPU too) with vllm-ascend's scheduler-side platform
patches, applied in either order: ``patch_mamba_block_aligned_split`` (and the
``patch_kv_cache_coordinator`` it imports), ``patch_balance_schedule`` and
``patch_mamba_manager`` (``AscendMambaManager``, rebinding vLLM's ``MambaManager`` name). The
prefill checkpoint block is declared (the lab's ``prefill_checkpoints``, as the plugin's spec
entry declares it on the NPU). Three requests share a prefix of whole blocks ``S`` (the
junction): the first is cold, the second's attention hits ``S`` and its GDN state does not
(``shared_prefix_boundary = S``), the third hits ``S``. Recorded: the junction rule's managers,
which class carries the plugin's manager wrappers, the split's wrapper chain, each request's
prefill chunks and the second request's Mamba block columns. ``--junctions off`` replays the
lab's default target with CUDA's junction export off (``VLLM_HYBRID_NPU_OPTIONS=junctions=off``: the
rule forced off, vLLM's junction stop), the control.

``--mode tailsplit --order ... --tail-split off|on`` (issue 38 item 3): the plugin's
``sub-block-tail-split-off`` entry (the option ``tailsplit``) with the same
vllm-ascend patches, in either order, ``--prefix-match-unit 64`` and the checkpoint declared: a
cold prompt of ``64 < p < 256`` tokens off the 64-token grid (its checkpoint fails vLLM's check by
its column clause alone), then its exact repeat. Recorded: whether the entry applied, the split's
wrapper chain, the scheduler module's ``is_mamba_prefill_checkpoint_valid`` (ours or vLLM's) and
the KV-cache manager module's, each request's prefill chunks and hits.

``--mode second --order ... --second on|off`` (issue 38 item 3): the plugin's
second block (the option ``second``, its rules in the ``gdn-manager-*`` hooks) with the same
vllm-ascend patches, in either order, ``--prefix-match-unit 64``, block 256, the checkpoint
declared, the NPU target (the runtime's engine entry decides, from the NPU stack's exporter
path, in the replay's ``Scheduler.__init__``): a cold prompt A of ``577 <= p <= 640`` tokens
(trace blocks 1, 2: its checkpoint 576 inside its last block), a sharer B of ``769 <= m <= 1023``
tokens sharing trace block 1 (512 tokens), then A again. Recorded: whether the entries applied,
which class carries the manager wrappers, the engine's managers, each step's second blocks on the
``SchedulerOutput``, each request's prefill chunks and hits, the free blocks at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE.parent))
from ascend import ascend_env, upstream  # noqa: E402

from vllm_hybrid_npu.envs import OPTIONS_ENV, with_option  # noqa: E402

ASCEND = "0.30.0rc2"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--policy", default="lean")
    ap.add_argument("--balance", choices=("on", "off"), default="on")
    ap.add_argument("--mode", choices=("policy", "junction", "tailsplit", "second", "resend"),
                    default="policy")
    ap.add_argument("--order", choices=("ascend-first", "registry-first"), default="ascend-first")
    ap.add_argument("--junctions", choices=("on", "off"), default="on")
    ap.add_argument("--tail-split", choices=("on", "off"), default="off")
    ap.add_argument("--second", choices=("on", "off"), default="on")
    ap.add_argument("--control", choices=("none", "coordinator", "keep"), default="none")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    result = {"seed": args.seed, "policy": args.policy, "balance": args.balance, "error": None}
    try:
        {"junction": run_junction, "tailsplit": run_tailsplit, "second": run_second,
         "resend": run_resend}.get(args.mode, run)(args, result)
    except BaseException:
        result["error"] = traceback.format_exc()
    Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    return 0


def _platform_package() -> str:
    """Load vllm-ascend's sdist with the stubs (A2) and make its ``patch.platform`` package
    importable module by module (without its ``__init__``, which applies them all); returns the
    package name."""
    import types

    sys.path.insert(0, str(REPO))
    root = upstream.vllm_ascend_src(ASCEND)
    ascend_env.setup(str(root), "A2")
    plat = "vllm_ascend.patch.platform"
    mod = types.ModuleType(plat)
    mod.__path__ = [str(root / "vllm_ascend/patch/platform")]
    sys.modules[plat] = mod
    return plat


def run(args, result) -> None:
    plat = _platform_package()
    import importlib

    split_mod = importlib.import_module(plat + ".patch_mamba_block_aligned_split")
    balance_mod = importlib.import_module(plat + ".patch_balance_schedule")
    import vllm.v1.core.sched.scheduler as sched_mod

    vllm_scheduler = balance_mod.Scheduler  # vLLM's own class (the module name now binds Balance)
    result["rebound"] = sched_mod.Scheduler is balance_mod.BalanceScheduler
    result["split_is_ascend_wrapper"] = (
        vllm_scheduler.__dict__["_mamba_block_aligned_split"] is split_mod._mamba_block_aligned_split)
    calls = {"ascend_split": 0}

    import functools

    @functools.wraps(split_mod._mamba_block_aligned_split)  # its signature, as vllm-ascend's own
    def counting(self, *a, **k):  # instrumentation around vllm-ascend's wrapper
        calls["ascend_split"] += 1
        return split_mod._mamba_block_aligned_split(self, *a, **k)

    vllm_scheduler._mamba_block_aligned_split = counting

    from vllm_hybrid_npu import patches
    from vllm_hybrid_npu.support import Stack

    # the plugin's registry as an NPU process of this stack applies it (its one split entry,
    # gdn-chunk-end, wraps the split over vllm-ascend's; the class below stays
    # vLLM's / vllm-ascend's until the lab wraps it)
    report = patches.apply_patches("npu", Stack(target="npu", vllm="0.30.0", vllm_ascend=ASCEND))
    result["failed"] = dict(report.failed)

    from vllm_hybrid_npu_lab.model import build_setup
    from vllm_hybrid_npu_lab.presets import TINY_HYBRID
    from vllm_hybrid_npu_lab.replay import replay
    from vllm_hybrid_npu_lab.trace import TraceRequest

    bs = 256
    rng = random.Random(args.seed)
    shared = rng.randint(2, 5)  # trace blocks of 512 tokens shared by every prompt
    rows = []
    for i in range(4):
        # the prompt's last block boundary one block past the shared prefix: upstream's first
        # sight keeps no state at the shared prefix's end, lean's window (the last 2 boundaries)
        # does
        n = shared * 512 + bs + rng.randint(1, bs - 1)
        rows.append((n, rng.randint(1, 4), list(range(1, shared + 1)) + [100 + i]))
    result["rows"] = rows
    reqs = [TraceRequest(10_000.0 * i, n, out, tuple(h)) for i, (n, out, h) in enumerate(rows)]

    setup = build_setup(TINY_HYBRID, kv_cache_bytes=64 << 20,
                        max_model_len=max(r.input_length + r.output_length for r in reqs),
                        block_size=bs, max_num_batched_tokens=8192)
    # vllm-ascend reads its switch from additional_config (_balance_scheduling_enabled)
    setup.vllm_config.additional_config = {
        "scheduler_config": {"enable_balance_scheduling": args.balance == "on"}}
    from vllm_hybrid_npu_lab.scheduling.scheduler import scheduler_class

    chosen = setup.vllm_config.scheduler_config.get_scheduler_cls()
    result["vllm_class"] = f"{chosen.__module__}.{chosen.__qualname__}"
    cls = scheduler_class(args.policy, chosen)  # the lab's policy over the class vLLM chose
    result["scheduler_class"] = f"{cls.__module__}.{cls.__qualname__}"
    result["mro"] = [f"{c.__module__}.{c.__qualname__}" for c in cls.__mro__]
    splits = []

    class Recording(cls):  # records what the composed split returns
        def _mamba_block_aligned_split(self, request, num_new_tokens, *a):
            out = super()._mamba_block_aligned_split(request, num_new_tokens, *a)
            local = a[0] if a else 0
            ext = a[1] if len(a) > 1 else 0
            start = request.num_computed_tokens + local + ext
            splits.append((request.request_id, start, num_new_tokens, out,
                           max(request.num_prompt_tokens, request.num_tokens - 1)))
            return out

        def schedule(self, *a, **k):
            so = super().schedule(*a, **k)
            result.setdefault("balance_enabled", self._balance_enabled)
            return so

    # no carried answers: a longer later prompt with the same full trace blocks would count as a
    # follow-up turn of an earlier one (vllm_hybrid_npu_lab.trace.conversation_parents) and share
    # more than the shared trace blocks
    res = replay(reqs, setup, Recording, carry_outputs=False)
    result["block_size"] = setup.block_size
    result["cached_per_request"] = list(res.cached_per_request)
    result["num_requests"] = len(reqs)
    result["splits"] = splits
    result["ascend_split_calls"] = calls["ascend_split"]
    result["balance_scheduler"] = f"{balance_mod.BalanceScheduler.__module__}.BalanceScheduler"


def _set_option(key: str, value: str) -> None:
    os.environ[OPTIONS_ENV] = with_option(os.environ.get(OPTIONS_ENV, ""), key, value)


def _chain(fn) -> list:
    """``fn`` and the functions it wraps (``__wrapped__``), outermost first: each one's source
    file from its package directory on, and for the plugin's its ``make`` (``functools.wraps``
    copies names and the registry's mark to a wrapper, not the code)."""
    out = []
    while fn is not None:
        code = fn.__code__
        path = Path(code.co_filename).as_posix()
        tail = path[max(path.rfind(p) for p in ("/vllm/", "/vllm_ascend/", "/vllm_hybrid_npu/")) + 1:]
        out.append(tail + (f":{code.co_qualname.split('.<locals>')[0]}" if "vllm_hybrid_npu" in tail else ""))
        fn = getattr(fn, "__wrapped__", None)
    return out


def _apply_in_order(order: str):
    """vllm-ascend's scheduler-side platform patches (``patch_mamba_block_aligned_split``,
    ``patch_mamba_manager``, ``patch_balance_schedule``, in ``vllm_ascend/patch/platform/
    __init__.py``'s order) and the plugin's registry for the NPU stack, in ``order``
    (``ascend-first`` or ``registry-first``); returns the registry's load report."""
    plat = _platform_package()
    import importlib
    from vllm_hybrid_npu import patches
    from vllm_hybrid_npu.support import Stack

    def ascend_patches():
        for name in ("patch_mamba_block_aligned_split", "patch_mamba_manager", "patch_balance_schedule"):
            importlib.import_module(f"{plat}.{name}")

    stack = Stack(target="npu", vllm="0.30.0", vllm_ascend=ASCEND)
    if order == "ascend-first":
        ascend_patches()
        return patches.apply_patches("npu", stack)
    report = patches.apply_patches("npu", stack)
    ascend_patches()
    return report


def run_junction(args, result) -> None:
    report = _apply_in_order(args.order)
    result["failed"] = dict(report.failed)
    result["applied"] = list(report.applied)
    import vllm.v1.core.sched.scheduler as sched_mod
    import vllm.v1.core.single_type_kv_cache_manager as stm
    from vllm.v1.core.sched.scheduler import Scheduler as bound  # vllm-ascend's BalanceScheduler

    from vllm_hybrid_npu.patches import gdn_junction
    from vllm_hybrid_npu.support import Stack
    from vllm_hybrid_npu.patches.registry import is_ours

    ascend_manager = stm.MambaManager  # AscendMambaManager (the module's name rebound)
    vllm_manager = ascend_manager.__mro__[1]
    result["managers_classes"] = [f"{c.__module__}.{c.__qualname__}" for c in (ascend_manager, vllm_manager)]
    result["wrapped_by"] = {
        attr: [c.__qualname__ for c in (ascend_manager, vllm_manager) if is_ours(vars(c).get(attr))]
        for attr in ("get_num_blocks_to_allocate", "allocate_new_blocks")}
    result["split_chain"] = _chain(sched_mod.Scheduler._mamba_block_aligned_split)

    from vllm_hybrid_npu_lab.model import build_setup
    from vllm_hybrid_npu_lab.presets import TINY_HYBRID
    from vllm_hybrid_npu_lab.replay import replay
    from vllm_hybrid_npu_lab.trace import TraceRequest

    rng = random.Random(args.seed)
    shared = rng.randint(1, 3)  # trace blocks of 512 tokens: the junction S = 512 * shared
    setup = build_setup(TINY_HYBRID, kv_cache_bytes=64 << 20, max_model_len=8192, block_size=256,
                        max_num_batched_tokens=8192, prefill_checkpoints=True)
    bs = setup.block_size
    rows = []
    for i in range(3):  # each prompt's checkpoint (its last boundary) one block past S
        n = shared * 512 + bs + rng.randint(1, bs - 1)
        rows.append((n, rng.randint(1, 4), list(range(1, shared + 1)) + [100 + i]))
    result["rows"], result["junction"], result["block_size"] = rows, shared * 512, bs
    reqs = [TraceRequest(10_000.0 * i, n, out, tuple(h)) for i, (n, out, h) in enumerate(rows)]
    chunks: dict[str, list] = {}
    columns: dict[str, list] = {}

    class Recording(setup.vllm_config.scheduler_config.get_scheduler_cls()):
        def schedule(self, *a, **k):
            if args.junctions == "on" and vars(self).get(gdn_junction.RULE, 0) is None:
                # the lab forces the rule off (it models vLLM's junction stop); let the runtime
                # decide, as the engine does at its start (gdn-manager-engine)
                del self.__dict__[gdn_junction.RULE]
                gdn_junction.decide(self, Stack(target="npu", vllm="0.30.0", vllm_ascend=ASCEND))
            so = super().schedule(*a, **k)
            rule = getattr(self, gdn_junction.RULE, None)
            if rule is not None:
                result["rule_managers"] = [f"{type(m).__module__}.{type(m).__qualname__}"
                                           for m in rule.managers]
            for rid, n in so.num_scheduled_tokens.items():
                req = self.requests[rid]
                start = req.num_computed_tokens - n  # schedule() advanced it (_update_after_schedule)
                if start < req.num_prompt_tokens:
                    chunks.setdefault(rid, []).append([start, n])
                    if rid not in columns:
                        columns[rid] = [
                            [i for i, blk in enumerate(m.req_to_blocks.get(rid, ())) if not blk.is_null]
                            for m in self.kv_cache_manager.coordinator.single_type_managers
                            if gdn_junction.is_mamba_manager(m)]
            return so

    if args.junctions == "off":
        # the lab's default target (cuda) replays CUDA's junction export, on by default since
        # 2026-11-29: the control keeps vLLM's junction stop
        _set_option("junctions", "off")
    res = replay(reqs, setup, Recording, carry_outputs=False)
    result["cached_per_request"] = list(res.cached_per_request)
    result["chunks"], result["mamba_columns"] = chunks, columns
    result["scheduler_bound"] = f"{bound.__module__}.{bound.__qualname__}"


def run_tailsplit(args, result) -> None:
    _set_option("tailsplit", args.tail_split)
    report = _apply_in_order(args.order)
    result["failed"], result["applied"] = dict(report.failed), list(report.applied)
    import vllm.v1.core.sched.scheduler as sched_mod
    import vllm.v1.core.single_type_kv_cache_manager as stm
    import vllm.v1.kv_cache_interface as kvi

    from vllm_hybrid_npu.patches.registry import is_ours

    result["split_chain"] = _chain(sched_mod.Scheduler._mamba_block_aligned_split)
    result["scheduler_valid_ours"] = is_ours(sched_mod.is_mamba_prefill_checkpoint_valid)
    result["manager_valid_vllms"] = stm.is_mamba_prefill_checkpoint_valid is kvi.is_mamba_prefill_checkpoint_valid

    from vllm_hybrid_npu_lab.model import build_setup
    from vllm_hybrid_npu_lab.presets import TINY_HYBRID
    from vllm_hybrid_npu_lab.replay import replay
    from vllm_hybrid_npu_lab.trace import TraceRequest
    from vllm_hybrid_npu_lab.upstream_grid import UpstreamSetting

    rng = random.Random(args.seed)
    setup = build_setup(TINY_HYBRID, kv_cache_bytes=64 << 20, max_model_len=8192, block_size=256,
                        max_num_batched_tokens=8192, prefill_checkpoints=True,
                        tune=UpstreamSetting(pmu=64, ckpt=True).tune)
    p = rng.choice([n for n in range(65, setup.block_size) if n % 64])
    result["prompt"], result["block_size"], result["hash_block_size"] = p, setup.block_size, setup.hash_block_size
    reqs = [TraceRequest(10_000.0 * i, p, 4, (1,)) for i in range(2)]
    chunks: dict[str, list] = {}

    class Recording(setup.vllm_config.scheduler_config.get_scheduler_cls()):
        def schedule(self, *a, **k):
            so = super().schedule(*a, **k)
            _record_prefill_chunks(self, so, chunks)
            return so

    res = replay(reqs, setup, Recording, carry_outputs=False, target="npu")
    result["cached_per_request"], result["chunks"] = list(res.cached_per_request), chunks


def _record_prefill_chunks(scheduler, output, chunks: dict) -> None:
    """Append each prompt chunk of the step ``output`` (a ``SchedulerOutput`` that
    ``scheduler.schedule()`` just returned) to ``chunks[request id]`` as ``[start, tokens]``."""
    for rid, n in output.num_scheduled_tokens.items():
        req = scheduler.requests[rid]
        start = req.num_computed_tokens - n  # schedule() advanced it (_update_after_schedule)
        if start < req.num_prompt_tokens:
            chunks.setdefault(rid, []).append([start, n])


def run_second(args, result) -> None:
    _set_option("second", args.second)
    report = _apply_in_order(args.order)
    result["failed"], result["applied"] = dict(report.failed), list(report.applied)
    import vllm.v1.core.single_type_kv_cache_manager as stm

    from vllm_hybrid_npu.patches import gdn_second_checkpoint as S
    from vllm_hybrid_npu.patches import gdn_step_checkpoints as P
    from vllm_hybrid_npu.patches.registry import is_ours

    ascend_manager = stm.MambaManager  # AscendMambaManager (the module's name rebound)
    vllm_manager = ascend_manager.__mro__[1]
    result["managers_classes"] = [f"{c.__module__}.{c.__qualname__}" for c in (ascend_manager, vllm_manager)]
    attrs = ("allocate_new_blocks", "_cache_partial_tail_block", "remove_skipped_blocks",
             "pop_blocks_for_free")
    result["wrapped_by"] = {
        attr: [c.__qualname__ for c in (ascend_manager, vllm_manager) if is_ours(vars(c).get(attr))]
        for attr in attrs}

    from vllm_hybrid_npu_lab.model import build_setup
    from vllm_hybrid_npu_lab.presets import TINY_HYBRID
    from vllm_hybrid_npu_lab.replay import replay
    from vllm_hybrid_npu_lab.trace import TraceRequest
    from vllm_hybrid_npu_lab.upstream_grid import UpstreamSetting

    rng = random.Random(args.seed)
    setup = build_setup(TINY_HYBRID, kv_cache_bytes=64 << 20, max_model_len=8192, block_size=256,
                        max_num_batched_tokens=8192, prefill_checkpoints=True,
                        tune=UpstreamSetting(pmu=64, ckpt=True).tune)
    p, m = rng.randrange(577, 641), rng.randrange(769, 1024)
    result["prompts"] = [p, m, p]
    result["block_size"], result["hash_block_size"] = setup.block_size, setup.hash_block_size
    reqs = [TraceRequest(10_000.0 * i, n, 4, h) for i, (n, h) in enumerate(
        [(p, (1, 2)), (m, (1, 3)), (p, (1, 2))])]
    chunks: dict[str, list] = {}
    payloads: list = []
    seen: dict = {}

    class Recording(setup.vllm_config.scheduler_config.get_scheduler_cls()):
        def schedule(self, *a, **k):
            seen["scheduler"] = self
            result["engine_managers"] = [
                f"{type(x).__module__}.{type(x).__qualname__}"
                for x in vars(self.kv_cache_manager).get(S.MANAGERS) or ()]
            so = super().schedule(*a, **k)
            result["planned_groups"] = len(vars(self).get(P.MANAGERS) or ())
            if (pay := getattr(so, P.ATTR, None)) is not None:
                payloads.append({str(g): {r: [list(e) for e in v] for r, v in x.items()}
                                 for g, x in pay.items()})
            _record_prefill_chunks(self, so, chunks)
            return so

    res = replay(reqs, setup, Recording, carry_outputs=False, target="npu")
    pool = seen["scheduler"].kv_cache_manager.block_pool
    result["cached_per_request"] = list(res.cached_per_request)
    result["chunks"], result["payloads"] = chunks, payloads
    result["free_blocks"], result["pool_blocks"] = pool.get_num_free_blocks(), pool.num_gpu_blocks
    result["extra_left"] = sum(len(vars(x).get(S.EXTRA, {})) for x in
                               seen["scheduler"].kv_cache_manager.coordinator.single_type_managers)


def run_resend(args, result) -> None:
    """Prompts ending on the 64-token grid, each with its checkpoint ``n - 64`` inside a block,
    then each resent, on vLLM's scheduler with vllm-ascend's hybrid coordinator
    (``patch_kv_cache_coordinator``, imported by ``patch_mamba_block_aligned_split``: its
    ``get_kv_cache_coordinator`` builds ``AscendHybridKVCacheCoordinator``, whose ``__init__``
    does not run vLLM's) and the plugin's registry in ``--order``. ``--control coordinator``:
    ``resend-tail-declared`` marks the managers in ``HybridKVCacheCoordinator.__init__`` instead
    (where it did before), ``keep``: the tail wrapper without its decode-step keep
    (``resend_tail.kept`` always False)."""
    import dataclasses
    import functools

    from vllm_hybrid_npu.patches import resend_tail

    if args.control == "coordinator":
        def on_coordinator(upstream, stack):
            @functools.wraps(upstream)
            def __init__(self, *a, **k):
                upstream(self, *a, **k)
                resend_tail.mark(self.single_type_managers)
            return __init__

        resend_tail.PATCHES[:] = [
            dataclasses.replace(p, module="vllm.v1.core.kv_cache_coordinator",
                                qualname="HybridKVCacheCoordinator.__init__", make=on_coordinator)
            if p.name == "resend-tail-declared" else p for p in resend_tail.PATCHES]
    elif args.control == "keep":
        resend_tail.kept = lambda block, end: False
    report = _apply_in_order(args.order)
    result["failed"], result["applied"] = dict(report.failed), list(report.applied)

    from vllm_hybrid_npu_lab.model import build_setup
    from vllm_hybrid_npu_lab.presets import TINY_HYBRID
    from vllm_hybrid_npu_lab.replay import replay
    from vllm_hybrid_npu_lab.trace import TraceRequest
    from vllm_hybrid_npu_lab.upstream_grid import UpstreamSetting

    rng = random.Random(args.seed)
    setup = build_setup(TINY_HYBRID, kv_cache_bytes=64 << 20, max_model_len=8192, block_size=256,
                        max_num_batched_tokens=8192, prefill_checkpoints=True,
                        tune=UpstreamSetting(pmu=64, ckpt=True).tune)
    bs = setup.block_size
    # on the 64-token grid, the checkpoint n - 64 inside a block (not on a block boundary); at
    # least two output tokens: a decode step after the prefill
    grid = [x for x in range(bs + 64, 8 * bs + 1, 64) if x % bs in (128, 192)]
    rows = [(rng.choice(grid), rng.randint(2, 6)) for _ in range(3)]
    result["rows"], result["block_size"], result["hash_block_size"] = rows, bs, setup.hash_block_size
    reqs = []
    for k, (n, out) in enumerate(rows):  # each prompt its own trace blocks (512 tokens each)
        ids = tuple(100 * (k + 1) + j for j in range(-(-n // 512)))
        reqs += [TraceRequest(10_000.0 * len(reqs), n, out, ids),
                 TraceRequest(10_000.0 * (len(reqs) + 1), n, out, ids)]
    seen: dict = {}

    class Recording(setup.vllm_config.scheduler_config.get_scheduler_cls()):
        def schedule(self, *a, **k):
            coordinator = self.kv_cache_manager.coordinator
            seen["coordinator"] = f"{type(coordinator).__module__}.{type(coordinator).__qualname__}"
            seen["marked"] = [len(getattr(m, resend_tail.FLAG, ())) for m in coordinator.single_type_managers]
            return super().schedule(*a, **k)

    res = replay(reqs, setup, Recording, carry_outputs=False, target="npu")
    result["cached_per_request"] = list(res.cached_per_request)
    result["coordinator"], result["marked"] = seen["coordinator"], seen["marked"]


if __name__ == "__main__":
    sys.exit(main())
