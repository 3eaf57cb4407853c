python -m vllm_hybrid_npu_lab hitrate --trace /tmp/h15_check_part.jsonl --model qwen3.5-35b-a3b --tp 1 --kv-cache-gib 16 --tokens-per-s 104566 --host-cache-gib 384 --policy upstream:ret=1b upstream:ret=2b upstream:ret=1b,ckpt upstream:ret=2b,ckpt upstream:ret=4b,ckpt upstream:ret=8b,ckpt
wall 165 s
