"""Bytes kept for backward, measured with ``torch.autograd.graph.saved_tensors_hooks`` (DESIGN.md §7).

Every tensor that autograd saves between forward and backward passes through the pack hook; we
count each underlying storage once (views and tensors saved twice share a storage) and leave out
the storages of tensors we are told to exclude (by default: none; pass the parameters, and the
inputs if you want only what a layer adds). Figures are bytes of whole storages, so a saved view of
a larger buffer counts the whole buffer — which is what it keeps alive.

Two forms:

* :func:`saved_bytes` runs a callable and returns the bytes its forward saved.
* :class:`SavedTensorCounter` is the context manager behind it; :meth:`SavedTensorCounter.track`
  counts only what chosen modules save (e.g. the MoE layers inside a whole model's forward).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn as nn

__all__ = ["SavedTensorCounter", "saved_bytes", "storage_key", "count_storage"]


def storage_key(t: torch.Tensor) -> tuple[str, int]:
    """``(device, data_ptr)`` of the storage under ``t``: one key for all its views."""
    return str(t.device), t.untyped_storage().data_ptr()


def count_storage(t: torch.Tensor, seen: dict[tuple[str, int], int], excluded: set[tuple[str, int]]) -> int:
    """Bytes of ``t``'s whole storage the first time it is met, else 0 (already in ``seen``, in
    ``excluded`` or empty); records it in ``seen``. The counting rule of this module and of
    :func:`moeblaze.memory_report`."""
    key = storage_key(t)
    if key[1] == 0 or key in excluded or key in seen:
        return 0
    seen[key] = nbytes = t.untyped_storage().nbytes()
    return nbytes


class SavedTensorCounter:
    """Counts unique storages saved for backward while active.

    Args:
        exclude: tensors whose storages are not counted (typically ``model.parameters()``).

    Attributes:
        bytes: total bytes (int) of the unique storages saved so far.
        count: number of unique storages counted.

    Use as ``with SavedTensorCounter(exclude=params) as c: loss = f(x)`` — then ``c.bytes`` — or,
    to count only inside some modules, ``with SavedTensorCounter(params).track(modules) as c: ...``.
    Tensors are passed through as detached views of the same storage (no copy), so results are
    bitwise identical with or without it. Returning ``t`` itself would leak every forward-only graph
    whose saved tensors include an output (softmax saves its result; the output then holds its own
    ``grad_fn`` through C++, a cycle Python's gc cannot see).
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._excluded = {storage_key(t) for t in exclude}
        self._seen: dict[tuple[str, int], int] = {}
        self._ctx: torch.autograd.graph.saved_tensors_hooks | None = None
        self._modules: list[nn.Module] = []
        self._handles: list[Any] = []
        self._depth = 0

    @property
    def bytes(self) -> int:
        return sum(self._seen.values())

    @property
    def count(self) -> int:
        return len(self._seen)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if self._depth > 0 or not self._modules:
            count_storage(t, self._seen, self._excluded)
        return t.detach()  # not t: a saved output holding its own grad_fn is a cycle gc cannot free

    @staticmethod
    def _unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    def track(self, modules: Iterable[nn.Module]) -> SavedTensorCounter:
        """Count only what is saved while one of ``modules`` runs its forward (returns ``self``)."""
        self._modules = list(modules)
        return self

    def _enter_module(self, *_: Any) -> None:
        self._depth += 1

    def _exit_module(self, *_: Any) -> None:
        self._depth -= 1

    def __enter__(self) -> SavedTensorCounter:
        for m in self._modules:
            self._handles.append(m.register_forward_pre_hook(self._enter_module))
            self._handles.append(m.register_forward_hook(self._exit_module))
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._ctx is not None
        self._ctx.__exit__(*exc)
        self._ctx = None
        for h in self._handles:
            h.remove()
        self._handles.clear()


def saved_bytes(fn: Callable[..., Any], *args: Any, exclude: Iterable[torch.Tensor] = (), **kwargs: Any) -> int:
    """Bytes that ``fn(*args, **kwargs)`` saves for backward (unique storages, ``exclude`` left out).

    Args:
        fn: a callable whose forward builds an autograd graph (some input or parameter needs grad).
        exclude: tensors not to count, e.g. ``list(module.parameters())`` or the inputs.

    Returns:
        The number of bytes (int). The result of ``fn`` is discarded (and its graph freed).

    Example: ``saved_bytes(layer, x, exclude=[x, *layer.parameters()])`` is what ``layer`` keeps
    beyond its input and weights.
    """
    with SavedTensorCounter(exclude) as counter:
        out = fn(*args, **kwargs)
    del out
    return counter.bytes
