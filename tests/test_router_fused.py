"""The Triton softmax top-k router (``moeblaze.kernels.router``; ``backend`` setting ``triton``) against the float64
reference under the DESIGN.md §7 rule, with the PyTorch router in fp32 as the baseline.

CPU: the kernels run in the interpreter (fp32 logits throughout, so nothing here meets the bf16 ``tl.dot``
trap). GPU (``-m gpu``): the layer in bf16 with the fused router (the default on CUDA) against the PyTorch
router, and the CUDA-graph replay equals eager bitwise.
"""

from __future__ import annotations

import pytest
import torch

import moeblaze
from moeblaze import MoE, Router, settings
from moeblaze.kernels import router as fused_router
from moeblaze.kernels.router import MAX_EXPERTS, router_topk
from moeblaze.testing import assert_close_to_reference


def _reference(logits64: torch.Tensor, ids: torch.Tensor, K: int, renorm: bool, scale: float, aux_coef: float,
               z_coef: float):
    """float64 weights, probabilities and losses of the given routing (ids chosen by the router under test)."""
    T, E = logits64.shape
    probs = torch.softmax(logits64, -1)
    sel = probs.gather(1, ids.long())
    w = (sel / sel.sum(-1, keepdim=True).clamp_min(1e-20) if renorm else sel) * scale
    counts = torch.zeros(E, dtype=torch.float64).index_add_(0, ids.long().reshape(-1),
                                                             torch.ones(T * K, dtype=torch.float64))
    aux = aux_coef * E / (T * K * T) * (counts @ probs.sum(0))
    z = z_coef / T * (torch.logsumexp(logits64, -1) ** 2).sum()
    return w, probs, aux, z


def _route(router: Router, x: torch.Tensor, fused: bool):
    with settings.override(backend="triton" if fused else "torch"):
        return router(x)


@pytest.mark.parametrize("T,E,K", [(1, 4, 1), (37, 12, 3), (64, 7, 7), (50, 128, 8), (9, 257, 4)])
@pytest.mark.parametrize("renorm,scale", [(False, 1.0), (True, 1.0), (True, 2.5)])
def test_fused_router_matches_reference(T, E, K, renorm, scale):
    torch.manual_seed(T * 1000 + E + K)
    d = 24
    router = Router(d, E, K, renormalize=renorm, aux_loss_coef=0.3, z_loss_coef=0.07, routed_scaling_factor=scale)
    x = torch.randn(T, d)
    got, base = _route(router, x, True), _route(router, x, False)
    assert got.topk_ids.dtype == torch.int32 and torch.equal(got.topk_ids, base.topk_ids)
    w64, p64, aux64, z64 = _reference(got.logits.double(), got.topk_ids, K, renorm, scale, 0.3, 0.07)
    assert_close_to_reference("weights", got.topk_weights, w64, base.topk_weights)
    assert_close_to_reference("scores", got.scores, p64, base.scores)
    assert_close_to_reference("aux", got.aux_loss, aux64, base.aux_loss)
    assert_close_to_reference("z", got.z_loss, z64, base.z_loss)


# every (renorm, losses) pair at the small shape; at the second (4 blocks of 16 tokens, E > 128: 15 s a case in
# the interpreter) each loss set once, both renorm values among them
_LOSSES = [(0.3, 0.07), (0.0, 0.07), (0.3, 0.0)]


@pytest.mark.parametrize("renorm, losses, T, E, K",
                         [(r, lo, 45, 10, 3) for r in (False, True) for lo in _LOSSES]
                         + [(False, _LOSSES[0], 70, 200, 5), (True, _LOSSES[1], 70, 200, 5),
                            (False, _LOSSES[2], 70, 200, 5)])
def test_fused_router_gradients_match_reference(renorm, losses, T, E, K):
    torch.manual_seed(int(renorm) + int(10 * losses[0]) + E)
    d = 16
    router = Router(d, E, K, renormalize=renorm, aux_loss_coef=losses[0], z_loss_coef=losses[1],
                    routed_scaling_factor=1.5)
    x = torch.randn(T, d)
    dw, dp = torch.randn(T, K), torch.randn(T, E)

    def grads(fused: bool):
        xx = x.clone().requires_grad_()
        router.weight.grad = None
        out = _route(router, xx, fused)
        ((out.topk_weights * dw).sum() + (out.scores * dp).sum() + 0.9 * out.aux_loss + 1.1 * out.z_loss).backward()
        return out.topk_ids, xx.grad, router.weight.grad.clone()

    ids, gx, gw = grads(True)
    _, bx, bw = grads(False)
    x64, w64 = x.double().requires_grad_(), router.weight.detach().double().requires_grad_()
    logits = x64 @ w64.t()
    w, p, aux, z = _reference(logits, ids, K, renorm, 1.5, *losses)
    ((w * dw.double()).sum() + (p * dp.double()).sum() + 0.9 * aux + 1.1 * z).backward()
    assert_close_to_reference("dx", gx, x64.grad, bx)
    assert_close_to_reference("dW_router", gw, w64.grad, bw)


def test_only_the_weights_gradient_and_eval_mode():
    torch.manual_seed(3)
    router = Router(8, 6, 2, aux_loss_coef=0.5, z_loss_coef=0.5)
    x = torch.randn(20, 8, requires_grad=True)
    out = _route(router, x, True)
    out.topk_weights.square().sum().backward()  # the losses and scores get no gradient
    ref = x.detach().clone().requires_grad_()
    _route(router, ref, False).topk_weights.square().sum().backward()
    assert_close_to_reference("dx", x.grad, ref.grad.double(), ref.grad, factor=4.0)
    router.eval()
    out = _route(router, x, True)
    assert out.aux_loss.item() == 0.0 and out.z_loss.item() == 0.0 and not out.aux_loss.requires_grad


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("aux_c,z_c", [(0.3, 0.0), (0.0, 0.2), (0.0, 0.0), (0.3, 0.2)])
def test_losses_that_are_off_are_exact_zeros_and_add_nothing(fused, aux_c, z_c):
    """A loss whose coefficient is 0 is an exact 0 without a gradient, and ``loss`` is the other term itself (no
    launch adds a zero); with both on, their sum; with both off, a zero. Logits of 8e28 make ``lse^2`` overflow:
    the z-loss that is off stays 0, not ``0 * inf``."""
    torch.manual_seed(5)
    router = Router(8, 6, 2, aux_loss_coef=aux_c, z_loss_coef=z_c)
    x = torch.randn(20, 8, requires_grad=True)
    out = _route(router, x, fused)
    for loss, c in ((out.aux_loss, aux_c), (out.z_loss, z_c)):
        assert (loss.requires_grad and loss.item() > 0) if c else (loss.item() == 0.0 and not loss.requires_grad)
    if aux_c and z_c:
        assert torch.equal(out.loss, out.aux_loss + out.z_loss)
    else:
        assert out.loss is (out.z_loss if z_c else out.aux_loss)
    if fused and not z_c:
        with torch.no_grad():
            router.weight.fill_(1e28)
        assert _route(router, torch.ones(4, 8), fused).z_loss.item() == 0.0


def test_backward_of_probabilities_alone_and_of_a_vanishing_renormalisation_sum():
    """The backward kernel's formula on given probabilities: only the scores get a gradient (token rounding's
    padded pairs), or only the weights, with rows whose chosen probabilities sum below the 1e-20 clamp of the
    renormalisation (its denominator is then the clamp, with no gradient through it). A softmax never gets
    there (its top-K sum to >= K/E); the kernel takes probabilities as they come."""
    from moeblaze.kernels.router import router_topk_backward

    torch.manual_seed(6)
    T, E, K = 24, 9, 2
    probs = torch.rand(T, E) + 0.05
    probs[:4] *= 1e-25  # rows 0-3: the chosen pair sums to ~1e-25
    ids = probs.topk(K, -1).indices.int()
    dw, dp = torch.randn(T, K), torch.randn(T, E)
    zeros = torch.zeros(E), torch.zeros(T)
    for use_w, use_p in ((False, True), (True, False)):
        p64 = probs.double().requires_grad_()
        sel = p64.gather(1, ids.long())
        w64 = sel / sel.sum(-1, keepdim=True).clamp_min(1e-20)
        (g,) = torch.autograd.grad((w64 * dw.double()).sum() * use_w + (p64 * dp.double()).sum() * use_p, p64)
        want = p64.detach() * (g - (g * p64.detach()).sum(-1, keepdim=True))  # the softmax backward
        got = router_topk_backward(probs, ids, dw if use_w else None, dp if use_p else None, *zeros, None, None,
                                   True, 1.0, 0.0, 0.0)
        row_err = (got.double() - want).norm(dim=1) / want.norm(dim=1)  # per row: rows 0-3 are ~1e-5 in size
        assert bool((row_err < 1e-5).all()), row_err


def test_ties_and_nan_logits_give_distinct_ids_in_range():
    logits = torch.zeros(6, 9)
    logits[1] = float("nan")
    logits[2, 4] = float("nan")
    logits[3] = -float("inf")
    logits[3, 2] = 0.0
    ids, w, probs, lse, counts, *_ = router_topk(logits, 4)
    for row in ids.tolist():
        assert len(set(row)) == 4 and all(0 <= e < 9 for e in row)
    assert ids[0].tolist() == [0, 1, 2, 3]  # equal probabilities: lowest ids first
    assert ids[3, 0].item() == 2
    assert torch.isnan(w[1]).all() and torch.isnan(w[2]).all()  # a NaN logit: a NaN row, as torch.topk gives
    assert torch.isfinite(w[[0, 3, 4, 5]]).all()
    assert counts.sum().item() == 6 * 4
    assert torch.equal(counts, torch.bincount(ids.flatten().long(), minlength=9).float())


def test_empty_batch_and_bad_input():
    ids, w, probs, lse, counts, aux, z = router_topk(torch.zeros(0, 5), 2, aux_c=1.0, z_c=1.0)
    assert ids.shape == (0, 2) and counts.sum().item() == 0 and aux.item() == 0 and z.item() == 0
    with pytest.raises(ValueError, match="logits must be"):
        router_topk(torch.zeros(4, 5, dtype=torch.float64), 2)
    with pytest.raises(ValueError, match="top_k"):
        router_topk(torch.zeros(4, 5), 6)
    with pytest.raises(ValueError, match="E <="):
        router_topk(torch.zeros(1, MAX_EXPERTS + 1), 2)
    with pytest.raises(ValueError, match="top_k <= 16"):
        router_topk(torch.zeros(3, 40), 17)


def test_routers_the_kernels_do_not_serve_take_the_pytorch_path(monkeypatch):
    applied = []
    monkeypatch.setattr(moeblaze.routing._FusedTopK, "apply", lambda *a: applied.append(a))
    for E, K, kw in ((8, 2, dict(score_func="sigmoid")), (8, 2, dict(n_group=2, topk_group=1)),
                     (8, 2, dict(score_correction_bias=True)), (40, 17, {})):
        router = Router(8, E, K, **kw)
        with settings.override(backend="triton"):
            out = router(torch.randn(5, 8))
        assert out.topk_ids.shape == (5, K) and applied == []


@pytest.mark.parametrize("selections", ["kernels", "torch"])
def test_layer_with_token_rounding_uses_the_fused_scores(selections, monkeypatch):
    """Token rounding pads with the router's scores: the layer trains the same with either router. The fused
    router rounds in its own node with the Triton selections; without them (``torch``: they do not serve), the
    layer rounds after the router, with the PyTorch selections on the fused router's scores."""
    torch.manual_seed(4)
    layer = MoE(16, 8, 4, 2, backend="torch", token_rounding="nr", rounding_tile=4, aux_loss_coef=0.1)
    x = torch.randn(23, 16)

    def run(backend):
        xx = x.clone().requires_grad_()
        for p in layer.parameters():
            p.grad = None
        with settings.override(backend=backend):
            (layer(xx).square().sum() + layer.aux_loss).backward()
        return [xx.grad] + [p.grad.clone() for p in layer.parameters()]

    want = run("torch")
    if selections == "torch":
        monkeypatch.setattr(moeblaze.token_rounding, "_kernels_serve", lambda *a: False)
    for got, w in zip(run("triton"), want):
        torch.testing.assert_close(got, w, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
def test_gpu_fused_router_layer_matches_pytorch_router_bf16():
    torch.manual_seed(5)
    layer = moeblaze.MoE(512, 256, 64, 8, backend="triton", device="cuda", dtype=torch.bfloat16, aux_loss_coef=0.01,
                         z_loss_coef=0.001)
    x = torch.randn(4096, 512, device="cuda", dtype=torch.bfloat16)

    def run(fused):
        xx = x.clone().requires_grad_()
        for p in layer.parameters():
            p.grad = None
        with settings.override(backend="triton" if fused else "torch"):
            out = layer(xx)
            (out.float().square().mean() + layer.aux_loss).backward()
        return layer.last_topk_ids.clone(), [out.float(), xx.grad.float(), layer.router.weight.grad.float()]

    ids_f, got = run(True)
    ids_t, want = run(False)
    assert (ids_f == ids_t).float().mean() > 0.99  # bf16 near-ties may order differently
    for g, w in zip(got, want):
        assert (g - w).norm() / w.norm() < 0.05


def test_bench_router_smoke(tmp_path):
    """``benchmarks/bench_router.py --smoke``: both paths (and a warp override) timed, rows written."""
    import csv
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_router.py"
    spec = importlib.util.spec_from_file_location("bench_router", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    default = fused_router._topk_warps
    assert bench.main(["--smoke", "--warps", "8", "--out", str(tmp_path / "r.csv")]) == 0
    assert fused_router._topk_warps is default
    with open(tmp_path / "r.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["path"] for r in rows] == ["torch", "fused", "fused-8-warps"]
    assert all(float(r["wall_ms"]) > 0 for r in rows)


def _split16_reference(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The four PyTorch operations the split kernel replaces."""
    E = t.shape[1]
    hl = t.new_empty(t.shape[0], 2 * E, dtype=dtype)
    hl[:, :E] = t
    hl[:, E:] = t - hl[:, :E].float()
    return hl


@pytest.mark.parametrize("dtype", [torch.float16, pytest.param(torch.bfloat16, marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="the interpreter truncates to bf16")])])
@pytest.mark.parametrize("T,E", [(1, 3), (37, 128), (5, 257)])
def test_split16_equals_the_pytorch_split_bitwise(dtype, T, E):
    """``[hi | lo]`` of the router's backward: bitwise the PyTorch split (rows, E not a power of two, tiny and huge
    values, zeros); in bf16 (fp32's exponent range) ``hi + lo`` is within 2^-16 of t."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    t = torch.randn(T, E, device=dev) * torch.logspace(-6, 4, E, device=dev)
    t[0, 0] = 0.0
    hl = fused_router.split16(t, dtype)
    assert hl.dtype == dtype and hl.shape == (T, 2 * E)
    assert torch.equal(hl, _split16_reference(t, dtype))
    if dtype == torch.bfloat16:
        back = hl[:, :E].double() + hl[:, E:].double()
        assert ((back - t.double()).abs() <= 2.0 ** -16 * t.double().abs()).all()


def test_split16_bad_input():
    with pytest.raises(ValueError, match="fp32"):
        fused_router.split16(torch.zeros(4, 3, dtype=torch.float16), torch.bfloat16)
    with pytest.raises(ValueError, match="dtype"):
        fused_router.split16(torch.zeros(4, 3), torch.float32)
    with pytest.raises(ValueError, match="unit column stride"):
        fused_router.split16(torch.zeros(3, 4).t(), torch.bfloat16)
