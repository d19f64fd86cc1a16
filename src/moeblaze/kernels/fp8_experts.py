"""The expert block's GEMMs under the rowwise FP8 recipe on the Triton kernels: the ops :class:`moeblaze.experts.
_Float8Experts` runs, with the signatures of their PyTorch emulation (:mod:`moeblaze.ops_fp8`); the recipe is
checked before, by :func:`moeblaze.fp8.check_fp8_backend`.

F1, F2, B1 and B3 run the 16-bit path's gather-fused grouped GEMM (:func:`moeblaze.kernels.launch.grouped_gemm`)
on e4m3 operands with one fp32 scale per row of the activation operand and per weight row along the reduction
(``FP8`` of :func:`moeblaze.kernels.grouped_gemm.grouped_gemm_kernel`): the e4m3 tensor cores read both K-major,
so B1 and B3 take transposed e4m3 copies of the weights (``w2^T [E, h, d]``, ``w1^T [E, d, 2h|h]``), quantized
along their rows as :meth:`moeblaze.fp8.Float8Recipe.quantize_weight` does along ``reduce_cols=False`` (B3's a
column chunk of ``dx`` at a time: the rows of ``w1^T`` that chunk reads, unless the copies are kept). The
activation backward, the router-weight gradient and the combine are the 16-bit path's kernels, and so are the
weight-gradient GEMMs B2 and B4 (the recipe's, :mod:`moeblaze.ops_fp8`): on ``dout`` and ``w act``, and on the
layer's ``x`` and ``dpre``. Why not on e4m3: there both operands run along the reduction (the slots), an
MN-major e4m3 tile the Hopper tensor cores do not read, and the wgrad kernel's FP8 flag on them took 24.3 ms for
both GEMMs against 3.6 ms in bf16 (H200, Qwen3-30B-A3B shape, T 32,768, ``torch.profiler`` of one layer step:
docs/results-fp8-profile.csv; ``benchmarks/profile_layer.py --impls moeblaze,moeblaze-fp8 --kernels`` prints the
same table); an FP8 weight gradient needs slot-contiguous (transposed) e4m3 copies of both operands.

Operands are quantized where this module needs them by one launch per tensor (:func:`quantize_rows`:
:mod:`moeblaze.kernels.fp8_quant`, bitwise the recipe's; the recipe's PyTorch ops on the CPU, where the
interpreter's e4m3 casts differ), except where the data is produced (on CUDA): the ``pre`` kept for backward, which
F1's epilogue writes in e4m3 tiles (``PRE_FP8`` of the grouped GEMM; no 16-bit ``pre`` exists) and the activation
backward reads as it is, and B3's ``dpre``, which B1's activation backward writes in e4m3 into the kept ``pre``'s
storage as it produces it (:mod:`moeblaze.kernels.act_bwd`, ``QUANT``); a weight's copies once per parameter version
inside :func:`moeblaze.fp8.reuse_weights` (gradient accumulation). Outputs are in the 16-bit
operands' dtype (``x``'s), weight gradients in ``dw_dtype``. Each op is a torch custom op (as
:mod:`moeblaze.kernels.experts`'), so ``torch.compile(fullgraph=True)`` traces the FP8 layer.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..activations import DEFAULT_ACT, GATED, ActArgs
from ..dispatch import DispatchIndex
from ..fp8 import E4M3, KEPT_TILE, Float8Recipe, Float8Tensor, copies_kept, quantize_fp8, quantize_kept, weight_copy
from . import experts as kx
from .custom_ops import call_op
from .fp8_gemm import down_rowwise, up_rowwise
from .fp8_quant import dequantize_rows_fp8, gives_col_amax, quantize_rows_col_amax, quantize_rows_fp8
from .launch import grouped_gemm
from .tuning import cdiv

# The kernels read w_gate_up as a gate block then an up block: moeblaze.experts._Float8Experts regroups GPT-OSS's
# alternating rows for them (a copy of the weight; the kernels' pointer arithmetic on e4m3 tiles stays one layout).
INTERLEAVED_GATE_UP = False

__all__ = ["quantize_rows", "dequantize", "up_forward", "down_forward", "down_backward", "up_backward", "bias_grad"]

# The expert-bias gradients are sums of 16-bit dpre and dout rows: the 16-bit path's segment sums (a custom op)
bias_grad = kx.bias_grad


def _rows(t: Tensor, pow2: bool, out: tuple[Tensor, Tensor] | None = None,
          as_dtype: torch.dtype | None = None) -> Float8Tensor:
    """``t [..., R, C]`` with one scale per row (into ``out``'s ``(data, scale)`` when given; ``as_dtype``: the values
    of ``t.to(as_dtype)``): one launch on CUDA, the recipe's PyTorch ops elsewhere."""
    if t.is_cuda:
        return quantize_rows_fp8(t, pow2, out, as_dtype)
    q = quantize_fp8(t if as_dtype is None else t.to(as_dtype), (1, t.shape[-1]), pow2)
    if out is None:
        return q
    out[0].copy_(q.data)
    out[1].copy_(q.scale)
    return Float8Tensor(out[0], out[1], q.block)


def _weight_rows(w: Tensor, pow2: bool, dtype: torch.dtype) -> tuple[Float8Tensor, Tensor]:
    """A weight ``[E, n, k]`` with one scale per row, as its cast to the compute ``dtype`` (an fp32 master under
    autocast: the rounding inside the quantization, no 16-bit copy), kept over micro-batches inside
    :func:`moeblaze.fp8.reuse_weights`; and ``[E, k]`` fp32, the cast's column maxima (empty off CUDA and where
    the quantization does not hold the rows whole, :func:`moeblaze.kernels.fp8_quant.gives_col_amax`), which
    :func:`_weight_cols` takes in backward so it reads the weight once."""
    if _amax_shape(w) == (0,):
        return weight_copy(w, ("rows", pow2, dtype), lambda: _rows(w, pow2, as_dtype=dtype)), _no_amax(w)
    return weight_copy(w, ("rows+amax", pow2, dtype), lambda: quantize_rows_col_amax(w, pow2, dtype))


def _weight_cols(w: Tensor, pow2: bool, dtype: torch.dtype, amax: Tensor | None) -> Float8Tensor:
    """The transposed view ``w^T [E, k, n]`` of a weight with one scale per row (K-major for B1 / B3), as
    :func:`_weight_rows`; ``amax`` its column maxima from the forward (empty or None: found here, a second read)."""
    if amax is None or not amax.numel():
        make = lambda: _rows(w.transpose(1, 2), pow2, as_dtype=dtype)  # noqa: E731
    else:
        make = lambda: quantize_rows_fp8(w.transpose(1, 2), pow2, as_dtype=dtype, amax=amax)  # noqa: E731
    return weight_copy(w.transpose(1, 2), ("rows", pow2, dtype), make)


def _amax_shape(w: Tensor) -> tuple[int, ...]:
    """The shape of :func:`_weight_rows`' column maxima of ``w [E, n, k]``: ``[E, k]``, or ``[0]`` (none)."""
    return (w.shape[0], w.shape[-1]) if w.is_cuda and gives_col_amax(w) else (0,)


def _no_amax(w: Tensor) -> Tensor:
    return w.new_empty(0, dtype=torch.float32)


def _index_args(index: DispatchIndex) -> tuple[Tensor, ...]:
    return (index.local_offsets, index.expert_token_indices, *kx._schedule(index))


# ---------------------------------------------------------------- quantization of x and pre (the autograd's)

def _quantize_rows_impl(t: Tensor, pow2: bool) -> tuple[Tensor, Tensor]:
    q = _rows(t, pow2)
    return q.data, q.scale


_quantize_rows_op = torch.library.custom_op(
    "moeblaze::fp8_quantize_rows", _quantize_rows_impl, mutates_args=(),
    schema="(Tensor t, bool pow2) -> (Tensor, Tensor)")


@_quantize_rows_op.register_fake
def _(t, pow2):
    return t.new_empty(t.shape, dtype=E4M3), t.new_empty((*t.shape[:-1], 1), dtype=torch.float32)


def quantize_rows(recipe: Float8Recipe, t: Tensor) -> Float8Tensor:
    """``t [..., R, C]`` quantized with one scale per row (:meth:`moeblaze.fp8.Float8Recipe.quantize_rows` of the
    rowwise recipe): one launch of :func:`moeblaze.kernels.fp8_quant.quantize_rows_fp8` on CUDA, the recipe's
    PyTorch ops elsewhere (the CPU interpreter's e4m3 casts differ; DESIGN.md §7)."""
    data, scale = call_op(_quantize_rows_op, _quantize_rows_impl, t, recipe.pow2_scales)
    return Float8Tensor(data, scale, (1, t.shape[-1]))


def dequantize(q: Float8Tensor, dtype: torch.dtype) -> Tensor:
    """The rowwise ``q [R, C]`` (rows expert parallelism received in e4m3) in ``dtype``: the fp32 products of
    :meth:`moeblaze.fp8.Float8Tensor.dequantize`, rounded; one launch on CUDA
    (:func:`moeblaze.kernels.fp8_quant.dequantize_rows_fp8`), the recipe's PyTorch ops elsewhere."""
    return dequantize_rows_fp8(q, dtype) if q.data.is_cuda else q.dequantize(dtype)


# ---------------------------------------------------------------- F1

def _kept_scale_shape(N: int, w1: Tensor, activation: str) -> tuple[int, int, int]:
    """``[N, 2|1, tiles]``: the scales of the kept ``pre``'s ``1 x KEPT_TILE`` tiles per half."""
    return N, 2 if activation in GATED else 1, cdiv(kx.up_widths(w1, activation)[1], KEPT_TILE)


def _up_impl(xq, xs, w1, b1, offsets, indices, tile_expert, tile_row, num_tiles, activation, alpha, limit,
             store_act, pow2, keep, dtype):
    # on CUDA the epilogue quantizes pre; elsewhere the recipe's PyTorch ops do (the interpreter's e4m3 casts differ)
    fused = keep and xq.is_cuda
    scale = xq.new_empty(_kept_scale_shape(indices.numel(), w1, activation) if keep else (0,), dtype=torch.float32)
    wq, amax = _weight_rows(w1, pow2, dtype)
    pre, act = up_rowwise(Float8Tensor(xq, xs, (1, xq.shape[1])), wq, offsets, indices,
                          (tile_expert, tile_row, num_tiles), activation, True, store_act, dtype, b1, alpha, limit,
                          keep=(scale, pow2) if fused else None)
    if keep and not fused:
        q = quantize_kept(pre, activation in GATED, pow2)
        pre = q.data.view(pre.shape)
        scale.copy_(q.scale)
    return pre, act, scale, amax


_up_op = torch.library.custom_op(
    "moeblaze::fp8_up_forward", _up_impl, mutates_args=(),
    schema="(Tensor xq, Tensor xs, Tensor w1, Tensor? b1, Tensor offsets, Tensor indices, Tensor tile_expert, "
           "Tensor tile_row, Tensor num_tiles, str activation, float alpha, float limit, bool store_act, "
           "bool pow2, bool keep, ScalarType dtype) -> (Tensor, Tensor, Tensor, Tensor)")


@_up_op.register_fake
def _(xq, xs, w1, b1, offsets, indices, tile_expert, tile_row, num_tiles, activation, alpha, limit, store_act, pow2,
      keep, dtype):
    N, (rows, h) = indices.shape[0], kx.up_widths(w1, activation)
    return (w1.new_empty((N, rows), dtype=E4M3 if keep else dtype),
            w1.new_empty((N, h) if store_act else (0,), dtype=dtype),
            w1.new_empty(_kept_scale_shape(N, w1, activation) if keep else (0,), dtype=torch.float32),
            w1.new_empty(_amax_shape(w1), dtype=torch.float32))


def up_forward(recipe: Float8Recipe, xq: Float8Tensor, w1: Tensor, index: DispatchIndex, activation: str, *,
               store_act: bool = True, b1: Tensor | None = None, act_args: ActArgs = DEFAULT_ACT,
               keep: bool = False,
               dtype: torch.dtype | None = None) -> tuple[Tensor | Float8Tensor, Tensor | None, Tensor]:
    """F1 (:func:`moeblaze.ops_fp8.up_forward`): ``(pre [N, 2h|h], act [N, h] | None, w1_amax)`` in ``dtype``
    (default ``w1``'s; ``w1`` quantized as its cast to it, :func:`_weight_rows`, whose column maxima ``w1_amax``
    are, for :func:`up_backward`'s ``w_amax``); with ``keep`` ``pre`` as kept for backward, e4m3 in
    ``1 x KEPT_TILE`` tiles per half (:meth:`moeblaze.fp8.Float8Recipe.quantize_kept` of the 16-bit ``pre``; on CUDA
    written so by F1's epilogue: no 16-bit ``pre`` exists), ``act`` from the 16-bit ``pre``.

    Raises:
        ValueError: ``act_args.interleaved`` (:data:`INTERLEAVED_GATE_UP`).
    """
    if act_args.interleaved:
        raise ValueError("the Triton FP8 ops read w_gate_up as a gate block and an up block; regroup interleaved "
                         "rows first (moeblaze.moe_experts does)")
    pre, act, scale, amax = call_op(_up_op, _up_impl, xq.data, xq.scale, w1, b1, *_index_args(index), activation,
                                    act_args.alpha, act_args.limit, store_act, recipe.pow2_scales, keep,
                                    dtype or w1.dtype)
    if keep:
        pre = Float8Tensor(pre.unflatten(1, scale.shape[1:2] + (-1,)), scale, (1, KEPT_TILE))
    return pre, (act if store_act else None), amax


# ---------------------------------------------------------------- F2-F3

def _down_impl(act, w2, b2, topk_weights, offsets, indices, tile_expert, tile_row, num_tiles, token_index_map,
               foreign, pair_offsets, pow2):
    wq, amax = _weight_rows(w2, pow2, act.dtype)
    return down_rowwise(_rows(act, pow2), wq, topk_weights, offsets, indices, (tile_expert, tile_row, num_tiles),
                        token_index_map, foreign, pair_offsets, b2, act.dtype), amax


_down_op = torch.library.custom_op(
    "moeblaze::fp8_down_forward", _down_impl, mutates_args=(),
    schema="(Tensor act, Tensor w2, Tensor? b2, Tensor topk_weights, Tensor offsets, Tensor indices, "
           "Tensor tile_expert, Tensor tile_row, Tensor num_tiles, Tensor token_index_map, bool foreign, "
           "Tensor? pair_offsets, bool pow2) -> (Tensor, Tensor)")


@_down_op.register_fake
def _(act, w2, b2, topk_weights, offsets, indices, tile_expert, tile_row, num_tiles, token_index_map, foreign,
      pair_offsets, pow2):
    return (act.new_empty(kx._tokens_pairs(token_index_map, pair_offsets)[0], w2.shape[1]),
            w2.new_empty(_amax_shape(w2), dtype=torch.float32))


def down_forward(recipe: Float8Recipe, act: Tensor, w2: Tensor, topk_weights: Tensor, index: DispatchIndex, *,
                 b2: Tensor | None = None, dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
    """F2-F3 (:func:`moeblaze.ops_fp8.down_forward`): ``(out [T, d], w2_amax)``, ``out`` in ``act``'s dtype, ``w2``
    quantized as its cast to it (``dtype``, the emulation's argument, is ``act``'s here), ``w2_amax`` that cast's
    column maxima for :func:`down_backward`'s ``w_amax`` (:func:`_weight_rows`)."""
    return call_op(_down_op, _down_impl, act, w2, b2, topk_weights, *_index_args(index), index.token_index_map,
                   index.foreign_experts, index.pair_offsets, recipe.pow2_scales)


# ---------------------------------------------------------------- B1-B2

def _down_backward_impl(dout, pre, pre_scale, w2, b2, topk_weights, offsets, indices, tile_expert, tile_row,
                        num_tiles, token_index_map, token_expert_indices, activation, alpha, limit, interleaved,
                        foreign, need_dw, need_dtw, general, dw_dtype, pow2, dpre_scale=None, w_amax=None):
    # B1 in FP8, then the 16-bit path's activation backward (dpre over a 16-bit pre, or into a new tensor from the
    # kept e4m3 pre and its tile scales pre_scale, whose storage then takes dpre in e4m3 for B3 on CUDA: dpre_scale),
    # dtopk_weights and B2 dW2[e] = sum_s dout[token(s)]^T (w act)
    dact = _b1(dout, w2, offsets, indices, (tile_expert, tile_row, num_tiles), pow2, w_amax)
    kept = pre_scale is not None
    dpre = torch.empty(pre.shape, dtype=dout.dtype, device=dout.device) if kept else pre
    quant = (pre, dpre_scale.view(-1), pow2) if kept and _fuses_dpre(dpre_scale, dout) else None
    dw2, dtw = kx.act_bwd_b2(dout, dact, pre, w2, b2, topk_weights, offsets, indices, token_index_map,
                             token_expert_indices, activation, alpha, limit, interleaved, foreign, need_dw, need_dtw,
                             general, dw_dtype, quant, dpre=dpre, pre_scale=pre_scale, pre_tile=KEPT_TILE)
    return (dpre if kept else kx._empty(dout)), dw2, dtw


def _fuses_dpre(dpre_scale, t) -> bool:
    """Whether B1's activation backward writes B3's e4m3 ``dpre`` (given a scale buffer, on CUDA: the interpreter's
    e4m3 casts differ from the recipe's, so on the CPU B3 quantizes with PyTorch's ops as before)."""
    return dpre_scale is not None and t.is_cuda


def _b1(dout, w2, offsets, indices, sched, pow2, w_amax):
    """B1 ``dact' [N, h] = dout[token(s)] w2[e]`` on e4m3 ``dout`` rows and ``w2^T [E, h, d]`` (K-major, a scale per
    column of w2), in ``dout``'s dtype. A function of its own so that the e4m3 copies are freed before the
    activation backward and B2 allocate (the copy of ``w2`` is ``E d h`` bytes)."""
    d, h = w2.shape[1], w2.shape[2]
    gq, wq = _rows(dout, pow2), _weight_cols(w2, pow2, dout.dtype, w_amax)
    dact = dout.new_empty(indices.numel(), h)
    grouped_gemm(gq.data, wq.data, dact, offsets, indices, sched, b_nk=True, n_cols=h, k_dim=d, gather_a=True,
                 a_scale=gq.scale[:, 0], b_scale=wq.scale[..., 0])
    return dact


_down_backward_op = torch.library.custom_op(
    "moeblaze::fp8_down_backward", _down_backward_impl, mutates_args=("pre", "dpre_scale"),
    schema="(Tensor dout, Tensor(a!) pre, Tensor? pre_scale, Tensor w2, Tensor? b2, Tensor topk_weights, "
           "Tensor offsets, Tensor indices, Tensor tile_expert, Tensor tile_row, Tensor num_tiles, "
           "Tensor token_index_map, Tensor token_expert_indices, str activation, float alpha, float limit, "
           "bool interleaved, bool foreign, bool need_dw, bool need_dtw, bool general, ScalarType? dw_dtype, "
           "bool pow2, Tensor(b!)? dpre_scale=None, Tensor? w_amax=None) -> (Tensor, Tensor, Tensor)")


@_down_backward_op.register_fake
def _(dout, pre, pre_scale, w2, b2, topk_weights, offsets, indices, tile_expert, tile_row, num_tiles,
      token_index_map, token_expert_indices, activation, alpha, limit, interleaved, foreign, need_dw, need_dtw,
      general, dw_dtype, pow2, dpre_scale=None, w_amax=None):
    dpre = pre.new_empty(pre.shape, dtype=dout.dtype) if pre_scale is not None else kx._empty(dout)
    return (dpre, *kx.down_backward_outputs(w2, topk_weights, token_index_map, need_dw, need_dtw, dw_dtype))


def down_backward(recipe: Float8Recipe, dout: Tensor, pre: Tensor | Float8Tensor, w2: Tensor, topk_weights: Tensor,
                  index: DispatchIndex, activation: str, need_dw: bool, need_dtw: bool, *, b2: Tensor | None = None,
                  act_args: ActArgs = DEFAULT_ACT, dw_dtype: torch.dtype | None = None,
                  dpre_q: Float8Tensor | None = None, dtype: torch.dtype | None = None,
                  w_amax: Tensor | None = None) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """B1 in FP8 (``dact' = dout[token(s)] w2[e]``, ``w2`` quantized as its cast to ``dout``'s dtype, which ``dtype``
    names in the emulation), the 16-bit path's activation backward and ``dtopk_weights``, B2 in 16 bits
    (:func:`moeblaze.ops_fp8.down_backward`): ``(dpre [N, 2h|h], dw2 | None, dtopk_weights | None)``.

    ``pre``: the kept e4m3 tiles of :func:`up_forward`'s ``keep`` (read as they are: no 16-bit copy; ``dpre`` is a
    new tensor in ``dout``'s dtype), or ``[N, 2h|h]`` in ``dout``'s dtype recomputed (unit column stride, else a
    copy), overwritten with ``dpre`` and returned. ``dpre_q``: B3's rowwise e4m3 ``dpre`` in the kept ``pre``'s
    storage (a view of it, a scale per row); on CUDA the activation backward writes ``dpre`` quantized into
    it (:func:`up_backward` with it as ``reuse`` and ``quantized``), elsewhere it is left. ``w_amax``:
    :func:`down_forward`'s ``w2_amax`` (the copy of ``w2^T`` then reads ``w2`` once), or None.

    Raises:
        ValueError: ``dpre_q`` not in the kept ``pre``'s storage.
    """
    dout = dout.contiguous()
    if isinstance(pre, Float8Tensor):
        data, pre_scale = pre.data.flatten(1), pre.scale
    else:
        data, pre_scale = pre.to(dout.dtype).contiguous(), None
    if dpre_q is not None and (pre_scale is None or (not torch.compiler.is_compiling()  # no data_ptr in a trace
                                                     and dpre_q.data.data_ptr() != data.data_ptr())):
        raise ValueError("down_backward: dpre_q must lie in the kept e4m3 pre's storage")
    q_scale = dpre_q.scale if dpre_q is not None else None
    dpre, dw2, dtw = call_op(_down_backward_op, _down_backward_impl, dout, data, pre_scale, w2, b2, topk_weights,
                             *_index_args(index), index.token_index_map, index.token_expert_indices, activation,
                             *act_args, index.foreign_experts, need_dw, need_dtw, index.is_general, dw_dtype,
                             recipe.pow2_scales, q_scale, w_amax,
                             mutated=(data,) if pre_scale is None else (data, q_scale) if q_scale is not None else ())
    return (dpre if pre_scale is not None else data), (dw2 if need_dw else None), (dtw if need_dtw else None)


# ---------------------------------------------------------------- B3-B5, B4

def _b3_impl(dpre, w1, offsets, indices, tile_expert, tile_row, num_tiles, token_index_map, foreign, pair_offsets,
             pow2, reuse_data=None, reuse_scale=None, quantized=False, w_amax=None):
    """B3 with the B5 combine, ``dx [T, d]`` in ``dpre``'s dtype, on e4m3 ``dpre`` rows (``reuse`` as it is when
    B1's activation backward wrote it; else quantized here, into ``reuse``, the kept e4m3 ``pre`` of the same shape,
    dead by now, when given) and ``w1^T [E, d, 2h|h]`` (K-major, a scale per column of w1), a copy of the rows each
    column chunk of ``dx`` reads made for that chunk."""
    reuse = (reuse_data, reuse_scale) if reuse_data is not None else None
    ready = quantized and _fuses_dpre(reuse_scale, dpre)
    gq = Float8Tensor(*reuse, (1, dpre.shape[1])) if ready else _rows(dpre, pow2, reuse)
    args = (offsets, indices, (tile_expert, tile_row, num_tiles), token_index_map, None, foreign, pair_offsets)
    if copies_kept():  # the whole copy is kept for the next micro-batch anyway: every chunk reads it in place
        wq = _weight_cols(w1, pow2, dpre.dtype, w_amax)
        return kx.slots_to_tokens(gq.data, wq.data, True, *args, out_dtype=dpre.dtype, a_elem=1,
                                  a_scale=gq.scale[:, 0], b_scale=wq.scale[..., 0])
    has_amax = w_amax is not None and w_amax.numel() > 0

    def weight_rows(c0, c1):
        amax = w_amax[:, c0:c1].contiguous() if has_amax else None
        wq = _weight_cols(w1[:, :, c0:c1], pow2, dpre.dtype, amax)
        return wq.data, wq.scale[..., 0]
    E, k = w1.shape[0], w1.shape[1]  # a chunk column's e4m3 row of w1^T and its fp32 scale: E (k + 4) bytes
    return kx.slots_to_tokens(gq.data, w1.transpose(1, 2), True, *args, out_dtype=dpre.dtype, weight_rows=weight_rows,
                              a_elem=1, col_extra=E * (k + 4), a_scale=gq.scale[:, 0])


_b3_op = torch.library.custom_op(
    "moeblaze::fp8_up_backward", _b3_impl, mutates_args=("reuse_data", "reuse_scale"),
    schema="(Tensor dpre, Tensor w1, Tensor offsets, Tensor indices, Tensor tile_expert, Tensor tile_row, "
           "Tensor num_tiles, Tensor token_index_map, bool foreign, Tensor? pair_offsets, bool pow2, "
           "Tensor(a!)? reuse_data=None, Tensor(b!)? reuse_scale=None, bool quantized=False, "
           "Tensor? w_amax=None) -> Tensor")


@_b3_op.register_fake
def _(dpre, w1, offsets, indices, tile_expert, tile_row, num_tiles, token_index_map, foreign, pair_offsets, pow2,
      reuse_data=None, reuse_scale=None, quantized=False, w_amax=None):
    return dpre.new_empty(kx._tokens_pairs(token_index_map, pair_offsets)[0], w1.shape[2])


def up_backward(recipe: Float8Recipe, dpre: Tensor, x: Tensor, w1: Tensor, index: DispatchIndex,
                need_dx: bool, need_dw: bool, *, dw_dtype: torch.dtype | None = None,
                reuse: Float8Tensor | None = None, quantized: bool = False, dtype: torch.dtype | None = None,
                w_amax: Tensor | None = None) -> tuple[Tensor | None, Tensor | None]:
    """B3 in FP8 with the B5 combine (``dx [T, d]`` in ``dpre``'s dtype, ``w1`` quantized as its cast to it, which
    ``dtype`` names in the emulation) and B4 in 16 bits on the layer's ``x``
    (:func:`moeblaze.ops_fp8.up_backward`): ``(dx | None, dw1 | None)``. ``reuse``: ``[N, 2h|h]`` e4m3 in the kept
    ``pre``'s storage (dead after the activation backward) with a scale per row: B3's e4m3 ``dpre`` is written into
    it (``N 2h`` bytes less at the backward's peak); autograd sees the change, so a second backward through the
    graph raises.
    ``quantized``: ``reuse`` was :func:`down_backward`'s ``dpre_q``, which on CUDA holds B3's e4m3 ``dpre``
    already (no quantization here). ``w_amax``: :func:`up_forward`'s ``w1_amax`` (the copy of ``w1^T`` then reads
    ``w1`` once), or None."""
    dx = dw1 = None
    if need_dx:
        kept = (reuse.data, reuse.scale) if reuse is not None else (None, None)
        dx = call_op(_b3_op, _b3_impl, dpre.contiguous(), w1, *_index_args(index), index.token_index_map,
                     index.foreign_experts, index.pair_offsets, recipe.pow2_scales, *kept,
                     quantized and reuse is not None, w_amax, mutated=tuple(t for t in kept if t is not None))
    if need_dw:  # B4 dW1[e]^T = sum_s x[token(s)]^T dpre[s] in 16 bits: the 16-bit path's op
        _, dw1 = call_op(kx._up_backward_op, kx._up_backward_impl, dpre, x.to(dpre.dtype), w1, *_index_args(index),
                         index.token_index_map, index.foreign_experts, False, True, index.pair_offsets, dw_dtype)
    return dx, dw1
