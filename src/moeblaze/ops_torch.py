"""The ``torch`` expert backend: the MoEBlaze dataflow (DESIGN.md §5, F1-F3 and B1-B5) in PyTorch.

Four ops, the contract every backend implements (the Triton backend in ``kernels.experts`` too):

``up_forward(x, w1, index, activation, store_pre, store_act) -> (pre | None, act | None)``   F1
``up_backward(dpre, x, w1, index, need_dx, need_dw) -> (dx | None, dw1 | None)``            B3-B5
``down_forward(act, w2, topk_weights, index) -> out``                                       F2-F3
``down_backward(dout, pre, w2, topk_weights, index, activation, need_dw, need_dtw)
    -> (dpre, dw2 | None, dtopk_weights | None)``                                           B1-B2

``down_backward`` may return ``dpre`` in the storage of ``pre`` (the Triton op writes it in place, as
``pre`` is dead after B1; this one returns a new tensor): callers must not use ``pre`` afterwards.

Shapes: ``x [T, d]``, ``w1 [E, 2h | h, d]``, ``pre [N, 2h | h]``, ``act [N, h]``, ``w2 [E, d, h]``,
``topk_weights [T, K]``, ``out [T, d]``; all rows of ``[N, ...]`` tensors are *slots* (DESIGN.md §3).
Here the gathered rows are temporaries of one op (freed before it returns); the Triton backend
fuses the gather into its GEMM loads. On CUDA in bf16 with 8-aligned d and h, the forward and
data-gradient grouped GEMMs go through ``torch.nn.functional.grouped_mm`` (no host sync); weight
gradients and everything else use a per-expert loop over the offsets (one host read of ``E+1`` ints).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .activations import acc, activation_backward, activation_forward
from .dispatch import DispatchIndex


def _use_grouped_mm(a: torch.Tensor, w: torch.Tensor) -> bool:
    # grouped_mm needs CUDA, bf16 operands and 16-byte aligned strides (8 elements) in both inner
    # dimensions of a [N, in] and w [E, out, in] (w may arrive transposed).
    return (hasattr(F, "grouped_mm") and a.is_cuda and w.is_cuda and a.dtype == w.dtype == torch.bfloat16
            and a.shape[-1] % 8 == 0 and w.shape[-1] % 8 == 0 and w.shape[-2] % 8 == 0)


def grouped_linear(a: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Per expert e: ``a[off[e]:off[e+1]] @ w[e].T``. ``a [N, in]``, ``w [E, out, in]`` -> ``[N, out]``."""
    if _use_grouped_mm(a, w):
        return F.grouped_mm(a.contiguous(), w.transpose(-2, -1), offs=offsets[1:])
    out = a.new_empty(a.shape[0], w.shape[1])
    bounds = offsets.tolist()
    for e in range(w.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            out[lo:hi] = a[lo:hi] @ w[e].t()
    return out


def grouped_weight_grad(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Per expert e: ``a[rows_e].T @ b[rows_e]``. ``a [N, p]``, ``b [N, q]`` -> ``[E, p, q]`` (fp32 accumulate).

    Always the per-expert loop: ``grouped_mm`` would reduce over the slot dimension, which it only
    accepts when every expert's slot count is a multiple of 8 (a device-side assert otherwise).
    """
    E = offsets.numel() - 1
    out = torch.zeros(E, a.shape[1], b.shape[1], dtype=torch.promote_types(a.dtype, torch.float32),
                      device=a.device)
    bounds = offsets.tolist()
    for e in range(E):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            out[e] = a[lo:hi].t().to(out.dtype) @ b[lo:hi].to(out.dtype)
    return out


def slot_weights(topk_weights: torch.Tensor, token_index_map: torch.Tensor,
                 dtype: torch.dtype | None = None) -> torch.Tensor:
    """``w_slot [N]``: the router weight of each slot (scatter through the pair->slot permutation).

    Args:
        topk_weights: ``[T, K]`` float; token_index_map: ``[T, K]`` int32 pair -> slot.
        dtype: of the result (default: ``topk_weights.dtype``).
    """
    w = torch.empty(token_index_map.numel(), dtype=dtype or topk_weights.dtype, device=topk_weights.device)
    w[token_index_map.reshape(-1).long()] = topk_weights.reshape(-1).to(w.dtype)
    return w


def up_forward(x: Tensor, w1: Tensor, index: DispatchIndex, activation: str, store_pre: bool,
               store_act: bool) -> tuple[Tensor | None, Tensor | None]:
    """F1: ``pre = x[token(s)] @ w1[e].T`` and ``act = f(pre)``."""
    xg = x.index_select(0, index.expert_token_indices.long())
    pre = grouped_linear(xg, w1, index.expert_token_offsets)
    act = activation_forward(pre, activation) if store_act else None
    return (pre if store_pre else None), act


def up_backward(dpre: Tensor, x: Tensor, w1: Tensor, index: DispatchIndex, need_dx: bool,
                need_dw: bool) -> tuple[Tensor | None, Tensor | None]:
    """B3 ``dx_slots = dpre @ w1[e]``, B5 ``dx[t] = sum_k dx_slots[map[t,k]]``, B4 ``dw1[e] = dpre^T x[token]``."""
    dx = dw1 = None
    if need_dx:
        dx_slots = grouped_linear(dpre, w1.transpose(-2, -1), index.expert_token_offsets)
        dx = acc(dx_slots)[index.token_index_map.long()].sum(1).to(x.dtype)
    if need_dw:
        xg = x.index_select(0, index.expert_token_indices.long())
        dw1 = grouped_weight_grad(dpre, xg, index.expert_token_offsets).to(w1.dtype)
    return dx, dw1


def down_forward(act: Tensor, w2: Tensor, topk_weights: Tensor, index: DispatchIndex) -> Tensor:
    """F2 ``y = act @ w2[e].T`` and F3 ``out[t] = sum_k w[t,k] * y[map[t,k]]`` (fp32 gather-sum)."""
    y = grouped_linear(act, w2, index.expert_token_offsets)
    yk = acc(y)[index.token_index_map.long()]  # [T, K, d]
    out = (yk * acc(topk_weights)[..., None]).sum(1)
    return out.to(act.dtype)


def down_backward(dout: Tensor, pre: Tensor, w2: Tensor, topk_weights: Tensor, index: DispatchIndex,
                  activation: str, need_dw: bool,
                  need_dtw: bool) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """B1-B2 with the activation recomputed from ``pre``; ``dtopk_weights = <dout[t] w2[e], act>``."""
    tokens = index.expert_token_indices.long()
    g = dout.index_select(0, tokens)  # [N, d]  dout of each slot's token
    dact_unscaled = grouped_linear(g, w2.transpose(-2, -1), index.expert_token_offsets)  # [N, h]
    act = activation_forward(pre, activation)  # recomputed, never stored
    w_slot = acc(slot_weights(topk_weights, index.token_index_map))
    dact_unscaled, act_acc = acc(dact_unscaled), acc(act)
    dtw = None
    if need_dtw:
        dw_slot = (dact_unscaled * act_acc).sum(-1)  # [N]
        dtw = dw_slot[index.token_index_map.long()].to(topk_weights.dtype)
    dact = (dact_unscaled * w_slot[:, None]).to(pre.dtype)
    dpre = activation_backward(dact, pre, activation)
    dw2 = None
    if need_dw:
        w_act = (act_acc * w_slot[:, None]).to(act.dtype)
        dw2 = grouped_weight_grad(g, w_act, index.expert_token_offsets).to(w2.dtype)
    return dpre, dw2, dtw
