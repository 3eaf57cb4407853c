#!/usr/bin/env bash
# One step of the CUDA e2e run / serving benchmark on a lent GPU machine (issue #14; docs/cuda.md,
# "Runbook"). Run from the repository root on the machine, one step per device call:
#
#   bash e2e/cuda_device.sh stash DIR...      copy carried wheelhouse batch folders to $VHN/wheelhouse
#   bash e2e/cuda_device.sh install           install them (and this project) into $VHN/site
#   bash e2e/cuda_device.sh e2e FILE...       pytest -rA of e2e files on the CUDA target
#   bash e2e/cuda_device.sh measure SCENARIO [ARGS...]   e2e/measure_on_off.py on CUDA
#   bash e2e/cuda_device.sh bench ROWS [ARGS...]         benchmarks.cuda_serving --resume
#
# MODEL_DIR overrides the benchmark's model (default: the Qwen3.5-35B-A3B-shaped one, built on first
# use). State lives outside the work tree under $VHN (default /tmp/vhn): the device keeps it only for
# back-to-back calls. Logs, pytest's junit XML and the benchmark JSON are copied to $OUT (the
# folder the device tool brings back, at most 8 files a call). Every step stops itself at
# $STEP_LIMIT seconds (default 570), under the tool's 600 s per call; chain steps in one call
# with && and a smaller STEP_LIMIT.
set -uo pipefail

VHN=${VHN:-/tmp/vhn}
OUT=${OUT:-$VHN/out}
STEP_LIMIT=${STEP_LIMIT:-570}
mkdir -p "$VHN" "$OUT"
PY=${PYTHON:-python3}

export PYTHONPATH="$PWD:$VHN/site${PYTHONPATH:+:$PYTHONPATH}"
export VLLM_USE_FLASHINFER_SAMPLER=0       # FlashInfer is not in the wheelhouse
export VLLM_HYBRID_NPU_CACHE="$VHN/cache"  # tiny checkpoints, built once per machine
export VLLM_HYBRID_NPU_E2E_TARGET=${VLLM_HYBRID_NPU_E2E_TARGET:-cuda}  # cpu: a dry run of the steps here
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

step=${1:?usage: cuda_device.sh stash|install|e2e|measure|bench ...}
shift
log="$OUT/$step-$(date -u +%H%M%S).log"

case "$step" in
  stash)
    mkdir -p "$VHN/wheelhouse"
    for d in "$@"; do cp -r "$d"/. "$VHN/wheelhouse/"; done
    ls -la "$VHN/wheelhouse" | tee "$log"
    ;;
  install)
    {
      "$PY" vllm_hybrid_npu/tools/wheelhouse.py install --wheelhouse "$VHN/wheelhouse" --target "$VHN/site" &&
      "$PY" -m pip install --no-deps --no-build-isolation --no-index --target "$VHN/site" . &&
      "$PY" -c "import torch, vllm, vllm_hybrid_npu; print('torch', torch.__version__, 'vllm', vllm.__version__, 'cuda', torch.cuda.get_device_name(0))" &&
      nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    } 2>&1 | tee "$log"
    ;;
  e2e)
    name=$(basename -s .py "${1:-e2e}")
    timeout "$STEP_LIMIT" "$PY" -m pytest "$@" -rA -p no:cacheprovider -o addopts="" \
      --junitxml="$OUT/junit-$name.xml" 2>&1 | tee "$log"
    ;;
  measure)
    timeout "$STEP_LIMIT" "$PY" e2e/measure_on_off.py "$@" --top 20 --json "$OUT/measure-$1.json" 2>&1 | tee "$log"
    ;;
  bench)
    rows=${1:?bench ROWS}
    shift
    mkdir -p "$VHN/bench"
    timeout "$STEP_LIMIT" "$PY" -m benchmarks.cuda_serving --model-dir "${MODEL_DIR:-$VHN/q35moe-8l}" --rows "$rows" \
      --out "$VHN/bench/cuda_serving.json" --row-timeout $((STEP_LIMIT - 30)) --resume "$@" 2>&1 | tee "$log"
    # the device tool brings back at most 8 files of $OUT: the JSON and the last 256 KiB of each row's log
    cp "$VHN/bench/cuda_serving.json" "$OUT"/ 2>/dev/null
    for f in "$VHN"/bench/*.log; do [ -e "$f" ] && tail -c 262144 "$f" > "$OUT/$(basename "$f")"; done
    ;;
  *)
    echo "unknown step $step" >&2
    exit 2
    ;;
esac
