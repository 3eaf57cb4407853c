#!/bin/bash
# usage: run.sh NAME MODE POLICY PART [KV HOST]   (PART: fit = requests 1-1,500, check = 1,501-3,000
#        of advise --limit 3000 on ../shared/data/mooncake_synthetic_trace.jsonl, read in place)
# Writes NAME.cmd (the command and its wall time) and NAME.json (cf5.py's JSON line) here.
# Run from the worktree root's parent layout: cwd is the repository root (the trace path is
# ../shared/data/... from there), PYTHONPATH the repository root, one replay at a time, nice 10.
set -e
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../../.." && pwd)
name=$1; shift
cd "$root"
cmd="python docs/notes/issue38-item3-cuda-2026-11-29/cf5.py $*"
echo "PYTHONPATH=$root nice -n 10 /work/main/.venv/bin/$cmd" > "$here/$name.cmd"
start=$(date +%s)
PYTHONPATH="$root" nice -n 10 /work/main/.venv/bin/$cmd > "/tmp/h20_$name.out" 2> "/tmp/h20_$name.err"
grep '^{' "/tmp/h20_$name.out" | tail -1 > "$here/$name.json"
echo "wall $(( $(date +%s) - start )) s" >> "$here/$name.cmd"
