"""What stops a training run cleanly and lets it continue: SIGTERM/Ctrl-C (:class:`StopOnSignal`), one decision
taken by every rank (:func:`agree`, bounded in time when a peer may be gone), an output folder proven writable
before the run starts (:func:`check_writable`), the RNG state a checkpoint keeps (:func:`rng_state`).
Re-exported by :mod:`moeblaze.training.checkpoint`."""

from __future__ import annotations

import base64
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from .heartbeat import PeerLostError

__all__ = ["StopOnSignal", "agree", "agree_all", "check_writable", "rng_state", "set_rng_state"]


def agree(flag: bool, timeout: float | None = None) -> bool:
    """True on every rank when ``flag`` is true on any rank: :func:`agree_all` of one flag."""
    return agree_all(flag, timeout=timeout)[0]


def agree_all(*flags: bool, timeout: float | None = None) -> tuple[bool, ...]:
    """Each flag true on every rank when it is true on any rank, all in one all-reduce of ints (the flags alone in
    a single process). Call it on all ranks at the same point of the loop with the same number of flags.

    ``timeout`` (seconds; None: unbounded): how long to wait for the other ranks, e.g. on the path of a SIGTERM,
    when torchrun may have sent it because a peer died. The all-reduce is waited on by polling, so the main thread
    stays responsive (signal handlers run) and never blocks past the deadline.

    Raises:
        moeblaze.training.heartbeat.PeerLostError: the other ranks did not join within ``timeout``.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return tuple(bool(f) for f in flags)
    t = torch.tensor([int(bool(f)) for f in flags], device="cuda" if dist.get_backend() == "nccl" else "cpu")
    if timeout is None:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return tuple(bool(v) for v in t.tolist())
    work = dist.all_reduce(t, op=dist.ReduceOp.MAX, async_op=True)
    deadline = time.monotonic() + timeout
    while not work.is_completed():
        if time.monotonic() > deadline:
            raise PeerLostError(f"the other ranks did not join the decision to stop within {timeout:g} s "
                                "(--dist-timeout); no checkpoint written")
        time.sleep(0.005)
    work.wait()
    return tuple(bool(v) for v in t.tolist())


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
                         "writing a checkpoint (a second Ctrl-C or SIGTERM exits at once, without one)\n")
        sys.stderr.flush()

    def _restore(self) -> None:
        for s, handler in self._old.items():
            signal.signal(s, handler)
        self._old = {}

    def __exit__(self, *exc) -> None:
        self._restore()


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
