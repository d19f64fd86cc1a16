"""Per-step training metrics of ``moeblaze train`` as CSV rows in ``<out_dir>/metrics.csv``.

One row per finished step (written by rank 0, flushed at once): the step number (1-based, as the checkpoints
count), the training loss in nats and in bits per byte, the learning rate, the step's wall seconds, the
run's tokens per second so far, the validation bits per byte on the steps that evaluated (empty
otherwise), and the step's expert load over every rank's tokens: ``load_ratio_max`` and ``load_ratio_mean``,
the largest and the mean over the MoE layers of (max tokens per expert) / (mean tokens per expert), 1.0 when
balanced, and ``zero_load_experts``, the experts that received no token, summed over the layers (three
columns whatever the depth; empty where the model counts nothing). ``moeblaze plot OUT_DIR`` draws them
(:mod:`moeblaze.training.plot`); any CSV reader works too, e.g. ``pandas.read_csv("moeblaze-out/metrics.csv")``.

Faults: a resumed run first rewrites the file (a temporary file, then ``os.replace``) keeping the complete
rows up to its checkpoint's step, so a kill between a checkpoint and the next one, or in the middle of a
row, leaves each step once. Rows of a file written before the load columns existed are kept, with those
columns empty. A file that cannot be written (a full disk, a read-only folder) is named once
through the run's log and the run trains on without it: the metrics never cost a step.

``--logger tensorboard`` / ``wandb`` sends each row's numbers (the columns but the step, as floats under the
columns' names, at the row's step) to TensorBoard (``torch.utils.tensorboard.SummaryWriter``, event files in the
run's folder: ``tensorboard --logdir moeblaze-out`` shows each run) or to Weights & Biases (``wandb.init(project=
"moeblaze")``; a resumed run continues the W&B run whose id ``wandb-run-id`` keeps). A resumed run hides the
TensorBoard events after its checkpoint's step (``purge_step``), as it drops those rows; a fresh run deletes the
folder's earlier event files, as it starts the CSV afresh. A logger that fails is named once and dropped, as the
file is.
"""

from __future__ import annotations

import contextlib
import csv
import io
import math
import os
from pathlib import Path

from .train_config import LOGGERS, ConfigError

LOSS_COLUMNS = ("step", "loss", "bits_per_byte", "lr", "step_s", "tokens_per_s", "val_bpb")
LOAD_COLUMNS = ("load_ratio_max", "load_ratio_mean", "zero_load_experts")
COLUMNS = LOSS_COLUMNS + LOAD_COLUMNS
FILE_NAME = "metrics.csv"
_WANDB_ID = "wandb-run-id"
_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}  # --logger -> the package to install


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _complete_rows(path: Path, up_to: int) -> list[dict[str, str]]:
    """Rows of an earlier file with exactly the columns of ``COLUMNS`` (or of ``LOSS_COLUMNS``, an older
    version's) and ``step <= up_to`` (a cut last row, a damaged or foreign row is dropped).

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
        if tuple(row) not in (COLUMNS, LOSS_COLUMNS) or None in row.values():  # too many fields (key None) or few
            continue
        numbers = all(_is_number(v) for v in row.values() if v)  # a damaged byte fails its number
        if numbers and row["step"].isdigit() and int(row["step"]) <= up_to:
            rows.append(row)
    return rows


def val_at(out_dir: str | os.PathLike, step: int) -> float | None:
    """The validation bits per byte that ``<out_dir>/metrics.csv`` holds for ``step``, or None (no such row, a row
    without it, or no readable file)."""
    try:
        rows = _complete_rows(Path(out_dir).expanduser() / FILE_NAME, step)
    except OSError:
        return None
    vals = [float(r["val_bpb"]) for r in rows if int(r["step"]) == step and r["val_bpb"]]
    return vals[-1] if vals else None


def check_logger(name: str) -> None:
    """``--logger name`` can run here: its library imports.

    Raises:
        ConfigError: an unknown name, or the library is not installed (one line naming the package to install).
    """
    if name not in LOGGERS:
        raise ConfigError(f"--logger must be one of {', '.join(LOGGERS)}, got {name!r}")
    if name == "none":
        return
    try:
        if name == "tensorboard":
            import torch.utils.tensorboard  # noqa: F401  (imports tensorboard, which it needs)
        else:
            import wandb  # noqa: F401
    except ImportError as err:
        raise ConfigError(f"--logger {name} needs the {_PACKAGES[name]} package, which does not import here ({err}); "
                          f"pip install {_PACKAGES[name]}, or pass --logger none") from None


def _open_logger(name: str, out: Path, resume_step: int | None, config: dict | None):
    """The TensorBoard writer or the W&B run of ``--logger name`` (module docstring), or None for ``none``."""
    if name == "tensorboard":
        from torch.utils.tensorboard import SummaryWriter

        if resume_step is None:
            for old in out.glob("events.out.tfevents.*"):
                old.unlink()
        return SummaryWriter(log_dir=str(out), purge_step=None if resume_step is None else resume_step + 1)
    if name == "wandb":
        import wandb

        id_file = out / _WANDB_ID
        run_id = id_file.read_text().strip() if resume_step is not None and id_file.is_file() else None
        run = wandb.init(project="moeblaze", name=out.name, dir=str(out), config=config, id=run_id,
                         resume="allow" if run_id else None)
        id_file.write_text(run.id)
        return run
    return None


class MetricsLog:
    """``<out_dir>/metrics.csv`` of one run (module docstring).

    Args:
        out_dir: the run's folder (exists: ``moeblaze train`` has checked it is writable).
        resume_step: the step of the checkpoint a resumed run starts from (rows after it are dropped), or
            None for a fresh run (the file starts empty).
        log: where the one warning of a failed write goes.
        enabled: False on ranks other than 0 (nothing is written).
        logger: ``--logger`` (``none``, ``tensorboard``, ``wandb``: module docstring); :func:`check_logger` first.
        config: the run's configuration, for W&B.
    """

    def __init__(self, out_dir: str | os.PathLike, resume_step: int | None, log, enabled: bool = True,
                 logger: str = "none", config: dict | None = None) -> None:
        self.path = Path(out_dir).expanduser() / FILE_NAME
        self.log, self.enabled, self.logger = log, enabled, None
        if not enabled:
            return
        try:
            self.logger = _open_logger(logger, self.path.parent, resume_step, config)
        except Exception as err:  # the logger's own errors (a W&B login, a full disk): a run without it
            self.log(f"warning: --logger {logger} failed to start ({type(err).__name__}: {err}); training goes on "
                     "without it")
        tmp = self.path.with_name(FILE_NAME + ".tmp")
        try:
            kept = _complete_rows(self.path, resume_step) if resume_step is not None else []
            with open(tmp, "w", newline="") as fh:
                writer = csv.DictWriter(fh, fieldnames=COLUMNS, restval="")  # an older file's rows: load empty
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
              val_bpb: float | None = None, load: tuple[float, float, int] | None = None) -> None:
        """Append the row of finished step ``step`` (1-based); ``val_bpb`` when the step evaluated; ``load``:
        ``(load_ratio_max, load_ratio_mean, zero_load_experts)`` (:func:`moeblaze.balance.load_summary`); and send
        its numbers to the logger."""
        if self.logger is not None:
            values = {"loss": loss, "bits_per_byte": loss / math.log(2), "lr": lr, "step_s": step_s,
                      "tokens_per_s": tokens_per_s, **({"val_bpb": val_bpb} if val_bpb is not None else {}),
                      **dict(zip(LOAD_COLUMNS, load or ()))}
            self._send(step, values)
        if not self.enabled:
            return
        row = {"step": step, "loss": f"{loss:.6f}", "bits_per_byte": f"{loss / math.log(2):.6f}", "lr": f"{lr:.6g}",
               "step_s": f"{step_s:.6f}", "tokens_per_s": f"{tokens_per_s:.1f}",
               "val_bpb": "" if val_bpb is None else f"{val_bpb:.6f}"}
        if load is not None:
            row |= {"load_ratio_max": f"{load[0]:.4f}", "load_ratio_mean": f"{load[1]:.4f}",
                    "zero_load_experts": str(int(load[2]))}
        try:
            with open(self.path, "a", newline="") as fh:
                csv.DictWriter(fh, fieldnames=COLUMNS, restval="").writerow(row)
        except OSError as err:
            self._fail(err)

    def _send(self, step: int, values: dict[str, float]) -> None:
        try:
            if hasattr(self.logger, "add_scalar"):  # TensorBoard's SummaryWriter
                for name, value in values.items():
                    self.logger.add_scalar(name, float(value), step)
            else:  # a W&B run
                self.logger.log({k: float(v) for k, v in values.items()}, step=step)
        except Exception as err:  # as the file: a failing logger never costs a step
            self.log(f"warning: --logger stopped at step {step} ({type(err).__name__}: {err}); training goes on "
                     "without it")
            self.logger = None

    def close(self) -> None:
        """Flush and close the logger (the CSV is flushed row by row)."""
        logger, self.logger = self.logger, None
        if logger is None:
            return
        try:
            if hasattr(logger, "add_scalar"):
                logger.close()
            else:
                logger.finish()
        except Exception as err:
            self.log(f"warning: closing --logger failed ({type(err).__name__}: {err})")
