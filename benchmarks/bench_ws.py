"""The warp-specialized Gluon kernels against the Triton ones they replace, same inputs, same run (sm90, triton 3.6).

For each shape (T, d, h, E, K; random top-k routing, bf16): F2 (``act [N, h] @ w_down[e]^T``) and B3 (``dpre [N, 2h] @
w_gate_up[e]``), each in the layer's column chunks, through ``launch.grouped_gemm``, and B2 / B4 (the weight
gradients) through ``launch.grouped_wgrad``, once as the launchers choose (the Gluon kernels on an sm90 GPU with
triton 3.6) and once with ``launch.ws_gemm_ok`` / ``launch.ws_wgrad_ok`` replaced by False (the Triton kernels,
autotuned); ``--fp8`` adds F2 and B3 on e4m3 operands under the rowwise recipe (the FP8 layer's: row scales of
``act`` / ``dpre`` and of the weight rows; B3 on the transposed ``w_gate_up`` copy, K-major as e4m3 ``wgmma`` reads
it) and B1 (``dout[token] @ w_down[e]``, its rows gathered, on the transposed ``w_down`` copy), whose Gluon kernel is
``kernels/fp8_ws_gemm.py``; their flops are counted as the bf16 steps'. Each is timed as a
CUDA-graph replay (``triton.testing.do_bench``, median), so the host's
launch time is out of the figure; ``--check`` also compares both with the float64 sums on the first shape. One CSV row
per kernel and shape.

Usage (GPU): ``python3 benchmarks/bench_ws.py --out ws.csv [--fp8]`` (the shapes of issues 24 and 25 by default);
``--masked-store`` times the weight gradients with masked tile stores instead of TMA stores (an A/B: run both on
the same GPU, one after the other).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime
import os
import sys
from pathlib import Path
from unittest import mock

import torch
import triton

from moeblaze import build_dispatch, settings
from moeblaze.bench.results import git_commit
from moeblaze.bench.runner import graph_replay_ms
from moeblaze.kernels import launch
from moeblaze.kernels.chunks import column_chunks
from moeblaze.kernels.fp8_quant import quantize_rows_fp8

SHAPES = "2048:2048:768:128:8,8192:2048:768:128:8,32768:2048:768:128:8,16384:1536:1024:128:2,16384:2048:512:512:10"


def _steps(T, d, h, E, K, gen, fp8=False):
    """(name, the launcher's check of the Gluon kernel, run(out) -> out, float64 reference or None, flops) of F2, B3,
    B2 and B4 at one shape."""
    ids = torch.rand(T, E, device="cuda", generator=gen).topk(K, dim=1).indices.to(torch.int32)
    index = build_dispatch(ids, E, block_m=128)
    off, ind, sc = index.expert_token_offsets, index.expert_token_indices, index.schedule
    sched, N = (sc.tile_expert, sc.tile_row_start, sc.num_tiles), ind.numel()

    def randn(*shape, std=1.0):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen) * std

    act, dpre, x, dout = randn(N, h), randn(N, 2 * h), randn(T, d), randn(T, d)
    w_down, w_gate_up = randn(E, d, h, std=0.03), randn(E, 2 * h, d, std=0.03)
    def gemm(a, w, b_nk, k, scales=(None, None)):
        chunks = column_chunks(N, d, k, 2)  # as the layer: chunks no wider than the A operand's row (act, dpre)

        def run():
            buf = torch.empty(N, max(c1 - c0 for c0, c1 in chunks), device="cuda", dtype=torch.bfloat16)
            for c0, c1 in chunks:
                launch.grouped_gemm(a, w, buf[:, :c1 - c0], off, ind, sched, b_nk=b_nk, n_cols=c1 - c0, k_dim=k,
                                    gather_a=False, n_start=c0 or None, a_scale=scales[0], b_scale=scales[1])
            return buf[:, :chunks[-1][1] - chunks[-1][0]]  # the last chunk's columns
        return run

    def wgrad(a, b, q, transpose):
        return lambda: launch.grouped_wgrad(a, b, off, ind, p=d, q=q, out_dtype=torch.bfloat16, transpose=transpose)

    bounds = off.tolist()

    def ref_gemm(a, wk):  # wk [E, k, n]: the last chunk's columns of a[s] @ W[e]
        c0 = column_chunks(N, d, a.shape[1], 2)[-1][0]
        return torch.cat([a[bounds[e]:bounds[e + 1]].double() @ wk[e, :, c0:].double() for e in range(E)])

    def ref_wgrad(a, b, transpose):
        out = torch.stack([a[ind[bounds[e]:bounds[e + 1]].long()].double().T @ b[bounds[e]:bounds[e + 1]].double()
                           for e in range(E)])
        return out.transpose(1, 2) if transpose else out

    steps = []
    if fp8:
        (aq, as_), (wq, ws_), (dq, ds), (gq, gs) = (_rows(t) for t in (act, w_down, dpre, w_gate_up.transpose(1, 2)))
        deq = lambda q, s: q.double() * s.double()[..., None]  # noqa: E731
        (oq, os_), (vq, vs) = _rows(dout), _rows(w_down.transpose(1, 2))  # B1: dout rows gathered, w_down^T [E, h, d]

        def b1():
            out = torch.empty(N, h, device="cuda", dtype=torch.bfloat16)
            launch.grouped_gemm(oq, vq, out, off, ind, sched, b_nk=True, n_cols=h, k_dim=d, gather_a=True,
                                a_scale=os_, b_scale=vs)
            return out

        def ref_b1():
            od, vd = deq(oq, os_)[ind.long()], deq(vq, vs)
            return torch.cat([od[bounds[e]:bounds[e + 1]] @ vd[e].T for e in range(E)])

        steps = [("F2-fp8", "ws_gemm_ok", gemm(aq, wq, True, h, (as_, ws_)),
                  lambda: ref_gemm(deq(aq, as_), deq(wq, ws_).transpose(1, 2)), 2 * N * h * d),
                 ("B1-fp8", "ws_gemm_ok", b1, ref_b1, 2 * N * h * d),
                 ("B3-fp8", "ws_gemm_ok", gemm(dq, gq, True, 2 * h, (ds, gs)),
                  lambda: ref_gemm(deq(dq, ds), deq(gq, gs).transpose(1, 2)), 4 * N * h * d)]
    return steps + [
        ("F2", "ws_gemm_ok", gemm(act, w_down, True, h), lambda: ref_gemm(act, w_down.transpose(1, 2)), 2 * N * h * d),
        ("B3", "ws_gemm_ok", gemm(dpre, w_gate_up, False, 2 * h), lambda: ref_gemm(dpre, w_gate_up), 4 * N * h * d),
        ("B2", "ws_wgrad_ok", wgrad(dout, act, h, False), lambda: ref_wgrad(dout, act, False), 2 * N * h * d),
        ("B4", "ws_wgrad_ok", wgrad(x, dpre, 2 * h, True), lambda: ref_wgrad(x, dpre, True), 4 * N * h * d),
    ]


def _rows(t):
    """``t [..., R, C]`` in e4m3 with one scale per row: ``(data, scale [..., R])``, contiguous."""
    q = quantize_rows_fp8(t)
    return q.data, q.scale[..., 0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=SHAPES, help="comma-separated T:d:h:E:K")
    ap.add_argument("--check", action="store_true", help="compare both kernels with the float64 sums (first shape)")
    ap.add_argument("--out", default="bench_ws.csv", help="CSV to append rows to")
    ap.add_argument("--commit", help="code version the rows record (default: git's HEAD here, +dirty)")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="a moeblaze setting for the whole run, e.g. autotune=off (repeatable; in the rows' command)")
    ap.add_argument("--fp8", action="store_true", help="also F2 and B3 on e4m3 operands (the FP8 layer's)")
    ap.add_argument("--masked-store", action="store_true",
                    help="the Gluon weight gradients store their tiles masked, not by TMA (in the rows' command)")
    args = ap.parse_args()
    settings.configure(**dict(kv.split("=", 1) for kv in args.set))
    if args.masked_store:
        mock.patch.object(launch, "ws_wgrad_tma_store", lambda *a: False).start()
    commit = args.commit or git_commit(Path(__file__).parent)
    command = " ".join(["python3", *sys.argv])
    gen = torch.Generator(device="cuda").manual_seed(0)
    fields = ["date", "device", "commit", "torch", "triton", "command", "T", "d", "h", "E", "K", "step", "triton_ms",
              "ws_ms", "speedup", "triton_tflops", "ws_tflops", "err_triton", "err_ws"]
    new = not os.path.exists(args.out)
    with open(args.out, "a", newline="") as f:
        out = csv.DictWriter(f, fieldnames=fields)
        if new:
            out.writeheader()
        for i, spec in enumerate(args.shapes.split(",")):
            T, d, h, E, K = map(int, spec.split(":"))
            for name, check, run, ref, flops in _steps(T, d, h, E, K, gen, args.fp8):
                row = {"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(),
                       "commit": commit, "torch": torch.__version__, "triton": triton.__version__, "command": command,
                       "T": T, "d": d, "h": h, "E": E,
                       "K": K, "step": name}
                want = ref() if args.check and i == 0 else None
                for on in (False, True):
                    with contextlib.nullcontext() if on else mock.patch.object(launch, check, lambda *a: False):
                        ms = graph_replay_ms(run)
                        if want is not None:
                            row["err_ws" if on else "err_triton"] = float((run().double() - want).abs().max()
                                                                         / want.abs().max())
                    row["ws_ms" if on else "triton_ms"] = round(ms, 4)
                    row["ws_tflops" if on else "triton_tflops"] = round(flops / ms / 1e9, 1)
                row["speedup"] = round(row["triton_ms"] / row["ws_ms"], 3)
                out.writerow(row)
                f.flush()
                print(row, flush=True)


if __name__ == "__main__":
    main()
