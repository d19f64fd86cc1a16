"""FP8 recipes (``moeblaze.fp8``): quantization round trips, the PyTorch emulation of the expert GEMMs against the
float64 reference (DESIGN.md §7, §8), what autograd keeps (the API: test_fp8_api.py)."""

from __future__ import annotations

import pytest
import torch

from moeblaze import build_dispatch, moe_experts
from moeblaze.experts import SAVE_MODES
from moeblaze.fp8 import (
    E4M3,
    E4M3_MAX,
    GRANULARITIES,
    KEPT_TILE,
    Float8Recipe,
    quantize_fp8,
    quantize_fp8_slots,
)
from moeblaze.memory import saved_bytes
from moeblaze.reference import act_reference
from moeblaze.testing import (
    make_expert_inputs,
    reference_outputs,
    rel_error,
    router_weight_grad_magnitude,
    run_and_grad,
    triton_on_cpu,
)

# the Triton FP8 ops on CPU tensors: through the interpreter (conftest sets TRITON_INTERPRET=1); on a GPU machine
# test_fp8_kernels runs them
TRITON_ON_CPU = triton_on_cpu()
U = 2.0**-4  # unit roundoff of e4m3 (3 mantissa bits): the largest relative error of one rounding
SUBNORMAL_HALF_STEP = 2.0**-10  # half the spacing of e4m3's subnormals (2^-9), in units of the scale


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny matmuls and per-expert loops: threads only contend (several times slower on a loaded 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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
    assert (recipe.granularity, recipe.block_size, recipe.pow2_scales) == ("rowwise", 128, False)
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


# ----------------------------------------------------------------------------- the emulated expert GEMMs

NAMES = ("out", "dx", "dw_gate_up", "dw_down", "dtopk_weights")


def e4m3_round(t: torch.Tensor) -> torch.Tensor:
    """``t`` rounded to e4m3's precision, 4 significant bits (round half to even), in ``t``'s dtype — with no
    scales and no range limits: the precision of the recipe without its blocks."""
    mantissa, exponent = torch.frexp(t)  # mantissa in [0.5, 1)
    return torch.ldexp(torch.round(mantissa * 16) / 16, exponent)


def rounded_baseline(inputs: dict, dout: torch.Tensor, save: str, granularity: str) -> tuple[torch.Tensor, ...]:
    """DESIGN.md §7's baseline for the recipe: plain PyTorch doing the same computation in the same precision.
    ``(out, dx, dw_gate_up, dw_down, dtopk_weights)`` one expert at a time in float64, written out by hand
    (no moeblaze.fp8), every GEMM operand rounded to 4 significant bits where the recipe quantizes it
    (moeblaze.ops_fp8's table: B2 and B4 only blockwise), ``pre`` rounded as kept for ``"preact"``."""
    R = e4m3_round
    Rw = R if granularity == "blockwise" else (lambda t: t)  # the weight gradients' operands
    x, w1, w2, tw = (inputs[k].detach().double() for k in ("x", "w_gate_up", "w_down", "topk_weights"))
    ids, g = inputs["topk_ids"].long(), dout.double()
    out, dx, dw1, dw2, dtw = (torch.zeros_like(t) for t in (x, x, w1, w2, tw))
    xr = R(x)
    for e in range(w1.shape[0]):
        tok, k = torch.nonzero(ids == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        w = tw[tok, k][:, None]
        pre = xr[tok] @ R(w1[e]).T  # F1
        out.index_add_(0, tok, w * (R(act_reference("swiglu", pre)) @ R(w2[e]).T))  # F2, F3
        kept = (R(pre) if save == "preact" else pre).requires_grad_()
        act = act_reference("swiglu", kept)
        dact = R(g[tok]) @ R(w2[e])  # B1
        dtw[tok, k] = (dact * act).sum(-1).detach()
        (dpre,) = torch.autograd.grad(act, kept, dact * w)
        dw2[e] = Rw(g[tok]).T @ Rw(w * act.detach())  # B2
        dx.index_add_(0, tok, R(dpre) @ R(w1[e]))  # B3, B5
        dw1[e] = Rw(dpre).T @ Rw(x[tok])  # B4
    return out, dx, dw1, dw2, dtw


def check_emulation(inputs: dict, recipe: Float8Recipe, save: str, backend: str = "torch") -> tuple:
    """Every output and gradient of ``moe_experts(fp8=recipe)`` against the float64 reference: error at most
    2x the rounded baseline's plus a floor of 2 eps of the result's dtype — for ``dtopk_weights`` at least
    e4m3's unit roundoff times the condition of its dot products (T = 1 has K of them: too few for the errors to
    average out), and at T = 1 for the weight gradients at least e4m3's unit roundoff: each element is then one
    product of two rounded values, no sum, so the two errors compared are two draws of a few roundings each (their
    ratio passed 2 in 10 of 6,000 draws; ``dw_down`` 0.126 against 0.041, seed 1730). Returns ``(dout, results)``."""
    dout = torch.randn(inputs["x"].shape).to(inputs["x"].device)
    got = run_and_grad(lambda **kw: moe_experts(**kw, backend=backend, save=save, fp8=recipe), inputs, dout)
    ref = reference_outputs(inputs, "swiglu", dout)
    base = rounded_baseline(inputs, dout, save, recipe.granularity)
    for name, a, r, b in zip(NAMES, got, ref, base):
        assert a.dtype == inputs["topk_weights" if name == "dtopk_weights" else "x"].dtype, name
        floor = 2 * torch.finfo(a.dtype).eps
        if name == "dtopk_weights":
            magnitude = router_weight_grad_magnitude(inputs, "swiglu", dout).norm() / r.norm()
            floor = max(floor, U * float(magnitude))
        if name in ("dw_gate_up", "dw_down") and inputs["x"].shape[0] == 1:
            floor = max(floor, U)
        err, base_err = rel_error(a, r), rel_error(b, r)
        assert err <= 2 * base_err + floor, f"{name}: error {err:.3e} > 2 x e4m3 baseline {base_err:.3e} + {floor:.1e}"
    return dout, got


CASES = {  # (T, d, h, E, K, routing); with block_size 32, d = 72 and h = 40 end in short tiles
    "T=1": (1, 256, 64, 4, 2, "uniform"),
    "empty experts": (48, 64, 32, 8, 2, "empty_experts"),
    "zipf": (128, 64, 32, 16, 4, "zipf"),
    "short last tiles": (40, 72, 40, 4, 2, "uniform"),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("save", SAVE_MODES)
def test_emulated_experts_within_the_e4m3_rule(case, granularity, save):
    T, d, h, E, K, routing = CASES[case]
    check_emulation(make_expert_inputs(T, d, h, E, K, routing=routing), Float8Recipe(granularity, 32), save)


@pytest.mark.skipif(not TRITON_ON_CPU,
                    reason="the Triton kernels on CPU tensors need TRITON_INTERPRET=1 (the GPU: test_fp8_kernels)")
@pytest.mark.parametrize("case, save", [(case, SAVE_MODES[i % 2]) for i, case in enumerate(CASES)])  # each mode twice
def test_triton_rowwise_within_the_e4m3_rule_and_as_the_emulation(case, save):
    """The Triton backend's rowwise FP8 path (the interpreter, fp32): the §7 rule against float64, and every result
    as the emulation computes it: the same e4m3 operands, fp32 sums in another order. That order may move an
    intermediate value (act, dpre, w act) across an e4m3 rounding tie, one step (12.5%) in that element and in what
    reads it; so the check counts the elements more than 1e-4 of the largest off: at most 5% of the weight gradients'
    and ``dtopk_weights``' elements, and of ``out``'s and ``dx``'s token rows at most 5% or one (a moved ``dpre``
    element moves its token's whole ``dx`` row, all of ``dx`` at T = 1: 92% of it off at seed 3145, 3.2e-3 apart);
    and no result further from the emulation than one e4m3 unit roundoff."""
    T, d, h, E, K, routing = CASES[case]
    inputs = make_expert_inputs(T, d, h, E, K, routing=routing)
    recipe = Float8Recipe("rowwise")
    dout, got = check_emulation(inputs, recipe, save, backend="triton")
    emulated = run_and_grad(lambda **kw: moe_experts(**kw, backend="torch", save=save, fp8=recipe), inputs, dout)
    for name, a, b in zip(NAMES, got, emulated):
        off = (a - b).abs() > 1e-4 * b.abs().max()
        if name in ("out", "dx"):  # token rows
            rows_off = int(off.any(dim=1).sum())
            assert rows_off <= max(1, 0.05 * T), (name, rows_off, rel_error(a, b))
        else:
            assert float(off.float().mean()) <= 0.05, (name, float(off.float().mean()), rel_error(a, b))
        assert rel_error(a, b) < U, (name, rel_error(a, b))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="needs a Hopper GPU (sm90+)")
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("save", SAVE_MODES)
def test_gpu_triton_rowwise_bf16_within_the_e4m3_rule(case, save):
    """The Triton FP8 path on the device in bf16 (e4m3 tensor cores, TMA reads where rows are aligned)."""
    T, d, h, E, K, routing = CASES[case]
    inputs = make_expert_inputs(T, d, h, E, K, routing=routing, dtype=torch.bfloat16, device="cuda")
    check_emulation(inputs, Float8Recipe("rowwise"), save, backend="triton")


@pytest.mark.parametrize("case", ["zipf", "short last tiles"])
@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("save", SAVE_MODES)
def test_power_of_two_scales_are_e4m3_rounding_at_every_operand(case, granularity, save):
    """Scaling by a power of two commutes with rounding to 4 significant bits, so with ``pow2_scales`` the emulation
    is the rounded baseline itself, up to e4m3 subnormals and fp32 sums, which may move a value across a rounding
    tie: one e4m3 step (12.5%) in that element and whatever reads it (usually 2e-4 of a tensor's norm; rarely more
    than 2e-3 in a small tensor). So the check counts the elements more than 0.1% off: every operand quantized
    where ops_fp8's table says, none missed (that moves 99% of the elements of every result). One tie moved in an
    intermediate row moves a whole token's row of ``out`` and ``dx``, 1/T of them (2.5% at T 40: seed 837483897 of
    the "short last tiles" case, rowwise, save "input"; two rows, 1.6%, at seed 304 of "zipf"), so the bound is 10%
    of the elements, four rows at T 40, far below what a missed quantization moves."""
    T, d, h, E, K, routing = CASES[case]
    inputs = make_expert_inputs(T, d, h, E, K, routing=routing)
    dout = torch.randn(T, d)
    recipe = Float8Recipe(granularity, 32, pow2_scales=True)
    got = run_and_grad(lambda **kw: moe_experts(**kw, backend="torch", save=save, fp8=recipe), inputs, dout)
    for name, a, b in zip(NAMES, got, rounded_baseline(inputs, dout, save, granularity)):
        off = ((a - b).abs() > 1e-3 * b.abs() + 1e-6 * b.abs().max()).float().mean()
        assert off < 0.1 and rel_error(a, b) < 2e-2, f"{name}: {off:.1%} of the elements off, " \
            f"{rel_error(a, b):.2e} from the e4m3-rounded baseline"


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_default_blocks_power_of_two_scales_and_range(granularity):
    """128-wide tiles (d = 160: a full one and a short one), power-of-two scales, tokens beyond e4m3's range and
    a zero tile in every row."""
    inputs = make_expert_inputs(64, 160, 96, 4, 2)
    inputs["x"][:, :128] *= 1e3  # up to ~4000: scaled into e4m3's range
    inputs["x"][:, 128:] = 0.0
    check_emulation(inputs, Float8Recipe(granularity, pow2_scales=True), "preact")


@pytest.mark.parametrize("activation, options", [("swiglu_clamped", {"gate_up_interleaved": True}),
                                                 ("gelu", {}), ("relu2", {})])
def test_biases_and_other_activations(activation, options):
    """GPT-OSS's clamped SwiGLU over interleaved rows and non-gated activations, with expert biases: every result
    within 2 e4m3 unit roundoffs of float64 (0.07 at most seen), and db_down, a sum of the 16-bit dout, to fp32
    precision."""
    inputs = make_expert_inputs(64, 64, 32, 4, 2, activation=activation, bias=True)
    dout = torch.randn(64, 64)
    recipe = Float8Recipe("blockwise", 32)
    got = run_and_grad(lambda **kw: moe_experts(**kw, activation=activation, backend="torch", fp8=recipe, **options),
                       inputs, dout)
    ref = reference_outputs(inputs, activation, dout, **options)
    for name, a, r in zip((*NAMES, "db_gate_up", "db_down"), got, ref):
        assert rel_error(a, r) < (1e-5 if name == "db_down" else 2 * U), name


@pytest.mark.parametrize("backend, granularity", [("torch", g) for g in GRANULARITIES] + [("triton", "rowwise")])
def test_autocast_is_the_call_on_16_bit_casts(backend, granularity):
    """fp32 master weights under bf16 autocast (fp16 for the Triton ops in the interpreter): a 16-bit output, fp32
    weight gradients, bitwise the call on 16-bit casts outside autocast (the contract of moe_experts), the recipe
    quantizing the same 16-bit values (the weights quantized from the masters as their 16-bit values: the ops'
    ``dtype``)."""
    if backend == "triton" and not TRITON_ON_CPU:
        pytest.skip("the Triton FP8 ops on CPU tensors need TRITON_INTERPRET=1")
    recipe = Float8Recipe(granularity, 32)
    inputs = make_expert_inputs(24, 64, 32, 4, 2)
    low = torch.bfloat16 if backend == "torch" else torch.float16
    dout = torch.randn(24, 64).to(low)

    def under_autocast(**kw):
        with torch.autocast("cpu", dtype=low):
            return moe_experts(**kw, backend=backend, fp8=recipe)

    got = run_and_grad(under_autocast, inputs, dout)
    cast = {k: (v.to(low) if k in ("x", "w_gate_up", "w_down") else v) for k, v in inputs.items()}
    want = run_and_grad(lambda **kw: moe_experts(**kw, backend=backend, fp8=recipe), cast, dout)
    assert got[0].dtype == low and all(g.dtype == torch.float32 for g in got[1:])
    for name, a, b in zip(NAMES, got, want):
        assert torch.equal(a, b.to(a.dtype)), name


# ----------------------------------------------------------------------------- what autograd keeps

@pytest.mark.parametrize("save", SAVE_MODES)
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_kept_for_backward_in_e4m3(save, granularity):
    """pre kept as float8_e4m3fn with fp32 scales for "preact" (N 2h + 8 N ceil(h / 64) bytes: 1 x 64 tiles of each
    half, both granularities), x as it came (the layer's input: nothing new), nothing else of the layer's size in 16
    bits."""
    T, d, h, E, K, B = 64, 96, 40, 4, 2, 32
    N, recipe = T * K, Float8Recipe(granularity, B)
    inputs = make_expert_inputs(T, d, h, E, K, dtype=torch.bfloat16)
    leaves = [inputs[k].requires_grad_() for k in ("x", "w_gate_up", "w_down", "topk_weights")]
    index = build_dispatch(inputs["topk_ids"], E)
    kept = []

    def keep(t):
        kept.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        out = moe_experts(**inputs, backend="torch", save=save, index=index, fp8=recipe)
    e4m3 = sorted(tuple(t.shape) for t in kept if t.dtype == E4M3)
    assert e4m3 == ([(N, 2, h)] if save == "preact" else [])
    assert not [t for t in kept if t.dtype == torch.bfloat16 and t.shape[0] == N], "a 16-bit slot tensor is kept"
    assert not [t for t in kept if t.dtype == torch.bfloat16 and t is not inputs["w_gate_up"]
                and t is not inputs["w_down"] and t is not inputs["x"]], "kept in bf16 beyond x and the weights"
    out.float().sum().backward()  # the kept tensors serve the backward

    expect = N * 2 * h + 4 * N * 2 * -(-h // KEPT_TILE) if save == "preact" else 0
    got = saved_bytes(lambda: moe_experts(**inputs, backend="torch", save=save, index=index, fp8=recipe),
                      exclude=[*leaves, *index.tensors()])
    assert got == expect
