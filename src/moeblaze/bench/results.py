"""The results file: every ``moeblaze bench`` measurement kept as data, and the README table and plots made from it.

``docs/results.csv`` holds one row per (run, config, implementation): where and when it was measured
(:data:`CALL_COLUMNS`: UTC day and time of the run, device, the commit of the code measured, torch and
triton versions, the exact command) followed by the fields of :class:`moeblaze.bench.runner.Row`.

* ``moeblaze bench ... --append-results docs/results.csv`` appends the rows of that run
  (:func:`append_results`);
* ``moeblaze bench --report docs/results.csv`` rewrites the README's performance table between the
  :data:`TABLE_START` / :data:`TABLE_END` markers and draws ``docs/plots/*.png`` (:func:`make_report`).

The table shows, per config of :data:`README_CONFIGS`, the rows of one run — among the runs that measured SonicMoE
(the headline peer) if any did, the latest of those that measured the most of moeblaze, the conventional layer,
SonicMoE and Liger-Kernel — so every ratio in it is a same-run ratio.
"""

from __future__ import annotations

import csv
import subprocess
from collections.abc import Sequence
from dataclasses import astuple, dataclass
from pathlib import Path
from typing import Any

from .configs import LAYER_SUITES
from .report import read_csv, write_dicts
from .runner import Row

__all__ = ["CALL_COLUMNS", "RESULT_COLUMNS", "README_CONFIGS", "TABLE_START", "TABLE_END", "Call",
           "call_of", "git_commit", "append_results", "read_results", "pick_rows", "readme_table",
           "rewrite_readme", "draw_plots", "make_report"]

CALL_COLUMNS = ["date", "time_utc", "device", "commit", "torch", "triton", "command"]
RESULT_COLUMNS = CALL_COLUMNS + Row.field_names()
README_CONFIGS = tuple(LAYER_SUITES["readme"])  # `moeblaze bench --suite readme`
TABLE_IMPLS = ("moeblaze", "conventional", "sonicmoe", "liger")
_NAMES = {"moeblaze": "moeblaze", "conventional": "conventional", "sonicmoe": "SonicMoE", "liger": "Liger"}
TABLE_START = "<!-- results-table:start (made by `moeblaze bench --report docs/results.csv`; do not edit) -->"
TABLE_END = "<!-- results-table:end -->"
_TITLES = {"sonicmoe-7b": "SonicMoE-7B", "olmoe-1b-7b": "OLMoE", "qwen3-30b-a3b": "Qwen3-30B-A3B",
           "conf3-swiglu": "paper conf3", "conf4-swiglu": "paper conf4", "conf7-swiglu": "paper conf7",
           "sweep-2m": "poster scale"}


@dataclass(frozen=True, order=True)
class Call:
    """One ``moeblaze bench`` invocation: the columns :data:`CALL_COLUMNS` (ordered by date, then time)."""

    date: str  # UTC day, YYYY-MM-DD
    time_utc: str  # HH:MM, when the run started
    device: str
    commit: str  # short hash of the code measured, "" where unknown
    torch: str
    triton: str
    command: str

    def as_dict(self) -> dict[str, str]:
        return dict(zip(CALL_COLUMNS, astuple(self)))


def call_of(meta: dict[str, Any], commit: str) -> Call:
    """The :class:`Call` of a run from its ``meta.json`` fields (:func:`moeblaze.bench.report.environment`).

    Args:
        meta: ``date`` as ``"YYYY-MM-DD HH:MM UTC"``, ``device``, ``torch``, ``triton``, ``command``.
        commit: the code's commit ("" where unknown).
    """
    day, _, clock = str(meta.get("date", "")).partition(" ")
    return Call(day, clock.removesuffix(" UTC"), str(meta.get("device", "")), commit, str(meta.get("torch") or ""),
                str(meta.get("triton") or ""), str(meta.get("command", "")))


def git_commit(where: str | Path | None = None) -> str:
    """Short hash of ``HEAD`` of the git checkout holding ``where`` (default: this package), with ``+dirty``
    when tracked files differ from it; ``""`` outside a checkout or without git."""
    cwd = Path(where) if where is not None else Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=cwd, capture_output=True, text=True,
                              timeout=10)
        if head.returncode != 0:
            return ""
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""
    return head.stdout.strip() + ("+dirty" if dirty else "")


def append_results(path: str | Path, rows: Sequence[Row], call: Call) -> Path:
    """Append ``rows`` of one run to the results file ``path`` (created with its header if absent).

    Raises:
        ValueError: ``path`` exists and its header is not :data:`RESULT_COLUMNS`.
    """
    path = Path(path)
    if not path.exists() or path.stat().st_size == 0:
        return write_dicts(path, [{**call.as_dict(), **r.as_dict()} for r in rows], RESULT_COLUMNS)
    with open(path, newline="") as f:
        header = next(csv.reader(f), [])
    if header != RESULT_COLUMNS:
        raise ValueError(f"{path}: not a results file of this version (columns {header[:8]}..., expected "
                         f"{RESULT_COLUMNS[:8]}...)")
    with open(path, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=RESULT_COLUMNS)
        for r in rows:
            writer.writerow({k: "" if v is None else v for k, v in {**call.as_dict(), **r.as_dict()}.items()})
    return path


def read_results(path: str | Path) -> list[tuple[Call, Row]]:
    """Every row of a results file with its run (:class:`Call`).

    Raises:
        FileNotFoundError: no such file. ValueError: a CSV without the columns :data:`RESULT_COLUMNS`.
    """
    path = Path(path)
    with open(path, newline="") as f:
        dicts = list(csv.DictReader(f))
    missing = [c for c in CALL_COLUMNS if dicts and c not in dicts[0]]
    if missing:
        raise ValueError(f"{path} is not a results file (missing columns {missing}); "
                         "`moeblaze bench --append-results` writes one")
    rows = read_csv(path)
    return [(Call(*(d[c] for c in CALL_COLUMNS)), r) for d, r in zip(dicts, rows)]


def _ok(row: Row | None) -> bool:
    return row is not None and row.status == "ok" and row.time_ms is not None


def _measured(rows: dict[str, Row]) -> int:
    """How many of :data:`TABLE_IMPLS` a run measured (status ok) for one config."""
    return sum(_ok(rows.get(i)) for i in TABLE_IMPLS)


def pick_rows(results: Sequence[tuple[Call, Row]], configs: Sequence[str] = README_CONFIGS,
              device: str | None = None) -> list[tuple[str, Call, dict[str, Row]]]:
    """Per config, the rows of one run: a run that measured SonicMoE (status ok) before one that did not, then the
    one with the most of :data:`TABLE_IMPLS` measured, then the latest; configs that no run measured with moeblaze
    are left out (a later run of fewer implementations leaves the table on the fuller one).

    Args:
        results: :func:`read_results`. configs: config names, in table order.
        device: keep only this device's runs (default: the device of the latest run among those that
            measured the most implementations of one config: a later run of moeblaze alone on another device
            does not take the table over).

    Returns:
        ``[(config, call, {impl: Row})]``.
    """
    if not results:
        return []
    by_call: dict[tuple[str, Call], dict[str, Row]] = {}
    for call, row in results:
        by_call.setdefault((row.config, call), {})[row.impl] = row
    if device is None:
        device = max((_measured(rows), call) for (_, call), rows in by_call.items())[1].device
    by_call = {key: rows for key, rows in by_call.items() if key[1].device == device}
    picked = []
    for cfg in configs:
        cands = [(_ok(rows.get("sonicmoe")), _measured(rows), call, rows)
                 for (name, call), rows in by_call.items() if name == cfg and _ok(rows.get("moeblaze"))]
        if cands:
            *_, call, rows = max(cands, key=lambda t: t[:3])
            picked.append((cfg, call, rows))
    return picked


def _time(r: Row | None) -> str:
    return f"{r.time_ms:.2f} ms · {r.tflops:.0f} TF/s" if _ok(r) else "—"


def _peak(r: Row | None) -> str:
    return f"{r.peak_mib:,.0f}" if _ok(r) and r.peak_mib is not None else "—"


def _ratio(ours: Row, other: Row | None) -> str:
    """How many times faster ``ours`` ran than ``other`` (same run)."""
    return f"{other.time_ms / ours.time_ms:.2f}x" if _ok(other) else "—"


def readme_table(picked: Sequence[tuple[str, Call, dict[str, Row]]]) -> str:
    """The README's performance table (markdown) of :func:`pick_rows`, with a numbered list of the runs
    (date, device, commit, command) that measured its rows. Liger's columns appear once a picked run has it."""
    runs: list[Call] = []
    impls = [i for i in TABLE_IMPLS if i != "liger" or any(_ok(rows.get(i)) for *_, rows in picked)]
    peers = [impls[2], impls[1], *impls[3:]]  # SonicMoE's ratio first: the headline peer
    names = [_NAMES[i] for i in impls]
    lines = [f"| config (T, d, h, E, K) | {' | '.join(names)} | "
             + " | ".join(f"speed vs {_NAMES[i]}" for i in peers) + f" | peak MiB: {' / '.join(names)} | run |",
             "|---" * (2 * len(impls) + 2) + "|"]
    for cfg, call, rows in picked:
        if call not in runs:
            runs.append(call)
        m = rows["moeblaze"]
        cells = [_time(rows.get(i)) for i in impls] + [_ratio(m, rows.get(i)) for i in peers]
        lines.append(f"| {_TITLES.get(cfg, cfg)} ({m.T}, {m.d}, {m.h}, {m.E}, {m.K}) | {' | '.join(cells)} | "
                     f"{' / '.join(_peak(rows.get(i)) for i in impls)} | {runs.index(call) + 1} |")
    lines.append("")
    for n, call in enumerate(runs, 1):
        soft = f"torch {call.torch}, triton {call.triton}" if call.torch else "versions not recorded"
        commit = f"commit {call.commit}" if call.commit else "commit not recorded"
        lines.append(f"{n}. {call.date}, {call.device} ({soft}; {commit}): `{call.command}`")
    return "\n".join(lines)


def rewrite_readme(path: str | Path, table: str) -> Path:
    """Replace what lies between :data:`TABLE_START` and :data:`TABLE_END` in ``path`` by ``table``.

    Raises:
        ValueError: the file lacks one of the two marker lines (or has them in the wrong order).
    """
    path = Path(path)
    text = path.read_text()
    start, end = text.find(TABLE_START), text.find(TABLE_END)
    if start < 0 or end < start:
        raise ValueError(f"{path}: no `{TABLE_START}` ... `{TABLE_END}` marker lines to put the table between")
    path.write_text(text[:start + len(TABLE_START)] + "\n" + table + "\n" + text[end:])
    return path


def draw_plots(results: Sequence[tuple[Call, Row]], picked: Sequence[tuple[str, Call, dict[str, Row]]],
               out_dir: str | Path) -> list[Path]:
    """PNGs into ``out_dir``: ``speedup.png`` and ``memory.png`` of the table's rows, ``tokens.png`` (time and
    peak memory against T) of the latest run of that device that measured one shape at >= 2 token counts.

    Raises:
        ImportError: matplotlib is not installed.
    """
    import matplotlib  # noqa: F401  (the plot functions import it lazily; fail here with its own message)

    from .plots import plot_memory, plot_speedup, plot_tokens

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = [r for _, _, rs in picked for i in TABLE_IMPLS if (r := rs.get(i)) is not None]
    device = picked[0][1].device if picked else ""
    meta = {"device": f"{device}, {max(c.date for _, c, _ in picked)}" if picked else ""}
    written = [p for name, fn in (("speedup", plot_speedup), ("memory", plot_memory))
               if (p := fn(rows, out_dir / f"{name}.png", meta)) is not None]
    runs = sorted({c for c, _ in results if c.device == device}, reverse=True)
    for call in runs:
        sweep = [r for c, r in results if c == call and r.status == "ok" and r.group == "sweep"]
        if len({r.T for r in sweep}) >= 2:
            p = plot_tokens(sweep, out_dir / "tokens.png", {"device": f"{call.device}, {call.date}"})
            written += [p] if p is not None else []
            break
    return written


def make_report(results_csv: str | Path, readme: str | Path | None, plots_dir: str | Path | None,
                configs: Sequence[str] = README_CONFIGS) -> tuple[str, list[Path]]:
    """``moeblaze bench --report``: the table of :func:`readme_table` (written into ``readme`` when given) and
    the plots of :func:`draw_plots` (into ``plots_dir`` when given). Returns ``(table, plot paths)``.

    Raises:
        FileNotFoundError, ValueError: see :func:`read_results` and :func:`rewrite_readme`; ValueError also
        when no row of ``configs`` was measured with moeblaze.
    """
    results = read_results(results_csv)
    picked = pick_rows(results, configs)
    if not picked:
        raise ValueError(f"{results_csv}: no moeblaze row for any of {list(configs)}")
    table = readme_table(picked)
    if readme is not None:
        rewrite_readme(readme, table)
    plots = draw_plots(results, picked, plots_dir) if plots_dir is not None else []
    return table, plots
