"""Patches of vLLM's configuration building: ``VllmConfig.try_verify_and_update_config``
(``vllm.config.vllm``, vLLM 0.23.0, 0.30.0, 0.32.0, 0.33.0, 0.34.0) and, on vLLM 0.33.0 / 0.34.0,
``EngineArgs.create_engine_config`` (``vllm.engine.arg_utils``).

* ``config-checks``: runs the align-mode checks of :mod:`vllm_hybrid_npu.core.config_checks` on
  the user's settings first, with the semantics of the installed vLLM:
  :func:`~vllm_hybrid_npu.core.config_checks.check_align_mode` (0.23.0 - 0.32.0) or
  :func:`~vllm_hybrid_npu.core.config_checks.check_align_mode_v033` (0.33.0, 0.34.0: the same
  ``EngineArgs`` / ``MambaModelConfig`` code). vLLM's model hooks
  (``MambaModelConfig.verify_and_update_config``) otherwise change the mode silently and only
  ``assert`` chunked prefill; here the user gets an error naming the flag, raised while the
  configuration is built (API server / ``LLM`` process), before any engine process exists.
  It runs once per config (``model_config.config_updated`` false), then upstream's method.
* ``config-checks-flag`` (vLLM 0.33.0, 0.34.0): 0.33's ``EngineArgs.create_engine_config``
  deprecates ``--mamba-cache-mode`` and drops its value before ``VllmConfig`` is built, so only
  ``EngineArgs`` still holds what the user asked for. After upstream's method built the config,
  :func:`~vllm_hybrid_npu.core.config_checks.check_mamba_cache_mode_flag` rejects an explicit
  mode that contradicts prefix caching (naming both flags); the config is returned unchanged
  otherwise.
* ``token-budget-default``, ``token-budget``, ``token-budget-check`` (vLLM 0.30.0, 0.32.0; CPU and
  CUDA, where the GDN prefill-checkpoint exporter applies): no extra engine step for a chunked
  cold prefill in align mode (:mod:`vllm_hybrid_npu.core.token_budget`). vLLM ends
  every non-final chunk on a block boundary, so a token budget that is not a block multiple costs
  a step per chunk boundary (16,384 tokens at Qwen3.5's block of 1,088: a 32,768-token prompt in
  3 steps, caching off 2). ``EngineArgs._set_default_max_num_seqs_and_batched_tokens_args`` is
  where vLLM picks its default budget: the first entry records on the ``ModelConfig`` that the
  budget is vLLM's (the user set neither ``--max-num-batched-tokens`` nor
  ``--max-num-scheduled-tokens``). ``VllmConfig._set_compile_ranges`` is the first step of
  ``VllmConfig.__post_init__`` after the platform's config updates that reads the budget (vLLM
  recomputes the compile ranges there because a platform may change the budget): the second
  entry raises a default budget to the next multiple of the hybrid block predicted with vLLM's
  rule (the block itself is fixed only in the worker, after the runner has sized its buffers
  from the budget), logging what changed, why and what it costs. ``VllmConfig.validate_block_size``
  runs in the engine core once the block is final, before the scheduler exists: the third entry
  brings a raised budget whose prediction missed to the real block's multiple
  (``max_num_scheduled_tokens``, within the raised buffers) and, for a budget the user set, logs
  the budget that would save the step (never changing it). ``VLLM_HYBRID_NPU_OPTIONS=budget=off``
  skips all three.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable

from vllm_hybrid_npu import envs
from vllm_hybrid_npu.core import token_budget
from vllm_hybrid_npu.patches.registry import Patch
from vllm_hybrid_npu.support import Stack

logger = logging.getLogger("vllm_hybrid_npu")

VLLM_VERSIONS = ("0.23.0", "0.30.0", "0.32.0", "0.33.0", "0.34.0")
#: vLLM versions whose ``EngineArgs`` ignores ``--mamba-cache-mode`` (deprecated).
VLLM_VERSIONS_DEPRECATED_MODE_FLAG = ("0.33.0", "0.34.0")


def _align_check(stack: Stack) -> Callable[[Any], Any]:
    from vllm_hybrid_npu.core import config_checks

    if stack.vllm in VLLM_VERSIONS_DEPRECATED_MODE_FLAG:
        return config_checks.check_align_mode_v033
    return config_checks.check_align_mode


def _make_config_checks(upstream: Any, stack: Stack) -> Any:
    check = _align_check(stack)

    @functools.wraps(upstream)
    def try_verify_and_update_config(self, *args, **kwargs):
        model_config = getattr(self, "model_config", None)
        if model_config is not None and not getattr(model_config, "config_updated", False):
            check(self)
        return upstream(self, *args, **kwargs)

    return try_verify_and_update_config


def _make_flag_check(upstream: Any, stack: Stack) -> Any:
    from vllm_hybrid_npu.core.config_checks import check_mamba_cache_mode_flag

    @functools.wraps(upstream)
    def create_engine_config(self, *args, **kwargs):
        explicit_prefix_caching = getattr(self, "enable_prefix_caching", None)
        vllm_config = upstream(self, *args, **kwargs)
        check_mamba_cache_mode_flag(self, vllm_config, explicit_prefix_caching)
        return vllm_config

    return create_engine_config


# --------------------------------------------------------------------------- token budget
#: The option (``VLLM_HYBRID_NPU_OPTIONS`` key): ``auto`` (default) or ``off`` (the
#: ``token-budget*`` entries skipped).
TOKEN_BUDGET_KEY = "budget"
#: vLLM versions whose budget default, compile ranges and block validation these entries read.
TOKEN_BUDGET_VERSIONS = ("0.30.0", "0.32.0")
#: Attribute on ``ModelConfig``: vLLM's default budget (tokens), set only when the user set no budget.
DEFAULT_MARK = "_vllm_hybrid_npu_default_budget"
#: Attribute on ``VllmConfig``: what ``token-budget`` did (``{"original", "predicted_block"}``).
RAISED_MARK = "_vllm_hybrid_npu_token_budget"
#: Smallest kernel block (tokens) of the attention backend vLLM 0.30.0 / 0.32.0 picks for these
#: models: FlashAttention ``MultipleOf(16)`` on CUDA, ``CPUAttentionBackend`` ``MultipleOf(32)``.
MIN_KERNEL_BLOCK = {"cuda": 16, "cpu": 32}

_advised: set[tuple[int, int]] = set()


def token_budget_mode() -> str:
    """The option ``budget`` (default ``auto``).

    Raises:
        ValueError: another value (the message names the variable).
    """
    return envs.option(TOKEN_BUDGET_KEY)


def _token_budget_wanted(stack: Stack) -> str | None:
    if token_budget_mode() == "off":
        return f"{envs.option_text(TOKEN_BUDGET_KEY, 'off')}"
    from vllm_hybrid_npu.patches.gdn_prefill_checkpoint import ENV_VAR, mode

    if mode() == "off":
        return f"{ENV_VAR}=off (no exporter: vLLM's split stops at block boundaries anyway)"
    return None


def predict_hybrid_block(vllm_config: Any, target: str) -> tuple[int | None, str]:
    """The hybrid block (tokens) the engine will run with, predicted while the configuration is
    built, with vLLM's rule (:func:`vllm_hybrid_npu.core.token_budget.predict_block`), for a
    Qwen GDN model in align mode with the exporter (64-token grid).

    Reads what ``Platform._align_hybrid_block_size`` reads: the attention page of one token
    (``FullAttentionSpec(block_size=1)``, the model's KV heads and head size, KV cache dtype
    ``auto``), the GDN state page (``MambaStateShapeCalculator.gated_delta_net_state_shape`` and
    ``MambaStateDtypeCalculator.gated_delta_net_state_dtype``, as the Qwen3-Next / Qwen3.5 model
    classes call them), the configured block and the backend's kernel block
    (:data:`MIN_KERNEL_BLOCK`).

    Returns:
        ``(block, "")``, or ``(None, reason)`` where the prediction does not hold (MLA, a
        quantized KV cache, speculative decoding, an unknown target).
    """
    model, cache, parallel = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    if target not in MIN_KERNEL_BLOCK:
        return None, f"no kernel block known for target {target}"
    if getattr(model, "use_mla", False) or cache.cache_dtype != "auto":
        return None, f"KV cache dtype {cache.cache_dtype} / MLA: the attention page is the backend's"
    if vllm_config.speculative_config is not None:
        return None, "speculative decoding configured"
    from vllm.model_executor.layers.mamba.mamba_utils import (
        MambaStateDtypeCalculator,
        MambaStateShapeCalculator,
    )
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    hf = model.hf_text_config
    shapes = MambaStateShapeCalculator.gated_delta_net_state_shape(
        parallel.tensor_parallel_size, hf.linear_num_key_heads, hf.linear_num_value_heads,
        hf.linear_key_head_dim, hf.linear_value_head_dim, hf.linear_conv_kernel_dim, 0)
    dtypes = MambaStateDtypeCalculator.gated_delta_net_state_dtype(
        model.dtype, cache.mamba_cache_dtype, cache.mamba_ssm_cache_dtype)
    mamba_page = MambaSpec(shapes=shapes, dtypes=dtypes, block_size=-1).page_size_bytes
    attn_page = FullAttentionSpec(block_size=1, num_kv_heads=model.get_num_kv_heads(parallel),
                                  head_size=model.get_head_size(), dtype=model.dtype).page_size_bytes
    from vllm_hybrid_npu.core.prefill_checkpoints import ALIGNMENT

    block = token_budget.predict_block(attn_page, mamba_page, MIN_KERNEL_BLOCK[target],
                                       cache.block_size, ALIGNMENT)
    return block, ""


def _exporter_applies(vllm_config: Any, target: str) -> bool:
    """The exporter applies and chunks still end on the block grid: not where the junction
    entries run prefill chunks to the budget's end (``gdn_junction.budget_rule_expected``)."""
    from vllm_hybrid_npu.patches.gdn_junction import budget_rule_expected
    from vllm_hybrid_npu.patches.gdn_prefill_checkpoint import exporter_path

    return exporter_path(vllm_config, target)[0] is not None \
        and not budget_rule_expected(vllm_config, target)


def plan_token_budget(vllm_config: Any, target: str) -> token_budget.Decision | None:
    """Raise a default token budget to the predicted hybrid block's multiple, in place.

    Called by the ``token-budget`` entry before vLLM's ``VllmConfig._set_compile_ranges``
    (vLLM 0.30.0 / 0.32.0), so the compile ranges, the runner's buffers and vLLM's profiling run
    follow the new budget. Changes ``scheduler_config.max_num_batched_tokens`` and, as
    ``SchedulerConfig.__post_init__`` derives them from it, ``max_num_encoder_input_tokens`` and
    ``encoder_cache_size`` where they equal the old budget; ``max_num_scheduled_tokens`` only
    where it equals the old budget (vLLM leaves it None without speculative decoding). Records
    the raise on the config for the ``token-budget-check`` entry. Only where the exporter
    applies and the budget is vLLM's default (``token-budget-default``'s mark).

    Returns:
        the :class:`~vllm_hybrid_npu.core.token_budget.Decision` taken, or None where nothing
        applies (no exporter, an explicit budget: the check entry advises later, with the real
        block).
    """
    sched = vllm_config.scheduler_config
    default = getattr(vllm_config.model_config, DEFAULT_MARK, None)
    if default is None or sched.max_num_batched_tokens != default:
        return None
    if not _exporter_applies(vllm_config, target):
        return None
    try:
        block, why = predict_hybrid_block(vllm_config, target)
    except Exception as exc:  # noqa: BLE001  (an optimisation: never stop a start-up for it)
        block, why = None, f"{type(exc).__name__}: {exc}"
    if block is None:
        logger.info("vllm-hybrid-npu: token budget %d kept: hybrid block not predictable (%s); "
                    "the engine core names the block to align it to", default, why)
        return None
    decision = token_budget.decide(default, block, defaulted=True,
                                   long_prefill_threshold=sched.long_prefill_token_threshold)
    if decision.action != "raise":
        logger.debug("vllm-hybrid-npu: %s", decision.message)
        return decision
    old, new = decision.budget, decision.new_budget
    sched.max_num_batched_tokens = new
    for field in ("max_num_encoder_input_tokens", "encoder_cache_size", "max_num_scheduled_tokens"):
        if getattr(sched, field, None) == old:
            setattr(sched, field, new)
    setattr(vllm_config, RAISED_MARK, {"original": old, "predicted_block": block})
    logger.info(
        "vllm-hybrid-npu: %s. Cost: %+.1f%% tokens per step for the model runner's buffers and "
        "vLLM's profiling run, which sizes the KV cache after it (about %.1f%% of that run's "
        "activation peak, where it grows with the tokens; none with a fixed "
        "kv_cache_memory_bytes); the compile ranges end at %d. %s keeps %d.",
        decision.message, 100.0 * (new - old) / old, 100.0 * (new - old) / old, new,
        envs.option_text(TOKEN_BUDGET_KEY, "off"), old)
    return decision


def check_token_budget(vllm_config: Any, target: str) -> int | None:
    """Once the hybrid block is final (engine core, after vLLM's
    ``VllmConfig.validate_block_size``, before the scheduler is built): correct a raised budget
    whose predicted block missed (:func:`vllm_hybrid_npu.core.token_budget.check_budget`:
    ``scheduler_config.max_num_scheduled_tokens`` set to the real block's multiple within
    ``max_num_batched_tokens``, or a WARNING naming the budget to set), or log once per budget
    and block the budget that would save the step for a budget left as it is (yours, or vLLM's
    default where the block could not be predicted). Nothing for engines without the exporter.

    Args:
        vllm_config: the engine core's ``VllmConfig`` (``cache_config.block_size`` final).
        target: ``cpu`` or ``cuda``.

    Returns:
        the scheduler's budget (tokens) where it was changed, else None.
    """
    sched = vllm_config.scheduler_config
    block = vllm_config.cache_config.block_size
    scheduled = sched.max_num_scheduled_tokens or sched.max_num_batched_tokens
    raised = getattr(vllm_config, RAISED_MARK, None)
    if raised is not None:
        budget, warning = token_budget.check_budget(scheduled, sched.max_num_batched_tokens,
                                                    raised["original"], block)
        if warning:
            logger.warning("vllm-hybrid-npu: %s", warning)
        if budget != scheduled:
            sched.max_num_scheduled_tokens = budget
            logger.info("vllm-hybrid-npu: hybrid block %d, not the %d predicted: the scheduler's "
                        "token budget is %d (%d blocks), the buffers keep %d", block,
                        raised["predicted_block"], budget, budget // block,
                        sched.max_num_batched_tokens)
            return budget
        return None
    if not block or scheduled % block == 0 or not _exporter_applies(vllm_config, target):
        return None
    default = getattr(vllm_config.model_config, DEFAULT_MARK, None)
    owner = "vLLM's default, not raised at start-up" if default == scheduled else "yours"
    decision = token_budget.decide(scheduled, block, defaulted=False,
                                   long_prefill_threshold=sched.long_prefill_token_threshold, owner=owner)
    if decision.action == "advise" and (scheduled, block) not in _advised:
        _advised.add((scheduled, block))
        logger.info("vllm-hybrid-npu: %s", decision.message)
    return None


def _make_budget_default(upstream: Any, stack: Stack) -> Any:
    @functools.wraps(upstream)
    def _set_default_max_num_seqs_and_batched_tokens_args(self, usage_context, model_config,
                                                          parallel_config, *args, **kwargs):
        defaulted = (self.max_num_batched_tokens is None
                     and getattr(self, "max_num_scheduled_tokens", None) is None)
        out = upstream(self, usage_context, model_config, parallel_config, *args, **kwargs)
        if defaulted and self.max_num_batched_tokens is not None:
            setattr(model_config, DEFAULT_MARK, int(self.max_num_batched_tokens))
        return out

    return _set_default_max_num_seqs_and_batched_tokens_args


def _make_budget(upstream: Any, stack: Stack) -> Any:
    @functools.wraps(upstream)
    def _set_compile_ranges(self, *args, **kwargs):
        if getattr(self, "model_config", None) is not None and getattr(self, "scheduler_config", None) is not None:
            plan_token_budget(self, stack.target)
        return upstream(self, *args, **kwargs)

    return _set_compile_ranges


def _make_budget_check(upstream: Any, stack: Stack) -> Any:
    @functools.wraps(upstream)
    def validate_block_size(self, *args, **kwargs):
        out = upstream(self, *args, **kwargs)
        if getattr(self, "model_config", None) is not None:
            check_token_budget(self, stack.target)
        return out

    return validate_block_size


def _budget_entry(name: str, module: str, qualname: str, signature: tuple, make, why: str) -> Patch:
    """A ``token-budget*`` entry (CPU and CUDA, vLLM :data:`TOKEN_BUDGET_VERSIONS`, off with
    ``VLLM_HYBRID_NPU_OPTIONS=budget=off``)."""
    return Patch(name=name, module=module, qualname=qualname, targets=("cpu", "cuda"),
                 vllm=TOKEN_BUDGET_VERSIONS, signature=signature, wanted=_token_budget_wanted,
                 make=make, why=why, until="vLLM rounds the budget to the hybrid block in align "
                 "mode, or lets a non-final chunk end off the block grid")


PATCHES = [
    Patch(
        name="config-checks",
        module="vllm.config.vllm",
        qualname="VllmConfig.try_verify_and_update_config",
        targets=("npu", "cuda", "cpu"),
        vllm=VLLM_VERSIONS,
        signature=("self",),
        make=_make_config_checks,
        why=(
            "flag-naming errors for align mode (prefix caching off, chunked prefill off, "
            "chunked multimodal input off, prefill context parallelism) where vLLM silently "
            "resets the mode or asserts; on 0.33 align mode is prefix caching on a hybrid model"
        ),
        until="vLLM validates align-mode flags itself",
    ),
    Patch(
        name="config-checks-flag",
        module="vllm.engine.arg_utils",
        qualname="EngineArgs.create_engine_config",
        targets=("npu", "cuda", "cpu"),
        vllm=VLLM_VERSIONS_DEPRECATED_MODE_FLAG,
        signature=("self", "usage_context"),
        make=_make_flag_check,
        why=(
            "vLLM 0.33 / 0.34 ignore the deprecated --mamba-cache-mode (the mode follows prefix "
            "caching): an explicit align with prefix caching off, none with it on, or another "
            "mode is an error naming --mamba-cache-mode and the prefix-caching flag"
        ),
        until="vLLM removes --mamba-cache-mode",
    ),
    _budget_entry(
        "token-budget-default", "vllm.engine.arg_utils",
        "EngineArgs._set_default_max_num_seqs_and_batched_tokens_args",
        ("self", "usage_context", "model_config", "parallel_config"), _make_budget_default,
        "records that the token budget is vLLM's default (no --max-num-batched-tokens, no "
        "--max-num-scheduled-tokens), so token-budget never changes a budget you set"),
    _budget_entry(
        "token-budget", "vllm.config.vllm", "VllmConfig._set_compile_ranges", ("self",),
        _make_budget,
        "align mode with the GDN prefill-checkpoint exporter: vLLM's default budget raised "
        "to the next multiple of the hybrid block (predicted with vLLM's rule), so a chunked "
        "cold prefill takes the steps of caching off (16,384 -> 17,408 at block 1,088: 2 "
        "steps for 32,768 tokens, not 3); logged with its cost"),
    _budget_entry(
        "token-budget-check", "vllm.config.vllm", "VllmConfig.validate_block_size", ("self",),
        _make_budget_check,
        "with the final hybrid block (engine core, before the scheduler): a raised budget "
        "whose predicted block missed is brought to the real block's multiple within the "
        "runner's buffers; a budget you set is kept and the log names the one that saves "
        "the step"),
]
