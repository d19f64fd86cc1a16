"""``conventional-fp8``: the conventional layer (:func:`moeblaze.bench.baselines.conventional_experts`) with its
expert GEMMs in FP8 through torchao's MoE training op (``torchao.prototype.moe_training.
_to_fp8_rowwise_then_scaled_grouped_mm``, torchao >= 0.18), as torchtitan runs FP8 rowwise MoE training on Hopper.
The peer of issue 59's FP8 layer.

torchao quantizes each grouped linear's operands with fused Triton kernels (power-of-two rowwise scales: per token
and per (expert, column) in forward and input gradient, per (expert group, column) in the weight gradient) and
multiplies with ``torch._scaled_grouped_mm`` (e4m3, bf16 out). The op needs every expert group non-empty and a
multiple of 16 rows (its 2d-2d weight-gradient GEMM) and does not pad them itself in 0.18, so each expert's rows
are padded here to a multiple of 16 (an empty expert to 16) in a buffer of static size ``T K + 16 E`` rounded up
to 16 (no host read), pad rows reading an appended zero row, as torchtitan's dispatcher pads them. The router,
the activation, the routing weights and the combine run as in the conventional layer, in bf16. The rowwise FP8
grouped GEMM runs on Hopper (sm90) and Blackwell (sm100) only.
"""

from __future__ import annotations

import torch

from ..reference import act_reference

__all__ = ["conventional_fp8_experts", "fp8_grouped_linear"]

ALIGN = 16  # rows per expert group: a multiple of 16 bytes of e4m3 along the 2d-2d GEMM's reduction


def fp8_grouped_linear(a: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Per expert ``e``: ``a[ends[e-1]:ends[e]] @ w[e]^T`` with FP8 operands in forward and backward (torchao).

    Args:
        a: ``[M, K]`` bf16 or fp32, row-major.
        w: ``[E, N, K]`` bf16 or fp32, contiguous.
        ends: ``[E]`` int32 cumulative group ends, every group a non-zero multiple of 16 rows; ``K`` and ``N``
            multiples of 16.

    Returns:
        ``[M, N]`` bf16, rows past ``ends[-1]`` unset.
    """
    from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm

    # w^T per expert as a view: [E, K, N] column-major, the layout the op's right operand needs
    return _to_fp8_rowwise_then_scaled_grouped_mm(a, w.transpose(-2, -1), ends, pad_token_groups_for_grouped_mm=False)


def conventional_fp8_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                             w_gate_up: torch.Tensor, w_down: torch.Tensor, activation: str = "swiglu") -> torch.Tensor:
    """The routed experts as :func:`moeblaze.bench.baselines.conventional_experts` computes them, the two expert
    GEMMs in FP8 (:func:`fp8_grouped_linear`, torchao) over expert groups padded to multiples of 16 rows.

    Args: as :func:`moeblaze.moe_experts` (``x [T, d]``, ``topk_ids [T, K]``, ``topk_weights [T, K]``,
        ``w_gate_up [E, 2h|h, d]``, ``w_down [E, d, h]``; ``d`` and ``h`` multiples of 16).

    Returns:
        ``[T, d]`` in ``x.dtype`` (the GEMMs' outputs and the activation in bf16).
    """
    T, K = topk_ids.shape
    E, d = w_down.shape[0], x.shape[1]
    flat = topk_ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)  # slot -> pair, grouped by expert
    counts = torch.bincount(flat, minlength=E)
    padded = (counts.clamp(min=1) + ALIGN - 1) // ALIGN * ALIGN
    ends = torch.cumsum(padded, 0)
    expert = flat[order]
    first = torch.cumsum(counts, 0) - counts  # the expert's first slot
    row = (ends - padded)[expert] + torch.arange(flat.numel(), device=x.device) - first[expert]  # slot -> its row
    # static size, a multiple of 16 rows: the weight gradient's operands are column-major, their leading stride
    # this many e4m3 bytes, which the GEMM wants 16-byte aligned
    rows = -(-flat.numel() // ALIGN) * ALIGN + ALIGN * E
    token = torch.full((rows,), T, device=x.device, dtype=torch.long)
    token[row] = order // K
    xg = torch.cat((x, x.new_zeros(1, d)))[token]  # pad rows read the zero row
    ends = ends.to(torch.int32)
    act = act_reference(activation, fp8_grouped_linear(xg, w_gate_up, ends))
    y = fp8_grouped_linear(act, w_down, ends)[row]
    y = y * topk_weights.reshape(-1)[order].to(y.dtype)[:, None]
    return torch.zeros_like(x).index_add(0, order // K, y.to(x.dtype))
