"""Triton kernels of the one-pass GDN prefill-checkpoint export (CUDA; the interpreter on CPU).

* :func:`chunk_states_kernel`: the chunked gated-delta-rule state recurrence of vLLM's FLA
  kernels (``chunk_gated_delta_rule_fwd_kernel_h_blockdim64``, vLLM 0.30.0 / 0.32.0 / 0.33.0,
  ``vllm/third_party/flash_linear_attention/ops/chunk_delta_h.py``), written anew with the same
  arithmetic in the same order and the same tiling (64-token chunks ``BT``, ``BV`` value columns
  a program, the key dimension in blocks of 64), so ``h``, ``v_new`` and the final state are the
  ones vLLM's kernel computes. It adds one thing: where a 64-token chunk starts at a prefill
  checkpoint (``chunk_map``), the running float32 state at that chunk start is also stored,
  cast to the SSM cache's dtype, straight into the checkpoint's block of the SSM cache. That is
  the state vLLM's block-aligned split stores (the final state of a pass that stops there, cast
  to the cache dtype), without a second kernel call or any gather or copy.
* :func:`conv_checkpoint_kernel`: each checkpoint's conv state (the ``width - 1`` pre-convolution
  input rows before it) into its block of the conv cache, in the cache's dtype and layout: one
  launch per layer.

Supported (the calls vLLM's ``chunk_gated_delta_rule_fwd`` makes): variable-length rows
(``cu_seqlens``, ``chunk_offsets``), a scalar gate per token and head (``g``, natural ``exp``), no
per-key gate, ``v_new`` saved, head dimension ``K <= 256``. Import needs ``triton``; callers import
this module inside ``try``.
"""

from __future__ import annotations

import functools
import sys

import triton
import triton.language as tl

from vllm_hybrid_npu.ops._interpreter import interpreted_copy

#: tokens per chunk (FLA's ``FLA_CHUNK_SIZE``; the checkpoint alignment)
CHUNK = 64


@triton.jit
def _tile(base, o_r, m_r, o_c, m_c, s_r, s_c):
    """Pointers and mask of the ``[R, C]`` tile ``base[o_r * s_r + o_c * s_c]``."""
    return base + o_r[:, None] * s_r + o_c[None, :] * s_c, m_r[:, None] & m_c[None, :]


@triton.jit
def _store_state(base, b_h, o_v, m_v, col, K: tl.constexpr, s_v, s_k):
    """``b_h`` ([BV, 64], float32) into keys ``col .. col + 63`` of a ``[V, K]`` state at ``base``,
    cast to its element type."""
    o_k = col + tl.arange(0, 64)
    p, m = _tile(base, o_v, m_v, o_k, o_k < K, s_v, s_k)
    tl.store(p, b_h.to(p.dtype.element_ty), mask=m)


@triton.jit
def _load_state(base, o_v, m_v, col, K: tl.constexpr):
    """Keys ``col .. col + 63`` of the contiguous ``[V, K]`` state at ``base``, as float32."""
    o_k = col + tl.arange(0, 64)
    p, m = _tile(base, o_v, m_v, o_k, o_k < K, K, 1)
    return tl.load(p, mask=m, other=0.0).to(tl.float32)


@triton.jit
def _w_times_h(w, o_t, m_t, stride_w, col, b_h, K: tl.constexpr):
    """``w[t, col:col + 64] @ b_h[:, col:col + 64]^T`` for the chunk's tokens: [BT, BV] float32,
    with ``b_h`` rounded to ``w``'s dtype first (as vLLM's kernel does)."""
    o_k = col + tl.arange(0, 64)
    p, m = _tile(w, o_t, m_t, o_k, o_k < K, stride_w, 1)
    b_w = tl.load(p, mask=m, other=0.0)
    return tl.dot(b_w, tl.trans(b_h).to(b_w.dtype))


@triton.jit
def _k_times_v(k, o_t, m_t, stride_k, col, b_v, K: tl.constexpr):
    """``(k[t, col:col + 64]^T @ b_v)^T`` for the chunk's tokens: the [BV, 64] state update."""
    o_k = col + tl.arange(0, 64)
    p, m = _tile(k, o_k, o_k < K, o_t, m_t, 1, stride_k)
    b_k = tl.load(p, mask=m, other=0.0)
    return tl.trans(tl.dot(b_k, b_v))


@triton.jit
def chunk_states_kernel(k, v, w, v_new, g, h, h0, ht, cu_seqlens, chunk_offsets,
                        chunk_map, slots, cache, s_cb, s_ch, s_cv, s_ck,
                        H: tl.constexpr, Hg: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                        BT: tl.constexpr, BV: tl.constexpr, USE_INITIAL_STATE: tl.constexpr,
                        STORE_FINAL_STATE: tl.constexpr):
    """One program: value columns ``i_v * BV ..`` of head ``i_h`` of row ``i_n``.

    ``k`` [1, T, Hg, K], ``w`` [1, T, H, K], ``v`` (FLA's ``u``) and ``v_new`` [1, T, H, V] in the
    input dtype; ``g`` [1, T, H] float32 (chunk-local cumulative log gates); ``h`` [1, NT, H, V, K]
    (the state at each chunk start, input dtype); ``h0`` [N, H, V, K] (any float dtype) and ``ht``
    [N, H, V, K] float32; ``cu_seqlens`` [N + 1], ``chunk_offsets`` [N] (each row's first chunk);
    ``chunk_map`` int64 [NT]: the checkpoint whose state is the start state of that chunk, or -1;
    ``slots`` int64 [n]: each checkpoint's block of ``cache`` ([blocks, H, V, K], strides
    ``s_c*`` in elements).
    """
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    T = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
    NT = (T + BT - 1) // BT
    boh = tl.load(chunk_offsets + i_n).to(tl.int64)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V

    h += (boh * H + i_h) * V * K
    v += (bos * H + i_h) * V
    v_new += (bos * H + i_h) * V
    k += (bos * Hg + i_h // (H // Hg)) * K
    w += (bos * H + i_h) * K
    g += bos * H + i_h
    cache += i_h * s_ch

    b_h1 = tl.full([BV, 64], 0, dtype=tl.float32)
    if K > 64:
        b_h2 = tl.full([BV, 64], 0, dtype=tl.float32)
    if K > 128:
        b_h3 = tl.full([BV, 64], 0, dtype=tl.float32)
    if K > 192:
        b_h4 = tl.full([BV, 64], 0, dtype=tl.float32)
    if USE_INITIAL_STATE:
        b_h1 += _load_state(h0 + i_nh * V * K, o_v, m_v, 0, K)
        if K > 64:
            b_h2 += _load_state(h0 + i_nh * V * K, o_v, m_v, 64, K)
        if K > 128:
            b_h3 += _load_state(h0 + i_nh * V * K, o_v, m_v, 128, K)
        if K > 192:
            b_h4 += _load_state(h0 + i_nh * V * K, o_v, m_v, 192, K)

    o_t = tl.arange(0, BT)  # a chunk's tokens, int32: tile offsets stay 32-bit (vLLM's do too)
    # the checkpoint (or -1) of the row's first chunk; each iteration loads the next chunk's a
    # whole iteration before its branch needs it: a load that feeds the branch directly stalls
    # the program (one warp group per SM) for a global load's latency in every chunk
    ck = tl.load(chunk_map + boh, mask=NT > 0, other=-1)  # an empty row reads nothing
    for i_t in range(NT):
        c = tl.full([], 0, dtype=tl.int64) + i_t  # chunk index in the row, int64 in both modes
        ck_next = tl.load(chunk_map + boh + tl.minimum(c + 1, NT - 1))
        # the chunk's bases (64-bit scalars); the tiles below add 32-bit offsets to them
        h_c = h + c * H * V * K
        w_c = w + c * BT * H * K
        k_c = k + c * BT * Hg * K
        v_c = v + c * BT * H * V
        vn_c = v_new + c * BT * H * V
        g_c = g + c * BT * H
        rem = tl.minimum(T - c * BT, BT).to(tl.int32)  # the chunk's tokens (the last may be short)
        m_t = o_t < rem
        # the state at this chunk's start: into h, and into a checkpoint block where one is planned
        _store_state(h_c, b_h1, o_v, m_v, 0, K, K, 1)
        if K > 64:
            _store_state(h_c, b_h2, o_v, m_v, 64, K, K, 1)
        if K > 128:
            _store_state(h_c, b_h3, o_v, m_v, 128, K, K, 1)
        if K > 192:
            _store_state(h_c, b_h4, o_v, m_v, 192, K, K, 1)
        if ck >= 0:
            dst = cache + tl.load(slots + ck) * s_cb
            _store_state(dst, b_h1, o_v, m_v, 0, K, s_cv, s_ck)
            if K > 64:
                _store_state(dst, b_h2, o_v, m_v, 64, K, s_cv, s_ck)
            if K > 128:
                _store_state(dst, b_h3, o_v, m_v, 128, K, s_cv, s_ck)
            if K > 192:
                _store_state(dst, b_h4, o_v, m_v, 192, K, s_cv, s_ck)

        b_v = _w_times_h(w_c, o_t, m_t, H * K, 0, b_h1, K)
        if K > 64:
            b_v += _w_times_h(w_c, o_t, m_t, H * K, 64, b_h2, K)
        if K > 128:
            b_v += _w_times_h(w_c, o_t, m_t, H * K, 128, b_h3, K)
        if K > 192:
            b_v += _w_times_h(w_c, o_t, m_t, H * K, 192, b_h4, K)
        p_v, m_tv = _tile(v_c, o_t, m_t, o_v, m_v, H * V, 1)
        b_v = tl.load(p_v, mask=m_tv, other=0.0) - b_v
        p_vn, _ = _tile(vn_c, o_t, m_t, o_v, m_v, H * V, 1)
        tl.store(p_vn, b_v.to(p_vn.dtype.element_ty), mask=m_tv)

        # gates: the chunk's last token decays the state, each token's value by its distance
        b_g_last = tl.load(g_c + (rem - 1) * H)
        b_g = tl.load(g_c + o_t * H, mask=m_t, other=0.0)
        b_v = b_v * tl.where(m_t, tl.exp(b_g_last - b_g), 0)[:, None]
        b_g_last = tl.exp(b_g_last)
        b_h1 *= b_g_last
        if K > 64:
            b_h2 *= b_g_last
        if K > 128:
            b_h3 *= b_g_last
        if K > 192:
            b_h4 *= b_g_last
        b_v = b_v.to(k.dtype.element_ty)

        b_h1 += _k_times_v(k_c, o_t, m_t, Hg * K, 0, b_v, K)
        if K > 64:
            b_h2 += _k_times_v(k_c, o_t, m_t, Hg * K, 64, b_v, K)
        if K > 128:
            b_h3 += _k_times_v(k_c, o_t, m_t, Hg * K, 128, b_v, K)
        if K > 192:
            b_h4 += _k_times_v(k_c, o_t, m_t, Hg * K, 192, b_v, K)
        ck = ck_next

    if STORE_FINAL_STATE:
        ht += i_nh * V * K
        _store_state(ht, b_h1, o_v, m_v, 0, K, K, 1)
        if K > 64:
            _store_state(ht, b_h2, o_v, m_v, 64, K, K, 1)
        if K > 128:
            _store_state(ht, b_h3, o_v, m_v, 128, K, K, 1)
        if K > 192:
            _store_state(ht, b_h4, o_v, m_v, 192, K, K, 1)


@triton.jit
def conv_checkpoint_kernel(x, s_xt, s_xd, conv_end, slots, cache, s_cb, s_cd, s_cj, D,
                           W1: tl.constexpr, BD: tl.constexpr):
    """Program ``(j, d-block)``: rows ``conv_end[j] - W1 .. conv_end[j] - 1`` of ``x`` ([T, D],
    strides ``s_x*``) into ``cache[slots[j], d, r]`` (strides ``s_cb``, ``s_cd``, ``s_cj``; row
    ``r`` of the ``W1 = width - 1`` conv-state rows), cast to the cache's element type."""
    j, i_d = tl.program_id(0), tl.program_id(1)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    end = tl.load(conv_end + j)
    dst = cache + tl.load(slots + j) * s_cb
    for r in tl.static_range(W1):
        row = tl.load(x + (end - W1 + r) * s_xt + o_d * s_xd, mask=m_d)
        tl.store(dst + r * s_cj + o_d * s_cd, row.to(cache.dtype.element_ty), mask=m_d)


@functools.lru_cache(maxsize=1)
def interpreted():
    """This module executed again under ``TRITON_INTERPRET=1`` (its kernels run on CPU tensors;
    :func:`vllm_hybrid_npu.ops._interpreter.interpreted_copy`)."""
    if type(chunk_states_kernel).__name__ == "InterpretedFunction":
        return sys.modules[__name__]
    return interpreted_copy(__name__, __file__)


def chunk_states(k, w, u, g, initial_state, output_final_state: bool, cu_seqlens, chunk_offsets,
                 num_chunks: int, chunk_map, slots, cache, bv: int = 64,
                 num_warps: int | None = None, num_stages: int | None = None, kernels=None):
    """vLLM's ``chunk_gated_delta_rule_fwd_h`` (variable-length rows, scalar gates) with the
    checkpoints of ``chunk_map`` written into ``cache`` from inside the recurrence.

    Args: ``k`` [1, T, Hg, K], ``w`` [1, T, H, K], ``u`` [1, T, H, V] (input dtype), ``g`` [1, T, H]
    float32, ``initial_state`` [N, H, V, K] or None, ``cu_seqlens`` [N + 1] and ``chunk_offsets``
    [N] (device, as vLLM's GDN builder precomputes them), ``num_chunks`` the 64-token chunks of
    all rows (``len(chunk_indices)``), ``chunk_map`` int64 [num_chunks] (a checkpoint index or -1),
    ``slots`` int64 [n] (each checkpoint's block), ``cache`` the SSM cache [blocks, H, V, K] (any
    strides, any float dtype); the launch configuration (``bv``, ``num_warps``, ``num_stages``:
    take vLLM's autotuned choice for bit-equal results); ``kernels`` the module whose kernel runs
    (default this one; :func:`interpreted` on CPU tensors).
    Returns ``(h, v_new, final_state)`` as vLLM's function: [1, num_chunks, H, V, K] input dtype,
    [1, T, H, V] input dtype, [N, H, V, K] float32 (None unless ``output_final_state``).
    Raises ValueError for a batch dimension other than 1 or ``K > 256``.
    """
    import torch

    if k.shape[0] != 1 or k.shape[-1] > 256:
        raise ValueError(f"chunk_states: k {tuple(k.shape)}: needs one batch row of variable-length "
                         "sequences and a head dimension <= 256")
    hg, kd = k.shape[-2:]
    heads, vd = u.shape[-2:]
    n = cu_seqlens.numel() - 1
    h = k.new_empty(1, num_chunks, heads, vd, kd)
    final = k.new_empty(n, heads, vd, kd, dtype=torch.float32) if output_final_state else None
    v_new = torch.empty_like(u)
    launch = {key: val for key, val in (("num_warps", num_warps), ("num_stages", num_stages))
              if val is not None}
    (kernels or sys.modules[__name__]).chunk_states_kernel[(triton.cdiv(vd, bv), n * heads)](
        k, u, w, v_new, g, h, initial_state, final, cu_seqlens, chunk_offsets, chunk_map, slots,
        cache, *cache.stride(), H=heads, Hg=hg, K=kd, V=vd, BT=CHUNK, BV=bv,
        USE_INITIAL_STATE=initial_state is not None, STORE_FINAL_STATE=output_final_state, **launch)
    return h, v_new, final


def write_conv(conv_cache, x, conv_end, slots, width: int, dim_first: bool, kernels=None) -> None:
    """Each checkpoint's conv state: rows ``conv_end[j] - width + 1 .. conv_end[j] - 1`` of ``x``
    ([T, D], the step's pre-convolution input) into block ``slots[j]`` of ``conv_cache``
    ([blocks, D, width - 1] when ``dim_first``, else [blocks, width - 1, D]) in its dtype; one
    launch. ``conv_end`` and ``slots`` int64 [n] on ``x``'s device."""
    s_cb, a, b = conv_cache.stride()
    s_cd, s_cj = (a, b) if dim_first else (b, a)
    d = x.shape[-1]
    bd = min(1024, triton.next_power_of_2(d))
    (kernels or sys.modules[__name__]).conv_checkpoint_kernel[(slots.numel(), triton.cdiv(d, bd))](
        x, *x.stride(), conv_end, slots, conv_cache, s_cb, s_cd, s_cj, d, W1=width - 1, BD=bd)
