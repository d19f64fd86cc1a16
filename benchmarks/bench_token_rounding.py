"""Token rounding (SonicMoE §5, issue 25): speed of the layer and training quality, top-k vs rounded.

``speed``: forward+backward of one ``moeblaze.MoE`` layer (bf16, Triton), router and rounding inside the
timed step, per variant on the same weights and inputs:

``topk``            the layer as it is (random top-k routing from its router)
``tr-nr``           the layer with ``token_rounding="nr"`` (router + rounding + general routing path)
``tr-nr-eager``     the same with the rounding's PyTorch ops run eagerly (where the layer rounds after its router;
                    ``moeblaze.token_rounding._compiles`` replaced)
``ceiling``         the router runs, then the experts take a fixed routing whose every expert count is a
                    multiple of the M tile with no imbalance (as equal as multiples of the tile allow): the
                    most rounding can give; x's gradient summed in place by both, as in the layer
``pairs-moeblaze``  ``moe_experts_general`` alone on the rounded pairs of one ``tr-nr`` step (compacted:
                    dropped / unused pairs removed), routing excluded; the pair index built in the step as the
                    layer builds it (``plan_pairs(validate=False)``: no range check, no host read; SonicMoE's
                    general routing inputs are not checked either)
``pairs-sonicmoe``  SonicMoE's ``moe_general_routing_inputs`` on the same pairs (skipped when not importable)

Per variant: the wall time of a step (median of ``triton.testing.do_bench``; CPU ``--smoke``: perf_counter
median) and its GPU time (:func:`moeblaze.bench.runner.kernel_time_ms`: kernel time summed by torch.profiler,
as the issue's ceiling was measured; the median of ``--rounds`` rounds over the variants in turn). Rows go to
a CSV, with
``share_of_ceiling = (t_topk / t_tr - 1) / (t_topk / t_ceiling - 1)`` on GPU times (the issue's target: >= 0.85).

``rounding``: :func:`moeblaze.round_tokens` alone at the same shapes (wall ms; GPU: kernel time too).
``select``: the Triton selections alone per select-kernel warp count and keys-kernel launch shape (GPU).

``quality``: ``moeblaze train`` twice, ``--routing topk`` and ``--routing token-rounding:nr``, same steps
and seed; writes the train-loss and validation bits/byte curves (CSV) and a side-by-side plot (PNG).

Usage (GPU):  python3 benchmarks/bench_token_rounding.py speed --out results/token_rounding.csv
              python3 benchmarks/bench_token_rounding.py quality --out-dir results/tr_quality
CPU check:    python3 benchmarks/bench_token_rounding.py speed --smoke; ... quality --smoke --out-dir /tmp/q
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime
import functools
import itertools
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch

from moeblaze import MoE, moe_experts, moe_experts_general, round_tokens, settings, tile_multiple, token_rounding
from moeblaze.backends import get_backend
from moeblaze.bench.report import append_dicts
from moeblaze.bench.runner import kernel_time_ms
from moeblaze.input_grad import SharedInputGrad
from moeblaze.token_rounding import round_tokens_fused

SHAPES = [(16384, 1536, 1024, 128, 2), (16384, 4096, 1024, 256, 4), (16384, 2048, 512, 512, 10)]
SMOKE_SHAPES = [(96, 32, 16, 4, 2), (80, 16, 8, 8, 3)]


def ceiling_ids(T: int, E: int, K: int, tile: int, device) -> torch.Tensor:
    """``[T, K]`` ids, distinct per row, whose per-expert counts are multiples of ``tile`` as equal as possible
    (``T*K`` must be a multiple of ``tile``): pair ``k*T + t`` goes to the expert whose block holds it."""
    tiles = T * K // tile
    per = torch.full((E,), tiles // E, dtype=torch.long)
    per[: tiles % E] += 1
    ends = (per * tile).cumsum(0)
    p = torch.arange(T * K).view(K, T).t().contiguous()  # [T, K]: pair k*T + t
    ids = torch.searchsorted(ends, p, right=True)
    if (T * K) % tile or int((per * tile).max()) > T:
        raise ValueError(f"no ceiling routing for T={T}, K={K}, E={E}, tile={tile}: T*K must be a multiple of the "
                         "tile and tile * ceil(T*K / (E*tile)) <= T")
    return ids.to(torch.int32).to(device)


def eager_rounding(on: bool):
    """A context in which :func:`moeblaze.token_rounding.round_tokens_fused` runs eagerly where ``on`` (else as it
    chooses: compiled on CUDA): the A/B of the ``tr-nr-eager`` variant."""
    if not on:
        return contextlib.nullcontext()
    return mock.patch.object(token_rounding, "_compiles", lambda scores: False)


def timer(device):
    if device == "cuda":
        import triton

        return lambda fn: triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")

    def cpu(fn, reps=3):
        fn()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
        return statistics.median(times)

    return cpu


def layer_steps(shape, device, dtype, backend, tile=None, sonic=True):
    """``name -> step()`` of the layer variants (module docstring) and the compacted rounded pairs."""
    T, d, h, E, K = shape
    torch.manual_seed(0)
    moe = MoE(d, h, E, K, backend=backend, aux_loss_coef=0.0, device=device, dtype=dtype, rounding_tile=tile)
    x = torch.randn(T, d, device=device, dtype=dtype, requires_grad=True)
    dout = torch.randn(T, d, device=device, dtype=dtype)
    params = [x, *moe.parameters()]
    tile = tile or tile_multiple(backend, device)
    ceil = ceiling_ids(T, E, K, tile, device)

    def clear():
        for p in params:
            p.grad = None

    def layer(mode, compiled=True):
        def step():
            clear()
            moe.token_rounding = mode
            with eager_rounding(not compiled):
                moe(x).backward(dout)
        return step

    def ceiling():  # x's gradient summed in place by the router and the experts, as the layer does
        clear()
        share = SharedInputGrad()
        r = moe.router(x, input_grad=share)
        index = get_backend(backend, x).plan(ceil, E, validate=False)
        moe_experts(x, ceil, r.topk_weights, moe.w1, moe.w_down, backend=backend, index=index,
                    input_grad=share).backward(dout)

    with torch.no_grad():
        r = moe.router(x)
        rt = round_tokens(r.scores, r.topk_ids, r.topk_weights, tile, "nr")
    keep = rt.expert_idx < E  # compaction reads the mask on the host: outside the timed steps
    pairs = (rt.token_idx[keep].contiguous(), rt.expert_idx[keep].contiguous(),
             rt.pair_weights[keep].float().contiguous().requires_grad_())

    def pairs_moeblaze():  # the index built as the layer builds it: no range checks (no host read)
        clear()
        index = get_backend(backend, x).plan_pairs(pairs[0], pairs[1], T, E, validate=False)
        moe_experts_general(x, *pairs, moe.w1, moe.w_down, backend=backend, index=index).backward(dout)

    steps = {"topk": layer(None), "tr-nr": layer("nr"), "tr-nr-eager": layer("nr", False), "ceiling": ceiling,
             "pairs-moeblaze": pairs_moeblaze}
    sonic = sonic_step(x, pairs, moe, dout, clear) if device == "cuda" and sonic else None
    if sonic is not None:
        steps["pairs-sonicmoe"] = sonic
    return steps, tile


def sonic_step(x, pairs, moe, dout, clear):
    """SonicMoE 0.1.2's ``moe_general_routing_inputs`` fed ``pairs``; None when SonicMoE is not importable."""
    try:
        from sonicmoe.enums import ActivationType
        from sonicmoe.functional import moe_general_routing_inputs
    except ImportError as err:
        print(f"pairs-sonicmoe skipped: {err}", flush=True)
        return None
    tok, exp, w = pairs
    E, h = moe.w_down.shape[0], moe.w_down.shape[2]
    stream = torch.cuda.current_stream().cuda_stream
    w2 = moe.w_down.permute(1, 2, 0)  # [d, h, E], SonicMoE's stride order (2, 0, 1), zero-copy
    try:  # gate rows then up rows (moeblaze's layout) where SonicMoE accepts it, else an interleaved copy
        w1, kw = moe.w1.permute(1, 2, 0), {"concat_layout": True}
        moe_general_routing_inputs(x, w, tok, exp, w1, None, w2, None, E, stream, ActivationType.SWIGLU, False, **kw)
    except TypeError:
        inter = torch.stack((moe.w1[:, :h], moe.w1[:, h:]), dim=2).reshape(moe.w1.shape).detach().requires_grad_()
        w1, kw = inter.permute(1, 2, 0), {}

    def step():
        clear()
        out, _ = moe_general_routing_inputs(x, w, tok, exp, w1, None, w2, None, E, stream, ActivationType.SWIGLU,
                                            False, **kw)
        out.backward(dout)

    return step


def gpu_times(steps: dict, rounds: int, breakdown: int, shape) -> dict:
    """Each variant's GPU time (:func:`kernel_time_ms`), the median of ``rounds`` rounds that take the variants in
    turn: the share of the ceiling is a ratio of differences of nearly equal times, and one measurement per
    variant let it swing between runs (H200, ``python3 benchmarks/bench_token_rounding.py speed
    --shapes 0`` with one measurement each: 0.17 and -0.05 at the first shape, top-k itself 0.15 ms apart). None per
    variant without CUDA. ``breakdown`` prints the first round's kernel tables."""
    runs: dict = {name: [] for name in steps}
    for r in range(rounds):
        for name, step in steps.items():
            if breakdown and r == 0:
                print(f"{shape} {name}: the kernels with the most GPU time", flush=True)
            runs[name].append(kernel_time_ms(step, table=breakdown if r == 0 else 0))
    return {name: None if None in t else statistics.median(t) for name, t in runs.items()}


def run_speed(args) -> int:
    device = "cpu" if args.smoke else "cuda"
    dtype = torch.float32 if args.smoke else torch.bfloat16
    backend = "torch" if args.smoke else "triton"
    bench = timer(device)
    rows = []
    shapes = SMOKE_SHAPES if args.smoke else [SHAPES[int(i)] for i in args.shapes.split(",")]
    for shape in shapes:
        steps, tile = layer_steps(shape, device, dtype, backend, tile=16 if args.smoke else None,
                                  sonic="pairs-sonicmoe" in args.variants.split(","))
        steps = {k: v for k, v in steps.items() if k in ("topk", "tr-nr", "ceiling") or k in args.variants.split(",")}
        ms = {name: bench(step) for name, step in steps.items()}
        gpu = gpu_times(steps, args.rounds, args.breakdown, shape)
        t_ref = gpu if device == "cuda" else ms  # the share: GPU time where there is one
        gain = t_ref["topk"] / t_ref["ceiling"] - 1
        share = (t_ref["topk"] / t_ref["tr-nr"] - 1) / gain if gain else None
        T, d, h, E, K = shape
        for name, t in ms.items():
            g = gpu[name]
            rows.append({"date": datetime.date.today().isoformat(),
                         "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                         "T": T, "d": d, "h": h, "E": E, "K": K, "tile": tile, "dtype": str(dtype).split(".")[-1],
                         "variant": name, "ms": round(t, 4), "vs_topk": round(ms["topk"] / t, 4),
                         "gpu_ms": "" if g is None else round(g, 4),
                         "gpu_vs_topk": "" if g is None else round(gpu["topk"] / g, 4),
                         "share_of_ceiling": round(share, 3) if share is not None else "", "command": command()})
            gtxt = "" if g is None else f"   GPU {g:8.3f} ms  {gpu['topk'] / g:5.3f}x top-k"
            print(f"{shape} {name:>15}: wall {t:8.3f} ms  {ms['topk'] / t:5.3f}x top-k{gtxt}", flush=True)
        print(f"{shape} tr-nr keeps {share if share is None else round(share, 3)} of the ceiling's gain", flush=True)
        write_csv(args.out, rows[-len(ms):])  # shape by shape: a run cut by a time limit keeps what it measured
    return 0


def run_rounding(args) -> int:
    """Time token rounding alone (``nr``, tile 128) on softmax top-k routings of the issue's shapes, per path:
    ``torch`` (:func:`moeblaze.round_tokens` with its PyTorch selections, ``backend="torch"``), and on the
    GPU ``kernels`` (the Triton selections) and ``kernels-compiled`` (:func:`round_tokens_fused`: the rest
    through ``torch.compile``): wall ms by :func:`timer` (as the layer variants), and on the GPU its kernel
    time (:func:`moeblaze.bench.runner.kernel_time_ms`; ``--breakdown N`` prints the N kernels with the most
    time). On the CPU one intra-op thread (a proxy of the work, not of GPU time)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        torch.set_num_threads(1)
    bench, rows = timer(device), []
    paths = {"torch": (round_tokens, "torch")}
    if device == "cuda":
        paths.update({"kernels": (round_tokens, "auto"), "kernels-compiled": (round_tokens_fused, "auto")})
    for T, _d, _h, E, K in SHAPES:
        gen = torch.Generator(device=device).manual_seed(0)
        scores = torch.softmax(torch.randn(T, E, device=device, generator=gen), -1)
        w, ids = scores.topk(K, -1)
        ids = ids.int()
        for path, (fn, backend) in paths.items():
            def step(scores=scores, ids=ids, w=w, fn=fn, backend=backend):
                with settings.override(backend=backend):
                    fn(scores, ids, w, 128, "nr")

            ms, gpu = bench(step), kernel_time_ms(step, table=args.breakdown)
            rows.append({"date": datetime.date.today().isoformat(),
                         "device": torch.cuda.get_device_name() if device == "cuda" else "cpu, 1 thread",
                         "T": T, "E": E, "K": K, "tile": 128, "path": path, "ms": round(ms, 3),
                         "gpu_ms": "" if gpu is None else round(gpu, 4), "command": command()})
            gtxt = "" if gpu is None else f", GPU {gpu:.4f} ms"
            print(f"round_tokens nr {path} T={T} E={E} K={K}: {rows[-1]['ms']} ms{gtxt}", flush=True)
    write_csv(args.out, rows)
    return 0


def command() -> str:
    """The command that produced a row: the MOEBLAZE_* environment and the script's arguments."""
    import os

    env = [f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("MOEBLAZE_")]
    return " ".join([*env, "python3", "benchmarks/bench_token_rounding.py", *sys.argv[1:]])


def run_select(args) -> int:
    """Time :func:`moeblaze.kernels.rounding.rounding_select` (both launches, ``nr``, tile 128) per select-kernel
    warp count on softmax top-k routings of the issue's shapes (GPU, CUDA-graph replay: the launches' host time
    stays out); the selections must be the same for every warp count."""
    from moeblaze.bench.runner import graph_replay_ms
    from moeblaze.kernels import rounding
    from moeblaze.token_rounding import _max_pad

    if not torch.cuda.is_available():
        sys.exit("bench_token_rounding.py select: needs a CUDA GPU (it times Triton kernels)")
    chosen, keys_block, rows = rounding._select_warps, rounding._keys_block, []
    blocks = [None] if args.keys_blocks == "tuned" else [tuple(int(v) for v in b.split("x"))
                                                          for b in args.keys_blocks.split(",")]
    for T, _d, _h, E, K in SHAPES:
        gen = torch.Generator(device="cuda").manual_seed(0)
        scores = torch.softmax(torch.randn(T, E, device="cuda", generator=gen), -1)
        w, ids = scores.topk(K, -1)
        ids = ids.int()
        f = torch.bincount(ids.flatten(), minlength=E).int()
        ref = None
        fn = functools.partial(rounding.rounding_select, scores, ids, w, f, 128, "nr", _max_pad("nr", 128, T), 127)
        for warps, block in itertools.product((int(x) for x in args.warps.split(",")), blocks):
            rounding._select_warps = lambda nb, w_=warps: w_
            rounding._keys_block = keys_block if block is None else (lambda E_, b_=block: b_)
            out = fn()
            ref = ref or out
            if not all(torch.equal(a, b) for a, b in zip(out, ref)):
                raise AssertionError(f"select kernel with {warps} warps, keys block {block} selects differently")
            us = 1e3 * graph_replay_ms(fn)
            kb = "x".join(map(str, rounding._keys_block(E)))
            rows.append({"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(),
                         "T": T, "E": E, "K": K, "warps": warps, "keys_block": kb, "us": round(us, 1),
                         "command": command()})
            print(f"rounding_select T={T} E={E} K={K} warps={warps} keys block {kb}: {us:.1f} us", flush=True)
    rounding._select_warps, rounding._keys_block = chosen, keys_block
    write_csv(args.out, rows)
    return 0


def write_csv(path, rows) -> None:
    if not path or not rows:
        return
    append_dicts(path, rows)


_EVAL = re.compile(r"step (\d+): train loss ([\d.]+) nats/byte, val ([\d.]+) bits/byte")


def _preset_configs(preset: str, routing: str, args):
    """``(TrainConfig, ModelConfig)`` of ``moeblaze train --preset PRESET --routing ROUTING`` for this run."""
    from dataclasses import fields

    from moeblaze.cli import PRESETS
    from moeblaze.training.model import ModelConfig
    from moeblaze.training.train import TrainConfig

    values = dict(PRESETS[preset])
    if args.smoke:
        values.update(seq_len=32, d_model=32, n_layers=1, n_heads=2, d_ff=32)
    names = {f.name for f in fields(ModelConfig)}
    mcfg = ModelConfig(routing=routing, backend="torch" if args.smoke else "triton",
                       **{k: v for k, v in values.items() if k in names})
    ckpt = tempfile.mkdtemp(prefix=f"tr_quality_{routing.replace(':', '-')}_")  # checkpoints stay out of --out-dir
    run = dict(batch_size=8, eval_interval=2, eval_tokens=256, warmup_steps=1) if args.smoke else dict(
        eval_interval=args.eval_interval, **({"batch_size": args.batch_size} if args.batch_size else {}))
    cfg = TrainConfig(out_dir=ckpt, steps=args.steps, seed=args.seed, checkpoint_interval=0,
                      device="cpu" if args.smoke else "cuda", overwrite=True, progress=False,
                      **{k: v for k, v in values.items() if k not in names}, **run)
    return cfg, mcfg


def run_quality(args) -> int:
    from moeblaze.training.train import train

    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for routing in args.routings.split(","):
        cfg, mcfg = _preset_configs(args.preset, routing, args)
        lines = []
        try:
            result = train(cfg, mcfg, log=lambda msg, lines=lines: (lines.append(str(msg)), print(msg, flush=True)))
        finally:  # the run's checkpoints (a temporary folder) are not results
            shutil.rmtree(cfg.out_dir, ignore_errors=True)
        evals = dict((int(m[1]), float(m[3])) for m in map(_EVAL.search, lines) if m)
        print(f"{routing}: final val {result.val_bpb:.4f} bits/byte", flush=True)
        path = out / f"curves-{routing.replace(':', '-')}.csv"
        path.unlink(missing_ok=True)
        write_csv(path, [{"routing": routing, "step": i + 1, "train_loss": round(v, 5), "val_bpb": evals.get(i + 1, "")}
                         for i, v in enumerate(result.losses)])
    summarise(out)
    return 0


def summarise(out: Path) -> None:
    """Final bits/byte of top-k and nr from ``out/curves-*.csv`` (one file per run, so two processes with one
    ``--routings`` each can share ``out``) and the side-by-side plot."""
    rows = []
    for path in sorted(out.glob("curves-*.csv")):
        with open(path, newline="") as f:
            rows += list(csv.DictReader(f))
    curves, evals = {}, {}
    for r in rows:
        curves.setdefault(r["routing"], []).append(float(r["train_loss"]))
        if r["val_bpb"]:
            evals.setdefault(r["routing"], []).append((int(r["step"]), float(r["val_bpb"])))
    final = {k: v[-1][1] for k, v in evals.items()}
    if {"topk", "token-rounding:nr"} <= set(final):
        top, tr = final["topk"], final["token-rounding:nr"]
        print(f"val bits/byte: top-k {top:.4f}, token rounding nr {tr:.4f} ({100 * (tr / top - 1):+.2f}%)", flush=True)
        plot(curves, evals, out / "token_rounding_quality.png")


def plot(curves, evals, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not importable: no plot", flush=True)
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for routing, losses in curves.items():
        k = max(1, len(losses) // 50)  # running mean over ~2% of the run
        smooth = [sum(losses[max(0, i - k + 1): i + 1]) / len(losses[max(0, i - k + 1): i + 1])
                  for i in range(len(losses))]
        a.plot(range(1, len(losses) + 1), smooth, label=routing)
        b.plot(*zip(*evals[routing]), marker="o", label=routing)
    a.set(xlabel="step", ylabel="train loss (nats/byte)", title="train loss")
    b.set(xlabel="step", ylabel="bits/byte", title="validation")
    a.legend()
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="stage", required=True)
    sp = sub.add_parser("speed", help="layer step times: top-k, tr-nr, ceiling, pairs (moeblaze, SonicMoE)")
    sp.add_argument("--out", default=None, help="CSV file to append the rows to")
    sp.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (PyTorch backend): a pipeline check")
    sp.add_argument("--breakdown", type=int, default=0, help="print each variant's N kernels with the most GPU time")
    sp.add_argument("--shapes", default="0,1,2", help="which of SHAPES (indices, comma-separated)")
    sp.add_argument("--rounds", type=int, default=3,
                    help="GPU times: median of this many rounds over the variants in turn (default 3)")
    sp.add_argument("--variants", default="tr-nr-eager,pairs-moeblaze,pairs-sonicmoe",
                    help="variants besides topk, tr-nr and ceiling (comma-separated)")
    rp = sub.add_parser("rounding", help="round_tokens alone at the issue's shapes (CPU: a proxy of its work)")
    rp.add_argument("--out", default=None, help="CSV file to append the rows to")
    rp.add_argument("--breakdown", type=int, default=0, help="print the N kernels with the most GPU time")
    sel = sub.add_parser("select", help="rounding_select per select-kernel warp count and keys launch shape (GPU)")
    sel.add_argument("--warps", default="4,8,16", help="select-kernel warp counts, comma-separated (default 4,8,16)")
    sel.add_argument("--keys-blocks", default="tuned",
                     help="keys-kernel launch shapes BLOCK_TxBLOCK_E, comma-separated (e.g. 16x32,16x128), or tuned")
    sel.add_argument("--out", default=None, help="CSV file to append the rows to")
    q = sub.add_parser("quality", help="train with top-k and with token rounding nr; curves and plot")
    q.add_argument("--out-dir", required=True)
    q.add_argument("--steps", type=int, default=800)
    q.add_argument("--eval-interval", type=int, default=100)
    q.add_argument("--seed", type=int, default=1337)
    q.add_argument("--routings", default="topk,token-rounding:nr", help="the runs, in order (comma-separated)")
    q.add_argument("--preset", default="small", help="moeblaze train --preset (small, 1b)")
    q.add_argument("--batch-size", type=int, default=0, help="sequences per step (0: the preset's)")
    q.add_argument("--summarise", action="store_true", help="only print the summary and plot of --out-dir")
    q.add_argument("--smoke", action="store_true", help="a tiny model for a few steps on the CPU")
    args = ap.parse_args(argv)
    if args.stage == "speed" and args.rounds < 1:
        sp.error(f"--rounds must be >= 1, got {args.rounds}")
    if args.stage == "quality" and args.smoke:
        args.steps = min(args.steps, 4)
    if args.stage == "quality" and args.summarise:
        summarise(Path(args.out_dir))
        return 0
    if args.stage == "rounding":
        return run_rounding(args)
    if args.stage == "select":
        return run_select(args)
    return run_speed(args) if args.stage == "speed" else run_quality(args)


if __name__ == "__main__":
    sys.exit(main())
