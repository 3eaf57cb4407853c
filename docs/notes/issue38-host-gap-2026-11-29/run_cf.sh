#!/bin/bash
# usage: run_cf.sh NAME [--keep-on-retention] ARGS...  (cf_drop_chunk_checkpoints.py on the check part)
set -e
name=$1; shift
cd /work/wt-h15/docs/notes/issue38-host-gap-2026-11-29
cmd="python cf_drop_chunk_checkpoints.py $* --trace /tmp/h15_check_part.jsonl --model qwen3.5-35b-a3b --tp 1 --kv-cache-gib 16 --tokens-per-s 104566"
echo "$cmd" > $name.cmd
start=$(date +%s)
PYTHONPATH=/work/wt-h15 timeout 1500 /work/main/.venv/bin/$cmd --json --quiet > /tmp/h15_$name.out 2> /tmp/h15_$name.err
sed -n '/^{/,$p' /tmp/h15_$name.out > $name.json
grep cf_drop /tmp/h15_$name.err >> $name.cmd || true
echo "wall $(( $(date +%s) - start )) s" >> $name.cmd
