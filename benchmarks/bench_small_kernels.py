"""Launch shapes of the two small kernels of a layer step: the fused router's top-k (forward) and backward kernels
over tokens per program and warps, and the gather-sum (F3 combine / B5 ``dx``) over its block shapes; and
(``--kernels pair_grads``) the router's backward from token rounding's pair gradients, dense or read in place;
(``--kernels act_bwd``) B1's activation backward over its tuned configs, as the bf16 layer launches it (``pre`` in
16 bits, ``dpre`` over it) and as the FP8 layer does (the kept e4m3 ``pre`` and its tile scales, ``dpre`` in 16 bits
and in e4m3 with a scale per row); each config's outputs checked bitwise against the first's but ``dtopk_weights``
(summed in the config's column blocks).

Each kernel is timed alone as a CUDA-graph replay (``triton.testing.do_bench`` median; the same method as
``bench_ws.py``), so host time stays out of the figures. The router rows time ``router_topk`` (top-k and loss
kernels) and ``router_topk_backward`` with ``moeblaze.kernels.router._block_t`` / ``_topk_warps`` /
``_bwd_block_t`` replaced for the run; the gather-sum rows launch ``gather_sum_kernel`` directly with each
config (the rows of every config are checked bitwise equal: the K pairs are summed in one order). One CSV row per
kernel, shape and launch shape, with the commit and the command.

Usage (GPU): ``python3 benchmarks/bench_small_kernels.py --out small.csv``.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import itertools
import os
import sys
from pathlib import Path

import torch
import triton

from moeblaze.bench.results import git_commit
from moeblaze.bench.runner import graph_replay_ms
from moeblaze.kernels import router as fused
from moeblaze.kernels.combine import gather_sum_kernel
from moeblaze.kernels.tuning import act_bwd_configs

ROUTER_SHAPES = [(32768, 128, 8), (4096, 128, 8), (16384, 256, 4), (16384, 512, 10)]  # T, E, K
# T, D, K, N: F3/B5 over Qwen3-30B-A3B's 768-column chunks and whole rows at 32k tokens, 4k tokens, and the first
# token-rounding shape (d 1536, K 2)
GATHER_SHAPES = [(32768, 768, 8, 262144), (32768, 2048, 8, 262144), (4096, 768, 8, 32768)]
# (BLOCK_T, BLOCK_D, warps): the tuned list of moeblaze.kernels.tuning.gather_sum_configs and two more
GATHER_CONFIGS = [(16, 256, 4), (32, 256, 8), (8, 512, 4), (16, 512, 8), (64, 128, 8), (8, 256, 4), (4, 512, 4),
                  (1, 1024, 4), (4, 256, 4), (2, 1024, 8)]


def _router_ms(logits: torch.Tensor, K: int, gen: torch.Generator) -> tuple[float, float]:
    """Forward (top-k and loss kernels) and backward ms of the fused router at the launch shape set now."""
    def fwd():
        return fused.router_topk(logits, K, True, 1.0, 0.01, 0.001)

    ids, _, probs, lse, counts, _, _ = fwd()
    dw, one = torch.randn(logits.shape[0], K, device="cuda", generator=gen), torch.ones((), device="cuda")
    bwd_ms = graph_replay_ms(lambda: fused.router_topk_backward(probs, ids, dw, None, counts, lse, one, one, True,
                                                                1.0, 0.01, 0.001))
    return graph_replay_ms(fwd), bwd_ms


def router_rows(gen: torch.Generator):
    """Rows of the fused router for each tokens-per-program and warp count (both kernels take the tokens)."""
    saved = fused._block_t, fused._topk_warps, fused._bwd_block_t
    try:
        for T, E, K in ROUTER_SHAPES:
            logits = torch.randn(T, E, device="cuda", generator=gen)
            default = (saved[0](E), saved[1](E))
            for bt in (4, 8, 16, 32, 64):
                for w in (4, 8):
                    if not 32 * w <= bt * triton.next_power_of_2(E) <= 16384:
                        continue
                    fused._block_t = fused._bwd_block_t = lambda e, bt=bt: bt
                    fused._topk_warps = lambda e, w=w: w
                    fwd_ms, bwd_ms = _router_ms(logits, K, gen)
                    yield dict(T=T, E=E, K=K, kernel="router", block_t=bt, warps=w, default=(bt, w) == default,
                               ms=round(fwd_ms, 4), bwd_ms=round(bwd_ms, 4))
    finally:
        fused._block_t, fused._topk_warps, fused._bwd_block_t = saved


def _gather_ms(src, wts, tmap, out, config) -> float:
    """ms of one weighted gather-sum launch shape ``(BLOCK_T, BLOCK_D, warps)``."""
    (T, K), D = tmap.shape, src.shape[1]
    bt, bd, w = config
    grid = (triton.cdiv(T, bt), triton.cdiv(D, bd))

    def run():
        gather_sum_kernel[grid](src, wts, tmap, out, tmap, tmap, T, D, src.stride(0), wts.stride(0), wts.stride(1),
                                tmap.stride(0), tmap.stride(1), out.stride(0), K=K, HAS_W=True, HAS_LIMIT=False,
                                CSR=False, BLOCK_T=bt, BLOCK_D=bd, num_warps=w, num_stages=1)

    return graph_replay_ms(run)


def gather_rows(gen: torch.Generator):
    """Rows of the weighted gather-sum for each config, its result checked bitwise against the first config's."""
    for T, D, K, N in GATHER_SHAPES:
        src = torch.randn(N, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        tmap = torch.randperm(N, device="cuda", generator=gen)[: T * K].view(T, K).to(torch.int32)
        wts = torch.rand(T, K, device="cuda", generator=gen)
        out = torch.empty(T, D, device="cuda", dtype=torch.bfloat16)
        first = None
        for config in GATHER_CONFIGS:
            ms = _gather_ms(src, wts, tmap, out, config)
            first = out.clone() if first is None else first
            if not torch.equal(out, first):
                raise AssertionError(f"gather_sum config {config} differs from {GATHER_CONFIGS[0]}")
            yield dict(T=T, D=D, K=K, kernel="gather_sum", block_t=config[0], block_d=config[1], warps=config[2],
                       ms=round(ms, 4), gbs=round((T * K * D * 2 + T * D * 2) / ms / 1e6))


PAIR_SHAPES = [(16384, 128, 2), (16384, 256, 4), (16384, 512, 10)]  # issue 25's T, E, K


def _pair_grad_steps(T: int, E: int, K: int, gen: torch.Generator) -> dict:
    """``dense``: the pair weights' backward writing ``[T, K]`` and ``[T, E]`` gradients and the router's backward
    reading them (two launches); ``pairs``: the router's backward reading the pair gradient ``dw [P]`` where it lies
    (one), over ``nr`` pairs at tile 128."""
    from moeblaze.kernels.pair_list import pair_weights_backward
    from moeblaze.token_rounding import round_tokens

    logits = torch.randn(T, E, device="cuda", generator=gen)
    ids, _, probs, lse, counts, _, _ = fused.router_topk(logits, K, False, 1.0, 0.01, 0.001)
    rt = round_tokens(probs, ids, probs.gather(1, ids.long()), 128, "nr", counts=counts)
    dw, one = torch.randn(rt.pair_weights.shape, device="cuda", generator=gen), torch.ones((), device="cuda")

    def dense():
        dtopk, dscores = pair_weights_backward(dw, rt.pair_offsets, rt.expert_idx, K, E, 1.0, torch.float32)
        return fused.router_topk_backward(probs, ids, dtopk, dscores, counts, lse, one, one, False, 1.0, 0.1, 0.1)

    def pairs():
        return fused.router_topk_backward(probs, ids, dw, None, counts, lse, one, one, False, 1.0, 0.1, 0.1,
                                          (rt.pair_offsets, rt.expert_idx))

    return {"dense": dense, "pairs": pairs}


def pair_grad_rows(gen: torch.Generator):
    """Rows of the router's backward from token rounding's pair gradients, dense or in place
    (:func:`_pair_grad_steps`)."""
    for T, E, K in PAIR_SHAPES:
        for path, fn in _pair_grad_steps(T, E, K, gen).items():
            yield dict(T=T, E=E, K=K, kernel=f"router_backward_{path}", default=path == "pairs",
                       ms=round(graph_replay_ms(fn), 5))


ACT_SHAPES = [(262144, 768), (262144, 1024)]  # N, h: Qwen3-30B-A3B and OLMoE-1B-7B at T 32,768, K 8


def _act_bwd_case(N: int, h: int, fp8: bool, gen: torch.Generator) -> tuple[dict, tuple]:
    """The keyword arguments of one launch (the FP8 layer's or the bf16 layer's) and the tensors it writes."""
    from moeblaze.fp8 import E4M3, E4M3_MAX, KEPT_TILE, SCALE_FLOOR, quantize_kept
    from moeblaze.kernels.act_math import ACTIVATION_CODES

    dact = torch.randn(N, h, device="cuda", dtype=torch.bfloat16, generator=gen)
    pre = torch.randn(N, 2 * h, device="cuda", dtype=torch.bfloat16, generator=gen) * 3
    w, dtw = torch.rand(N, device="cuda", generator=gen), torch.empty(N, device="cuda")
    if fp8:
        kept = quantize_kept(pre, True)
        pre, pre_s = kept.data.view(N, 2 * h), kept.scale
        dpre = torch.empty(N, 2 * h, device="cuda", dtype=torch.bfloat16)
        q, q_s = torch.empty(N, 2 * h, device="cuda", dtype=E4M3), torch.empty(N, device="cuda")
    else:
        pre_s, dpre, q, q_s = w, pre, pre, w
    args = dict(dact_ptr=dact, pre_ptr=pre, pre_s_ptr=pre_s, dpre_ptr=dpre, scale_ptr=w, dtw_ptr=dtw, limit_ptr=w,
                dpre_q_ptr=q, dpre_s_ptr=q_s, N=N, H=h, UP_OFF=h, alpha=0.0, limit=0.0, stride_dact_m=dact.stride(0),
                stride_pre_m=pre.stride(0), stride_dpre_m=dpre.stride(0), stride_q_m=q.stride(0), tiny=SCALE_FLOOR,
                ACTIVATION=ACTIVATION_CODES["swiglu"], STORE_PART=True, STORE_WACT=True, PRE_STEP=1,
                HAS_LIMIT=False, TF32_DPRE=False, QUANT=fp8, POW2=False, PRE_E4M3=fp8, PRE_TILE=KEPT_TILE,
                QMAX=E4M3_MAX)
    return args, ((dact, dpre, q, q_s) if fp8 else (dact, dpre))


def act_bwd_rows():
    """Rows of B1's activation backward for each tuned config (module docstring), each on the same inputs. Each
    replay writes its outputs over its inputs in the bf16 launch (as the layer does): the check compares the first
    launch's."""
    from moeblaze.kernels.act_bwd import act_bwd_rows_kernel

    for (N, h), fp8 in itertools.product(ACT_SHAPES, (False, True)):
        first = None
        for cfg in act_bwd_configs("tuned16"):
            r, bh, warps = cfg.kwargs["BLOCK_R"], cfg.kwargs["BLOCK_H"], cfg.num_warps
            args, outs = _act_bwd_case(N, h, fp8, torch.Generator(device="cuda").manual_seed(N + h))

            grid, whole = (triton.cdiv(N, r),), h <= bh

            def run(args=args, grid=grid, r=r, bh=bh, warps=warps, whole=whole):
                act_bwd_rows_kernel[grid](**args, BLOCK_R=r, BLOCK_H=bh, ROW_WHOLE=whole, num_warps=warps,
                                          num_stages=1)

            run()
            got = [t.view(torch.uint8) if t.element_size() == 1 else t for t in outs]
            first = [t.clone() for t in got] if first is None else first
            if not all(torch.equal(a, b) for a, b in zip(got, first)):
                raise AssertionError(f"act_bwd config {cfg} differs from the first config's outputs")
            ms = graph_replay_ms(run)
            # bytes an element of h: bf16 reads dact' 2 and pre 4, writes w act 2 and dpre 4; FP8 reads pre in 2
            # (and its tile scales), writes dpre in 4 and 2
            moved = N * h * 12
            yield dict(T=N, D=h, kernel=f"act_bwd_{'fp8' if fp8 else 'bf16'}", block_t=r, block_d=bh, warps=warps,
                       ms=round(ms, 4), gbs=round(moved / ms / 1e6))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="small_kernels.csv", help="CSV to append rows to")
    ap.add_argument("--kernels", default="router,gather_sum", help="any of router, gather_sum, pair_grads, act_bwd")
    ap.add_argument("--commit", default=None, help="the commit to record (default: git's HEAD)")
    args = ap.parse_args()
    commit, command = args.commit or git_commit(Path(__file__).parent), " ".join(["python3", *sys.argv])
    gen = torch.Generator(device="cuda").manual_seed(0)
    fields = ["date", "device", "commit", "command", "kernel", "T", "E", "D", "K", "block_t", "block_d", "warps",
              "default", "ms", "bwd_ms", "gbs"]
    new = not os.path.exists(args.out)
    with open(args.out, "a", newline="") as f:
        out = csv.DictWriter(f, fieldnames=fields)
        if new:
            out.writeheader()
        kinds = args.kernels.split(",")
        rows = itertools.chain(router_rows(gen) if "router" in kinds else (),
                               gather_rows(gen) if "gather_sum" in kinds else (),
                               pair_grad_rows(gen) if "pair_grads" in kinds else (),
                               act_bwd_rows() if "act_bwd" in kinds else ())
        for row in rows:
            row.update(date=datetime.date.today().isoformat(), device=torch.cuda.get_device_name(), commit=commit,
                       command=command)
            out.writerow(row)
            f.flush()
            print(row, flush=True)


if __name__ == "__main__":
    main()
