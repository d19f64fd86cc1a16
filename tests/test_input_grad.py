"""moeblaze.input_grad: the router and the experts sum x's gradient in place, not through autograd's addition."""

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import moeblaze
import moeblaze.layer

T, D, H, E, K = 96, 16, 8, 8, 2


def _layer(**kw) -> moeblaze.MoE:
    torch.manual_seed(0)
    return moeblaze.MoE(D, H, E, K, backend="torch", dtype=torch.float64, **kw)


def _grads(moe, x, loss_fn, share: bool, monkeypatch):
    """x's gradient and the autograd additions of a [T, d] tensor seen by the profiler, sharing on or off."""
    if not share:
        monkeypatch.setattr(moeblaze.layer, "SharedInputGrad", lambda: None)
    x.grad = None
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        loss_fn(moe, moe(x)).backward()
    monkeypatch.undo()
    adds = sum(e.count for e in prof.key_averages(group_by_input_shape=True)
               if e.key in ("aten::add", "aten::add_") and e.input_shapes[:2] == [list(x.shape)] * 2)
    return x.grad.clone(), adds


LOSSES = {
    "output and aux loss": lambda moe, out: out.square().sum() + moe.aux_loss,
    "aux loss only": lambda moe, out: moe.aux_loss,  # the experts' backward never runs
}


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("kw", [{}, {"save": "input"}, {"token_rounding": "nr", "rounding_tile": 8},
                                {"shared_d_ff": 8}], ids=["preact", "input", "token-rounding", "shared-experts"])
def test_shared_input_grad_equals_autograd_sum(loss, kw, monkeypatch):
    """Bitwise autograd's sum of the router's and the experts' dx (fp64, torch backend: the router's fp32-math
    path adds its dx into the experts' in place, where autograd added the two)."""
    moe = _layer(**kw)
    x = torch.randn(T, D, dtype=torch.float64, requires_grad=True)
    want, adds_before = _grads(moe, x, LOSSES[loss], False, monkeypatch)
    got, adds_after = _grads(moe, x, LOSSES[loss], True, monkeypatch)
    assert torch.equal(got, want) and want.abs().max() > 0
    # the router's fp32-math path adds in place where autograd added; shared experts: a third reader, no sharing
    assert adds_after == adds_before
    assert "shared_d_ff" in kw or adds_before == (loss == "output and aux loss")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("save", ["preact", "input"])
def test_gpu_router_adds_its_dx_in_its_gemm(save, monkeypatch):
    """bf16 on the GPU: the router's dx GEMM accumulates into the experts' dx (beta = 1): no [T, d] addition in
    the backward, and x's gradient within one bf16 rounding of autograd's sum."""
    torch.manual_seed(0)
    moe = moeblaze.MoE(64, 32, E, K, device="cuda", dtype=torch.bfloat16, save=save)
    x = torch.randn(512, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    want, adds_before = _grads(moe, x, LOSSES["output and aux loss"], False, monkeypatch)
    got, adds_after = _grads(moe, x, LOSSES["output and aux loss"], True, monkeypatch)
    assert adds_before == 1 and adds_after == 0
    assert (got.float() - want.float()).abs().max() <= 2 ** -7 * want.float().abs().max()


def test_retained_graph_second_pass_and_frozen_router():
    """A retain_graph second backward starts its own sum (the same gradient again); a router without a
    weight gradient still gives x both contributions."""
    moe = _layer()
    x = torch.randn(T, D, dtype=torch.float64, requires_grad=True)
    loss = moe(x).square().sum()
    loss.backward(retain_graph=True)
    first = x.grad.clone()
    x.grad = None
    loss.backward()
    assert torch.equal(x.grad, first)
    moe.router.weight.requires_grad_(False)
    x.grad = None
    moe(x).square().sum().backward()
    assert torch.equal(x.grad, first)


def test_no_sharing_under_no_grad_or_expert_parallel_inputs():
    """No share where x needs no gradient; a cast between router and experts (another tensor) does not share."""
    share = moeblaze.input_grad.SharedInputGrad()
    a, b = torch.zeros(2, 2), torch.zeros(2, 2)
    assert share.bind(a) is share and share.bind(a) is share and share.bind(b) is None
    assert share.offer(None) is None and share.take() is None


def test_no_gradient_kept_after_the_layer_backward(monkeypatch):
    """The share drops its reference once the second Function has added: a model's layers do not each keep a
    [T, d] gradient alive until the end of the backward (their autograd nodes, which hold the shares, do)."""
    shares = []

    def record():
        shares.append(moeblaze.input_grad.SharedInputGrad())
        return shares[-1]

    monkeypatch.setattr(moeblaze.layer, "SharedInputGrad", record)
    layers = [_layer() for _ in range(3)]
    x = h = torch.randn(T, D, dtype=torch.float64, requires_grad=True)
    for moe in layers:
        h = h + moe(h)
    h.square().sum().backward()
    assert len(shares) == 3 and all(s._dx is None for s in shares) and x.grad.abs().max() > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_stack_peak_memory_not_raised(monkeypatch):
    """A 4-layer bf16 stack's peak with the shared input gradient is at most its peak without it."""
    torch.manual_seed(0)
    layers = [moeblaze.MoE(256, 128, 8, 2, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    x = torch.randn(4096, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def peak(share: bool) -> int:
        if not share:
            monkeypatch.setattr(moeblaze.layer, "SharedInputGrad", lambda: None)
        h = x
        for moe in layers:
            h = h + moe(h)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        h.float().square().sum().backward()
        torch.cuda.synchronize()
        monkeypatch.undo()
        x.grad = None
        for moe in layers:
            moe.zero_grad(set_to_none=True)
        return torch.cuda.max_memory_allocated()

    peak(True)  # warm-up: kernels compiled, allocator blocks cached
    assert peak(True) <= peak(False)


@pytest.mark.parametrize("mode", ["checkpoint", "checkpoint-reentrant", "accumulation", "autocast"])
def test_shared_input_grad_under_training_wrappers(mode, monkeypatch):
    """Activation checkpointing (both modes), two micro-batches into one .grad, and autocast over fp32 weights:
    every gradient bitwise what autograd's own sum gives."""
    from torch.utils.checkpoint import checkpoint

    dtype = torch.float32 if mode == "autocast" else torch.float64
    torch.manual_seed(0)
    moe = moeblaze.MoE(D, H, E, K, backend="torch", dtype=dtype)
    x = torch.randn(T, D, dtype=dtype, requires_grad=True)

    def grads(share: bool):
        if not share:
            monkeypatch.setattr(moeblaze.layer, "SharedInputGrad", lambda: None)
        x.grad = None
        moe.zero_grad(set_to_none=True)
        if mode.startswith("checkpoint"):
            out = checkpoint(moe, x, use_reentrant=mode.endswith("reentrant"))
        elif mode == "accumulation":
            (moe(x[: T // 2]).square().sum() + moe.aux_loss).backward()
            out = moe(x[T // 2:])
        else:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = moe(x).float()
        (out.square().sum() + moe.aux_loss).backward()
        monkeypatch.undo()
        return [x.grad.clone(), *(p.grad.clone() for p in moe.parameters())]

    want, got = grads(False), grads(True)
    assert all(torch.equal(a, b) for a, b in zip(got, want)) and want[0].abs().max() > 0
