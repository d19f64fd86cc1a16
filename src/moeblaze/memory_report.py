"""``moeblaze.memory_report(model, example_batch)``: where a model's activation memory goes.

One training step (forward, loss, backward) of ``model`` on ``example_batch`` runs under
``torch.autograd.graph.saved_tensors_hooks``; every tensor autograd saves is attributed to the innermost
module running its forward at that moment (tracked with forward pre/post hooks). Each storage is counted
once, by the first module that saves it; parameters and buffers are not counted (they exist anyway).
On CUDA the step's peak memory (``torch.cuda.max_memory_allocated``) is reported too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from .memory import count_storage, storage_key

__all__ = ["ModuleMemory", "MemoryReport", "memory_report", "default_loss"]

MIB = 1 << 20
UNATTRIBUTED = "(outside any module)"


@dataclass
class ModuleMemory:
    """Bytes saved for backward by one module.

    Attributes:
        name: qualified module name (``""`` is the model itself); type: its class name.
        self_bytes: saved while this module, and none of its children, was running.
        total_bytes: ``self_bytes`` plus that of every descendant.
        tensors: unique storages counted in ``self_bytes``.
    """

    name: str
    type: str
    self_bytes: int = 0
    total_bytes: int = 0
    tensors: int = 0


@dataclass
class MemoryReport:
    """What :func:`memory_report` measured.

    Attributes:
        modules: one entry per module, in ``model.named_modules()`` order.
        saved_bytes: all bytes saved for backward in the step (unique storages, parameters and buffers
            excluded), including ``unattributed_bytes``.
        unattributed_bytes: saved outside every module's forward (e.g. by the loss).
        peak_bytes: CUDA peak of the step (``None`` on CPU); baseline_bytes: allocated before it.
        device: where the step ran.
    """

    modules: list[ModuleMemory]
    saved_bytes: int
    unattributed_bytes: int
    peak_bytes: int | None = None
    baseline_bytes: int | None = None
    device: str = "cpu"
    notes: list[str] = field(default_factory=list)

    def __str__(self) -> str:  # print(report) shows the table, not the dataclass fields
        return self.table()

    def by_name(self) -> dict[str, ModuleMemory]:
        """Entries keyed by module name."""
        return {m.name: m for m in self.modules}

    def table(self, max_depth: int | None = None, min_fraction: float = 0.0) -> str:
        """A text table: module, type, self MiB, total MiB, share of all saved bytes.

        Args:
            max_depth: show modules at most this many dots deep (``None``: all).
            min_fraction: hide modules whose total is below this fraction of ``saved_bytes``.
        """
        total = max(self.saved_bytes, 1)
        lines = [f"{'module':<40} {'type':<18} {'self MiB':>10} {'total MiB':>10} {'share':>7}"]
        for m in self.modules:
            depth = 0 if not m.name else m.name.count(".") + 1
            if (max_depth is not None and depth > max_depth) or m.total_bytes < min_fraction * total:
                continue
            name = ("  " * depth + (m.name.rsplit(".", 1)[-1] if m.name else "(model)"))[:40]
            lines.append(f"{name:<40} {m.type[:18]:<18} {m.self_bytes / MIB:>10.2f} {m.total_bytes / MIB:>10.2f} "
                         f"{m.total_bytes / total:>7.1%}")
        if self.unattributed_bytes:
            lines.append(f"{UNATTRIBUTED:<40} {'':<18} {self.unattributed_bytes / MIB:>10.2f} "
                         f"{self.unattributed_bytes / MIB:>10.2f} {self.unattributed_bytes / total:>7.1%}")
        lines.append(f"saved for backward: {self.saved_bytes / MIB:.2f} MiB (parameters and buffers not counted)")
        if self.peak_bytes is not None:
            lines.append(f"peak of one training step: {self.peak_bytes / MIB:.2f} MiB "
                         f"({(self.peak_bytes - (self.baseline_bytes or 0)) / MIB:.2f} MiB above the "
                         f"{(self.baseline_bytes or 0) / MIB:.2f} MiB allocated before it)")
        else:
            lines.append(f"peak memory: not measured on {self.device} (CUDA only)")
        return "\n".join(lines + self.notes)

    def as_dict(self) -> dict[str, Any]:
        return {"saved_bytes": self.saved_bytes, "unattributed_bytes": self.unattributed_bytes,
                "peak_bytes": self.peak_bytes, "baseline_bytes": self.baseline_bytes, "device": self.device,
                "modules": [vars(m) for m in self.modules]}


def default_loss(output: Any) -> torch.Tensor:
    """A scalar to differentiate: ``output.loss`` / ``output["loss"]`` if present, a 0-dim output as is,
    else the mean square of the (first) output tensor in fp32.

    Raises:
        TypeError: no tensor found in ``output``.
    """
    if isinstance(output, dict) and "loss" in output:
        output = output["loss"]
    elif getattr(output, "loss", None) is not None:
        output = output.loss
    if isinstance(output, (tuple, list)) and output:
        output = output[0]
    if not isinstance(output, torch.Tensor):
        raise TypeError(f"cannot make a loss from a {type(output).__name__}; pass loss_fn=")
    return output.float() if output.dim() == 0 else output.float().square().mean()


def _call(model: nn.Module, batch: Any) -> Any:
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


class _Attributor:
    """Saved-tensor pack hook + module stack: bytes per innermost module, unique storages."""

    def __init__(self, model: nn.Module) -> None:
        self.names = {m: n for n, m in model.named_modules(remove_duplicate=False)}
        self.excluded = {storage_key(t) for t in (*model.parameters(), *model.buffers())}
        self.seen: dict[tuple[str, int], int] = {}
        self.stack: list[str] = []
        self.self_bytes: dict[str, int] = {}
        self.counts: dict[str, int] = {}
        self.handles: list[Any] = []

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        nbytes = count_storage(t, self.seen, self.excluded)
        if nbytes:
            owner = self.stack[-1] if self.stack else UNATTRIBUTED
            self.self_bytes[owner] = self.self_bytes.get(owner, 0) + nbytes
            self.counts[owner] = self.counts.get(owner, 0) + 1
        return t.detach()  # see moeblaze.memory.SavedTensorCounter: returning t leaks saved outputs

    def _enter(self, name: str) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            self.stack.append(name)

        return hook

    def _exit(self, *_: Any) -> None:  # returns None: a forward hook's return value replaces the output
        self.stack.pop()

    def __enter__(self) -> _Attributor:
        for module, name in self.names.items():
            self.handles.append(module.register_forward_pre_hook(self._enter(name)))
            self.handles.append(module.register_forward_hook(self._exit))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self.handles:
            h.remove()


def memory_report(model: nn.Module, example_batch: Any,
                  loss_fn: Callable[[Any, Any], torch.Tensor] | None = None, warmup: int = 0) -> MemoryReport:
    """Per-module bytes saved for backward, and (CUDA) the peak memory, of one training step.

    Args:
        model: any ``nn.Module``, in the mode and on the device you want measured (``model.train()``
            for training figures).
        example_batch: the input: a tensor (``model(batch)``), a tuple/list (``model(*batch)``) or a dict
            (``model(**batch)``), on the model's device.
        loss_fn: ``loss_fn(output, example_batch) -> scalar``; default :func:`default_loss` of the output.
        warmup: untracked steps first (so that e.g. Triton autotuning does not count in the peak).

    Returns:
        :class:`MemoryReport`; ``report.table()`` prints it. Gradients of the step are discarded: each
        parameter's ``.grad`` is what it was before the call.

    Raises:
        TypeError: the output gives no loss (pass ``loss_fn``). RuntimeError: the loss needs no grad.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    old_grads = [p.grad for p in params]
    device = next((t.device for t in (*model.parameters(), *model.buffers())), torch.device("cpu"))
    lossf = loss_fn if loss_fn is not None else (lambda out, _: default_loss(out))
    try:
        for _ in range(warmup):
            lossf(_call(model, example_batch), example_batch).backward()
        for p in params:
            p.grad = None
        att, peak, baseline = _tracked_step(model, example_batch, lossf, device)
    finally:
        for p, g in zip(params, old_grads):
            p.grad = g
    return _summarise(model, att, peak, baseline, str(device))


def _tracked_step(model: nn.Module, batch: Any, lossf: Callable, device: torch.device):
    """One forward+loss under the attributing hooks, then backward; ``(attributor, peak, baseline)``."""
    cuda = device.type == "cuda"
    peak = baseline = None
    if cuda:
        torch.cuda.synchronize(device)
        baseline = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    att = _Attributor(model)
    with att, torch.autograd.graph.saved_tensors_hooks(att.pack, lambda t: t):
        output = _call(model, batch)
        loss = lossf(output, batch)
    del output
    loss.backward()
    del loss
    if cuda:
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
    return att, peak, baseline


def _summarise(model: nn.Module, att: _Attributor, peak: int | None, baseline: int | None,
               device: str) -> MemoryReport:
    modules = []
    for name, module in model.named_modules():
        prefix = name + "."
        total = sum(b for n, b in att.self_bytes.items() if n != UNATTRIBUTED and (not name or n == name
                                                                                     or n.startswith(prefix)))
        modules.append(ModuleMemory(name, type(module).__name__, att.self_bytes.get(name, 0), total,
                                    att.counts.get(name, 0)))
    saved = sum(att.self_bytes.values())
    return MemoryReport(modules, saved, att.self_bytes.get(UNATTRIBUTED, 0), peak, baseline, device)
