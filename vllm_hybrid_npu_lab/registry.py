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
    #: vLLM versions the policy's scheduler hooks were written against (None: any). The retired
    #: runtime policies (``lean`` and its variants, ``tail``, ``adaptive``) hook vLLM 0.30's
    #: ``KVCacheCoordinator.get_replay_boundaries`` and its retention rules; 0.32 moved both.
    vllm: tuple[str, ...] | None = None
    #: what :meth:`unavailable` adds on another vLLM (why the policy is tied to :attr:`vllm`)
    vllm_why: str = "it is a retired lab row kept for comparison there"

    def unavailable(self) -> str | None:
        """Why this policy cannot be replayed on the installed vLLM, or None."""
        if self.vllm is None:
            return None
        import vllm

        from vllm_hybrid_npu.support import base_version

        installed = base_version(vllm.__version__)
        if installed in self.vllm:
            return None
        return (f"policy {self.name!r} was written against vLLM {', '.join(self.vllm)} "
                f"(installed: {installed}); {self.vllm_why}")


#: name -> Policy; iterate in registration order
POLICIES: dict[str, Policy] = {}


def register_policy(policy: Policy) -> Policy:
    """Add ``policy`` to :data:`POLICIES` and return it; ``ValueError`` if the name is taken."""
    if policy.name in POLICIES:
        raise ValueError(f"policy {policy.name!r} is already registered")
    POLICIES[policy.name] = policy
    return policy
