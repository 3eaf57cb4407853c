"""``e2e/cpu_kinds/no_avx512`` (``make test-no-avx512``) must not share torch inductor's cache
with processes on the real CPU.

Under that ``sitecustomize`` torch reports no AVX-512, so inductor generates its CPU kernels for
AVX2 (8 float lanes); its FX graph cache key (torch 2.13) does not include the vector ISA, so an
AVX-512 process sharing the cache loads the 8-lane source and builds it with AVX-512 flags. Seen
2026-11-26: ``e2e/test_worker_patches.py``'s workload died with glibc's "double free or
corruption" in vLLM's ``compiled_random_sample`` (16-lane stores every 8 floats write past the
buffer). The check here is the deterministic symptom of the same mix-up: a compiled rank count
(vLLM's logprob rank, ``(x >= y[:, None]).sum(-1)``) counts 8 phantom lanes per step.

Two fresh processes share one starting cache directory: the first compiles under the
``sitecustomize``, the second on the real CPU; the second's result must equal eager. Random
logits from the test's seed (printed on failure).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

SITE = pathlib.Path(__file__).resolve().parents[1] / "e2e" / "cpu_kinds" / "no_avx512"

RANK = r"""
import json, sys, torch
from torch._inductor.cpu_vec_isa import pick_vec_isa
seed, rows, vocab = json.loads(sys.argv[1])
g = torch.Generator().manual_seed(seed)
x = torch.randn(rows, vocab, generator=g).log_softmax(-1)
y = x[torch.arange(rows), torch.randint(vocab, (rows,), generator=g)]
rank = torch.compile(lambda x, y: (x >= y.unsqueeze(-1)).sum(-1), dynamic=True, backend="inductor")
print(json.dumps({"isa": str(pick_vec_isa()), "compiled": rank(x, y).tolist(),
                  "eager": (x >= y.unsqueeze(-1)).sum(-1).tolist()}))
"""


def _avx512_here() -> bool:
    return bool(torch.cpu._is_avx512_supported())


@pytest.mark.skipif(not _avx512_here(), reason="needs an AVX-512 CPU (the mix-up is AVX2 code built for AVX-512)")
def test_no_avx512_processes_do_not_share_the_inductor_cache(tmp_path, seed):
    args = json.dumps([seed, 3, 2048])  # vocab a multiple of 16: every step a full vector
    base = {k: v for k, v in os.environ.items()
            if k not in ("PYTHONPATH", "ATEN_CPU_CAPABILITY") and not k.startswith("TORCHINDUCTOR_")}
    base["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "inductor")
    base["VLLM_CACHE_ROOT"] = str(tmp_path / "vllm")
    runs = []
    for site in (str(SITE), None):
        env = dict(base, **({"PYTHONPATH": site} if site else {}))
        proc = subprocess.run([sys.executable, "-c", RANK, args], env=env,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    no_avx512, real = runs
    assert no_avx512["isa"].startswith("avx2"), no_avx512["isa"]  # the sitecustomize took effect
    assert no_avx512["compiled"] == no_avx512["eager"]
    assert real["isa"].startswith("avx512"), real["isa"]
    assert real["compiled"] == real["eager"], (
        f"inductor reused the no-AVX-512 process's kernel on {real['isa']}: {real}")


def test_no_avx512_caches_are_their_own(tmp_path):
    """The sitecustomize moves both caches once (a child inheriting them keeps them)."""
    probe = "import os; print(os.environ['TORCHINDUCTOR_CACHE_DIR'], os.environ['VLLM_CACHE_ROOT'])"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=str(SITE), TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "i"),
               VLLM_CACHE_ROOT=str(tmp_path / "v"))
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True,
                         timeout=300, check=True).stdout.split()
    assert out == [str(tmp_path / "i") + "-no_avx512", str(tmp_path / "v") + "-no_avx512"]
    env.update(TORCHINDUCTOR_CACHE_DIR=out[0], VLLM_CACHE_ROOT=out[1])  # a child process
    again = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True,
                           timeout=300, check=True).stdout.split()
    assert again == out
