"""Finished ``moeblaze train`` runs side by side: loss curves and expert load (issue 61).

The comparison it was written for (one GPU, 1,000 steps of the 1B preset; the second run's flags name the
Switch loss explicitly, although it is the default):

    moeblaze train --preset 1b --device cuda --steps 1000 --expert-bias-rate 1e-3 --aux-loss-coef 0 \\
        --out-dir runs/aux-free
    moeblaze train --preset 1b --device cuda --steps 1000 --aux-loss-type switch --aux-loss-coef 0.01 \\
        --out-dir runs/switch
    python benchmarks/bench_balance.py runs/aux-free runs/switch --labels "aux-free u=1e-3" "switch 0.01"

It reads each folder's ``metrics.csv`` (:mod:`moeblaze.training.metrics_log`), draws the training / validation bits per
byte and the max / mean tokens per expert (worst MoE layer and mean over layers) of both runs into one PNG
(default ``docs/plots/balance.png``), and prints per run: the last step, the final training loss (mean of the
last 10 steps, nats per byte) and validation bits per byte, the final (mean of the last 10 steps) and the mean
over all steps of the worst layer's max / mean load, and the experts that received no token (final, mean).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from moeblaze.training.plot import draw_load, draw_loss, has_load, read_metrics
from moeblaze.training.train_config import ConfigError

ROOT = Path(__file__).resolve().parents[1]
COLORS = ("#d62728", "#1f77b4", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b")
TAIL = 10  # steps averaged for the "final" figures: one step's load is noisy


def summary(metrics: dict) -> dict[str, float | None]:
    """The figures printed for one run (None where the run did not log them)."""
    def values(name: str) -> list[float]:
        return [v for v in metrics.get(name, []) if v is not None]

    loss, ratio, zeros, val = (values(n) for n in ("loss", "load_ratio_max", "zero_load_experts", "val_bpb"))
    return {"steps": max(values("step")), "final_loss": statistics.fmean(loss[-TAIL:]),
            "final_val_bpb": val[-1] if val else None,
            "final_load": statistics.fmean(ratio[-TAIL:]) if ratio else None,
            "mean_load": statistics.fmean(ratio) if ratio else None,
            "final_zero_load": statistics.fmean(zeros[-TAIL:]) if zeros else None,
            "mean_zero_load": statistics.fmean(zeros) if zeros else None}


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="the --out-dir of finished moeblaze train runs")
    p.add_argument("--labels", nargs="+", metavar="LABEL", help="legend names, one per run (default: folder names)")
    p.add_argument("--out", default=str(ROOT / "docs" / "plots" / "balance.png"), help="the PNG to write [%(default)s]")
    args = p.parse_args(argv)
    labels = args.labels or [Path(r).name for r in args.runs]
    if len(labels) != len(args.runs):
        p.error(f"--labels needs one name per run ({len(args.runs)}), got {len(labels)}")
    if len(args.runs) > len(COLORS):
        p.error(f"at most {len(COLORS)} runs fit one plot, got {len(args.runs)}")
    try:
        runs = [read_metrics(r) for r in args.runs]
    except ConfigError as err:
        p.error(str(err))
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 4.5), layout="constrained")
    loss_ax, load_ax = fig.subplots(1, 2)
    for metrics, label, color in zip(runs, labels, COLORS):
        draw_loss(loss_ax, metrics, label, color)
        if has_load(metrics):
            draw_load(load_ax, metrics, label, color)
    loss_ax.set_title("loss")
    load_ax.set_title("expert load: max / mean tokens per expert (all ranks)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    print(f"{'run':<24} {'steps':>6} {'loss':>8} {'val bpb':>8} {'load final':>10} {'load mean':>10} "
          f"{'zero final':>10} {'zero mean':>10}")
    for metrics, label in zip(runs, labels):
        s = summary(metrics)
        print(f"{label:<24} {s['steps']:>6.0f} {s['final_loss']:>8.4f} {_fmt(s['final_val_bpb'], '>8.4f')} "
              f"{_fmt(s['final_load'], '>10.3f')} {_fmt(s['mean_load'], '>10.3f')} "
              f"{_fmt(s['final_zero_load'], '>10.1f')} {_fmt(s['mean_zero_load'], '>10.1f')}")
    print(f"(loss: nats per byte, mean of the last {TAIL} steps; load: the worst MoE layer's max / mean tokens per "
          f"expert, final = mean of the last {TAIL} steps; zero: experts without a token, summed over layers)")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
