"""Run vLLM here as it runs on an x86 CPU without AVX-512 (e.g. an AMD EPYC without it).

Put this folder on ``PYTHONPATH`` (``make test-no-avx512``): Python imports ``sitecustomize`` at
start-up in every process, vLLM's server subprocesses included, and this one makes torch report
neither AVX-512 nor AVX-512-BF16. vLLM 0.30.0's CPU platform (``vllm/platforms/cpu.py``) reads
exactly these two probes to choose what differs between the two kinds of CPU this project's CI
runs on: the SSM state dtype (float32 only with AVX-512-BF16, else the model's bf16), hence the
hybrid block size (384 against 256 tokens for the tiny Qwen3-Next), the conv state layout
(``VLLM_SSM_CONV_STATE_LAYOUT=SD`` only with AVX-512-BF16) and the extension it loads
(``vllm._C_AVX512`` or ``vllm._C``). torch's own kernels keep dispatching on the real CPU.
"""

import torch.cpu as _cpu

_cpu._is_avx512_supported = lambda: False
_cpu._is_avx512_bf16_supported = lambda: False
