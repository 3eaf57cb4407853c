"""Run vLLM here as it runs on an x86 CPU without AVX-512 (e.g. an AMD EPYC without it).

Put this folder on ``PYTHONPATH`` (``make test-no-avx512``): Python imports ``sitecustomize`` at
start-up in every process, vLLM's server subprocesses included, and this one makes torch report
neither AVX-512 nor AVX-512-BF16 (nor AMX, which comes only with AVX-512). vLLM 0.30.0's CPU platform (``vllm/platforms/cpu.py``) reads
exactly these two probes to choose what differs between the two kinds of CPU this project's CI
runs on: the SSM state dtype (float32 only with AVX-512-BF16, else the model's bf16), hence the
hybrid block size (384 against 256 tokens for the tiny Qwen3-Next), the conv state layout
(``VLLM_SSM_CONV_STATE_LAYOUT=SD`` only with AVX-512-BF16) and the extension it loads
(``vllm._C_AVX512`` or ``vllm._C``). torch's own kernels keep dispatching on the real CPU.
"""

import os as _os

# torch inductor generates its CPU C++ kernels for the vector ISA it picks (here AVX2: 8 float
# lanes, read off torch.cpu._is_avx512_supported) but its FX graph cache key does not include that
# ISA (torch 2.13 FxGraphHashDetails). A process on the real CPU (AVX-512) that shares the cache
# would load the 8-lane source and build it with AVX-512 flags: full-vector stores then write 16
# lanes every 8 elements, past the end of its buffers (glibc "double free or corruption" /
# "free(): invalid next size" in vLLM's compiled_random_sample) or counting 8 phantom lanes
# (vLLM's logprob ranks off by the vocabulary size). These processes get their own cache.
_SUFFIX = "-no_avx512"
_base = _os.environ.get("TORCHINDUCTOR_CACHE_DIR")
if _base is None:  # torch's default (torch/_inductor/runtime/cache_dir_utils.py), not imported here
    import getpass as _getpass
    import tempfile as _tempfile

    try:
        _user = _getpass.getuser()
    except Exception:
        _user = f"uid_{_os.getuid()}"
    _base = _os.path.join(_tempfile.gettempdir(), "torchinductor_" + _user)
_base = _os.path.abspath(_base)
if not _base.endswith(_SUFFIX):  # a child process inherits the parent's already-moved cache
    _os.environ["TORCHINDUCTOR_CACHE_DIR"] = _base + _SUFFIX
# vLLM's own compilation cache (VLLM_CACHE_ROOT/torch_compile_cache, inductor artifacts keyed by
# vLLM's config hash, which names no vector ISA either; default as vllm/envs.py spells it) moves
# the same way
_vbase = _os.environ.get("VLLM_CACHE_ROOT") or _os.path.join(
    _os.environ.get("XDG_CACHE_HOME") or _os.path.expanduser("~/.cache"), "vllm")
_vbase = _os.path.abspath(_os.path.expanduser(_vbase))
if not _vbase.endswith(_SUFFIX):
    _os.environ["VLLM_CACHE_ROOT"] = _vbase + _SUFFIX

import torch.cpu as _cpu

_cpu._is_avx512_supported = lambda: False
_cpu._is_avx512_bf16_supported = lambda: False
# AMX (Intel Sapphire Rapids and later) comes only with AVX-512: on an Intel machine with AMX,
# vLLM 0.30's CPU linear layers take the AMX "SGL" kernels (check_cpu_sgl_kernel), which exist in
# vllm._C_AVX512 only, and fail in vllm._C ("no attribute 'convert_weight_packed'", seen on an
# Intel Xeon with AMX, 2026-11-28)
for _probe in ("_is_amx_tile_supported", "_is_amx_fp16_supported"):
    if hasattr(_cpu, _probe):
        setattr(_cpu, _probe, lambda: False)
