"""The warp-specialized Gluon kernels (``moeblaze.kernels.ws_wgrad``: B2, B4; ``moeblaze.kernels.ws_gemm``: F2, B3)
against the float64 reference.

It runs only on an sm90 GPU with triton 3.6 (Gluon kernels have no CPU interpreter), so apart from the gating
checks these tests are ``gpu``-marked and skip elsewhere. Each GPU test asserts that the Gluon launcher ran.
"""

import pytest
import torch

import moeblaze
from moeblaze.dispatch import build_dispatch
from moeblaze.kernels import launch, tma, tuning
from moeblaze.kernels.tuning import ws_enabled

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
needs_ws = pytest.mark.skipif(not (HAS_CUDA and ws_enabled(torch.device("cuda"))),
                              reason="needs an sm90 GPU and triton 3.6")


def _spy(monkeypatch, *names: str) -> list[str]:
    """Record each call of the named launchers of ``moeblaze.kernels.launch`` (by name), still launching."""
    launched = []
    for name in names:
        orig = getattr(launch, name)
        monkeypatch.setattr(launch, name, lambda *a, _o=orig, _n=name, **k: launched.append(_n) or _o(*a, **k))
    return launched


# What switches the Gluon kernels off on a GPU that runs them: no TMA reads (the pointer paths), or a device or
# triton version other than sm90 with triton 3.6.
_OFF = (("tma_enabled", lambda device: False), ("_ws_supported", lambda index: False))


def test_gating_on_cpu_and_by_device(monkeypatch):
    """Never on the CPU; 16-bit operands of one dtype, an output in that dtype or fp32, a gathered width that is a
    multiple of 16; without TMA reads or on another device or triton (:data:`_OFF`) it is off."""
    a, b = torch.zeros(8, 64, dtype=torch.bfloat16), torch.zeros(16, 32, dtype=torch.bfloat16)
    assert not ws_enabled(torch.device("cpu"))
    assert not launch.ws_wgrad_ok(a, b, torch.bfloat16)
    if HAS_CUDA and ws_enabled(torch.device("cuda")):
        ac, bc = a.cuda(), b.cuda()
        assert launch.ws_wgrad_ok(ac, bc, torch.bfloat16) and launch.ws_wgrad_ok(ac, bc, torch.float32)
        assert not launch.ws_wgrad_ok(ac.float(), bc.float(), torch.float32)  # 16-bit only
        assert not launch.ws_wgrad_ok(ac, bc.half(), torch.bfloat16)  # one dtype
        assert not launch.ws_wgrad_ok(ac, bc, torch.float16)  # output: the operands' dtype or fp32
        assert not launch.ws_wgrad_ok(ac[:, :56], bc, torch.bfloat16)  # gathered width % 16
        assert not launch.ws_wgrad_ok(ac.t().contiguous().t(), bc, torch.bfloat16)  # rows not contiguous
        for name, off in _OFF:
            with monkeypatch.context() as m:
                m.setattr(tuning, name, off)
                assert not launch.ws_wgrad_ok(ac, bc, torch.bfloat16)


def _routing(T, E, K, kind, gen):
    scores = torch.rand(T, E, device=DEVICE, generator=gen)
    if kind == "holes":  # every third expert gets no token: its gradient is a stored zero tile
        scores[:, ::3] = -1.0
    elif kind == "one_expert":
        scores[:, 1] = 2.0
    return scores.topk(K, dim=1).indices.to(torch.int32)


CASES = {  # T, d, h, E, K, routing: tiles past P and Q, several tiles per program, empty experts, K = 1
    "qwen3-like": (2048, 2048, 768, 128, 8, "random"),
    "tma-clipped": (600, 256, 104, 16, 2, "holes"),  # B2 by TMA store with Q = 104 columns of a 256-column tile
    "ragged": (300, 256, 200, 64, 4, "holes"),
    "narrow": (1000, 144, 40, 16, 2, "one_expert"),
    "tiny": (5, 64, 48, 8, 1, "random"),
}


@pytest.mark.gpu
@needs_ws
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype,out_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32)])
def test_gpu_ws_wgrad_against_float64(case, dtype, out_dtype, monkeypatch):
    """B2 (``dW_down``, gathered operand as A) and B4 (``dW_gate_up``, stored ``[E, 2h, d]``: gathered operand as
    B) within rounding of the float64 sums; bitwise reproducible; the Triton kernel's results agree."""
    T, d, h, E, K, kind = CASES[case]
    gen = torch.Generator(device=DEVICE).manual_seed(T + E)
    index = build_dispatch(_routing(T, E, K, kind, gen), E)
    offsets, indices = index.expert_token_offsets, index.expert_token_indices
    N = indices.numel()
    ran = _spy(monkeypatch, "grouped_wgrad_ws")
    tma_store = []  # which store path each launch took
    orig = launch.ws_wgrad_tma_store
    monkeypatch.setattr(launch, "ws_wgrad_tma_store", lambda *a: tma_store.append(orig(*a)) or tma_store[-1])
    for q, transpose in ((h, False), (2 * h, True)):
        a = torch.randn(T, d, device=DEVICE, dtype=dtype, generator=gen)
        b = torch.randn(N, q, device=DEVICE, dtype=dtype, generator=gen)
        ref = torch.stack([a[indices[offsets[e]:offsets[e + 1]].long()].double().T
                           @ b[offsets[e]:offsets[e + 1]].double() for e in range(E)])
        ref = ref.transpose(1, 2) if transpose else ref

        def wgrad(ws, a=a, b=b, q=q, transpose=transpose):
            with monkeypatch.context() as m, moeblaze.settings.override(autotune=False):
                if not ws:  # the Triton kernel
                    m.setattr(launch, "ws_wgrad_ok", lambda *args: False)
                return launch.grouped_wgrad(a, b, offsets, indices, p=d, q=q, out_dtype=out_dtype, transpose=transpose)

        got, again, triton_out = wgrad(True), wgrad(True), wgrad(False)
        assert got.shape == ref.shape and got.dtype == out_dtype and got.is_contiguous()
        assert torch.equal(got, again)
        # the 16-bit rounding of the stored gradient costs up to 2^-8 of the largest sum (fp16: 2^-11), plus
        # the fp32 accumulation; a wrong slot, token or tile costs O(1)
        scale = ref.abs().max()
        assert (got.double() - ref).abs().max() <= 2 ** -7 * scale
        assert (got.double() - triton_out.double()).abs().max() <= 2 ** -7 * scale
        if kind == "holes":
            assert got[0].abs().max() == 0 and got[3].abs().max() == 0
    assert len(ran) == 4  # two invocations of each product went through the Gluon launcher
    # whole tiles by TMA where the output is 16-bit and P a multiple of the 128-row tile, else masked stores
    want = [out_dtype == dtype and p % 128 == 0 for p in (d, 2 * h)]
    assert tma_store == [want[0], want[0], want[1], want[1]]


@pytest.mark.gpu
@needs_ws
@pytest.mark.parametrize("save", ["preact", "input"])
def test_gpu_layer_with_ws_wgrad_bf16(save, monkeypatch):
    """The layer with the Gluon kernels (F2, B3 and the weight gradients): outputs and gradients against the
    float64 reference (DESIGN.md §7 rule) and the Triton kernels'."""
    from moeblaze.testing import run_and_grad
    from test_experts_triton import NAMES, check_against_reference, inputs, triton_experts

    monkeypatch.setattr(launch, "_ws_gemm_pays", lambda *x: True)
    ran = _spy(monkeypatch, "grouped_wgrad_ws", "grouped_gemm_ws")
    inp = inputs(1024, 256, 192, 32, 4, dtype=torch.bfloat16)
    check_against_reference(inp, "swiglu", save)
    assert set(ran) == {"grouped_wgrad_ws", "grouped_gemm_ws"}
    dout = torch.randn_like(inp["x"])
    runs = []
    for ws in (True, False):
        with monkeypatch.context() as m, moeblaze.settings.override(autotune=False):
            if not ws:  # the Triton kernels
                m.setattr(tuning, "ws_enabled", lambda device: False)
            runs.append(run_and_grad(triton_experts("swiglu", save), inp, dout))
    for name, x, y in zip(NAMES, *runs):
        assert (x.double() - y.double()).abs().max() <= 2 ** -7 * y.double().abs().max(), name


def test_ws_gemm_gating_on_cpu_and_by_device(monkeypatch):
    """Never on the CPU; 16-bit tensors of one dtype, a contiguous weight, k a multiple of 64; without TMA reads or
    on another device or triton (:data:`_OFF`) it is off."""
    a, c = torch.zeros(8, 64, dtype=torch.bfloat16), torch.zeros(8, 32, dtype=torch.bfloat16)
    w = torch.zeros(2, 32, 64, dtype=torch.bfloat16)
    assert not launch.ws_gemm_ok(a, w, c, True, 64)
    if HAS_CUDA and ws_enabled(torch.device("cuda")):
        a, w, c = a.cuda(), w.cuda(), c.cuda()
        assert launch.ws_gemm_ok(a, w, c, True, 64)
        assert not launch.ws_gemm_ok(a.float(), w.float(), c.float(), True, 64)
        assert not launch.ws_gemm_ok(a, w, c.half(), True, 64)
        assert not launch.ws_gemm_ok(a[:, :48], w[..., :48], c, True, 48)  # k % 64
        assert not launch.ws_gemm_ok(a, w.transpose(1, 2).contiguous().transpose(1, 2), c, True, 64)
        for name, off in _OFF:
            with monkeypatch.context() as m:
                m.setattr(tuning, name, off)
                assert not launch.ws_gemm_ok(a, w, c, True, 64)


GEMM_CASES = {  # T, k, n, E, K, routing: several M-tiles per expert, empty experts, partial N tiles
    "qwen3-like": (2048, 768, 2048, 128, 8, "random"),
    "ragged": (1500, 128, 320, 16, 2, "holes"),
    "one_expert": (700, 256, 200, 8, 2, "one_expert"),
}


@pytest.mark.gpu
@needs_ws
@pytest.mark.parametrize("case", GEMM_CASES)
@pytest.mark.parametrize("b_nk", [True, False])
def test_gpu_ws_gemm_against_float64(case, b_nk, monkeypatch):
    """``c[s] = a[s] @ W[e]`` for every slot (F2's ``[E, n, k]`` weight and B3's ``[E, k, n]``), whole and in column
    chunks: within bf16 rounding of the float64 products; every slot row written, nothing past the chunk."""
    T, k, n, E, K, kind = GEMM_CASES[case]
    gen = torch.Generator(device=DEVICE).manual_seed(T + k)
    index = build_dispatch(_routing(T, E, K, kind, gen), E, block_m=128)
    offsets, indices, sched = index.expert_token_offsets, index.expert_token_indices, index.schedule
    N = indices.numel()
    a = torch.randn(N, k, device=DEVICE, dtype=torch.bfloat16, generator=gen)
    w = torch.randn((E, n, k) if b_nk else (E, k, n), device=DEVICE, dtype=torch.bfloat16, generator=gen)
    wk = w.transpose(1, 2) if b_nk else w  # [E, k, n]
    bounds = offsets.tolist()
    ref = torch.cat([a[bounds[e]:bounds[e + 1]].double() @ wk[e].double() for e in range(E)])
    ran = _spy(monkeypatch, "grouped_gemm_ws")
    monkeypatch.setattr(launch, "_ws_gemm_pays", lambda *x: True)  # small shapes take it too (fewer tiles than SMs)
    sched_t = (sched.tile_expert, sched.tile_row_start, sched.num_tiles)
    for c0, c1 in ((0, n), (0, 128), (128, n)):
        c = torch.full((N, c1 - c0 + 8), float("nan"), device=DEVICE, dtype=torch.bfloat16)
        with moeblaze.settings.override(autotune=False):
            launch.grouped_gemm(a, w, c, offsets, indices, sched_t, b_nk=b_nk, n_cols=c1 - c0, k_dim=k,
                                gather_a=False, n_start=c0 or None)
        got = c[:, :c1 - c0]
        assert torch.isnan(c[:, c1 - c0:]).all()  # nothing written past the chunk
        scale = ref.abs().max()
        assert (got.double() - ref[:, c0:c1]).abs().max() <= 2 ** -7 * scale, (c0, c1)
    assert len(ran) == 3


def test_ws_gemm_takes_shapes_of_several_tiles_per_sm(monkeypatch):
    """The Gluon GEMM runs where it gets >= 12 output tiles per SM (below, it gains little or loses)."""
    monkeypatch.setattr(launch, "num_programs", lambda device: 132)
    assert launch._ws_gemm_pays(792, 512, torch.device("cuda"))  # 792 M-tiles x 2 N-tiles = 12 per SM
    assert not launch._ws_gemm_pays(791, 512, torch.device("cuda"))


def test_host_descriptor_layout_is_built_once_per_box_and_dtype():
    """The launchers' TMA descriptors: the box and the layout ``wgmma`` reads (Gluon's default for the box), one
    layout object per box and dtype across launches."""
    gl = pytest.importorskip("triton.experimental.gluon.language")
    t = torch.zeros(64, 256, dtype=torch.bfloat16)
    d1, d2 = tma.tma_desc(t, [64, 128]), tma.tma_desc(t.clone(), [64, 128])
    assert d1.block_shape == [64, 128] and d1.layout == gl.NVMMASharedLayout.get_default_for([64, 128], gl.bfloat16)
    assert d2.layout is d1.layout and tma.tma_desc(t.half(), [64, 128]).layout is not d1.layout


def test_ws_fp8_gemm_gating_and_tile_count(monkeypatch):
    """The FP8 form (``kernels/fp8_ws_gemm.py``): e4m3 operands with a weight ``[E, n, k]`` and a 16-bit output, never
    on the CPU; gathered rows of A only in e4m3; at any tile count (the 16-bit kernel from 12 tiles per SM)."""
    a, w = torch.zeros(8, 128, dtype=torch.float8_e4m3fn), torch.zeros(2, 32, 128, dtype=torch.float8_e4m3fn)
    c = torch.zeros(8, 32, dtype=torch.bfloat16)
    assert not launch.ws_gemm_ok(a, w, c, True, 128)
    if HAS_CUDA and ws_enabled(torch.device("cuda")):
        a, w, c = a.cuda(), w.cuda(), c.cuda()
        assert launch.ws_gemm_ok(a, w, c, True, 128) and launch.ws_gemm_ok(a, w, c.half(), True, 128)
        assert not launch.ws_gemm_ok(a, w.transpose(1, 2).contiguous(), c, False, 128)  # e4m3 wgmma: K-major only
        assert not launch.ws_gemm_ok(a, w, c.float(), True, 128)
        assert not launch.ws_gemm_ok(a, w.to(torch.bfloat16), c, True, 128)
        assert launch.ws_gemm_ok(a, w, c, True, 128, gather_a=True)
        a16, w16 = a.to(torch.bfloat16), w.to(torch.bfloat16)
        assert launch.ws_gemm_ok(a16, w16, c, True, 128) and not launch.ws_gemm_ok(a16, w16, c, True, 128, True)
    monkeypatch.setattr(launch, "num_programs", lambda device: 132)
    assert launch.WS_GEMM_FP8_CONFIG["BLOCK_N"] == launch.WS_GEMM_CONFIG["BLOCK_N"] == 256
    assert launch._ws_gemm_pays(792, 512, torch.device("cuda"))  # 16-bit: 792 M-tiles x 2 N-tiles = 12 per SM
    assert not launch._ws_gemm_pays(791, 512, torch.device("cuda"))


def test_fp8_gemm_takes_the_ws_kernel_at_any_tile_count(monkeypatch):
    """Where the Gluon kernels run, an FP8 slot-row GEMM takes its warp-specialized kernel whatever its tile count
    (1.25-1.38x faster than the Triton FP8 kernel down to 1 tile per SM: ``launch._ws_gemm_pays``); a 16-bit one
    only where ``_ws_gemm_pays`` says so."""
    ids = torch.rand(16, 4, generator=torch.Generator().manual_seed(0)).topk(2, dim=1).indices.to(torch.int32)
    bm = tuning.block_m(32, 4)  # the interpreter's M tile
    index = build_dispatch(ids, 4, block_m=bm)
    sc, N = index.schedule, index.expert_token_indices.numel()
    sched = (sc.tile_expert, sc.tile_row_start, sc.num_tiles)
    ran = []
    monkeypatch.setattr(launch, "ws_gemm_ok", lambda *a: True)
    monkeypatch.setattr(launch, "_ws_gemm_pays", lambda *a: False)
    monkeypatch.setattr(launch, "grouped_gemm_ws", lambda a, *rest, **kw: ran.append(a.dtype))
    monkeypatch.setitem(launch.WS_GEMM_CONFIG, "BLOCK_M", bm)
    for dtype in (torch.float8_e4m3fn, torch.float16):
        a, w = torch.randn(N, 32).to(dtype), torch.randn(4, 16, 32).to(dtype)
        scales = {"a_scale": torch.ones(N), "b_scale": torch.ones(4, 16)} if dtype != torch.float16 else {}
        launch.grouped_gemm(a, w, torch.zeros(N, 16, dtype=torch.float16), index.expert_token_offsets,
                            index.expert_token_indices, sched, b_nk=True, n_cols=16, k_dim=32, gather_a=False,
                            **scales)
    assert ran == [torch.float8_e4m3fn]


def _fp8_rows(t: torch.Tensor):
    from moeblaze.kernels.fp8_quant import quantize_rows_fp8

    q = quantize_rows_fp8(t)
    return q.data, q.scale[..., 0]


@pytest.mark.gpu
@needs_ws
@pytest.mark.parametrize("case", GEMM_CASES)
@pytest.mark.parametrize("gather_a", [False, True])
def test_gpu_ws_fp8_gemm_is_the_triton_kernels_bitwise(case, gather_a, monkeypatch):
    """``c[s] = a_scale[r] w_scale[e] (a[r] @ W[e]^T)`` on e4m3 operands, ``r`` the slot (F2, B3 of the FP8 layer)
    or its token (``gather_a``: B1), whole and in column chunks: bitwise the Triton kernel's (the same 128-product
    partial sums added in k order, then the same scaling: module docstring of ``kernels/fp8_ws_gemm.py``) and within
    bf16 rounding of the float64 products of the dequantized operands; every slot row written, nothing past the
    chunk."""
    T, k, n, E, K, kind = GEMM_CASES[case]
    gen = torch.Generator(device=DEVICE).manual_seed(T + k + 8)
    index = build_dispatch(_routing(T, E, K, kind, gen), E, block_m=128)
    offsets, indices, sched = index.expert_token_offsets, index.expert_token_indices, index.schedule
    N = indices.numel()
    a, a_scale = _fp8_rows(torch.randn(T if gather_a else N, k, device=DEVICE, generator=gen) * 4)
    w, w_scale = _fp8_rows(torch.randn(E, n, k, device=DEVICE, generator=gen))
    deq = lambda q, s: q.double() * s.double()[..., None]  # noqa: E731
    wd, ad = deq(w, w_scale), deq(a, a_scale)
    if gather_a:
        ad = ad[indices.long()]
    bounds = offsets.tolist()
    ref = torch.cat([ad[bounds[e]:bounds[e + 1]] @ wd[e].T for e in range(E)])
    ran = _spy(monkeypatch, "grouped_gemm_ws")
    monkeypatch.setattr(launch, "_ws_gemm_pays", lambda *x: True)  # small shapes take it too (fewer tiles than SMs)
    sched_t = (sched.tile_expert, sched.tile_row_start, sched.num_tiles)
    for c0, c1 in ((0, n), (0, 128), (128, n)):
        outs = []
        for ws in (True, False):
            c = torch.full((N, c1 - c0 + 8), float("nan"), device=DEVICE, dtype=torch.bfloat16)
            with monkeypatch.context() as m, moeblaze.settings.override(autotune=False):
                if not ws:
                    m.setattr(tuning, "ws_enabled", lambda device: False)
                launch.grouped_gemm(a, w, c, offsets, indices, sched_t, b_nk=True, n_cols=c1 - c0, k_dim=k,
                                    gather_a=gather_a, n_start=c0 or None, a_scale=a_scale, b_scale=w_scale)
            assert torch.isnan(c[:, c1 - c0:]).all()  # nothing written past the chunk
            outs.append(c[:, :c1 - c0])
        scale = ref.abs().max()
        assert (outs[0].double() - ref[:, c0:c1]).abs().max() <= 2 ** -7 * scale, (c0, c1)
        assert torch.equal(outs[0], outs[1]), (c0, c1)
    assert len(ran) == 3


def _spy_ws_up(monkeypatch) -> list[str]:
    """Record each launch of the Gluon FP8 F1 (looked up in its module at each call), still launching."""
    from moeblaze.kernels import fp8_ws_up

    launched = []
    orig = fp8_ws_up.launch_ws_up
    monkeypatch.setattr(fp8_ws_up, "launch_ws_up", lambda *a, **k: launched.append("up") or orig(*a, **k))
    return launched


@pytest.mark.gpu
@needs_ws
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("shape", [(2048, 768, 384, 32, 8), (700, 256, 200, 8, 2)])  # h = 200: a short last kept tile
def test_gpu_ws_fp8_up_is_the_triton_kernels_bitwise(shape, pow2, monkeypatch):
    """F1 of the FP8 layer on the Gluon kernel (``kernels/fp8_ws_up.py``): the kept e4m3 ``pre``, its tile scales and
    ``act`` bitwise the Triton kernel's (same sums, scaling, rounding and device functions), zipf routing (empty
    experts); ``act`` within bf16 rounding of the float64 SwiGLU of the float64 products."""
    from moeblaze.fp8 import KEPT_TILE, Float8Recipe
    from moeblaze.kernels.fp8_gemm import up_rowwise

    T, d, h, E, K = shape
    gen = torch.Generator(device=DEVICE).manual_seed(T + h)
    index = build_dispatch(_routing(T, E, K, "holes", gen), E, block_m=128)
    offsets, indices, sc = index.expert_token_offsets, index.expert_token_indices, index.schedule
    N = indices.numel()
    recipe = Float8Recipe()
    xq = recipe.quantize_rows(torch.randn(T, d, device=DEVICE, dtype=torch.bfloat16, generator=gen))
    w1q = recipe.quantize_weight(torch.randn(E, 2 * h, d, device=DEVICE, dtype=torch.bfloat16, generator=gen) * 0.05,
                                 True)
    monkeypatch.setattr(launch, "_ws_gemm_pays", lambda *x: True)
    ran = _spy_ws_up(monkeypatch)
    outs = []
    for ws in (True, False):
        scale = torch.full((N, 2, -(-h // KEPT_TILE)), -1.0, device=DEVICE)
        with monkeypatch.context() as m, moeblaze.settings.override(autotune=False):
            if not ws:
                m.setattr(tuning, "ws_enabled", lambda device: False)
            pre, act = up_rowwise(xq, w1q, offsets, indices, (sc.tile_expert, sc.tile_row_start, sc.num_tiles),
                                  "swiglu", True, True, torch.bfloat16, None, 1.702, 7.0, keep=(scale, pow2))
        outs.append((pre.view(torch.uint8), scale, act))
    assert ran == ["up"]
    for name, a, b in zip(("pre", "scale", "act"), *outs):
        assert torch.equal(a, b), name
    x64 = xq.data.double() * xq.scale.double()
    w64 = w1q.data.double() * w1q.scale.double()
    bounds = offsets.tolist()
    pre64 = torch.cat([x64[indices[bounds[e]:bounds[e + 1]].long()] @ w64[e].T for e in range(E)])
    act64 = torch.nn.functional.silu(pre64[:, :h]) * pre64[:, h:]
    assert (outs[0][2].double() - act64).abs().max() <= 2 ** -6 * act64.abs().max()


@pytest.mark.gpu
@needs_ws
def test_gpu_fp8_layer_with_the_ws_gemm_is_the_triton_kernels(monkeypatch):
    """The FP8 layer (rowwise recipe) with F1, F2, B1 and B3 on the Gluon FP8 kernels: every output and gradient
    bitwise that of the same layer on the Triton kernels."""
    from moeblaze.fp8 import Float8Recipe
    from moeblaze.testing import make_expert_inputs, run_and_grad
    from test_experts_triton import NAMES

    monkeypatch.setattr(launch, "_ws_gemm_pays", lambda *x: True)
    inputs = make_expert_inputs(1024, 256, 192, 16, 4, routing="zipf", dtype=torch.bfloat16, device="cuda")
    dout = torch.randn(inputs["x"].shape, dtype=torch.bfloat16, device="cuda")
    runs = []
    for ws in (True, False):
        with monkeypatch.context() as m, moeblaze.settings.override(autotune=False):
            ran, up = _spy(m, "grouped_gemm_ws"), _spy_ws_up(m)
            if not ws:  # the weight gradients keep their Gluon kernel (not bitwise the Triton one)
                from moeblaze.kernels import fp8_ws_up

                m.setattr(launch, "ws_gemm_ok", lambda *args: False)
                m.setattr(fp8_ws_up, "ws_up_ok", lambda *args: False)
            runs.append(run_and_grad(lambda **kw: moeblaze.moe_experts(**kw, backend="triton", fp8=Float8Recipe()),
                                     inputs, dout))
            assert (len(ran) >= 3 and up == ["up"]) if ws else not (ran or up)  # F2, B1, B3; F1 once
    for name, x, y in zip(NAMES, *runs):
        assert torch.equal(x, y), name
