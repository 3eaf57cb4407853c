PYTHONPATH=/work/wt-h19 nice -n 10 /work/main/.venv/bin/python docs/notes/issue38-item3-final-2026-11-29/cf4.py plain upstream:ckpt fit
wall 38 s
