"""The token exchange of expert parallelism under autograd: rows (and their pairs) through an
:class:`moeblaze.parallel.exchange.Exchange`, whole or split into a start and a finish.

:class:`Transfer` is one exchange of a layer step: a dispatch (send layout -> receive layout, the rows with their
pairs) or a combine (``reverse``: the rows alone, back). Its backward is the exchange the other way.

- :func:`transfer` runs it whole: the exchange, then its result (one autograd node; backward alike).
- :func:`start` / :func:`finish` split it for overlap (chunks of tokens, :mod:`moeblaze.parallel.ep`): ``start``
  issues the exchange and returns a token (an empty tensor that carries the autograd edge), ``finish`` waits for
  it and returns the rows; kernels launched in between run while the rows travel. In backward the order flips:
  ``finish``'s backward issues the reverse exchange of the gradients and ``start``'s backward waits for it, so the
  expert backward of another chunk runs in between (autograd's device queue takes the latest forward op first).
  Issued with ``async_op=True`` on the group's communication stream (NCCL, gloo); ``nvshmem`` runs on the current
  stream, so it does not overlap.
"""

from __future__ import annotations

import torch

from ..settings import carried_to_backward
from .exchange import Exchange, Layout

__all__ = ["Payload", "Transfer", "finish", "start", "transfer"]


class Payload:
    """The byte layout of a row packed for an exchange: the row's ``[d]`` values, its ``[K]`` weights and ``[K]`` int32
    local expert ids, each section 16-byte aligned (so that each reads back as its dtype), the row a multiple of 64
    bytes. ``d = 0``: the pairs alone (the values then travel in their own bytes, :meth:`Transfer.send`). Gradients
    travel in the same layout (values and weights; the ids section unused)."""

    def __init__(self, d: int, K: int, x_dtype: torch.dtype, w_dtype: torch.dtype) -> None:
        def up(n: int, a: int = 16) -> int:
            return -(-n // a) * a
        self.d, self.K, self.x_dtype, self.w_dtype = d, K, x_dtype, w_dtype
        xe, we = torch.empty((), dtype=x_dtype).element_size(), torch.empty((), dtype=w_dtype).element_size()
        self.x_end = d * xe
        self.w_at = up(self.x_end)
        self.w_end = self.w_at + K * we
        self.id_at = up(self.w_end)
        self.width = up(self.id_at + 4 * K, 64)

    def values(self, buf: torch.Tensor) -> torch.Tensor:
        return buf[:, :self.x_end].view(self.x_dtype)

    def weights(self, buf: torch.Tensor) -> torch.Tensor:
        return buf[:, self.w_at:self.w_end].view(self.w_dtype)

    def ids(self, buf: torch.Tensor) -> torch.Tensor:
        return buf[:, self.id_at:self.id_at + 4 * self.K].view(torch.int32)


class _InFlight:
    """An issued exchange: its pending work handles and received buffers; :meth:`wait` returns the rows."""

    def __init__(self, works: list, got: torch.Tensor, pairs: torch.Tensor | None, payload: Payload,
                 dtype: torch.dtype, packed: bool) -> None:
        self.works, self.got, self.pairs, self.payload = works, got, pairs, payload
        self.dtype, self.packed = dtype, packed

    def wait(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        for work in self.works:
            work.wait()  # the current stream waits for the communication stream
        pay = self.payload
        if self.packed:  # already copied out of the symmetric buffer (Transfer.send)
            return self.got, self.pairs[0] if self.pairs else None, self.pairs[1] if self.pairs else None
        got = self.got.view(self.dtype)
        if self.pairs is None:
            return got, None, None
        return got, pay.weights(self.pairs).contiguous(), pay.ids(self.pairs).contiguous()


class Transfer:
    """One exchange of a layer step (module docstring): ``exchange`` over ``layout`` with rows packed as
    ``payload``, of rows of ``d`` values; ``reverse``: receive layout -> send layout (a combine). Made in the
    forward, used by both passes."""

    def __init__(self, exchange: Exchange, layout: Layout, payload: Payload, d: int, reverse: bool) -> None:
        self.exchange, self.layout, self.payload, self.d, self.reverse = exchange, layout, payload, d, reverse
        self.pending: _InFlight | None = None

    def send(self, values: torch.Tensor, weights: torch.Tensor | None = None, ids: torch.Tensor | None = None,
             reverse: bool = False, async_op: bool = False) -> _InFlight:
        """Issue ``values [S, d]`` (with ``weights``: each row's ``[S, K]`` weights and local expert ids, None:
        zeros) through the exchange (``reverse``: the other way). Symmetric buffers (``nvshmem``; ``payload.d ==
        d``) take one packed byte row per token, copied out at once; the other exchanges send the values' own bytes
        (a copy in and a copy out of ``[S, d]`` saved) and the pairs in a second exchange of ``payload.width`` bytes
        per row."""
        ex, layout, pay = self.exchange, self.layout, self.payload
        if pay.d:
            buf = ex.buffer(layout.recv_rows if reverse else layout.send_rows, pay.width, reverse=reverse)
            sections = [(pay.values(buf), values)]
            if weights is not None:
                sections += [(pay.weights(buf), weights), (pay.ids(buf), ids)]
            for section, t in sections:
                section.copy_(t) if t is not None else section.zero_()
            got, _ = ex.rows(buf, layout, reverse)
            pairs = None if weights is None else (pay.weights(got).clone(), pay.ids(got).clone())
            return _InFlight([], pay.values(got).clone(), pairs, pay, values.dtype, packed=True)
        got, work = ex.rows(values.contiguous().view(torch.uint8), layout, reverse, async_op)
        works = [work] if work is not None else []
        pairs = None
        if weights is not None:
            buf = ex.buffer(weights.shape[0], pay.width, reverse=reverse)
            pay.weights(buf).copy_(weights)
            pay.ids(buf).copy_(ids) if ids is not None else pay.ids(buf).zero_()
            pairs, work = ex.rows(buf, layout, reverse, async_op)
            works += [work] if work is not None else []
        return _InFlight(works, got, pairs, pay, values.dtype, packed=False)

    def grads(self, grad_values: torch.Tensor | None, grad_weights: torch.Tensor | None, with_weights: bool):
        """The backward's inputs, zeros for a gradient autograd did not produce."""
        rows = self.layout.send_rows if self.reverse else self.layout.recv_rows
        pay, dev = self.payload, self.exchange.device
        if grad_values is None:
            grad_values = torch.zeros(rows, self.d, dtype=pay.x_dtype, device=dev)
        if with_weights and grad_weights is None:
            grad_weights = torch.zeros(rows, pay.K, dtype=pay.w_dtype, device=dev)
        return grad_values, grad_weights if with_weights else None


def _outputs(ctx, got: tuple) -> tuple:
    values, weights, ids = got
    if weights is None:
        return values
    ctx.mark_non_differentiable(ids)
    return values, weights, ids


class _Whole(torch.autograd.Function):
    """:func:`transfer`: the exchange and its result in one node; backward: the reverse exchange, waited."""

    @staticmethod
    @carried_to_backward
    def forward(ctx, values, weights, ids, tr: Transfer):
        ctx.tr, ctx.with_weights = tr, weights is not None
        return _outputs(ctx, tr.send(values, weights, ids, reverse=tr.reverse).wait())

    @staticmethod
    @carried_to_backward
    def backward(ctx, grad_values, grad_weights=None, _grad_ids=None):
        tr = ctx.tr
        g, gw = tr.grads(grad_values, grad_weights, ctx.with_weights)
        dv, dw, _ = tr.send(g, gw, reverse=not tr.reverse).wait()
        return dv, dw, None, None


class _Start(torch.autograd.Function):
    """:func:`start`: issues the exchange, returns an empty token; backward waits for the reverse exchange that
    :class:`_Finish`'s backward issued and returns its rows."""

    @staticmethod
    @carried_to_backward
    def forward(ctx, values, weights, ids, tr: Transfer):
        ctx.tr, ctx.with_weights = tr, weights is not None
        tr.pending = tr.send(values, weights, ids, reverse=tr.reverse, async_op=True)
        return values.new_empty(0)

    @staticmethod
    @carried_to_backward
    def backward(ctx, _grad_token):
        dv, dw, _ = ctx.tr.pending.wait()
        ctx.tr.pending = None
        return dv, dw if ctx.with_weights else None, None, None


class _Finish(torch.autograd.Function):
    """:func:`finish`: waits for the exchange :class:`_Start` issued and returns its rows; backward issues the
    reverse exchange of the gradients (waited for in :class:`_Start`'s backward)."""

    @staticmethod
    @carried_to_backward
    def forward(ctx, token, tr: Transfer):
        ctx.tr, ctx.with_weights = tr, tr.pending.pairs is not None
        got, tr.pending = tr.pending.wait(), None
        return _outputs(ctx, got)

    @staticmethod
    @carried_to_backward
    def backward(ctx, grad_values, grad_weights=None, _grad_ids=None):
        tr = ctx.tr
        g, gw = tr.grads(grad_values, grad_weights, ctx.with_weights)
        tr.pending = tr.send(g, gw, reverse=not tr.reverse, async_op=True)
        return g.new_empty(0), None


def transfer(tr: Transfer, values: torch.Tensor, weights: torch.Tensor | None = None,
             ids: torch.Tensor | None = None):
    """The whole exchange ``tr`` of ``values [S, d]`` (a dispatch with ``weights [S, K]`` and ``ids [S, K]`` int32
    gives ``(values, weights, ids)`` received; a combine the values alone)."""
    return _Whole.apply(values, weights, ids, tr)


def start(tr: Transfer, values: torch.Tensor, weights: torch.Tensor | None = None,
          ids: torch.Tensor | None = None) -> torch.Tensor:
    """Issue the exchange ``tr`` (as :func:`transfer`); returns the token that :func:`finish` takes."""
    return _Start.apply(values, weights, ids, tr)


def finish(tr: Transfer, token: torch.Tensor):
    """Wait for the exchange :func:`start` issued; its received rows, as :func:`transfer` returns them."""
    return _Finish.apply(token, tr)

