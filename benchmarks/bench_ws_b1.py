"""The warp-specialized B1 (``moeblaze.kernels.ws_b1``) against the two-launch B1, in one process.

Per config (shapes of ``moeblaze bench``): routing drawn uniformly and the index built once; B1 run both
ways on the same ``pre``: ``dpre`` and ``w * act`` compared bitwise, ``<dact', act>`` by relative
difference; each way timed alone (``triton.testing.do_bench``: L2 flushed, median; in place, so the
replays run on their own outputs: the timing holds, the values do not matter). Then the moeblaze layer's
forward+backward step (router included, as ``moeblaze bench``) with ``MOEBLAZE_WS=1`` and ``0``, and the
conventional layer, in interleaved rounds of back-to-back steps whose order alternates (the card's power
limit makes a step after idle faster: docs/benchmarks.md), median.

Usage (GPU, triton 3.6): ``python3 benchmarks/bench_ws_b1.py --configs conf4-swiglu,qwen3-30b-a3b``
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
from moeblaze.kernels.act_bwd import act_bwd_rows
from moeblaze.kernels.launch import WS_BLOCK_N, grouped_gemm, ws_b1, ws_b1_ok
from moeblaze.testing import make_routing, rel_error


def compare_ops(cfg, ws_configs: list[dict]) -> None:
    """B1 both ways: agreement and time alone; the warp-specialized kernel also with each of ``ws_configs``."""
    N, d, h = cfg.T * cfg.K, cfg.d, cfg.h
    dout = torch.randn(cfg.T, d, device="cuda", dtype=torch.bfloat16)
    w2 = make_weights(cfg, "cuda", torch.bfloat16).w2.detach()
    index = build_dispatch(make_routing(cfg.T, cfg.E, cfg.K, "uniform", device="cuda"), cfg.E, block_m=128)
    idx = (index.expert_token_offsets, index.expert_token_indices, index.schedule.tensors())
    pre0 = torch.randn(N, 2 * h, device="cuda", dtype=torch.bfloat16)
    scale = torch.rand(N, device="cuda")
    if not ws_b1_ok(dout, w2, pre0, pre0):
        print(f"  warp-specialized B1 not available here (triton {triton.__version__}); skipped")
        return
    pre, wact = pre0.clone(), pre0.new_empty(N, h)
    dtw = torch.empty(N, device="cuda")
    part = torch.empty(N, triton.cdiv(h, 64), device="cuda")  # room for the BLOCK_N of any swept config

    def two_launch():
        grouped_gemm(dout, w2, wact, *idx, b_nk=False, n_cols=h, k_dim=d, gather_a=True)
        act_bwd_rows(wact, pre, pre, scale, dtw, h=h, activation=0, store_wact=True)

    def fused():
        ws_b1(dout, w2, pre, wact, scale, part, *idx, activation=0)

    two_launch()  # autotunes its kernels
    want = (pre.clone(), wact.clone(), dtw.clone())
    pre.copy_(pre0)
    wact.fill_(float("nan"))  # poison: every element must be written again
    fused()
    got = (pre, wact, part[:, :triton.cdiv(h, WS_BLOCK_N)].sum(1))
    same = [torch.equal(a, b) for a, b in zip(got[:2], want[:2])]
    nan = any(t.isnan().any().item() for t in got)
    ms = [triton.testing.do_bench(f, warmup=25, rep=200, return_mode="median") for f in (two_launch, fused)]
    flops = 2.0 * N * d * h
    print(f"  B1: two launches {ms[0]:7.3f} ms {flops / ms[0] / 1e9:5.0f} TF/s | ws {ms[1]:7.3f} ms "
          f"{flops / ms[1] / 1e9:5.0f} TF/s | {ms[0] / ms[1]:.3f}x | dpre, w*act bitwise equal {same} | "
          f"dtw rel diff {rel_error(got[2], want[2]):.2e}{' NaN!' if nan else ''}", flush=True)
    for c in ws_configs:
        t = triton.testing.do_bench(lambda c=c: ws_b1(dout, w2, pre, wact, scale, part, *idx, activation=0, config=c),
                                    warmup=25, rep=200, return_mode="median")
        print(f"      ws {c}: {t:7.3f} ms {flops / t / 1e9:5.0f} TF/s | {ms[0] / t:.3f}x", flush=True)


def compare_steps(cfg, rounds: int, steps: int) -> None:
    """The layer's forward+backward step with the warp-specialized B1 on (``ws``) and off (``two``), and the
    conventional grouped_mm layer (``moeblaze bench``'s baseline), interleaved in rounds."""
    w = make_weights(cfg, "cuda", torch.bfloat16)
    x = torch.randn(cfg.T, cfg.d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dout = torch.randn_like(x)
    fns = {name: resolve_impl(name).build(cfg, w, ImplOptions()) for name in ("moeblaze", "conventional")}
    modes = {"ws": ("moeblaze", "1"), "two": ("moeblaze", "0"), "conventional": ("conventional", "0")}
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
    ws, two, conv = med["ws"], med["two"], med["conventional"]
    print(f"  step: ws {ws:8.3f} ms | two launches {two:8.3f} ms | conventional {conv:8.3f} ms | ws/two {two / ws:.3f}x"
          f" | vs conventional: ws {conv / ws:.3f}x, two {conv / two:.3f}x ({rounds} rounds x {steps} steps, median)",
          flush=True)
    quartiles = " | ".join(f"{m} {q[0]:.3f}-{q[2]:.3f}" for m, q in
                           ((m, statistics.quantiles(t, n=4)) for m, t in times.items()))
    print(f"        quartiles (ms): {quartiles}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="conf4-swiglu,qwen3-30b-a3b,olmoe-1b-7b,conf7-swiglu")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--no-steps", action="store_true", help="time B1 alone only")
    ap.add_argument("--ws-configs", default="", help="more BLOCK_NxBLOCK_KxNUM_STAGES to time, e.g. 192x64x4")
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__} | "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    for name in parse_list(args.configs):
        cfg = CONFIGS[name]
        print(f"{name} (T {cfg.T}, d {cfg.d}, h {cfg.h}, E {cfg.E}, K {cfg.K})", flush=True)
        compare_ops(cfg, [dict(zip(("BLOCK_N", "BLOCK_K", "NUM_STAGES"), map(int, c.split("x"))))
                          for c in parse_list(args.ws_configs)])
        if not args.no_steps:
            compare_steps(cfg, args.rounds, args.steps)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
