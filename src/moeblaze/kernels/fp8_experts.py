"""The expert block's GEMMs under the rowwise FP8 recipe on the Triton kernels: the ops :class:`moeblaze.experts.
_Float8Experts` calls, with the signatures of their PyTorch emulation (:mod:`moeblaze.ops_fp8`).

F1, F2, B1 and B3 run the 16-bit path's gather-fused grouped GEMM (:func:`moeblaze.kernels.launch.grouped_gemm`)
on e4m3 operands with one fp32 scale per row of the activation operand and per weight row along the reduction
(``FP8`` of :func:`moeblaze.kernels.grouped_gemm.grouped_gemm_kernel`): the e4m3 tensor cores read both K-major,
so B1 and B3 take transposed e4m3 copies of the weights (``w2^T [E, h, d]``, ``w1^T [E, d, 2h|h]``), quantized
along their rows as :meth:`moeblaze.fp8.Float8Recipe.quantize_weight` does along ``reduce_cols=False``. The
activation backward, the router-weight gradient and the combine are the 16-bit path's kernels. The
weight-gradient GEMMs B2 and B4 (:func:`moeblaze.kernels.wgrad.grouped_wgrad_kernel`, ``FP8``) read the e4m3 rows
of ``dout`` (B1's operand) and of the kept ``x`` through the index as they are, their row scales folded into the
other operand (``w act``, ``dpre``), which is quantized per (expert, column) over the expert's slots; the tile's
sum is multiplied by those scales once.

Operands are quantized where this module needs them by one launch per tensor (:func:`quantize_rows`:
:mod:`moeblaze.kernels.fp8_quant`, bitwise the recipe's), not yet in the producing kernels' epilogues. Outputs are
in the 16-bit operands' dtype (``x``'s), weight gradients in ``dw_dtype``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..activations import DEFAULT_ACT, ActArgs
from ..dispatch import DispatchIndex
from ..fp8 import Float8Recipe, Float8Tensor
from . import experts as kx
from .fp8_gemm import down_forward_fp8, up_forward_fp8
from .fp8_quant import quantize_expert_columns_fp8, quantize_rows_fp8
from .launch import grouped_gemm, grouped_wgrad

__all__ = ["quantize_rows", "dequantize", "up_forward", "down_forward", "down_backward", "up_backward"]


def _check_rowwise(recipe: Float8Recipe) -> None:
    if recipe.granularity != "rowwise":
        raise NotImplementedError(f"fp8 on backend='triton' runs the rowwise recipe (Float8Recipe('rowwise')); "
                                  f"got {recipe.granularity!r}, whose backward kernels are not written "
                                  "(backend='torch' emulates it)")


def quantize_rows(recipe: Float8Recipe, t: Tensor) -> Float8Tensor:
    """``t [..., R, C]`` quantized with one scale per row (:meth:`moeblaze.fp8.Float8Recipe.quantize_rows` of the
    rowwise recipe): one launch of :func:`moeblaze.kernels.fp8_quant.quantize_rows_fp8` on CUDA, the recipe's
    PyTorch ops elsewhere (the CPU interpreter's e4m3 casts differ; DESIGN.md §7)."""
    return quantize_rows_fp8(t, recipe.pow2_scales) if t.is_cuda else recipe.quantize_rows(t)


DEQUANTIZE_ELEMENTS = 1 << 24  # fp32 products per block of :func:`dequantize` (64 MiB)


def dequantize(q: Float8Tensor, dtype: torch.dtype) -> Tensor:
    """The rowwise ``q [R, C]`` in ``dtype``: the fp32 products of :meth:`moeblaze.fp8.Float8Tensor.dequantize`,
    rounded, a block of rows at a time, so the backward's kept ``pre`` never has a whole fp32 copy (twice its
    16-bit size) at the backward's peak."""
    out = torch.empty(q.data.shape, dtype=dtype, device=q.data.device)
    step = max(1, DEQUANTIZE_ELEMENTS // max(1, q.data.shape[-1]))
    for r0 in range(0, q.data.shape[0], step):
        out[r0:r0 + step] = (q.data[r0:r0 + step].float() * q.scale[r0:r0 + step]).to(dtype)
    return out


def _expert_columns(recipe: Float8Recipe, slots: Tensor, rows: Float8Tensor, index: DispatchIndex):
    """The B operand of a weight-gradient GEMM whose A is the rowwise e4m3 ``rows`` read as they are: ``slots [N,
    Q]`` times the row scale of their token, quantized per (expert, column): ``(data [N, Q] e4m3, scale [E, Q])``.
    One launch on CUDA (:func:`moeblaze.kernels.fp8_quant.quantize_expert_columns_fp8`), PyTorch ops elsewhere."""
    offsets, indices, factor = index.local_offsets, index.expert_token_indices, rows.scale[:, 0]
    if slots.is_cuda:
        return quantize_expert_columns_fp8(slots, offsets, indices, factor, recipe.pow2_scales)
    q = recipe.quantize_slots(slots * factor.index_select(0, indices.long())[:, None], offsets)
    return q.data, q.scale[:offsets.numel() - 1]


def _k_major(recipe: Float8Recipe, w: Tensor) -> Float8Tensor:
    """``w [E, rows, cols]`` transposed to ``[E, cols, rows]`` (contiguous) and quantized along ``rows``: the
    K-major e4m3 weight of an input-gradient GEMM, one scale per column of ``w``."""
    return quantize_rows(recipe, w.transpose(1, 2))


def _sched(index: DispatchIndex) -> tuple[Tensor, Tensor, Tensor]:
    return kx._schedule(index)


def up_forward(recipe: Float8Recipe, xq: Float8Tensor, w1: Tensor, index: DispatchIndex, activation: str, *,
               store_act: bool = True, b1: Tensor | None = None,
               act_args: ActArgs = DEFAULT_ACT) -> tuple[Tensor, Tensor | None]:
    """F1 (:func:`moeblaze.ops_fp8.up_forward`): ``(pre [N, 2h|h], act [N, h] | None)`` in ``w1``'s dtype."""
    _check_rowwise(recipe)
    pre, act = up_forward_fp8(xq, quantize_rows(recipe, w1), index, activation,
                              store_act=store_act, out_dtype=w1.dtype, b1=b1, act_args=act_args)
    return pre, act


def down_forward(recipe: Float8Recipe, act: Tensor, w2: Tensor, topk_weights: Tensor, index: DispatchIndex, *,
                 b2: Tensor | None = None) -> Tensor:
    """F2-F3 (:func:`moeblaze.ops_fp8.down_forward`): ``out [T, d]`` in ``act``'s dtype."""
    _check_rowwise(recipe)
    return down_forward_fp8(quantize_rows(recipe, act), quantize_rows(recipe, w2), topk_weights, index, b2=b2,
                            out_dtype=act.dtype)


def down_backward(recipe: Float8Recipe, dout: Tensor, pre: Tensor, w2: Tensor, topk_weights: Tensor,
                  index: DispatchIndex, activation: str, need_dw: bool, need_dtw: bool, *, b2: Tensor | None = None,
                  act_args: ActArgs = DEFAULT_ACT,
                  dw_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """B1 in FP8 (``dact' = dout[token(s)] w2[e]``), then the 16-bit path's activation backward, ``dtopk_weights``
    and B2 (:func:`moeblaze.ops_fp8.down_backward`). ``pre [N, 2h|h]`` (unit column stride) is overwritten with
    ``dpre`` and returned: ``(dpre, dw2 | None, dtopk_weights | None)``."""
    _check_rowwise(recipe)
    dout = dout.contiguous()
    pre = pre.to(dout.dtype).contiguous()  # kept in e4m3: dequantized to fp32 by the caller
    d, h = w2.shape[1], w2.shape[2]
    gq, wq = quantize_rows(recipe, dout), _k_major(recipe, w2)
    dact = pre.new_empty(index.num_pairs, h)
    offsets, indices, sched = index.local_offsets, index.expert_token_indices, _sched(index)
    grouped_gemm(gq.data, wq.data, dact, offsets, indices, sched, b_nk=True, n_cols=h, k_dim=d, gather_a=True,
                 a_scale=gq.scale[:, 0], b_scale=wq.scale[..., 0])
    dtw = kx.act_bwd_dtw(dout, dact, pre, w2, b2, topk_weights, offsets, indices, index.token_index_map,
                         index.token_expert_indices, activation, *act_args, index.foreign_experts, need_dw, need_dtw,
                         index.is_general)
    dw2 = None
    if need_dw:  # B2 dW2[e] = sum_s dout[token(s)]^T (w act)[s], dact' now holding w act
        bq, bs = _expert_columns(recipe, dact, gq, index)
        flip = kx._stored_transposed(w2)  # [E, h, d] storage: the transposed products, viewed back as [E, d, h]
        dw2 = grouped_wgrad(gq.data, bq, offsets, indices, p=d, q=h, out_dtype=dw_dtype or w2.dtype, transpose=flip,
                            slot_desc=not index.foreign_experts, b_scale=bs)
        dw2 = dw2.transpose(1, 2) if flip else dw2
    return pre, dw2, (dtw if need_dtw else None)


def up_backward(recipe: Float8Recipe, dpre: Tensor, xq: Float8Tensor, w1: Tensor, index: DispatchIndex,
                need_dx: bool, need_dw: bool, *,
                dw_dtype: torch.dtype | None = None) -> tuple[Tensor | None, Tensor | None]:
    """B3 in FP8 with the B5 combine (``dx [T, d]`` in ``dpre``'s dtype) and B4 in 16 bits from the kept e4m3
    ``xq`` (:func:`moeblaze.ops_fp8.up_backward`): ``(dx | None, dw1 | None)``."""
    _check_rowwise(recipe)
    rows, d = w1.shape[1], w1.shape[2]
    T = xq.data.shape[0]
    offsets, indices, sched = index.local_offsets, index.expert_token_indices, _sched(index)
    dx = dw1 = None
    if need_dx:
        gq, wq = quantize_rows(recipe, dpre), _k_major(recipe, w1)
        scales = dict(a_scale=gq.scale[:, 0], b_scale=wq.scale[..., 0])
        if kx._tokens_pairs(index.token_index_map, index.pair_offsets)[1] == 1:  # K = 1: dx[token] directly
            dx = dpre.new_zeros(T, d) if index.foreign_experts else dpre.new_empty(T, d)
            if index.num_pairs:
                grouped_gemm(gq.data, wq.data, dx, offsets, indices, sched, b_nk=True, n_cols=d, k_dim=rows,
                             gather_a=False, scatter_c=True, **scales)
        else:
            dx = kx._gemm_gather_sum(gq.data, wq.data, True, rows, offsets, indices, sched, index.token_index_map,
                                     None, index.foreign_experts, index.pair_offsets, T, d, rows,
                                     out_dtype=dpre.dtype, **scales)
    if need_dw:  # B4 dW1[e]^T = sum_s x[token(s)]^T dpre[s] from the kept e4m3 x
        bq, bs = _expert_columns(recipe, dpre, xq, index)
        flip = kx._stored_transposed(w1)  # [E, d, rows] storage (GPT-OSS): the plain products, viewed back
        dw1 = grouped_wgrad(xq.data, bq, offsets, indices, p=d, q=rows, out_dtype=dw_dtype or w1.dtype,
                            transpose=not flip, slot_desc=not index.foreign_experts, b_scale=bs)
        dw1 = dw1.transpose(1, 2) if flip else dw1
    return dx, dw1
