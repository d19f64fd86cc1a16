"""The cost of ``moeblaze train --deterministic`` in tokens/s (issue 58): the same run with and without the flag,
alternated (with / without, then without / with, ...) so that a drift of the machine weighs on both alike.

Each run is a fresh process (``moeblaze train``, or ``torchrun --nproc-per-node N ... --fsdp`` with ``--nproc N``):
the autotuner of a run without the flag tunes in that process, as a user's run would. The figure is the run's own
``steady state (median step after the first)`` line; one CSV row per run (``--out``, appended): date, UTC time,
device, torch, triton, commit, the command, deterministic, tokens/s; then the medians and their ratio on stdout.

Usage (one GPU; 2 GPUs with ``--nproc 2``; flags after ``--`` go to ``moeblaze train``):

    python benchmarks/bench_deterministic.py --out docs/results-deterministic.csv --rounds 2 [--nproc 2] \\
        [-- --preset 1b --steps 40]

``--smoke``: a tiny CPU run (a check that the script works; its numbers mean nothing).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton

ROOT = Path(__file__).resolve().parents[1]
STEADY = re.compile(r"steady state \(median step after the first\): ([\d,.]+) tokens/s")
DEFAULT = ["--steps", "60", "--eval-interval", "1000", "--eval-tokens", "4096", "--checkpoint-interval", "0",
           "--checkpoint-minutes", "0", "--device", "cuda"]
SMOKE = ["--steps", "4", "--eval-interval", "1000", "--eval-tokens", "32", "--checkpoint-interval", "0",
         "--checkpoint-minutes", "0", "--device", "cpu", "--seq-len", "16", "--d-model", "16", "--n-layers", "1",
         "--n-heads", "2", "--d-ff", "8", "--batch-size", "4", "--backend", "torch", "--threads", "1"]
COLUMNS = ["date", "time_utc", "device", "torch", "triton", "commit", "command", "deterministic", "tokens_per_s"]


def _command(nproc: int, train_args: list[str], out_dir: str, deterministic: bool) -> list[str]:
    launcher = [sys.executable, "-m", "moeblaze.cli"] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "-m", "moeblaze.cli"]
    fsdp = ["--fsdp"] if nproc > 1 else []
    return [*launcher, "train", *train_args, *fsdp, "--out-dir", out_dir, "--overwrite", "--no-progress",
            *(["--deterministic"] if deterministic else [])]


def _run(cmd: list[str]) -> float:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600, env=env)
    found = STEADY.findall(proc.stdout)
    if proc.returncode != 0 or not found:
        sys.exit(f"failed ({proc.returncode}): {shlex.join(cmd)}\n{proc.stderr[-3000:]}")
    return float(found[-1].replace(",", ""))


def _commit() -> str:
    proc = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return proc.stdout.strip() or "unknown"


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="CSV file to append rows to")
    parser.add_argument("--rounds", type=int, default=2, help="pairs of runs (with and without), alternated")
    parser.add_argument("--nproc", type=int, default=1, help="GPUs (processes); > 1: torchrun ... --fsdp")
    parser.add_argument("--smoke", action="store_true", help="a tiny CPU run (checks the script)")
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    train_args = [*(SMOKE if args.smoke else DEFAULT), *extra]
    device = "cpu" if args.smoke or not torch.cuda.is_available() else torch.cuda.get_device_name()
    speeds: dict[bool, list[float]] = {False: [], True: []}
    out = Path(args.out)
    new = not out.exists()
    with tempfile.TemporaryDirectory() as tmp, open(out, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        if new:
            writer.writeheader()
        for i in range(args.rounds):
            for det in ((False, True) if i % 2 == 0 else (True, False)):
                cmd = _command(args.nproc, train_args, os.path.join(tmp, "run"), det)
                speeds[det].append(_run(cmd))
                now = datetime.datetime.now(datetime.timezone.utc)
                writer.writerow({"date": now.strftime("%Y-%m-%d"), "time_utc": now.strftime("%H:%M"),
                                 "device": device, "torch": torch.__version__, "triton": triton.__version__,
                                 "commit": _commit(), "command": shlex.join(["python", *cmd[1:]]),
                                 "deterministic": int(det), "tokens_per_s": f"{speeds[det][-1]:.0f}"})
                f.flush()
                print(f"{'deterministic' if det else 'default      '}: {speeds[det][-1]:,.0f} tokens/s", flush=True)
    plain, det = statistics.median(speeds[False]), statistics.median(speeds[True])
    print(f"{device}, {args.nproc} process(es): default {plain:,.0f} tokens/s, --deterministic {det:,.0f} tokens/s "
          f"({det / plain:.3f}x), medians of {args.rounds} runs each")


if __name__ == "__main__":
    main()
