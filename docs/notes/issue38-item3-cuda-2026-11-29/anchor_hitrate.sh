#!/bin/bash
# the anchor: the lab's own `hitrate` on the check part (requests 1,501-3,000 of the trace as
# their own file, CHECK_PART; the same rate as cf5, advise's 104,565.76 tokens/s; the same
# max_model_len, the 3,000's longest request being in this part) for the block's unit and pmu 64
# as installed at ret=2b,ckpt=final. Writes anchor_hitrate.cmd / anchor_hitrate.json here.
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../../.." && pwd)
cd "$root"
mkdir -p /tmp/h20
sed -n 1501,3000p ../shared/data/mooncake_synthetic_trace.jsonl > /tmp/h20/check_part.jsonl
cmd="python -m vllm_hybrid_npu_lab hitrate --trace /tmp/h20/check_part.jsonl --model qwen3.5-35b-a3b --tp 1 --kv-cache-gib 16 --host-cache-gib 256 --policy upstream:ret=2b,ckpt=final upstream:ret=2b,pmu=64,ckpt=final --tokens-per-s 104565.75947627175 --json --quiet"
echo "sed -n 1501,3000p ../shared/data/mooncake_synthetic_trace.jsonl > /tmp/h20/check_part.jsonl" > "$here/anchor_hitrate.cmd"
echo "PYTHONPATH=$root nice -n 10 /work/main/.venv/bin/$cmd" >> "$here/anchor_hitrate.cmd"
start=$(date +%s)
PYTHONPATH="$root" nice -n 10 /work/main/.venv/bin/$cmd > /tmp/h20_anchor.out 2> /tmp/h20_anchor.err
cp /tmp/h20_anchor.out "$here/anchor_hitrate.json"
echo "wall $(( $(date +%s) - start )) s" >> "$here/anchor_hitrate.cmd"
