"""Token rounding (SonicMoE §5 Alg. 4): count rules, agreement with SonicMoE's reference algorithm,
the MoE router option, and bad input."""

import pytest
import torch

import moeblaze
from moeblaze import MoE, moe_experts_general, round_tokens, settings, tile_multiple
from moeblaze.token_rounding import ROUNDING_MODES, round_counts


@pytest.fixture(params=["torch", "kernels"])
def selection(request):
    """Token rounding's selections as PyTorch ops, or as the Triton kernels (in the interpreter)."""
    with settings.override(backend="triton" if request.param == "kernels" else "torch"):
        yield request.param


def routing(T, E, K, seed, renormalize=True):
    gen = torch.Generator().manual_seed(seed)
    scores = torch.softmax(torch.randn(T, E, generator=gen) * 2, -1)
    w, ids = scores.topk(K, -1)
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    return scores, ids.to(torch.int32), w


def active_pairs(r, E):
    keep = r.expert_idx < E
    return {(int(t), int(e)): float(w) for t, e, w in zip(r.token_idx[keep], r.expert_idx[keep], r.pair_weights[keep])}


def sonicmoe_reference(scores, ids, w, tile, ties):
    """SonicMoE 0.1.2's token rounding, written out: per expert, tokens ordered top-k first by their top-k
    weight, then the others by score; the first ``r_e`` are kept. ``ties``: ``"half_even"`` (its
    ``torch.round``) or ``"drop"`` (ours). Counts that would pass T drop instead (our cap)."""
    T, E = scores.shape
    f = torch.bincount(ids.flatten().long(), minlength=E)
    if ties == "half_even":
        r = torch.round(f / tile).long() * tile
    else:
        r = torch.where(2 * (f % tile) > tile, f - f % tile + tile, f - f % tile)
    r = torch.where(r > T, r - tile, r)
    key = (scores - 1).scatter(1, ids.long(), w)  # top-k pairs above all others (scores - 1 < 0 <= w)
    order = key.argsort(dim=0, descending=True)
    weight = scores.scatter(1, ids.long(), w)
    return {(int(order[i, e]), e): float(weight[order[i, e], e]) for e in range(E) for i in range(int(r[e]))}


@pytest.mark.parametrize("mode", ROUNDING_MODES)
@pytest.mark.parametrize("T,E,K,tile", [(50, 8, 2, 8), (300, 16, 4, 16), (40, 4, 2, 64), (64, 6, 3, 1)])
def test_counts_are_tile_multiples_within_one_tile(mode, T, E, K, tile, selection):
    for seed in range(3):
        scores, ids, w = routing(T, E, K, seed)
        gen = torch.Generator().manual_seed(seed)
        r = round_tokens(scores, ids, w, tile, mode, generator=gen)
        f = torch.bincount(ids.flatten().long(), minlength=E)
        counts = torch.bincount(r.expert_idx.long(), minlength=E + 1)[:E]
        assert torch.equal(counts, r.counts.long())
        assert bool((counts % tile == 0).all()) and bool(((counts - f).abs() < tile).all())
        assert bool((counts <= T).all())
        if mode == "down":
            assert bool((counts <= f).all())
        if mode == "up" and tile * ((f.max() + tile - 1) // tile) <= T:  # no cap reached
            assert bool((counts >= f).all())
        assert torch.equal(r.token_idx, r.token_idx.sort().values)  # ascending: valid general routing inputs
        pairs = active_pairs(r, E)
        assert len(pairs) == int(counts.sum())  # no (token, expert) pair twice


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_nr_rounds_as_sonicmoe_reference(renormalize, seed, selection):
    T, E, K, tile = 96, 8, 2, 16
    scores, ids, w = routing(T, E, K, seed, renormalize)
    f = torch.bincount(ids.flatten().long(), minlength=E)
    ours = active_pairs(round_tokens(scores, ids, w, tile, "nr"), E)
    assert ours == pytest.approx(sonicmoe_reference(scores, ids, w, tile, "drop"))
    if not bool((2 * (f % tile) == tile).any()):  # without ties, SonicMoE's torch.round agrees
        assert ours == pytest.approx(sonicmoe_reference(scores, ids, w, tile, "half_even"))


def _fields(r):
    return r.token_idx, r.expert_idx, r.pair_weights, r.counts


@pytest.mark.parametrize("mode", ROUNDING_MODES)
@pytest.mark.parametrize("T,E,K,tile,dtype", [(90, 8, 2, 8, torch.float32), (70, 6, 3, 16, torch.float16),
                                               (1, 4, 2, 8, torch.float32), (12, 3, 3, 4, torch.float32),
                                               (0, 4, 2, 8, torch.float32), (700, 5, 2, 32, torch.float32)])
def test_kernel_selections_equal_torch_bitwise(mode, T, E, K, tile, dtype):
    """The Triton selections (interpreter) and the PyTorch ones give the same pairs, weights and order,
    with ties in weights and scores (the lower token first) and counts capped by T (T = 12, K = E = 3); at
    T = 700 the select kernel's group maxima tie across many of its 44 groups of 16 tokens (its candidates
    beyond the first half of its candidate rows, where an expert drops or pads 16 to 31 tokens)."""
    gen = torch.Generator().manual_seed(T + E)
    scores = (torch.randn(T, E, generator=gen) * 2).round().div(2).sigmoid().to(dtype)  # many equal scores
    w, ids = scores.float().topk(K, -1)
    w = (w * 4).round().div(4).to(dtype)  # many equal weights
    got = {}
    for on in (False, True):
        with settings.override(backend="triton" if on else "torch"):
            got[on] = _fields(round_tokens(scores, ids.int(), w, tile, mode,
                                           generator=torch.Generator().manual_seed(5), scale=1.5))
    for a, b in zip(got[False], got[True]):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_kernel_selections_mark_the_best_pads_and_drop_the_lowest():
    from moeblaze.kernels.rounding import rounding_select

    T, E, K, J = 64, 4, 1, 7
    scores = torch.rand(T, E, generator=torch.Generator().manual_seed(3))
    ids = torch.zeros(T, K, dtype=torch.int32)
    ids[:5] = 1  # expert 1: 5 tokens, pads 3 to 8; expert 0: 59, drops 3 to 56; experts 2, 3: nothing
    counts = torch.tensor([59, 5, 0, 0], dtype=torch.int32)
    kept, pad_mask, pad_tok, target = rounding_select(scores, ids, scores.gather(1, ids.long()), counts, 8, "nr",
                                                      J, J)
    assert torch.equal(target, torch.tensor([56, 8, 0, 0], dtype=torch.int32))  # nr at tile 8
    assert pad_mask.dtype == torch.uint8 and pad_mask.shape == (T, E) and pad_tok.shape == (J, E)
    outside = scores[5:, 1]  # expert 1's tokens outside its top-k: 5..63
    best = (outside.topk(3).indices + 5).sort().values
    assert torch.equal(pad_mask[:, 1].nonzero().flatten(), best)
    assert int(pad_mask[:, [0, 2, 3]].sum()) == 0
    assert torch.equal(pad_tok[:3, 1], best.int()) and bool((pad_tok[3:, 1] == -1).all())
    assert bool((pad_tok[:, [0, 2, 3]] == -1).all())
    dropped = (kept[:, 0] == E).nonzero().flatten()
    w0 = scores[5:, 0]
    assert torch.equal(dropped, (w0.topk(3, largest=False).indices + 5).sort().values)


def _pair_list_case(T, E, K, J):
    """Kept ids (E where dropped), a pad mask with at most J pads per expert at random tokens, its pad_tok."""
    gen = torch.Generator().manual_seed(T * E + J)
    kept = torch.randint(0, E + 1, (T, K), generator=gen, dtype=torch.int32)
    pad_mask = torch.zeros(T, E, dtype=torch.uint8)
    for e in range(E):
        pad_mask[torch.randperm(T, generator=gen)[:int(torch.randint(0, J + 1, (), generator=gen))], e] = 1
    pad_tok = torch.full((J, E), -1, dtype=torch.int32)
    for e in range(E):
        tokens = pad_mask[:, e].nonzero().flatten()
        pad_tok[:tokens.numel(), e] = tokens.int()
    return kept, pad_mask, pad_tok


@pytest.mark.parametrize("T,E,K,J", [(64, 4, 1, 7), (5, 6, 2, 3), (1, 4, 2, 1), (37, 3, 3, 9), (0, 4, 2, 0)])
def test_pair_list_layout(T, E, K, J):
    """The pair list of kept and padded pairs: per token its K top-k pairs, then its padded pairs in expert order;
    the CSR delimits them; the unused entries (expert E, weight 0, token T-1) follow as one tail past
    ``pair_offsets[T]``; top-k pairs weigh their top-k weight, padded ones ``scores * scale``; the kernels
    (interpreter) give it bitwise as the PyTorch ops do (fp32 and fp16)."""
    from moeblaze.kernels.pair_list import rounding_place
    from moeblaze.token_rounding import _place_torch

    kept, pad_mask, pad_tok = _pair_list_case(T, E, K, J)
    gen = torch.Generator().manual_seed(J)
    topk_w, scores = torch.rand(T, K, generator=gen), torch.rand(T, E, generator=gen)
    for dtype in (torch.float32, torch.float16):
        got = _place_torch(kept, pad_mask, J, topk_w.to(dtype), scores.to(dtype), 1.3)
        for a, b in zip(got, rounding_place(kept, pad_mask, pad_tok, topk_w.to(dtype), scores.to(dtype), 1.3)):
            assert a.dtype == b.dtype and torch.equal(a, b)
    token_idx, expert_idx, w, offsets = _place_torch(kept, pad_mask, J, topk_w, scores, 1.3)
    P, used = T * K + J * E, T * K + int(pad_mask.sum())
    assert token_idx.shape == (P,) and int(offsets[-1]) == used and int(offsets[0]) == 0
    for t in range(T):
        a, b = int(offsets[t]), int(offsets[t + 1])
        assert bool((token_idx[a:b] == t).all())
        experts = [int(e) for e in pad_mask[t].nonzero().flatten()]
        assert b - a == K + len(experts)
        assert expert_idx[a:a + K].tolist() == kept[t].tolist() and torch.equal(w[a:a + K], topk_w[t])
        assert expert_idx[a + K:b].tolist() == experts
        assert torch.equal(w[a + K:b], scores[t, experts] * 1.3)
    assert bool((token_idx[used:] == T - 1).all()) and bool((expert_idx[used:] == E).all())
    assert bool((w[used:] == 0).all())


# bf16 on the GPU only: the interpreter rounds fp32 -> bf16 toward zero, not to nearest as the GPU and torch do
@pytest.mark.parametrize("dtype,device", [(torch.float32, "cpu"), (torch.float16, "cpu"),
                                          pytest.param(torch.bfloat16, "cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("T,E,K,J", [(64, 4, 1, 7), (37, 3, 3, 9), (5, 6, 2, 3)])
def test_pair_weights_backward_kernel_equals_torch(T, E, K, J, dtype, device):
    """One launch writes the top-k gradients ``dw[pair_offsets[t] + k]`` and the padded pairs' ``dw * scale`` into
    whole ``[T, E]`` rows (zeros elsewhere; the tail adds nothing), bitwise as the PyTorch ops."""
    from moeblaze.kernels.pair_list import pair_weights_backward
    from moeblaze.token_rounding import _pair_weights_backward_torch, _place_torch

    kept, pad_mask, _ = (t.to(device) for t in _pair_list_case(T, E, K, J))
    token_idx, expert_idx, _, offsets = _place_torch(kept, pad_mask, J, torch.zeros(T, K, device=device),
                                                     torch.zeros(T, E, device=device), 1.0)
    dw = torch.randn(expert_idx.numel(), generator=torch.Generator().manual_seed(T)).to(device, dtype)
    got = pair_weights_backward(dw, offsets, expert_idx, K, E, 1.7, dtype)
    want = _pair_weights_backward_torch(dw, offsets, expert_idx, K, E, 1.7, dtype)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a, b)
    p = torch.arange(dw.numel(), device=device)  # the padded pairs: past a token's K, before the tail
    pad = (p < offsets[-1]) & (p - offsets[token_idx.long()] >= K)
    dense = torch.zeros(T * E, dtype=dtype, device=device).index_put(
        (token_idx[pad].long() * E + expert_idx[pad],), (dw[pad].float() * 1.7).to(dtype))
    assert torch.equal(got[1], dense.view(T, E))
    with pytest.raises(ValueError, match="scores_dtype"):
        pair_weights_backward(dw, offsets, expert_idx, K, E, 1.0, torch.float64)


@pytest.mark.parametrize("mode", ["nr", "up"])
def test_pair_weights_and_their_gradients(mode, selection):
    """Top-k pairs (kept or dropped) weigh their top-k weight at ``pair_offsets[t] + k``, padded pairs the scaled
    score; the gradients of both inputs are those of that gather (float64), unused entries add nothing."""
    T, E, K, tile, scale = 80, 6, 2, 16, 1.5
    scores, ids, w = routing(T, E, K, 9)
    scores, w = scores.double().requires_grad_(), w.double().requires_grad_()
    r = round_tokens(scores, ids, w, tile, mode, scale=scale)
    P = r.token_idx.numel()
    c = torch.randn(P, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ds, dw = torch.autograd.grad((r.pair_weights * c).sum(), (scores, w))
    topk_pos = (r.pair_offsets[:-1, None].long() + torch.arange(K)).flatten()
    is_topk = torch.zeros(P, dtype=torch.bool)
    is_topk[topk_pos] = True
    pad = ~is_topk & (r.expert_idx < E)
    tok, exp = r.token_idx.long(), r.expert_idx.long()
    s2, w2 = scores.detach().requires_grad_(), w.detach().requires_grad_()
    ref = torch.zeros(P, dtype=torch.float64).index_put((topk_pos,), w2.flatten())
    ref = torch.where(pad, s2[tok, exp.clamp(max=E - 1)] * scale, ref)
    assert torch.equal(r.pair_weights[is_topk | pad], ref[is_topk | pad])
    ds_ref, dw_ref = torch.autograd.grad((ref * torch.where(is_topk | pad, c, 0)).sum(), (s2, w2))
    assert torch.equal(dw, dw_ref) and torch.allclose(ds, ds_ref, rtol=0, atol=1e-15)


def test_pair_weights_gradients_of_both_paths_are_bitwise_alike():
    """fp32 routing: the Triton pair list and weights' backward (interpreter) give the PyTorch path's gradients."""
    scores, ids, w = routing(90, 6, 2, 5)
    grads = []
    for fused in (False, True):
        s, ww = scores.clone().requires_grad_(), w.clone().requires_grad_()
        with settings.override(backend="triton" if fused else "torch"):
            r = round_tokens(s, ids, ww, 16, "nr", scale=2.5)
        c = torch.randn(r.pair_weights.numel(), generator=torch.Generator().manual_seed(2))
        grads.append(torch.autograd.grad((r.pair_weights * c).sum(), (s, ww)))
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    assert int((grads[0][0] != 0).sum()) > 0  # some padded pairs carry a gradient to the scores


def test_down_pair_weights_are_the_topk_weights_and_give_the_scores_no_gradient(selection):
    """``down`` pads nothing: the pair list is the top-k pairs in order, their weights' gradient reaches
    ``topk_weights`` as it is and the scores get none (no ``[T, E]`` rows written)."""
    scores, ids, w = routing(90, 6, 2, 5)
    s, ww = scores.clone().requires_grad_(), w.clone().requires_grad_()
    r = round_tokens(s, ids, ww, 16, "down")
    assert torch.equal(r.pair_weights, w.flatten())
    c = torch.randn(r.pair_weights.numel(), generator=torch.Generator().manual_seed(2))
    ds, dw = torch.autograd.grad((r.pair_weights * c).sum(), (s, ww), allow_unused=True)
    assert ds is None and torch.equal(dw, c.view(90, 2))


def test_given_counts_round_as_counted(selection):
    """``counts`` (the router's pairs per expert, fp32) gives the rounding that counting topk_ids gives."""
    scores, ids, w = routing(300, 6, 2, 11)
    counts = torch.bincount(ids.flatten().long(), minlength=6).float()
    for mode in ("nr", "up", "down"):
        for a, b in zip(_fields(round_tokens(scores, ids, w, 16, mode)),
                        _fields(round_tokens(scores, ids, w, 16, mode, counts=counts))):
            assert torch.equal(a, b)


def test_padded_pairs_carry_the_scaled_score():
    """Padded pairs weigh ``scores[t, e] * scale`` (routed_scaling_factor); kept top-k pairs keep their weights."""
    T, E, K, tile = 64, 4, 1, 8
    scores, ids, w = routing(T, E, K, 5)
    plain, scaled = (active_pairs(round_tokens(scores, ids, w, tile, "up", scale=s), E) for s in (1.0, 2.5))
    topk = {(t, int(e)) for t in range(T) for e in ids[t]}
    padded = [p for p in plain if p not in topk]
    assert padded and plain.keys() == scaled.keys()
    for t, e in plain:
        expected = float(scores[t, e]) * 2.5 if (t, e) not in topk else plain[(t, e)]
        assert scaled[(t, e)] == pytest.approx(expected, rel=1e-6), (t, e)


def test_round_counts_rules():
    f = torch.tensor([0, 3, 4, 5, 8, 12, 13, 20])
    assert round_counts(f, 8, "nr").tolist() == [0, 0, 0, 8, 8, 8, 16, 16]  # 4 and 12 are ties: drop
    assert round_counts(f, 8, "up").tolist() == [0, 8, 8, 8, 8, 16, 16, 24]
    assert round_counts(f, 8, "down").tolist() == [0, 0, 0, 0, 8, 8, 8, 16]
    assert round_counts(f, 8, "up", num_tokens=20).tolist() == [0, 8, 8, 8, 8, 16, 16, 16]  # 24 > T: drop
    assert round_counts(torch.tensor([12]), 8, "up", num_tokens=16).tolist() == [16]  # exactly T: allowed
    draws = torch.stack([round_counts(f, 8, "sr", generator=torch.Generator().manual_seed(s)) for s in range(400)])
    assert bool(((draws == round_counts(f, 8, "down")) | (draws == round_counts(f, 8, "up"))).all())
    assert torch.allclose(draws.double().mean(0), f.double(), atol=1.0)  # unbiased: E[r] = f
    one = torch.Generator().manual_seed(9)
    again = torch.Generator().manual_seed(9)
    assert torch.equal(round_counts(f, 8, "sr", generator=one), round_counts(f, 8, "sr", generator=again))


def test_all_dropped_token_gets_zero_output_and_gradient():
    T, E, d, h = 40, 4, 16, 8
    scores, ids, w = routing(T, E, 1, 1)
    r = round_tokens(scores, ids, w, 8, "down")
    dropped = sorted(set(range(T)) - {t for t, _ in active_pairs(r, E)})
    assert dropped, "the case must drop some token's only pair"
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(T, d, generator=gen, requires_grad=True)
    w1, w2 = torch.randn(E, 2 * h, d, generator=gen) / 4, torch.randn(E, d, h, generator=gen) / 3
    pw = r.pair_weights.clone().requires_grad_()
    out = moe_experts_general(x, r.token_idx, r.expert_idx, pw, w1, w2, backend="torch", foreign_experts=True)
    out.backward(torch.randn(T, d, generator=gen))
    assert torch.equal(out[dropped], torch.zeros(len(dropped), d)) and torch.equal(x.grad[dropped], out[dropped])
    assert bool((pw.grad[r.expert_idx == E] == 0).all())


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_moe_token_rounding_option(backend, monkeypatch):
    """The layer's rounded routing equals round_tokens over its router's output; with the Triton router
    (forced in the interpreter) the rounding takes the router's counts (``RouterOutput.counts``). The Triton
    selections do not serve here (the layer then rounds after its router: ``test_routed_pairs.py`` covers the
    router's own rounding node)."""
    if backend == "triton":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(moeblaze.token_rounding, "_kernels_serve", lambda *a: False)
    with settings.override(backend=backend):
        _check_moe_token_rounding_option(backend)


def _check_moe_token_rounding_option(backend):
    torch.manual_seed(0)
    kw = dict(d_model=16, d_ff=8, num_experts=4, top_k=2, backend=backend, renormalize=True)
    layer, plain = MoE(**kw, token_rounding="nr", rounding_tile=8), MoE(**kw)
    plain.load_state_dict(layer.state_dict())
    x = torch.randn(37, 16, requires_grad=True)
    out = layer(x)
    routing_out = layer.router(x)
    assert (routing_out.counts is not None) == (backend == "triton")
    r = round_tokens(routing_out.scores, routing_out.topk_ids, routing_out.topk_weights, 8, "nr")
    expect = moe_experts_general(x, r.token_idx, r.expert_idx, r.pair_weights, layer.w1, layer.w_down,
                                 backend=backend, foreign_experts=True)
    assert torch.equal(out, expect)
    out.square().sum().backward()
    assert layer.router.weight.grad.abs().sum() > 0 and torch.isfinite(x.grad).all()
    layer.eval()
    plain.eval()
    assert torch.equal(layer(x), plain(x))  # evaluation routes with plain top-k
    assert "token_rounding=nr" in repr(layer)


def test_rounding_too_few_tokens_per_expert_warns():
    """Under half a tile of pairs per expert on average, nearest / down / stochastic rounding drops most pairs
    (zero MoE output for their tokens): the layer says so, from the shapes alone; ``up`` only pads."""
    import warnings

    torch.manual_seed(0)
    x = torch.randn(37, 16)  # 37 * 2 / 8 = 9.25 pairs per expert, under 64 = half the torch backend's 128
    for mode in ("nr", "down", "sr"):
        with pytest.warns(UserWarning, match=r"9.25 pairs per expert on average, under half the tile \(128\)"):
            MoE(16, 8, 8, 2, backend="torch", token_rounding=mode)(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        MoE(16, 8, 8, 2, backend="torch", token_rounding="up")(x)
        MoE(16, 8, 8, 2, backend="torch", token_rounding="nr", rounding_tile=16)(x)  # 9.25 >= 8


def test_tile_multiple(monkeypatch):
    assert tile_multiple("torch") == 128 and tile_multiple("auto", "cpu") == 128
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert tile_multiple("triton") == 32
    assert moeblaze.tile_multiple is tile_multiple


def _select(tile, mode, rand):
    from moeblaze.kernels.rounding import rounding_select

    scores, ids, w = routing(8, 4, 2, 0)
    return rounding_select(scores, ids, w, torch.ones(4, dtype=torch.int32), tile, mode, 3, 3, rand)


@pytest.mark.parametrize("call,match", [
    (lambda: round_tokens(*routing(8, 4, 2, 0), 0, "nr"), r"tile \(the M tile to round to\) must be a positive int"),
    (lambda: round_tokens(*routing(8, 4, 2, 0), 8, "half"), "token rounding mode must be one of"),
    (lambda: round_tokens(*routing(8, 4, 2, 0), 8, "nr", counts=torch.ones(5)), r"counts must have shape \(4,\)"),
    (lambda: round_counts(torch.tensor([3]), -1), "must be a positive int, got -1"),
    (lambda: MoE(8, 4, 4, 2, token_rounding="ceil"), "token_rounding must be None or one of"),
    (lambda: MoE(8, 4, 4, 2, token_rounding="nr", rounding_tile=0), "rounding_tile must be None or a positive int"),
    (lambda: tile_multiple("cuda"), "backend must be one of"),
    (lambda: _select(8, "sr", None), "rand must be \\[E=4\\] fp32 for mode 'sr'"),
    (lambda: _select(8, "nr", torch.rand(4)), "rand must be .* None otherwise"),
    (lambda: _select(8, "half", None), "need mode in"),
    (lambda: _select(0, "nr", None), "tile >= 1"),
])
def test_bad_rounding_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ROUNDING_MODES)
def test_gpu_token_rounding_layer_bf16_no_host_sync(mode):
    torch.manual_seed(0)
    kw = dict(d_model=256, d_ff=128, num_experts=32, top_k=4, token_rounding=mode, device="cuda",
              dtype=torch.bfloat16)
    layer = MoE(**kw, backend="triton")
    ref = MoE(**kw, backend="torch")
    ref.load_state_dict(layer.state_dict())
    x = torch.randn(3000, 256, device="cuda", dtype=torch.bfloat16)
    layer(x).float().square().mean().backward()  # first call: autotuning and compilation may synchronise
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = layer(x)
        out.float().square().mean().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    counts = torch.bincount(layer.last_topk_ids.flatten().long(), minlength=32)
    assert counts.sum() == 3000 * 4
    if mode != "sr":  # sr draws from each layer's own generator state
        expect = ref(x)
        err = (out.float() - expect.float()).norm() / expect.float().norm()
        assert err < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,E,K,mode", [(16384, 128, 2, "nr"), (16384, 512, 10, "nr"), (5000, 64, 4, "up"),
                                         (40000, 32, 8, "down")])
def test_gpu_kernel_selections_equal_torch_bitwise(T, E, K, mode, dtype):
    gen = torch.Generator(device="cuda").manual_seed(T + E)
    scores = torch.softmax(torch.randn(T, E, device="cuda", generator=gen), -1).to(dtype)
    w, ids = scores.topk(K, -1)
    got = {}
    for on in (False, True):
        with settings.override(backend="triton" if on else "torch"):
            got[on] = _fields(round_tokens(scores, ids.int(), w, 128, mode))
    for a, b in zip(got[False], got[True]):
        assert torch.equal(a, b)
