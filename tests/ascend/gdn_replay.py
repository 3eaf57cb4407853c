"""Replay vllm-ascend 0.30.0rc2's GDN prefill forward on CPU, on each of its prefill paths, with the
plugin's checkpoint export.

Run as a subprocess (it installs import stubs and replaces module globals of vllm-ascend)::

    python tests/ascend/gdn_replay.py --seed 123 --paths chunk,fused --draws 3 --out result.json
    python tests/ascend/gdn_replay.py --seed 123 --paths fla-npu --draws 3 --out result.json

What is vllm-ascend's real code: ``AscendGDNAttentionMetadataBuilder.build`` (and its host-metadata
subclass, which vllm-ascend's backend picks where a fused prefill op runs), built without
``__init__``; ``AscendGatedDeltaNetAttention._forward_core`` (``vllm_ascend/ops/gdn.py``; installed
as vLLM's ``QwenGatedDeltaNetAttention._forward_core``, as ``patch_qwen3_5.py`` does) with its
prefill path choice (``_get_fla_gdn_prefill_op``, ``_probe_fused_chunk``, hardware profile A2),
``_chunk_gated_delta_rule_fused``, ``DeviceOperator.fla_gdn_prefill`` (A2) and the chunk glue
``chunk_gated_delta_rule`` / ``chunk_gated_delta_rule_fwd`` (``ops/triton/fla/chunk.py``) with
its chunk metadata (``_build_non_spec_chunked_prefill_metadata``) and empty-segment compaction;
vLLM's ``CommonAttentionMetadata``, ``MambaSpec``, ``GDNAttentionMetadata``; and the plugin's
registry (``apply_patches("npu", ...)``). One expression of ``_forward_core`` is changed: the
fused CANN op is "NPU-only", so vllm-ascend skips it for CPU tensors (``query_non_spec.device.type
!= "cpu"``); for the ``fused`` path that comparison is compiled as ``True`` (AST, same file name
and line numbers), everything else of the function unchanged.

What is replaced (kernels that need an NPU, or Triton, which vLLM disables on this CPU build), each
by a torch reference of its contract, all computing in float32:

* the fused CANN op ``torch_npu.npu_chunk_gated_delta_rule(q, k, v, *, beta, initial_state,
  actual_seq_lengths, scale, g) -> (o, final_state)`` (torch-npu 2.10.0.post4's
  ``_op_plugin_docs.py``: TND layout, q / k l2-normed by the caller, raw float32 ``g``, bf16
  ``initial_state`` / ``final_state`` ``[N, HV, V, K]``, ``actual_seq_lengths`` per sequence);
* ``fla_npu.ops.ascendc.chunk_gated_delta_rule_fwd`` (as ``DeviceOperator.fla_gdn_prefill`` calls
  it: BNSD q / k / v, state ``[N, HV, K, V]``, output sequence-major), only in ``--paths fla-npu``
  (then vllm-ascend chooses it), ``causal_conv1d_fn`` (on a conv state ``W - 1 + k`` wide under
  MTP: its first ``W - 1`` columns, as vLLM's Triton kernel), ``causal_conv1d_update`` and
  ``recurrent_gated_delta_rule`` with ``num_accepted_tokens`` (the speculative rows; their
  contracts on the wide state and the ``k + 1`` slots are vLLM's Triton ones, unverified for
  fla_npu's binaries; only determinism is relied on) and without (a decode);
* AscendC ops under their own names and schemas (``csrc/torch_binding.cpp``) with
  ``torch.library``: ``_C_ascend::chunk_gated_delta_rule_fwd_h_vllm`` and ``chunk_fwd_o_vllm``;
* Triton: ``chunk_local_cumsum``, ``chunk_scaled_dot_kkt_fwd``, ``solve_tril``,
  ``recompute_w_u_fwd``, ``l2norm_fwd``, ``clear_ssm_states``, ``gather_ssm_states``,
  ``scatter_ssm_states_``, ``fused_gdn_gating``; ``torch.npu.device`` a null context; torch_npu
  dtype constants; the PCP group a world of one.

The chunked references are checked against a token-by-token gated delta rule (``reference_check``).

Per path and SSM cache dtype (bf16, float32), per draw (one decode row and prefill rows with and
without context, block 64 or 128, at least one checkpoint), from the same initial caches: the
one-pass step with the plugin's plan, the same step without it, and vLLM's split (a first step
stopping every checkpointed request at its checkpoint, then its second step over the rest after
align mode's copy of the running state). Checked: the exported conv and SSM blocks equal the
split's first step's bytes; the step's outputs equal the step without the plan on every token but
the tails, and the split's second step on the tails; every cache byte equals the step without the
plan but the checkpoint blocks (the split's) and the checkpointed rows' running blocks (the split's
second step); a plan shifted by one chunk exports other bytes (control). A one-token tail is a
decode in the split's second step (vllm-ascend's builder makes it one: the recurrent kernel) and a
prefill row in the exporter's step (the chunk kernel), from the same state: its output and final
state are compared with a tolerance, apart. The tails' share of the
prefill tokens (the kernel work the split adds) and the prefill kernel calls with and without the
plan are recorded (no time: the references are CPU code, not the NPU's kernels). The block tables
are align mode's: context, checkpoint and running columns hold blocks, the others the null block.

Junction draws (``--junction-draws``, issue 38; :func:`junction_draw`): rows with shared-prefix
junction blocks before the prompt's checkpoint (two or more such rows per batch) and, at block
128, a row started mid-block whose crossed boundary goes to its initial state's block, the block
table held by vllm-ascend's own ``vllm_ascend/worker/block_table.py`` ``BlockTable`` (the plugin's
``gdn-checkpoint-ascend-host-table`` entry records it; the builder is watched for host reads of
its device tensor). Checked against vLLM's ``K + 1``-step split: the planned checkpoints are the
constructed ones, vllm-ascend's op runs once per round, every exported conv and SSM block, every
output and every other cache byte are the split's; a plan one token earlier is caught.

MTP draws (``--spec-draws``, issue 58; :func:`spec_draw`): ``k`` speculative tokens drawn from
1-3 (builder and layer as MTP builds them: ``use_spec_decode``, ``num_spec``, ``k`` speculative
blocks, the conv state ``W - 1 + k`` wide; vLLM's EAGLE block drop in the plan), speculative
decode rows (``k + 1`` tokens, accepted counts drawn) first and between prefill rows, a 1-token
non-speculative row; every second one under a full graph with padded suffix rows (sequence length
0, a ``k + 1`` span; ``num_actual_reqs``, which vllm-ascend's runner passes, the real rows or
all).
Checked against vLLM's split (both its steps with the speculative rows): the planned offsets are
vLLM's rule at the non-speculative rows' batch rows; each checkpoint's conv (first ``W - 1``
columns) and SSM blocks are the split's, its other ``k`` conv columns unchanged; every output and
cache byte is the step's without the plan but the checkpoint and final blocks (the split's); the
speculative rows' outputs and ``k + 1`` slots are the step's without the plan; vllm-ascend's
speculative kernels ran once, its prefill op once without the plan and twice with it. Controls:
the forward's conv rows in batch order (no ``non_spec_token_indx`` map), the plan one chunk
earlier, and (full graph) the plan of the rows as passed, padded spans kept.

Second-checkpoint draws (``--second-draws``, issue 38 item 3; :func:`second_rows`): at
``--prefix-match-unit 64``, block 128, rows whose checkpoint ``cp`` lies inside the prompt's last
block off the block grid, each given a second block (a new block id) by a scheduler output the
step reads through the plugin's runner wrapper (``gdn_step_checkpoints._make_receive``, the
``gdn-checkpoint-receive*`` entries' make): checked as the junction draws, against vLLM's split stopping at the
block boundary ``q`` and at ``cp``, the state at ``cp`` in the second block.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import inspect
import json
import random
import sys
import textwrap
import traceback
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parents[1]))  # this checkout's vllm_hybrid_npu, not an installed one
from ascend import ascend_env, upstream  # noqa: E402

ASCEND = "0.30.0rc2"
CHUNK = 64
NK, NV, DK, DV, WIDTH = 2, 4, 16, 16, 4  # GVA: two v heads per k head
CONV_DIM = 2 * NK * DK + NV * DV
PREFIX = "model.layers.0.linear_attn"
PATHS = ("chunk", "fused", "fla-npu")
#: the plugin's name of each vllm-ascend prefill path
PLUGIN_PATH = {"chunk": "ascend-chunk", "fused": "ascend-fused", "fla-npu": "ascend-fla-npu"}


# --------------------------------------------------------------------------- references
def _torch():
    import torch

    return torch


def l2norm_ref(x, eps=1e-6, output_dtype=None):
    torch = _torch()
    y = x.float()
    y = y / torch.sqrt((y * y).sum(-1, keepdim=True) + eps)
    return y.to(output_dtype or x.dtype)


def _segments(cu_seqlens, total):
    cu = [0, total] if cu_seqlens is None else [int(c) for c in cu_seqlens]
    return list(zip(cu[:-1], cu[1:]))


def _chunks(s, e):
    return [(c, min(c + CHUNK, e)) for c in range(s, e, CHUNK)]


def chunk_local_cumsum_ref(g, chunk_size, cu_seqlens=None, **_):
    out = g.float().clone()
    for s, e in _segments(cu_seqlens, g.shape[1]):
        for a, b in _chunks(s, e):
            out[:, a:b] = g[:, a:b].float().cumsum(1)
    return out


def _kv_heads(k):  # [.., T, NK, K] -> [.., T, NV, K]
    return k.repeat_interleave(NV // k.shape[-2], dim=-2)


def chunk_scaled_dot_kkt_ref(k, beta, g_cumsum, cu_seqlens=None, output_dtype=None, **_):
    torch = _torch()
    kk = _kv_heads(k[0].float())  # [T, HV, K]
    t_all, hv = kk.shape[:2]
    A = torch.zeros(1, t_all, hv, CHUNK, dtype=torch.float32)
    for s, e in _segments(cu_seqlens, t_all):
        for a, b in _chunks(s, e):
            kc, gc, bc = kk[a:b], g_cumsum[0, a:b].float(), beta[0, a:b].float()
            dots = torch.einsum("thk,ihk->hti", kc, kc)  # [HV, L, L]
            decay = torch.exp(gc.t()[:, :, None] - gc.t()[:, None, :])
            m = torch.tril(torch.ones(b - a, b - a), -1)
            A[0, a:b, :, : b - a] = (dots * decay * m * bc.t()[:, :, None]).permute(1, 0, 2)
    return A.to(output_dtype or torch.float32)


def solve_tril_ref(A, cu_seqlens=None, output_dtype=None, **_):
    torch = _torch()
    out = torch.zeros_like(A, dtype=torch.float32)
    for s, e in _segments(cu_seqlens, A.shape[1]):
        for a, b in _chunks(s, e):
            blk = A[0, a:b, :, : b - a].float().permute(1, 0, 2)  # [HV, L, L]
            eye = torch.eye(b - a).expand_as(blk)
            out[0, a:b, :, : b - a] = torch.linalg.inv(eye + blk).permute(1, 0, 2)
    return out.to(output_dtype or A.dtype)


def recompute_w_u_ref(k, v, beta, A, g_cumsum, cu_seqlens=None, **_):
    torch = _torch()
    kk = _kv_heads(k[0].float())
    gc = g_cumsum[0].float().t()  # g_cumsum arrives [B, HV, T]
    w = torch.zeros(1, kk.shape[0], NV, kk.shape[-1])
    u = torch.zeros(1, v.shape[1], NV, v.shape[-1])
    for s, e in _segments(cu_seqlens, kk.shape[0]):
        for a, b in _chunks(s, e):
            ai = A[0, a:b, :, : b - a].float()  # [L, HV, L]
            bc = beta[0, a:b].float()
            w[0, a:b] = torch.einsum("thi,ihk->thk", ai, kk[a:b] * (bc * torch.exp(gc[a:b]))[..., None])
            u[0, a:b] = torch.einsum("thi,ihv->thv", ai, v[0, a:b].float() * bc[..., None])
    return w.to(k.dtype), u.to(v.dtype)


def fwd_h_ref(k, w, u, g=None, gk=None, initial_state=None, output_final_state=False,
              chunk_size=None, save_new_value=True, cu_seqlens=None, chunk_indices=None,
              use_exp2=False, transpose_state_layout=False):
    """``chunk_gated_delta_rule_fwd_h_vllm``: k ``[B, H, T, K]``, w ``[B, HV, T, K]``, u
    ``[B, HV, T, V]``, g ``[B, HV, T]`` (chunk-local cumsum); returns ``h`` ``[B, HV, NT, K, V]``
    (k's dtype), ``v_new`` (u's dtype), ``final_state`` ``[N, HV, K, V]``."""
    torch = _torch()
    assert chunk_size == CHUNK and not use_exp2 and not transpose_state_layout and gk is None
    kk = _kv_heads(k[0].transpose(0, 1).float())  # [T, HV, K]
    ww, uu = w[0].transpose(0, 1).float(), u[0].transpose(0, 1).float()
    gc = g[0].float().t()  # [T, HV]
    t_all = kk.shape[0]
    segs = _segments(cu_seqlens, t_all)
    nt = (len(chunk_indices) // 2 if chunk_indices is not None
          else sum(len(_chunks(s, e)) for s, e in segs))
    h = torch.zeros(1, NV, nt, kk.shape[-1], uu.shape[-1], dtype=k.dtype)
    v_new = torch.zeros_like(u)
    final = []
    c = 0
    for n, (s, e) in enumerate(segs):
        S = (initial_state[n].float() if initial_state is not None
             else torch.zeros(NV, kk.shape[-1], uu.shape[-1]))
        for a, b in _chunks(s, e):
            h[0, :, c] = S.to(k.dtype)
            vn = uu[a:b] - torch.einsum("thk,hkv->thv", ww[a:b], S)
            v_new[0, :, a:b] = vn.transpose(0, 1).to(u.dtype)
            last = gc[b - 1]  # [HV]
            kd = kk[a:b] * torch.exp(last[None] - gc[a:b])[..., None]
            S = S * torch.exp(last)[:, None, None] + torch.einsum("thk,thv->hkv", kd, vn)
            c += 1
        final.append(S)
    assert c == nt, (c, nt)
    dtype = initial_state.dtype if initial_state is not None else k.dtype
    return h, v_new, torch.stack(final).to(dtype)


def fwd_o_ref(q, k, v, h, scale, g=None, g_gamma=None, cu_seqlens=None, chunk_indices=None,
              chunk_size=None, transpose_state_layout=False):
    torch = _torch()
    qq = _kv_heads(q[0].transpose(0, 1).float())
    kk = _kv_heads(k[0].transpose(0, 1).float())
    vv = v[0].transpose(0, 1).float()
    gc = g[0].float().t()
    o = torch.zeros(1, NV, vv.shape[0], vv.shape[-1])
    c = 0
    for s, e in _segments(cu_seqlens, vv.shape[0]):
        for a, b in _chunks(s, e):
            S = h[0, :, c].float()
            inter = torch.einsum("thk,hkv->thv", qq[a:b], S) * torch.exp(gc[a:b])[..., None]
            att = torch.einsum("thk,ihk->hti", qq[a:b], kk[a:b])
            att = att * torch.exp(gc[a:b].t()[:, :, None] - gc[a:b].t()[:, None, :])
            att = att * torch.tril(torch.ones(b - a, b - a))
            intra = torch.einsum("hti,ihv->thv", att, vv[a:b])
            o[0, :, a:b] = ((inter + intra) * scale).transpose(0, 1)
            c += 1
    return o.to(v.dtype)


def causal_conv1d_fn_ref(x, weight, bias=None, conv_states=None, query_start_loc=None,
                         cache_indices=None, has_initial_state=None, activation=None,
                         pad_slot_id=None, null_block_id=None):
    """fla_npu's prefill conv: ``x`` ``[T, D]``, ``weight`` ``[W, D]`` (packed), conv states
    ``[blocks, W - 1 + k, D]`` (``k`` speculative tokens, else 0): their first ``W - 1`` time
    columns read where ``has_initial_state`` and set to the last ``W - 1`` input rows of each
    sequence (initial rows first), the other ``k`` left as they were (vLLM's Triton
    ``causal_conv1d_fn``, ``state_len = KERNEL_WIDTH - 1``; fla_npu's binary on a wide state:
    unverified)."""
    torch = _torch()
    width = weight.shape[0]
    out = torch.empty_like(x)
    qsl = query_start_loc.tolist()
    for n in range(len(qsl) - 1):
        s, e = qsl[n], qsl[n + 1]
        if e == s:
            continue
        idx = int(cache_indices[n])
        init = (conv_states[idx, :width - 1].float() if bool(has_initial_state[n])
                else torch.zeros(width - 1, x.shape[1]))
        xx = torch.cat([init, x[s:e].float()])
        out[s:e] = _conv_rows(xx, weight, bias, activation).to(x.dtype)
        conv_states[idx, :width - 1] = xx[-(width - 1):].to(conv_states.dtype)
    return out


def _conv_rows(xx, weight, bias, activation):
    """The causal convolution of one row: ``xx`` [W - 1 + L, D] float32 (the state's ``W - 1``
    columns, then the row's ``L`` tokens), ``weight`` [W, D]; returns [L, D] float32."""
    torch = _torch()
    width = weight.shape[0]
    y = sum(weight[j].float() * xx[j: j + xx.shape[0] - width + 1] for j in range(width))
    if bias is not None:
        y = y + bias.float()
    return torch.nn.functional.silu(y) if activation == "silu" else y


def causal_conv1d_update_ref(x, conv_state, weight, bias=None, activation=None,
                             conv_state_indices=None, num_accepted_tokens=None,
                             query_start_loc=None, max_query_len=None, null_block_id=None,
                             out=None):
    """fla_npu's conv update as vllm-ascend's speculative rows call it (its contract is
    unverified; vLLM's Triton ``causal_conv1d_update`` with ``num_accepted_tokens`` read so):
    ``x`` ``[T, D]`` the rows' tokens (``query_start_loc``), ``weight`` ``[W, D]`` (packed), each
    row's block ``conv_state[conv_state_indices[n]]`` ``[W - 1 + k, D]`` read from time column
    ``num_accepted_tokens[n] - 1`` (its ``W - 1`` columns before the row's first token), then set
    to the last ``W - 1 + k`` columns of the state from that column followed by the tokens. The
    speculative rows are compared with and without the plugin's plan, so only determinism
    matters here."""
    torch = _torch()
    width, span = weight.shape[0], conv_state.shape[1]
    out = torch.empty_like(x) if out is None else out
    qsl = query_start_loc.tolist()
    for n in range(len(qsl) - 1):
        s, e = qsl[n], qsl[n + 1]
        if e == s:
            continue
        idx, off = int(conv_state_indices[n]), int(num_accepted_tokens[n]) - 1
        state = conv_state[idx].float()
        xx = torch.cat([state[off:off + width - 1], x[s:e].float()])
        out[s:e] = _conv_rows(xx, weight, bias, activation).to(x.dtype)
        full = torch.cat([state[off:], x[s:e].float()])
        assert full.shape[0] >= span, (full.shape, span)
        conv_state[idx] = full[-span:].to(conv_state.dtype)
    return out


def recurrent_gdr_spec_ref(q, k, v, ssm_state, g, beta, scale, actual_seq_lengths,
                           ssm_state_indices, num_accepted_tokens):
    """fla_npu's recurrence on speculative rows as vllm-ascend calls it (contract unverified;
    vLLM's ``fused_recurrent_gated_delta_rule`` with 2-D state indices read so): ``R`` rows
    (``num_accepted_tokens`` [R]), row ``n`` of ``actual_seq_lengths[n + 1]`` tokens
    (vllm-ascend's ``[query_start_loc[0], lengths...]``), its ``k + 1`` state slots
    ``ssm_state_indices.view(R, -1)[n]``: the state read from slot ``num_accepted_tokens[n] - 1``,
    the state after its ``j``-th token written to slot ``j``; state ``[blocks, HV, V, K]``."""
    torch = _torch()
    rows = num_accepted_tokens.numel()
    slots = ssm_state_indices.view(rows, -1).tolist()
    lens = actual_seq_lengths[1:rows + 1].tolist()
    assert sum(lens) == q.shape[0], (lens, q.shape)
    out = torch.empty(q.shape[0], NV, v.shape[-1], dtype=v.dtype)
    qq, kk = _kv_heads(q.float()), _kv_heads(k.float())
    t = 0
    for n, length in enumerate(lens):
        S = ssm_state[slots[n][int(num_accepted_tokens[n]) - 1]].float().transpose(-1, -2)
        for j in range(length):
            S = S * torch.exp(g[t].float())[:, None, None]
            vn = v[t].float() - torch.einsum("hk,hkv->hv", kk[t], S)
            S = S + torch.einsum("hk,hv->hkv", kk[t], vn * beta[t].float()[:, None])
            out[t] = (torch.einsum("hk,hkv->hv", qq[t], S) * scale).to(v.dtype)
            ssm_state[slots[n][j]] = S.transpose(-1, -2).to(ssm_state.dtype)
            t += 1
    return out


def recurrent_gdr_ref(q, k, v, ssm_state, g=None, beta=None, scale=None, actual_seq_lengths=None,
                      ssm_state_indices=None, num_accepted_tokens=None):
    """fla_npu's decode recurrence, one token per sequence; state ``[blocks, HV, V, K]``. With
    ``num_accepted_tokens`` (vllm-ascend's speculative rows): :func:`recurrent_gdr_spec_ref`."""
    torch = _torch()
    if num_accepted_tokens is not None:
        CALLS["spec_recurrent"] += 1
        return recurrent_gdr_spec_ref(q, k, v, ssm_state, g, beta, scale, actual_seq_lengths,
                                      ssm_state_indices, num_accepted_tokens)
    out = torch.empty(q.shape[0], NV, v.shape[-1], dtype=v.dtype)
    qq, kk = _kv_heads(q.float()), _kv_heads(k.float())
    for t in range(q.shape[0]):
        idx = int(ssm_state_indices[t])
        S = ssm_state[idx].float().transpose(-1, -2) * torch.exp(g[t].float())[:, None, None]
        vn = v[t].float() - torch.einsum("hk,hkv->hv", kk[t], S)
        S = S + torch.einsum("hk,hv->hkv", kk[t], vn * beta[t].float()[:, None])
        out[t] = (torch.einsum("hk,hkv->hv", qq[t], S) * scale).to(v.dtype)
        ssm_state[idx] = S.transpose(-1, -2).to(ssm_state.dtype)
    return out


def naive_gdr(q, k, v, g, beta, S0, scale):
    """Token-by-token gated delta rule (checks the chunked references): q, k ``[T, HV, K]``
    (l2-normed), v ``[T, HV, V]``, g, beta ``[T, HV]``, state ``[HV, K, V]``."""
    torch = _torch()
    S, out = S0.float().clone(), []
    for t in range(q.shape[0]):
        S = S * torch.exp(g[t])[:, None, None]
        vn = v[t] - torch.einsum("hk,hkv->hv", k[t], S)
        S = S + torch.einsum("hk,hv->hkv", k[t], vn * beta[t][:, None])
        out.append(torch.einsum("hk,hkv->hv", q[t], S) * scale)
    return (torch.stack(out) if out else v.new_zeros((0, *v.shape[1:]), dtype=torch.float32)), S


def fused_gdn_gating_ref(A_log, a, b, dt_bias):
    torch = _torch()
    x = a.float() + dt_bias.float()
    sp = torch.where(x > 20.0, x, torch.log1p(torch.exp(x)))
    g = -torch.exp(A_log.float()) * sp
    return g.unsqueeze(0), torch.sigmoid(b.float()).to(b.dtype).unsqueeze(0)


def clear_ssm_states_ref(states, has_initial_state):
    states[~has_initial_state.to(states.device)] = 0


def _naive_rows(q, k, v, g, beta, states, bounds, scale):
    """Token-by-token gated delta rule per sequence: q, k [T, NK, K] (l2-normed), v [T, HV, V],
    g, beta [T, HV], states [N, HV, K, V] float32; returns o [T, HV, V], final [N, HV, K, V]."""
    torch = _torch()
    o = torch.zeros(q.shape[0], NV, v.shape[-1])
    finals = []
    for n, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
        out, S = naive_gdr(_kv_heads(q[s:e].float()), _kv_heads(k[s:e].float()), v[s:e].float(),
                           g[s:e].float(), beta[s:e].float(), states[n], scale)
        o[s:e] = out
        finals.append(S)
    return o, torch.stack(finals) if finals else states.new_zeros((0, *states.shape[1:]))


def fused_cann_ref(query, key, value, *, beta, initial_state, actual_seq_lengths, scale, g):
    """``torch_npu.npu_chunk_gated_delta_rule``: TND q, k [T, NK, K] (l2-normed by the caller),
    v [T, HV, V], beta [T, HV] bf16, g [T, HV] float32, initial_state [N, HV, V, K] bf16,
    actual_seq_lengths int32 [N]; returns o [T, HV, V] bf16 and final_state [N, HV, V, K] bf16 (a
    zero-length sequence keeps its initial state: assumed, the op's documentation is silent)."""
    torch = _torch()
    assert initial_state.dtype == torch.bfloat16 and g.dtype == torch.float32, "op contract"
    assert query.dim() == 3 and actual_seq_lengths.dtype == torch.int32, "TND layout"
    bounds = [0, *torch.cumsum(actual_seq_lengths, 0).tolist()]
    assert bounds[-1] == query.shape[0], (bounds, query.shape)
    o, final = _naive_rows(query, key, value, g, beta,
                           initial_state.float().transpose(-1, -2), bounds, scale)
    return o.to(torch.bfloat16), final.transpose(-1, -2).to(torch.bfloat16)


def fla_npu_fwd_ref(q, k, v, g, beta, initial_state=None, output_final_state=False,
                    chunk_size=None, cu_seqlens=None, chunk_indices=None, scale=None,
                    layout=None, use_exp2=False, use_qk_l2norm_in_kernel=False,
                    allow_neg_eigval=False, disable_recompute=False, state_v_first=True):
    """fla_npu's ``chunk_gated_delta_rule_fwd`` as A2's ``fla_gdn_prefill`` calls it: q, k
    [1, NK, T, K] and v [1, HV, T, V] (BNSD, q / k l2-normed), g, beta [1, T, HV], initial_state
    [N, HV, K, V] (``state_v_first=False``), host cu_seqlens; returns the output sequence-major
    [1, T, HV, V] (v's dtype) and the final state [N, HV, K, V] float32."""
    torch = _torch()
    assert layout == "BNSD" and chunk_size == CHUNK and not state_v_first, "call contract"
    assert not use_qk_l2norm_in_kernel and not use_exp2 and output_final_state
    bounds = list(cu_seqlens)
    o, final = _naive_rows(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1),
                           g[0], beta[0], initial_state.float(), bounds, scale)
    return o.unsqueeze(0).to(v.dtype), final, None


def gather_ssm_states_ref(state, indices, has_initial_state, *, output_dtype=None):
    out = state[indices].to(output_dtype or state.dtype)
    out[~has_initial_state] = 0
    return out


def scatter_ssm_states_ref(state, indices, source):
    state[indices] = source.to(state.dtype)


# --------------------------------------------------------------------------- environment
#: kernel calls by kind: the three prefill paths' ops, and the speculative rows' conv update and
#: recurrence (:func:`causal_conv1d_update_ref`, :func:`recurrent_gdr_spec_ref`)
CALLS = {"fused_cann": 0, "fla_npu": 0, "ascendc_fwd_h": 0, "spec_conv": 0, "spec_recurrent": 0}


def _counting(name, fn):
    def wrapper(*a, **k):
        CALLS[name] += 1
        return fn(*a, **k)

    return wrapper


def neutralize_cpu_guard(cls) -> None:
    """Compile ``cls._forward_core`` from vllm-ascend's source with its one CPU guard of the fused
    CANN path (``query_non_spec.device.type != "cpu"``) as ``True`` (same file, same lines)."""
    fn = cls.__dict__["_forward_core"]
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    found = []

    class Guard(ast.NodeTransformer):
        def visit_Compare(self, node):
            if ast.unparse(node) == "query_non_spec.device.type != 'cpu'":
                found.append(node.lineno)
                return ast.copy_location(ast.Constant(True), node)
            return self.generic_visit(node)

    tree = Guard().visit(tree)
    assert len(found) == 1, f"vllm-ascend's CPU guard of the fused path: {found} (changed?)"
    ast.increment_lineno(tree, fn.__code__.co_firstlineno - 1)
    namespace: dict = {}
    exec(compile(ast.fix_missing_locations(tree), inspect.getsourcefile(fn), "exec"),
         fn.__globals__, namespace)
    new = namespace["_forward_core"]
    new.__qualname__, new.__module__ = fn.__qualname__, fn.__module__
    cls._forward_core = new


def setup(fla_npu: bool):
    """Stubs, references and the plugin's registry; returns the imported vllm-ascend modules."""
    root = str(upstream.vllm_ascend_src(ASCEND))
    ascend_env.setup(root, "A2")
    import torch
    import torch_npu

    # dtype constants vllm_ascend/quantization/utils.py reads at import (device_op imports it)
    for name in ("float4_e2m1fn_x2", "hifloat8", "float8_e8m0fnu"):
        setattr(torch_npu, name, torch.uint8)
    torch_npu.npu_chunk_gated_delta_rule = _counting("fused_cann", fused_cann_ref)
    for name in ("fla_npu", "fla_npu.ops", "fla_npu.ops.ascendc"):
        mod = types.ModuleType(name)
        mod.__path__ = []
        sys.modules[name] = mod
    asc = sys.modules["fla_npu.ops.ascendc"]
    asc.causal_conv1d_fn = causal_conv1d_fn_ref
    asc.causal_conv1d_update = _counting("spec_conv", causal_conv1d_update_ref)
    asc.recurrent_gated_delta_rule = recurrent_gdr_ref
    if fla_npu:
        asc.chunk_gated_delta_rule_fwd = _counting("fla_npu", fla_npu_fwd_ref)
    lib = torch.library.Library("_C_ascend", "DEF")
    lib.define(
        "chunk_gated_delta_rule_fwd_h_vllm(Tensor k, Tensor w, Tensor u, Tensor? g=None, *, "
        "Tensor? gk=None, Tensor? initial_state=None, bool? output_final_state=False, "
        "int? chunk_size=None, bool? save_new_value=True, int[]? cu_seqlens=None, "
        "int[]? chunk_indices=None, bool? use_exp2=False, bool? transpose_state_layout=False) -> "
        "(Tensor h_out, Tensor v_new_out, Tensor final_state_out)")
    lib.impl("chunk_gated_delta_rule_fwd_h_vllm", _counting("ascendc_fwd_h", fwd_h_ref), "CPU")
    lib.define(
        "chunk_fwd_o_vllm(Tensor q, Tensor k, Tensor v, Tensor h, float scale, *, Tensor? g=None, "
        "Tensor? g_gamma=None, int[]? cu_seqlens=None, int[]? chunk_indices=None, "
        "int? chunk_size=None, bool? transpose_state_layout=False) -> Tensor")
    lib.impl("chunk_fwd_o_vllm", fwd_o_ref, "CPU")
    setup.lib = lib  # keep the registrations alive
    from vllm.distributed import parallel_state

    parallel_state._PCP = types.SimpleNamespace(world_size=1, rank_in_group=0)
    # vllm-ascend's BlockTable.__init__ asks the DCP group its size (a world of one)
    parallel_state._DCP = types.SimpleNamespace(world_size=1, rank_in_group=0)

    from vllm_hybrid_npu.patches import apply_patches, registry
    from vllm_hybrid_npu.support import Stack

    stack = Stack("npu", "0.30.0", ASCEND)
    apply_patches("npu", stack)
    import vllm_ascend.device.device_op as device_op
    import vllm_ascend.ops.gdn as gdn_mod
    import vllm_ascend.ops.gdn_attn_builder as builder_mod
    import vllm_ascend.ops.triton.fla.chunk as chunk_mod
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
        QwenGatedDeltaNetAttention,
    )

    # the forward with the CPU guard neutralized, then the registry applied to it
    registry.unapply_all()
    neutralize_cpu_guard(gdn_mod.AscendGatedDeltaNetAttention)
    report = apply_patches("npu", stack)
    # vllm_ascend/patch/worker/patch_qwen3_5.py (A2 branch):
    #   _GDN_PATCH_TARGET._forward_core = AscendGatedDeltaNetAttention._forward_core
    QwenGatedDeltaNetAttention._forward_core = gdn_mod.AscendGatedDeltaNetAttention._forward_core
    for name, fn in (("chunk_local_cumsum", chunk_local_cumsum_ref),
                     ("chunk_scaled_dot_kkt_fwd", chunk_scaled_dot_kkt_ref),
                     ("solve_tril", solve_tril_ref), ("recompute_w_u_fwd", recompute_w_u_ref),
                     ("l2norm_fwd", l2norm_ref)):
        assert hasattr(chunk_mod, name), name
        setattr(chunk_mod, name, fn)
    for name, fn in (("l2norm_fwd", l2norm_ref), ("clear_ssm_states", clear_ssm_states_ref),
                     ("gather_ssm_states", gather_ssm_states_ref),
                     ("scatter_ssm_states_", scatter_ssm_states_ref)):
        assert hasattr(gdn_mod, name), name
        setattr(gdn_mod, name, fn)
    device_op.l2norm_fwd = l2norm_ref

    class ReplayOperator(gdn_mod.DeviceOperator):  # vllm-ascend's (A2), its Triton gating replaced
        fused_gdn_gating = staticmethod(fused_gdn_gating_ref)

    gdn_mod.DeviceOperator = ReplayOperator
    # input_guard (chunk.py) enters torch.npu.device(index); set after the imports (transformers
    # reads torch.npu.is_available() when it finds the attribute)
    torch.npu = types.SimpleNamespace(device=lambda index=None: contextlib.nullcontext(),
                                      is_available=lambda: False)
    return report, gdn_mod, builder_mod, QwenGatedDeltaNetAttention


# --------------------------------------------------------------------------- replay
def make_layer(qwen_cls, gen):
    torch = _torch()
    layer = object.__new__(qwen_cls)
    torch.nn.Module.__init__(layer)
    conv = torch.nn.Module()
    weight = (torch.randn(CONV_DIM, 1, WIDTH, generator=gen) * 0.5).to(torch.bfloat16)
    conv.weight = torch.nn.Parameter(weight, requires_grad=False)
    conv.bias = None
    conv.ascend_conv1d_weight = torch.nn.Parameter(
        weight.view(CONV_DIM, WIDTH).t().contiguous(), requires_grad=False)
    layer.conv1d = conv
    layer.prefix, layer.activation, layer.num_spec, layer.tp_size = PREFIX, "silu", 0, 1
    layer.num_k_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim = NK, NV, DK, DV
    layer.key_dim, layer.value_dim, layer.conv_kernel_size = NK * DK, NV * DV, WIDTH
    layer.A_log = torch.randn(NV, generator=gen) * 0.5 - 3.0  # decay ~ 0.1 over a 64-token chunk
    layer.dt_bias = torch.randn(NV, generator=gen) * 0.1
    return layer


def mtp_config(k):
    """vLLM 0.30's ``SpeculativeConfig`` as the plugin reads it: ``qwen3_next_mtp`` (rewritten to
    ``mtp``, an EAGLE drafter: its block drop) with ``k`` speculative tokens."""
    return types.SimpleNamespace(method="mtp", num_speculative_tokens=k, use_eagle=lambda: True,
                                 use_eagle_block_drop=lambda: True)


def vllm_config(pcp=1, ssm="auto", num_spec=0):
    """An engine configuration as the plugin reads it (a Qwen3-Next, align mode, bf16; with
    ``num_spec`` > 0 MTP with that many speculative tokens)."""
    torch = _torch()
    return types.SimpleNamespace(
        cache_config=types.SimpleNamespace(enable_prefix_caching=True, mamba_cache_mode="align",
                                           mamba_ssm_cache_dtype=ssm, prefix_match_unit=None),
        model_config=types.SimpleNamespace(
            dtype=torch.bfloat16, architecture="Qwen3NextForCausalLM",
            hf_config=types.SimpleNamespace(architectures=["Qwen3NextForCausalLM"]),
            hf_text_config=types.SimpleNamespace(linear_num_value_heads=NV)),
        parallel_config=types.SimpleNamespace(tensor_parallel_size=1,
                                              prefill_context_parallel_size=pcp),
        speculative_config=mtp_config(num_spec) if num_spec else None)


def make_builder(builder_mod, block_size, ssm_dtype, host, num_spec=0, graph=False):
    """vllm-ascend's builder as its fused backend picks it: the host-metadata one where a fused
    prefill op runs (``AscendGDNFusedAttentionBackend.get_builder_cls``). With ``num_spec`` > 0 as
    MTP builds it (``k`` speculative tokens: a conv state ``W - 1 + k`` wide, ``k`` speculative
    blocks, ``use_spec_decode``, the sequence-index buffers its ``__init__`` allocates); ``graph``:
    a full graph (``use_full_cuda_graph``)."""
    import torch
    from vllm.v1.kv_cache_interface import MambaSpec

    cls = (builder_mod.AscendGDNHostMetadataBuilder if host
           else builder_mod.AscendGDNAttentionMetadataBuilder)
    b = object.__new__(cls)
    b.kv_cache_spec = MambaSpec(
        block_size=block_size, shapes=((WIDTH - 1 + num_spec, CONV_DIM), (NV, DV, DK)),
        dtypes=(torch.bfloat16, ssm_dtype), mamba_cache_mode="align",
        num_speculative_blocks=num_spec, num_prefill_checkpoint_blocks=1,
        prefill_checkpoint_alignment=CHUNK)
    b.vllm_config = vllm_config(num_spec=num_spec)
    b.use_full_cuda_graph, b.use_spec_decode, b.num_spec = graph, num_spec > 0, num_spec
    b.decode_cudagraph_max_bs = 16
    if num_spec:  # AscendGDNAttentionMetadataBuilder.__init__'s buffers (capacity 16)
        for name, dtype in (("spec_sequence_masks", torch.bool), ("spec_sequence_masks_cpu", torch.bool),
                            ("spec_sequence_indices", torch.int64),
                            ("spec_sequence_indices_cpu", torch.int64),
                            ("non_spec_sequence_indices", torch.int64),
                            ("non_spec_sequence_indices_cpu", torch.int64)):
            setattr(b, name, torch.empty(16, dtype=dtype))
        b.spec_actual_seq_lengths = torch.empty(17, dtype=torch.int32)
        b.non_spec_actual_seq_lengths = torch.empty(17, dtype=torch.int32)
    return b


def common_metadata(rows, tables, decoding=(), padded=0):
    """``rows``: (context, query_len) per request (decodes first); ``decoding``: rows that are
    not prefilling (speculative decode rows); the last ``padded`` rows are full-graph padding
    (sequence length 0, their query span kept)."""
    import torch
    from vllm.v1.attention.backend import CommonAttentionMetadata

    qlens = [q for _, q in rows]
    qsl = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)
    seq = torch.tensor([c + q if r < len(rows) - padded else 0 for r, (c, q) in enumerate(rows)],
                       dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=seq,
        num_reqs=len(rows), num_actual_tokens=int(qsl[-1]), max_query_len=max(qlens),
        max_seq_len=int(seq.max()), block_table_tensor=tables,
        slot_mapping=torch.zeros(int(qsl[-1]), dtype=torch.int64),
        is_prefilling=torch.tensor([q > 1 and r not in decoding for r, q in enumerate(qlens)]),
        seq_lens_cpu_upper_bound=seq.clone())


@dataclasses.dataclass
class Spec:
    """A step's speculative decoding inputs (MTP, ``k`` tokens): per request the draft tokens
    (``k`` for a speculative decode row, -1 otherwise) and accepted tokens (1..k+1; 1 elsewhere),
    the rows the runner counts (``num_actual_reqs``), the last ``padded`` rows full-graph padding
    (counted in ``num_actual_reqs`` or not)."""
    drafts: list
    accepted: list
    num_actual_reqs: int
    padded: int = 0

    def kwargs(self):
        import torch

        return dict(num_accepted_tokens=torch.tensor(self.accepted, dtype=torch.int32),
                    num_decode_draft_tokens_cpu=torch.tensor(self.drafts, dtype=torch.int32),
                    num_actual_reqs=self.num_actual_reqs)

    def of(self, rows):
        """The same inputs for a step of ``rows`` (indices into this step's requests)."""
        return Spec([self.drafts[r] for r in rows], [self.accepted[r] for r in rows], len(rows))

    def decoding(self):
        return {r for r, d in enumerate(self.drafts) if d >= 0}


def run_step(layer, builder, rows, tables, inputs, caches, plan=True, override=None, reads=None,
             spec=None):
    """One step of ``rows`` over clones of ``caches``: ``(checkpoints, out, conv, ssm, calls)``
    (``calls``: kernel calls, by kind);
    ``plan=False`` drops the plugin's plan, ``override(checkpoints)`` replaces it; with ``reads``
    (a list) the metadata builder runs under :class:`HostReads` of ``tables``, its reads appended;
    ``spec`` (a :class:`Spec`): the step's speculative decoding inputs, as vllm-ascend's runner
    passes them to the builder."""
    import torch
    import vllm.forward_context as fc
    from vllm_hybrid_npu.patches.gdn_prefill_checkpoint import FIELD

    with HostReads(tables, reads) if reads is not None else contextlib.nullcontext():
        if spec is None:
            md = builder.build(0, common_metadata(rows, tables))
        else:
            md = builder.build(0, common_metadata(rows, tables, spec.decoding(), spec.padded),
                               **spec.kwargs())
    ck = getattr(md, FIELD, None)
    if not plan or override is not None:
        setattr(md, FIELD, None if not plan else override(ck))
    conv, ssm = caches[0].clone(), caches[1].clone()
    layer.kv_cache = (conv, ssm)
    mixed_qkv, b, a = inputs
    out = torch.zeros(mixed_qkv.shape[0], NV, DV, dtype=torch.bfloat16)
    fc._forward_context = types.SimpleNamespace(attn_metadata={PREFIX: md})
    before = dict(CALLS)
    try:
        layer._forward_core(mixed_qkv, b, a, out)
    finally:
        fc._forward_context = None
    return ck, out, conv, ssm, {k: CALLS[k] - before[k] for k in CALLS if CALLS[k] > before[k]}


def shifted(ck, builder):
    """The same checkpoint blocks with the checkpoints planned one chunk earlier (or at half the
    offset), built as the plugin builds a plan: the control."""
    import torch
    from vllm_hybrid_npu.core.prefill_checkpoints import plan_step
    from vllm_hybrid_npu.ops import gdn_checkpoint as ops
    from vllm_hybrid_npu.patches.vllm_ascend_gdn import _kernel_meta

    p = ck.plan
    lens = [1] * p.num_decodes + [e - s for s, e in zip(p.head_bounds, p.head_bounds[1:])]
    for i, r in enumerate(p.rows):
        lens[r] += p.tail_bounds[i + 1] - p.tail_bounds[i]
    offsets, cols = [0] * len(lens), [-1] * len(lens)
    table = torch.zeros(len(lens), max(p.cols) + 1, dtype=torch.int32)
    for r, off, col, slot in zip(p.rows, p.offsets, p.cols, ck.slots.tolist()):
        offsets[r], cols[r] = (off - CHUNK if off > CHUNK else off // 2), col
        table[r, col] = slot
    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    new = plan_step(qsl, offsets, cols, p.num_decodes)
    return ops.build_metadata(new, table, lambda v, d: torch.tensor(v, dtype=d), ck.method,
                              _kernel_meta(builder, torch.device("cpu")))


def draw(rng, gen, layer, builder_mod, path, ssm_dtype):
    """One random batch on ``path`` with an SSM cache of ``ssm_dtype``: the plan, no plan, the
    split's two steps and the control; the checks of the module docstring."""
    import torch

    block = rng.choice([64, 128])
    builder = make_builder(builder_mod, block, ssm_dtype, host=path != "chunk")
    while True:
        rows = [(rng.randint(1, 300), 1)]  # a decode row
        for _ in range(rng.randint(2, 3)):
            ctx = rng.choice([0, 0, block * rng.randint(1, 3)])
            rows.append((ctx, rng.randint(2, 5 * block)))
        # the split's second step must hold a prefill row: a row whose checkpoint (its last
        # block boundary, strictly inside it) leaves two tokens or more. vllm-ascend runs a step
        # of one-token tails only as decodes, which the replay's conv stub refuses (session seed
        # 43: block 64, rows (147, 1), (0, 51), (128, 257): the only tail is 1 token). By hand:
        if not any((c + q - 1) // block * block > c and (c + q) % block != 1 for c, q in rows[1:]):
            continue
        # align mode's tables: context, the prompt checkpoint's column where vLLM 0.30 reserves
        # one (hash block = block), the running column; every other column null (a real block
        # there would be a junction block the builder exports to)
        real = [None]
        for c, q in rows[1:]:
            cols = set(range(-(-c // block))) | {(c + q - 1) // block}
            P = (c + q - 1) // block * block
            if c % block == 0 and c + block <= P < c + q:
                cols.add(P // block - 1)
            real.append(cols)
        tables, nb = align_tables(real, max(-(-(c + q) // block) for c, q in rows) + 1)
        tables = torch.tensor(tables, dtype=torch.int32)
        from vllm_hybrid_npu.patches.gdn_prefill_checkpoint import FIELD

        if getattr(builder.build(0, common_metadata(rows, tables)), FIELD, None) is not None:
            break
    t = sum(q for _, q in rows)
    mixed_qkv = torch.randn(t, CONV_DIM, generator=gen).to(torch.bfloat16)
    b = torch.randn(t, NV, generator=gen).to(torch.bfloat16)
    a = torch.randn(t, NV, generator=gen).to(torch.bfloat16)
    conv0 = torch.randn(nb, WIDTH - 1, CONV_DIM, generator=gen).to(torch.bfloat16)
    ssm0 = (torch.randn(nb, NV, DV, DK, generator=gen) * 0.1).to(ssm_dtype)
    # a request with context: vLLM's align-mode copy (preprocess_mamba) has put the state after
    # its context into the block its step reads, column (seq_len - 1) // block; the split's first
    # step reads column (checkpoint - 1) // block: both get that state
    for r, (ctx, q) in enumerate(rows):
        if ctx:
            src = tables[r, (ctx - 1) // block]
            dst = [blk for blk in tables[r, (ctx - 1) // block:].tolist() if blk]
            conv0[dst] = conv0[src].clone()
            ssm0[dst] = ssm0[src].clone()
    caches, inputs = (conv0, ssm0), (mixed_qkv, b, a)
    _, out_n, conv_n, ssm_n, calls_n = run_step(layer, builder, rows, tables, inputs, caches, False)
    ck, out_p, conv_p, ssm_p, calls_p = run_step(layer, builder, rows, tables, inputs, caches)
    plan = ck.plan
    qsl = [0, *torch.tensor([q for _, q in rows]).cumsum(0).tolist()]
    offset = dict(zip(plan.rows, plan.offsets))
    # vLLM's split, first step: every checkpointed request stops at its checkpoint
    first = [(c, offset.get(r, q)) for r, (c, q) in enumerate(rows)]
    idx = torch.tensor([tok for r, (c, n) in enumerate(first) for tok in range(qsl[r], qsl[r] + n)])
    _, _, conv_1, ssm_1, _ = run_step(layer, builder, first, tables,
                                      tuple(x[idx] for x in inputs), caches, False)
    # its second step: the rest, from the running state align mode copies into the row's block
    conv_m, ssm_m = conv_1.clone(), ssm_1.clone()
    second, tail_idx, finals, running = [], [], [], []
    for r in plan.rows:
        ctx, q = rows[r]
        run_b = tables[r, (ctx + offset[r] - 1) // block]
        fin_b = tables[r, (ctx + q - 1) // block]
        conv_m[fin_b], ssm_m[fin_b] = conv_1[run_b], ssm_1[run_b]
        second.append((ctx + offset[r], q - offset[r]))
        tail_idx.extend(range(qsl[r] + offset[r], qsl[r + 1]))
        running.append(run_b.item())
        finals.append(fin_b.item())
    tail_idx = torch.tensor(tail_idx)
    _, out_2, conv_2, ssm_2, _ = run_step(layer, builder, second, tables[list(plan.rows)],
                                          tuple(x[tail_idx] for x in inputs), (conv_m, ssm_m), False)
    checks = []
    slots = ck.slots.tolist()
    for i, r in enumerate(plan.rows):
        slot, run_b = slots[i], running[i]
        checks.append({
            "row": r, "context": rows[r][0], "query_len": rows[r][1], "offset": offset[r],
            "checkpoint_block": slot, "split_block": run_b,
            "conv_equal": bool(torch.equal(conv_p[slot], conv_1[run_b])),
            "ssm_equal": bool(torch.equal(ssm_p[slot], ssm_1[run_b])),
            "block_differed_before": bool(not torch.equal(conv0[slot], conv_1[run_b])
                                          and not torch.equal(ssm0[slot], ssm_1[run_b])),
        })
    want_out = out_n.clone()
    want_out[tail_idx] = out_2
    want_conv, want_ssm = conv_n.clone(), ssm_n.clone()
    for slot, run_b, fin_b in zip(slots, running, finals):
        want_conv[slot], want_ssm[slot] = conv_1[run_b], ssm_1[run_b]
        want_conv[fin_b], want_ssm[fin_b] = conv_2[fin_b], ssm_2[fin_b]
    # a one-token tail is a decode in the split's second step (vllm-ascend's builder:
    # _treat_single_token_prefills_with_state_as_decodes): the recurrent kernel there, the chunk
    # kernel in the exporter's step, from the same state; compared apart, with a tolerance
    single, same = [], torch.ones(t, dtype=torch.bool)
    for r, fin_b in zip(plan.rows, finals):
        if rows[r][1] - offset[r] == 1:
            tok = qsl[r + 1] - 1
            same[tok] = False
            single.append({"row": r, "output_diff": float((out_p[tok].float() - want_out[tok].float()).abs().max()),
                           "output_scale": float(want_out[tok].float().abs().max()),
                           "state_diff": float((ssm_p[fin_b].float() - want_ssm[fin_b].float()).abs().max()),
                           "state_scale": float(want_ssm[fin_b].float().abs().max())})
            want_out[tok], want_ssm[fin_b] = out_p[tok], ssm_p[fin_b]
    _, _, _, ssm_c, _ = run_step(layer, builder, rows, tables, inputs, caches,
                                  override=lambda c: shifted(c, builder))
    return {
        "block_size": block, "rows": rows, "tokens": t, "checkpoints": checks,
        "vllm_ascend_choice": sorted(calls_n), "kernel_calls": [calls_n, calls_p],
        "single_token_tails": single,
        "outputs_equal": bool(torch.equal(out_p, want_out)),
        "caches_equal": bool(torch.equal(conv_p, want_conv) and torch.equal(ssm_p, want_ssm)),
        "tail_max_diff_vs_no_plan": float((out_p[tail_idx].float() - out_n[tail_idx].float()).abs().max()),
        "control_shifted_caught": all(not torch.equal(ssm_c[s], ssm_1[rb])
                                      for s, rb in zip(slots, running)),
        "tail_share": plan.tail_bounds[-1] / plan.num_prefill_tokens,  # the second call's tokens
    }


# --------------------------------------------------------------------------- MTP (issue 58)
def spec_rows(rng, block, k):
    """A batch under MTP with ``k`` speculative tokens: ``(context, query_len, speculative?)`` per
    request, in batch order. Two or three prefill rows (query 2 to ``5 * block`` tokens, context
    0 or whole blocks) and one 1-token non-speculative row (a prefill in vllm-ascend's step: it
    folds such rows into its prefills beside speculative rows), shuffled; speculative decode rows
    (``k + 1`` tokens, context 1-300) first, between two prefill rows, and up to two more
    anywhere."""
    rows = [(rng.choice([0, 0, block * rng.randint(1, 3)]), rng.randint(2, 5 * block), False)
            for _ in range(rng.randint(2, 3))]
    rows.append((rng.choice([0, rng.randint(1, 300)]), 1, False))
    rng.shuffle(rows)
    prefill = [i for i, (_, q, _) in enumerate(rows) if q > 1]

    def spec_row():
        return (rng.randint(1, 300), k + 1, True)

    rows.insert(rng.randint(prefill[0] + 1, prefill[-1]), spec_row())  # after the first prefill
    rows.insert(0, spec_row())
    for _ in range(rng.randint(0, 2)):
        rows.insert(rng.randint(0, len(rows)), spec_row())
    return rows


def spec_draw(rng, gen, layer, builder_mod, path, ssm_dtype, graph=False):
    """One random batch under MTP (:func:`spec_rows`; ``k`` drawn from 1-3, a conv state
    ``W - 1 + k`` wide, ``use_spec_decode``, vLLM's EAGLE block drop) on ``path`` with an SSM cache
    of ``ssm_dtype``; ``graph``: a full graph with one or two padded suffix rows (sequence length
    0, a ``k + 1`` token span: FIA's padding, which vllm-ascend's builder zero-lengths), counted in
    ``num_actual_reqs`` or not (then vllm-ascend also cuts them). From the same caches: the step with the plugin's plan, without it, and
    vLLM's split (a first step with the same rows, every checkpointed row stopped at its
    checkpoint; a second with the speculative rows and the checkpointed rows' rest, from the
    running state align mode copies into each such row's final block); controls: the conv rows
    taken in batch order (the forward without ``non_spec_token_indx``), the plan one chunk
    earlier, and (full graph) the plan of the unnormalised rows (padded spans kept). The
    speculative rows run in both split steps (they fold the non-speculative 1-token rows into
    prefills there too, as in the planned step); their own states are compared with and without
    the plan only."""
    import torch
    from vllm.v1.kv_cache_interface import (
        get_mamba_prefill_checkpoint_position,
        is_mamba_prefill_checkpoint_valid,
    )
    from vllm_hybrid_npu.ops import gdn_checkpoint as ops
    from vllm_hybrid_npu.patches import gdn_prefill_checkpoint as gpc
    from vllm_hybrid_npu.patches import registry
    from vllm_hybrid_npu.patches.vllm_ascend_gdn import _kernel_meta

    k, block = rng.choice([1, 2, 3]), rng.choice([64, 128])
    builder = make_builder(builder_mod, block, ssm_dtype, host=path != "chunk", num_spec=k,
                           graph=graph)
    layer.num_spec = k
    w1 = WIDTH - 1
    while True:
        drawn = spec_rows(rng, block, k)
        rows, is_spec = [(c, q) for c, q, _ in drawn], [x for _, _, x in drawn]
        n, pad = len(rows), rng.randint(1, 2) if graph else 0
        # the padded rows within num_actual_reqs (zero-length prefill rows then). Not on fla_npu
        # with a bf16 cache: vllm-ascend's scatter around empty segments there
        # (DeviceOperator.fla_gdn_prefill) puts the kernel's final state into a copy of the
        # initial state, so it needs the cache dtype, and this reference returns float32
        counted = graph and rng.random() < 0.5 and (path != "fla-npu" or ssm_dtype == torch.float32)
        spec = Spec([k if x else -1 for x in is_spec] + [-1] * pad,
                    [rng.randint(1, k + 1) if x else 1 for x in is_spec] + [1] * pad,
                    n + pad if counted else n, pad)
        all_rows = rows + [(0, k + 1)] * pad
        # align mode's tables, every column a block: the speculative gather reads k columns past
        # each row's running column
        tables, nb = align_tables([None] * len(all_rows),
                                  max((c + q - 1) // block for c, q in rows) + k + 1)
        tables = torch.tensor(tables, dtype=torch.int32)
        if getattr(builder.build(0, common_metadata(all_rows, tables, spec.decoding(), pad),
                                 **spec.kwargs()), gpc.FIELD, None) is not None:
            break
    t = sum(q for _, q in all_rows)
    qsl = [0, *torch.tensor([q for _, q in rows]).cumsum(0).tolist()]
    mixed_qkv = torch.randn(t, CONV_DIM, generator=gen).to(torch.bfloat16)
    b = torch.randn(t, NV, generator=gen).to(torch.bfloat16)
    a = torch.randn(t, NV, generator=gen).to(torch.bfloat16)
    conv0 = torch.randn(nb, w1 + k, CONV_DIM, generator=gen).to(torch.bfloat16)
    ssm0 = (torch.randn(nb, NV, DV, DK, generator=gen) * 0.1).to(ssm_dtype)
    for r, (ctx, q) in enumerate(rows):  # a prefill row's state after its context, where read
        if ctx and not is_spec[r]:
            src = tables[r, (ctx - 1) // block]
            dst = tables[r, (ctx - 1) // block:]
            conv0[dst], ssm0[dst] = conv0[src].clone(), ssm0[src].clone()
    caches, inputs = (conv0, ssm0), (mixed_qkv, b, a)

    def step(**kw):
        return run_step(layer, builder, all_rows, tables, inputs, caches, spec=spec, **kw)

    _, out_n, conv_n, ssm_n, calls_n = step(plan=False)
    ck, out_p, conv_p, ssm_p, calls_p = step()
    plan, slots = ck.plan, ck.slots.tolist()
    keep = [r for r in range(n) if not is_spec[r]]  # the plan's rows: the non-speculative ones
    offset = {keep[i]: o for i, o in zip(plan.rows, plan.offsets)}
    expected = {}
    for r in keep:  # vLLM's rule (EAGLE's block drop), by its own functions
        c, q = rows[r]
        pos = get_mamba_prefill_checkpoint_position(c + q, block, True)
        if q > 1 and is_mamba_prefill_checkpoint_valid(
                query_start=c, query_end=c + q, checkpoint_position=pos, hash_block_size=block,
                mamba_block_size=block, checkpoint_alignment=CHUNK):
            expected[r] = pos - c
    # vLLM's split, first step: the same rows, every checkpointed one stopped at its checkpoint
    first = [(c, offset.get(r, q)) for r, (c, q) in enumerate(rows)]
    idx = torch.tensor([tok for r, (_, m) in enumerate(first) for tok in range(qsl[r], qsl[r] + m)])
    _, _, conv_1, ssm_1, _ = run_step(layer, builder, first, tables[:n], tuple(x[idx] for x in inputs),
                                      caches, False, spec=spec.of(range(n)))
    # its second step: the speculative rows and the checkpointed rows' rest, from the running
    # state align mode copies into each checkpointed row's final block
    conv_m, ssm_m = conv_1.clone(), ssm_1.clone()
    running, finals = {}, {}
    for r, off in offset.items():
        ctx, q = rows[r]
        running[r] = int(tables[r, (ctx + off - 1) // block])
        finals[r] = int(tables[r, (ctx + q - 1) // block])
        conv_m[finals[r]], ssm_m[finals[r]] = conv_1[running[r]], ssm_1[running[r]]
    members = [r for r in range(n) if is_spec[r] or r in offset]
    second = [(rows[r][0] + offset[r], rows[r][1] - offset[r]) if r in offset else rows[r]
              for r in members]
    idx2 = [tok for r in members for tok in range(qsl[r] + offset.get(r, 0), qsl[r + 1])]
    _, out_2, conv_2, ssm_2, _ = run_step(layer, builder, second, tables[members],
                                          tuple(x[torch.tensor(idx2)] for x in inputs),
                                          (conv_m, ssm_m), False, spec=spec.of(members))
    tails = {tok for r in offset for tok in range(qsl[r] + offset[r], qsl[r + 1])}
    want_out = out_n.clone()
    for i, tok in enumerate(idx2):
        if tok in tails:
            want_out[tok] = out_2[i]
    want_conv, want_ssm = conv_n.clone(), ssm_n.clone()
    checks = []
    for i, pr in enumerate(plan.rows):
        r, slot = keep[pr], slots[i]
        run_b, fin_b = running[r], finals[r]
        checks.append({
            "row": r, "context": rows[r][0], "query_len": rows[r][1], "offset": offset[r],
            "checkpoint_block": slot, "split_block": run_b,
            "conv_equal": bool(torch.equal(conv_p[slot, :w1], conv_1[run_b, :w1])),
            "ssm_equal": bool(torch.equal(ssm_p[slot], ssm_1[run_b])),
            "spec_columns_kept": bool(torch.equal(conv_p[slot, w1:], conv0[slot, w1:])),
            "block_differed_before": bool(not torch.equal(conv0[slot, :w1], conv_1[run_b, :w1])
                                          and not torch.equal(ssm0[slot], ssm_1[run_b])),
        })
        want_conv[slot, :w1], want_ssm[slot] = conv_1[run_b, :w1], ssm_1[run_b]
        want_conv[fin_b, :w1], want_ssm[fin_b] = conv_2[fin_b, :w1], ssm_2[fin_b]
    spec_tok = torch.tensor([tok for r in range(n) if is_spec[r] for tok in range(qsl[r], qsl[r + 1])])
    spec_blocks = [int(tables[r, (c + q - 1) // block + j]) for r, (c, q) in enumerate(rows)
                   if is_spec[r] for j in range(k + 1)]

    def same_spec(conv, ssm):
        return all(torch.equal(conv[x], conv_n[x]) and torch.equal(ssm[x], ssm_n[x]) for x in spec_blocks)

    def exported(conv, ssm):  # every checkpoint block holds the split's bytes
        return all(torch.equal(conv[c["checkpoint_block"], :w1], conv_1[c["split_block"], :w1])
                   and torch.equal(ssm[c["checkpoint_block"]], ssm_1[c["split_block"]]) for c in checks)

    # control (a): the conv rows in batch order, as the forward took them before the spec map
    real = ops.write_conv
    ops.write_conv = lambda cache, x, md, width, dim_first, rows=None: real(cache, x, md, width, dim_first)
    try:
        _, _, conv_a, _, _ = step()
    finally:
        ops.write_conv = real
    # control (c): the plan one chunk earlier
    _, _, _, ssm_c, _ = step(override=lambda c: shifted(c, builder))
    # the plan's prefill rows and tokens against those vllm-ascend's prefill kernel gets
    raw, kwargs = common_metadata(all_rows, tables, spec.decoding(), pad), spec.kwargs()
    md0 = builder.build(0, raw, **kwargs)

    def layout(p):
        return [len(p.head_bounds) - 1, p.num_prefill_tokens]

    vllm_ascend_layout = [md0.prefill_query_start_loc.numel() - 1, int(md0.prefill_query_start_loc[-1])]
    control_graph = None
    if graph:  # control (d): the plan of the rows as the runner passed them (padded spans kept)
        bad = gpc.build_checkpoints(builder, raw, md0, registry.REPORT.stack, _kernel_meta,
                                    kwargs["num_decode_draft_tokens_cpu"])
        control_graph = {"plan_layout": layout(bad.plan), "raised": None, "bytes_differ": None}
        try:
            _, _, conv_d, ssm_d, _ = step(override=lambda _: bad)
            control_graph["bytes_differ"] = not exported(conv_d, ssm_d)
        except (RuntimeError, IndexError, AssertionError) as exc:  # the kernels' row counts
            control_graph["raised"] = f"{type(exc).__name__}: {exc}"[:300]
    layer.num_spec = 0
    return {
        "k": k, "block_size": block, "graph": graph, "padded_rows": pad,
        "padded_counted": counted, "rows": rows,
        "spec_rows": [r for r in range(n) if is_spec[r]], "accepted": spec.accepted[:n],
        "one_token_rows": [r for r in keep if rows[r][1] == 1],
        "planned": {str(r): o for r, o in offset.items()},
        "expected": {str(r): o for r, o in expected.items()},
        "checkpoints": checks,
        "vllm_ascend_choice": sorted(calls_n), "kernel_calls": [calls_n, calls_p],
        "outputs_equal": bool(torch.equal(out_p, want_out)),
        "caches_equal": bool(torch.equal(conv_p, want_conv) and torch.equal(ssm_p, want_ssm)),
        "spec_rows_equal": bool(torch.equal(out_p[spec_tok], out_n[spec_tok]) and same_spec(conv_p, ssm_p)),
        "spec_rows_ran": bool(any(not torch.equal(ssm_n[x], ssm0[x]) for x in spec_blocks)
                              and any(not torch.equal(conv_n[x], conv0[x]) for x in spec_blocks)),
        "control_batch_order_caught": all(
            not torch.equal(conv_a[c["checkpoint_block"], :w1], conv_1[c["split_block"], :w1])
            for c in checks),
        "control_shifted_caught": all(not torch.equal(ssm_c[c["checkpoint_block"]], ssm_1[c["split_block"]])
                                      for c in checks),
        "plan_layout": layout(getattr(md0, gpc.FIELD).plan), "vllm_ascend_layout": vllm_ascend_layout,
        "control_graph": control_graph,
    }


# --------------------------------------------------------------------------- junctions (issue 38)
#: Host reads of a tensor: what the builder must not do to the device block table.
HOST_READ_FUNCS = ("tolist", "item", "numpy", "cpu", "__bool__", "__int__", "__float__",
                   "__index__", "__array__", "__repr__", "__format__")


class HostReads:
    """A torch function mode recording every host read (:data:`HOST_READ_FUNCS`, ``to`` a CPU
    device) of a tensor whose storage is ``device_table``'s (a view of vllm-ascend's
    ``BlockTable.block_table.gpu``: the NPU's memory in a real runner) into ``reads``."""

    def __init__(self, device_table, reads):
        import torch

        self.ptr, self.reads = device_table.untyped_storage().data_ptr(), reads
        self.mode = type("_Mode", (torch.overrides.TorchFunctionMode,), {
            "__torch_function__": lambda mode, func, types_, args=(), kwargs=None:
                self._seen(func, args, kwargs or {})})()

    def _seen(self, func, args, kwargs):
        import torch

        name = getattr(func, "__name__", str(func))
        to_host = name == "to" and any(
            str(a) == "cpu" for a in (*args[1:], kwargs.get("device")) if isinstance(a, (str, torch.device)))
        if (name in HOST_READ_FUNCS or to_host) and any(
                isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() == self.ptr for a in args):
            self.reads.append(name)
        return func(*args, **kwargs)

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)


def junction_rows(rng, block):
    """A batch for the junction draw: a decode row first, then 2-4 prefill rows, two or more of
    them with a shared-prefix junction block (one or two) before the prompt's own checkpoint.
    Per row ``(context, query_len, cuts, table)``: ``cuts`` the checkpoints the batch is built
    to have, ``(offset from the row's start, block-table column)`` sorted; ``table`` the row's
    block-table columns as vLLM 0.30's align mode leaves them (0: the null block) plus the blocks
    the junction entries reserve. By construction (vLLM 0.30's rule, hash block = block): a row
    starting on the grid at ``c`` has its prompt checkpoint at ``P = (c + q - 1) // block * block``
    (valid: ``P >= c + block``) in column ``P // block - 1``, its junctions at block boundaries
    strictly between ``c`` and ``P`` in columns ``jf // block - 1``, every other column from
    ``c // block`` up to its running column ``(c + q - 1) // block`` null; a row started mid-block
    (``c = 128 a + 64``, block 128: a chunk the budget rule ended on the 64-token grid) has no
    valid prompt checkpoint, the boundary ``b1`` it crosses goes to its initial state's column
    ``a``, and a later boundary reserved by the allocate entry (``core.crossed_checkpoint``) to
    its own column. Every segment between cuts and after the last one is 2 tokens or more (no
    one-token tail: vllm-ascend makes that a decode in the split's step). The first junction row
    has a null column between ``c`` and ``P`` (the builder must skip it)."""
    rows = [(rng.randint(1, 300), 1, [], None)]  # a decode row (its table filled below)
    kinds = ["junction", "junction"] + rng.sample(
        ["junction", "plain", "none"] + (["crossing"] if block == 128 else []), rng.randint(0, 2))
    rng.shuffle(kinds)
    first = True  # the first junction row leaves a null column between c and P (two blocks more)
    for kind in kinds:
        if kind == "crossing":
            a = rng.randint(0, 2)
            c, b1 = 128 * a + 64, 128 * (a + 1)
            cuts = [(b1 - c, a)]
            if rng.random() < 0.5:
                p = b1 + 128 * rng.randint(1, 2)
                cuts.append((p - c, p // 128 - 1))
                end = p + rng.randint(2, 128)
            else:
                end = b1 + rng.randint(2, 3 * 128)
        else:
            c = block * rng.randint(0, 2)
            junctions = {"junction": rng.randint(1, 2), "plain": 0, "none": 0}[kind]
            if kind == "none":  # ends within the next block: no checkpoint, no column to look in
                end = c + rng.randint(2, block)
                cuts = []
            else:
                big = rng.randint(junctions + (2 if first and junctions else 1), junctions + 3)
                first = first and not junctions  # big: blocks from c to P
                P = c + block * big
                inner = sorted(rng.sample(range(1, big), junctions))
                cuts = [(block * i, (c + block * i) // block - 1) for i in inner]
                cuts.append((P - c, P // block - 1))
                end = P + rng.randint(2, block)
        rows.append((c, end - c, cuts, None))
    return rows


def second_rows(rng, block=128):
    """A batch for the second-checkpoint draw (``--prefix-match-unit 64``, block 128; issue 38
    item 3, :mod:`vllm_hybrid_npu.patches.gdn_second_checkpoint`): a decode row first, then two
    or three rows whose prompt checkpoint ``cp = (L - 1) // 64 * 64`` lies inside the prompt's
    last block, off the block grid (``cp = q + 64``, ``q`` that block's start, past the row's
    start ``c``), and maybe one whose checkpoint is on the grid (``plain``: no second block).
    Rows as :func:`junction_rows`'; a second row's cuts are ``q`` in the column vLLM 0.30
    reserves for ``cp`` (``q // block - 1``, keyed at ``q`` by the KV-cache manager) and ``cp``
    in the second block (column None here: the one column the builder appends). The first
    second row leaves a null column between ``c`` and ``q``. Every segment is 2 tokens or more."""
    rows = [(rng.randint(1, 300), 1, [], None)]  # a decode row
    kinds = ["second", "second"] + rng.sample(["second", "plain"], rng.randint(0, 2))
    rng.shuffle(kinds)
    first = True
    for kind in kinds:
        c = block * rng.randint(0, 2)
        big = rng.randint(2 if first and kind == "second" else 1, 3)  # blocks from c to q
        first = first and kind != "second"
        q = c + block * big
        if kind == "second":
            cuts = [(q - c, q // block - 1), (q + 64 - c, None)]
            end = q + 64 + rng.randint(2, 64)  # (end - 1) // 64 * 64 == q + 64
        else:
            cuts = [(q - c, q // block - 1)]
            end = q + rng.randint(2, 64)  # (end - 1) // 64 * 64 == q: on the block grid
        rows.append((c, end - c, cuts, None))
    return rows


def align_tables(real, width):
    """Block-table rows of ``width`` columns, ``real[r]`` the columns of row ``r`` holding a block
    (None: all), numbered from 1 in row order, every other column 0 (vLLM's null block); returns
    ``(rows, number of blocks)``."""
    out, nb = [], 1
    for cols in real:
        row = []
        for col in range(width):
            row.append(nb if cols is None or col in cols else 0)
            nb += row[-1] != 0
        out.append(row)
    return out, nb


def junction_tables(rows, block):
    """Each row's columns (see :func:`junction_rows`): context columns, the columns of its cuts,
    its running column real (the decode row: all real); every other column null."""
    return align_tables(
        [None] + [set(range(-(-c // block))) | {col for _, col in cuts} | {(c + q - 1) // block}
                  for c, q, cuts, _ in rows[1:]],
        max(-(-(c + q) // block) for c, q, _, _ in rows) + 1)


def junction_draw(rng, gen, layer, builder_mod, path, ssm_dtype, second=False):
    """One junction batch (:func:`junction_rows`) on ``path`` with an SSM cache of
    ``ssm_dtype``, the block table held by vllm-ascend's own ``BlockTable`` (host copy ``.cpu``,
    the "device" copy ``.gpu`` committed per step, handed to the builder as
    ``get_device_tensor()[:n]``): the one-pass step with the plugin's plan (the builder watched
    for host reads of the device table), the same step without it, and vLLM's ``K + 1``-step split
    (each step stops every row at its next cut; between steps align mode's copy of the running
    state into the block the next step reads), all from the same caches; a control plan one
    token earlier at every cut.

    Every planned step runs through the plugin's ``gdn-checkpoint-receive`` wrapper with a
    scheduler output carrying the engine's plan for the batch (``core.step_checkpoints``), for a
    runner whose attention group holds the builder. ``second``: a :func:`second_rows` batch at
    ``--prefix-match-unit 64`` instead, each second row's block a new block id outside the block
    table: the split stops at ``q`` and ``cp``
    and the second block must hold the state at ``cp``."""
    import torch
    from vllm_ascend.worker.block_table import BlockTable

    block = 128 if second else rng.choice([64, 128])
    builder = make_builder(builder_mod, block, ssm_dtype, host=path != "chunk")
    if second:
        builder.vllm_config.cache_config.prefix_match_unit = 64
    rows = (second_rows if second else junction_rows)(rng, block)
    table_rows, nb = junction_tables(rows, block)
    width = len(table_rows[0])
    # the second blocks: new ids after the table's, in one column past its width
    extra = {r: nb + i for i, r in enumerate(r for r, row in enumerate(rows) if any(
        col is None for _, col in row[2]))}
    rows = [(c, q, [(o, width if col is None else col) for o, col in cuts], t)
            for c, q, cuts, t in rows]
    ext_rows = [row + [extra.get(r, 0)] for r, row in enumerate(table_rows)]
    nb += len(extra)
    bt = BlockTable(block, len(rows), width, 1 << 14, False, torch.device("cpu"), kernel_sizes=[block])

    def device_table(step_rows):  # the runner: rows into the host table, committed, device view
        for i, r in enumerate(step_rows):
            bt.add_row(table_rows[r], i)
        bt.commit_block_table(len(step_rows))
        return bt.get_device_tensor()[:len(step_rows)]

    t = sum(q for _, q, _, _ in rows)
    qsl = [0]
    for _, q, _, _ in rows:
        qsl.append(qsl[-1] + q)
    mixed_qkv = torch.randn(t, CONV_DIM, generator=gen).to(torch.bfloat16)
    b = torch.randn(t, NV, generator=gen).to(torch.bfloat16)
    a = torch.randn(t, NV, generator=gen).to(torch.bfloat16)
    conv0 = torch.randn(nb, WIDTH - 1, CONV_DIM, generator=gen).to(torch.bfloat16)
    ssm0 = (torch.randn(nb, NV, DV, DK, generator=gen) * 0.1).to(ssm_dtype)
    # a row with context: the state after it is in its column (c - 1) // block (the last hit, or
    # the mid-block running block); align mode copies it into the block each step reads (that
    # step's running column): here, into every real column after it, once for all the runs
    for r, (c, q, _, _) in enumerate(rows):
        if c:
            src = table_rows[r][(c - 1) // block]
            for blk in table_rows[r][(c - 1) // block + 1:]:
                if blk:
                    conv0[blk], ssm0[blk] = conv0[src].clone(), ssm0[src].clone()
    caches, inputs = (conv0, ssm0), (mixed_qkv, b, a)
    everyone = list(range(len(rows)))
    step_rows = [(c, q) for c, q, _, _ in rows]
    _, out_n, conv_n, ssm_n, calls_n = run_step(layer, builder, step_rows, device_table(everyone),
                                                inputs, caches, False)
    reads = []
    dev = device_table(everyone)

    def planned_step():
        return run_step(layer, builder, step_rows, dev, inputs, caches, reads=reads)

    # the engine's plan (core.step_checkpoints on each row's block ids, with the checkpoint the
    # KV-cache manager reserved and a second block's id), held for the step by the plugin's runner
    # wrapper (gdn_step_checkpoints._make_receive) as vllm-ascend's execute_model gets it
    from vllm_hybrid_npu.core.prefill_checkpoints import step_checkpoints
    from vllm_hybrid_npu.patches import gdn_step_checkpoints as P

    sent = {}
    for r, (c, q, cuts, _) in enumerate(rows):
        if q < 2 or not cuts:
            continue
        if r in extra:  # q in its column, cp in the second block
            (_, col), (cp, _) = cuts
            found = step_checkpoints(c, c + q, block, (c + cp, col), table_rows[r], (extra[r], c + cp))
        elif c % block:  # started mid-block: no checkpoint of its own
            found = step_checkpoints(c, c + q, block, None, table_rows[r])
        else:
            found = step_checkpoints(c, c + q, block, (c + cuts[-1][0], cuts[-1][1]), table_rows[r])
        if found:
            sent[f"req-{r}"] = found
    runner = types.SimpleNamespace(
        attn_groups=[[types.SimpleNamespace(metadata_builders=[builder])]],
        input_batch=types.SimpleNamespace(req_ids=[f"req-{r}" for r in everyone]))
    receive = P._make_receive(lambda runner_, output_: planned_step(), None)
    ck, out_p, conv_p, ssm_p, calls_p = receive(runner, types.SimpleNamespace(**{P.ATTR: {0: sent}}))
    control_reads = []
    with HostReads(dev, control_reads):
        dev[0, :1].tolist()  # the recorder sees a host read of the device table
    # vLLM's split: step k runs each row's k-th segment (its edges: 0, the cuts, the row's end)
    edges = [[0, *(o for o, _ in cuts), q] for _, q, cuts, _ in rows]
    conv_s, ssm_s = conv0.clone(), ssm0.clone()
    want_out = out_n.clone()
    stored = {}  # (row, k) -> (conv, ssm) of the block the split leaves at the row's k-th cut
    for k in range(max(len(e) for e in edges) - 1):
        members = [r for r in everyone if len(edges[r]) - 1 > k]
        for r in members if k else ():  # align mode's copy into this step's running block
            c = rows[r][0]
            prev = table_rows[r][(c + edges[r][k] - 1) // block]
            run_b = table_rows[r][(c + edges[r][k + 1] - 1) // block]
            conv_s[run_b], ssm_s[run_b] = conv_s[prev].clone(), ssm_s[prev].clone()
        idx = torch.tensor([tok for r in members
                            for tok in range(qsl[r] + edges[r][k], qsl[r] + edges[r][k + 1])])
        seg = [(rows[r][0] + edges[r][k], edges[r][k + 1] - edges[r][k]) for r in members]
        _, out_k, conv_s, ssm_s, _ = run_step(layer, builder, seg, device_table(members),
                                              tuple(x[idx] for x in inputs), (conv_s, ssm_s), False)
        want_out[idx] = out_k
        for r in members:
            if k < len(edges[r]) - 2:  # the step stopped at a cut: its running block holds it
                blk = table_rows[r][(rows[r][0] + edges[r][k + 1] - 1) // block]
                stored[r, k] = (conv_s[blk].clone(), ssm_s[blk].clone())
    want_conv, want_ssm = conv_n.clone(), ssm_n.clone()
    checks = []
    for r, (c, q, cuts, _) in enumerate(rows):
        for k, (off, col) in enumerate(cuts):
            blk = ext_rows[r][col]
            conv_k, ssm_k = stored[r, k]
            want_conv[blk], want_ssm[blk] = conv_k, ssm_k
            checks.append({"row": r, "cut": k, "offset": off, "column": col, "block": blk,
                           "conv_equal": bool(torch.equal(conv_p[blk], conv_k)),
                           "ssm_equal": bool(torch.equal(ssm_p[blk], ssm_k)),
                           "block_differed_before": bool(not torch.equal(conv0[blk], conv_k)
                                                         and not torch.equal(ssm0[blk], ssm_k))})
        if cuts:  # the final running block: the split's last step
            fin = table_rows[r][(c + q - 1) // block]
            want_conv[fin], want_ssm[fin] = conv_s[fin], ssm_s[fin]
    # the control: every cut one token earlier, the same blocks (a plan as the plugin builds it)
    from vllm_hybrid_npu.core.prefill_checkpoints import plan_step
    from vllm_hybrid_npu.ops import gdn_checkpoint as ops
    from vllm_hybrid_npu.patches.vllm_ascend_gdn import _kernel_meta

    def earlier(_):
        offsets = [cuts[-1][0] - 1 if cuts else 0 for _, _, cuts, _ in rows]
        cols = [cuts[-1][1] if cuts else -1 for _, _, cuts, _ in rows]
        junctions = {r: [(o - 1, col) for o, col in cuts[:-1]] for r, (_, _, cuts, _) in enumerate(rows) if cuts}
        return ops.build_metadata(plan_step(qsl, offsets, cols, 1, junctions=junctions),
                                  torch.tensor(ext_rows, dtype=torch.int32),
                                  lambda v, d: torch.tensor(v, dtype=d), "split",
                                  _kernel_meta(builder, torch.device("cpu")))

    _, _, _, ssm_c, _ = run_step(layer, builder, step_rows, device_table(everyone), inputs, caches,
                                 override=earlier)
    plan, slots = ck.plan, ck.slots.tolist()
    return {
        "block_size": block, "rows": [[c, q] for c, q, _, _ in rows], "tokens": t,
        "tables": table_rows, "constructed": [[list(x) for x in cuts] for _, _, cuts, _ in rows],
        "constructed_blocks": [[[o, ext_rows[r][col]] for o, col in cuts]
                               for r, (_, _, cuts, _) in enumerate(rows)],
        "planned": [[[o, blk] for rr, o, blk in zip(plan.rows, plan.offsets, slots) if rr == r]
                    for r in everyone],
        "sent_rows": sorted(int(rid.split("-")[1]) for rid in sent),
        # null columns where the builder looks (from the row's start column to its checkpoint's,
        # or its running column's), by the construction
        "null_columns_looked_at": sum(
            1 for r, (c, q, cuts, _) in enumerate(rows) if r and q > 1
            for col in range(c // block, max(x for _, x in cuts if x < width)
                             if cuts and c % block == 0 else (c + q - 1) // block)
            if table_rows[r][col] == 0),
        "second_blocks": {str(r): blk for r, blk in extra.items()},
        "checkpoints": checks, "vllm_ascend_choice": sorted(calls_n),
        "kernel_calls": [calls_n, calls_p], "host_reads": reads, "host_read_control": control_reads,
        "outputs_equal": bool(torch.equal(out_p, want_out)),
        "caches_equal": bool(torch.equal(conv_p, want_conv) and torch.equal(ssm_p, want_ssm)),
        "control_caught": all(not torch.equal(ssm_c[x["block"]], stored[x["row"], x["cut"]][1])
                              for x in checks),
    }


def reference_check(gen):
    """The chunked references against the token-by-token rule (two sequences, one with state)."""
    import torch

    lens = [150, 70]
    t = sum(lens)
    q = l2norm_ref(torch.randn(1, t, NK, DK, generator=gen)).to(torch.bfloat16)
    k = l2norm_ref(torch.randn(1, t, NK, DK, generator=gen)).to(torch.bfloat16)
    v = torch.randn(1, t, NV, DV, generator=gen).to(torch.bfloat16)
    g = -torch.rand(1, t, NV, generator=gen) * 0.2
    beta = torch.rand(1, t, NV, generator=gen).to(torch.bfloat16)
    h0 = torch.randn(2, NV, DK, DV, generator=gen) * 0.1
    cu = [0, lens[0], t]
    gc = chunk_local_cumsum_ref(g, CHUNK, cu_seqlens=cu)
    A = solve_tril_ref(chunk_scaled_dot_kkt_ref(k, beta, gc, cu_seqlens=cu), cu_seqlens=cu,
                       output_dtype=torch.float32)
    w, u = recompute_w_u_ref(k.float(), v.float(), beta, A, gc.transpose(1, 2), cu_seqlens=cu)
    h, v_new, final = fwd_h_ref(k.float().transpose(1, 2), w.transpose(1, 2), u.transpose(1, 2),
                                g=gc.transpose(1, 2), initial_state=h0, chunk_size=CHUNK,
                                cu_seqlens=cu)
    o = fwd_o_ref(q.float().transpose(1, 2), k.float().transpose(1, 2), v_new, h, DK ** -0.5,
                  g=gc.transpose(1, 2), cu_seqlens=cu)
    worst_o = worst_s = 0.0
    for n, (s, e) in enumerate(zip(cu[:-1], cu[1:])):
        ref_o, ref_s = naive_gdr(_kv_heads(q[0, s:e].float()), _kv_heads(k[0, s:e].float()),
                                 v[0, s:e].float(), g[0, s:e], beta[0, s:e].float(), h0[n],
                                 DK ** -0.5)
        worst_o = max(worst_o, float((o[0, :, s:e].transpose(0, 1) - ref_o).abs().max()))
        worst_s = max(worst_s, float((final[n] - ref_s).abs().max()))
    return {"max_abs_diff_output": worst_o, "max_abs_diff_final_state": worst_s}


def path_checks(gdn_mod):
    """The plugin's NPU path decision under vllm-ascend's choices and configurations."""
    from vllm_hybrid_npu.patches import gdn_prefill_checkpoint as gpc

    cls = gdn_mod.AscendGatedDeltaNetAttention
    out = {"default": gpc.exporter_path(vllm_config(), "npu"),
           "mtp": gpc.exporter_path(vllm_config(num_spec=2), "npu"),
           "pcp2": gpc.exporter_path(vllm_config(pcp=2), "npu"),
           "ssm_float32": gpc.exporter_path(vllm_config(ssm="float32"), "npu")}
    saved = cls._fused_chunk_available
    cls._fused_chunk_available = True  # as if the smoke call of npu_chunk_gated_delta_rule passed
    try:
        out["fused_probe_passed"] = gpc.exporter_path(vllm_config(), "npu")
        out["mtp_fused_probe_passed"] = gpc.exporter_path(vllm_config(num_spec=2), "npu")
    finally:
        cls._fused_chunk_available = saved
    return {k: list(v) for k, v in out.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--draws", type=int, default=3, help="draws per path and SSM cache dtype")
    ap.add_argument("--junction-draws", type=int, default=1,
                    help="junction batches (several checkpoints per row) per path and dtype")
    ap.add_argument("--second-draws", type=int, default=1,
                    help="second-checkpoint batches (--prefix-match-unit 64) per path and dtype")
    ap.add_argument("--spec-draws", type=int, default=1,
                    help="MTP batches (speculative decode rows beside prefill rows) per path and "
                         "dtype; every second one under a full graph with padded rows")
    ap.add_argument("--paths", default="chunk,fused",
                    help="comma-separated from chunk, fused, fla-npu (fla-npu alone: the stub "
                         "package then has the fused op, which vllm-ascend prefers)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    paths = args.paths.split(",")
    result = {"seed": args.seed, "paths_run": paths, "error": None}
    try:
        if not set(paths) <= set(PATHS) or ("fla-npu" in paths and len(paths) > 1):
            raise ValueError(f"--paths {args.paths}: from {PATHS}, fla-npu alone")
        import torch

        torch.set_num_threads(1)
        report, gdn_mod, builder_mod, qwen_cls = setup("fla-npu" in paths)
        result["applied"] = list(report.applied)
        result["skipped"] = dict(report.skipped)
        result["failed"] = dict(report.failed)
        gen = torch.Generator().manual_seed(args.seed)
        rng = random.Random(args.seed)
        result["reference_check"] = reference_check(gen)
        layer = make_layer(qwen_cls, gen)
        cls = gdn_mod.AscendGatedDeltaNetAttention
        result["runs"] = {}
        for path in paths:
            cls._fused_chunk_available = path == "fused"
            from vllm_hybrid_npu.patches.gdn_prefill_checkpoint import exporter_path

            result["runs"][path] = {
                "plugin_path": list(exporter_path(vllm_config(), "npu")),
                "draws": {str(dt).replace("torch.", ""): [draw(rng, gen, layer, builder_mod, path, dt)
                                                          for _ in range(args.draws)]
                          for dt in (torch.bfloat16, torch.float32)},
                "junction_draws": {
                    str(dt).replace("torch.", ""): [junction_draw(rng, gen, layer, builder_mod, path, dt)
                                                    for _ in range(args.junction_draws)]
                    for dt in (torch.bfloat16, torch.float32)},
                "second_draws": {
                    str(dt).replace("torch.", ""): [
                        junction_draw(rng, gen, layer, builder_mod, path, dt, second=True)
                        for _ in range(args.second_draws)]
                    for dt in (torch.bfloat16, torch.float32)},
                "spec_draws": {
                    str(dt).replace("torch.", ""): [
                        spec_draw(rng, gen, layer, builder_mod, path, dt, graph=i % 2 == 1)
                        for i in range(args.spec_draws)]
                    for dt in (torch.bfloat16, torch.float32)},
            }
        cls._fused_chunk_available = False
        result["paths"] = path_checks(gdn_mod)
    except Exception:
        result["error"] = traceback.format_exc()
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
