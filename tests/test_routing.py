import math

import pytest
import torch

from moeblaze import Router, load_balancing_loss, router_z_loss


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("renormalize", [None, True, False])
def test_router_matches_plain_topk(score_func, renormalize):
    T, d, E, K = 29, 16, 7, 3
    r = Router(d, E, K, score_func=score_func, renormalize=renormalize)
    x = torch.randn(T, d, dtype=torch.bfloat16)
    out = r(x)
    logits = x.double() @ r.weight.double().t()
    torch.testing.assert_close(out.logits.double(), logits, rtol=1e-5, atol=1e-5)
    scores = torch.softmax(logits, -1) if score_func == "softmax" else torch.sigmoid(logits)
    w, ids = scores.topk(K, dim=-1)
    if r.renormalize:
        w = w / w.sum(-1, keepdim=True)
    assert out.topk_ids.dtype == torch.int32 and out.topk_ids.shape == (T, K)
    assert torch.equal(out.topk_ids.long(), ids)
    assert out.topk_weights.dtype == torch.float32
    torch.testing.assert_close(out.topk_weights.double(), w, rtol=1e-5, atol=1e-6)
    assert r.renormalize == (score_func == "sigmoid" if renormalize is None else renormalize)


def test_router_gradients_flow_in_fp32_and_keep_input_dtype():
    r = Router(8, 4, 2, aux_loss_coef=0.1, z_loss_coef=0.01)
    x = torch.randn(10, 8, dtype=torch.bfloat16, requires_grad=True)
    out = r(x)
    (out.topk_weights.sum() + out.loss).backward()
    assert x.grad.dtype == torch.bfloat16 and r.weight.grad.dtype == torch.float32
    assert torch.isfinite(r.weight.grad).all() and r.weight.grad.abs().sum() > 0


def test_load_balancing_loss_values():
    E = 4
    probs = torch.full((8, E), 1.0 / E)
    ids = torch.arange(8).remainder(E)[:, None]
    assert load_balancing_loss(probs, ids).item() == pytest.approx(1.0)  # perfect balance -> 1
    skew = torch.zeros(8, E)
    skew[:, 0] = 1.0
    assert load_balancing_loss(skew, torch.zeros(8, 1, dtype=torch.long)).item() == pytest.approx(E)


def test_z_loss_value():
    logits = torch.tensor([[0.0, 0.0], [1.0, -1.0]])
    expect = (math.log(2) ** 2 + math.log(math.e + 1 / math.e) ** 2) / 2
    assert router_z_loss(logits).item() == pytest.approx(expect, rel=1e-6)


def test_losses_scaled_by_coefficients_and_off_in_eval():
    torch.manual_seed(0)
    r = Router(8, 4, 2, aux_loss_coef=0.5, z_loss_coef=0.25)
    x = torch.randn(16, 8)
    out = r(x)
    probs = torch.softmax(out.logits, -1)
    assert out.aux_loss.item() == pytest.approx(0.5 * load_balancing_loss(probs, out.topk_ids).item(), rel=1e-6)
    assert out.z_loss.item() == pytest.approx(0.25 * router_z_loss(out.logits).item(), rel=1e-6)
    r.eval()
    assert r(x).loss.item() == 0.0


def test_sigmoid_router_aux_loss_uses_normalised_scores():
    """Sigmoid routers balance with the scores normalised per token (the probabilities the loss assumes):
    E * sum_e f_e * mean_t (s[t, e] / sum_e' s[t, e']), written out by hand."""
    torch.manual_seed(1)
    E, K, T = 6, 2, 20
    r = Router(8, E, K, score_func="sigmoid", aux_loss_coef=1.0)
    out = r(torch.randn(T, 8))
    s = torch.sigmoid(out.logits.double())
    p = (s / s.sum(-1, keepdim=True)).mean(0)
    f = torch.bincount(out.topk_ids.flatten().long(), minlength=E).double() / (T * K)
    assert out.aux_loss.item() == pytest.approx(E * float((f * p).sum()), rel=1e-5)


def test_router_bad_arguments():
    with pytest.raises(ValueError, match="score_func"):
        Router(8, 4, 2, score_func="tanh")
    with pytest.raises(ValueError, match="top_k"):
        Router(8, 4, 5)
    with pytest.raises(ValueError, match=r"\[T, d=8\]"):
        Router(8, 4, 2)(torch.randn(3, 7))


def test_empty_batch_gives_zero_losses_not_nan():
    r = Router(8, 4, 2, aux_loss_coef=0.1, z_loss_coef=0.1)
    out = r(torch.randn(0, 8))
    assert out.topk_ids.shape == (0, 2) and out.loss.item() == 0.0


def test_router_sizes_must_be_positive_ints():
    with pytest.raises(ValueError, match="d_model"):
        Router(0, 4, 2)
    with pytest.raises(ValueError, match="top_k"):
        Router(8, 4, 2.0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_router_16bit_tensor_core_path_keeps_fp32_math(dtype):
    """CUDA + 16-bit x and weight: logits from one tensor-core GEMM with fp32 output, gradients from a
    two-term split of dlogits — both as close to float64 as fp32 math (logits) or one final rounding
    to ``dtype`` (gradients)."""
    from moeblaze.testing import rel_error

    T, d, E, K = 1000, 256, 64, 8
    r = Router(d, E, K, device="cuda", dtype=dtype)
    x = torch.randn(T, d, device="cuda", dtype=dtype, requires_grad=True)
    out = r(x)
    assert out.logits.dtype == torch.float32
    assert rel_error(out.logits, x.double() @ r.weight.double().t()) < 1e-5
    g = torch.randn(T, E, device="cuda")
    out.logits.backward(g)
    eps = torch.finfo(dtype).eps
    assert x.grad.dtype == dtype and r.weight.grad.dtype == dtype
    assert rel_error(x.grad, g.double() @ r.weight.double()) < eps
    assert rel_error(r.weight.grad, g.double().t() @ x.double()) < eps
