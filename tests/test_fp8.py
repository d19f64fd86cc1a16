"""FP8 recipes (``moeblaze.fp8``): quantization round trips, the PyTorch emulation of the expert GEMMs against the
float64 reference (DESIGN.md §7, §8), what autograd keeps, the API and its errors, ``--precision fp8-mixed``."""

from __future__ import annotations

import pytest
import torch

from moeblaze.fp8 import (
    E4M3,
    E4M3_MAX,
    GRANULARITIES,
    Float8Recipe,
    quantize_fp8,
    quantize_fp8_slots,
)

U = 2.0**-4  # unit roundoff of e4m3 (3 mantissa bits): the largest relative error of one rounding
SUBNORMAL_HALF_STEP = 2.0**-10  # half the spacing of e4m3's subnormals (2^-9), in units of the scale


def _tile_view(t: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``t [..., R, C]`` zero-padded to whole tiles as ``[..., nR, rows, nC, cols]`` (a plain second reading)."""
    *lead, R, C = t.shape
    nr, nc = -(-R // block[0]), -(-C // block[1])
    padded = t.new_zeros(*lead, nr * block[0], nc * block[1])
    padded[..., :R, :C] = t
    return padded.view(*lead, nr, block[0], nc, block[1])


def _per_element(scale: torch.Tensor, block: tuple[int, int], shape: torch.Size) -> torch.Tensor:
    """Each element's scale: ``scale [..., nR, nC]`` repeated over its tiles and cut to ``shape [..., R, C]``."""
    s = scale.repeat_interleave(block[0], -2)[..., :shape[-2], :]
    return s.repeat_interleave(block[1], -1)[..., :shape[-1]]


# ----------------------------------------------------------------------------- quantization

@pytest.mark.parametrize("shape, block", [
    ((5, 200), (1, 128)),           # 1 x 128 activation tiles, a short last tile (72 columns)
    ((3, 300, 260), (128, 128)),    # 128 x 128 weight blocks, short on both sides
    ((7, 33), (1, 33)),             # one scale per row
    ((2, 40, 24), (40, 1)),         # one scale per column
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_within_one_e4m3_rounding(shape, block, dtype):
    t = (torch.randn(shape) * torch.logspace(-3, 3, shape[-1])).to(dtype)  # magnitudes over 6 decades
    q = quantize_fp8(t, block)
    nr, nc = -(-shape[-2] // block[0]), -(-shape[-1] // block[1])
    assert q.data.dtype == E4M3 and q.data.shape == t.shape
    assert q.scale.dtype == torch.float32 and q.scale.shape == (*shape[:-2], nr, nc)
    back, exact = q.dequantize(), t.float()
    per_elem = _per_element(q.scale, block, t.shape)
    assert ((back - exact).abs() <= U * exact.abs() + SUBNORMAL_HALF_STEP * per_elem * (1 + 1e-6)).all()
    # every tile's largest magnitude lands on 448
    assert torch.equal(_tile_view(q.data.float().abs(), block).amax(dim=(-3, -1)),
                       torch.full_like(q.scale, E4M3_MAX))


def test_short_last_tile_is_zero_padding():
    """Sizes that are not multiples of the block: bitwise what zero padding to whole tiles and slicing gives."""
    t = torch.randn(6, 200)
    padded = torch.cat([t, t.new_zeros(6, 56)], dim=1)
    for block in ((1, 128), (4, 128), (128, 128)):
        q, qp = quantize_fp8(t, block), quantize_fp8(padded, block)
        assert torch.equal(q.scale, qp.scale)
        assert torch.equal(q.data.float(), qp.data[:, :200].float())


def test_zeros_in_a_block_get_scale_one():
    t = torch.randn(3, 384)
    t[1, 128:256] = 0.0  # one zero tile
    t[2, 256:] = 1e-42  # a subnormal fp32 tile: amax / 448 underflows
    q = quantize_fp8(t, (1, 128))
    assert q.scale[1, 1] == 1.0 and (q.data[1, 128:256].float() == 0).all()
    assert q.scale[2, 2] == torch.finfo(torch.float32).tiny
    back = q.dequantize()
    assert torch.isfinite(back).all() and (back[1, 128:256] == 0).all()
    assert torch.equal(back[0], quantize_fp8(t[:1], (1, 128)).dequantize()[0])  # other rows as on their own


def test_values_near_and_beyond_448():
    grid = torch.tensor([448.0, -448.0, 416.0, 384.0, 1.0, 0.5])  # e4m3 values: a tile with amax 448 has scale 1
    q = quantize_fp8(grid[None], (1, 6))
    assert q.scale.item() == 1.0 and torch.equal(q.dequantize()[0], grid)
    big = torch.tensor([[1e6, -1e4, 7.0, -1e-3], [3e38, -3e38, 1.0, 0.0]])  # beyond e4m3's range: scaled into it
    q = quantize_fp8(big, (1, 4))
    assert torch.isfinite(q.dequantize()).all() and (q.data.float().abs().amax(1) == E4M3_MAX).all()
    assert torch.allclose(q.dequantize()[:, :2], big[:, :2], rtol=U)
    edge = torch.tensor([[448 * (1 + 2**-20), 448.0, 1.0]])  # division lands a hair past 448: clamped, not NaN
    assert torch.isfinite(quantize_fp8(edge, (1, 3)).data.float()).all()


def test_non_finite_block_is_nan_only_there():
    t = torch.randn(2, 256)
    t[0, 5], t[1, 200] = float("nan"), float("inf")
    back = quantize_fp8(t, (1, 128)).dequantize()
    assert back[0, :128].isnan().all() and back[1, 128:].isnan().all()
    assert torch.isfinite(back[0, 128:]).all() and torch.isfinite(back[1, :128]).all()


@pytest.mark.parametrize("block", [(1, 128), (128, 128), (1, 50)])
def test_power_of_two_scales(block):
    t = torch.randn(4, 100, 300) * 3
    t[0, :, :128] = 0
    q = quantize_fp8(t, block, pow2_scales=True)
    mantissa, _ = torch.frexp(q.scale)
    assert (mantissa == 0.5).all()  # powers of two
    amax = _tile_view(t, block).abs().amax(dim=(-3, -1))
    nonzero = amax > 0
    bound = amax[nonzero] / E4M3_MAX
    assert (q.scale[nonzero] >= bound).all() and (q.scale[nonzero] < 2 * bound).all()
    assert (q.scale[~nonzero] == 1).all()
    top = _tile_view(q.data.float().abs(), block).amax(dim=(-3, -1))[nonzero]
    assert (top >= E4M3_MAX / 2).all() and (top <= E4M3_MAX).all()  # one bit of range given up, never more
    # scaling by a power of two is exact: e4m3's rounding is the only one
    per_elem = _per_element(q.scale, block, t.shape)
    assert torch.equal(t / per_elem * per_elem, t)
    assert torch.equal(q.dequantize(), (t / per_elem).to(E4M3).float() * per_elem)


def test_slot_runs_stay_inside_one_expert():
    """Weight-gradient operands: runs of ``block`` slots from each expert's first slot, empty experts, and the
    slots past ``offsets[E]`` (another rank's experts) in a run of their own."""
    offsets = torch.tensor([0, 5, 5, 9, 20], dtype=torch.int32)  # expert 1 empty; slots 20-22 foreign
    t = torch.randn(23, 3) * torch.arange(1, 24)[:, None]
    t[21] = float("nan")  # a foreign slot's garbage never reaches a local scale
    for block in (4, None):
        q = quantize_fp8_slots(t, offsets, block)
        runs = []
        for e in range(4):
            lo, hi = int(offsets[e]), int(offsets[e + 1])
            step = block or max(hi - lo, 1)
            runs += [list(range(s, min(s + step, hi))) for s in range(lo, hi, step)]
        runs.append([20, 21, 22])
        assert len(set(q.tile.tolist())) == len(runs)
        for run in runs:
            assert len(set(q.tile[run].tolist())) == 1  # one run, one tile
            if run[0] < 20:
                expect = t[run].abs().amax(0) / E4M3_MAX
                assert torch.equal(q.scale[q.tile[run[0]]], expect)
        back = q.dequantize()
        assert torch.isfinite(back[:20]).all()
        assert ((back[:20] - t[:20]).abs() <= U * t[:20].abs() + 1e-6).all()


@pytest.mark.parametrize("kwargs, error, match", [
    ({"granularity": "tensorwise"}, ValueError, "granularity"),
    ({"block_size": 100}, ValueError, "block_size"),
    ({"block_size": 8}, ValueError, "block_size"),
    ({"block_size": 128.0}, TypeError, "block_size"),
    ({"pow2_scales": 1}, TypeError, "pow2_scales"),
])
def test_recipe_errors_name_the_argument(kwargs, error, match):
    with pytest.raises(error, match=match):
        Float8Recipe(**kwargs)


def test_recipe_is_frozen_and_quantize_errors():
    recipe = Float8Recipe()
    assert (recipe.granularity, recipe.block_size, recipe.pow2_scales) == ("blockwise", 128, False)
    with pytest.raises(AttributeError):
        recipe.block_size = 64
    with pytest.raises(TypeError, match="floating-point"):
        quantize_fp8(torch.ones(2, 2, dtype=torch.int32), (1, 2))
    with pytest.raises(ValueError, match="2 dimensions"):
        quantize_fp8(torch.ones(4), (1, 2))
    with pytest.raises(ValueError, match="block"):
        quantize_fp8(torch.ones(2, 2), (0, 2))
    with pytest.raises(ValueError, match=r"\[N, C\]"):
        quantize_fp8_slots(torch.ones(2, 2, 2), torch.tensor([0, 2]), 16)


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_recipe_tiles(granularity):
    recipe = Float8Recipe(granularity, block_size=32)
    w = torch.randn(3, 70, 50)
    rowwise = granularity == "rowwise"
    assert recipe.quantize_rows(torch.randn(4, 70)).scale.shape == ((4, 1) if rowwise else (4, 3))
    assert recipe.quantize_weight(w, reduce_cols=True).scale.shape == ((3, 70, 1) if rowwise else (3, 3, 2))
    assert recipe.quantize_weight(w, reduce_cols=False).scale.shape == ((3, 1, 50) if rowwise else (3, 3, 2))
