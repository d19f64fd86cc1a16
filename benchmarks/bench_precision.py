"""Mixed precision and fp32 (issue 27): one MoE layer forward+backward per precision, and the training preset.

Parts (rows of one CSV, ``part`` column):

``amp``     (a) ``moeblaze.MoE`` with fp32 parameters (and an fp32 input, as the residual stream of an
            autocast model) under ``torch.autocast(bfloat16)`` vs the same layer with bf16 parameters;
            target: within 1.2x (the weight casts are the only extra work).
``fp32``    (c) fp32 parameters without autocast: at ``float32_matmul_precision("high")`` (TF32) against the bf16
            layer's TF/s (target >= 40%: TF32 tensor cores run at half the bf16 rate), and at ``"highest"`` (IEEE)
            against the conventional layer computing in fp32 (``moeblaze bench``'s per-expert fallback), in the
            same run (target: at least as fast), at ``--ieee-tokens`` (default 8192, the issue's fp32 figure:
            IEEE fp32 runs without tensor cores, and autotuning tries each config several times).
``train``   the ``moeblaze train`` default preset (model and batch of ``TrainConfig``/``ModelConfig``), one
            optimizer step per ``--precision`` (fp32 at both matmul precisions; ``fp8-mixed`` on a Hopper GPU): what
            the CUDA default should be.

Layer shape: Qwen3-30B-A3B experts (d 2048, h 768, E 128, K 8, SwiGLU), T = 32768 tokens, router included.
TF/s = 18*N*d*h / time (DESIGN.md §5). Timing: CUDA events around each step, after warm-up steps past the
Triton autotuning (fp32 tunes its own configs per precision), median of ``--reps`` steps. ``--smoke``: tiny shapes,
a few steps, wall clock on the CPU (a check that the script runs; its numbers mean nothing).

Usage: python benchmarks/bench_precision.py --out results.csv [--parts amp,fp32,train] [--reps 20] [--smoke]
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime
import functools
import gc
import statistics
import sys
from collections.abc import Callable

import torch

import moeblaze
from moeblaze.bench.baselines import conventional_experts, torch_router
from moeblaze.bench.configs import layer_flops
from moeblaze.bench.runner import cuda_time_ms
from moeblaze.fp8 import check_fp8_backend
from moeblaze.training.model import ModelConfig, MoETransformer
from moeblaze.training.train import train_step
from moeblaze.training.train_config import TrainConfig, fp8_recipe, make_optimizer, resolve_precision

PARTS = ("amp", "fp32", "train")
QWEN3_30B = {"T": 32768, "d": 2048, "h": 768, "E": 128, "K": 8}
SMOKE = {"T": 64, "d": 32, "h": 16, "E": 4, "K": 2}
COLUMNS = ["part", "variant", "params", "autocast", "matmul_precision", "T", "d", "h", "E", "K", "ms", "tflops",
           "tokens_per_s", "compared_to", "ratio", "target", "status", "note", "device", "torch", "date"]


@contextlib.contextmanager
def matmul_precision(setting: str):
    """``torch.set_float32_matmul_precision(setting)`` for the block, restored afterwards."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(setting)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def median_ms(step: Callable[[], None], warmup: int, reps: int) -> float:
    """Median time of ``step`` (CUDA events; wall clock without CUDA) after ``warmup`` untimed runs."""
    for _ in range(warmup):
        step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return statistics.median(cuda_time_ms(step, reps))


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def layer_row(variant: str, shape: dict, device: str, params: torch.dtype, autocast: torch.dtype | None,
              setting: str, args, impl: str = "moeblaze") -> dict:
    """Forward+backward of one layer (router included): gradients of ``x`` and of every parameter."""
    _free()  # the previous row's tensors
    torch.manual_seed(0)
    T, d, h, E, K = (shape[k] for k in ("T", "d", "h", "E", "K"))
    moe = moeblaze.MoE(d, h, E, K, aux_loss_coef=0.0, device=device, dtype=params)
    x = torch.randn(T, d, device=device, dtype=params, requires_grad=True)
    dout = torch.randn(T, d, device=device, dtype=autocast or params)
    leaves = [x, *moe.parameters()]
    if impl == "moeblaze":
        forward = moe
    else:  # the conventional layer (argsort, gathered x, grouped_mm or a per-expert loop in fp32) on the same weights

        def forward(x):
            tw, ids = torch_router(x, moe.router.weight, K)
            return conventional_experts(x, ids, tw, moe.w_gate_up, moe.w_down)

    def step() -> None:
        with torch.autocast(x.device.type, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            out = forward(x)
        torch.autograd.grad(out, leaves, dout)

    row = {"variant": variant, "params": str(params).removeprefix("torch."), "matmul_precision": setting,
           "autocast": str(autocast).removeprefix("torch.") if autocast else "", **shape, "status": "ok", "note": ""}
    try:
        with matmul_precision(setting):
            ms = median_ms(step, args.warmup, args.reps)
        row.update(ms=ms, tflops=layer_flops(T, d, h, K) / (ms * 1e-3) / 1e12, tokens_per_s=T / (ms * 1e-3))
    except torch.OutOfMemoryError:
        row.update(status="OOM")
    except Exception as exc:  # a benchmark records the failure as data and goes on
        row.update(status="error", note=f"{type(exc).__name__}: {str(exc)[:160]}")
    return row


def _compare(row: dict, base: dict, key: str, target: str, smaller_is_better: bool) -> None:
    """Fill ``compared_to``/``ratio``/``target`` of ``row`` against ``base`` on ``key``."""
    row.update(compared_to=base["variant"], target=target)
    if row.get(key) and base.get(key):
        row["ratio"] = row[key] / base[key] if smaller_is_better else base[key] / row[key]


def amp_and_fp32_rows(parts: set[str], shape: dict, device: str, args) -> list[dict]:
    bf16 = layer_row("moeblaze bf16 params", shape, device, torch.bfloat16, None, "highest", args)
    rows = [dict(bf16, part="amp" if "amp" in parts else "fp32")]
    if "amp" in parts:
        amp = layer_row("moeblaze fp32 params, bf16 autocast", shape, device, torch.float32, torch.bfloat16,
                        "highest", args)
        _compare(amp, bf16, "ms", "time ratio <= 1.2", smaller_is_better=True)
        rows.append(dict(amp, part="amp"))
    if "fp32" in parts:
        high = layer_row("moeblaze fp32 (TF32)", shape, device, torch.float32, None, "high", args)
        high.update(compared_to=bf16["variant"], target="TF/s ratio >= 0.40")
        if high.get("tflops") and bf16.get("tflops"):
            high["ratio"] = high["tflops"] / bf16["tflops"]
        rows.append(dict(high, part="fp32"))
        rows.append(dict(layer_row("conventional fp32 (TF32)", shape, device, torch.float32, None, "high", args,
                                   impl="conventional"), part="fp32"))
        small = dict(shape, T=args.ieee_tokens)
        conv = layer_row("conventional fp32 (IEEE)", small, device, torch.float32, None, "highest", args,
                         impl="conventional")
        ieee = layer_row("moeblaze fp32 (IEEE)", small, device, torch.float32, None, "highest", args)
        _compare(ieee, conv, "ms", "time ratio <= 1.0", smaller_is_better=True)
        rows += [dict(ieee, part="fp32"), dict(conv, part="fp32")]
    return rows


def train_rows(device: str, args) -> list[dict]:
    """One optimizer step of the ``moeblaze train`` preset per precision (the loop's own ``train_step``)."""
    tcfg = TrainConfig()
    mcfg = ModelConfig(seq_len=32, d_model=32, n_layers=1, n_heads=2, d_ff=32) if args.smoke else ModelConfig()
    batch = 2 if args.smoke else tcfg.batch_size
    tokens = batch * mcfg.seq_len
    rows = []
    precisions = [("bf16-mixed", "highest"), ("bf16", "highest"), ("fp32", "highest"), ("fp32", "high")]
    if device == "cuda":  # fp8-mixed where the FP8 kernels run (Hopper and newer)
        with contextlib.suppress(ValueError):
            check_fp8_backend("triton", torch.bfloat16, torch.device(device), fp8_recipe("fp8-mixed"))
            precisions.append(("fp8-mixed", "highest"))
    for precision, setting in precisions:
        _, params, amp = resolve_precision(precision, torch.device(device))
        torch.manual_seed(tcfg.seed)
        model = MoETransformer(mcfg).to(device=device, dtype=params)
        model.set_fp8(fp8_recipe(precision))
        opt = make_optimizer(model, tcfg)
        gen = torch.Generator(device=device).manual_seed(0)
        data = torch.randint(0, 256, (batch, mcfg.seq_len + 1), device=device, generator=gen)
        step = functools.partial(train_step, model, opt, data[:, :-1], data[:, 1:], tcfg.lr, tcfg.grad_clip,
                                 autocast=amp)
        row = {"part": "train", "variant": f"--precision {precision}", "params": str(params).removeprefix("torch."),
               "autocast": str(amp).removeprefix("torch.") if amp else "", "matmul_precision": setting,
               "T": tokens, "d": mcfg.d_model, "h": mcfg.d_ff, "E": mcfg.num_experts, "K": mcfg.top_k,
               "status": "ok", "note": f"{mcfg.n_layers} layers, batch {batch} x {mcfg.seq_len}"}
        try:
            with matmul_precision(setting):
                ms = median_ms(step, args.warmup, args.reps)
            row.update(ms=ms, tokens_per_s=tokens / (ms * 1e-3))
        except Exception as exc:
            row.update(status="error", note=f"{type(exc).__name__}: {str(exc)[:160]}")
        rows.append(row)
        del model, opt, step
        _free()
    fastest = min((r for r in rows if r.get("ms")), key=lambda r: r["ms"], default=None)
    for r in rows:
        if fastest is not None and r.get("ms"):
            _compare(r, fastest, "ms", "fastest = CUDA default", smaller_is_better=True)
    return rows


def print_table(rows: list[dict]) -> None:
    head = f"{'part':<6} {'variant':<38} {'matmul':<8} {'ms':>10} {'TF/s':>8} {'tok/s':>12} {'ratio':>7}  target"
    print(head)
    print("-" * len(head))
    for r in rows:
        ms = f"{r['ms']:.3f}" if r.get("ms") else r["status"]
        tf = f"{r['tflops']:.1f}" if r.get("tflops") else ""
        tok = f"{r['tokens_per_s']:,.0f}" if r.get("tokens_per_s") else ""
        ratio = f"{r['ratio']:.3f}" if r.get("ratio") else ""
        print(f"{r['part']:<6} {r['variant']:<38} {r['matmul_precision']:<8} {ms:>10} {tf:>8} {tok:>12} {ratio:>7}  "
              f"{r.get('target', '')} {r.get('note', '')}".rstrip())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="CSV file to append the rows to (header written if new)")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {PARTS}")
    p.add_argument("--reps", type=int, default=20, help="timed steps per row (median reported)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (compilation, autotuning)")
    p.add_argument("--tokens", type=int, default=QWEN3_30B["T"], help="T of the layer rows")
    p.add_argument("--ieee-tokens", type=int, default=8192, help="T of the IEEE fp32 rows (no tensor cores)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, 2 steps: checks that the script runs (CPU ok)")
    args = p.parse_args(argv)
    parts = {s for s in args.parts.split(",") if s}
    if not parts <= set(PARTS):
        p.error(f"--parts must be a subset of {PARTS}, got {sorted(parts)}")
    if args.smoke:
        args.reps, args.warmup = 2, 1
    elif not torch.cuda.is_available():
        p.error("needs a CUDA GPU (use --smoke to check the script on the CPU)")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shape = dict(SMOKE) if args.smoke else dict(QWEN3_30B, T=args.tokens)
    if args.smoke:
        args.ieee_tokens = SMOKE["T"] // 2
    rows = amp_and_fp32_rows(parts, shape, device, args) if parts & {"amp", "fp32"} else []
    if "train" in parts:
        rows += train_rows(device, args)
    stamp = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
             "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    print_table(rows)
    with open(args.out, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        if f.tell() == 0:
            writer.writeheader()
        writer.writerows({**r, **stamp} for r in rows)
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
