"""Routed experts with smart checkpointing (MoEBlaze §4.3, DESIGN.md §4-5).

``moe_experts`` runs the experts of a top-k MoE layer over the zero-buffer dispatch index. The
autograd graph is cut at the activation into two Functions (``save="preact"``) or fused into one
recompute Function (``save="input"``); each calls the four ops of a backend (``ops_torch`` or the
Triton ``kernels.experts``), documented in :mod:`moeblaze.ops_torch`.
"""

from __future__ import annotations

from types import ModuleType

import torch

from . import ops_torch, settings
from .activations import check_activation, is_gated
from .dispatch import DispatchIndex, TileSchedule, build_dispatch, with_schedule

__all__ = ["moe_experts", "schedule_block_m", "SAVE_MODES", "BACKENDS"]

SAVE_MODES = ("preact", "input")
BACKENDS = ("auto", "torch", "triton")
_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # the kernels' operand dtypes


def _index_from(tensors, num_experts: int, block_m: int) -> DispatchIndex:
    """The index from the Function arguments: its four arrays, then its tile schedule's three when ``block_m``."""
    schedule = TileSchedule(block_m, *tensors[4:]) if block_m else None
    return DispatchIndex(*tensors[:4], num_experts=num_experts, schedule=schedule)


def _index_args(index: DispatchIndex) -> tuple[int, tuple[torch.Tensor, ...]]:
    """``(block_m or 0, tensors)``: how an index travels through ``Function.apply`` (tensors, so saved-tensor
    hooks and torch.compile see them)."""
    if index.schedule is None:
        return 0, index.tensors()
    return index.schedule.block_m, index.tensors() + index.schedule.tensors()


class _UpProjection(torch.autograd.Function):
    """F1 / B3-B5: ``pre = x[token(s)] W_gate_up[e]^T`` and ``act = f(pre)`` (``act`` not differentiable).

    Saves ``x`` and the index; ``act`` is handed to :class:`_DownProjection` for its forward only.
    """

    @staticmethod
    def forward(ctx, x, w1, ops, activation, num_experts, block_m, *index_tensors):
        index = _index_from(index_tensors, num_experts, block_m)
        pre, act = ops.up_forward(x, w1, index, activation, store_pre=True, store_act=True)
        ctx.save_for_backward(x, w1, *index_tensors)
        ctx.ops, ctx.num_experts, ctx.block_m = ops, num_experts, block_m
        ctx.mark_non_differentiable(act)
        ctx.set_materialize_grads(False)  # else autograd fills a zero [N, h] gradient for act every step
        return pre, act

    @staticmethod
    def backward(ctx, dpre, _dact):
        x, w1, *index_tensors = ctx.saved_tensors
        if dpre is None:  # the output does not depend on pre (grads are not materialised)
            return (None,) * (6 + len(index_tensors))
        index = _index_from(index_tensors, ctx.num_experts, ctx.block_m)
        dx, dw1 = ctx.ops.up_backward(dpre.contiguous(), x, w1, index,
                                      ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        return (dx, dw1, None, None, None, None) + (None,) * len(index_tensors)


class _DownProjection(torch.autograd.Function):
    """F2-F3 / B1-B2: ``out[t] = sum_k w[t,k] act[s] W_down[e]^T`` with ``s = map[t,k]``.

    Saves ``pre`` (not ``act``, not ``y``): backward recomputes ``act = f(pre)`` (N*h elementwise ops)
    and gets ``d topk_weights`` from ``<dout[t] W_down[e], act[s]>``, so no expert output is kept.
    """

    @staticmethod
    def forward(ctx, pre, act, w2, topk_weights, ops, activation, num_experts, block_m, *index_tensors):
        index = _index_from(index_tensors, num_experts, block_m)
        out = ops.down_forward(act, w2, topk_weights, index)
        ctx.save_for_backward(pre, w2, topk_weights, *index_tensors)
        ctx.ops, ctx.activation, ctx.num_experts, ctx.block_m = ops, activation, num_experts, block_m
        return out

    @staticmethod
    def backward(ctx, dout):
        pre, w2, topk_weights, *index_tensors = ctx.saved_tensors
        index = _index_from(index_tensors, ctx.num_experts, ctx.block_m)
        dpre, dw2, dtw = ctx.ops.down_backward(dout.contiguous(), pre, w2, topk_weights, index,
                                               ctx.activation, ctx.needs_input_grad[2],
                                               ctx.needs_input_grad[3])
        return (dpre, None, dw2, dtw, None, None, None, None) + (None,) * len(index_tensors)


class _ExpertsRecompute(torch.autograd.Function):
    """``save="input"``: the whole expert block, saving only ``x``, ``topk_weights`` and the index.

    Bytes saved versus ``"preact"``: the pre-activation, ``N*2h*elt`` (4Nh bytes in bf16; 256 MiB
    at T=32k, K=8, h=256). FLOPs added: the up-projection again in backward, ``4*N*d*h`` (+22% of the
    layer's 18*N*d*h forward+backward).
    """

    @staticmethod
    def forward(ctx, x, w1, w2, topk_weights, ops, activation, num_experts, block_m, *index_tensors):
        index = _index_from(index_tensors, num_experts, block_m)
        _, act = ops.up_forward(x, w1, index, activation, store_pre=False, store_act=True)
        out = ops.down_forward(act, w2, topk_weights, index)
        ctx.save_for_backward(x, w1, w2, topk_weights, *index_tensors)
        ctx.ops, ctx.activation, ctx.num_experts, ctx.block_m = ops, activation, num_experts, block_m
        return out

    @staticmethod
    def backward(ctx, dout):
        x, w1, w2, topk_weights, *index_tensors = ctx.saved_tensors
        index = _index_from(index_tensors, ctx.num_experts, ctx.block_m)
        ops, need = ctx.ops, ctx.needs_input_grad
        pre, _ = ops.up_forward(x, w1, index, ctx.activation, store_pre=True, store_act=False)
        dpre, dw2, dtw = ops.down_backward(dout.contiguous(), pre, w2, topk_weights, index,
                                           ctx.activation, need[2], need[3])
        del pre
        dx, dw1 = ops.up_backward(dpre, x, w1, index, need[0], need[1])
        return (dx, dw1, dw2, dtw, None, None, None, None) + (None,) * len(index_tensors)


def _select_ops(backend: str, x: torch.Tensor) -> ModuleType:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        chosen = settings.get("backend")
        kernels_fit = x.is_cuda and x.dtype in _TRITON_DTYPES and _triton_experts_available()
        backend = chosen if chosen != "auto" else ("triton" if kernels_fit else "torch")
    if backend == "torch":
        return ops_torch
    if not x.is_cuda and not settings.interpreting():
        raise ValueError(f"backend='triton' needs CUDA tensors (x is on {x.device}); use backend='torch' "
                         "or set TRITON_INTERPRET=1 to run the kernels in Triton's CPU interpreter")
    from .kernels import experts as ops_triton

    return ops_triton


def _triton_experts_available() -> bool:
    try:
        from .kernels import experts  # noqa: F401
    except ImportError:
        return False
    return True


def _check_inputs(x, topk_ids, topk_weights, w1, w2, activation, save) -> None:
    check_activation(activation)
    if save not in SAVE_MODES:
        raise ValueError(f"save must be one of {SAVE_MODES}, got {save!r}")
    if not x.is_floating_point() or x.dim() != 2:
        raise ValueError(f"x must be a floating-point tensor of shape [T, d], got {x.dtype} {tuple(x.shape)}")
    T, d = x.shape
    if w1.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"w_gate_up and w_down must be rank 3, got {tuple(w1.shape)} and {tuple(w2.shape)}")
    E, h = w2.shape[0], w2.shape[2]
    rows = 2 * h if is_gated(activation) else h
    if tuple(w1.shape) != (E, rows, d):
        name = "w_gate_up [E, 2h, d]" if is_gated(activation) else "w_up [E, h, d]"
        raise ValueError(f"{name} for activation {activation!r} must have shape {(E, rows, d)} "
                         f"(from w_down {tuple(w2.shape)} and x {tuple(x.shape)}), got {tuple(w1.shape)}")
    if w2.shape[1] != d:
        raise ValueError(f"w_down must have shape [E, d={d}, h], got {tuple(w2.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != T:
        raise ValueError(f"topk_ids must have shape [T={T}, K], got {tuple(topk_ids.shape)}")
    if tuple(topk_weights.shape) != tuple(topk_ids.shape) or not topk_weights.is_floating_point():
        raise ValueError(f"topk_weights must be a float tensor of shape {tuple(topk_ids.shape)}, "
                         f"got {topk_weights.dtype} {tuple(topk_weights.shape)}")
    for name, t in (("w_gate_up", w1), ("w_down", w2)):
        if t.dtype != x.dtype:
            raise TypeError(f"{name} has dtype {t.dtype}; expected x's dtype {x.dtype}")
    for name, t in (("topk_ids", topk_ids), ("topk_weights", topk_weights), ("w_gate_up", w1),
                    ("w_down", w2)):
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device}; expected x's device {x.device}")


def moe_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    activation: str = "swiglu",
    save: str = "preact",
    backend: str = "auto",
    index: DispatchIndex | None = None,
) -> torch.Tensor:
    """Routed experts of a dropless top-k MoE layer: ``out[t] = sum_k w[t,k] * FFN_e(x[t])``.

    The MoEBlaze dataflow (arXiv 2601.05296 §4; DESIGN.md §2, §4, §5): experts read rows of the
    unpermuted ``x`` through the dispatch index; no gathered copy of ``x``, no activation and no expert
    output survives to the backward pass.

    Args:
        x: ``[T, d]`` tokens, fp32/fp16/bf16 (fp64 on the ``torch`` backend).
        topk_ids: ``[T, K]`` int32/int64 expert ids, distinct per row, in ``[0, E)``.
        topk_weights: ``[T, K]`` float router weights (any float dtype; gets a gradient).
        w_gate_up: ``[E, 2h, d]`` (gate rows then up rows) for ``swiglu``/``geglu``; ``w_up [E, h, d]``
            for ``silu``/``gelu``/``relu``. Same dtype as ``x``.
        w_down: ``[E, d, h]``, same dtype as ``x``.
        activation: ``"swiglu"`` (default), ``"geglu"``, ``"silu"``, ``"gelu"`` or ``"relu"``.
        save: ``"preact"`` keeps ``x``, the pre-activation ``[N, 2h]`` and the index (2Td + 4Nh + O(N)
            bytes in bf16); ``"input"`` keeps ``x`` and the index only (2Td + O(N)) and recomputes the
            up-projection in backward (+4Ndh FLOPs).
        backend: ``"auto"`` (Triton on CUDA for fp16/bf16/fp32, else PyTorch; env
            ``MOEBLAZE_BACKEND=torch|triton`` overrides), ``"torch"`` or ``"triton"``.
        index: a prebuilt :class:`DispatchIndex` of ``topk_ids`` (built here when ``None``).

    Returns:
        ``[T, d]`` tensor in ``x.dtype``.

    Raises:
        ValueError: bad shapes, devices, activation, save mode or backend; ids out of range.
        TypeError: dtype mismatch between ``x`` and the weights, or non-integer ``topk_ids``.
    """
    _check_inputs(x, topk_ids, topk_weights, w_gate_up, w_down, activation, save)
    E = w_down.shape[0]
    if index is None:
        index = build_dispatch(topk_ids, E)
    elif index.num_experts != E or tuple(index.token_index_map.shape) != tuple(topk_ids.shape):
        raise ValueError(f"index was built for E={index.num_experts}, [T, K]={tuple(index.token_index_map.shape)}; "
                         f"expected E={E}, [T, K]={tuple(topk_ids.shape)}")
    ops = _select_ops(backend, x)
    bm = _schedule_block_m(ops)
    if bm is not None:  # the grouped GEMMs' tile schedule, built once for the four ops (if not with the index)
        index = with_schedule(index, bm)
    bm, idx = _index_args(index)
    if save == "input":
        return _ExpertsRecompute.apply(x, w_gate_up, w_down, topk_weights, ops, activation, E, bm, *idx)
    pre, act = _UpProjection.apply(x, w_gate_up, ops, activation, E, bm, *idx)
    return _DownProjection.apply(pre, act, w_down, topk_weights, ops, activation, E, bm, *idx)


def _schedule_block_m(ops: ModuleType) -> int | None:
    """BLOCK_M of the tile schedule the backend's grouped GEMMs need (None: the backend needs none)."""
    fn = getattr(ops, "schedule_block_m", None)
    return fn() if fn is not None else None


def schedule_block_m(backend: str, x: torch.Tensor) -> int | None:
    """The ``block_m`` to pass to :func:`moeblaze.build_dispatch` so that the index it builds carries the
    tile schedule that ``moe_experts(x, ..., backend=backend)`` will use (None: no schedule needed).

    Raises:
        ValueError: as :func:`moe_experts` for a bad backend or device.
    """
    return _schedule_block_m(_select_ops(backend, x))
