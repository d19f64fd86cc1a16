"""The expert GEMMs under an FP8 recipe, emulated in PyTorch (DESIGN.md §8): quantize, dequantize, fp32 GEMM.

Each GEMM of DESIGN.md §5 quantizes its two operands along its reduction dimension with the
:class:`moeblaze.fp8.Float8Recipe` (e4m3 values, fp32 scales), dequantizes them to fp32 and multiplies in
fp32; the rest (gather, activation, combine, router-weight gradient) is the ``torch`` backend's
(:mod:`moeblaze.ops_torch`) on fp32 tensors. It defines what the FP8 kernels compute, up to the order of
fp32 sums, and runs the recipe on any device.

| GEMM | operand A, quantized along | operand B, quantized along |
|---|---|---|
| F1 ``pre = x[token(s)] w1[e]^T`` | x [T, d]: d | w1 [E, 2h, d]: d |
| F2 ``y = act w2[e]^T`` | act [N, h]: h | w2 [E, d, h]: h |
| B1 ``dact' = dout[token(s)] w2[e]`` | dout [T, d]: d | w2: d |
| B2 ``dw2[e] = dout[token(s)]^T (w act)`` | dout gathered [N, d]: the expert's slots (b) | w act [N, h]: slots (b) |
| B3 ``dx_slots = dpre w1[e]`` | dpre [N, 2h]: 2h | w1: 2h |
| B4 ``dw1[e] = dpre^T x[token(s)]`` | dpre: slots (b) | x gathered: slots (b) |

(b) blockwise only: the rowwise recipe runs B2 and B4 on the 16-bit operands, as its Triton kernels do
(:mod:`moeblaze.kernels.fp8_experts` says why).

x is quantized once in forward (F1's operand); backward reads the layer's 16-bit x (``"input"`` quantizes it again
for F1's recomputation, bitwise the forward's). ``dout`` reaches B1 and the down bias's share of
``dtopk_weights`` in e4m3.

Shapes as :mod:`moeblaze.ops_torch`; all results fp32 except the weight gradients, rounded through the
weight's compute dtype into ``dw_dtype`` as there. Per-expert loops read the offsets on the host.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import ops_torch
from .activations import DEFAULT_ACT, ActArgs, activation_forward, is_gated
from .dispatch import DispatchIndex
from .fp8 import Float8Recipe, Float8Tensor, weight_copy
from .shared_ops import slot_weights

INTERLEAVED_GATE_UP = True  # reads w_gate_up's alternating gate and up rows (GPT-OSS) as they are

__all__ = ["quantize_rows", "dequantize", "up_forward", "down_forward", "down_backward", "up_backward", "bias_grad"]

bias_grad = ops_torch.bias_grad  # sums of the 16-bit dpre and dout rows, as the 16-bit path's


def quantize_rows(recipe: Float8Recipe, t: Tensor) -> Float8Tensor:
    """An activation-like operand (x; the rows expert parallelism sends) in the recipe's tiles:
    :meth:`moeblaze.fp8.Float8Recipe.quantize_rows`."""
    return recipe.quantize_rows(t)


def dequantize(q: Float8Tensor, dtype: torch.dtype) -> Tensor:
    """``q``'s values in fp32 (the emulation computes in fp32; ``dtype`` is the Triton ops' and unused here)."""
    return q.dequantize()


def _kept_values(pre: Tensor | Float8Tensor) -> Tensor:
    """``pre [N, 2h|h]`` as the activation backward reads it: the kept e4m3 tiles in fp32, or the tensor."""
    if isinstance(pre, Float8Tensor):
        return pre.dequantize().flatten(1)
    return pre


def _weight(recipe: Float8Recipe, w: Tensor, reduce_cols: bool, dtype: torch.dtype | None) -> Tensor:
    """The weight's cast to the compute ``dtype`` (None: ``w``'s) quantized by the recipe, as fp32 (kept over
    micro-batches inside :func:`moeblaze.fp8.reuse_weights`)."""
    return weight_copy(w, ("emulation", recipe, reduce_cols, dtype),
                       lambda: recipe.quantize_weight(w.to(dtype or w.dtype), reduce_cols=reduce_cols).dequantize())


def up_forward(recipe: Float8Recipe, xq: Float8Tensor, w1: Tensor, index: DispatchIndex, activation: str, *,
               store_act: bool = True, b1: Tensor | None = None, act_args: ActArgs = DEFAULT_ACT,
               keep: bool = False,
               dtype: torch.dtype | None = None) -> tuple[Tensor | Float8Tensor, Tensor | None, None]:
    """F1: ``pre = x[token(s)] w1[e]^T (+ b1[e])`` from the e4m3 ``xq`` (``x [T, d]`` in rows of the recipe's
    tiles) and ``w1 [E, 2h | h, d]``; ``act = f(pre)`` with ``store_act``. Returns ``(pre [N, 2h | h],
    act [N, h] | None, None)`` fp32; with ``keep`` ``pre`` as kept for backward
    (:meth:`moeblaze.fp8.Float8Recipe.quantize_kept`), ``act`` from the unquantized ``pre``. (The Triton ops
    return the weight's column maxima third, for B3's copy of it; here the backward quantizes the weight anew.)
    ``dtype`` (every op's): the 16-bit compute dtype of the call, whose cast of a wider (fp32 master) weight the
    recipe quantizes (default: the weight's dtype)."""
    w = _weight(recipe, w1, True, dtype)
    pre, act = ops_torch.up_forward(xq.dequantize(), w, index, activation, store_pre=True, store_act=store_act,
                                    b1=b1, act_args=act_args)
    return (recipe.quantize_kept(pre, is_gated(activation)) if keep else pre), act, None


def down_forward(recipe: Float8Recipe, act: Tensor, w2: Tensor, topk_weights: Tensor, index: DispatchIndex, *,
                 b2: Tensor | None = None, dtype: torch.dtype | None = None) -> tuple[Tensor, None]:
    """F2 ``y = act w2[e]^T (+ b2[e])`` and the fp32 combine F3: ``act [N, h]``, ``w2 [E, d, h]`` ->
    ``(out [T, d] fp32, None)`` (None: as :func:`up_forward`'s third)."""
    a = recipe.quantize_rows(act).dequantize()
    w = _weight(recipe, w2, True, dtype)
    return ops_torch.down_forward(a, w, topk_weights, index, b2=b2), None


def down_backward(recipe: Float8Recipe, dout: Tensor, pre: Tensor, w2: Tensor, topk_weights: Tensor,
                  index: DispatchIndex, activation: str, need_dw: bool, need_dtw: bool, *, b2: Tensor | None = None,
                  act_args: ActArgs = DEFAULT_ACT, dw_dtype: torch.dtype | None = None,
                  dpre_q: Float8Tensor | None = None, dtype: torch.dtype | None = None,
                  w_amax: Tensor | None = None) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """B1 ``dact' = dout[token(s)] w2[e]`` with ``act = f(pre)`` recomputed, ``dtopk_weights`` and ``dpre``;
    B2 ``dw2[e] = dout[token(s)]^T (w act)``. ``dpre_q`` (where the Triton ops write B3's e4m3 ``dpre``) is not
    used here: :func:`up_backward` quantizes ``dpre`` itself, to the same values; nor ``w_amax`` (the Triton ops'
    column maxima of ``w2`` from the forward).

    Args: ``dout [T, d]``, ``pre [N, 2h | h]`` (fp32, recomputed; or the kept e4m3 tiles of :func:`up_forward`'s
    ``keep``), ``w2 [E, d, h]``, ``topk_weights [T, K]``.
    Returns: ``(dpre [N, 2h | h] fp32, dw2 [E, d, h] in dw_dtype | None, dtopk_weights | None)``.
    """
    pre = _kept_values(pre)
    g = recipe.quantize_rows(dout).dequantize()
    w = _weight(recipe, w2, False, dtype)
    dpre, _, dtw = ops_torch.down_backward(g, pre, w, topk_weights, index, activation, False, need_dtw, b2=b2,
                                           act_args=act_args)
    dw2 = None
    if need_dw:
        offsets, tokens = index.local_offsets, index.expert_token_indices.long()
        act = activation_forward(pre, activation, **act_args._asdict())
        w_act = act * slot_weights(topk_weights, index.token_index_map, torch.float32)[:, None]
        a, b = dout.index_select(0, tokens).float(), w_act
        if recipe.granularity == "blockwise":
            a, b = (recipe.quantize_slots(t, offsets).dequantize() for t in (a, b))
        dw2 = ops_torch.grouped_weight_grad(a, b, offsets).to(dtype or w2.dtype).to(dw_dtype or w2.dtype)
    return dpre, dw2, dtw


def up_backward(recipe: Float8Recipe, dpre: Tensor, x: Tensor, w1: Tensor, index: DispatchIndex,
                need_dx: bool, need_dw: bool, *, dw_dtype: torch.dtype | None = None,
                reuse: Float8Tensor | None = None, quantized: bool = False, dtype: torch.dtype | None = None,
                w_amax: Tensor | None = None) -> tuple[Tensor | None, Tensor | None]:
    """B3 ``dx_slots = dpre w1[e]`` with B5 ``dx[t] = sum_k dx_slots[map[t,k]]``, and B4
    ``dw1[e] = dpre^T x[token(s)]``. ``reuse`` (the kept e4m3 ``pre``, where the Triton ops write B3's e4m3 ``dpre``),
    ``quantized`` and ``w_amax`` are not used here: the emulation's memory is not the kernels'.

    Args: ``dpre [N, 2h | h]`` fp32, ``x [T, d]`` (the layer's 16-bit input), ``w1 [E, 2h | h, d]``.
    Returns: ``(dx [T, d] fp32 | None, dw1 [E, 2h | h, d] in dw_dtype | None)``.
    """
    dx = dw1 = None
    if need_dx:
        a = recipe.quantize_rows(dpre).dequantize()
        w = _weight(recipe, w1, False, dtype)
        dx, _ = ops_torch.up_backward(a, x.float(), w, index, True, False)
    if need_dw:
        offsets = index.local_offsets
        a, b = dpre, x.float().index_select(0, index.expert_token_indices.long())
        if recipe.granularity == "blockwise":
            a, b = (recipe.quantize_slots(t, offsets).dequantize() for t in (a, b))
        dw1 = ops_torch.grouped_weight_grad(a, b, offsets).to(dtype or w1.dtype).to(dw_dtype or w1.dtype)
    return dx, dw1
