"""The Triton expert backend (``moeblaze.kernels.experts``) against the float64 reference (DESIGN.md §7).

CPU: kernels run in the Triton interpreter (``TRITON_INTERPRET=1``, set by conftest when there is no
CUDA) in fp32/fp16 on small shapes (``tl.dot`` on bf16 is wrong in the interpreter). GPU (``-m gpu``):
the same checks in bf16 plus bigger shapes, saved bytes and ``torch.compile``.
"""

import os

import pytest
import torch

import moeblaze
from moeblaze import build_dispatch, moe_experts, ops_torch
from moeblaze.activations import ACTIVATIONS
from moeblaze.kernels import tuning
from moeblaze.memory import SavedTensorCounter
from moeblaze.testing import (
    EDGE_CASES,
    assert_close_to_reference,
    make_expert_inputs,
    reference_outputs,
    rel_error,
    router_weight_grad_magnitude,
    run_and_grad,
)

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
NAMES = ("out", "dx", "dw_gate_up", "dw_down", "dtopk_weights")

kernels_runnable = pytest.mark.skipif(
    not HAS_CUDA and os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton kernels need CUDA or TRITON_INTERPRET=1")
pytestmark = kernels_runnable


def triton_experts(activation, save):
    return lambda **kw: moe_experts(**kw, activation=activation, save=save, backend="triton")


def check_against_reference(inputs, activation, save):
    """Forward and the four gradients within 2x plain PyTorch's error (same dtype) of float64.

    "Plain PyTorch computing the same thing" is the worse of two baselines: the reference run in the
    test dtype, and the ``torch`` backend (same formulas as the kernels, e.g. ``dtopk_weights =
    <dout W_down, act>``). With T = 1 the two-element ``dtopk_weights`` suffers cancellation and both
    baselines can be luckily exact (a ~1-in-6 failure of fp32 draws in the interpreter, either
    backend): its floor scales with the condition number of the sums (``magnitude``).
    """
    dt = inputs["x"].dtype
    dout = torch.randn(inputs["x"].shape, dtype=dt, device=inputs["x"].device)
    got = run_and_grad(triton_experts(activation, save), inputs, dout)
    ref = reference_outputs(inputs, activation, dout)
    base = reference_outputs(inputs, activation, dout, dtype=dt)
    torch_backend = run_and_grad(
        lambda **kw: moe_experts(**kw, activation=activation, save=save, backend="torch"), inputs, dout)
    for name, a, r, b, b2 in zip(NAMES, got, ref, base, torch_backend):
        assert a.dtype == (inputs["topk_weights"].dtype if name == "dtopk_weights" else dt), name
        assert a.device == inputs["x"].device, name
        mag = router_weight_grad_magnitude(inputs, activation, dout) if name == "dtopk_weights" else None
        assert_close_to_reference(name, a, r, (b, b2), magnitude=mag)  # the worse of the two baselines counts
    return got


def inputs(T, d, h, E, K, activation="swiglu", dtype=torch.float32, routing="uniform", device=DEVICE):
    return make_expert_inputs(T, d, h, E, K, activation, dtype, device=device, routing=routing)


# ------------------------------------------------------------------------------------------ CPU + GPU

@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("save", ["preact", "input"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_every_activation_and_save_mode(activation, save, dtype):
    check_against_reference(inputs(40, 24, 20, 6, 2, activation, dtype), activation, save)


@pytest.mark.parametrize("save", ["preact", "input"])
@pytest.mark.parametrize("case", EDGE_CASES)
def test_edge_cases(case, save):
    T, d, h, E, K, routing = EDGE_CASES[case]
    check_against_reference(inputs(T, d, h, E, K, routing=routing), "swiglu", save)


@pytest.mark.parametrize("activation", ["geglu", "relu"])
def test_odd_shapes_other_activations(activation):
    check_against_reference(inputs(21, 17, 13, 5, 1, activation, torch.float16), activation, "preact")


def non_contiguous(inp, dtype=torch.float32):
    T, d = inp["x"].shape
    E, d2, h = inp["w_down"].shape
    dev = inp["x"].device
    inp["x"] = torch.randn(d, T, dtype=dtype, device=dev).t()  # column-major view
    inp["w_gate_up"] = inp["w_gate_up"].transpose(1, 2).contiguous().transpose(1, 2)
    inp["w_down"] = (torch.randn(E, h, d, dtype=dtype, device=dev) * h**-0.5).transpose(1, 2)
    inp["topk_weights"] = inp["topk_weights"].t().contiguous().t()
    assert not inp["x"].is_contiguous() and not inp["w_down"].is_contiguous()
    assert not inp["w_gate_up"].is_contiguous()
    return inp


@pytest.mark.parametrize("save", ["preact", "input"])
def test_non_contiguous_inputs(save):
    check_against_reference(non_contiguous(inputs(30, 16, 12, 5, 2)), "swiglu", save)


def pointer_reads(monkeypatch) -> None:
    """Pointer reads where TMA would serve (as before sm90; no Gluon kernel either): ``tuning.tma_enabled`` off."""
    monkeypatch.setattr(tuning, "tma_enabled", lambda device: False)


def test_weight_read_modes(monkeypatch):
    """Which weights the GEMMs read through TMA descriptors (sm90+ or the interpreter) and which through
    pointers: misaligned rows, k not a multiple of 64 for rows along k, or no TMA (GPUs before sm90)."""
    from moeblaze.kernels.grouped_gemm import B_DESC_KN, B_DESC_NK, B_DESC_NONE, B_DESC_PAIRED
    from moeblaze.kernels.launch import b_desc_mode

    none, nk, kn, paired = B_DESC_NONE.value, B_DESC_NK.value, B_DESC_KN.value, B_DESC_PAIRED.value

    w = torch.zeros(3, 128, 64, device=DEVICE)
    if not HAS_CUDA or torch.cuda.get_device_capability()[0] >= 9:
        assert b_desc_mode(w, True, 64) == nk  # rows are n: [E*n, k]
        assert b_desc_mode(w, True, 64, paired=True) == paired  # gated F1: gate and up rows in one box
        assert b_desc_mode(w, False, 128) == kn  # rows are k: [E*k, n]
        assert b_desc_mode(w.transpose(1, 2), True, 128) == kn  # a transposed view flips the storage rows
        assert b_desc_mode(w, False, 96) == none  # k tiles would run into the next expert's rows
        assert b_desc_mode(torch.zeros(3, 128, 65, device=DEVICE)[..., :64], True, 64) == none  # 260-byte rows
        assert b_desc_mode(torch.zeros(3 * 128 * 64 + 1, device=DEVICE)[1:].view(3, 128, 64), True, 64) == none
        assert b_desc_mode(w[:, ::2], True, 64) == nk  # every other row: still rows of one 2-D view
        assert b_desc_mode(torch.zeros(3, 130, 64, device=DEVICE)[:, :128], True, 64) == none  # gaps between experts
    pointer_reads(monkeypatch)
    assert b_desc_mode(w, True, 64) == none


@pytest.mark.parametrize("tma", ["1", "0"])
def test_tma_and_pointer_weight_reads(tma, monkeypatch):
    """d and h multiples of 64: every GEMM and weight gradient has a descriptor path (``B_DESC_NK``, ``B_DESC_KN``, the
    unpermuted wgrad operands); without TMA (:func:`pointer_reads`) the pointer loads on the same shapes."""
    if tma == "0":
        pointer_reads(monkeypatch)
    check_against_reference(inputs(40, 64, 64, 3, 2, routing="zipf"), "swiglu", "preact")
    # transposed weight views swap the descriptor modes (the gated F1 reads gate and up along columns)
    check_against_reference(non_contiguous(inputs(24, 64, 32, 3, 2)), "swiglu", "input")


def _tma_vs_pointers(inp, activation, monkeypatch):
    """Outputs and gradients with the weights (and the wgrad slot rows) read through TMA descriptors and
    through pointers, same block sizes; the TMA run is also checked against the reference."""
    from moeblaze.kernels import launch

    monkeypatch.setenv("MOEBLAZE_AUTOTUNE", "0")
    monkeypatch.setattr(launch, "ws_wgrad_ok", lambda *a: False)  # the Gluon weight gradient reads through TMA only
    dout = torch.randn_like(inp["x"])
    runs = []
    for tma in (True, False):
        with monkeypatch.context() as m:
            if not tma:
                pointer_reads(m)
            runs.append(run_and_grad(triton_experts(activation, "preact"), inp, dout))
    check_against_reference(inp, activation, "preact")
    return runs


@pytest.mark.parametrize("activation", ["silu", "swiglu"])
def test_tma_and_pointer_paths_agree(activation, monkeypatch):
    """TMA descriptors load the same elements as the pointer loads. Non-gated: the same dots in the same
    order, so bitwise equal (the weight-gradient steps that run past an expert through TMA add exact
    zeros). Gated: the TMA F1 runs one ``[BLOCK_K, 2*BLOCK_N]`` dot where the pointers run two
    ``[BLOCK_K, BLOCK_N]`` ones; the interpreter's dot (numpy) may block those differently (seen with
    triton 3.9: 1 ulp), so within a few fp32 ulps here and bitwise on the GPU
    (``test_gpu_tma_and_pointer_paths_bitwise``). Two experts of 70 slots each: full M-tiles and a
    partial tile at each expert's end."""
    a, b = _tma_vs_pointers(inputs(70, 64, 64, 2, 2, activation=activation), activation, monkeypatch)
    for name, x, y in zip(NAMES, a, b):
        if activation == "silu":
            assert torch.equal(x, y), name
        else:
            assert rel_error(x, y) < 1e-6, name


def _persistent_vs_per_tile(inp, monkeypatch):
    """Both grouped-GEMM launch shapes (persistent: a program per SM walks the tiles; per tile: a program
    per output tile; the autotuner picks one, :func:`moeblaze.kernels.tuning._gemm_launch` forced here) on the
    same fixed configs: bitwise equal outputs and gradients, and the reference."""
    monkeypatch.setenv("MOEBLAZE_AUTOTUNE", "0")  # same block sizes, hence the same summation order
    dout = torch.randn_like(inp["x"])
    runs = []
    for persistent in ("1", "0"):
        monkeypatch.setattr(tuning, "_gemm_launch", lambda mode=persistent: mode)
        check_against_reference(inp, "swiglu", "preact")
        runs.append(run_and_grad(triton_experts("swiglu", "preact"), inp, dout))
    for name, a, b in zip(NAMES, *runs):
        assert torch.equal(a, b), name


def test_gemm_launch_shape_choices():
    """``auto`` (the library's launch mode): the autotuner tries per-tile and persistent launches; ``1`` or ``0``
    (tests) keeps one."""
    from moeblaze.kernels.tuning import _gemm_launch, gemm_configs

    assert _gemm_launch() == "auto"

    def shapes(kind, mode):
        return {c.kwargs["PERSISTENT"] for c in gemm_configs(kind, mode)}

    assert shapes("tuned16", "auto") == {False, True}
    assert shapes("tuned16", "0") == {False} and shapes("tuned16", "1") == {True}
    assert shapes("fixed16", "auto") == {False} and shapes("fixed16", "1") == {True}
    assert shapes("interpret", "auto") == {True} and shapes("interpret", "0") == {False}


def test_persistent_and_per_tile_launches_bitwise_equal(monkeypatch):
    # more tiles than the interpreter's 4 persistent programs, empty experts, K = 1 scatter path
    _persistent_vs_per_tile(inputs(150, 40, 24, 6, 2, routing="zipf"), monkeypatch)
    _persistent_vs_per_tile(inputs(90, 32, 16, 3, 1), monkeypatch)


def test_two_runs_bitwise_equal():
    inp = inputs(70, 48, 40, 5, 3, routing="zipf")
    dout = torch.randn(70, 48, device=DEVICE)
    first = run_and_grad(triton_experts("swiglu", "preact"), inp, dout)
    second = run_and_grad(triton_experts("swiglu", "preact"), inp, dout)
    for name, a, b in zip(NAMES, first, second):
        assert torch.equal(a, b), name


def test_launches_after_the_first_skip_the_autotuner(monkeypatch):
    """After a key's first launch, every kernel launches directly with the remembered config and the
    heuristic flags computed by the launcher (odd d, h: EVEN_K and EVEN_N false); the results are those
    of the first (autotuner) launch, bitwise, and match the reference."""
    tuned = []
    real = tuning.Launchable.tuner
    monkeypatch.setattr(tuning.Launchable, "tuner",
                        lambda self, dtype, bucket=None: tuned.append(self.fn) or real(self, dtype, bucket))
    import moeblaze.kernels.act_bwd as ab
    import moeblaze.kernels.combine as cb
    import moeblaze.kernels.launch as ln

    for mod, name in ((ln, "_GEMM"), (ln, "_WGRAD"), (cb, "_GATHER_SUM"), (ab, "_ACT_BWD")):
        monkeypatch.setattr(getattr(mod, name), "_best", {})  # forget earlier tests' keys
    inp = inputs(33, 40, 24, 3, 2)
    dout = torch.randn(33, 40, device=DEVICE)
    first = run_and_grad(triton_experts("swiglu", "preact"), inp, dout)
    assert len(tuned) == 9  # one per key: F1, F2, B1, B3, act_bwd, 2 wgrad, 2 gather-sums (weighted, plain)
    second = run_and_grad(triton_experts("swiglu", "preact"), inp, dout)
    assert len(tuned) == 9
    for name, a, b in zip(NAMES, first, second):
        assert torch.equal(a, b), name
    check_against_reference(inp, "swiglu", "preact")


def test_second_backward_through_overwritten_pre_is_a_clear_error():
    """B1 writes dpre over the saved pre; retain_graph + a second backward must fail loudly, not give
    garbage gradients (the "input" mode recomputes pre, so it allows it)."""
    inp = inputs(20, 16, 12, 4, 2)
    x = inp["x"].requires_grad_()
    out = moe_experts(x, inp["topk_ids"], inp["topk_weights"], inp["w_gate_up"], inp["w_down"], backend="triton")
    out.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()
    x.grad = None
    out = moe_experts(x, inp["topk_ids"], inp["topk_weights"], inp["w_gate_up"], inp["w_down"], save="input",
                      backend="triton")
    out.sum().backward(retain_graph=True)
    first = x.grad.clone()
    x.grad = None
    out.sum().backward()
    torch.testing.assert_close(x.grad, first, rtol=0, atol=0)


def test_ops_match_torch_backend_and_honour_need_flags():
    """The four ops of the backend contract, one by one, against ``ops_torch`` (fp32)."""
    from moeblaze.kernels import experts as ops_triton

    inp = inputs(33, 24, 16, 5, 2, "swiglu")
    index = build_dispatch(inp["topk_ids"], 5)
    x, w1, w2, tw = inp["x"], inp["w_gate_up"], inp["w_down"], inp["topk_weights"]
    for store_pre, store_act in ((True, True), (True, False), (False, True)):
        got = ops_triton.up_forward(x, w1, index, "swiglu", store_pre, store_act)
        want = ops_torch.up_forward(x, w1, index, "swiglu", store_pre, store_act)
        for g, w in zip(got, want):
            assert (g is None) == (w is None)
            if g is not None:
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    pre, act = ops_torch.up_forward(x, w1, index, "swiglu", True, True)
    torch.testing.assert_close(ops_triton.down_forward(act, w2, tw, index),
                               ops_torch.down_forward(act, w2, tw, index), rtol=1e-5, atol=1e-5)
    dout = torch.randn_like(x)
    for flags in ((True, True), (False, True), (True, False), (False, False)):
        want = ops_torch.down_backward(dout, pre, w2, tw, index, "swiglu", *flags)
        pre_t = pre.clone()
        got = ops_triton.down_backward(dout, pre_t, w2, tw, index, "swiglu", *flags)
        assert got[0] is pre_t  # dpre is written over pre
        for g, w in zip(got, want):
            assert (g is None) == (w is None)
            if g is not None:
                torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
    dpre = got[0]
    for flags in ((True, True), (False, True), (True, False)):
        got = ops_triton.up_backward(dpre, x, w1, index, *flags)
        want = ops_torch.up_backward(dpre, x, w1, index, *flags)
        for g, w in zip(got, want):
            assert (g is None) == (w is None)
            if g is not None:
                torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("block", [1, 4, 16])
def test_tile_schedule_never_straddles_experts(block):
    from moeblaze.dispatch import build_tile_schedule_torch, with_schedule

    ids = moeblaze.testing.make_routing(37, 7, 2, "empty_experts")
    index = build_dispatch(ids, 7)
    offs = index.expert_token_offsets.tolist()
    te, tr, nt = build_tile_schedule_torch(index.expert_token_offsets, 74, block).tensors()
    assert te.numel() == -(-74 // block) + 7
    n = int(nt)
    want = [(e, r) for e in range(7) for r in range(offs[e], offs[e + 1], block)]
    assert list(zip(te[:n].tolist(), tr[:n].tolist())) == want
    assert (te[n:] == -1).all() and (tr[n:] == 74).all()
    on_device = build_dispatch(ids.to(DEVICE), 7)
    for built in (with_schedule(on_device, block), build_dispatch(ids.to(DEVICE), 7, block_m=block)):
        assert built.schedule.block_m == block
        for a, b in zip(built.schedule.tensors(), (te, tr, nt)):
            assert torch.equal(a.cpu(), b.cpu())


@pytest.mark.parametrize("save", ["preact", "input"])
def test_layer_builds_the_tile_schedule_once(monkeypatch, save):
    """MoE's dispatch build carries the grouped-GEMM schedule: on CUDA the write launch emits it (no
    schedule launch at all), on the CPU it is built once; the four ops never rebuild it."""
    import moeblaze.dispatch as md
    from moeblaze.kernels import schedule as ks

    schedules = []
    for mod, name in ((md, "build_tile_schedule_torch"), (ks, "tile_schedule")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _real=real, **k: schedules.append(1) or _real(*a, **k))
    torch.manual_seed(0)
    moe = moeblaze.MoE(16, 8, 4, 2, save=save, backend="triton", device=DEVICE)
    x = torch.randn(2, 9, 16, device=DEVICE, requires_grad=True)
    moe(x).sum().backward()
    assert len(schedules) == (0 if HAS_CUDA else 1)
    assert x.grad is not None and moe.w_down.grad is not None


def test_bad_dtype_is_a_clear_error():
    inp = {k: (v.double() if v.is_floating_point() else v) for k, v in inputs(8, 16, 8, 4, 2).items()}
    with pytest.raises(TypeError, match="dtype"):
        moe_experts(**inp, backend="triton")


def check_compiled_module(dtype, shape=(2, 9, 32), d_ff=16, experts=4, top_k=2):
    torch.manual_seed(0)
    m = moeblaze.MoE(shape[-1], d_ff, experts, top_k, backend="triton", device=DEVICE, dtype=dtype)
    x = torch.randn(*shape, device=DEVICE, dtype=dtype, requires_grad=True)
    ref = m(x)
    (gx_ref,) = torch.autograd.grad(ref.float().square().sum(), x)
    compiled = torch.compile(m, fullgraph=True, backend="inductor" if HAS_CUDA else "aot_eager")
    out = compiled(x)
    (gx,) = torch.autograd.grad(out.float().square().sum(), x)
    torch.testing.assert_close(out, ref)
    # Inductor fuses the router's fp32 softmax/top-k backward differently from eager, so dx agrees to
    # rounding, not bitwise (seen on an H200 in bf16: 0.6% of elements off by <= 1.2e-4).
    assert rel_error(gx, gx_ref) <= torch.finfo(dtype).eps, rel_error(gx, gx_ref)


def test_torch_compile_fullgraph_module():
    """``torch.compile(fullgraph=True)`` over ``moeblaze.MoE`` on the Triton backend (custom ops)."""
    check_compiled_module(torch.float32)


# ------------------------------------------------------------------------------------------ GPU (bf16)

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")


@gpu
@needs_cuda
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("save", ["preact", "input"])
def test_gpu_bf16_every_activation(activation, save):
    check_against_reference(inputs(256, 128, 96, 8, 2, activation, torch.bfloat16), activation, save)


@gpu
@needs_cuda
@pytest.mark.parametrize("save", ["preact", "input"])
@pytest.mark.parametrize("case", EDGE_CASES)
def test_gpu_bf16_edge_cases(case, save):
    T, d, h, E, K, routing = EDGE_CASES[case]
    check_against_reference(inputs(T, d, h, E, K, dtype=torch.bfloat16, routing=routing), "swiglu", save)


GPU_SHAPES = {  # T, d, h, E, K, routing
    "olmoe-like": (2048, 512, 256, 16, 4, "uniform"),
    "odd": (1000, 200, 136, 7, 2, "zipf"),
    "K=1 big": (4096, 256, 512, 4, 1, "uniform"),
    "one expert": (1500, 256, 128, 8, 2, "one_expert"),
    "many experts": (3000, 256, 64, 64, 8, "uniform"),
}


@gpu
@needs_cuda
@pytest.mark.parametrize("case", GPU_SHAPES)
@pytest.mark.parametrize("tma", ["1", "0"])
def test_gpu_bf16_bigger_shapes(case, tma, monkeypatch):
    if tma == "0":  # weights through TMA descriptors (sm90+) and through pointers
        pointer_reads(monkeypatch)
    T, d, h, E, K, routing = GPU_SHAPES[case]
    check_against_reference(inputs(T, d, h, E, K, dtype=torch.bfloat16, routing=routing), "swiglu", "preact")


@gpu
@needs_cuda
@pytest.mark.parametrize("case", GPU_SHAPES)
def test_gpu_persistent_and_per_tile_bitwise(case, monkeypatch):
    T, d, h, E, K, routing = GPU_SHAPES[case]
    _persistent_vs_per_tile(inputs(T, d, h, E, K, dtype=torch.bfloat16, routing=routing), monkeypatch)


@gpu
@needs_cuda
@pytest.mark.parametrize("activation", ["silu", "swiglu"])
def test_gpu_tma_and_pointer_paths_bitwise(activation, monkeypatch):
    a, b = _tma_vs_pointers(inputs(700, 128, 128, 4, 2, activation=activation, dtype=torch.bfloat16), activation,
                            monkeypatch)
    for name, x, y in zip(NAMES, a, b):
        assert torch.equal(x, y), name


@gpu
@needs_cuda
def test_gpu_non_contiguous_and_bitwise():
    inp = non_contiguous(inputs(300, 64, 48, 6, 2, dtype=torch.bfloat16), torch.bfloat16)
    got = check_against_reference(inp, "swiglu", "preact")
    dout = torch.randn(300, 64, device="cuda", dtype=torch.bfloat16)
    a = run_and_grad(triton_experts("swiglu", "preact"), inp, dout)
    b = run_and_grad(triton_experts("swiglu", "preact"), inp, dout)
    assert all(torch.equal(u, v) for u, v in zip(a, b)) and len(got) == 5


@gpu
@needs_cuda
def test_gpu_torch_compile_fullgraph_bf16():
    check_compiled_module(torch.bfloat16, shape=(4, 256, 128), d_ff=96, experts=8, top_k=2)


@gpu
@needs_cuda
@pytest.mark.parametrize("save", ["preact", "input"])
def test_gpu_saved_bytes(save):
    """DESIGN.md §4: <= 2Td + 4Nh + 64N bytes ("preact"), <= 2Td + 64N ("input"), bf16."""
    T, d, h, E, K = 4096, 256, 128, 16, 4
    inp = inputs(T, d, h, E, K, dtype=torch.bfloat16)
    x = inp["x"].requires_grad_()
    w1, w2 = torch.nn.Parameter(inp["w_gate_up"]), torch.nn.Parameter(inp["w_down"])
    tw = inp["topk_weights"].requires_grad_()
    with SavedTensorCounter(exclude=[w1, w2]) as counter:
        out = moe_experts(x, inp["topk_ids"], tw, w1, w2, "swiglu", save,
                          backend="triton")
    saved = counter.bytes
    N = T * K
    bound = 2 * T * d + 64 * N + (4 * N * h if save == "preact" else 0)
    assert saved <= bound, (saved, bound)
    out.float().sum().backward()
    assert x.grad is not None and w1.grad is not None and tw.grad is not None


def test_act_bwd_skips_foreign_slots():
    """``act_bwd_rows`` with ``local_slots``: the first ``ZERO_TAIL`` foreign rows get zeros in ``w * act`` and
    ``dpre``, the rows past them (whole blocks returning at once) are left as they were, NaN included; every
    foreign row's router-weight gradient is 0 (the gather after it needs no mask); the local rows equal a run
    over every row."""
    from moeblaze.kernels.act_bwd import ZERO_TAIL, act_bwd_rows
    from moeblaze.kernels.act_math import ACTIVATION_CODES

    gen = torch.Generator().manual_seed(0)
    tail = ZERO_TAIL.value
    N, h, local = 9 + tail + 14, 8, 9  # interpreter blocks of 4 rows: 8..11 straddle the limit
    dact0, pre0 = torch.randn(N, h, generator=gen), torch.randn(N, 2 * h, generator=gen)
    dact0[local:], pre0[local:] = float("nan"), float("nan")  # foreign rows: never computed, any garbage
    scale = torch.rand(N, generator=gen)
    outs = {}
    for limit in (None, torch.tensor([local], dtype=torch.int32)):
        dact, pre = dact0.clone(), pre0.clone()
        dtw = torch.full((N,), 7.0)
        act_bwd_rows(dact, pre, pre, scale, dtw, h=h, activation=ACTIVATION_CODES["swiglu"], store_wact=True,
                     local_slots=limit)
        outs[limit is None] = (dact, pre, dtw)
    (dact, pre, dtw), full = outs[False], outs[True]
    for got, want in zip((dact, pre, dtw), full):
        assert torch.equal(got[:local], want[:local])
    assert (dact[local:local + tail] == 0).all() and (pre[local:local + tail] == 0).all()
    assert dact[local + tail:].isnan().all() and pre[local + tail:].isnan().all()
    assert torch.equal(dtw[local:], torch.zeros(N - local))  # +0.0 each, over the initial 7.0
