"""The ``torch`` expert backend: the MoEBlaze dataflow (DESIGN.md §5, F1-F3 and B1-B5) in PyTorch.

The five expert ops of the backend contract (:mod:`moeblaze.backends`, where it is written), with its
semantics: the reference for the Triton backend and the path for CPUs and fp64.

Shapes: ``x [T, d]``, ``w1 [E, 2h | h, d]``, ``pre [N, 2h | h]``, ``act [N, h]``, ``w2 [E, d, h]``,
``topk_weights [T, K]``, ``out [T, d]``; all rows of ``[N, ...]`` tensors are *slots* (DESIGN.md §3).
Here the gathered rows are temporaries of one op (freed before it returns); the Triton backend
fuses the gather into its GEMM loads. On CUDA in bf16 with 8-aligned d and h, the grouped GEMMs go through
``torch.nn.functional.grouped_mm`` (no host sync; weight gradients over groups zero-padded to multiples of 8);
the other dtypes and the expert-bias gradients use a per-expert loop over the offsets (one host read of
``E+1`` ints), which refuses to run inside CUDA-graph capture.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .activations import DEFAULT_ACT, ActArgs, acc, activation_backward, activation_forward
from .dispatch import DispatchIndex
from .graphs import capturing
from .shared_ops import bias_dot, slot_weights


def _use_grouped_mm(a: torch.Tensor, w: torch.Tensor) -> bool:
    # grouped_mm needs CUDA, bf16 operands and 16-byte aligned strides (8 elements) in both inner
    # dimensions of a [N, in] and w [E, out, in] (w may arrive transposed).
    return (hasattr(F, "grouped_mm") and a.is_cuda and w.is_cuda and a.dtype == w.dtype == torch.bfloat16
            and a.shape[-1] % 8 == 0 and w.shape[-1] % 8 == 0 and w.shape[-2] % 8 == 0)


def _host_bounds(offsets: torch.Tensor, op: str) -> list[int]:
    """The offsets read on the host (one synchronisation) for a per-expert loop.

    Raises:
        RuntimeError: inside a CUDA-graph capture, where a host read would invalidate the capture.
    """
    if capturing(offsets):
        raise RuntimeError(f"backend='torch' {op} reads the expert offsets on the host (a per-expert loop) and "
                           "cannot run inside CUDA-graph capture; use backend='triton' (see moeblaze.graphs)")
    return offsets.tolist()


def grouped_linear(a: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Per expert e: ``a[off[e]:off[e+1]] @ w[e].T``. ``a [N, in]``, ``w [E, out, in]`` -> ``[N, out]``."""
    if _use_grouped_mm(a, w):
        return F.grouped_mm(a.contiguous(), w.transpose(-2, -1), offs=offsets[1:])
    out = a.new_empty(a.shape[0], w.shape[1])
    bounds = _host_bounds(offsets, "grouped GEMM off the grouped_mm path")
    for e in range(w.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            out[lo:hi] = a[lo:hi] @ w[e].t()
    return out


def _padded_weight_grad(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """:func:`grouped_weight_grad` as one ``grouped_mm`` over slot rows padded with zeros to a multiple of 8 per
    expert (``grouped_mm`` reduces over a grouped dimension only in such groups); ``[E, p, q]`` in ``a.dtype``,
    rounded once from fp32 sums. No host read (CUDA-graph capturable): the padded length ``N + 8E`` is a
    bound known on the host. Costs two ``[N + 8E, p + q]`` scatters next to the GEMM's ``2Npq`` FLOPs."""
    N, E = a.shape[0], offsets.numel() - 1
    counts = (offsets[1:] - offsets[:-1]).long()
    ends = ((counts + 7) // 8 * 8).cumsum(0)  # [E] padded group ends
    slot = torch.arange(N, device=a.device)
    expert = torch.searchsorted(offsets[1:].long(), slot, right=True).clamp_(max=E - 1)  # slot -> its expert
    dst = slot + (ends - (counts + 7) // 8 * 8 - offsets[:-1].long()).index_select(0, expert)
    rows = N + 8 * E
    # Slots past offsets[E] (an index's foreign bucket: never computed, may hold NaN) go to one extra row past
    # every group, which grouped_mm never reads; else they would land in the last expert's zero padding.
    dst = torch.where(slot < offsets[-1], dst, rows)
    pa, pb = a.new_zeros(rows + 1, a.shape[1]), b.new_zeros(rows + 1, b.shape[1])
    pa.index_copy_(0, dst, a)
    pb.index_copy_(0, dst, b)
    return F.grouped_mm(pa.t(), pb, offs=ends.to(torch.int32))


def grouped_weight_grad(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Per expert e: ``a[rows_e].T @ b[rows_e]``. ``a [N, p]``, ``b [N, q]`` -> ``[E, p, q]`` (fp32 accumulate;
    fp32, or ``a.dtype`` rounded once from fp32 sums on the ``grouped_mm`` path).

    On CUDA in bf16 with 8-aligned p and q: one ``grouped_mm`` over zero-padded groups (no host read, so it
    can be captured in a CUDA graph); elsewhere a per-expert loop over the offsets read on the host.
    """
    if (hasattr(F, "grouped_mm") and a.is_cuda and a.dtype == b.dtype == torch.bfloat16 and a.shape[1] % 8 == 0
            and b.shape[1] % 8 == 0):  # 16-byte aligned rows of both operands
        return _padded_weight_grad(a, b, offsets)
    E = offsets.numel() - 1
    out = torch.zeros(E, a.shape[1], b.shape[1], dtype=torch.promote_types(a.dtype, torch.float32),
                      device=a.device)
    bounds = _host_bounds(offsets, "weight gradient")
    for e in range(E):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            out[e] = a[lo:hi].t().to(out.dtype) @ b[lo:hi].to(out.dtype)
    return out


def slot_experts(index: DispatchIndex) -> torch.Tensor:
    """``[N]`` int64 expert of each slot (foreign slots: E - 1, a valid row of any ``[E, ...]`` table;
    their results are never used). No host synchronisation."""
    ids = index.token_expert_indices.reshape(-1).long().clamp(max=index.num_experts - 1)
    out = torch.empty_like(ids)
    out[index.token_index_map.reshape(-1).long()] = ids
    return out


def pair_tokens(index: DispatchIndex) -> torch.Tensor:
    """``[P]`` int32 token of each pair of a general index (``expert_token_indices[token_index_map]``)."""
    return index.expert_token_indices.index_select(0, index.token_index_map.reshape(-1).long())


def sum_pairs(v: Tensor, index: DispatchIndex) -> Tensor:
    """Per token, the sum of its pairs' rows in pair order: ``v [T, K, d]`` (top-k) or ``[P, d]`` (a general
    index) -> ``[T, d]``. A general index is laid out as ``[T, Kmax, d]`` with zero rows after each token's
    pairs (one host read of ``Kmax``) and summed as the top-k case, so ``P = T*K`` pairs sum bitwise alike. Pairs
    past ``pair_offsets[T]`` (token rounding's unused tail) belong to no token's sum."""
    if not index.is_general:
        return v.sum(1)
    T, off = index.num_tokens, index.pair_offsets
    kmax = int((off[1:] - off[:-1]).max()) if T else 0
    tok = pair_tokens(index).long()
    p = torch.arange(tok.numel(), device=v.device)
    pos = torch.where(p < off[-1], p - off[tok], kmax)  # the tail: a dummy column, left out of the sum
    padded = v.new_zeros(T, kmax + 1, v.shape[-1])
    padded[tok, pos] = v
    return padded[:, :kmax].sum(1)


def _local_pairs(index: DispatchIndex) -> torch.Tensor | None:
    """``[T, K, 1]`` bool, False for foreign pairs; None for an index without foreign experts."""
    if not index.foreign_experts:
        return None
    return (index.token_expert_indices < index.num_experts)[..., None]


def up_forward(x: Tensor, w1: Tensor, index: DispatchIndex, activation: str, store_pre: bool,
               store_act: bool, *, b1: Tensor | None = None,
               act_args: ActArgs = DEFAULT_ACT) -> tuple[Tensor | None, Tensor | None]:
    """F1: ``pre = x[token(s)] @ w1[e].T (+ b1[e])`` and ``act = f(pre)``."""
    xg = x.index_select(0, index.expert_token_indices.long())
    pre = grouped_linear(xg, w1, index.local_offsets)
    if b1 is not None:  # fp32 add, one rounding, as the kernels' epilogue
        pre = (acc(pre) + acc(b1).index_select(0, slot_experts(index))).to(pre.dtype)
    act = activation_forward(pre, activation, **act_args._asdict()) if store_act else None
    return (pre if store_pre else None), act


def up_backward(dpre: Tensor, x: Tensor, w1: Tensor, index: DispatchIndex, need_dx: bool,
                need_dw: bool, *, dw_dtype: torch.dtype | None = None) -> tuple[Tensor | None, Tensor | None]:
    """B3 ``dx_slots = dpre @ w1[e]``, B5 ``dx[t] = sum_k dx_slots[map[t,k]]``, B4 ``dw1[e] = dpre^T x[token]``
    (in ``w1.dtype``, returned in ``dw_dtype``, default ``w1.dtype``)."""
    dx = dw1 = None
    if need_dx:
        dx_slots = acc(grouped_linear(dpre, w1.transpose(-2, -1), index.local_offsets))[index.token_index_map.long()]
        local = _local_pairs(index)
        if local is not None:
            dx_slots = torch.where(local, dx_slots, 0.0)
        dx = sum_pairs(dx_slots, index).to(x.dtype)
    if need_dw:
        xg = x.index_select(0, index.expert_token_indices.long())
        dw1 = grouped_weight_grad(dpre, xg, index.local_offsets).to(w1.dtype).to(dw_dtype or w1.dtype)
    return dx, dw1


def down_forward(act: Tensor, w2: Tensor, topk_weights: Tensor, index: DispatchIndex, *,
                 b2: Tensor | None = None) -> Tensor:
    """F2 ``y = act @ w2[e].T (+ b2[e])`` and F3 ``out[t] = sum_k w[t,k] * y[map[t,k]]`` (fp32 gather-sum)."""
    y = grouped_linear(act, w2, index.local_offsets)
    if b2 is not None:
        y = (acc(y) + acc(b2).index_select(0, slot_experts(index))).to(y.dtype)
    yk = acc(y)[index.token_index_map.long()] * acc(topk_weights)[..., None]  # [T, K, d]
    local = _local_pairs(index)
    if local is not None:
        yk = torch.where(local, yk, 0.0)
    return sum_pairs(yk, index).to(act.dtype)


def down_backward(dout: Tensor, pre: Tensor, w2: Tensor, topk_weights: Tensor, index: DispatchIndex,
                  activation: str, need_dw: bool, need_dtw: bool, *, b2: Tensor | None = None,
                  act_args: ActArgs = DEFAULT_ACT,
                  dw_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """B1-B2 with the activation recomputed from ``pre``;
    ``dtopk_weights = <dout[t] w2[e], act> (+ <dout[t], b2[e]>)``; ``dw2`` as ``dw1`` of :func:`up_backward`."""
    tokens = index.expert_token_indices.long()
    offsets = index.local_offsets
    g = dout.index_select(0, tokens)  # [N, d]  dout of each slot's token
    dact_unscaled = grouped_linear(g, w2.transpose(-2, -1), offsets)  # [N, h]
    act = activation_forward(pre, activation, **act_args._asdict())  # recomputed, never stored
    w_slot = acc(slot_weights(topk_weights, index.token_index_map))
    dact_unscaled, act_acc = acc(dact_unscaled), acc(act)
    dtw = None
    if need_dtw:
        dw_slot = (dact_unscaled * act_acc).sum(-1)  # [N]
        dtw = dw_slot[index.token_index_map.long()]
        if index.foreign_experts:
            dtw = torch.where(_local_pairs(index)[..., 0], dtw, 0.0)
        if b2 is not None:
            tokens = pair_tokens(index) if index.is_general else None
            dtw = dtw + bias_dot(dout, b2, index.token_expert_indices, tokens)
        dtw = dtw.to(topk_weights.dtype)
    dact = (dact_unscaled * w_slot[:, None]).to(pre.dtype)
    dpre = activation_backward(dact, pre, activation, **act_args._asdict())
    dw2 = None
    if need_dw:
        w_act = (act_acc * w_slot[:, None]).to(act.dtype)
        dw2 = grouped_weight_grad(g, w_act, offsets).to(w2.dtype).to(dw_dtype or w2.dtype)
    return dpre, dw2, dtw


def bias_grad(src: Tensor, index: DispatchIndex, topk_weights: Tensor | None = None) -> Tensor:
    """Expert-bias gradients, per expert e a sum over its slots (foreign slots excluded), fp32 accumulate.

    ``topk_weights`` None: ``db_gate_up[e] = sum_s src[s]`` with ``src = dpre [N, 2h|h]``; else
    ``db_down[e] = sum_s w_s * src[token(s)]`` with ``src = dout [T, d]``. Returns ``[E, cols]`` in
    ``src.dtype``. A per-expert loop over the offsets (one host read of E+1 ints), deterministic.
    """
    rows = src
    if topk_weights is not None:
        w_slot = acc(slot_weights(topk_weights, index.token_index_map))
        rows = acc(src).index_select(0, index.expert_token_indices.long()) * w_slot[:, None]
    E = index.num_experts
    out = torch.zeros(E, src.shape[1], dtype=torch.promote_types(src.dtype, torch.float32), device=src.device)
    bounds = _host_bounds(index.local_offsets, "expert-bias gradient")
    for e in range(E):
        if bounds[e + 1] > bounds[e]:
            out[e] = acc(rows[bounds[e]:bounds[e + 1]]).sum(0)
    return out.to(src.dtype)
