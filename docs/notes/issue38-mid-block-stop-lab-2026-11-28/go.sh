set -x
P=${P:-python}
A="hitrate --trace check.jsonl --model qwen3.5-35b-a3b --tp 1 --kv-cache-gib 16 --policy upstream:pmu=64,ckpt --tokens-per-s 104566 --jobs 1 --json"
date
$P run.py $A > stop16.json 2> stop16.err
NO_STOP=1 $P run.py $A > nostop16.json 2> nostop16.err
date
$P run.py $A --host-cache-gib 256 > stop16h.json 2> stop16h.err
NO_STOP=1 $P run.py $A --host-cache-gib 256 > nostop16h.json 2> nostop16h.err
date
