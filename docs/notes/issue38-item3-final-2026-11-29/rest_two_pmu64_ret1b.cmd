PYTHONPATH=/work/wt-h19 nice -n 10 /work/main/.venv/bin/python docs/notes/issue38-item3-final-2026-11-29/cf4.py two upstream:ret=1b,pmu=64,ckpt=final rest
wall 19 s
