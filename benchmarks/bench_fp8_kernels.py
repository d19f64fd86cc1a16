"""The FP8 forward kernels F1 and F2-F3 (``moeblaze.kernels.fp8_gemm``, e4m3 under the blockwise and the rowwise
recipe) against the bf16 ones.

Per shape (T, d, h, E, K; uniform top-k routing, SwiGLU, bf16 inputs from ``moeblaze.testing.make_expert_inputs``):
the largest difference of each FP8 kernel's output from the PyTorch emulation of the same recipe
(``moeblaze.ops_fp8``: the same e4m3 operands and scales, fp32 sums; relative to the largest output, so the bf16
rounding of the stored output is what remains), how far FP8's ``pre`` lies from the bf16 kernel's (the recipe's own
rounding), and the median time of each kernel (``triton.testing.do_bench``; quantization of the operands not timed)
with its TFLOP/s (F1 4·N·d·h, F2 2·N·d·h, N = T·K), and the time to quantize ``x`` with the recipe's PyTorch ops
and (rowwise) with the one-launch kernel. Both kernels run in this process on the same inputs. Rowwise also times
the FP8 layer's F1 (``f1_layer``: ``pre`` kept in e4m3 tiles by the epilogue, on the warp-specialized Gluon kernel
where it runs, ``moeblaze.kernels.fp8_ws_up``; weights quantized once, as a layer under ``fp8.reuse_weights()``).

Blockwise (this module's kernels) promotes each 128-deep K step's product into the fp32 accumulator with its
scales; rowwise (the 16-bit path's grouped GEMM on e4m3 operands) accumulates over all of K and scales once:
which is faster on Hopper decides the recipe of the FP8 backward kernels.

Usage (a GPU of sm90 or newer):
    python3 benchmarks/bench_fp8_kernels.py [--configs small,qwen3-30b-a3b] [--recipes blockwise,rowwise]
        [--tokens T] [--note TEXT] [--out F.csv]
"""

from __future__ import annotations

import argparse
import datetime
import sys

import torch
import triton

from moeblaze import build_dispatch, fp8, ops_fp8
from moeblaze.bench.report import append_dicts
from moeblaze.bench.results import git_commit
from moeblaze.dispatch import with_schedule
from moeblaze.fp8 import GRANULARITIES, Float8Recipe
from moeblaze.kernels import experts as bf16_kernels
from moeblaze.kernels import fp8_experts, tuning
from moeblaze.kernels.fp8_gemm import down_forward_fp8, up_forward_fp8
from moeblaze.kernels.fp8_quant import quantize_rows_fp8
from moeblaze.testing import make_expert_inputs

CONFIGS = {  # name: (T, d, h, E, K)
    "small": (512, 256, 128, 8, 2),
    "odd": (300, 200, 72, 5, 2),  # d and h not multiples of the 128-wide scale blocks
    "qwen3-30b-a3b": (16384, 2048, 768, 128, 8),
    "olmoe-1b-7b": (16384, 2048, 1024, 64, 8),
    "deepseek-v3": (16384, 7168, 2048, 256, 8),
}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def measure(name: str, recipe: Float8Recipe, tokens: int | None = None) -> dict:
    """One shape's row (see the module docstring); ``tokens``: T instead of the config's."""
    T, d, h, E, K = CONFIGS[name]
    T = tokens or T
    inp = make_expert_inputs(T, d, h, E, K, dtype=torch.bfloat16, device="cuda", seed=0)
    x, w1, w2, tw = inp["x"], inp["w_gate_up"], inp["w_down"], inp["topk_weights"]
    # the tile schedule built once here, as a layer's plan does: not in the timed runs
    index = with_schedule(build_dispatch(inp["topk_ids"], E), tuning.block_m(T * K, E))
    xq, w1q, w2q = recipe.quantize_rows(x), recipe.quantize_weight(w1, True), recipe.quantize_weight(w2, True)
    pre, act = up_forward_fp8(xq, w1q, index, "swiglu")
    pre_em, _, _ = ops_fp8.up_forward(recipe, xq, w1, index, "swiglu")
    actq = recipe.quantize_rows(act)
    out = down_forward_fp8(actq, w2q, tw, index)
    out_em, _ = ops_fp8.down_forward(recipe, act, w2, tw, index)
    pre16, act16 = bf16_kernels.up_forward(x, w1, index, "swiglu", True, True)
    times = {
        "f1_fp8": lambda: up_forward_fp8(xq, w1q, index, "swiglu"),
        "f1_bf16": lambda: bf16_kernels.up_forward(x, w1, index, "swiglu", True, True),
        "f2_fp8": lambda: down_forward_fp8(actq, w2q, tw, index),
        "f2_bf16": lambda: bf16_kernels.down_forward(act16, w2, tw, index),
    }
    if recipe.granularity == "rowwise":
        times["f1_layer"] = lambda: fp8_experts.up_forward(recipe, xq, w1, index, "swiglu", keep=True)
    with fp8.reuse_weights():  # f1_layer quantizes w1 once; the other kernels take quantized weights
        ms = {k: triton.testing.do_bench(fn, warmup=50, rep=300) for k, fn in times.items()}
    flop = {"f1": 4 * T * K * d * h, "f2": 2 * T * K * d * h}
    row = {"config": name, "T": T, "d": d, "h": h, "E": E, "K": K, "recipe": recipe.granularity,
           "f1_rel_err_vs_emulation": f"{_rel(pre, pre_em):.2e}", "f2_rel_err_vs_emulation": f"{_rel(out, out_em):.2e}",
           "f1_rel_diff_vs_bf16": f"{_rel(pre, pre16):.2e}"}
    for k, v in ms.items():
        row[f"{k}_ms"] = f"{v:.4f}"
        row[f"{k}_tflops"] = f"{flop[k[:2]] / v / 1e9:.0f}"
    row.setdefault("f1_layer_ms", "")
    row.setdefault("f1_layer_tflops", "")
    # quantizing x: the recipe's PyTorch ops against the rowwise kernel (one launch; blockwise has none)
    row["quant_x_torch_ms"] = f"{triton.testing.do_bench(lambda: recipe.quantize_rows(x), warmup=50, rep=300):.4f}"
    row["quant_x_kernel_ms"] = (f"{triton.testing.do_bench(lambda: quantize_rows_fp8(x), warmup=50, rep=300):.4f}"
                                if recipe.granularity == "rowwise" else "")
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated names [%(default)s]")
    p.add_argument("--recipes", default="blockwise,rowwise", help="comma-separated granularities [%(default)s]")
    p.add_argument("--tokens", type=int, help="T for every config instead of its own")
    p.add_argument("--note", default="", help="text for the rows' note column (e.g. which code ran)")
    p.add_argument("--out", help="append the rows to this CSV (header written when new)")
    args = p.parse_args(argv)
    names = args.configs.split(",")
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        p.error(f"--configs: unknown {unknown}; known: {', '.join(CONFIGS)}")
    recipes = args.recipes.split(",")
    if bad := [r for r in recipes if r not in GRANULARITIES]:
        p.error(f"--recipes: unknown {bad}; known: {', '.join(GRANULARITIES)}")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        p.error("needs a CUDA GPU of compute capability 9.0 or newer (e4m3 tensor cores)")
    args_given = argv if argv is not None else sys.argv[1:]
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
            "device": torch.cuda.get_device_name(), "commit": git_commit(), "torch": torch.__version__,
            "triton": triton.__version__,
            "command": " ".join(["python3 benchmarks/bench_fp8_kernels.py", *args_given])}
    for name, recipe in ((n, r) for n in names for r in recipes):
        row = {**meta, **measure(name, Float8Recipe(recipe), args.tokens), "note": args.note}
        print(row, flush=True)
        if args.out:
            append_dicts(args.out, [row])
    return 0


if __name__ == "__main__":
    sys.exit(main())
