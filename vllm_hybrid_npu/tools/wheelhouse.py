"""``vllm-hybrid-npu wheelhouse``: an offline wheelhouse for an air-gapped serving site, and its install.

Air-gapped GPU and Ascend sites have a Python with their framework (torch + CUDA, or torch-npu +
CANN) but no registry. This tool, run where a registry is reachable, collects what such a site
lacks as wheels for the *site's* Python and platform, and installs them there with no network:

``build`` (registry side)
    1. ``pip download --no-deps --only-binary=:all:`` of a pinned requirement list (``--requirements``;
       ``docker/wheelhouse/<target>.txt`` holds the ones this project measured), for
       ``--python-version`` and the manylinux platforms of ``--platform``;
    2. optionally a vLLM wheel given by path (``--vllm-wheel``), repacked without the members that
       match ``--drop`` (fnmatch patterns on archive paths, e.g. FlashAttention's 460 MB of
       ``vllm/vllm_flash_attn/*.so`` when the site serves with the Triton attention backend); the
       wheel's ``RECORD`` is rewritten to list what remains;
    3. every file larger than ``--split-mib`` MiB is cut into ``NAME.partNNN`` pieces (transfer
       limits, e.g. 64 MiB per copy), and ``--batch-mib`` groups the files into ``batch-N/``
       folders no larger than that, to be carried one after another;
    4. ``MANIFEST.json``: every wheel's name, size and sha256, and its parts.

``install`` (site side)
    Reassembles the parts found under ``--wheelhouse`` (all batch folders, or several folders
    given), checks each wheel's sha256 against the manifest, and runs
    ``pip install --no-index --no-deps --no-compile`` of all of them (into ``--target`` if given,
    else the running environment). ``--no-deps``: the wheelhouse is the whole closure, checked
    once where it was built; pins that the site's framework contradicts (vLLM 0.30.0's
    ``torch==2.13.0`` against a site's 2.11.0) are deliberately not enforced, see docs/cuda.md.

Errors: :class:`SystemExit` with a message naming the flag and value (missing wheel, checksum
mismatch, a part missing, pip failing).
"""

from __future__ import annotations

import argparse
import csv
import fnmatch
import io
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from base64 import urlsafe_b64encode
from pathlib import Path

#: manylinux tags pip must be told one by one (``pip download`` matches each tag exactly).
MANYLINUX_X86_64 = [
    "manylinux_2_34_x86_64", "manylinux_2_31_x86_64", "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
    "manylinux2014_x86_64", "manylinux1_x86_64",
]
MANYLINUX_AARCH64 = [t.replace("x86_64", "aarch64") for t in MANYLINUX_X86_64[:6]] + ["manylinux2014_aarch64"]

MANIFEST = "MANIFEST.json"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def strip_wheel(src: Path, dst_dir: Path, drop: list[str]) -> tuple[Path, list[str]]:
    """Write ``dst_dir/<src.name>``: the wheel ``src`` without the members matching any fnmatch
    pattern of ``drop``, with ``*.dist-info/RECORD`` rewritten for what remains.

    Returns (the new wheel's path, the dropped member names). Raises ``SystemExit`` if ``src``
    is not a wheel or a pattern drops a ``.dist-info`` member."""
    if not zipfile.is_zipfile(src):
        raise SystemExit(f"--vllm-wheel {src}: not a wheel (zip) file")
    dst = dst_dir / src.name
    dropped: list[str] = []
    record_lines: list[list[str]] = []
    record_name = None
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            name = info.filename
            if name.endswith(".dist-info/RECORD"):
                record_name = name
                continue
            if any(fnmatch.fnmatch(name, p) for p in drop):
                if ".dist-info/" in name:
                    raise SystemExit(f"--drop would remove wheel metadata {name}")
                dropped.append(name)
                continue
            data = zin.read(info)
            zout.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=6)
            digest = urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            record_lines.append([name, f"sha256={digest}", str(len(data))])
        if record_name is None:
            raise SystemExit(f"--vllm-wheel {src}: no .dist-info/RECORD member")
        record_lines.append([record_name, "", ""])
        buf = io.StringIO()
        csv.writer(buf, lineterminator="\n").writerows(record_lines)  # RECORD is CSV (PEP 376)
        zout.writestr(record_name, buf.getvalue())
    return dst, dropped


def _split(path: Path, limit: int) -> list[str]:
    """Cut ``path`` into ``path.partNNN`` files of at most ``limit`` bytes, remove ``path`` and
    return the part names (in order)."""
    parts = []
    with open(path, "rb") as f:
        i = 0
        while chunk := f.read(limit):
            part = path.with_name(f"{path.name}.part{i:03d}")
            part.write_bytes(chunk)
            parts.append(part.name)
            i += 1
    path.unlink()
    return parts


def build(args: argparse.Namespace) -> int:
    out = Path(args.out)
    stage = out / "_stage"
    if out.exists() and any(out.iterdir()) and not args.force:
        raise SystemExit(f"--out {out} is not empty (pass --force to replace it)")
    shutil.rmtree(out, ignore_errors=True)
    stage.mkdir(parents=True)
    platforms = {"x86_64": MANYLINUX_X86_64, "aarch64": MANYLINUX_AARCH64}[args.arch]
    if args.requirements:
        req = Path(args.requirements)
        if not req.is_file():
            raise SystemExit(f"--requirements {req}: no such file")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--python-version", args.python_version, "--implementation", "cp",
               *[a for p in platforms for a in ("--platform", p)], "--platform", "any",
               "-d", str(stage), "-r", str(req)]
        print("+", " ".join(cmd), flush=True)
        if subprocess.run(cmd).returncode != 0:
            raise SystemExit(f"pip download of --requirements {req} failed (see above)")
    if args.vllm_wheel:
        src = Path(args.vllm_wheel)
        if not src.is_file():
            raise SystemExit(f"--vllm-wheel {src}: no such file")
        dst, dropped = strip_wheel(src, stage, args.drop or [])
        print(f"{src.name}: {src.stat().st_size >> 20} MiB -> {dst.stat().st_size >> 20} MiB, "
              f"{len(dropped)} members dropped", flush=True)
    limit = int(args.split_mib * (1 << 20))
    entries = []
    for whl in sorted(stage.glob("*.whl")):
        entry = {"wheel": whl.name, "bytes": whl.stat().st_size, "sha256": _sha256(whl)}
        entry["files"] = _split(whl, limit) if whl.stat().st_size > limit else [whl.name]
        entries.append(entry)
    # batches: first-fit of files, largest first, into folders of at most --batch-mib
    batch_limit = int(args.batch_mib * (1 << 20))
    files = sorted(((stage / f).stat().st_size, f) for e in entries for f in e["files"])[::-1]
    batches: list[list[tuple[int, str]]] = []
    for size, name in files:
        if size > batch_limit:
            raise SystemExit(f"{name} ({size} bytes) is larger than --batch-mib {args.batch_mib}")
        for b in batches:
            if sum(s for s, _ in b) + size <= batch_limit:
                b.append((size, name))
                break
        else:
            batches.append([(size, name)])
    where = {}
    for i, b in enumerate(batches, 1):
        d = out / f"batch-{i}"
        d.mkdir()
        for _, name in b:
            shutil.move(str(stage / name), d / name)
            where[name] = d.name
    stage.rmdir()
    manifest = {"python_version": args.python_version, "arch": args.arch, "target": args.target,
                "wheels": entries, "batches": {n: where[n] for e in entries for n in e["files"]}}
    for i in range(1, len(batches) + 1):  # every batch carries the manifest
        (out / f"batch-{i}" / MANIFEST).write_text(json.dumps(manifest, indent=1))
    for i, b in enumerate(batches, 1):
        print(f"batch-{i}: {len(b)} files, {sum(s for s, _ in b) / (1 << 20):.1f} MiB")
    return 0


def install(args: argparse.Namespace) -> int:
    roots = [Path(p) for p in args.wheelhouse]
    dirs = []
    for r in roots:
        if not r.is_dir():
            raise SystemExit(f"--wheelhouse {r}: no such folder")
        dirs += [r] + sorted(p for p in r.iterdir() if p.is_dir() and p.name.startswith("batch-"))
    manifests = [d / MANIFEST for d in dirs if (d / MANIFEST).is_file()]
    if not manifests:
        raise SystemExit(f"--wheelhouse {args.wheelhouse}: no {MANIFEST} found")
    manifest = json.loads(manifests[0].read_text())
    found = {p.name: p for d in dirs for p in d.iterdir() if p.is_file()}
    work = Path(tempfile.mkdtemp(prefix="wheelhouse-"))
    wheels = []
    for e in manifest["wheels"]:
        missing = [f for f in e["files"] if f not in found]
        if missing:
            raise SystemExit(f"--wheelhouse: {missing} of {e['wheel']} not found (carry every batch)")
        if e["files"] == [e["wheel"]]:
            whl = found[e["wheel"]]
        else:
            whl = work / e["wheel"]
            with open(whl, "wb") as f:
                for part in e["files"]:
                    with open(found[part], "rb") as p:
                        shutil.copyfileobj(p, f)
        if _sha256(whl) != e["sha256"]:
            raise SystemExit(f"--wheelhouse: {e['wheel']} fails its sha256 check")
        wheels.append(str(whl))
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
           "--no-cache-dir", "--upgrade"]
    if args.target:
        cmd += ["--target", args.target]
    rc = subprocess.run(cmd + wheels).returncode
    shutil.rmtree(work, ignore_errors=True)
    if rc != 0:
        raise SystemExit(f"pip install of {len(wheels)} wheels failed (exit {rc})")
    print(f"installed {len(wheels)} wheels" + (f" into {args.target}" if args.target else ""))
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    b = sub.add_parser("build", help="download and pack the wheels a target site lacks")
    b.add_argument("--target", choices=["cuda", "npu"], required=True)
    b.add_argument("--requirements", help="pinned requirement file (one NAME==VERSION a line)")
    b.add_argument("--vllm-wheel", help="path of a vLLM wheel to repack into the wheelhouse")
    b.add_argument("--drop", action="append", metavar="GLOB",
                   help="archive members of --vllm-wheel to leave out (repeatable)")
    b.add_argument("--python-version", default="3.12", help="the site's Python (default 3.12)")
    b.add_argument("--arch", choices=["x86_64", "aarch64"], default="x86_64")
    b.add_argument("--split-mib", type=float, default=60.0, help="cut wheels larger than this")
    b.add_argument("--batch-mib", type=float, default=60.0, help="size of each batch-N folder")
    b.add_argument("--out", required=True, help="wheelhouse folder to write")
    b.add_argument("--force", action="store_true", help="replace a non-empty --out")
    i = sub.add_parser("install", help="install a wheelhouse with no network")
    i.add_argument("--wheelhouse", nargs="+", required=True,
                   help="wheelhouse folder(s): the --out of build, or its batch-N folders")
    i.add_argument("--target", help="pip --target folder (then put it on PYTHONPATH)")


def run(args: argparse.Namespace) -> int:
    return build(args) if args.action == "build" else install(args)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="wheelhouse", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
