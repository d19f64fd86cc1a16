"""Numbered run folders, as Lightning's ``version_N``: ``moeblaze train`` without ``--out-dir`` writes each run into
a new ``moeblaze-out/run_N`` (the number after the highest one there, ``run_0`` first), so the same command can be
run again without touching an earlier run; ``moeblaze train --resume`` without ``--out-dir``, and ``moeblaze
sample``, ``export`` and ``plot`` by default, take the newest run. A folder of numbered runs given to those commands
stands for its newest run too. An explicit ``moeblaze train --out-dir`` is used as it is
(:mod:`moeblaze.training.resume` refuses one that holds a checkpoint unless ``--resume`` or ``--overwrite``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path

from .checkpoint_manifest import checkpoint_dirs
from .metrics_log import FILE_NAME as METRICS_FILE
from .train_config import ConfigError

__all__ = ["ROOT", "holds_checkpoint", "holds_metrics", "new_run_dir", "newest_run", "resolve_run", "run_numbers"]

ROOT = "moeblaze-out"  # TrainConfig.out_dir's default
_RUN = re.compile(r"run_(\d+)")


def run_numbers(root: str | os.PathLike) -> list[int]:
    """The numbers N of the ``run_N`` folders in ``root``, ascending (none when ``root`` does not exist)."""
    root = Path(root).expanduser()
    if not root.is_dir():
        return []
    return sorted(int(m.group(1)) for p in root.iterdir() if (m := _RUN.fullmatch(p.name)) and p.is_dir())


def new_run_dir(root: str | os.PathLike = ROOT, claim: bool = True) -> Path:
    """``root/run_N``, N one above the highest number in ``root`` (``run_0`` in a new or empty root).

    Args:
        claim: create the folder (``mkdir``, which fails when another process took the number first: then the next
            one is taken), so two runs started at once never share one. False for the ranks of one job, which must
            all name the same folder: each lists ``root`` before any rank creates it (the ranks' configurations are
            compared, :func:`moeblaze.training.job.check_same_config`, before the run's folder is made).

    Raises:
        ConfigError: ``root`` cannot be created or written (the message names it).
    """
    root = Path(root).expanduser()
    n = max(run_numbers(root), default=-1) + 1
    if not claim:
        return root / f"run_{n}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        while True:
            try:
                (root / f"run_{n}").mkdir()
                return root / f"run_{n}"
            except FileExistsError:
                n += 1
    except OSError as err:
        raise ConfigError(f"cannot create a run folder in {root} ({err.strerror or err}); pass --out-dir") from None


def holds_checkpoint(path: Path) -> bool:
    """``path`` holds a ``checkpoints/step-*`` folder (or a checkpoint of the layout before them)."""
    return bool(checkpoint_dirs(path)) or (path / "state.json").is_file()


def holds_metrics(path: Path) -> bool:
    """``path`` holds a ``metrics.csv``."""
    return (path / METRICS_FILE).is_file()


def newest_run(root: str | os.PathLike = ROOT, holds: Callable[[Path], bool] = holds_checkpoint) -> Path:
    """The highest-numbered ``root/run_N`` for which ``holds`` is true; ``root`` itself when none is (a run written
    there directly, or nothing: the caller's error then names ``root``)."""
    root = Path(root).expanduser()
    for n in reversed(run_numbers(root)):
        if holds(root / f"run_{n}"):
            return root / f"run_{n}"
    return root


def resolve_run(path: str | os.PathLike, holds: Callable[[Path], bool] = holds_checkpoint) -> str:
    """``path`` itself, unless it is a folder of numbered runs without a run of its own: then its newest run that
    ``holds`` (as :func:`newest_run`). Files and ``step-*`` folders pass through unchanged."""
    p = Path(path).expanduser()
    if not p.is_dir() or holds(p):
        return str(path)
    return str(newest_run(p, holds))
