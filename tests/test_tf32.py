"""TF32 operands (issue 27, ``moeblaze.kernels.tf32``): one pass that rounds fp32 to the nearest TF32 value
(ties to even), gathers rows and transposes, bitwise equal to the PyTorch bit arithmetic it replaces.
CPU: Triton's interpreter; GPU (``-m gpu``): the dense-storage rounding of :func:`round_tf32` in every layout
the launchers hand it, and the weight gradients through the K-major TF32 path at the layer's shapes."""

from __future__ import annotations

import os

import pytest
import torch

from moeblaze.kernels.tf32 import _round_tf32_torch, round_tf32, tf32_copy

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
pytestmark = pytest.mark.skipif(not HAS_CUDA and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="Triton kernels need CUDA or TRITON_INTERPRET=1")


def _values(*shape: int) -> torch.Tensor:
    """Random fp32 of many magnitudes, with exact ties (bit 12 set, low 12 bits clear) and specials."""
    x = torch.randn(*shape, device=DEVICE) * torch.logspace(-20, 20, shape[-1], device=DEVICE)
    bits = x.view(torch.int32)
    tie = bits & ~0x1FFF | 0x1000
    x = torch.where(torch.rand(shape, device=DEVICE) < 0.2, tie.view(torch.float32), x)
    special = torch.tensor([0.0, float("inf"), -1.5], device=DEVICE)
    x.view(-1)[: special.numel()] = special[: x.numel()]
    return x


@pytest.mark.parametrize("shape", [(70, 90), (3, 65, 130), (1, 1)])
def test_tf32_copy_rounds_gathers_and_transposes(shape):
    x = _values(*shape)
    want = _round_tf32_torch(x.clone())
    assert torch.equal(tf32_copy(x), want)
    assert torch.equal(tf32_copy(x, transpose=True), want.transpose(-1, -2))
    assert torch.equal(tf32_copy(x.transpose(-1, -2), transpose=True), want)  # a strided source
    rows = torch.randint(0, shape[-2], (2 * shape[-2] + 1,), device=DEVICE, dtype=torch.int32)
    if x.dim() == 2:
        assert torch.equal(tf32_copy(x, rows=rows), want[rows.long()])
        assert torch.equal(tf32_copy(x, rows=rows, transpose=True), want[rows.long()].t())


def test_tf32_copy_rejects_bad_input():
    with pytest.raises(TypeError, match="float32"):
        tf32_copy(torch.zeros(2, 2, dtype=torch.float16, device=DEVICE))
    with pytest.raises(ValueError, match=r"\[R, C\]"):
        tf32_copy(torch.zeros(2, device=DEVICE))


def test_round_tf32_keeps_the_layout():
    x = _values(4, 48, 40).transpose(1, 2)  # GPT-OSS-style transposed weight view
    got = round_tf32(x)
    assert got.stride() == x.stride() and torch.equal(got, _round_tf32_torch(x.contiguous()))
    sliced = x[:, ::2]  # not dense: the PyTorch fallback, same values
    assert torch.equal(round_tf32(sliced), _round_tf32_torch(sliced.contiguous()))


@pytest.mark.parametrize("foreign", [False, True])
def test_k_major_weight_gradient_matches_the_gathered_one(foreign):
    """The TF32 wgrad path (padded slot-contiguous copies, ``GATHER_A=False``) against the gathered kernel on
    the same TF32-rounded operands: equal up to the fp32 summation (empty experts, ranges of any length)."""
    from moeblaze import build_dispatch
    from moeblaze.kernels.launch import grouped_wgrad

    T, K, E, p, q = 150, 2, 6, 48, 40
    experts = torch.tensor([e for e in range(E + 2 * foreign) if e != 1])  # expert 1 left empty
    ids = torch.stack([experts[torch.randperm(len(experts))[:K]] for _ in range(T)]).to(DEVICE)
    index = build_dispatch(ids, E, foreign_experts=foreign)
    off = index.local_offsets
    a, b = torch.randn(T, p, device=DEVICE), torch.randn(index.num_pairs, q, device=DEVICE)
    b[int(off[-1]):] = float("nan")  # foreign slots hold garbage the kernels never read
    ra, rb = _round_tf32_torch(a.clone()), _round_tf32_torch(b.clone())
    want = grouped_wgrad(ra, rb, off, index.expert_token_indices, p=p, q=q, out_dtype=torch.float32,
                         slot_desc=False, k_major=False)
    got = grouped_wgrad(a, b, off, index.expert_token_indices, p=p, q=q, out_dtype=torch.float32, k_major=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("foreign", [False, True])
def test_gpu_tf32_weight_gradients_match_torch_tf32(foreign):
    """The K-major TF32 wgrad (gathered, transposed copies) and B1/B3 (transposed weight copies) against the
    float64 reference, within 2x torch's own TF32 error, with and without foreign experts."""
    from moeblaze import moe_experts
    from moeblaze.testing import assert_close_to_reference, make_expert_inputs, reference_outputs, run_and_grad

    E = 8
    inputs = make_expert_inputs(1000, 256, 192, E + 2 * foreign, 2, "swiglu", device="cuda")
    if foreign:  # ids of the two extra experts become foreign ids (of other ranks), their weights dropped
        inputs["w_gate_up"], inputs["w_down"] = inputs["w_gate_up"][:E].contiguous(), inputs["w_down"][:E].contiguous()
    dout = torch.randn(1000, 256, device="cuda")
    ref = reference_outputs(inputs, "swiglu", dout)  # ids >= E add nothing there
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        got = run_and_grad(lambda **kw: moe_experts(**kw, backend="triton", foreign_experts=foreign), inputs, dout)
        base = run_and_grad(lambda **kw: moe_experts(**kw, backend="torch", foreign_experts=foreign), inputs, dout)
    finally:
        torch.set_float32_matmul_precision(before)
    for name, a, r, b in zip(("out", "dx", "dw_gate_up", "dw_down"), got, ref, base):
        assert_close_to_reference(f"tf32 {name}", a, r, b)


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_gpu_tf32_producers_store_rounded_operands(activation):
    """F1's ``act`` and the activation backward's ``dpre`` come out TF32-rounded (the A operands F2 and B3 then
    read without a copy): no low mantissa bit set, each value the nearest TF32 value of the unrounded one."""
    from moeblaze import build_dispatch
    from moeblaze.activations import activation_forward
    from moeblaze.kernels.experts import down_backward, up_forward

    T, K, E, d, h = 300, 2, 5, 128, 96
    rows = 2 * h if activation == "swiglu" else h
    index = build_dispatch(torch.rand(T, E).argsort(dim=1)[:, :K].to(DEVICE), E)  # distinct ids per row
    x, w1 = torch.randn(T, d, device=DEVICE), torch.randn(E, rows, d, device=DEVICE) / d**0.5
    w2, dout = torch.randn(E, d, h, device=DEVICE) / h**0.5, torch.randn(T, d, device=DEVICE)
    weights = torch.rand(T, K, device=DEVICE)
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        pre, act = up_forward(x, w1, index, activation, store_pre=True, store_act=True)
        unrounded = activation_forward(pre, activation)
        dpre, _, _ = down_backward(dout, pre.clone(), w2, weights, index, activation, False, False)
    finally:
        torch.set_float32_matmul_precision(before)
    for name, t in (("act", act), ("dpre", dpre)):
        assert not (t.view(torch.int32) & 0x1FFF).any(), f"{name} holds bits below TF32's mantissa"
    torch.testing.assert_close(act, _round_tf32_torch(unrounded.clone()), rtol=2**-10, atol=1e-6)
