"""Expert-parallel MoE layer: moeblaze against a torchtitan-style EP layer on the same ranks (issue 23).

Launch with torchrun, one process per GPU (NCCL; gloo on the CPU with tiny shapes, for testing):

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \\
        torchrun --nproc-per-node 2 benchmarks/bench_ep.py --out ep.csv          # Qwen3-30B-A3B shape
    torchrun --nproc-per-node 2 benchmarks/bench_ep.py --tokens 64 --d-model 32 --d-ff 16 --experts 8 --top-k 2 \\
        --dtype float32 --iters 2 --warmup 1                                      # CPU smoke run

Both layers share the router and the expert weights and route the same tokens. ``moeblaze``:
:class:`moeblaze.MoE` with ``ep_group`` (each token sent once per destination rank with its pairs, fused
kernels over the received rows through a general routing index, each row's local experts combined before it
goes back). ``torchtitan-style``: argsort of the routing, gathered copy of x with a row per (token, expert)
pair, the all-to-alls, received rows regrouped by local expert (a second copy), ``grouped_mm`` for both
projections, autograd through plain PyTorch ops.

Per layer, rank 0 writes one CSV row: forward+backward time (median over ``--iters`` steps, the slowest
rank; CUDA events on GPU), peak memory (``torch.cuda.max_memory_allocated``, the largest rank; empty on
the CPU) and the step's own part of it (above the resident weights of both layers, x and dout; no
gradient held between steps), the rows each rank sends, the time of the step's all-to-alls replayed alone
with the same split sizes and their share of the step, the output's relative difference from the
moeblaze layer, and the code version and command.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

import moeblaze
from moeblaze.bench.baselines import _act, grouped_linear
from moeblaze.bench.results import git_commit
from moeblaze.parallel import init_distributed
from moeblaze.parallel.breakdown import gather, profile_steps, summary

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _a2a(t: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
    return wait_tensor(all_to_all_single_autograd(t, out_splits, in_splits, dist.group.WORLD))


class TitanStyleEP(nn.Module):
    """An expert-parallel layer written the way torchtitan writes it (argsort permute, gathered buffers,
    grouped GEMMs, autograd), on the router and local expert weights of a moeblaze EP layer."""

    def __init__(self, src: moeblaze.MoE) -> None:
        super().__init__()
        self.router = src.router
        self.w_gate_up = nn.Parameter(src.w1.detach().clone())
        self.w_down = nn.Parameter(src.w_down.detach().clone())
        self.activation, self.E, self.P = src.activation, src.num_experts, src.ep.size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routing = self.router(x)
        T, K = routing.topk_ids.shape
        P, El = self.P, self.E // self.P
        flat = routing.topk_ids.reshape(-1).long()
        order = torch.argsort(flat, stable=True)  # slot -> pair, grouped by expert, hence by rank
        token_idx = order // K
        counts = torch.bincount(flat, minlength=self.E)
        recv_counts = wait_tensor(all_to_all_single_autograd(counts, None, None, dist.group.WORLD))  # [P*El]
        splits = torch.cat((counts.view(P, El).sum(1), recv_counts.view(P, El).sum(1))).tolist()
        send, recv = splits[:P], splits[P:]
        x_recv = _a2a(x[token_idx], recv, send)  # the gathered routing buffer [N, d], then [R, d]
        local_ids = torch.arange(El, device=x.device).repeat(P).repeat_interleave(recv_counts, output_size=sum(recv))
        perm = torch.argsort(local_ids, stable=True)  # received rows regrouped by local expert
        ends = torch.cumsum(recv_counts.view(P, El).sum(0), 0).to(torch.int32)
        y = grouped_linear(_act(grouped_linear(x_recv[perm], self.w_gate_up, ends), self.activation),
                           self.w_down, ends)
        y = torch.zeros_like(y).index_copy(0, perm, y)  # back to the received order
        y = _a2a(y, send, recv) * routing.topk_weights.reshape(-1)[order].to(y.dtype)[:, None]
        return torch.zeros_like(x).index_add(0, token_idx, y)


def _split_sizes(layer: moeblaze.MoE, x: torch.Tensor, per_token: bool) -> tuple[list[int], list[int]]:
    """The send / receive row counts of ``x``'s routing: one row per (token, expert) pair (torchtitan-style),
    or with ``per_token`` one per (token, destination rank) as moeblaze sends (both layers route alike)."""
    P, El = layer.ep.size, layer.ep.num_local_experts
    with torch.no_grad():
        ids = layer.router(x).topk_ids.long()
    if per_token:
        send = torch.zeros(ids.shape[0], P, dtype=torch.bool, device=x.device).scatter_(1, ids // El, True).sum(0)
    else:
        send = torch.bincount(ids.reshape(-1), minlength=layer.num_experts).view(P, El).sum(1)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)
    return send.tolist(), recv.tolist()


def _timed(fn, iters: int, warmup: int, device: torch.device) -> float:
    """Median milliseconds of ``fn()`` over ``iters`` calls after ``warmup``, the slowest rank's."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        dist.barrier()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    ms = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
    dist.all_reduce(ms, op=dist.ReduceOp.MAX)
    return float(ms)


def _comm_replay(x: torch.Tensor, K: int, send: list[int], recv: list[int], pair_data: bool):
    """The step's all-to-alls alone: rows of d out and back in forward, the same two in backward; with
    ``pair_data`` (moeblaze) also each row's K weights (fp32) and K local expert ids (int32) out in forward,
    and the weights' gradient back in backward."""
    rows = x.new_empty(sum(send), x.shape[1])
    back = x.new_empty(sum(recv), x.shape[1])
    w, wb = rows.new_empty(rows.shape[0], K, dtype=torch.float32), back.new_empty(back.shape[0], K, dtype=torch.float32)
    ids, idb = w.to(torch.int32), wb.to(torch.int32)

    def run():
        for _ in range(2):
            dist.all_to_all_single(back, rows, recv, send)
            dist.all_to_all_single(rows, back, send, recv)
        if pair_data:
            dist.all_to_all_single(wb, w, recv, send)
            dist.all_to_all_single(idb, ids, recv, send)
            dist.all_to_all_single(w, wb, send, recv)
    return run


def _max_over_ranks(value: float, device: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=16384, help="tokens per rank (T)")
    p.add_argument("--d-model", type=int, default=2048, help="d")
    p.add_argument("--d-ff", type=int, default=768, help="h")
    p.add_argument("--experts", type=int, default=128, help="E, split over the ranks")
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--out", help="append the CSV rows to this file")
    p.add_argument("--breakdown", type=int, default=0, metavar="STEPS",
                   help="also profile this many steps of each layer and print where its time goes "
                        "(moeblaze.parallel.breakdown)")
    p.add_argument("--commit", help="code version recorded in the rows (default: git's HEAD here, +dirty)")
    args = p.parse_args(argv)

    cuda = torch.cuda.is_available()
    if cuda:
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    env = init_distributed()
    if env.backend is None:
        p.error("launch with torchrun (e.g. torchrun --nproc-per-node 2 benchmarks/bench_ep.py)")
    device, rank, world = env.device, env.rank, env.world_size
    dtype = DTYPES[args.dtype]
    torch.manual_seed(0)  # the same router on every rank; each rank draws its own tokens below
    mb = moeblaze.MoE(args.d_model, args.d_ff, args.experts, args.top_k, aux_loss_coef=0.0, device=device, dtype=dtype,
                      ep_group=dist.group.WORLD)
    titan = TitanStyleEP(mb)
    # the one-GPU layer on this rank's tokens alone (all E experts, no exchange): the floor the EP layer is held to
    torch.manual_seed(0)
    single = moeblaze.MoE(args.d_model, args.d_ff, args.experts, args.top_k, aux_loss_coef=0.0, device=device,
                          dtype=dtype)
    gen = torch.Generator(device=device).manual_seed(1 + rank)
    x = torch.randn(args.tokens, args.d_model, device=device, dtype=dtype, generator=gen).requires_grad_()
    dout = torch.randn(args.tokens, args.d_model, device=device, dtype=dtype, generator=gen)
    splits = {"moeblaze": _split_sizes(mb, x, per_token=True), "torchtitan-style": _split_sizes(mb, x, per_token=False)}
    with torch.no_grad():
        ref = mb(x).float()
        diffs = {"moeblaze": 0.0, **{name: float((layer(x).float() - ref).norm() / ref.norm().clamp_min(1e-30))
                                     for name, layer in (("torchtitan-style", titan), ("moeblaze one GPU", single))}}

    command = " ".join([*(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("MOEBLAZE_")),
                        f"torchrun --nproc-per-node {world}", *sys.argv])
    rows = []
    layers = (("moeblaze", mb), ("torchtitan-style", titan), ("moeblaze one GPU", single))
    everything = [x, *mb.parameters(), *titan.parameters(), *single.parameters()]
    for name, layer in layers:
        def step(layer=layer):
            for q in everything:  # no gradient of the other layer held
                q.grad = None
            layer(x).backward(dout)
        peak = step_peak = None
        if cuda:
            step()  # autotuning and first-call allocations outside the measured peak
            for q in everything:
                q.grad = None
            torch.cuda.empty_cache()
            resident = torch.cuda.memory_allocated(device)  # both layers' weights, x and dout
            torch.cuda.reset_peak_memory_stats(device)
        ms = _timed(step, args.iters, args.warmup, device)
        if cuda:
            top = torch.cuda.max_memory_allocated(device)
            peak, step_peak = (_max_over_ranks(v / 2**20, device) for v in (top, top - resident))
        if args.breakdown:
            rows_bd = gather(profile_steps(step, args.breakdown, device))
            if rank == 0:
                print(f"{name}: {summary(rows_bd)}")
        comm = (_timed(_comm_replay(x.detach(), args.top_k, *splits[name], name == "moeblaze"), args.iters,
                       args.warmup, device) if name in splits else 0.0)
        rows.append({"impl": name, "world": world, "device": torch.cuda.get_device_name(device) if cuda else "cpu",
                     "dtype": args.dtype, "tokens_per_rank": args.tokens, "d": args.d_model, "h": args.d_ff,
                     "E": args.experts, "K": args.top_k, "fwd_bwd_ms": round(ms, 4),
                     "peak_mib": None if peak is None else round(peak, 1),
                     "step_peak_mib": None if step_peak is None else round(step_peak, 1),
                     "sent_rows": sum(splits[name][0]) if name in splits else 0, "comm_ms": round(comm, 4),
                     "comm_share": round(comm / ms, 4), "out_rel_diff": diffs[name],
                     "date": datetime.date.today().isoformat(), "torch": torch.__version__,
                     "commit": args.commit or git_commit(os.path.dirname(os.path.abspath(__file__))),
                     "command": command})
    if rank == 0:
        for r in rows:
            print(", ".join(f"{k}={v}" for k, v in r.items()))
        base, mine = rows[1], rows[0]
        print(f"moeblaze speed-up {base['fwd_bwd_ms'] / mine['fwd_bwd_ms']:.3f}x"
              + ("" if mine["peak_mib"] is None else
                 f", peak memory {mine['peak_mib'] / base['peak_mib']:.1%} of torchtitan-style "
                 f"(above the resident weights and inputs: {mine['step_peak_mib'] / base['step_peak_mib']:.1%})"))
        if args.out:
            new = not os.path.exists(args.out)
            with open(args.out, "a", newline="") as fh:
                writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
                if new:
                    writer.writeheader()
                writer.writerows(rows)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
