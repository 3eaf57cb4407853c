#!/usr/bin/env bash
# Build this project's images with podman on the registry-free Debian bookworm base
# (docker/make-base.sh), on a machine without a Docker daemon and without access to image
# registries. `make image` runs `docker/build-image.sh cpu`; `make image-cuda` runs
# `docker/build-image.sh cuda`.
#
#   cpu:  docker/Dockerfile.cpu, all stages: the serving image, then its smoke stage (the demo's
#         serve-and-hit check inside the image), tagged localhost/vllm-hybrid-npu:cpu.
#   cuda: downloads vLLM 0.30.0's CUDA wheel from PyPI, builds the CUDA wheelhouse for the base's
#         Python (3.11) with `wheelhouse build` (docs/cuda.md section 1), then
#         docker/Dockerfile.cuda-wheelhouse (with its import check), tagged
#         localhost/vllm-hybrid-npu:cuda-wheelhouse. Built, not run (no GPU).
#
# Needs root, podman and debootstrap (apt-get install podman debootstrap). Builds use chroot
# isolation (`podman run` cannot start containers on this project's machine: crun's
# setrlimit(RLIMIT_NOFILE) is not permitted), so the smoke test is a build step.
#
# pip inside the build gets what pip on this machine has: the CA bundle of $PIP_CERT (default
# /etc/ssl/certs/ca-certificates.crt: on this project's machine PyPI's certificate chain ends in a
# CA that is in that bundle and not in pip's own) and, for the CPU image, $LOCAL_WHEELS (default
# /opt/wheels, if present) as --find-links, through a pip.conf mounted at /etc/xdg/pip for the RUN
# steps only (the empty mount points /etc/xdg/pip and /wheels stay in the image, nothing else of
# them). Where $LOCAL_WHEELS holds torch-2.13.0+cpu, TORCH_INDEX_URL is PyPI instead of PyTorch's CPU index
# (download.pytorch.org is unreachable here); elsewhere the Dockerfile's default, PyTorch's CPU
# index, gives the same wheel.
#
# Environment: BASE_IMAGE (default localhost/vllm-hybrid-npu-base:bookworm, made if missing),
# NO_CACHE=1 (podman build --no-cache), TAG, LOG (default build/image-<target>.log), LOCAL_WHEELS,
# PIP_CERT, WHEELHOUSE_PYTHON (cuda).
set -euo pipefail
cd "$(dirname "$0")/.."

target="${1:-cpu}"
case "$target" in
    cpu) dockerfile=docker/Dockerfile.cpu; tag="${TAG:-localhost/vllm-hybrid-npu:cpu}" ;;
    cuda) dockerfile=docker/Dockerfile.cuda-wheelhouse; tag="${TAG:-localhost/vllm-hybrid-npu:cuda-wheelhouse}" ;;
    *) echo "usage: $0 cpu|cuda" >&2; exit 2 ;;
esac
BASE_IMAGE="${BASE_IMAGE:-localhost/vllm-hybrid-npu-base:bookworm}"
LOG="${LOG:-build/image-$target.log}"
LOCAL_WHEELS="${LOCAL_WHEELS:-/opt/wheels}"
PIP_CERT="${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}"
mkdir -p build "$(dirname "$LOG")"

for tool in podman debootstrap; do
    command -v "$tool" >/dev/null || { echo "$0: $tool not found (apt-get install podman debootstrap)" >&2; exit 2; }
done

# every line of the log carries the seconds since the start: [  42s]
exec > >(while IFS= read -r line; do printf '[%5ds] %s\n' "$SECONDS" "$line"; done | tee "$LOG") 2>&1
SECONDS=0
echo "== $0 $target: $(date -u +%FT%TZ) on $(uname -n), $(nproc) CPUs," \
     "$(lscpu | sed -n 's/^Model name: *//p'), $(podman --version)"

if [[ "$BASE_IMAGE" == localhost/vllm-hybrid-npu-base:* ]]; then
    IMAGE="$BASE_IMAGE" docker/make-base.sh
fi

conf_dir=$(mktemp -d /var/tmp/vllm-hybrid-npu-pip.XXXXXX)
trap 'rm -rf "$conf_dir"' EXIT
args=(--isolation chroot --format docker --build-arg "BASE_IMAGE=$BASE_IMAGE" -f "$dockerfile" -t "$tag")
[[ "${NO_CACHE:-0}" == 1 ]] && args+=(--no-cache)
{
    echo "[global]"
    if [[ -f "$PIP_CERT" ]]; then
        cp "$PIP_CERT" "$conf_dir/ca.crt"
        echo "cert = /etc/xdg/pip/ca.crt"
    fi
    # cpu only: the CUDA image's torch==2.13.0 must be PyPI's CUDA build, and a local
    # torch-2.13.0+cpu would satisfy that pin too (and win, as the higher version)
    if [[ "$target" == cpu && -d "$LOCAL_WHEELS" ]]; then
        echo "find-links = /wheels"
        args+=(--volume "$LOCAL_WHEELS:/wheels:ro")
    fi
} > "$conf_dir/pip.conf"
# pip reads /etc/xdg/pip/pip.conf (its site configuration); only the empty mount points
# /etc/xdg/pip and /wheels remain in the image
args+=(--volume "$conf_dir:/etc/xdg/pip:ro")
echo "pip.conf for the build steps:"; sed 's/^/  /' "$conf_dir/pip.conf"

if [[ "$target" == cpu ]]; then
    if compgen -G "$LOCAL_WHEELS/torch-2.13.0+cpu-*.whl" >/dev/null; then
        args+=(--build-arg "TORCH_INDEX_URL=https://pypi.org/simple")
    fi
else
    # The CUDA wheelhouse, as in docs/cuda.md section 1, for the base's Python.
    # the base's Python: 3.11 on Debian bookworm (set WHEELHOUSE_PYTHON for another base)
    py="${WHEELHOUSE_PYTHON:-3.11}"
    vllm_wheel=build/vllm-cuda-wheel/vllm-0.30.0-cp38-abi3-manylinux_2_28_x86_64.whl
    if [[ ! -f "$vllm_wheel" ]]; then
        python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
            --platform manylinux_2_28_x86_64 -d build/vllm-cuda-wheel vllm==0.30.0
    fi
    wheelhouse="build/wheelhouse-cuda-py$py"
    python3 vllm_hybrid_npu/tools/wheelhouse.py build --target cuda --python-version "$py" --force \
        --requirements docker/wheelhouse/cuda-vllm0.30-py312.txt --vllm-wheel "$vllm_wheel" \
        --drop 'vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so' --drop 'vllm/vllm-rs' \
        --drop 'vllm/third_party/deep_gemm/*' --drop 'vllm/third_party/fmha_sm100/*' \
        --drop 'vllm/_flashmla*' --drop 'vllm/_qutlass_C*' --drop 'vllm/_deepselect_C*' \
        --drop 'vllm/_flashkda_C*' --split-mib 58 --batch-mib 58 --out "$wheelhouse"
    args+=(--build-context "wheelhouse=$wheelhouse")
fi

echo "+ podman build ${args[*]} ."
podman build "${args[@]}" .
echo "== built $tag in $SECONDS s (base included); $(date -u +%FT%TZ)"
podman image ls --format '{{.Repository}}:{{.Tag}} {{.ID}} {{.Size}}' "$tag"
podman image inspect --format 'size: {{.Size}} bytes' "$tag"
