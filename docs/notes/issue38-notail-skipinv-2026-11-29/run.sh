#!/bin/bash
# usage: run.sh NAME MODE POLICY PART [KV HOST]   (cf7.py's arguments; PART fit = requests 1-1,500,
#        check = 1,501-3,000 of advise --limit 3000 on ../shared/data/mooncake_synthetic_trace.jsonl)
# Writes NAME.cmd (the command and its wall time) and NAME.json (cf7.py's JSON line) here.
# cwd: the repository root; PYTHONPATH the repository root; one replay at a time, nice 10.
set -e
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../../.." && pwd)
name=$1; shift
cd "$root"
cmd="python docs/notes/issue38-notail-skipinv-2026-11-29/cf7.py $*"
echo "PYTHONPATH=$root nice -n 10 /work/main/.venv/bin/$cmd" > "$here/$name.cmd"
echo "start $(date -u +%FT%TZ)" >> "$here/$name.cmd"
start=$(date +%s)
PYTHONPATH="$root" nice -n 10 /work/main/.venv/bin/$cmd > "/tmp/h24_$name.out" 2> "/tmp/h24_$name.err"
grep '^{' "/tmp/h24_$name.out" | tail -1 > "$here/$name.json"
echo "wall $(( $(date +%s) - start )) s" >> "$here/$name.cmd"
