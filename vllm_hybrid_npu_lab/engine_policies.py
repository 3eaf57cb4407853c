"""The checkpoint policies (``lean``, the retired ``tail`` and ``adaptive``, ``gdn`` variants and lab-only ``lean`` lever variants) registered in the hit-rate lab.

Importing this module registers them in :data:`vllm_hybrid_npu_lab.policies.POLICIES`;
``upstream`` is the lab's own entry. All of them are retired comparison rows: placement is vLLM's
in the runtime since 2026-11-25 (issue 20; ``lean`` was ``VLLM_HYBRID_NPU_CHECKPOINTS=lean``
until then), ``tail`` and ``adaptive`` were retired on 2026-11-23 (:mod:`.retired_policies`: split
rules passed to :func:`vllm_hybrid_npu_lab.scheduling.scheduler.scheduler_class`). Registration
is idempotent (a second import, or a name already registered by this module, is skipped).

``lean``'s ``scheduler_class()`` is :func:`vllm_hybrid_npu_lab.scheduling.scheduler.scheduler_class`
over vLLM's ``Scheduler``: the class the plugin installed in engines until 2026-11-25 (there the
base was ``AsyncScheduler`` when async scheduling was on; both share the split and retention
code); an engine the lab builds gets it as ``scheduler_cls``.
"""

from __future__ import annotations

from vllm_hybrid_npu_lab.registry import POLICIES, Policy, register_policy
from vllm_hybrid_npu_lab.retired_policies import RULES as RETIRED_RULES

DESCRIPTIONS = {
    "tail": "retired from the runtime (= vLLM's --long-prefill-token-threshold <block size> "
    "--prefix-cache-retention-interval None): " + RETIRED_RULES["tail"].description,
    "adaptive": "retired from the runtime (below upstream's best): "
    + RETIRED_RULES["adaptive"].description,
    "lean": "checkpoints at the prompt's last 2 block boundaries; keeps only those, decode "
    "boundaries and junctions; segment-ordered eviction (orphaned attention blocks first)",
}

#: Lab-only variants of ``lean`` isolating one lever each (not selectable in the engine):
#: name -> (description, attribute overrides of LeanRetentionMixin / lean_levers.LeanLeversMixin)
LEVERS: dict[str, tuple[str, dict]] = {
    "lean-r": ("lab-only lever: lean's chunk ends and sparse retention, vLLM's LRU order",
               {"lean_order": False}),
    "lean-w1": ("lab-only lever: lean keeping only the prompt's last boundary",
                {"lean_window": 1}),
    "lean-w3": ("lab-only lever: lean keeping the prompt's last 3 boundaries",
                {"lean_window": 3}),
    "lean-ladder": ("lab-only lever: lean + the adaptive ladder's chunk ends and states",
                    {"lean_ladder": True}),
    "lean-hold": ("lab-only lever: lean + holding kept states until the request ends",
                  {"lean_hold": True}),
    "lean-nodecode": ("lab-only lever: lean without the states crossed in decode",
                      {"lean_decode": False}),
    "lean-supersede": ("lab-only lever: lean + a hit sends the window states just below it to "
                       "the front of the free queue", {"lean_supersede": True}),
}


def _factory(policy: str):
    def scheduler_class() -> type:
        from vllm_hybrid_npu_lab.scheduling.scheduler import scheduler_class as make

        return make(RETIRED_RULES.get(policy, policy))

    return scheduler_class


def _lever_factory(name: str, overrides: dict):
    def scheduler_class() -> type:
        from vllm_hybrid_npu_lab.lean_levers import lever_scheduler

        return lever_scheduler(name, overrides)

    return scheduler_class


#: GDN chunk of the chunked kernels (FLA on CUDA, ``chunk_gated_delta_rule_cpu``): what the
#: engine's ``gdn`` mode reports as the Mamba chunk size, so 'all' mode aligns blocks to it
GDN_CHUNK_TOKENS = 64


def all_mode(vllm_config) -> None:
    """Lab ``configure`` hook: vLLM 0.30's ``mamba_cache_mode='all'`` for the GDN model.

    vLLM itself falls back to ``align`` for GDN models (``MambaModelConfig.verify_and_update_config``,
    vllm/model_executor/models/config.py, no ``supports_mamba_prefix_caching``); the lab forces
    ``all`` since it simulates the forward pass, as the engine's retired ``VLLM_HYBRID_NPU_CHECKPOINTS=gdn``
    did. The Mamba block is aligned to the 64-token GDN chunk (``mamba_block_size`` as a user
    value, which ``Platform._align_hybrid_block_size`` rounds up to a multiple of the chunk that
    holds one state page), as the engine's ``get_mamba_chunk_size`` patch makes vLLM do.
    """
    cc = vllm_config.cache_config
    cc.mamba_cache_mode = "all"
    cc.mamba_block_size = GDN_CHUNK_TOKENS
    cc.user_specified_mamba_block_size = True


#: vLLM versions the retired runtime policies were written against (:attr:`Policy.vllm`)
RETIRED_VLLM = ("0.30.0",)

#: name -> (description, scheduler policy, LeanRetentionMixin overrides or None)
GDN_POLICIES: dict[str, tuple[str, str, dict | None]] = {
    "gdn-lean": (
        "lab-only: 'all'-mode states captured in the step, kept and evicted like lean "
        "(prompt's last 2 boundaries, decode, junctions; segment-ordered eviction)",
        "lean",
        {"lean_modes": ("all",)},
    ),
}


def _gdn_factory(name: str, policy: str, overrides: dict | None):
    def scheduler_class() -> type:
        from vllm_hybrid_npu_lab.scheduling.scheduler import scheduler_class as make

        from vllm_hybrid_npu_lab.lean_levers import lever_scheduler

        base = make(policy)
        if overrides is None:
            return base
        return lever_scheduler(name, overrides, base)

    return scheduler_class


def register() -> list[str]:
    """Register ``tail``, ``adaptive``, ``lean``, the ``gdn`` variants and the lean levers in the
    lab (skipping names already present).

    Returns:
        The names registered by this call.
    """
    done = []
    for name, desc in DESCRIPTIONS.items():
        if name in POLICIES:
            continue
        register_policy(Policy(name=name, description=desc, scheduler_class=_factory(name),
                               vllm=RETIRED_VLLM))
        done.append(name)
    for name, (desc, policy, overrides) in GDN_POLICIES.items():
        if name in POLICIES:
            continue
        register_policy(
            Policy(name=name, description=desc,
                   scheduler_class=_gdn_factory(name, policy, overrides), configure=all_mode,
                   vllm=RETIRED_VLLM)
        )
        done.append(name)
    for name, (desc, overrides) in LEVERS.items():
        if name in POLICIES:
            continue
        register_policy(
            Policy(name=name, description=desc, scheduler_class=_lever_factory(name, overrides),
                   vllm=RETIRED_VLLM)
        )
        done.append(name)
    return done


register()
