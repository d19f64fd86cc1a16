"""Expert-parallel MoE layer: moeblaze against torchtitan 0.3.0's own EP MoE and a torchtitan-style EP layer on the
same ranks (issues 23, 57), and the FP8 layer beside the bf16 one (issue 59).

Launch with torchrun, one process per GPU (NCCL; gloo on the CPU with tiny shapes, for testing):

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \\
        torchrun --nproc-per-node 2 benchmarks/bench_ep.py --out ep.csv          # Qwen3-30B-A3B shape
    torchrun --nproc-per-node 2 benchmarks/bench_ep.py --tokens 64 --d-model 32 --d-ff 16 --experts 8 --top-k 2 \\
        --dtype float32 --iters 2 --warmup 1                                      # CPU smoke run

All layers share the router weight and the expert weights and route the same tokens (``--impls``, default all
that can run here; :mod:`moeblaze.bench.ep_baselines` builds the baselines). ``moeblaze``: :class:`moeblaze.MoE`
made expert-parallel (each token sent once per destination rank with its pairs, fused kernels over the received
rows through a general routing index, each row's local experts combined before it goes back). ``torchtitan``:
torchtitan 0.3.0's ``MoE`` (``TokenChoiceTopKRouter``, ``GroupedExperts`` on ``torch._grouped_mm``,
``AllToAllTokenDispatcher``) parallelised by its own ``ParallelDims`` / ``moe_sharding`` / ``Module.parallelize``
with its default ``spmd_types`` backend, whose uneven exchange is ``dist.all_to_all`` over split chunks (NCCL
only); ``torchtitan-dtensor``: the same layer under its ``partial_dtensor`` backend (DTensor experts,
``all_to_all_single``; runs on gloo too). Both need torchtitan importable (the wheels torchtitan==0.3.0, tyro,
docstring_parser, spmd_types==0.2.3). ``torchtitan-style``: the same steps written in this repository (argsort
of the routing, gathered copy of x with a row per (token, expert) pair, the all-to-alls, received rows
regrouped by local expert, ``grouped_mm`` for both projections, autograd through plain PyTorch ops).
``moeblaze-fp8``: the moeblaze layer with ``fp8=Float8Recipe()`` (the rowwise recipe), the same weights and exchange;
its rows go out in e4m3 with their scales (gradients back in 16 bits).

Per layer, rank 0 writes one CSV row: forward+backward time (median over ``--iters`` steps, the slowest
rank; CUDA events on GPU), peak memory (``torch.cuda.max_memory_allocated``, the largest rank; empty on
the CPU) and the step's own part of it (above the resident weights of all the layers built, x and dout; no
gradient held between steps), the rows each rank sends, the time of the step's all-to-alls replayed alone
with the same split sizes and their share of the step, the output's relative difference from the
moeblaze layer (the largest rank's; torchtitan computes its experts with bf16 operands whatever the dtype,
so in float32 its difference is bf16 rounding), and the code version and command.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

import moeblaze
from moeblaze.bench.ep_baselines import TitanStyleEP, build_torchtitan_ep, torchtitan_available
from moeblaze.bench.report import append_dicts
from moeblaze.bench.results import git_commit
from moeblaze.fp8 import Float8Recipe
from moeblaze.parallel import EXCHANGES, expert_parallel, init_distributed
from moeblaze.parallel.breakdown import gather, profile_steps, summary

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


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
    """Median milliseconds of ``fn()`` over ``iters`` runs after ``warmup``, the slowest rank's."""
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


def _comm_replay(x: torch.Tensor, K: int, send: list[int], recv: list[int], pair_data: bool, fp8: bool = False):
    """The step's all-to-alls alone: rows of d out and back in forward, the same two in backward; with
    ``pair_data`` (moeblaze) also each row's K weights (fp32) and K local expert ids (int32) out in forward,
    and the weights' gradient back in backward; with ``fp8`` the forward's rows out as d e4m3 bytes and each row's
    fp32 scale beside its pairs (as :mod:`moeblaze.parallel.ep` sends them), the other three in ``x``'s dtype."""
    rows = x.new_empty(sum(send), x.shape[1])
    back = x.new_empty(sum(recv), x.shape[1])
    extra = 1 if fp8 else 0  # the scale travels with the pairs
    w, wb = (t.new_empty(t.shape[0], K + extra, dtype=torch.float32) for t in (rows, back))
    ids, idb = w[:, :K].to(torch.int32).contiguous(), wb[:, :K].to(torch.int32).contiguous()
    grad_w, grad_wb = w[:, :K].contiguous(), wb[:, :K].contiguous()
    rows8, back8 = (t.new_empty(t.shape, dtype=torch.uint8) for t in (rows, back))  # e4m3 rows: a byte a value

    def run():
        for i in range(2):
            if fp8 and i == 0:
                dist.all_to_all_single(back8, rows8, recv, send)
            else:
                dist.all_to_all_single(back, rows, recv, send)
            dist.all_to_all_single(rows, back, send, recv)
        if pair_data:
            dist.all_to_all_single(wb, w, recv, send)
            dist.all_to_all_single(idb, ids, recv, send)
            dist.all_to_all_single(grad_w, grad_wb, send, recv)
    return run


def _max_over_ranks(value: float, device: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


IMPLS = ("moeblaze", "moeblaze-fp8", "torchtitan", "torchtitan-dtensor", "torchtitan-style", "one-gpu")
TITAN_BACKENDS = {"torchtitan": "spmd_types", "torchtitan-dtensor": "partial_dtensor"}


def _parse_impls(p: argparse.ArgumentParser, text: str | None, backend: str) -> list[str]:
    """The layers to time, in ``IMPLS`` order; by default every one that can run here."""
    if text is None:
        titan = ["torchtitan" if backend == "nccl" else "torchtitan-dtensor"] if torchtitan_available() else []
        return [n for n in IMPLS if n in ("moeblaze", "torchtitan-style", "one-gpu", *titan)]
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in IMPLS]
    if bad or not names:
        p.error(f"--impls takes a comma-separated list of {', '.join(IMPLS)}; got {text!r}")
    if "torchtitan" in names and backend != "nccl":
        p.error("--impls torchtitan (its spmd_types backend) exchanges uneven chunks with dist.all_to_all, which "
                "gloo cannot run; use torchtitan-dtensor (its partial_dtensor backend) on the CPU")
    return [n for n in IMPLS if n in names]


def _build(names: list[str], mb: moeblaze.MoE) -> dict[str, torch.nn.Module]:
    """The baseline layers of ``names`` on ``mb``'s router and expert weights."""
    layers = {}
    for name in names:
        if name == "torchtitan-style":
            layers[name] = TitanStyleEP(mb)
        elif name == "one-gpu":  # all E experts on this rank's own tokens, no exchange: the floor of the EP layer
            torch.manual_seed(0)  # mb's draw: the same router and (all) experts
            layers[name] = moeblaze.MoE(mb.d_model, mb.d_ff, mb.num_experts, mb.top_k, aux_loss_coef=0.0,
                                        device=mb.w_down.device, dtype=mb.w_down.dtype)
        else:
            layers[name] = build_torchtitan_ep(mb, TITAN_BACKENDS[name])
    return layers


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=16384, help="tokens per rank (T)")
    p.add_argument("--d-model", type=int, default=2048, help="d")
    p.add_argument("--d-ff", type=int, default=768, help="h")
    p.add_argument("--experts", type=int, default=128, help="E, split over the ranks")
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--impls", help=f"comma-separated layers of {', '.join(IMPLS)} (default: moeblaze, "
                   "torchtitan-style and, where torchtitan imports, torchtitan on NCCL or torchtitan-dtensor on gloo)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--out", help="append the CSV rows to this file")
    p.add_argument("--commit", help="code version recorded in the rows (default: git's HEAD here, +dirty)")
    p.add_argument("--exchanges", default="auto",
                   help=f"comma-separated token exchanges of the moeblaze layer, one layer each "
                        f"({', '.join(EXCHANGES)}; moeblaze.parallel.exchange); the baselines are compared with the "
                        "first")
    p.add_argument("--breakdown", type=int, default=0, metavar="STEPS",
                   help="also profile this many steps of each layer and print where its time goes "
                        "(moeblaze.parallel.breakdown)")
    return p


def _layers(p: argparse.ArgumentParser, args: argparse.Namespace, backend: str, device: torch.device,
            dtype: torch.dtype) -> dict[str, torch.nn.Module]:
    """The moeblaze layer of each ``--exchanges`` kind (the first named ``moeblaze``), the FP8 layer on the first
    (``moeblaze-fp8``, when named), then the baselines."""
    names = _parse_impls(p, args.impls, backend)
    exchanges = [e.strip() for e in args.exchanges.split(",") if e.strip()]
    if not exchanges or any(e not in EXCHANGES for e in exchanges):
        p.error(f"--exchanges takes a comma-separated list of {', '.join(EXCHANGES)}; got {args.exchanges!r}")
    ours = [("moeblaze" if i == 0 else f"moeblaze:{kind}", kind, None) for i, kind in enumerate(exchanges)]
    if "moeblaze-fp8" in names:
        ours.append(("moeblaze-fp8", exchanges[0], Float8Recipe()))
    ep_layers = {}
    for name, kind, fp8 in ours:
        torch.manual_seed(0)  # the same router and experts on every rank and in every layer
        ep_layers[name] = expert_parallel(
            moeblaze.MoE(args.d_model, args.d_ff, args.experts, args.top_k, aux_loss_coef=0.0, device=device,
                         dtype=dtype, fp8=fp8), dist.group.WORLD, kind, max_tokens=args.tokens)  # T known to every rank
    baselines = [n for n in names if not n.startswith("moeblaze")]
    return {**ep_layers, **_build(baselines, ep_layers["moeblaze"])}


def _measure(name: str, layer: torch.nn.Module, x: torch.Tensor, dout: torch.Tensor, params: list, splits,
             args: argparse.Namespace, device: torch.device) -> dict:
    """One layer's forward+backward time, its peaks (CUDA) and its all-to-alls replayed alone: the row's figures, its
    exchange first."""
    ours = name.startswith("moeblaze")

    def step():
        for q in (x, *params):  # no gradient of another layer held
            q.grad = None
        layer(x).backward(dout)
    peak = step_peak = None
    cuda = device.type == "cuda"
    if cuda:
        step()  # autotuning and first-call allocations outside the measured peak
        for q in (x, *params):
            q.grad = None
        torch.cuda.empty_cache()
        resident = torch.cuda.memory_allocated(device)  # all the layers' weights, x and dout
        torch.cuda.reset_peak_memory_stats(device)
    ms = _timed(step, args.iters, args.warmup, device)
    if cuda:
        top = torch.cuda.max_memory_allocated(device)
        peak, step_peak = (_max_over_ranks(v / 2**20, device) for v in (top, top - resident))
    if args.breakdown:
        if ours:
            layer.ep.recv_rows = None  # rows received per step, counted over the profiled steps
        row = profile_steps(step, args.breakdown, device)
        if ours:
            row.recv_rows = int(layer.ep.recv_rows) // args.breakdown
        split = gather(row)
        if dist.get_rank() == 0:
            print(f"{name}: {summary(split)}")
    comm = 0.0 if name == "one-gpu" else _timed(_comm_replay(x.detach(), args.top_k, *splits, ours,
                                                             fp8=name == "moeblaze-fp8"),
                                                args.iters, args.warmup, device)
    return {"exchange": layer.ep.exchange.kind if ours else "", "fwd_bwd_ms": round(ms, 4),
            "peak_mib": None if peak is None else round(peak, 1),
            "step_peak_mib": None if step_peak is None else round(step_peak, 1),
            "sent_rows": 0 if name == "one-gpu" else sum(splits[0]), "comm_ms": round(comm, 4),
            "comm_share": round(comm / ms, 4)}


def main(argv: list[str] | None = None) -> int:
    p = _parser()
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
    layers = _layers(p, args, env.backend, device, dtype)
    mb = layers["moeblaze"]
    params = [q for q in {id(q): q for m in layers.values() for q in m.parameters()}.values()]
    gen = torch.Generator(device=device).manual_seed(1 + rank)
    x = torch.randn(args.tokens, args.d_model, device=device, dtype=dtype, generator=gen).requires_grad_()
    dout = torch.randn(args.tokens, args.d_model, device=device, dtype=dtype, generator=gen)
    pair_splits = _split_sizes(mb, x, per_token=False)  # the baselines send a row per (token, expert) pair
    with torch.no_grad():
        ref = mb(x).float()
        diffs = {name: 0.0 if name == "moeblaze" else
                 _max_over_ranks(float((layer(x).float() - ref).norm() / ref.norm().clamp_min(1e-30)), device)
                 for name, layer in layers.items()}

    command = " ".join([*(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("MOEBLAZE_")),
                        f"torchrun --nproc-per-node {world}", *sys.argv])
    rows = []
    for name, layer in layers.items():
        splits = _split_sizes(mb, x, per_token=True) if name.startswith("moeblaze") else pair_splits
        figures = _measure(name, layer, x, dout, params, splits, args, device)
        rows.append({"impl": name, "exchange": figures.pop("exchange"), "world": world,
                     "device": torch.cuda.get_device_name(device) if cuda else "cpu",
                     "dtype": args.dtype, "tokens_per_rank": args.tokens, "d": args.d_model, "h": args.d_ff,
                     "E": args.experts, "K": args.top_k, **figures,
                     "out_rel_diff": diffs[name],
                     "date": datetime.date.today().isoformat(), "torch": torch.__version__,
                     "commit": args.commit or git_commit(os.path.dirname(os.path.abspath(__file__))),
                     "command": command})
    if rank == 0:
        _report(rows, args.out)
    dist.destroy_process_group()
    return 0


def _report(rows: list[dict], out: str | None) -> None:
    """Print the rows and moeblaze's speed-up and peak memory against each baseline; append them to ``out``."""
    for r in rows:
        print(", ".join(f"{k}={v}" for k, v in r.items()))
    mine = next((r for r in rows if r["impl"] == "moeblaze"), None)
    for base in rows if mine is not None else []:
        if base is mine:
            continue
        if base["impl"].startswith("moeblaze"):  # a variant (another exchange, FP8), not a baseline
            print(f"{base['impl']}: {mine['fwd_bwd_ms'] / base['fwd_bwd_ms']:.3f}x the moeblaze layer's speed")
            continue
        print(f"moeblaze speed-up over {base['impl']} {base['fwd_bwd_ms'] / mine['fwd_bwd_ms']:.3f}x"
              + ("" if mine["peak_mib"] is None else
                 f", peak memory {mine['peak_mib'] / base['peak_mib']:.1%} of {base['impl']}'s "
                 f"(above the resident weights and inputs: {mine['step_peak_mib'] / base['step_peak_mib']:.1%})"))
    if out:
        append_dicts(out, rows)


if __name__ == "__main__":
    sys.exit(main())
