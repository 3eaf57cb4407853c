"""Generated parts of docs/: rendered from the live code, compared by tests/docs/, rewritten here.

* every ``--help`` block: a heading ``### `COMMAND --help` `` followed by a fenced block holds
  what COMMAND's real parser prints (``COLUMNS=100``); COMMAND is ``vllm-hybrid-npu SUB``,
  ``vllm-hybrid-npu-lab SUB`` or ``python -m MODULE`` (a module with ``main(argv)``);
* the table of the "Environment variables" section of docs/configuration.md:
  :func:`vllm_hybrid_npu.envs.markdown_table`.

    python docs/sync.py           # list what is out of date (exit 1 if anything)
    python docs/sync.py --write   # rewrite it

(The README's demo block is written by ``vllm-hybrid-npu demo --readme README.md``: it needs
two real servers, so it is not redone here.)
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
HELP_COLUMNS = 100
HELP_HEADING = re.compile(r"^#+ `(?P<cmd>[^`]+?) --help`\s*$")
ENV_SECTION = "## Environment variables"
OPTIONS_SECTION = "### Options"


@dataclass
class Block:
    """A generated region of a doc: ``text[start:end]`` should equal ``expected``."""

    path: Path
    what: str
    start: int
    end: int
    current: str
    expected: str

    @property
    def stale(self) -> bool:
        return self.current != self.expected


def render_help(command: str) -> str:
    """What ``COMMAND --help`` prints, from the real parser, at :data:`HELP_COLUMNS` columns.

    Raises:
        ValueError: a command form this module does not know.
    """
    words = command.split()
    if words[0] == "vllm-hybrid-npu":
        from vllm_hybrid_npu.cli import main as run, SUBCOMMANDS  # noqa: F401

        call = lambda: run([*words[1:], "--help"])  # noqa: E731
    elif words[0] == "vllm-hybrid-npu-lab":
        from vllm_hybrid_npu_lab.__main__ import main as run

        call = lambda: run([*words[1:], "--help"])  # noqa: E731
    elif words[:2] == ["python", "-m"] and len(words) == 3:
        module = importlib.import_module(words[2])
        argv0 = module.__file__  # what ``python -m`` puts in sys.argv[0]
        call = lambda: _with_argv0(argv0, lambda: module.main(["--help"]))  # noqa: E731
    else:
        raise ValueError(f"no renderer for a `{command} --help` block")
    out = io.StringIO()
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(HELP_COLUMNS)
    try:
        with contextlib.redirect_stdout(out):
            try:
                call()
            except SystemExit:
                pass
    finally:
        if old is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old
    return out.getvalue().rstrip("\n") + "\n"


def _with_argv0(argv0, fn):
    old = sys.argv[:]
    sys.argv[:] = [argv0]
    try:
        return fn()
    finally:
        sys.argv[:] = old


def help_blocks(path: Path) -> list[Block]:
    """The ``--help`` blocks of ``path``: the fenced block right after each heading."""
    text = path.read_text()
    blocks = []
    for m in re.finditer(r"^#+ `[^`\n]+ --help`[ \t]*$", text, flags=re.M):
        cmd = HELP_HEADING.match(m.group(0)).group("cmd")
        fence = re.compile(r"\n```[^\n]*\n(.*?)^```", re.S | re.M).search(text, m.end())
        if fence is None or text[m.end():fence.start()].strip():
            raise ValueError(f"{path.name}: heading `{cmd} --help` is not followed by a fenced block")
        blocks.append(Block(path, f"`{cmd} --help`", fence.start(1), fence.end(1),
                            fence.group(1), render_help(cmd)))
    return blocks


def _table_block(path: Path, heading: str, label: str, expected: str) -> Block:
    """The first table after ``heading`` in ``path``, to be ``expected``."""
    text = path.read_text()
    m = re.compile(r"^\|.*\n(?:\|.*\n)*", re.M).search(text, text.index(heading))
    return Block(path, label, m.start(), m.end(), m.group(0), expected + "\n")


def env_block(path: Path = DOCS / "configuration.md") -> Block:
    """The first table after the "Environment variables" heading of ``path``."""
    from vllm_hybrid_npu.envs import markdown_table

    return _table_block(path, ENV_SECTION, "environment variable table", markdown_table())


def options_block(path: Path = DOCS / "configuration.md") -> Block:
    """The first table after the "Options" heading of ``path``."""
    from vllm_hybrid_npu.envs import options_markdown_table

    return _table_block(path, OPTIONS_SECTION, "options table", options_markdown_table())


_DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
_CMD_WORDS = (r"(?:[A-Z_]+=\S+ )*(?:python3?|vllm-hybrid-npu(?:-lab)?|vllm serve|make|pytest|bash|"
              r"docker|nice|timeout|curl)\b")
#: a backticked command line, a shell fence, or a fence whose first line is a command
_COMMAND = re.compile(
    rf"`{_CMD_WORDS}[^`]*`|^\s*```(?:bash|sh|console)\s*$|^\s*```\s*\n\s*{_CMD_WORDS}", re.M)


#: a table of configuration values rather than measurements names its source just above it
_STATIC = re.compile(r"\bvalues from\b", re.I)


@dataclass
class NumericTable:
    """A Markdown table with numbers in its body, and whether its section names the command
    and the date that produced them."""

    path: Path
    line: int  #: 1-based line of the table's header
    has_command: bool
    has_date: bool

    @property
    def ok(self) -> bool:
        return self.has_command and self.has_date

    def __str__(self) -> str:
        lacks = [w for w, ok in (("command", self.has_command), ("date", self.has_date)) if not ok]
        return f"{self.path.relative_to(ROOT)}:{self.line}: numeric table without a nearby {' or '.join(lacks)}"


_NUMERIC_CELL = re.compile(
    r"^[-+~≈<>≤≥]*\s*\d[\d,]*(?:\.\d+)?\s*(?:%|x|×|ms|s|us|µs|GiB|MiB|GB/s|tokens|blocks)?"
    r"(?:\s*(?:,|/|-|–)\s*\d[\d,]*(?:\.\d+)?\s*(?:%|x|×|ms|s)?)*"
    r"(?:\s*\([^)]*\))?$")


def _numbers_in(body: list[str]) -> bool:
    """Whether some column of a table body is mostly measurements: at least half of its cells
    (and at least one) are numbers, with units, percentages or lists of numbers."""
    rows = [[c.strip() for c in r.strip().strip("|").split("|")] for r in body]
    width = max((len(r) for r in rows), default=0)
    for col in range(width):
        cells = [r[col] for r in rows if col < len(r)]
        clean = [re.sub(r"\*\*|__|`", "", c).strip() for c in cells]
        numeric = sum(bool(_NUMERIC_CELL.match(c)) for c in clean if c)
        if numeric and numeric * 2 >= len(cells):
            return True
    return False


def numeric_tables(path: Path, after: int = 6) -> list[NumericTable]:
    """Tables of ``path`` with a column of measurements (see :func:`_numbers_in`), each with whether its *section* (from the previous heading to ``after`` lines past the
    table) carries a command (a backticked command line or a shell fence) and a date
    (``YYYY-MM-DD``): the docs' rule that every number names the command and date behind it."""
    lines = path.read_text().splitlines()
    out = []
    i = 0
    in_fence = False
    heading = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("```"):
            in_fence = not in_fence
        if not in_fence and re.match(r"^#{1,2} ", line):
            heading = i
        if not in_fence and line.startswith("|") and i + 1 < len(lines) and re.match(r"^\|[-:| ]+\|\s*$", lines[i + 1]):
            j = i + 2
            while j < len(lines) and lines[j].startswith("|"):
                j += 1
            if _numbers_in(lines[i + 2:j]):
                context = "\n".join(lines[heading:min(len(lines), j + after)])
                static = bool(_STATIC.search("\n".join(lines[max(heading, i - 8):i])))
                out.append(NumericTable(path, i + 1, static or bool(_COMMAND.search(context)),
                                        static or bool(_DATE.search(context))))
            i = j
            continue
        i += 1
    return out


def all_blocks() -> list[Block]:
    blocks = []
    for path in sorted(DOCS.glob("*.md")):
        blocks += help_blocks(path)
    blocks.append(env_block())
    blocks.append(options_block())
    return blocks


def write(blocks: list[Block]) -> None:
    """Rewrite every stale block (regions of one file replaced back to front)."""
    by_path: dict[Path, list[Block]] = {}
    for b in blocks:
        if b.stale:
            by_path.setdefault(b.path, []).append(b)
    for path, bs in by_path.items():
        text = path.read_text()
        for b in sorted(bs, key=lambda b: -b.start):
            text = text[: b.start] + b.expected + text[b.end:]
        path.write_text(text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="check / rewrite the generated parts of docs/")
    ap.add_argument("--write", action="store_true", help="rewrite the stale blocks")
    ap.add_argument("--numbers", action="store_true",
                    help="list numeric tables whose section names no command or no date")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    if args.numbers:
        bad = [t for p in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))] for t in numeric_tables(p)
               if not t.ok]
        print("\n".join(map(str, bad)) or "every numeric table names its command and date")
        return 1 if bad else 0
    blocks = all_blocks()
    stale = [b for b in blocks if b.stale]
    for b in stale:
        print(f"{b.path.relative_to(ROOT)}: {b.what} is out of date")
    if args.write:
        write(blocks)
        print(f"rewrote {len(stale)} block(s)")
        return 0
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
