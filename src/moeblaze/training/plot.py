"""``moeblaze plot OUT_DIR``: the curves of a ``moeblaze train`` run, from its ``metrics.csv``, as PNG files;
``moeblaze plot RUN RUN ... --out FILE``: the loss curves of several runs in one figure (a precision, recipe or
config against another: same steps, one color per label) and a table of their final losses; runs given one label are
one group (seeds of one setting), summarised by mean and range: two runs of one seed already end 2-3% apart on a GPU
(docs/benchmarks.md, FP8 training), so a comparison at 1% needs several runs a side.

``loss.png``: the training loss and the validation loss in bits per byte against the step. ``expert_load.png``
(where the run logged the expert load, :mod:`moeblaze.training.metrics_log`): max / mean tokens per expert of the worst
MoE layer and the mean over the layers, and the experts that received no token. matplotlib draws them without a
display (``matplotlib.figure.Figure``, no pyplot state); ``benchmarks/bench_balance.py`` puts two runs side by
side with the same functions.
"""

from __future__ import annotations

import csv
import importlib.util
import os
from pathlib import Path

from .metrics_log import FILE_NAME, LOAD_COLUMNS
from .train_config import ConfigError

__all__ = ["FINAL_STEPS", "compare_table", "draw_load", "draw_loss", "final_metrics", "plot_compare", "plot_run",
           "read_metrics", "read_runs"]

FINAL_STEPS = 10  # a run's final loss: the mean of its last 10 logged training losses (docs/results-fp8-train.csv)


def read_metrics(out_dir: str | os.PathLike) -> dict[str, list[float | None]]:
    """The columns of ``<out_dir>/metrics.csv`` as lists of floats (None where a cell is empty), rows by step.

    Raises:
        ConfigError: no readable ``metrics.csv`` there, or one without rows.
    """
    path = Path(out_dir).expanduser() / FILE_NAME
    try:
        with open(path, newline="") as fh:
            rows = list(csv.DictReader(fh))
    except OSError as err:
        raise ConfigError(f"cannot read {path} ({err.strerror or err}): pass the --out-dir of a moeblaze train "
                          "run") from None
    if not rows:
        raise ConfigError(f"{path} holds no step yet")

    def number(text: str | None) -> float | None:
        try:
            return float(text) if text else None
        except ValueError:
            return None

    return {name: [number(r.get(name)) for r in rows] for name in rows[0]}


def _series(metrics: dict, name: str) -> tuple[list[float], list[float]]:
    """(steps, values) of the rows where column ``name`` has a value."""
    pairs = [(s, v) for s, v in zip(metrics["step"], metrics.get(name, [])) if s is not None and v is not None]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def draw_loss(ax, metrics: dict, label: str | None = "", color=None) -> None:
    """Training (line) and validation (markers) bits per byte against the step on ``ax``; ``label`` None: no legend
    entries (another run of a group already has them)."""
    prefix = f"{label}: " if label else ""
    names = ("_nolegend_",) * 2 if label is None else (f"{prefix}train", f"{prefix}validation")
    ax.plot(*_series(metrics, "bits_per_byte"), lw=0.8, color=color, label=names[0])
    steps, val = _series(metrics, "val_bpb")
    if steps:
        ax.plot(steps, val, "o--", ms=4, color=color, label=names[1])
    ax.set_xlabel("step")
    ax.set_ylabel("bits per byte")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def draw_load(ax, metrics: dict, label: str = "", color=None) -> None:
    """Max / mean tokens per expert (worst layer: line; mean over layers: dotted) against the step on ``ax``."""
    prefix = f"{label}: " if label else ""
    ax.plot(*_series(metrics, "load_ratio_max"), lw=0.8, color=color, label=f"{prefix}worst layer")
    ax.plot(*_series(metrics, "load_ratio_mean"), ":", lw=1.0, color=color, label=f"{prefix}mean over layers")
    ax.axhline(1.0, color="grey", lw=0.5)
    ax.set_xlabel("step")
    ax.set_ylabel("max / mean tokens per expert")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def has_load(metrics: dict) -> bool:
    """The run logged the expert load on some step."""
    return any(v is not None for name in LOAD_COLUMNS for v in metrics.get(name, []))


def _figure_class():
    if importlib.util.find_spec("matplotlib") is None:
        raise ConfigError("moeblaze plot needs matplotlib (pip install matplotlib)")
    from matplotlib.figure import Figure

    return Figure


def read_runs(out_dirs: list[str | os.PathLike], labels: list[str] | None = None) -> list[tuple[str, dict]]:
    """``(label, metrics)`` of each run in ``out_dirs``, each ``metrics.csv`` read once (:func:`read_metrics`), labelled
    by ``labels`` or the folder names: what :func:`plot_compare` and :func:`compare_table` take.

    Raises:
        ConfigError: a folder without a ``metrics.csv`` with rows, or ``labels`` not one per run.
    """
    runs = [Path(d).expanduser() for d in out_dirs]
    labels = labels or [r.name for r in runs]
    if len(labels) != len(runs):
        raise ConfigError(f"--labels: {len(labels)} given for {len(runs)} runs; give one per run")
    return [(label, read_metrics(run)) for run, label in zip(runs, labels)]


def plot_compare(runs: list[tuple[str, dict]], out_file: str | os.PathLike) -> Path:
    """The training and validation bits per byte of each run of ``runs`` (:func:`read_runs`; a color per label, runs
    of one label a group) in one figure, written to ``out_file`` (PNG); returns its path.

    Raises:
        ConfigError: matplotlib is not installed.
    """
    labels = [label for label, _ in runs]
    Figure = _figure_class()
    groups = list(dict.fromkeys(labels))
    fig = Figure(figsize=(7, 4.5), layout="constrained")
    ax = fig.subplots()
    for i, (label, metrics) in enumerate(runs):
        n = labels.count(label)
        name = f"{label} ({n} runs)" if n > 1 else label
        draw_loss(ax, metrics, name if labels.index(label) == i else None, color=f"C{groups.index(label)}")
    ax.set_title("loss — " + " vs ".join(groups))
    out = Path(out_file).expanduser()
    fig.savefig(out, dpi=120)
    return out


def final_metrics(metrics: dict) -> tuple[float | None, float | None]:
    """``(final loss, last validation)`` of a run's metrics: the mean of its last :data:`FINAL_STEPS` training losses
    (nats per byte) and its last validation bits per byte; None where it logged none."""
    losses = _series(metrics, "loss")[1][-FINAL_STEPS:]
    val = _series(metrics, "val_bpb")[1]
    return (sum(losses) / len(losses) if losses else None), (val[-1] if val else None)


def compare_table(runs: list[tuple[str, dict]]) -> str:
    """A text table of ``runs`` (:func:`read_runs`) by label (runs sharing one are a group, e.g. seeds of one
    precision): the number of runs, the mean final loss (:func:`final_metrics`) with its range, the mean last
    validation bits per byte with its range, and the group's mean final loss over the first group's."""
    finals: dict[str, list[tuple[float | None, float | None]]] = {}
    for label, metrics in runs:
        finals.setdefault(label, []).append(final_metrics(metrics))

    def spread(values: list[float | None]) -> tuple[str, float | None]:
        known = [v for v in values if v is not None]
        if not known:
            return "—", None
        mean = sum(known) / len(known)
        return f"{mean:.4f}" + (f" ({min(known):.4f}-{max(known):.4f})" if len(known) > 1 else ""), mean

    rows = [("label", "runs", f"final loss, nats/byte (last {FINAL_STEPS} steps)", "validation, bits/byte",
             f"loss / {next(iter(finals))}'s")]
    base = None
    for label, pairs in finals.items():
        loss, mean = spread([p[0] for p in pairs])
        val, _ = spread([p[1] for p in pairs])
        base = mean if base is None else base
        ratio = f"{mean / base:.4f}" if mean is not None and base else "—"
        rows.append((label, str(len(pairs)), loss, val, ratio))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def plot_run(out_dir: str | os.PathLike) -> list[Path]:
    """Write ``loss.png`` (and ``expert_load.png`` where the load was logged) into ``out_dir``; returns the paths.

    Raises:
        ConfigError: no ``metrics.csv`` with rows in ``out_dir``, or matplotlib is not installed.
    """
    Figure = _figure_class()

    out = Path(out_dir).expanduser()
    metrics = read_metrics(out)
    fig = Figure(figsize=(7, 4.5), layout="constrained")
    ax = fig.subplots()
    draw_loss(ax, metrics)
    ax.set_title(f"loss — {out.name}")
    written = [out / "loss.png"]
    fig.savefig(written[0], dpi=120)
    if has_load(metrics):
        fig = Figure(figsize=(11, 4.5), layout="constrained")
        ratio, zeros = fig.subplots(1, 2)
        draw_load(ratio, metrics)
        ratio.set_title("expert load (tokens of every rank)")
        zeros.plot(*_series(metrics, "zero_load_experts"), lw=0.8)
        zeros.set_xlabel("step")
        zeros.set_ylabel("experts without a token (sum over layers)")
        top = max([1.0, *_series(metrics, "zero_load_experts")[1]]) * 1.05
        zeros.set_ylim(bottom=-0.05 * top, top=top)  # below 0: a run that never starves an expert shows its line
        zeros.yaxis.get_major_locator().set_params(integer=True)
        zeros.grid(alpha=0.3)
        written.append(out / "expert_load.png")
        fig.savefig(written[1], dpi=120)
    return written
