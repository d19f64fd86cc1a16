"""The implementations ``moeblaze bench`` runs side by side, each as forward of one MoE layer (router included).

* ``conventional`` — the layer as torchtitan and HF transformers v5 write it: a bf16 router, ``argsort`` of
  the routing to group pairs by expert, a materialised gathered input ``x[token_idx] [N, d]``,
  ``torch.nn.functional.grouped_mm`` for both projections (a per-expert matmul where grouped_mm cannot
  run: CPU, fp32, unaligned shapes), the weighted expert outputs combined with ``index_add``, plain autograd.
* ``conventional-fp8`` — the same with its expert GEMMs in FP8 through torchao's MoE training op
  (:mod:`moeblaze.bench.fp8_baseline`; torchao >= 0.18, sm90 and sm100).
* ``hf-loop`` — the HF transformers v4 per-expert loop (one-hot mask, ``torch.where``, ``index_add_``).
* ``moeblaze`` / ``moeblaze-input`` / ``moeblaze-torch`` — :class:`moeblaze.MoE` with the Triton backend
  (``save="preact"`` / ``"input"``) and with the PyTorch backend; ``moeblaze-tr``: the Triton layer with token
  rounding ``nr`` (``moeblaze bench --impls moeblaze,moeblaze-tr`` times it against top-k); ``moeblaze-fp8``: the
  Triton layer under the rowwise FP8 recipe (Hopper and Blackwell).
* ``liger`` — Liger-Kernel's ``LigerFusedMoEFunction`` (SwiGLU only), fed by the same router as ``conventional``.
* ``sonicmoe`` — SonicMoE's ``moe_TC_softmax_topk_layer`` (GLU activations only), its own fused router,
  configured as top-k over softmax without renormalisation (the maths of every other row).
* ``dense`` — not an MoE: a dense gated MLP of width ``K*h`` (the layer's active FLOPs per token, no router, no
  dispatch; its own weights). The floor of a layer doing that work in eager PyTorch: the host time of three
  ``nn.Linear`` and an activation, and the GPU time of dense GEMMs of the same FLOPs.

All share the weights of :class:`LayerWeights` (layout of DESIGN.md §2; SonicMoE gets permuted views,
zero-copy). Peers are optional: when not importable the row is skipped with a note. An implementation
whose first call may compile for minutes (``sonicmoe``) sets :attr:`Impl.isolate`: the runner measures it
in a child process that it can kill (:mod:`moeblaze.bench.worker`).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..dispatch import DispatchIndex
from .configs import BenchConfig

__all__ = ["LayerWeights", "ImplOptions", "Impl", "IMPLS", "DEFAULT_IMPLS", "BASELINE_IMPL", "make_weights",
           "resolve_impl", "step_params", "torch_router", "conventional_experts", "hf_loop_experts", "sort_dispatch",
           "grouped_linear"]

BASELINE_IMPL = "conventional"
PEERS_HINT = "install the peers: source .peers/install.sh /tmp/peers"


@dataclass
class LayerWeights:
    """Parameters of one MoE layer: ``router [E, d]``, ``w1 [E, 2h|h, d]``, ``w2 [E, d, h]``."""

    router: nn.Parameter
    w1: nn.Parameter
    w2: nn.Parameter

    def params(self) -> list[nn.Parameter]:
        return [self.router, self.w1, self.w2]


@dataclass
class ImplOptions:
    """Options of the implementations.

    Attributes:
        liger_autotune: let Liger autotune its kernels (> 2 min per (d, h) shape; off: one fixed config).
        hf_max_tokens: skip the per-expert loop above this many tokens (it is slow and memory-hungry).
    """

    liger_autotune: bool = False
    hf_max_tokens: int = 131072


def make_weights(cfg: BenchConfig, device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16,
                 seed: int = 0) -> LayerWeights:
    """Random weights (``nn.Linear``-like scale) for ``cfg`` on ``device`` in ``dtype``."""
    gen = torch.Generator(device=device).manual_seed(seed)
    rows = 2 * cfg.h if cfg.gated else cfg.h

    def param(*shape: int, fan_in: int) -> nn.Parameter:
        t = torch.empty(*shape, device=device, dtype=dtype)
        t.uniform_(-(fan_in**-0.5), fan_in**-0.5, generator=gen)
        return nn.Parameter(t)

    return LayerWeights(param(cfg.E, cfg.d, fan_in=cfg.d), param(cfg.E, rows, cfg.d, fan_in=cfg.d),
                        param(cfg.E, cfg.d, cfg.h, fan_in=cfg.h))


def torch_router(x: torch.Tensor, router_w: torch.Tensor, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """HF v5 / torchtitan router: ``logits = x Wr^T`` in x's dtype, softmax in fp32, top-K (no renormalisation).

    Returns ``(topk_weights [T, K] fp32, topk_ids [T, K] int64)``.
    """
    scores = torch.softmax(F.linear(x, router_w).float(), dim=-1)
    return torch.topk(scores, K, dim=-1)


def _act(pre: torch.Tensor, activation: str) -> torch.Tensor:
    """Plain-PyTorch activation (as HF and torchtitan write it): gate rows first, then up rows."""
    f = {"swiglu": F.silu, "silu": F.silu, "geglu": F.gelu, "gelu": F.gelu, "relu": F.relu}[activation]
    if activation in ("swiglu", "geglu"):
        gate, up = pre.chunk(2, dim=-1)
        return f(gate) * up
    return f(pre)


def _grouped_mm_fn() -> Callable | None:
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def grouped_linear(a: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Per expert e: ``a[ends[e-1]:ends[e]] @ w[e].T`` (differentiable).

    ``a [N, in]``, ``w [E, out, in]``, ``ends [E]`` int32 inclusive cumulative counts -> ``[N, out]``.
    ``grouped_mm`` on CUDA with 16-bit operands and 16-byte aligned rows; a per-expert loop otherwise
    (one host read of the counts).
    """
    gmm = _grouped_mm_fn()
    if (gmm is not None and a.is_cuda and a.dtype in (torch.bfloat16, torch.float16)
            and a.shape[-1] % 8 == 0 and w.shape[1] % 8 == 0):
        return gmm(a, w.transpose(-2, -1), offs=ends)
    bounds = [0] + ends.tolist()
    return torch.cat([a[bounds[e]:bounds[e + 1]] @ w[e].t() for e in range(w.shape[0])])


def conventional_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                         w_gate_up: torch.Tensor, w_down: torch.Tensor, activation: str = "swiglu",
                         combine: str = "index_add") -> torch.Tensor:
    """The routed experts as torchtitan / HF v5 compute them (argsort permute, gathered copy, grouped_mm).

    Args: as :func:`moeblaze.moe_experts` (``x [T, d]``, ``topk_ids [T, K]``, ``topk_weights [T, K]``,
        ``w_gate_up [E, 2h|h, d]``, ``w_down [E, d, h]``); ``combine``: ``"index_add"`` or ``"scatter_add"``.

    Returns:
        ``[T, d]`` in ``x.dtype``. Autograd saves the gathered input ``[N, d]``, the pre-activation, the
        activation pieces and the expert outputs ``[N, d]`` (DESIGN.md §4, "conventional").
    """
    T, K = topk_ids.shape
    E = w_down.shape[0]
    flat = topk_ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)  # slot -> pair, grouped by expert
    token_idx = order // K  # slot -> token
    ends = torch.cumsum(torch.bincount(flat, minlength=E), 0).to(torch.int32)
    xg = x[token_idx]  # the materialised routing buffer [N, d]
    act = _act(grouped_linear(xg, w_gate_up, ends), activation)
    y = grouped_linear(act, w_down, ends)
    y = y * topk_weights.reshape(-1)[order].to(y.dtype)[:, None]
    if combine == "scatter_add":
        return torch.zeros_like(x).scatter_add(0, token_idx[:, None].expand(-1, x.shape[1]), y)
    return torch.zeros_like(x).index_add(0, token_idx, y)


def hf_loop_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                    w_gate_up: torch.Tensor, w_down: torch.Tensor, activation: str = "swiglu") -> torch.Tensor:
    """The HF transformers v4 per-expert loop (Mixtral / Qwen-MoE ``forward``); arguments as
    :func:`conventional_experts`. One host sync for the experts hit, one Python iteration per expert."""
    E = w_down.shape[0]
    out = torch.zeros_like(x)
    expert_mask = F.one_hot(topk_ids.long(), num_classes=E).permute(2, 1, 0)  # [E, K, T]
    hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero().flatten().tolist()
    for e in hit:
        k_idx, tok = torch.where(expert_mask[e])
        h = _act(F.linear(x[tok], w_gate_up[e]), activation)
        y = F.linear(h, w_down[e]) * topk_weights[tok, k_idx, None].to(x.dtype)
        out.index_add_(0, tok, y)
    return out


def sort_dispatch(topk_ids: torch.Tensor, num_experts: int) -> DispatchIndex:
    """The dispatch index of DESIGN.md §3 built the conventional way: a stable ``argsort`` of the routing.

    The baseline of the dispatch micro-benchmark; gives bitwise the arrays of :func:`moeblaze.build_dispatch`.
    """
    T, K = topk_ids.shape
    flat = topk_ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    offsets = torch.zeros(num_experts + 1, dtype=torch.int32, device=flat.device)
    torch.cumsum(torch.bincount(flat, minlength=num_experts), 0, out=offsets[1:])
    tim = torch.empty(T * K, dtype=torch.int32, device=flat.device)
    tim[order] = torch.arange(T * K, dtype=torch.int32, device=flat.device)
    return DispatchIndex(offsets, (order // K).to(torch.int32), topk_ids.to(torch.int32), tim.view(T, K),
                         num_experts)


# ---------------------------------------------------------------------------------------------------
# The registry: each implementation builds ``fn(x [T, d]) -> out [T, d]`` over shared weights.
# ---------------------------------------------------------------------------------------------------

Builder = Callable[[BenchConfig, LayerWeights, ImplOptions], Callable[[torch.Tensor], torch.Tensor]]


@dataclass
class Impl:
    """One benchmarked implementation.

    Attributes:
        name: row label; description: one line for the report.
        build: ``build(cfg, weights, opts) -> fn(x) -> out``.
        module: a module that must be importable (``None``: always available).
        activations: activations it supports (``None``: all).
        needs_cuda: True when it cannot run on the CPU.
        sm: the GPU architectures it runs on (compute capability majors; empty: any).
        align: ``d`` and ``h`` must be multiples of this.
        install: how to install ``module`` when it is missing.
        isolate: measure it in a child process killed after ``RunOptions.isolate_timeout_s`` (a first call
            that compiles for minutes cannot be interrupted in-process); see :mod:`moeblaze.bench.worker`.
    """

    name: str
    description: str
    build: Builder
    module: str | None = None
    activations: tuple[str, ...] | None = None
    needs_cuda: bool = False
    sm: tuple[int, ...] = ()
    align: int = 1
    install: str = PEERS_HINT
    isolate: bool = False

    def unavailable(self) -> str | None:
        """Why it cannot run in this process at all (missing package), or ``None``."""
        if self.needs_cuda and not torch.cuda.is_available():
            return "needs CUDA"
        if self.sm and (cc := torch.cuda.get_device_capability())[0] not in self.sm:
            return (f"runs on {' / '.join(f'sm{m}0' for m in self.sm)} only ({torch.cuda.get_device_name()} is "
                    f"sm{cc[0]}{cc[1]})")
        if self.module is not None and not _importable(self.module):
            hint = self.install if not self.module.startswith("moeblaze") else "not in this build of moeblaze"
            return f"{self.module} not importable ({hint})"
        return None

    def unsupported(self, cfg: BenchConfig, opts: ImplOptions) -> str | None:
        """Why it cannot run ``cfg`` (activation, size caps), or ``None``."""
        if self.activations is not None and cfg.activation not in self.activations:
            return f"{self.name} supports {'/'.join(self.activations)} only"
        if self.name == "hf-loop" and opts.hf_max_tokens < cfg.T:
            return f"per-expert loop skipped above T={opts.hf_max_tokens} (--hf-max-tokens)"
        if cfg.d % self.align or cfg.h % self.align:
            return f"{self.name} needs d and h multiples of {self.align}"
        return None


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _routed(experts: Callable) -> Builder:
    def build(cfg: BenchConfig, w: LayerWeights, opts: ImplOptions):
        def fn(x: torch.Tensor) -> torch.Tensor:
            tw, ids = torch_router(x, w.router, cfg.K)
            return experts(x, ids, tw, w.w1, w.w2, cfg.activation)

        return fn

    return build


def _moeblaze(backend: str, save: str, token_rounding: str | None = None, fp8: bool = False) -> Builder:
    def build(cfg: BenchConfig, w: LayerWeights, opts: ImplOptions):
        from ..fp8 import Float8Recipe
        from ..layer import MoE

        moe = MoE(cfg.d, cfg.h, cfg.E, cfg.K, activation=cfg.activation, save=save, backend=backend,
                  aux_loss_coef=0.0, z_loss_coef=0.0, device="meta", dtype=w.w1.dtype, token_rounding=token_rounding,
                  fp8=Float8Recipe("rowwise") if fp8 else None)
        moe.router.weight = w.router
        setattr(moe, "w_gate_up" if cfg.gated else "w_up", w.w1)
        moe.w_down = w.w2
        return moe

    return build


def _conventional_fp8(cfg: BenchConfig, w: LayerWeights, opts: ImplOptions):
    from .fp8_baseline import conventional_fp8_experts

    return _routed(conventional_fp8_experts)(cfg, w, opts)


def _dense(cfg: BenchConfig, w: LayerWeights, opts: ImplOptions) -> nn.Module:
    from ..layer import SharedExpert

    return SharedExpert(cfg.d, cfg.K * cfg.h, cfg.activation, device=w.w1.device, dtype=w.w1.dtype)


def step_params(fn: Callable, w: LayerWeights) -> list[torch.Tensor]:
    """The parameters a training step of ``fn`` updates: the shared weights ``w``, then the parameters of ``fn``
    itself (an ``nn.Module``'s) that are not among them, as ``dense``'s own weights."""
    shared = w.params()
    ids = {id(p) for p in shared}
    own = fn.parameters() if isinstance(fn, nn.Module) else ()
    return shared + [p for p in own if id(p) not in ids]


def _liger(cfg: BenchConfig, w: LayerWeights, opts: ImplOptions):
    # Read once, when liger_kernel.ops.fused_moe is first imported.
    os.environ.setdefault("LIGER_FUSED_MOE_AUTOTUNE", "1" if opts.liger_autotune else "0")
    from liger_kernel.ops.fused_moe import LigerFusedMoEFunction

    def fn(x: torch.Tensor) -> torch.Tensor:
        tw, ids = torch_router(x, w.router, cfg.K)
        return LigerFusedMoEFunction.apply(x, w.w1, w.w2, ids.to(torch.int32), tw.to(x.dtype))

    return fn


def _sonic(cfg: BenchConfig, w: LayerWeights, opts: ImplOptions):
    from sonicmoe import moe_TC_softmax_topk_layer
    from sonicmoe.enums import ActivationType

    act = ActivationType(cfg.activation)
    stream = torch.cuda.current_stream().cuda_stream

    def fn(x: torch.Tensor) -> torch.Tensor:
        # [E, 2h, d] -> [2h, d, E] and [E, d, h] -> [d, h, E]: SonicMoE's stride order (2, 0, 1), zero-copy;
        # concat_layout: gate rows then up rows, as in DESIGN.md §2.
        out, _, _ = moe_TC_softmax_topk_layer(x, w.router, w.w1.permute(1, 2, 0), None, w.w2.permute(1, 2, 0),
                                              None, cfg.K, stream, act, False, is_softmax_over_topk=False,
                                              norm_topk_probs=False, concat_layout=True)
        return out

    return fn


IMPLS: dict[str, Impl] = {i.name: i for i in [
    Impl("moeblaze", "moeblaze.MoE, Triton backend, save='preact'", _moeblaze("triton", "preact"),
         module="moeblaze.kernels.experts", needs_cuda=True),
    Impl("moeblaze-input", "moeblaze.MoE, Triton backend, save='input' (recompute up-projection)",
         _moeblaze("triton", "input"), module="moeblaze.kernels.experts", needs_cuda=True),
    Impl("moeblaze-torch", "moeblaze.MoE, PyTorch backend (grouped_mm over the dispatch index)",
         _moeblaze("torch", "preact")),
    Impl("moeblaze-tr", "moeblaze.MoE, Triton backend, token rounding 'nr' (SonicMoE §5; router and rounding timed)",
         _moeblaze("triton", "preact", "nr"), module="moeblaze.kernels.experts", needs_cuda=True),
    Impl("moeblaze-fp8", "moeblaze.MoE, Triton backend, save='preact', FP8 rowwise recipe (e4m3 F1, F2, B1, B3)",
         _moeblaze("triton", "preact", fp8=True), module="moeblaze.kernels.fp8_experts", needs_cuda=True, sm=(9, 10)),
    Impl("conventional", "torchtitan / HF v5 style: argsort, gathered x, grouped_mm, index_add, autograd",
         _routed(conventional_experts)),
    Impl("conventional-fp8", "the conventional layer, expert GEMMs in FP8 through torchao's rowwise MoE training "
         "op (torch._scaled_grouped_mm, groups padded to 16)", _conventional_fp8,
         module="torchao.prototype.moe_training", install="pip install torchao==0.18.0", needs_cuda=True,
         sm=(9, 10), align=16),  # the FP8 grouped GEMM's 16-byte rows
    Impl("hf-loop", "HF v4 style per-expert loop", _routed(hf_loop_experts)),
    Impl("liger", "Liger-Kernel LigerFusedMoEFunction (Triton)", _liger, module="liger_kernel",
         activations=("swiglu",), needs_cuda=True),
    Impl("sonicmoe", "SonicMoE moe_TC_softmax_topk_layer (CuTe DSL)", _sonic, module="sonicmoe",
         activations=("swiglu", "geglu"), needs_cuda=True, isolate=True),
    Impl("dense", "not an MoE: dense gated MLP of width K*h (the active FLOPs), no router", _dense,
         activations=("swiglu", "geglu")),
]}
DEFAULT_IMPLS = ["moeblaze", "moeblaze-torch", "conventional", "hf-loop", "liger", "sonicmoe"]


def resolve_impl(spec: str) -> Impl:
    """The implementation named ``spec``: a key of :data:`IMPLS`, or ``"module:attribute"`` naming an
    importable :class:`Impl` (or a callable returning one) outside the registry, e.g. a test's or a user's
    own layer. The same string finds it again in the child process of an isolated run.

    Args:
        spec: ``"conventional"``, ``"mypkg.moe_impls:MY_IMPL"``, ...

    Raises:
        KeyError: not a registered name, or a ``module:attribute`` that cannot be imported or is no Impl.
    """
    if spec in IMPLS:
        return IMPLS[spec]
    module, sep, attr = spec.partition(":")
    if not sep:
        raise KeyError(f"unknown implementation {spec!r}; choose from {list(IMPLS)} or give module:attribute")
    try:
        obj = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise KeyError(f"cannot load implementation {spec!r}: {type(exc).__name__}: {exc}") from exc
    impl = obj if isinstance(obj, Impl) else obj() if callable(obj) else None
    if not isinstance(impl, Impl):
        raise KeyError(f"{spec!r} is not an Impl nor a factory of one (got {type(impl).__name__})")
    return impl
