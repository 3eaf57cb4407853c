"""The ``vllm-hybrid-npu`` console script.

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and ``run(args) -> int``
(the exit code); modules are imported only when their subcommand runs, so ``--help`` is fast and a
subcommand's heavy imports (vLLM, torch) never slow the others down.
"""

from __future__ import annotations

import argparse
import importlib
import sys

#: subcommand -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "make-model": (
        "vllm_hybrid_npu.tools.make_model",
        "write a tiny random-weight hybrid checkpoint (GDN + attention) and a local tokenizer",
    ),
    "wheelhouse": (
        "vllm_hybrid_npu.tools.wheelhouse",
        "build an offline wheelhouse for an air-gapped site (cuda, npu) and install from it",
    ),
    "demo": (
        "vllm_hybrid_npu.tools.demo",
        "serve a hybrid model with --enable-prefix-caching --mamba-cache-mode align and show hits",
    ),
}


def build_parser(
    prog: str = "vllm-hybrid-npu",
    subcommands: dict[str, tuple[str, str]] | None = None,
    description: str = "Prefix caching for hybrid (GDN/Mamba + attention) models on vLLM / vllm-ascend.",
) -> argparse.ArgumentParser:
    """Return the top-level parser with one subparser per entry of ``subcommands`` (default
    :data:`SUBCOMMANDS`; the lab's console script passes its own)."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    from vllm_hybrid_npu import __version__

    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module_name, help_text) in (subcommands or SUBCOMMANDS).items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module_name)
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.startswith(("vllm_hybrid_npu", "benchmarks")):
                p.set_defaults(_missing=str(exc))
                continue
            raise
        module.add_arguments(p)
    return parser


def main(argv: list[str] | None = None, **parser_kwargs) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the subcommand and return its exit code.

    ``parser_kwargs`` go to :func:`build_parser` (``prog``, ``subcommands``, ``description``)."""
    parser = build_parser(**parser_kwargs)
    args = parser.parse_args(argv)
    if getattr(args, "_missing", None):
        parser.error(f"{args.command} is not available in this installation: {args._missing}")
    module = importlib.import_module(args._module)
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
