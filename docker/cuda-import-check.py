"""Import check of the CUDA image (docker/Dockerfile.cuda-wheelhouse), run as a build step.

A build has no GPU and no NVIDIA driver, so nothing is served. This imports torch (the CUDA
build), vLLM and the plugin, runs the plugin's registration the way vLLM's plugin loader does,
and checks that vLLM's compiled CUDA extensions find every shared library they link except the
driver's ``libcuda.so.1``, which the NVIDIA container runtime mounts from the host at
``docker run --gpus`` (the extensions cannot be loaded without it). Exits non-zero on failure.
"""

import importlib.metadata as md
import os
import subprocess
import sys
from pathlib import Path

import torch

print(f"cuda-import-check: python {sys.version.split()[0]}, torch {torch.__version__} "
      f"(CUDA {torch.version.cuda}), GPU visible: {torch.cuda.is_available()}")
assert torch.version.cuda, "torch is not a CUDA build"

import vllm  # noqa: E402

print(f"cuda-import-check: vllm {vllm.__version__} from {vllm.__file__}")

eps = [ep for ep in md.entry_points(group="vllm.general_plugins") if ep.name == "vllm_hybrid_npu"]
assert eps, "the vllm.general_plugins entry point vllm_hybrid_npu is not installed"
eps[0].load()()
print(f"cuda-import-check: plugin vllm-hybrid-npu {md.version('vllm-hybrid-npu')} registered "
      f"({eps[0].value})")

# The libraries an imported torch puts in the process: libtorch*, and the nvidia-* wheels' CUDA
# runtime, cuBLAS, ... (torch loads them from site-packages/nvidia/*/lib).
site = Path(torch.__file__).parents[1]
lib_dirs = [Path(torch.__file__).parent / "lib"]
lib_dirs += sorted({p.parent for p in (site / "nvidia").rglob("lib*.so*")})
env = {**os.environ, "LD_LIBRARY_PATH": ":".join(map(str, lib_dirs))}
extensions = ["vllm/_C_stable_libtorch.abi3.so", "vllm/_moe_C_stable_libtorch.abi3.so",
              "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so"]
failed = False
for ext in extensions:
    out = subprocess.run(["ldd", str(site / ext)], env=env, capture_output=True, text=True,
                         check=True).stdout
    linked = [line.split()[0] for line in out.splitlines() if "=>" in line]
    missing = sorted(line.split()[0] for line in out.splitlines() if "not found" in line)
    ok = missing in ([], ["libcuda.so.1"])
    failed |= not ok
    print(f"cuda-import-check: {ext}: {len(linked)} libraries linked, unresolved: "
          f"{missing or 'none'}{'' if ok else '  <- FAIL'}")
    if "libcudart.so.13" in out:
        print(f"cuda-import-check:   libcudart.so.13 => "
              f"{next(l.split('=>')[1].split()[0] for l in out.splitlines() if 'libcudart.so.13' in l)}")
print("cuda-import-check: FAIL" if failed else "cuda-import-check: PASS (libcuda.so.1 comes from "
      "the host's driver at run time)")
sys.exit(1 if failed else 0)
