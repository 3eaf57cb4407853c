"""``vllm-hybrid-npu-lab`` / ``python -m vllm_hybrid_npu_lab``: the lab's console script.

The lab and the benchmarks live apart from the runtime package (:mod:`vllm_hybrid_npu`), which
imports nothing from them; they use the runtime like any other caller.
"""

from __future__ import annotations

import sys

#: subcommand -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "hitrate": (
        "vllm_hybrid_npu_lab.cli",
        "replay a request trace through vLLM's scheduler and report prefix-cache hit rates",
    ),
    "advise": (
        "vllm_hybrid_npu_lab.advise",
        "search vLLM's prefix-caching options on a trace; print the vllm serve flags to use",
    ),
}


def main(argv: list[str] | None = None) -> int:
    """Run a lab subcommand (see :data:`SUBCOMMANDS`) and return its exit code.

    Raises:
        ValueError: from :func:`vllm_hybrid_npu.envs.check`: a malformed
            ``VLLM_HYBRID_NPU_OPTIONS`` or a variable its keys replaced set (the lab replays the
            options the runtime would read, so it refuses what the runtime refuses).
    """
    from vllm_hybrid_npu import envs
    from vllm_hybrid_npu.cli import main as run_cli

    envs.check()
    return run_cli(
        argv,
        prog="vllm-hybrid-npu-lab",
        subcommands=SUBCOMMANDS,
        description="Hit-rate lab of vllm-hybrid-npu: trace replays through vLLM's own scheduler.",
    )


if __name__ == "__main__":
    sys.exit(main())
