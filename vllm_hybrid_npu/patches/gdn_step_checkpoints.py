"""The step's GDN checkpoints, planned in the engine and sent to the worker explicitly.

vLLM's own prefill-checkpoint plan is one checkpoint per row, which the worker's GDN metadata
builder derives from the step's lengths and block table (vLLM's ``MambaPrefillCheckpointBuilder``
shape). Every other checkpoint a step writes is decided in the engine, where the KV-cache manager
placed its block, and travels on the ``SchedulerOutput`` (:data:`ATTR`):

* engine side, ``Scheduler._update_after_schedule`` (``gdn-checkpoint-send``; vLLM's and
  vllm-ascend's schedulers call it with the finished output): per KV-cache group and scheduled
  prefill request, :func:`~vllm_hybrid_npu.core.prefill_checkpoints.step_checkpoints` of the
  chunk: ``(position, block id, kind)`` for each shared-prefix junction block
  (:mod:`.gdn_junction`), crossed block boundary, second checkpoint block
  (:mod:`.gdn_second_checkpoint`) and, beside them or under EAGLE/MTP's block drop (the
  drafter-drop position the manager reserved), the chunk's own checkpoint; read from the
  Mamba manager's own records (``req_to_blocks``, ``_checkpoints``), plain data, so it survives
  the multiprocess executor's pickle;
* worker side, the model runner's ``execute_model`` (``gdn-checkpoint-receive``: vLLM's V1 GPU
  runner, which the CPU runner inherits; ``-receive-v2``: vLLM 0.30's V2 runner on CUDA;
  ``-receive-ascend``: vllm-ascend 0.30.0rc2's V1 ``NPUModelRunner``, which overrides it): the
  list held for the step's GDN metadata builders (``gdn_prefill_checkpoint.STEP``), read at
  entry, before a runner could ``dataclasses.replace`` the output, dropped when the step returns;
  on the V2 runner ``GPUModelRunner.prepare_attn`` (``gdn-checkpoint-v2-rows``) records the
  step's batch order, which its builders cannot see.

The engine plans only where the exporter path writes several checkpoints per row
(``gdn_prefill_checkpoint.junctions_off`` is None), decided once per scheduler; elsewhere it sends
nothing and vLLM's stops stand (the scheduler entries decide by the same rule). The worker reads
no block-table column and keeps no host copy of a device table: the list carries the block ids.
"""

from __future__ import annotations

import functools
from typing import Any

from vllm_hybrid_npu.core import prefill_checkpoints as core
from vllm_hybrid_npu.patches import gdn_prefill_checkpoint as gdn
from vllm_hybrid_npu.patches import gdn_second_checkpoint as second
from vllm_hybrid_npu.patches.gdn_junction import checkpoint_managers
from vllm_hybrid_npu.support import Stack

#: ``SchedulerOutput`` attribute: ``{KV-cache group id: {request id: ((position, block id, kind),
#: ...)}}`` (tokens from the prompt's start; kinds ``core.KINDS``), absent in a step without one.
ATTR = "vhn_checkpoints"
#: A scheduler's align-mode Mamba managers the planner reads (a tuple; empty: it sends nothing),
#: decided at its first step.
MANAGERS = "_vhn_planned_managers"


def planned_managers(scheduler: Any, target: str) -> tuple:
    """The Mamba managers (vLLM's ``MambaManager`` or a subclass) of ``scheduler``'s KV-cache
    manager whose checkpoints the engine plans: align mode with a prefill checkpoint block
    declared, where the engine's exporter path on ``target`` writes several checkpoints per row
    (``gdn_prefill_checkpoint.junctions_off``); else ``()``. Decided once per scheduler
    (:data:`MANAGERS`)."""
    found = vars(scheduler).get(MANAGERS)
    if found is None:
        config = scheduler.vllm_config
        found = ()
        if gdn.junctions_off(config, gdn.exporter_path(config, target)[0]) is None:
            found = checkpoint_managers(scheduler.kv_cache_manager)
        vars(scheduler)[MANAGERS] = found
    return found


def plan(scheduler: Any, scheduler_output: Any, managers: tuple) -> dict:
    """The step's explicit checkpoints (:data:`ATTR`'s value) for ``scheduler_output`` after vLLM's
    ``_update_after_schedule`` (each request's ``num_computed_tokens`` is its chunk's end): every
    request scheduled more than one token and no draft tokens (a speculative decode row schedules
    ``1 + k`` tokens, ``scheduled_spec_decode_tokens``; it crosses no prefill checkpoint), in
    each manager of ``managers``. A second block
    (``gdn_second_checkpoint.EXTRA``) cached in this step's allocation is listed and marked
    ``sent``; one taken but not cached (a delayed KV load) is marked ``unused``, so a later cache
    call does not key it unwritten."""
    payload: dict[int, dict[str, tuple]] = {}
    requests = scheduler.requests
    drafts = getattr(scheduler_output, "scheduled_spec_decode_tokens", None) or {}
    chunks = [(rid, n) for rid, n in scheduler_output.num_scheduled_tokens.items()
              if n > 1 and rid not in drafts]
    for manager in managers:
        extras = vars(manager).get(second.EXTRA) or {}
        block, group = manager.block_size, manager.kv_cache_group_id
        for rid, n in chunks:
            end = requests[rid].num_computed_tokens
            extra, pair = extras.get(rid), None
            checkpoint = manager._checkpoints.get(rid)
            if extra is not None and extra[3] == "keyed":  # the column keyed at q, E at cp
                pair, checkpoint = (extra[0].block_id, extra[1]), (extra[1], extra[2])
            blocks = manager.req_to_blocks.get(rid)
            if not blocks:  # none in this group (a request it holds no blocks for)
                continue
            found = core.step_checkpoints(end - n, end, block, checkpoint,
                                          [b.block_id for b in blocks], pair,
                                          eagle_drop=bool(getattr(manager, "drop_eagle_checkpoint_block", False)))
            if found:
                payload.setdefault(group, {})[rid] = found
        for extra in extras.values():
            if extra[3] == "keyed":
                extra[3] = "sent"
            elif extra[3] == "new":
                extra[3] = "unused"
    return payload


def _make_send(upstream: Any, stack: Stack) -> Any:
    @functools.wraps(upstream)
    def _update_after_schedule(self, scheduler_output):
        upstream(self, scheduler_output)
        managers = planned_managers(self, stack.target)
        if managers and (payload := plan(self, scheduler_output, managers)):
            setattr(scheduler_output, ATTR, payload)

    return _update_after_schedule


def _make_receive(upstream: Any, stack: Stack) -> Any:
    @functools.wraps(upstream)
    def execute_model(self, scheduler_output, *args, **kwargs):
        payload = getattr(scheduler_output, ATTR, None)
        if not payload:
            return upstream(self, scheduler_output, *args, **kwargs)
        token = gdn.STEP.set((self, payload))
        try:
            return upstream(self, scheduler_output, *args, **kwargs)
        finally:
            gdn.STEP.reset(token)

    return execute_model


def _make_v2_rows(upstream: Any, stack: Stack) -> Any:
    @functools.wraps(upstream)
    def prepare_attn(self, input_batch):
        vars(self)[gdn.V2_REQ_IDS] = input_batch.req_ids if self.pcp_manager is None else ()
        return upstream(self, input_batch)

    return prepare_attn


def _v2_wanted(stack: Stack) -> str | None:
    """``gdn_prefill_checkpoint.wanted``, and only where CUDA's junction export is on."""
    return gdn.wanted(stack) or gdn.cuda_junctions_off()


UNTIL = "vLLM plans every GDN checkpoint of a step in its engine (RFC #52959)"
RECEIVE_WHY = "the step's explicit checkpoints held for its GDN metadata builders"
PATCHES = [
    gdn.entry("gdn-checkpoint-send", "vllm.v1.core.sched.scheduler",
              "Scheduler._update_after_schedule", _make_send, ("cpu", "cuda", "npu"),
              "the engine's plan: each prefill chunk's junction, crossed-boundary and second "
              f"checkpoints, with their block ids, on the SchedulerOutput ({ATTR})",
              signature=("self", "scheduler_output"), until=UNTIL),
    gdn.entry("gdn-checkpoint-receive", "vllm.v1.worker.gpu_model_runner",
              "GPUModelRunner.execute_model", _make_receive, ("cpu",),
              RECEIVE_WHY + " (the CPU V1 runner inherits it)",
              signature=("self", "scheduler_output"), until=UNTIL),
    gdn.entry("gdn-checkpoint-receive-v2", "vllm.v1.worker.gpu.model_runner",
              "GPUModelRunner.execute_model", _make_receive, ("cuda",),
              RECEIVE_WHY + " (vLLM 0.30's V2 GPU model runner, CUDA's one pass)",
              vllm=gdn.RUNNER_V2_VERSIONS, wanted=_v2_wanted,
              signature=("self", "scheduler_output"), until=UNTIL),
    gdn.entry("gdn-checkpoint-v2-rows", "vllm.v1.worker.gpu.model_runner",
              "GPUModelRunner.prepare_attn", _make_v2_rows, ("cuda",),
              "the step's batch order (input_batch.req_ids) for the V2 runner's GDN builders, "
              "which see rows, not request ids", vllm=gdn.RUNNER_V2_VERSIONS, wanted=_v2_wanted,
              signature=("self", "input_batch"), until=UNTIL),
    gdn.entry("gdn-checkpoint-receive-ascend", "vllm_ascend.worker.model_runner_v1",
              "NPUModelRunner.execute_model", _make_receive, ("npu",),
              RECEIVE_WHY + " (vllm-ascend's V1 NPU model runner overrides vLLM's)",
              vllm=("0.30.0",), vllm_ascend=gdn.ASCEND_VERSIONS,
              signature=("self", "scheduler_output"), until=UNTIL),
]
