"""Expert parallelism for :class:`moeblaze.MoE`: experts spread over the ranks of a process group.

A group of P ranks shares E experts: rank r owns experts ``[r*E/P, (r+1)*E/P)`` as its local
``w_gate_up [E/P, 2h, d]`` and ``w_down [E/P, d, h]`` (with ``bias=True`` also ``b_gate_up [E/P, 2h]`` and
``b_down [E/P, d]``); ``router.weight [E, d]`` is replicated. Each rank routes its own tokens ``x [T, d]``
and gets their outputs back. The dataflow is GShard / Megatron-Core expert parallelism with each token sent
once per destination rank rather than once per (token, expert) pair, as DeepEP's dispatch does, and the
experts' side on MoEBlaze's general routing index:

1. router -> top-k ids over the global E; ``hit [T, P]``: which ranks hold one of a token's experts.
2. per-expert pair counts ``[E]`` and per-rank token counts ``[P]`` all-gathered over the group: the split
   sizes of the all-to-alls, the receiver's pair count and the global counts of the load-balancing loss.
3. the send buffer ``x[send_tokens]`` (``[S, d]``, rows by destination rank, then token: the only copy of
   x; ``S <= T * min(K, P)``) goes out with ``all_to_all_single``, and with each row its token's K pairs
   as the destination's local expert ids (``E/P`` marks another rank's pair) and weights ``[S, K]``.
4. the received rows' local pairs form a general routing input (:func:`moeblaze.moe_experts_general`):
   the fused kernels read the received rows through its index and each row's output is the weighted sum
   of its local experts, so one ``[R, d]`` row goes back per received token, not one per pair.
5. reverse all-to-all -> ``out[t] = sum over t's destination ranks of y_back[row]`` at the source rank.

At K 8 over 2 ranks (Qwen3-30B-A3B's E 128) a token's pairs reach at most 2 ranks, so the all-to-alls carry
at most 2 rows per token where a row per pair carried 8.

Backward mirrors it through autograd (the all-to-alls are ``all_to_all_single_autograd`` of
``torch.distributed._functional_collectives``; the gather of step 3 and the sum of step 5 are each other's
adjoint, both atomic-free: fp32 sums over each token's rows in rank order).

Host synchronisation: exactly one per forward — the 2P split sizes of the variable-size all-to-all and the
receiver's pair count are read to the host (``.tolist()``) after the count exchange, because
``all_to_all_single`` takes its splits as host integers and the receive buffers are allocated with their
sizes. The backward reuses them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh

from ..backends import get_backend
from ..general_routing import moe_experts_general
from ..settings import carried_to_backward

__all__ = ["EPConfig", "ExpertParallel", "expert_parallel_forward", "expert_parameter_names",
           "global_load_balancing_loss", "init_local_experts", "resolve_group", "shard_experts"]

# torch 2.13 renamed all_gather_tensor to all_gather_single (same arguments); the GPU machine runs 2.11.
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


def resolve_group(group: dist.ProcessGroup | DeviceMesh) -> dist.ProcessGroup:
    """The process group of ``group``: a ``ProcessGroup`` as is, or the group of a 1-D ``DeviceMesh``.

    Raises:
        RuntimeError: ``torch.distributed`` is not initialised.
        TypeError: ``group`` is neither a ``ProcessGroup`` nor a ``DeviceMesh``.
        ValueError: a ``DeviceMesh`` that is not 1-D (pass one dimension, e.g. ``mesh["ep"]``).
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("ep_group needs torch.distributed initialised (dist.init_process_group or torchrun)")
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(f"ep_group must be a 1-D DeviceMesh (one dimension, e.g. mesh['ep']), got a "
                             f"{group.ndim}-D mesh {group.mesh_dim_names}")
        return group.get_group()
    if isinstance(group, dist.ProcessGroup):
        return group
    raise TypeError(f"ep_group must be a torch.distributed ProcessGroup or a 1-D DeviceMesh, "
                    f"got {type(group).__name__}")


@dataclass(frozen=True)
class EPConfig:
    """What every rank of an expert-parallel group must agree on (checked at construction)."""

    d_model: int
    d_ff: int
    num_experts: int
    top_k: int
    activation: str
    score_func: str
    bias: bool
    group_size: int


class ExpertParallel:
    """The expert-parallel state of one :class:`moeblaze.MoE`: its group and its slice of the experts.

    Construction is collective over the group (every rank must construct its layer in the same order):
    one ``all_gather_object`` of the configuration, so that a mismatch raises on every rank instead of
    hanging in the first all-to-all.

    Args:
        group: a ``ProcessGroup`` or a 1-D ``DeviceMesh`` of P ranks (NCCL: call
            ``torch.cuda.set_device`` first, the object all-gather uses the current device).
        moe: the :class:`moeblaze.MoE` (its sizes, activation and router; its router must exist).

    Attributes:
        group, size (P), rank (in the group), num_local_experts (E/P), first_expert (rank * E/P).
        grad_divide: the expert weights' gradients are divided by it in backward (1: each is the sum over
            the losses of every rank whose tokens reached the expert; :func:`moeblaze.parallel.parallelize`
            sets P so that, after FSDP's mean over ``dp_shard``, they are means over all ranks as the
            router's gradient is).

    Raises:
        ValueError: the ranks disagree on the configuration (message lists each rank's), or
            ``E % P != 0``.
    """

    def __init__(self, group: dist.ProcessGroup | DeviceMesh, moe) -> None:
        self.group = resolve_group(group)
        self.size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        config = EPConfig(moe.d_model, moe.d_ff, moe.num_experts, moe.top_k, moe.activation,
                          moe.router.score_func, moe.has_bias, self.size)
        gathered: list[EPConfig | None] = [None] * self.size
        dist.all_gather_object(gathered, config, group=self.group)  # before any check that could differ by rank
        if any(c != config for c in gathered):
            rows = "; ".join(f"rank {i}: {c}" for i, c in enumerate(gathered))
            raise ValueError(f"expert-parallel ranks disagree on the MoE configuration: {rows}")
        if config.num_experts % self.size:
            raise ValueError(f"num_experts={config.num_experts} must be divisible by the expert-parallel group "
                             f"size P={self.size}")
        self.config = config
        self.num_local_experts = config.num_experts // self.size
        self.first_expert = self.rank * self.num_local_experts
        self.grad_divide = 1
        self.mesh = None  # (DeviceMesh, dp dimension name or None): the experts' layout in checkpoints

    def __deepcopy__(self, memo) -> ExpertParallel:
        return self  # a copied layer (EMA weights, a reference model) exchanges tokens over the same group

    def __repr__(self) -> str:
        return (f"ExpertParallel(P={self.size}, rank={self.rank}, experts=[{self.first_expert}, "
                f"{self.first_expert + self.num_local_experts}))")


class _SendPlan:
    """Where this rank's tokens go: each token once per destination rank that holds one of its experts.

    ``hit [T, P]``: token t has a pair on rank r. Send rows are ordered by destination rank, then token
    (``send_tokens [S]``, ``send_rank [S]``; ``send``: the P block sizes of the all-to-all); ``row_offsets [T+1]``
    and ``token_rows [S]`` list each token's send rows in rank order (a CSR, for the sums over ranks). Built by
    cumulative sums and ``searchsorted`` over the flattened ``hit``: no sort, no atomics, sizes from ``send``.
    """

    def __init__(self, hit: torch.Tensor, send: list[int]) -> None:
        T, P = hit.shape
        want = torch.arange(1, sum(send) + 1, device=hit.device)
        # rank-major: the j-th set entry of hit^T is send row j; its inclusive count at (r, t) is the rows of
        # ranks below r plus rank r's up to token t. (One flat scan: a cumsum along dim 0 of [T, P] runs one
        # thread per column, 1.5 ms at T 16384, P 2 on an H200 against microseconds flat; 2026-11-26,
        # torch.profiler over moeblaze train --fsdp --ep 2 --preset 1b.)
        rank_major = hit.t().reshape(-1).cumsum(0)  # [P*T]
        q = torch.searchsorted(rank_major, want)  # [S] in [0, P*T)
        self.send_rank, self.send_tokens = q // T, q % T
        # token-major: the j-th set entry of hit is token t's next destination, in rank order
        row_of = (rank_major.view(P, T).t() - 1).reshape(-1)  # [T*P] send row of (t, r) where hit
        self.token_rows = row_of.index_select(0, torch.searchsorted(hit.reshape(-1).cumsum(0), want)).to(torch.int32)
        self.row_offsets = torch.cat((hit.new_zeros(1, dtype=torch.int64), hit.sum(1).cumsum(0))).to(torch.int32)

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What the sums over a token's rows read: ``(send_tokens, token_rows, row_offsets)``."""
        return self.send_tokens, self.token_rows, self.row_offsets


def _sum_rows(rows: torch.Tensor, send_tokens: torch.Tensor, token_rows: torch.Tensor, row_offsets: torch.Tensor,
              send: list[int]) -> torch.Tensor:
    """``out[t] = sum over t's send rows (rank order) of rows[row]``, fp32 sums (fp64 for fp64), no atomics:
    the fused CSR gather-sum on CUDA; elsewhere one ``index_add_`` per rank's block of rows (a token appears
    once in a block, so the blocks add in rank order whatever the device)."""
    T = row_offsets.numel() - 1
    if rows.is_cuda and rows.dtype in (torch.float16, torch.bfloat16, torch.float32):
        from ..kernels.combine import gather_sum

        return gather_sum(rows.contiguous(), token_rows, None, rows.dtype, pair_offsets=row_offsets)
    acc = torch.float64 if rows.dtype == torch.float64 else torch.float32
    out = rows.new_zeros(T, rows.shape[1], dtype=acc)
    for tokens, block in zip(send_tokens.split(send), rows.split(send)):
        out.index_add_(0, tokens, block.to(acc))
    return out.to(rows.dtype)


class _GatherRows(torch.autograd.Function):
    """``x [T, d]`` -> ``x[send_tokens] [S, d]``; backward sums each token's rows (:func:`_sum_rows`)."""

    @staticmethod
    @carried_to_backward
    def forward(ctx, x, send_tokens, token_rows, row_offsets, send):
        ctx.save_for_backward(send_tokens, token_rows, row_offsets)
        ctx.send = send
        return x.index_select(0, send_tokens)

    @staticmethod
    @carried_to_backward
    def backward(ctx, grad_rows):
        return _sum_rows(grad_rows, *ctx.saved_tensors, ctx.send), None, None, None, None


class _SumRows(torch.autograd.Function):
    """``y [S, d]`` (send order) -> ``out [T, d]``, each token's rows summed; backward is the row gather."""

    @staticmethod
    @carried_to_backward
    def forward(ctx, y, send_tokens, token_rows, row_offsets, send):
        ctx.save_for_backward(send_tokens)
        return _sum_rows(y, send_tokens, token_rows, row_offsets, send)

    @staticmethod
    @carried_to_backward
    def backward(ctx, dout):
        (send_tokens,) = ctx.saved_tensors
        return dout.index_select(0, send_tokens), None, None, None, None


class _DivideGrad(torch.autograd.Function):
    """Identity forward; the gradient divided by ``divisor`` in backward."""

    @staticmethod
    @carried_to_backward
    def forward(ctx, w, divisor):
        ctx.divisor = divisor
        return w.view_as(w)

    @staticmethod
    @carried_to_backward
    def backward(ctx, grad):
        return grad / ctx.divisor, None


def _exchange_counts(counts: torch.Tensor, ep: ExpertParallel) -> torch.Tensor:
    """All-gather this rank's count vector ``[n]`` -> ``[P, n]`` (row i: rank i's counts)."""
    return funcol.wait_tensor(_all_gather(counts, 0, ep.group)).view(ep.size, counts.numel())


def _all_to_all(t: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Autograd-aware ``all_to_all_single`` over dim 0, waited on: the Triton kernels read raw pointers, so
    they need the plain tensor, not the functional collective's lazy wrapper."""
    return funcol.wait_tensor(all_to_all_single_autograd(t, out_splits, in_splits, group))


def global_load_balancing_loss(probs: torch.Tensor, global_counts: torch.Tensor) -> torch.Tensor:
    """Switch load-balancing loss with the group's expert counts: ``E * sum_e f_e * P_e``.

    ``f_e`` is expert e's share of all pairs routed in the group (``global_counts [E]``, all ranks),
    ``P_e`` the mean probability over this rank's tokens (``probs [T, E]`` fp32). For ranks with equal T
    the mean of this loss over the group is the single-process loss on the concatenated tokens, so
    averaging gradients over ranks (FSDP, DDP) gives the single-process gradient. 0 for T = 0.
    """
    f = global_counts.float() / global_counts.sum().clamp_min(1)
    p_mean = probs.sum(0) / max(probs.shape[0], 1)
    return probs.shape[1] * (f * p_mean).sum()


def _router_probs(moe, logits: torch.Tensor) -> torch.Tensor:
    """The routing probabilities of the load-balancing loss, as :class:`moeblaze.Router` defines them."""
    if moe.router.score_func == "softmax":
        return torch.softmax(logits, dim=-1)
    scores = torch.sigmoid(logits)
    return scores / scores.sum(-1, keepdim=True)


def expert_parallel_forward(moe, x: torch.Tensor, routing) -> tuple[torch.Tensor, torch.Tensor]:
    """The expert-parallel forward of ``moe`` on this rank's tokens (steps in the module docstring).

    Args:
        moe: a :class:`moeblaze.MoE` built with ``ep_group`` (``moe.ep`` set; local expert weights).
        x: ``[T, d]`` this rank's tokens (T may be 0).
        routing: the :class:`moeblaze.RouterOutput` of ``moe.router(x)`` (global expert ids).

    Returns:
        ``(out [T, d] in x.dtype, aux_loss)``: ``aux_loss`` is the router's z-loss plus the load-balancing
        loss over the group's counts (:func:`global_load_balancing_loss`), each times its coefficient.
    """
    ep: ExpertParallel = moe.ep
    E, P, El = moe.num_experts, ep.size, ep.num_local_experts
    ids = routing.topk_ids.to(torch.int64)  # [T, K] global expert ids
    T, K = ids.shape
    hit = torch.zeros(T, P, dtype=torch.bool, device=x.device).scatter_(1, ids // El, True)  # [T, P]
    send_counts = hit.sum(0)  # [P] tokens this rank sends to each rank
    # [E] pairs per expert; integer sums are exact in any order. (torch.bincount would read its maximum to the
    # host: a second synchronisation per layer.)
    expert_counts = ids.new_zeros(E).scatter_add_(0, ids.reshape(-1), torch.ones_like(ids).reshape(-1))
    all_counts = _exchange_counts(torch.cat((expert_counts, send_counts)), ep)  # [P, E + P]
    mine = slice(ep.first_expert, ep.first_expert + El)
    # The one host synchronisation of the layer: all_to_all_single takes its split sizes as host ints, and the
    # receive side's pair count sizes its pair list.
    sizes = torch.cat((send_counts, all_counts[:, E + ep.rank], all_counts[:, mine].sum().view(1))).tolist()
    send, recv, n_pairs = sizes[:P], sizes[P:2 * P], sizes[2 * P]
    plan = _SendPlan(hit, send)
    weights = routing.topk_weights.to(x.dtype) if x.dtype == torch.float64 else routing.topk_weights
    # each send row carries its token's K pairs: the destination's local expert ids (El where the pair is
    # another rank's) and the weights
    local_ids = ids.index_select(0, plan.send_tokens) - (plan.send_rank * El).view(-1, 1)  # [S, K]
    local_ids = torch.where((local_ids >= 0) & (local_ids < El), local_ids, El).to(torch.int32)
    group = ep.group
    x_send = _GatherRows.apply(x, *plan.tensors(), send)  # [S, d]: the only copy of x
    x_recv = _all_to_all(x_send, recv, send, group)  # [R, d], by source rank, then token
    w_recv = _all_to_all(weights.index_select(0, plan.send_tokens), recv, send, group)  # [R, K]
    ids_recv = funcol.wait_tensor(funcol.all_to_all_single(local_ids, recv, send, group))  # [R, K]
    # the received rows' local pairs, row-major (token_idx ascending): the general routing input
    valid = (ids_recv < El).reshape(-1)
    pos = torch.searchsorted(valid.cumsum(0), torch.arange(1, n_pairs + 1, device=x.device))  # [n_pairs]
    experts = {"w_gate_up": moe.w1, "w_down": moe.w_down, **moe.bias_kwargs()}
    if ep.grad_divide != 1:
        experts = {k: _DivideGrad.apply(v, ep.grad_divide) for k, v in experts.items()}
    token_idx, expert_idx = (pos // K).to(torch.int32), ids_recv.reshape(-1).index_select(0, pos)
    # built here without its range checks (their host synchronisations): the pairs are in range by construction
    index = get_backend(moe.backend, x_recv).plan_pairs(token_idx, expert_idx, x_recv.shape[0], El, validate=False)
    y = moe_experts_general(x_recv, token_idx, expert_idx, w_recv.reshape(-1).index_select(0, pos),
                            activation=moe.activation, save=moe.save, backend=moe.backend, index=index,
                            **experts)  # [R, d]: each row's local pairs, weighted (the down bias too)
    out = _SumRows.apply(_all_to_all(y, send, recv, group), *plan.tensors(), send)  # [T, d]

    aux = routing.z_loss
    if moe.router.aux_loss_coef and moe.training:
        probs = _router_probs(moe, routing.logits)
        aux = aux + moe.router.aux_loss_coef * global_load_balancing_loss(probs, all_counts[:, :E].sum(0))
    return out, aux


def expert_parameter_names(moe) -> tuple[str, ...]:
    """Names of ``moe``'s per-expert parameters (``[E, ...]``; ``[E/P, ...]`` when expert-parallel)."""
    return (moe._w1_name, "w_down") + ((moe._b1_name, "b_down") if moe.has_bias else ())


def shard_experts(moe, group: dist.ProcessGroup | DeviceMesh) -> None:
    """Turn a :class:`moeblaze.MoE` holding all E experts into an expert-parallel one, in place.

    Rank r keeps experts ``[r*E/P, (r+1)*E/P)`` of its current weights (so ranks that built the model
    with the same seed hold one consistent set of experts); works on ``meta`` tensors too. Collective over
    ``group`` (the configuration check of :class:`ExpertParallel`).

    Raises:
        ValueError: the layer is already expert-parallel, or as :class:`ExpertParallel`.
    """
    if moe.ep is not None:
        raise ValueError(f"the MoE layer is already expert-parallel ({moe.ep})")
    ep = ExpertParallel(group, moe)
    sl = slice(ep.first_expert, ep.first_expert + ep.num_local_experts)
    for name in expert_parameter_names(moe):
        old = getattr(moe, name)
        setattr(moe, name, torch.nn.Parameter(old.detach()[sl].clone(), requires_grad=old.requires_grad))
    moe.ep = ep


@torch.no_grad()
def init_local_experts(moe) -> None:
    """Initialise an expert-parallel layer's local experts (``U(-1/sqrt(fan_in), 1/sqrt(fan_in))``).

    Every rank draws all E experts in order from its RNG and keeps its own, so that ranks seeded alike
    hold E distinct experts (drawing only the local E/P would give every rank the same ones).
    """
    ep: ExpertParallel = moe.ep
    for w, fan_in in moe.expert_fan_ins():
        bound = fan_in ** -0.5
        draw = torch.empty(w.shape[1:], device=w.device, dtype=w.dtype)
        for e in range(moe.num_experts):
            draw.uniform_(-bound, bound)
            if ep.first_expert <= e < ep.first_expert + ep.num_local_experts:
                w[e - ep.first_expert].copy_(draw)
