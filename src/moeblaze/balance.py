"""Expert load balancing beyond the Switch loss: DeepSeek-V3's auxiliary-loss-free expert biases, its
sequence-wise balance loss, Qwen's global-batch balance loss, and the expert load a training step saw.

- **Auxiliary-loss-free balancing** (DeepSeek-V3, arXiv 2412.19437 §2.1.2, eq. 16; Wang et al. 2024,
  arXiv 2408.15664): each router keeps a bias ``b [E]`` (``e_score_correction_bias``) added to the scores for
  the choice of the top-k experts only; the combine weights stay the unbiased scores. After every optimizer
  step each expert's bias moves by ``u * sign(mean_load - load_e)`` (u = 1e-3 in DeepSeek-V3), where
  ``load_e`` counts the pairs the routers sent to expert e over the step's forwards on every rank.
  ``moeblaze.MoE(..., expert_bias_update_rate=u)`` counts them on the device (``Router.tokens_per_expert``,
  int64, no host synchronisation); :func:`update_expert_biases` applies the rule after ``optimizer.step()``.
  torchtitan (``load_balance_coeff``) and Megatron-Core (``--moe-router-enable-expert-bias``) do the same.
- **Sequence-wise balance loss** (DeepSeek-V3 §2.1.2, eq. 17-20): the Switch loss over each sequence of S
  tokens, ``L = alpha * sum_e f_e P_e`` with ``f_e = E / (K S) * #{t in the sequence: e in top-k(t)}`` and
  ``P_e = mean_t s'_{t,e}`` (``s'``: scores normalised per token), averaged over the sequences
  (:func:`sequence_load_balancing_loss`, ``aux_loss_type="seq"``).
- **Global-batch balance loss** (Qiu et al. 2025, "Demons in the Detail", arXiv 2501.11873 §2): the Switch
  loss with the expert frequencies ``f_e`` of the whole data-parallel batch (the counts all-reduced over the
  group: no gradient flows through them) and this rank's ``P_e`` (:func:`global_batch_load_balancing_loss`,
  ``aux_loss_type="global"``). With equal tokens per rank, the mean over ranks of the loss (and so the
  data-parallel mean of its gradient) is the single-process loss on the concatenated batch.

Counts are of the router's top-k choice (with token rounding: before the rounding drops or pads pairs).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn

__all__ = ["AUX_LOSS_TYPES", "expert_counts", "expert_load", "global_batch_load_balancing_loss", "load_summary",
           "sequence_load_balancing_loss", "update_expert_biases"]

AUX_LOSS_TYPES = ("switch", "seq", "global")


def check_bias_rate(rate) -> float:
    """``expert_bias_update_rate`` as a float (0 = off).

    Raises:
        ValueError: not a finite number >= 0.
    """
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not math.isfinite(rate) or rate < 0:
        raise ValueError(f"expert_bias_update_rate must be a finite number >= 0 (0: off), got {rate!r}")
    return float(rate)


def check_aux_loss_type(kind) -> str:
    """Raises ValueError unless ``kind`` is one of :data:`AUX_LOSS_TYPES`."""
    if kind not in AUX_LOSS_TYPES:
        raise ValueError(f"aux_loss_type must be one of {AUX_LOSS_TYPES}, got {kind!r}")
    return kind


def check_group(group) -> None:
    """Raises TypeError unless ``group`` is None or a ``torch.distributed`` ProcessGroup."""
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"aux_loss_group must be None (the world) or a torch.distributed ProcessGroup, "
                        f"got {type(group).__name__}")


def _resolve(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """The group to sum counts over: ``group``, or the world where torch.distributed is initialised with more
    than one rank; None where there is nothing to sum."""
    if group is not None:
        return group
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.group.WORLD
    return None


def _all_sum(t: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The sum of ``t`` over ``group`` (a functional collective: stream-ordered, no host synchronisation on NCCL,
    traceable by torch.compile), or ``t`` itself without a group."""
    group = _resolve(group)
    return t if group is None else funcol.wait_tensor(funcol.all_reduce(t, "sum", group))


def expert_counts(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Pairs routed to each expert: ``[E]`` int64 from ``topk_ids [T, K]`` (ids in ``[0, E)``), on their device.

    A scatter-add of ones: exact in any order, no host read (``torch.bincount`` reads its maximum to the host).
    """
    ids = topk_ids.reshape(-1).long()
    return ids.new_zeros(num_experts).scatter_add_(0, ids, torch.ones_like(ids))


def sequence_load_balancing_loss(probs: torch.Tensor, topk_ids: torch.Tensor, seq_len: int,
                                 scale: float = 1.0) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss (arXiv 2412.19437 §2.1.2, eq. 17-20), averaged over sequences.

    For each sequence of S = ``seq_len`` consecutive tokens: ``sum_e f_e P_e`` with
    ``f_e = E / (K S) * #{t: e in topk_ids[t]}`` and ``P_e = (1/S) sum_t probs[t, e]``; 1.0 at perfect balance
    within every sequence (as the Switch loss for one sequence).

    Args:
        probs: ``[T, E]`` fp32 routing probabilities, rows summing to 1 (sigmoid routers: the scores normalised
            per token, DeepSeek-V3's ``s'``); differentiable.
        topk_ids: ``[T, K]`` chosen experts (no gradient). seq_len: S, dividing T (the rows of sequence b are
            ``b*S .. (b+1)*S - 1``, as ``x [B, S, d]`` flattens). scale: the coefficient alpha.

    Returns:
        A 0-dim tensor in ``probs.dtype`` (0 for T = 0).

    Raises:
        ValueError: ``seq_len`` is not a positive divisor of T.
    """
    T, E = probs.shape
    if not isinstance(seq_len, int) or seq_len < 1 or T % seq_len:
        raise ValueError(f"seq_len must be a positive divisor of the {T} tokens, got {seq_len!r}")
    if T == 0:
        return probs.sum() * 0.0
    B, K = T // seq_len, topk_ids.shape[1]
    ids = topk_ids.reshape(B, seq_len * K).long()
    counts = probs.new_zeros(B, E).scatter_add_(1, ids, probs.new_ones(()).expand(B, seq_len * K))  # [B, E]
    p_sum = probs.reshape(B, seq_len, E).sum(1)  # [B, E]
    return (scale * E / (K * seq_len * seq_len * B)) * (counts * p_sum).sum()


def global_batch_load_balancing_loss(probs: torch.Tensor, topk_ids: torch.Tensor, scale: float = 1.0,
                                     group: dist.ProcessGroup | None = None,
                                     counts: torch.Tensor | None = None) -> torch.Tensor:
    """Qwen's global-batch balance loss (arXiv 2501.11873 §2): ``scale * E * sum_e f_e P_e`` with ``f_e`` the
    share of all pairs of the data-parallel batch routed to expert e and ``P_e`` this rank's mean probability.

    Args:
        probs: ``[T, E]`` fp32 probabilities of this rank's tokens (T may be 0); differentiable.
        topk_ids: ``[T, K]`` this rank's choices. scale: the coefficient.
        group: the data-parallel group whose counts are summed (one all-reduce of ``[E]`` int64); None: the
            world where torch.distributed is initialised, else this process alone. Collective: every rank of
            the group must call it, also with T = 0.
        counts: ``[E]`` int64 pairs of ``topk_ids`` if already counted (:func:`expert_counts`).

    Returns:
        A 0-dim tensor in ``probs.dtype``; the counts carry no gradient. One process: the Switch loss.
    """
    T, E = probs.shape
    counts = _all_sum(expert_counts(topk_ids, E) if counts is None else counts, group)
    f = counts.to(probs.dtype) / counts.sum().clamp_min(1).to(probs.dtype)
    return (scale * E / max(T, 1)) * torch.dot(f, probs.sum(0))


def _counting_routers(model: nn.Module) -> list[nn.Module]:
    """The routers of ``model`` that count their tokens (:class:`moeblaze.Router` s holding ``tokens_per_expert``),
    in module order. Found by those attributes: :mod:`moeblaze.routing` imports this module."""
    return [m for m in model.modules() if isinstance(getattr(m, "tokens_per_expert", None), torch.Tensor)
            and hasattr(m, "expert_bias_update_rate")]


def expert_load(model: nn.Module, group: dist.ProcessGroup | None = None, reset: bool = False) -> list[torch.Tensor]:
    """The pairs each expert of each counting router received since the counts were last reset, summed over
    ``group``: one ``[E]`` int64 tensor per router (module order), from ONE all-reduce of their concatenation.

    Routers count in training-mode forwards when built with ``track_expert_load=True`` or
    ``expert_bias_update_rate > 0`` (:class:`moeblaze.MoE`). Collective over ``group`` (default: the world where
    torch.distributed is initialised; every rank must call it). No host synchronisation.

    Args:
        model: a module holding :class:`moeblaze.Router` s (an FSDP2 / expert-parallel model included: the router
            is replicated, each rank counts its own tokens, so the sum over the world is the global load).
        reset: zero the routers' counts afterwards.
    """
    routers = _counting_routers(model)
    if not routers:
        return []
    local = [r.tokens_per_expert for r in routers]
    total = _all_sum(torch.cat(local), group)  # a copy: the routers' counts stay as they are until reset
    if reset:
        torch._foreach_zero_(local)
    return list(total.split([t.numel() for t in local]))


@torch.no_grad()
def update_expert_biases(model: nn.Module, group: dist.ProcessGroup | None = None,
                         load: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Auxiliary-loss-free balancing (DeepSeek-V3 §2.1.2): ``b_e += u * sign(mean_load - load_e)`` for every
    router of ``model`` with ``expert_bias_update_rate = u > 0``, then zero the counts of every counting router.

    Call it after ``optimizer.step()`` (on every rank), once per step. ``mean_load - load_e`` is compared in
    integers (``sum_e' load_e' - E * load_e``), so the sign is exact; the bias stays fp32.

    Args:
        model: as :func:`expert_load`.
        group: where the counts are summed (default: the world where torch.distributed is initialised).
        load: this step's global counts as :func:`expert_load` returned them (without ``reset``): one ``[E]``
            int64 tensor per counting router, in :func:`expert_load`'s order; given, no collective runs here.

    Returns:
        The global counts the update used (as :func:`expert_load`).

    Raises:
        ValueError: ``model`` holds no counting router, or ``load`` does not hold one tensor per counting router.
    """
    routers = _counting_routers(model)
    if not routers:
        raise ValueError("update_expert_biases: no router of model counts its tokens; build its MoE layers with "
                         "expert_bias_update_rate > 0 (MoE(..., expert_bias_update_rate=1e-3))")
    if load is None:
        load = expert_load(model, group)
    if len(load) != len(routers):
        raise ValueError(f"load must hold one [E] tensor per counting router ({len(routers)}), got {len(load)}")
    for router, counts in zip(routers, load):
        if router.expert_bias_update_rate > 0:
            E = counts.numel()
            step = torch.sign(counts.sum() - E * counts).to(torch.float32)  # sign(mean - load_e), exact
            router.e_score_correction_bias.add_(step, alpha=router.expert_bias_update_rate)
    torch._foreach_zero_([r.tokens_per_expert for r in routers])
    return load


def load_summary(load: list[torch.Tensor]) -> torch.Tensor:
    """``[3]`` fp32 on the counts' device: the largest and the mean over routers of ``max_e load_e / mean_e
    load_e`` (1 = balanced; 0 for a router that saw no token), and the number of (router, expert) pairs that
    received no token. No host synchronisation.

    Raises:
        ValueError: ``load`` is empty.
    """
    if not load:
        raise ValueError("load_summary needs the load of at least one router")
    ratios = torch.stack([c.max().float() * c.numel() / c.sum().clamp_min(1).float() for c in load])
    zeros = sum((c == 0).sum() for c in load)
    return torch.stack((ratios.max(), ratios.mean(), zeros.float()))
