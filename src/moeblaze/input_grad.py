"""One ``[T, d]`` input gradient summed in place by the two autograd Functions of a layer that read the input.

:class:`moeblaze.MoE` feeds the same ``x`` to the router's logits GEMM and to the experts' up-projection. Autograd
gives each its own ``dx`` and then adds the two: an element-wise kernel that reads both and writes the sum, 3 x 2Td
bytes in 16-bit (150 MB and 34 µs per step at T 16384, d 1536 on an H200: the largest kernel of the
step outside the experts' and the router's GEMMs, ``python3 benchmarks/bench_token_rounding.py speed --shapes 0
--breakdown 16``). With a :class:`SharedInputGrad` the first of the two backwards to run returns its ``dx`` as
usual and keeps a reference to it; the second adds into that tensor in place and returns None, so autograd adds
nothing. The router, which autograd runs second (it needs the experts' router-weight gradient), adds its ``dx`` in
its GEMM's epilogue (``addmm_``, beta = 1: the experts' ``dx`` read once, no ``[T, d]`` buffer of its own). Either
order gives the same sum; a layer whose output gets no gradient leaves the router's ``dx`` alone.

Used only where it is safe: eager autograd without ``create_graph`` (an in-place update of a returned gradient
would break a double backward), the same tensor object in both Functions (a cast between them makes two inputs),
one backward pass at a time (the pass is told by autograd's graph-task id, so a ``retain_graph`` second pass
starts afresh), and no third reader of the input: autograd adds a third gradient out of place (the kept tensor is
referenced twice), into a new tensor the second Function would not see, so the layer does not share when it
has shared experts. Under ``torch.compile`` the layer does not share (Inductor traces the add and fuses it).
"""

from __future__ import annotations

import weakref

import torch


class SharedInputGrad:
    """The running sum of one input's gradient between two autograd Functions (module docstring)."""

    def __init__(self) -> None:
        self._input: weakref.ref | None = None
        self._task = None
        self._dx: torch.Tensor | None = None

    def bind(self, x: torch.Tensor) -> SharedInputGrad | None:
        """In a Function's forward: this share if ``x`` is the tensor of every earlier :meth:`bind`, else None
        (the Function then returns its gradient to autograd as usual)."""
        if self._input is None:
            self._input = weakref.ref(x)
            return self
        return self if self._input() is x else None

    def take(self) -> torch.Tensor | None:
        """In a backward: the gradient the other Function returned earlier in this backward pass (the reference is
        dropped here: the graph's nodes, which hold this share, live until the whole backward ends), or None
        (this Function runs first, or alone, or gradients are being differentiated: ``create_graph``)."""
        if torch.is_grad_enabled() or self._task != torch._C._current_graph_task_id():
            return None
        dx, self._dx, self._task = self._dx, None, None
        return dx

    def offer(self, dx: torch.Tensor | None) -> torch.Tensor | None:
        """In a backward, with this Function's gradient: added in place into :meth:`take`'s (returns None), or
        kept as this pass's running sum and returned for autograd (the first)."""
        if dx is None:
            return None
        pending = self.take()
        if pending is not None:
            pending.add_(dx)
            return None
        if not torch.is_grad_enabled():
            self._task, self._dx = torch._C._current_graph_task_id(), dx
        return dx
