"""Expert-bias gradients as deterministic segment sums over each expert's slot range (no atomics).

``db_gate_up[e] = sum_{s in slots(e)} dpre[s]``  (slot rows, ``GATHER`` off, ``SCALE`` off)
``db_down[e]    = sum_{s in slots(e)} w_s * dout[token(s)]``  (rows of ``dout`` through the index, scaled)

``slots(e) = offsets[e]:offsets[e+1]`` (the local experts' offsets: foreign slots are never read).
One program per (expert, column block) walks the expert's slots in a fixed order with an fp32
accumulator, so results are bitwise reproducible (DESIGN.md §5 rules). The pass is memory-bound:
it reads each slot row once (``N * cols`` elements), against ``2 * N * cols * h`` FLOPs of the weight
gradient of the same projection.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .tuning import Launchable, cdiv


@triton.jit
def segment_sum_kernel(
    src_ptr,  # [N, D] slot rows (dpre) or [T, D] token rows (dout, GATHER); fp16/bf16/fp32
    scale_ptr,  # [N] fp32 router weight of each slot (SCALE)
    offsets_ptr,  # [E+1] int32 expert_token_offsets of the local experts
    indices_ptr,  # [N] int32 expert_token_indices (slot -> token)
    out_ptr,  # [E, D] result, dtype of the bias
    D, stride_src_m, stride_out_e,
    GATHER: tl.constexpr, SCALE: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    e = tl.program_id(0)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    start = tl.load(offsets_ptr + e)
    end = tl.load(offsets_ptr + e + 1)
    acc = tl.zeros((BLOCK_S, BLOCK_D), dtype=tl.float32)
    for s0 in range(start, end, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        s_ok = s < end
        rows = s.to(tl.int64)
        if GATHER:
            rows = tl.load(indices_ptr + s, mask=s_ok, other=0).to(tl.int64)
        v = tl.load(src_ptr + rows[:, None] * stride_src_m + offs_d[None, :], mask=s_ok[:, None] & d_mask[None, :],
                    other=0.0).to(tl.float32)
        if SCALE:
            v = v * tl.load(scale_ptr + s, mask=s_ok, other=0.0)[:, None]
        acc += v
    tl.store(out_ptr + e.to(tl.int64) * stride_out_e + offs_d, tl.sum(acc, axis=0).to(out_ptr.dtype.element_ty),
             mask=d_mask)


def _configs(kind: str) -> list[triton.Config]:
    if kind == "interpret":
        return [triton.Config({"BLOCK_S": 16, "BLOCK_D": 32}, num_warps=1, num_stages=1)]
    return [triton.Config({"BLOCK_S": 32, "BLOCK_D": 128}, num_warps=4, num_stages=1)]  # one fixed config: a small bandwidth-bound pass


_SEGMENT_SUM = Launchable(segment_sum_kernel, _configs, key=["D", "GATHER", "SCALE"])


def segment_sum(src: torch.Tensor, offsets: torch.Tensor, indices: torch.Tensor, scale: torch.Tensor | None,
                *, gather: bool, out_dtype: torch.dtype) -> torch.Tensor:
    """``out[e] = sum_{s in slots(e)} (scale[s] *) src[token(s) if gather else s]`` -> ``[E, D]`` in ``out_dtype``.

    Args:
        src: ``[N, D]`` slot rows or ``[T, D]`` token rows (``gather``), unit column stride.
        offsets: ``[E+1]`` int32 (local experts). indices: ``[N]`` int32 slot -> token.
        scale: ``[N]`` fp32 slot weights, or None.
    """
    E, D = offsets.numel() - 1, src.shape[1]
    out = torch.empty(E, D, dtype=out_dtype, device=src.device)
    if E == 0 or D == 0:
        return out
    s = scale if scale is not None else offsets  # dummy pointer when SCALE is off
    _SEGMENT_SUM.launch(src.dtype, lambda meta: (E, cdiv(D, meta["BLOCK_D"])),
        src_ptr=src, scale_ptr=s, offsets_ptr=offsets, indices_ptr=indices, out_ptr=out, D=D,
        stride_src_m=src.stride(0), stride_out_e=out.stride(0),
        GATHER=gather, SCALE=scale is not None,
    )
    return out
