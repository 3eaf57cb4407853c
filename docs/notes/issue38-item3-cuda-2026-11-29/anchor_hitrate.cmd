sed -n 1501,3000p ../shared/data/mooncake_synthetic_trace.jsonl > /tmp/h20/check_part.jsonl
PYTHONPATH=/work/wt-h20 nice -n 10 /work/main/.venv/bin/python -m vllm_hybrid_npu_lab hitrate --trace /tmp/h20/check_part.jsonl --model qwen3.5-35b-a3b --tp 1 --kv-cache-gib 16 --host-cache-gib 256 --policy upstream:ret=2b,ckpt=final upstream:ret=2b,pmu=64,ckpt=final --tokens-per-s 104565.75947627175 --json --quiet
wall 86 s
