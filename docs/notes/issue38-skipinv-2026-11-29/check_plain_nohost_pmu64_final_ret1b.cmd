PYTHONPATH=/work/wt-h23 nice -n 10 /work/main/.venv/bin/python docs/notes/issue38-skipinv-2026-11-29/cf6.py plain upstream:ret=1b,pmu=64,ckpt=final check 16 0
start 2026-11-29T16:52:30Z
wall 27 s
