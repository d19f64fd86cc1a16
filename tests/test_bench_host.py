"""``benchmarks/bench_host.py --mode cpu``: the host path of a layer step timed with stubbed launches, rows as data."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_cpu_mode_times_the_host_path_and_appends_rows(tmp_path):
    out = tmp_path / "stack.csv"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_host.py"), "--mode", "cpu", "--shapes", "olmoe-1b-7b",
           "--tokens", "16", "--stack", "1,2", "--steps", "3", "--cpu-dims", "16", "--csv", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = list(csv.DictReader(out.open()))
    assert [(r["layers"], r["status"], r["mode"]) for r in rows] == [("1", "ok", "eager"), ("2", "ok", "eager")]
    for r in rows:
        assert r["shape"] == "olmoe-1b-7b" and (r["T"], r["d"], r["E"], r["K"]) == ("16", "16", "64", "8")
        assert float(r["host_us_per_layer"]) > 0 and "launches stubbed" in r["device"]
        assert " python3 " in f" {r['command']}" and "--mode cpu" in r["command"]  # MOEBLAZE_* variables first


def test_cpu_parts_prints_the_host_cost_of_each_part():
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_host.py"), "--mode", "cpu", "--parts", "--shapes",
           "olmoe-1b-7b", "--tokens", "16", "--cpu-dims", "16"]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("olmoe-1b-7b T 16: host µs per call")
    parts = {}
    for line in lines[1:]:  # "   12.3  name" or "    nan  name: ErrorType"
        value, name = line.strip().split("  ", 1)
        parts[name.strip().split(":")[0]] = value
    for name in ("router forward + backward", "dispatch build (validate=False)", "layer forward + backward"):
        assert float(parts[name]) > 0, (name, proc.stdout)
    # bf16 GEMMs with out_dtype= are CUDA-only: reported as such, not as a crash
    assert parts["mm [T, d] x [d, E] bf16 -> fp32 (out_dtype=)"] == "nan"


def test_the_plot_takes_each_shape_s_latest_sweep(monkeypatch):
    """A run at two token counts appended after a five-point sweep does not replace the sweep in the plot; a later
    sweep does."""
    import importlib.util

    monkeypatch.setattr(sys, "argv", ["bench_host.py"])  # the script reads its arguments when loaded
    spec = importlib.util.spec_from_file_location("bench_host", ROOT / "benchmarks" / "bench_host.py")
    bench_host = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_host)

    def run(date, commit, tokens):
        return [dict(date=date, time_utc="01:00", device="H200", commit=commit, T=t) for t in tokens]

    sweep, ab = run("2026-11-25", "a", [2048, 4096, 8192, 16384, 32768]), run("2026-11-26", "b", [16384, 32768])
    assert bench_host.latest_run(sweep + ab) == sweep
    later = run("2026-11-27", "c", [2048, 4096, 8192, 16384, 32768])
    assert bench_host.latest_run(sweep + ab + later) == later
