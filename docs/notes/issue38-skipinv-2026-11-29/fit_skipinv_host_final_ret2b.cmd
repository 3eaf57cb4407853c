PYTHONPATH=/work/wt-h23 nice -n 10 /work/main/.venv/bin/python docs/notes/issue38-skipinv-2026-11-29/cf6.py skipinv upstream:ret=2b,pmu=64,ckpt=final fit 16 256
start 2026-11-29T16:49:12Z
wall 37 s
