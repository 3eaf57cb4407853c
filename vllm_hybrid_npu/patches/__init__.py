"""The plugin's patches of vLLM / vllm-ascend, behind one registry (:mod:`.registry`).

One module per patched upstream module (or, for ``gdn_prefill_checkpoint``, per feature), each with a
``PATCHES`` list of :class:`~vllm_hybrid_npu.patches.registry.Patch` entries:

* :mod:`.vllm_config` - ``VllmConfig.try_verify_and_update_config``: flag-naming align-mode
  checks (with vLLM 0.33's semantics there and on 0.34); on vLLM 0.33 / 0.34 also
  ``EngineArgs.create_engine_config`` (its deprecated ``--mamba-cache-mode``).
* :mod:`.vllm_mamba_utils` - vLLM's ``mamba_utils.batch_memcpy`` launcher (CUDA).
* :mod:`.vllm_ascend_mamba_utils` - vllm-ascend's copy launchers (batched and layerwise).
* :mod:`.worker_warmup` - the workers' ``compile_or_warm_up_model``: our kernel compiled at
  start-up.
* :mod:`.vllm_v1_worker_cpu_model_runner` - ``CPUModelRunner.sample_tokens``: a seeded request
  whose prompt is chunked keeps its CPU generator through the steps whose token vLLM discards
  (vLLM rewinds by a Philox offset, which CPU generators lack: the engine core died).
* :mod:`.gdn_prefill_checkpoint` - GDN prefill checkpoints through vLLM's own interface
  (``MambaSpec.num_prefill_checkpoint_blocks``): no block-aligned split in align mode (CPU, CUDA).
* :mod:`.resend_tail` - vLLM 0.32's resend boundary for a prompt's partial attention tail, on
  vLLM 0.30 engines that declare prefill checkpoints.
* :mod:`.gdn_junction` - shared-prefix junction states exported from inside the step (vLLM 0.30,
  where the exporter path writes several states per row): the scheduler's junction stop dropped
  where the step writes that state; the rule the Mamba managers' hooks reserve its block by.
* :mod:`.gdn_mamba_manager` - the align-mode Mamba managers' hooks, one per upstream method
  (vLLM 0.30): the junction's and crossed boundary's blocks, the second block
  (:mod:`.gdn_second_checkpoint`'s rules, opt-in ``VLLM_HYBRID_NPU_OPTIONS=second=on``) and
  the retention rule.
* :mod:`.gdn_step_checkpoints` - the engine's explicit list of each step's GDN checkpoints beyond
  vLLM's one per row (junctions, crossed boundaries, second blocks), sent on the
  ``SchedulerOutput`` and held by the model runner for the GDN metadata builders.
* :mod:`.vllm_kv_offload_scheduler` - opt-in: vLLM's host tier (OffloadingConnector) keeps no
  partial tail (``VLLM_HYBRID_NPU_OPTIONS=tails=off``; vLLM's own branch without them).
* :mod:`.sub_block_tail_split` - opt-in: with ``--prefix-match-unit`` below the block, a prompt's
  last chunk that fails vLLM's checkpoint check by its column clause alone runs whole
  (``VLLM_HYBRID_NPU_OPTIONS=tailsplit=off``; the scheduler's name of
  ``is_mamba_prefill_checkpoint_valid``).
* :mod:`.vllm_v1_engine_core` - ``EngineCore._initialize_kv_caches`` / ``EngineCoreProc.__init__``
  (CPU): the engine-core process keeps the block size vLLM resolved, which its handshake resets.
* :mod:`.vllm_v1_core_sched_scheduler` - ``Scheduler.schedule`` / ``make_stats`` and
  ``KVCacheManager.free`` / ``pop_blocks_for_free``: state-move and miss-reason counters carried
  to ``/metrics`` in ``SchedulerStats`` (:mod:`vllm_hybrid_npu.metrics`).

What is *not* patched, because the supported stacks already do it (vLLM >= 0.23 and
vllm-ascend since its PR #7103): block tables sized per KV-cache group, ``preprocess_mamba``
called by the model runner, the copy plan and its staging. ``docs/patches.md`` is the index.

``VLLM_HYBRID_NPU_PATCHES=none`` applies nothing (upstream unchanged; the load line says so).

Checkpoint placement is vLLM's on every target: the plugin installs no scheduler. Two
things move a chunk's end, both where a step exports the state vLLM would have stopped for: the
prefill-checkpoint declaration (vLLM's own interface drops the split at a cold prompt's end) and
the junction entries (:mod:`.gdn_junction`, one rule for the scheduler and the KV-cache manager).
The former ``checkpoint-policy`` entry and its policies are the hit-rate lab's
(``vllm_hybrid_npu_lab.scheduling``); :func:`apply_patches` rejects
``VLLM_HYBRID_NPU_CHECKPOINTS`` set to a policy (:mod:`vllm_hybrid_npu.core.placement`).
"""

from __future__ import annotations

import importlib

from vllm_hybrid_npu.core.placement import check_checkpoints_env
from vllm_hybrid_npu.patches.registry import LoadReport, Patch, apply_all, unapply_all
from vllm_hybrid_npu.support import Stack, detect_stack, unsupported_reason
from vllm_hybrid_npu import envs

#: Environment variable: ``auto`` (default: the registry decides per stack) or ``none``.
MODE_ENV = "VLLM_HYBRID_NPU_PATCHES"
MODES = ("auto", "none")

#: Patch modules, in application order.
PATCH_MODULES = (
    "vllm_hybrid_npu.patches.vllm_config",
    "vllm_hybrid_npu.patches.vllm_mamba_utils",
    "vllm_hybrid_npu.patches.vllm_ascend_mamba_utils",
    "vllm_hybrid_npu.patches.worker_warmup",
    "vllm_hybrid_npu.patches.vllm_v1_worker_cpu_model_runner",
    "vllm_hybrid_npu.patches.gdn_prefill_checkpoint",
    "vllm_hybrid_npu.patches.resend_tail",
    "vllm_hybrid_npu.patches.gdn_junction",
    "vllm_hybrid_npu.patches.gdn_mamba_manager",
    "vllm_hybrid_npu.patches.gdn_step_checkpoints",
    "vllm_hybrid_npu.patches.vllm_kv_offload_scheduler",
    "vllm_hybrid_npu.patches.sub_block_tail_split",
    "vllm_hybrid_npu.patches.vllm_ascend_gdn",
    "vllm_hybrid_npu.patches.vllm_v1_core_sched_scheduler",
    "vllm_hybrid_npu.patches.vllm_v1_engine_core",
)

__all__ = ["MODE_ENV", "MODES", "all_patches", "apply_patches", "patch_mode", "unapply_patches"]


def patch_mode() -> str:
    """``$VLLM_HYBRID_NPU_PATCHES`` (default ``auto``).

    Raises:
        ValueError: a value other than ``auto`` or ``none`` (the message names the variable).
    """
    return envs.choice(MODE_ENV, MODES, "auto")


def all_patches() -> list[Patch]:
    """Every registry entry, in application order (imports only our patch modules)."""
    out: list[Patch] = []
    for name in PATCH_MODULES:
        out.extend(importlib.import_module(name).PATCHES)
    return out


def apply_patches(target: str | None = None, stack: Stack | None = None) -> LoadReport:
    """Apply the registry's entries for this process's stack.

    Args:
        target: ``npu``, ``cuda`` or ``cpu``; None detects it.
        stack: the stack (tests pass one); None detects it with ``target``.

    Returns:
        The process's :class:`~vllm_hybrid_npu.patches.registry.LoadReport`.

    Raises:
        ValueError: unknown target, a bad value of one of the plugin's variables, a malformed
            ``VLLM_HYBRID_NPU_OPTIONS`` or a variable its keys replaced set
            (:func:`vllm_hybrid_npu.envs.check`);
            :class:`~vllm_hybrid_npu.core.placement.PlacementPolicyRetiredError` (a
            ``ValueError``) when ``VLLM_HYBRID_NPU_CHECKPOINTS`` names a placement policy, also
            with ``VLLM_HYBRID_NPU_PATCHES=none``.
        vllm_hybrid_npu.patches.registry.PatchError: a behaviour-changing entry failed.
    """
    if target is not None and target not in ("npu", "cuda", "cpu"):
        raise ValueError(f"unknown target {target!r}; expected npu, cuda or cpu")
    check_checkpoints_env()
    envs.check()
    stack = stack or detect_stack(target)
    if patch_mode() == "none":
        return apply_all([], stack, unsupported=f"{MODE_ENV}=none")
    return apply_all(all_patches(), stack, unsupported=unsupported_reason(stack))


def unapply_patches() -> None:
    """Undo every patch of this process and forget pending ones (tests)."""
    unapply_all()


def index_markdown() -> str:
    """The registry as a Markdown table (``docs/patches.md`` holds it between
    ``<!-- registry:begin -->`` and ``<!-- registry:end -->``; a test compares the two)."""
    rows = [
        "| entry | upstream target | targets | vLLM | vllm-ascend | on failure | why | until |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for p in all_patches():
        trigger = f" (at import of `{p.trigger}`)" if p.trigger else ""
        rows.append(
            f"| `{p.name}` | `{p.module}:{p.qualname}`{trigger} | {', '.join(p.targets)} "
            f"| {', '.join(p.vllm)} | {', '.join(p.vllm_ascend) if p.vllm_ascend else 'any'} "
            f"| {'error' if p.behaviour_changing else 'warning, upstream kept'} | {p.why} "
            f"| {p.until} |"
        )
    return "\n".join(rows) + "\n"
