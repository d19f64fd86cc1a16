"""Atomic, verified training checkpoints for one process or many ranks (``torch.distributed.checkpoint``).

Layout under a run's ``out_dir``::

    checkpoints/step-000600/        one complete checkpoint (the step is in the name)
        .metadata, __0_0.distcp ...  model + optimizer state, written by DCP (one file per rank)
        state.json                   step, RNG state, run and model configuration (rank 0)
        manifest.json                step, and the size and SHA-256 of every other file (rank 0, written last)
    checkpoints/latest              the name of the newest checkpoint (a pointer for people and tools)

Write protocol (:func:`save`): everything goes into ``checkpoints/.step-000600.tmp/``; every file is
fsynced; ``manifest.json`` is written and fsynced last; the folder is renamed to ``step-000600`` (one
atomic ``rename``) and its parent fsynced; ``latest`` is replaced atomically (write a temporary file,
fsync, ``os.replace``, fsync the folder); then checkpoints beyond the newest ``keep`` are deleted.
A process killed at any point leaves either no new ``step-*`` folder or a complete one, and the older
checkpoints untouched.

Why a manifest on top of DCP: DCP writes its ``.metadata`` last (pickled to ``.metadata.tmp``, fsynced,
renamed; ``FileSystemWriter.finish`` in torch 2.13), so a ``.metadata`` means every rank finished its
shard files. But DCP neither fsyncs the folder nor checks the shard files' sizes or contents when it
loads, and it knows nothing of our ``state.json``. The manifest makes a truncated or corrupted file, or
parts of two different steps, a named error instead of wrong weights.

Loading (:func:`find_latest`, :func:`load`): the newest ``step-*`` folder whose manifest verifies is used
(the ``latest`` pointer is not trusted: a kill between the rename and the pointer update leaves it one
checkpoint behind); a folder that does not verify is named with its bad file and problem in a warning
and skipped, so the previous complete checkpoint is used.

Rank contract (``torch.distributed`` initialised, FSDP2 or expert-parallel models): **every rank**
calls :func:`save`, :func:`find_latest`/:func:`resolve`, :func:`load`, :func:`tidy` and :func:`clear` with
the same arguments, at the same step.
Rank 0 alone creates and renames the folder, writes ``state.json``/``manifest.json``/``latest`` and
deletes old checkpoints; every rank writes its own DCP shard file(s) through
``get_state_dict``/``set_state_dict`` (which gather/scatter sharded parameters themselves), fsyncs and
hashes them, and sends their manifest entries to rank 0 (so no rank reads the whole checkpoint when
saving); barriers separate the phases. ``out_dir`` must be one filesystem shared by all ranks (DCP's
own requirement). :func:`find_latest` spreads the hashing over the ranks and gives all the same answer;
:func:`agree` turns a per-rank flag (a signal seen, a time limit reached) into one decision so that all
ranks checkpoint together.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

__all__ = ["CheckpointError", "StopOnSignal", "agree", "check_writable", "checkpoint_dirs", "clear", "find_latest",
           "load", "read_state", "resolve", "rng_state", "save", "set_rng_state", "tidy", "verify"]

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


# ----------------------------------------------------------------------------- file operations
# Every change the writer makes to the filesystem goes through one of these functions (and the DCP
# shard write through _dcp_save), so a test can stop the process right after the i-th of them.

FILE_OPS = ("_mkdir", "_write_file", "_fsync", "_rename", "_remove_tree", "_dcp_save")


def _mkdir(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)


def _write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def _fsync(path: Path) -> None:
    """fsync a file, or a folder (so that a rename or a new entry in it is durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rename(src: Path, dst: Path) -> None:
    os.replace(src, dst)


def _remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def _dcp_save(state: dict, path: Path) -> None:
    with _single_process_quiet():
        dcp.save(state, checkpoint_id=str(path), no_dist=not _distributed())


@contextlib.contextmanager
def _single_process_quiet():
    """DCP warns on every single-process save/load that it assumes one process: that is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


# ----------------------------------------------------------------------------- ranks

def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def _broadcast(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank."""
    if not _distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _gather_to_rank0(entries: dict) -> dict:
    """The union of every rank's ``entries`` on rank 0 (``{}`` on the others)."""
    if not _distributed():
        return entries
    out = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(entries, out, dst=0)
    return {k: v for part in out for k, v in part.items()} if out is not None else {}


def _writer(path: Path) -> int:
    """The rank that wrote a checkpoint file: DCP names shard files ``__{rank}_{i}.distcp``; the rest is rank 0's."""
    m = _SHARD.match(path.name)
    return int(m.group(1)) if m else 0


def agree(flag: bool) -> bool:
    """True on every rank when ``flag`` is true on any rank (an all-reduce of one int; ``flag`` alone in
    a single process). Call it on all ranks at the same point of the loop."""
    if not _distributed():
        return bool(flag)
    t = torch.tensor([int(bool(flag))], device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


# ----------------------------------------------------------------------------- writing

def step_dir_name(step: int) -> str:
    """``step-000600``: zero-padded so that names sort by step."""
    return f"step-{step:06d}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def save(out_dir: str | os.PathLike, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
         state: dict | None = None, keep: int = 3) -> Path:
    """Write the checkpoint of ``step`` atomically (protocol in the module docstring); returns its folder.

    Args:
        out_dir: the run's folder (``checkpoints/`` is made under it).
        step: optimizer steps taken so far (>= 0).
        model, optimizer: saved through ``get_state_dict`` + DCP (sharded models: every rank's shards).
        state: JSON-serialisable run state (RNG, configurations; ``moeblaze train`` stores its own there);
            stored with ``"step"`` in ``state.json`` (None: the step alone).
        keep: how many newest checkpoints to keep (>= 1; default 3, as ``--keep-checkpoints``); older ones are
            deleted after this one is current.

    Raises:
        OSError: the filesystem refused a write (the previous checkpoints are left as they were).
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    root = Path(out_dir) / CHECKPOINTS
    final, tmp = root / step_dir_name(step), root / f".{step_dir_name(step)}.tmp"
    if _rank() == 0:
        _mkdir(root)
        if tmp.exists():  # left by a process killed while writing this step
            _remove_tree(tmp)
        _mkdir(tmp)
    _barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    # expert-parallel weights under their global [E, ...] shape, put back after the write: the optimizer's
    # state dict shares its per-parameter dicts with the live optimizer, whose next step would otherwise
    # read the global moments (a shape error at the first step after a mid-run checkpoint, --fsdp --ep 2)
    replaced = _globalize(model, model_sd, optim_sd)
    try:
        _dcp_save({"model": model_sd, "optim": optim_sd}, tmp)  # collective; DCP's .metadata comes last
    finally:
        _restore(model_sd, optim_sd, replaced)
    rank = _rank()
    if rank == 0:
        _write_file(tmp / STATE, json.dumps({**(state or {}), "step": step}, indent=1).encode())
    # each rank fsyncs and hashes the files it wrote (rank 0: also .metadata and state.json), so no rank
    # reads the whole checkpoint; rank 0 gathers the entries into the manifest
    mine = sorted(p for p in tmp.iterdir() if p.is_file() and _writer(p) == rank)
    for p in mine:
        _fsync(p)
    files = _gather_to_rank0({p.name: {"size": p.stat().st_size, "sha256": _sha256(p)} for p in mine})
    if rank == 0:
        manifest = {"format": FORMAT, "step": step, "files": dict(sorted(files.items()))}
        _write_file(tmp / MANIFEST, json.dumps(manifest, indent=1).encode())
        _fsync(tmp / MANIFEST)
        _fsync(tmp)
        if final.exists():  # a checkpoint of this step that did not verify (resume went back past it)
            _remove_tree(final)
        _rename(tmp, final)
        _fsync(root)
        _write_file(root / f".{LATEST}.tmp", (final.name + "\n").encode())
        _fsync(root / f".{LATEST}.tmp")
        _rename(root / f".{LATEST}.tmp", root / LATEST)
        _fsync(root)
        for old in _to_prune(out_dir, step, keep):
            _remove_tree(old)
    _barrier()
    return final


def _to_prune(out_dir: str | os.PathLike, step: int, keep: int) -> list[Path]:
    """All but the ``keep`` newest checkpoints up to ``step``, and every one after it (left by a run that
    resumed from an older checkpoint because these did not verify: they must not shadow the new ones)."""
    dirs = checkpoint_dirs(out_dir)
    older = [p for p in dirs if _step_of(p) <= step]
    return older[:-keep] + [p for p in dirs if _step_of(p) > step]


def _step_of(path: Path) -> int:
    return int(_STEP_DIR.match(path.name).group(1))


# ----------------------------------------------------------------------------- reading

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


def _warn(message: str) -> None:
    warnings.warn(message, stacklevel=3)


def find_latest(out_dir: str | os.PathLike, warn: Callable[[str], None] | None = _warn) -> Path | None:
    """The newest checkpoint folder of ``out_dir`` that verifies, or None when there is none.

    A newer folder that fails :func:`verify` is skipped, and ``warn`` (default: a ``UserWarning``; None:
    silent) gets a line naming the file and the problem. Collective when distributed: rank 0 lists the
    folders, every rank hashes its share of each candidate's files, all get the same answer, and ``warn``
    is called on rank 0 only.
    """
    rank, world = (dist.get_rank(), dist.get_world_size()) if _distributed() else (0, 1)
    for path in map(Path, _broadcast([str(p) for p in reversed(checkpoint_dirs(out_dir))])):
        try:
            verify(path, share=(rank, world))
            problem = None
        except CheckpointError as err:
            problem = str(err)
        if _distributed():
            problems = [None] * world
            dist.all_gather_object(problems, problem)
            problem = next((p for p in problems if p), None)
        if problem is None:
            return path
        if warn is not None and rank == 0:
            warn(f"checkpoint {path.name} is not usable: {problem}")
    return None


def clear(out_dir: str | os.PathLike) -> None:
    """Delete every checkpoint of ``out_dir`` (``--overwrite``). Call on every rank (rank 0 deletes)."""
    if _rank() == 0:
        _remove_tree(Path(out_dir) / CHECKPOINTS)
    _barrier()


def tidy(out_dir: str | os.PathLike, newest: Path | None) -> None:
    """Remove what a killed writer left (``.step-*.tmp`` folders, ``.latest.tmp``) and point ``latest`` at
    ``newest`` (what :func:`find_latest` chose) if a kill came between its rename and the pointer update.
    Call on every rank (rank 0 acts) before training resumes."""
    root = Path(out_dir) / CHECKPOINTS
    if _rank() == 0 and root.is_dir():
        for p in root.iterdir():
            if p.name.startswith(".step-") and p.name.endswith(".tmp"):
                _remove_tree(p)
        (root / f".{LATEST}.tmp").unlink(missing_ok=True)
        pointer = root / LATEST
        if newest is not None and (not pointer.is_file() or pointer.read_text().strip() != newest.name):
            _write_file(root / f".{LATEST}.tmp", (newest.name + "\n").encode())
            _fsync(root / f".{LATEST}.tmp")
            _rename(root / f".{LATEST}.tmp", pointer)
            _fsync(root)
    _barrier()


def read_state(path: str | os.PathLike, check: bool = True) -> dict:
    """``state.json`` of a checkpoint folder (step, RNG state, configurations), verified against the manifest
    (``check=False``: only parsed, for a folder just verified; verifying hashes every file).

    Raises:
        CheckpointError: as :func:`verify`.
    """
    if check:
        return verify(path)
    state = _read_json(Path(path) / STATE)
    if not isinstance(state.get("step"), int):
        raise CheckpointError(f"{Path(path) / STATE}: no integer step")
    return state


def resolve(path: str | os.PathLike) -> Path:
    """``path`` itself when it is a checkpoint folder (holds a manifest) that verifies, else the newest one
    under it that verifies (as :func:`find_latest`).

    Raises:
        CheckpointError: the folder or every one under it fails :func:`verify` (naming the newest one's bad
            file), or there is none.
    """
    p = Path(path).expanduser()
    if (p / MANIFEST).is_file():
        verify(p)
        return p
    problems: list[str] = []
    found = find_latest(p, warn=problems.append)
    if found is not None:
        return found
    if problems:
        raise CheckpointError(f"no usable checkpoint in {path}: {problems[0]}")
    legacy = " (an old-format checkpoint: model.safetensors; retrain it)" if (p / "state.json").is_file() else ""
    raise CheckpointError(f"no checkpoint in {path} (no complete {CHECKPOINTS}/step-* folder){legacy}")


def rng_state() -> dict:
    """The CPU (and every CUDA device's) RNG state, base64-encoded for JSON."""
    rng = {"torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}
    if torch.cuda.is_available():
        rng["cuda"] = [base64.b64encode(s.numpy().tobytes()).decode() for s in torch.cuda.get_rng_state_all()]
    return rng


def set_rng_state(rng: dict, device: torch.device) -> None:
    """Restore what :func:`rng_state` returned (CUDA states only when ``device`` is a CUDA device)."""
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(rng["torch"])), dtype=torch.uint8))
    if device.type == "cuda" and "cuda" in rng:
        torch.cuda.set_rng_state_all([torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)
                                      for s in rng["cuda"]])


def _globalize(model: torch.nn.Module, model_sd: dict, optim_sd: dict | None) -> dict:
    """Expert-parallel weights (and their AdamW moments) as global DTensors for DCP
    (:mod:`moeblaze.parallel.state_dict`); an expert sharding it cannot describe is a CheckpointError."""
    from .parallel.state_dict import globalize_expert_state

    try:
        return globalize_expert_state(model, model_sd, optim_sd)
    except ValueError as err:
        raise CheckpointError(str(err)) from None


def _restore(model_sd: dict, optim_sd: dict | None, replaced: dict) -> None:
    from .parallel.state_dict import restore

    restore(model_sd, optim_sd, replaced)


def _check_finite(model: torch.nn.Module, path: Path) -> None:
    for name, p in model.named_parameters():
        if p.is_floating_point() and not bool(torch.isfinite(p).all()):
            raise CheckpointError(f"{path}: parameter {name} holds non-finite values (NaN or inf)")


def load(path: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Load a checkpoint folder's weights (and optimizer state when ``optimizer`` is given) in place.

    The model (and optimizer) must be built as when saving; a sharded model may be sharded differently
    (DCP reshards). Call on every rank.

    Raises:
        CheckpointError: DCP cannot read the folder, or a loaded parameter is not finite.
    """
    path = Path(path)
    try:
        if optimizer is None:
            sd = {"model": get_model_state_dict(model)}
            replaced = _globalize(model, sd["model"], None)
            with _single_process_quiet():
                dcp.load(sd, checkpoint_id=str(path), no_dist=not _distributed())
            _restore(sd["model"], None, replaced)
            set_model_state_dict(model, sd["model"])
        else:
            model_sd, optim_sd = get_state_dict(model, optimizer)
            sd = {"model": model_sd, "optim": optim_sd}
            replaced = _globalize(model, model_sd, optim_sd)  # loaded in place into the local storage
            with _single_process_quiet():
                dcp.load(sd, checkpoint_id=str(path), no_dist=not _distributed())
            _restore(model_sd, optim_sd, replaced)
            set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    except (RuntimeError, ValueError, KeyError, OSError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(f"{path}: cannot load model/optimizer state ({first})") from None
    _check_finite(model, path)


# ----------------------------------------------------------------------------- run guards

def check_writable(out_dir: str | os.PathLike) -> str | None:
    """Create ``out_dir`` and write, fsync and delete a file in it; returns None, or what is wrong in words
    (to be prefixed with the folder's name: "exists and is not a directory", "is not writable: ...")."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        return "exists and is not a directory"
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".write-test-") as f:
            f.write(b"moeblaze")
            f.flush()
            os.fsync(f.fileno())
    except OSError as err:
        return f"is not writable: {err.strerror or err}"
    return None


class StopOnSignal:
    """While active, the first SIGINT or SIGTERM only sets ``signum``: the loop finishes its step, writes a
    checkpoint and stops. The handlers in place before are then restored, so a second Ctrl-C raises
    KeyboardInterrupt at once and a second SIGTERM terminates. Signal handlers can only be set in the main
    thread; elsewhere this does nothing."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.signum: int | None = None
        self._old: dict = {}

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            self._old = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def _handle(self, signum, frame) -> None:
        self.signum = signum
        self._restore()
        sys.stderr.write(f"moeblaze train: {signal.Signals(signum).name} received: finishing this step, then "
                         "writing a checkpoint (Ctrl-C again to exit at once, without one)\n")
        sys.stderr.flush()

    def _restore(self) -> None:
        for s, handler in self._old.items():
            signal.signal(s, handler)
        self._old = {}

    def __exit__(self, *exc) -> None:
        self._restore()
