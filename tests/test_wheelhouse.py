"""``vllm-hybrid-npu wheelhouse``: strip, split, batch and reassemble wheels, install offline.

Wheels are made here (fresh random payloads, so a wrong reassembly cannot pass by luck); nothing
is downloaded (``--requirements`` is not given)."""

from __future__ import annotations

import argparse
import csv
import hashlib
import io
import os
import random
import subprocess
import sys
import zipfile
from base64 import urlsafe_b64encode
from pathlib import Path

import pytest

from vllm_hybrid_npu.tools import wheelhouse


def _record_line(name: str, data: bytes) -> list[str]:
    d = urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return [name, f"sha256={d}", str(len(data))]


def _make_wheel(path: Path, files: dict[str, bytes], dist="toypkg", version="1.0") -> Path:
    info = f"{dist}-{version}.dist-info"
    files = {**files,
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n".encode(),
             f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    rows = [_record_line(n, d) for n, d in files.items()] + [[f"{info}/RECORD", "", ""]]
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows(rows)
    whl = path / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w", zipfile.ZIP_STORED) as z:  # stored: sizes stay large
        for n, d in files.items():
            z.writestr(n, d)
        z.writestr(f"{info}/RECORD", buf.getvalue())
    return whl


def _args(**kw):
    base = dict(target="cuda", requirements=None, vllm_wheel=None, drop=None, python_version="3.12",
                arch="x86_64", split_mib=1.0, batch_mib=2.0, out=None, force=False)
    return argparse.Namespace(**{**base, **kw})


def test_strip_split_batch_and_install_roundtrip(tmp_path):
    seed = random.SystemRandom().randrange(1 << 30)
    rng = random.Random(seed)
    keep = rng.randbytes(3 * (1 << 20) + rng.randrange(1 << 20))  # > split size: cut in parts
    drop = rng.randbytes(1 << 20)
    src = _make_wheel(tmp_path, {"toypkg/__init__.py": b"VALUE = 7\n", "toypkg/blob.bin": keep,
                                 "toypkg/big,name=x.so": drop})  # a comma: RECORD must quote it
    out = tmp_path / "house"
    assert wheelhouse.build(_args(vllm_wheel=str(src), drop=["toypkg/big*"], out=str(out))) == 0
    batches = sorted(p for p in out.iterdir())
    assert len(batches) >= 2, (batches, seed)  # 3+ MiB of parts into 2-MiB batches
    for b in batches:
        assert sum(f.stat().st_size for f in b.iterdir() if f.name != "MANIFEST.json") <= 2 << 20
    target = tmp_path / "site"
    assert wheelhouse.install(argparse.Namespace(wheelhouse=[str(b) for b in batches],
                                                 target=str(target))) == 0
    assert (target / "toypkg" / "blob.bin").read_bytes() == keep, seed
    assert not (target / "toypkg" / "big,name=x.so").exists()
    r = subprocess.run([sys.executable, "-c", "import toypkg; print(toypkg.VALUE)"],
                       env={**os.environ, "PYTHONPATH": str(target)}, capture_output=True, text=True)
    assert r.stdout.strip() == "7", r.stderr


def test_install_refuses_a_missing_part_and_a_corrupt_wheel(tmp_path):
    seed = random.SystemRandom().randrange(1 << 30)
    print("seed", seed)
    rng = random.Random(seed)
    src = _make_wheel(tmp_path, {"toypkg/blob.bin": rng.randbytes(3 << 20)})
    out = tmp_path / "house"
    wheelhouse.build(_args(vllm_wheel=str(src), out=str(out)))
    batches = sorted(out.iterdir())
    with pytest.raises(SystemExit, match="not found"):
        wheelhouse.install(argparse.Namespace(wheelhouse=[str(batches[0])], target=str(tmp_path / "s")))
    part = next(p for b in batches for p in b.iterdir() if ".part" in p.name)
    data = part.read_bytes()
    part.write_bytes(bytes([data[0] ^ 0xFF]) + data[1:])  # always a different byte
    with pytest.raises(SystemExit, match="sha256"):
        wheelhouse.install(argparse.Namespace(wheelhouse=[str(out)], target=str(tmp_path / "s")))


def test_bad_input_names_the_flag(tmp_path):
    with pytest.raises(SystemExit, match="--vllm-wheel"):
        wheelhouse.build(_args(vllm_wheel=str(tmp_path / "nope.whl"), out=str(tmp_path / "o")))
    with pytest.raises(SystemExit, match="--wheelhouse"):
        wheelhouse.install(argparse.Namespace(wheelhouse=[str(tmp_path / "none")], target=None))
