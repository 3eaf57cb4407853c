"""The plugin's environment variables: one declaration each, the source of the table in
docs/configuration.md (``python docs/sync.py`` rewrites it; ``tests/docs/`` compares), and the
one place the plugin reads them (:func:`get`), as vLLM's own ``envs.py`` is for vLLM's.

The plugin's real choices are not variables of their own but keys of one,
``VLLM_HYBRID_NPU_OPTIONS`` (:class:`Option`, :func:`option`; the keys the hit-rate lab replays
and ``advise`` prints); besides it only the plugin's and the exporter's kill switches change
behaviour. A variable a key replaced stops the plugin's load naming the key (:func:`check`).

Each variable is interpreted by the module named in ``read_by`` (whose own constant, e.g.
``patches.MODE_ENV``, must equal the name declared here; the values a module accepts must equal
``values``: both are checked by ``tests/docs/test_env_table.py``, which also fails on a
``VLLM_HYBRID_NPU_*`` name in the code that is not declared here); that module reads the raw
value through :func:`get` (an option through :func:`option`), at call time (never cached at
import).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class EnvVar:
    """One environment variable of the plugin.

    Attributes:
        name: the variable.
        values: the values it accepts (``None``: free form, described by ``kind``).
        kind: what a free-form value is (``"directory"``), or ``""``.
        default: the value used when unset, or how it is derived (``"detected"``).
        read_by: who reads it (Markdown; modules dotted, relative to ``vllm_hybrid_npu``).
        effect: what it does (Markdown, one paragraph).
    """

    name: str
    values: tuple[str, ...] | None
    kind: str
    default: str
    read_by: str
    effect: str


ENV_VARS: dict[str, EnvVar] = {}


def register(var: EnvVar) -> str:
    """Declare ``var``; returns its name (so a module can write ``X_ENV = register(...)``).

    Raises:
        ValueError: the name is declared twice with different contents.
    """
    return _declare(ENV_VARS, var.name, var, "environment variable")


def _declare(table: dict, name: str, item: Any, what: str) -> str:
    old = table.get(name)
    if old is not None and old != item:
        raise ValueError(f"{what} {name} declared twice, differently")
    table[name] = item
    return name


#: The variable holding the options (:class:`Option`), ``key=value`` pairs, comma-separated.
OPTIONS_ENV = "VLLM_HYBRID_NPU_OPTIONS"


@dataclass(frozen=True)
class Option:
    """One key of ``$VLLM_HYBRID_NPU_OPTIONS``: a real choice of the user (what the engine's
    configuration decides is decided from it, not from an option).

    Attributes:
        key: the key (the lab's and ``advise``'s name of the setting).
        values: the values it accepts.
        default: the value used when the key is absent, or how it is derived (``"detected"``).
        read_by: who reads it (Markdown; modules dotted, relative to ``vllm_hybrid_npu``).
        effect: what it does (Markdown, one paragraph).
        replaces: the environment variable this key replaced (retired: setting it stops the
            plugin's load with an error naming this key), or ``""``.
    """

    key: str
    values: tuple[str, ...]
    default: str
    read_by: str
    effect: str
    replaces: str = ""


OPTIONS: dict[str, Option] = {}


def register_option(opt: Option) -> str:
    """Declare ``opt``; returns its key.

    Raises:
        ValueError: the key is declared twice with different contents.
    """
    return _declare(OPTIONS, opt.key, opt, "option")


register(EnvVar(
    name="VLLM_HYBRID_NPU_PATCHES",
    values=("auto", "none"),
    kind="",
    default="auto",
    read_by="`patches.apply_patches` (every vLLM process)",
    effect="`auto`: the registry applies each entry where the stack lacks the capability or ours "
    "is measured better ([patches.md](patches.md)); `none`: nothing applied (vLLM / vllm-ascend "
    "unchanged; the load line says `no patches: VLLM_HYBRID_NPU_PATCHES=none`)",
))
register(EnvVar(
    name="VLLM_HYBRID_NPU_PREFILL_CHECKPOINTS",
    values=("auto", "off"),
    kind="",
    default="auto",
    read_by="`patches.gdn_prefill_checkpoint.mode` (every vLLM process)",
    effect="`auto`: Qwen GDN layers export the prompt's checkpoint state from inside the "
    "prefill through vLLM's prefill-checkpoint interface where a path exists (vLLM's CPU GDN "
    "function; the Triton/FLA kernel on CUDA with `--gdn-prefill-backend triton`; vllm-ascend "
    "0.30.0rc2's fused CANN op, fla_npu's op and its chunk pipeline), so vLLM drops its "
    "block-aligned split: cold prompts take the steps of caching off; the hybrid block is "
    "rounded up to a multiple of 64. Not with speculative decoding (except EAGLE/MTP on vLLM "
    "0.30's CPU path), FlashInfer, PCP or on 310P "
    "(vLLM's split kept, logged) ([gdn-checkpoints.md](gdn-checkpoints.md)); `off`: vLLM's "
    "split everywhere",
))
register(EnvVar(
    name="VLLM_HYBRID_NPU_OPTIONS",
    values=None,
    kind="`key=value` pairs, comma-separated (the keys: [Options](#options))",
    default="unset (every key at its default)",
    read_by="`envs.option` (each key by the module its row names)",
    effect="the plugin's real choices, one setting: the keys the lab and `advise` name "
    "(`second=on`, `tails=off`, `tailsplit=off`, `ckpt=final`, ...) are this variable's, e.g. "
    "`VLLM_HYBRID_NPU_OPTIONS=second=on,tails=off`. An unknown key, a bad value or a key given "
    "twice stops the plugin's load with an error naming the variable, the key and the values it "
    "takes; a variable these keys replaced (`VLLM_HYBRID_NPU_SECOND_CHECKPOINT`, ...) does too, "
    "naming the key that replaces it",
))
register(EnvVar(
    name="VLLM_HYBRID_NPU_CHECKPOINTS",
    values=("upstream",),
    kind="",
    default="unset",
    read_by="`core.placement.check_checkpoints_env` (at plugin load, `patches.apply_patches`)",
    effect="retired: checkpoint placement is vLLM's on every target, the plugin "
    "installs no scheduler. `upstream` is accepted with a deprecation warning and changes "
    "nothing; any other value (`lean`, `tail`, `adaptive`, `gdn`, ...) stops the plugin's load "
    "with an error naming the variable (`gdn`'s also names "
    "`VLLM_HYBRID_NPU_PREFILL_CHECKPOINTS`). vLLM's own flags: `vllm-hybrid-npu-lab advise`; "
    "`lean` and the other policies are the lab's retired comparison rows "
    "([hitrate-lab.md](hitrate-lab.md))",
))
register(EnvVar(
    name="VLLM_HYBRID_NPU_CACHE",
    values=None,
    kind="directory",
    default="~/.cache/vllm-hybrid-npu",
    read_by="`tools.make_model` (`make-model`, `demo`, the e2e tests), `tests/contract`",
    effect="where the default tiny model is built (`models/tiny-<arch>-s<seed>`) and the "
    "vllm-ascend source distribution is cached",
))


register_option(Option(
    key="ckpt",
    values=("all", "final"),
    default="all",
    read_by="registry entry `gdn-manager-cache` (`patches.gdn_prefill_checkpoint.retention`; at "
    "load, then at each checkpoint the Mamba manager caches)",
    effect="which prefill checkpoints of a chunked prompt the prefix cache keeps at a retention "
    "interval above 0 (`--prefix-cache-retention-interval`), with the GDN prefill-checkpoint "
    "exporter on vLLM 0.30: `all` = vLLM 0.30's rule (each chunk's checkpoint, one block below "
    "the chunk's end, is kept); `final` = a non-final chunk's checkpoint is not kept (dropped as "
    "vLLM drops it at retention 0), the prompt's own and a shared-prefix junction's are; the "
    "retention grid's chunk-end states and the computation are unchanged. `final` keeps fewer "
    "states: it helps where the host tier evicts (searched by `advise`; "
    "[hitrate-guide.md](hitrate-guide.md)). Not read on vLLM 0.32 (whose own rule keeps such a "
    "checkpoint only on the retention grid) nor 0.33",
    replaces="VLLM_HYBRID_NPU_CHUNK_CHECKPOINTS",
))
register_option(Option(
    key="tails",
    values=("on", "off"),
    default="on",
    read_by="registry entry `host-tier-partial-tails-off` (`patches.vllm_kv_offload_scheduler`; "
    "at load)",
    effect="`on` (default): vLLM's host tier (the OffloadingConnector, `--kv-offloading-size`) "
    "stores and looks up partial tails as vLLM 0.30 does (with `--prefix-match-unit` below the "
    "block: an attention page and each GDN group's state at a boundary off the block grid); "
    "`off`: it keeps none (vLLM's own branch without partial tails, "
    "`SchedulerOffloadConfig.supports_partial_tail` False), leaving the host's pages to block-grid "
    "chunks; whether that pays depends on the traffic ([hitrate-guide.md](hitrate-guide.md)). "
    "vLLM 0.30 only (not read on 0.32 / 0.33)",
    replaces="VLLM_HYBRID_NPU_HOST_TIER_PARTIAL_TAILS",
))
register_option(Option(
    key="tailsplit",
    values=("on", "off"),
    default="on",
    read_by="registry entry `sub-block-tail-split-off` (`patches.sub_block_tail_split`; at load)",
    effect="`on` (default): vLLM's scheduler splits, as vLLM 0.30 does, a prompt's last chunk "
    "that spans at most one block column past its start (a cold prompt of at most one block, a "
    "hit leaving at most about a block) with `--prefix-match-unit` below the block and the GDN "
    "prefill-checkpoint exporter on, to cache the GDN state at its last prefix-match boundary: "
    "one or two more prefill steps; `off`: that chunk runs whole (one step where the path writes "
    "the block boundary a chunk started inside a block crosses; else it still stops there), and "
    "that one state is not cached (the KV-cache manager reserves no block for it; the hit the "
    "prompt started from and the state at its end stay). Whether that pays depends on the "
    "traffic ([hitrate-guide.md](hitrate-guide.md)). vLLM 0.30 only (not read on 0.32 / 0.33)",
    replaces="VLLM_HYBRID_NPU_SUB_BLOCK_TAIL_SPLIT",
))
register_option(Option(
    key="second",
    values=("off", "on"),
    default="off",
    read_by="registry entries `gdn-manager-*` (`patches.gdn_second_checkpoint`; at load, and once "
    "per engine at its start)",
    effect="`off` (default): as vLLM 0.30, with `--prefix-match-unit` below the block a prompt's "
    "GDN checkpoint inside its last block takes the block that would hold the state at that "
    "block's start, so that state is not cached; `on`: a second block per such prompt keeps both "
    "(the KV-cache manager takes it beside the request's blocks, the step writes both states, the "
    "host tier is offered both), so a prompt sharing only the block's start hits there and the "
    "host tier, which looks GDN states up on the block grid, finds it. vLLM 0.30 only, where the "
    "exporter path writes several states per row: the CPU path, CUDA's one pass on the V2 "
    "runner (as for `junctions`) and vllm-ascend 0.30.0rc2's V1 runner without a KV connector "
    "(replayed on CPU only; beside the host tier the NPU's junction export and this are off) "
    "([hitrate-guide.md](hitrate-guide.md))",
    replaces="VLLM_HYBRID_NPU_SECOND_CHECKPOINT",
))
register_option(Option(
    key="junctions",
    values=("on", "off"),
    default="on",
    read_by="`patches.gdn_prefill_checkpoint.cuda_junctions_off` (CUDA's Triton/FLA path) and the "
    "registry entries `gdn-checkpoint-receive-v2` / `-v2-rows` (at load)",
    effect="`on` (the default): on vLLM 0.30's V2 GPU model runner the one pass also writes the "
    "state at a shared-prefix junction, at the block boundary a chunk started mid-block crosses "
    "and where a chunk under a shared token budget ends, so vLLM's stops there are lifted, as on "
    "CPU and vllm-ascend's paths (the engine sends those checkpoints with the step); `off`: "
    "vLLM's junction, mid-block and block-rounded stops kept on CUDA, the runner entries not "
    "installed ([gdn-checkpoints.md](gdn-checkpoints.md))",
    replaces="VLLM_HYBRID_NPU_CUDA_JUNCTIONS",
))
register_option(Option(
    key="budget",
    values=("auto", "off"),
    default="auto",
    read_by="registry entries `token-budget*` (`patches.vllm_config`, at load)",
    effect="`auto`: where the GDN prefill-checkpoint exporter applies (align mode, Qwen GDN "
    "model), chunks still end on the block grid (not vLLM 0.30's CPU path without "
    "`--prefix-match-unit`) and `--max-num-batched-tokens` is vLLM's default, the budget is "
    "raised at start-up to the next multiple of the hybrid block, so a chunked cold prefill "
    "takes the steps of caching off (one INFO line says what changed, why and what it costs); a "
    "budget you set is kept and the line names the one that would save the step "
    "([patches.md](patches.md#token-budget)); `off`: vLLM's budget untouched, no line",
    replaces="VLLM_HYBRID_NPU_TOKEN_BUDGET",
))
register_option(Option(
    key="copy",
    values=("auto", "ours", "upstream"),
    default="auto",
    read_by="registry entries `copy-kernel*` (`patches.vllm_mamba_utils`)",
    effect="which kernel launches the align-mode state copies under vLLM's / vllm-ascend's own "
    "plan: `auto` = ours on CUDA (measured faster) and under vllm-ascend's batched and layerwise "
    "paths (not on 310P), vLLM's elsewhere (CPU); `ours` = also on CPU; `upstream` = never ours",
    replaces="VLLM_HYBRID_NPU_COPY_KERNEL",
))
register_option(Option(
    key="copy-impl",
    values=("auto", "triton", "torch"),
    default="auto",
    read_by="`ops.batch_memcpy` (at the first copy)",
    effect="state-copy implementation; `auto`: Triton on CUDA, triton-ascend on NPU (torch on "
    "310P), torch on CPU (Triton there only with `TRITON_INTERPRET=1`)",
    replaces="VLLM_HYBRID_NPU_COPY_IMPL",
))
register_option(Option(
    key="unsupported",
    values=("refuse", "apply"),
    default="refuse",
    read_by="`support.unsupported_reason`",
    effect="`apply`: apply the patches on a stack outside the support matrix "
    "([compatibility.md](compatibility.md)); each registry entry's own versions still decide",
    replaces="VLLM_HYBRID_NPU_ALLOW_UNSUPPORTED",
))
register_option(Option(
    key="target",
    values=("npu", "cuda", "cpu"),
    default="detected",
    read_by="`target.detect_target`",
    effect="forces the target whose patches are applied (detection: vLLM's `current_platform`, "
    "then torch-npu / CUDA availability)",
    replaces="VLLM_HYBRID_NPU_TARGET",
))


def get(name: str) -> str:
    """The value of the declared variable ``name`` in this process's environment, stripped of
    white space (``""`` when unset or empty); the reading module interprets it.

    Raises:
        KeyError: ``name`` is not declared here (a typo in the plugin, not a user error).
    """
    if name not in ENV_VARS:
        raise KeyError(f"{name} is not a declared vllm-hybrid-npu environment variable")
    return os.environ.get(name, "").strip()


def choice(name: str, values: tuple[str, ...], default: str) -> str:
    """The declared variable ``name`` as one of ``values`` (lower-cased; ``default`` when unset).

    ``values`` is the reading module's own tuple (``tests/docs/test_env_table.py`` checks that it
    equals the declaration).

    Raises:
        KeyError: ``name`` is not declared here.
        ValueError: any other value; the message names the variable and the values it takes.
    """
    value = get(name).lower() or default
    if value not in values:
        raise ValueError(f"{name}={value!r} is not one of {', '.join(values)}")
    return value


def options() -> dict[str, str]:
    """The keys set in ``$VLLM_HYBRID_NPU_OPTIONS`` (key -> value, lower-cased, stripped; keys
    absent there are absent here), validated against the declarations.

    Raises:
        ValueError: an item without ``=``, an unknown key, a key given twice or a value the key
            does not take; the message names the variable, the key and the accepted values.
    """
    out: dict[str, str] = {}
    for item in get(OPTIONS_ENV).split(","):
        item = item.strip()
        if not item:
            continue
        key, eq, value = (x.strip().lower() for x in item.partition("="))
        if not eq:
            raise ValueError(f"{OPTIONS_ENV}: {item!r} is not key=value (keys: {', '.join(OPTIONS)})")
        opt = OPTIONS.get(key)
        if opt is None:
            raise ValueError(f"{OPTIONS_ENV}: unknown key {key!r} (keys: {', '.join(OPTIONS)})")
        if key in out:
            raise ValueError(f"{OPTIONS_ENV}: key {key!r} given twice")
        if value not in opt.values:
            raise ValueError(f"{OPTIONS_ENV}: {key}={value!r} is not one of {', '.join(opt.values)}")
        out[key] = value
    return out


def option(key: str) -> str | None:
    """The value of ``key`` in ``$VLLM_HYBRID_NPU_OPTIONS``; where it is absent, the declared
    default when that is one of the key's values, else None (a default derived at run time,
    ``target``'s ``detected``). Read at call time, never cached.

    Raises:
        KeyError: ``key`` is not declared here (a typo in the plugin, not a user error).
        ValueError: from :func:`options`: the variable is malformed anywhere, not only at ``key``.
    """
    opt = OPTIONS.get(key)
    if opt is None:
        raise KeyError(f"{key} is not a declared {OPTIONS_ENV} key")
    value = options().get(key)
    if value is not None:
        return value
    return opt.default if opt.default in opt.values else None


def with_option(current: str, key: str, value: str | None) -> str:
    """``current`` (a ``VLLM_HYBRID_NPU_OPTIONS`` value) with ``key`` set to ``value``, or
    removed where ``value`` is None; the other items kept in their order. For whoever sets the
    variable for a process (the lab, the tests); not validated here (:func:`options` does).
    """
    items = [i.strip() for i in current.split(",") if i.strip()]
    items = [i for i in items if i.partition("=")[0].strip().lower() != key]
    if value is not None:
        items.append(f"{key}={value}")
    return ",".join(items)


def option_text(key: str, value: str) -> str:
    """How a log line or an error names the setting ``key=value``:
    ``VLLM_HYBRID_NPU_OPTIONS=key=value``, as one would set it (other keys may be set beside)."""
    return f"{OPTIONS_ENV}={key}={value}"


def check() -> None:
    """Validate the plugin's variables at its load: ``$VLLM_HYBRID_NPU_OPTIONS`` whole, and none
    of the variables its keys replaced set.

    Raises:
        ValueError: see :func:`options`; or a retired variable set (the message names it and the
            key that replaces it).
    """
    retired = []
    for opt in OPTIONS.values():
        old = os.environ.get(opt.replaces, "").strip().lower() if opt.replaces else ""
        if old:
            retired.append(f"{opt.replaces} is retired: the setting is the key {opt.key!r} of "
                           f"{OPTIONS_ENV} (values {', '.join(opt.values)}; "
                           f"{OPTIONS_ENV}={opt.key}={_carried(opt, old)} for your value)")
    if retired:
        raise ValueError("; ".join(retired) + "; unset the retired variable(s)")
    options()


def _carried(opt: Option, old: str) -> str:
    """The value of ``opt`` that the retired variable's value ``old`` meant."""
    if old in opt.values:
        return old
    other = next(v for v in opt.values if v != opt.default)
    if old in ("1", "true", "yes", "on"):  # a flag turned on (ALLOW_UNSUPPORTED=1)
        return other
    if old in ("0", "false", "no", "off"):
        return opt.default if opt.default in opt.values else other
    return other


def markdown_table() -> str:
    """The table of docs/configuration.md's "Environment variables" section (Markdown, no
    trailing newline)."""

    def code(s: str) -> str:
        return f"`{s}`"

    rows = ["| variable | values | default | read by | effect |", "| --- | --- | --- | --- | --- |"]
    for v in ENV_VARS.values():
        values = ", ".join(code(x) for x in v.values) if v.values else v.kind
        default = code(v.default) if (v.values and v.default in v.values) or v.default.startswith(("~", "/")) else v.default
        rows.append(f"| {code(v.name)} | {values} | {default} | {v.read_by} | {v.effect} |")
    return "\n".join(rows)



def options_markdown_table() -> str:
    """The table of docs/configuration.md's "Options" section (Markdown, no trailing newline)."""
    rows = ["| key | values | default | replaces | read by | effect |",
            "| --- | --- | --- | --- | --- | --- |"]
    for o in OPTIONS.values():
        values = ", ".join(f"`{x}`" for x in o.values)
        default = f"`{o.default}`" if o.default in o.values else o.default
        replaces = f"`{o.replaces}`" if o.replaces else ""
        rows.append(f"| `{o.key}` | {values} | {default} | {replaces} | {o.read_by} | {o.effect} |")
    return "\n".join(rows)
