"""The expert-parallel (EP) layers ``benchmarks/bench_ep.py`` runs against an expert-parallel :class:`moeblaze.MoE`
(issue 57), each built on the router and the local expert weights of a moeblaze EP layer so that all of them
compute the same function of the same tokens (DESIGN.md §2: softmax scores, top-k without renormalisation,
SwiGLU experts, the weighted sum of the K expert outputs).

* :class:`TitanStyleEP` — an EP layer written the way torchtitan writes it, in this repository: argsort of the
  routing, a gathered copy of x with a row per (token, expert) pair, the all-to-alls, the received rows regrouped
  by local expert (a second copy), ``grouped_mm`` for both projections, plain autograd.
* :func:`build_torchtitan_ep` — torchtitan 0.3.0's own MoE (``torchtitan.models.common.moe``:
  ``TokenChoiceTopKRouter``, ``GroupedExperts`` on ``torch._grouped_mm``, ``AllToAllTokenDispatcher``) with its
  expert parallelism applied the way its trainer applies it: ``ParallelDims`` (EP over the data-parallel ranks),
  ``set_moe_sharding_config`` (``torchtitan.models.common.moe_sharding``: experts ``Shard(0)`` on the 1-D ``ep``
  mesh, router replicated) and ``Module.parallelize``, run under its SPMD context (its default ``spmd_types``
  backend). torchtitan is optional: it is imported only here, and its absence is a one-line ``ImportError``.

torchtitan 0.3.0's layout and maths, as mapped from moeblaze's (checked in its source):
``router.gate.weight [E, d]`` = ``router.weight``; ``GroupedExperts.w1_EFD [E, h, d]`` = gate rows
``w_gate_up[:, :h]``, ``w3_EFD [E, h, d]`` = up rows ``w_gate_up[:, h:]``, ``w2_EDF [E, d, h]`` = ``w_down``;
experts ``silu(x w1^T) * (x w3^T) w2^T`` with bf16 operands whatever the parameters' dtype (its forward casts
them); scores ``softmax`` of fp32 logits (the gate under fp32 autocast), ``topk`` of them, ``route_norm=False``,
``route_scale=1``; the scores multiply each expert output in fp32 after the experts, in its combine (the same
function as weighting before: the weight is a scalar per row).
"""

from __future__ import annotations

import importlib.util

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

from ..layer import MoE
from .baselines import _act, grouped_linear

TORCHTITAN_INSTALL = "pip install torchtitan==0.3.0 tyro docstring_parser spmd_types==0.2.3"


def _a2a(t: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    return wait_tensor(all_to_all_single_autograd(t, out_splits, in_splits, group))


class TitanStyleEP(nn.Module):
    """An expert-parallel layer written the way torchtitan writes it (argsort permute, gathered buffers,
    grouped GEMMs, autograd), on the router and local expert weights of a moeblaze EP layer.

    ``forward(x [T, d]) -> [T, d]`` in x's dtype, on the ranks of ``src``'s EP group (every rank invokes it).
    The router is ``src``'s own module (shared); the expert weights are copies (``w_gate_up [E/P, 2h, d]``,
    ``w_down [E/P, d, h]``), so gradients of the two layers' experts stay apart.
    """

    def __init__(self, src: MoE) -> None:
        super().__init__()
        if src.ep is None:
            raise ValueError("TitanStyleEP needs an expert-parallel moeblaze.MoE (moeblaze.parallel.expert_parallel), "
                             "got one that is not")
        self.router = src.router
        self.w_gate_up = nn.Parameter(src.w1.detach().clone())
        self.w_down = nn.Parameter(src.w_down.detach().clone())
        self.activation, self.E, self.P, self.group = src.activation, src.num_experts, src.ep.size, src.ep.group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routing = self.router(x)
        T, K = routing.topk_ids.shape
        P, El = self.P, self.E // self.P
        flat = routing.topk_ids.reshape(-1).long()
        order = torch.argsort(flat, stable=True)  # slot -> pair, grouped by expert, hence by rank
        token_idx = order // K
        counts = torch.bincount(flat, minlength=self.E)
        recv_counts = wait_tensor(all_to_all_single_autograd(counts, None, None, self.group))  # [P*El]
        splits = torch.cat((counts.view(P, El).sum(1), recv_counts.view(P, El).sum(1))).tolist()
        send, recv = splits[:P], splits[P:]
        x_recv = _a2a(x[token_idx], recv, send, self.group)  # the gathered routing buffer [N, d], then [R, d]
        local_ids = torch.arange(El, device=x.device).repeat(P).repeat_interleave(recv_counts, output_size=sum(recv))
        perm = torch.argsort(local_ids, stable=True)  # received rows regrouped by local expert
        ends = torch.cumsum(recv_counts.view(P, El).sum(0), 0).to(torch.int32)
        y = grouped_linear(_act(grouped_linear(x_recv[perm], self.w_gate_up, ends), self.activation),
                           self.w_down, ends)
        y = torch.zeros_like(y).index_copy(0, perm, y)  # back to the received order
        y = _a2a(y, send, recv, self.group) * routing.topk_weights.reshape(-1)[order].to(y.dtype)[:, None]
        return torch.zeros_like(x).index_add(0, token_idx, y)


SPMD_BACKENDS = ("spmd_types", "partial_dtensor")


def torchtitan_available() -> bool:
    """Whether ``torchtitan`` can be found (its import itself may still fail; :func:`build_torchtitan_ep`
    says why)."""
    return importlib.util.find_spec("torchtitan") is not None


class TorchTitanEP(nn.Module):
    """torchtitan's expert-parallel ``MoE`` behind moeblaze's calling convention: ``forward(x [T, d]) -> [T, d]``
    in x's dtype (torchtitan's layer takes ``[B, L, d]``; here ``B = 1``), every rank calling it. Each forward
    runs under torchtitan's SPMD backend and context as its trainer's step does (the backend is a torchtitan
    global: it is set for the forward and restored after, so layers of both backends can run in one process).
    Build it with :func:`build_torchtitan_ep`.

    Attributes: ``moe`` (the torchtitan module, parallelised), ``parallel_dims`` (its ``ParallelDims``),
    ``spmd_backend``, ``ep_mesh`` (the 1-D ``ep`` DeviceMesh its experts are sharded on).
    """

    def __init__(self, moe: nn.Module, parallel_dims, spmd_backend: str, tt_utils) -> None:
        super().__init__()
        self.moe, self.parallel_dims, self.spmd_backend, self._utils = moe, parallel_dims, spmd_backend, tt_utils
        self.ep_mesh = parallel_dims.get_mesh("ep")
        self._context = tt_utils.get_spmd_context(parallel_dims=parallel_dims)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            raise ValueError(f"TorchTitanEP takes x [T, d], got shape {tuple(x.shape)}")
        T, d = x.shape
        before = self._utils.get_spmd_backend()
        self._utils.set_spmd_backend(self.spmd_backend)
        try:
            with self._context():
                return self.moe(x.reshape(1, T, d)).reshape(T, d)
        finally:
            self._utils.set_spmd_backend(before)


def _import_torchtitan():
    try:
        from torchtitan.distributed import parallel_dims, utils
        from torchtitan.models.common import moe, moe_sharding, token_dispatcher
        from torchtitan.models.common.linear import Linear
        from torchtitan.tools.utils import set_default_dtype
    except ImportError as e:
        raise ImportError(f"the torchtitan baseline needs torchtitan 0.3.0 ({TORCHTITAN_INSTALL}): {e}") from None
    return parallel_dims, utils, moe, moe_sharding, token_dispatcher, Linear, set_default_dtype


def _check_source(src: MoE) -> None:
    """The moeblaze configurations torchtitan's MoE computes alike; anything else is a ValueError."""
    if not isinstance(src, MoE) or src.ep is None:
        got = "one that is not" if isinstance(src, MoE) else type(src).__name__
        raise ValueError(f"build_torchtitan_ep needs an expert-parallel moeblaze.MoE "
                         f"(moeblaze.parallel.expert_parallel), got {got}")
    r = src.router
    plain = (src.activation == "swiglu" and r.score_func == "softmax" and not r.renormalize and r.n_group == 1
             and r.e_score_correction_bias is None and r.routed_scaling_factor == 1.0
             and src.shared_experts is None and not src.has_bias and src.token_rounding is None)
    if not plain:
        raise ValueError("build_torchtitan_ep needs a moeblaze.MoE with activation='swiglu', score_func='softmax', "
                         "no renormalisation, groups, correction bias, scaling, shared experts, biases or rounding")
    if src.ep.size != dist.get_world_size() or src.ep.rank != dist.get_rank():
        raise ValueError(f"build_torchtitan_ep needs the moeblaze layer's EP group to be the whole world in rank "
                         f"order (torchtitan takes its ep mesh from the world), got EP size {src.ep.size} of "
                         f"world {dist.get_world_size()}")
    if src.d_model % 8 or src.d_ff % 8:
        raise ValueError(f"torchtitan's grouped_mm needs d_model and d_ff multiples of 8 (16-byte rows in bf16), "
                         f"got d_model={src.d_model}, d_ff={src.d_ff}")


def _moe_config(tt_moe, tt_dispatcher, Linear, src: MoE):
    """torchtitan's ``MoE.Config`` for ``src``: its standard all-to-all dispatcher, no load-balancing bias,
    no shared experts."""
    E, K, d, h = src.num_experts, src.top_k, src.d_model, src.d_ff
    return tt_moe.MoE.Config(
        num_experts=E, load_balance_coeff=None, shared_experts=None,
        router=tt_moe.TokenChoiceTopKRouter.Config(
            num_experts=E, gate=Linear.Config(in_features=d, out_features=E, bias=False), top_k=K,
            score_func="softmax", route_norm=False, route_scale=1.0),
        routed_experts=tt_moe.RoutedExperts.Config(
            inner_experts=tt_moe.GroupedExperts.Config(dim=d, hidden_dim=h, num_experts=E),
            token_dispatcher=tt_dispatcher.AllToAllTokenDispatcher.Config(num_experts=E, top_k=K)))


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter: a DTensor's local tensor (``partial_dtensor``), or the parameter itself
    (``spmd_types`` keeps plain local tensors)."""
    return t.to_local() if hasattr(t, "to_local") else t


def build_torchtitan_ep(src: MoE, spmd_backend: str = "spmd_types") -> TorchTitanEP:
    """torchtitan 0.3.0's MoE with its expert parallelism, holding the weights of the moeblaze EP layer ``src``.

    Every rank of the default process group invokes it (collective: it builds torchtitan's meshes). The router
    weight ``[E, d]`` is copied whole; this rank's experts (``src``'s ``w_gate_up [E/P, 2h, d]``, gate rows first,
    and ``w_down [E/P, d, h]``) become torchtitan's local shards ``w1_EFD``, ``w3_EFD [E/P, h, d]`` and
    ``w2_EDF [E/P, d, h]``, in ``src``'s dtype and device. torchtitan's EP ranks are its data-parallel ranks
    (``ParallelDims(dp_shard=P, ep=P)``): each rank routes its own tokens, as with moeblaze.

    ``spmd_backend``: torchtitan's ``parallelism.spmd_backend``. ``"spmd_types"`` (its default) exchanges the
    tokens with ``spmd_types.all_to_all`` (``dist.all_to_all`` over split chunks, uneven: NCCL, not gloo);
    ``"partial_dtensor"`` keeps the experts as DTensors and exchanges with ``all_to_all_single``.

    Raises:
        ImportError: torchtitan (0.3.0, with tyro, docstring_parser and spmd_types 0.2.3) cannot be imported;
            the message names what to install.
        ValueError: ``spmd_backend`` is not one of ``SPMD_BACKENDS``; ``src`` is not an EP ``moeblaze.MoE``
            over the whole world in rank order, or has a configuration torchtitan's layer does not compute.
    """
    if spmd_backend not in SPMD_BACKENDS:
        raise ValueError(f"spmd_backend must be one of {SPMD_BACKENDS}, got {spmd_backend!r}")
    _check_source(src)
    tt_dims, tt_utils, tt_moe, tt_sharding, tt_dispatcher, Linear, set_default_dtype = _import_torchtitan()
    if not hasattr(torch.compiler, "_is_non_strict_tracing"):
        # torchtitan 0.3.0's token dispatcher asks this private function of torch >= 2.12 whether a non-strict
        # trace runs; torch 2.11 has none, and no such trace runs here
        torch.compiler._is_non_strict_tracing = lambda: False
    device, dtype, P, h = src.w_down.device, src.w_down.dtype, src.ep.size, src.d_ff
    # torchtitan takes "cuda" as its device type when it finds no accelerator; its meshes follow the layer's
    # device instead, so that the same code runs on gloo CPU ranks.
    tt_dims.device_type = device.type
    before = tt_utils.get_spmd_backend()
    tt_utils.set_spmd_backend(spmd_backend)  # a torchtitan global, which its trainer sets once
    try:
        dims = tt_dims.ParallelDims(dp_replicate=1, dp_shard=P, cp=1, tp=1, pp=1, ep=P, world_size=P,
                                    spmd_backend=spmd_backend)
        cfg = _moe_config(tt_moe, tt_dispatcher, Linear, src)
        tt_sharding.set_moe_sharding_config(cfg, enable_ep=True, enable_sp=False,
                                            expert_param_layout=_expert_param_layout())
        with torch.device("meta"), set_default_dtype(dtype):  # its trainer's order: build on meta, parallelise,
            moe = cfg.build()                                   # then materialise the local shards
        moe.parallelize(dims)
        moe.to_empty(device=device)
        experts = moe.routed_experts.inner_experts
        with torch.no_grad():
            for param, value in ((moe.router.gate.weight, src.router.weight), (experts.w1_EFD, src.w1[:, :h]),
                                 (experts.w3_EFD, src.w1[:, h:]), (experts.w2_EDF, src.w_down)):
                _local(param).copy_(value)
            moe.tokens_per_expert_E.zero_()
    finally:
        tt_utils.set_spmd_backend(before)
    return TorchTitanEP(moe, dims, spmd_backend, tt_utils)


def _expert_param_layout():
    """The dense (EP-off) TP placements torchtitan's qwen3 and deepseek_v3 pass for ``GroupedExperts``; with EP
    on, the experts are ``Shard(0)`` on ``ep`` whatever these say."""
    import spmd_types as spmd

    return {"w1_EFD": spmd.S(1), "w2_EDF": spmd.S(2), "w3_EFD": spmd.S(1)}
