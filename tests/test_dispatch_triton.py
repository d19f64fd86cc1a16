"""Triton dispatch build (kernels/dispatch.py) against the PyTorch build, bitwise; tile schedule; bad input.

Runs on a CUDA GPU, or on CPU through the Triton interpreter: the interpreter must be switched on before
Triton is first imported, so the CPU run needs ``TRITON_INTERPRET=1`` in the environment of the whole
pytest process (e.g. ``TRITON_INTERPRET=1 pytest tests/test_dispatch_triton.py``). Without it and without
CUDA the module is skipped. Under the interpreter only small cases run (it is slow); the full grid of
the issue is marked ``gpu``.
"""

from __future__ import annotations

import os

import pytest
import torch

import moeblaze
from moeblaze.dispatch import build_dispatch_torch, build_tile_schedule_torch

_INTERP = os.environ.get("TRITON_INTERPRET") == "1"
_CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(not (_INTERP or _CUDA), reason="needs CUDA or TRITON_INTERPRET=1 (set before start)")
DEVICE = "cuda" if _CUDA and not _INTERP else "cpu"
gpu = pytest.mark.skipif(not _CUDA or _INTERP, reason="needs CUDA (without TRITON_INTERPRET)")

if _INTERP or _CUDA:
    from triton.runtime.interpreter import InterpretedFunction

    from moeblaze.kernels import dispatch as kd
    from moeblaze.kernels import schedule as ks

    if DEVICE == "cpu" and not isinstance(kd._count_kernel, InterpretedFunction):
        pytest.skip("TRITON_INTERPRET=1 was set after moeblaze.kernels.dispatch was imported",
                    allow_module_level=True)

KINDS = ("uniform", "zipf", "one_expert", "empty_experts")


def routing(T: int, K: int, E: int, kind: str, dtype=torch.int64, device=DEVICE) -> torch.Tensor:
    """A fresh [T, K] routing with distinct ids per row, of the named kind (drawn on `device`)."""
    seed = int(torch.randint(1 << 30, ()))
    print(f"routing(T={T}, K={K}, E={E}, kind={kind!r}) seed {seed}")  # shown by pytest on failure
    g = torch.Generator(device=device).manual_seed(seed)
    perm = torch.randperm(E, generator=g, device=device)
    if kind == "uniform":
        p = torch.ones(E, device=device)
    elif kind == "zipf":
        p = 1.0 / torch.arange(1, E + 1, dtype=torch.float64, device=device)[perm] ** 1.3
    elif kind == "one_expert":  # expert perm[0] is in every row
        p = torch.ones(E, device=device)
        p[perm[0]] = 0
        rest = torch.multinomial(p.expand(T, E), K - 1, generator=g) if K > 1 else p.new_empty(T, 0).long()
        ids = torch.cat([perm[:1].expand(T, 1), rest], dim=1)
        return ids[:, torch.randperm(K, generator=g, device=device)].to(dtype)
    elif kind == "empty_experts":  # only max(K, E // 3) experts are ever used
        p = torch.zeros(E, device=device)
        p[perm[: max(K, E // 3)]] = 1
    else:
        raise ValueError(kind)
    return torch.multinomial(p.double().expand(T, E), K, replacement=False, generator=g).to(dtype)


def spread_routing(T: int, K: int, E: int) -> torch.Tensor:
    """Large-T routing without a [T, E] draw: row t takes (r_t + c_k) mod E with distinct c_k."""
    r = torch.randint(E, (T, 1), device="cuda")
    return (r + torch.randperm(E, device="cuda")[:K]) % E


def assert_same(topk_ids: torch.Tensor, E: int, block_m: int | None = 128, **kw) -> moeblaze.DispatchIndex:
    """The Triton build (with the tile schedule of ``block_m`` written by its last launch) against the
    PyTorch build and the PyTorch schedule, bitwise; also without a schedule."""
    got = kd.build_dispatch_triton(topk_ids, E, block_m=block_m, **kw)
    ref = build_dispatch_torch(topk_ids, E)
    names = ("expert_token_offsets", "expert_token_indices", "token_expert_indices", "token_index_map")
    for name, a, b in zip(names, got.tensors(), ref.tensors()):
        assert a.dtype == torch.int32 and a.shape == b.shape, (name, a.dtype, a.shape, b.shape)
        assert torch.equal(a, b), f"{name} differs (T, K, E = {tuple(topk_ids.shape)}, {E})"
    assert got.num_experts == E
    if block_m is None:
        assert got.schedule is None
        return got
    want = build_tile_schedule_torch(ref.expert_token_offsets, ref.num_pairs, block_m)
    assert got.schedule.block_m == block_m
    for name, a, b in zip(("tile_expert", "tile_row_start", "num_tiles"), got.schedule.tensors(), want.tensors()):
        assert a.dtype == torch.int32 and a.shape == b.shape, (name, a.shape, b.shape)
        assert torch.equal(a, b), f"schedule {name} differs (T, K, E = {tuple(topk_ids.shape)}, {E}, {block_m})"
    plain = kd.build_dispatch_triton(topk_ids, E, **kw)
    assert plain.schedule is None and all(torch.equal(a, b) for a, b in zip(plain.tensors(), got.tensors()))
    return got


# ---------------------------------------------------------------------------------------------------
# CPU (interpreter) and GPU: a subset that keeps the interpreter run short, every case real
# ---------------------------------------------------------------------------------------------------

# (T, K, E, kind, tile_pairs); tile_pairs=None is the production plan, larger tiles walk many steps
SMALL_CASES = [
    (1, 1, 1, "uniform", None),
    (7, 1, 1, "one_expert", None),
    (7, 2, 3, "uniform", None),
    (7, 3, 3, "zipf", None),
    (1, 8, 8, "uniform", None),
    (7, 4, 64, "empty_experts", None),
    (7, 10, 512, "uniform", None),
    (1, 10, 128, "zipf", None),
    (1000, 1, 8, "uniform", None),
    (1000, 1, 3, "one_expert", 256),
    (1000, 2, 8, "zipf", 512),
    (1000, 4, 64, "empty_experts", 1024),
    (1000, 8, 128, "uniform", 2048),
    (1000, 10, 256, "zipf", 4096),
    (1000, 4, 512, "one_expert", 1024),
    (1000, 10, 16, "one_expert", 4096),
    (333, 8, 1024, "uniform", 1024),
    (257, 2, 3, "empty_experts", None),
    (3001, 2, 40, "zipf", 96),  # P not a power of two
    # T past 65,535 (a CUDA grid's y / z limit, which the interpreter does not have): the GPU grid below
]


@pytest.mark.parametrize("T,K,E,kind,tile_pairs", SMALL_CASES)
def test_matches_torch_build(T, K, E, kind, tile_pairs):
    block_m = (1, 32, 128)[T % 3]  # the tile heights of the kernels (interpreter, GPU) and one-slot tiles
    assert_same(routing(T, K, E, kind), E, block_m=block_m, tile_pairs=tile_pairs)


def test_paper_figure_2():
    ids = torch.tensor([[2, 3], [0, 1], [0, 3], [1, 2], [0, 3]], device=DEVICE)
    idx = assert_same(ids, 4)
    assert idx.expert_token_indices.tolist() == [1, 2, 4, 1, 3, 0, 3, 0, 2, 4]
    assert idx.expert_token_offsets.tolist() == [0, 3, 5, 7, 10]


def test_invariants_and_repeatability():
    ids = routing(300, 4, 32, "zipf")
    a = kd.build_dispatch_triton(ids, 32, tile_pairs=256)
    b = kd.build_dispatch_triton(ids, 32, tile_pairs=256)
    assert all(torch.equal(x, y) for x, y in zip(a.tensors(), b.tensors()))
    tmap = a.token_index_map.long()
    tokens = torch.arange(300, device=DEVICE, dtype=torch.int32)[:, None].expand(300, 4)
    assert torch.equal(a.expert_token_indices[tmap], tokens)
    assert torch.equal(torch.sort(tmap.flatten()).values, torch.arange(1200, device=DEVICE))
    counts = torch.bincount(ids.flatten(), minlength=32)
    assert torch.equal(a.expert_token_offsets.diff().long(), counts)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.int16, torch.uint8])
def test_input_dtypes_and_strides(dtype):
    ids = routing(77, 3, 200, "uniform", dtype=dtype)
    idx = assert_same(ids, 200)
    if dtype == torch.int32:  # contiguous int32 is used as is, like the PyTorch build
        assert idx.token_expert_indices.data_ptr() == ids.data_ptr()
    transposed = routing(77, 3, 200, "uniform", dtype=dtype).t().contiguous().t()  # strides (1, 77)
    assert not transposed.is_contiguous()
    assert_same(transposed, 200)
    assert_same(routing(40, 8, 64, "zipf", dtype=dtype)[::3], 64)  # row stride 3K


def test_no_tokens():
    idx = assert_same(torch.empty(0, 2, dtype=torch.int64, device=DEVICE), 5)
    assert idx.expert_token_offsets.tolist() == [0] * 6


# ---------------------------------------------------------------------------------------------------
# tile schedule
# ---------------------------------------------------------------------------------------------------


def schedule_reference(offsets: list[int], block_m: int) -> tuple[list[int], list[int], int]:
    E, N = len(offsets) - 1, offsets[-1]
    expert, row = [], []
    for e in range(E):
        for r in range(offsets[e], offsets[e + 1], block_m):
            expert.append(e)
            row.append(r)
    n = len(expert)
    pad = -(-N // block_m) + E - n
    return expert + [-1] * pad, row + [N] * pad, n


def _offsets(counts: list[int]) -> torch.Tensor:
    return torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize("block_m", [1, 3, 16, 64, 128])
@pytest.mark.parametrize("counts", [[3, 2, 2, 3], [0, 0, 5, 0], [0], [7], [0, 0, 0], [128, 0, 129, 1, 0, 255, 64, 3]])
def test_tile_schedule_small(counts, block_m):
    off = _offsets(counts)
    exp_e, exp_r, exp_n = schedule_reference(off.tolist(), block_m)
    for num_pairs in (int(off[-1]), None):
        te, tr, nt = ks.tile_schedule(off, block_m, num_pairs)
        assert te.dtype == tr.dtype == nt.dtype == torch.int32 and nt.shape == (1,)
        assert te.tolist() == exp_e and tr.tolist() == exp_r and int(nt) == exp_n


@pytest.mark.parametrize("E,block_m,kind", [(8, 64, "zipf"), (200, 16, "empty_experts"), (1024, 128, "uniform")])
def test_tile_schedule_from_routing(E, block_m, kind):
    off = build_dispatch_torch(routing(3000, min(4, E), E, kind), E).expert_token_offsets
    te, tr, nt = ks.tile_schedule(off, block_m, 3000 * min(4, E))
    exp_e, exp_r, exp_n = schedule_reference(off.tolist(), block_m)
    assert te.tolist() == exp_e and tr.tolist() == exp_r and int(nt) == exp_n


@pytest.mark.parametrize("foreign", [False, True])
def test_pair_build_writes_tokens_and_the_local_schedule(foreign):
    """General routing inputs (``[P, 1]`` ids): ``pair_tokens`` makes the write pass map slots to tokens, and
    ``schedule_experts = E`` over an ``E + 1``-bucket build (foreign pairs last) schedules the local experts only:
    bitwise the PyTorch build, its token gather and :func:`moeblaze.dispatch.with_schedule` on the local offsets."""
    from moeblaze.dispatch import DispatchIndex, with_schedule

    gen = torch.Generator().manual_seed(7)
    P, T, E, bm = 300, 90, 6, 16
    ids = torch.randint(0, E + foreign, (P, 1), generator=gen, dtype=torch.int32)
    tok = torch.randint(0, T, (P,), generator=gen, dtype=torch.int32).sort().values
    got = kd.build_dispatch_triton(ids.to(DEVICE), E + foreign, block_m=bm, pair_tokens=tok.to(DEVICE),
                                   schedule_experts=E)
    ref = build_dispatch_torch(ids, E + foreign)
    ref = with_schedule(DispatchIndex(*ref.tensors(), E, foreign_experts=foreign), bm)
    assert torch.equal(got.expert_token_indices.cpu(), tok[ref.expert_token_indices.long()])
    for a, b in ((got.expert_token_offsets, ref.expert_token_offsets), (got.token_index_map, ref.token_index_map),
                 *zip(got.schedule.tensors(), ref.schedule.tensors())):
        assert torch.equal(a.cpu(), b)
    with pytest.raises(ValueError, match="pair_tokens"):
        kd.build_dispatch_triton(ids.to(DEVICE), E + foreign, pair_tokens=tok[:-1].to(DEVICE))
    with pytest.raises(ValueError, match="schedule_experts"):
        kd.build_dispatch_triton(ids.to(DEVICE), E + foreign, schedule_experts=E + 2)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_foreign_topk_build_schedules_the_local_experts(dtype):
    """A top-k routing with foreign ids (K 3, ids E and E+1; the count pass clamps them into bucket E):
    ``schedule_experts = E`` gives the schedule of ``with_schedule`` on the local offsets, bitwise, and the index of
    the PyTorch build over the clamped ids (``token_expert_indices`` clamped; the input is left as it was)."""
    from moeblaze.dispatch import DispatchIndex, with_schedule

    T, K, E, bm = 120, 3, 7, 8
    ids = routing(T, K, E + 2, "uniform", dtype=dtype, device="cpu")
    given = ids.to(DEVICE)
    got = kd.build_dispatch_triton(given, E + 1, block_m=bm, schedule_experts=E)
    ref = build_dispatch_torch(ids.clamp(max=E), E + 1)
    ref = with_schedule(DispatchIndex(*ref.tensors(), E, foreign_experts=True), bm)
    assert int((ids == E + 1).sum()) > 0 and torch.equal(given.cpu(), ids)
    for a, b in (*zip(got.tensors(), ref.tensors()), *zip(got.schedule.tensors(), ref.schedule.tensors())):
        assert torch.equal(a.cpu(), b.to(a.dtype))


# ---------------------------------------------------------------------------------------------------
# bad input: a clear error, and no kernel launched
# ---------------------------------------------------------------------------------------------------


class _NoLaunch:
    def __getitem__(self, grid):
        raise AssertionError("a kernel was launched for bad input")


@pytest.fixture
def no_launch(monkeypatch):
    for name in ("_count_kernel", "_scan_kernel", "_write_kernel"):
        monkeypatch.setattr(kd, name, _NoLaunch())
    monkeypatch.setattr(ks, "_schedule_kernel", _NoLaunch())


@pytest.mark.parametrize("make,E,err,match", [
    (lambda: torch.tensor([[0, 1], [2, 4]]), 4, ValueError, r"expert ids in \[0, 4\]"),
    (lambda: torch.tensor([[0, -1]]), 4, ValueError, "expected ids in"),
    (lambda: torch.tensor([[1, 1], [0, 2]]), 4, ValueError, "repeats an expert"),
    (lambda: torch.tensor([[0.0, 1.0]]), 4, TypeError, "integer tensor"),
    (lambda: torch.tensor([0, 1, 2]), 4, ValueError, "rank 2"),
    (lambda: torch.zeros(2, 2, 2, dtype=torch.long), 4, ValueError, "rank 2"),
    (lambda: torch.tensor([[0, 1, 2]]), 2, ValueError, "K=3"),
])
def test_bad_input_via_build_dispatch(no_launch, make, E, err, match):
    with pytest.raises(err, match=match):
        moeblaze.build_dispatch(make().to(DEVICE), E)


def test_bad_input_to_launchers(no_launch):
    ids = torch.zeros(4, 2, dtype=torch.int32, device=DEVICE)
    ids[:, 1] = 1
    with pytest.raises(TypeError, match="int32/int64"):
        kd.build_dispatch_triton(ids.float(), 4)
    with pytest.raises(ValueError, match=r"\[T, K\]"):
        kd.build_dispatch_triton(ids[0], 4)
    with pytest.raises(ValueError, match="num_experts"):
        kd.build_dispatch_triton(ids, 1025)
    with pytest.raises(ValueError, match="top-k"):
        kd.build_dispatch_triton(torch.zeros(4, 17, dtype=torch.int32, device=DEVICE), 64)
    with pytest.raises(ValueError, match="tile_pairs"):
        kd.build_dispatch_triton(ids, 4, tile_pairs=48)
    with pytest.raises(ValueError, match="tile_pairs"):
        kd.build_dispatch_triton(ids, 4, tile_pairs=1 << 21)
    with pytest.raises(ValueError, match="block_m"):
        kd.build_dispatch_triton(ids, 4, block_m=0)
    with pytest.raises(TypeError, match="int32"):
        ks.tile_schedule(torch.zeros(5, dtype=torch.int64, device=DEVICE), 64, 0)
    with pytest.raises(ValueError, match="block_m"):
        ks.tile_schedule(torch.zeros(5, dtype=torch.int32, device=DEVICE), 0, 0)


# ---------------------------------------------------------------------------------------------------
# GPU: the full grid of the issue, large T, and the automatic selection in build_dispatch
# ---------------------------------------------------------------------------------------------------

GRID = [(E, K) for E in (1, 3, 8, 64, 128, 256, 512) for K in (1, 2, 4, 8, 10) if K <= E]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 7, 1000, 65537])
@pytest.mark.parametrize("E,K", GRID)
@pytest.mark.parametrize("kind", KINDS)
def test_full_grid_gpu(T, E, K, kind):
    assert_same(routing(T, K, E, kind, dtype=torch.int64 if (T + E) % 2 else torch.int32), E)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("T,K,E", [(1 << 24, 1, 64), ((1 << 24) + 3, 2, 1024), (3_000_001, 16, 256)])
def test_large_T_gpu(T, K, E):
    assert_same(spread_routing(T, K, E), E)
    torch.cuda.empty_cache()


@gpu
@pytest.mark.gpu
def test_build_dispatch_selects_triton_on_cuda(monkeypatch):
    builds = []
    real = kd.build_dispatch_triton
    monkeypatch.setattr(kd, "build_dispatch_triton", lambda *a, **k: builds.append(1) or real(*a, **k))
    ids = routing(4097, 8, 64, "zipf")
    got = moeblaze.build_dispatch(ids, 64)
    ref = build_dispatch_torch(ids, 64)
    assert builds and all(torch.equal(a, b) for a, b in zip(got.tensors(), ref.tensors()))
