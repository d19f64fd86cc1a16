"""``moeblaze.MoE``: router + routed experts as one ``nn.Module`` (DESIGN.md §2)."""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn as nn

from .activations import DEFAULT_ACT, check_activation, is_gated
from .amp import autocast_target
from .backends import BACKENDS, Backend, get_backend
from .dispatch import DispatchIndex
from .expert_checks import SAVE_MODES, check_devices, check_placement, check_tokens, check_weight_dtypes
from .experts import run_experts
from .fp8 import Float8Recipe, check_fp8_recipe
from .input_grad import SharedInputGrad
from .routing import Router
from .token_rounding import ROUNDING_MODES, Rounding, round_tokens_fused, tile_multiple

__all__ = ["MoE", "SharedExpert", "aux_loss", "detach_aux_losses"]

_SHARED_ACTS = {"swiglu": nn.functional.silu, "geglu": nn.functional.gelu}


class SharedExpert(nn.Module):
    """A dense gated MLP that every token passes through, added to the routed experts' output (DeepSeek-MoE
    §3.2 "shared expert isolation"; DeepSeek-V3, Qwen2-MoE, GLM-4-MoE): ``down(f(gate(x)) * up(x))``, times
    ``sigmoid(x w_g)`` when ``gated_output`` (Qwen2-MoE's ``shared_expert_gate``).

    Args:
        d_model: d. d_ff: its intermediate size (DeepSeek-V3: ``moe_intermediate_size * n_shared_experts``).
        activation: ``"swiglu"`` (f = SiLU) or ``"geglu"`` (f = exact GELU).
        gated_output: add the scalar output gate ``shared_expert_gate`` (``nn.Linear(d, 1)``, no bias).

    Parameters (transformers' names, so that their weights load as they are): ``gate_proj``, ``up_proj``
    (``[d_ff, d]``), ``down_proj`` (``[d, d_ff]``), ``shared_expert_gate`` (``[1, d]``).
    Forward: ``x [..., d]`` -> ``[..., d]``.

    Raises:
        ValueError: an activation without a gated form.
    """

    def __init__(self, d_model: int, d_ff: int, activation: str = "swiglu", gated_output: bool = False,
                 device=None, dtype=None) -> None:
        super().__init__()
        if activation not in _SHARED_ACTS:
            raise ValueError(f"shared experts need activation in {tuple(_SHARED_ACTS)}, got {activation!r}")
        kw = {"bias": False, "device": device, "dtype": dtype}
        self.act_fn = _SHARED_ACTS[activation]
        self.gate_proj, self.up_proj = nn.Linear(d_model, d_ff, **kw), nn.Linear(d_model, d_ff, **kw)
        self.down_proj = nn.Linear(d_ff, d_model, **kw)
        self.shared_expert_gate = nn.Linear(d_model, 1, **kw) if gated_output else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        return out if self.shared_expert_gate is None else torch.sigmoid(self.shared_expert_gate(x)) * out


class MoE(nn.Module):
    """A dropless token-choice top-k Mixture-of-Experts feed-forward layer (MoEBlaze, arXiv 2601.05296).

    Args:
        d_model: d, the model dimension.
        d_ff: h, each expert's intermediate dimension (gated activations project to 2h).
        num_experts: E.
        top_k: K, experts per token.
        activation: a name of :data:`moeblaze.activations.ACTIVATIONS` (default ``swiglu``).
        score_func: router scores, ``softmax`` or ``sigmoid``.
        renormalize: renormalise the top-k weights (default: False for softmax, True for sigmoid).
        save: ``"preact"`` or ``"input"`` — what the experts keep for backward (see :func:`moe_experts`).
        aux_loss_coef: load-balancing loss coefficient; z_loss_coef: router z-loss coefficient.
        aux_loss_type: the load-balancing loss: ``"switch"`` (Switch Transformer, over this forward's tokens;
            expert-parallel, over the expert-parallel group's counts), ``"seq"`` (DeepSeek-V3's sequence-wise loss,
            arXiv 2412.19437 eq. 17-20: each sequence of ``x [..., S, d]`` on its own; a 2-D input is one
            sequence) or ``"global"`` (Qwen's global-batch loss, arXiv 2501.11873: expert frequencies summed over
            ``aux_loss_group``, default the world; every rank's training forward takes part). See
            :mod:`moeblaze.balance`.
        expert_bias_update_rate: u of DeepSeek-V3's auxiliary-loss-free balancing (§2.1.2; 1e-3 there, 0 = off):
            the router keeps ``e_score_correction_bias [E]`` (fp32) for the choice of experts only and counts the
            pairs routed to each expert over a step's training forwards; call :func:`moeblaze.update_expert_biases`
            after ``optimizer.step()``.
        track_expert_load: count those pairs without a bias update (for :func:`moeblaze.expert_load`).
        aux_loss_group: the data-parallel ``ProcessGroup`` of ``aux_loss_type="global"`` (None: the world).
        backend: ``"auto"``, ``"torch"`` or ``"triton"`` (as :func:`moeblaze.moe_experts`'s, which says which one
            ``torch.compile(fullgraph=True)`` traces).
        n_group, topk_group, score_correction_bias, routed_scaling_factor, logits_dtype: the router's
            DeepSeek-V3 / GLM-4-MoE selection and its logits dtype (see :class:`moeblaze.Router`).
        shared_d_ff: intermediate size of a :class:`SharedExpert` added to the output (0: none);
            shared_gate: scale it by ``sigmoid(x w)`` (Qwen2-MoE).
        bias: expert biases ``b_gate_up [E, 2h]`` (``b_up [E, h]``) and ``b_down [E, d]`` (as GPT-OSS).
        token_rounding: ``None`` (top-k) or a mode of :data:`moeblaze.token_rounding.ROUNDING_MODES`
            (``"nr"``, ``"up"``, ``"down"``, ``"sr"``): in training, round every expert's token count to a
            multiple of the M tile (SonicMoE §5; :mod:`moeblaze.token_rounding`); eval routes with top-k.
        rounding_tile: the tile to round to (default: :func:`moeblaze.tile_multiple` of the backend and
            the input's device). rounding_seed: seed of the ``"sr"`` random source.
        fp8: a :class:`moeblaze.fp8.Float8Recipe` for the routed experts' GEMMs (see :func:`moe_experts`; the
            router and the shared expert stay as they are), or None. An attribute: may be set on a built layer.

    DeepSeek-V3's MoE block is ``MoE(d, h, E, 8, score_func="sigmoid", n_group=8, topk_group=4,
    score_correction_bias=True, routed_scaling_factor=2.5, shared_d_ff=h * n_shared_experts)``; trained as
    DeepSeek-V3 was, add ``expert_bias_update_rate=1e-3, aux_loss_type="seq", aux_loss_coef=1e-4`` (§2.1.2, §4.2).

    Parameters (layout of DESIGN.md §2, HF transformers v5 fused experts): ``router.weight [E, d]``,
    ``w_gate_up [E, 2h, d]`` (gated; ``w_up [E, h, d]`` otherwise) and ``w_down [E, d, h]`` (and the
    biases), all initialised ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))`` as ``nn.Linear``.

    Forward: ``x [..., d]`` -> ``[..., d]`` in ``x.dtype``. Under ``torch.autocast`` (bf16/fp16) with fp32
    parameters (mixed precision with fp32 master weights): ``x`` is cast once to the autocast dtype, the
    router's GEMM and the experts run on it and on casts of their weights, the router keeps fp32 logits,
    scores, top-k and losses (:class:`Router`), and the output is in the autocast dtype — bitwise the layer
    on bf16 copies of ``x`` and the parameters, with gradients reaching the fp32 parameters (and an fp32
    ``x``) in fp32 through the casts (see :func:`moe_experts`).
    After each training-mode forward, ``self.aux_loss`` holds the router's coefficient-weighted auxiliary
    loss (load balancing + z-loss, a 0-dim fp32 tensor in the graph); add it to the training loss, or use
    :func:`aux_loss` to sum it over a model. ``self.last_topk_ids [T, K]`` keeps the last routing (detached)
    for load statistics; ``self.router.tokens_per_expert [E]`` (int64) the pairs per expert since the last
    reset, where counted.

    Raises:
        ValueError: bad configuration (e.g. an unknown ``aux_loss_type``, an ``expert_bias_update_rate`` that is
            not a finite number >= 0), or an input whose last dimension is not d.
        TypeError: an input that is not a tensor, or of another dtype than the parameters (outside autocast);
            ``renormalize`` not None or a bool, ``dtype`` not a floating-point dtype; ``aux_loss_group`` not None
            or a ProcessGroup; ``fp8`` not None or a recipe.

    Expert parallelism is applied to a built layer (or a model holding layers) by
    :func:`moeblaze.parallel.expert_parallel` (or :func:`moeblaze.parallel.parallelize` on a 2-D mesh).
    """

    def __init__(self, d_model: int, d_ff: int, num_experts: int, top_k: int, activation: str = "swiglu",
                 score_func: str = "softmax", renormalize: bool | None = None, save: str = "preact",
                 aux_loss_coef: float = 0.01, z_loss_coef: float = 0.0, backend: str = "auto",
                 device=None, dtype=None, *, n_group: int = 1, topk_group: int | None = None,
                 score_correction_bias: bool = False, routed_scaling_factor: float = 1.0,
                 logits_dtype: str = "fp32", shared_d_ff: int = 0, shared_gate: bool = False,
                 bias: bool = False, token_rounding: str | None = None,
                 rounding_tile: int | None = None, rounding_seed: int = 0, aux_loss_type: str = "switch",
                 expert_bias_update_rate: float = 0.0, track_expert_load: bool = False,
                 aux_loss_group=None, fp8: Float8Recipe | None = None) -> None:
        super().__init__()
        check_fp8_recipe(fp8)
        self.fp8 = fp8
        if token_rounding is not None and token_rounding not in ROUNDING_MODES:
            raise ValueError(f"token_rounding must be None or one of {ROUNDING_MODES}, got {token_rounding!r}")
        if rounding_tile is not None and (not isinstance(rounding_tile, int) or rounding_tile < 1):
            raise ValueError(f"rounding_tile must be None or a positive int (the M tile), got {rounding_tile!r}")
        self.token_rounding, self.rounding_tile, self.rounding_seed = token_rounding, rounding_tile, rounding_seed
        self._rounding_gen: torch.Generator | None = None
        check_activation(activation)
        if save not in SAVE_MODES:
            raise ValueError(f"save must be one of {SAVE_MODES}, got {save!r}")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        for name, v in (("d_model", d_model), ("d_ff", d_ff), ("num_experts", num_experts), ("top_k", top_k)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        self.d_model, self.d_ff, self.num_experts, self.top_k = d_model, d_ff, num_experts, top_k
        self.activation, self.save, self.backend = activation, save, backend
        self.router = Router(d_model, num_experts, top_k, score_func, renormalize, aux_loss_coef,
                             z_loss_coef, device=device, dtype=dtype, n_group=n_group, topk_group=topk_group,
                             score_correction_bias=score_correction_bias,
                             routed_scaling_factor=routed_scaling_factor, logits_dtype=logits_dtype,
                             aux_loss_type=aux_loss_type, expert_bias_update_rate=expert_bias_update_rate,
                             track_expert_load=track_expert_load, aux_loss_group=aux_loss_group)
        if not isinstance(shared_d_ff, int) or shared_d_ff < 0:
            raise ValueError(f"shared_d_ff must be an int >= 0, got {shared_d_ff!r}")
        self.shared_experts = (SharedExpert(d_model, shared_d_ff, activation, shared_gate, device=device, dtype=dtype)
                               if shared_d_ff else None)
        rows = 2 * d_ff if is_gated(activation) else d_ff
        self._w1_name = "w_gate_up" if is_gated(activation) else "w_up"
        self.has_bias = bool(bias)
        # expert parallelism (moeblaze.parallel.expert_parallel) sets it: the layer then runs ep.forward for its
        # routed experts and holds its rank's slice of the experts
        self.ep = None
        kw = {"device": device, "dtype": dtype}
        self.register_parameter(self._w1_name, nn.Parameter(torch.empty(num_experts, rows, d_model, **kw)))
        self.w_down = nn.Parameter(torch.empty(num_experts, d_model, d_ff, **kw))
        if self.has_bias:
            self._b1_name = "b_gate_up" if is_gated(activation) else "b_up"
            self.register_parameter(self._b1_name, nn.Parameter(torch.empty(num_experts, rows, **kw)))
            self.b_down = nn.Parameter(torch.empty(num_experts, d_model, **kw))
        self.reset_parameters()
        self.aux_loss: torch.Tensor = torch.zeros(())
        self.last_topk_ids: torch.Tensor | None = None

    @property
    def w1(self) -> nn.Parameter:
        """The up-projection weight: ``w_gate_up [E, 2h, d]`` or ``w_up [E, h, d]``."""
        return getattr(self, self._w1_name)

    def expert_fan_ins(self) -> list[tuple[nn.Parameter, int]]:
        """The per-expert parameters in initialisation order, each with the fan-in of its bound: the
        up-projection (and its bias) d, the down-projection (and its bias) h."""
        pairs = [(self.w1, self.d_model), (self.w_down, self.d_ff)]
        if self.has_bias:
            pairs += [(getattr(self, self._b1_name), self.d_model), (self.b_down, self.d_ff)]
        return pairs

    def bias_kwargs(self) -> dict[str, nn.Parameter]:
        """The expert biases as :func:`moe_experts` takes them (``b_gate_up``, ``b_down``; empty without)."""
        return {"b_gate_up": getattr(self, self._b1_name), "b_down": self.b_down} if self.has_bias else {}

    def reset_parameters(self) -> None:
        """Re-initialise the router and the experts (``U(-1/sqrt(fan_in), 1/sqrt(fan_in))``)."""
        self.router.reset_parameters()
        if self.ep is not None:
            self.ep.reset_experts(self)
        else:
            for w, fan_in in self.expert_fan_ins():
                nn.init.uniform_(w, -1 / math.sqrt(fan_in), 1 / math.sqrt(fan_in))
        if self.shared_experts is not None:
            for m in self.shared_experts.modules():
                if isinstance(m, nn.Linear):
                    m.reset_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Route and run the experts: ``x [..., d]`` -> ``[..., d]`` in ``x.dtype`` (the autocast dtype under
        ``torch.autocast``); sets ``self.aux_loss``.

        Raises:
            TypeError: ``x`` is not a floating-point tensor. ValueError: the last dimension of ``x`` is not d.
        """
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"MoE input x must be a torch.Tensor [..., d_model={self.d_model}], got {type(x).__name__}")
        if not x.is_floating_point():  # before the router reads it
            raise TypeError(f"MoE input x must be a floating-point tensor, got {x.dtype}")
        if x.dim() == 0 or x.shape[-1] != self.d_model:
            raise ValueError(f"MoE input must have last dimension d_model={self.d_model}, got {tuple(x.shape)}")
        shape = x.shape
        # The layer's one autocast step (moeblaze.amp): one cast of x for the router and the experts, so that its
        # gradient sums in the autocast dtype before the cast's backward, as in the layer on 16-bit copies; the
        # expert biases are cast with the same dtype (expert_biases), the expert weights inside the experts'
        # Functions, the router's weight by the router.
        x_flat = x.reshape(-1, self.d_model)
        # None outside autocast; under it, parameters autocast would not cast (fp64) are an error here
        dtype = autocast_target(x_flat, ("w_gate_up", self.w1), ("w_down", self.w_down), *self.bias_kwargs().items())
        x2 = x_flat if dtype is None else x_flat.to(dtype)
        # x2's gradient summed in place by the router and the experts, not by autograd (moeblaze.input_grad); only
        # where they are x2's only readers (x2 is a view of its own: the caller's other uses of x are not)
        share = (SharedInputGrad() if x2.requires_grad and torch.is_grad_enabled() and self.ep is None
                 and self.shared_experts is None and not torch.compiler.is_compiling() else None)
        rounding = self._rounding(x2) if self.token_rounding is not None and self.training else None
        # float64 (the reference check) rounds with the PyTorch ops, after the router
        routing = self.router(x2, input_grad=share, rounding=rounding if x2.dtype != torch.float64 else None,
                              seq_len=shape[-2] if x.dim() >= 3 and shape[-2] else None)  # 2-D: one sequence
        backend = self._expert_backend(x2, dtype)
        if self.ep is not None:  # expert parallelism: the routed experts run on the ranks that hold them
            out, self.aux_loss = self.ep.forward(self, x2, routing, backend, dtype)
            if self.shared_experts is not None:
                out = out + self.shared_experts(x2)
            self.last_topk_ids = routing.topk_ids.detach()
            return out.reshape(shape)
        # fp32 router weights feed the kernels as they are; only a float64 run (the reference check)
        # upcasts them so that nothing in the layer rounds to fp32.
        topk_weights = routing.topk_weights.to(x.dtype) if x.dtype == torch.float64 else routing.topk_weights
        if rounding is not None:
            index, weights = self._rounded_pairs(x2, routing, topk_weights, backend, rounding)
        else:
            # Ids come from torch.topk over E scores: in range and distinct by construction, so the
            # host-synchronising range check is skipped. The build also writes the experts' tile schedule.
            index, weights = backend.plan(routing.topk_ids, self.num_experts, validate=False), topk_weights
        out = run_experts(x2, weights, self.w1, self.w_down, *self.expert_biases(dtype), index, self.activation,
                          self.save, backend, DEFAULT_ACT, share, self.fp8)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x2)
        self.aux_loss = routing.loss
        self.last_topk_ids = routing.topk_ids.detach()
        return out.reshape(shape)

    def _rounding(self, x2: torch.Tensor) -> Rounding:
        """The token rounding request of a training step (warns where most experts would round to 0 pairs)."""
        tile = self.rounding_tile or tile_multiple(self.backend, x2.device)
        pairs_per_expert = x2.shape[0] * self.top_k / self.num_experts  # shapes only: no host synchronisation
        if self.token_rounding != "up" and pairs_per_expert < tile / 2 and not torch.compiler.is_compiling():
            warnings.warn(f"token_rounding={self.token_rounding!r} with {pairs_per_expert:g} pairs per expert on "
                          f"average, under half the tile ({tile}): most experts round to 0 pairs, and a token whose "
                          "pairs are all dropped gets zero MoE output; use more tokens per step, a smaller "
                          "rounding_tile, token_rounding='up' or top-k routing", stacklevel=3)
        gen = None
        if self.token_rounding == "sr":
            if self._rounding_gen is None or self._rounding_gen.device != x2.device:
                self._rounding_gen = torch.Generator(x2.device).manual_seed(self.rounding_seed)
            gen = self._rounding_gen
        return Rounding(self.token_rounding, tile, gen)

    def _expert_backend(self, x2: torch.Tensor, dtype: torch.dtype | None) -> Backend:
        """The routed experts' checks, once per forward, and the backend resolved for ``x2 [T, d]``. The router
        has checked ``x2``'s shape; the parameters' shapes and the options hold by construction, so what
        :func:`moe_experts` checks beyond is left out (``fp8`` is checked: an attribute that may be set on a built
        layer). ``dtype``: the autocast dtype, or None outside autocast.

        Raises:
            ValueError, TypeError: as :func:`moeblaze.backends.get_backend`; ``x2`` not floating point; an expert
                weight or bias on another device than ``x2`` or, outside autocast, in another dtype; ``fp8`` not a
                recipe.
        """
        backend = get_backend(self.backend, x2)
        check_fp8_recipe(self.fp8)
        check_tokens(x2)
        check_weight_dtypes(x2, self.w1, self.w_down, dtype is not None)
        check_devices(x2, ("w_gate_up", self.w1), ("w_down", self.w_down))
        check_placement(x2, dtype is not None, *self.bias_kwargs().items())
        return backend

    def expert_biases(self, dtype: torch.dtype | None, grad_scale=None) -> tuple:
        """``(b_gate_up [E, 2h | h] | None, b_down [E, d] | None)`` cast to the autocast ``dtype`` (None: as they
        are); ``grad_scale``, a function applied to each bias parameter before the cast (expert parallelism's
        gradient scaling), or None."""
        biases = self.bias_kwargs()
        out = []
        for b in (biases.get("b_gate_up"), biases.get("b_down")):
            if b is not None and grad_scale is not None:
                b = grad_scale(b)
            out.append(b if b is None or dtype is None else b.to(dtype))
        return tuple(out)

    def _rounded_pairs(self, x2: torch.Tensor, routing, topk_weights: torch.Tensor, backend: Backend,
                       rounding: Rounding) -> tuple[DispatchIndex, torch.Tensor]:
        """The token-rounded routing (no host synchronisation; :mod:`moeblaze.token_rounding`), the router's
        (:attr:`moeblaze.routing.RouterOutput.rounded`) or rounded here: its pair index (foreign pairs: the unused
        tail) and ``pair_weights [P]``."""
        r = routing.rounded
        if r is None:
            r = round_tokens_fused(routing.scores, routing.topk_ids, topk_weights, rounding.tile, rounding.mode,
                                   rounding.generator, self.router.routed_scaling_factor,
                                   routing.counts if x2.shape[0] * self.top_k < 2**24 else None)  # fp32: exact below
        index = backend.plan_pairs(r.token_idx, r.expert_idx, x2.shape[0], self.num_experts, validate=False,
                                   foreign_experts=True, pair_offsets=r.pair_offsets)
        return index, r.pair_weights

    def __getstate__(self) -> dict:
        # a copy (copy.deepcopy: an EMA or reference model) or pickle holds the last aux_loss detached: a tensor
        # inside an autograd graph cannot be deep-copied, and the copy has no part in the layer's graph
        state = super().__getstate__()
        if isinstance(state.get("aux_loss"), torch.Tensor):
            state["aux_loss"] = state["aux_loss"].detach()
        return state

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, d_ff={self.d_ff}, num_experts={self.num_experts}, "
                f"top_k={self.top_k}, activation={self.activation}, save={self.save}, backend={self.backend}"
                + (f", token_rounding={self.token_rounding}" if self.token_rounding else "")
                + (f", fp8={self.fp8}" if self.fp8 is not None else "")
                + ("" if self.ep is None else f", ep={self.ep}"))


def aux_loss(model: nn.Module) -> torch.Tensor:
    """Sum of ``aux_loss`` over every :class:`MoE` in ``model`` (from their last forward)."""
    losses = [m.aux_loss for m in model.modules() if isinstance(m, MoE)]
    return torch.stack([loss.float().to(losses[0].device) for loss in losses]).sum() if losses else torch.zeros(())


def detach_aux_losses(model: nn.Module) -> None:
    """Detach the ``aux_loss`` every :class:`MoE` in ``model`` keeps from its last forward (values unchanged).

    Why: that tensor keeps its step's autograd graph alive until the layer's next forward, and with it the
    gradient accumulators of the parameters (and inputs) upstream of the router, which the next steps then
    reuse. PyTorch binds an accumulator to the stream of the step that made it, so after eager steps on the
    default stream every later step — the side-stream warm-up and the capture included — accumulates on the
    legacy default stream, and ``torch.cuda.graph`` fails ("operation would make the legacy stream depend on
    a capturing blocking stream", then ``cudaErrorStreamCaptureInvalidated``: ``benchmarks/bench_host.py
    --graph`` at OLMoE, T 4096, on an H100). Call it (and drop your own references to the last
    loss) before the warm-up that precedes a capture.
    """
    for m in model.modules():
        if isinstance(m, MoE) and isinstance(m.aux_loss, torch.Tensor):
            m.aux_loss = m.aux_loss.detach()
