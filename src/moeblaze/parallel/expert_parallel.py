"""Expert parallelism for :class:`moeblaze.MoE`: experts spread over the ranks of a process group.

A group of P ranks shares E experts: rank r owns experts ``[r*E/P, (r+1)*E/P)`` as its local
``w_gate_up [E/P, 2h, d]`` and ``w_down [E/P, d, h]``; ``router.weight [E, d]`` is replicated. Each rank
routes its own tokens ``x [T, d]`` and gets their outputs back (the dataflow of GShard / Megatron-Core /
torchtitan expert parallelism, on MoEBlaze's dispatch index):

1. router -> top-k ids over the global E -> :func:`moeblaze.build_dispatch` over E. Its slots are
   grouped by expert, and a rank's experts are contiguous, so the slots are grouped by destination rank.
2. per-expert counts ``[E]`` all-gathered over the group (``[P, E]``): they give the split sizes of both
   all-to-alls and the global counts of the load-balancing loss.
3. the send buffer ``x[expert_token_indices]`` (``[N, d]``, rows in slot order: the only copy of x) and
   the combine weights in slot order ``[N]`` go out with ``all_to_all_single``.
4. each received row is one (token, expert) pair: a local dispatch index over the received rows (K = 1,
   local expert ids) feeds :func:`moeblaze.moe_experts`, which runs the fused kernels and scales each
   row by its weight (so the weight gradient comes out of the kernels' backward, without saving y).
5. reverse all-to-all -> ``out[t] = sum_k y[token_index_map[t, k]]`` at the source rank.

Backward mirrors it through autograd (the all-to-alls are ``all_to_all_single_autograd`` of
``torch.distributed._functional_collectives``; the gather of step 3 and the sum of step 5 are each other's
adjoint, both atomic-free).

Host synchronisation: exactly one per forward — the 2P split sizes of the variable-size all-to-all are
read to the host (``.tolist()``) after the count exchange, because ``all_to_all_single`` takes its splits
as host integers and the receive buffer must be allocated with its size. The backward reuses them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh

from ..backends import get_backend
from ..dispatch import build_dispatch
from ..experts import moe_experts

__all__ = ["EPConfig", "ExpertParallel", "expert_parallel_forward", "global_load_balancing_loss",
           "init_local_experts", "resolve_group", "shard_experts"]

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
                          moe.router.score_func, self.size)
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


class _GatherSlots(torch.autograd.Function):
    """``x [T, d]`` -> ``x[expert_token_indices] [N, d]`` (slot order); backward is the K-way slot sum."""

    @staticmethod
    def forward(ctx, x, expert_token_indices, token_index_map):
        ctx.save_for_backward(token_index_map)
        return x.index_select(0, expert_token_indices.long())

    @staticmethod
    def backward(ctx, grad_slots):
        (token_index_map,) = ctx.saved_tensors
        return _sum_slots(grad_slots, token_index_map), None, None


class _DivideGrad(torch.autograd.Function):
    """Identity forward; the gradient divided by ``divisor`` in backward."""

    @staticmethod
    def forward(ctx, w, divisor):
        ctx.divisor = divisor
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad):
        return grad / ctx.divisor, None


class _SumSlots(torch.autograd.Function):
    """``y [N, d]`` (slot order) -> ``out[t] = sum_k y[token_index_map[t, k]]``; backward is the slot gather."""

    @staticmethod
    def forward(ctx, y, expert_token_indices, token_index_map):
        ctx.save_for_backward(expert_token_indices)
        return _sum_slots(y, token_index_map)

    @staticmethod
    def backward(ctx, dout):
        (expert_token_indices,) = ctx.saved_tensors
        return dout.index_select(0, expert_token_indices.long()), None, None


def _sum_slots(y: torch.Tensor, token_index_map: torch.Tensor) -> torch.Tensor:
    """``out[t] = sum_k y[token_index_map[t, k]]``, fp32 sums, no atomics: the fused gather-sum (F3 without
    weights) on CUDA, so no ``[T, K, d]`` temporary (512 MiB at T 16384, K 8, d 2048 in bf16); a gather
    and a sum over K elsewhere."""
    if y.is_cuda and y.dtype in (torch.float16, torch.bfloat16, torch.float32):
        from ..kernels.combine import gather_sum

        return gather_sum(y.contiguous(), token_index_map, None, y.dtype)
    T, K = token_index_map.shape
    return y.index_select(0, token_index_map.reshape(-1).long()).view(T, K, y.shape[-1]).sum(1)


def _exchange_counts(counts: torch.Tensor, ep: ExpertParallel) -> torch.Tensor:
    """All-gather this rank's per-expert pair counts ``[E]`` -> ``[P, E]`` (row i: rank i's counts)."""
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
    index = build_dispatch(routing.topk_ids, E, validate=False)
    counts = torch.diff(index.expert_token_offsets).to(torch.int64)  # [E]
    all_counts = _exchange_counts(counts, ep)  # [P, E]
    recv_counts = all_counts[:, ep.first_expert:ep.first_expert + El]  # [P, El]: from rank i to my expert j
    send_splits = counts.view(P, El).sum(1)
    eti, tim = index.expert_token_indices, index.token_index_map
    # The send buffers are queued before the host waits for the split sizes, so the device fills them meanwhile.
    x_send = _GatherSlots.apply(x, eti, tim)  # [N, d], the only copy of x
    weights = routing.topk_weights.to(x.dtype) if x.dtype == torch.float64 else routing.topk_weights
    w_send = weights.new_empty(tim.numel()).scatter(0, tim.reshape(-1).long(), weights.reshape(-1))  # slot order
    # The one host synchronisation of the layer: all_to_all_single takes its split sizes as host ints.
    sizes = torch.cat((send_splits, recv_counts.sum(1))).tolist()
    send, recv = sizes[:P], sizes[P:]
    group = ep.group
    x_recv = _all_to_all(x_send, recv, send, group)  # [R, d]: by source rank, then expert
    w_recv = _all_to_all(w_send, recv, send, group)  # [R]
    R = sum(recv)
    local_ids = torch.arange(El, dtype=torch.int32, device=x.device).repeat(P)
    local_ids = local_ids.repeat_interleave(recv_counts.reshape(-1), output_size=R).view(R, 1)
    local_index = get_backend(moe.backend, x_recv).plan(local_ids, El, validate=False)
    w1, w2 = moe.w1, moe.w_down
    if ep.grad_divide != 1:
        w1, w2 = _DivideGrad.apply(w1, ep.grad_divide), _DivideGrad.apply(w2, ep.grad_divide)
    y = moe_experts(x_recv, local_ids, w_recv.view(R, 1), w1, w2, activation=moe.activation,
                    save=moe.save, backend=moe.backend, index=local_index)  # [R, d], weighted
    y_back = _all_to_all(y, send, recv, group)  # [N, d], slot order
    out = _SumSlots.apply(y_back, eti, tim)

    aux = routing.z_loss
    if moe.router.aux_loss_coef and moe.training:
        probs = _router_probs(moe, routing.logits)
        aux = aux + moe.router.aux_loss_coef * global_load_balancing_loss(probs, all_counts.sum(0))
    return out, aux


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
    if getattr(moe, "has_bias", False):
        raise ValueError("an MoE layer with expert biases (bias=True) cannot be made expert-parallel")
    ep = ExpertParallel(group, moe)
    sl = slice(ep.first_expert, ep.first_expert + ep.num_local_experts)
    for name in (moe._w1_name, "w_down"):
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
    for w, fan_in in ((moe.w1, moe.d_model), (moe.w_down, moe.d_ff)):
        bound = fan_in ** -0.5
        draw = torch.empty(w.shape[1:], device=w.device, dtype=w.dtype)
        for e in range(moe.num_experts):
            draw.uniform_(-bound, bound)
            if ep.first_expert <= e < ep.first_expert + ep.num_local_experts:
                w[e - ep.first_expert].copy_(draw)
