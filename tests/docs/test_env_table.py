"""The environment variables: docs/configuration.md's tables vs the code.

* the plugin's table is :func:`vllm_hybrid_npu.envs.markdown_table` (the single declaration);
* each declared variable with a value list is read by its module with exactly those values
  (every value accepted; a bogus one refused with an error naming the variable and listing the
  accepted values, which must be the declared ones);
* every ``VLLM_HYBRID_NPU_*`` name in the packages' source is declared, and every declared one
  is used somewhere in the source;
* every other variable the packages read or set through ``os.environ`` / ``os.getenv`` is in the
  "Variables of vLLM and others" table, and that table names only such variables (or ones
  vLLM reads).
"""

from __future__ import annotations

import ast
import difflib
import re

import pytest
from _sync import ROOT, sync

from vllm_hybrid_npu.envs import ENV_VARS, OPTIONS, OPTIONS_ENV

PACKAGES = ("vllm_hybrid_npu", "vllm_hybrid_npu_lab", "benchmarks")
OURS = re.compile(r"\bVLLM_HYBRID_NPU_[A-Z0-9_]*[A-Z0-9]\b")


def _sources():
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            yield path, ast.parse(path.read_text(), filename=str(path))


def test_plugin_table_is_the_declaration():
    block = sync.env_block()
    diff = "".join(difflib.unified_diff(block.current.splitlines(True), block.expected.splitlines(True),
                                        "docs", "envs.markdown_table()"))
    assert not block.stale, f"run `python docs/sync.py --write`\n{diff}"


def _readers():
    """name -> callable reading the variable now (raises ValueError on a bad value)."""

    def patches():
        from vllm_hybrid_npu.patches import patch_mode

        return patch_mode()

    def checkpoints():
        from vllm_hybrid_npu.core.placement import check_checkpoints_env

        return check_checkpoints_env()

    def prefill_checkpoints():
        from vllm_hybrid_npu.patches.gdn_prefill_checkpoint import mode

        return mode()

    def token_budget():
        from vllm_hybrid_npu.patches.vllm_config import token_budget_mode

        return token_budget_mode()

    def copy_impl():
        from vllm_hybrid_npu.ops import memcpy

        memcpy.refresh_settings()
        try:
            return memcpy.active_impl("cpu")
        except RuntimeError:  # triton requested on CPU without the interpreter: value accepted
            return "triton"

    def target():
        from vllm_hybrid_npu.target import detect_target

        return detect_target()

    def unsupported():
        from vllm_hybrid_npu.support import Stack, unsupported_reason

        return "apply" if unsupported_reason(Stack("cuda", "0.29.0")) is None else "refuse"

    def copy_kernel():
        from vllm_hybrid_npu.patches.vllm_mamba_utils import copy_kernel_choice

        return copy_kernel_choice()

    def chunk_checkpoints():
        from vllm_hybrid_npu.patches.gdn_prefill_checkpoint import chunk_checkpoints

        return chunk_checkpoints()

    def cuda_junctions():
        from vllm_hybrid_npu.patches.gdn_prefill_checkpoint import cuda_junctions_off

        return "off" if cuda_junctions_off() else "on"

    def host_tier_partial_tails():
        from vllm_hybrid_npu.patches.vllm_kv_offload_scheduler import partial_tails

        return partial_tails()

    def sub_block_tail_split():
        from vllm_hybrid_npu.patches.sub_block_tail_split import tail_split

        return tail_split()

    def second_checkpoint():
        from vllm_hybrid_npu.patches.gdn_second_checkpoint import mode

        return mode()

    # name -> (reader, whether it returns the setting itself, so the default can be checked;
    # COPY_IMPL's reader returns the resolved implementation, "auto" never comes back)
    # CHECKPOINTS is retired: unset gives None (no setting), not a value
    return {"VLLM_HYBRID_NPU_PATCHES": (patches, True), "VLLM_HYBRID_NPU_CHECKPOINTS": (checkpoints, False),
            "VLLM_HYBRID_NPU_PREFILL_CHECKPOINTS": (prefill_checkpoints, True),
            "copy": (copy_kernel, True), "ckpt": (chunk_checkpoints, True),
            "junctions": (cuda_junctions, True), "tails": (host_tier_partial_tails, True),
            "tailsplit": (sub_block_tail_split, True), "second": (second_checkpoint, True),
            "budget": (token_budget, True), "unsupported": (unsupported, True),
            "copy-impl": (copy_impl, False), "target": (target, False)}


ENUMERATED = [v for v in ENV_VARS.values() if v.values]


def _check_reader(name, values, default, set_value, unset, monkeypatch, error_names):
    read, returns_setting = _readers()[name]
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    try:
        for value in values:
            set_value(value)
            read()  # accepted
        unset()
        if returns_setting:
            assert read() == default, f"{name} unset: not the declared default {default!r}"
        set_value("no-such-value")
        with pytest.raises(ValueError, match=error_names) as err:
            read()
        listed = re.search(r"one of ([\w, -]+)", str(err.value))
        assert listed, f"the error should list the accepted values: {err.value}"
        assert [v.strip() for v in listed.group(1).split(",")] == list(values)
    finally:
        monkeypatch.undo()
        from vllm_hybrid_npu.ops import memcpy

        memcpy.refresh_settings()


@pytest.mark.parametrize("var", ENUMERATED, ids=[v.name for v in ENUMERATED])
def test_declared_values_are_what_the_reader_accepts(var, monkeypatch):
    assert var.name in _readers(), f"no reader known for {var.name}: add it to _readers()"
    _check_reader(var.name, var.values, var.default, lambda v: monkeypatch.setenv(var.name, v),
                  lambda: monkeypatch.delenv(var.name), monkeypatch, var.name)


@pytest.mark.parametrize("opt", list(OPTIONS.values()), ids=list(OPTIONS))
def test_declared_option_values_are_what_the_reader_accepts(opt, monkeypatch):
    """Each key of ``VLLM_HYBRID_NPU_OPTIONS``, beside another key set (the items are read
    apart), its values accepted, its default when absent, anything else refused naming the
    variable and the key."""
    assert opt.key in _readers(), f"no reader known for option {opt.key}: add it to _readers()"
    other = next(o for o in OPTIONS.values() if o.key != opt.key)
    keep = f"{other.key}={other.default if other.default in other.values else other.values[0]}"
    _check_reader(opt.key, opt.values, opt.default,
                  lambda v: monkeypatch.setenv(OPTIONS_ENV, f"{keep},{opt.key}={v}"),
                  lambda: monkeypatch.setenv(OPTIONS_ENV, keep), monkeypatch,
                  f"{OPTIONS_ENV}: {opt.key}=")


def test_options_refuse_unknown_keys_repeats_and_the_variables_they_replaced(monkeypatch):
    """A malformed ``VLLM_HYBRID_NPU_OPTIONS`` stops the load naming the variable; so does a
    variable an option replaced, naming its key (the user's value carried where it is one)."""
    from vllm_hybrid_npu import envs

    for bad, words in (("secnd=on", "unknown key 'secnd'"), ("second", "is not key=value"),
                       ("second=on,second=off", "key 'second' given twice")):
        monkeypatch.setenv(OPTIONS_ENV, bad)
        with pytest.raises(ValueError, match=f"{OPTIONS_ENV}: .*{re.escape(words)}"):
            envs.check()
    monkeypatch.setenv(OPTIONS_ENV, " second = ON , ,tails=off")
    assert envs.options() == {"second": "on", "tails": "off"}
    monkeypatch.delenv(OPTIONS_ENV)
    for opt in OPTIONS.values():
        monkeypatch.setenv(opt.replaces, opt.values[-1])
        with pytest.raises(ValueError, match=f"{opt.replaces} is retired: .* key '{opt.key}' .*"
                                             f"{OPTIONS_ENV}={opt.key}={opt.values[-1]}"):
            envs.check()
        monkeypatch.delenv(opt.replaces)
    # a retired flag's value is carried over (ALLOW_UNSUPPORTED=1 meant apply, 0 meant refuse);
    # every retired variable set is named at once
    monkeypatch.setenv("VLLM_HYBRID_NPU_ALLOW_UNSUPPORTED", "1")
    monkeypatch.setenv("VLLM_HYBRID_NPU_SECOND_CHECKPOINT", "on")
    with pytest.raises(ValueError) as err:
        envs.check()
    assert f"{OPTIONS_ENV}=unsupported=apply" in str(err.value), err.value
    assert f"{OPTIONS_ENV}=second=on" in str(err.value), err.value
    monkeypatch.setenv("VLLM_HYBRID_NPU_ALLOW_UNSUPPORTED", "0")
    with pytest.raises(ValueError, match=f"{OPTIONS_ENV}=unsupported=refuse"):
        envs.check()
    monkeypatch.delenv("VLLM_HYBRID_NPU_ALLOW_UNSUPPORTED")
    monkeypatch.delenv("VLLM_HYBRID_NPU_SECOND_CHECKPOINT")
    envs.check()


def test_every_plugin_variable_in_the_code_is_declared_and_every_declared_one_is_used():
    used: dict[str, str] = {}
    for path, tree in _sources():
        if path.name == "envs.py" and path.parent.name == "vllm_hybrid_npu":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                for name in OURS.findall(node.value):
                    used.setdefault(name, f"{path.relative_to(ROOT)}:{node.lineno}")
    undeclared = {n: where for n, where in used.items() if n not in ENV_VARS}
    assert not undeclared, f"declare these in vllm_hybrid_npu/envs.py (and document them): {undeclared}"
    unused = sorted(set(ENV_VARS) - set(used))
    assert not unused, f"declared in envs.py but named nowhere in the code: {unused}"


def _environ_names() -> dict[str, str]:
    """Literal names the packages read or set via ``os.environ[...]``, ``os.environ.get/
    setdefault/pop(...)`` or ``os.getenv(...)``."""
    found = {}

    def is_environ(node):
        return (isinstance(node, ast.Attribute) and node.attr == "environ") or (
            isinstance(node, ast.Name) and node.id == "environ")

    for path, tree in _sources():
        for node in ast.walk(tree):
            name = None
            if isinstance(node, ast.Subscript) and is_environ(node.value):
                name = node.slice
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                f = node.func
                if ((f.attr in ("get", "setdefault", "pop") and is_environ(f.value))
                        or (f.attr == "getenv")) and node.args:
                    name = node.args[0]
            if isinstance(name, ast.Constant) and isinstance(name.value, str):
                found.setdefault(name.value, f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def _foreign_table() -> dict[str, str]:
    text = (ROOT / "docs" / "configuration.md").read_text()
    at = text.index("Variables of vLLM and others")
    m = re.compile(r"^\|.*\n(?:\|.*\n)*", re.M).search(text, at)
    rows = {}
    for line in m.group(0).splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0].strip("`")] = cells[1]
    return rows


def test_other_variables_the_code_touches_are_documented():
    names = {n: w for n, w in _environ_names().items() if not OURS.fullmatch(n)}
    table = _foreign_table()
    missing = {n: w for n, w in names.items() if n not in table}
    assert not missing, f"add to docs/configuration.md's 'Variables of vLLM and others': {missing}"
    stale = [n for n, who in table.items() if n not in names and who != "vLLM"]
    assert not stale, f"documented as read/set by the plugin but touched nowhere in the code: {stale}"
