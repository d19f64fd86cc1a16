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
invokes :func:`save`, :func:`find_latest`/:func:`resolve`, :func:`load`, :func:`tidy`, :func:`clear` and
:func:`make_room` with the same arguments, at the same step.
Rank 0 alone creates and renames the folder, writes ``state.json``/``manifest.json``/``latest`` and
deletes old checkpoints; every rank writes its own DCP shard file(s) through
``get_state_dict``/``set_state_dict`` (which gather/scatter sharded parameters themselves), fsyncs and
hashes them, and shares their manifest entries (so no rank reads the whole checkpoint when saving). Each
phase ends with the ranks agreeing on its outcome (one ``all_gather_object``): a write that fails on one rank
(a full disk, a quota) fails :func:`save` on every rank with the same one-line error, and no rank is left
waiting in the next phase. A rank killed in the middle leaves a ``.step-*.tmp`` folder that nothing reads
(the others are ended by :mod:`moeblaze.training.heartbeat`). ``out_dir`` must be one filesystem shared by
all ranks (DCP's own requirement). :func:`find_latest` spreads the hashing over the ranks and gives all the
same answer; :func:`agree` turns a per-rank flag (a signal seen, a time limit reached) into one decision so
that all ranks checkpoint together.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from .checkpoint_manifest import (  # re-exported: the folder's names and checks
    _SHARD,
    CHECKPOINTS,
    FORMAT,
    LATEST,
    MANIFEST,
    STATE,
    CheckpointError,
    _read_json,
    _sha256,
    _step_of,
    checkpoint_dirs,
    saved_dtype,
    step_dir_name,
    verify,
)
from .run_control import StopOnSignal, agree, agree_all, check_writable, rng_state, set_rng_state  # re-exported

__all__ = ["CheckpointError", "StopOnSignal", "agree", "agree_all", "check_writable", "checkpoint_dirs", "clear",
           "find_latest", "load", "make_room", "read_state", "resolve", "rng_state", "save", "saved_dtype",
           "set_rng_state", "tidy", "verify"]

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


def _writer(path: Path) -> int:
    """The rank that wrote a checkpoint file: DCP names shard files ``__{rank}_{i}.distcp``; the rest is rank 0's."""
    m = _SHARD.match(path.name)
    return int(m.group(1)) if m else 0


# ----------------------------------------------------------------------------- writing

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
        ValueError: ``keep < 1``.
        CheckpointError: a write failed on some rank (a full disk, a quota, a read-only folder): raised on every rank
            with one message naming the folder, the first failure and the space left (each phase ends with the
            ranks agreeing on its outcome, so no rank waits on one that failed); the partial folder is removed,
            the previous checkpoints are left as they were. Its ``no_space`` is True when the disk is full.
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    root = Path(out_dir) / CHECKPOINTS
    final, tmp = root / step_dir_name(step), root / f".{step_dir_name(step)}.tmp"
    rank = _rank()
    try:
        _agreed(lambda: _start(root, tmp) if rank == 0 else None)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        # expert-parallel weights under their global [E, ...] shape, put back after the write: the optimizer's
        # state dict shares its per-parameter dicts with the live optimizer, whose next step would otherwise
        # read the global moments (a shape error at the first step after a mid-run checkpoint, --fsdp --ep 2)
        replaced = _globalize(model, model_sd, optim_sd)
        try:  # collective; DCP's .metadata comes last and DCP itself raises a failure on every rank
            _agreed(lambda: _dcp_save({"model": model_sd, "optim": optim_sd}, tmp))
        finally:
            _restore(model_sd, optim_sd, replaced)
        # each rank fsyncs and hashes the files it wrote (rank 0: also .metadata and state.json), so no rank
        # reads the whole checkpoint; rank 0 writes the manifest from every rank's entries
        files = _agreed(lambda: _own_files(tmp, rank, state, step))
        _agreed(lambda: _commit(out_dir, root, tmp, final, step, files, keep) if rank == 0 else None)
    except _Failed as failed:
        if rank == 0:
            _remove_tree(tmp)
        raise _write_error(failed, root, step) from None
    return final


class _Failed(Exception):
    """A phase of :func:`save` failed on some rank; ``str`` names the rank and the first line of the error."""

    def __init__(self, what: str, errno_: int | None) -> None:
        super().__init__(what)
        self.errno = errno_


def _describe_failure(err: BaseException) -> tuple[str, int | None]:
    """``("rank r: first line", errno)`` of an exception; inside DCP's ``CheckpointException``, the first failing
    rank's own."""
    rank = _rank()
    if isinstance(err, CheckpointException) and err.failures:
        rank, (err, _) = min(err.failures.items(), key=lambda kv: kv[0])
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return f"rank {rank}: {text}", getattr(err, "errno", None)


def _agreed(phase: Callable[[], Any]) -> Any:
    """Run one phase of :func:`save` on every rank and agree on its outcome: its result (every rank's, merged,
    when results are dicts), or :class:`_Failed` raised on every rank for the first rank's failure."""
    try:
        result, failure = phase(), None
    except (Exception, CheckpointException) as err:
        result, failure = None, _describe_failure(err)
    if not _distributed():
        outcomes = [(result, failure)]
    else:
        outcomes = [None] * dist.get_world_size()
        dist.all_gather_object(outcomes, (result, failure))
    failures = [f for _, f in outcomes if f is not None]
    if failures:
        raise _Failed(*failures[0])
    if all(isinstance(r, dict) for r, _ in outcomes):
        return {k: v for r, _ in outcomes for k, v in r.items()}
    return result


def _start(root: Path, tmp: Path) -> None:
    _mkdir(root)
    if tmp.exists():  # left by a process killed while writing this step
        _remove_tree(tmp)
    _mkdir(tmp)


def _own_files(tmp: Path, rank: int, state: dict | None, step: int) -> dict:
    """Rank 0 writes ``state.json``; every rank fsyncs and hashes the files it wrote: ``{name: {size, sha256}}``."""
    if rank == 0:
        _write_file(tmp / STATE, json.dumps({**(state or {}), "step": step}, indent=1).encode())
    mine = sorted(p for p in tmp.iterdir() if p.is_file() and _writer(p) == rank)
    for p in mine:
        _fsync(p)
    return {p.name: {"size": p.stat().st_size, "sha256": _sha256(p)} for p in mine}


def _commit(out_dir, root: Path, tmp: Path, final: Path, step: int, files: dict, keep: int) -> None:
    """Rank 0: the manifest, then the rename that makes the checkpoint current, the ``latest`` pointer and the
    pruning. After the rename the checkpoint is complete: a failure to update the pointer (which nothing trusts,
    :func:`tidy` repairs it) or to prune is not one of the checkpoint."""
    manifest = {"format": FORMAT, "step": step, "files": dict(sorted(files.items()))}
    _write_file(tmp / MANIFEST, json.dumps(manifest, indent=1).encode())
    _fsync(tmp / MANIFEST)
    _fsync(tmp)
    if final.exists():  # a checkpoint of this step that did not verify (resume went back past it)
        _remove_tree(final)
    _rename(tmp, final)
    _fsync(root)
    try:
        _write_file(root / f".{LATEST}.tmp", (final.name + "\n").encode())
        _fsync(root / f".{LATEST}.tmp")
        _rename(root / f".{LATEST}.tmp", root / LATEST)
        _fsync(root)
    except OSError:
        (root / f".{LATEST}.tmp").unlink(missing_ok=True)
    for old in _to_prune(out_dir, step, keep):
        _remove_tree(old)


def _size(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _write_error(failed: _Failed, root: Path, step: int) -> CheckpointError:
    """The one-line error of a failed write (the same on every rank: rank 0's words, broadcast), with the space
    left on the filesystem (after the partial folder was removed) and what the newest checkpoint takes."""
    message, no_space = None, False
    if _rank() == 0:
        previous = checkpoint_dirs(root.parent)
        need = sum(f.stat().st_size for f in previous[-1].iterdir() if f.is_file()) if previous else 0
        try:
            usage = shutil.disk_usage(root)
            no_space = failed.errno in (errno.ENOSPC, errno.EDQUOT) or usage.free < max(need, 1 << 20)
            space = f"{_size(usage.free)} free of {_size(usage.total)} on its filesystem"
        except OSError as err:
            no_space, space = failed.errno in (errno.ENOSPC, errno.EDQUOT), f"its free space unknown ({err})"
        if previous:
            space += f", {previous[-1].name} takes {_size(need)}"
        message = (f"cannot write the checkpoint of step {step} in {root}: {'disk full: ' if no_space else ''}"
                   f"{failed}; {space}; the earlier checkpoints are untouched")
    message, no_space = _broadcast((message, no_space))
    error = CheckpointError(message)
    error.no_space = no_space
    return error


def make_room(out_dir: str | os.PathLike) -> list[str]:
    """Delete every checkpoint older than the newest complete one (a write that found the disk full tries once
    more in the space they held); returns their names. Call on every rank (rank 0 deletes)."""
    newest = find_latest(out_dir, warn=None)
    # rank 0's listing for every rank: one that listed after rank 0 deleted would see nothing to retry for
    older = _broadcast([p.name for p in checkpoint_dirs(out_dir)
                        if newest is not None and _step_of(p) < _step_of(newest)])
    if _rank() == 0:
        for name in older:
            _remove_tree(Path(out_dir) / CHECKPOINTS / name)
    _barrier()
    return older


def _to_prune(out_dir: str | os.PathLike, step: int, keep: int) -> list[Path]:
    """All but the ``keep`` newest checkpoints up to ``step``, and every one after it (left by a run that
    resumed from an older checkpoint because these did not verify: they must not shadow the new ones)."""
    dirs = checkpoint_dirs(out_dir)
    older = [p for p in dirs if _step_of(p) <= step]
    return older[:-keep] + [p for p in dirs if _step_of(p) > step]


# ----------------------------------------------------------------------------- reading

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


def _globalize(model: torch.nn.Module, model_sd: dict, optim_sd: dict | None) -> dict:
    """Expert-parallel weights (and their AdamW moments) as global DTensors for DCP
    (:mod:`moeblaze.parallel.state_dict`); an expert sharding it cannot describe is a CheckpointError."""
    from ..parallel.state_dict import globalize_expert_state

    try:
        return globalize_expert_state(model, model_sd, optim_sd)
    except ValueError as err:
        raise CheckpointError(str(err)) from None


def _restore(model_sd: dict, optim_sd: dict | None, replaced: dict) -> None:
    from ..parallel.state_dict import restore

    restore(model_sd, optim_sd, replaced)


def _check_finite(model: torch.nn.Module, path: Path) -> None:
    """Every rank raises alike when some rank's shard of a parameter holds a NaN or an inf."""
    bad = next((name for name, p in model.named_parameters()
                if p.is_floating_point() and not bool(torch.isfinite(p).all())), None)
    if _distributed():
        found = [None] * dist.get_world_size()
        dist.all_gather_object(found, bad)
        bad = next((b for b in found if b is not None), None)
    if bad is not None:
        raise CheckpointError(f"{path}: parameter {bad} holds non-finite values (NaN or inf)")


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
    except (RuntimeError, ValueError, KeyError, OSError, CheckpointException) as err:
        first = _describe_failure(err)[0] if isinstance(err, CheckpointException) else (
            str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__)
        raise CheckpointError(f"{path}: cannot load model/optimizer state ({first})") from None
    _check_finite(model, path)
