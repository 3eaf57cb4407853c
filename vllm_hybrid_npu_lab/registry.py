"""The lab's policy registry: :class:`Policy` and :data:`POLICIES` (the contract is in
:mod:`vllm_hybrid_npu_lab.policies`, which re-exports these and loads the policy modules)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable


def _noop(vllm_config: Any) -> None:
    return None


@dataclass(frozen=True)
class Policy:
    """A replay policy (see :mod:`vllm_hybrid_npu_lab.policies` for the contract)."""

    name: str
    description: str
    scheduler_class: Callable[[], type]
    configure: Callable[[Any], None] = field(default=_noop)
    tune: Callable[[Any, int], None] | None = None
    #: replay the runtime's GDN prefill-checkpoint exporter (``VLLM_HYBRID_NPU_PREFILL_CHECKPOINTS
    #: =auto``): the GDN specs declare one checkpoint block (alignment 64), the hybrid block is
    #: rounded up to the 64-token grid and, on vLLM 0.30, the runtime's retention fix is active
    #: (:func:`vllm_hybrid_npu_lab.exporter.exporter_scheduler`)
    prefill_checkpoints: bool = False


#: name -> Policy; iterate in registration order
POLICIES: dict[str, Policy] = {}


def register_policy(policy: Policy) -> Policy:
    """Add ``policy`` to :data:`POLICIES` and return it; ``ValueError`` if the name is taken."""
    if policy.name in POLICIES:
        raise ValueError(f"policy {policy.name!r} is already registered")
    POLICIES[policy.name] = policy
    return policy
