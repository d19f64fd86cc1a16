"""Per-step training metrics of ``moeblaze train`` as CSV rows in ``<out_dir>/metrics.csv``.

One row per finished step (written by rank 0, flushed at once): the step number (1-based, as the checkpoints
count), the training loss in nats and in bits per byte, the learning rate, the step's wall seconds, the
run's tokens per second so far, and the validation bits per byte on the steps that evaluated (empty
otherwise). Plot it with any CSV reader, e.g. ``pandas.read_csv("moeblaze-out/metrics.csv")``.

Faults: a resumed run first rewrites the file (a temporary file, then ``os.replace``) keeping the complete
rows up to its checkpoint's step, so a kill between a checkpoint and the next one, or in the middle of a
row, leaves each step once. A file that cannot be written (a full disk, a read-only folder) is named once
through the run's log and the run trains on without it: the metrics never cost a step.
"""

from __future__ import annotations

import contextlib
import csv
import io
import math
import os
from pathlib import Path

COLUMNS = ("step", "loss", "bits_per_byte", "lr", "step_s", "tokens_per_s", "val_bpb")
FILE_NAME = "metrics.csv"


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _complete_rows(path: Path, up_to: int) -> list[dict[str, str]]:
    """Rows of an earlier file with exactly the columns of ``COLUMNS`` and ``step <= up_to`` (a cut last row,
    a damaged or foreign row is dropped).

    Raises:
        OSError: the file exists but cannot be read.
    """
    try:
        text = path.read_text(errors="replace")  # a damaged byte spoils its row, not the file
    except FileNotFoundError:
        return []
    if not text.endswith("\n"):  # the last row was being written when the run stopped
        text = text[: text.rfind("\n") + 1]
    rows = []
    for row in csv.DictReader(io.StringIO(text)):
        if tuple(row) != COLUMNS or None in row.values():  # too many fields (key None) or too few
            continue
        numbers = all(_is_number(v) for v in row.values() if v)  # a damaged byte fails its number
        if numbers and row["step"].isdigit() and int(row["step"]) <= up_to:
            rows.append(row)
    return rows


class MetricsLog:
    """``<out_dir>/metrics.csv`` of one run (module docstring).

    Args:
        out_dir: the run's folder (exists: ``moeblaze train`` has checked it is writable).
        resume_step: the step of the checkpoint a resumed run starts from (rows after it are dropped), or
            None for a fresh run (the file starts empty).
        log: where the one warning of a failed write goes.
        enabled: False on ranks other than 0 (nothing is written).
    """

    def __init__(self, out_dir: str | os.PathLike, resume_step: int | None, log, enabled: bool = True) -> None:
        self.path = Path(out_dir).expanduser() / FILE_NAME
        self.log, self.enabled = log, enabled
        if not enabled:
            return
        tmp = self.path.with_name(FILE_NAME + ".tmp")
        try:
            kept = _complete_rows(self.path, resume_step) if resume_step is not None else []
            with open(tmp, "w", newline="") as fh:
                writer = csv.DictWriter(fh, fieldnames=COLUMNS)
                writer.writeheader()
                writer.writerows(kept)
            os.replace(tmp, self.path)
        except OSError as err:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            self._fail(err)

    def _fail(self, err: OSError) -> None:
        self.enabled = False
        self.log(f"warning: cannot write {self.path} ({err}); training goes on without the metrics file")

    def write(self, step: int, loss: float, lr: float, step_s: float, tokens_per_s: float,
              val_bpb: float | None = None) -> None:
        """Append the row of finished step ``step`` (1-based); ``val_bpb`` when the step evaluated."""
        if not self.enabled:
            return
        row = {"step": step, "loss": f"{loss:.6f}", "bits_per_byte": f"{loss / math.log(2):.6f}", "lr": f"{lr:.6g}",
               "step_s": f"{step_s:.6f}", "tokens_per_s": f"{tokens_per_s:.1f}",
               "val_bpb": "" if val_bpb is None else f"{val_bpb:.6f}"}
        try:
            with open(self.path, "a", newline="") as fh:
                csv.DictWriter(fh, fieldnames=COLUMNS).writerow(row)
        except OSError as err:
            self._fail(err)
