"""Counterfactual (2026-11-30, lab only): the runtime's junction entries bound on a `--target npu`
replay beside a host tier, where the runtime turns them off (`junctions_off`: a KV connector on
vllm-ascend's paths) and the lab follows it (`replay.junctions_modelled`).

    PYTHONPATH=. .venv/bin/python docs/notes/issue38-item3-junction-2026-11-30/jx.py on|off \
        hitrate --trace CHECK_PART --target npu ...   # any `vllm-hybrid-npu-lab` command line

`on`: `junctions_modelled` answers True for npu with a connector too; `off`: as installed.
"""
import sys

import vllm_hybrid_npu_lab.replay as r

if sys.argv[1] == "on":
    orig = r.junctions_modelled
    r.junctions_modelled = lambda target, connector: True if target == "npu" else orig(target, connector)
elif sys.argv[1] != "off":
    raise SystemExit("first argument: on or off")
from vllm_hybrid_npu_lab.__main__ import main  # noqa: E402

sys.argv = ["vllm-hybrid-npu-lab"] + sys.argv[2:]
main()
