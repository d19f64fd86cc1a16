"""Test utilities: routings for the named edge cases and the DESIGN.md §7 tolerance rule.

The rule (after flash-attention's tests): a kernel's error against the float64 reference may be at
most ``factor`` (2) times the error of plain PyTorch computing the same thing in the same dtype, plus a
rounding floor of two machine epsilons of that dtype. Errors are relative Frobenius norms.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .activations import is_gated
from .backends import triton_available
from .reference import act_reference, moe_experts_reference


def triton_on_cpu() -> bool:
    """Whether the Triton kernels are tested on CPU tensors here: no CUDA GPU and the Triton backend imports (the
    test suite runs them in Triton's interpreter, ``TRITON_INTERPRET=1``)."""
    return not torch.cuda.is_available() and triton_available()


ROUTINGS = ("uniform", "zipf", "one_expert", "empty_experts")

# The named edge cases of DESIGN.md §7, as (T, d, h, E, K, routing); small enough for the interpreter.
EDGE_CASES = {
    "T=1": (1, 16, 8, 4, 2, "uniform"),
    "T<tile": (5, 32, 16, 3, 2, "uniform"),
    "odd d and h": (19, 17, 13, 4, 2, "uniform"),
    "prime E": (64, 16, 8, 13, 3, "uniform"),
    "K=1": (50, 16, 24, 6, 1, "uniform"),
    "K=E": (20, 16, 8, 5, 5, "uniform"),
    "empty experts": (48, 16, 8, 8, 2, "empty_experts"),
    "one expert": (48, 16, 8, 8, 1, "one_expert"),
    "zipf": (128, 16, 8, 16, 4, "zipf"),
    "multi-tile": (96, 80, 72, 3, 2, "uniform"),  # several M, N and K tiles; router partials per N-tile
}


def make_routing(T: int, E: int, K: int, kind: str = "uniform", generator: torch.Generator | None = None,
                 device: str | torch.device = "cpu") -> torch.Tensor:
    """Random top-k routing ``[T, K]`` int32 with distinct ids per row.

    Kinds: ``uniform``; ``zipf`` (expert e drawn with weight 1/(e+1)^1.5, highly skewed);
    ``one_expert`` (every token's first choice is expert 0, i.e. all tokens on one expert when K=1);
    ``empty_experts`` (only the first ``max(K, E//2)`` experts are used).
    """
    if kind not in ROUTINGS:
        raise ValueError(f"kind must be one of {ROUTINGS}, got {kind!r}")
    weights = torch.ones(E)
    if kind == "zipf":
        weights = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** 1.5
    elif kind == "empty_experts":
        weights = torch.zeros(E)
        weights[: max(K, E // 2)] = 1.0
    if T == 0:
        return torch.empty(0, K, dtype=torch.int32, device=device)
    # Gumbel top-k = sampling K distinct experts without replacement, proportional to weights.
    g = -torch.log(-torch.log(torch.rand(T, E, generator=generator, dtype=torch.float64).clamp_min(1e-12)))
    keys = torch.log(weights.double().clamp_min(1e-30))[None, :] + g
    if kind == "one_expert":
        keys[:, 0] = float("inf")
    ids = keys.topk(K, dim=1).indices
    return ids.to(torch.int32).to(device)


def make_expert_inputs(T: int, d: int, h: int, E: int, K: int, activation: str = "swiglu",
                       dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                       routing: str = "uniform", seed: int | None = None,
                       bias: bool = False) -> dict[str, torch.Tensor]:
    """Fresh random inputs of :func:`moeblaze.moe_experts` (never zeros), scaled so outputs are O(1).

    Returns a dict with ``x [T, d]``, ``topk_ids [T, K]``, ``topk_weights [T, K]`` (fp32, rows sum to 1),
    ``w_gate_up [E, 2h|h, d]`` and ``w_down [E, d, h]`` in ``dtype`` on ``device`` (and, with ``bias``,
    ``b_gate_up [E, 2h|h]`` and ``b_down [E, d]``). Without ``seed`` a fresh one is drawn and printed
    (pytest shows it with a failing test; pass it back to replay the draw).
    """
    if seed is None:
        seed = int(torch.randint(1 << 30, ()))
        print(f"make_expert_inputs(T={T}, d={d}, h={h}, E={E}, K={K}, routing={routing!r}): seed={seed}")
    gen = torch.Generator().manual_seed(seed)
    rows = 2 * h if is_gated(activation) else h

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)

    tw = torch.rand(T, K, generator=gen) + 0.1
    inputs = {
        "x": randn(T, d),
        "topk_ids": make_routing(T, E, K, routing, gen, device),
        "topk_weights": (tw / tw.sum(1, keepdim=True)).to(device),
        "w_gate_up": randn(E, rows, d, scale=d**-0.5),
        "w_down": randn(E, d, h, scale=h**-0.5),
    }
    if bias:
        inputs["b_gate_up"] = randn(E, rows, scale=0.5)
        inputs["b_down"] = randn(E, d, scale=0.5)
    return inputs


# Differentiable inputs of moe_experts, in the order of the gradients that reference_outputs and
# run_and_grad return after ``out``; the biases only where the inputs hold them.
GRAD_INPUTS = ("x", "w_gate_up", "w_down", "topk_weights", "b_gate_up", "b_down")


def _grad_names(inputs: dict[str, torch.Tensor]) -> list[str]:
    return [k for k in GRAD_INPUTS if inputs.get(k) is not None]


def rel_error(actual: torch.Tensor, ref: torch.Tensor) -> float:
    """``||actual - ref|| / ||ref||`` in float64 (NaN or Inf in ``actual`` gives ``inf``)."""
    a, r = actual.double().cpu(), ref.double().cpu()
    if not torch.isfinite(a).all():
        return float("inf")
    return float((a - r).norm() / r.norm().clamp_min(1e-300))


def assert_close_to_reference(name: str, actual: torch.Tensor, ref64: torch.Tensor,
                              baseline: torch.Tensor | Sequence[torch.Tensor], factor: float = 2.0,
                              magnitude: torch.Tensor | None = None) -> None:
    """DESIGN.md §7: ``err(actual) <= factor * err(baseline) + 2 eps(dtype)`` against the float64 ``ref64``.

    ``baseline`` is plain PyTorch's result in ``actual``'s dtype, or several plain-PyTorch ways of
    computing it (the worst one counts). ``magnitude``: for a quantity that is a sum with cancellation
    (``dtopk_weights`` at T = 1: two dot products), the float64 sums of the terms' absolute values; the
    floor becomes ``2 eps * ||magnitude|| / ||ref64||`` (eps times the sum's condition number, the
    rounding any summation order pays), since every baseline can come out luckily exact.
    Raises ``AssertionError`` with both errors.
    """
    if actual.shape != ref64.shape:
        raise AssertionError(f"{name}: shape {tuple(actual.shape)} != reference {tuple(ref64.shape)}")
    floor = 2 * torch.finfo(actual.dtype).eps if actual.is_floating_point() else 0.0
    if magnitude is not None:
        floor *= max(1.0, float(magnitude.double().norm() / ref64.double().cpu().norm().clamp_min(1e-300)))
    baselines = [baseline] if isinstance(baseline, torch.Tensor) else list(baseline)
    err, base = rel_error(actual, ref64), max(rel_error(b, ref64) for b in baselines)
    if base == float("inf"):
        raise AssertionError(f"{name}: the PyTorch baseline is not finite; the comparison would prove nothing")
    if not err <= factor * base + floor:
        raise AssertionError(f"{name}: relative error {err:.3e} > {factor} x torch's {base:.3e} + {floor:.1e}")


def reference_outputs(inputs: dict[str, torch.Tensor], activation: str, dout: torch.Tensor,
                      dtype: torch.dtype | None = None, **options) -> tuple[torch.Tensor, ...]:
    """``(out, dx, dw_gate_up, dw_down, dtopk_weights[, db_gate_up, db_down])`` of :func:`moe_experts_reference`.

    Computed on the CPU in ``dtype`` (float64 by default: the reference; the inputs' dtype: the
    plain-PyTorch baseline of the tolerance rule). ``options``: the reference's keyword options
    (``gate_up_interleaved``, ``swiglu_alpha``, ``swiglu_limit``); biases come from ``inputs``.
    """
    names = _grad_names(inputs)
    dt = dtype or torch.float64
    leaves = {k: inputs[k].detach().cpu().to(dt if k != "topk_weights" or dtype is None else
                                             inputs[k].dtype).requires_grad_() for k in names}
    out = moe_experts_reference(leaves["x"], inputs["topk_ids"].cpu(), leaves["topk_weights"],
                                leaves["w_gate_up"], leaves["w_down"], activation, b_gate_up=leaves.get("b_gate_up"),
                                b_down=leaves.get("b_down"), **options)
    grads = torch.autograd.grad(out, [leaves[k] for k in names], dout.detach().cpu().to(out.dtype))
    return (out.detach(), *grads)


def _router_weight_grad_terms(inputs: dict[str, torch.Tensor], activation: str, dout: torch.Tensor,
                              dtype: torch.dtype, reduce: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``reduce`` over j of the terms ``(dout[t] W_down[e])_j act[t, k]_j`` of ``dtopk_weights``, ``[T, K]``
    in ``dtype``, a per-expert loop on the CPU."""
    x, ids = inputs["x"].detach().cpu().to(dtype), inputs["topk_ids"].cpu().long()
    w1, w2 = inputs["w_gate_up"].detach().cpu().to(dtype), inputs["w_down"].detach().cpu().to(dtype)
    g = dout.detach().cpu().to(dtype)
    out = torch.zeros(ids.shape, dtype=dtype)
    for e in range(w2.shape[0]):
        tok, k = torch.nonzero(ids == e, as_tuple=True)
        if tok.numel():
            act = act_reference(activation, x[tok] @ w1[e].t())
            out[tok, k] = reduce((g[tok] @ w2[e]) * act)
    return out


def router_weight_grad_alternative(inputs: dict[str, torch.Tensor], activation: str, dout: torch.Tensor,
                                   dtype: torch.dtype) -> torch.Tensor:
    """``dtopk_weights [T, K]`` as ``<dout[t] W_down[e], act[t, k]>`` (DESIGN.md §4), a per-expert loop in
    ``dtype`` on the CPU: the second plain-PyTorch baseline of that gradient beside ``<dout[t], y[t, k]>``."""
    dtw = _router_weight_grad_terms(inputs, activation, dout, dtype, lambda terms: terms.sum(-1))
    return dtw.to(inputs["topk_weights"].dtype)


def router_weight_grad_magnitude(inputs: dict[str, torch.Tensor], activation: str,
                                 dout: torch.Tensor) -> torch.Tensor:
    """``sum_j |(dout[t] W_down[e])_j act[t, k]_j|`` in float64 ``[T, K]``: the magnitude of the terms of
    ``dtopk_weights`` (the ``magnitude`` of :func:`assert_close_to_reference`)."""
    return _router_weight_grad_terms(inputs, activation, dout, torch.float64, lambda terms: terms.abs().sum(-1))


def run_and_grad(fn: Callable[..., torch.Tensor], inputs: dict[str, torch.Tensor],
                 dout: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Run ``fn(**inputs)`` and return ``(out, dx, dw_gate_up, dw_down, dtopk_weights[, db_gate_up, db_down])``."""
    names: Sequence[str] = _grad_names(inputs)
    leaves = {k: (v.detach().clone().requires_grad_() if k in names else v) for k, v in inputs.items()}
    out = fn(**leaves)
    grads = torch.autograd.grad(out, [leaves[k] for k in names], dout)
    return (out.detach(), *grads)
