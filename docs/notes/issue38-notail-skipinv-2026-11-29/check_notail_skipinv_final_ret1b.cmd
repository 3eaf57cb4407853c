PYTHONPATH=/work/wt-h24 nice -n 10 /work/main/.venv/bin/python docs/notes/issue38-notail-skipinv-2026-11-29/cf7.py notail_skipinv upstream:ret=1b,pmu=64,ckpt=final check 16 256
start 2026-11-29T16:59:17Z
wall 40 s
