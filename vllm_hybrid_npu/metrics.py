"""State-copy counters on the server's Prometheus ``/metrics``.

Two counters tell a user what align mode costs:

* ``vllm_hybrid_npu:state_copies_total``: byte ranges copied by the align-mode state copy
  (one per request move x Mamba/GDN layer x state tensor; summed over worker processes);
* ``vllm_hybrid_npu:state_copy_bytes_total``: bytes copied by it (summed over worker processes,
  i.e. over TP ranks, each copying its own shard).

The copies happen in the worker / engine-core process while ``/metrics`` is served by the API
server process. vLLM 0.30.0/0.32.0 serve ``/metrics`` from ``vllm.v1.metrics.prometheus.
get_prometheus_registry()``: prometheus_client's default ``REGISTRY`` with one API server, or a
``MultiProcessCollector`` over ``$PROMETHEUS_MULTIPROC_DIR`` when vLLM set that up
(``--api-server-count`` > 1). Both are served here with prometheus_client's public API:

* multiprocess mode (``PROMETHEUS_MULTIPROC_DIR`` set in the worker): the counters are ordinary
  prometheus_client ``Counter`` objects; their values land in the multiprocess directory and
  vLLM's own collector serves them;
* otherwise: each worker process writes its totals, after each step that copied, to
  ``$VLLM_HYBRID_NPU_METRICS_DIR/<pid>.prom`` with ``prometheus_client.write_to_textfile``
  (atomic rename), and a collector registered in the default ``REGISTRY`` of every process
  (the API server's included) sums those files at scrape time. The directory is created by the
  top-level process (the API server; ``multiprocessing.parent_process() is None``) when the
  plugin loads, inherited by the engine-core / worker processes through the environment, and
  removed when that process exits.
"""

from __future__ import annotations

import atexit
import glob
import logging
import multiprocessing
import os
import shutil
import tempfile
import threading

logger = logging.getLogger("vllm_hybrid_npu")

#: Counter names without the ``_total`` suffix prometheus_client appends to counters.
STATE_COPIES = "vllm_hybrid_npu:state_copies"
STATE_COPY_BYTES = "vllm_hybrid_npu:state_copy_bytes"
_HELP = {
    STATE_COPIES: "Align-mode Mamba/GDN state copies (byte ranges) done by vllm-hybrid-npu.",
    STATE_COPY_BYTES: "Bytes copied by vllm-hybrid-npu's align-mode Mamba/GDN state copies.",
}

#: Directory of the per-process counter files (set by the top-level process).
DIR_ENV = "VLLM_HYBRID_NPU_METRICS_DIR"

_lock = threading.Lock()
_totals = {STATE_COPIES: 0, STATE_COPY_BYTES: 0}
_mp_counters = None  # prometheus_client Counters in multiprocess mode
_collector_registered = False
_owned_dir: str | None = None


def totals() -> tuple[int, int]:
    """This process's ``(state copies, bytes)`` so far (ints)."""
    with _lock:
        return _totals[STATE_COPIES], _totals[STATE_COPY_BYTES]


def _multiprocess_mode() -> bool:
    return bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))


def _remove_dir(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def setup() -> str | None:
    """Prepare this process to export / serve the counters; idempotent.

    Called by :func:`vllm_hybrid_npu.patches.apply_patches` in every process vLLM loads the
    plugin in. The top-level process creates a fresh counter directory (ignoring one inherited
    from an unrelated parent) and exports it in ``$VLLM_HYBRID_NPU_METRICS_DIR``; every process
    registers the file-summing collector in prometheus_client's default ``REGISTRY``.

    Returns:
        The counter directory (str), or None when it could not be prepared (logged).
    """
    global _collector_registered, _owned_dir
    try:
        if multiprocessing.parent_process() is None and _owned_dir is None:
            _owned_dir = tempfile.mkdtemp(prefix="vllm-hybrid-npu-metrics-")
            os.environ[DIR_ENV] = _owned_dir
            atexit.register(_remove_dir, _owned_dir)
        if not _collector_registered:
            from prometheus_client import REGISTRY

            REGISTRY.register(_FileCollector())
            _collector_registered = True
    except Exception as exc:  # metrics must never break serving
        logger.warning("vllm-hybrid-npu metrics not set up: %s", exc)
        return None
    return os.environ.get(DIR_ENV)


def _file_path() -> str | None:
    d = os.environ.get(DIR_ENV)
    if not d or not os.path.isdir(d):
        return None
    return os.path.join(d, f"{os.getpid()}.prom")


def _write_file(copies: int, nbytes: int) -> None:
    path = _file_path()
    if path is None:
        return
    from prometheus_client import CollectorRegistry, write_to_textfile
    from prometheus_client.core import CounterMetricFamily

    class _Snapshot:
        def collect(self):
            yield CounterMetricFamily(STATE_COPIES, _HELP[STATE_COPIES], value=copies)
            yield CounterMetricFamily(STATE_COPY_BYTES, _HELP[STATE_COPY_BYTES], value=nbytes)

    reg = CollectorRegistry()
    reg.register(_Snapshot())
    write_to_textfile(path, reg)


def record_state_copies(num_copies: int, num_bytes: int) -> None:
    """Add ``num_copies`` state copies of ``num_bytes`` bytes in total to the counters.

    Args:
        num_copies: byte ranges copied (int >= 0).
        num_bytes: bytes copied (int >= 0).
    """
    global _mp_counters
    if num_copies <= 0 and num_bytes <= 0:
        return
    with _lock:
        _totals[STATE_COPIES] += int(num_copies)
        _totals[STATE_COPY_BYTES] += int(num_bytes)
        copies, nbytes = _totals[STATE_COPIES], _totals[STATE_COPY_BYTES]
        try:
            if _multiprocess_mode():
                if _mp_counters is None:
                    from prometheus_client import CollectorRegistry, Counter

                    reg = CollectorRegistry()  # values go to the multiprocess directory
                    _mp_counters = (
                        Counter(STATE_COPIES, _HELP[STATE_COPIES], registry=reg),
                        Counter(STATE_COPY_BYTES, _HELP[STATE_COPY_BYTES], registry=reg),
                    )
                _mp_counters[0].inc(int(num_copies))
                _mp_counters[1].inc(int(num_bytes))
            else:
                _write_file(copies, nbytes)
        except Exception as exc:  # metrics must never break a forward step
            logger.warning("vllm-hybrid-npu: could not export state-copy counters: %s", exc)


def read_dir_totals(directory: str | None = None) -> tuple[int, int]:
    """Sum the counters of every ``*.prom`` file in ``directory`` (default
    ``$VLLM_HYBRID_NPU_METRICS_DIR``).

    Returns:
        ``(state copies, bytes)`` summed over the worker processes' files (ints).
    """
    from prometheus_client.parser import text_string_to_metric_families

    directory = directory or os.environ.get(DIR_ENV)
    copies = nbytes = 0
    if not directory:
        return 0, 0
    for path in sorted(glob.glob(os.path.join(directory, "*.prom"))):
        try:
            with open(path) as f:
                text = f.read()
        except OSError:
            continue
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == STATE_COPIES + "_total":
                    copies += int(sample.value)
                elif sample.name == STATE_COPY_BYTES + "_total":
                    nbytes += int(sample.value)
    return copies, nbytes


class _FileCollector:
    """Serves the summed per-process counter files as two counters."""

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        copies, nbytes = read_dir_totals()
        yield CounterMetricFamily(STATE_COPIES, _HELP[STATE_COPIES], value=copies)
        yield CounterMetricFamily(STATE_COPY_BYTES, _HELP[STATE_COPY_BYTES], value=nbytes)

    def describe(self):
        return []
