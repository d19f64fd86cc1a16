"""Automatic mixed precision (``torch.autocast``) for the experts and the router.

The contract is ``torch.nn.Linear``'s: under ``torch.autocast(device_type, dtype)`` the GEMMs run in the
autocast dtype on casts of their operands (``x``, ``w_gate_up``, ``w_down``, the router weight), each cast
once per call, and fp32 parameters — "master weights" — receive fp32 gradients. The casts of ``x``, the
biases and the router weight are made by :func:`autocast_operands` *before* the autograd Functions (an
ordinary differentiable ``.to``). The expert weights are cast inside the experts' Functions
(:mod:`moeblaze.experts`), whose weight-gradient kernels then store the fp32 gradient directly — the
16-bit gradient upcast, bitwise what autograd's cast backward gives, in one pass instead of a 16-bit
store, a read and an fp32 write (3.6 GB of memory traffic per step at Qwen3-30B-A3B's expert shape). Inside the
Functions autocast is switched off (:func:`autocast_off`): the kernels and the torch backend choose their
own precisions (fp32 sums, an fp32 combine, fp32 router logits), which autocast must not cast again, also
when ``backward`` is called inside the autocast region.

Why not ``torch.amp.custom_fwd(cast_inputs=...)``: it is bound to one device type and one dtype at
decoration time, casts inside ``forward`` where autograd does not see the cast, and would cast every
floating-point argument, the fp32 router weights ``topk_weights`` included (their fp32 combine is part
of the contract). :func:`autocast_off` is ``torch.amp.custom_bwd`` for whichever device the call runs on.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["autocast_dtype", "autocast_target", "autocast_operands", "autocast_off", "AUTOCAST_OPERAND_DTYPES"]

# What autocast casts (fp64 is never cast by torch's autocast, as in torch.nn.Linear) and what the
# kernels run.
AUTOCAST_OPERAND_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_AUTOCAST_DEVICE_TYPES = ("cuda", "cpu", "xpu", "mps")


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype of the ``torch.autocast`` region active for ``device_type`` (``"cuda"``, ``"cpu"``, ...),
    or ``None`` when autocast is off there (or the device type has no autocast)."""
    # A fixed set rather than torch.amp.is_autocast_available: dynamo cannot trace that one (torch 2.11,
    # tests/test_autocast.py::test_gpu_torch_compile_fullgraph_under_autocast).
    if device_type not in _AUTOCAST_DEVICE_TYPES or not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def autocast_target(x: torch.Tensor, *weights: tuple[str, torch.Tensor]) -> torch.dtype | None:
    """The dtype that ``x`` and ``weights`` are cast to under the autocast of ``x``'s device, or ``None``
    (autocast off there, or a tensor that is not floating point: the caller's checks report that).

    Args:
        x: ``[T, d]`` tokens (named ``x`` in errors). weights: ``(name, tensor)`` pairs.

    Raises:
        TypeError: under autocast, an operand that autocast does not cast (fp64) or an autocast dtype
            the kernels do not run, naming every dtype involved.
    """
    dtype = autocast_dtype(x.device.type)
    named = (("x", x), *weights)
    if dtype is None or not all(t.is_floating_point() for _, t in named):
        return None
    if dtype not in AUTOCAST_OPERAND_DTYPES or any(t.dtype not in AUTOCAST_OPERAND_DTYPES for _, t in named):
        got = ", ".join(f"{name} {t.dtype}" for name, t in named)
        raise TypeError(f"under torch.autocast({x.device.type!r}, dtype={dtype}) moeblaze runs its GEMMs on operands "
                        f"cast to the autocast dtype; got {got}: autocast casts fp32/fp16/bf16 (never fp64) to "
                        "fp16 or bf16 — use fp32 parameters, or run float64 outside autocast")
    return dtype


def autocast_operands(x: torch.Tensor, *weights: tuple[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """``(x, *weights)`` cast to the autocast dtype of ``x``'s device (:func:`autocast_target`), or
    unchanged outside autocast.

    Args:
        x: ``[T, d]`` tokens (named ``x`` in errors).
        weights: ``(name, tensor)`` pairs (e.g. ``("router.weight", w)``), cast alike.

    Returns:
        The tensors in the autocast dtype (``.to``: differentiable, a no-op where the dtype already
        matches), or as given.

    Raises:
        TypeError: as :func:`autocast_target`.
    """
    dtype = autocast_target(x, *weights)
    if dtype is None:
        return (x, *(t for _, t in weights))
    return (x.to(dtype), *(t.to(dtype) for _, t in weights))


def autocast_off(method: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate an autograd Function's ``forward`` or ``backward``: run it with autocast off on the device
    of the call (``forward`` records it from its first tensor argument as ``ctx.autocast_device``).

    Outside autocast this adds one check and no context manager (host time matters at small T). While
    dynamo traces a ``backward`` it runs as is: entering autocast there trips dynamo's global-state check
    (torch 2.13), and the compiled backward already matches eager's bitwise
    (``tests/test_autocast.py::test_torch_compile_fullgraph_under_autocast``).
    """
    forward = method.__name__ == "forward"

    @functools.wraps(method)
    def run(ctx, *args):
        if forward:
            ctx.autocast_device = next(a for a in args if isinstance(a, torch.Tensor)).device.type
        device = ctx.autocast_device
        if autocast_dtype(device) is None or (not forward and torch.compiler.is_compiling()):
            return method(ctx, *args)
        with torch.autocast(device, enabled=False):
            return method(ctx, *args)

    return run
