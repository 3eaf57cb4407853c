PYTHONPATH=/work/wt-h20 nice -n 10 /work/main/.venv/bin/python docs/notes/issue38-item3-cuda-2026-11-29/cf5.py two_notail upstream:ret=2b,pmu=64,ckpt=final check
wall 36 s
