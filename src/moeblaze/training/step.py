"""One optimizer step of ``moeblaze train``, launched without a host synchronisation: :func:`train_step` (loss =
cross-entropy + the routers' auxiliary losses, gradient clipping, the routers' bias update) and its
:class:`StepOutcome`, the figures the host reads while the next step runs (:class:`NonFiniteLossError` when one is
NaN or inf). The loop that runs it is :mod:`moeblaze.training.train`.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F

from ..balance import expert_load, load_summary, update_expert_biases
from ..fp8 import reuse_weights
from ..layer import aux_loss
from ..memory import SavedTensorCounter
from .job import Job, clip_grad_norm
from .model import MoETransformer
from .train_config import autocast_context

__all__ = ["NonFiniteLossError", "StepOutcome", "train_step"]


class NonFiniteLossError(RuntimeError):
    """Training stopped at a non-finite loss or gradient norm; the optimizer did not step on it."""


_VALUE_NAMES = ("LM loss (cross-entropy)", "auxiliary loss (router load-balancing + z-loss)", "gradient norm")


class StepOutcome:
    """A launched optimizer step whose figures travel to the host without stopping the device.

    :func:`train_step` ends with a non-blocking copy of the step's losses, gradient norm and expert load into
    pinned host memory and an event behind it; :meth:`result` waits for that event only (the copy, queued right
    after the step's work), so the host can launch the next step first and keep the device fed.
    """

    def __init__(self, values: torch.Tensor, has_load: bool) -> None:
        self._host = torch.empty(values.shape, dtype=values.dtype, pin_memory=values.is_cuda)
        self._host.copy_(values, non_blocking=True)
        self._event = torch.cuda.Event() if values.is_cuda else None
        if self._event is not None:
            self._event.record()
        self.has_load = has_load

    def result(self) -> tuple[float, tuple | None]:
        """``(cross-entropy in nats, expert load or None)``, the load as :func:`train_step` describes it.

        Raises:
            NonFiniteLossError: the LM loss, the auxiliary loss or the gradient norm is NaN or inf (the optimizer
                skipped the step: :func:`train_step`).
        """
        if self._event is not None:
            self._event.synchronize()
        values = self._host.tolist()
        for name, v in zip(_VALUE_NAMES, values):
            if not math.isfinite(v):
                raise NonFiniteLossError(f"{name} is {v}")
        return values[0], (values[3], values[4], int(values[5])) if self.has_load else None


def train_step(model: MoETransformer, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, lr: float,
               grad_clip: float, counter: SavedTensorCounter | None = None,
               autocast: torch.dtype | None = None, job: Job | None = None, micro_batches: int = 1) -> StepOutcome:
    """One optimizer step on a batch ``x, y [B, seq]`` (int64 bytes), launched without a host synchronisation;
    :meth:`StepOutcome.result` gives the cross-entropy (nats) and the step's expert load
    (:func:`moeblaze.balance.load_summary` as floats: the worst and the mean over the MoE layers of max / mean
    tokens per expert, and the experts that received no token), or None without counts.

    The loss is cross-entropy plus the MoE layers' auxiliary losses; gradients are clipped to
    ``grad_clip`` (0: off). With ``counter``, the forward runs under it (bytes saved for backward). With
    ``autocast`` (mixed precision), the forward runs under ``torch.autocast(x.device.type, autocast)``; the
    backward and the optimizer step run outside it, on the fp32 parameters. After ``opt.step()``,
    :func:`moeblaze.update_expert_biases` moves the routers' biases (``expert_bias_rate`` > 0) and resets
    the counts, from the same all-reduced counts as the load (one all-reduce of ``[layers * E]`` int64).
    With ``micro_batches`` > 1 the batch runs forward and backward in that many equal parts along ``B`` (a
    :class:`ValueError` when it does not divide ``B``), each loss divided by their number so the gradients sum to
    the batch's mean; the reported losses are the parts' means, the load their sum, the FP8 layers' weight copies
    made once (:func:`moeblaze.fp8.reuse_weights`); under FSDP2 the gradients are reduced after the last part only.
    With ``counter``, the first part's forward runs under it.
    With a ``job`` of several ranks (FSDP2), the losses are means over the ranks and the gradient norm is the
    global one (:func:`moeblaze.training.job.clip_grad_norm`), so every rank decides alike; the load is over
    every rank's tokens.

    A non-finite loss or gradient norm is found on the device: a fused optimizer
    (:func:`moeblaze.training.train_config.make_optimizer`'s AdamW) skips the step there (its ``found_inf``), so
    the weights and the optimizer state stay those of the previous step, and :meth:`StepOutcome.result` raises
    :class:`NonFiniteLossError` when the host reads it. Another optimizer has no such skip: the figures are then
    read before ``opt.step()`` (one synchronisation), which raises before stepping.
    """
    for group in opt.param_groups:
        group["lr"] = lr
    ce, aux = _forward_backward(model, x, y, counter, autocast, micro_batches)
    load = expert_load(model)  # over the world's tokens where distributed (the routers are replicated)
    params = [p for p in model.parameters() if p.grad is not None]
    if job is not None and job.mesh is not None:
        norm = clip_grad_norm(params, grad_clip, job)
        ce, aux = job.all_mean(torch.stack([ce.detach(), aux.detach().float()]))
    elif grad_clip > 0:
        norm = torch.nn.utils.clip_grad_norm_(params, grad_clip)
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    summary = [load_summary(load).to(ce.device)] if load else []
    values = torch.cat([torch.stack([ce.detach(), aux.detach().float(), norm.float().to(ce.device)]), *summary])
    outcome = StepOutcome(values, bool(load))
    if opt.defaults.get("fused"):
        opt.found_inf = (~torch.isfinite(values[:3]).all()).float()  # read by the fused kernel: skip the step
    else:
        try:
            outcome.result()
        except NonFiniteLossError:
            opt.zero_grad(set_to_none=True)
            raise
    opt.step()
    opt.zero_grad(set_to_none=True)
    update_expert_biases(model, load=load)  # the auxiliary-loss-free step (expert_bias_rate 0: only the reset)
    return outcome


def _forward_backward(model: MoETransformer, x: torch.Tensor, y: torch.Tensor, counter: SavedTensorCounter | None,
                      autocast: torch.dtype | None, parts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward and backward of ``x, y [B, seq]`` in ``parts`` equal micro-batches (:func:`train_step`): the mean
    cross-entropy and auxiliary loss over them, detached."""
    if x.shape[0] % parts:
        raise ValueError(f"micro_batches {parts} must divide the batch's {x.shape[0]} sequences")
    sync = getattr(model, "set_requires_gradient_sync", None) if parts > 1 else None  # FSDP2: reduce once
    losses = []
    with reuse_weights() if parts > 1 else contextlib.nullcontext():
        for i, (xi, yi) in enumerate(zip(x.chunk(parts), y.chunk(parts))):
            if sync is not None:
                sync(i == parts - 1)
            first = counter if counter is not None and i == 0 else contextlib.nullcontext()
            with first, autocast_context(x.device, autocast):
                logits = model(xi)
            ce = F.cross_entropy(logits.float().flatten(0, 1), yi.flatten())
            aux = aux_loss(model).to(x.device)
            ((ce + aux) / parts).backward()
            losses.append(torch.stack([ce.detach(), aux.detach().float()]))
    ce, aux = torch.stack(losses).mean(0).unbind()
    return ce, aux
