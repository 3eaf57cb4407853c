#!/bin/bash
# usage: run.sh NAME ARGS...            `hitrate` on the check part (requests 1,501-3,000)
#        run.sh --cf NAME ARGS...       the same through cf_drop_chunk_checkpoints.py (ARGS may
#                                       start with --keep-on-retention)
# Writes NAME.cmd (the command, its wall time) and NAME.json here. The check part, outside the
# project: sed -n 1501,3000p ../../../../shared/data/mooncake_synthetic_trace.jsonl > /tmp/h15_check_part.jsonl
# (run on 2026-11-29 from a worktree at /work/wt-h15; the .cmd files hold what ran).
set -e
cf=; [ "$1" = --cf ] && { cf=1; shift; }
name=$1; shift
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../../.." && pwd)
cd "$here"
common="--trace /tmp/h15_check_part.jsonl --model qwen3.5-35b-a3b --tp 1 --kv-cache-gib 16 --tokens-per-s 104566"
if [ -n "$cf" ]; then cmd="python cf_drop_chunk_checkpoints.py $* $common"
else cmd="python -m vllm_hybrid_npu_lab hitrate $common $*"; fi
echo "$cmd" > "$name.cmd"
start=$(date +%s)
PYTHONPATH="$root" timeout 1500 "$root/.venv/bin/"$cmd --json --quiet > "/tmp/h15_$name.out" 2> "/tmp/h15_$name.err"
sed -n '/^{/,$p' "/tmp/h15_$name.out" > "$name.json"   # the counterfactual prints a line first
[ -z "$cf" ] || grep cf_drop "/tmp/h15_$name.err" >> "$name.cmd" || true
echo "wall $(( $(date +%s) - start )) s" >> "$name.cmd"
