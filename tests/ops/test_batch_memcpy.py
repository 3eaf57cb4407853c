"""Single-op tests of ``vllm_hybrid_npu.ops.batch_memcpy`` on every target present.

Targets: CPU under the Triton interpreter, CPU torch fallback, CUDA (Triton kernel and torch
fallback), NPU (triton-ascend kernel and torch fallback). Accelerator targets skip only when the
accelerator is absent; the CPU interpreter cases never skip (a Triton that cannot interpret here
fails them: they are CI's only run of the kernel).

Every case lays its copies out in one arena of fresh random bytes with random guard gaps,
poisons each destination with the bitwise complement of the bytes it must receive, runs the op
and compares the WHOLE arena with an expectation computed independently on the host with
numpy slice assignment (memmove semantics): destinations hold the source bytes, every other
byte (guards, sources) is untouched.
"""

from __future__ import annotations

import functools
import sys
import importlib.util

import numpy as np
import pytest
import torch

from vllm_hybrid_npu.ops import active_impl, batch_memcpy, refresh_settings
from vllm_hybrid_npu.envs import OPTIONS_ENV

_HAS_NPU = importlib.util.find_spec("torch_npu") is not None
if _HAS_NPU:
    import torch_npu  # noqa: F401

    _HAS_NPU = torch.npu.is_available()  # type: ignore[attr-defined]

TARGETS = [
    pytest.param(("cpu", "triton"), id="cpu-interpreter"),
    pytest.param(("cpu", "torch"), id="cpu-torch"),
    pytest.param(("cuda", "triton"), id="cuda-triton",
                 marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")),
    pytest.param(("cuda", "torch"), id="cuda-torch",
                 marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")),
    pytest.param(("npu", "triton"), id="npu-triton",
                 marks=pytest.mark.skipif(not _HAS_NPU, reason="no NPU")),
    pytest.param(("npu", "torch"), id="npu-torch",
                 marks=pytest.mark.skipif(not _HAS_NPU, reason="no NPU")),
]


@functools.lru_cache(maxsize=1)
def _interpreter_broken() -> str:
    """Why this Triton's interpreter cannot run kernels here ('' if it can).

    Triton 3.6's interpreter turns one-element arrays into Python ints, which numpy >= 2.5
    refuses ("only 0-dimensional arrays can be converted to Python scalars"); Triton 3.9 works.
    """
    import warnings

    import triton

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            int(np.array([1], dtype=np.int32))
    except TypeError:
        if tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 9):
            return (f"Triton {triton.__version__} interpreter is incompatible with numpy "
                    f"{np.__version__} (size-1 array to int); runs with Triton >= 3.9")
    return ""


#: the Triton-kernel targets (tile-layout cases exist for the Triton kernel only)
TRITON_TARGETS = [p for p in TARGETS if p.values[0][1] == "triton"]


def _select_target(param, monkeypatch):
    device, impl = param
    monkeypatch.delenv(OPTIONS_ENV, raising=False)
    if device == "cpu" and impl == "triton":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        reason = _interpreter_broken()
        if reason:
            # CI's only run of the Triton kernel: an incompatible Triton/numpy pair is a broken
            # install (the test extra pins both), never a reason to skip
            pytest.fail(f"{reason}; install the pinned versions: pip install -e '.[test]'")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    refresh_settings()
    return torch.device(device), impl


@pytest.fixture(params=TARGETS)
def target(request, monkeypatch):
    yield _select_target(request.param, monkeypatch)
    monkeypatch.undo()
    refresh_settings()


@pytest.fixture(params=TRITON_TARGETS)
def triton_target(request, monkeypatch):
    yield _select_target(request.param, monkeypatch)
    monkeypatch.undo()
    refresh_settings()


@pytest.fixture
def rng(np_rng):
    """numpy Generator from the test's fresh seed (conftest.py; printed if the case fails)."""
    return np_rng


class Arena:
    """Random bytes on a device holding the copies of one case, with guard gaps between them.

    ``add(size, src_mis, dst_mis)`` places a non-overlapping copy; ``add_shift(size, shift)``
    places a copy whose destination is its source moved by ``shift`` bytes (overlapping when
    ``|shift| < size``). Offsets are relative to the arena base, which is 512-byte aligned, so
    ``*_mis`` give the address residues mod 16 (drawn at random when not given).
    """

    def __init__(self, rng: np.random.Generator):
        self.rng = rng
        self.copies: list[tuple[int, int, int]] = []  # (src_off, dst_off, size)
        self.end = 0

    def _gap(self) -> None:
        self.end += int(self.rng.integers(1, 64))

    def _place(self, nbytes: int, mis: int) -> int:
        self._gap()
        self.end += (mis - self.end) % 16
        off = self.end
        self.end += nbytes
        return off

    def add(self, size: int, src_mis: int | None = None, dst_mis: int | None = None) -> None:
        s = self._place(size, int(self.rng.integers(16)) if src_mis is None else src_mis)
        d = self._place(size, int(self.rng.integers(16)) if dst_mis is None else dst_mis)
        if self.rng.random() < 0.5:  # destinations both above and below their sources
            s, d = d, s
        self.copies.append((s, d, size))

    def add_shift(self, size: int, shift: int, mis: int | None = None) -> None:
        base = self._place(size + abs(shift), int(self.rng.integers(16)) if mis is None else mis)
        s = base + (abs(shift) if shift < 0 else 0)
        self.copies.append((s, s + shift, size))

    def run(self, device: torch.device, impl: str, **kwargs) -> None:
        self._gap()
        host = self.rng.integers(0, 256, self.end + 8, dtype=np.uint8)
        before = host.copy()
        expected = host.copy()
        for s, d, n in self.copies:  # poison: complement of what must arrive
            data = before[s:s + n]
            outside = np.ones(n, dtype=bool)  # destination bytes that are not source bytes
            lo, hi = max(s, d), min(s + n, d + n)
            if lo < hi:
                outside[lo - d:hi - d] = False
            host[d:d + n][outside] = ~data[outside]
        for s, d, n in self.copies:
            expected[d:d + n] = host[s:s + n]  # copies are independent: order does not matter
        buf = torch.empty(self.end + 8 + 512, dtype=torch.uint8, device=device)
        shift = (-buf.data_ptr()) % 512
        arena = buf[shift:shift + self.end + 8]
        arena.copy_(torch.from_numpy(host))
        base = arena.data_ptr()
        n = len(self.copies)
        src = torch.tensor([base + s for s, _, _ in self.copies], dtype=torch.int64).reshape(n)
        dst = torch.tensor([base + d for _, d, _ in self.copies], dtype=torch.int64).reshape(n)
        sz = torch.tensor([c[2] for c in self.copies], dtype=torch.int64).reshape(n)
        batch_memcpy(src.to(device), dst.to(device), sz.to(device), device=device, impl=impl, **kwargs)
        got = arena.cpu().numpy()
        bad = np.nonzero(got != expected)[0]
        assert bad.size == 0, f"{bad.size} wrong bytes, first at arena offsets {bad[:8].tolist()}"


def test_sizes(target, rng):
    device, impl = target
    arena = Arena(rng)
    big = 3 * 2**20 + int(rng.integers(1, 8)) if device.type != "cpu" or impl == "torch" else 2**20 + 5
    for size in (0, 1, 7, 8, 9, 63, 64, 1001, 4093, 65536 + int(rng.integers(1, 100)), big):
        arena.add(size)
    arena.add(2 * 2**20, 0, 0)  # an SSM-state-sized aligned copy
    arena.run(device, impl)


def test_misaligned_addresses(target, rng):
    device, impl = target
    arena = Arena(rng)
    for src_mis in range(8):
        for dst_mis in range(8):
            arena.add(int(rng.integers(1, 300)), src_mis, dst_mis)
    arena.add(int(rng.integers(20000, 30000)), 3, 3)  # long copy, equal residues: u64 body
    arena.add(int(rng.integers(20000, 30000)), 2, 6)  # u32 body
    arena.add(int(rng.integers(20000, 30000)), 1, 5)  # u32 body after 3 head bytes
    arena.add(int(rng.integers(20000, 30000)), 1, 2)  # bytes
    arena.run(device, impl)


def test_sixteen_byte_relative_alignment(target, rng):
    """Copies whose addresses agree mod 16 (the kernel's 16-byte path: a 0-15 byte head, whole
    16-byte units, a 0-15 byte tail) next to pairs 8 apart mod 16 (the 8-byte path), with sizes
    that end inside a block, on a block edge and past several blocks and tiles."""
    device, impl = target
    arena = Arena(rng)
    long = 200_000 if device.type != "cpu" or impl == "torch" else 40_000
    for mis in range(16):
        arena.add(int(rng.integers(1, 40)), mis, mis)  # shorter than the head: bytes only
        arena.add(int(rng.integers(40, long)), mis, mis)
        arena.add(int(rng.integers(40, long)), mis, (mis + 8) % 16)
    arena.add(16384 * 3, 0, 0)  # whole blocks, no remainder
    arena.add(16384 * 3 + 16, 0, 0)  # one unit past a block edge
    arena.run(device, impl)


@pytest.mark.parametrize("layout", ["contiguous", "cyclic", "contiguous-8byte"])
def test_tile_layouts(triton_target, rng, monkeypatch, layout):
    """Both tile layouts of the Triton kernel (contiguous ranges, block-cyclic), forced through
    the launch configuration, on copies that split into many tiles with uneven remainders;
    ``contiguous-8byte`` also compiles the kernel without its 16-byte path (the NPU setting)."""
    device, impl = triton_target
    import dataclasses

    from vllm_hybrid_npu.ops import _triton_copy

    orig = _triton_copy.target_config
    threshold = 1 if layout == "cyclic" else 1 << 30
    wide16 = layout != "contiguous-8byte"
    monkeypatch.setattr(_triton_copy, "target_config", lambda t, i: dataclasses.replace(
        orig(t, i), cyclic_min_tiles=threshold, wide16=wide16))
    arena = Arena(rng)
    big = 2**20 if device.type != "cpu" else 60_000
    for _ in range(3):
        arena.add(big + int(rng.integers(0, 50_000)))  # random residues: 16/8/4/2/1-byte paths
    arena.add(big, 0, 0)
    arena.add(int(rng.integers(1, 5000)))
    arena.add(0)
    arena.run(device, impl)


@pytest.mark.parametrize("direction", [-1, 1], ids=["left", "right"])
def test_overlapping_shifts(target, rng, direction):
    device, impl = target
    arena = Arena(rng)
    cases = [(200, 1), (300, 3), (1000, 8), (1001, 62), (4096, 100), (65536 + 8, 4096),
             (3 * 16384, 16384)]  # the last: a conv state [8192, 3] bf16 shifted by one token
    if device.type != "cpu" or impl == "torch":
        cases += [(2**20 + 4, 2), (3 * 2**20, 2**20 + 8), (20000, 1)]
    for size, dist in cases:
        arena.add_shift(size, direction * dist)
    arena.add_shift(100, 0)  # in place: a no-op
    arena.add(777)  # a plain copy in the same batch
    arena.run(device, impl)


def test_hundreds_of_copies(target, rng):
    device, impl = target
    arena = Arena(rng)
    for _ in range(300):
        arena.add(int(rng.integers(0, 2000)))
    for _ in range(4):
        arena.add_shift(int(rng.integers(100, 2000)), int(rng.choice([-1, 1]) * rng.integers(50, 99)))
    arena.run(device, impl, check_values=False)


def test_empty_batch(target):
    device, impl = target
    empty = torch.empty(0, dtype=torch.int64, device=device)
    batch_memcpy(empty, empty.clone(), empty.clone(), impl=impl)  # N = 0: nothing, no error


def _valid_batch(device, rng):
    host = rng.integers(0, 256, 4096, dtype=np.uint8)
    buf = torch.from_numpy(host.copy()).to(device)
    base = buf.data_ptr()
    src = torch.tensor([base, base + 1000, base + 2000], dtype=torch.int64, device=device)
    dst = torch.tensor([base + 3000, base + 3200, base + 3400], dtype=torch.int64, device=device)
    sizes = torch.tensor([100, 150, 120], dtype=torch.int64, device=device)
    return host, buf, src, dst, sizes


@pytest.mark.parametrize("what", ["shape", "dtype", "ndim", "negative", "null", "device", "type"])
def test_invalid_input_raises_before_any_byte_moves(target, rng, what):
    device, impl = target
    host, buf, src, dst, sizes = _valid_batch(device, rng)
    expect: type[Exception] = ValueError
    match = None
    if what == "shape":
        sizes, match = sizes[:2], "sizes has 2 entries but src_ptrs has 3"
    elif what == "dtype":
        dst, expect, match = dst.to(torch.int32), TypeError, "dst_ptrs must have dtype torch.int64"
    elif what == "ndim":
        src, match = src.reshape(3, 1), r"src_ptrs must be 1-D"
    elif what == "negative":
        sizes[1], match = -5, r"sizes\[1\] = -5 is negative"
    elif what == "null":
        src[2], match = 0, "copy 2 of 120 bytes has a null address"
    elif what == "type":
        src, expect, match = src.tolist(), TypeError, "src_ptrs must be a torch.Tensor"
    elif what == "device":
        # CPU tensors handed to an op that must run on an accelerator
        want = "npu" if device.type == "npu" else "cuda"
        with pytest.raises(ValueError, match=f"must be on {want}"):
            batch_memcpy(src.cpu(), dst.cpu(), sizes.cpu(), device=want, impl=impl)
        assert np.array_equal(buf.cpu().numpy(), host), "bytes moved before the error"
        return
    with pytest.raises(expect, match=match):
        batch_memcpy(src, dst, sizes, impl=impl)
    assert np.array_equal(buf.cpu().numpy(), host), "bytes moved before the error"


def test_selection_by_setting(monkeypatch):
    def setenv(name, value):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
        refresh_settings()

    try:
        setenv(OPTIONS_ENV, "copy-impl=torch")
        assert active_impl("cpu") == "torch"
        setenv(OPTIONS_ENV, "copy-impl=bogus")
        with pytest.raises(ValueError, match=OPTIONS_ENV):
            active_impl("cpu")
        setenv(OPTIONS_ENV, "copy-impl=auto")
        setenv("TRITON_INTERPRET", None)
        assert active_impl("cpu") == "torch"  # CPU without the interpreter: fallback
        setenv("TRITON_INTERPRET", "1")
        assert active_impl("cpu") == "triton"
        setenv("TRITON_INTERPRET", None)
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
            active_impl("cpu", impl="triton")
        with pytest.raises(ValueError, match="impl='fast'"):
            active_impl("cpu", impl="fast")
        if torch.cuda.is_available():
            assert active_impl("cuda") == "triton"
    finally:
        monkeypatch.undo()
        refresh_settings()


def test_broken_interpreter_fails_the_cpu_cases_instead_of_skipping(monkeypatch):
    """CI's only run of the Triton kernel must not vanish into a skip: an incompatible
    Triton/numpy pair fails the CPU-interpreter cases, naming the fix."""
    monkeypatch.setattr(sys.modules[__name__], "_interpreter_broken",
                        lambda: "Triton 3.6 interpreter is incompatible with numpy 2.5")
    with pytest.raises(pytest.fail.Exception, match=r"incompatible.*pip install -e '\.\[test\]'"):
        _select_target(("cpu", "triton"), monkeypatch)
    monkeypatch.undo()
    refresh_settings()
