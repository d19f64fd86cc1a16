"""The argument checks of the routed experts (:func:`moeblaze.moe_experts`, :func:`moeblaze.general_routing.
moe_experts_general`, :class:`moeblaze.MoE`): each raises naming the argument at fault and what was expected, before
any kernel sees it."""

from __future__ import annotations

import math

import torch

from .activations import GATED, check_activation, is_gated
from .dispatch import DispatchIndex

__all__ = ["SAVE_MODES", "check_devices", "check_inputs", "check_options", "check_placement", "check_tokens",
           "check_weight_dtypes", "check_weight_shapes"]

SAVE_MODES = ("preact", "input")


def check_weight_dtypes(x, w1, w2, autocast: bool) -> None:
    """The weights share ``x``'s dtype; under autocast (``x`` already cast) they are the master weights the
    Functions cast (any dtype :func:`moeblaze.amp.autocast_target` accepted). Weights that agree name ``x``.
    Raises TypeError naming the tensor of the wrong dtype."""
    if not autocast and w1.dtype == w2.dtype != x.dtype:
        raise TypeError(f"x has dtype {x.dtype}; expected the weights' dtype {w1.dtype} (w_gate_up and w_down): "
                        f"cast x, or the weights (a MoE layer: .to({x.dtype}))")
    for name, t in (("w_gate_up", w1), ("w_down", w2)):
        if t.dtype != x.dtype and not autocast:
            raise TypeError(f"{name} has dtype {t.dtype}; expected x's dtype {x.dtype}")


def check_devices(x: torch.Tensor, *named: tuple[str, object]) -> None:
    """Each tensor of the ``(name, value)`` pairs ``named`` is on ``x``'s device (other values are not looked at).
    Raises ValueError naming the first tensor elsewhere."""
    for name, t in named:
        if isinstance(t, torch.Tensor) and t.device != x.device:
            raise ValueError(f"{name} is on {t.device}; expected x's device {x.device}")


def check_placement(x: torch.Tensor, autocast: bool, *named: tuple[str, torch.Tensor | None]) -> None:
    """Each ``(name, tensor)`` of ``named`` (None: absent) is on ``x``'s device and, outside autocast, in its dtype
    (under autocast the Functions cast them: :func:`moeblaze.amp.autocast_target` checked what they may be).
    Raises TypeError (dtype) or ValueError (device) naming the tensor."""
    for name, t in named:
        if t is not None and t.dtype != x.dtype and not autocast:
            raise TypeError(f"{name} has dtype {t.dtype}; expected x's dtype {x.dtype}")
        check_devices(x, (name, t))


def check_tokens(x: torch.Tensor) -> None:
    """``x`` is a floating-point ``[T, d]`` tensor (the experts' tokens); else ValueError."""
    if not x.is_floating_point() or x.dim() != 2:
        raise ValueError(f"x must be a floating-point tensor of shape [T, d], got {x.dtype} {tuple(x.shape)}")


def check_inputs(x, topk_ids, topk_weights, w1, w2, activation, save, autocast, index=None) -> None:
    """The tensors of :func:`moeblaze.moe_experts`: types, shapes, dtypes (``autocast``: see
    :func:`check_weight_dtypes`), devices; ``activation`` and ``save`` known. Raises TypeError (a non-tensor, a
    dtype) or ValueError (a shape, a device, an unknown ``save`` or ``activation``) naming the argument."""
    for name, t in (("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    check_activation(activation)
    if save not in SAVE_MODES:
        raise ValueError(f"save must be one of {SAVE_MODES}, got {save!r}")
    check_tokens(x)
    T, d = x.shape
    if w1.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"w_gate_up and w_down must be rank 3, got {tuple(w1.shape)} and {tuple(w2.shape)}")
    check_weight_shapes(x, w1, w2, activation, getattr(index, "num_experts", None))
    if topk_ids.dim() != 2 or topk_ids.shape[0] != T:
        raise ValueError(f"topk_ids must have shape [T={T}, K], got {tuple(topk_ids.shape)}")
    if tuple(topk_weights.shape) != tuple(topk_ids.shape) or not topk_weights.is_floating_point():
        raise ValueError(f"topk_weights must be a float tensor of shape {tuple(topk_ids.shape)}, "
                         f"got {topk_weights.dtype} {tuple(topk_weights.shape)}")
    check_weight_dtypes(x, w1, w2, autocast)
    check_devices(x, ("topk_ids", topk_ids), ("topk_weights", topk_weights), ("w_gate_up", w1), ("w_down", w2))


def check_weight_shapes(x, w1, w2, activation, num_experts: int | None = None) -> None:
    """Name the tensor that is actually wrong: x when both weights agree on another d, else the weight (for E:
    w_down, unless ``num_experts``, the E of a given index, sides with it). Raises ValueError with the expected
    ``[E, 2h, d]`` / ``[E, d, h]`` shape."""
    d = x.shape[1]
    w1_name = "w_gate_up [E, 2h, d]" if is_gated(activation) else "w_up [E, h, d]"
    if w1.shape[2] != d and w2.shape[1] != d and w1.shape[2] == w2.shape[1]:
        raise ValueError(f"x must have shape [T, d={w1.shape[2]}] (the d of w_gate_up and w_down), "
                         f"got {tuple(x.shape)}")
    if w1.shape[2] != d:
        raise ValueError(f"{w1_name} must have last dimension d={d} (from x and w_down), got {tuple(w1.shape)}")
    if w2.shape[1] != d:
        raise ValueError(f"w_down [E, d, h] must have d={d} (from x and {w1_name.split()[0]}) in dimension 1, "
                         f"got {tuple(w2.shape)}")
    E, rows = w1.shape[0], w1.shape[1]
    h = rows // 2 if is_gated(activation) else rows
    if is_gated(activation) and rows % 2:
        raise ValueError(f"{w1_name} for activation {activation!r} needs an even number of rows (2h), "
                         f"got {tuple(w1.shape)}")
    if w2.shape[0] != E and num_experts == w2.shape[0]:  # the index's E: w_gate_up is the odd one
        raise ValueError(f"{w1_name} must have E={num_experts} experts in dimension 0 (the E of the index and "
                         f"w_down), got {tuple(w1.shape)}")
    if w2.shape[0] != E:
        raise ValueError(f"w_down [E, d, h] must have E={E} experts in dimension 0 (the E of {w1_name.split()[0]} "
                         f"{tuple(w1.shape)}), got {tuple(w2.shape)}")
    if w2.shape[2] != h:
        raise ValueError(f"w_down [E, d, h] has h={w2.shape[2]} but {w1_name} {tuple(w1.shape)} has "
                         f"h={h} (activation {activation!r})")


def check_options(x, w2, activation, b_gate_up, b_down, gate_up_interleaved, swiglu_alpha, swiglu_limit,
                   foreign_experts, index) -> None:
    """The keyword-only options of :func:`moeblaze.moe_experts` (biases, layout, activation parameters, foreign ids).
    Raises ValueError naming the option (TypeError for an ``index`` that is not a DispatchIndex)."""
    E, d, h = w2.shape
    rows = 2 * h if is_gated(activation) else h
    for name, b, shape in (("b_gate_up", b_gate_up, (E, rows)), ("b_down", b_down, (E, d))):
        if b is None:
            continue
        if not isinstance(b, torch.Tensor) or tuple(b.shape) != shape:
            got = tuple(b.shape) if isinstance(b, torch.Tensor) else type(b).__name__
            raise ValueError(f"{name} for activation {activation!r} must have shape {shape}, got {got}")
        check_placement(x, False, (name, b))  # under autocast the biases are cast already
    if gate_up_interleaved and not is_gated(activation):
        raise ValueError(f"gate_up_interleaved=True needs a gated activation {GATED}, got {activation!r}")
    for name, v in (("swiglu_alpha", swiglu_alpha), ("swiglu_limit", swiglu_limit)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"{name} must be a finite float, got {v!r}")
    if swiglu_limit <= 0:
        raise ValueError(f"swiglu_limit must be > 0, got {swiglu_limit!r}")
    if index is not None and not isinstance(index, DispatchIndex):
        raise TypeError(f"index must be a DispatchIndex (from moeblaze.build_dispatch) or None, got "
                        f"{type(index).__name__}")
    if index is not None and index.foreign_experts != bool(foreign_experts):
        raise ValueError(f"index was built with foreign_experts={index.foreign_experts}; "
                         f"expected foreign_experts={bool(foreign_experts)}")
