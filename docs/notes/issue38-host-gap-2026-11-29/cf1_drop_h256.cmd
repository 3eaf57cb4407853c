python cf_drop_chunk_checkpoints.py --host-cache-gib 256 --policy upstream:ret=1b,ckpt upstream:ret=2b,ckpt upstream:ret=4b,ckpt upstream:ret=8b,ckpt upstream:ret=8b,lpt=1b,ckpt --trace /tmp/h15_check_part.jsonl --model qwen3.5-35b-a3b --tp 1 --kv-cache-gib 16 --tokens-per-s 104566
cf_drop_chunk_checkpoints: keep_on_retention=False {'dropped': 18114, 'kept': 7893}
wall 148 s
