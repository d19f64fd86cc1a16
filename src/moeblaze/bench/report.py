"""Results of ``moeblaze bench`` as CSV, markdown and a terminal table, with the run's environment.

Files written into the results folder: ``results.csv`` (one row per config x implementation, the fields
of :class:`moeblaze.bench.runner.Row`), ``meta.json`` (device, date, versions, command), ``results.md``
(a header with the environment and the exact command, per-group tables of time/TFLOP/s and memory, the
plots, notes on every skipped row, and all rows) and, when run, ``dispatch.csv`` / ``train.csv``.
"""

from __future__ import annotations

import csv
import datetime as _dt
import importlib.metadata
import json
import os
import platform
import shlex
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

import moeblaze

from .baselines import BASELINE_IMPL, IMPLS
from .runner import Row

__all__ = ["environment", "write_csv", "read_csv", "read_dicts", "write_dicts", "markdown", "terminal_row",
           "TERMINAL_HEADER", "speedup_impl", "dict_table", "write_meta", "read_meta", "write_outputs"]

_NUMERIC = {"T": int, "d": int, "h": int, "E": int, "K": int, "reps": int, "time_ms": float, "tflops": float,
            "saved_mib": float, "peak_mib": float, "step_mib": float, "warmup_s": float}


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Where and how the run happened: date (UTC), device, versions, peers, the exact command, env switches."""
    argv = sys.argv[1:] if argv is None else argv
    cuda = torch.cuda.is_available()
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    peers = {d: v for d in ("liger_kernel", "sonic-moe", "quack-kernels", "nvidia-cutlass-dsl")
             if (v := _version(d))}
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "moeblaze " + shlex.join(list(argv)),
        "device": torch.cuda.get_device_name() if cuda else f"CPU ({platform.processor() or platform.machine()})",
        "gpu_memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1) if cuda else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton_version,
        "python": platform.python_version(),
        "moeblaze": _version("moeblaze") or moeblaze.__version__,
        "peers": peers,
        "env": {k: v for k, v in os.environ.items()
                if k.startswith(("MOEBLAZE_", "LIGER_FUSED_MOE_")) or k in ("TRITON_INTERPRET",)},
    }


def write_dicts(path: Path, rows: Iterable[dict], fieldnames: list[str]) -> Path:
    """Write dict rows to a CSV file (``None`` as empty); returns ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fieldnames)
        writer.writeheader()
        for r in rows:
            writer.writerow({k: ("" if r.get(k) is None else r[k]) for k in fieldnames})
    return path


def append_dicts(path: str | Path, rows: Sequence[dict]) -> Path:
    """Append dict rows (the first row's keys as the columns) to the CSV file ``path``, the header first when the
    file is absent or empty (the benchmark scripts' ``--out``); returns ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        if f.tell() == 0:
            writer.writeheader()
        writer.writerows(rows)
    return path


def read_dicts(path: Path) -> list[dict[str, str]]:
    """Rows of a CSV file as dicts of strings."""
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def write_csv(rows: Iterable[Row], path: Path) -> Path:
    """Write layer rows to ``path`` (columns: the fields of :class:`Row`)."""
    return write_dicts(path, (r.as_dict() for r in rows), Row.field_names())


def read_csv(path: str | Path) -> list[Row]:
    """Read rows written by :func:`write_csv` (empty cells become ``None``).

    Raises:
        FileNotFoundError: no such file. ValueError: a CSV without the columns of :class:`Row`.
    """
    path = Path(path)
    dicts = read_dicts(path)
    missing = {"config", "impl", "status", "time_ms"} - set(dicts[0] if dicts else {})
    if dicts and missing:
        raise ValueError(f"{path} is not a `moeblaze bench` results CSV (missing columns {sorted(missing)})")
    rows = []
    for d in dicts:
        kw: dict[str, Any] = {}
        for name in Row.field_names():
            v = d.get(name, "")
            kw[name] = (_NUMERIC[name](float(v)) if v != "" else (0 if name == "reps" else None)) \
                if name in _NUMERIC else v
        rows.append(Row(**kw))
    return rows


def _fmt(v: float | None, digits: int = 1) -> str:
    """A number for a table: ``—`` for None; ``digits=0`` gets more digits for small values (MiB)."""
    if v is None:
        return "—"
    if digits == 0 and abs(v) < 100:
        digits = 2 if abs(v) < 10 else 1
    return f"{v:,.{digits}f}" if abs(v) < 1e4 else f"{v:,.0f}"


TERMINAL_HEADER = (f"{'config':<30} {'impl':<15} {'status':<11} {'ms':>9} {'TFLOP/s':>8} {'saved MiB':>10} "
                   f"{'peak MiB':>10}  note")


def terminal_row(r: Row) -> str:
    """One fixed-width line for the terminal (see :data:`TERMINAL_HEADER`)."""
    return (f"{r.config:<30} {r.impl:<15} {r.status:<11} {_fmt(r.time_ms, 2):>9} {_fmt(r.tflops):>8} "
            f"{_fmt(r.saved_mib, 0):>10} {_fmt(r.peak_mib, 0):>10}  {r.note}")


def _ordered(values: Iterable[str]) -> list[str]:
    seen: dict[str, None] = {}
    for v in values:
        seen.setdefault(v, None)
    return list(seen)


def speedup_impl(rows: Sequence[Row]) -> str | None:
    """The moeblaze row the speedup columns compare: ``moeblaze`` if it has times, else ``moeblaze-torch``."""
    for name in ("moeblaze", "moeblaze-torch"):
        if any(r.impl == name and r.time_ms for r in rows):
            return name
    return None


def _cell(r: Row | None, kind: str) -> str:
    if r is None:
        return ""
    if r.status != "ok":
        return {"unsupported": "n/a", "unavailable": "—"}.get(r.status, r.status)
    if kind == "time":
        return f"{r.time_ms:.2f} ms · {r.tflops:.0f} TF/s"
    return f"{_fmt(r.saved_mib, 0)} / {_fmt(r.peak_mib, 0)}"


def _group_table(rows: list[Row], impls: list[str], kind: str) -> list[str]:
    by = {(r.config, r.impl): r for r in rows}
    configs = _ordered(r.config for r in rows)
    ours = speedup_impl(rows)
    timed = {i for (c, i), r in by.items() if r.time_ms}
    extra = [f"{ours} vs {o}" for o in (BASELINE_IMPL, "sonicmoe")
             if kind == "time" and ours and o in timed and o != ours]
    head = ["config", "T", "d", "h", "E", "K", "act", *impls, *extra]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in configs:
        first = next(r for r in rows if r.config == c)
        cells = [c, str(first.T), str(first.d), str(first.h), str(first.E), str(first.K), first.activation]
        cells += [_cell(by.get((c, i)), kind) for i in impls]
        for o in (BASELINE_IMPL, "sonicmoe"):
            if f"{ours} vs {o}" in extra:
                a, b = by.get((c, ours)), by.get((c, o))
                ok = a and b and a.time_ms and b.time_ms
                cells.append(f"{b.time_ms / a.time_ms:.2f}x" if ok else "")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _header(meta: dict[str, Any], dtype: str | None) -> list[str]:
    peers = ", ".join(f"{k} {v}" for k, v in meta.get("peers", {}).items()) or "none importable"
    env = ", ".join(f"{k}={v}" for k, v in meta.get("env", {}).items()) or "—"
    return [
        "| | |", "|---|---|",
        f"| command | `{meta.get('command', '')}` |",
        f"| date | {meta.get('date', '')} |",
        f"| device | {meta.get('device', '')}"
        + (f" ({meta['gpu_memory_gib']} GiB)" if meta.get("gpu_memory_gib") else "") + " |",
        f"| torch / CUDA / triton | {meta.get('torch')} / {meta.get('cuda')} / {meta.get('triton')} |",
        f"| moeblaze | {meta.get('moeblaze')} |",
        f"| peers | {peers} |",
        f"| dtype | {dtype or meta.get('dtype', '')} |",
        f"| settings | {meta.get('settings', '')} |",
        f"| env | {env} |",
    ]


_METHOD = ("Forward+backward of one MoE layer, router included, median of the timed steps after warm-up "
           "(autotuning / compilation excluded), L2 flushed before each step, CUDA events. "
           "TFLOP/s = 18·N·d·h (gated) or 12·N·d·h (non-gated) per step, N = T·K, router not counted. "
           "Memory in MiB (2^20 B): *saved* = bytes kept for backward (saved-tensor hooks, unique storages, "
           "the input x and the weights not counted); *peak* = `torch.cuda.max_memory_allocated` during one "
           "step (weights, their gradients, x and dout included). n/a = not supported by that library, "
           "— = not importable here.")


def markdown(rows: Sequence[Row], meta: dict[str, Any], plots: Sequence[Path] = (), extra: Sequence[str] = (),
             image_prefix: str = "") -> str:
    """The results as markdown: header (environment, command), method, per-group tables, plots, notes, all rows.

    ``extra``: further sections (already markdown), e.g. the dispatch and train tables. ``image_prefix``:
    prepended to the PNG file names in image links (e.g. ``benchmarks/`` when the markdown moves up a folder).
    """
    dtype = rows[0].dtype if rows else None
    out = ["# moeblaze bench", "", *_header(meta, dtype), "", _METHOD, ""]
    impls = _ordered(r.impl for r in rows)
    for group in _ordered(r.group for r in rows):
        g = [r for r in rows if r.group == group]
        gi = [i for i in impls if any(r.impl == i for r in g)]
        out += [f"## {group}: time per step and TFLOP/s", "", *_group_table(g, gi, "time"), ""]
        out += [f"## {group}: MiB saved for backward / peak MiB", "", *_group_table(g, gi, "memory"), ""]
    if plots:
        out += ["## Plots", ""] + [f"![{p.stem}]({image_prefix}{p.name})" for p in plots] + [""]
    out += list(extra)
    notes = _notes(rows)
    if notes:
        out += ["## Notes", "", *notes, ""]
    out += ["## Implementations", ""] + [f"- **{i}**: {IMPLS[i].description}" for i in impls if i in IMPLS] + [""]
    out += ["## All rows", "", "| config | impl | status | ms | TFLOP/s | saved MiB | peak MiB | step MiB | reps |"
            " warm-up s |", "|" + "---|" * 10]
    for r in rows:
        out.append(f"| {r.config} | {r.impl} | {r.status} | {_fmt(r.time_ms, 2)} | {_fmt(r.tflops)} | "
                   f"{_fmt(r.saved_mib, 0)} | {_fmt(r.peak_mib, 0)} | {_fmt(r.step_mib, 0)} | {r.reps} | "
                   f"{_fmt(r.warmup_s, 1)} |")
    return "\n".join(out) + "\n"


def _notes(rows: Sequence[Row]) -> list[str]:
    """One line per (status, note): which implementations, on which configs."""
    groups: dict[tuple[str, str], tuple[dict, dict]] = {}
    for r in rows:
        if r.status != "ok" or r.note:
            impls, configs = groups.setdefault((r.status, r.note), ({}, {}))
            impls[r.impl], configs[r.config] = None, None
    lines = []
    for (status, note), (impls, configs) in groups.items():
        where = ", ".join(configs) if len(configs) <= 6 else f"{len(configs)} configs"
        lines.append(f"- {status}: {note} — {', '.join(impls)} on {where}")
    return lines


def dict_table(title: str, rows: Sequence[dict], columns: Sequence[str], note: str = "") -> list[str]:
    """A markdown section: ``## title``, an optional note, a table of ``columns`` from dict rows."""
    lines = [f"## {title}", ""] + ([note, ""] if note else [])
    lines += ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join(_num(r.get(c)) for c in columns) + " |")
    return lines + [""]


def _num(v: Any) -> str:
    """A table cell: ints as they are, floats to 3-4 significant digits; numeric strings (from a CSV) too."""
    if isinstance(v, str):
        for cast in (int, float):
            try:
                v = cast(v)
                break
            except ValueError:
                continue
    if v is None or v == "":
        return ""
    if isinstance(v, float):
        return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.2f}" if abs(v) >= 1 else f"{v:.3g}"
    return str(v)


def write_meta(meta: dict[str, Any], out_dir: Path) -> Path:
    """Write ``meta.json`` into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "meta.json"
    path.write_text(json.dumps(meta, indent=2) + "\n")
    return path


def read_meta(out_dir: Path) -> dict[str, Any]:
    """``meta.json`` of a results folder, or ``{}``."""
    path = out_dir / "meta.json"
    return json.loads(path.read_text()) if path.exists() else {}


DISPATCH_NOTE = "Build of the index of DESIGN.md §3 from uniform random top-K ids; median of 50 builds."
TRAIN_NOTE = ("MoETransformer (the `moeblaze train` model) at a GPU-sized config, bf16 weights, fused AdamW, random "
              "bytes; tokens/s of whole optimizer steps; MFU = model FLOPs per token x tokens/s over the data-sheet "
              "dense bf16 peak of the device.")


def write_outputs(out_dir: Path, rows: Sequence[Row], meta: dict[str, Any], dispatch_rows: Sequence[dict] = (),
                  train_rows: Sequence[dict] = (), image_prefix: str = "") -> tuple[Path, list[Path]]:
    """Plots and ``results.md`` (with dispatch / train sections when given) into ``out_dir``.

    Returns ``(markdown path, plot paths)``.
    """
    from .micro import DISPATCH_COLUMNS, TRAIN_COLUMNS
    from .plots import plot_all  # imports matplotlib lazily, inside the plot functions

    extra: list[str] = []
    if dispatch_rows:
        extra += dict_table("Dispatch index build (ms)", dispatch_rows, DISPATCH_COLUMNS, DISPATCH_NOTE)
    if train_rows:
        extra += dict_table("End-to-end training throughput", train_rows, TRAIN_COLUMNS, TRAIN_NOTE)
    try:
        import matplotlib  # noqa: F401
    except ImportError:  # e.g. a GPU machine without it: the figures are in the CSV, plots can follow
        plots = []
        extra += ["## Plots", "", "matplotlib is not installed where this ran: draw the plots with "
                  "`moeblaze bench --plot results.csv` on any machine that has it.", ""]
    else:
        plots = plot_all(rows, out_dir, meta)
    path = out_dir / "results.md"
    path.write_text(markdown(rows, meta, plots, extra, image_prefix))
    return path, plots
