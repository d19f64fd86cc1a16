"""The router alone: forward + backward of ``moeblaze.Router`` (softmax top-k, aux and z losses), the fused
Triton kernels against the PyTorch ops (setting ``backend``: ``triton``, ``torch``), at the shapes of the layer
benchmarks.

Per (shape, path): GPU time of a step (kernel time summed by torch.profiler, as ``bench_token_rounding.py``)
and its wall time (``do_bench`` median). ``--warps 4,8`` also times the fused path with the top-k kernel at
each warp count (``moeblaze.kernels.router._topk_warps``). Rows go to a CSV.

    python3 benchmarks/bench_router.py --out router.csv            # GPU
    TRITON_INTERPRET=1 python3 benchmarks/bench_router.py --smoke  # CPU, a pipeline check (the fused path
                                                                   # runs in the interpreter only when it is set)
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch

from moeblaze import Router, settings
from moeblaze.bench.report import append_dicts
from moeblaze.bench.runner import kernel_time_ms
from moeblaze.kernels import router as fused

SHAPES = [(16384, 1536, 128, 2), (16384, 2048, 128, 8), (16384, 4096, 256, 4), (16384, 2048, 512, 10)]
SMOKE_SHAPES = [(64, 16, 8, 2)]


def wall_ms(step) -> float:
    if torch.cuda.is_available():
        import triton

        return triton.testing.do_bench(step, warmup=25, rep=100, return_mode="median")
    import time

    step()
    t0 = time.perf_counter()
    step()
    return 1e3 * (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="CSV file to append the rows to")
    ap.add_argument("--warps", default="", help="top-k kernel warp counts to time besides the default")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.smoke
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    command = " ".join([*(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("MOEBLAZE_")),
                        "python3", "benchmarks/bench_router.py", *sys.argv[1:]])
    default_warps, rows = fused._topk_warps, []
    device_cpu = "cpu (interpreter)" if settings.interpreting() else "cpu (fused path off: no TRITON_INTERPRET)"
    for T, d, E, K in SMOKE_SHAPES if args.smoke else SHAPES:
        torch.manual_seed(0)
        router = Router(d, E, K, aux_loss_coef=0.01, z_loss_coef=0.001, device=device, dtype=dtype)
        x = torch.randn(T, d, device=device, dtype=dtype, requires_grad=True)
        paths = [("torch", False, None), ("fused", True, None)]
        paths += [(f"fused-{w}-warps", True, int(w)) for w in args.warps.split(",") if w]
        for name, on, warps in paths:
            fused._topk_warps = default_warps if warps is None else (lambda E_, w=warps: w)

            def step(on=on, router=router, x=x):
                x.grad = None
                router.weight.grad = None
                with settings.override(backend="triton" if on else "torch"):
                    out = router(x)
                    (out.topk_weights.float().square().sum() + out.aux_loss + out.z_loss).backward()

            g, w = kernel_time_ms(step), wall_ms(step)
            rows.append({"date": datetime.date.today().isoformat(),
                         "device": torch.cuda.get_device_name() if cuda else device_cpu, "T": T, "d": d,
                         "E": E, "K": K, "path": name, "gpu_ms": "" if g is None else round(g, 4),
                         "wall_ms": round(w, 4), "command": command})
            gtxt = "" if g is None else f"GPU {g:.4f} ms, "
            print(f"router T={T} d={d} E={E} K={K} {name}: {gtxt}wall {w:.4f} ms", flush=True)
    fused._topk_warps = default_warps
    if args.out:
        append_dicts(args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
