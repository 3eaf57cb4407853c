"""The replay loop: trace requests through a real vLLM scheduler on a simulated clock.

Only the forward pass is replaced: after each ``Scheduler.schedule()`` a
``ModelRunnerOutput`` with one sampled token per request that finished its prompt (none for a
partial prefill chunk, as vLLM's model runner discards those) goes to
``Scheduler.update_from_output()``. Everything else (block hashing, prefix-cache lookup, the
hybrid KV-cache coordinator, align-mode chunk splitting, allocation, eviction, preemption) is
vLLM's own code, as in ``EngineCore.step`` (vllm/v1/engine/core.py, vLLM 0.30).

Simulated clock: a step takes ``step_ms + scheduled_tokens / tokens_per_s`` seconds; requests
are admitted in trace order once their arrival time (trace ``timestamp``) has passed; when
nothing is running the clock jumps to the next arrival (or the next host transfer completion).
Wall-clock time is never read for the replay's decisions, so results depend only on the inputs.

Generated tokens: request ``i``'s ``k``-th output token is ``output_token(i, k)`` (distinct per
request and position). With ``carry_outputs`` (the default), a request whose prompt extends an
earlier one (:func:`vllm_hybrid_npu_lab.trace.conversation_parents`) gets the earlier request's
prompt followed by its generated tokens where a chat carries the answer, so states kept where
decode crossed a block boundary can hit (:func:`vllm_hybrid_npu_lab.trace.carried_prompts`).

Host tier (``setup.host_cache_bytes > 0``): the scheduler is built with vLLM's
``OffloadingConnector`` (the scheduler side a server runs, vLLM 0.30
``vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py``); the worker side is
:class:`vllm_hybrid_npu_lab.host_tier.SimulatedOffloadWorker`, which completes the connector's
load and store jobs after a bandwidth + latency model and reports them back through
``ModelRunnerOutput.kv_connector_output`` the way the real worker does.
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from vllm_hybrid_npu_lab.trace import TraceRequest

#: at most this many arrived requests wait inside the scheduler; later arrivals wait outside
#: (in arrival order) so memory stays bounded. With FCFS scheduling the scheduler never looks
#: past its first unschedulable waiting request, so this does not change its decisions unless
#: more than this many requests could start in one step.
MAX_WAITING_IN_SCHEDULER = 1024

#: output token id base: above every prompt token id the trace mapping produces for < 2**21
#: hash ids, so outputs never collide with prompt tokens
_OUTPUT_TOKEN = 1 << 30
#: output positions per request in the output token id space (outputs are shorter than this)
_OUTPUT_SPAN = 1 << 20


def output_token(idx: int, k: int) -> int:
    """Token id of request ``idx``'s ``k``-th generated token (int; distinct for every pair)."""
    return _OUTPUT_TOKEN + idx * _OUTPUT_SPAN + k


@dataclass
class ReplayResult:
    """Numbers of one replay (tokens are prompt tokens unless said otherwise).

    ``token_hit_rate`` = cached_prompt_tokens / prompt_tokens; ``request_hit_rate`` = share of
    requests with at least one cached prompt token; ``cached_prompt_tokens`` = sum over requests of
    ``NewRequestData.num_computed_tokens`` at first scheduling (the prefix-cache hit); ``computed_prompt_tokens``
    = prompt tokens actually scheduled (includes recomputation after preemption);
    ``cached_states`` / ``cached_state_bytes``: GDN states held in the prefix cache at the end
    of the replay (one state = all GDN layers at one block boundary; bytes on one TP rank);
    ``block_size`` (tokens), ``num_blocks`` (KV pool), ``steps``, ``preemptions``,
    ``sim_time_s`` (simulated seconds), ``wall_s`` (measured, informative only).
    """

    token_hit_rate: float
    request_hit_rate: float
    num_requests: int
    prompt_tokens: int
    cached_prompt_tokens: int
    computed_prompt_tokens: int
    cached_states: int
    cached_state_bytes: int
    block_size: int
    num_blocks: int
    steps: int
    preemptions: int
    sim_time_s: float
    wall_s: float
    #: load: offered prompt tokens per second (prompt tokens / trace span), scheduled tokens per
    #: simulated second, share of simulated time with a non-empty step, mean seconds from arrival
    #: to first scheduling
    offered_prompt_tokens_per_s: float = 0.0
    served_tokens_per_s: float = 0.0
    busy_fraction: float = 0.0
    mean_wait_s: float = 0.0
    #: requests whose prompt carried an earlier request's prompt + generated tokens
    carried_requests: int = 0
    #: hits by tier (prompt tokens): device prefix cache, host tier (OffloadingConnector loads)
    device_cached_prompt_tokens: int = 0
    host_cached_prompt_tokens: int = 0
    #: host tier transfers: bytes and simulated seconds of loads/stores, seconds requests waited
    #: for their loads (arrival of the load job to its completion, summed)
    host: dict[str, Any] = field(default_factory=dict)
    #: missed prompt tokens by reason (``vllm_hybrid_npu.core.miss_reasons.MissTracker``
    #: totals), ``None`` when the runtime has no miss classifier (issue 15 item 5)
    miss_reasons: dict[str, int] | None = None
    #: the KV-cache manager's prefix-match unit (tokens; ``--prefix-match-unit``, else the block)
    hash_block_size: int = 0
    #: mean steps that scheduled prompt tokens of a request (its prefill chunks, recomputation
    #: after preemption included), and the mean of those beyond the fewest the request's uncached
    #: prompt tokens need (``ceil(uncached / --max-num-batched-tokens)``): vLLM's block-aligned
    #: split of a cold prompt is one extra step, the exporter's prompts take none (a request
    #: resumed after a preemption that finds more of its prompt cached than it had computed counts
    #: its fewest steps from there: :class:`vllm_hybrid_npu_lab.step_reasons.PrefillLedger`)
    prefill_steps_per_prompt: float = 0.0
    extra_prefill_steps_per_prompt: float = 0.0
    #: ``extra_prefill_steps_per_prompt`` by reason (:data:`vllm_hybrid_npu_lab.step_reasons.REASONS`,
    #: every name, summing to it): which scheduler decision ended each extra step's chunk
    extra_prefill_steps_by_reason: dict[str, float] = field(default_factory=dict)
    #: ``--target npu``: the counters of :mod:`vllm_hybrid_npu_lab.ascend_scheduler`'s model of
    #: vllm-ascend's scheduler (``kept_whole``: chunks a KV consumer kept whole that vLLM's split
    #: would have cut; ``extra_blocks``: blocks added for synchronous external hits); empty on CUDA
    ascend_model: dict[str, int] = field(default_factory=dict)
    #: prompt tokens found cached at first scheduling, per request in trace order (not in JSON)
    cached_per_request: list[int] = field(default_factory=list, repr=False)

    #: host-tier part of ``cached_per_request`` (not in JSON)
    host_per_request: list[int] = field(default_factory=list, repr=False)
    #: missed prompt tokens by reason per request in trace order (``MissTracker.on_admit``'s
    #: counts; empty without a miss classifier; not in JSON)
    miss_per_request: list[dict[str, int]] = field(default_factory=list, repr=False)

    def to_dict(self) -> dict[str, Any]:
        """Return the fields as a JSON-ready dict (without the per-request lists)."""
        d = asdict(self)
        del d["cached_per_request"]
        del d["host_per_request"]
        del d["miss_per_request"]
        return d


def _count_cached_states(scheduler: Any) -> int:
    from vllm.v1.core.kv_cache_utils import get_group_id
    from vllm.v1.kv_cache_interface import MambaSpec

    groups = scheduler.kv_cache_manager.kv_cache_config.kv_cache_groups
    mamba = [i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, MambaSpec)]
    if not mamba:
        return 0
    first = mamba[0]
    pool = scheduler.kv_cache_manager.block_pool
    count = 0
    for block in pool.blocks:
        keys = set(pool.cached_block_hashes_by_block.get(block.block_id, ()))
        if block.block_hash is not None:
            keys.add(block.block_hash)
        count += sum(1 for key in keys if get_group_id(key) == first)
    return count


def _miss_tracker(setup: Any, host_tier: bool, scheduler: Any = None) -> Any:
    """A ``MissTracker`` of the runtime's miss classifier (``vllm_hybrid_npu.core.miss_reasons``,
    issue 15 item 5) for this replay, or ``None`` while that module is not installed or prefix
    caching is off (nothing is looked up, so nothing is missed for a reason). Under EAGLE/MTP's
    block drop on ``scheduler`` (vLLM's ``Scheduler``), the drafter's drop unit as the runtime's
    step counters read it (``drafter_drop_unit``)."""
    if not setup.vllm_config.cache_config.enable_prefix_caching:
        return None
    try:
        from vllm_hybrid_npu.core.miss_reasons import MissTracker
        from vllm_hybrid_npu.patches.vllm_v1_core_sched_scheduler import drafter_drop_unit
    except ImportError:
        return None
    return MissTracker(setup.hash_block_size, host_tier=host_tier, block_size=setup.block_size,
                       drop_tokens=drafter_drop_unit(scheduler, setup.block_size,
                                                     setup.hash_block_size))


#: the exporter paths :func:`replay` models (its ``target``)
TARGETS = ("cuda", "npu", "cpu")


def junctions_modelled(target: str, connector: bool) -> bool:
    """Whether :func:`replay` binds the runtime's junction entries for ``target`` (a replay with
    a KV connector, ``connector``, or without), as the runtime's ``junctions_off`` decides on
    vLLM 0.30: ``npu`` without a KV connector (vllm-ascend's paths turn them off beside one);
    ``cuda`` where the option ``junctions`` is on (the default; read from this
    process's environment, so ``off`` replays CUDA with vLLM's stops), beside a KV connector too,
    as the runtime on the V2 runner. Raises ValueError for a bad value of that option."""
    if target == "npu":
        return not connector
    if target == "cpu":  # the runtime's rule for its CPU path: on, beside a KV connector too
        from vllm_hybrid_npu.patches.gdn_prefill_checkpoint import junctions_off

        return junctions_off(None, "cpu") is None
    from vllm_hybrid_npu.patches.gdn_prefill_checkpoint import cuda_junctions_off

    return cuda_junctions_off() is None
#: ``--target``'s help in ``hitrate`` and ``advise``
TARGET_HELP = ("the GDN prefill-checkpoint exporter path modelled: cuda (the one-pass Triton/FLA "
               "export on vLLM 0.30's V2 runner, default: junction states and budget chunk ends "
               "exported inside the step, also beside a host tier; a chunk started off the "
               "64-token grid still stops at the next block boundary; with "
               "VLLM_HYBRID_NPU_OPTIONS=junctions=off in the environment, vLLM's stops) or npu "
               "(vllm-ascend 0.30.0rc2's prefill paths as the plugin runs them on vLLM 0.30, "
               "replayed on CPU only: the same exports; off beside a host tier, whose KV connector "
               "turns them off there; with vllm-ascend's own scheduler changes for every setting: "
               "beside a host tier a request with a computed prefix runs its chunk whole) or cpu "
               "(vLLM's CPU GDN path as the plugin runs it: the same exports, also beside a host "
               "tier, no mid-block stop); under --speculative-tokens checkpoints are declared "
               "on cpu (vLLM 0.30, not on a CPU with AMX tiles) and npu (vllm-ascend 0.30.0rc2 "
               "over vLLM 0.30), not on cuda")

#: ``--speculative-tokens``' help in ``hitrate`` and ``advise``
SPECULATIVE_HELP = ("replay an MTP drafter with N speculative tokens (vLLM's qwen3_next_mtp, "
                    "rewritten to mtp; 0 = none, default): vLLM's scheduler drops one "
                    "prefix-match unit of each hit (its EAGLE block drop) and reserves the "
                    "lookahead slots; the plugin's checkpoint is declared where the runtime "
                    "declares it under MTP (--target cpu and npu), on cuda vLLM's split is kept")


def add_speculative_argument(parser: Any) -> None:
    """The ``--speculative-tokens`` option of ``hitrate`` and ``advise``."""
    parser.add_argument("--speculative-tokens", type=int, default=0, metavar="N",
                        help=SPECULATIVE_HELP)


def check_speculative(n: int) -> None:
    """Raise ValueError naming ``--speculative-tokens`` for a negative ``n``."""
    if n < 0:
        raise ValueError(f"--speculative-tokens must be >= 0 (0 = no drafter), got {n}")


def replay(
    requests: list[TraceRequest],
    setup: Any,
    scheduler_class: type,
    *,
    step_ms: float = 5.0,
    tokens_per_s: float = 40000.0,
    carry_outputs: bool = True,
    link: Any = None,
    progress: Callable[[int, int, float], None] | None = None,
    on_admit: Callable[[Any, Any], None] | None = None,
    target: str = "cuda",
) -> ReplayResult:
    """Replay ``requests`` through ``scheduler_class`` built on ``setup`` and return the numbers.

    Args:
        requests: trace requests in arrival order.
        setup: a :class:`vllm_hybrid_npu_lab.model.Setup` built for this replay alone (with
            ``host_cache_bytes > 0`` its ``vllm_config`` carries the OffloadingConnector).
        scheduler_class: vLLM's ``Scheduler`` or a subclass (a policy's ``scheduler_class()``).
        step_ms: simulated fixed cost of one engine step, milliseconds.
        tokens_per_s: simulated throughput, scheduled tokens per second.
        carry_outputs: put an earlier request's generated tokens into the prompts that extend it
            (see module docstring).
        link: a :class:`vllm_hybrid_npu_lab.host_tier.HostLink` (bandwidth/latency of the host
            tier); default ``HostLink()`` when the setup has a host tier.
        progress: called as ``progress(finished, total, sim_time_s)`` every few hundred steps.
        target: the exporter path modelled (:data:`TARGETS`): ``cuda`` (the one-pass export on
            vLLM 0.30's V2 runner), ``npu`` (vllm-ascend's paths as the runtime runs them on
            vLLM 0.30) or ``cpu`` (vLLM's CPU GDN path, no mid-block stop), the runtime's junction entries bound where :func:`junctions_modelled`
            says (:func:`vllm_hybrid_npu_lab.exporter.apply_junction_entries`). Settings without
            the exporter replay the same on both.
        on_admit: called as ``on_admit(scheduler, request)`` when a request is first scheduled
            (after ``schedule()`` returned, before the step's output): an observer, e.g. of what
            the host tier holds for the request's prefix (:mod:`.host_breakdown`).

    Raises ``ValueError`` for a ``target`` outside :data:`TARGETS`; ``RuntimeError`` if the
    scheduler stops making progress (a request that can never be
    scheduled under the KV budget).
    """
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.outputs import ModelRunnerOutput

    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    # vLLM 0.34's output has no req_id_to_index (its scheduler indexes by req_ids' order)
    with_index = "req_id_to_index" in getattr(ModelRunnerOutput, "__dataclass_fields__", {})

    from vllm_hybrid_npu_lab.step_reasons import PrefillLedger, SplitRecorder, chunk_reason, per_prompt
    from vllm_hybrid_npu_lab.trace import carried_prompts

    t0 = time.perf_counter()
    vllm_config = setup.vllm_config
    hash_fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    block_hasher = get_request_block_hasher(setup.hash_block_size, hash_fn)
    sched = scheduler_class(
        vllm_config=vllm_config,
        kv_cache_config=setup.kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=setup.scheduler_block_size,
        hash_block_size=setup.hash_block_size,
        log_stats=False,
    )
    # the runtime's junction entries (vllm_hybrid_npu.patches.gdn_junction) export a shared-prefix
    # junction's state inside the step where junctions_modelled says the runtime does; elsewhere,
    # also in a process where the runtime's registry is applied, vLLM's junction stop stays
    from vllm_hybrid_npu.patches.gdn_junction import RULE
    from vllm_hybrid_npu_lab.exporter import apply_junction_entries

    if target not in TARGETS:
        raise ValueError(f"replay: target {target!r}: one of {', '.join(TARGETS)}")
    if not (junctions_modelled(target, getattr(sched, "connector", None) is not None)
            and apply_junction_entries(sched, target)):
        setattr(sched, RULE, None)
        setattr(sched.kv_cache_manager, RULE, None)
        # nor a second checkpoint block (second=on), as the runtime's engine entry decides
        # (gdn-manager-engine: none where the step exports no junction state)
        from vllm_hybrid_npu.patches.gdn_second_checkpoint import MANAGERS

        vars(sched.kv_cache_manager)[MANAGERS] = ()
    # vllm-ascend's own scheduler changes on the NPU, outermost (every setting): a KV consumer's
    # chunk stays whole after a computed prefix, one block more for a synchronous external hit
    ascend_stats: dict[str, int] = {}
    if target == "npu":
        from vllm_hybrid_npu_lab import ascend_scheduler

        ascend_stats = ascend_scheduler.apply(sched)
    worker = None
    if getattr(sched, "connector", None) is not None:
        from vllm_hybrid_npu_lab.host_tier import HostLink, SimulatedOffloadWorker

        worker = SimulatedOffloadWorker(setup.kv_cache_config, link or HostLink())

    recorder = SplitRecorder(sched)
    tracker = _miss_tracker(setup, host_tier=worker is not None, scheduler=sched)
    n = len(requests)
    prompts, parents = carried_prompts(
        requests, lambda i, k: output_token(i, k), carry=carry_outputs
    )
    live: dict[str, Any] = {}
    first_hit: dict[str, int] = {}
    first_host: dict[str, int] = {}
    per_request = [0] * n
    host_per_request = [0] * n
    miss_per_request: list[dict[str, int]] = [{} for _ in range(n)] if tracker is not None else []
    next_idx = 0
    finished = 0
    clock = 0.0
    busy = 0.0
    wait_total = 0.0
    steps = idle_steps = 0
    prompt_tokens = cached_tokens = computed_tokens = hit_requests = preemptions = 0
    scheduled_total = 0
    ledger = PrefillLedger(vllm_config.scheduler_config.max_num_batched_tokens)
    prefill_steps_total = extra_steps_total = 0
    extra_by_reason: dict[str, int] = {}

    def admit(idx: int) -> None:
        tr = requests[idx]
        rid = str(idx)
        req = Request(
            request_id=rid,
            prompt_token_ids=prompts[idx],
            sampling_params=SamplingParams(max_tokens=tr.output_length, ignore_eos=True),
            pooling_params=None,
            arrival_time=tr.timestamp_ms / 1000.0,
            block_hasher=block_hasher,
        )
        live[rid] = req
        sched.add_request(req)

    while finished < n:
        while (
            next_idx < n
            and requests[next_idx].timestamp_ms / 1000.0 <= clock
            and len(sched.waiting) < MAX_WAITING_IN_SCHEDULER
        ):
            admit(next_idx)
            next_idx += 1
        if not live:
            clock = max(clock, requests[next_idx].timestamp_ms / 1000.0)
            continue
        recorder.begin_step()
        out = sched.schedule()
        total = out.total_num_scheduled_tokens
        req_ids = list(out.num_scheduled_tokens)
        for new in out.scheduled_new_reqs:
            # First scheduling: the tokens found cached (device prefix cache + host tier), as
            # vLLM's PrefillStats records them (num_local/num_external_cached_tokens).
            if new.req_id not in first_hit:
                first_hit[new.req_id] = new.num_computed_tokens
                wait_total += clock - requests[int(new.req_id)].timestamp_ms / 1000.0
                if tracker is not None:
                    r = live[new.req_id]
                    miss_per_request[int(new.req_id)] = tracker.on_admit(
                        r.block_hashes, r.num_prompt_tokens, new.num_computed_tokens,
                        getattr(r, "shared_prefix_boundary", 0) or 0)
                if on_admit is not None:
                    on_admit(sched, live[new.req_id])
        sampled: list[list[int]] = []
        for rid in req_ids:
            req = live[rid]
            k = out.num_scheduled_tokens[rid]
            done_now = req.num_computed_tokens
            p = req.num_prompt_tokens
            computed_tokens += max(0, min(done_now, p) - min(done_now - k, p))
            start = done_now - k
            if start < p:  # a prefill chunk; its reason is asked for only when it is extra
                ledger.chunk(rid, start, done_now, p, lambda: chunk_reason(
                    start, done_now, req.num_tokens, p, recorder.settings,
                    recorder.decision(rid, start, k)))
            sampled.append(
                [output_token(int(rid), req.num_output_tokens)] if done_now >= req.num_tokens else []
            )
        step_s = step_ms / 1000.0 + total / tokens_per_s if total else 0.0
        kv_out = None
        if worker is not None:
            step_s += worker.submit(out.kv_connector_metadata, clock)
            kv_out = worker.collect(clock + step_s)
        mro = ModelRunnerOutput(
            req_ids=req_ids,
            sampled_token_ids=sampled,
            kv_connector_output=kv_out,
            **({"req_id_to_index": {rid: i for i, rid in enumerate(req_ids)}} if with_index else {}),
        )
        if worker is not None:
            # the host-tier share of a request's hit: recorded by vLLM at its lookup
            for rid in req_ids:
                if rid not in first_host and rid in live:
                    stats = live[rid].prefill_stats
                    first_host[rid] = stats.num_external_cached_tokens if stats is not None else 0
        sched.update_from_output(out, mro)
        steps += 1
        scheduled_total += total
        if total == 0:
            clock += step_s  # a flush the worker waited for, if any
            idle_steps += 1
            nxt = requests[next_idx].timestamp_ms / 1000.0 if next_idx < n else None
            pending = worker.next_completion() if worker is not None else None
            targets = [t for t in (nxt, pending) if t is not None and t > clock]
            if targets:
                clock = min(targets)
                idle_steps = 0
            elif pending is not None:
                clock += 1e-6
            elif idle_steps > 1000:
                raise RuntimeError(
                    "the scheduler made no progress for 1000 steps; the KV budget "
                    "(--kv-cache-gib) is probably too small for the longest request"
                )
        else:
            idle_steps = 0
            clock += step_s
            busy += step_s
        for rid in [r for r, req in live.items() if req.is_finished()]:
            req = live.pop(rid)
            if tracker is not None:
                tracker.on_cached(req.block_hashes, req.num_computed_tokens,
                                  num_prompt_tokens=req.num_prompt_tokens)
            finished += 1
            prompt_tokens += req.num_prompt_tokens
            hit = first_hit.pop(rid)
            chunks, extra = ledger.finish(rid)
            prefill_steps_total += chunks
            extra_steps_total += sum(extra.values())
            for why, count in extra.items():
                extra_by_reason[why] = extra_by_reason.get(why, 0) + count
            per_request[int(rid)] = hit
            host_per_request[int(rid)] = min(hit, first_host.pop(rid, 0))
            cached_tokens += hit
            hit_requests += hit > 0
            preemptions += req.num_preemptions
        if progress is not None and steps % 500 == 0:
            progress(finished, n, clock)
    if progress is not None:
        progress(finished, n, clock)
    states = _count_cached_states(sched)
    span = (requests[-1].timestamp_ms - requests[0].timestamp_ms) / 1000.0
    host_tokens = sum(host_per_request)
    return ReplayResult(
        token_hit_rate=cached_tokens / prompt_tokens,
        request_hit_rate=hit_requests / n,
        num_requests=n,
        prompt_tokens=prompt_tokens,
        cached_prompt_tokens=cached_tokens,
        computed_prompt_tokens=computed_tokens,
        cached_states=states,
        cached_state_bytes=states * setup.state_bytes,
        block_size=setup.block_size,
        num_blocks=setup.num_blocks,
        steps=steps,
        preemptions=preemptions,
        sim_time_s=clock,
        wall_s=time.perf_counter() - t0,
        offered_prompt_tokens_per_s=prompt_tokens / span if span > 0 else 0.0,
        served_tokens_per_s=scheduled_total / clock if clock > 0 else 0.0,
        busy_fraction=busy / clock if clock > 0 else 0.0,
        mean_wait_s=wait_total / n,
        carried_requests=sum(p is not None for p in parents),
        device_cached_prompt_tokens=cached_tokens - host_tokens,
        host_cached_prompt_tokens=host_tokens,
        host=worker.summary() if worker is not None else {},
        miss_reasons=dict(tracker.totals) if tracker is not None else None,
        hash_block_size=setup.hash_block_size,
        prefill_steps_per_prompt=prefill_steps_total / n,
        extra_prefill_steps_per_prompt=extra_steps_total / n,
        extra_prefill_steps_by_reason=per_prompt(extra_by_reason, n),
        ascend_model=dict(ascend_stats),
        cached_per_request=per_request,
        host_per_request=host_per_request,
        miss_per_request=miss_per_request,
    )


def stderr_progress(label: str) -> Callable[[int, int, float], None]:
    """Return a progress callback printing ``label: finished/total`` on one stderr line."""

    def show(done: int, total: int, sim_s: float) -> None:
        end = "\n" if done >= total else ""
        print(f"\r{label}: {done}/{total} requests, simulated {sim_s:,.0f} s", end=end,
              file=sys.stderr, flush=True)

    return show
