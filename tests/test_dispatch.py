"""The index contract of moeblaze.dispatch, tested on its own (PyTorch build)."""

import pytest
import torch

from moeblaze import build_dispatch
from moeblaze.dispatch import build_dispatch_torch
from moeblaze.testing import ROUTINGS, make_routing


def check_invariants(index, topk_ids, E):
    T, K = topk_ids.shape
    N = T * K
    off, idx, tei, tim = index.tensors()
    assert all(t.dtype == torch.int32 for t in (off, idx, tei, tim))
    assert off.shape == (E + 1,) and idx.shape == (N,) and tei.shape == (T, K) and tim.shape == (T, K)
    assert torch.equal(tei, topk_ids.to(torch.int32))
    counts = torch.bincount(topk_ids.reshape(-1).long(), minlength=E)
    assert off[0] == 0 and off[-1] == N
    assert torch.equal(off.diff().long(), counts)
    # pair -> slot is a permutation, and slot -> token inverts it
    assert torch.equal(torch.sort(tim.reshape(-1)).values, torch.arange(N, dtype=torch.int32))
    assert torch.equal(idx[tim.long()], torch.arange(T, dtype=torch.int32)[:, None].expand(T, K))
    # the slot of pair (t, k) lies in expert topk_ids[t, k]'s range; tokens ascend inside each range
    e = topk_ids.long()
    assert ((tim >= off[e]) & (tim < off[e + 1])).all()
    for x in range(E):
        seg = idx[off[x]:off[x + 1]]
        assert (seg[1:] > seg[:-1]).all()


def test_paper_figure_2_example():
    routing = torch.tensor([[2, 3], [0, 1], [0, 3], [1, 2], [0, 3]])
    index = build_dispatch(routing, 4)
    assert index.expert_token_indices.tolist() == [1, 2, 4, 1, 3, 0, 3, 0, 2, 4]
    assert index.expert_token_offsets.tolist() == [0, 3, 5, 7, 10]
    check_invariants(index, routing, 4)


@pytest.mark.parametrize("kind", ROUTINGS)
@pytest.mark.parametrize("T,E,K", [(1, 1, 1), (1, 8, 8), (7, 3, 2), (100, 13, 1), (257, 64, 8), (1000, 128, 10)])
def test_invariants_random_routings(kind, T, E, K):
    ids = make_routing(T, E, K, kind)
    index = build_dispatch(ids, E)
    check_invariants(index, ids, E)
    assert index.num_tokens == T and index.top_k == K and index.num_pairs == T * K
    assert index.nbytes() == 4 * (E + 1) + 12 * T * K


def test_empty_and_single_expert_cases():
    ids = make_routing(50, 9, 2, "empty_experts")
    index = build_dispatch(ids, 9)
    assert (index.expert_token_offsets.diff()[5:] == 0).all()  # experts 5..8 receive nothing
    one = torch.zeros(40, 1, dtype=torch.int64)
    index = build_dispatch(one, 5)
    assert index.expert_token_offsets.tolist() == [0, 40, 40, 40, 40, 40]
    assert index.expert_token_indices.tolist() == list(range(40))


def test_chunked_rank_scan_matches(monkeypatch):
    """Chunks of the one-hot scan carry their per-expert base correctly across boundaries."""
    import moeblaze.dispatch as dispatch

    ids = make_routing(300, 6, 3, "zipf")
    whole = build_dispatch_torch(ids, 6)
    monkeypatch.setattr(dispatch, "_ONEHOT_CHUNK_ELEMS", 6 * 7)  # 7 pairs per chunk
    chunked = build_dispatch_torch(ids, 6)
    for a, b in zip(whole.tensors(), chunked.tensors()):
        assert torch.equal(a, b)


def test_deterministic():
    ids = make_routing(500, 16, 4, "zipf")
    a, b = build_dispatch(ids, 16), build_dispatch(ids.clone(), 16)
    assert all(torch.equal(x, y) for x, y in zip(a.tensors(), b.tensors()))


def test_bad_input_errors():
    with pytest.raises(TypeError, match="integer"):
        build_dispatch(torch.zeros(4, 2), 4)
    with pytest.raises(ValueError, match="rank 2"):
        build_dispatch(torch.zeros(4, dtype=torch.int32), 4)
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        build_dispatch(torch.tensor([[0, 4]]), 4)
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        build_dispatch(torch.tensor([[-1, 2]]), 4)
    with pytest.raises(ValueError, match="K=3"):
        build_dispatch(torch.tensor([[0, 1, 2]]), 2)
    with pytest.raises(ValueError, match="distinct"):
        build_dispatch(torch.tensor([[1, 1]]), 4)
    with pytest.raises(ValueError, match="num_experts"):
        build_dispatch(torch.tensor([[0]]), 0)


def test_pair_count_must_fit_int32():
    huge = torch.zeros(1, 1, dtype=torch.int32).expand(2**31, 1)  # no memory behind the expansion
    with pytest.raises(ValueError, match="2\\^31"):
        build_dispatch(huge, 4)
