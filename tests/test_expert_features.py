"""What model families need from the experts (issue 22 item 2), both backends, against the float64 reference.

Expert biases (GPT-OSS), GPT-OSS's clamped SwiGLU with its interleaved gate/up layout read through the
strides of a transposed ``[E, d, 2h]`` parameter, tanh GELU (gated and not), squared ReLU, and ids ``>= E``
as experts of other ranks (transformers' expert-parallel sentinel). DESIGN.md §7 rule: the error may be
at most 2x the worst plain-PyTorch baseline in the same dtype (the reference run in that dtype, a per-pair
dense computation, and for the kernels the torch backend) plus a rounding floor.
CPU: torch backend in fp64/fp32, Triton kernels in the interpreter in fp32/fp16 at tiny shapes.
GPU (``-m gpu``): the kernels in bf16 (and fp32 for the clamp boundaries).
"""

import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import moeblaze
from moeblaze import build_dispatch, moe_experts
from moeblaze.activations import ACTIVATIONS, GATED, is_gated
from moeblaze.backends import get_backend
from moeblaze.reference import act_reference, moe_experts_reference
from moeblaze.testing import assert_close_to_reference, make_expert_inputs, reference_outputs, run_and_grad

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
KERNELS = HAS_CUDA or os.environ.get("TRITON_INTERPRET") == "1"
NAMES = ("out", "dx", "dw_gate_up", "dw_down", "dtopk_weights", "db_gate_up", "db_down")
GPT_OSS = {"activation": "swiglu_clamped", "gate_up_interleaved": True}

needs_kernels = pytest.mark.skipif(not KERNELS, reason="Triton kernels need CUDA or TRITON_INTERPRET=1")
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")


def make_inputs(T, d, h, E, K, activation, dtype, *, bias=True, interleaved=False, foreign=False,
                routing="uniform", device="cpu"):
    """Inputs of moe_experts. ``interleaved``: ``w_gate_up`` is the ``[E, 2h, d]`` transposed view of a
    GPT-OSS ``[E, d, 2h]`` tensor (and ``w_down`` of ``[E, h, d]``). ``foreign``: ids of E + 3 experts drawn,
    those ``>= E`` kept as foreign ids (several values, repeats within a row), token 0 all foreign."""
    inp = make_expert_inputs(T, d, h, E + (3 if foreign else 0), K, activation, dtype, device, routing, bias=bias)
    if foreign:
        ids = inp["topk_ids"]
        ids[ids >= E] = torch.where(torch.rand(ids.shape, device=ids.device) < 0.5, E, E + 2)[ids >= E].to(ids.dtype)
        ids[0] = E
        for k in ("w_gate_up", "w_down", "b_gate_up", "b_down"):
            if k in inp:
                inp[k] = inp[k][:E].contiguous()
    if interleaved:
        inp["w_gate_up"] = inp["w_gate_up"].transpose(1, 2).contiguous().transpose(1, 2)
        inp["w_down"] = inp["w_down"].transpose(1, 2).contiguous().transpose(1, 2)
    return inp


def dense_pairs(inputs, activation, dout, dtype, **options):
    """A second plain-PyTorch computation in ``dtype``: every pair at once through gathered weights
    (another summation order than the per-expert reference), with autograd gradients."""
    names = [k for k in ("x", "w_gate_up", "w_down", "topk_weights", "b_gate_up", "b_down") if k in inputs]
    lv = {k: inputs[k].detach().cpu().to(dtype if k != "topk_weights" else inputs[k].dtype).requires_grad_()
          for k in names}
    E = lv["w_down"].shape[0]
    ids = inputs["topk_ids"].cpu().long()
    local = ids < E
    e = ids.clamp(max=E - 1)
    pre = torch.einsum("td,tkrd->tkr", lv["x"], lv["w_gate_up"][e])
    if "b_gate_up" in lv:
        pre = pre + lv["b_gate_up"][e]
    opts = {"alpha": options.get("swiglu_alpha", 1.702), "limit": options.get("swiglu_limit", 7.0),
            "interleaved": options.get("gate_up_interleaved", False)}
    y = torch.einsum("tkh,tkdh->tkd", act_reference(activation, pre, **opts), lv["w_down"][e])
    if "b_down" in lv:
        y = y + lv["b_down"][e]
    out = (y * (lv["topk_weights"].to(dtype) * local)[..., None]).sum(1)
    grads = torch.autograd.grad(out, [lv[k] for k in names], dout.detach().cpu().to(dtype))
    return (out.detach(), *grads)


def check(inputs, activation, save, backend, **options):
    """Forward and every gradient (biases included) against the float64 reference, DESIGN.md §7 rule."""
    dt = inputs["x"].dtype
    dout = torch.randn(inputs["x"].shape, dtype=dt, device=inputs["x"].device)
    foreign = bool((inputs["topk_ids"] >= inputs["w_down"].shape[0]).any())

    def run(backend_name):
        return run_and_grad(lambda **kw: moe_experts(**kw, activation=activation, save=save, backend=backend_name,
                                                     foreign_experts=foreign, **options), inputs, dout)

    got = run(backend)
    ref = reference_outputs(inputs, activation, dout, **options)
    baselines = [reference_outputs(inputs, activation, dout, dtype=dt, **options),
                 dense_pairs(inputs, activation, dout, dt, **options)]
    if backend == "triton":
        baselines.append(run("torch"))
    for name, a, r, *base in zip(NAMES, got, ref, *baselines):
        assert a.dtype == (inputs["topk_weights"].dtype if name == "dtopk_weights" else dt), name
        assert_close_to_reference(name, a, r, base)
    if foreign:  # foreign pairs get exactly no router-weight gradient
        assert (got[4][inputs["topk_ids"] >= inputs["w_down"].shape[0]] == 0).all(), "dtopk_weights of foreign pairs"
    return got


# ------------------------------------------------------------------------------- torch backend, fp64/fp32

@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_torch_backend_every_activation_with_bias(activation, dtype):
    check(make_inputs(30, 16, 12, 5, 2, activation, dtype), activation, "preact", "torch")


@pytest.mark.parametrize("save", ["preact", "input"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("K", [1, 3])
def test_torch_backend_gpt_oss_layout_and_foreign_ids(save, dtype, K):
    inp = make_inputs(26, 12, 10, 4, K, "swiglu_clamped", dtype, interleaved=True, foreign=True)
    check(inp, "swiglu_clamped", save, "torch", gate_up_interleaved=True, swiglu_alpha=1.3, swiglu_limit=0.8)


# ------------------------------------------------------------------------- Triton kernels (interpreter)

@needs_kernels
@pytest.mark.parametrize("activation", ["geglu_tanh", "relu2"])  # every activation without bias: test_experts_triton
def test_kernels_bias_gated_and_not(activation):
    check(make_inputs(40, 24, 20, 6, 2, activation, torch.float32), activation, "preact", "triton")


@needs_kernels
@pytest.mark.parametrize("save", ["preact", "input"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernels_gpt_oss(save, dtype):
    """GPT-OSS's experts: biases, clamped SwiGLU (clamps active in fp32; fp16 keeps GPT-OSS's limit 7 so
    that no rounding of pre lands on the other side of a clamp), interleaved gate/up through strides."""
    limit = 0.8 if dtype == torch.float32 else 7.0
    inp = make_inputs(40, 24, 20, 5, 2, "swiglu_clamped", dtype, interleaved=True)
    check(inp, "swiglu_clamped", save, "triton", gate_up_interleaved=True, swiglu_alpha=1.702, swiglu_limit=limit)


@needs_kernels
@pytest.mark.parametrize("tma", ["1", "0"])
def test_kernels_gpt_oss_weight_reads(tma, monkeypatch):
    """d a multiple of 64: F1 reads GPT-OSS's ``[E, d, 2h]`` storage through one TMA box of alternating
    gate/up columns (``B_DESC_INTERLEAVED``); without TMA (GPUs before sm90): the strided pointer loads. Both
    against the reference."""
    from moeblaze.kernels.launch import interleaved_desc_ok
    from test_experts_triton import pointer_reads

    if tma == "0":
        pointer_reads(monkeypatch)
    inp = make_inputs(40, 64, 24, 3, 2, "swiglu_clamped", torch.float32, interleaved=True)
    assert interleaved_desc_ok(inp["w_gate_up"], 64) == (tma == "1")
    assert not interleaved_desc_ok(inp["w_gate_up"].contiguous(), 64)  # rows of d: no interleaved columns
    assert not interleaved_desc_ok(inp["w_gate_up"][..., :48], 48)  # d not a multiple of 64
    check(inp, "swiglu_clamped", "input", "triton", gate_up_interleaved=True, swiglu_limit=0.8)


@needs_kernels
@pytest.mark.parametrize("save", ["preact", "input"])
@pytest.mark.parametrize("K", [1, 2])
def test_kernels_foreign_ids(save, K):
    """Ids >= E (several values, repeated in a row, one token all foreign), with biases; K = 1 takes the
    scatter epilogues (out / dx written per token: foreign tokens must come out zero)."""
    check(make_inputs(36, 16, 12, 4, K, "swiglu", torch.float32, foreign=True), "swiglu", save, "triton")


@needs_kernels
@pytest.mark.parametrize("case", ["odd d and h", "empty experts", "K=1 interleaved", "interleaved fp16 odd"])
def test_kernels_edge_cases(case):
    T, d, h, E, K, dtype, routing, act, inter = {
        "odd d and h": (19, 17, 13, 4, 2, torch.float32, "uniform", "geglu_tanh", False),
        "empty experts": (48, 16, 8, 8, 2, torch.float32, "empty_experts", "relu2", False),
        "K=1 interleaved": (30, 16, 12, 3, 1, torch.float32, "uniform", "swiglu", True),
        "interleaved fp16 odd": (21, 17, 13, 5, 2, torch.float16, "zipf", "swiglu_clamped", True),
    }[case]
    inp = make_inputs(T, d, h, E, K, act, dtype, interleaved=inter, foreign=case == "empty experts", routing=routing)
    check(inp, act, "preact", "triton", **({"gate_up_interleaved": True} if inter else {}))


# ---------------------------------------------------------------- layouts, no weight copies, errors, index

class _NewTensors(TorchDispatchMode):
    """Records ``(numel, storage pointer)`` of every tensor an op returns (views keep their base's storage)."""

    def __init__(self):
        super().__init__()
        self.outputs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.outputs.append((t.numel(), t.untyped_storage().data_ptr()))
        return out

    def copies_of(self, p: torch.Tensor) -> int:
        """Outputs as large as ``p`` in other storage than ``p``'s."""
        return sum(n == p.numel() and ptr != p.untyped_storage().data_ptr() for n, ptr in self.outputs)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_kernels)])
def test_gpt_oss_parameters_read_in_place_and_get_their_gradients(backend):
    """transformers' GPT-OSS stores ``gate_up_proj [E, d, 2h]`` (interleaved columns) and ``down_proj
    [E, h, d]``: their transposed views go in, no op copies them in forward (checked on the torch backend
    and on the GPU), and the gradients arrive on the parameters themselves (equal to the reference's)."""
    # E*2h*d = 858 and E*h*d = 429 elements: no other tensor of the forward has as many (an expert has at
    # most T = 24 slots, so its [slots, 2h | h | d] products stay below; [N, *] and [T, K, d] hold 1056 or less)
    T, d, h, E, K = 24, 13, 11, 3, 2
    inp = make_inputs(T, d, h, E, K, "swiglu_clamped", torch.float32, interleaved=True)
    gate_up_proj = torch.nn.Parameter(inp["w_gate_up"].transpose(1, 2).contiguous())
    down_proj = torch.nn.Parameter(inp["w_down"].transpose(1, 2).contiguous())
    opts = dict(activation="swiglu_clamped", gate_up_interleaved=True, b_gate_up=inp["b_gate_up"],
                b_down=inp["b_down"])
    w1, w2 = gate_up_proj.transpose(1, 2), down_proj.transpose(1, 2)
    with _NewTensors() as ops:
        out = moe_experts(inp["x"], inp["topk_ids"], inp["topk_weights"], w1, w2, backend=backend, **opts)
    if backend == "torch" or HAS_CUDA:  # the interpreter itself copies kernel arguments to host buffers
        assert ops.copies_of(gate_up_proj) == 0 and ops.copies_of(down_proj) == 0
    dout = torch.randn_like(out)
    dw1, dw2, *grads = torch.autograd.grad(out, [w1, w2, gate_up_proj, down_proj], dout)
    if backend == "triton":  # the kernels write the weight gradients in the parameters' own storage order
        assert dw1.stride() == w1.stride() and dw2.stride() == w2.stride()
    p64 = [p.detach().double().requires_grad_() for p in (gate_up_proj, down_proj)]
    ref = moe_experts_reference(inp["x"].double(), inp["topk_ids"], inp["topk_weights"].double(),
                                p64[0].transpose(1, 2), p64[1].transpose(1, 2), "swiglu_clamped",
                                gate_up_interleaved=True, b_gate_up=inp["b_gate_up"].double(),
                                b_down=inp["b_down"].double())
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    g64 = torch.autograd.grad(ref, p64, dout.double())
    for p, got, g in zip((gate_up_proj, down_proj), grads, g64):
        assert got.shape == p.shape
        torch.testing.assert_close(got.double(), g, rtol=1e-5, atol=1e-5)


def test_bias_does_not_change_results_when_zero():
    inp = make_inputs(20, 16, 8, 4, 2, "swiglu", torch.float32, bias=False)
    zeros = {"b_gate_up": torch.zeros(4, 16), "b_down": torch.zeros(4, 16)}
    torch.testing.assert_close(moe_experts(**inp, backend="torch", **zeros), moe_experts(**inp, backend="torch"),
                               rtol=0, atol=0)


def test_bad_options_are_clear_errors():
    inp = make_inputs(8, 16, 8, 4, 2, "swiglu", torch.float32, bias=False)
    with pytest.raises(ValueError, match="b_gate_up"):
        moe_experts(**inp, b_gate_up=torch.zeros(4, 8))
    with pytest.raises(ValueError, match="b_down"):
        moe_experts(**inp, b_down=torch.zeros(4, 8))
    with pytest.raises(TypeError, match="b_down"):
        moe_experts(**inp, b_down=torch.zeros(4, 16, dtype=torch.float64))
    up = make_inputs(8, 16, 8, 4, 2, "relu2", torch.float32, bias=False)
    with pytest.raises(ValueError, match="gate_up_interleaved"):
        moe_experts(**up, activation="relu2", gate_up_interleaved=True)
    with pytest.raises(ValueError, match="swiglu_limit"):
        moe_experts(**inp, activation="swiglu_clamped", swiglu_limit=float("nan"))
    with pytest.raises(ValueError, match="foreign_experts"):
        moe_experts(**inp, foreign_experts=True, index=build_dispatch(inp["topk_ids"], 4))
    inp["topk_ids"][0, 0] = 4
    with pytest.raises(ValueError, match=r"expected ids in \[0, 4\)"):
        moe_experts(**inp)
    inp["topk_ids"][0, 0] = -1
    with pytest.raises(ValueError, match=">= 0"):
        moe_experts(**inp, foreign_experts=True)


def test_foreign_dispatch_index():
    """Foreign pairs go to a last bucket E (offsets [E+2]); the tile schedule covers the local experts only;
    the index's invariants hold; K may exceed E (a rank with few experts)."""
    E = 3
    ids = torch.tensor([[0, 5, 3], [1, 0, 3], [3, 3, 3], [2, 1, 4], [4, 4, 0]])
    index = build_dispatch(ids, E, foreign_experts=True, block_m=2)
    off = index.expert_token_offsets
    assert off.tolist() == [0, 3, 5, 6, 15] and index.local_offsets.tolist() == [0, 3, 5, 6]
    assert index.expert_token_indices[:6].tolist() == [0, 1, 4, 1, 3, 3]
    tokens = torch.arange(5, dtype=torch.int32)[:, None].expand(5, 3)
    assert torch.equal(index.expert_token_indices[index.token_index_map.long()], tokens)
    assert sorted(index.token_index_map.flatten().tolist()) == list(range(15))
    assert torch.equal(index.token_expert_indices, ids.clamp(max=E).int())
    sched = index.schedule
    n = int(sched.num_tiles)
    assert list(zip(sched.tile_expert[:n].tolist(), sched.tile_row_start[:n].tolist())) == [(0, 0), (0, 2), (1, 3),
                                                                                             (2, 5)]
    with pytest.raises(ValueError, match="repeats"):
        build_dispatch(torch.tensor([[1, 1, 3]]), E, foreign_experts=True)
    few = build_dispatch(torch.tensor([[0, 5, 1], [2, 1, 2]]), 2, foreign_experts=True)  # K = 3 > E = 2
    assert few.expert_token_offsets.tolist() == [0, 1, 3, 6]


def test_foreign_index_checked_against_a_copy_of_its_ids():
    """A foreign index passed with an equal copy of its ids (not the tensor it was built from) is accepted, the
    foreign ids compared as the index clamps them; other ids are refused."""
    E = 3
    ids = torch.tensor([[0, 5], [1, 0], [3, 4], [2, 1]])
    inp = make_expert_inputs(4, 8, 4, E, 2, seed=3)
    index = build_dispatch(ids, E, foreign_experts=True)
    args = (inp["x"], inp["topk_weights"], inp["w_gate_up"], inp["w_down"])

    def run(i):
        return moe_experts(args[0], i, *args[1:], backend="torch", index=index, foreign_experts=True)
    assert torch.equal(run(ids.clone()), run(ids))
    with pytest.raises(ValueError, match="index was built from other topk_ids"):
        run(torch.tensor([[0, 5], [1, 0], [3, 4], [2, 0]]))


def test_moe_layer_bias_and_new_activations():
    """``moeblaze.MoE(bias=True)``: expert biases as parameters, equal to the reference with the layer's routing."""
    torch.manual_seed(0)
    moe = moeblaze.MoE(16, 8, 4, 2, activation="geglu_tanh", bias=True, backend="torch", dtype=torch.float64)
    assert moe.b_gate_up.shape == (4, 16) and moe.b_down.shape == (4, 16)
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    out = moe(x)
    routing = moe.router(x.reshape(-1, 16))
    ref = moe_experts_reference(x.reshape(-1, 16), routing.topk_ids, routing.topk_weights.double(), moe.w_gate_up,
                                moe.w_down, "geglu_tanh", b_gate_up=moe.b_gate_up, b_down=moe.b_down)
    torch.testing.assert_close(out.reshape(-1, 16), ref)
    out.sum().backward()
    assert moe.b_gate_up.grad is not None and moe.b_down.grad is not None
    assert not moeblaze.MoE(16, 8, 4, 2, activation="relu2").has_bias


def test_activation_names():
    assert set(GATED) == {"swiglu", "geglu", "geglu_tanh", "swiglu_clamped"}
    assert all(is_gated(a) == (a in GATED) for a in ACTIVATIONS)
    assert {"gelu_tanh", "relu2"} <= set(ACTIVATIONS)


# ------------------------------------------------------------------------------------------ GPU (bf16)

@gpu
@needs_cuda
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("save", ["preact", "input"])
def test_gpu_bf16_every_activation_with_bias(activation, save):
    check(make_inputs(256, 128, 96, 8, 2, activation, torch.bfloat16, device="cuda"), activation, save, "triton")


@gpu
@needs_cuda
@pytest.mark.parametrize("save", ["preact", "input"])
@pytest.mark.parametrize("shape", [(512, 128, 128, 8, 4), (300, 72, 40, 5, 1), (1000, 256, 192, 16, 2)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_gpt_oss_and_foreign(save, shape, dtype):
    """GPT-OSS layout (strided weights: pointer loads) with foreign ids, bf16 and fp32 (clamps active)."""
    T, d, h, E, K = shape
    limit = 0.8 if dtype == torch.float32 else 7.0
    inp = make_inputs(T, d, h, E, K, "swiglu_clamped", dtype, interleaved=True, foreign=True, device="cuda")
    check(inp, "swiglu_clamped", save, "triton", gate_up_interleaved=True, swiglu_limit=limit)


@gpu
@needs_cuda
@pytest.mark.parametrize("tma", ["1", "0"])
def test_gpu_bias_and_foreign_both_weight_read_modes(tma, monkeypatch):
    from test_experts_triton import pointer_reads

    if tma == "0":
        pointer_reads(monkeypatch)
    check(make_inputs(700, 128, 128, 4, 2, "swiglu", torch.bfloat16, foreign=True, device="cuda"), "swiglu", "preact",
          "triton")


@gpu
@needs_cuda
def test_gpu_foreign_dispatch_matches_cpu_build():
    ids = moeblaze.testing.make_routing(5000, 40, 8)
    ids[ids >= 32] = 32
    a = build_dispatch(ids.cuda(), 32, foreign_experts=True, block_m=128)
    b = build_dispatch(ids, 32, foreign_experts=True, block_m=128)
    for x, y in zip(a.tensors() + a.schedule.tensors(), b.tensors() + b.schedule.tensors()):
        assert torch.equal(x.cpu(), y), "foreign index differs between the Triton and the PyTorch build"


@needs_kernels
def test_torch_compile_fullgraph_with_every_feature():
    """Biases, the GPT-OSS layout and foreign ids through the custom ops' fake implementations."""
    inp = make_inputs(24, 16, 8, 3, 2, "swiglu_clamped", torch.float32, interleaved=True, foreign=True,
                      device=DEVICE)
    index = get_backend("triton", inp["x"]).plan(inp["topk_ids"], 3, foreign_experts=True)
    opts = dict(activation="swiglu_clamped", gate_up_interleaved=True, foreign_experts=True, backend="triton",
                index=index)

    def loss(x, w1, w2, b1, b2):
        out = moe_experts(x, inp["topk_ids"], inp["topk_weights"], w1, w2, b_gate_up=b1, b_down=b2, **opts)
        return out.square().sum()

    leaves = [inp[k].detach().clone().requires_grad_() for k in ("x", "w_gate_up", "w_down", "b_gate_up", "b_down")]
    eager = torch.autograd.grad(loss(*leaves), leaves)
    compiled = torch.compile(loss, fullgraph=True, backend="inductor" if HAS_CUDA else "aot_eager")
    for a, b in zip(torch.autograd.grad(compiled(*leaves), leaves), eager):
        torch.testing.assert_close(a, b)
