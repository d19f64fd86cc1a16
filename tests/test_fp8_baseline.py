"""The FP8 conventional layer of ``moeblaze bench`` (``conventional-fp8``, :mod:`moeblaze.bench.fp8_baseline`):
its layouts, scales and padding against the float64 layer, with ``torch._scaled_grouped_mm`` emulated on the CPU
(the op's semantics: e4m3 operands times their fp32 scales, fp32 products per expert group, bf16 out; rows past
the last group unset); on a Hopper GPU (``-m gpu``) the op itself."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from moeblaze.bench.baselines import IMPLS, ImplOptions, conventional_experts
from moeblaze.bench.configs import CONFIGS
from moeblaze.bench.fp8_baseline import ALIGN, conventional_fp8_experts, quantize_group_columns, quantize_rows


def _emulated_scaled_grouped_mm(a, b, scale_a, scale_b, offs=None, out_dtype=None, use_fast_accum=False):
    assert a.dtype == b.dtype == torch.float8_e4m3fn and scale_a.dtype == scale_b.dtype == torch.float32
    assert a.stride(-1) == 1 and b.stride(-2) == 1, "a row-major, b column-major"
    assert a.stride(-2) % 16 == 0 and b.stride(-1) % 16 == 0, "leading strides of 16 bytes"
    assert offs.dtype == torch.int32 and out_dtype == torch.bfloat16
    ends = offs.tolist()
    bounds = list(zip([0, *ends[:-1]], ends))
    if b.dim() == 3:  # 2d-3d: scales per row of a, per (group, column) of b
        assert scale_a.shape == (a.shape[0],) and scale_b.shape == (b.shape[0], b.shape[2])
        out = torch.full((a.shape[0], b.shape[2]), float("nan"))
        for g, (lo, hi) in enumerate(bounds):
            out[lo:hi] = (a[lo:hi].float() * scale_a[lo:hi, None]) @ (b[g].float() * scale_b[g])
        return out.to(out_dtype)
    R, C, E = a.shape[0], b.shape[1], len(ends)  # 2d-2d: the groups split the reduction
    assert scale_a.shape == (E * R,) and scale_b.shape == (E * C,)
    assert all(hi > lo and (hi - lo) % ALIGN == 0 for lo, hi in bounds), bounds
    return torch.stack([(a[:, lo:hi].float() * scale_a[g * R:(g + 1) * R, None])
                        @ (b[lo:hi].float() * scale_b[g * C:(g + 1) * C]) for g, (lo, hi) in enumerate(bounds)]
                       ).to(out_dtype)


def _sqnr(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Signal to quantization noise in dB against the float64 layer."""
    return (10 * torch.log10(ref.square().sum() / (got.double() - ref).square().sum())).item()


def _case(T, d, h, E, K, skew, device):
    gen = torch.Generator().manual_seed(T + E)
    x = torch.randn(T, d, generator=gen)
    w1 = torch.randn(E, 2 * h, d, generator=gen) * d**-0.5
    w2 = torch.randn(E, d, h, generator=gen) * h**-0.5
    experts = E // 2 if skew else E  # skew: half the experts get no token
    ids = torch.stack([torch.randperm(experts, generator=gen)[:K] for _ in range(T)])
    weights = torch.rand(T, K, generator=gen)
    return [t.to(device) for t in (x, ids, weights, w1, w2)]


def _run(fn, x, ids, weights, w1, w2, dtype, gout):
    leaves = [t.to(dtype).requires_grad_() for t in (x, w1, w2)]
    out = fn(leaves[0], ids, weights.to(dtype if dtype == torch.float64 else torch.float32), *leaves[1:])
    (out.double() * gout).sum().backward()
    return [out] + [t.grad for t in leaves]


def _check(T, d, h, E, K, skew, device):
    x, ids, weights, w1, w2 = _case(T, d, h, E, K, skew, device)
    gout = torch.randn(T, d, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(device)
    got = _run(conventional_fp8_experts, x, ids, weights, w1, w2, torch.bfloat16, gout)
    ref = _run(conventional_experts, x, ids, weights, w1, w2, torch.float64, gout)
    # e4m3 keeps 3 mantissa bits: measured 22.9-24.2 dB (out), 21.1-23.6 (dx), 19.1-23.5 (dw) at these cases and
    # T 512, d 256 (bf16 alone: 43-49 dB); a wrong scale layout gives -1 to 8 dB
    floors = {"out": 20.0, "dx": 19.0, "dw1": 17.0, "dw2": 17.0}
    for (name, floor), g, r in zip(floors.items(), got, ref):
        assert g.dtype == torch.bfloat16 and torch.isfinite(g).all(), name
        assert _sqnr(g, r) >= floor, (name, _sqnr(g, r))


@pytest.mark.parametrize("T, d, h, E, K, skew", [(40, 32, 16, 4, 2, False), (64, 48, 32, 8, 2, True),
                                                 (1, 16, 16, 4, 1, False)])
def test_fp8_layer_against_float64_with_the_op_emulated(monkeypatch, T, d, h, E, K, skew):
    """Emulated op: random routing, empty experts (padded to one block of 16), T = 1."""
    monkeypatch.setattr(torch, "_scaled_grouped_mm", _emulated_scaled_grouped_mm)
    _check(T, d, h, E, K, skew, "cpu")


def test_rowwise_scales_are_powers_of_two_with_the_row_max_in_the_top_binade():
    a = torch.tensor([[1.0, -3.0, 0.5], [0.0, 0.0, 0.0], [1e-3, 2e-3, -4e-3]])
    q, s = quantize_rows(a)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.shape == (3,)
    assert torch.equal(torch.log2(s), torch.log2(s).round())  # powers of two
    assert (q.float().abs().amax(dim=1)[[0, 2]] > 224).all() and not q[1].float().any()  # amax lands in (224, 448]
    torch.testing.assert_close(q.float() * s[:, None], a, rtol=2**-3, atol=0)


def test_group_column_scales_equal_one_quantization_per_group():
    """The 16-row block amax path equals quantizing each group's rows on their own (rows in no group last)."""
    gen = torch.Generator().manual_seed(3)
    sizes = [32, 16, 48, 16]  # the last: rows past every group
    a = torch.randn(sum(sizes), 24, generator=gen, dtype=torch.bfloat16) * torch.rand(24, generator=gen) * 100
    a[32:48] = 0  # a group of zeros: a finite scale, zero values
    group = torch.repeat_interleave(torch.arange(4), torch.tensor(sizes))
    q, s = quantize_group_columns(a, group, groups=3)
    assert q.stride() == (1, a.shape[0]) and s.shape == (3 * 24,)
    lo = 0
    for g, n in enumerate(sizes[:3]):
        qg, sg = quantize_rows(a[lo:lo + n].t())  # a row of a^T is a column of the group
        assert torch.equal(q[lo:lo + n].float(), qg.t().float()) and torch.equal(s[g * 24:(g + 1) * 24], sg)
        lo += n


def test_runs_on_hopper_and_blackwell_only_and_keeps_the_input_dtype(monkeypatch):
    impl = IMPLS["conventional-fp8"]
    why = impl.unavailable()
    if not torch.cuda.is_available():
        assert why == "needs CUDA"
    else:
        assert (why is None) == (torch.cuda.get_device_capability()[0] in (9, 10)), why
    assert "multiples of 16" in impl.unsupported(replace(CONFIGS["conf7-swiglu"], d=2040), ImplOptions())
    monkeypatch.setattr(torch, "_scaled_grouped_mm", _emulated_scaled_grouped_mm)
    x, ids, weights, w1, w2 = (t.requires_grad_() if t.is_floating_point() else t
                               for t in _case(24, 32, 16, 4, 2, False, "cpu"))
    out = conventional_fp8_experts(x, ids, weights, w1, w2)  # fp32 in: fp32 out and gradients
    out.sum().backward()
    assert out.dtype == x.grad.dtype == w1.grad.dtype == torch.float32


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] not in (9, 10),
                    reason="needs a Hopper or Blackwell GPU (sm90, sm100)")
@pytest.mark.parametrize("T, d, h, E, K, skew", [(512, 256, 128, 8, 2, False), (300, 128, 64, 16, 4, True)])
def test_gpu_fp8_layer_against_float64(T, d, h, E, K, skew):
    """``torch._scaled_grouped_mm`` itself (cuBLAS / CUTLASS on sm90), as ``moeblaze bench`` runs it."""
    _check(T, d, h, E, K, skew, "cuda")
