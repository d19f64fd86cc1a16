"""What the model-family features cost: forward+backward of ``moe_experts`` (Triton) per variant.

Variants on one shape (router excluded, one fixed uniform routing, dispatch included):

``plain``        SwiGLU, contiguous ``[E, 2h, d]`` / ``[E, d, h]`` weights (the fast path, for reference)
``bias``         ``plain`` + expert biases ``b_gate_up [E, 2h]``, ``b_down [E, d]`` (with their gradients)
``gpt_oss``      GPT-OSS's experts as transformers stores them: ``gate_up_proj [E, d, 2h]`` (interleaved
                 columns) and ``down_proj [E, h, d]`` passed as transposed views, biases, ``swiglu_clamped``
``foreign``      ``plain`` with half of the pairs' ids ``>= E`` (expert parallelism over 2 ranks as
                 transformers does it: every rank sees all T*K pairs, ids of the other rank's experts are
                 foreign), ``foreign_experts=True``
``local_half``   ``plain`` on only the local pairs of ``foreign`` (T*K/2 pairs): the floor ``foreign`` can reach

Records the median time (``triton.testing.do_bench``) per variant and its ratio to ``plain`` as CSV rows.

Usage (GPU): python3 benchmarks/bench_expert_features.py [--shape gpt-oss-20b] [--tokens 16384]
             [--out results/expert_features.csv]
"""

from __future__ import annotations

import argparse
import datetime
import sys

import torch
import triton

from moeblaze import moe_experts
from moeblaze.bench.report import append_dicts

SHAPES = {"gpt-oss-20b": (2880, 2880, 32, 4), "qwen3-30b": (2048, 768, 128, 8), "olmoe": (2048, 1024, 64, 8)}


def variants(T: int, d: int, h: int, E: int, K: int, dtype: torch.dtype):
    """``name -> (kwargs of moe_experts, parameters to clear between steps)``."""
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)

    def param(*shape, scale):
        return (torch.randn(*shape, device=dev, generator=g) * scale).to(dtype).requires_grad_()

    x = param(T, d, scale=1.0)
    ids = torch.rand(T, 2 * E, device=dev, generator=g).topk(K, dim=1).indices  # ids over 2E: half foreign
    w = torch.softmax(torch.randn(T, K, device=dev, generator=g), -1).requires_grad_()
    local_ids = torch.rand(T, E, device=dev, generator=g).topk(K, dim=1).indices
    w1, w2 = param(E, 2 * h, d, scale=d**-0.5), param(E, d, h, scale=h**-0.5)
    b1, b2 = param(E, 2 * h, scale=0.1), param(E, d, scale=0.1)
    gate_up_proj, down_proj = param(E, d, 2 * h, scale=d**-0.5), param(E, h, d, scale=h**-0.5)
    base = {"x": x, "topk_ids": local_ids, "topk_weights": w, "w_gate_up": w1, "w_down": w2}
    half = T // 2
    return {
        "plain": (base, [x, w, w1, w2]),
        "bias": ({**base, "b_gate_up": b1, "b_down": b2}, [x, w, w1, w2, b1, b2]),
        "gpt_oss": ({**base, "w_gate_up": gate_up_proj.transpose(1, 2), "w_down": down_proj.transpose(1, 2),
                     "b_gate_up": b1, "b_down": b2, "activation": "swiglu_clamped", "gate_up_interleaved": True},
                    [x, w, gate_up_proj, down_proj, b1, b2]),
        "foreign": ({**base, "topk_ids": ids, "foreign_experts": True}, [x, w, w1, w2]),
        "local_half": ({**base, "x": x[:half].detach().requires_grad_(), "topk_ids": local_ids[:half],
                        "topk_weights": w[:half].detach().requires_grad_()}, [w1, w2]),
    }


def make_step(kw: dict, params: list[torch.Tensor]):
    """One forward+backward of ``moe_experts(**kw)`` on the Triton backend, gradients cleared first."""
    dout = torch.randn_like(kw["x"])

    def step() -> None:
        for p in params:
            p.grad = None
        moe_experts(**kw, backend="triton").backward(dout)

    return step


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="gpt-oss-20b", choices=sorted(SHAPES))
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    ap.add_argument("--out", default=None, help="CSV file to append the rows to")
    args = ap.parse_args(argv)
    d, h, E, K = SHAPES[args.shape]
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    rows, plain_ms = [], None
    for name, (kw, params) in variants(args.tokens, d, h, E, K, dtype).items():
        ms = triton.testing.do_bench(make_step(kw, params + [kw["x"]]), warmup=200, rep=1000)
        plain_ms = plain_ms or ms
        rows.append({"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(),
                     "shape": args.shape, "T": args.tokens, "d": d, "h": h, "E": E, "K": K, "dtype": args.dtype,
                     "variant": name, "ms": round(ms, 4), "vs_plain": round(ms / plain_ms, 3)})
        print(f"{name:>11}: {ms:8.3f} ms  {ms / plain_ms:5.2f}x plain", flush=True)
    if args.out:
        append_dicts(args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
