"""The manifest of a moeblaze checkpoint folder: its names, its format, its check (:func:`verify`), and what DCP's
metadata says of a tensor (:func:`saved_dtype`). Part of
:mod:`moeblaze.training.checkpoint`, which re-exports it (the layout and the protocol are described there)."""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

__all__ = ["CheckpointError", "checkpoint_dirs", "saved_dtype", "step_dir_name", "verify"]

CHECKPOINTS = "checkpoints"
LATEST = "latest"
MANIFEST = "manifest.json"
STATE = "state.json"
FORMAT = 1
_STEP_DIR = re.compile(r"^step-(\d+)$")
_SHARD = re.compile(r"^__(\d+)_")
_CHUNK = 1 << 24  # bytes hashed per read (16 MiB)


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete or corrupt; the message names the file and the problem."""


def step_dir_name(step: int) -> str:
    """``step-000600``: zero-padded so that names sort by step."""
    return f"step-{step:06d}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _step_of(path: Path) -> int:
    return int(_STEP_DIR.match(path.name).group(1))


def checkpoint_dirs(out_dir: str | os.PathLike) -> list[Path]:
    """The ``checkpoints/step-*`` folders of ``out_dir``, oldest first (not verified)."""
    root = Path(out_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path}: unreadable ({type(err).__name__}: {err})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def verify(path: str | os.PathLike, share: tuple[int, int] = (0, 1)) -> dict:
    """Check a checkpoint folder against its manifest; returns its ``state.json`` contents.

    Checks: ``manifest.json`` parses and names this folder's step; every listed file exists with the
    listed size and SHA-256; DCP's ``.metadata`` and ``state.json`` are among them; ``state.json``
    holds the same step. ``share=(i, n)`` hashes only every n-th file from the i-th (the other checks
    cover all files): :func:`find_latest` spreads the hashing over the ranks this way.

    Raises:
        CheckpointError: the first problem found, naming the file.
    """
    path = Path(path)
    m = _STEP_DIR.match(path.name)
    if not m:
        raise CheckpointError(f"{path}: not a checkpoint folder (expected a step-* folder of a run's output)")
    manifest = _read_json(path / MANIFEST)
    files = manifest.get("files")
    if manifest.get("format") != FORMAT or not isinstance(files, dict):
        raise CheckpointError(f"{path / MANIFEST}: not a moeblaze checkpoint manifest (format {FORMAT})")
    if manifest.get("step") != int(m.group(1)):
        raise CheckpointError(f"{path / MANIFEST}: step {manifest.get('step')} does not match the folder name")
    for name in (".metadata", STATE):
        if name not in files:
            raise CheckpointError(f"{path / MANIFEST}: does not list {name}")
    for i, (name, info) in enumerate(sorted(files.items())):
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"{f}: missing")
        if f.stat().st_size != info.get("size"):
            raise CheckpointError(f"{f}: {f.stat().st_size} bytes, the manifest says {info.get('size')}")
        if i % share[1] == share[0] and _sha256(f) != info.get("sha256"):
            raise CheckpointError(f"{f}: contents differ from the manifest's SHA-256 (corrupt)")
    state = _read_json(path / STATE)
    if state.get("step") != manifest["step"]:
        raise CheckpointError(f"{path / STATE}: step {state.get('step')}, the manifest says {manifest['step']}")
    return state


def saved_dtype(path: str | os.PathLike, key: str) -> torch.dtype | None:
    """The dtype DCP saved the tensor ``key`` (e.g. ``"model.embed.weight"``) in, from the folder's ``.metadata``;
    None when it cannot tell."""
    try:
        meta = dcp.FileSystemReader(str(path)).read_metadata()
    except Exception:  # any unreadable metadata: the caller falls back, and load() names the problem
        return None
    return getattr(getattr(meta.state_dict_metadata.get(key), "properties", None), "dtype", None)
