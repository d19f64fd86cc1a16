"""Reliable runs on many ranks (issue 58): a dead rank ends the others with one line naming it (under torchrun
within 10 s; with each rank started as its own process within ``--dist-timeout``) and ``--resume`` then ends
bitwise equal to an uninterrupted run; a rank killed in the middle of a checkpoint write and a full disk lose no
checkpoint; the weights of a 2-rank ``--fsdp --ep 2`` checkpoint leave as safetensors. 2 gloo ranks on the CPU
(every wait has a timeout); the same on GPUs under ``gpu`` / ``multigpu``."""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import fault_runs as fr
from dist_utils import run_ranks
from fault_worker import PROBE
from moeblaze.training import checkpoint

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("data") / "text.txt"
    path.write_text(Path(argparse.__file__).read_text()[:40000])  # the standard library's: no edit here moves it
    return str(path)


@pytest.fixture(scope="module")
def reference(text_file, tmp_path_factory) -> dict:
    """The uninterrupted 2-rank run (torchrun, --fsdp --ep 2): its metrics, final weights and final logits."""
    out = tmp_path_factory.mktemp("reference") / "run"
    logits = out.parent / "logits.pt"
    proc, _ = fr.torchrun(fr.train_args(text_file, out), faults=("--logits", str(logits)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"out": out, "losses": fr.losses(out), "digest": fr.weights_digest(out), "logits": torch.load(logits)}


def _one_line(stderr: str, words: str) -> None:
    """``words`` on exactly one line of a rank's stderr, and no traceback there."""
    lines = [line for line in stderr.splitlines() if words in line]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr[-3000:]


def _resumed_equals_reference(out: Path, reference: dict) -> None:
    assert fr.losses(out) == reference["losses"], (fr.losses(out), reference["losses"])
    assert fr.weights_digest(out) == reference["digest"]


def test_torchrun_survivor_names_the_dead_rank_within_10_s_and_resume_is_bitwise(text_file, reference, tmp_path):
    out, logs = tmp_path / "run", tmp_path / "logs"
    proc, ended = fr.torchrun(fr.train_args(text_file, out), faults=("--kill-rank", "1", "--kill-step", "7"),
                              log_dir=logs)
    assert proc.returncode != 0
    assert ended - fr.killed_at(out) < 10, ended - fr.killed_at(out)
    _one_line(fr.rank_log(logs, 0), "rank 1 of 2 is lost")
    assert checkpoint.find_latest(out, warn=None).name == "step-000004"
    proc, _ = fr.torchrun(fr.train_args(text_file, out, extra=("--resume",)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    _resumed_equals_reference(out, reference)


def test_ranks_started_alone_survivor_exits_within_dist_timeout_and_resume_is_bitwise(text_file, reference, tmp_path):
    """No launcher watches the ranks (as srun starts them); rank 0, which holds the job's store, is killed."""
    out = tmp_path / "run"
    runs = fr.srun(fr.train_args(text_file, out, extra=("--dist-timeout", "20")),
                   faults=("--kill-rank", "0", "--kill-step", "7"))
    (code0, *_), (code1, _, err1, ended1) = runs
    assert code0 == -9 and code1 == 3, (code0, code1, err1[-3000:])
    assert ended1 - fr.killed_at(out) < 20, ended1 - fr.killed_at(out)
    _one_line(err1, "rank 0 of 2 is lost")
    runs = fr.srun(fr.train_args(text_file, out, extra=("--resume",)))
    assert [r[0] for r in runs] == [0, 0], runs[0][2][-3000:]
    _resumed_equals_reference(out, reference)


def test_a_rank_killed_in_the_middle_of_a_checkpoint_write_leaves_the_previous_one(text_file, reference, tmp_path):
    out = tmp_path / "run"
    runs = fr.srun(fr.train_args(text_file, out), faults=("--kill-rank", "1", "--kill-in-save", "2"))
    (code0, _, err0, _), (code1, *_) = runs
    assert (code0, code1) == (3, -9), (code0, code1, err0[-3000:])
    _one_line(err0, "rank 1 of 2 is lost")
    entries = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert ".step-000008.tmp" in entries and "step-000008" not in entries, entries
    assert checkpoint.find_latest(out, warn=None).name == "step-000004"
    runs = fr.srun(fr.train_args(text_file, out, extra=("--resume",)))
    assert [r[0] for r in runs] == [0, 0], runs[0][2][-3000:]
    _resumed_equals_reference(out, reference)


def _tmpfs_command(mount: Path, size: int) -> list[str] | None:
    """A shell prefix that mounts a ``size``-byte tmpfs on ``mount`` (as root, else in a mount namespace of its
    own: ``unshare -rm``), or None when neither works here."""
    mount.mkdir(parents=True, exist_ok=True)
    for prefix in ([], ["unshare", "-rm"]):
        probe = subprocess.run([*prefix, "sh", "-c", f"mount -t tmpfs -o size={size} tmpfs {mount} && umount {mount}"],
                               capture_output=True, text=True)
        if probe.returncode == 0:
            return prefix
    return None


def test_a_full_disk_during_a_checkpoint_write_is_one_line_and_keeps_the_previous_one(text_file, reference,
                                                                                      tmp_path):
    step4 = reference["out"] / "checkpoints" / "step-000004"
    pages = sum(-(-f.stat().st_size // 4096) * 4096 for f in step4.iterdir())  # tmpfs allocates whole pages
    mount = tmp_path / "disk"
    prefix = _tmpfs_command(mount, 1 << 20)
    if prefix is None:
        pytest.skip("cannot mount a tmpfs here (neither as root nor with unshare -rm)")
    spec = {"mount": str(mount), "data": text_file, "ballast": pages}
    script = (f"mount -t tmpfs -o size={5 * pages // 2 + (64 << 10)} tmpfs {mount} && "
              f"{sys.executable} {ROOT / 'tests' / 'fault_runs.py'} disk-full '{json.dumps(spec)}'; "
              f"rc=$?; umount {mount}; exit $rc")
    proc = subprocess.run([*prefix, "sh", "-c", script], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    full = found["full"]
    assert full["codes"] == [2, 2], full
    for err in full["stderr"]:  # one line on each rank, naming the folder and the space
        _one_line(err, "cannot write the checkpoint of step 8")
        line = next(x for x in err.splitlines() if "step 8" in x)
        assert "disk full" in line and str(mount / "full" / "checkpoints") in line and "free of" in line, line
    assert full["latest"] == "step-000004" and full["entries"] == ["latest", "step-000004"], full
    assert full["rows"] == 8  # every finished step's row
    room = found["room"]
    assert room["codes"] == [0, 0], room["stderr"]
    assert "disk full at the checkpoint of step 12: deleted step-000004" in room["stdout"]
    assert room["checkpoints"] == ["step-000008", "step-000012"]
    assert [tuple(r) for r in room["losses"]] == reference["losses"] and room["digest"] == reference["digest"]


def test_export_of_a_two_rank_ep_checkpoint_loads_with_safetensors_alone(reference, tmp_path, capsys):
    from safetensors import safe_open
    from safetensors.torch import load_file

    from moeblaze.cli import main
    from moeblaze.training.export import export, load_model
    from moeblaze.training.model import ModelConfig, MoETransformer
    from moeblaze.training.train import sample

    files = export(reference["out"], tmp_path / "model.safetensors")
    assert files == [tmp_path / "model.safetensors"]
    with safe_open(str(files[0]), "pt") as f:  # safetensors alone: the configuration, the full tensors
        meta = f.metadata()
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    assert meta["format"] == "pt" and meta["moeblaze_step"] == "12"
    cfg = ModelConfig(**json.loads(meta["moeblaze_model_config"]))
    assert tensors["blocks.0.moe.w_gate_up"].shape == (cfg.num_experts, 2 * cfg.d_ff, cfg.d_model)
    model = MoETransformer(cfg)
    model.load_state_dict({**tensors, "head.weight": tensors["embed.weight"]})  # tied: stored once
    with torch.no_grad():
        logits = model.eval()(PROBE)
    # the run's model on 2 ranks (FSDP2 + EP: its sums in another order) against one process
    torch.testing.assert_close(logits, reference["logits"], rtol=1e-4, atol=1e-5)
    with torch.no_grad():  # the checkpoint itself, loaded in one process: bitwise the export
        assert torch.equal(load_model(reference["out"])(PROBE), logits)
        assert torch.equal(load_model(files[0])(PROBE), logits)
    # sharded above --max-shard-size, with transformers' index; loads the same
    with pytest.raises(SystemExit) as exit_info:
        main(["export", "--checkpoint", str(reference["out"]), "--out", str(tmp_path / "sh" / "model.safetensors"),
              "--max-shard-size", "8000"])
    assert exit_info.value.code == 0
    index = json.loads((tmp_path / "sh" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors", shards
    assert set(index["weight_map"]) == set(tensors) and index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in tensors.values())
    merged = {k: v for s in shards for k, v in load_file(str(tmp_path / "sh" / s)).items()}
    assert all(torch.equal(merged[k], tensors[k]) for k in tensors)
    with torch.no_grad():
        assert torch.equal(load_model(tmp_path / "sh" / "model.safetensors")(PROBE), logits)
    # sampling reads the export as it reads the checkpoint
    kw = {"prompt": "def ", "max_new_tokens": 12, "temperature": 0.0, "device": "cpu"}
    assert sample(str(files[0]), **kw) == sample(str(reference["out"]), **kw)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(["sample", "--checkpoint", str(files[0]), "--prompt", "def ", "--max-new-tokens", "12",
              "--temperature", "0"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.strip() == sample(str(files[0]), **kw).strip()


def test_export_keeps_the_dtype_the_run_trained_in(text_file, tmp_path):
    """--precision bf16 (bf16 parameters): bf16 tensors out, and back in."""
    from dataclasses import replace

    from safetensors.torch import load_file

    import train_workers as tw
    from moeblaze.training.export import export, load_model
    from moeblaze.training.train import train

    cfg, mcfg = tw.tiny_configs(text_file, str(tmp_path / "run"))
    train(replace(cfg, steps=2, precision="bf16"), mcfg)
    (file,) = export(tmp_path / "run", tmp_path / "out" / "bf16.safetensors")
    tensors = load_file(str(file))
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    model = load_model(file)
    assert all(torch.equal(p, tensors[n]) for n, p in model.named_parameters())


@pytest.mark.parametrize("bad", ["model.bin", "8x"])
def test_export_bad_arguments_are_one_line_errors(reference, tmp_path, capsys, bad):
    from moeblaze.cli import main

    out, size = (str(tmp_path / bad), "5GB") if bad.endswith(".bin") else (str(tmp_path / "m.safetensors"), bad)
    with pytest.raises(SystemExit) as exit_info:
        main(["export", "--checkpoint", str(reference["out"]), "--out", out, "--max-shard-size", size])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1, err
    assert ("--out" if bad.endswith(".bin") else "--max-shard-size") in err, err


# ----------------------------------------------------------------------------- the heartbeat itself

def _silent_peer(rank: int, world: int, results) -> None:
    """Rank 1 stops beating without leaving; rank 0 (lost_after 30 s) is alarmed by a SIGTERM it sends itself,
    seen through the wake-up fd while its main thread waits in C code: the verdict comes within about 6 s."""
    import signal

    import torch.distributed as dist

    from moeblaze.training.checkpoint import StopOnSignal
    from moeblaze.training.heartbeat import PeerMonitor

    verdicts: list[str] = []
    monitor = PeerMonitor(rank, world, lost_after=30.0, on_lost=verdicts.append).start()
    dist.barrier()
    if rank == 1:
        monitor.close(finished=False)
        results["left"] = time.monotonic()
    else:
        with StopOnSignal():
            time.sleep(2)
            start = time.monotonic()
            os.kill(os.getpid(), signal.SIGTERM)
            verdict = monitor.wait_verdict(20)  # a wait in C code, as a collective is
            results.update(verdict=verdict, seconds=time.monotonic() - start, lines=verdicts)
        monitor.close(finished=False)


def test_a_silent_rank_is_named_soon_after_a_sigterm():
    import multiprocessing

    with multiprocessing.Manager() as manager:
        results = manager.dict()
        run_ranks(_silent_peer, 2, results, timeout=120)
        r = dict(results)
    assert r["verdict"].startswith("rank 1 of 2 is lost: no heartbeat for"), r
    assert r["seconds"] < 10, r
    assert r["lines"] == [f"moeblaze: rank 0: {r['verdict']}; stopping this rank"], r


# ----------------------------------------------------------------------------- GPUs

def _gpu_args(text_file: str, out: Path, *extra: str) -> list[str]:
    return fr.train_args(text_file, out, "cuda", ("--fsdp", *extra), sizes=fr.GPU)


@pytest.mark.multigpu
@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.device_count() >= 2), reason="needs 2 CUDA GPUs")
def test_two_gpus_dead_rank_is_named_and_resume_continues(text_file, tmp_path):
    """NCCL: a survivor blocked in a collective with the dead rank exits (torchrun: within 10 s; ranks started
    alone: within --dist-timeout) with one line naming it; --resume then finishes the run."""
    out, logs = tmp_path / "torchrun", tmp_path / "logs"
    proc, ended = fr.torchrun(_gpu_args(text_file, out), ("--kill-rank", "1", "--kill-step", "6"), device="cuda",
                              log_dir=logs)
    assert proc.returncode != 0 and ended - fr.killed_at(out) < 10, ended - fr.killed_at(out)
    _one_line(fr.rank_log(logs, 0), "rank 1 of 2 is lost")
    proc, _ = fr.torchrun(_gpu_args(text_file, out, "--resume"), device="cuda")
    assert proc.returncode == 0 and len(fr.losses(out)) == 8, proc.stderr[-3000:]
    out = tmp_path / "alone"
    runs = fr.srun(_gpu_args(text_file, out, "--dist-timeout", "30"), ("--kill-rank", "1", "--kill-step", "6"),
                   device="cuda")
    (code0, _, err0, ended0), (code1, *_) = runs
    assert (code0, code1) == (3, -9) and ended0 - fr.killed_at(out) < 30, (code0, code1, err0[-3000:])
    _one_line(err0, "rank 1 of 2 is lost")


def test_silence_that_marks_a_rank_lost():
    """Half of --dist-timeout, at most 30 s (the default 300 s: 30 s)."""
    from moeblaze.training.heartbeat import lost_after

    assert lost_after(300.0) == 30.0 and lost_after(20.0) == 10.0 and math.isclose(lost_after(10.0), 5.0)
