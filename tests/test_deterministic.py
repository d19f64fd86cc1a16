"""``--deterministic`` (issue 58): nothing chosen by timing, torch's deterministic algorithms, NCCL's ring; run to
run bitwise equal training on one GPU and under FSDP2 on 2, and bitwise ``--resume`` there (``gpu`` /
``multigpu``). On the CPU, where every run is bitwise reproducible anyway, it changes no bit."""

from __future__ import annotations

import argparse
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import fault_runs as fr
import train_workers as tw
from moeblaze import settings
from moeblaze.kernels.tuning import autotune_enabled
from moeblaze.training.determinism import ATTENTION_BACKENDS, deterministic_mode
from moeblaze.training.train import train

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("data") / "text.txt"
    path.write_text(Path(argparse.__file__).read_text()[:40000])  # the standard library's: no edit here moves it
    return str(path)


def _forget_env(monkeypatch, *names: str) -> None:
    """Unset ``names`` for this test and have monkeypatch unset them again afterwards (deterministic_mode sets them
    for the rest of the process)."""
    for name in names:
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


def test_the_setting_turns_autotuning_off(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the interpreter never tunes
    monkeypatch.setenv("MOEBLAZE_AUTOTUNE", "1")
    assert autotune_enabled()
    with settings.override(deterministic=True):
        assert not autotune_enabled()
    monkeypatch.setenv("MOEBLAZE_DETERMINISTIC", "1")
    assert settings.get("deterministic") is True and not autotune_enabled()


def test_deterministic_mode_sets_everything_and_restores_the_flags(monkeypatch):
    _forget_env(monkeypatch, "CUBLAS_WORKSPACE_CONFIG", "NCCL_ALGO", "NCCL_PROTO")

    def flags():
        return (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark,
                settings.get("deterministic"))

    before = flags()
    with deterministic_mode():
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.is_deterministic_algorithms_warn_only_enabled()  # warn_only keeps the atomic backwards
        assert not torch.backends.cudnn.benchmark and settings.get("deterministic") is True
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        assert (os.environ["NCCL_ALGO"], os.environ["NCCL_PROTO"]) == ("Ring", "Simple")
        assert not torch.backends.cuda.cudnn_sdp_enabled()  # cuDNN's attention is not among ATTENTION_BACKENDS
    assert flags() == before and torch.backends.cuda.cudnn_sdp_enabled()
    monkeypatch.setenv("NCCL_ALGO", "Tree")  # a value the user set wins
    with deterministic_mode():
        assert os.environ["NCCL_ALGO"] == "Tree"
    with deterministic_mode(False):
        assert torch.are_deterministic_algorithms_enabled() == before[0]
    assert len(ATTENTION_BACKENDS) == 3


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_deterministic_changes_no_bit_on_the_cpu(backend, text_file, tmp_path, monkeypatch):
    """torch's deterministic mode also fills every new empty tensor with NaN: the same bits here show that no kernel
    (Triton's under the interpreter too) reads memory it did not write."""
    _forget_env(monkeypatch, "CUBLAS_WORKSPACE_CONFIG", "NCCL_ALGO", "NCCL_PROTO")
    if backend == "triton":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    cfg, mcfg = tw.tiny_configs(text_file, str(tmp_path / "plain"))
    cfg, mcfg = replace(cfg, steps=2 if backend == "triton" else 8, eval_tokens=32), replace(mcfg, backend=backend)
    plain = train(cfg, mcfg)
    det = train(replace(cfg, out_dir=str(tmp_path / "det"), deterministic=True), mcfg)
    assert det.losses == plain.losses and det.val_bpb == plain.val_bpb
    assert fr.weights_digest(tmp_path / "det") == fr.weights_digest(tmp_path / "plain")
    assert not torch.are_deterministic_algorithms_enabled()  # restored after the run


def test_the_environment_switch_is_recorded_as_the_flag(text_file, tmp_path, monkeypatch):
    from moeblaze.training.train import load_run_config

    _forget_env(monkeypatch, "CUBLAS_WORKSPACE_CONFIG", "NCCL_ALGO", "NCCL_PROTO")
    monkeypatch.setenv("MOEBLAZE_DETERMINISTIC", "1")
    cfg, mcfg = tw.tiny_configs(text_file, str(tmp_path / "run"))
    train(replace(cfg, steps=2), mcfg)
    assert load_run_config(str(tmp_path / "run"))[0].deterministic is True  # --resume keeps it


# ----------------------------------------------------------------------------- GPUs

def _gpu(text_file: str, out: Path, *extra: str) -> list[str]:
    return fr.train_args(text_file, out, "cuda", ("--deterministic", *extra), sizes=fr.GPU)


def _same_run(a: Path, b: Path) -> None:
    assert fr.losses(a) == fr.losses(b), (fr.losses(a), fr.losses(b))
    assert fr.weights_digest(a) == fr.weights_digest(b)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_deterministic_runs_and_resume_are_bitwise_equal(text_file, tmp_path):
    """Two runs of ``moeblaze train --device cuda --deterministic`` (separate processes: each would autotune on its
    own), and one killed (SIGKILL) right after its step-4 checkpoint then resumed: equal losses, equal weights."""
    for name in ("a", "b"):
        (code, _, err, _), = fr.srun(_gpu(text_file, tmp_path / name), world=1, device="cuda", timeout=300)
        assert code == 0, err[-3000:]
    _same_run(tmp_path / "a", tmp_path / "b")
    killed = tmp_path / "killed"
    (code, *_), = fr.srun(_gpu(text_file, killed), ("--kill-rank", "0", "--kill-step", "5"), world=1, device="cuda",
                          timeout=300)
    assert code == -9 and [p.name for p in (killed / "checkpoints").iterdir() if p.name.startswith("step")] == [
        "step-000004"]
    (code, _, err, _), = fr.srun(_gpu(text_file, killed, "--resume"), world=1, device="cuda", timeout=300)
    assert code == 0, err[-3000:]
    _same_run(killed, tmp_path / "a")


@pytest.mark.multigpu
@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.device_count() >= 2), reason="needs 2 CUDA GPUs")
def test_two_gpus_fsdp_deterministic_runs_and_resume_are_bitwise_equal(text_file, tmp_path):
    """The same under ``torchrun --nproc-per-node 2 ... --fsdp --deterministic`` (NCCL reduce-scatters)."""
    for name in ("a", "b"):
        proc, _ = fr.torchrun(_gpu(text_file, tmp_path / name, "--fsdp"), device="cuda", timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
    _same_run(tmp_path / "a", tmp_path / "b")
    killed = tmp_path / "killed"
    proc, _ = fr.torchrun(_gpu(text_file, killed, "--fsdp"), ("--kill-rank", "1", "--kill-step", "5"), device="cuda",
                          timeout=300)
    assert proc.returncode != 0
    proc, _ = fr.torchrun(_gpu(text_file, killed, "--fsdp", "--resume"), device="cuda", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _same_run(killed, tmp_path / "a")
