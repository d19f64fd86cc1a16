"""``moeblaze bench`` and ``moeblaze memory``: the subcommands, added to the main CLI by :func:`register`.

Examples (see ``_EXAMPLES``)::

    moeblaze bench --suite all --out results/        # everything, ~8 minutes on an H100/H200
    moeblaze bench --suite smoke                     # a quick check (the default suite)
    moeblaze bench --configs 'olmoe*,conf3-*' --impls moeblaze,conventional --tokens 8k,32k
    moeblaze bench --plot results/results.csv        # redraw the plots from a CSV (no GPU needed)
    moeblaze bench --list                            # configs and suites (no GPU needed)
    moeblaze bench --configs conf4-swiglu --impls moeblaze,conventional,sonicmoe --append-results docs/results.csv
    moeblaze bench --report docs/results.csv         # README table and docs/plots/ from the results file
    moeblaze memory                                  # where the train model's activation memory goes
    moeblaze memory --config olmoe-1b-7b --impl conventional --tokens 8192
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from .configs import CONFIGS, SUITES, get_configs, parse_list, parse_shape, parse_tokens

__all__ = ["register", "run_bench", "run_memory"]

_EXAMPLES = __doc__.split("::", 1)[1]

# Per-suite defaults: (min_reps, max_reps, target_s, budget_s). ``all`` must finish in ~8 minutes.
_SUITE_DEFAULTS = {"all": (3, 20, 0.3, 420.0), "layers": (3, 20, 0.3, 420.0), "smoke": (3, 10, 0.2, None)}
_RUN_DEFAULTS = (5, 50, 0.5, None)


def register(subparsers: Any) -> None:
    """Add the ``bench`` and ``memory`` subcommands to an ``argparse`` subparsers object.

    Each parser sets ``func``: call ``args.func(args)``; it returns 0, or raises ``SystemExit`` with a
    message (e.g. no CUDA GPU) that makes the process exit non-zero.
    """
    _add_bench(subparsers)
    _add_memory(subparsers)


def _add_bench(subparsers: Any) -> None:
    from .baselines import DEFAULT_IMPLS, IMPLS

    p = subparsers.add_parser("bench", help="benchmark MoE layers against conventional and peer implementations",
                              description="Forward+backward of one MoE layer (router included) at named configs, "
                              "moeblaze side by side with a conventional grouped_mm layer, an HF-style loop, "
                              "Liger-Kernel and SonicMoE; CSV, markdown and PNG plots into --out. Needs a CUDA "
                              "GPU, except --list, --plot and --report.",
                              formatter_class=argparse.RawDescriptionHelpFormatter, epilog="examples:" + _EXAMPLES)
    p.add_argument("--suite", choices=sorted(SUITES), default=None,
                   help="what to run (default: smoke; with --configs: just those configs)")
    p.add_argument("--configs", default=None, help="comma-separated config names, globs or groups")
    p.add_argument("--tokens", default=None, help="run the configs at these token counts instead (e.g. 8k,32k,2M)")
    p.add_argument("--shape", default=None, metavar="d:h:E:K[:act]",
                   help="an unnamed layer shape to run (at --tokens, default 32768), e.g. 2048:1024:64:8:swiglu")
    p.add_argument("--activation", default=None, help="keep only configs with this activation")
    p.add_argument("--impls", default=",".join(DEFAULT_IMPLS),
                   help=f"comma-separated implementations, of {', '.join(IMPLS)} (default: %(default)s)")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # "cpu": tests of the pipeline only
    p.add_argument("--out", default="results", help="results folder (default: %(default)s)")
    p.add_argument("--min-reps", type=int, default=None, help="fewest timed steps per implementation")
    p.add_argument("--max-reps", type=int, default=None, help="most timed steps per implementation")
    p.add_argument("--target-s", type=float, default=None, help="seconds of timed steps per implementation")
    p.add_argument("--cap-s", type=float, default=60.0,
                   help="per-implementation cap in seconds (first step slower: skipped; default: %(default)s)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="total seconds for the run; what is left is skipped (default: 420 for all/layers)")
    p.add_argument("--isolate", choices=["auto", "all", "none"], default="auto",
                   help="measure implementations in a child process killed after --isolate-timeout-s: auto = "
                   "those whose first call may compile for minutes (sonicmoe); default: %(default)s")
    p.add_argument("--isolate-timeout-s", type=float, default=600.0,
                   help="wall-clock limit of an isolated measurement, compile included (also bounded by what "
                   "is left of --budget-s; bounds its first step instead of --cap-s); past it the child is "
                   "killed and the row skipped (default: %(default)s)")
    p.add_argument("--no-flush", action="store_true", help="do not flush L2 before each timed step")
    p.add_argument("--grad-accum", type=int, default=1,
                   help="forward+backward passes per timed step, gradients accumulated, as under gradient "
                   "accumulation (FP8 layers quantize their weights once a step: moeblaze.fp8.reuse_weights); "
                   "times per pass (default: %(default)s)")
    p.add_argument("--liger-autotune", action="store_true",
                   help="let Liger autotune (> 2 min per shape); default: LIGER_FUSED_MOE_AUTOTUNE=0")
    p.add_argument("--hf-max-tokens", type=int, default=131072, help="skip the HF loop above this T")
    p.add_argument("--peak-tflops", type=float, default=None, help="device dense bf16 peak for MFU (train)")
    p.add_argument("--train-steps", type=int, default=10, help="timed steps of the train benchmark")
    p.add_argument("--image-prefix", default="", help="prefix of the PNG links in results.md (e.g. benchmarks/)")
    p.add_argument("--list", action="store_true", help="list configs and suites, then exit")
    p.add_argument("--append-results", metavar="CSV", default=None,
                   help="also append this run's rows, with date, device, commit and command, to this results file "
                   "(e.g. docs/results.csv; see moeblaze.bench.results)")
    p.add_argument("--commit", default=None,
                   help="commit of the code measured, for --append-results (default: git HEAD of this checkout)")
    p.add_argument("--report", metavar="CSV", default=None,
                   help="from a results file: rewrite --readme's performance table and draw --plots-dir (no GPU)")
    p.add_argument("--readme", default="README.md", help="the README --report rewrites (default: %(default)s)")
    p.add_argument("--plots-dir", default="docs/plots", help="where --report draws (default: %(default)s)")
    p.add_argument("--plot", metavar="CSV", default=None,
                   help="redraw the plots and results.md from a results CSV (into its folder, or --out if given)")
    p.set_defaults(func=run_bench, bench_parser=p)


def _add_memory(subparsers: Any) -> None:
    p = subparsers.add_parser("memory", help="per-module activation memory (saved for backward) and peak",
                              description="moeblaze.memory_report on the train model (default) or on one MoE "
                              "layer config: bytes saved for backward per module and the peak memory of one "
                              "training step (CUDA).")
    p.add_argument("--config", default=None, help="a named layer config (see `moeblaze bench --list`)")
    p.add_argument("--shape", default=None, metavar="d:h:E:K[:act]", help="an unnamed layer shape instead")
    p.add_argument("--impl", default="moeblaze", help="implementation for --config (default: %(default)s; "
                   "falls back to moeblaze-torch where Triton cannot run)")
    p.add_argument("--tokens", default=None, help="T for --config (default: the config's)")
    p.add_argument("--batch-size", type=int, default=None, help="train model: sequences per batch "
                   "(default: moeblaze train's)")
    p.add_argument("--seq-len", type=int, default=None, help="train model: sequence length (default: config's)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None,
                   help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--depth", type=int, default=None, help="show modules at most this deep")
    p.add_argument("--json", default=None, help="also write the report as JSON here")
    p.set_defaults(func=run_memory)


def _list() -> None:
    print(f"{'config':<20} {'group':<8} {'T':>8} {'d':>5} {'h':>6} {'E':>4} {'K':>2}  activation")
    for c in CONFIGS.values():
        print(f"{c.name:<20} {c.group:<8} {c.T:>8} {c.d:>5} {c.h:>6} {c.E:>4} {c.K:>2}  {c.activation}")
    print()
    for name, s in SUITES.items():
        parts = [f"{len(s['layers'])} layer configs"] + [k for k in ("dispatch", "train") if s[k]]
        print(f"suite {name:<9} {', '.join(parts)}")


def _replot(args: argparse.Namespace) -> int:
    """``--plot CSV``: plots and results.md again from the CSVs (and meta.json) of a results folder."""
    from . import report

    csv_path = Path(args.plot)
    if not csv_path.exists():
        raise SystemExit(f"moeblaze bench --plot: no such file: {csv_path}")
    try:
        rows = report.read_csv(csv_path)
    except ValueError as exc:
        raise SystemExit(f"moeblaze bench --plot: {exc}") from exc
    src = csv_path.parent
    out_dir = Path(args.out) if args.out != "results" else src
    extra = {n: report.read_dicts(src / f"{n}.csv") if (src / f"{n}.csv").exists() else []
             for n in ("dispatch", "train")}
    md, plots = report.write_outputs(out_dir, rows, report.read_meta(src), extra["dispatch"], extra["train"],
                                     args.image_prefix)
    for p in [*plots, md]:
        print(f"wrote {p}")
    return 0


def _report(args: argparse.Namespace) -> int:
    """``--report CSV``: the README table and the plots from a results file (:mod:`moeblaze.bench.results`)."""
    from .results import make_report

    try:
        _, plots = make_report(args.report, args.readme, args.plots_dir)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"moeblaze bench --report: {exc}") from exc
    for p in [args.readme, *plots]:
        print(f"wrote {p}")
    return 0


def _argv(args: argparse.Namespace) -> list[str]:
    """The options that differ from their defaults, as command-line words (for the report's header)."""
    parser = getattr(args, "bench_parser", None)
    words = ["bench"]
    for action in parser._actions if parser is not None else ():
        value = getattr(args, action.dest, None)
        if not action.option_strings or value == action.default or action.dest == "help":
            continue
        words += [action.option_strings[0]] if isinstance(value, bool) else [action.option_strings[0], str(value)]
    return words


def _options(args: argparse.Namespace, suite: str | None):
    from .baselines import ImplOptions
    from .runner import RunOptions

    if args.grad_accum < 1:
        args.bench_parser.error(f"--grad-accum must be an integer >= 1, got {args.grad_accum}")
    min_r, max_r, target, budget = _SUITE_DEFAULTS.get(suite or "", _RUN_DEFAULTS)
    pick = lambda v, d: d if v is None else v
    return RunOptions(dtype=args.dtype, device=args.device, min_reps=pick(args.min_reps, min_r),
                      max_reps=pick(args.max_reps, max_r),
                      target_s=pick(args.target_s, target), cap_s=args.cap_s, budget_s=pick(args.budget_s, budget),
                      flush_l2=not args.no_flush, isolate=args.isolate, isolate_timeout_s=args.isolate_timeout_s,
                      grad_accum=args.grad_accum,
                      impl=ImplOptions(liger_autotune=args.liger_autotune, hf_max_tokens=args.hf_max_tokens))


def run_bench(args: argparse.Namespace) -> int:
    """Entry point of ``moeblaze bench`` (see the module docstring). Returns 0.

    Raises:
        SystemExit: no CUDA GPU (except ``--list``, ``--plot`` and ``--report``), an unknown config,
            implementation or file.
    """
    from .baselines import IMPLS

    if args.list:
        _list()
        return 0
    if args.plot:
        return _replot(args)
    if args.report:
        return _report(args)
    suite = args.suite or (None if args.configs or args.shape else "smoke")
    spec = SUITES[suite] if suite else {"layers": None, "dispatch": False, "train": False}
    impls = parse_list(args.impls)
    unknown = [i for i in impls if i not in IMPLS]
    if unknown:
        raise SystemExit(f"moeblaze bench: unknown implementation(s) {unknown}; choose from {list(IMPLS)}")
    try:
        tokens = parse_tokens(args.tokens)
        if args.shape:
            configs = parse_shape(args.shape, tokens) + (get_configs(suite, parse_list(args.configs), tokens,
                                                                     args.activation) if args.configs else [])
        else:
            configs = (get_configs(suite, parse_list(args.configs), tokens, args.activation)
                       if spec["layers"] is None or spec["layers"] else [])
    except ValueError as exc:
        raise SystemExit(f"moeblaze bench: {exc}") from exc
    from .runner import NoCudaError, require_cuda

    try:
        if args.device != "cpu":
            require_cuda("moeblaze bench" + (f" --suite {suite}" if suite else ""))
    except NoCudaError as exc:
        raise SystemExit(str(exc)) from exc
    return _run(args, suite, spec, configs, impls)


def _run(args: argparse.Namespace, suite: str | None, spec: dict, configs: list, impls: list[str]) -> int:
    from . import micro, report
    from .suite import run_layers

    out_dir = Path(args.out)
    opts = _options(args, suite)
    opts.child_log_dir = str(out_dir / "children")  # isolated children's output, kept whatever happens
    # Read by liger_kernel when first imported: one fixed config per kernel unless --liger-autotune.
    os.environ.setdefault("LIGER_FUSED_MOE_AUTOTUNE", "1" if args.liger_autotune else "0")
    meta = report.environment(_argv(args))
    budget = f"{opts.budget_s:.0f} s" if opts.budget_s is not None else "none"
    meta.update(dtype=args.dtype, suite=suite,
                settings=f"suite {suite or '(configs)'}; {opts.min_reps}-{opts.max_reps} timed steps "
                f"(~{opts.target_s} s) per implementation; cap {opts.cap_s:.0f} s per implementation; "
                f"budget {budget}; HF loop up to T={opts.impl.hf_max_tokens}; child processes: {opts.isolate} "
                f"(killed after {opts.isolate_timeout_s:.0f} s)")
    report.write_meta(meta, out_dir)
    print(f"# {meta['command']}\n# {meta['device']}, torch {meta['torch']}, triton {meta['triton']}, "
          f"{meta['date']}")
    start = time.perf_counter()
    stamp = lambda: f"[{time.perf_counter() - start:4.0f}s]"
    rows_d = rows_t = []
    if spec["dispatch"]:
        rows_d = micro.run_dispatch(device=args.device, on_row=lambda r: print(
            f"{stamp()} dispatch T={r['T']:<8} E={r['E']:<4} K={r['K']:<2} {r['builder']:<28} "
            f"{r.get('time_ms', float('nan')):8.3f} ms  {r['status']} {r['note']}", flush=True))
        report.write_dicts(out_dir / "dispatch.csv", rows_d, micro.DISPATCH_COLUMNS)
    if spec["train"]:
        rows_t = micro.run_train(micro.TrainSpec(steps=args.train_steps), peak=args.peak_tflops, device=args.device,
                                 on_row=lambda r: print(f"{stamp()} train {r['backend']:<8} {r['status']} "
                                                        f"{r.get('tokens_per_s') or 0:,.0f} tok/s "
                                                        f"MFU {r.get('mfu') or 0:.1%} {r['note']}", flush=True))
        report.write_dicts(out_dir / "train.csv", rows_t, micro.TRAIN_COLUMNS)
    rows: list = []

    def on_row(r) -> None:  # the CSV is rewritten after every row: a crash keeps what was measured
        rows.append(r)
        report.write_csv(rows, out_dir / "results.csv")
        print(f"{stamp()} {report.terminal_row(r)}", flush=True)

    if configs:
        print(f"{'':7} {report.TERMINAL_HEADER}")
        run_layers(configs, impls, opts, on_row=on_row, start=start)
    if args.append_results:
        from .results import append_results, call_of, git_commit

        append_results(args.append_results, rows, call_of(meta, args.commit or git_commit()))
        print(f"appended {len(rows)} rows to {args.append_results}")
    md, plots = report.write_outputs(out_dir, rows, meta, rows_d, rows_t, args.image_prefix)
    print(f"\nwrote {md}, the CSVs, meta.json and {len(plots)} plots into {out_dir}/ "
          f"in {time.perf_counter() - start:.0f} s")
    return 0


def run_memory(args: argparse.Namespace) -> int:
    """Entry point of ``moeblaze memory``: print a :func:`memory_report` table. Returns 0.

    Raises:
        SystemExit: unknown config or implementation, or CUDA requested but absent.
    """
    import torch

    from ..memory_report import memory_report
    from .runner import DTYPES

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"moeblaze memory: --device {device} needs a CUDA GPU, and torch.cuda.is_available() "
                         "is False here; use --device cpu (no peak memory on the CPU)")
    dtype = DTYPES[args.dtype or ("bf16" if device.startswith("cuda") else "fp32")]
    if args.config or args.shape:
        model, batch, loss_fn, what = _layer_target(args, device, dtype)
    else:
        model, batch, loss_fn, what = _train_target(args, device, dtype)
    report = memory_report(model, batch, loss_fn, warmup=1 if device.startswith("cuda") else 0)
    print(f"# moeblaze memory: {what}, {device}, {str(dtype).replace('torch.', '')}")
    print(report.table(max_depth=args.depth))
    if args.json:
        Path(args.json).write_text(json.dumps(report.as_dict(), indent=2) + "\n")
    return 0


def _train_target(args: argparse.Namespace, device: str, dtype):
    import torch
    import torch.nn.functional as F

    from ..layer import aux_loss
    from ..training.model import ModelConfig, MoETransformer
    from ..training.train_config import TrainConfig

    cfg = ModelConfig() if args.seq_len is None else ModelConfig(seq_len=args.seq_len)
    B = args.batch_size or TrainConfig.batch_size
    model = MoETransformer(cfg).to(device=device, dtype=dtype).train()
    batch = torch.randint(0, cfg.vocab_size, (B, cfg.seq_len + 1), device=device)

    def loss_fn(logits, _):
        return F.cross_entropy(logits.float().view(-1, cfg.vocab_size), batch[:, 1:].reshape(-1)) + aux_loss(model)

    return model, batch[:, :-1], loss_fn, f"train model (ModelConfig defaults), batch {B}x{cfg.seq_len}"


def _layer_target(args: argparse.Namespace, device: str, dtype):
    import torch
    import torch.nn as nn

    from .baselines import IMPLS, ImplOptions, make_weights

    if args.config and args.config not in CONFIGS:
        raise SystemExit(f"moeblaze memory: unknown config {args.config!r}; see `moeblaze bench --list`")
    try:
        tokens = parse_tokens(args.tokens)[:1]
        cfg = parse_shape(args.shape, tokens)[0] if args.shape else CONFIGS[args.config]
    except ValueError as exc:
        raise SystemExit(f"moeblaze memory: {exc}") from exc
    cfg = cfg.with_tokens(tokens[0]) if tokens and not args.shape else cfg
    impl = IMPLS.get(args.impl)
    if impl is None:
        raise SystemExit(f"moeblaze memory: unknown implementation {args.impl!r}; choose from {list(IMPLS)}")
    if impl.unavailable() and args.impl == "moeblaze":
        impl = IMPLS["moeblaze-torch"]
    why = impl.unavailable() or impl.unsupported(cfg, ImplOptions(hf_max_tokens=1 << 62))
    if why:
        raise SystemExit(f"moeblaze memory: {impl.name} cannot run {cfg.name} here: {why}")
    w = make_weights(cfg, device, dtype)
    fn = impl.build(cfg, w, ImplOptions())

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.router_weight, self.w1, self.w2 = w.router, w.w1, w.w2
            self.layer = fn if isinstance(fn, nn.Module) else None

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return fn(x)

    x = torch.randn(cfg.T, cfg.d, device=device, dtype=dtype, requires_grad=True)
    return Layer().train(), x, None, f"{impl.name} on {cfg.name} ({cfg.shape}, {cfg.activation})"
