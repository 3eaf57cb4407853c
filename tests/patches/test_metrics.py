"""State-copy counters: counted in worker processes, served by the process that serves
``/metrics`` (here: this process's default prometheus registry, as vLLM's single API server)."""

from __future__ import annotations

import multiprocessing
import os
import random

from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from vllm_hybrid_npu import metrics


def _served() -> dict[str, float]:
    text = generate_latest(REGISTRY).decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.startswith("vllm_hybrid_npu:"):
                out[s.name] = s.value
    return out


def _worker(n: int, nbytes: int, q) -> None:
    # A multiprocessing child, as vLLM's engine core is: inherits the directory, records.
    from vllm_hybrid_npu import metrics as m

    m.setup()
    m.record_state_copies(n, nbytes)
    m.record_state_copies(1, 10)
    q.put((os.getpid(), m.totals()))


def test_counters_from_worker_processes_reach_the_serving_registry():
    directory = metrics.setup()
    assert directory and os.path.isdir(directory)
    before = _served()
    assert {"vllm_hybrid_npu:state_copies_total", "vllm_hybrid_npu:state_copy_bytes_total"} <= set(before)
    draws = [(random.randrange(1, 50), random.randrange(1, 10**6)) for _ in range(2)]
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(n, b, q)) for n, b in draws]
    for p in procs:
        p.start()
    results = [q.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    assert {pid for pid, _ in results} == {p.pid for p in procs}
    after = _served()
    want_copies = sum(n + 1 for n, _ in draws)
    want_bytes = sum(b + 10 for _, b in draws)
    assert after["vllm_hybrid_npu:state_copies_total"] - before["vllm_hybrid_npu:state_copies_total"] == want_copies
    assert after["vllm_hybrid_npu:state_copy_bytes_total"] - before["vllm_hybrid_npu:state_copy_bytes_total"] == want_bytes


def test_in_process_totals_add_up():
    c0, b0 = metrics.totals()
    metrics.record_state_copies(3, 300)
    metrics.record_state_copies(0, 0)
    assert metrics.totals() == (c0 + 3, b0 + 300)
