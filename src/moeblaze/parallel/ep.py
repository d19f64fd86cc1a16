"""Expert parallelism for :class:`moeblaze.MoE`, applied as a wrapper: experts spread over a process group.

``expert_parallel(model, group)`` turns every MoE layer of ``model`` expert-parallel in place (as ``fully_shard``
does for FSDP2; :func:`moeblaze.parallel.parallelize` invokes it on a 2-D mesh). A group of P ranks shares E experts:
rank r keeps experts ``[r*E/P, (r+1)*E/P)`` as its local ``w_gate_up [E/P, 2h, d]`` and ``w_down [E/P, d, h]``
(with expert biases also ``b_gate_up [E/P, 2h]``, ``b_down [E/P, d]``); the router is replicated. Each rank routes
its own tokens ``x [T, d]`` and gets their outputs back. The dataflow is GShard / Megatron-Core expert parallelism
with each token sent once per destination rank rather than once per (token, expert) pair, as DeepEP's dispatch:

1. router -> top-k ids over the global E; ``hit [T, P]``: which ranks hold one of a token's experts.
2. per-expert pair counts ``[E]`` and per-rank row counts ``[P]`` all-gathered over the group (device tensors): the
   global counts of the load-balancing loss, and the split sizes of the ``all_to_all`` exchange.
3. the send buffer: ``x[send_tokens]`` (rows by destination rank, then token: the only copy of x), each row with
   its token's K pairs as the destination's local expert ids (``E/P`` marks another rank's pair) and weights:
   the rows' own bytes and a small exchange of the pairs, or for symmetric buffers (nvshmem) one packed byte row
   each (:func:`_exchange`, :mod:`moeblaze.parallel.exchange`). An FP8 layer sends the rows in e4m3 with their
   scales, about half the bytes of bf16 rows (:class:`_Dispatch`); gradients go back in 16 bits.
4. the received rows are a top-k routing over the local experts with foreign pairs (``moe_experts(...,
   foreign_experts=True)``; rows past what a source sent are all foreign): the fused kernels read the received
   rows through its index, and each row's output is the weighted sum of its local experts, so one row goes back
   per received token.
5. the reverse exchange -> ``out[t] = sum over t's destination ranks of the returned rows`` (fp32, rank order).

Backward mirrors it through autograd (the exchanges' own backward is the reverse exchange; the gather of step 3
and the sum of step 5 are each other's adjoint, both atomic-free).

Host synchronisation: none with a sync-free exchange (``nvshmem``, ``padded``): every shape is fixed by
``T_cap``, the group's largest T (``max_tokens`` when given, else agreed on the hosts in each layer forward:
:class:`moeblaze.parallel.exchange.Exchange`), and the buffers hold the worst case (a rank receives at most
``P * T_cap`` rows, its experts at most ``P * T_cap * K`` pairs); so an EP layer step can be captured in a CUDA
graph. With the ``all_to_all`` exchange, one per forward: the split sizes, read to the host; buffers are then exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from ..activations import DEFAULT_ACT
from ..backends import Backend
from ..experts import run_experts
from ..fp8 import E4M3, Float8Tensor
from ..layer import MoE
from ..settings import carried_to_backward
from .exchange import Exchange, Layout, get_exchange, resolve_exchange
from .send_plan import GatherRows, SendPlan, SumRows, take

# torch 2.13 renamed all_gather_into_tensor to all_gather_single (same arguments) and deprecates the old name; torch
# 2.11 has only the old one
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

__all__ = ["EPConfig", "ExpertParallel", "expert_parallel", "expert_parameter_names", "global_load_balancing_loss",
           "resolve_group", "shard_experts"]


def resolve_group(group: dist.ProcessGroup | DeviceMesh) -> dist.ProcessGroup:
    """The process group of ``group``: a ``ProcessGroup`` as is, or the group of a 1-D ``DeviceMesh``.

    Raises:
        RuntimeError: ``torch.distributed`` is not initialised.
        TypeError: ``group`` is neither a ``ProcessGroup`` nor a ``DeviceMesh``.
        ValueError: a ``DeviceMesh`` that is not 1-D (pass one dimension, e.g. ``mesh["ep"]``).
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("expert parallelism needs torch.distributed initialised (dist.init_process_group or "
                           "torchrun)")
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(f"group must be a 1-D DeviceMesh (one dimension, e.g. mesh['ep']), got a "
                             f"{group.ndim}-D mesh {group.mesh_dim_names}")
        return group.get_group()
    if isinstance(group, dist.ProcessGroup):
        return group
    raise TypeError(f"group must be a torch.distributed ProcessGroup or a 1-D DeviceMesh, got {type(group).__name__}")


@dataclass(frozen=True)
class EPConfig:
    """What every rank of an expert-parallel group must agree on (checked when the layer is sharded)."""

    d_model: int
    d_ff: int
    num_experts: int
    top_k: int
    activation: str
    score_func: str
    bias: bool
    group_size: int
    exchange: str
    aux_loss_type: str
    expert_bias_update_rate: float
    max_tokens: int | None


class ExpertParallel:
    """The expert-parallel state of one :class:`moeblaze.MoE` (its ``ep`` attribute): group, slice of the experts,
    exchange. Made by :func:`expert_parallel`; the layer invokes :meth:`forward` for its routed experts.

    Attributes:
        group, size (P), rank (in the group), num_local_experts (E/P), first_expert (rank * E/P).
        exchange: the :class:`moeblaze.parallel.exchange.Exchange` (shared by the layers of the group).
        max_tokens: the most tokens any rank of the group passes to the layer in one forward, known to every rank
            (the sync-free exchanges' ``T_cap`` then needs no agreement between the hosts), or None.
        grad_divide: the expert weights' gradients are divided by it in backward (1: each is the sum over
            the losses of every rank whose tokens reached the expert; :func:`moeblaze.parallel.parallelize`
            sets P so that, after FSDP's mean over ``dp_shard``, they are means over all ranks as the
            router's gradient is).
        recv_rows: rows this rank's experts received, summed over forwards (a device tensor; reset by the reader).
    """

    def __init__(self, group: dist.ProcessGroup, config: EPConfig, exchange: Exchange) -> None:
        self.group, self.config, self.exchange = group, config, exchange
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.num_local_experts = config.num_experts // self.size
        self.first_expert = self.rank * self.num_local_experts
        self.max_tokens = config.max_tokens
        self.grad_divide = 1
        self.mesh = None  # (DeviceMesh, dp dimension name or None): the experts' layout in checkpoints
        self.recv_rows: torch.Tensor | None = None

    def __deepcopy__(self, memo) -> ExpertParallel:
        return self  # a copied layer (EMA weights, a reference model) exchanges tokens over the same group

    def __repr__(self) -> str:
        return (f"ExpertParallel(P={self.size}, rank={self.rank}, experts=[{self.first_expert}, "
                f"{self.first_expert + self.num_local_experts}), exchange={self.exchange.kind})")

    def forward(self, moe: MoE, x: torch.Tensor, routing, backend: Backend,
                dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The routed experts of ``moe`` on this rank's tokens ``x [T, d]`` (module docstring): ``(out [T, d],
        aux_loss)``, the loss with the load-balancing term over the group's counts. ``backend``, ``dtype``: the
        layer's resolved backend and autocast dtype (None outside autocast)."""
        return expert_parallel_forward(moe, x, routing, backend, dtype)

    @torch.no_grad()
    def reset_experts(self, moe: MoE) -> None:
        """Initialise the local experts (``U(-1/sqrt(fan_in), 1/sqrt(fan_in))``): every rank draws all E experts in
        order from its RNG and keeps its own, so that ranks seeded alike hold the experts one process would."""
        for w, fan_in in moe.expert_fan_ins():
            bound = fan_in ** -0.5
            draw = torch.empty(w.shape[1:], device=w.device, dtype=w.dtype)
            for e in range(moe.num_experts):
                draw.uniform_(-bound, bound)
                if self.first_expert <= e < self.first_expert + self.num_local_experts:
                    w[e - self.first_expert].copy_(draw)


def expert_parameter_names(moe: MoE) -> tuple[str, ...]:
    """Names of ``moe``'s per-expert parameters (``[E, ...]``; ``[E/P, ...]`` when expert-parallel)."""
    return (moe._w1_name, "w_down") + ((moe._b1_name, "b_down") if moe.has_bias else ())


def shard_experts(moe: MoE, group: dist.ProcessGroup | DeviceMesh, exchange: str = "auto",
                  max_tokens: int | None = None) -> MoE:
    """Make one :class:`moeblaze.MoE` holding all E experts expert-parallel over ``group``, in place.

    Rank r keeps experts ``[r*E/P, (r+1)*E/P)`` of its current weights (so ranks that built the model with the
    same seed hold one consistent set of experts); works on ``meta`` tensors too. Collective over ``group``: one
    ``all_gather_object`` of the configuration, so that a mismatch raises on every rank instead of hanging in the
    first exchange (every rank must shard its layers in the same order).

    Args:
        moe: the layer. group: a ``ProcessGroup`` or 1-D ``DeviceMesh`` of P ranks (NCCL: call
            ``torch.cuda.set_device`` first). exchange: one of :data:`moeblaze.parallel.exchange.EXCHANGES`.
        max_tokens: the most tokens any rank will pass to the layer in one forward (``x``'s T; the same value on
            every rank), or None. Given, the sync-free exchanges size their buffers by it with no communication;
            None, the ranks agree on the group's largest T in every forward (an all-reduce of a host integer over
            the group's CPU backend, which holds each host at the slowest one's). The ``padded`` exchange sends
            every block at this size, so give the real bound (the training loop gives its rows per rank times
            the sequence length). A forward with more tokens raises ``ValueError`` on that rank, before any
            collective (checking it with the others would be the synchronisation ``max_tokens`` saves): let that
            rank end, as an uncaught error does under torchrun; one that catches it and goes on leaves the others
            waiting in the exchange until the group's timeout.

    Raises:
        TypeError: ``moe`` is not a :class:`moeblaze.MoE`; a bad ``group`` (see :func:`resolve_group`).
        ValueError: the layer is already expert-parallel or rounds tokens; ``E % P != 0``; ``max_tokens`` not a
            positive int or None; the ranks disagree on the configuration (the message lists each rank's); an
            exchange that cannot run here.
    """
    if not isinstance(moe, MoE):
        raise TypeError(f"shard_experts takes a moeblaze.MoE, got {type(moe).__name__}")
    if moe.ep is not None:
        raise ValueError(f"the MoE layer is already expert-parallel ({moe.ep})")
    if moe.token_rounding is not None:
        raise ValueError("token_rounding with expert parallelism is not supported: token rounding runs on one GPU "
                         "or under FSDP2")
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise ValueError(f"max_tokens must be a positive int or None, got {max_tokens!r}")
    pg = resolve_group(group)
    P = dist.get_world_size(pg)
    device = moe.w_down.device if moe.w_down.device.type != "meta" else _group_device(pg)
    kind = resolve_exchange(exchange, pg, device)
    config = EPConfig(moe.d_model, moe.d_ff, moe.num_experts, moe.top_k, moe.activation, moe.router.score_func,
                      moe.has_bias, P, kind, moe.router.aux_loss_type, moe.router.expert_bias_update_rate,
                      max_tokens)
    gathered: list[EPConfig | None] = [None] * P
    dist.all_gather_object(gathered, config, group=pg)  # before any check that could differ by rank
    if any(c != config for c in gathered):
        rows = "; ".join(f"rank {i}: {c}" for i, c in enumerate(gathered))
        raise ValueError(f"expert-parallel ranks disagree on the MoE configuration: {rows}")
    if config.num_experts % P:
        raise ValueError(f"num_experts={config.num_experts} must be divisible by the expert-parallel group size P={P}")
    ep = ExpertParallel(pg, config, get_exchange(pg, kind, device))
    sl = slice(ep.first_expert, ep.first_expert + ep.num_local_experts)
    for name in expert_parameter_names(moe):
        old = getattr(moe, name)
        setattr(moe, name, nn.Parameter(old.detach()[sl].clone(), requires_grad=old.requires_grad))
    moe.ep = ep
    return moe


def _group_device(group: dist.ProcessGroup) -> torch.device:
    """The device a group's collectives run on: the current CUDA device for NCCL groups, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if "nccl" in str(dist.get_backend(group)) \
        else torch.device("cpu")


def expert_parallel(module: nn.Module, group: dist.ProcessGroup | DeviceMesh, exchange: str = "auto",
                    max_tokens: int | None = None) -> nn.Module:
    """Apply expert parallelism over ``group`` to every :class:`moeblaze.MoE` in ``module`` (``module`` itself
    included), in place, with :func:`shard_experts` (``exchange``, ``max_tokens``: its); returns ``module``.

    Raises:
        ValueError: ``module`` holds no MoE layer; as :func:`shard_experts`.
    """
    layers = [m for m in module.modules() if isinstance(m, MoE)]
    if not layers:
        raise ValueError(f"expert_parallel found no moeblaze.MoE layer in {type(module).__name__}")
    for moe in layers:
        shard_experts(moe, group, exchange, max_tokens)
    return module


# ----------------------------------------------------------------------------------------------- the forward

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


class _Payload:
    """The byte layout of a row packed for an exchange: the row's ``[d]`` values, its ``[K]`` weights, ``[K]`` int32
    local expert ids and ``[scales]`` fp32 scales of FP8 values, each section 16-byte aligned (so that each reads back
    as its dtype), the row a multiple of 64 bytes. ``d = 0``: the pairs (and scales) alone (the values then travel in
    their own bytes, :func:`_exchange`). Gradients travel in a 16-bit layout (values and weights; ids unused)."""

    def __init__(self, d: int, K: int, x_dtype: torch.dtype, w_dtype: torch.dtype, scales: int = 0) -> None:
        def up(n: int, a: int = 16) -> int:
            return -(-n // a) * a
        self.d, self.K, self.x_dtype, self.w_dtype, self.scales = d, K, x_dtype, w_dtype, scales
        xe, we = torch.empty((), dtype=x_dtype).element_size(), torch.empty((), dtype=w_dtype).element_size()
        self.x_end = d * xe
        self.w_at = up(self.x_end)
        self.w_end = self.w_at + K * we
        self.id_at = up(self.w_end)
        self.s_at = up(self.id_at + 4 * K)
        self.width = up(self.s_at + 4 * scales, 64)

    def values(self, buf: torch.Tensor) -> torch.Tensor:
        return buf[:, :self.x_end].view(self.x_dtype)

    def weights(self, buf: torch.Tensor) -> torch.Tensor:
        return buf[:, self.w_at:self.w_end].view(self.w_dtype)

    def ids(self, buf: torch.Tensor) -> torch.Tensor:
        return buf[:, self.id_at:self.id_at + 4 * self.K].view(torch.int32)

    def scale(self, buf: torch.Tensor) -> torch.Tensor:
        return buf[:, self.s_at:self.s_at + 4 * self.scales].view(torch.float32)


def _exchange(exchange: Exchange, layout: Layout, payload: _Payload, values: torch.Tensor | None,
              weights: torch.Tensor | None = None, ids: torch.Tensor | None = None, scales: torch.Tensor | None = None,
              reverse: bool = False):
    """Rows through one exchange of ``layout`` (``reverse``: receive layout back to send layout): ``values [S, d]``
    and, with ``weights``, each row's ``[S, K]`` weights and local expert ids (None: zeros) and its
    ``[S, payload.scales]`` scales (FP8 values). Returns the received ``(values, weights, ids, scales)``, None for
    what was not sent.

    Symmetric buffers (``nvshmem``; ``payload.d == d``) take one packed byte row per token. The other exchanges
    (``payload.d == 0``) send the values' own bytes, which saves a copy in and a copy out of ``[S, d]`` per exchange,
    and the pairs in a second exchange of ``payload.width`` bytes per row."""
    sections = [] if weights is None else [(payload.weights, weights), (payload.ids, ids)]
    sections += [(payload.scale, scales)] if payload.scales else []
    if payload.d:
        rows = layout.recv_rows if reverse else layout.send_rows
        buf = exchange.buffer(rows, payload.width, reverse=reverse)
        for section, t in [(payload.values, values), *sections]:
            section(buf).copy_(t) if t is not None else section(buf).zero_()
        got = exchange.rows(buf, layout, reverse)
        values = payload.values(got).clone()
    else:
        values = exchange.rows(values.contiguous().view(torch.uint8), layout, reverse).view(values.dtype)
        if sections:
            buf = exchange.buffer(weights.shape[0], payload.width, reverse=reverse)
            for section, t in sections:
                section(buf).copy_(t) if t is not None else section(buf).zero_()
            got = exchange.rows(buf, layout, reverse)
    if not sections:
        return values, None, None, None
    return (values, payload.weights(got).contiguous(), payload.ids(got).contiguous(),
            payload.scale(got).contiguous() if payload.scales else None)


class _Dispatch(torch.autograd.Function):
    """``(x_send [S, d], w_send [S, K], ids_send [S, K])`` -> ``(x_recv [R, d], w_recv [R, K], ids_recv [R, K])``
    through the exchange (:func:`_exchange`); backward: the gradients of values and weights back through the
    reverse exchange, in ``grads``'s 16-bit layout.

    ``fp8`` (``(recipe, fp8 ops)`` of an FP8 layer): the rows travel as the recipe's e4m3 F1 operand with their
    scales (``d + 4`` bytes a row rowwise against ``2d`` in bf16) and arrive dequantized to ``x_send``'s dtype; the
    experts' quantization of them gives the same e4m3 values (a value on the e4m3 grid times a scale, rounded to
    16 bits and divided by a scale within 2^-8 of it, rounds back to it), scales within a 16-bit rounding."""

    @staticmethod
    @carried_to_backward
    def forward(ctx, x_send, w_send, ids_send, exchange: Exchange, layout: Layout, payload: _Payload,
                grads: _Payload, fp8):
        ctx.exchange, ctx.layout, ctx.payload, ctx.d = exchange, layout, grads, x_send.shape[1]
        if fp8 is None:
            x_recv, w_recv, ids, _ = _exchange(exchange, layout, payload, x_send, w_send, ids_send)
        else:
            recipe, ops = fp8
            q = ops.quantize_rows(recipe, x_send)
            data, w_recv, ids, scale = _exchange(exchange, layout, payload, q.data, w_send, ids_send,
                                                 q.scale.reshape(-1, payload.scales))
            x_recv = ops.dequantize(Float8Tensor(data, scale, q.block), x_send.dtype).to(x_send.dtype)
        ctx.mark_non_differentiable(ids)
        return x_recv, w_recv, ids

    @staticmethod
    @carried_to_backward
    def backward(ctx, grad_x, grad_w, _grad_ids):
        if grad_x is None:
            grad_x = torch.zeros(ctx.layout.recv_rows, ctx.d, dtype=ctx.payload.x_dtype,
                                 device=ctx.exchange.device)
        if grad_w is None:
            grad_w = torch.zeros(ctx.layout.recv_rows, ctx.payload.K, dtype=ctx.payload.w_dtype,
                                 device=ctx.exchange.device)
        dx, dw, _, _ = _exchange(ctx.exchange, ctx.layout, ctx.payload, grad_x, grad_w, reverse=True)
        return dx, dw, None, None, None, None, None, None


class _Combine(torch.autograd.Function):
    """``y [R, d]`` (receive layout) -> ``[S, d]`` (send layout) through the reverse exchange; backward: the
    gradient through a forward exchange."""

    @staticmethod
    @carried_to_backward
    def forward(ctx, y, exchange: Exchange, layout: Layout, payload: _Payload):
        ctx.exchange, ctx.layout, ctx.payload = exchange, layout, payload
        return _exchange(exchange, layout, payload, y, reverse=True)[0]

    @staticmethod
    @carried_to_backward
    def backward(ctx, grad):
        return _exchange(ctx.exchange, ctx.layout, ctx.payload, grad)[0], None, None, None


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


def _router_probs(moe: MoE, routing) -> torch.Tensor:
    """The routing probabilities of the load-balancing loss, as :class:`moeblaze.Router` defines them, from the
    router's differentiable scores (softmax: the scores themselves; no second softmax and its backward)."""
    if moe.router.score_func == "softmax":
        return routing.scores
    return routing.scores / routing.scores.sum(-1, keepdim=True)


def expert_parallel_forward(moe: MoE, x: torch.Tensor, routing, backend: Backend,
                            dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The expert-parallel forward of ``moe`` on this rank's tokens (steps in the module docstring).

    Args:
        moe: a :class:`moeblaze.MoE` made expert-parallel (``moe.ep`` set; local expert weights).
        x: ``[T, d]`` this rank's tokens (T may be 0).
        routing: the :class:`moeblaze.RouterOutput` of ``moe.router(x)`` (global expert ids).
        backend: the layer's resolved :class:`moeblaze.backends.Backend` for ``x`` (checked once by the layer).
        dtype: the autocast dtype (``x`` already in it), or None outside autocast.

    Returns:
        ``(out [T, d] in x.dtype, aux_loss)``: with ``aux_loss_type="switch"`` the router's z-loss plus the
        load-balancing loss over the group's counts (:func:`global_load_balancing_loss`), each times its
        coefficient; with the other types the router's own loss (``routing.loss``).
    """
    ep: ExpertParallel = moe.ep
    E, P, El = moe.num_experts, ep.size, ep.num_local_experts
    ids = routing.topk_ids.to(torch.int64)  # [T, K] global expert ids
    T, K = ids.shape
    if ep.max_tokens is not None and ep.max_tokens < T:
        raise ValueError(f"x holds {T} tokens on rank {ep.rank}, more than max_tokens={ep.max_tokens} given to "
                         "expert_parallel (the most any rank passes to an expert-parallel layer in one forward)")
    M = min(K, P)
    hit = torch.zeros(T, P, dtype=torch.bool, device=x.device).scatter_(1, ids // El, True)  # [T, P]
    send_counts = hit.sum(0)  # [P] rows this rank sends to each rank
    # [E] pairs per expert; integer sums are exact in any order (torch.bincount would read its maximum to the host)
    expert_counts = ids.new_zeros(E).scatter_add_(0, ids.reshape(-1), torch.ones_like(ids).reshape(-1))
    counts = torch.cat((expert_counts, send_counts))
    # c10d's all-gather, not the functional one: its result tensor subclass cost ~0.3 ms of host time per layer
    # forward in a host trace (torch.profiler, moeblaze train --fsdp --preset 1b --ep 2, 2 x H200)
    all_counts = counts.new_empty(P * counts.numel())
    _all_gather(all_counts, counts, group=ep.group)
    all_counts = all_counts.view(P, E + P)
    layout = ep.exchange.layout(T, K, send_counts, all_counts, ep.max_tokens)
    if ep.exchange.sync_free and layout.T_cap == 0:  # no rank of the group holds a token: nothing to exchange
        return x.new_zeros(x.shape), routing.z_loss
    plan = SendPlan(hit, layout.send_offsets, layout.send_rows, M)
    weights = routing.topk_weights.to(x.dtype) if x.dtype == torch.float64 else routing.topk_weights
    # each send row carries its token's K pairs: the destination's local expert ids (El: another rank's pair)
    local_ids = take(ids, plan.send_tokens, -1) - (plan.send_rank * El).view(-1, 1)  # [rows, K]
    local_ids = torch.where((local_ids >= 0) & (local_ids < El), local_ids, El).to(torch.int32)
    packed = moe.d_model if ep.exchange.symmetric else 0
    payload = sent = _Payload(packed, K, x.dtype, weights.dtype)
    fp8 = None if moe.fp8 is None else (moe.fp8, backend.fp8_ops)
    if fp8 is not None:  # the rows go in e4m3 with their scales
        sent = _Payload(packed, K, E4M3, weights.dtype, scales=-(-moe.d_model // moe.fp8.row_block(moe.d_model)[1]))
    x_send = GatherRows.apply(x, *plan.tensors(), M)  # [rows, d]: the only copy of x
    x_recv, w_recv, ids_recv = _Dispatch.apply(x_send, take(weights, plan.send_tokens), local_ids,
                                               ep.exchange, layout, sent, payload, fp8)
    # Rows past what a source sent: the padded exchange's carry the sender's unused rows (every pair foreign, weight
    # 0: take's fills); a symmetric buffer's hold whatever was there, so they are masked.
    valid = layout.recv_valid() if ep.exchange.symmetric else None
    if valid is not None:
        ids_recv = torch.where(valid.view(-1, 1), ids_recv, El)
        w_recv = torch.where(valid.view(-1, 1), w_recv, 0)
    rows = layout.recv_counts.sum()
    ep.recv_rows = rows if ep.recv_rows is None else ep.recv_rows + rows
    scale = None if ep.grad_divide == 1 else (lambda w: _DivideGrad.apply(w, ep.grad_divide))
    w1, w2 = (moe.w1, moe.w_down) if scale is None else (scale(moe.w1), scale(moe.w_down))
    # built here without its range checks (their host synchronisations): the ids are in range by construction
    index = backend.plan(ids_recv, El, validate=False, foreign_experts=True)
    y = run_experts(x_recv, w_recv, w1, w2, *moe.expert_biases(dtype, scale), index, moe.activation, moe.save,
                    backend, DEFAULT_ACT, None, moe.fp8)  # [R, d]: each row's local pairs, weighted
    out = SumRows.apply(_Combine.apply(y, ep.exchange, layout, payload), *plan.tensors(), M)  # [T, d]

    if moe.router.aux_loss_type != "switch":
        return out, routing.loss
    aux = routing.z_loss
    if moe.router.aux_loss_coef and moe.training:
        probs = _router_probs(moe, routing)
        aux = aux + moe.router.aux_loss_coef * global_load_balancing_loss(probs, all_counts[:, :E].sum(0))
    return out, aux
