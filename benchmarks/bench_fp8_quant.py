"""The rowwise e4m3 quantization kernel (``moeblaze.kernels.fp8_quant``) on every operand the FP8 layer quantizes
in one step, at one config: ``x [T, d]``, ``act [N, h]``, ``pre [N, 2h]`` (B3's ``dpre`` has its shape), the
weights ``w1 [E, 2h, d]`` and ``w2 [E, d, h]`` along their rows (F1, F2) and their transposed views along theirs
(B3, B1), N = T·K; and the dequantization of the kept ``pre``. The weights once more from fp32 masters (``moeblaze
train --precision fp8-mixed``): cast to bf16 then quantized, against quantized from fp32 with the bf16 rounding in
the kernel (``as_dtype``; checked bitwise), counted as the bytes each moves (4 + 2 + 2 + 1, and 4 + 1). And each
weight's pair of copies (rows for the forward, the transposed view's rows for the backward) as the FP8 layer makes
them: the transposed copy reading the weight twice (its rows' maxima, then the values), against reading it once
with the column maxima the rowwise pass took (``quantize_rows_col_amax``; checked bitwise), each part and the pair,
counted as 6 bytes an element for the pair.

Per operand: the median time (``triton.testing.do_bench``) with the launcher's tiles and with each of a few
alternative ``(BLOCK_R, BLOCK_C, num_warps)``, and the bandwidth counted as the bytes the kernel must move (2 read
and 1 written per bf16 element; 1 read and 2 written to dequantize). The rows show whether the launcher's choice
is the fastest measured one. All in one process on one GPU.

Usage (a CUDA GPU):
    python3 benchmarks/bench_fp8_quant.py [--config qwen3-30b-a3b] [--commit HASH] [--out F.csv]
"""

from __future__ import annotations

import argparse
import datetime
import sys

import torch
import triton

from moeblaze.bench.report import append_dicts
from moeblaze.bench.results import git_commit
from moeblaze.fp8 import E4M3
from moeblaze.kernels import fp8_quant

CONFIGS = {"qwen3-30b-a3b": (32768, 2048, 768, 128, 8), "olmoe-1b-7b": (32768, 2048, 1024, 64, 8)}  # T, d, h, E, K
ALTERNATIVES = {  # operand kind: tiles tried beside the launcher's
    # the last four sweep rows of 768 columns (act, w2) twice in 256- and 512-column blocks, where the launcher
    # masks a quarter of a 1,024-column block
    "rows": [(4, 1024, 4), (2, 2048, 4), (1, 2048, 4), (4, 2048, 8), (8, 1024, 8), (16, 256, 4), (32, 256, 8),
             (8, 512, 4), (16, 512, 8)],
    "transposed": [(32, 64, 4), (64, 64, 4), (8, 2048, 8), (16, 2048, 16), (4, 2048, 4), (64, 128, 8), (32, 128, 4),
                   (128, 64, 8), (64, 64, 8)],
}


def _operands(T: int, d: int, h: int, E: int, K: int) -> dict[str, torch.Tensor]:
    N, bf = T * K, torch.bfloat16
    w1, w2 = torch.randn(E, 2 * h, d, device="cuda", dtype=bf), torch.randn(E, d, h, device="cuda", dtype=bf)
    return {"x": torch.randn(T, d, device="cuda", dtype=bf), "act": torch.randn(N, h, device="cuda", dtype=bf),
            "pre": torch.randn(N, 2 * h, device="cuda", dtype=bf), "w1": w1, "w2": w2,
            "w1^T": w1.transpose(1, 2), "w2^T": w2.transpose(1, 2)}


def _time_tiles(t: torch.Tensor, tiles: tuple[int, int, int]) -> float:
    src = t if t.dim() == 3 else t.unsqueeze(0)
    L, R, C = src.shape
    q = torch.empty(L * R, C, dtype=E4M3, device="cuda")
    scale = torch.empty(L * R, dtype=torch.float32, device="cuda")
    ref = fp8_quant.quantize_rows_fp8(t)
    fp8_quant.launch_quantize_rows(src, q, scale, False, tiles)
    if not (torch.equal(q.view(ref.data.shape), ref.data) and torch.equal(scale.view(ref.scale.shape), ref.scale)):
        raise AssertionError(f"tiles {tiles} give other values than the launcher's on {tuple(t.shape)}")
    return triton.testing.do_bench(lambda: fp8_quant.launch_quantize_rows(src, q, scale, False, tiles),
                                   warmup=10, rep=100)


def measure(config: str) -> list[dict]:
    """One row per (operand, tiles), and one for the dequantization (module docstring)."""
    rows = []
    for name, t in _operands(*CONFIGS[config]).items():
        src = t if t.dim() == 3 else t.unsqueeze(0)
        default = fp8_quant._tiles(src)
        kind = "transposed" if src.stride(1) == 1 else "rows"
        for tiles in [default] + [a for a in ALTERNATIVES[kind] if a != default]:
            ms = _time_tiles(t, tiles)
            rows.append({"config": config, "operand": name, "shape": "x".join(map(str, t.shape)),
                         "tiles": "/".join(map(str, tiles)), "launcher_tiles": tiles == default, "ms": f"{ms:.4f}",
                         "gb_s": f"{t.numel() * 3 / ms / 1e6:.0f}"})
    weights = {k: v for k, v in _operands(*CONFIGS[config]).items() if k in ("w1", "w2")}
    rows += _from_masters(config, {k: v for k, v in _operands(*CONFIGS[config]).items() if k.startswith("w")})
    rows += _weight_pairs(config, weights)
    q = fp8_quant.quantize_rows_fp8(torch.randn(CONFIGS[config][0] * CONFIGS[config][4], 2 * CONFIGS[config][2],
                                                device="cuda", dtype=torch.bfloat16))
    ms = triton.testing.do_bench(lambda: fp8_quant.dequantize_rows_fp8(q, torch.bfloat16), warmup=10, rep=100)
    rows.append({"config": config, "operand": "dequantize pre", "shape": "x".join(map(str, q.data.shape)),
                 "tiles": "16/256/4", "launcher_tiles": True, "ms": f"{ms:.4f}",
                 "gb_s": f"{q.data.numel() * 3 / ms / 1e6:.0f}"})
    return rows


def _from_masters(config: str, weights: dict[str, torch.Tensor]) -> list[dict]:
    """Per weight: its fp32 master cast to bf16 and quantized, against quantized with the rounding in the kernel."""
    rows = []
    for name, w in weights.items():
        master = w.float()  # the same strides: a transposed view stays one
        fused = fp8_quant.quantize_rows_fp8(master, as_dtype=torch.bfloat16)
        ref = fp8_quant.quantize_rows_fp8(master.to(torch.bfloat16))
        if not (torch.equal(fused.data, ref.data) and torch.equal(fused.scale, ref.scale)):
            raise AssertionError(f"{name}: quantized from fp32 as bf16 differs from the cast's quantization")
        for how, run, nbytes in (
                ("cast + quantize", lambda m=master: fp8_quant.quantize_rows_fp8(m.to(torch.bfloat16)), 9),
                ("from fp32", lambda m=master: fp8_quant.quantize_rows_fp8(m, as_dtype=torch.bfloat16), 5)):
            ms = triton.testing.do_bench(run, warmup=10, rep=100)
            rows.append({"config": config, "operand": f"{name} fp32: {how}", "shape": "x".join(map(str, w.shape)),
                         "tiles": "/".join(map(str, fp8_quant._tiles(master))), "launcher_tiles": True,
                         "ms": f"{ms:.4f}", "gb_s": f"{w.numel() * nbytes / ms / 1e6:.0f}"})
        del master
    return rows


def _weight_pairs(config: str, weights: dict[str, torch.Tensor]) -> list[dict]:
    """Per weight: its two copies with two reads of the transposed view against one (module docstring)."""
    return [row for name, w in weights.items() for row in _pair_rows(config, name, w)]


def _pair_rows(config: str, name: str, w: torch.Tensor) -> list[dict]:
    wt = w.transpose(1, 2)
    ref, ref_t = fp8_quant.quantize_rows_fp8(w), fp8_quant.quantize_rows_fp8(wt)
    q, amax = fp8_quant.quantize_rows_col_amax(w)
    q_t = fp8_quant.quantize_rows_fp8(wt, amax=amax)
    for a, b in ((q, ref), (q_t, ref_t)):
        if not (torch.equal(a.data, b.data) and torch.equal(a.scale, b.scale)):
            raise AssertionError(f"{name}: the copies from the column maxima differ from the two-read ones")
    runs = (("pair: two reads of the transposed view",
             lambda: (fp8_quant.quantize_rows_fp8(w), fp8_quant.quantize_rows_fp8(wt)), 6),
            ("pair: column maxima, one read",
             lambda: fp8_quant.quantize_rows_fp8(wt, amax=fp8_quant.quantize_rows_col_amax(w)[1]), 6),
            ("rows with column maxima", lambda: fp8_quant.quantize_rows_col_amax(w), 3),
            ("transposed from the maxima", lambda: fp8_quant.quantize_rows_fp8(wt, amax=amax), 3))
    rows = []
    for how, run, nbytes in runs:
        ms = triton.testing.do_bench(run, warmup=10, rep=100)
        rows.append({"config": config, "operand": f"{name} {how}", "shape": "x".join(map(str, w.shape)),
                     "tiles": "/".join(map(str, fp8_quant._tiles(w))), "launcher_tiles": True,
                     "ms": f"{ms:.4f}", "gb_s": f"{w.numel() * nbytes / ms / 1e6:.0f}"})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="qwen3-30b-a3b", choices=sorted(CONFIGS))
    p.add_argument("--commit", default=None, help="the commit to record (default: git's HEAD)")
    p.add_argument("--out", help="append the rows to this CSV (header written when new)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    now = datetime.datetime.now(datetime.timezone.utc)
    given = argv if argv is not None else sys.argv[1:]
    meta = {"date": now.strftime("%Y-%m-%d"), "time_utc": now.strftime("%H:%M"),
            "device": torch.cuda.get_device_name(), "commit": args.commit or git_commit(),
            "torch": torch.__version__, "triton": triton.__version__,
            "command": " ".join(["python3 benchmarks/bench_fp8_quant.py", *given])}
    rows = [{**meta, **r} for r in measure(args.config)]
    for r in rows:
        print(f"{r['operand']:27s} {r['shape']:16s} tiles {r['tiles']:12s} {'*' if r['launcher_tiles'] else ' '} "
              f"{r['ms']} ms {r['gb_s']:>5s} GB/s", flush=True)
    if args.out:
        append_dicts(args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
