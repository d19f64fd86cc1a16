"""The FP8 conventional layer of ``moeblaze bench`` (``conventional-fp8``, :mod:`moeblaze.bench.fp8_baseline`):
its dispatch, padding and combine around torchao's FP8 grouped linear. On the CPU the grouped linear is replaced by
an exact float64 one that checks what torchao's op requires (non-empty groups of a multiple of 16 rows, layouts),
so the layer must equal the float64 conventional layer; on a Hopper GPU with torchao (``-m gpu``) the op itself
against the float64 layer."""

from __future__ import annotations

import importlib.util
from dataclasses import replace

import pytest
import torch

from moeblaze.bench import fp8_baseline
from moeblaze.bench.baselines import IMPLS, ImplOptions, conventional_experts
from moeblaze.bench.configs import CONFIGS
from moeblaze.bench.fp8_baseline import ALIGN, conventional_fp8_experts

HAS_TORCHAO = importlib.util.find_spec("torchao") is not None


def _exact_grouped_linear(a, w, ends):
    """``a[group e] @ w[e]^T`` in the inputs' dtype, with torchao's op's requirements asserted; NaN past the end."""
    assert ends.dtype == torch.int32 and ends.shape == (w.shape[0],)
    assert a.stride(-1) == 1 and a.shape[1] % 16 == 0 and w.shape[1] % 16 == 0, "a row-major, K and N by 16"
    bounds = list(zip([0, *ends.tolist()[:-1]], ends.tolist()))
    assert all(hi > lo and (hi - lo) % ALIGN == 0 for lo, hi in bounds), bounds
    assert a.shape[0] % ALIGN == 0 and a.shape[0] >= bounds[-1][1], "a static buffer of whole 16-row blocks"
    out = torch.full((a.shape[0], w.shape[1]), float("nan"), dtype=a.dtype)
    return out.index_put((torch.arange(bounds[-1][1]),),
                         torch.cat([a[lo:hi] @ w[e].t() for e, (lo, hi) in enumerate(bounds)]))


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


def _gout(T, d, device):
    return torch.randn(T, d, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(device)


@pytest.mark.parametrize("T, d, h, E, K, skew", [(40, 32, 16, 4, 2, False), (64, 48, 32, 8, 2, True),
                                                 (1, 16, 16, 4, 1, False), (37, 16, 48, 16, 4, True)])
def test_padding_dispatch_and_combine_equal_the_float64_layer(monkeypatch, T, d, h, E, K, skew):
    """Exact grouped linear: random routing, empty experts (padded to one block of 16), T = 1, more padding rows
    than tokens (E 16, T 37)."""
    monkeypatch.setattr(fp8_baseline, "fp8_grouped_linear", _exact_grouped_linear)
    x, ids, weights, w1, w2 = _case(T, d, h, E, K, skew, "cpu")
    gout = _gout(T, d, "cpu")
    got = _run(conventional_fp8_experts, x, ids, weights, w1, w2, torch.float64, gout)
    ref = _run(conventional_experts, x, ids, weights, w1, w2, torch.float64, gout)
    for name, g, r in zip(("out", "dx", "dw1", "dw2"), got, ref):
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12, msg=name)


def test_needs_torchao_on_hopper_or_blackwell_and_d_h_multiples_of_16():
    impl = IMPLS["conventional-fp8"]
    why = impl.unavailable()
    if not torch.cuda.is_available():
        assert why == "needs CUDA"
    elif torch.cuda.get_device_capability()[0] not in (9, 10):
        assert "sm90 / sm100" in why
    else:
        assert (why is None) == HAS_TORCHAO and (HAS_TORCHAO or "pip install torchao" in why), why
    assert "multiples of 16" in impl.unsupported(replace(CONFIGS["conf7-swiglu"], d=2040), ImplOptions())


def _sqnr(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Signal to quantization noise in dB against the float64 layer."""
    return (10 * torch.log10(ref.square().sum() / (got.double() - ref).square().sum())).item()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] not in (9, 10)
                    or not HAS_TORCHAO, reason="needs a Hopper or Blackwell GPU (sm90, sm100) and torchao")
@pytest.mark.parametrize("T, d, h, E, K, skew", [(512, 256, 128, 8, 2, False), (300, 128, 64, 16, 4, True)])
def test_gpu_fp8_layer_against_float64(T, d, h, E, K, skew):
    """torchao's op (``torch._scaled_grouped_mm`` on sm90), as ``moeblaze bench`` runs it, against float64."""
    x, ids, weights, w1, w2 = _case(T, d, h, E, K, skew, "cuda")
    gout = _gout(T, d, "cuda")
    got = _run(conventional_fp8_experts, x, ids, weights, w1, w2, torch.bfloat16, gout)
    ref = _run(conventional_experts, x, ids, weights, w1, w2, torch.float64, gout)
    # e4m3 keeps 3 mantissa bits: the same recipe in PyTorch measured 22.9-24.2 dB (out), 21.1-23.6 (dx),
    # 19.1-23.5 (dw) at these cases (bf16 alone: 43-49 dB); a wrong scale layout gives -1 to 8 dB
    floors = {"out": 20.0, "dx": 19.0, "dw1": 17.0, "dw2": 17.0}
    for (name, floor), g, r in zip(floors.items(), got, ref):
        assert g.dtype == torch.bfloat16 and torch.isfinite(g).all(), name
        assert _sqnr(g, r) >= floor, (name, _sqnr(g, r))
