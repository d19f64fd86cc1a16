"""The send layout of expert parallelism (:mod:`moeblaze.parallel.ep`): which rows go to which rank, the gather of
a rank's tokens into them and the sum of each token's returned rows, all at fixed shapes and without a host read.

:class:`SendPlan` builds the layout from ``hit [T, P]`` (token t has a pair on rank r) by cumulative sums and
scatters of unique indices (no sort, no atomics); :class:`GatherRows` and :class:`SumRows` are each other's
adjoint: forward gathers / sums, backward sums / gathers.
"""

from __future__ import annotations

import torch

from ..settings import carried_to_backward

__all__ = ["GatherRows", "SendPlan", "SumRows", "gather_rows", "sum_rows", "take"]


class SendPlan:
    """Where this rank's tokens go: each token once per destination rank that holds one of its experts, at fixed
    shapes (no host read).

    ``hit [T, P]``: token t has a pair on rank r. Row of (t, r) in the send buffer: ``send_offsets[r]`` plus t's
    index among rank r's tokens (ascending). ``send_tokens [rows]`` / ``send_rank [rows]``: each row's token and
    destination (rows no token uses hold token T and rank 0: :func:`gather_rows` fills them with any row, :func:`take`
    with a fill value; the receivers treat them as foreign). ``row_offsets [T+1]`` and ``token_rows [T*M]``
    (M = min(K, P)): each token's rows in rank order (a CSR, for the sums over ranks). Built by cumulative sums and
    scatters of unique indices: no sort, no atomics.
    """

    def __init__(self, hit: torch.Tensor, send_offsets: torch.Tensor, rows: int, M: int) -> None:
        T, P = hit.shape
        dev = hit.device
        # Token-major [T, P] throughout (no transposed copies): ~20 launches, the training step being bound by them.
        # Row of (t, r): rank r's block start plus t's index among r's tokens (an inclusive count down the tokens).
        row = hit.cumsum(0, dtype=torch.int64).add_((send_offsets - 1).view(1, P))
        row = torch.where(hit, row, rows).view(-1)  # a dump row for the pairs (t, r) with no hit
        ids = torch.arange(T, device=dev).view(T, 1).expand(T, P).reshape(-1)
        ranks = torch.arange(P, device=dev).expand(T, P).reshape(-1)
        self.send_tokens = torch.full((rows + 1,), T, dtype=torch.int64, device=dev).scatter_(0, row, ids)[:rows]
        self.send_rank = hit.new_zeros(rows + 1, dtype=torch.int64).scatter_(0, row, ranks)[:rows]
        # the j-th set entry of token t (token-major) is its j-th destination in rank order
        seen = hit.view(-1).cumsum(0, dtype=torch.int64)  # [T*P] inclusive count of set entries
        pos = torch.where(hit.view(-1), seen - 1, T * M)
        self.token_rows = hit.new_zeros(T * M + 1, dtype=torch.int32).scatter_(0, pos, row.to(torch.int32))[:T * M]
        self.row_offsets = hit.new_zeros(T + 1, dtype=torch.int32)
        self.row_offsets[1:] = seen.view(T, P)[:, -1]  # set entries through token t
        self.M = M

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What the sums over a token's rows read: ``(send_tokens, token_rows, row_offsets)``."""
        return self.send_tokens, self.token_rows, self.row_offsets


def sum_rows(rows: torch.Tensor, token_rows: torch.Tensor, row_offsets: torch.Tensor, M: int) -> torch.Tensor:
    """``out[t] = sum over t's rows (rank order) of rows[row]``, fp32 sums (fp64 for fp64), no atomics: the fused
    CSR gather-sum on CUDA; elsewhere a gather of each token's (at most M) rows, masked, summed in order."""
    T = row_offsets.numel() - 1
    if rows.is_cuda and rows.dtype in (torch.float16, torch.bfloat16, torch.float32):
        from ..kernels.combine import gather_sum

        return gather_sum(rows.contiguous(), token_rows, None, rows.dtype, pair_offsets=row_offsets)
    acc = torch.float64 if rows.dtype == torch.float64 else torch.float32
    first = row_offsets[:-1].to(torch.int64).view(T, 1)
    slot = first + torch.arange(M, device=rows.device)  # [T, M]: positions in token_rows
    mask = slot < row_offsets[1:].to(torch.int64).view(T, 1)
    picked = token_rows.to(torch.int64).index_select(0, slot.clamp(max=max(token_rows.numel() - 1, 0)).reshape(-1))
    got = rows.index_select(0, picked).view(T, M, rows.shape[1]).to(acc)
    out = torch.zeros(T, rows.shape[1], dtype=acc, device=rows.device)
    for j in range(M):  # rank order, one add per position: the same order whatever the device
        out += torch.where(mask[:, j:j + 1], got[:, j], 0)
    return out.to(rows.dtype)


def gather_rows(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``t[rows]`` of a send layout whose unused rows name row ``t.shape[0]``: they take the last row of ``t`` (no
    copy of ``t`` with a row appended, as :func:`take`), as nothing reads them: their receivers mark them foreign
    (padded) or never receive them (nvshmem), and the sums over a token's rows skip them."""
    if t.shape[0] == 0:
        return t.new_zeros(rows.shape[0], *t.shape[1:])
    return t.index_select(0, rows.clamp(max=t.shape[0] - 1))


def take(t: torch.Tensor, rows: torch.Tensor, fill: float = 0) -> torch.Tensor:
    """``t[rows]`` where ``rows`` may name row ``t.shape[0]``: a row of ``fill`` appended (the unused send rows')."""
    return torch.cat((t, t.new_full((1, *t.shape[1:]), fill))).index_select(0, rows)


class GatherRows(torch.autograd.Function):
    """``x [T, d]`` -> ``x[send_tokens] [rows, d]`` (:func:`gather_rows`); backward sums each token's rows
    (:func:`sum_rows`)."""

    @staticmethod
    @carried_to_backward
    def forward(ctx, x, send_tokens, token_rows, row_offsets, M):
        ctx.save_for_backward(token_rows, row_offsets)
        ctx.M = M
        return gather_rows(x, send_tokens)

    @staticmethod
    @carried_to_backward
    def backward(ctx, grad_rows):
        return sum_rows(grad_rows, *ctx.saved_tensors, ctx.M), None, None, None, None


class SumRows(torch.autograd.Function):
    """``y [rows, d]`` (send layout) -> ``out [T, d]``, each token's rows summed; backward is the row gather."""

    @staticmethod
    @carried_to_backward
    def forward(ctx, y, send_tokens, token_rows, row_offsets, M):
        ctx.save_for_backward(send_tokens)
        return sum_rows(y, token_rows, row_offsets, M)

    @staticmethod
    @carried_to_backward
    def backward(ctx, dout):
        (send_tokens,) = ctx.saved_tensors
        return gather_rows(dout, send_tokens), None, None, None, None
