"""The Triton backend of :func:`moeblaze.moe_experts` (DESIGN.md §5, MoEBlaze §4).

Implements the five ops of the backend contract documented in :mod:`moeblaze.backends`, with the
same signatures, semantics and result dtypes:

``up_forward``     F1     ``pre = x[token(s)] W1[e]^T`` (gather fused in the loads), ``act = f(pre)``
``down_forward``   F2-F3  ``y = act W2[e]^T``; ``out[t] = sum_k w[t,k] y[map[t,k]]`` (fp32 gather-sum;
                          K = 1: ``out[token(s)] = w * y`` straight from the GEMM epilogue)
``down_backward``  B1-B2  ``dact' = dout[token(s)] W2[e]``, act recomputed from ``pre``,
                          ``dtopk_weights = <dact', act>``, ``dpre``; ``dW2[e] = sum_s dout[token]^T (w act)``
``up_backward``    B3-B5  ``dx_slots = dpre W1[e]``, ``dx[t] = sum_k dx_slots[map[t,k]]`` (K = 1: direct);
                          ``dW1[e] = sum_s dpre[s]^T x[token(s)]``
``bias_grad``             ``db1[e] = sum_s dpre[s]``, ``db2[e] = sum_s w_s dout[token(s)]`` (segment sums)

Expert biases are added in the GEMM epilogues (F1 before ``pre`` is rounded, F2 before the router
weight); an interleaved ``w_gate_up`` (GPT-OSS) is read in place through strides (F1 reads its even
rows as gate and odd rows as up; ``pre``/``dpre`` keep its row order, so B3/B4 read the view as is);
an index with foreign experts never schedules their slots and the combines skip them.

Each op is a ``torch.library.custom_op`` (``moeblaze::experts_*``) with a fake (meta) implementation,
so ``torch.compile(fullgraph=True)`` treats it as one opaque node (eager invocations skip the dispatcher:
:func:`~moeblaze.kernels.custom_ops.call_op`).
``down_backward`` writes ``dpre`` over ``pre`` (declared as a mutation). No op reads device data on the host,
none uses atomics (bitwise reproducible), and row offsets are 64-bit inside the kernels.
Dtypes: fp16, bf16 (fast paths) and fp32 (tests), all with fp32 accumulation.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..activations import DEFAULT_ACT, GATED, ActArgs, check_activation
from ..dispatch import DispatchIndex, with_schedule
from ..shared_ops import bias_dot, slot_weights
from . import tuning
from .act_bwd import act_bwd_rows
from .act_math import ACTIVATION_CODES
from .bias_grad import segment_sum
from .chunks import gemm_gather_sum
from .combine import local_slots
from .custom_ops import call_op
from .grouped_gemm import B_DESC_INTERLEAVED, EPILOGUE_ACT_FWD
from .launch import grouped_gemm, grouped_wgrad, interleaved_desc_ok, rounds_tf32

__all__ = ["up_forward", "up_backward", "down_forward", "down_backward", "bias_grad"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check(op: str, **tensors: torch.Tensor) -> None:
    """Dtype/device checks shared by the four ops (shapes are checked by ``moe_experts``)."""
    first = next(iter(tensors.values()))
    for name, t in tensors.items():
        if t.dtype not in _DTYPES:
            raise TypeError(f"triton {op}: {name} has dtype {t.dtype}; expected one of fp16, bf16, fp32")
        if t.dtype != first.dtype:
            raise TypeError(f"triton {op}: {name} has dtype {t.dtype}; expected {first.dtype}")
        if t.device != first.device:
            raise ValueError(f"triton {op}: {name} is on {t.device}; expected {first.device}")


def _rows_contig(t: torch.Tensor) -> torch.Tensor:
    """Row-major rows with unit column stride (row stride free) — what the kernels' loads want."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _empty(like: torch.Tensor) -> torch.Tensor:
    return like.new_empty(0)


def _stored_transposed(w: Tensor) -> bool:
    """``w [E, n, k]`` is the transposed view of a packed ``[E, k, n]`` tensor (GPT-OSS's and other
    ``is_transposed`` experts' parameters): its weight gradient is then written in that storage order, so
    autograd hands the parameter a gradient of its own layout (no ``E*n*k`` copy when it accumulates)."""
    return w.stride(1) == 1 and w.stride(2) != 1


def _like_weight(w: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """An uninitialised tensor of ``w``'s shape and storage order, in ``dtype`` (default ``w``'s; fakes)."""
    dtype = dtype or w.dtype
    if _stored_transposed(w):
        return w.new_empty(w.shape[0], w.shape[2], w.shape[1], dtype=dtype).transpose(1, 2)
    return w.new_empty(w.shape, dtype=dtype)


def _schedule(index: DispatchIndex) -> tuple[Tensor, Tensor, Tensor]:
    """The index's tile schedule for the GEMMs' BLOCK_M (:func:`.tuning.block_m`, as the plan's); built here (one
    small launch per op) only for an index that came without it (``moe_experts`` attaches it once per layer call)."""
    return with_schedule(index, tuning.block_m(index.num_pairs, index.num_experts)).schedule.tensors()


# ---------------------------------------------------------------- F1: up-projection forward

def _up_forward_impl(x, w1, b1, offsets, indices, tile_expert, tile_row, num_tiles, activation, alpha, limit,
                     interleaved, store_pre, store_act):
    x = _rows_contig(x)
    N, rows = indices.numel(), w1.shape[1]
    gated = activation in GATED
    h = rows // 2 if gated else rows
    pre = x.new_empty(N, rows) if store_pre else _empty(x)
    act = x.new_empty(N, h) if store_act else _empty(x)
    layout, up_off = {}, h
    if interleaved and interleaved_desc_ok(w1, x.shape[1]):  # one TMA box of alternating gate/up columns
        layout, up_off = dict(pre_step=2, b_mode=B_DESC_INTERLEAVED.value), 1
    elif interleaved:  # gate rows = the even rows of the view (row stride doubled), up rows one row later
        layout = dict(up_shift_b=w1.stride(1), pre_step=2, weight_desc=False)
        w1, up_off = w1[:, 0::2], 1
    grouped_gemm(x, w1, pre if store_pre else act, offsets, indices, (tile_expert, tile_row, num_tiles),
                 b_nk=True, n_cols=h, k_dim=x.shape[1], gather_a=True, up_off=up_off, epilogue=EPILOGUE_ACT_FWD.value,
                 activation=ACTIVATION_CODES[activation], dual=gated, store_pre=store_pre,
                 aux=act if store_act else None, store_aux=store_act,
                 bias=_rows_contig(b1) if b1 is not None else None, alpha=alpha, limit=limit, **layout)
    return pre, act


_up_forward_op = torch.library.custom_op(
    "moeblaze::experts_up_forward", _up_forward_impl, mutates_args=(),
    schema="(Tensor x, Tensor w1, Tensor? b1, Tensor offsets, Tensor indices, Tensor tile_expert, Tensor tile_row, "
           "Tensor num_tiles, str activation, float alpha, float limit, bool interleaved, bool store_pre, "
           "bool store_act) -> (Tensor, Tensor)")


def up_widths(w1, activation):
    """``(rows, h)``: the widths of F1's ``pre`` (``w1``'s rows: 2h gated, h otherwise) and ``act``."""
    rows = w1.shape[1]
    return rows, (rows // 2 if activation in GATED else rows)


@_up_forward_op.register_fake
def _(x, w1, b1, offsets, indices, tile_expert, tile_row, num_tiles, activation, alpha, limit, interleaved,
      store_pre, store_act):
    N, (rows, h) = indices.shape[0], up_widths(w1, activation)
    return (x.new_empty(N, rows) if store_pre else _empty(x)), (x.new_empty(N, h) if store_act else _empty(x))


def up_forward(x: Tensor, w1: Tensor, index: DispatchIndex, activation: str, store_pre: bool,
               store_act: bool, *, b1: Tensor | None = None,
               act_args: ActArgs = DEFAULT_ACT) -> tuple[Tensor | None, Tensor | None]:
    """F1: ``pre [N, 2h|h] = x[token(s)] @ w1[e].T (+ b1[e])`` and ``act [N, h] = f(pre)``, both in ``x.dtype``.

    Args:
        x: ``[T, d]`` fp16/bf16/fp32; w1: ``[E, 2h|h, d]`` same dtype, any strides; index: the dispatch index.
        activation: one of :data:`moeblaze.activations.ACTIVATIONS`.
        store_pre, store_act: which results to produce (the other is returned as ``None``).
        b1: ``[E, 2h|h]`` bias in ``w1``'s row order, or None. act_args: see :class:`moeblaze.activations.ActArgs`
            (``interleaved``: ``w1``'s rows and ``pre``'s columns alternate gate, up).

    Returns:
        ``(pre | None, act | None)``; foreign slots' rows are left unwritten. fp32 at TF32 precision: ``act``
        rounded to TF32 (the operand :func:`down_forward` reads; :mod:`moeblaze.kernels.tf32`).

    Raises:
        TypeError: a dtype other than fp16/bf16/fp32, or ``x``, ``w1`` and ``b1`` of different dtypes.
        ValueError: unknown activation, or tensors on different devices.
    """
    check_activation(activation)
    _check("up_forward", x=x, w1=w1, **({"b1": b1} if b1 is not None else {}))
    pre, act = call_op(_up_forward_op, _up_forward_impl, x, w1, b1, index.local_offsets,
                       index.expert_token_indices, *_schedule(index), activation, *act_args, store_pre, store_act)
    return (pre if store_pre else None), (act if store_act else None)


# ---------------------------------------------------------------- F2-F3: down-projection forward

def _tokens_pairs(token_index_map: Tensor, pair_offsets: Tensor | None) -> tuple[int, int]:
    """``(T, K)`` of a top-k index; ``(T, 0)`` for general routing (pairs per token vary: never the K = 1
    direct-scatter paths, which assume one pair per token)."""
    if pair_offsets is not None:
        return pair_offsets.shape[0] - 1, 0
    return token_index_map.shape[0], token_index_map.shape[1]


def _down_forward_impl(act, w2, b2, topk_weights, offsets, indices, tile_expert, tile_row, num_tiles,
                       token_index_map, foreign, pair_offsets=None):
    bias = _rows_contig(b2) if b2 is not None else None
    return slots_to_tokens(_rows_contig(act), w2, True, offsets, indices, (tile_expert, tile_row, num_tiles),
                           token_index_map, topk_weights, foreign, pair_offsets, bias=bias)


def slots_to_tokens(a, w, b_nk, offsets, indices, sched, token_index_map, weights, foreign, pair_offsets, *,
                    bias=None, out_dtype=None, weight_rows=None, a_elem=None, col_extra=0, **fp8_scales):
    """``out [T, n] = sum_k (weights[t, k] *) (a[s] @ W[e] (+ bias[e]))[map[t, k]]``, F2-F3 (``a = act``, with the
    router weights) and B3-B5 (``a = dpre``, ``weights`` None): K = 1 writes each slot's row straight into
    ``out[token]`` (no ``[N, n]`` buffer, no combine; foreign tokens never written: zeros), else column chunks
    (:func:`.chunks.gemm_gather_sum`). ``w``: ``[E, n, k]`` (``b_nk``) or ``[E, k, n]``; ``out_dtype`` and
    ``fp8_scales`` (``a_scale``, ``b_scale``) for e4m3 ``a`` and ``w``; ``weight_rows``: the e4m3 rows of ``w``
    (``b_nk``; then only its shape is read) made per chunk, ``a_elem`` and ``col_extra``: the chunk rule's
    (:func:`.chunks.gemm_gather_sum`)."""
    T, K = _tokens_pairs(token_index_map, pair_offsets)
    k_dim, n = (w.shape[2], w.shape[1]) if b_nk else (w.shape[1], w.shape[2])
    if K != 1:
        return gemm_gather_sum(a, w, b_nk, k_dim, offsets, indices, sched, token_index_map, weights, foreign,
                               pair_offsets, T, n, k_dim, bias=bias, out_dtype=out_dtype, weight_rows=weight_rows,
                               a_elem=a_elem, col_extra=col_extra, **fp8_scales)
    if weight_rows is not None:
        w, fp8_scales["b_scale"] = weight_rows(0, n)
    out = (a.new_zeros if foreign else a.new_empty)(T, n, dtype=out_dtype or a.dtype)
    scale = slot_weights(weights, token_index_map, torch.float32) if weights is not None else None
    grouped_gemm(a, w, out, offsets, indices, sched, b_nk=b_nk, n_cols=n, k_dim=k_dim, gather_a=False,
                 scatter_c=True, scale=scale, bias=bias, a_tf32=True, **fp8_scales)
    return out


_down_forward_op = torch.library.custom_op(
    "moeblaze::experts_down_forward", _down_forward_impl, mutates_args=(),
    schema="(Tensor act, Tensor w2, Tensor? b2, Tensor topk_weights, Tensor offsets, Tensor indices, "
           "Tensor tile_expert, Tensor tile_row, Tensor num_tiles, Tensor token_index_map, bool foreign, "
           "Tensor? pair_offsets) -> Tensor")


@_down_forward_op.register_fake
def _(act, w2, b2, topk_weights, offsets, indices, tile_expert, tile_row, num_tiles, token_index_map, foreign,
      pair_offsets):
    return act.new_empty(_tokens_pairs(token_index_map, pair_offsets)[0], w2.shape[1])


def down_forward(act: Tensor, w2: Tensor, topk_weights: Tensor, index: DispatchIndex, *,
                 b2: Tensor | None = None) -> Tensor:
    """F2-F3: ``out [T, d] = sum_k topk_weights[t,k] * (act @ w2[e].T + b2[e])[map[t,k]]`` in ``act.dtype``.

    Args:
        act: ``[N, h]``; w2: ``[E, d, h]`` (same dtype); topk_weights: ``[T, K]`` any float dtype;
        b2: ``[E, d]`` (same dtype as ``act``) or None.

    fp32 at TF32 precision: ``act`` is read as TF32 values, as :func:`up_forward` stores it then (rounded);
    the tensor cores truncate any other low mantissa bits.

    Raises:
        TypeError, ValueError: as :func:`up_forward`.
    """
    _check("down_forward", act=act, w2=w2, **({"b2": b2} if b2 is not None else {}))
    return call_op(_down_forward_op, _down_forward_impl, act, w2, b2, topk_weights, index.local_offsets,
                   index.expert_token_indices, *_schedule(index), index.token_index_map, index.foreign_experts,
                   index.pair_offsets)


# ---------------------------------------------------------------- B1-B2: down-projection backward

def _down_backward_impl(dout, pre, w2, b2, topk_weights, offsets, indices, tile_expert, tile_row, num_tiles,
                        token_index_map, token_expert_indices, activation, alpha, limit, interleaved, foreign,
                        need_dw, need_dtw, general=False, dw_dtype=None):
    # B1 in two launches (why: moeblaze.kernels.act_bwd): the GEMM stores dact' [N, h], then one pass over
    # the rows recomputes act from pre and writes dpre over pre (unit column stride, checked by
    # down_backward) and w * act over dact' — the B operand of B2, a backward-only temporary.
    dout = _rows_contig(dout)
    d, h = w2.shape[1], w2.shape[2]
    N = indices.numel()
    dact = pre.new_empty(N, h)
    grouped_gemm(dout, w2, dact, offsets, indices, (tile_expert, tile_row, num_tiles), b_nk=False, n_cols=h, k_dim=d, gather_a=True)
    return act_bwd_b2(dout, dact, pre, w2, b2, topk_weights, offsets, indices, token_index_map, token_expert_indices,
                      activation, alpha, limit, interleaved, foreign, need_dw, need_dtw, general, dw_dtype)


def grad_in_storage(w, a, b, offsets, indices, dw_dtype, products_transposed, foreign, **kw):
    """``sum_s a[token(s)]^T b[s]`` (:func:`.launch.grouped_wgrad`) as the gradient of the weight ``w [E, p, q]`` in
    ``w``'s storage order: the products are ``w``'s transpose when ``products_transposed`` (B4's ``x^T dpre``), and a
    transposed-view ``w`` (GPT-OSS's layouts) gets them stored through swapped strides, viewed back."""
    flip = _stored_transposed(w)
    p, q = w.shape[2:0:-1] if products_transposed else w.shape[1:]
    dw = grouped_wgrad(a, b, offsets, indices, p=p, q=q, out_dtype=dw_dtype or w.dtype,
                       transpose=flip != products_transposed, slot_desc=not foreign, **kw)
    return dw.transpose(1, 2) if flip else dw


def act_bwd_b2(dout, dact, pre, w2, b2, topk_weights, offsets, indices, token_index_map, token_expert_indices,
               activation, alpha, limit, interleaved, foreign, need_dw, need_dtw, general, dw_dtype, quant=None,
               dpre=None, pre_scale=None, pre_tile=1):
    """B1's second launch (:mod:`moeblaze.kernels.act_bwd`) and B2, from B1's GEMM output ``dact' [N, h]`` (the
    16-bit and the FP8 path's): ``dpre`` over ``pre``, or into ``dpre`` (given for a ``pre`` in e4m3 tiles with
    ``pre_scale``, ``pre_tile``), with ``quant`` in e4m3 too (``act_bwd_rows``); with ``need_dw`` ``w * act`` over
    ``dact'`` and ``dW2[e] = sum_s dout[token(s)]^T (w act)[s]`` on the 16-bit ``dout``; returns ``(dw2,
    dtopk_weights)``, placeholders for what is not needed."""
    h = w2.shape[2]
    N = indices.numel()
    dpre = pre if dpre is None else dpre
    w_slot = slot_weights(topk_weights, token_index_map, torch.float32)
    dtw_slot = torch.empty(N, dtype=torch.float32, device=pre.device) if need_dtw else None
    local = local_slots(offsets, foreign)
    act_bwd_rows(dact, pre, dpre, w_slot, dtw_slot, h=h, activation=ACTIVATION_CODES[activation],
                 store_wact=need_dw, alpha=alpha, limit=limit, interleaved=interleaved, local_slots=local,
                 tf32_dpre=rounds_tf32(dpre), quant=quant, pre_scale=pre_scale, pre_tile=pre_tile)
    dtw = None if need_dtw else _empty(topk_weights)  # a placeholder only for an output not asked for
    if need_dtw:
        # int32 indices (no int64 copy); foreign pairs read act_bwd_rows' zeros: they get no gradient
        dtw = dtw_slot.index_select(0, token_index_map.reshape(-1)).view(token_index_map.shape)
        if b2 is not None:  # <dout[t], y> gains <dout[t], b2[e]>
            tokens = indices.index_select(0, token_index_map.long()) if general else None
            dtw = dtw + bias_dot(dout, b2, token_expert_indices, tokens)
        dtw = dtw.to(topk_weights.dtype)
    dw2 = _empty(w2)  # a placeholder unless asked for
    if need_dw:  # act_bwd_rows zeroed the tail (foreign)
        dw2 = grad_in_storage(w2, dout, dact, offsets, indices, dw_dtype, False, foreign, zero_tail=foreign)
    return dw2, dtw


_down_backward_op = torch.library.custom_op(
    "moeblaze::experts_down_backward", _down_backward_impl, mutates_args=("pre",),
    schema="(Tensor dout, Tensor(a!) pre, Tensor w2, Tensor? b2, Tensor topk_weights, Tensor offsets, "
           "Tensor indices, Tensor tile_expert, Tensor tile_row, Tensor num_tiles, Tensor token_index_map, "
           "Tensor token_expert_indices, str activation, float alpha, float limit, bool interleaved, bool foreign, "
           "bool need_dw, bool need_dtw, bool general, ScalarType? dw_dtype) -> (Tensor, Tensor)")


def down_backward_outputs(w2, topk_weights, token_index_map, need_dw, need_dtw, dw_dtype):
    """The fake outputs of a B1-B2 op (this module's and the FP8 one's): ``(dw2, dtopk_weights)``, placeholders
    for what is not needed."""
    return (_like_weight(w2, dw_dtype) if need_dw else _empty(w2),
            topk_weights.new_empty(token_index_map.shape) if need_dtw else _empty(topk_weights))


@_down_backward_op.register_fake
def _(dout, pre, w2, b2, topk_weights, offsets, indices, tile_expert, tile_row, num_tiles, token_index_map,
      token_expert_indices, activation, alpha, limit, interleaved, foreign, need_dw, need_dtw, general, dw_dtype):
    return down_backward_outputs(w2, topk_weights, token_index_map, need_dw, need_dtw, dw_dtype)


def down_backward(dout: Tensor, pre: Tensor, w2: Tensor, topk_weights: Tensor, index: DispatchIndex,
                  activation: str, need_dw: bool, need_dtw: bool, *, b2: Tensor | None = None,
                  act_args: ActArgs = DEFAULT_ACT,
                  dw_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """B1-B2 with the activation recomputed from ``pre``; ``dtopk_weights = <dout[t] w2[e], act> (+ <dout[t], b2[e]>)``.

    ``dpre`` is written over ``pre`` in place (``pre`` is dead after B1; this saves an ``[N, 2h]``
    buffer, 4Nh bytes in bf16, at the backward's peak). Autograd sees the change: a second backward
    through the same graph (``retain_graph=True``) raises PyTorch's in-place modification error.

    Args:
        dout: ``[T, d]``; pre: ``[N, 2h|h]`` with unit column stride (overwritten); w2: ``[E, d, h]``
            (one dtype); topk_weights: ``[T, K]``; b2: ``[E, d]`` or None; act_args: as :func:`up_forward`.
        dw_dtype: dtype of ``dw2`` (default ``w2.dtype``; fp32 for 16-bit operands: their rounded gradient upcast,
            stored in one pass).

    Returns:
        ``(dpre [N, 2h|h] = pre itself (fp32 at TF32 precision: rounded to TF32, the operand
        :func:`up_backward` reads), dw2 [E, d, h] in dw_dtype and w2's storage order | None,
        dtopk_weights [T, K] in topk_weights.dtype | None)``.

    Raises:
        TypeError, ValueError: as :func:`up_forward`; ValueError: ``pre`` without unit column stride.
    """
    check_activation(activation)
    _check("down_backward", dout=dout, pre=pre, w2=w2)
    if pre.dim() != 2 or pre.stride(-1) != 1:
        raise ValueError(f"triton down_backward: pre must be [N, 2h|h] with unit column stride (it is "
                         f"overwritten with dpre), got shape {tuple(pre.shape)} strides {pre.stride()}")
    dw2, dtw = call_op(_down_backward_op, _down_backward_impl,
                       dout, pre, w2, b2, topk_weights, index.local_offsets, index.expert_token_indices,
                       *_schedule(index), index.token_index_map, index.token_expert_indices, activation, *act_args,
                       index.foreign_experts, need_dw, need_dtw, index.is_general, dw_dtype,
                       mutated=(pre,))
    return pre, (dw2 if need_dw else None), (dtw if need_dtw else None)


# ---------------------------------------------------------------- B3-B5: up-projection backward

def _up_backward_impl(dpre, x, w1, offsets, indices, tile_expert, tile_row, num_tiles, token_index_map, foreign,
                      need_dx, need_dw, pair_offsets=None, dw_dtype=None):
    dpre, x = _rows_contig(dpre), _rows_contig(x)
    dx = None if need_dx else _empty(x)  # placeholders only for outputs not asked for
    dw1 = None if need_dw else _empty(w1)
    if need_dx:
        dx = slots_to_tokens(dpre, w1, False, offsets, indices, (tile_expert, tile_row, num_tiles), token_index_map,
                             None, foreign, pair_offsets)
    if need_dw:  # as dW1[e]^T = sum_s x[token]^T dpre[s]: the gathered operand on the A side (kernels.wgrad)
        dw1 = grad_in_storage(w1, x, dpre, offsets, indices, dw_dtype, True, foreign, zero_tail=foreign)
    return dx, dw1


_up_backward_op = torch.library.custom_op(
    "moeblaze::experts_up_backward", _up_backward_impl, mutates_args=(),
    schema="(Tensor dpre, Tensor x, Tensor w1, Tensor offsets, Tensor indices, Tensor tile_expert, "
           "Tensor tile_row, Tensor num_tiles, Tensor token_index_map, bool foreign, bool need_dx, "
           "bool need_dw, Tensor? pair_offsets, ScalarType? dw_dtype) -> (Tensor, Tensor)")


def up_backward_outputs(x, w1, need_dx, need_dw, dw_dtype):
    """The fake outputs of a B3-B5 / B4 op: ``(dx, dw1)``, placeholders for what is not needed."""
    return (x.new_empty(x.shape) if need_dx else _empty(x)), (_like_weight(w1, dw_dtype) if need_dw else _empty(w1))


@_up_backward_op.register_fake
def _(dpre, x, w1, offsets, indices, tile_expert, tile_row, num_tiles, token_index_map, foreign, need_dx, need_dw,
      pair_offsets, dw_dtype):
    return up_backward_outputs(x, w1, need_dx, need_dw, dw_dtype)


def up_backward(dpre: Tensor, x: Tensor, w1: Tensor, index: DispatchIndex, need_dx: bool, need_dw: bool, *,
                dw_dtype: torch.dtype | None = None) -> tuple[Tensor | None, Tensor | None]:
    """B3-B5: ``dx [T, d]`` (x.dtype) and ``dw1 [E, 2h|h, d]`` (``dw_dtype``, default w1.dtype, as for
    :func:`down_backward`; in w1's storage order: a transposed view for a transposed-view ``w1``); ``None``
    where not needed.

    Args:
        dpre: ``[N, 2h|h]`` in ``w1``'s row order; x: ``[T, d]``; w1: ``[E, 2h|h, d]`` (one dtype, any strides).

    fp32 at TF32 precision: ``dpre`` is read as TF32 values, as :func:`down_backward` stores it then (rounded);
    the tensor cores truncate any other low mantissa bits.

    Raises:
        TypeError, ValueError: as :func:`up_forward`.
    """
    _check("up_backward", dpre=dpre, x=x, w1=w1)
    dx, dw1 = call_op(_up_backward_op, _up_backward_impl, dpre, x, w1, index.local_offsets,
                      index.expert_token_indices, *_schedule(index), index.token_index_map, index.foreign_experts,
                      need_dx, need_dw, index.pair_offsets, dw_dtype)
    return (dx if need_dx else None), (dw1 if need_dw else None)


# ---------------------------------------------------------------- expert-bias gradients

def _bias_grad_impl(src, topk_weights, offsets, indices, token_index_map):
    src = _rows_contig(src)
    scale = None if topk_weights is None else slot_weights(topk_weights, token_index_map, torch.float32)
    return segment_sum(src, offsets, indices, scale, gather=topk_weights is not None, out_dtype=src.dtype)


_bias_grad_op = torch.library.custom_op(
    "moeblaze::experts_bias_grad", _bias_grad_impl, mutates_args=(),
    schema="(Tensor src, Tensor? topk_weights, Tensor offsets, Tensor indices, Tensor token_index_map) -> Tensor")


@_bias_grad_op.register_fake
def _(src, topk_weights, offsets, indices, token_index_map):
    return src.new_empty(offsets.shape[0] - 1, src.shape[1])


def bias_grad(src: Tensor, index: DispatchIndex, topk_weights: Tensor | None = None) -> Tensor:
    """Expert-bias gradients ``[E, cols]`` in ``src.dtype``, deterministic segment sums (no atomics).

    ``topk_weights`` None: ``db_gate_up[e] = sum_s dpre[s]`` with ``src = dpre [N, 2h|h]``; else
    ``db_down[e] = sum_s w_s * dout[token(s)]`` with ``src = dout [T, d]``. Foreign slots are excluded.

    Raises:
        TypeError: ``src`` not fp16/bf16/fp32.
    """
    _check("bias_grad", src=src)
    return call_op(_bias_grad_op, _bias_grad_impl, src, topk_weights, index.local_offsets,
                   index.expert_token_indices, index.token_index_map)
