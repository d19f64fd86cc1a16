"""PNG plots of ``moeblaze bench`` results (matplotlib, no display needed).

Per group of configs:

* ``speedup_<group>.png`` — bars per config: each implementation's speedup over ``conventional``
  (its time / theirs), with the 1x line;
* ``memory_<group>.png`` — bars per config: MiB saved for backward (log scale) and peak GiB;
* ``tokens_<group>.png`` — for layer shapes measured at several T (the poster sweep): time and peak
  memory against tokens, log-log, one line per implementation (the paper's figures).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from .baselines import BASELINE_IMPL
from .runner import Row

__all__ = ["plot_all", "plot_speedup", "plot_memory", "plot_tokens"]

_COLORS = {"moeblaze": "#d62728", "moeblaze-input": "#ff9896", "moeblaze-torch": "#9467bd",
           "conventional": "#7f7f7f", "hf-loop": "#bcbd22", "liger": "#1f77b4", "sonicmoe": "#2ca02c"}


def _figure(ncols: int = 1, width: float = 10.0, height: float = 4.5):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    axes = fig.subplots(1, ncols, squeeze=False)[0]
    return fig, list(axes)


def _ordered(values) -> list:
    return list(dict.fromkeys(values))


def _title(meta: dict, text: str) -> str:
    dev = meta.get("device")
    return f"{text} — {dev}" if dev else text


def _bars(ax, configs: list[str], impls: list[str], value, label: str | None = None) -> None:
    """Grouped bars: one group per config, one bar per implementation; ``label``: value format on the bars."""
    width = 0.8 / max(len(impls), 1)
    for j, impl in enumerate(impls):
        xs, ys = [], []
        for i, c in enumerate(configs):
            v = value(c, impl)
            if v is not None:
                xs.append(i + (j - (len(impls) - 1) / 2) * width)
                ys.append(v)
        bars = ax.bar(xs, ys, width, label=impl, color=_COLORS.get(impl))
        if label and len(configs) * len(impls) <= 40:
            ax.bar_label(bars, fmt=label, fontsize=6, rotation=90, padding=2)
    ax.set_xticks(range(len(configs)))
    ax.set_xticklabels(configs, rotation=30, ha="right", fontsize=8)


def plot_speedup(rows: Sequence[Row], path: Path, meta: dict | None = None) -> Path | None:
    """Bars of ``time(conventional) / time(impl)`` per config; ``None`` when nothing to compare."""
    ok = {(r.config, r.impl): r.time_ms for r in rows if r.status == "ok" and r.time_ms}
    configs = [c for c in _ordered(r.config for r in rows) if (c, BASELINE_IMPL) in ok]
    impls = [i for i in _ordered(r.impl for r in rows)
             if i != BASELINE_IMPL and any((c, i) in ok for c in configs)]
    if not configs or not impls:
        return None
    fig, (ax,) = _figure(width=max(6.0, 1.1 * len(configs) + 3))
    _bars(ax, configs, impls, lambda c, i: ok[(c, BASELINE_IMPL)] / ok[(c, i)] if (c, i) in ok else None, "%.2f")
    ax.margins(y=0.15)
    ax.axhline(1.0, color="black", lw=0.8, ls="--")
    ax.set_ylabel(f"speedup over {BASELINE_IMPL} (x)")
    ax.set_title(_title(meta or {}, "MoE layer forward+backward"))
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.savefig(path, dpi=120)
    return path


def plot_memory(rows: Sequence[Row], path: Path, meta: dict | None = None) -> Path | None:
    """Bars of MiB saved for backward (log) and peak GiB per config; ``None`` when no row has memory."""
    ok = {(r.config, r.impl): r for r in rows if r.status == "ok" and r.peak_mib is not None}
    if not ok:
        return None
    configs = [c for c in _ordered(r.config for r in rows) if any(k[0] == c for k in ok)]
    impls = [i for i in _ordered(r.impl for r in rows) if any(k[1] == i for k in ok)]
    fig, (a1, a2) = _figure(2, width=max(10.0, 2.0 * len(configs) + 4))
    saved = lambda c, i: ok[(c, i)].saved_mib if (c, i) in ok else None
    peak = lambda c, i: ok[(c, i)].peak_mib / 1024 if (c, i) in ok else None
    for ax, value, label in ((a1, saved, "MiB saved for backward"), (a2, peak, "peak GiB (one step)")):
        _bars(ax, configs, impls, value)
        ax.set_ylabel(label)
        vals = [v for c in configs for i in impls if (v := value(c, i))]
        if vals and max(vals) > 20 * min(vals):  # a token sweep spans orders of magnitude
            ax.set_yscale("log")
    a2.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.suptitle(_title(meta or {}, "MoE layer memory"))
    fig.savefig(path, dpi=120)
    return path


def plot_tokens(rows: Sequence[Row], path: Path, meta: dict | None = None) -> Path | None:
    """Time and peak memory against T for every layer shape measured at >= 2 token counts; ``None`` if none."""
    shapes: dict[tuple, list[Row]] = {}
    for r in rows:
        if r.status == "ok" and r.time_ms:
            shapes.setdefault((r.d, r.h, r.E, r.K, r.activation), []).append(r)
    shapes = {k: v for k, v in shapes.items() if len({r.T for r in v}) >= 2}
    if not shapes:
        return None
    fig, (a1, a2) = _figure(2, width=11)
    for (d, h, E, K, act), rs in shapes.items():
        tag = f" (d{d} h{h} E{E} K{K} {act})" if len(shapes) > 1 else ""
        for impl in _ordered(r.impl for r in rs):
            pts = sorted((r.T, r.time_ms, r.peak_mib) for r in rs if r.impl == impl)
            kw = {"marker": "o", "label": impl + tag, "color": _COLORS.get(impl)}
            a1.plot([p[0] for p in pts], [p[1] for p in pts], **kw)
            mem = [(p[0], p[2] / 1024) for p in pts if p[2] is not None]
            if mem:
                a2.plot([m[0] for m in mem], [m[1] for m in mem], **kw)
    for ax, label in ((a1, "time per step (ms)"), (a2, "peak GiB")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens T")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
    a1.legend(fontsize=8)
    d, h, E, K, act = next(iter(shapes))
    fig.suptitle(_title(meta or {}, f"token sweep, d {d} h {h} E {E} K {K} {act}" if len(shapes) == 1
                        else "token sweep"))
    fig.savefig(path, dpi=120)
    return path


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text) or "all"


def plot_all(rows: Sequence[Row], out_dir: str | Path, meta: dict | None = None) -> list[Path]:
    """Draw every plot of the module docstring into ``out_dir``; returns the PNG paths written."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for group in _ordered(r.group for r in rows):
        g = [r for r in rows if r.group == group]
        for name, fn in (("speedup", plot_speedup), ("memory", plot_memory), ("tokens", plot_tokens)):
            p = fn(g, out_dir / f"{name}_{_slug(group)}.png", meta)
            if p is not None:
                written.append(p)
    return written
