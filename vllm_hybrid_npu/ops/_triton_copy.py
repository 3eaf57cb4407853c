"""Triton batch-memcpy kernel for mamba/GDN state copies (Triton on CUDA, triton-ascend on NPU).

One kernel, written to the subset of Triton that both the CUDA Triton (3.x) and triton-ascend
3.2 compile:

* Raw byte addresses arrive as int64 scalars; they are cast to typed pointers **once per work
  item, outside every copy loop** (vLLM 0.30's ``batch_memcpy_kernel`` casts a vector of
  addresses inside its loop, which triton-ascend lowers to a gather/scatter and which
  misbehaved on Ascend).
* Each copy uses the widest access that the relative alignment of its two addresses allows
  (16 bytes - pairs of int64 behind a pointer-alignment hint - where enabled, then 8, 4, 2 or
  1 bytes): bytes before the first aligned source address (the head, < 16 bytes) and after the
  last whole unit (the tail, < 16 bytes) go through a 16-lane byte access. Whole blocks move
  unmasked (a mask with a run-time bound keeps the compiler at one element per access), the
  last partial block masked. Every width moves ``BLOCK_BYTES // 8`` elements per step, so the
  narrow paths do not inflate the kernel's register count (registers, not bandwidth, limited
  the first version: 255 registers with spills, two programs per SM on an H100).
* Non-overlapping copies are split into ``tiles_per_copy`` tiles; the work items
  ``(copy, tile)`` are spread over a grid bounded by the device's core count (CUDA SMs times
  :data:`CUDA_PROGRAMS_PER_SM`, Ascend vector cores) and each program loops over its items
  (persistent grid; no grid dimension ever exceeds that bound, so triton-ascend's 65535 cap on
  the flattened grid is never reached). A tile is either one contiguous range or (CUDA, when a
  launch cuts each copy into at least :data:`CUDA_CYCLIC_MIN_TILES` tiles) block-cyclic:
  tile ``t`` of ``T`` moves blocks ``t, t + T, ...``, so the tiles of a copy sweep it side by
  side and differ by at most one block. Cyclic launches on CUDA also mark their loads and
  stores ``evict_first`` in L2 (streaming data). Both are compile-time switches, so the NPU
  build never contains them.
* A copy whose source and destination ranges overlap (memmove) is not tiled: tile 0 of that
  copy moves it alone, in chunks of exactly ``|dst - src|`` bytes, left shifts front to back
  and right shifts back to front. With chunk length equal to the shift, a destination element
  written in chunk ``j`` is the source element read in chunk ``j - 1`` at the same lane
  offset, i.e. by the same thread, earlier in program order, so no barrier is needed.
* Signed element types for the 2-, 4- and 8-byte accesses (triton-ascend 3.2 lists uint16 /
  uint32 / uint64 as unsupported on Atlas A2/A3; a copy does not care about the sign); bytes
  as uint8, as vllm-ascend's own batch_memcpy_kernel does.
* No cache modifiers, no barriers, no atomics; the only cache hint (``evict_first``) is
  CUDA-only and compile-time gated.

Block sizes (bytes moved per loop step and program) per target, see :func:`target_config`:
CUDA 16 KiB with 4 warps (tuned on an H100, see docs/notes/state-copy-kernel.md); Ascend 32 KiB
(a vector core's 192 KiB unified buffer holds it twice over for double buffering; not verified
on NPU; 16-byte path and cyclic tiles off there); interpreter 4 KiB (both layouts exercised).

Import needs ``triton``; callers import this module inside ``try``.
"""

from __future__ import annotations

import dataclasses
import functools

import triton
import triton.language as tl

from vllm_hybrid_npu.ops._interpreter import interpreted_copy

#: CUDA: resident programs per SM the grid is bounded by (programs loop over further items).
CUDA_PROGRAMS_PER_SM = 16
#: CUDA: work items ``(copy, tile)`` aimed for per SM when choosing the tile count.
CUDA_ITEMS_PER_SM = 16
#: CUDA: bytes one program moves per loop step.
CUDA_BLOCK_BYTES = 16384
CUDA_NUM_WARPS = 4
#: CUDA: block-cyclic tiles when a launch splits each copy into at least this many tiles.
CUDA_CYCLIC_MIN_TILES = 6
#: CUDA: round the tile count down to a power of two.
CUDA_POW2_TILES = False
#: Ascend: bytes one program moves per loop step (not verified on NPU).
NPU_BLOCK_BYTES = 32768
#: Ascend: work items aimed for per vector core.
NPU_ITEMS_PER_CORE = 4
#: Upper bound on tiles per copy (a copy smaller than a tile's block just leaves tiles empty).
MAX_TILES_PER_COPY = 64


@triton.jit
def _move_block(src, dst, idx, EVICT: tl.constexpr):
    """Unmasked ``dst[idx] = src[idx]``; ``EVICT`` (CUDA only) marks both as evict-first in L2."""
    if EVICT:
        tl.store(dst + idx, tl.load(src + idx, eviction_policy="evict_first"),
                 eviction_policy="evict_first")
    else:
        tl.store(dst + idx, tl.load(src + idx))


@triton.jit
def _copy_span(src, dst, start, end, BLOCK: tl.constexpr, VEC: tl.constexpr, EVICT: tl.constexpr):
    """Copy elements ``[start, end)`` of typed pointers ``src`` -> ``dst``, BLOCK per step.

    Whole blocks go unmasked (a mask with a run-time bound stops the compiler from widening
    accesses), the last partial block masked. ``start`` must be a multiple of ``VEC`` elements
    (the caller guarantees it; it lets 16-byte accesses through when ``VEC * elem == 16``).
    """
    offs = tl.arange(0, BLOCK)
    full_end = start + (end - start) // BLOCK * BLOCK
    for i in range(start, full_end, BLOCK):
        idx = tl.multiple_of(i, VEC) + offs
        _move_block(src, dst, idx, EVICT)
    idx = full_end + offs
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
def _cyclic_span(src, dst, n, first, step, BLOCK: tl.constexpr, VEC: tl.constexpr,
                 EVICT: tl.constexpr):
    """Copy blocks ``first, first + step, ...`` of elements ``[0, n)``; the last partial block
    (masked) goes to the program whose turn it is. ``VEC`` divides ``BLOCK``."""
    offs = tl.arange(0, BLOCK)
    nfull = n // BLOCK
    for j in range(first, nfull, step):
        idx = tl.multiple_of(j * BLOCK, VEC) + offs
        _move_block(src, dst, idx, EVICT)
    if first == nfull % step:
        idx = nfull * BLOCK + offs
        m = idx < n
        tl.store(dst + idx, tl.load(src + idx, mask=m), mask=m)


@triton.jit
def _tiled_copy(src, dst, size, tile, n_tiles, ELEM: tl.constexpr, ESIZE: tl.constexpr,
                UNIT: tl.constexpr, BLOCK_BYTES: tl.constexpr, GRANULE_BYTES: tl.constexpr,
                CYCLIC: tl.constexpr, EVICT: tl.constexpr):
    """Tile ``tile`` of ``n_tiles`` of a non-overlapping copy of ``size`` bytes.

    ``src ^ dst`` is a multiple of ``UNIT`` (16, 8, 4, 2 or 1 bytes); elements are ``ELEM`` of
    ``ESIZE`` bytes (``UNIT`` = 16 moves pairs of int64, i.e. 16-byte accesses). The head
    (< ``UNIT`` bytes) lifts ``src`` (and so ``dst``) to a ``UNIT`` boundary, the body moves whole
    units, the tail the rest; tile 0 also moves head and tail through a 16-lane byte access.
    ``CYCLIC``: tile ``t`` moves body blocks ``t, t + n_tiles, ...`` (the tiles of one copy sweep
    it side by side, like one grid-stride memcpy); otherwise one contiguous range, its length
    rounded up to ``GRANULE_BYTES`` (a multiple of 16, so every tile starts on a ``UNIT``
    boundary).
    """
    VEC: tl.constexpr = UNIT // ESIZE
    BLK: tl.constexpr = BLOCK_BYTES // 8  # elements per step, every width (see module doc)
    GRN: tl.constexpr = GRANULE_BYTES // ESIZE
    head = tl.minimum((0 - src) & (UNIT - 1), size)
    body = (size - head) // UNIT * VEC
    src_u = (src + head).to(tl.pointer_type(ELEM))
    dst_u = (dst + head).to(tl.pointer_type(ELEM))
    if UNIT > ESIZE:  # alignment hint for the wide path (a cast pointer has unknown alignment)
        src_u = tl.multiple_of(src_u, UNIT)
        dst_u = tl.multiple_of(dst_u, UNIT)
    if CYCLIC:
        _cyclic_span(src_u, dst_u, body, tile, n_tiles, BLK, VEC, EVICT)
    else:
        per = ((body + n_tiles - 1) // n_tiles + GRN - 1) // GRN * GRN
        lo = tile * per
        hi = tl.minimum(lo + per, body)
        _copy_span(src_u, dst_u, lo, hi, BLK, VEC, EVICT)
    if tile == 0:
        src_b = src.to(tl.pointer_type(tl.uint8))
        dst_b = dst.to(tl.pointer_type(tl.uint8))
        b = tl.arange(0, 16)
        hm = b < head
        tl.store(dst_b + b, tl.load(src_b + b, mask=hm), mask=hm)
        tail_start = head + body * ESIZE
        tm = b < (size - tail_start)
        tl.store(dst_b + tail_start + b, tl.load(src_b + tail_start + b, mask=tm), mask=tm)


@triton.jit
def _tiled_copy_narrow(src, dst, size, tile, n_tiles, x, BLOCK_BYTES: tl.constexpr,
                       GRANULE_BYTES: tl.constexpr, CYCLIC: tl.constexpr, EVICT: tl.constexpr):
    """:func:`_tiled_copy` with the widest of 8/4/2/1-byte accesses that ``x = src ^ dst`` allows."""
    if (x & 7) == 0:
        _tiled_copy(src, dst, size, tile, n_tiles, tl.int64, 8, 8, BLOCK_BYTES, GRANULE_BYTES,
                    CYCLIC, EVICT)
    elif (x & 3) == 0:
        _tiled_copy(src, dst, size, tile, n_tiles, tl.int32, 4, 4, BLOCK_BYTES, GRANULE_BYTES,
                    CYCLIC, EVICT)
    elif (x & 1) == 0:
        _tiled_copy(src, dst, size, tile, n_tiles, tl.int16, 2, 2, BLOCK_BYTES, GRANULE_BYTES,
                    CYCLIC, EVICT)
    else:
        _tiled_copy(src, dst, size, tile, n_tiles, tl.uint8, 1, 1, BLOCK_BYTES, GRANULE_BYTES,
                    CYCLIC, EVICT)


@triton.jit
def _overlapping_copy(src, dst, size, ELEM: tl.constexpr, UNIT: tl.constexpr,
                      BLOCK_BYTES: tl.constexpr):
    """memmove of ``size`` bytes; ``src``, ``dst`` and ``size`` are multiples of ``UNIT``."""
    dist = tl.where(dst > src, dst - src, src - dst)
    _move_overlapping(src.to(tl.pointer_type(ELEM)), dst.to(tl.pointer_type(ELEM)), size // UNIT,
                      dist // UNIT, dst < src, BLOCK_BYTES // 32)


# One compiled variant per ``sizes`` dtype: the address tensors are never specialised on 16-byte
# alignment (the kernel reads one scalar from each per work item, so the hint buys nothing), so
# a warm-up launch covers every call of the step path - vllm-ascend's per-layer slices
# ``gpu[start:end]`` are 16-byte aligned or not depending on ``start``, and a batched call's
# tensors are aligned where a warm-up's may not be.
@triton.jit(do_not_specialize=["n_copies", "tiles_per_copy"],
            do_not_specialize_on_alignment=["src_ptrs", "dst_ptrs", "sizes"])
def batch_memcpy_kernel(src_ptrs, dst_ptrs, sizes, n_copies, tiles_per_copy,
                        BLOCK_BYTES: tl.constexpr, GRANULE_BYTES: tl.constexpr,
                        MIN_TILE_BYTES: tl.constexpr, WIDE16: tl.constexpr,
                        CYCLIC: tl.constexpr, EVICT: tl.constexpr):
    """Copy ``sizes[c]`` bytes from address ``src_ptrs[c]`` to ``dst_ptrs[c]`` for every c.

    Work item ``w`` in ``[0, n_copies * tiles_per_copy)`` is tile ``w // n_copies`` of copy
    ``w % n_copies`` (tile-major, so the programs that share an SM / core work on different
    copies and big and small copies mix evenly); program ``p`` takes items ``p, p + P, ...``. A copy of ``size``
    bytes uses only ``min(tiles_per_copy, ceil(size / MIN_TILE_BYTES))`` tiles; its other
    items are empty. Negative sizes copy
    nothing (the host wrapper rejects them before launch).

    Compile-time switches: ``WIDE16`` (0/1) compiles the 16-byte path; ``CYCLIC`` (0/1)
    block-cyclic instead of contiguous tiles; ``EVICT`` (0/1, CUDA only) ``evict_first`` hints
    on the unmasked block loads/stores. See :class:`LaunchConfig` and the module docstring.
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
                    _overlapping_copy(src, dst, size, tl.int64, 8, BLOCK_BYTES)
                elif (a & 3) == 0:
                    _overlapping_copy(src, dst, size, tl.int32, 4, BLOCK_BYTES)
                elif (a & 1) == 0:
                    _overlapping_copy(src, dst, size, tl.int16, 2, BLOCK_BYTES)
                else:
                    _overlapping_copy(src, dst, size, tl.uint8, 1, BLOCK_BYTES)
        elif dist > 0:
            # small copies use fewer tiles: none shorter than MIN_TILE_BYTES
            n_tiles = tl.minimum(tiles_per_copy, (size + MIN_TILE_BYTES - 1) // MIN_TILE_BYTES)
            if tile < n_tiles:
                x = src ^ dst
                if WIDE16:  # compile-time: the 16-byte path exists only where enabled
                    if (x & 15) == 0:
                        _tiled_copy(src, dst, size, tile, n_tiles, tl.int64, 8, 16, BLOCK_BYTES,
                                    GRANULE_BYTES, CYCLIC, EVICT)
                    else:
                        _tiled_copy_narrow(src, dst, size, tile, n_tiles, x, BLOCK_BYTES,
                                           GRANULE_BYTES, CYCLIC, EVICT)
                else:
                    _tiled_copy_narrow(src, dst, size, tile, n_tiles, x, BLOCK_BYTES,
                                       GRANULE_BYTES, CYCLIC, EVICT)


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """Per-target launch parameters of :func:`batch_memcpy_kernel`.

    Attributes:
        max_programs: grid bound (programs); CUDA: SMs x programs per SM, NPU: vector cores.
        target_items: work items ``(copy, tile)`` aimed for; decides the tiles per copy.
        block_bytes: bytes one program moves per loop step with 8-byte (and 16-byte)
            accesses (power of two, >= 128); narrower paths move ``block_bytes // 8`` elements.
        num_warps: CUDA warps per program; ``None`` where the backend takes none.
        granule_bytes: contiguous tile lengths are rounded up to this (power of two,
            16..block_bytes).
        min_tile_bytes: no copy is split into tiles shorter than this.
        wide16: compile the 16-byte path (copies whose addresses agree mod 16).
        cyclic_min_tiles: block-cyclic tiles when a launch splits each copy into at least this
            many tiles, contiguous tiles below (``1 << 30``: never).
        evict_first: mark cyclic launches' loads/stores ``evict_first`` (CUDA only).
        pow2_tiles: round the tile count down to a power of two (measured: no gain; off).
    """

    max_programs: int
    target_items: int
    block_bytes: int
    num_warps: int | None
    granule_bytes: int = 1024
    min_tile_bytes: int = 16384
    wide16: bool = True
    cyclic_min_tiles: int = 1 << 30
    evict_first: bool = False
    pow2_tiles: bool = False


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
                            CUDA_BLOCK_BYTES, CUDA_NUM_WARPS,
                            cyclic_min_tiles=CUDA_CYCLIC_MIN_TILES, evict_first=True,
                            pow2_tiles=CUDA_POW2_TILES)
    if device_type == "npu":
        import torch

        cores = _npu_vector_cores(torch.device("npu", device_index))
        # no 16-byte path (its pointer-alignment hint is untested on triton-ascend), contiguous
        # tiles, no eviction hints: the kernel as before the H100 tuning
        return LaunchConfig(cores, cores * NPU_ITEMS_PER_CORE, NPU_BLOCK_BYTES, None, wide16=False)
    # CPU under the Triton interpreter: programs run one after another; few of them.
    return LaunchConfig(4, 256, 4096, None, 256, 1024, cyclic_min_tiles=8)


def tiles_for(n_copies: int, target_items: int, pow2: bool = False) -> int:
    """Tiles per copy: the most that keep ``n_copies * tiles <= target_items`` (1..64).

    ``pow2``: rounded down to a power of two (so a power-of-two number of blocks in a copy, e.g.
    a 2 MiB state = 128 blocks of 16 KiB, splits into tiles of equal block counts).
    """
    t = max(1, min(target_items // max(n_copies, 1), MAX_TILES_PER_COPY))
    return 1 << (t.bit_length() - 1) if pow2 else t


def launch(kernel, src_ptrs, dst_ptrs, sizes, cfg: LaunchConfig, tiles: int | None = None,
           max_programs: int | None = None) -> None:
    """Launch ``kernel`` (compiled or interpreted) over ``N = src_ptrs.numel() > 0`` copies.

    Block-cyclic tiles when ``tiles >= cfg.cyclic_min_tiles``, contiguous tiles otherwise (two
    compiled variants; the choice depends on ``N`` only, never on device data).
    """
    n = src_ptrs.numel()
    if tiles is None:
        tiles = tiles_for(n, cfg.target_items, cfg.pow2_tiles)
    cyclic = tiles >= cfg.cyclic_min_tiles
    bound = cfg.max_programs if max_programs is None else max_programs
    grid = (max(1, min(n * tiles, bound)),)
    fast_key = None
    if (src_ptrs.is_cuda and FAST_LAUNCH and kernel is batch_memcpy_kernel
            and not ((src_ptrs.data_ptr() | dst_ptrs.data_ptr() | sizes.data_ptr()) & 15)):
        fast_key = (src_ptrs.device.index, sizes.dtype, cfg, cyclic)
        compiled = _compiled.get(fast_key)
        if compiled is not None:
            try:
                compiled[(grid[0], 1, 1)](src_ptrs, dst_ptrs, sizes, n, tiles, cfg.block_bytes,
                                          cfg.granule_bytes, cfg.min_tile_bytes, int(cfg.wide16),
                                          int(cyclic), int(cyclic and cfg.evict_first))
                return
            except Exception as exc:  # an unexpected Triton API: use the regular path from now on
                _disable_fast_launch(exc)
                fast_key = None
    compiled = kernel[grid](src_ptrs, dst_ptrs, sizes, n, tiles, **_launch_kwargs(cfg, cyclic))
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
def _launch_kwargs(cfg: LaunchConfig, cyclic: bool) -> dict:
    kwargs = {"BLOCK_BYTES": cfg.block_bytes, "GRANULE_BYTES": cfg.granule_bytes,
              "MIN_TILE_BYTES": cfg.min_tile_bytes, "WIDE16": int(cfg.wide16),
              "CYCLIC": int(cyclic), "EVICT": int(cyclic and cfg.evict_first)}
    if cfg.num_warps is not None:
        kwargs["num_warps"] = cfg.num_warps
    return kwargs


@functools.lru_cache(maxsize=1)
def interpreted_kernel():
    """This module's kernel built for the Triton interpreter (CPU tensors;
    :func:`vllm_hybrid_npu.ops._interpreter.interpreted_copy`)."""
    if type(batch_memcpy_kernel).__name__ == "InterpretedFunction":
        return batch_memcpy_kernel  # this very module was decorated under the interpreter
    return interpreted_copy(__name__, __file__).batch_memcpy_kernel