"""Checkpoint policies of the hit-rate lab: where align mode stores GDN/Mamba states during
prefill (issue 7), kept for replaying retired comparison rows (issue 20).

Until 2026-11-25 this package was the runtime's ``vllm_hybrid_npu.scheduling`` and ``lean`` could
be installed in an engine with ``VLLM_HYBRID_NPU_CHECKPOINTS=lean`` (the registry entry
``checkpoint-policy`` wrapped ``SchedulerConfig.get_scheduler_cls``). Placement is vLLM's now:
the runtime installs no scheduler and rejects that variable (:mod:`vllm_hybrid_npu.core.placement`).
The lab builds its scheduler classes here and passes them to the engines and replays it builds
itself (``scheduler_cls=`` of ``LLM(...)`` / ``EngineArgs``, or the lab's replay):

* :mod:`.split`: the pure cut logic (no vLLM import).
* :mod:`.scheduler`: vLLM ``Scheduler``/``AsyncScheduler`` subclasses applying a policy
  (:func:`.scheduler.scheduler_class`; ``--scheduler-cls
  vllm_hybrid_npu_lab.scheduling.scheduler.LeanCheckpointScheduler`` for a served engine).
* :mod:`.retention` / :mod:`.lean`: policy ``lean`` (chunk ends at the prompt's last two block
  boundaries, only those states kept, kept states and their attention blocks evicted as
  segments, orphaned attention blocks first).
* ``tail`` and ``adaptive`` (retired 2026-11-23, docs/hitrate-lab.md) are split rules of
  ``vllm_hybrid_npu_lab/retired_policies.py`` passed to :func:`.scheduler.scheduler_class`.

Nothing here reads an environment variable; importing the package does not import vLLM.
"""

from __future__ import annotations
