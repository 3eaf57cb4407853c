python -m vllm_hybrid_npu_lab hitrate --trace /tmp/h15_check_part.jsonl --model qwen3.5-35b-a3b --tp 1 --kv-cache-gib 16 --policy upstream:ret=4b,ckpt --host-cache-gib 256 --tokens-per-s 104566
wall 65 s
