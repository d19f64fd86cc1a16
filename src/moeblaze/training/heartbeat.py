"""A dead rank never hangs the others: heartbeats in the job's ``torch.distributed`` store, watched by a thread.

Why a thread: a collective waits for every rank. When one dies (SIGKILL, the OOM killer, a lost node), the others
wait in their next collective — NCCL until its watchdog (the process group's timeout), gloo until a socket closes
or the timeout passes — and a SIGTERM (torchrun sends one to the survivors) reaches Python only when the main
thread comes back from that wait. The main thread cannot notice; a second thread can.

Design (:class:`PeerMonitor`, one per rank, started by :func:`moeblaze.training.job.start_job`):

* Every ``interval`` (1 s) a daemon thread adds 1 to ``beat/<rank>`` in the store the process group was made with,
  through a client connection of its own (``Store.clone``: a main thread blocked on the store never blocks it),
  and reads ``beat/<next rank>`` (a ring: each rank watches one other, so O(1) store operations per rank and
  second, whatever the world size) and ``lost``.
* A counter that has not moved for ``lost_after`` seconds (half of ``--dist-timeout``, at most 30 s: a stalled
  but living process still beats, as the thread needs only the GIL for a moment) marks its rank lost; the watcher
  writes its verdict to ``lost``, which every rank reads on its next beat.
* After an alarm the silence that counts is ``ALARM_AFTER`` (5 s): a SIGTERM or SIGINT, seen through
  ``signal.set_wakeup_fd`` (the C-level handler writes the signal's number there even while the main thread is
  blocked in a collective), or a collective that failed in the main thread (:meth:`PeerMonitor.alarm`). torchrun
  sends SIGTERM right after a worker dies, so its survivors exit within about 6 s of the death.
* The store's host (torchrun's agent, or rank 0's process under a launcher that starts each rank itself) may be
  the rank that died. The thread keeps a plain TCP connection to the store's port, on which nothing is ever sent:
  the host's kernel closes it when the process dies, and the EOF names the host before any store operation fails
  (each failed one logs a C++ stack).
* A rank that leaves normally — done, or with an error every rank raised alike — writes ``left/<rank>`` and waits
  (at most ``lost_after``) for the others' (:meth:`PeerMonitor.close`), so that no store host goes down under a
  monitor still running; a rank that leaves with an error of its own writes nothing, and its peers see it stop.

On a verdict the thread writes one line to stderr naming the lost rank and ends the process with
``os._exit(EXIT_PEER_LOST)``: the main thread may be inside a collective that never returns, and the process
group's destructors would wait on the dead peer too. Checkpoints are atomic (:mod:`moeblaze.training.checkpoint`), so
``--resume`` continues from the newest complete one.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from .. import settings

__all__ = ["ALARM_AFTER", "EXIT_PEER_LOST", "PeerLostError", "PeerMonitor", "lost_after"]

EXIT_PEER_LOST = 3
ALARM_AFTER = 5.0
MAX_LOST_AFTER = 30.0
_ALARM_SIGNALS = {int(signal.SIGINT), int(signal.SIGTERM)}
_jobs = itertools.count()  # one key prefix per job: every rank starts its jobs in the same order


class PeerLostError(RuntimeError):
    """Other ranks did not answer within the time allowed (a bounded agreement that timed out)."""


def lost_after(dist_timeout: float) -> float:
    """Seconds without a heartbeat that mark a rank lost: half of ``--dist-timeout``, at most 30 s."""
    return min(MAX_LOST_AFTER, dist_timeout / 2)


def _default_store() -> dist.Store:
    # The store init_process_group made (private in torch 2.13: no public accessor exists).
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


def _tcp_address(store: dist.Store) -> tuple[str, int] | None:
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return (store.host, store.port) if isinstance(store, dist.TCPStore) else None


def _own_client(store: dist.Store) -> dist.Store:
    """A client of ``store`` for this thread alone (``Store.clone``); the store itself where it cannot be cloned
    (a FileStore or HashStore of a caller's own group: no connection for a blocked main thread to hold)."""
    try:
        return store.clone()
    except (RuntimeError, NotImplementedError):
        return store


def _exit_with(line: str) -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    with contextlib.suppress(Exception):
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    os._exit(EXIT_PEER_LOST)


class PeerMonitor:
    """The heartbeat of one rank and its watch over the next (module docstring).

    Args:
        rank, world: this rank and the job's size (>= 2).
        lost_after: seconds of silence that mark a rank lost (:func:`lost_after`).
        advice: appended to the line printed on a verdict (what to run next).
        store: the job's store (default: the default process group's).
        interval: seconds between beats.
        on_lost: called with the line on a verdict (default: print it and ``os._exit(EXIT_PEER_LOST)``).
    """

    def __init__(self, rank: int, world: int, lost_after: float, advice: str = "", store: dist.Store | None = None,
                 interval: float = 1.0, on_lost: Callable[[str], None] = _exit_with) -> None:
        self.rank, self.world, self.lost_after, self.interval = rank, world, lost_after, interval
        self.advice, self.on_lost = advice, on_lost
        base = store if store is not None else _default_store()
        prefix = f"moeblaze/peers/{next(_jobs)}"
        self._main = dist.PrefixStore(prefix, base)  # the main thread's, in close()
        self._store = dist.PrefixStore(prefix, _own_client(base))  # the thread's own connection
        self._store.set_timeout(timedelta(seconds=max(lost_after, ALARM_AFTER)))
        self._address = _tcp_address(base)
        self._stop = threading.Event()
        self.verdict: str | None = None
        self._decided = threading.Event()
        self._alarmed = False
        self._pipe: tuple[int, int] | None = None
        self._old_wakeup = -1
        self._thread = threading.Thread(target=self._run, name="moeblaze-heartbeat", daemon=True)

    def start(self) -> PeerMonitor:
        """Beat once (so the watcher's clock starts from a beat), then start the thread. In the main thread the
        signal wake-up fd is taken (and given back by :meth:`close`)."""
        self._store.add(f"beat/{self.rank}", 1)
        if threading.current_thread() is threading.main_thread():
            r, w = os.pipe()
            os.set_blocking(r, False)
            os.set_blocking(w, False)
            self._pipe = (r, w)
            self._old_wakeup = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        self._thread.start()
        return self

    def alarm(self) -> None:
        """Something went wrong in the main thread: count silences from now on with ``ALARM_AFTER``."""
        self._alarmed = True

    def wait_verdict(self, timeout: float) -> str | None:
        """The verdict once one is reached within ``timeout`` seconds, else None."""
        self._decided.wait(timeout)
        return self.verdict

    def check_after_failure(self) -> str | None:
        """After a failed collective: alarm, and wait as long as a verdict on a dead peer takes."""
        self.alarm()
        return self.wait_verdict(ALARM_AFTER + 3 * self.interval)

    def close(self, finished: bool) -> None:
        """Stop beating. ``finished``: this rank leaves normally (the run ended, or an error every rank raised
        alike): mark it and wait, at most ``lost_after``, for every rank's mark; else leave unmarked, so the
        others see a lost rank. Call from the thread that called :meth:`start`."""
        self._stop.set()
        if self._pipe is not None:
            with contextlib.suppress(OSError):
                os.write(self._pipe[1], b"\0")  # wakes the thread at once
        self._thread.join(timeout=self.interval + self.lost_after)
        if self._pipe is not None:
            signal.set_wakeup_fd(self._old_wakeup)
            for fd in self._pipe:
                os.close(fd)
            self._pipe = None
        if finished and self.verdict is None:
            keys = [f"left/{r}" for r in range(self.world)]
            with contextlib.suppress(Exception):  # a rank that left with an error of its own never marks
                self._main.set(keys[self.rank], "1")
                self._main.wait(keys, timedelta(seconds=self.lost_after))

    # ------------------------------------------------------------------------- the thread

    def _run(self) -> None:
        host = self._connect()
        try:
            self._watch(host)
        finally:
            if host is not None:
                host.close()

    def _watch(self, host: socket.socket | None) -> None:
        watched: int | None = (self.rank + 1) % self.world
        seen, changed = -1, time.monotonic()
        store_failed_at: float | None = None
        while not self._tick():
            now = time.monotonic()
            if host is not None and _closed(host):
                return self._decide(self._host_gone())
            try:
                self._store.add(f"beat/{self.rank}", 1)
                if self._store.check(["lost"]):
                    return self._decide(self._store.get("lost").decode())
                if watched is not None and self._store.check([f"left/{watched}"]):
                    watched = None  # it finished: the job is ending
                if watched is not None:
                    beats = self._store.add(f"beat/{watched}", 0)
                    seen, changed = (beats, now) if beats != seen else (seen, changed)
                    silent = now - changed
                    if silent > self._allowed():
                        what = (f"rank {watched} of {self.world} is lost: no heartbeat for {silent:.0f} s "
                                "(its process died, or hangs)")
                        self._store.set("lost", what)
                        return self._decide(what)
                store_failed_at = None
            except Exception as err:  # the store itself: unreachable for lost_after means the job is gone
                store_failed_at = store_failed_at or now
                if now - store_failed_at > self.lost_after:
                    return self._decide(f"the job's store is unreachable ({str(err).splitlines()[0]})")
        return None

    def _tick(self) -> bool:
        """Wait one interval (woken by a signal or by close); True when the monitor is to stop."""
        if self._pipe is None:
            return self._stop.wait(self.interval)
        ready, _, _ = select.select([self._pipe[0]], [], [], self.interval)
        if ready:
            with contextlib.suppress(BlockingIOError):
                if _ALARM_SIGNALS & set(os.read(self._pipe[0], 64)):
                    self.alarm()
        return self._stop.is_set()

    def _allowed(self) -> float:
        """The silence that marks a rank lost: ``lost_after``, after an alarm ``ALARM_AFTER`` (a silence that began
        before the alarm counts: torchrun's SIGTERM follows the death)."""
        return self.lost_after if not self._alarmed else min(self.lost_after, ALARM_AFTER)

    def _connect(self) -> socket.socket | None:
        if self._address is None:
            return None
        try:
            sock = socket.create_connection(self._address, timeout=self.lost_after)
        except OSError:
            return None
        sock.setblocking(False)
        return sock

    def _host_gone(self) -> str:
        where = f"{self._address[0]}:{self._address[1]}"
        if settings.launcher_env().get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            return f"torchrun's agent, which holds the job's store at {where}, is gone"
        return f"rank 0 of {self.world} is lost: it held the job's store at {where}, which closed"

    def _decide(self, what: str) -> None:
        self.verdict = what
        self._decided.set()
        if not self._stop.is_set():
            self.on_lost(f"moeblaze: rank {self.rank}: {what}; stopping this rank{self.advice}")


def _closed(sock: socket.socket) -> bool:
    """The peer closed the connection (its process ended): readable with nothing to read."""
    try:
        ready, _, _ = select.select([sock], [], [], 0)
        return bool(ready) and sock.recv(1) == b""
    except OSError:
        return True
