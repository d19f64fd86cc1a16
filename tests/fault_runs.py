"""Multi-rank ``moeblaze train`` runs for the fault tests, launched the two ways a job starts: torchrun, or one
process per rank with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set (as SLURM's srun starts them); every wait
has a timeout. Ranks run ``tests/fault_worker.py`` (faults injected there).

Run as a script (``python tests/fault_runs.py disk-full SPEC``) it is the driver of the full-disk scenario, run
inside the mount namespace that holds the size-limited tmpfs: it prints one JSON line of findings.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKER = str(ROOT / "tests" / "fault_worker.py")

# 2 ranks, FSDP2 + expert parallelism over both (the checkpoints hold global expert DTensors), 12 steps, a
# checkpoint every 4: small enough for 2 shared CPU cores
MICRO = ["--steps", "12", "--batch-size", "4", "--seq-len", "16", "--d-model", "16", "--n-layers", "1", "--n-heads",
         "2", "--d-ff", "8", "--num-experts", "4", "--top-k", "2", "--eval-tokens", "32", "--eval-interval", "6",
         "--checkpoint-interval", "4", "--checkpoint-minutes", "0", "--warmup-steps", "2", "--threads", "1",
         "--backend", "torch", "--no-progress", "--fsdp", "--ep", "2"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(device: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    # NVLink multicast off: a fault in it can take the host's GPUs out of service
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    if device == "cpu":
        env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


# GPU runs: the Triton kernels in bf16 on shapes they tile (d, h multiples of 64), one process or --fsdp
GPU = ["--steps", "8", "--batch-size", "8", "--seq-len", "64", "--d-model", "128", "--n-layers", "2", "--n-heads", "4",
       "--d-ff", "64", "--num-experts", "8", "--top-k", "2", "--eval-tokens", "1024", "--eval-interval", "8",
       "--checkpoint-interval", "4", "--checkpoint-minutes", "0", "--warmup-steps", "2", "--backend", "triton",
       "--precision", "bf16-mixed", "--no-progress"]


def train_args(data: str, out_dir: str | Path, device: str = "cpu", extra: tuple = (),
               sizes: list = MICRO) -> list[str]:
    return ["train", "--data", data, "--out-dir", str(out_dir), "--device", device, *sizes, *extra]


def torchrun(args: list[str], faults: tuple = (), world: int = 2, timeout: float = 240, device: str = "cpu",
             log_dir: Path | None = None) -> tuple[subprocess.CompletedProcess, float]:
    """``torchrun --nproc-per-node world tests/fault_worker.py FAULTS ARGS``; with ``log_dir`` each rank's
    output goes to ``log_dir/.../<local rank>/{stdout,stderr}.log`` (:func:`rank_log`). Returns the process and
    the time it ended."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), "--master-port",
           str(free_port())]
    if log_dir is not None:
        cmd += ["--log-dir", str(log_dir), "--redirects", "3"]
    proc = subprocess.run([*cmd, WORKER, *faults, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=_env(device))
    return proc, time.time()


def rank_log(log_dir: Path, rank: int, stream: str = "stderr") -> str:
    found = sorted(log_dir.rglob(f"{rank}/{stream}.log"))
    return found[-1].read_text() if found else ""


def srun(args: list[str], faults: tuple = (), world: int = 2, timeout: float = 240,
         device: str = "cpu") -> list[tuple[int, str, str, float]]:
    """One process per rank, RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT set here and no launcher
    watching them: ``[(exit code, stdout, stderr, time it ended)]`` by rank (a rank still running after ``timeout``
    is killed: exit code None)."""
    port, procs = free_port(), []
    for rank in range(world):
        env = dict(_env(device), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, WORKER, *faults, *args], cwd=ROOT, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    deadline, results = time.monotonic() + timeout, []
    for p in procs:
        try:
            out, err = p.communicate(timeout=max(deadline - time.monotonic(), 1))
            results.append((p.returncode, out, err, time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate(timeout=30)
            results.append((None, out, err, time.time()))
    return results


def losses(out_dir: str | Path) -> list[tuple[str, str, str]]:
    """``(step, loss, val_bpb)`` of every row of the run's metrics.csv."""
    import csv

    with open(Path(out_dir) / "metrics.csv") as f:
        return [(r["step"], r["loss"], r["val_bpb"]) for r in csv.DictReader(f)]


def weights_digest(out_dir: str | Path) -> str:
    """SHA-256 over the names, dtypes and bytes of the final weights (the newest checkpoint, loaded in one process)."""
    import torch

    from moeblaze.training.export import load_model

    model = load_model(out_dir)
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def killed_at(out_dir: str | Path) -> float:
    return float((Path(out_dir) / "killed-at").read_text())


def _disk_full(spec: dict) -> dict:
    """Inside the tmpfs ``spec["mount"]`` (room for about 2.5 checkpoints, sized by the test): a 2-rank run whose
    step-8 checkpoint finds the disk full with nothing older to delete (``--keep-checkpoints 1``, a ballast file of
    one checkpoint's size beside it), then, ballast gone, a run of 12 steps keeping 2 whose step-12 checkpoint makes
    room by deleting step 4 and goes on."""
    from moeblaze.training import checkpoint

    mount, data = Path(spec["mount"]), spec["data"]
    found: dict = {}
    ballast = mount / "ballast"
    ballast.write_bytes(bytes(spec["ballast"]))
    out = mount / "full"
    runs = srun(train_args(data, out, extra=("--keep-checkpoints", "1", "--steps", "8")))
    found["full"] = {"codes": [r[0] for r in runs], "stderr": [r[2] for r in runs],
                     "latest": getattr(checkpoint.find_latest(out, warn=None), "name", None),
                     "entries": sorted(p.name for p in (out / "checkpoints").iterdir()), "rows": len(losses(out))}
    checkpoint.verify(out / "checkpoints" / "step-000004")
    ballast.unlink()
    subprocess.run(["rm", "-rf", str(out)], check=True)
    out = mount / "room"
    runs = srun(train_args(data, out, extra=("--keep-checkpoints", "2")))
    found["room"] = {"codes": [r[0] for r in runs], "stdout": runs[0][1], "stderr": [r[2] for r in runs],
                     "checkpoints": [p.name for p in checkpoint.checkpoint_dirs(out)],
                     "losses": losses(out), "digest": weights_digest(out)}
    return found


if __name__ == "__main__":
    if sys.argv[1] == "disk-full":
        print(json.dumps(_disk_full(json.loads(sys.argv[2]))))
