"""The fused router and token rounding in one autograd node (``Router.forward(..., rounding=...)``): the same
pairs, weights and gradients, bitwise, as the fused router followed by :func:`moeblaze.round_tokens` with the
Triton selections (interpreter on CPU, fp32), whose backward writes the dense top-k and score gradients."""

import pytest
import torch

from moeblaze import MoE, moe_experts_general, round_tokens, settings, token_rounding
from moeblaze.routing import Router
from moeblaze.testing import rel_error
from moeblaze.token_rounding import ROUNDING_MODES, Rounding


@pytest.fixture
def fused():
    with settings.override(backend="triton"):
        yield


def _route_then_round(router, x, mode, tile, seed):
    r = router(x)
    rt = round_tokens(r.scores, r.topk_ids, r.topk_weights, tile, mode, torch.Generator(x.device).manual_seed(seed),
                      router.routed_scaling_factor, r.counts)
    return r, rt


def _round_in_router(router, x, mode, tile, seed):
    r = router(x, rounding=Rounding(mode, tile, torch.Generator(x.device).manual_seed(seed)))
    assert r.rounded is not None
    return r, r.rounded


@pytest.mark.parametrize("mode", ROUNDING_MODES)
@pytest.mark.parametrize("renormalize,scale,others", [(True, 1.0, False), (False, 2.5, False), (True, 2.5, True)])
@pytest.mark.parametrize("device,shape", [("cpu", (150, 16, 8, 2, 8)),
                                          pytest.param("cuda", (16384, 256, 128, 2, 128), marks=pytest.mark.gpu)])
def test_router_node_equals_route_then_round_bitwise(mode, renormalize, scale, others, device, shape, fused):
    """Pairs, weights, counts and the gradients of x and the router's weight; ``others``: the loss also reads the
    router's top-k weights and scores (the node's dense backward path). On the GPU at issue 25's E 128 shape."""
    T, d, E, K, tile = shape
    torch.manual_seed(T + int(scale))
    router = Router(d, E, K, renormalize=renormalize, aux_loss_coef=0.1, z_loss_coef=0.01,
                    routed_scaling_factor=scale, device=device)
    x0 = torch.randn(T, d, device=device)
    c = torch.randn(T * K + (tile - 1) * E, device=device)  # more entries than P: sliced
    a, b = torch.randn(T, K, device=device), torch.randn(T, E, device=device)
    got = []
    for route in (_route_then_round, _round_in_router):
        x = x0.clone().requires_grad_()
        router.weight.grad = None
        r, rt = route(router, x, mode, tile, seed=3)
        loss = (rt.pair_weights * c[:rt.pair_weights.numel()]).sum() + r.loss
        if others:
            loss = loss + (r.topk_weights * a).sum() + (r.scores * b).sum()
        loss.backward()
        got.append((rt.token_idx, rt.expert_idx, rt.pair_weights.detach(), rt.counts, rt.pair_offsets, r.topk_ids,
                    r.loss.detach(), x.grad, router.weight.grad))
    assert int((got[0][1] == E).sum()) < got[0][1].numel()  # some pairs kept
    for i, (u, v) in enumerate(zip(*got)):
        assert u.dtype == v.dtype, i
        if device == "cuda" and i >= 7:
            # the gradients: two compiled variants of the router's backward kernel (dense or pair gradients)
            # contract their sums into FMAs differently on the GPU, a rounding apart in fp32
            assert rel_error(u, v) < 1e-6, i
        else:
            assert torch.equal(u, v), i


def test_router_without_fused_selections_leaves_rounding_to_the_caller(monkeypatch):
    """Off the fused selections (here the PyTorch ones: the Triton ones do not serve), ``rounded`` is None;
    eval-free callers round after."""
    monkeypatch.setattr(token_rounding, "_kernels_serve", lambda *a: False)
    router = Router(16, 8, 2)
    with settings.override(backend="triton"):
        assert router._fused(torch.zeros(40, 8))  # the fused router serves, its selections do not
        assert router(torch.randn(40, 16), rounding=Rounding("nr", 8)).rounded is None


@pytest.mark.parametrize("mode", ["nr", "sr"])
def test_layer_rounds_in_the_router_node(mode, fused, monkeypatch):
    """:class:`moeblaze.MoE` with token rounding takes the router's node (it never rounds after the router): output
    and every gradient as the router followed by round_tokens and the experts."""
    torch.manual_seed(0)
    kw = dict(d_model=16, d_ff=8, num_experts=4, top_k=2, backend="triton", renormalize=True, aux_loss_coef=0.1)
    layer = MoE(**kw, token_rounding=mode, rounding_tile=8, rounding_seed=7)
    x0, dout = torch.randn(37, 16), torch.randn(37, 16)
    x = x0.clone().requires_grad_()
    with monkeypatch.context() as m:
        m.setattr("moeblaze.layer.round_tokens_fused", lambda *a, **k: pytest.fail("rounded after the router"))
        (layer(x) * dout).sum().add(layer.aux_loss).backward()
    got = [x.grad, *(p.grad for p in layer.parameters())]
    layer.zero_grad()
    x = x0.clone().requires_grad_()
    r, rt = _route_then_round(layer.router, x, mode, 8, seed=7)
    out = moe_experts_general(x, rt.token_idx, rt.expert_idx, rt.pair_weights, layer.w1, layer.w_down,
                              backend="triton", foreign_experts=True)
    (out * dout).sum().add(r.loss).backward()
    expect = [x.grad, *(p.grad for p in layer.parameters())]
    for u, v in zip(got, expect):
        assert torch.equal(u, v)


@pytest.mark.parametrize("T,E,K,most,frac", [(13, 8, 2, 6, 1.0), (60, 8, 2, 5, 0.2), (40, 16, 3, 1, 1.0)])
def test_router_backward_reads_pair_gradients_as_the_dense_path(T, E, K, most, frac):
    """``router_topk_backward(..., pairs=...)`` equals the pair weights' dense backward followed by the router's
    (interpreter), with tokens of 0 to ``most`` padded pairs (a ``frac`` of the tokens): bitwise for tokens of at
    most 2 (read unrolled, in the tile's sums); within fp32 roundings past them (their share of ``<g, p>`` is
    summed after the tile's, and their columns rewritten)."""
    from moeblaze.kernels.pair_list import pair_weights_backward
    from moeblaze.kernels.router import router_topk, router_topk_backward

    gen = torch.Generator().manual_seed(T * E)
    ids, w, probs, lse, counts, _, _ = router_topk(torch.randn(T, E, generator=gen), K, True, 2.5, 0.1, 0.1)
    pads = torch.randint(0, most + 1, (T,), generator=gen) * (torch.rand(T, generator=gen) < frac)
    pads[T // 2] = most
    experts = []
    for t in range(T):
        free = [e for e in torch.randperm(E, generator=gen).tolist() if e not in ids[t].tolist()]
        experts += ids[t].tolist() + sorted(free[:int(pads[t])])
    n = K + pads
    pair_offsets = torch.cat((torch.zeros(1, dtype=torch.long), n.cumsum(0))).int()
    tail = 5  # unused entries past pair_offsets[T]
    expert_idx = torch.tensor(experts + [E] * tail, dtype=torch.int32)
    dw = torch.randn(expert_idx.numel(), generator=gen)
    daux, dz = torch.tensor(0.7), torch.tensor(-0.3)
    dtopk, dscores = pair_weights_backward(dw, pair_offsets, expert_idx, K, E, 2.5, torch.float32)
    dense = router_topk_backward(probs, ids, dtopk, dscores, counts, lse, daux, dz, True, 2.5, 0.1, 0.1)
    pairs = router_topk_backward(probs, ids, dw, None, counts, lse, daux, dz, True, 2.5, 0.1, 0.1,
                                 (pair_offsets, expert_idx))
    assert int(pads.max()) == most
    few = pads <= 2
    assert torch.equal(pairs[few], dense[few]) and rel_error(pairs, dense) < 1e-6
