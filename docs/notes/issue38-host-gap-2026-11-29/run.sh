#!/bin/bash
# usage: run.sh NAME ARGS...  (replays the check part: requests 1501-3000 of the shared trace)
# CHECK_PART = sed -n 1501,3000p /work/shared/data/mooncake_synthetic_trace.jsonl > /tmp/h15_check_part.jsonl
set -e
name=$1; shift
cd /work/wt-h15/docs/notes/issue38-host-gap-2026-11-29
cmd="python -m vllm_hybrid_npu_lab hitrate --trace /tmp/h15_check_part.jsonl --model qwen3.5-35b-a3b --tp 1 --kv-cache-gib 16 --tokens-per-s 104566 $*"
echo "$cmd" > $name.cmd
start=$(date +%s)
PYTHONPATH=/work/wt-h15 timeout 1500 /work/main/.venv/bin/$cmd --json --quiet > $name.json 2> /tmp/h15_$name.err
echo "wall $(( $(date +%s) - start )) s" >> $name.cmd
