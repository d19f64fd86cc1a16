"""Expert backends as objects: one interface, the ``torch`` and ``triton`` implementations (DESIGN.md §5).

A backend does two things for :func:`moeblaze.moe_experts`:

- **plans the dispatch**: ``plan(topk_ids, E)`` / ``plan_pairs(token_idx, expert_idx, T, E)`` build the
  zero-buffer index (:mod:`moeblaze.dispatch`) together with the grouped-GEMM tile schedule its kernels
  read, for the M tile of its ``block_m`` (the Triton backend's: :func:`moeblaze.kernels.tuning.block_m`, the
  one function that chooses it);
- **runs the five expert ops** the autograd Functions of :mod:`moeblaze.experts` call:

``up_forward(x, w1, index, activation, store_pre, store_act, *, b1, act_args) -> (pre | None, act | None)``  F1
``up_backward(dpre, x, w1, index, need_dx, need_dw, *, dw_dtype) -> (dx | None, dw1 | None)``  B3-B5
``down_forward(act, w2, topk_weights, index, *, b2) -> out``                                F2-F3
``down_backward(dout, pre, w2, topk_weights, index, activation, need_dw, need_dtw, *, b2, act_args, dw_dtype)
    -> (dpre, dw2 | None, dtopk_weights | None)``                                           B1-B2
``bias_grad(src, index, topk_weights=None) -> [E, cols]``   expert-bias gradients (segment sums)

and, as ``fp8_ops``, ``quantize_rows``, ``dequantize`` and the four GEMM ops under an FP8 recipe
(:mod:`moeblaze.ops_fp8` gives their signatures: the torch backend's PyTorch emulation; the Triton backend's
:mod:`moeblaze.kernels.fp8_experts`, rowwise recipe), and ``INTERLEAVED_GATE_UP``: whether they read alternating
gate and up rows (else the experts' Function regroups them).

Shapes: ``x [T, d]``, ``w1 [E, 2h | h, d]``, ``pre [N, 2h | h]``, ``act [N, h]``, ``w2 [E, d, h]``,
``topk_weights [T, K]`` (``[P]`` for a general index), ``out [T, d]``; rows of ``[N, ...]`` tensors are
*slots* (DESIGN.md §3). ``b1 [E, 2h | h]`` / ``b2 [E, d]`` are the optional expert biases; ``act_args``
the :class:`moeblaze.activations.ActArgs` of the activation. ``dw_dtype`` (default: the weight's dtype):
the dtype of the weight gradient, computed in the weight's dtype and then cast — fp32 for the fp32 master
weights of an autocast call, whose 16-bit casts the ops receive (the kernels store it so directly).
An index with ``foreign_experts`` has slots ``>= offsets[E]`` of other ranks' experts: no op computes
them, the combines and ``dtopk_weights`` count them as zero. ``down_backward`` may return ``dpre`` in the
storage of ``pre`` (the Triton op writes it in place): callers must not use ``pre`` afterwards.

Adding a backend: a module with the five ops, a :class:`Backend` subclass here naming them and its
``block_m``, and an entry in :func:`get_backend`.
"""

from __future__ import annotations

from types import ModuleType

import torch

from . import ops_fp8, ops_torch, settings
from .dispatch import DispatchIndex, build_dispatch, build_dispatch_pairs, with_schedule

__all__ = ["BACKENDS", "Backend", "TorchBackend", "TritonBackend", "create_backends", "get_backend", "triton_available"]

BACKENDS = ("auto", "torch", "triton")
_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # the kernels' operand dtypes


class Backend:
    """The interface: dispatch planning and the five expert ops of the module docstring.

    Attributes:
        name: ``"torch"`` or ``"triton"``.
        fp8_ops: the module of the FP8 ops (see the module docstring).
    """

    name = ""

    def __init__(self, ops: ModuleType, fp8_ops: ModuleType):
        self.fp8_ops = fp8_ops
        self.up_forward = ops.up_forward
        self.up_backward = ops.up_backward
        self.down_forward = ops.down_forward
        self.down_backward = ops.down_backward
        self.bias_grad = ops.bias_grad

    def block_m(self, num_pairs: int | None = None, num_experts: int | None = None) -> int | None:
        """Slots per M-tile of this backend's grouped GEMMs for N = ``num_pairs`` and E = ``num_experts``
        (None: the backend reads no tile schedule)."""
        return None

    def plan(self, topk_ids: torch.Tensor, num_experts: int, *, validate: bool = True,
             foreign_experts: bool = False) -> DispatchIndex:
        """The index of a top-k routing ``topk_ids [T, K]`` with this backend's tile schedule
        (:func:`moeblaze.build_dispatch`; same arguments, errors and contract)."""
        bm = self.block_m(topk_ids.numel(), num_experts)
        return build_dispatch(topk_ids, num_experts, validate=validate, block_m=bm, foreign_experts=foreign_experts)

    def plan_pairs(self, token_idx: torch.Tensor, expert_idx: torch.Tensor, num_tokens: int, num_experts: int, *,
                   validate: bool = True, foreign_experts: bool = False,
                   pair_offsets: torch.Tensor | None = None) -> DispatchIndex:
        """The index of general routing inputs (``[P]`` pairs) with this backend's tile schedule
        (:func:`moeblaze.dispatch.build_dispatch_pairs`; same arguments, errors and contract)."""
        bm = self.block_m(expert_idx.numel(), num_experts)
        return build_dispatch_pairs(token_idx, expert_idx, num_tokens, num_experts, validate=validate, block_m=bm,
                                    foreign_experts=foreign_experts, pair_offsets=pair_offsets)

    def scheduled(self, index: DispatchIndex) -> DispatchIndex:
        """``index`` with the tile schedule this backend's ops read (itself when it has it or needs none:
        one small launch otherwise)."""
        bm = self.block_m(index.num_pairs, index.num_experts)
        return index if bm is None else with_schedule(index, bm)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class TorchBackend(Backend):
    """PyTorch ops (:mod:`moeblaze.ops_torch`): any device and dtype (fp64 for the reference checks);
    ``grouped_mm`` on CUDA bf16, a per-expert loop otherwise. Reads no tile schedule."""

    name = "torch"

    def __init__(self):
        super().__init__(ops_torch, ops_fp8)


class TritonBackend(Backend):
    """The fused Triton kernels (:mod:`moeblaze.kernels.experts`): CUDA (or ``TRITON_INTERPRET=1``), fp16,
    bf16 and fp32."""

    name = "triton"

    def __init__(self):
        from .kernels import experts, fp8_experts, tuning

        super().__init__(experts, fp8_experts)
        self._tuning = tuning  # the module: its block_m is looked up at each call, as the kernels' launchers do

    def block_m(self, num_pairs: int | None = None, num_experts: int | None = None) -> int:
        """128 on the GPU (32 under the interpreter), half of it for few tokens per expert
        (:func:`moeblaze.kernels.tuning.block_m`, which the ops and launchers call too); without N and E the
        large bucket's."""
        return self._tuning.block_m(num_pairs, num_experts)


_INSTANCES: dict[str, Backend] = {}


def _instance(name: str) -> Backend:
    if name not in _INSTANCES:  # one object per backend: the autograd Functions keep it in ctx
        _INSTANCES[name] = TorchBackend() if name == "torch" else TritonBackend()
    return _INSTANCES[name]


def create_backends() -> None:
    """Create the backend objects now (the Triton one where it imports): ``torch.compile`` then never traces
    their first creation, whose guard on this registry would compile every graph a second time."""
    _instance("torch")
    triton_available()


def triton_available() -> bool:
    """Whether the Triton backend imports (Triton installed and its kernels load)."""
    try:
        _instance("triton")
    except ImportError:
        return False
    return True


def get_backend(name: str, x: torch.Tensor) -> Backend:
    """The backend that runs the experts on ``x``.

    Args:
        name: ``"auto"`` (the ``backend`` setting of :mod:`moeblaze.settings` when it names one, else Triton on
            CUDA for fp16/bf16/fp32 and PyTorch otherwise), ``"torch"`` or ``"triton"``.
        x: ``[T, d]`` tokens (their device and dtype decide ``"auto"`` and are checked for ``"triton"``).

    Raises:
        ValueError: an unknown name; ``"triton"`` where its kernels do not import (no triton installed), for a CPU
            tensor without ``TRITON_INTERPRET=1``, or for bfloat16 under the interpreter (its bf16 dot products are
            wrong).
        TypeError: ``"triton"`` for a dtype other than fp16/bf16/fp32.
    """
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    asked = "backend='triton'"
    if name == "auto":
        chosen = settings.get("backend")
        kernels_fit = x.is_cuda and x.dtype in _TRITON_DTYPES and triton_available()
        name = chosen if chosen != "auto" else ("triton" if kernels_fit else "torch")
        asked = "the backend setting 'triton' (moeblaze.settings, MOEBLAZE_BACKEND)"
    if name == "torch":
        return _instance("torch")
    if x.dtype not in _TRITON_DTYPES:
        raise TypeError(f"{asked} runs the dtypes fp16, bf16 and fp32; x has dtype {x.dtype} "
                        "(use backend='torch')")
    try:
        _instance("triton")
    except ImportError as err:  # no triton, or the kernels need another version: say which
        raise ValueError(f"{asked} needs triton, and its kernels do not import here ({err}); pip install "
                         "'moeblaze[gpu]' (CUDA builds of torch bring triton), or use backend='torch'") from None
    if not x.is_cuda and not settings.interpreting():
        raise ValueError(f"{asked} needs CUDA tensors (x is on {x.device}); use backend='torch' "
                         "or set TRITON_INTERPRET=1 to run the kernels in Triton's CPU interpreter")
    if x.dtype == torch.bfloat16 and settings.interpreting():
        # Triton's CPU interpreter computes bf16 tl.dot wrongly (outputs near 5e9 instead of O(1)).
        raise ValueError(f"{asked} under TRITON_INTERPRET=1 cannot run bfloat16 x (Triton's interpreter "
                         "computes bf16 dot products wrongly); use float16/float32, or backend='torch'")
    return _instance("triton")
