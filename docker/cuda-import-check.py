"""Import check of the CUDA image (docker/Dockerfile.cuda-wheelhouse), run as a build step.

A build has no GPU, so nothing is served: this imports vLLM, loads its compiled CUDA extensions
(which resolve libtorch and libcudart.so.13 of the nvidia-* wheels at load time), imports the
plugin and runs its registration the way vLLM's plugin loader does. Exits non-zero on failure.
"""

import importlib.metadata as md
import sys

import torch

print(f"cuda-import-check: python {sys.version.split()[0]}, torch {torch.__version__} "
      f"(CUDA {torch.version.cuda}), GPU visible: {torch.cuda.is_available()}")

import vllm  # noqa: E402

print(f"cuda-import-check: vllm {vllm.__version__} from {vllm.__file__}")

# vLLM's main ops and MoE ops (libtorch stable ABI) and FlashAttention 3: dlopen resolves every
# library they link, so this fails if libcudart/libtorch are missing or of the wrong ABI.
import vllm._C_stable_libtorch  # noqa: E402,F401
import vllm._moe_C_stable_libtorch  # noqa: E402,F401
import vllm.vllm_flash_attn._vllm_fa3_C  # noqa: E402,F401

print("cuda-import-check: loaded vllm._C_stable_libtorch, vllm._moe_C_stable_libtorch, "
      "vllm.vllm_flash_attn._vllm_fa3_C")

eps = [ep for ep in md.entry_points(group="vllm.general_plugins") if ep.name == "vllm_hybrid_npu"]
assert eps, "the vllm.general_plugins entry point vllm_hybrid_npu is not installed"
register = eps[0].load()
register()
print(f"cuda-import-check: plugin vllm-hybrid-npu {md.version('vllm-hybrid-npu')} registered "
      f"({eps[0].value})")
print("cuda-import-check: PASS")
