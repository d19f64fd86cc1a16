"""General routing inputs (pair lists): the pair index, bitwise equality with top-k, ragged lists
against the float64 reference (DESIGN.md §7), bad input."""

import pytest
import torch

from moeblaze import build_dispatch_pairs, moe_experts, moe_experts_general
from moeblaze.general_routing import topk_to_pairs
from moeblaze.reference import act_reference
from moeblaze.testing import assert_close_to_reference, make_expert_inputs

BACKENDS = ["torch", "triton"]


def _backend(backend, monkeypatch):
    if backend == "triton":
        monkeypatch.setenv("TRITON_INTERPRET", "1")


def pairs_reference(x, token_idx, expert_idx, w, w1, w2, activation="swiglu", b1=None, b2=None):
    """``out[t] = sum_{p of t} w_p FFN_e(x[t])``: a plain per-expert loop in the inputs' dtype."""
    out = torch.zeros_like(x)
    for e in range(w2.shape[0]):
        sel = torch.nonzero(expert_idx == e).squeeze(1)
        if sel.numel() == 0:
            continue
        tok = token_idx[sel].long()
        pre = x[tok] @ w1[e].t() + (b1[e] if b1 is not None else 0)
        y = act_reference(activation, pre) @ w2[e].t() + (b2[e] if b2 is not None else 0)
        out = out.index_add(0, tok, y * w[sel].to(x.dtype)[:, None])
    return out


def ragged_pairs(T, E, gen):
    """Token 0: no pair, token 1: one, token 2: all E experts, token 3: expert 1 twice; the rest 0..E at random."""
    counts = torch.randint(0, E + 1, (T,), generator=gen)
    counts[:4] = torch.tensor([0, 1, E, 2])
    tok, exp = [], []
    for t, c in enumerate(counts.tolist()):
        ids = [1, 1] if t == 3 else torch.randperm(E, generator=gen)[:c].tolist()
        tok += [t] * len(ids)
        exp += ids
    return torch.tensor(tok, dtype=torch.int32), torch.tensor(exp, dtype=torch.int32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("save", ["preact", "input"])
@pytest.mark.parametrize("K,bias", [(2, False), (3, True), (1, False)])
def test_pairs_equal_topk_bitwise_fp32(backend, save, K, bias, monkeypatch):
    _backend(backend, monkeypatch)
    inp = make_expert_inputs(21, 32, 16, 5, K, seed=3 + K, bias=bias)
    leaves = {k: v.clone().requires_grad_() for k, v in inp.items() if k != "topk_ids"}
    biases = {k: leaves[k] for k in ("b_gate_up", "b_down") if k in leaves}
    out1 = moe_experts(leaves["x"], inp["topk_ids"], leaves["topk_weights"], leaves["w_gate_up"], leaves["w_down"],
                       save=save, backend=backend, **biases)
    dout = torch.randn_like(out1)
    g1 = torch.autograd.grad(out1, list(leaves.values()), dout)
    tok, exp, pw = topk_to_pairs(inp["topk_ids"], leaves["topk_weights"])
    out2 = moe_experts_general(leaves["x"], tok, exp, pw, leaves["w_gate_up"], leaves["w_down"], save=save,
                               backend=backend, **biases)
    g2 = torch.autograd.grad(out2, list(leaves.values()), dout)
    assert torch.equal(out1, out2)
    for name, a, b in zip(leaves, g1, g2):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("backend,dtype", [("torch", torch.float32), ("triton", torch.float32),
                                           ("triton", torch.float16)])
@pytest.mark.parametrize("save", ["preact", "input"])
def test_ragged_pairs_match_float64_reference(backend, dtype, save, monkeypatch):
    _backend(backend, monkeypatch)
    check_ragged_pairs(backend, dtype, save, "cpu", 19, 32, 16, 5)


@pytest.mark.gpu
@pytest.mark.parametrize("save", ["preact", "input"])
@pytest.mark.parametrize("T,d,h,E", [(19, 32, 16, 5), (700, 256, 128, 24)])
def test_gpu_ragged_pairs_bf16(save, T, d, h, E):
    check_ragged_pairs("triton", torch.bfloat16, save, "cuda", T, d, h, E)


def check_ragged_pairs(backend, dtype, save, device, T, d, h, E):
    gen = torch.Generator().manual_seed(7)
    tok, exp = ragged_pairs(T, E, gen)
    inp = make_expert_inputs(T, d, h, E, 1, dtype=dtype, seed=11, bias=True)
    pw = torch.rand(tok.numel(), generator=gen) + 0.1
    names = ("x", "w_gate_up", "w_down", "b_gate_up", "b_down")

    def run(kind, dt):
        dev = device if kind == "ours" else "cpu"
        leaves = [inp[n].detach().to(dev, dt).requires_grad_() for n in names]
        w = pw.to(dev, dt if kind == "ref" else torch.float32).requires_grad_()
        x, w1, w2, b1, b2 = leaves
        if kind == "ref":
            out = pairs_reference(x, tok, exp, w, w1, w2, b1=b1, b2=b2)
        else:
            out = moe_experts_general(x, tok.to(dev), exp.to(dev), w, w1, w2, save=save, backend=backend,
                                      b_gate_up=b1, b_down=b2)
        grads = torch.autograd.grad(out, [*leaves, w], dout.to(dev, out.dtype))
        return tuple(t.detach().cpu() for t in (out, *grads))

    dout = torch.randn(T, d, generator=gen)
    ref, base, got = run("ref", torch.float64), run("ref", dtype), run("ours", dtype)
    assert torch.equal(got[0][0], torch.zeros(d, dtype=dtype)) and torch.equal(got[1][0], torch.zeros(d, dtype=dtype))
    for name, a, r, b in zip(("out", "dx", *("d" + n for n in names[1:]), "dpair_weights"), got, ref, base):
        assert_close_to_reference(name, a, r, b)


@pytest.mark.parametrize("foreign", [False, True])
def test_pair_index_contract(foreign):
    gen = torch.Generator().manual_seed(5)
    T, E = 23, 6
    tok, exp = ragged_pairs(T, E, gen)
    if foreign:
        exp = torch.where(torch.rand(exp.shape, generator=gen) < 0.3, E, exp).to(torch.int32)
    idx = build_dispatch_pairs(tok, exp, T, E, block_m=4, foreign_experts=foreign)
    P = tok.numel()
    assert idx.is_general and idx.num_tokens == T and idx.num_pairs == P
    assert torch.equal(idx.expert_token_indices[idx.token_index_map.long()], tok)
    assert torch.equal(torch.sort(idx.token_index_map).values, torch.arange(P, dtype=torch.int32))
    counts = torch.bincount(exp.long(), minlength=E + 1)[: E + foreign]
    assert torch.equal(idx.expert_token_offsets.diff(), counts.to(torch.int32))
    assert torch.equal(idx.pair_offsets, torch.searchsorted(tok, torch.arange(T + 1, dtype=torch.int32)).int())
    tiles = (counts[:E] + 3).div(4, rounding_mode="floor").sum()
    assert idx.schedule is not None and int(idx.schedule.num_tiles) == int(tiles)
    given = build_dispatch_pairs(tok, exp, T, E, block_m=4, foreign_experts=foreign, pair_offsets=idx.pair_offsets)
    assert given.pair_offsets is idx.pair_offsets  # the caller's CSR (token rounding's), used as given
    assert torch.equal(given.token_index_map, idx.token_index_map)
    with pytest.raises(ValueError, match="pair_offsets must be"):
        build_dispatch_pairs(tok, exp, T, E, foreign_experts=foreign, pair_offsets=idx.pair_offsets[:-1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_foreign_tail_past_the_last_token_adds_nothing(backend, monkeypatch):
    """Foreign pairs after ``pair_offsets[T]`` (token rounding's unused tail) are in no token's combine: output and
    every gradient equal those of the list without them, bitwise (fp32)."""
    _backend(backend, monkeypatch)
    gen = torch.Generator().manual_seed(8)
    T, E = 9, 4
    tok, exp = ragged_pairs(T, E, gen)
    inp = make_expert_inputs(T, 16, 8, E, 1, seed=3)
    w = torch.rand(tok.numel(), generator=gen)
    offsets = torch.searchsorted(tok, torch.arange(T + 1, dtype=torch.int32)).int()
    tail = 5
    tok_t = torch.cat((tok, torch.full((tail,), T - 1, dtype=torch.int32)))
    exp_t = torch.cat((exp, torch.full((tail,), E, dtype=torch.int32)))
    w_t = torch.cat((w, torch.rand(tail, generator=gen)))
    results = []
    for pairs, weights in (((tok, exp), w), ((tok_t, exp_t), w_t)):
        x, w1, w2 = (inp[k].clone().requires_grad_() for k in ("x", "w_gate_up", "w_down"))
        pw = weights.clone().requires_grad_()
        index = build_dispatch_pairs(*pairs, T, E, block_m=4, foreign_experts=True, pair_offsets=offsets)
        out = moe_experts_general(x, *pairs, pw, w1, w2, backend=backend, index=index, foreign_experts=True)
        grads = torch.autograd.grad(out.square().sum(), (x, w1, w2, pw))
        results.append((out, *grads[:3], grads[3][: tok.numel()]))
    assert all(torch.equal(a, b) for a, b in zip(*results))
    assert torch.equal(grads[3][tok.numel():], torch.zeros(tail))  # the tail's weights get no gradient


def test_tokens_without_pairs_and_no_pairs_at_all():
    inp = make_expert_inputs(6, 16, 8, 3, 1, seed=2)
    x = inp["x"].requires_grad_()
    empty = torch.zeros(0, dtype=torch.int32)
    out = moe_experts_general(x, empty, empty, torch.zeros(0), inp["w_gate_up"], inp["w_down"], backend="torch")
    out.sum().backward()
    assert torch.equal(out, torch.zeros_like(out)) and torch.equal(x.grad, torch.zeros_like(x))


def _bad(**kw):
    inp = make_expert_inputs(6, 16, 8, 3, 1, seed=1)
    args = dict(x=inp["x"], token_idx=torch.tensor([0, 1, 1, 4], dtype=torch.int32),
                expert_idx=torch.tensor([0, 2, 1, 0], dtype=torch.int32), pair_weights=torch.rand(4),
                w_gate_up=inp["w_gate_up"], w_down=inp["w_down"], backend="torch")
    args.update(kw)
    return moe_experts_general(**args)


@pytest.mark.parametrize("kw,err,match", [
    (dict(token_idx=torch.tensor([0, 2, 1, 4], dtype=torch.int32)), ValueError, "token_idx must be ascending"),
    (dict(token_idx=torch.tensor([0, 1, 1, 6], dtype=torch.int32)), ValueError, r"token_idx holds tokens in \[0, 6\]"),
    (dict(expert_idx=torch.tensor([0, 3, 1, 0], dtype=torch.int32)), ValueError,
     r"expert_idx holds expert ids from 0 to 3; expected ids in \[0, 3\) \(id 3 marks .* foreign_experts=True\)"),
    (dict(expert_idx=torch.tensor([0, -1, 1, 0], dtype=torch.int32)), ValueError,
     r"expert_idx holds expert ids from -1 to 1; expected ids in \[0, 3\)$"),
    (dict(expert_idx=torch.tensor([0, 1, 0], dtype=torch.int32)), ValueError, r"expert_idx must have shape \[P=4\]"),
    (dict(pair_weights=torch.rand(5)), ValueError, r"pair_weights must have shape \[P=4\]"),
    (dict(pair_weights=torch.ones(4, dtype=torch.int64)), TypeError, "pair_weights must be a float tensor"),
    (dict(token_idx=torch.tensor([0.0, 1, 1, 4])), TypeError, "token_idx must be an int32/int64 tensor"),
    (dict(token_idx=torch.zeros(4, 1, dtype=torch.int32)), ValueError, r"token_idx must have shape \[P\]"),
])
def test_bad_pairs_raise_clear_errors(kw, err, match):
    with pytest.raises(err, match=match):
        _bad(**kw)


def test_an_index_of_other_pairs_is_refused():
    """An index built from another pair list (another P) or from a top-k routing does not fit these pairs."""
    from moeblaze import build_dispatch

    other = build_dispatch_pairs(torch.tensor([0, 1, 4], dtype=torch.int32), torch.tensor([0, 2, 1], dtype=torch.int32),
                                 6, 3)
    topk = build_dispatch(torch.tensor([[0], [2], [1], [0], [1], [2]], dtype=torch.int32), 3)
    for index in (other, topk):
        with pytest.raises(ValueError, match="index must be a build_dispatch_pairs index for E=3, T=6, P=4"):
            _bad(index=index)
