"""``vllm_hybrid_npu.envs``: the one place the plugin reads its environment variables."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from vllm_hybrid_npu import envs

ROOT = Path(__file__).resolve().parents[1]


def test_get_strips_and_reads_at_call_time(monkeypatch):
    name = "VLLM_HYBRID_NPU_PREFILL_CHECKPOINTS"
    monkeypatch.delenv(name, raising=False)
    assert envs.get(name) == ""
    monkeypatch.setenv(name, "  Off \n")
    assert envs.get(name) == "Off"


def test_get_refuses_an_undeclared_name():
    with pytest.raises(KeyError, match="VLLM_HYBRID_NPU_NO_SUCH"):
        envs.get("VLLM_HYBRID_NPU_NO_SUCH")


#: a read of the environment whose key is one of ours: a VLLM_HYBRID_NPU_ literal or a constant
#: named like the modules' (``*_ENV``, ``ENV_VAR``)
DIRECT_READ = re.compile(
    r"os\.(?:environ\.get|getenv)\(\s*(?:\"VLLM_HYBRID_NPU_\w+\"|[A-Z_]*ENV[A-Z_]*\b)"
    r"|os\.environ\[\s*(?:\"VLLM_HYBRID_NPU_\w+\"|[A-Z_]*ENV[A-Z_]*)\s*\]"
)


def test_runtime_reads_its_variables_only_through_envs():
    """The runtime's modules (not the CLI tools, which set variables for child servers) read the
    plugin's variables through :func:`envs.get`; a direct read is listed with its line."""
    found = []
    for path in sorted((ROOT / "vllm_hybrid_npu").rglob("*.py")):
        if path.name == "envs.py" or "tools" in path.parts:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if DIRECT_READ.search(line):
                found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not found, "\n".join(found)


def test_the_check_sees_a_direct_read():
    assert DIRECT_READ.search('x = os.environ.get(COPY_KERNEL_ENV, "")')
    assert DIRECT_READ.search('os.environ["VLLM_HYBRID_NPU_OPTIONS"]')
    assert not DIRECT_READ.search('os.environ.get("TRITON_INTERPRET")')
