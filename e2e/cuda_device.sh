#!/usr/bin/env bash
# One step of the CUDA e2e run / serving benchmark on a lent GPU machine (issue #14; docs/cuda.md,
# "Runbook"). Run from the repository root on the machine, one step per device call:
#
#   bash e2e/cuda_device.sh stash DIR...      copy carried wheelhouse batch folders to $VHN/wheelhouse
#   bash e2e/cuda_device.sh install           install them (and this project) into $VHN/site
#   bash e2e/cuda_device.sh e2e FILE...       pytest -rA of e2e files on the CUDA target
#   bash e2e/cuda_device.sh measure SCENARIO [ARGS...]   e2e/measure_on_off.py on CUDA
#   bash e2e/cuda_device.sh bench ROWS [ARGS...]         benchmarks.cuda_serving --resume
#   bash e2e/cuda_device.sh reap              only the clean-up below, and the GPU's holders
#
# MODEL_DIR overrides the benchmark's model (default: the Qwen3.5-35B-A3B-shaped config of the
# step's --arch and --layers, $VHN/q35moe-8l for the defaults, written on first use; dummy
# weights), BENCH_NAME its JSON's name (default cuda_serving). State lives outside the work tree under $VHN (default /tmp/vhn): the device keeps it only for
# back-to-back calls. Logs, pytest's junit XML and the benchmark JSON are copied to $OUT (the
# folder the device tool brings back, at most 8 files a call). Every step stops itself at
# $STEP_LIMIT seconds (default 570), under the tool's 600 s per call; chain steps in one call
# with && and a smaller STEP_LIMIT. The benchmark bounds itself (--call-budget STEP_LIMIT - 20)
# and resumes across calls.
#
# Clean-up (issue 21: a timed-out step left `vllm serve` processes holding 31 GiB, and the next
# call failed vLLM's free-memory check): every process a step starts carries VHN_ROOT=$VHN in its
# environment (inherited, also by servers started in a new session); before and after every step
# (trap EXIT) those left over are sent SIGTERM, then SIGKILL, except this script and its
# ancestors; then the GPU's compute processes are listed in the step's log.
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
# Multi-GPU machines (tensor parallel, issue 31): NVLink multicast stays off (the lent machines'
# rule: it can take the host's shared GPUs out of service), also for vLLM's symmetric-memory
# all-reduce, which would try multimem first; NCCL's ring/tree all-reduce remains.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 VLLM_ALLREDUCE_USE_SYMM_MEM=0

step=${1:?usage: cuda_device.sh stash|install|e2e|measure|bench|reap ...}
shift
log="$OUT/$step-$(date -u +%H%M%S).log"

ancestors() {  # this shell and its ancestors' pids, space-separated and padded
  local p=$$ out=" $$ "
  while [ "${p:-1}" -gt 1 ]; do
    p=$(sed 's/.*) //' "/proc/$p/stat" 2>/dev/null | cut -d' ' -f2)
    out+="${p:-1} "
  done
  echo "$out"
}

reap() {  # end what earlier steps left behind (processes with VHN_ROOT=$VHN in their environment)
  local keep pids=() d p
  keep=$(ancestors)
  for d in /proc/[0-9]*; do
    p=${d#/proc/}
    [[ "$keep" == *" $p "* ]] && continue
    [ "$(sed 's/.*) //' "$d/stat" 2>/dev/null | cut -c1)" = Z ] && continue  # a zombie holds nothing
    { tr '\0' '\n' < "$d/environ"; } 2>/dev/null | grep -qxF "VHN_ROOT=$VHN" && pids+=("$p")
  done
  if [ ${#pids[@]} -gt 0 ]; then
    echo "cuda_device.sh: ending leftover processes of earlier steps: ${pids[*]}"
    for p in "${pids[@]}"; do echo "  $p: $(tr '\0' ' ' < "/proc/$p/cmdline" 2>/dev/null | cut -c1-160)"; done
    kill -TERM "${pids[@]}" 2>/dev/null
    for _ in 1 2 3 4 5 6 7 8 9 10; do
      local alive=()
      for p in "${pids[@]}"; do [ -e "/proc/$p" ] && alive+=("$p"); done
      [ ${#alive[@]} -eq 0 ] && break
      sleep 1
    done
    for p in "${pids[@]}"; do [ -e "/proc/$p" ] && kill -KILL "$p" 2>/dev/null; done
  fi
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=memory.used,memory.free,memory.total --format=csv,noheader
    nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader
  fi
}

reap 2>&1 | tee -a "$log"
export VHN_ROOT="$VHN" VHN_STEP="$step-$$"
trap 'reap >>"$log" 2>&1' EXIT

case "$step" in
  stash)
    mkdir -p "$VHN/wheelhouse"
    for d in "$@"; do cp -r "$d"/. "$VHN/wheelhouse/"; done
    ls -la "$VHN/wheelhouse" | tee -a "$log"
    ;;
  install)
    {
      "$PY" vllm_hybrid_npu/tools/wheelhouse.py install --wheelhouse "$VHN/wheelhouse" --target "$VHN/site" &&
      "$PY" -m pip install --no-deps --no-build-isolation --no-index --target "$VHN/site" . &&
      "$PY" -c "import torch, vllm, vllm_hybrid_npu; print('torch', torch.__version__, 'vllm', vllm.__version__, 'cuda', torch.cuda.get_device_name(0))" &&
      nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    } 2>&1 | tee -a "$log"
    ;;
  e2e)
    name=$(basename -s .py "${1:-e2e}")
    timeout -k 15 "$STEP_LIMIT" "$PY" -m pytest "$@" -rA -p no:cacheprovider -o addopts="" \
      --junitxml="$OUT/junit-$name.xml" 2>&1 | tee -a "$log"
    ;;
  measure)
    timeout -k 15 "$STEP_LIMIT" "$PY" e2e/measure_on_off.py "$@" --top 20 --json "$OUT/measure-$1.json" 2>&1 | tee -a "$log"
    ;;
  bench)
    rows=${1:?bench ROWS}
    shift
    name=${BENCH_NAME:-cuda_serving}  # one JSON per run (another model: another name)
    mkdir -p "$VHN/bench"
    # the harness stops starting work at its --call-budget and kills its rows' process groups on
    # SIGTERM; timeout -k is the last resort (the rows die with it: PR_SET_PDEATHSIG)
    # without MODEL_DIR the harness picks $VHN/<q35moe|qnext>-<layers>l after --arch and --layers
    # (one folder per depth: --layers 24 never reuses the 8-layer config)
    VHN="$VHN" timeout -k 15 "$STEP_LIMIT" "$PY" -m benchmarks.cuda_serving ${MODEL_DIR:+--model-dir "$MODEL_DIR"} --rows "$rows" \
      --out "$VHN/bench/$name.json" --call-budget $((STEP_LIMIT - 20)) --resume "$@" 2>&1 | tee -a "$log"
    rc=$?  # the harness's status (3: nothing measured in this call), the device call's rc
    # the device tool brings back at most 8 files of $OUT: the JSON and the last 256 KiB of each row's log
    cp "$VHN/bench/$name.json" "$OUT"/ 2>/dev/null
    for f in "$VHN/bench/$name".*.log; do [ -e "$f" ] && tail -c 262144 "$f" > "$OUT/$(basename "$f")"; done
    exit "$rc"
    ;;
  reap)
    ;;
  *)
    echo "unknown step $step" >&2
    exit 2
    ;;
esac
