"""The FP8 Triton kernels (``moeblaze.kernels.fp8_gemm``) against the PyTorch emulation of the same recipe
(``moeblaze.ops_fp8``: equal up to the order of fp32 sums) and the float64 reference under DESIGN.md §7's rule.

Operands are quantized with torch (``moeblaze.fp8``): the interpreter's in-kernel casts to e4m3 are wrong
(DESIGN.md §7), while its e4m3 loads and ``tl.dot`` on them are exact. Outputs are fp32 in the interpreter, where
``tl.dot`` results feed a bf16 store through a path that only the GPU tests (``-m gpu``, bf16 on the device) run;
on a CUDA host the interpreter tests skip.
"""

from __future__ import annotations

import os

import pytest
import torch

from moeblaze import build_dispatch, ops_fp8
from moeblaze.activations import DEFAULT_ACT, GATED
from moeblaze.dispatch import with_schedule
from moeblaze.fp8 import E4M3, KEPT_TILE, Float8Recipe, quantize_kept
from moeblaze.kernels import fp8_gemm, tuning
from moeblaze.kernels.fp8_gemm import down_forward_fp8, fp8_down_slots, fp8_up_forward, up_forward_fp8
from moeblaze.kernels.grouped_gemm import EPILOGUE_ACT_FWD
from moeblaze.kernels.launch import grouped_gemm
from moeblaze.reference import act_reference
from moeblaze.testing import assert_close_to_reference, make_expert_inputs, rel_error

RECIPE = Float8Recipe("blockwise")
RECIPES = [RECIPE, Float8Recipe("rowwise")]
GRANULARITY = pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.granularity)
# Agreement with the emulation: both sum the same fp32 products of exact e4m3 values, in another order.
FP32_SUM_TOL = 1e-5


HAS_CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(not HAS_CUDA and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="Triton kernels need CUDA or TRITON_INTERPRET=1")
# bf16 outputs against the fp32 emulation: the kernel's store and the emulation's bf16 GEMM each round once (2^-9
# of a value); the sums' order adds far less. Measured 2.5e-3 to 3.6e-3 of the largest output on an H200
# (docs/results-fp8-kernels.csv, python3 benchmarks/bench_fp8_kernels.py).
BF16_OUT_TOL = 2.0 ** -7


@pytest.fixture(autouse=True)
def one_thread(request):
    """Small matmuls on a shared 2-core machine: threads only contend. The interpreter's tests build CPU tensors:
    on a CUDA host only the ``gpu`` ones run."""
    if HAS_CUDA and "gpu" not in request.keywords:
        pytest.skip("an interpreter test (CPU tensors); the gpu tests run the kernels on the device")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _f1_case(T, d, h, E, K, activation="swiglu", routing="uniform", zero_blocks=False, bias=False):
    inp = make_expert_inputs(T, d, h, E, K, activation, routing=routing, bias=bias)
    x, w1 = inp["x"], inp["w_gate_up"]
    if zero_blocks:  # a tile of x and a block of w1 all zeros: their scale is 1 (never 0/0)
        x[0, :128] = 0.0
        w1[0, :128, :128] = 0.0
    index = build_dispatch(inp["topk_ids"], E)
    return inp, x, w1, index


def _kernel_f1(x, w1, index, activation, out_dtype=torch.float32, b1=None, recipe=RECIPE):
    xq, wq = recipe.quantize_rows(x), recipe.quantize_weight(w1, reduce_cols=True)
    return up_forward_fp8(xq, wq, index, activation, out_dtype=out_dtype, b1=b1), xq


def _check_f1(x, w1, index, activation, b1=None, recipe=RECIPE):
    """The kernel's (pre, act) against the emulation (fp32 sums) and the float64 reference (§7 rule); returns
    the relative errors (emulation, reference) of pre."""
    (pre, act), xq = _kernel_f1(x, w1, index, activation, b1=b1, recipe=recipe)
    pre_em, act_em, _ = ops_fp8.up_forward(recipe, xq, w1, index, activation, b1=b1)
    scale = pre_em.abs().max().clamp_min(1e-30)
    assert float((pre - pre_em).abs().max() / scale) <= FP32_SUM_TOL
    assert float((act - act_em).abs().max() / act_em.abs().max().clamp_min(1e-30)) <= FP32_SUM_TOL
    tokens = index.expert_token_indices.long()
    expert = torch.repeat_interleave(torch.arange(w1.shape[0]), index.local_offsets.long().diff())
    pre64 = torch.einsum("sd,snd->sn", x.double()[tokens], w1.double()[expert])
    if b1 is not None:
        pre64 += b1.double()[expert]
    # the exact GEMM of the dequantized operands: the kernel differs by its fp32 sums only
    wq = recipe.quantize_weight(w1, reduce_cols=True)
    deq64 = torch.einsum("sd,snd->sn", xq.dequantize().double()[tokens], wq.dequantize().double()[expert])
    if b1 is not None:
        deq64 += b1.double()[expert]
    assert rel_error(pre, deq64) <= FP32_SUM_TOL / 10
    assert_close_to_reference("pre", pre, pre64, pre_em)
    assert_close_to_reference("act", act, act_reference(activation, pre64), act_em)
    return rel_error(pre, pre_em), rel_error(pre, pre64)


@pytest.mark.parametrize("T, d, h, E, K, routing", [
    (64, 256, 64, 4, 2, "uniform"),        # whole 128 blocks along d and 2h
    (1, 256, 64, 4, 2, "uniform"),         # T = 1: one row in one tile per expert, the rest empty
    (48, 200, 72, 5, 2, "empty_experts"),  # d, 2h not multiples of 128: short last blocks; empty experts
    (80, 136, 40, 6, 3, "zipf"),           # skewed routing: one expert takes most slots (several M tiles)
])
@GRANULARITY
def test_f1_matches_emulation_and_reference(T, d, h, E, K, routing, recipe):
    _check_f1(*_f1_case(T, d, h, E, K, routing=routing)[1:], "swiglu", recipe=recipe)


def test_f1_zero_blocks_get_scale_one():
    _, x, w1, index = _f1_case(16, 256, 64, 2, 2, zero_blocks=True)
    xq, wq = RECIPE.quantize_rows(x), RECIPE.quantize_weight(w1, reduce_cols=True)
    assert xq.scale[0, 0] == 1.0 and wq.scale[0, 0, 0] == 1.0
    _check_f1(x, w1, index, "swiglu")


def test_f1_outliers_and_values_near_448():
    """A 30x outlier channel costs precision in its 128-wide tile only; each block's largest element lands on
    e4m3's largest value, 448."""
    _, x, w1, index = _f1_case(32, 256, 64, 3, 2)
    x[:, 5] *= 30.0
    w1[1, 7, 200] = 4.0 * w1[1].abs().max()  # its block's amax: it lands on 448
    xq, wq = RECIPE.quantize_rows(x), RECIPE.quantize_weight(w1, reduce_cols=True)
    assert xq.data.float().abs().max() == 448.0 and wq.data.float().abs().max() == 448.0
    _check_f1(x, w1, index, "swiglu")


@GRANULARITY
@pytest.mark.parametrize("activation", ["gelu", "swiglu_clamped"])
def test_f1_other_activations_and_bias(activation, recipe):
    inp, x, w1, index = _f1_case(24, 160, 48, 3, 2, activation=activation, bias=True)
    _check_f1(x, w1, index, activation, b1=inp["b_gate_up"], recipe=recipe)


def test_f1_store_flags_and_fp16_output():
    _, x, w1, index = _f1_case(20, 128, 32, 3, 2)
    xq, wq = RECIPE.quantize_rows(x), RECIPE.quantize_weight(w1, reduce_cols=True)
    pre32, act32 = up_forward_fp8(xq, wq, index, "swiglu", out_dtype=torch.float32)
    pre16, none = up_forward_fp8(xq, wq, index, "swiglu", store_act=False, out_dtype=torch.float16)
    none2, act16 = up_forward_fp8(xq, wq, index, "swiglu", store_pre=False, out_dtype=torch.float16)
    assert none is None and none2 is None and pre16.dtype == act16.dtype == torch.float16
    # fp16 rounding of the same fp32 sums (act from the rounded pre, as the 16-bit kernel does)
    torch.testing.assert_close(pre16.float(), pre32, rtol=2**-10, atol=1e-6)
    torch.testing.assert_close(act16.float(), act32, rtol=2 * 2**-10, atol=1e-5)


def test_f1_no_slots():
    _, x, w1, _ = _f1_case(4, 128, 32, 3, 1)
    index = build_dispatch(torch.empty(0, 1, dtype=torch.int32), 3)
    pre, act = up_forward_fp8(RECIPE.quantize_rows(x[:0]), RECIPE.quantize_weight(w1, True), index, "swiglu")
    assert pre.shape == (0, 64) and act.shape == (0, 32)


def test_f1_errors_name_the_argument():
    _, x, w1, index = _f1_case(8, 128, 32, 2, 1)
    xq, wq = RECIPE.quantize_rows(x), RECIPE.quantize_weight(w1, reduce_cols=True)
    sched = with_schedule(index, tuning.block_m(index.num_pairs, 2)).schedule.tensors()
    args = (index.local_offsets, index.expert_token_indices, sched)
    kw = dict(activation="swiglu", store_pre=True, store_act=True, out_dtype=torch.float32)
    with pytest.raises(TypeError, match="x must be float8_e4m3fn"):
        fp8_up_forward(x, xq.scale, wq.data, wq.scale, *args, **kw)
    with pytest.raises(ValueError, match="x_scale must be"):
        fp8_up_forward(xq.data, xq.scale[:, :0], wq.data, wq.scale, *args, **kw)
    with pytest.raises(ValueError, match="w1_scale must be"):
        fp8_up_forward(xq.data, xq.scale, wq.data, wq.scale[:1], *args, **kw)
    with pytest.raises(TypeError, match="w1_scale must be fp32"):
        fp8_up_forward(xq.data, xq.scale, wq.data, wq.scale.double(), *args, **kw)
    with pytest.raises(ValueError, match="reduces over"):
        fp8_up_forward(xq.data[:, :64], xq.scale, wq.data, wq.scale, *args, **kw)
    with pytest.raises(TypeError, match="out_dtype"):
        fp8_up_forward(xq.data, xq.scale, wq.data, wq.scale, *args, **{**kw, "out_dtype": torch.float64})
    wide = Float8Recipe("blockwise", 256).quantize_rows(x)  # a block wider than d: (1, 256), not a row
    with pytest.raises(ValueError, match=r"\(blockwise\), or each in rows .* got \(1, 256\) and \(1, 128\)"):
        up_forward_fp8(wide, Float8Recipe("rowwise").quantize_weight(w1, True), index, "swiglu")
    rq, rw = Float8Recipe("rowwise").quantize_rows(x), Float8Recipe("rowwise").quantize_weight(w1, True)
    gemm = dict(b_nk=True, n_cols=32, k_dim=128, gather_a=True, up_off=32, epilogue=EPILOGUE_ACT_FWD.value, dual=True,
                store_pre=True)
    out = torch.empty(index.num_pairs, 64)
    with pytest.raises(ValueError, match=r"a_scale fp32 \(8,\)"):
        grouped_gemm(rq.data, rw.data, out, *args, **gemm, b_scale=rw.scale[..., 0])
    with pytest.raises(ValueError, match=r"b_scale fp32 \(2, 64\)"):
        grouped_gemm(rq.data, rw.data, out, *args, **gemm, a_scale=rq.scale[:, 0], b_scale=rw.scale)
    with pytest.raises(ValueError, match="e4m3 weight stored"):
        grouped_gemm(rq.data, rw.data.transpose(1, 2), out, *args, **{**gemm, "b_nk": False},
                     a_scale=rq.scale[:, 0], b_scale=rw.scale[..., 0])
    with pytest.raises(ValueError, match="interleaved"):
        up_forward_fp8(xq, wq, index, "swiglu", act_args=DEFAULT_ACT._replace(interleaved=True))
    assert xq.data.dtype == E4M3 and fp8_gemm.FP8_GEMM_CONFIG["BLOCK_N"] % 16 == 0


# ----------------------------------------------------------------------------- F2-F3

def _check_f2(inp, index, b2=None, recipe=RECIPE):
    """F2-F3 from the emulation's act (fp32, quantized here): against ops_fp8.down_forward (fp32 sums) and the
    float64 reference of the same act (§7 rule); returns the relative errors (emulation, reference)."""
    x, w2, tw = inp["x"], inp["w_down"], inp["topk_weights"]
    xq = recipe.quantize_rows(x)
    _, act, _ = ops_fp8.up_forward(recipe, xq, inp["w_gate_up"], index, "swiglu")
    actq, w2q = recipe.quantize_rows(act), recipe.quantize_weight(w2, reduce_cols=True)
    out = down_forward_fp8(actq, w2q, tw, index, b2=b2, out_dtype=torch.float32)
    out_em, _ = ops_fp8.down_forward(recipe, act, w2, tw, index, b2=b2)
    assert float((out - out_em).abs().max() / out_em.abs().max()) <= FP32_SUM_TOL
    expert = torch.repeat_interleave(torch.arange(w2.shape[0]), index.local_offsets.long().diff())
    y64 = torch.einsum("sh,sdh->sd", act.double(), w2.double()[expert])
    if b2 is not None:
        y64 += b2.double()[expert]
    out64 = (y64[index.token_index_map.long()] * tw.double()[..., None]).sum(1)
    assert_close_to_reference("out", out, out64, out_em)
    return rel_error(out, out_em), rel_error(out, out64)


@pytest.mark.parametrize("T, d, h, E, K, routing", [
    (64, 256, 128, 4, 2, "uniform"),       # whole blocks along h and d
    (1, 256, 64, 4, 2, "uniform"),         # T = 1
    (1, 200, 72, 4, 1, "uniform"),         # K = 1: scattered into out[token] with the router weight
    (48, 200, 72, 5, 2, "empty_experts"),  # d, h not multiples of 128 (short blocks), empty experts
    (80, 136, 160, 6, 3, "zipf"),          # skewed routing, h = 128 + 32
])
@GRANULARITY
def test_f2_matches_emulation_and_reference(T, d, h, E, K, routing, recipe):
    inp = make_expert_inputs(T, d, h, E, K, routing=routing)
    _check_f2(inp, build_dispatch(inp["topk_ids"], E), recipe=recipe)


@GRANULARITY
@pytest.mark.parametrize("K", [1, 2])
def test_f2_bias(K, recipe):
    inp = make_expert_inputs(24, 160, 48, 3, K, bias=True)
    _check_f2(inp, build_dispatch(inp["topk_ids"], 3), b2=inp["b_down"], recipe=recipe)


def test_f2_errors_name_the_argument():
    inp = make_expert_inputs(8, 128, 32, 2, 2)
    index = build_dispatch(inp["topk_ids"], 2)
    act = torch.randn(index.num_pairs, 32)
    aq, wq = RECIPE.quantize_rows(act), RECIPE.quantize_weight(inp["w_down"], reduce_cols=True)
    sched = with_schedule(index, tuning.block_m(index.num_pairs, 2)).schedule.tensors()
    args = (index.local_offsets, index.expert_token_indices, sched)
    y = torch.empty(index.num_pairs, 128)
    with pytest.raises(TypeError, match="act must be float8_e4m3fn"):
        fp8_down_slots(act, aq.scale, wq.data, wq.scale, *args, y)
    with pytest.raises(ValueError, match="act has 3 rows"):
        fp8_down_slots(aq.data[:3], aq.scale[:3], wq.data, wq.scale, *args, y)
    with pytest.raises(ValueError, match="c must be"):
        fp8_down_slots(aq.data, aq.scale, wq.data, wq.scale, *args, y[:, :64])
    with pytest.raises(ValueError, match="scale must be fp32"):
        fp8_down_slots(aq.data, aq.scale, wq.data, wq.scale, *args, y, scale=torch.ones(3))
    with pytest.raises(ValueError, match=r"act in \(1, B\) tiles and w2 in \(B, B\) blocks"):
        down_forward_fp8(aq, Float8Recipe("rowwise").quantize_weight(inp["w_down"], True), inp["topk_weights"], index)


# ----------------------------------------------------------------------------- GPU (bf16)

@pytest.mark.gpu
@pytest.mark.parametrize("T, d, h, E, K, routing", [
    (512, 256, 128, 8, 2, "uniform"),
    (300, 200, 72, 5, 2, "empty_experts"),  # short scale blocks along d and h
    (1, 256, 64, 4, 1, "uniform"),         # T = 1, K = 1: F2 scatters into out[token]
    (2048, 512, 384, 16, 4, "zipf"),       # several tiles per expert, skewed
])
@GRANULARITY
def test_gpu_bf16_f1_f2_match_emulation_and_reference(T, d, h, E, K, routing, recipe):
    inp = make_expert_inputs(T, d, h, E, K, dtype=torch.bfloat16, device="cuda", routing=routing)
    x, w1, w2, tw = inp["x"], inp["w_gate_up"], inp["w_down"], inp["topk_weights"]
    index = build_dispatch(inp["topk_ids"], E)
    xq = recipe.quantize_rows(x)
    pre, act = up_forward_fp8(xq, recipe.quantize_weight(w1, reduce_cols=True), index, "swiglu")
    pre_em, act_em, _ = ops_fp8.up_forward(recipe, xq, w1, index, "swiglu")
    assert pre.dtype == act.dtype == torch.bfloat16
    assert rel_error(pre, pre_em) <= BF16_OUT_TOL and rel_error(act, act_em) <= BF16_OUT_TOL
    tokens = index.expert_token_indices.long()
    expert = torch.repeat_interleave(torch.arange(E, device="cuda"), index.local_offsets.long().diff())
    pre64 = torch.einsum("sd,snd->sn", x.double()[tokens], w1.double()[expert])
    assert_close_to_reference("pre", pre, pre64, pre_em)
    out = down_forward_fp8(recipe.quantize_rows(act), recipe.quantize_weight(w2, reduce_cols=True), tw, index)
    out_em, _ = ops_fp8.down_forward(recipe, act, w2, tw, index)
    assert out.dtype == torch.bfloat16 and rel_error(out, out_em) <= BF16_OUT_TOL
    y64 = torch.einsum("sh,sdh->sd", act_reference("swiglu", pre64), w2.double()[expert])
    out64 = (y64[index.token_index_map.long()] * tw.double()[..., None]).sum(1)
    assert_close_to_reference("out", out, out64, out_em)


# ----------------------------------------------------------------------------- the kept pre written by F1

def _f1_pre_both_ways(T, d, h, E, K, activation, pow2, device, dtype, bias=False):
    """Rowwise F1 writing ``pre`` in e4m3 tiles (``keep``: the epilogue quantizes) and in ``dtype`` (the recipe's
    quantization of it is the reference): ``(kept pre [N, rows] e4m3, scale, act, the 16-bit pre, its act)``."""
    inp = make_expert_inputs(T, d, h, E, K, activation, routing="zipf", dtype=dtype, device=device, bias=bias)
    x, w1 = inp["x"], inp["w_gate_up"]
    x[0] = 0.0  # without a bias, the rows of pre of token 0's slots are zeros: their tiles get scale 1
    index = build_dispatch(inp["topk_ids"], E)
    recipe = Float8Recipe("rowwise", pow2_scales=pow2)
    xq, wq = recipe.quantize_rows(x), recipe.quantize_weight(w1, reduce_cols=True)
    sched = with_schedule(index, tuning.block_m(index.num_pairs, E)).schedule.tensors()
    halves = 2 if activation in GATED else 1
    scale = torch.full((index.num_pairs, halves, -(-h // KEPT_TILE)), -1.0, device=device)
    args = (xq, wq, index.local_offsets, index.expert_token_indices, sched, activation, True, True, dtype,
            inp.get("b_gate_up"), 0.0, 0.0)
    kept, act = fp8_gemm.up_rowwise(*args, keep=(scale, pow2))
    pre16, act16 = fp8_gemm.up_rowwise(*args)
    return kept, scale, act, pre16, act16


def _kept_reference(pre16, scale, pow2):
    return quantize_kept(pre16, scale.shape[1] == 2, pow2)


@pytest.mark.parametrize("h, activation, pow2, bias", [(200, "swiglu", False, True), (40, "gelu", True, False),
                                                       (256, "swiglu", True, False)])
def test_f1_writes_the_kept_pre_in_e4m3_tiles(h, activation, pow2, bias):
    """The epilogue's e4m3 pre (``PRE_FP8``) against the recipe's quantization of the pre the kernel writes
    without it (the same tiles, so the same fp32 sums): scales and act bitwise, each value its tile's quotient cast to
    e4m3 but for the interpreter's known casts (test_fp8_quant: values below e4m3's smallest normal, a carry to a
    power of two dropped, ties rounded away from zero). h 200: a short last tile (masked columns not counted); 40: one
    tile, not gated; x's first row zero: scale 1 without a bias."""
    kept, scale, act, pre16, act16 = _f1_pre_both_ways(70, 64, h, 4, 2, activation, pow2, "cpu", torch.float32,
                                                       bias)
    ref = _kept_reference(pre16, scale, pow2)
    assert kept.dtype == E4M3 and kept.shape == pre16.shape
    assert torch.equal(act, act16) and torch.equal(scale, ref.scale)
    tiles = scale.repeat_interleave(KEPT_TILE, dim=-1)[..., :h]
    quotient = pre16.view(tiles.shape) / tiles
    g, r = kept.view(tiles.shape).float(), quotient.clamp(-448, 448).to(E4M3).float()
    known = ((r.abs() <= 2.0**-6) | ((torch.frexp(r)[0].abs() == 0.5) & (g == r / 2))
             | ((quotient - (g + r) / 2).abs() <= FP32_SUM_TOL * quotient.abs()))
    assert not ((g != r) & ~known).any() and (g == r).float().mean() >= 0.75
    zero_rows = (pre16 == 0).all(dim=1)
    assert zero_rows.any() != bias and (scale[zero_rows] == 1.0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("h, activation, pow2", [(768, "swiglu", False), (200, "swiglu", True), (72, "gelu", False)])
def test_gpu_f1_kept_pre_is_bitwise_the_recipes(h, activation, pow2):
    """On the device, in bf16: the epilogue's e4m3 pre and scales bitwise the recipe's quantization of the 16-bit
    pre the same kernel writes without it (and act unchanged)."""
    kept, scale, act, pre16, act16 = _f1_pre_both_ways(1024, 256, h, 8, 4, activation, pow2, "cuda", torch.bfloat16)
    ref = _kept_reference(pre16, scale, pow2)
    assert torch.equal(act, act16) and torch.equal(scale, ref.scale)
    assert torch.equal(kept.view(ref.data.shape).view(torch.uint8), ref.data.view(torch.uint8))
