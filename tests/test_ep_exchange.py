"""The expert-parallel exchange (moeblaze.parallel.exchange, moeblaze.parallel.ep): the host-free logic against plain
loops on the CPU, the sync-free exchange bitwise equal to the host-split one on gloo ranks, and on GPUs (``multigpu``)
every exchange against one process in bf16, no host synchronisation, and a captured EP layer step replaying bitwise.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import moeblaze
import parallel_workers as pw
from dist_utils import run_ranks
from moeblaze.parallel import expert_parallel
from moeblaze.parallel.ep import _Payload
from moeblaze.parallel.exchange import Layout
from moeblaze.parallel.send_plan import SendPlan, sum_rows


def _hit(T: int, P: int, K: int, gen: torch.Generator) -> torch.Tensor:
    ids = torch.stack([torch.randperm(P * 2, generator=gen)[:K] for _ in range(T)]) if T else torch.zeros(0, K)
    return torch.zeros(T, P, dtype=torch.bool).scatter_(1, ids.long() // 2, True) if T else torch.zeros(0, P,
                                                                                                     dtype=torch.bool)


@pytest.mark.parametrize("T,P,K,blocked", [(9, 4, 3, False), (9, 4, 3, True), (1, 2, 2, False), (0, 3, 2, True),
                                           (13, 2, 1, True)])
def test_send_plan_matches_a_plain_loop(T, P, K, blocked):
    """Row of (t, r) = r's block start + t's index among r's tokens; unused rows hold token T; each token's rows in
    rank order in the CSR."""
    gen = torch.Generator().manual_seed(T * 31 + P)
    hit = _hit(T, P, K, gen)
    counts = hit.sum(0)
    M = min(K, P)
    offsets = (torch.arange(P) * T if blocked else counts.cumsum(0) - counts).to(torch.int64)
    rows = P * T if blocked else T * M
    plan = SendPlan(hit, offsets, rows, M)
    want_tokens, want_rank = [T] * rows, [0] * rows
    token_rows: list[list[int]] = [[] for _ in range(T)]
    for r in range(P):
        i = 0
        for t in range(T):
            if hit[t, r]:
                row = int(offsets[r]) + i
                want_tokens[row], want_rank[row] = t, r
                token_rows[t].append(row)
                i += 1
    assert plan.send_tokens.tolist() == want_tokens and plan.send_rank.tolist() == want_rank
    flat = [row for rows_t in token_rows for row in rows_t]
    assert plan.row_offsets.tolist() == [0, *torch.tensor([len(r) for r in token_rows]).cumsum(0).tolist()]
    assert plan.token_rows[:len(flat)].tolist() == flat


def test_sum_rows_matches_a_plain_loop():
    gen = torch.Generator().manual_seed(1)
    hit = _hit(11, 3, 2, gen)
    counts = hit.sum(0)
    plan = SendPlan(hit, counts.cumsum(0) - counts, 22, 2)
    rows = torch.randn(22, 5, dtype=torch.float64, generator=gen)
    rows[int(counts.sum()):] = float("nan")  # unused rows are never read
    got = sum_rows(rows, plan.token_rows, plan.row_offsets, 2)
    for t in range(11):
        a, b = int(plan.row_offsets[t]), int(plan.row_offsets[t + 1])
        want = sum((rows[int(plan.token_rows[j])] for j in range(a, b)), torch.zeros(5, dtype=torch.float64))
        assert torch.equal(got[t], want), t


def test_recv_valid_packed_and_blocked():
    counts = torch.tensor([2, 0, 3])
    packed = Layout(4, 8, 12, counts, counts.cumsum(0) - counts, counts, counts.cumsum(0) - counts)
    assert packed.recv_valid().tolist() == [True] * 5 + [False] * 7
    blocked = Layout(4, 12, 12, counts, torch.arange(3) * 4, counts, torch.arange(3) * 4)
    assert blocked.recv_valid().tolist() == [True, True, False, False] + [False] * 4 + [True] * 3 + [False]
    host = Layout(4, 5, 5, counts, counts, counts, counts, splits=([2, 0, 3], [2, 0, 3]))
    assert host.recv_valid() is None


@pytest.mark.parametrize("x_dtype,w_dtype,d,K", [(torch.bfloat16, torch.float32, 7, 3),
                                                 (torch.float64, torch.float64, 5, 8), (torch.float16, torch.float32,
                                                                                        16, 1)])
def test_payload_round_trip(x_dtype, w_dtype, d, K):
    """Values, weights and ids packed into one byte row read back bitwise (odd d: aligned sections)."""
    pay = _Payload(d, K, x_dtype, w_dtype)
    assert pay.width % 64 == 0 and pay.w_at % 16 == 0 and pay.id_at % 16 == 0
    x, w = torch.randn(6, d).to(x_dtype), torch.rand(6, K, dtype=w_dtype)
    ids = torch.randint(0, 9, (6, K), dtype=torch.int32)
    buf = torch.empty(6, pay.width, dtype=torch.uint8)
    pay.values(buf).copy_(x)
    pay.weights(buf).copy_(w)
    pay.ids(buf).copy_(ids)
    assert torch.equal(pay.values(buf), x) and torch.equal(pay.weights(buf), w) and torch.equal(pay.ids(buf), ids)


def exchanges_bitwise(rank: int, world: int, tokens: list[int], backend: str, dtype: torch.dtype) -> None:
    """The same layer, weights and tokens over the host-split and the sync-free exchanges: output and every gradient
    bitwise equal (same rows, same kernels, same sums; only the buffers' shapes differ)."""
    dev = pw._device()
    kinds = ["all_to_all", "padded"] + (["nvshmem"] if dev.type == "cuda" else [])
    got = {}
    for kind in kinds:
        torch.manual_seed(7)
        moe = moeblaze.MoE(32, 16, 4 * world, 3, backend=backend, device=dev, dtype=dtype, aux_loss_coef=0.01)
        x_all = torch.randn(sum(tokens), 32, device=dev, dtype=dtype)
        dout_all = torch.randn(sum(tokens), 32, device=dev, dtype=dtype)
        ep = expert_parallel(moe, dist.group.WORLD, kind)
        mine = slice(sum(tokens[:rank]), sum(tokens[:rank + 1]))
        x = x_all[mine].clone().requires_grad_()
        out = ep(x)
        torch.autograd.backward([out, ep.aux_loss], [dout_all[mine], torch.ones_like(ep.aux_loss)])
        got[kind] = [out.detach(), x.grad, *(p.grad for p in ep.parameters())]
    for kind in kinds[1:]:
        for i, (a, b) in enumerate(zip(got["all_to_all"], got[kind])):
            assert torch.equal(a, b), f"rank {rank}: {kind} tensor {i} differs from all_to_all"


def test_sync_free_exchange_bitwise_equals_host_split_on_cpu():
    """3 ranks (P not a power of two), one of them without tokens."""
    run_ranks(exchanges_bitwise, 3, [4, 0, 3], "torch", torch.float32, timeout=120)


def exchange_table(rank: int, world: int) -> None:
    import gc
    import weakref

    a, b = (expert_parallel(moeblaze.MoE(16, 8, 4, 2), dist.group.WORLD) for _ in range(2))
    assert a.ep.exchange is b.ep.exchange  # layers on one group share its exchange (and buffers)
    group = dist.new_group(list(range(world)))
    c = expert_parallel(moeblaze.MoE(16, 8, 4, 2), group)
    assert c.ep.exchange is not a.ep.exchange and c.ep.exchange.group is group
    held = weakref.ref(c.ep.exchange)
    del c
    gc.collect()
    assert held() is None, "the exchange table kept an exchange its layers no longer use (and its group)"
    assert expert_parallel(moeblaze.MoE(16, 8, 4, 2), dist.group.WORLD).ep.exchange is a.ep.exchange


def test_layers_share_an_exchange_that_the_table_does_not_keep():
    run_ranks(exchange_table, 2, timeout=120)


def _gpus(n: int) -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() >= n


_GPU_CASES = [dict(c, dtype=torch.bfloat16, backend="triton") for c in (
    {"tokens": [96, 64], "E": 8, "K": 2, "d": 64, "h": 32},
    {"tokens": [0, 80], "E": 8, "K": 2, "d": 64, "h": 32},  # a rank with no token, receiving none either
    {"tokens": [70, 30], "E": 8, "K": 1, "d": 64, "h": 32, "one_remote_expert": True},  # all to one remote expert
)]
_EXCHANGES = ("all_to_all", "padded", "nvshmem")


@pytest.mark.multigpu
@pytest.mark.skipif(not _gpus(2), reason="needs 2 CUDA GPUs")
def test_ep_exchanges_two_gpus():
    """2 GPUs, one spawn (the kernels compile once): every exchange against one process in bf16 (a rank with no
    token, all tokens to one remote expert); the sync-free ones bitwise equal to the host-split one, without host
    synchronisation, and a captured layer step replaying bitwise."""
    cases = [dict(c, exchange=e) for e in _EXCHANGES for c in _GPU_CASES]
    bodies = [("ep_cases", (cases,)), ("exchanges_bitwise", ([128, 96], "triton", torch.bfloat16))]
    bodies += [(name, (e,)) for e in ("padded", "nvshmem") for name in ("no_host_sync", "graph_replay")]
    run_ranks(_run_all, 2, bodies, backend="nccl", timeout=500)


@pytest.mark.multigpu
@pytest.mark.skipif(not _gpus(4), reason="needs 4 CUDA GPUs")
def test_ep_exchanges_four_gpus():
    """4 GPUs: EP over all four with every exchange; FSDP2 + EP on the 2-D (dp_shard 2, ep 2) mesh."""
    cases = [{"tokens": [64, 0, 96, 32], "E": 8, "K": 3, "d": 64, "h": 32, "dtype": torch.bfloat16,
              "backend": "triton", "exchange": e} for e in _EXCHANGES]
    run_ranks(_run_all, 4, [("ep_cases", (cases,)), ("fsdp_equal", ((2, 2), ("dp_shard", "ep"), 12))],
              backend="nccl", timeout=500)


def _run_all(rank: int, world: int, bodies: list[tuple[str, tuple]]) -> None:
    """Rank bodies of this file and of parallel_workers in one spawn."""
    for name, args in bodies:
        fn = globals().get(name) or getattr(pw, name)
        try:
            fn(rank, world, *args)
        except AssertionError as err:
            raise AssertionError(f"{name}{args if name != 'ep_cases' else ''}: {err}") from err


def no_host_sync(rank: int, world: int, exchange: str) -> None:
    """Forward and backward of an EP layer with a sync-free exchange under ``set_sync_debug_mode("error")``."""
    dev = pw._device()
    torch.manual_seed(3)
    ep = expert_parallel(moeblaze.MoE(64, 32, 8, 2, device=dev, dtype=torch.bfloat16), dist.group.WORLD, exchange)
    x = torch.randn(128, 64, device=dev, dtype=torch.bfloat16, requires_grad=True)
    for check in (False, True):  # the first step compiles and tunes (which synchronise)
        torch.cuda.set_sync_debug_mode("error" if check else "default")
        try:
            out = ep(x)
            (out.float().square().sum() + ep.aux_loss).backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")


def graph_replay(rank: int, world: int, exchange: str) -> None:
    """A captured forward + backward of an EP layer replays bitwise equal to eager steps on fresh inputs."""
    import gc

    dev = pw._device()
    torch.manual_seed(4)
    ep = expert_parallel(moeblaze.MoE(64, 32, 8, 2, device=dev, dtype=torch.bfloat16), dist.group.WORLD, exchange)

    def inputs(seed):
        gen = torch.Generator(device=dev).manual_seed(seed * 10 + rank)
        return (torch.randn(96, 64, device=dev, dtype=torch.bfloat16, generator=gen),
                torch.randn(96, 64, device=dev, dtype=torch.bfloat16, generator=gen))

    def step(x, dout):
        out = ep(x)
        torch.autograd.backward([out, ep.aux_loss], [dout, torch.ones_like(ep.aux_loss)])
        return out

    def clear(x):
        for t in (x, *ep.parameters()):
            t.grad = None

    static_x, static_dout = inputs(0)
    static_x.requires_grad_(True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            clear(static_x)
            step(static_x, static_dout)
    torch.cuda.current_stream().wait_stream(side)
    clear(static_x)
    moeblaze.detach_aux_losses(ep)
    gc.collect()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step(static_x, static_dout)
    static_grads = [static_x.grad, *(p.grad for p in ep.parameters())]
    for seed in (1, 2):
        x, dout = inputs(seed)
        with torch.no_grad():
            static_x.copy_(x)
            static_dout.copy_(dout)
        graph.replay()
        got = [static_out.clone(), *(g.clone() for g in static_grads)]
        clear(static_x)
        x.requires_grad_(True)
        want = [step(x, dout).detach(), x.grad, *(p.grad for p in ep.parameters())]
        for i, (g, w) in enumerate(zip(got, want)):
            assert torch.equal(g, w), f"rank {rank}, replay {seed}: tensor {i} differs from eager"
