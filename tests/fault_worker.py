"""``moeblaze`` with a fault injected, one rank of a multi-rank test run (under torchrun, or started with RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT set, as SLURM's srun starts each rank):

    python tests/fault_worker.py [--kill-rank R (--kill-step S | --kill-in-save N)] [--logits FILE] train ...

``--kill-step S``: rank R SIGKILLs itself as its S-th optimizer step of this process starts. ``--kill-in-save N``:
rank R SIGKILLs itself in the middle of the DCP write of its N-th checkpoint (after its first item is written).
Before dying it writes the time to ``<out-dir>/killed-at`` (the test measures from there). ``--logits FILE``:
after the training loop, every rank runs the run's model on :data:`PROBE` (rank 0 saves the logits), so a test
can compare them with the exported weights'.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import torch

PROBE = (torch.arange(2 * 16).reshape(2, 16) * 37 % 256).long()  # [2, 16] byte values


def _die(out_dir: str) -> None:
    (Path(out_dir) / "killed-at").write_text(repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)


def _kill_at_step(out_dir: str, step: int) -> None:
    import moeblaze.training.train as train_mod

    real, steps_run = train_mod.train_step, []

    def step_then_die(*args, **kwargs):
        steps_run.append(1)
        if len(steps_run) == step:
            _die(out_dir)
        return real(*args, **kwargs)

    train_mod.train_step = step_then_die


def _kill_in_save(out_dir: str, nth: int) -> None:
    import torch.distributed.checkpoint.filesystem as dcp_fs

    from moeblaze.training import checkpoint

    real_save, real_write, saves = checkpoint.save, dcp_fs._write_item, []

    def counted_save(*args, **kwargs):
        saves.append(1)
        return real_save(*args, **kwargs)

    def write_then_die(transforms, stream, *args, **kwargs):
        result = real_write(transforms, stream, *args, **kwargs)
        if len(saves) == nth:  # this rank's shard file is half written
            stream.flush()
            _die(out_dir)
        return result

    checkpoint.save = counted_save
    dcp_fs._write_item = write_then_die


def _save_logits(path: str) -> None:
    import moeblaze.training.train as train_mod

    real = train_mod._loop

    def loop_then_probe(model, *args, **kwargs):
        result = real(model, *args, **kwargs)
        model.eval()
        with torch.no_grad():  # every rank: FSDP2 gathers the weights, expert parallelism exchanges tokens
            logits = model(PROBE)
        if int(os.environ.get("RANK", "0")) == 0:
            torch.save(logits.float(), path)
        return result

    train_mod._loop = loop_then_probe


def main() -> None:
    split = sys.argv.index("train")  # the moeblaze command line starts there
    parser = argparse.ArgumentParser()
    parser.add_argument("--kill-rank", type=int, default=-1)
    parser.add_argument("--kill-step", type=int, default=0)
    parser.add_argument("--kill-in-save", type=int, default=0)
    parser.add_argument("--logits", default="")
    args = parser.parse_args(sys.argv[1:split])
    argv = sys.argv[split:]
    out_dir = argv[argv.index("--out-dir") + 1]
    if int(os.environ.get("RANK", "0")) == args.kill_rank:
        if args.kill_step:
            _kill_at_step(out_dir, args.kill_step)
        if args.kill_in_save:
            _kill_in_save(out_dir, args.kill_in_save)
    if args.logits:
        _save_logits(args.logits)
    from moeblaze.cli import main as cli_main

    cli_main(argv)


if __name__ == "__main__":
    main()
