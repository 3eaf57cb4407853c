"""Policy registry of the hit-rate lab.

A *policy* is a way of scheduling/caching that the lab replays a trace under. The registry
:data:`POLICIES` maps a name (the ``--policy`` value) to a :class:`Policy`.

Interface (what a policy must supply, for the policies of issue 7 and later):

* ``name``: the registry key, also the name used by ``VLLM_HYBRID_NPU_CHECKPOINTS`` where the
  engine has the same policy.
* ``description``: one line for ``--help``/reports.
* ``scheduler_class()``: returns the scheduler class to instantiate. It is constructed exactly
  as vLLM's ``EngineCore`` constructs ``vllm.v1.core.sched.scheduler.Scheduler`` (vLLM 0.30):
  ``cls(vllm_config=..., kv_cache_config=..., structured_output_manager=..., block_size=...,
  hash_block_size=..., log_stats=False)``, and driven with ``schedule()`` /
  ``update_from_output()`` / ``add_request()``. A subclass of vLLM's ``Scheduler`` is the
  expected form. Import vLLM inside this method (the registry is imported for ``--help``).
* ``configure(vllm_config)`` (optional, default no-op): adjusts the ``VllmConfig`` (e.g.
  ``cache_config`` fields) before the KV-cache config and the scheduler are built; called once per
  replay on a config built for that replay only.
* ``tune(vllm_config, block_size)`` (optional): like ``configure`` but called once the hybrid's
  block size is final (upstream option values expressed in blocks, :mod:`.upstream_grid`).
* ``prefill_checkpoints`` (optional, default ``False``): build the setup with the runtime's GDN
  prefill-checkpoint exporter declared (:mod:`.exporter`); :func:`setup_kwargs` passes it on.

Register with :func:`register_policy`; a name can be registered once (``ValueError`` otherwise).
Modules listed in :data:`POLICY_MODULES` register policies when imported;
:func:`load_policy_modules` imports them (``get_policy`` and the CLI call it), so a new policy
module only needs its name added there.
``upstream`` is the installed vLLM's own ``Scheduler``, unmodified, in align mode.
"""

from __future__ import annotations

import importlib

#: modules that register more policies on import (``lean`` and its levers, the retired ``tail`` and
#: ``adaptive``, the upstream option grid); a module
#: that is not installed is skipped, any other import error propagates
POLICY_MODULES: tuple[str, ...] = (
    "vllm_hybrid_npu_lab.upstream_grid",
    "vllm_hybrid_npu_lab.engine_policies",
)

#: The documented default policy (``--policy default``, the JSON's ``default_policy``): what the
#: runtime does by default since 2026-11-25 (issue 20): vLLM's own scheduler, with the GDN layers
#: declaring the prefill checkpoint the runtime exports (``upstream:ckpt``). ``lean`` was the
#: default until then (docs/hitrate-lab.md, "Which policy"); it is a retired row now.
DEFAULT_POLICY = "upstream:ckpt"

#: Pseudo-policy: the best upstream setting per point (:mod:`.upstream_grid`).
UPSTREAM_BEST = "upstream-best"


# The registry itself lives in .registry (policy modules import it, not this module, so that
# POLICY_MODULES naming them makes no import cycle); re-exported here.
from vllm_hybrid_npu_lab.registry import POLICIES, Policy, register_policy  # noqa: E402,F401


def load_policy_modules() -> None:
    """Import every module of :data:`POLICY_MODULES` that exists (they register on import)."""
    for module in POLICY_MODULES:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if not (exc.name and module.startswith(exc.name)):
                raise


def get_policy(name: str) -> Policy:
    """Return the registered policy ``name``; ``ValueError`` naming ``--policy`` if unknown or
    not replayable on the installed vLLM (:meth:`Policy.unavailable`)."""
    load_policy_modules()
    if name == "default":
        name = DEFAULT_POLICY
    from vllm_hybrid_npu_lab.upstream_grid import ensure_registered

    ensure_registered(name)
    try:
        policy = POLICIES[name]
    except KeyError:
        raise ValueError(
            f"--policy {name!r}: unknown policy; registered: {', '.join(POLICIES)}"
        ) from None
    why = policy.unavailable()
    if why:
        raise ValueError(f"--policy {name!r}: {why}")
    return policy


def policy_unavailable(name: str) -> str | None:
    """Why the registered policy ``name`` cannot be replayed on the installed vLLM
    (:meth:`Policy.unavailable`), or None (also for names not registered)."""
    load_policy_modules()
    policy = POLICIES.get(DEFAULT_POLICY if name == "default" else name)
    return policy.unavailable() if policy else None


def setup_kwargs(policy: Policy) -> dict:
    """The :func:`vllm_hybrid_npu_lab.model.build_setup` keywords a policy supplies."""
    return dict(configure=policy.configure, tune=policy.tune,
                prefill_checkpoints=policy.prefill_checkpoints)


def _upstream_scheduler() -> type:
    from vllm.v1.core.sched.scheduler import Scheduler

    return Scheduler


if "upstream" not in POLICIES:
    register_policy(
        Policy(
            name="upstream",
            description="the installed vLLM's Scheduler, unmodified (align mode)",
            scheduler_class=_upstream_scheduler,
        )
    )


#: Pseudo-policy: prefix caching off (the reference the extra prefill steps are measured against).
CACHING_OFF = "caching-off"


def caching_off(vllm_config) -> None:
    """``configure`` hook of :data:`CACHING_OFF`: what ``vllm serve --no-enable-prefix-caching``
    gives a hybrid model: no prefix caching and ``mamba_cache_mode='none'`` (one running state per
    request, nothing cached), so vLLM's scheduler never splits for Mamba
    (``need_mamba_block_aligned_split`` is false): a prompt's chunks end only where the token
    budget ends them. The Mamba block is ``max_model_len`` tokens, as vLLM 0.30's
    ``MambaModelConfig.verify_and_update_config`` sets it without prefix caching."""
    cache_config = vllm_config.cache_config
    cache_config.enable_prefix_caching = False
    cache_config.mamba_cache_mode = "none"
    cache_config.mamba_block_size = vllm_config.model_config.max_model_len


if CACHING_OFF not in POLICIES:
    register_policy(
        Policy(
            name=CACHING_OFF,
            description="reference, not a policy: prefix caching off (vLLM's "
            "--no-enable-prefix-caching): no hits, no align-mode split; its extra prefill steps "
            "are the load's (the token budget shared in a step)",
            scheduler_class=_upstream_scheduler,
            configure=caching_off,
        )
    )


def _free_states_scheduler() -> type:
    from vllm.v1.core.sched.scheduler import Scheduler

    from vllm_hybrid_npu_lab.bounds import free_states_scheduler

    return free_states_scheduler(Scheduler)


if "free-states" not in POLICIES:
    register_policy(
        Policy(
            name="free-states",
            description="reference, not a policy: cached GDN states free and everywhere, running "
            "requests' states charged (vllm_hybrid_npu_lab/bounds.py)",
            scheduler_class=_free_states_scheduler,
        )
    )
