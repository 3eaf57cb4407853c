"""Host tier of the hit-rate lab: vLLM's OffloadingConnector with its worker side simulated.

The scheduler side is vLLM's own (vLLM 0.30,
``vllm/distributed/kv_transfer/kv_connector/v1/offloading_connector.py`` and
``offloading/scheduler.py`` with ``vllm/v1/kv_offload/cpu/spec.py``'s ``CPUOffloadingManager``):
the lab sets ``CacheConfig.kv_offloading_size`` and lets ``VllmConfig._post_init_kv_transfer_config``
build the ``KVTransferConfig`` exactly as ``vllm serve --kv-offloading-size N`` does, and the
``Scheduler`` creates the connector itself. What the server's workers do
(``OffloadingConnectorWorker``: submit the jobs of ``OffloadingConnectorMetadata``, report them in
``KVConnectorOutput``) is replaced by :class:`SimulatedOffloadWorker`:

* a load job starts when its metadata arrives, a store job at the start of the next step (the
  worker defers stores, ``prepare_store_kv``); each direction is one FIFO link
  (``latency_us + bytes / GB/s``); bytes = blocks per KV-cache group x that group's page bytes
  x its layers (the bytes one worker moves);
* a finished job is reported once, in the first step output at or after its completion time:
  ``kv_connector_worker_meta.completed_jobs`` (both directions) and ``finished_recving`` (loads),
  as ``OffloadingConnectorWorker.get_finished`` does;
* ``jobs_to_flush`` (a store whose GPU blocks are about to be reused) completes before the step
  runs; the wait is added to that step.

Defaults of :class:`HostLink`: 50 GB/s per direction and 10 us per job, the order of a PCIe Gen5
x16 link (64 GB/s raw, about 50 GB/s for pinned-memory DMA) on an H100/H200 host; an Ascend host
over HCCS is of the same order (pass ``--host-link-gbps`` for another).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class HostLink:
    """Bandwidth/latency model of the device <-> host link (one worker).

    ``gbps``: GB/s (1e9 bytes/s) per direction, > 0; ``latency_us``: fixed cost per job,
    microseconds, >= 0. Raises ``ValueError`` naming ``--host-link-gbps`` / ``--host-link-latency-us``.
    """

    gbps: float = 50.0
    latency_us: float = 10.0

    def __post_init__(self) -> None:
        if not self.gbps > 0:
            raise ValueError(f"--host-link-gbps must be > 0, got {self.gbps}")
        if self.latency_us < 0:
            raise ValueError(f"--host-link-latency-us must be >= 0, got {self.latency_us}")

    def seconds(self, num_bytes: int) -> float:
        """Transfer time of ``num_bytes`` bytes, seconds."""
        return self.latency_us * 1e-6 + num_bytes / (self.gbps * 1e9)


def group_block_bytes(kv_cache_config: Any) -> list[int]:
    """Bytes of one block of each KV-cache group on one worker (page bytes x layers), as
    ``offloading/config.py``'s ``_group_kv_bytes_per_block`` (vLLM 0.30) counts them."""
    return [g.kv_cache_spec.page_size_bytes * len(g.layer_names) for g in kv_cache_config.kv_cache_groups]


def _spec_bytes(spec: Any, per_group: list[int]) -> int:
    sizes = getattr(spec, "group_sizes", None)
    block_ids = getattr(spec, "block_ids", None)
    if sizes is not None and len(sizes) == len(per_group):
        return sum(int(n) * b for n, b in zip(sizes, per_group))
    count = len(block_ids) if block_ids is not None else 0
    return count * max(per_group)


class SimulatedOffloadWorker:
    """The OffloadingConnector's worker side on a simulated clock (see module docstring).

    Args:
        kv_cache_config: the scheduler's ``KVCacheConfig`` (block bytes per group).
        link: the :class:`HostLink`.
    """

    def __init__(self, kv_cache_config: Any, link: HostLink) -> None:
        self.link = link
        self.per_group = group_block_bytes(kv_cache_config)
        self._free_at = {"load": 0.0, "store": 0.0}
        self._done: list[tuple[float, int, int, str | None]] = []  # (time, seq, job, load req)
        self._deferred: list[tuple[int, int]] = []  # store (job, bytes) for the next step
        self._running: dict[int, float] = {}  # job -> completion time
        self._seq = 0
        self.load_bytes = self.store_bytes = 0
        self.load_s = self.store_s = 0.0
        self.load_jobs = self.store_jobs = 0
        self.flush_wait_s = 0.0

    def _start(self, kind: str, job: int, num_bytes: int, now: float, req: str | None) -> float:
        begin = max(now, self._free_at[kind])
        end = begin + self.link.seconds(num_bytes)
        self._free_at[kind] = end
        self._seq += 1
        heapq.heappush(self._done, (end, self._seq, job, req))
        self._running[job] = end
        if kind == "load":
            self.load_bytes += num_bytes
            self.load_s += end - begin
            self.load_jobs += 1
        else:
            self.store_bytes += num_bytes
            self.store_s += end - begin
            self.store_jobs += 1
        return end

    def submit(self, meta: Any, now: float) -> float:
        """Take one step's ``OffloadingConnectorMetadata`` at simulated time ``now`` (seconds).

        Returns the seconds the step waits for flushed stores before it runs (>= 0).
        """
        if meta is None:
            return 0.0
        # stores queued by the previous step start now (the real worker submits them at the
        # start of this step's start_kv_transfers / handle_preemptions)
        for job, num_bytes in self._deferred:
            self._start("store", job, num_bytes, now, None)
        self._deferred = []
        wait = 0.0
        flush = set(meta.jobs_to_flush or ())
        for job, entry in meta.store_jobs.items():
            num_bytes = _spec_bytes(entry.src_spec, self.per_group)
            if job in flush:
                end = self._start("store", job, num_bytes, now, None)
                wait = max(wait, end - now)
            else:
                self._deferred.append((job, num_bytes))
        for job in flush:
            end = self._running.get(job)
            if end is not None:
                wait = max(wait, end - now)
        if wait > 0:
            # the worker blocks on the flushed jobs: they complete before the step runs
            self.flush_wait_s += wait
            self._done = [(min(t, now) if j in flush else t, s, j, r) for t, s, j, r in self._done]
            heapq.heapify(self._done)
        for job, entry in meta.load_jobs.items():
            self._start("load", job, _spec_bytes(entry.dst_spec, self.per_group), now + wait, entry.req_id)
        return wait

    def collect(self, now: float) -> Any:
        """The ``KVConnectorOutput`` of a step ending at ``now``: jobs finished by then."""
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
            OffloadingWorkerMetadata,
        )
        from vllm.v1.outputs import KVConnectorOutput

        meta = OffloadingWorkerMetadata()
        recving: set[str] = set()
        while self._done and self._done[0][0] <= now:
            _, _, job, req = heapq.heappop(self._done)
            self._running.pop(job, None)
            meta.mark_completed(job)
            if req is not None:
                recving.add(req)
        if not meta.completed_jobs:
            return KVConnectorOutput()
        return KVConnectorOutput(finished_recving=recving or None, kv_connector_worker_meta=meta)

    def next_completion(self) -> float | None:
        """Simulated time of the next job completion, or ``None`` when nothing is in flight
        (deferred stores count as in flight: they start on the next step)."""
        if self._done:
            return self._done[0][0]
        return None

    def summary(self) -> dict[str, Any]:
        """Transfer totals: ``load_bytes``, ``load_s``, ``load_jobs``, ``store_*``, ``flush_wait_s``,
        the link (``gbps``, ``latency_us``)."""
        return {
            "load_bytes": self.load_bytes,
            "load_s": self.load_s,
            "load_jobs": self.load_jobs,
            "store_bytes": self.store_bytes,
            "store_s": self.store_s,
            "store_jobs": self.store_jobs,
            "flush_wait_s": self.flush_wait_s,
            "gbps": self.link.gbps,
            "latency_us": self.link.latency_us,
        }


def tails_off_scheduler(base: type) -> type:
    """A subclass of ``base`` (vLLM's ``Scheduler``, or the lab's exporter subclass of it) whose
    host tier keeps no partial tail: the runtime's ``host-tier-partial-tails-off`` entry
    (:mod:`vllm_hybrid_npu.patches.vllm_kv_offload_scheduler`, ``VLLM_HYBRID_NPU_OPTIONS=tails=off``;
    vLLM 0.30) wraps ``SchedulerOffloadConfig.from_spec`` while this scheduler builds its
    OffloadingConnector, and only then (the class is restored after; a replay runs in one thread
    of its process), so other replays in the process keep vLLM's partial tails. Without a host
    tier nothing changes. The installed vLLM is the policy's to check (``tails=off`` settings
    carry the entry's versions, :func:`vllm_hybrid_npu_lab.upstream_grid.policy_of`)."""
    from vllm_hybrid_npu.patches import registry
    from vllm_hybrid_npu.patches import vllm_kv_offload_scheduler as T

    class TailsOffScheduler(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            import importlib

            import vllm

            from vllm_hybrid_npu.support import Stack, base_version

            version = base_version(vllm.__version__)
            owner = importlib.import_module(T.MODULE).SchedulerOffloadConfig
            upstream = vars(owner)["from_spec"]
            if not registry.is_ours(upstream):  # the runtime's entry not applied process-wide
                entry = next(p for p in T.PATCHES if p.name == T.ENTRY)
                owner.from_spec = entry.make(upstream, Stack(target="cpu", vllm=version))
            try:
                super().__init__(*args, **kwargs)
            finally:
                owner.from_spec = upstream

    TailsOffScheduler.__name__ = TailsOffScheduler.__qualname__ = f"TailsOff{base.__name__}"
    return TailsOffScheduler
