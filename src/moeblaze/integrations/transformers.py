"""moeblaze as an experts implementation of Hugging Face transformers v5 MoE models (issue 22).

transformers wraps the fused experts module of every MoE family with ``use_experts_implementation``; its
forward invokes ``ExpertsInterface[config._experts_implementation](self, hidden_states [T, d],
top_k_index [T, K], top_k_weights [T, K])``. Importing this module registers :func:`moeblaze_experts_forward`
under the name ``"moeblaze"``::

    import moeblaze.integrations.transformers  # registers "moeblaze"
    model = AutoModelForCausalLM.from_pretrained(path, experts_implementation="moeblaze")
    model.set_experts_implementation("moeblaze")  # or switch a built model

The function reads the module's weights in place (``gate_up_proj [E, 2h, d]`` / ``down_proj [E, d, h]``,
or strided transposed views of ``[E, d, 2h]`` / ``[E, h, d]`` when ``is_transposed``), builds the dispatch
index without a host synchronisation (HF's routers give in-range ids), and leaves HF's router and
auxiliary loss untouched. The activation is identified once per module by evaluating the module's own
``_apply_gate`` / ``act_fn`` on a fixed float64 probe and matching it against moeblaze's activations; a
module whose activation or flags moeblaze cannot serve raises :class:`UnsupportedExpertsError` naming it.
:func:`prepare` does that for a whole model at once (call it before ``torch.compile``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers.integrations.moe import ExpertsInterface

from ..backends import BACKENDS, get_backend
from ..experts import SAVE_MODES, moe_experts
from ..fp8 import Float8Recipe, check_fp8_recipe

__all__ = ["UnsupportedExpertsError", "ExpertsPlan", "experts_plan", "make_experts_forward",
           "moeblaze_experts_forward", "prepare", "register"]

IMPLEMENTATION_NAME = "moeblaze"

# The base functions f of moeblaze's activations: gated ``act = f(gate) * up``, non-gated ``act = f(pre)``.
_BASE: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda z: F.gelu(z, approximate="tanh"),
    "relu": F.relu,
    "relu2": lambda z: F.relu(z).square(),
}
_GATED_NAME = {"silu": "swiglu", "gelu": "geglu", "gelu_tanh": "geglu_tanh"}  # relu/relu2 have no gated kernel
# Attribute names of the clamped-SwiGLU parameters in transformers' experts classes (GPT-OSS, MiniMax-M3).
_ALPHA_LIMIT_ATTRS = (("alpha", "limit"), ("swiglu_alpha", "swiglu_limit"))


class UnsupportedExpertsError(ValueError):
    """A transformers experts module uses a flag, layout or activation that moeblaze cannot run."""


@dataclass(frozen=True)
class ExpertsPlan:
    """How one transformers experts module maps onto :func:`moeblaze.moe_experts`.

    Attributes:
        activation: moeblaze's activation name (``swiglu``, ``geglu``, ``geglu_tanh``, ``swiglu_clamped``,
            ``silu``, ``gelu``, ``gelu_tanh``, ``relu`` or ``relu2``).
        gated: the module has ``gate_up_proj`` (else ``up_proj``).
        interleaved: gate and up rows alternate (``is_concatenated=False``, GPT-OSS).
        transposed: weights stored ``[E, d, 2h]`` / ``[E, h, d]`` (``is_transposed``).
        has_bias: ``gate_up_proj_bias [E, 2h]`` / ``down_proj_bias [E, d]`` exist.
        alpha, limit: parameters of ``swiglu_clamped`` (None otherwise).
        foreign_experts: expert parallelism is on: ids ``>= E`` name experts of other ranks.
    """

    activation: str
    gated: bool
    interleaved: bool
    transposed: bool
    has_bias: bool
    alpha: float | None = None
    limit: float | None = None
    foreign_experts: bool = False


def _probe(width: int) -> torch.Tensor:
    """Fixed float64 probe ``[64, width]`` over [-12, 12]: crosses every clamp limit and GELU's tails."""
    g = torch.Generator().manual_seed(22)
    return torch.rand(64, width, generator=g, dtype=torch.float64) * 24.0 - 12.0


def _matches(fn: Callable[[torch.Tensor], torch.Tensor], z: torch.Tensor, expected: torch.Tensor) -> bool:
    try:
        got = fn(z)
    except Exception:  # a module-specific function that cannot run on the probe is simply not a match
        return False
    # 1e-6: tolerates an activation that computes in fp32 internally, far below the smallest gap between two
    # candidates (exact vs tanh GELU: 4.7e-4 at |z| ~ 2)
    return isinstance(got, torch.Tensor) and got.shape == expected.shape and torch.allclose(
        got.double(), expected, rtol=1e-6, atol=1e-6)


def _split(pre: torch.Tensor, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return (pre[..., ::2], pre[..., 1::2]) if interleaved else pre.chunk(2, dim=-1)


def _gated_candidates(module: nn.Module, interleaved: bool):
    """(name, alpha, limit, act_fn of pre [.., 2h]) for every gated activation moeblaze runs."""
    for base, name in _GATED_NAME.items():
        def gated(p, f=_BASE[base]):
            g, u = _split(p, interleaved)
            return f(g) * u
        yield name, None, None, gated
    for a_attr, l_attr in _ALPHA_LIMIT_ATTRS:
        alpha, limit = getattr(module, a_attr, None), getattr(module, l_attr, None)
        if isinstance(alpha, (int, float)) and isinstance(limit, (int, float)):
            def clamped(p, alpha=float(alpha), limit=float(limit)):
                g, u = _split(p, interleaved)
                g, u = g.clamp(max=limit), u.clamp(-limit, limit)
                return (u + 1) * g * torch.sigmoid(alpha * g)
            yield "swiglu_clamped", float(alpha), float(limit), clamped


def _identify_activation(module: nn.Module, gated: bool, interleaved: bool) -> tuple[str, float | None, float | None]:
    """Name the module's activation by evaluating it on :func:`_probe` (float64, CPU, once per module)."""
    cls = type(module).__name__
    if gated:
        z = _probe(2 * 48)
        for name, alpha, limit, fn in _gated_candidates(module, interleaved):
            if _matches(module._apply_gate, z, fn(z)):
                return name, alpha, limit
        raise UnsupportedExpertsError(
            f"{cls}: its gating (_apply_gate with act_fn {getattr(module, 'act_fn', None)!r}, is_concatenated="
            f"{not interleaved}) matches none of moeblaze's gated activations "
            f"{tuple(_GATED_NAME.values()) + ('swiglu_clamped',)}")
    act_fn = getattr(module, "act_fn", None)
    z = _probe(48)
    for name, f in _BASE.items():
        if act_fn is not None and _matches(act_fn, z, f(z)):
            return name, None, None
    raise UnsupportedExpertsError(f"{cls}: its activation act_fn={act_fn!r} matches none of moeblaze's "
                                  f"non-gated activations {tuple(_BASE)}")


def _expert_parallel(module: nn.Module) -> bool:
    dist = getattr(getattr(module, "config", None), "distributed_config", None)
    return bool(getattr(dist, "enable_expert_parallel", False)) or bool(getattr(module, "_is_expert_parallel", False))


def experts_plan(module: nn.Module) -> ExpertsPlan:
    """Map a transformers experts module (one wrapped by ``use_experts_implementation``) to moeblaze.

    The result is cached on the module (``module._moeblaze_plan``).

    Raises:
        UnsupportedExpertsError: a flag moeblaze cannot serve (``has_post_expert_norm``, missing weights)
            or an activation it cannot identify.
    """
    plan = module.__dict__.get("_moeblaze_plan")
    if plan is not None:
        return plan
    cls = type(module).__name__
    if getattr(module, "has_post_expert_norm", False):
        raise UnsupportedExpertsError(f"{cls}: has_post_expert_norm=True (a norm on each expert's output) "
                                      "is not supported by moeblaze's fused experts")
    gated = bool(getattr(module, "has_gate", True))
    w1_name = "gate_up_proj" if gated else "up_proj"
    for name in (w1_name, "down_proj"):
        w = getattr(module, name, None)
        if not isinstance(w, torch.Tensor) or w.dim() != 3:
            raise UnsupportedExpertsError(f"{cls}: expected a 3-d parameter {name!r} [E, rows, cols], got {w!r}")
    interleaved = gated and not bool(getattr(module, "is_concatenated", True))
    activation, alpha, limit = _identify_activation(module, gated, interleaved)
    plan = ExpertsPlan(activation, gated, interleaved, bool(getattr(module, "is_transposed", False)),
                       bool(getattr(module, "has_bias", False)), alpha, limit, _expert_parallel(module))
    module.__dict__["_moeblaze_plan"] = plan
    return plan


def prepare(model: nn.Module) -> dict[str, ExpertsPlan]:
    """Compute (and cache) the plan of every transformers experts module in ``model`` now: errors surface at
    once, and a later ``torch.compile`` of the model does not trace the one-time activation probe.

    Returns:
        ``{module name: ExpertsPlan}``.

    Raises:
        UnsupportedExpertsError: as :func:`experts_plan`, for the first module moeblaze cannot run.
    """
    return {name: experts_plan(m) for name, m in model.named_modules() if hasattr(m, "has_gate")}


def _weights(module: nn.Module, plan: ExpertsPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """``w_gate_up [E, 2h, d]`` (or ``w_up [E, h, d]``) and ``w_down [E, d, h]``: the parameters themselves,
    or strided transposed views of them (never a copy)."""
    w1 = module.gate_up_proj if plan.gated else module.up_proj
    w2 = module.down_proj
    if plan.transposed:
        w1, w2 = w1.transpose(1, 2), w2.transpose(1, 2)
    return w1, w2


def make_experts_forward(save: str = "preact", backend: str = "auto",
                         fp8: Float8Recipe | None = None) -> Callable[..., torch.Tensor]:
    """An experts function for ``ExpertsInterface`` running :func:`moeblaze.moe_experts` with these options.

    Args:
        save: ``"preact"`` or ``"input"`` (see :func:`moeblaze.moe_experts`).
        backend: ``"auto"``, ``"torch"`` or ``"triton"``.
        fp8: a :class:`moeblaze.fp8.Float8Recipe` for the expert GEMMs (e4m3 operands with DeepSeek-V3's tile
            scales or rowwise ones, ``pre`` saved in FP8), or None for the model's dtype (see
            :func:`moeblaze.moe_experts`; the ``"torch"`` backend emulates the recipe).

    Returns:
        ``fn(module, hidden_states [T, d], top_k_index [T, K], top_k_weights [T, K]) -> [T, d]`` in
        ``hidden_states.dtype``; register it with ``ExpertsInterface.register(name, fn)``.

    Raises:
        ValueError: bad ``save`` or ``backend``.
        TypeError: ``fp8`` neither None nor a recipe.
    """
    if save not in SAVE_MODES:
        raise ValueError(f"save must be one of {SAVE_MODES}, got {save!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    check_fp8_recipe(fp8)

    def experts_forward(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                        top_k_weights: torch.Tensor) -> torch.Tensor:
        plan = experts_plan(module)
        w1, w2 = _weights(module, plan)
        x = hidden_states
        # As transformers' grouped_mm, x takes the weights' dtype (e.g. an fp32 norm output before bf16 experts),
        # except fp32 weights under autocast: those are moe_experts' own autocast case, left to it.
        if x.dtype != w1.dtype and not (w1.dtype == torch.float32 and torch.is_autocast_enabled(x.device.type)):
            x = x.to(w1.dtype)
        # Router weights of a float64 model (DeepSeek's router computes in fp32) are upcast so that nothing in
        # the experts rounds to fp32; other dtypes go to the kernels as they are.
        weights = top_k_weights.to(x.dtype) if x.dtype == torch.float64 else top_k_weights
        kwargs = {}
        if plan.has_bias:
            kwargs.update(b_gate_up=module.gate_up_proj_bias if plan.gated else module.up_proj_bias,
                          b_down=module.down_proj_bias)
        if plan.interleaved:
            kwargs["gate_up_interleaved"] = True
        if plan.activation == "swiglu_clamped":
            kwargs.update(swiglu_alpha=plan.alpha, swiglu_limit=plan.limit)
        index = None
        if plan.foreign_experts:
            kwargs["foreign_experts"] = True
        else:  # ids from transformers' routers come from top-k over E scores: in range, so no host-syncing check
            index = get_backend(backend, x).plan(top_k_index, w2.shape[0], validate=False)
        out = moe_experts(x, top_k_index, weights, w1, w2, activation=plan.activation, save=save,
                          backend=backend, index=index, fp8=fp8, **kwargs)
        return out.to(hidden_states.dtype)

    name = f"moeblaze_experts_forward_{save}_{backend}" + ("" if fp8 is None else f"_fp8_{fp8.granularity}")
    experts_forward.__name__ = experts_forward.__qualname__ = name
    return experts_forward


moeblaze_experts_forward = make_experts_forward()
moeblaze_experts_forward.__doc__ = """The ``"moeblaze"`` experts implementation: :func:`moeblaze.moe_experts` with
``save="preact"``, ``backend="auto"`` on a transformers experts module (see :func:`make_experts_forward`)."""


def register(name: str = IMPLEMENTATION_NAME, fn: Callable[..., torch.Tensor] = moeblaze_experts_forward) -> None:
    """Register ``fn`` as the transformers experts implementation ``name`` (done for ``"moeblaze"`` on import)."""
    ExpertsInterface.register(name, fn)


register()
