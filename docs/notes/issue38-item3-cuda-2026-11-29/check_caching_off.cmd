PYTHONPATH=/work/wt-h20 nice -n 10 /work/main/.venv/bin/python docs/notes/issue38-item3-cuda-2026-11-29/cf5.py plain caching-off check 16 0
wall 18 s
