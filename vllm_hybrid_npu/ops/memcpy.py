"""``batch_memcpy``: the state-copy op (GDN/Mamba SSM and conv states between cache blocks).

Mirrors the contract of vLLM 0.30.0 ``vllm/v1/worker/mamba_utils.py::batch_memcpy`` (and its
``batch_memcpy_kernel``), which align mode calls once per step through
``do_mamba_copy_block``: three int64 tensors ``[N]`` on the device holding source byte
addresses, destination byte addresses and byte counts. Differences: every copy has memmove
semantics (vLLM 0.30 handles only the left-shift overlap, with a barrier), the inputs are
validated, and the implementation is chosen per target.

Implementations:

* ``"triton"``: :mod:`vllm_hybrid_npu.ops._triton_copy` (one kernel for CUDA Triton and
  triton-ascend; on CPU tensors it runs under the Triton interpreter).
* ``"torch"``: :mod:`vllm_hybrid_npu.ops._torch_copy` (a ``copy_`` per copy; syncs to read the
  addresses; for CPUs without triton and CUDA without Triton; NPU tensors are refused: on 310P
  the plugin keeps vllm-ascend's own tensor-copy path).

Selection: the option ``copy-impl`` (``VLLM_HYBRID_NPU_OPTIONS``) = ``auto`` (default) | ``triton``
| ``torch``, or the ``impl=`` argument. ``auto`` picks ``triton`` on CUDA when triton imports,
on NPU when triton (triton-ascend) imports and the device is not a 310P, and on CPU only when
``TRITON_INTERPRET=1``; ``torch`` otherwise. The choice is logged once per device type at INFO
(logger ``vllm_hybrid_npu.ops.memcpy``). Forcing ``triton`` where it cannot run raises. Both
variables are read once per process (first call); :func:`refresh_settings` re-reads them.

Imports need torch only (triton optional); no vLLM.
"""

from __future__ import annotations

import logging
import os

import torch

from vllm_hybrid_npu.ops._torch_copy import batch_memcpy_torch
from vllm_hybrid_npu import envs

logger = logging.getLogger(__name__)

#: The option (``VLLM_HYBRID_NPU_OPTIONS`` key) selecting the implementation: ``auto`` |
#: ``triton`` | ``torch``.
COPY_IMPL_KEY = "copy-impl"
IMPLS = envs.OPTIONS[COPY_IMPL_KEY].values

try:
    from vllm_hybrid_npu.ops import _triton_copy

    _TRITON_ERROR: str | None = None
except Exception as exc:  # ImportError, or a triton build that fails to initialise
    _triton_copy = None
    _TRITON_ERROR = f"{type(exc).__name__}: {exc}"

_logged: set[tuple[str, str]] = set()
_resolved: dict[tuple, str] = {}  # (device, impl) -> choice, for the current settings


_env_cache: tuple[str | ValueError | None, str | None] | None = None


def refresh_settings() -> None:
    """Re-read the option ``copy-impl`` and ``$TRITON_INTERPRET``.

    Both are read once, at the first call of :func:`batch_memcpy` / :func:`active_impl` (an
    environment lookup per call costs microseconds on the hot path); call this after changing
    them in a running process.
    """
    global _env_cache
    try:
        impl: str | ValueError | None = envs.options().get(COPY_IMPL_KEY)
    except ValueError as exc:  # raised where the implementation is asked for, as before
        impl = exc
    _env_cache = (impl, os.environ.get("TRITON_INTERPRET"))
    _resolved.clear()


def triton_available() -> bool:
    """Whether the Triton kernel module imported (``triton`` present and working)."""
    return _triton_copy is not None


def _requested(impl: str | None, env_impl: str | ValueError | None) -> str:
    if impl is None:
        if isinstance(env_impl, ValueError):
            raise ValueError(str(env_impl))
        return env_impl or "auto"
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r} is not one of {', '.join(IMPLS)}")
    return impl


def _is_310p(device: torch.device) -> bool:
    try:
        return "310" in str(torch.npu.get_device_name(device.index or 0))  # type: ignore[attr-defined]
    except Exception:
        return False


def active_impl(device: torch.device | str | None = None, impl: str | None = None) -> str:
    """Which implementation ``batch_memcpy`` uses for tensors on ``device``: ``"triton"`` or ``"torch"``.

    Args:
        device: device of the address tensors; ``None`` means CUDA if available, else CPU.
        impl: ``auto`` | ``triton`` | ``torch``; ``None`` reads the option ``copy-impl``.

    Raises:
        ValueError: unknown ``impl`` / environment value.
        RuntimeError: ``triton`` forced where it cannot run (triton missing; CPU without
            ``TRITON_INTERPRET=1``).
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if _env_cache is None:
        refresh_settings()
    key = (device, impl)
    hit = _resolved.get(key)
    if hit is not None:
        return hit
    env_impl, env_interp = _env_cache
    dev = torch.device(device)
    req = _requested(impl, env_impl)
    interp = env_interp == "1"
    if req == "torch":
        choice, why = "torch", "forced"
    elif req == "triton":
        if not triton_available():
            raise RuntimeError(
                f"{envs.option_text(COPY_IMPL_KEY, 'triton')} but the Triton kernel is "
                f"unavailable ({_TRITON_ERROR})"
            )
        if dev.type == "cpu" and not interp:
            raise RuntimeError(
                f"{envs.option_text(COPY_IMPL_KEY, 'triton')} on CPU tensors needs "
                "TRITON_INTERPRET=1 (Triton interpreter)"
            )
        choice, why = "triton", "forced"
    elif not triton_available():
        choice, why = "torch", f"triton unavailable ({_TRITON_ERROR})"
    elif dev.type == "cpu":
        choice, why = ("triton", "TRITON_INTERPRET=1") if interp else ("torch", "CPU without TRITON_INTERPRET=1")
    elif dev.type == "npu" and _is_310p(dev):
        choice, why = "torch", "310P-class NPU"
    else:
        choice, why = "triton", "auto"
    if (dev.type, choice) not in _logged:
        _logged.add((dev.type, choice))
        logger.info("vllm_hybrid_npu batch_memcpy on %s: %s implementation (%s)", dev.type, choice, why)
    _resolved[key] = choice
    return choice


#: dtypes accepted for ``sizes``: int64, and int32 as vLLM 0.30 / 0.32's ``MambaCopyBuffers``
#: allocate it (``vllm/v1/worker/mamba_utils.py``), so the launcher needs no conversion launch.
_SIZE_DTYPES = (torch.int64, torch.int32)


def _validate(src_ptrs, dst_ptrs, sizes, device, check_values: bool) -> None:
    T, I64 = torch.Tensor, torch.int64
    if (  # fast path of the structural checks (the common, valid call)
        isinstance(src_ptrs, T) and isinstance(dst_ptrs, T) and isinstance(sizes, T)
        and src_ptrs.dtype == I64 and dst_ptrs.dtype == I64 and sizes.dtype in _SIZE_DTYPES
        and src_ptrs.dim() == 1 and src_ptrs.shape == dst_ptrs.shape == sizes.shape
        and src_ptrs.device == dst_ptrs.device == sizes.device and device is None
    ):
        if check_values:
            _check_values(src_ptrs, dst_ptrs, sizes)
        return
    named = (("src_ptrs", src_ptrs), ("dst_ptrs", dst_ptrs), ("sizes", sizes))
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"batch_memcpy: {name} must be a torch.Tensor, got {type(t).__name__}")
        allowed = _SIZE_DTYPES if name == "sizes" else (torch.int64,)
        if t.dtype not in allowed:
            raise TypeError(
                f"batch_memcpy: {name} must have dtype "
                f"{' or '.join(str(d) for d in allowed)}, got {t.dtype}"
            )
        if t.dim() != 1:
            raise ValueError(f"batch_memcpy: {name} must be 1-D [N], got shape {tuple(t.shape)}")
    n = src_ptrs.shape[0]
    for name, t in named[1:]:
        if t.shape[0] != n:
            raise ValueError(
                f"batch_memcpy: {name} has {t.shape[0]} entries but src_ptrs has {n}"
            )
        if t.device != src_ptrs.device:
            raise ValueError(
                f"batch_memcpy: {name} is on {t.device} but src_ptrs is on {src_ptrs.device}"
            )
    if device is not None:
        want = torch.device(device)
        have = src_ptrs.device
        if have.type != want.type or (want.index is not None and have.index != want.index):
            raise ValueError(
                f"batch_memcpy: src_ptrs/dst_ptrs/sizes must be on {want} (the copies run there), "
                f"got {have}"
            )
    if check_values:
        _check_values(src_ptrs, dst_ptrs, sizes)


def _check_values(src_ptrs, dst_ptrs, sizes) -> None:
    if src_ptrs.shape[0]:
        bad = (sizes < 0) | ((sizes > 0) & ((src_ptrs == 0) | (dst_ptrs == 0)))
        if bool(bad.any()):  # one device-to-host sync
            i = int(bad.nonzero()[0, 0])
            size = int(sizes[i])
            if size < 0:
                raise ValueError(f"batch_memcpy: sizes[{i}] = {size} is negative")
            raise ValueError(
                f"batch_memcpy: copy {i} of {size} bytes has a null address "
                f"(src_ptrs[{i}] = {int(src_ptrs[i])}, dst_ptrs[{i}] = {int(dst_ptrs[i])})"
            )


def batch_memcpy(
    src_ptrs: torch.Tensor,
    dst_ptrs: torch.Tensor,
    sizes: torch.Tensor,
    *,
    device: torch.device | str | None = None,
    impl: str | None = None,
    check_values: bool = True,
) -> None:
    """Copy ``sizes[i]`` bytes from address ``src_ptrs[i]`` to address ``dst_ptrs[i]``, for all i.

    Same contract as vLLM 0.30.0 ``vllm/v1/worker/mamba_utils.py::batch_memcpy``. Runs on the
    stream current for the tensors' device and does not synchronise (except the value check and
    the torch fallback, see below).

    Args:
        src_ptrs: int64 ``[N]``, source byte addresses in the memory of the tensors' device.
        dst_ptrs: int64 ``[N]``, destination byte addresses, same device.
        sizes: int64 or int32 ``[N]``, byte counts (>= 0; 0 copies nothing). ``N`` may be 0.
        device: if given, the device the copies must run on; tensors elsewhere are an error
            (e.g. CPU tensors on a CUDA/NPU worker).
        impl: ``auto`` | ``triton`` | ``torch``; ``None`` reads the option ``copy-impl``.
        check_values: also reject negative sizes and null addresses of non-empty copies before
            anything moves. Costs one device-to-host sync on accelerators; hot paths that build
            the tensors from trusted metadata may pass ``False`` (the kernel then copies nothing
            for a negative size).

    Semantics: each copy behaves like ``memmove`` (its source and destination may overlap, e.g.
    an in-place conv-state shift, left or right). Copies in one batch are independent: one
    copy's destination must not overlap another copy's source or destination.

    Raises:
        TypeError: an argument is not a tensor of the dtype above (uint64 addresses, as vLLM
            allocates them, are passed as ``t.view(torch.int64)``: same bits, no copy).
        ValueError: shapes differ or are not 1-D; tensors on different devices or not on
            ``device``; (``check_values``) a negative size or a null address.
        RuntimeError: ``triton`` forced where it cannot run (see :func:`active_impl`).
    """
    _validate(src_ptrs, dst_ptrs, sizes, device, check_values)
    dev = src_ptrs.device
    choice = active_impl(dev, impl)
    if src_ptrs.shape[0] == 0:
        return
    src_ptrs, dst_ptrs, sizes = src_ptrs.contiguous(), dst_ptrs.contiguous(), sizes.contiguous()
    if choice == "torch":
        batch_memcpy_torch(src_ptrs, dst_ptrs, sizes)
        return
    if dev.type == "cpu":
        kernel = _triton_copy.interpreted_kernel()
    else:
        kernel = _triton_copy.batch_memcpy_kernel
    cfg = _triton_copy.target_config(dev.type, dev.index or 0)
    if (dev.type == "cuda" and torch.cuda.device_count() > 1
            and dev.index is not None and dev.index != torch.cuda.current_device()):
        with torch.cuda.device(dev):
            _triton_copy.launch(kernel, src_ptrs, dst_ptrs, sizes, cfg)
    else:
        _triton_copy.launch(kernel, src_ptrs, dst_ptrs, sizes, cfg)


def warm_up(device: torch.device | str) -> int:
    """Compile (JIT) every kernel variant :func:`batch_memcpy` can launch on ``device``, so the
    first align-mode step does not pay Triton's compile time.

    Copies 64 bytes between two scratch buffers on ``device`` with int32 and int64 ``sizes`` (vLLM
    and vllm-ascend allocate int32) and with contiguous and block-cyclic tiles; synchronises the
    device once at the end (start-up, not the step path).

    Returns:
        Number of launches made (int; 0 when the torch implementation is active there).

    Raises:
        RuntimeError: a copy came back wrong (the message names the variant).
    """
    dev = torch.device(device)
    if active_impl(dev) != "triton":
        return 0
    cfg = _triton_copy.target_config(dev.type, dev.index or 0)
    kernel = _triton_copy.interpreted_kernel() if dev.type == "cpu" else _triton_copy.batch_memcpy_kernel
    src = torch.arange(64, dtype=torch.uint8, device=dev)
    launches = 0
    for size_dtype in (torch.int32, torch.int64):
        for tiles in sorted({1, min(cfg.cyclic_min_tiles, _triton_copy.MAX_TILES_PER_COPY)}):
            dst = torch.zeros_like(src)
            ptrs = torch.tensor([[src.data_ptr()], [dst.data_ptr()]], dtype=torch.int64, device=dev)
            sizes = torch.tensor([64], dtype=size_dtype, device=dev)
            _triton_copy.launch(kernel, ptrs[0], ptrs[1], sizes, cfg, tiles=tiles)
            launches += 1
            if not torch.equal(dst.cpu(), src.cpu()):
                raise RuntimeError(f"batch_memcpy warm-up copy wrong ({size_dtype}, {tiles} tiles)")
    return launches
