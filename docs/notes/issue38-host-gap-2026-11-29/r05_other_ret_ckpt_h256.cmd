python -m vllm_hybrid_npu_lab hitrate --trace /tmp/h15_check_part.jsonl --model qwen3.5-35b-a3b --tp 1 --kv-cache-gib 16 --tokens-per-s 104566 --host-cache-gib 256 --policy upstream:ret=3b,ckpt upstream:ret=6b,ckpt upstream:ret=7b,ckpt upstream:ret=32b,ckpt upstream:ret=dense,ckpt
wall 147 s
