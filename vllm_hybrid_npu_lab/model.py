"""vLLM configs and KV-cache specs for a replay, built with vLLM's own functions.

Mirrors what vLLM 0.30 does at engine start for a Qwen3-Next/Qwen3.5 hybrid, minus the weights:

* ``ModelConfig``/``VllmConfig`` from a ``config.json`` (written to a temporary directory). The
  architecture is set to ``Qwen3NextForCausalLM`` for every preset: its
  ``get_mamba_state_shape_from_config``/``get_mamba_state_dtype_from_config`` are the same code
  as ``Qwen3_5ForCausalLM``'s (vllm/model_executor/models/qwen3_next.py vs qwen3_5.py, vLLM 0.30),
  and the Qwen3.5 classes cannot be imported here (their module imports ``torchvision``).
  ``mamba_ssm_dtype`` from the config is applied as
  ``Qwen3_5ForConditionalGenerationConfig.verify_and_update_config`` does.
* Platform (``platform``): the deployment modelled, independent of the machine the lab runs
  on. ``"cuda"`` (the CLI's): FlashAttention's kernel block (``--kernel-block-size``, 16) and the
  SSM cache dtype the model asks for. ``"cpu"``: vLLM's CPU platform, its own hook
  (``CpuPlatform.check_and_update_config``: 128-token block unless one is given, float32 SSM
  states on a CPU with AVX-512-BF16) and its attention backend (``CPU_ATTN``); what the CPU
  engine of the e2e tests runs, against which ``e2e/test_tensor_parallel.py`` checks the lab.
  ``VllmConfig`` itself runs the *host's* platform hook: on a CPU host with AVX-512-BF16 vLLM's
  CPU hook resets an ``auto`` SSM cache dtype to float32, which until 2026-11-27 leaked into the
  ``"cuda"`` setups (Qwen3-Next-80B-A3B: block 1,056 instead of 544); the requested dtype is now
  put back for ``"cuda"``.
* Block size: the kernel block size, then ``Platform._align_hybrid_block_size`` (vLLM 0.30,
  vllm/platforms/interface.py) with the platform's attention backend class, which raises it so
  the attention page >= the GDN state page and pads the state page to the attention page.
* Per-layer specs: ``FullAttentionSpec`` as ``Attention.get_kv_cache_spec`` builds it and
  ``MambaSpec`` as ``MambaBase.get_kv_cache_spec`` builds it (mamba_type GDN_ATTN).
* ``get_kv_cache_configs`` + ``generate_scheduler_kv_cache_config`` (vllm/v1/core/kv_cache_utils.py)
  for the KV budget, and ``resolve_kv_cache_block_sizes`` for the scheduler/hash block sizes.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_hybrid_npu_lab.presets import layer_types

_MODEL_CONFIG_CACHE: dict[str, Any] = {}

#: deployments :func:`build_setup` models: name -> vLLM attention backend (``AttentionBackendEnum``
#: member) of a Qwen3-Next / Qwen3.5 full-attention layer there
PLATFORMS: dict[str, str] = {"cuda": "FLASH_ATTN", "cpu": "CPU_ATTN"}
#: FlashAttention's preferred kernel block (tokens): the ``"cuda"`` platform's default
CUDA_KERNEL_BLOCK = 16


@dataclass
class Setup:
    """Everything a replay needs: configs, KV-cache config and the derived sizes.

    ``block_size``: tokens per KV block (the hit granularity of align mode); ``hash_block_size``
    and ``scheduler_block_size``: as vLLM's ``resolve_kv_cache_block_sizes`` returns them;
    ``num_blocks``: blocks in the shared pool; ``state_bytes``: bytes one cached GDN state
    occupies (padded page size x GDN layers, on one TP rank); ``num_gdn_layers``,
    ``num_attention_layers``: layer counts in the specs.
    """

    vllm_config: Any
    kv_cache_config: Any
    block_size: int
    hash_block_size: int
    scheduler_block_size: int
    num_blocks: int
    state_bytes: int
    num_gdn_layers: int
    num_attention_layers: int
    #: host tier bytes per worker (0 = none): vLLM's OffloadingConnector (``--kv-offloading-size``)
    host_cache_bytes: int = 0
    #: the GDN specs declare the runtime exporter's prefill checkpoint block
    prefill_checkpoints: bool = False
    #: MTP speculative tokens replayed (0 = no speculative decoding)
    speculative_tokens: int = 0
    #: why the runtime declares no checkpoint under that drafter on the target (its
    #: ``speculative_off``), or None
    speculative_off: str | None = None


def _kv_cache_configs(vllm_config: Any, specs: dict[str, Any], available_bytes: int) -> list[Any]:
    """vLLM's ``get_kv_cache_configs`` for one worker, called as the engine core calls it
    (``EngineCore._initialize_kv_caches``).

    vLLM 0.33 moved it to ``vllm/v1/core/kv_cache_planning.py`` and takes the layers' grouping as
    a fourth argument, computed first by ``get_global_kv_cache_groups`` (the engine core then calls
    ``VllmConfig.adjust_dcp_kv_cache_interleave_size`` with it, a no-op without decode context
    parallelism, done here too); vLLM 0.30 / 0.32 take three arguments in ``kv_cache_utils.py``.

    Args:
        vllm_config: the replay's ``VllmConfig``.
        specs: ``{layer name: KVCacheSpec}`` of the one worker.
        available_bytes: the worker's KV-cache budget (bytes).

    Returns:
        vLLM's list of one ``KVCacheConfig``.

    Raises:
        ValueError: from vLLM when the budget cannot hold the model's blocks.
    """
    try:
        from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
    except ImportError:
        from vllm.v1.core.kv_cache_utils import get_kv_cache_configs

        return get_kv_cache_configs(vllm_config, [specs], [int(available_bytes)])
    groups = get_global_kv_cache_groups(vllm_config, [specs])
    adjust = getattr(vllm_config, "adjust_dcp_kv_cache_interleave_size", None)
    if adjust is not None:
        adjust(groups)
    return get_kv_cache_configs(vllm_config, [specs], [int(available_bytes)], groups)


def _model_config(cfg: dict[str, Any], max_model_len: int):
    from vllm.config import ModelConfig

    hf = {k: v for k, v in cfg.items() if k != "source"}
    hf["layer_types"] = layer_types(cfg)
    hf["num_hidden_layers"] = len(hf["layer_types"])
    hf.pop("full_attention_interval", None)
    hf["architectures"] = ["Qwen3NextForCausalLM"]
    hf["model_type"] = "qwen3_next"
    hf["max_position_embeddings"] = max(int(hf.get("max_position_embeddings", 0)), max_model_len)
    key = json.dumps(hf, sort_keys=True) + f"|{max_model_len}"
    if key not in _MODEL_CONFIG_CACHE:
        with tempfile.TemporaryDirectory(prefix="hitrate-model-") as d:
            (Path(d) / "config.json").write_text(json.dumps(hf))
            _MODEL_CONFIG_CACHE[key] = ModelConfig(
                model=d,
                skip_tokenizer_init=True,
                dtype=str(hf.get("dtype", "bfloat16")),
                max_model_len=max_model_len,
            )
    return _MODEL_CONFIG_CACHE[key]


#: vLLM 0.33's default block for the CPU backends, the argument its
#: ``CpuPlatform.update_block_size_for_backend`` passes to ``_preferred_block_size_for_backends``
#: (0.30 / 0.32 set the same 128 in ``check_and_update_config``, read from there)
CPU_DEFAULT_BLOCK_033 = 128


def _cpu_platform_hook(vllm_config: Any, backend: Any) -> int:
    """vLLM's CPU platform rules on ``vllm_config``: its hook (``CpuPlatform.check_and_update_config``:
    the SSM cache dtype rule, float32 for the accelerated GDN backend on a CPU with AVX-512-BF16;
    in vLLM 0.30 / 0.32 also the block, 128 unless the user set one), then the block the CPU
    backend ``backend`` prefers before the hybrid alignment (vLLM 0.33 chose it in
    ``update_block_size_for_backend`` through ``_preferred_block_size_for_backends``, which the
    lab calls with ``backend``: the engine finds it among the model's layers). The hook also
    writes process settings into ``os.environ`` (``LD_PRELOAD``, OpenMP and inductor variables)
    for the engine it prepares; the lab starts none, so they are undone.

    Returns:
        the block size (tokens) before the hybrid alignment.

    Raises:
        ValueError: naming ``platform`` where vLLM's device config is not the CPU (the hook
            asserts it: not vLLM's CPU build).
    """
    import os

    from vllm.platforms.cpu import CpuPlatform

    if vllm_config.device_config.device_type != "cpu":
        raise ValueError("platform 'cpu' runs vLLM's CPU platform hook, which needs vLLM's CPU "
                         f"build (device here: {vllm_config.device_config.device_type})")
    saved = dict(os.environ)
    try:
        CpuPlatform.check_and_update_config(vllm_config)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    cache_config = vllm_config.cache_config
    choose = getattr(CpuPlatform, "_preferred_block_size_for_backends", None)
    if cache_config.user_specified_block_size or choose is None:
        return cache_config.block_size
    return choose([backend], CPU_DEFAULT_BLOCK_033, vllm_config)


#: the runtime's exporter path (:func:`vllm_hybrid_npu.patches.gdn_prefill_checkpoint.speculative_off`'s
#: ``path``) of each lab target: the CPU GDN function, CUDA's Triton/FLA pass, vllm-ascend's paths
TARGET_PATHS = {"cpu": "cpu", "cuda": "triton", "npu": "ascend"}


#: the vLLM whose ``SpeculativeConfig`` :func:`mtp_config` stands in for
MTP_VLLM = "0.30.0"

#: the vllm-ascend the lab's ``npu`` target models over each vLLM (the newest release built on it)
NPU_VLLM_ASCEND = {"0.30.0": "0.30.0rc2", "0.23.0": "0.23.0.post1"}


def modelled_stack(target: str):
    """The :class:`~vllm_hybrid_npu.support.Stack` a lab ``target`` (``cpu``, ``cuda``, ``npu``)
    stands for: the installed vLLM and, for ``npu``, the vllm-ascend of
    :data:`NPU_VLLM_ASCEND` over it (none is installed where the lab runs)."""
    from vllm_hybrid_npu.support import Stack

    vllm = vllm_version()
    return Stack(target=target, vllm=vllm,
                 vllm_ascend=NPU_VLLM_ASCEND.get(vllm) if target == "npu" else None)


def vllm_version() -> str:
    """The installed vLLM's version (``vllm.__version__`` without a local ``+`` suffix)."""
    import vllm

    return vllm.__version__.split("+")[0]


def mtp_config(k: int) -> Any:
    """vLLM 0.30 ``SpeculativeConfig``'s predicates for ``qwen3_next_mtp`` (rewritten to method
    ``mtp``, an EAGLE drafter: ``use_eagle()`` and the block drop) with ``k`` speculative tokens;
    a real one needs the target's HF files for its draft config, which the lab has not."""
    import types

    return types.SimpleNamespace(
        method="mtp", num_speculative_tokens=k, num_speculative_tokens_per_batch_size=None,
        disable_eagle_block_drop=False, use_eagle=lambda: True,
        use_eagle_block_drop=lambda: True, use_multi_module_mtp=lambda: False,
        use_dflash=lambda: False, use_dspark=lambda: False, uses_draft_model=lambda: False,
        uses_extract_hidden_states=lambda: False,
        uses_dynamic_speculative_decoding=lambda: False, max_num_new_slots_for_drafting=0,
        draft_model_config=None)


def build_setup(
    cfg: dict[str, Any],
    *,
    tp: int = 1,
    kv_cache_bytes: int,
    max_num_batched_tokens: int = 8192,
    max_num_seqs: int = 256,
    max_model_len: int = 262144,
    block_size: int | None = None,
    kernel_block_size: int | None = None,
    attention_only: bool = False,
    configure=None,
    tune=None,
    host_cache_bytes: int = 0,
    prefill_checkpoints: bool = False,
    platform: str = "cuda",
    speculative_tokens: int = 0,
    exporter_target: str = "cuda",
) -> Setup:
    """Build the vLLM configs and KV-cache config of one replay.

    Args:
        cfg: text-config dict (see :func:`vllm_hybrid_npu_lab.presets.resolve_model`).
        tp: tensor-parallel size; KV heads and GDN heads are split over it as vLLM does.
        kv_cache_bytes: KV-cache memory of ONE worker (one TP rank), bytes.
        block_size: ``--block-size`` (tokens); for the hybrid vLLM raises it when the attention
            page would be smaller than the state page, as ``_align_hybrid_block_size`` does.
        kernel_block_size: the attention backend's preferred block size (tokens); ``None``: the
            platform's (16 on ``"cuda"``, what vLLM's CPU hook picks on ``"cpu"``: 128).
        attention_only: keep only the full-attention layers (the "attention bound" model):
            block size = ``block_size`` or ``kernel_block_size``, no GDN specs.
        configure: a policy's ``configure(vllm_config)`` hook, called before specs are built
            (it may switch ``cache_config.mamba_cache_mode`` to ``"all"``: the GDN specs and the
            block-size alignment follow the config's mode).
        tune: ``tune(vllm_config, block_size)``, called once the block size is final and before
            the KV-cache config is built (upstream option settings expressed in blocks:
            ``prefix_cache_retention_interval``, ``long_prefill_token_threshold``,
            ``prefix_match_unit``).
        host_cache_bytes: host tier per worker, bytes (0 = none): sets
            ``CacheConfig.kv_offloading_size`` (GiB) so that vLLM's own
            ``VllmConfig._post_init_kv_transfer_config`` configures the native
            ``OffloadingConnector`` (``kv_role="kv_both"``, ``cpu_bytes_to_use``), as
            ``vllm serve --kv-offloading-size`` does; vLLM's checks on that combination apply.
        prefill_checkpoints: declare the runtime exporter's prefill checkpoint block in the GDN
            specs and round the block to its 64-token grid (the plugin's entries).
        platform: the deployment modelled (:data:`PLATFORMS`; module docstring): ``"cuda"``
            (default) or ``"cpu"`` (vLLM's CPU platform; needs vLLM's CPU build, whose device
            config the hook asserts).
        speculative_tokens: an MTP drafter with this many speculative tokens (0 = none):
            :func:`mtp_config` set as the config's ``speculative_config`` (vLLM's scheduler
            then drops one prefix-match unit of each hit and reserves the lookahead slots) and
            the GDN specs' ``num_speculative_blocks``, as vLLM builds them. With
            ``prefill_checkpoints`` the checkpoint is declared only where the runtime's
            ``speculative_off`` allows it on ``exporter_target``'s path (:data:`TARGET_PATHS`:
            the CPU path on vLLM 0.30, not on a CPU with AMX tiles); elsewhere vLLM's split is
            kept (:attr:`Setup.speculative_off` says why).
        exporter_target: the lab's ``--target`` (``cpu``, ``cuda``, ``npu``), read only with
            ``speculative_tokens``.

    Raises ``ValueError`` naming ``--kv-cache-gib`` when the budget cannot hold one request of
    ``max_model_len`` tokens (vLLM's own check), ``--tp`` when heads do not split, ``platform``
    when it is not one of :data:`PLATFORMS`.
    """
    from vllm.config import CacheConfig, ParallelConfig, SchedulerConfig, VllmConfig
    from vllm.model_executor.layers.mamba.mamba_utils import (
        MambaStateDtypeCalculator,
        MambaStateShapeCalculator,
    )
    from vllm.platforms.interface import Platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, MambaAttentionBackendEnum
    from vllm.v1.attention.backends.utils import (
        get_supported_kv_cache_layouts,
        resolve_kv_cache_layout,
    )
    from vllm.v1.core.kv_cache_utils import (
        generate_scheduler_kv_cache_config,
        resolve_kv_cache_block_sizes,
    )
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    if platform not in PLATFORMS:
        raise ValueError(f"platform {platform!r}: one of {', '.join(PLATFORMS)}")
    if speculative_tokens < 0:
        raise ValueError(f"--speculative-tokens must be >= 0, got {speculative_tokens}")
    if speculative_tokens and (installed := vllm_version()) != MTP_VLLM:
        raise ValueError(f"--speculative-tokens {speculative_tokens}: the lab replays an MTP drafter "
                         f"on vLLM {MTP_VLLM}'s scheduler only (installed: vLLM {installed})")
    if exporter_target not in TARGET_PATHS:
        raise ValueError(f"target {exporter_target!r}: one of {', '.join(TARGET_PATHS)}")
    if tp < 1 or cfg["linear_num_key_heads"] % tp or cfg["linear_num_value_heads"] % tp:
        raise ValueError(f"--tp {tp}: must be >= 1 and divide the GDN head counts")
    model_config = _model_config(cfg, max_model_len)
    user_block = block_size is not None
    cache_config = CacheConfig(
        block_size=block_size or kernel_block_size or CUDA_KERNEL_BLOCK,
        enable_prefix_caching=True,
        mamba_cache_mode="align",
    )
    if cfg.get("mamba_ssm_dtype") and cache_config.mamba_ssm_cache_dtype == "auto":
        cache_config.mamba_ssm_cache_dtype = cfg["mamba_ssm_dtype"]
    ssm_dtype = cache_config.mamba_ssm_cache_dtype
    vllm_config = VllmConfig(
        model_config=model_config,
        cache_config=cache_config,
        parallel_config=ParallelConfig(tensor_parallel_size=tp),
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
        ),
    )
    cache_config = vllm_config.cache_config
    # VllmConfig ran the host's platform hook (vLLM's current_platform), not the modelled one's:
    # start again from what was asked, then apply the modelled platform's rules.
    cache_config.mamba_ssm_cache_dtype = ssm_dtype
    cache_config.user_specified_block_size = user_block
    backend = AttentionBackendEnum[PLATFORMS[platform]].get_class()
    if platform == "cpu":
        if user_block:
            cache_config.block_size = block_size
        kernel = kernel_block_size or _cpu_platform_hook(vllm_config, backend)
    else:
        kernel = kernel_block_size or CUDA_KERNEL_BLOCK
    # The platform's config hook may have picked its own default; the backend's choice wins,
    # as in Platform.update_block_size_for_backend phase 1.
    cache_config.block_size = block_size or kernel
    if configure is not None:
        configure(vllm_config)
    if host_cache_bytes:
        if host_cache_bytes < 0:
            raise ValueError(f"--host-cache-gib must be >= 0, got {host_cache_bytes / 2**30:g}")
        cache_config.kv_offloading_size = tp * host_cache_bytes / (1 << 30)
        vllm_config._post_init_kv_transfer_config()

    lt = layer_types(cfg)
    dtype = model_config.dtype
    parallel_config = vllm_config.parallel_config
    checkpoints = bool(prefill_checkpoints and not attention_only
                       and cache_config.mamba_cache_mode == "align")
    spec_off = None
    if speculative_tokens:  # as vLLM's VllmConfig carries it (qwen3_next_mtp -> mtp)
        object.__setattr__(vllm_config, "speculative_config", mtp_config(speculative_tokens))
        if checkpoints:  # the runtime's own decision for the target's exporter path
            from vllm_hybrid_npu.patches.gdn_prefill_checkpoint import speculative_off

            spec_off = speculative_off(vllm_config, TARGET_PATHS[exporter_target],
                                       modelled_stack(exporter_target))
            checkpoints = spec_off is None
    if not attention_only:
        Platform._align_hybrid_block_size(vllm_config, backend)
        if checkpoints:  # the runtime's rounding (gdn-checkpoint-block-size), page padding redone
            from vllm_hybrid_npu.core.prefill_checkpoints import round_hybrid_block

            round_hybrid_block(cache_config,
                               lambda: Platform._align_hybrid_block_size(vllm_config, backend))
    bs = cache_config.block_size
    if tune is not None:
        tune(vllm_config, bs)
    specs: dict[str, Any] = {}
    n_gdn = n_attn = 0
    state_bytes = 0
    for i, kind in enumerate(lt):
        if kind == "full_attention":
            specs[f"model.layers.{i}.self_attn.attn"] = FullAttentionSpec(
                block_size=bs,
                num_kv_heads=model_config.get_num_kv_heads(parallel_config),
                head_size=model_config.get_head_size(),
                dtype=dtype,
            )
            n_attn += 1
        elif not attention_only:
            shapes = MambaStateShapeCalculator.gated_delta_net_state_shape(
                tp,
                cfg["linear_num_key_heads"],
                cfg["linear_num_value_heads"],
                cfg["linear_key_head_dim"],
                cfg["linear_value_head_dim"],
                cfg["linear_conv_kernel_dim"],
                speculative_tokens,  # the conv state's k extra columns (Qwen3Next's num_spec)
            )
            dtypes = MambaStateDtypeCalculator.gated_delta_net_state_dtype(
                dtype, cache_config.mamba_cache_dtype, cache_config.mamba_ssm_cache_dtype
            )
            spec = MambaSpec(
                shapes=tuple(shapes),
                dtypes=tuple(dtypes),
                block_size=cache_config.mamba_block_size,
                page_size_padded=cache_config.mamba_page_size_padded,
                mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
                mamba_cache_mode=cache_config.mamba_cache_mode,
                # MambaBase.get_kv_cache_spec: one block per speculative token
                num_speculative_blocks=speculative_tokens,
            )
            if checkpoints:  # the runtime's declaration (gdn-checkpoint-spec)
                from vllm_hybrid_npu.core.prefill_checkpoints import declare

                spec = declare(spec)
            specs[f"model.layers.{i}.linear_attn"] = spec
            state_bytes += spec.page_size_bytes
            n_gdn += 1
    # The engine core resolves one layout from the workers' backends before sizing the cache
    # (EngineCore._initialize_kv_caches -> resolve_kv_cache_layout); do the same for the
    # platform's attention backend (plus the GDN backend for the hybrid).
    backends = [backend]
    if n_gdn:
        backends.append(MambaAttentionBackendEnum.GDN_ATTN.get_class())
    layouts = [layout.name for layout in get_supported_kv_cache_layouts(backends)]
    resolve_kv_cache_layout(vllm_config, [layouts], list(specs.values()))
    try:
        kv_cache_configs = _kv_cache_configs(vllm_config, specs, int(kv_cache_bytes))
    except ValueError as exc:
        raise ValueError(f"--kv-cache-gib too small for this model/trace: {exc}") from exc
    kv_cache_config = generate_scheduler_kv_cache_config(kv_cache_configs)
    cache_config.num_gpu_blocks = kv_cache_config.num_blocks
    sched_bs, hash_bs = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    return Setup(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        block_size=bs,
        hash_block_size=hash_bs,
        scheduler_block_size=sched_bs,
        num_blocks=kv_cache_config.num_blocks,
        state_bytes=state_bytes,
        num_gdn_layers=n_gdn,
        num_attention_layers=n_attn,
        host_cache_bytes=int(host_cache_bytes),
        prefill_checkpoints=checkpoints,
        speculative_tokens=speculative_tokens,
        speculative_off=spec_off,
    )
