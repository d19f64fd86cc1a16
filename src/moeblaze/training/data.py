"""Byte-level training data for ``moeblaze train`` (vocabulary 256, no tokenizer).

Default corpus: the ``.py`` files of the running interpreter's standard library (present on every
machine), without ``site-packages`` and test directories, in sorted order. Train and validation are
split *by file* with a fixed hash of each relative path, so the split is deterministic and no
validation file leaks into training. ``--data PATH`` takes a text file (split by position: the last
``val_fraction`` of its bytes is validation) or a directory (every text file under it, split by file).

Batches are drawn by :func:`get_batch` from a generator seeded by ``(seed, step)``, so the batch of a
step depends on nothing else — which is what lets ``--resume`` replay the exact data order.
"""

from __future__ import annotations

import math
import os
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

__all__ = ["Corpus", "DataError", "eval_windows", "get_batch", "load_corpus", "unigram_entropy"]

_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


class DataError(ValueError):
    """The data path is missing, unreadable, or holds too little text."""


@dataclass
class Corpus:
    """Train and validation bytes.

    Attributes:
        train: ``[n_train]`` uint8 array.
        val: ``[n_val]`` uint8 array.
        source: a description (path and how it was split), for printing.
        num_files: number of files read.
    """

    train: np.ndarray
    val: np.ndarray
    source: str
    num_files: int


def _in_val(rel: str, val_fraction: float) -> bool:
    # crc32 of the relative path: stable across runs, machines and Python versions.
    return zlib.crc32(rel.encode("utf-8", "surrogateescape")) % 10_000 < val_fraction * 10_000


def _is_text(raw: bytes) -> bool:
    if b"\0" in raw[:8192]:
        return False
    try:
        raw[:8192].decode("utf-8")
    except UnicodeDecodeError as err:  # a multi-byte character cut at 8192 is still text
        return err.start >= 8192 - 4
    return True


def _walk(root: Path, suffix: str | None) -> list[Path]:
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
        files += [Path(dirpath) / f for f in sorted(filenames)
                  if (suffix is None or f.endswith(suffix)) and not f.startswith(".")]
    # regular files only: reading a FIFO blocks until a writer comes, a device may never end
    return sorted(f for f in files if f.is_file())


def _split_files(root: Path, files: list[Path], val_fraction: float, text_only: bool) -> Corpus:
    train, val, n = [], [], 0
    for f in files:
        try:
            raw = f.read_bytes()
        except OSError:
            continue
        if not raw or (text_only and not _is_text(raw)):
            continue
        n += 1
        (val if _in_val(f.relative_to(root).as_posix(), val_fraction) else train).append(raw + b"\n")
    if not train or not val:  # too few files to split by file: split the concatenation by position
        return _split_bytes(b"".join(train + val), f"{root} ({n} files, split by position)", n, val_fraction)
    return Corpus(np.frombuffer(b"".join(train), dtype=np.uint8), np.frombuffer(b"".join(val), dtype=np.uint8),
                  f"{root} ({n} files: {len(train)} train, {len(val)} validation, split by file)", n)


def _split_bytes(raw: bytes, source: str, num_files: int, val_fraction: float) -> Corpus:
    data = np.frombuffer(raw, dtype=np.uint8)
    cut = len(data) - max(1, int(len(data) * val_fraction))
    return Corpus(data[:cut], data[cut:], source, num_files)


def load_corpus(path: str | None = None, val_fraction: float = 0.1, min_bytes: int = 1024) -> Corpus:
    """Load the training corpus.

    Args:
        path: ``None`` for the standard-library default, a text file, or a directory.
        val_fraction: share of files (directory, default corpus) or bytes (file) kept for validation.
        min_bytes: fewer bytes than this in train or validation raises ``DataError``.

    Returns:
        A :class:`Corpus` of uint8 arrays.

    Raises:
        DataError: the path does not exist, is not readable, is a single file that is not text or not a
            regular file, or holds too little text. Directories: only regular text files are read.
    """
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"val_fraction must be in (0, 1), got {val_fraction}")
    if path is None:
        root = Path(sysconfig.get_paths()["stdlib"])
        corpus = _split_files(root, _walk(root, ".py"), val_fraction, text_only=False)
        corpus.source = f"Python standard library: {corpus.source}"
    else:
        p = Path(path).expanduser()
        if not p.exists():
            raise DataError(f"--data path does not exist: {path}")
        if p.is_dir():
            corpus = _split_files(p, _walk(p, None), val_fraction, text_only=True)
        else:
            if not p.is_file():
                raise DataError(f"--data {path} is neither a regular file nor a directory (a FIFO or device?)")
            try:
                raw = p.read_bytes()
            except OSError as err:
                raise DataError(f"cannot read --data file {path}: {err.strerror}") from None
            if not _is_text(raw):
                raise DataError(f"--data file {path} is not text (NUL bytes or invalid UTF-8 in its first 8 KiB)")
            corpus = _split_bytes(raw, f"{p} (split by position)", 1, val_fraction)
    for name, arr in (("training", corpus.train), ("validation", corpus.val)):
        if len(arr) < min_bytes:
            raise DataError(f"too little {name} text in {path or 'the standard library'}: "
                            f"{len(arr)} bytes (need at least {min_bytes})")
    return corpus


def unigram_entropy(data: np.ndarray) -> float:
    """Order-0 entropy of a uint8 array in bits per byte: ``-sum_b p_b log2 p_b``.

    This is the cross-entropy of the best model that ignores context; a model that uses context
    should beat it.
    """
    counts = np.bincount(np.asarray(data, dtype=np.uint8), minlength=256).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log2(p)).sum())


def _windows(data: np.ndarray, starts: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx = starts[:, None] + np.arange(seq_len + 1)[None, :]
    chunk = torch.from_numpy(data[idx].astype(np.int64))
    return chunk[:, :-1], chunk[:, 1:]


def get_batch(data: np.ndarray, step: int, batch_size: int, seq_len: int,
              seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of training step ``step``: random windows drawn from a generator seeded by ``(seed, step)``.

    Returns:
        ``(x, y)``, both ``[batch_size, seq_len]`` int64 on CPU, with ``y`` = ``x`` shifted by one byte.

    Raises:
        DataError: ``data`` holds fewer than ``seq_len + 2`` bytes.
    """
    if len(data) < seq_len + 2:
        raise DataError(f"data has {len(data)} bytes, fewer than seq_len + 2 = {seq_len + 2}")
    rng = np.random.Generator(np.random.PCG64([seed, step]))
    starts = rng.integers(0, len(data) - seq_len - 1, size=batch_size)
    return _windows(data, starts, seq_len)


def eval_windows(data: np.ndarray, num_tokens: int, seq_len: int, batch_size: int):
    """Fixed validation batches: ``ceil(num_tokens / seq_len)`` windows evenly spaced over ``data``.

    Yields ``(x, y)`` pairs of ``[<= batch_size, seq_len]`` int64 tensors; the same ones on every call.

    Raises:
        DataError: ``data`` is shorter than ``seq_len + 2`` bytes.
    """
    if len(data) < seq_len + 2:
        raise DataError(f"validation data has {len(data)} bytes, fewer than seq_len + 2 = {seq_len + 2}")
    n = max(1, min(math.ceil(num_tokens / seq_len), (len(data) - 1) // seq_len))
    starts = np.linspace(0, len(data) - seq_len - 1, n).astype(np.int64)
    for i in range(0, n, batch_size):
        yield _windows(data, starts[i:i + batch_size], seq_len)
