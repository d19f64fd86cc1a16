"""Top-k token-choice router with fp32 math and the usual auxiliary losses (DESIGN.md §2).

Score functions: ``softmax`` (softmax over E, then top-k, optional renormalisation — Switch/Mixtral/
Qwen3 style) and ``sigmoid`` (DeepSeek-V3: sigmoid scores, top-k, renormalised to sum 1).
Losses: the Switch Transformer load-balancing loss (Fedus et al. 2021, eq. 4)
``E * sum_e f_e * P_e`` (or, ``aux_loss_type``, its per-sequence form of DeepSeek-V3 and its global-batch form
of Qwen: :mod:`moeblaze.balance`) and the router z-loss (ST-MoE, Zoph et al. 2022, eq. 5)
``mean_t logsumexp(logits_t)^2``. Auxiliary-loss-free balancing (DeepSeek-V3): the router's selection bias and
its token counts, updated by :func:`moeblaze.update_expert_biases`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import settings
from .amp import autocast_off, autocast_operands
from .balance import (
    check_aux_loss_type,
    check_bias_rate,
    check_group,
    global_batch_load_balancing_loss,
    sequence_load_balancing_loss,
)
from .input_grad import SharedInputGrad
from .settings import carried_to_backward

if TYPE_CHECKING:  # annotations only: token rounding is opt-in, reached through the Rounding request
    from .token_rounding import Rounding, TokenRounding

SCORE_FUNCS = ("softmax", "sigmoid")
LOGITS_DTYPES = ("fp32", "input")


def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of two 16-bit CUDA matrices on the tensor cores, fp32 products and sum, fp32 result."""
    return torch.mm(a, b, out_dtype=torch.float32)


_ROUTER_KERNELS = None


def _kernels():
    """:mod:`moeblaze.kernels.router`, imported on first use: only where its kernels run (CUDA tensors or Triton's
    interpreter), so a CPU install needs no Triton. Kept in a global, as an import statement costs about 2 µs of host
    time per use (``timeit`` of ``from moeblaze.kernels.router import MAX_EXPERTS``, 2-core x86-64 CPU) and the
    router would pay it several times per layer and step (``functools.cache`` would do, but torch.compile warns
    about it)."""
    global _ROUTER_KERNELS
    if _ROUTER_KERNELS is None:
        from .kernels import router

        _ROUTER_KERNELS = router
    return _ROUTER_KERNELS


def _tensor_core_path(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Both 16-bit of one dtype on CUDA: the router's GEMMs run on the tensor cores with fp32 sums."""
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype


class _RouterLogits(torch.autograd.Function):
    """``logits = x Wr^T`` in fp32 while saving ``x`` in its own dtype (no fp32 copy kept: 4Td bytes
    less than ``F.linear(x.float(), ...)``, and ``x`` is shared with the experts' saved input).

    Fast path (CUDA, ``x`` and ``Wr`` both bf16 or fp16): the products of 16-bit values are exact in
    fp32, so one tensor-core GEMM with fp32 accumulation and output gives the fp32-math logits without
    converting x (on an H200, olmoe shape T 32768, d 2048, E 64: 0.22 ms fp32 SIMT GEMM + 0.19 ms x.float()
    forward, 0.7 ms backward, before). Backward splits the fp32 ``dlogits`` into two 16-bit terms
    ``[hi | lo]`` and sums both in one GEMM per gradient (K = 2E), so the gradients keep ~16 mantissa bits
    of ``dlogits`` before their own rounding; ``dx`` comes out of the GEMM in x's dtype. Why one GEMM:
    two GEMMs with fp32 outputs, their sum and the cast took 0.52 ms of a T 32768, d 2048 step on an H200
    (``benchmarks/profile_layer.py --configs qwen3-30b-a3b --timeline``: 0.075 + 0.075 + 0.188 +
    0.094 ms), 3% of a qwen3-30b layer step; the one-GEMM form made the layer step 1.008-1.014x faster
    (H200, same-run step times of conf4, qwen3-30b and olmoe; ``moeblaze bench --configs
    conf4-swiglu,qwen3-30b-a3b,olmoe-1b-7b`` measures the step).

    Any other pair of dtypes takes the fp32 path (fp32 products, so TF32 where
    ``torch.backends.cuda.matmul.allow_tf32``). Autocast is off inside (:func:`moeblaze.amp.autocast_off`):
    it would return 16-bit logits; :class:`Router` casts the operands under autocast before this Function.
    """

    @staticmethod
    @carried_to_backward
    @autocast_off
    def forward(ctx, x, weight, input_grad=None):
        ctx.save_for_backward(x, weight)
        ctx.input_grad = input_grad.bind(x) if input_grad is not None else None
        if _tensor_core_path(x, weight):
            return _mm_fp32(x, weight.t())
        return x.float() @ weight.float().t()

    @staticmethod
    @carried_to_backward
    @autocast_off
    def backward(ctx, dlogits):
        x, weight = ctx.saved_tensors
        share = ctx.input_grad  # x's gradient shared with the experts (moeblaze.input_grad), or None
        dx = dw = None
        if _tensor_core_path(x, weight):  # one GEMM each: [hi | lo] against the weight stacked twice / x, fp32 sums
            hl = _kernels().split16(dlogits.contiguous(), x.dtype)  # [hi | lo]: K = 2E
            if ctx.needs_input_grad[0]:
                w2 = torch.cat((weight, weight))
                pending = share.take() if share is not None else None
                if pending is not None:  # the experts' dx, plus this one in the GEMM's epilogue (beta = 1)
                    pending.addmm_(hl, w2)
                else:
                    dx = hl @ w2  # x.dtype out, rounded once from the fp32 sum
            if ctx.needs_input_grad[1]:
                E = weight.shape[0]
                dw = _mm_fp32(hl.t(), x).view(2, E, -1).sum(0).to(weight.dtype)
        else:
            if ctx.needs_input_grad[0]:
                dx = (dlogits @ weight.float()).to(x.dtype)
            if ctx.needs_input_grad[1]:
                dw = (dlogits.t() @ x.float()).to(weight.dtype)
        return (share.offer(dx) if share is not None else dx), dw, None


class _FusedTopK(torch.autograd.Function):
    """Softmax, top-k, weights and both losses of fp32 ``logits [T, E]`` in Triton (two launches forward, one
    backward: :mod:`moeblaze.kernels.router`), instead of about 14 PyTorch operations forward and 20 backward
    (issue 24: a few thousand tokens per GPU leave the step bound by host time). Returns ``(ids, weights,
    probs, aux, z, counts)``; ids and counts carry no gradient."""

    @staticmethod
    @carried_to_backward
    def forward(ctx, logits, top_k, renormalize, scale, aux_c, z_c):
        fused_router = _kernels()
        ids, weights, probs, lse, counts, aux, z = fused_router.router_topk(logits, top_k, renormalize, scale, aux_c,
                                                                            z_c)
        ctx.mark_non_differentiable(ids, counts, *fused_router.off_losses(aux, z, aux_c, z_c))
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(probs, ids, lse, counts)
        ctx.options = (renormalize, scale, aux_c, z_c)
        return ids, weights, probs, aux, z, counts

    @staticmethod
    @carried_to_backward
    def backward(ctx, _dids, dweights, dprobs, daux, dz, _dcounts):
        if dweights is None and dprobs is None and daux is None and dz is None:
            return None, None, None, None, None, None
        probs, ids, lse, counts = ctx.saved_tensors
        dlogits = _kernels().router_topk_backward(probs, ids, dweights, dprobs, counts, lse, daux, dz, *ctx.options)
        return dlogits, None, None, None, None, None


def _aux_coefficient(scale: float, num_experts: int, num_pairs: int, num_tokens: int) -> float:
    """The factor of ``<counts, sum_t probs_t>`` in the load-balancing loss: ``scale * E / (T*K * T)`` (an
    empty batch counts as 1 in the denominators). Shared by the PyTorch and the fused router."""
    return scale * num_experts / (max(num_pairs, 1) * max(num_tokens, 1))


def _z_coefficient(scale: float, num_tokens: int) -> float:
    """The factor of ``sum_t lse_t^2`` in the z-loss: ``scale / T``. Shared by the PyTorch and the fused router."""
    return scale / max(num_tokens, 1)


def load_balancing_loss(probs: torch.Tensor, topk_ids: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Switch load-balancing loss ``scale * E * sum_e f_e * P_e`` (1.0 at perfect balance, scale 1).

    Args:
        probs: ``[T, E]`` fp32 routing probabilities (rows sum to 1).
        topk_ids: ``[T, K]`` chosen experts; ``f_e`` is the fraction of the T*K pairs sent to e.
        scale: a coefficient folded into the one scalar product (the router's ``aux_loss_coef``).

    Computed as ``scale * E / (T*K*T) * <counts, sum_t probs_t>``: six launches (no host read, so CUDA-graph
    capturable) where the textbook form takes ten, forward and backward (host-bound small-T steps, issue 24).
    """
    T, E = probs.shape
    counts = torch.zeros(E, dtype=probs.dtype, device=probs.device)
    counts.index_add_(0, topk_ids.reshape(-1).long(),
                      torch.ones(topk_ids.numel(), dtype=probs.dtype, device=probs.device))
    return _aux_coefficient(scale, E, topk_ids.numel(), T) * torch.dot(counts, probs.sum(0))


def router_z_loss(logits: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """ST-MoE z-loss ``scale * mean_t logsumexp(logits_t)^2`` on ``[T, E]`` fp32 logits (``scale``: the
    router's ``z_loss_coef``, folded into the one scalar product)."""
    lse = torch.logsumexp(logits, dim=-1)
    return _z_coefficient(scale, lse.numel()) * torch.dot(lse, lse)


@dataclass
class RouterOutput:
    """What :class:`Router` returns.

    Attributes:
        topk_ids: ``[T, K]`` int32 expert ids (distinct per row).
        topk_weights: ``[T, K]`` fp32 combine weights (differentiable).
        logits: ``[T, E]`` fp32 router logits.
        aux_loss: load-balancing loss times its coefficient (a 0-dim fp32 tensor).
        z_loss: z-loss times its coefficient.
        scores: ``[T, E]`` fp32 router scores (softmax probabilities or sigmoid scores, differentiable): what
            token rounding pads with.
        counts: ``[E]`` fp32 pairs routed to each expert where the fused router computed them (None otherwise):
            token rounding's ``f_e`` without a histogram of its own.
        rounded: the token-rounded routing (:class:`moeblaze.token_rounding.TokenRounding`) where a rounding was
            asked for and the fused router and selections computed it in the router's autograd node; None
            otherwise (the caller rounds: :func:`moeblaze.token_rounding.round_tokens`).
        losses_on: whether ``(aux_loss, z_loss)`` are on; a loss that is off is an exact 0 and :attr:`loss`
            adds nothing for it.
    """

    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    logits: torch.Tensor
    aux_loss: torch.Tensor
    z_loss: torch.Tensor
    scores: torch.Tensor | None = None
    counts: torch.Tensor | None = None
    rounded: TokenRounding | None = None
    losses_on: tuple[bool, bool] = (True, True)

    @property
    def loss(self) -> torch.Tensor:
        """The router's total auxiliary loss, to add to the training loss: the losses that are on (the zero of
        ``aux_loss`` where neither is), so that no launch adds a zero."""
        aux_on, z_on = self.losses_on
        if aux_on and z_on:
            return self.aux_loss + self.z_loss
        return self.z_loss if z_on else self.aux_loss


class Router(nn.Module):
    """Top-k router: ``logits = x Wr^T`` (fp32), scores, top-k, weights and auxiliary losses.

    Args:
        d_model: d.
        num_experts: E.
        top_k: K, 1 <= K <= E.
        score_func: ``"softmax"`` or ``"sigmoid"``.
        renormalize: rescale the K chosen weights to sum to 1. ``None``: False for softmax, True for
            sigmoid (DeepSeek-V3).
        aux_loss_coef: coefficient of the load-balancing loss (0 disables it).
        z_loss_coef: coefficient of the z-loss (0 disables it).
        n_group, topk_group: group-limited top-k (DeepSeek-V3 §2.1.2, "node-limited routing"): the E experts
            form ``n_group`` groups of E / n_group; a group's score is the sum of its two best selection
            scores, and the K experts are chosen within the ``topk_group`` best groups. ``n_group=1``: off.
        score_correction_bias: keep a buffer ``e_score_correction_bias [E]`` (fp32, zeros; DeepSeek-V3's
            auxiliary-loss-free balancing) added to the scores for the choice of experts only; the combine
            weights are the scores themselves. It stays fp32 when the module is cast to a 16-bit dtype (as
            transformers keeps DeepSeek-V3's in fp32): steps of 1e-3 would round away in bf16.
        aux_loss_type: the load-balancing loss ``aux_loss_coef`` weighs: ``"switch"`` (Switch Transformer, over
            this call's tokens), ``"seq"`` (DeepSeek-V3's sequence-wise loss, arXiv 2412.19437 eq. 17-20, over
            each sequence of ``seq_len`` tokens) or ``"global"`` (Qwen's global-batch loss, arXiv 2501.11873:
            the expert frequencies summed over ``aux_loss_group``, one all-reduce of ``[E]`` per training
            forward, collective). See :mod:`moeblaze.balance`.
        expert_bias_update_rate: u of DeepSeek-V3's auxiliary-loss-free balancing (1e-3 there; 0 = off): keeps
            ``e_score_correction_bias`` (as ``score_correction_bias=True``) and counts the tokens routed to each
            expert; :func:`moeblaze.update_expert_biases` moves the bias by ``u * sign(mean_load - load_e)``.
        track_expert_load: count the pairs routed to each expert in training-mode forwards into the buffer
            ``tokens_per_expert [E]`` (int64, not saved in the state dict; read by :func:`moeblaze.expert_load`)
            without a bias update; on whenever ``expert_bias_update_rate > 0``.
        aux_loss_group: the data-parallel ``ProcessGroup`` of ``aux_loss_type="global"`` (None: the world where
            torch.distributed is initialised).
        routed_scaling_factor: multiplies the K combine weights after renormalisation (DeepSeek-V3: 2.5).
        logits_dtype: ``"fp32"`` computes the logits in fp32 math; ``"input"`` computes them in the input's
            dtype and then upcasts (as transformers' Qwen/Mixtral routers do for a bf16 model), so that such a
            model routes exactly as transformers does.

    Shapes: input ``[T, d]`` (any float dtype), weight ``[E, d]``. Logits, scores, top-k and losses are fp32
    whatever dtypes reach the router. Under ``torch.autocast`` (bf16/fp16) the logits GEMM takes casts of
    ``x`` and the weight to the autocast dtype, as ``torch.nn.Linear`` would, but sums and returns fp32 (the
    tensor-core path of the bf16 layer, bitwise): an fp32 weight gets its fp32 gradient through the cast.
    Why not fp32 operands: an fp32 GEMM without tensor cores over [T, d] x [d, E] three times per step
    (forward, dx, dW: 51 GFLOP at T 32768, d 2048, E 128), about 1 ms on an H100 at fp32's 67 TFLOP/s
    data-sheet peak, next to a 15-18 ms layer step.

    Raises:
        ValueError: bad ``top_k``, ``score_func``, group settings, ``logits_dtype``, ``aux_loss_type``, a loss
            coefficient or ``expert_bias_update_rate`` that is not a finite number >= 0, or a wrong input shape.
        TypeError: ``renormalize`` not None or a bool; ``dtype`` not None or a floating-point dtype;
            ``aux_loss_group`` not None or a ProcessGroup.
    """

    def __init__(self, d_model: int, num_experts: int, top_k: int, score_func: str = "softmax",
                 renormalize: bool | None = None, aux_loss_coef: float = 0.01, z_loss_coef: float = 0.0,
                 device=None, dtype=None, *, n_group: int = 1, topk_group: int | None = None,
                 score_correction_bias: bool = False, routed_scaling_factor: float = 1.0,
                 logits_dtype: str = "fp32", aux_loss_type: str = "switch", expert_bias_update_rate: float = 0.0,
                 track_expert_load: bool = False, aux_loss_group=None) -> None:
        super().__init__()
        for name, v in (("d_model", d_model), ("num_experts", num_experts), ("top_k", top_k)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if score_func not in SCORE_FUNCS:
            raise ValueError(f"score_func must be one of {SCORE_FUNCS}, got {score_func!r}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
        for name, v in (("aux_loss_coef", aux_loss_coef), ("z_loss_coef", z_loss_coef)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
        if renormalize is not None and not isinstance(renormalize, bool):
            raise TypeError(f"renormalize must be None, True or False, got {renormalize!r}")
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise TypeError(f"dtype must be None or a floating-point torch.dtype (torch.float32, torch.bfloat16, ...), "
                            f"got {dtype!r}")
        self.d_model, self.num_experts, self.top_k = d_model, num_experts, top_k
        self.score_func = score_func
        self.renormalize = (score_func == "sigmoid") if renormalize is None else renormalize
        self.aux_loss_coef, self.z_loss_coef = aux_loss_coef, z_loss_coef
        self.aux_loss_type = check_aux_loss_type(aux_loss_type)
        self.expert_bias_update_rate = check_bias_rate(expert_bias_update_rate)
        check_group(aux_loss_group)
        self.aux_loss_group = aux_loss_group
        self.weight = nn.Parameter(torch.empty(num_experts, d_model, device=device, dtype=dtype))
        self._init_deepseek(n_group, topk_group, score_correction_bias or self.expert_bias_update_rate > 0,
                            routed_scaling_factor, logits_dtype, device)
        counting = bool(track_expert_load) or self.expert_bias_update_rate > 0
        counts = torch.zeros(num_experts, device=device, dtype=torch.int64) if counting else None
        self.register_buffer("tokens_per_expert", counts, persistent=False)  # this step's, until reset
        self.reset_parameters()

    def _init_deepseek(self, n_group, topk_group, score_correction_bias, routed_scaling_factor, logits_dtype,
                       device) -> None:
        """Checks and state of the group-limited top-k, the correction bias, the scaling and the logits dtype."""
        E, K = self.num_experts, self.top_k
        if not isinstance(n_group, int) or n_group < 1 or E % n_group or (n_group > 1 and E // n_group < 2):
            raise ValueError(f"n_group must be a positive int dividing num_experts={E} into groups of >= 2 "
                             f"experts, got {n_group!r}")
        topk_group = n_group if topk_group is None else topk_group
        if not isinstance(topk_group, int) or not 1 <= topk_group <= n_group or topk_group * (E // n_group) < K:
            raise ValueError(f"topk_group must be an int in [1, n_group={n_group}] whose groups hold >= top_k={K} "
                             f"experts, got {topk_group!r}")
        if logits_dtype not in LOGITS_DTYPES:
            raise ValueError(f"logits_dtype must be one of {LOGITS_DTYPES}, got {logits_dtype!r}")
        self.n_group, self.topk_group = n_group, topk_group
        self.routed_scaling_factor, self.logits_dtype = float(routed_scaling_factor), logits_dtype
        bias = torch.zeros(E, device=device, dtype=torch.float32) if score_correction_bias else None
        self.register_buffer("e_score_correction_bias", bias)

    def _select(self, scores: torch.Tensor) -> torch.Tensor:
        """Top-K ids ``[T, K]`` of ``scores + e_score_correction_bias`` within the ``topk_group`` best groups."""
        choice = scores if self.e_score_correction_bias is None else scores + self.e_score_correction_bias
        if self.n_group > 1:
            T, E = choice.shape
            groups = choice.view(T, self.n_group, E // self.n_group)
            best = groups.topk(2, dim=-1).values.sum(-1).topk(self.topk_group, dim=-1).indices  # [T, topk_group]
            keep = torch.zeros(T, self.n_group, dtype=torch.bool, device=choice.device).scatter_(1, best, True)
            choice = groups.masked_fill(~keep[..., None], float("-inf")).view(T, E)
        return choice.topk(self.top_k, dim=-1).indices

    def _fused(self, logits: torch.Tensor) -> bool:
        """The Triton router (:class:`_FusedTopK`) serves this call: softmax scores, no groups or correction
        bias, within the kernels' limits (E, K and T*E: :mod:`moeblaze.kernels.router`), on logits where the
        ``backend`` setting runs Triton (:func:`moeblaze.settings.use_triton`: CUDA by default)."""
        if self.score_func != "softmax" or self.n_group > 1 or self.e_score_correction_bias is not None:
            return False
        if not settings.use_triton(logits):
            return False
        limits = _kernels()  # imported only where the kernels could run: a CPU install needs no Triton
        return (self.num_experts <= limits.MAX_EXPERTS and self.top_k <= limits.MAX_TOP_K
                and logits.numel() < limits.MAX_ELEMENTS)

    def reset_parameters(self) -> None:
        """``U(-1/sqrt(d), 1/sqrt(d))``, as ``nn.Linear``; the correction bias and the token counts to zero."""
        bound = 1.0 / math.sqrt(self.d_model)
        nn.init.uniform_(self.weight, -bound, bound)
        with torch.no_grad():
            for buf in (self.e_score_correction_bias, self.tokens_per_expert):
                if buf is not None:
                    buf.zero_()

    def _apply(self, fn, recurse=True):
        """As ``nn.Module._apply`` (``.to``, ``.half()``, ...), but a cast to a 16-bit dtype leaves the
        correction bias fp32 (moved to the new device): its updates of ``u`` = 1e-3 would round away in bf16."""
        bias = self.e_score_correction_bias
        super()._apply(fn, recurse)
        moved = self.e_score_correction_bias
        if bias is not None and bias.dtype == torch.float32 and moved.dtype in (torch.bfloat16, torch.float16):
            self.e_score_correction_bias = bias.to(moved.device)
        return self

    def forward(self, x: torch.Tensor, *, input_grad: SharedInputGrad | None = None,
                rounding: Rounding | None = None, seq_len: int | None = None) -> RouterOutput:
        """Route ``x [T, d]``: fp32 logits, scores, top-k ids and weights, and the scaled losses
        (zero in eval mode or for an empty batch). ``input_grad``: ``x``'s gradient shared with the experts
        (:mod:`moeblaze.input_grad`; :class:`moeblaze.MoE` passes one), or None. ``rounding``: token rounding
        to compute with the routing where the fused router and selections serve (``RouterOutput.rounded``; one
        autograd node, whose backward reads the pair weights' gradient where it lies), or None. ``seq_len``:
        the tokens per sequence of ``aux_loss_type="seq"`` (rows ``b*S .. (b+1)*S - 1`` form sequence b; None:
        all T tokens are one sequence). In training mode, adds the top-k choice to ``tokens_per_expert`` where
        counted.

        Raises:
            ValueError: ``x`` is not ``[T, d]``, or ``seq_len`` does not divide T.
        """
        if x.dim() != 2 or x.shape[1] != self.d_model:
            raise ValueError(f"router input must have shape [T, d={self.d_model}], got {tuple(x.shape)}")
        if seq_len is not None and (not isinstance(seq_len, int) or seq_len < 1 or x.shape[0] % seq_len):
            raise ValueError(f"seq_len must be a positive divisor of the {x.shape[0]} tokens, got {seq_len!r}")
        if self.logits_dtype == "input":  # rounded to x's dtype as transformers computes them, then upcast
            logits = F.linear(x, self.weight.to(x.dtype)).float()
        else:
            logits = _RouterLogits.apply(*autocast_operands(x, ("router.weight", self.weight)), input_grad)
        losses_on = self.training and x.shape[0] > 0  # means over zero tokens would be NaN
        if self._fused(logits):
            return self._fused_forward(logits, losses_on, rounding, seq_len)
        if self.score_func == "softmax":
            scores = torch.softmax(logits, dim=-1)
            probs = scores
        else:
            scores = torch.sigmoid(logits)
            probs = scores / scores.sum(-1, keepdim=True)
        if self.e_score_correction_bias is None and self.n_group == 1:
            topk_weights, topk_ids = torch.topk(scores, self.top_k, dim=-1)
        else:
            topk_ids = self._select(scores)
            topk_weights = scores.gather(1, topk_ids)
        if self.renormalize:
            topk_weights = topk_weights / topk_weights.sum(-1, keepdim=True).clamp_min(1e-20)
        if self.routed_scaling_factor != 1.0:
            topk_weights = topk_weights * self.routed_scaling_factor
        aux = self._balance(probs, topk_ids, seq_len, losses_on, switch=True)
        z = router_z_loss(logits, self.z_loss_coef) if self.z_loss_coef and losses_on else None
        on = (aux is not None, z is not None)
        if not all(on):  # a zero only where a loss is off (one launch fewer per step otherwise)
            zero = logits.new_zeros(())
            aux, z = (zero if aux is None else aux), (zero if z is None else z)
        return RouterOutput(topk_ids.to(torch.int32), topk_weights, logits, aux, z, scores, losses_on=on)

    def _balance(self, probs: torch.Tensor, topk_ids: torch.Tensor, seq_len: int | None, losses_on: bool,
                 switch: bool) -> torch.Tensor | None:
        """Count the choice (training mode, where counted), and the load-balancing loss of ``aux_loss_type``
        times its coefficient, or None where it is off (``switch``: compute the Switch loss here too; the fused
        router's kernel computes it). The global loss runs on every rank in training mode, with T = 0 too:
        its all-reduce is collective."""
        if self.training and self.tokens_per_expert is not None:  # two launches: a ones fill and an index_add_
            ids = topk_ids.reshape(-1)
            self.tokens_per_expert.index_add_(0, ids, self.tokens_per_expert.new_ones(()).expand(ids.numel()))
        if not self.aux_loss_coef or not self.training:
            return None
        if self.aux_loss_type == "global":
            return global_batch_load_balancing_loss(probs, topk_ids, self.aux_loss_coef, self.aux_loss_group)
        if not losses_on:
            return None
        if self.aux_loss_type == "seq":
            return sequence_load_balancing_loss(probs, topk_ids, seq_len or probs.shape[0], self.aux_loss_coef)
        return load_balancing_loss(probs, topk_ids, self.aux_loss_coef) if switch else None

    def _fused_forward(self, logits: torch.Tensor, losses_on: bool, rounding: Rounding | None,
                       seq_len: int | None) -> RouterOutput:
        """:meth:`forward` through :class:`_FusedTopK` (with ``rounding``: its ``route`` where it serves):
        the same outputs (losses with the coefficients of :func:`load_balancing_loss` and :func:`router_z_loss`),
        exact zeros for losses that are off (written by the loss kernel). The kernel computes the Switch loss;
        the sequence-wise and global losses are computed here from its probabilities."""
        T, K, E = logits.shape[0], self.top_k, self.num_experts
        switch_on = self.aux_loss_coef and losses_on and self.aux_loss_type == "switch"
        aux_c = _aux_coefficient(self.aux_loss_coef, E, T * K, T) if switch_on else 0.0
        z_c = _z_coefficient(self.z_loss_coef, T) if self.z_loss_coef and losses_on else 0.0
        options = (K, bool(self.renormalize), self.routed_scaling_factor, aux_c, z_c)
        rounded = None
        if rounding is not None and rounding.serves(logits, K):
            (ids, weights, scores, aux, z, counts), rounded = rounding.route(logits, *options)
        else:
            ids, weights, scores, aux, z, counts = _FusedTopK.apply(logits, *options)
        other = self._balance(scores, ids, seq_len, losses_on, switch=False)  # softmax: the scores are the probs
        aux = aux if other is None else other
        return RouterOutput(ids, weights, logits, aux, z, scores, counts, rounded,
                            losses_on=(bool(aux_c) or other is not None, bool(z_c)))

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, num_experts={self.num_experts}, top_k={self.top_k}, "
                f"score_func={self.score_func}, renormalize={self.renormalize}"
                + (f", n_group={self.n_group}, topk_group={self.topk_group}" if self.n_group > 1 else "")
                + (", score_correction_bias=True" if self.e_score_correction_bias is not None else "")
                + (f", routed_scaling_factor={self.routed_scaling_factor}" if self.routed_scaling_factor != 1 else "")
                + (f", logits_dtype={self.logits_dtype}" if self.logits_dtype != "fp32" else "")
                + (f", aux_loss_type={self.aux_loss_type}" if self.aux_loss_type != "switch" else "")
                + (f", expert_bias_update_rate={self.expert_bias_update_rate:g}"
                   if self.expert_bias_update_rate else ""))
