"""Early, flag-naming configuration errors for align mode.

Run on the user's settings before vLLM's own model-specific config hooks rewrite them (vLLM
0.30.0 / 0.32.0 ``VllmConfig.try_verify_and_update_config`` -> ``MambaModelConfig.
verify_and_update_config`` silently turns ``--mamba-cache-mode align`` into ``none`` when prefix
caching is off, and only ``assert``s chunked prefill). Raising here happens while the
configuration is being built in the API-server / ``LLM`` process, before any engine-core or
worker process exists, so a rejected configuration leaves no half-started engine behind.

What vLLM 0.30.0 itself supports for align mode (read from its source, not guessed):

* ``--enable-prefix-caching`` (else the mode is reset to ``none``), except with a KV-transfer
  connector (vllm-ascend 0.30.0rc2 uses align without prefix caching for PD disaggregation);
* chunked prefill (``MambaModelConfig.verify_and_update_config`` asserts it);
* chunked multimodal input (``VllmConfig`` asserts ``not disable_chunked_mm_input``);
* no prefill context parallelism (``HybridKVCacheCoordinator`` asserts ``pcp_world_size == 1``);
* ``--use-replayssm`` with align needs model runner V2 (vLLM raises this itself).

vLLM 0.32.0 does the same, except that ``--mamba-cache-mode all`` is gone (``MambaCacheMode`` is
``Literal["align", "none"]``: ``CacheConfig`` rejects ``all`` itself, a pydantic error naming
``mamba_cache_mode``). :func:`check_align_mode` holds these semantics (0.23.0 - 0.32.0).

What vLLM 0.33.0 does (read from its source, ``vllm/engine/arg_utils.py``,
``vllm/model_executor/models/config.py``, ``vllm/config/vllm.py``,
``vllm/v1/core/kv_cache_coordinator.py``; checked by building configs with 0.33's Python files):

* flag spelling: 0.33's command line pairs ``--enable-x`` with ``--disable-x``
  (``EnableDisableAction``); ``--no-enable-x`` is still accepted but hidden from ``--help``. The
  0.33 messages name both spellings; 0.30 / 0.32 have ``--no-enable-x`` only.
* ``--mamba-cache-mode`` is deprecated: ``EngineArgs.create_engine_config`` logs (once per
  process) "--mamba-cache-mode is deprecated ... It has no effect: Mamba prefix caching follows
  --enable-prefix-caching" and does **not** pass the value to ``CacheConfig``, so the explicit
  value never reaches ``VllmConfig``. ``MambaModelConfig.verify_and_update_config`` then sets
  the mode from prefix caching alone: ``align`` when it is on, ``none`` when it is off (a
  ``CacheConfig`` built by hand with ``align`` and prefix caching off is reset to ``none`` with a
  warning). Prefix caching is on by default for the hybrid models (``is_prefix_caching_supported``).
  So, silently for the user's explicit choice:
  - ``--mamba-cache-mode align`` with prefix caching off (``--disable-prefix-caching``, or the
    model's default; with or without a KV-transfer connector): runs with ``none``;
  - ``--mamba-cache-mode none`` with prefix caching on: runs with ``align``;
  - ``--mamba-cache-mode all``: the command line rejects it (``MambaCacheMode`` choices), but
    ``LLM(..., mamba_cache_mode="all")`` / ``EngineArgs`` is accepted and ignored (no
    ``CacheConfig`` validation sees it any more);
  - ``--mamba-cache-mode align`` / ``none`` matching prefix caching: only the deprecation warning.
  :func:`check_mamba_cache_mode_flag` raises for the first three, naming ``--mamba-cache-mode``
  and ``--enable-prefix-caching`` / ``--disable-prefix-caching``; the fourth is left to vLLM's
  warning.
* ``--disable-chunked-prefill`` with prefix caching on: ``MambaModelConfig`` only ``assert``s
  ("Chunked prefill is required for Mamba prefix caching.", a pydantic ``ValidationError`` naming
  no flag; gone under ``python -O``).
* ``--disable-chunked-mm-input`` with align: accepted while the config is built; the
  ``assert`` is in ``VllmConfig.validate_block_size``, which the engine core calls after the KV
  cache is sized, i.e. in a started engine process.
* ``--prefill-context-parallel-size`` > 1 with prefix caching of a model with Mamba layers:
  accepted while the config is built (model runner V1 refuses PCP itself; V2 does not);
  ``HybridKVCacheCoordinator`` asserts "PCP only supports full attention ..." in the engine core.
* ``--use-replayssm`` with prefix caching: vLLM raises clear ``ValueError``s itself
  (``VllmConfig.validate_mamba_cached_kernel``); left to it.
* a model without Mamba/GDN layers: the mode stays ``none``; vLLM's deprecation warning already
  says the flag has no effect.
:func:`check_align_mode_v033` raises for the chunked-prefill, chunked-multimodal-input and PCP
cases (align mode being prefix caching on a model with Mamba/GDN layers on 0.33), and for a
``CacheConfig`` with ``align`` and prefix caching off.

vLLM 0.34.0 does the same (read from its source: ``EngineArgs.create_engine_config``
still logs the deprecation and does not pass ``--mamba-cache-mode`` to ``CacheConfig``;
``MambaModelConfig.verify_and_update_config``, ``VllmConfig.try_verify_and_update_config``,
``validate_block_size``'s chunked-multimodal-input ``assert``, ``kv_cache_coordinator.py`` and
``EnableDisableAction`` unchanged; its deprecation text now says "removed in v0.34.0" although the
flag is still there), so both checks run there with 0.33's semantics (checked by building configs
with 0.34's Python files, ``tests/patches/test_config_checks.py``). One difference at the same
stage: 0.34's CPU platform refuses any configuration on an x86 CPU without triton-cpu.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("vllm_hybrid_npu")


class AlignModeConfigError(ValueError):
    """A configuration align mode cannot run with; the message names the flag to change."""


def model_has_mamba_layers(model_config: Any) -> bool:
    """True when the model has Mamba/GDN (recurrent-state) layers (hybrid or attention-free).

    Args:
        model_config: ``vllm.config.ModelConfig``.
    """
    return bool(
        getattr(model_config, "is_hybrid", False)
        or getattr(model_config, "is_attention_free", False)
        or getattr(model_config, "has_inner_state", False)
    )


def check_align_mode(vllm_config: Any) -> bool:
    """Validate an align-mode configuration; return whether align mode will be active.

    vLLM 0.23.0 - 0.32.0 semantics (the mode is ``CacheConfig.mamba_cache_mode``, set from
    ``--mamba-cache-mode``); for 0.33.0 see :func:`check_align_mode_v033`.

    Args:
        vllm_config: ``vllm.config.VllmConfig`` as built from the user's flags (before vLLM's
            per-model config hooks ran).

    Returns:
        True when ``--mamba-cache-mode align`` applies to a model with Mamba/GDN layers; False
        when align mode is not requested, or requested for a model without such layers (then a
        warning is logged and nothing is changed).

    Raises:
        AlignModeConfigError: ``--mamba-cache-mode align`` without ``--enable-prefix-caching``
            (and without a KV-transfer connector); with ``--no-enable-chunked-prefill``; with
            ``--disable-chunked-mm-input``; with ``--prefill-context-parallel-size`` > 1.
    """
    cache = getattr(vllm_config, "cache_config", None)
    model = getattr(vllm_config, "model_config", None)
    if cache is None or model is None or getattr(cache, "mamba_cache_mode", "none") != "align":
        return False
    if not model_has_mamba_layers(model):
        logger.warning(
            "--mamba-cache-mode align has no effect: model %s has no Mamba/GDN layers",
            getattr(model, "model", "?"),
        )
        return False
    if not getattr(cache, "enable_prefix_caching", False) and not getattr(
        vllm_config, "kv_transfer_config", None
    ):
        raise AlignModeConfigError(
            "--mamba-cache-mode align caches the Mamba/GDN state for prefix caching and needs "
            "--enable-prefix-caching (got prefix caching disabled); add --enable-prefix-caching "
            "or drop --mamba-cache-mode align"
        )
    _check_align_requirements(
        vllm_config, "--mamba-cache-mode align", "--no-enable-chunked-prefill", ""
    )
    return True


_V033_ALIGN = (
    "prefix caching of a model with Mamba/GDN layers (vLLM 0.33 / 0.34: align mode, which follows "
    "--enable-prefix-caching)"
)
#: vLLM 0.33's command line pairs ``--enable-x`` with ``--disable-x`` (``EnableDisableAction``;
#: ``--no-enable-x`` still accepted, hidden from ``--help``): both spellings are named.
_V033_NO_PREFIX_CACHING = "--disable-prefix-caching (--no-enable-prefix-caching)"
_V033_NO_CHUNKED_PREFILL = "--disable-chunked-prefill (--no-enable-chunked-prefill)"


def check_align_mode_v033(vllm_config: Any) -> bool:
    """Validate the configuration with vLLM 0.33.0's semantics; return whether align mode will be
    active.

    On vLLM 0.33.0 align mode is prefix caching on a model with Mamba/GDN layers
    (``MambaModelConfig.verify_and_update_config`` sets ``mamba_cache_mode`` from
    ``enable_prefix_caching``; ``--mamba-cache-mode`` never reaches ``VllmConfig``, see
    :func:`check_mamba_cache_mode_flag`). Runs before that hook, like :func:`check_align_mode`.

    Args:
        vllm_config: ``vllm.config.VllmConfig`` as built from the user's flags (prefix caching
            and chunked prefill already resolved by ``EngineArgs``).

    Returns:
        True when prefix caching is on for a model with Mamba/GDN layers; False otherwise
        (nothing logged: for an explicit ``--mamba-cache-mode`` vLLM logs its own deprecation
        warning).

    Raises:
        AlignModeConfigError: a ``CacheConfig`` with ``mamba_cache_mode="align"`` and prefix
            caching off (vLLM 0.33 resets it to ``none``); with prefix caching on,
            ``--disable-chunked-prefill`` (0.33 only asserts), ``--disable-chunked-mm-input``
            or ``--prefill-context-parallel-size`` > 1 (0.33 asserts in the engine core).
    """
    cache = getattr(vllm_config, "cache_config", None)
    model = getattr(vllm_config, "model_config", None)
    if cache is None or model is None or not model_has_mamba_layers(model):
        return False
    prefix_caching = bool(getattr(cache, "enable_prefix_caching", False))
    if getattr(cache, "mamba_cache_mode", "none") == "align" and not prefix_caching:
        raise AlignModeConfigError(
            "--mamba-cache-mode align contradicts prefix caching disabled "
            f"({_V033_NO_PREFIX_CACHING} or the model's default): vLLM 0.33 / 0.34 ignore "
            "--mamba-cache-mode and caches Mamba/GDN states only with --enable-prefix-caching; "
            "add --enable-prefix-caching or drop --mamba-cache-mode align"
        )
    if not prefix_caching:
        return False
    _check_align_requirements(
        vllm_config, _V033_ALIGN, _V033_NO_CHUNKED_PREFILL, f" or add {_V033_NO_PREFIX_CACHING}"
    )
    return True


def check_mamba_cache_mode_flag(
    engine_args: Any, vllm_config: Any, explicit_prefix_caching: bool | None
) -> None:
    """vLLM 0.33.0: reject an explicit ``--mamba-cache-mode`` that vLLM would silently ignore.

    vLLM 0.33.0's ``EngineArgs.create_engine_config`` logs the flag's deprecation and drops its
    value; the mode follows prefix caching. Called with the ``VllmConfig`` it built.

    Args:
        engine_args: the ``vllm.engine.arg_utils.EngineArgs`` (``mamba_cache_mode`` is None
            unless the user passed it).
        vllm_config: the ``VllmConfig`` built from ``engine_args``.
        explicit_prefix_caching: ``engine_args.enable_prefix_caching`` before vLLM resolved its
            default (None: the user did not pass the flag).

    Raises:
        AlignModeConfigError: a mode other than ``align`` / ``none`` (possible through ``LLM``
            / ``EngineArgs``; the command line rejects it itself); ``align`` with prefix
            caching off, or ``none`` with prefix caching on, for a model with Mamba/GDN layers.
            The message names ``--mamba-cache-mode`` and the prefix-caching flag.
    """
    mode = getattr(engine_args, "mamba_cache_mode", None)
    if mode is None:
        return
    if mode not in ("align", "none"):
        raise AlignModeConfigError(
            f"--mamba-cache-mode {mode} is not a mode of vLLM 0.33 / 0.34 (align or none; the "
            "flag is deprecated and ignored there: Mamba/GDN caching follows --enable-prefix-caching); "
            "drop --mamba-cache-mode"
        )
    model = getattr(vllm_config, "model_config", None)
    cache = getattr(vllm_config, "cache_config", None)
    if model is None or cache is None or not model_has_mamba_layers(model):
        return  # vLLM's own deprecation warning says the flag has no effect
    prefix_caching = bool(getattr(cache, "enable_prefix_caching", False))
    if mode == "align" and not prefix_caching:
        given = (
            _V033_NO_PREFIX_CACHING if explicit_prefix_caching is False
            else "prefix caching off by the model's default"
        )
        raise AlignModeConfigError(
            f"--mamba-cache-mode align contradicts {given}: vLLM 0.33 / 0.34 ignore the deprecated "
            "--mamba-cache-mode and would run without caching Mamba/GDN states; use "
            "--enable-prefix-caching (align mode on 0.33) and drop --mamba-cache-mode"
        )
    if mode == "none" and prefix_caching:
        given = (
            "--enable-prefix-caching" if explicit_prefix_caching
            else "--enable-prefix-caching (the model's default)"
        )
        raise AlignModeConfigError(
            f"--mamba-cache-mode none contradicts {given}: vLLM 0.33 / 0.34 ignore the deprecated "
            "--mamba-cache-mode and caches Mamba/GDN states in align mode whenever prefix "
            f"caching is on; use {_V033_NO_PREFIX_CACHING} for no caching and drop "
            "--mamba-cache-mode"
        )


def _check_align_requirements(
    vllm_config: Any, what: str, no_chunked_prefill: str, fix: str
) -> None:
    """Chunked prefill, chunked multimodal input, no prefill context parallelism.

    Args:
        what: the setting that turned align mode on (starts the message).
        no_chunked_prefill: the flag that turns chunked prefill off, as that vLLM spells it.
        fix: alternative fix appended to "remove <flag>" (``""`` for none).
    """
    sched = getattr(vllm_config, "scheduler_config", None)
    if sched is not None and getattr(sched, "enable_chunked_prefill", True) is False:
        raise AlignModeConfigError(
            f"{what} needs chunked prefill (vLLM schedules prompts in block-aligned chunks); "
            f"remove {no_chunked_prefill}{fix}"
        )
    if sched is not None and getattr(sched, "disable_chunked_mm_input", False):
        raise AlignModeConfigError(
            f"{what} needs chunked multimodal input; remove --disable-chunked-mm-input{fix}"
        )
    par = getattr(vllm_config, "parallel_config", None)
    pcp = int(getattr(par, "prefill_context_parallel_size", 1) or 1)
    if pcp > 1:
        raise AlignModeConfigError(
            f"{what} does not support prefill context parallelism in vLLM "
            f"(got --prefill-context-parallel-size {pcp}); use 1{fix}"
        )
