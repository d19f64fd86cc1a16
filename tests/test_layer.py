import pytest
import torch

import moeblaze
from moeblaze import MoE, moe_experts_reference


@pytest.mark.parametrize("activation,rows", [("swiglu", 24), ("relu", 12)])
def test_parameters_follow_design_layout(activation, rows):
    m = MoE(16, 12, 5, 2, activation=activation)
    shapes = {n: tuple(p.shape) for n, p in m.named_parameters()}
    w1 = "w_gate_up" if activation == "swiglu" else "w_up"
    assert shapes == {"router.weight": (5, 16), w1: (5, rows, 16), "w_down": (5, 16, 12)}
    assert m.w1 is getattr(m, w1)


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("save", ["preact", "input"])
def test_module_matches_reference_in_float64(score_func, save):
    torch.manual_seed(1)
    m = MoE(16, 12, 6, 2, score_func=score_func, save=save, aux_loss_coef=0.1, z_loss_coef=0.01,
            dtype=torch.float64)
    x = torch.randn(3, 11, 16, dtype=torch.float64, requires_grad=True)
    out = m(x)
    assert out.shape == x.shape and out.dtype == x.dtype
    go = torch.randn_like(out)
    grads = torch.autograd.grad((out * go).sum() + m.aux_loss, [x, *m.parameters()])

    routing = m.router(x.reshape(-1, 16))  # the same routing, differentiable through the router
    ref = moe_experts_reference(x.reshape(-1, 16), routing.topk_ids, routing.topk_weights.double(),
                                m.w_gate_up, m.w_down).reshape(x.shape)
    ref_grads = torch.autograd.grad((ref * go).sum() + routing.loss, [x, *m.parameters()])
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    for g, r in zip(grads, ref_grads):  # x, router.weight, w_gate_up, w_down
        torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-11)
    assert m.aux_loss.item() > 0 and m.last_topk_ids.shape == (33, 2)


def test_aux_loss_gradient_reaches_router_and_sum_over_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(MoE(8, 8, 4, 1, aux_loss_coef=1.0), MoE(8, 8, 4, 1, aux_loss_coef=1.0))
    model(torch.randn(20, 8))
    total = moeblaze.aux_loss(model)
    assert total.item() == pytest.approx(sum(m.aux_loss.item() for m in model))
    total.backward()
    assert model[0].router.weight.grad.abs().sum() > 0


def test_a_trained_layer_copies_and_pickles_with_its_aux_loss_detached():
    """After a training forward the layer keeps aux_loss inside the step's graph; copy.deepcopy (an EMA or
    reference copy) raised on it ("Only Tensors created explicitly by the user ... deepcopy")."""
    import copy
    import io

    layer = MoE(16, 8, 4, 2)
    (layer(torch.randn(5, 16)).sum() + layer.aux_loss).backward()
    assert layer.aux_loss.grad_fn is not None
    copied = copy.deepcopy(layer)
    buf = io.BytesIO()
    torch.save(layer, buf)
    buf.seek(0)
    for other in (copied, torch.load(buf, weights_only=False)):
        assert other.aux_loss.grad_fn is None and torch.equal(other.aux_loss, layer.aux_loss.detach())
        assert all(torch.equal(a, b) for a, b in zip(other.state_dict().values(), layer.state_dict().values()))
    assert layer.aux_loss.grad_fn is not None  # the layer itself keeps its graph


def test_module_trains_on_a_tiny_regression():
    torch.manual_seed(0)
    m = MoE(8, 16, 4, 2)
    x, y = torch.randn(64, 8), torch.randn(64, 8)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    first = None
    for _ in range(60):
        loss = torch.nn.functional.mse_loss(m(x), y) + m.aux_loss
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.7 * first


def test_module_bad_config_and_input():
    with pytest.raises(ValueError, match="activation"):
        MoE(8, 8, 4, 2, activation="swish")
    with pytest.raises(ValueError, match="save"):
        MoE(8, 8, 4, 2, save="all")
    with pytest.raises(ValueError, match="top_k"):
        MoE(8, 8, 4, 8)
    with pytest.raises(ValueError, match="d_ff"):
        MoE(8, 0, 4, 2)
    with pytest.raises(ValueError, match="d_model=8"):
        MoE(8, 8, 4, 2)(torch.randn(2, 7))
