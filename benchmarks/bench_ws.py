"""The warp-specialized Gluon GEMM (F1, B1) against the Triton grouped GEMM, in one process.

Per config (shapes of ``moeblaze bench``): routing drawn uniformly and the index built once; F1 (``pre``,
``act``) and B1 (``dact'``) computed by both paths, their largest relative difference printed, each op
timed alone (``triton.testing.do_bench``: L2 flushed, median); then the moeblaze layer's forward+backward
step (router included, as ``moeblaze bench``) with ``MOEBLAZE_WS=1`` and ``0``, and the conventional layer,
in interleaved rounds of back-to-back steps (the card's power limit makes a step after idle faster:
docs/benchmarks.md), median.

Usage (GPU, triton 3.6): ``python3 benchmarks/bench_ws.py --configs conf4-swiglu,qwen3-30b-a3b``
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import triton
import triton.testing

from moeblaze import build_dispatch
from moeblaze.bench.baselines import ImplOptions, make_weights, resolve_impl
from moeblaze.bench.configs import CONFIGS, parse_list
from moeblaze.kernels.launch import grouped_gemm, grouped_gemm_ws, ws_ok
from moeblaze.testing import make_routing, rel_error


def _ops(x, w1, w2, dout, index, h):
    """``{name: (triton_fn, ws_fn, outputs)}`` for F1 and B1 writing into fresh buffers."""
    N = index.expert_token_indices.numel()
    d = x.shape[1]
    sched = index.schedule.tensors()
    idx = (index.expert_token_offsets, index.expert_token_indices)
    pre, act, dact = x.new_empty(N, 2 * h), x.new_empty(N, h), x.new_empty(N, h)

    def f1_triton():
        grouped_gemm(x, w1, pre, *idx, sched, b_nk=True, n_cols=h, k_dim=d, gather_a=True, up_off=h, epilogue=1,
                     activation=0, dual=True, store_pre=True, aux=act, store_aux=True)

    def f1_ws():
        grouped_gemm_ws(x, w1, pre, *idx, sched, gated=True, n_cols=h, store_pre=True, aux=act, store_aux=True)

    def b1_triton():
        grouped_gemm(dout, w2, dact, *idx, sched, b_nk=False, n_cols=h, k_dim=d, gather_a=True)

    def b1_ws():
        grouped_gemm_ws(dout, w2, dact, *idx, sched, gated=False, n_cols=h)

    return {"F1": (f1_triton, f1_ws, (pre, act), 4.0 * N * d * h), "B1": (b1_triton, b1_ws, (dact,), 2.0 * N * d * h)}


def compare_ops(cfg) -> None:
    """F1 and B1 by both paths: agreement and time alone."""
    x = torch.randn(cfg.T, cfg.d, device="cuda", dtype=torch.bfloat16)
    dout = torch.randn_like(x)
    w = make_weights(cfg, "cuda", torch.bfloat16)
    ids = make_routing(cfg.T, cfg.E, cfg.K, "uniform", device="cuda")
    index = build_dispatch(ids, cfg.E, block_m=128)
    if not ws_ok(x, w.w1, (x,), cfg.d):
        print(f"  warp-specialized GEMM not available here (triton {triton.__version__}); skipped")
        return
    for name, (slow, fast, outs, flops) in _ops(x, w.w1.detach(), w.w2.detach(), dout, index, cfg.h).items():
        slow()
        want = [o.clone() for o in outs]
        for o in outs:
            o.fill_(float("nan"))  # poison: every element must be written again
        fast()
        diff = max(rel_error(o, r) for o, r in zip(outs, want))
        nan = any(o.isnan().any().item() for o in outs)
        ms = [triton.testing.do_bench(f, warmup=25, rep=200, return_mode="median") for f in (slow, fast)]
        print(f"  {name}: triton {ms[0]:7.3f} ms {flops / ms[0] / 1e9:5.0f} TF/s | ws {ms[1]:7.3f} ms "
              f"{flops / ms[1] / 1e9:5.0f} TF/s | {ms[0] / ms[1]:.3f}x | rel diff {diff:.2e}{' NaN!' if nan else ''}",
              flush=True)


def compare_steps(cfg, rounds: int, steps: int) -> None:
    """The layer's forward+backward step with the warp-specialized GEMM on (``ws``) and off (``triton``), and
    the conventional grouped_mm layer (``moeblaze bench``'s baseline), interleaved in rounds."""
    w = make_weights(cfg, "cuda", torch.bfloat16)
    x = torch.randn(cfg.T, cfg.d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dout = torch.randn_like(x)
    fns = {name: resolve_impl(name).build(cfg, w, ImplOptions()) for name in ("moeblaze", "conventional")}
    modes = {"ws": ("moeblaze", "1"), "triton": ("moeblaze", "0"), "conventional": ("conventional", "0")}
    times: dict[str, list[float]] = {m: [] for m in modes}
    for rnd in range(rounds + 1):  # round 0 compiles and autotunes every path and is not timed
        order = list(modes) if rnd % 2 else list(modes)[::-1]  # alternate, so no path always follows another
        for mode in order:
            impl, ws = modes[mode]
            os.environ["MOEBLAZE_WS"] = ws
            for _ in range(steps if rnd else 3):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fns[impl](x).backward(dout)
                end.record()
                end.synchronize()
                if rnd:
                    times[mode].append(start.elapsed_time(end))
    os.environ.pop("MOEBLAZE_WS")
    med = {m: statistics.median(t) for m, t in times.items()}
    ws, tr, conv = med["ws"], med["triton"], med["conventional"]
    print(f"  step: ws {ws:8.3f} ms | triton {tr:8.3f} ms | conventional {conv:8.3f} ms | ws/triton {tr / ws:.3f}x"
          f" | vs conventional: ws {conv / ws:.3f}x, triton {conv / tr:.3f}x ({rounds} rounds x {steps} steps, median)",
          flush=True)
    quartiles = " | ".join(f"{m} {q[0]:.3f}-{q[2]:.3f}" for m, q in
                           ((m, statistics.quantiles(t, n=4)) for m, t in times.items()))
    print(f"        quartiles (ms): {quartiles}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="conf4-swiglu,qwen3-30b-a3b,olmoe-1b-7b,conf7-swiglu")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--no-steps", action="store_true", help="time the ops only")
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__} | "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    for name in parse_list(args.configs):
        cfg = CONFIGS[name]
        print(f"{name} (T {cfg.T}, d {cfg.d}, h {cfg.h}, E {cfg.E}, K {cfg.K})", flush=True)
        compare_ops(cfg)
        if not args.no_steps:
            compare_steps(cfg, args.rounds, args.steps)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
