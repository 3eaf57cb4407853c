PYTHONPATH=/work/wt-h23 nice -n 10 /work/main/.venv/bin/python docs/notes/issue38-skipinv-2026-11-29/cf6.py skipinv upstream:pmu=64,ckpt fit 16 256
start 2026-11-29T16:47:57Z
wall 38 s
