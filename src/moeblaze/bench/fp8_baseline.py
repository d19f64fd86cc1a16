"""``conventional-fp8``: the conventional layer (:func:`moeblaze.bench.baselines.conventional_experts`) with its
expert GEMMs in FP8, as torchao's MoE training runs them on Hopper (``prototype.moe_training``, FP8 rowwise,
torchao 0.14-0.18) and torchtitan's dispatcher feeds them. The peer of issue 59's FP8 layer.

Each grouped linear ``y = a W[e]^T`` (``a [M, K]`` rows grouped by expert, ``W [E, N, K]``) is three
``torch._scaled_grouped_mm`` calls on e4m3 operands with fp32 scales, bf16 out, fast accumulation:

- forward (2d-3d): ``a`` with one scale per row (token), ``W`` one per (expert, output column), over ``K``;
- input gradient ``da = g W[e]`` (2d-3d): ``g`` per row, ``W`` one per (expert, input column), over ``N``;
- weight gradient ``dW[e] = g_e^T a_e`` (2d-2d, the tokens are the reduction): ``g`` and ``a`` each with one scale
  per (expert group, column), over the group's rows, flattened group-major.

Scales are ``448 / amax`` rounded down to a power of two, values saturated to +-448, the GEMMs given the
reciprocals. Quantization runs as PyTorch ops (torchao up to 0.16; later versions fuse it into Triton kernels).
The 2d-2d GEMM needs every group non-empty and a multiple of 16 rows, so each expert's rows are padded to a
multiple of 16 (an empty expert to 16) in a buffer of static size ``T K + 16 E`` (no host read), pad rows reading
an appended zero row, as torchtitan's dispatcher pads them. The router, the activation, the routing weights and
the combine run as in the conventional layer, in bf16. The rowwise FP8 grouped GEMM runs on Hopper (sm90) and
Blackwell (sm100) only.
"""

from __future__ import annotations

import torch

from ..reference import act_reference

__all__ = ["conventional_fp8_experts", "fp8_grouped_linear"]

E4M3_MAX = 448.0
ALIGN = 16  # rows per expert group: a multiple of 16 bytes of e4m3 along the 2d-2d GEMM's reduction


def _quant_scales(amax: torch.Tensor) -> torch.Tensor:
    """Quantization multipliers ``448 / amax`` rounded down to a power of two (fp32; amax 0 -> a finite one)."""
    s = E4M3_MAX / amax.double().clamp(min=1e-12)
    return torch.exp2(torch.floor(torch.log2(s))).float()


def _cast(a: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    # s is a power of two, so a * s is exact in a's own dtype (bf16 keeps fp32's exponent range): one rounding, in
    # the cast, and no fp32 copy of a
    return (a * s.to(a.dtype)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def quantize_rows(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``a [..., R, C]`` -> (e4m3 ``[..., R, C]`` contiguous, dequantization scales ``[..., R]`` fp32), one scale
    per row over ``C``."""
    s = _quant_scales(a.abs().amax(dim=-1, keepdim=True).float())
    return _cast(a, s).contiguous(), (1.0 / s).squeeze(-1)


def quantize_group_columns(a: torch.Tensor, group: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``a [M, C]``, ``group [M]`` (a row's expert group; ``groups`` for rows in none; groups in whole blocks of
    16 rows) -> (e4m3 ``[M, C]`` column-major, dequantization scales ``[groups * C]`` group-major), one scale per
    (group, column)."""
    M, C = a.shape
    blocks = a.view(M // ALIGN, ALIGN, C)
    block_group = group[::ALIGN]
    # the amax of each 16-row block first: a scatter of every row contends 16x more on the same (group, column)
    amax = torch.zeros(groups + 1, C, device=a.device).scatter_reduce_(
        0, block_group[:, None].expand(-1, C), blocks.abs().amax(1).float(), "amax")
    s = _quant_scales(amax)
    q = _cast(blocks, s[block_group][:, None]).view(M, C)
    return q.t().contiguous().t(), (1.0 / s[:groups]).reshape(-1)


def _gmm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
         ends: torch.Tensor) -> torch.Tensor:
    return torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs=ends, out_dtype=torch.bfloat16,
                                    use_fast_accum=True)


class _FP8GroupedLinear(torch.autograd.Function):
    """``a [M, K]`` bf16, ``w [E, N, K]`` bf16, ``ends [E]`` int32 cumulative group ends -> ``[M, N]`` bf16
    (rows past ``ends[-1]`` unset). Saves ``a`` and ``w`` in bf16 and quantizes again in backward, as torchao."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        qa, sa = quantize_rows(a)
        qw, sw = quantize_rows(w)  # [E, N, K], scales [E, N]
        ctx.save_for_backward(a, w, ends)
        return _gmm(qa, qw.transpose(-2, -1), sa, sw, ends)  # W^T: [E, K, N] column-major

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        a, w, ends = ctx.saved_tensors
        g = g.contiguous()
        qg, sg = quantize_rows(g)
        qwt, swt = quantize_rows(w.transpose(-2, -1))  # [E, K, N]: one scale per (expert, input column)
        da = _gmm(qg, qwt.transpose(-2, -1), sg, swt, ends)  # W: [E, N, K] column-major
        E, rows = w.shape[0], torch.arange(a.shape[0], device=a.device, dtype=ends.dtype)
        group = torch.searchsorted(ends, rows, right=True).long()  # E for the rows past the last group
        qg_cols, sg_cols = quantize_group_columns(g, group, E)
        qa_cols, sa_cols = quantize_group_columns(a, group, E)
        dw = _gmm(qg_cols.t(), qa_cols, sg_cols, sa_cols, ends)  # [E, N, K]
        return da.to(a.dtype), dw.to(w.dtype), None


def fp8_grouped_linear(a: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Per expert ``e``: ``a[ends[e-1]:ends[e]] @ w[e]^T`` with FP8 operands in forward and backward (module
    docstring). ``a [M, K]`` bf16, ``w [E, N, K]`` bf16, ``ends [E]`` int32, every group a non-zero multiple of 16
    rows, ``K`` and ``N`` multiples of 16 -> ``[M, N]`` bf16, rows past ``ends[-1]`` unset."""
    return _FP8GroupedLinear.apply(a, w, ends)


def conventional_fp8_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                             w_gate_up: torch.Tensor, w_down: torch.Tensor, activation: str = "swiglu") -> torch.Tensor:
    """The routed experts as :func:`moeblaze.bench.baselines.conventional_experts` computes them, the two expert
    GEMMs in FP8 (:func:`fp8_grouped_linear`) over expert groups padded to multiples of 16 rows.

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
