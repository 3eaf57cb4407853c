"""The replay loop: trace requests through a real vLLM scheduler on a simulated clock.

Only the forward pass is replaced: after each ``Scheduler.schedule()`` a
``ModelRunnerOutput`` with one sampled token per request that finished its prompt (none for a
partial prefill chunk, as vLLM's model runner discards those) goes to
``Scheduler.update_from_output()``. Everything else (block hashing, prefix-cache lookup, the
hybrid KV-cache coordinator, align-mode chunk splitting, allocation, eviction, preemption) is
vLLM's own code, as in ``EngineCore.step`` (vllm/v1/engine/core.py, vLLM 0.30).

Simulated clock: a step takes ``step_ms + scheduled_tokens / tokens_per_s`` seconds; requests
are admitted in trace order once their arrival time (trace ``timestamp``) has passed; when
nothing is running the clock jumps to the next arrival. Wall-clock time is never read for the
replay's decisions, so results depend only on the inputs.
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from vllm_hybrid_npu_lab.trace import TraceRequest, prompt_token_ids

#: at most this many arrived requests wait inside the scheduler; later arrivals wait outside
#: (in arrival order) so memory stays bounded. With FCFS scheduling the scheduler never looks
#: past its first unschedulable waiting request, so this does not change its decisions unless
#: more than this many requests could start in one step.
MAX_WAITING_IN_SCHEDULER = 1024

#: output token id base: above every prompt token id the trace mapping produces for < 2**21
#: hash ids, so outputs never collide with prompt tokens
_OUTPUT_TOKEN = 1 << 30


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
    #: prompt tokens found cached at first scheduling, per request in trace order (not in JSON)
    cached_per_request: list[int] = field(default_factory=list, repr=False)

    def to_dict(self) -> dict[str, Any]:
        """Return the fields as a JSON-ready dict (without ``cached_per_request``)."""
        d = asdict(self)
        del d["cached_per_request"]
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


def replay(
    requests: list[TraceRequest],
    setup: Any,
    scheduler_class: type,
    *,
    step_ms: float = 5.0,
    tokens_per_s: float = 40000.0,
    progress: Callable[[int, int, float], None] | None = None,
) -> ReplayResult:
    """Replay ``requests`` through ``scheduler_class`` built on ``setup`` and return the numbers.

    Args:
        requests: trace requests in arrival order.
        setup: a :class:`vllm_hybrid_npu_lab.model.Setup` built for this replay alone.
        scheduler_class: vLLM's ``Scheduler`` or a subclass (a policy's ``scheduler_class()``).
        step_ms: simulated fixed cost of one engine step, milliseconds.
        tokens_per_s: simulated throughput, scheduled tokens per second.
        progress: called as ``progress(finished, total, sim_time_s)`` every few hundred steps.

    Raises ``RuntimeError`` if the scheduler stops making progress (a request that can never be
    scheduled under the KV budget).
    """
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

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

    n = len(requests)
    live: dict[str, Any] = {}
    out_token: dict[str, int] = {}
    first_hit: dict[str, int] = {}
    per_request = [0] * len(requests)
    next_idx = 0
    finished = 0
    clock = 0.0
    steps = idle_steps = 0
    prompt_tokens = cached_tokens = computed_tokens = hit_requests = preemptions = 0

    def admit(idx: int) -> None:
        tr = requests[idx]
        rid = str(idx)
        req = Request(
            request_id=rid,
            prompt_token_ids=prompt_token_ids(tr),
            sampling_params=SamplingParams(max_tokens=tr.output_length, ignore_eos=True),
            pooling_params=None,
            arrival_time=tr.timestamp_ms / 1000.0,
            block_hasher=block_hasher,
        )
        live[rid] = req
        out_token[rid] = _OUTPUT_TOKEN + idx
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
        out = sched.schedule()
        total = out.total_num_scheduled_tokens
        req_ids = list(out.num_scheduled_tokens)
        for new in out.scheduled_new_reqs:
            # First scheduling: the tokens found in the prefix cache (local hit), as vLLM's
            # PrefillStats.num_local_cached_tokens records them.
            first_hit.setdefault(new.req_id, new.num_computed_tokens)
        sampled: list[list[int]] = []
        for rid in req_ids:
            req = live[rid]
            k = out.num_scheduled_tokens[rid]
            done_now = req.num_computed_tokens
            p = req.num_prompt_tokens
            computed_tokens += max(0, min(done_now, p) - min(done_now - k, p))
            sampled.append([out_token[rid]] if done_now >= req.num_tokens else [])
        mro = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
            sampled_token_ids=sampled,
        )
        sched.update_from_output(out, mro)
        steps += 1
        if total == 0:
            idle_steps += 1
            nxt = requests[next_idx].timestamp_ms / 1000.0 if next_idx < n else None
            if nxt is not None and nxt > clock:
                clock = nxt
            elif idle_steps > 1000:
                raise RuntimeError(
                    "the scheduler made no progress for 1000 steps; the KV budget "
                    "(--kv-cache-gib) is probably too small for the longest request"
                )
        else:
            idle_steps = 0
            clock += step_ms / 1000.0 + total / tokens_per_s
        for rid in [r for r, req in live.items() if req.is_finished()]:
            req = live.pop(rid)
            del out_token[rid]
            finished += 1
            prompt_tokens += req.num_prompt_tokens
            hit = first_hit.pop(rid)
            per_request[int(rid)] = hit
            cached_tokens += hit
            hit_requests += hit > 0
            preemptions += req.num_preemptions
        if progress is not None and steps % 500 == 0:
            progress(finished, n, clock)
    if progress is not None:
        progress(finished, n, clock)
    states = _count_cached_states(sched)
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
        cached_per_request=per_request,
    )


def stderr_progress(label: str) -> Callable[[int, int, float], None]:
    """Return a progress callback printing ``label: finished/total`` on one stderr line."""

    def show(done: int, total: int, sim_s: float) -> None:
        end = "\n" if done >= total else ""
        print(f"\r{label}: {done}/{total} requests, simulated {sim_s:,.0f} s", end=end,
              file=sys.stderr, flush=True)

    return show
