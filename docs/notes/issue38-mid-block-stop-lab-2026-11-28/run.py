import os, sys
from vllm_hybrid_npu_lab import exporter
if os.environ.get("NO_STOP"):
    exporter.apply_mid_block_stop = lambda scheduler: False
from vllm_hybrid_npu_lab.__main__ import main
sys.exit(main(sys.argv[1:]))
