"""Triton batch-memcpy kernel for mamba/GDN state copies (Triton on CUDA, triton-ascend on NPU).

One kernel, written to the subset of Triton that both the CUDA Triton (3.x) and triton-ascend
3.2 compile:

* Raw byte addresses arrive as int64 scalars; they are cast to typed pointers **once per work
  item, outside every copy loop** (vLLM 0.30's ``batch_memcpy_kernel`` casts a vector of
  addresses inside its loop, which triton-ascend lowers to a gather/scatter and which
  misbehaved on Ascend).
* Each copy uses the widest access that the relative alignment of its two addresses allows
  (8, 4, 2 or 1 bytes): bytes before the first aligned source address (the head, < 8 bytes)
  and after the last whole unit (the tail, < 8 bytes) go through an 8-lane byte access.
* Non-overlapping copies are split into ``tiles_per_copy`` contiguous tiles; the work items
  ``(copy, tile)`` are spread over a grid bounded by the device's core count (CUDA SMs times
  :data:`CUDA_PROGRAMS_PER_SM`, Ascend vector cores) and each program loops over its items
  (persistent grid; no grid dimension ever exceeds that bound, so triton-ascend's 65535 cap on
  the flattened grid is never reached).
* A copy whose source and destination ranges overlap (memmove) is not tiled: tile 0 of that
  copy moves it alone, in chunks of exactly ``|dst - src|`` bytes, left shifts front to back
  and right shifts back to front. With chunk length equal to the shift, a destination element
  written in chunk ``j`` is the source element read in chunk ``j - 1`` at the same lane
  offset, i.e. by the same thread, earlier in program order, so no barrier is needed.
* No cache modifiers, no barriers, no atomics.

Block sizes (bytes moved per loop step and program) per target, see :func:`target_config`:
CUDA 16 KiB with 4 warps (tuned on an H100, see docs/benchmarks.md); Ascend 32 KiB (a vector
core's 192 KiB unified buffer holds it twice over for double buffering; not verified on NPU);
interpreter 4 KiB.

Import needs ``triton``; callers import this module inside ``try``.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import sys

import triton
import triton.language as tl

#: CUDA: resident programs per SM the grid is bounded by (programs loop over further items).
CUDA_PROGRAMS_PER_SM = 16
#: CUDA: work items ``(copy, tile)`` aimed for per SM when choosing the tile count.
CUDA_ITEMS_PER_SM = 16
#: CUDA: bytes one program moves per loop step.
CUDA_BLOCK_BYTES = 16384
CUDA_NUM_WARPS = 4
#: Ascend: bytes one program moves per loop step (not verified on NPU).
NPU_BLOCK_BYTES = 32768
#: Ascend: work items aimed for per vector core.
NPU_ITEMS_PER_CORE = 4
#: Upper bound on tiles per copy (a copy smaller than a tile's block just leaves tiles empty).
MAX_TILES_PER_COPY = 64


@triton.jit
def _copy_span(src, dst, start, end, BLOCK: tl.constexpr):
    """Copy elements ``[start, end)`` of typed pointers ``src`` -> ``dst``, BLOCK per step."""
    offs = tl.arange(0, BLOCK)
    for i in range(start, end, BLOCK):
        idx = i + offs
        m = idx < end
        tl.store(dst + idx, tl.load(src + idx, mask=m), mask=m)


@triton.jit
def _move_overlapping(src, dst, n, shift, forward, BLOCK: tl.constexpr):
    """memmove ``n`` elements between overlapping ranges ``shift`` (1..n-1) elements apart.

    Chunks of exactly ``shift`` elements, front to back when ``forward`` (dst < src), back to
    front otherwise. Lane offset ``rel`` inside a chunk is stable across chunks, so the thread
    that overwrites a source element is the thread that read it one chunk earlier.
    """
    offs = tl.arange(0, BLOCK)
    nchunks = (n + shift - 1) // shift
    for j in range(0, nchunks):
        base = tl.where(forward, j * shift, n - (j + 1) * shift)
        for k in range(0, shift, BLOCK):
            rel = k + offs
            idx = base + rel
            m = (rel < shift) & (idx >= 0) & (idx < n)
            tl.store(dst + idx, tl.load(src + idx, mask=m), mask=m)


@triton.jit
def _tiled_copy(src, dst, size, tile, n_tiles, ELEM: tl.constexpr, UNIT: tl.constexpr,
                BLOCK_BYTES: tl.constexpr, GRANULE_BYTES: tl.constexpr):
    """Tile ``tile`` of ``n_tiles`` of a non-overlapping copy of ``size`` bytes.

    ``src ^ dst`` is a multiple of ``UNIT``; the head lifts ``src`` (and so ``dst``) to a
    ``UNIT`` boundary, the body moves whole ``ELEM`` units, the tail the rest. Tile 0 also
    moves head and tail (each < 8 bytes). Tile lengths are rounded up to ``GRANULE_BYTES``.
    """
    BLK: tl.constexpr = BLOCK_BYTES // UNIT
    GRN: tl.constexpr = GRANULE_BYTES // UNIT
    head = tl.minimum((0 - src) & (UNIT - 1), size)
    body = (size - head) // UNIT
    per = ((body + n_tiles - 1) // n_tiles + GRN - 1) // GRN * GRN
    lo = tile * per
    hi = tl.minimum(lo + per, body)
    src_u = (src + head).to(tl.pointer_type(ELEM))
    dst_u = (dst + head).to(tl.pointer_type(ELEM))
    _copy_span(src_u, dst_u, lo, hi, BLK)
    if tile == 0:
        src_b = src.to(tl.pointer_type(tl.uint8))
        dst_b = dst.to(tl.pointer_type(tl.uint8))
        b = tl.arange(0, 8)
        hm = b < head
        tl.store(dst_b + b, tl.load(src_b + b, mask=hm), mask=hm)
        tail_start = head + body * UNIT
        tm = b < (size - tail_start)
        tl.store(dst_b + tail_start + b, tl.load(src_b + tail_start + b, mask=tm), mask=tm)


@triton.jit
def _overlapping_copy(src, dst, size, ELEM: tl.constexpr, UNIT: tl.constexpr,
                      BLOCK_BYTES: tl.constexpr):
    """memmove of ``size`` bytes; ``src``, ``dst`` and ``size`` are multiples of ``UNIT``."""
    dist = tl.where(dst > src, dst - src, src - dst)
    _move_overlapping(src.to(tl.pointer_type(ELEM)), dst.to(tl.pointer_type(ELEM)), size // UNIT,
                      dist // UNIT, dst < src, BLOCK_BYTES // UNIT)


@triton.jit(do_not_specialize=["n_copies", "tiles_per_copy"])
def batch_memcpy_kernel(src_ptrs, dst_ptrs, sizes, n_copies, tiles_per_copy,
                        BLOCK_BYTES: tl.constexpr, GRANULE_BYTES: tl.constexpr,
                        MIN_TILE_BYTES: tl.constexpr):
    """Copy ``sizes[c]`` bytes from address ``src_ptrs[c]`` to ``dst_ptrs[c]`` for every c.

    Work item ``w`` in ``[0, n_copies * tiles_per_copy)`` is tile ``w // n_copies`` of copy
    ``w % n_copies`` (tile-major, so the programs that share an SM / core work on different
    copies and big and small copies mix evenly); program ``p`` takes items ``p, p + P, ...``. A copy of ``size``
    bytes uses only ``min(tiles_per_copy, ceil(size / MIN_TILE_BYTES))`` tiles; its other
    items are empty. Negative sizes copy
    nothing (the host wrapper rejects them before launch).
    """
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    total = n_copies * tiles_per_copy
    for w in range(pid, total, nprog):
        tile = w // n_copies  # tile-major: neighbouring programs (one SM) serve different copies
        c = w - tile * n_copies
        src = tl.load(src_ptrs + c)
        dst = tl.load(dst_ptrs + c)
        size = tl.maximum(tl.load(sizes + c), 0)
        dist = tl.where(dst > src, dst - src, src - dst)
        if (dist > 0) & (dist < size):
            if tile == 0:
                a = src | dst | size
                if (a & 7) == 0:
                    _overlapping_copy(src, dst, size, tl.uint64, 8, BLOCK_BYTES)
                elif (a & 3) == 0:
                    _overlapping_copy(src, dst, size, tl.uint32, 4, BLOCK_BYTES)
                elif (a & 1) == 0:
                    _overlapping_copy(src, dst, size, tl.uint16, 2, BLOCK_BYTES)
                else:
                    _overlapping_copy(src, dst, size, tl.uint8, 1, BLOCK_BYTES)
        elif dist > 0:
            # small copies use fewer tiles: none shorter than MIN_TILE_BYTES
            n_tiles = tl.minimum(tiles_per_copy, (size + MIN_TILE_BYTES - 1) // MIN_TILE_BYTES)
            if tile < n_tiles:
                x = src ^ dst
                if (x & 7) == 0:
                    _tiled_copy(src, dst, size, tile, n_tiles, tl.uint64, 8, BLOCK_BYTES,
                                GRANULE_BYTES)
                elif (x & 3) == 0:
                    _tiled_copy(src, dst, size, tile, n_tiles, tl.uint32, 4, BLOCK_BYTES,
                                GRANULE_BYTES)
                elif (x & 1) == 0:
                    _tiled_copy(src, dst, size, tile, n_tiles, tl.uint16, 2, BLOCK_BYTES,
                                GRANULE_BYTES)
                else:
                    _tiled_copy(src, dst, size, tile, n_tiles, tl.uint8, 1, BLOCK_BYTES,
                                GRANULE_BYTES)


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """Per-target launch parameters of :func:`batch_memcpy_kernel`.

    Attributes:
        max_programs: grid bound (programs); CUDA: SMs x programs per SM, NPU: vector cores.
        target_items: work items ``(copy, tile)`` aimed for; decides the tiles per copy.
        block_bytes: bytes one program moves per loop step (power of two, >= 8).
        num_warps: CUDA warps per program; ``None`` where the backend takes none.
        granule_bytes: tile lengths are rounded up to this (power of two, 8..block_bytes).
        min_tile_bytes: no copy is split into tiles shorter than this.
    """

    max_programs: int
    target_items: int
    block_bytes: int
    num_warps: int | None
    granule_bytes: int = 1024
    min_tile_bytes: int = 16384


def _npu_vector_cores(device) -> int:
    """Vector core count of an Ascend device through triton-ascend's driver properties."""
    import torch  # noqa: F401  (torch_npu registers torch.npu)

    props = triton.runtime.driver.active.utils.get_device_properties(device.index or 0)
    n = int(props.get("num_vectorcore", -1))
    if n <= 0:
        raise RuntimeError(f"triton-ascend reported no vector cores for {device}: {props!r}")
    return n


@functools.lru_cache(maxsize=None)
def target_config(device_type: str, device_index: int) -> LaunchConfig:
    """Launch parameters for a device (cached). ``device_type`` is ``cuda``, ``npu`` or ``cpu``."""
    if device_type == "cuda":
        import torch

        sms = torch.cuda.get_device_properties(device_index).multi_processor_count
        return LaunchConfig(sms * CUDA_PROGRAMS_PER_SM, sms * CUDA_ITEMS_PER_SM,
                            CUDA_BLOCK_BYTES, CUDA_NUM_WARPS)
    if device_type == "npu":
        import torch

        cores = _npu_vector_cores(torch.device("npu", device_index))
        return LaunchConfig(cores, cores * NPU_ITEMS_PER_CORE, NPU_BLOCK_BYTES, None)
    # CPU under the Triton interpreter: programs run one after another; few of them.
    return LaunchConfig(4, 256, 4096, None, 256, 1024)


def tiles_for(n_copies: int, target_items: int) -> int:
    """Tiles per copy: the most that keep ``n_copies * tiles <= target_items`` (1..64)."""
    return max(1, min(target_items // max(n_copies, 1), MAX_TILES_PER_COPY))


def launch(kernel, src_ptrs, dst_ptrs, sizes, cfg: LaunchConfig, tiles: int | None = None,
           max_programs: int | None = None) -> None:
    """Launch ``kernel`` (compiled or interpreted) over ``N = src_ptrs.numel() > 0`` copies."""
    n = src_ptrs.numel()
    if tiles is None:
        tiles = tiles_for(n, cfg.target_items)
    bound = cfg.max_programs if max_programs is None else max_programs
    grid = (max(1, min(n * tiles, bound)),)
    kwargs = _launch_kwargs(cfg)
    fast_key = None
    if (src_ptrs.is_cuda and FAST_LAUNCH and kernel is batch_memcpy_kernel
            and not ((src_ptrs.data_ptr() | dst_ptrs.data_ptr() | sizes.data_ptr()) & 15)):
        fast_key = (src_ptrs.device.index, cfg)
        compiled = _compiled.get(fast_key)
        if compiled is not None:
            try:
                compiled[(grid[0], 1, 1)](src_ptrs, dst_ptrs, sizes, n, tiles, cfg.block_bytes,
                                          cfg.granule_bytes, cfg.min_tile_bytes)
                return
            except Exception as exc:  # an unexpected Triton API: use the regular path from now on
                _disable_fast_launch(exc)
                fast_key = None
    compiled = kernel[grid](src_ptrs, dst_ptrs, sizes, n, tiles, **kwargs)
    if fast_key is not None and compiled is not None:
        _compiled[fast_key] = compiled


#: CUDA: re-launch the compiled kernel directly (``CompiledKernel[grid](*args)``), skipping the
#: per-call argument binding and cache lookup of ``JITFunction.run`` (about 5 us of host time
#: per call on the benchmark machine). Used only for 16-byte-aligned address tensors on the
#: device the kernel was compiled for - the specialisation the cached kernel was built with
#: (``n_copies`` / ``tiles_per_copy`` are not specialised).
FAST_LAUNCH = True
_compiled: dict = {}


def _disable_fast_launch(exc: Exception) -> None:
    global FAST_LAUNCH
    FAST_LAUNCH = False
    _compiled.clear()
    import logging

    logging.getLogger(__name__).warning(
        "batch_memcpy: direct launch of the compiled kernel failed (%s: %s); using JITFunction.run",
        type(exc).__name__, exc)


@functools.lru_cache(maxsize=None)
def _launch_kwargs(cfg: LaunchConfig) -> dict:
    kwargs = {"BLOCK_BYTES": cfg.block_bytes, "GRANULE_BYTES": cfg.granule_bytes,
              "MIN_TILE_BYTES": cfg.min_tile_bytes}
    if cfg.num_warps is not None:
        kwargs["num_warps"] = cfg.num_warps
    return kwargs


@functools.lru_cache(maxsize=1)
def interpreted_kernel():
    """This module's kernel built for the Triton interpreter (CPU tensors).

    ``triton.jit`` decides compiled vs interpreted when the function is decorated, from
    ``TRITON_INTERPRET``; a second copy of this module is executed with the variable set, so the
    compiled kernel of the first copy stays usable in the same process.
    """
    if type(batch_memcpy_kernel).__name__ == "InterpretedFunction":
        return batch_memcpy_kernel  # this very module was decorated under the interpreter
    name = __name__ + "_interpreted"
    spec = importlib.util.spec_from_file_location(name, __file__)
    mod = importlib.util.module_from_spec(spec)
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old
    return mod.batch_memcpy_kernel
