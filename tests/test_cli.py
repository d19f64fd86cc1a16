"""The command line for a new user: numbered run folders (the first command run twice), no progress-bar frames in a
log, a resumed finished run's final validation, ``--version``, ``--config`` / ``--print-config``, ``--logger``."""

from __future__ import annotations

import csv
import importlib.metadata
import os
import signal
import subprocess
import sys
import sysconfig
from dataclasses import replace
from pathlib import Path

import pytest

import moeblaze
import moeblaze.training.train as train_mod
from moeblaze.cli import main
from moeblaze.training import checkpoint
from moeblaze.training.config_file import read_config
from moeblaze.training.model import ModelConfig
from moeblaze.training.train import TrainConfig, train

MICRO = ["--seq-len", "16", "--d-model", "16", "--n-layers", "1", "--n-heads", "2", "--d-ff", "16",
         "--num-experts", "4", "--top-k", "2", "--batch-size", "4", "--eval-tokens", "64", "--warmup-steps", "1",
         "--threads", "1"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    path = tmp_path_factory.mktemp("data") / "corpus.py"
    path.write_bytes((stdlib / "textwrap.py").read_bytes() + (stdlib / "string.py").read_bytes())
    return path


def run_cli(*args: str) -> int:
    with pytest.raises(SystemExit) as exc:
        main(list(args))
    return exc.value.code


def _val_rows(out: Path) -> dict[int, float]:
    with open(out / "metrics.csv", newline="") as fh:
        return {int(r["step"]): float(r["val_bpb"]) for r in csv.DictReader(fh) if r["val_bpb"]}


# ----------------------------------------------------------------------------- numbered run folders

def test_the_same_command_twice_writes_two_numbered_runs(corpus, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    args = ("train", "--data", str(corpus), "--steps", "2", "--no-progress", *MICRO)
    assert run_cli(*args) == 0
    assert run_cli(*args) == 0  # the README's first command, run again: a new folder, the first run untouched
    root = tmp_path / "moeblaze-out"
    assert sorted(p.name for p in root.iterdir()) == ["run_0", "run_1"]
    for run in ("run_0", "run_1"):
        assert [p.name for p in checkpoint.checkpoint_dirs(root / run)] == ["step-000002"]
    assert "out-dir moeblaze-out/run_1" in capsys.readouterr().out
    (root / "run_7").mkdir()  # the next is one above the highest number, as Lightning's version_N
    assert run_cli("train", "--device", "tpu", *args[1:]) == 2  # a run that never started leaves no folder
    assert sorted(p.name for p in root.iterdir()) == ["run_0", "run_1", "run_7"]
    assert run_cli(*args) == 0
    assert checkpoint.checkpoint_dirs(root / "run_8")
    # an explicit --out-dir keeps its rule: a folder with a checkpoint is refused without --resume / --overwrite
    assert run_cli(*args, "--out-dir", str(root / "run_0")) == 2
    assert "holds a checkpoint" in capsys.readouterr().err


def test_resume_sample_export_and_plot_take_the_newest_run(corpus, tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    monkeypatch.chdir(tmp_path)
    base = ("train", "--data", str(corpus), "--no-progress", *MICRO)
    assert run_cli(*base, "--steps", "2") == 0
    assert run_cli(*base, "--steps", "4", "--stop-after", "2") == 0  # run_1, stopped halfway
    root = tmp_path / "moeblaze-out"
    capsys.readouterr()
    assert run_cli("train", "--resume", "--no-progress") == 0  # no --out-dir: the newest run, run_1
    assert "resuming at step 2" in capsys.readouterr().out
    assert [p.name for p in checkpoint.checkpoint_dirs(root / "run_1")][-1] == "step-000004"
    assert [p.name for p in checkpoint.checkpoint_dirs(root / "run_0")] == ["step-000002"]
    (root / "run_2").mkdir()  # a newer run that never wrote anything is passed over
    old_mask = os.umask(0o027)
    try:
        assert run_cli("export", "--out", str(tmp_path / "model.safetensors")) == 0
    finally:
        os.umask(old_mask)
    assert (tmp_path / "model.safetensors").stat().st_mode & 0o777 == 0o640  # as the umask leaves a new file
    assert "(step 4)" in _export_step(tmp_path / "model.safetensors")
    assert run_cli("sample", "--max-new-tokens", "4", "--prompt", "def ") == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("def ")
    assert run_cli("plot") == 0
    assert (root / "run_1" / "loss.png").is_file() and not (root / "run_0" / "loss.png").exists()


def test_the_ranks_of_a_job_share_one_numbered_run(corpus, tmp_path):
    """Under torchrun each rank names the next number itself (none creates it before all have): one folder."""
    from dist_utils import free_port

    (tmp_path / "moeblaze-out" / "run_3").mkdir(parents=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "-m", "moeblaze.cli", "train", "--fsdp", "--data", str(corpus), "--steps", "2", "--device", "cpu",
           "--backend", "torch", "--no-progress", *MICRO]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "moeblaze-out").iterdir()) == ["run_3", "run_4"]
    assert [p.name for p in checkpoint.checkpoint_dirs(tmp_path / "moeblaze-out" / "run_4")] == ["step-000002"]


def _export_step(path: Path) -> str:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return f"(step {f.metadata()['moeblaze_step']})"


# ----------------------------------------------------------------------------- progress bar

def test_no_bar_frames_when_stderr_is_not_a_terminal_and_progress_forces_the_bar(corpus, tmp_path):
    def run(*flags):
        cmd = [sys.executable, "-m", "moeblaze", "train", "--data", str(corpus), "--steps", "4", "--eval-interval",
               "2", *MICRO, *flags]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)

    plain = run("--out-dir", str(tmp_path / "a"))  # stderr is a pipe, as in a log file
    assert plain.returncode == 0, plain.stderr
    assert "\r" not in plain.stderr + plain.stdout and "train:" not in plain.stderr + plain.stdout
    assert [line.split(":")[0] for line in plain.stdout.splitlines() if line.startswith("step ")] == ["step 2",
                                                                                                   "step 4"]
    forced = run("--out-dir", str(tmp_path / "b"), "--progress")
    assert forced.returncode == 0, forced.stderr
    assert "train:" in forced.stderr and "4/4" in forced.stderr


# ----------------------------------------------------------------------------- a resumed finished run

def test_resumed_finished_run_prints_its_final_validation_from_metrics(corpus, tmp_path, capsys):
    out = tmp_path / "run"
    assert run_cli("train", "--data", str(corpus), "--steps", "3", "--out-dir", str(out), "--no-progress",
                   *MICRO) == 0
    final = _val_rows(out)[3]
    capsys.readouterr()
    assert run_cli("train", "--resume", "--out-dir", str(out), "--no-progress") == 0
    said = capsys.readouterr().out
    assert "already finished" in said and f"val {final:.3f} bits/byte (metrics.csv)" in said


def test_a_run_stopped_by_a_signal_in_its_last_step_evaluates_when_resumed(corpus, tmp_path, monkeypatch):
    """SIGINT during the last step: the step is checkpointed but not evaluated; the resumed run evaluates it once,
    the figure of an uninterrupted run."""
    cfg = TrainConfig(data=str(corpus), steps=3, batch_size=4, progress=False, threads=1, eval_tokens=64,
                      warmup_steps=1)
    mcfg = ModelConfig(seq_len=16, d_model=16, n_layers=1, n_heads=2, d_ff=16, num_experts=4, top_k=2)
    whole = train(replace(cfg, out_dir=str(tmp_path / "whole")), mcfg, log=lambda *a: None)

    real_step, started = train_mod.train_step, []

    def step_then_sigint(*args, **kwargs):
        started.append(1)
        if len(started) == 3:
            os.kill(os.getpid(), signal.SIGINT)  # caught by the run (StopOnSignal): checkpoint and stop
        return real_step(*args, **kwargs)

    cut = str(tmp_path / "cut")
    monkeypatch.setattr(train_mod, "train_step", step_then_sigint)
    stopped = train(replace(cfg, out_dir=cut), mcfg, log=lambda *a: None)
    monkeypatch.undo()
    assert stopped.status == "SIGINT" and stopped.step == 3 and 3 not in _val_rows(Path(cut))
    said = []
    resumed = train(replace(cfg, out_dir=cut, resume=True), None, log=said.append)
    assert resumed.status == "finished" and resumed.val_bpb == whole.val_bpb  # bitwise on the CPU
    assert f"val {whole.val_bpb:.3f} bits/byte (evaluated now)" in said[-1]


# ----------------------------------------------------------------------------- --version

def test_version_is_the_installed_package_version(capsys):
    assert run_cli("--version") == 0
    assert capsys.readouterr().out.strip() == f"moeblaze {moeblaze.__version__}"
    assert moeblaze.__version__ == importlib.metadata.version("moeblaze")


# ----------------------------------------------------------------------------- --config and --print-config

def test_an_expert_parallel_run_resumes_without_ep(tmp_path, monkeypatch, capsys):
    """Saved with ``--ep 2 --ep-exchange padded``, resumed with ``--ep 1``: the saved exchange is dropped (it belongs
    to expert parallelism), not an error; named again with ``--ep 1`` it is one."""
    import moeblaze.cli

    saved = TrainConfig(fsdp=True, ep=2, ep_exchange="padded", out_dir=str(tmp_path))
    monkeypatch.setattr(moeblaze.cli, "load_run_config", lambda out_dir: (saved, ModelConfig(), 5))
    assert run_cli("train", "--resume", "--out-dir", str(tmp_path), "--ep", "1", "--print-config") == 0
    text = capsys.readouterr().out
    assert 'ep_exchange = "auto"' in text and "ep = 1" in text, text
    assert run_cli("train", "--resume", "--out-dir", str(tmp_path), "--print-config") == 0
    assert 'ep_exchange = "padded"' in capsys.readouterr().out
    assert run_cli("train", "--resume", "--out-dir", str(tmp_path), "--ep", "1", "--ep-exchange", "padded") == 2
    assert "--ep-exchange padded is expert parallelism's exchange" in capsys.readouterr().err


def test_print_config_reads_back_equal_through_config(tmp_path, capsys):
    flags = ("--steps", "7", "--lr", "0.002", "--d-model", "64", "--routing", "token-rounding:up", "--no-fsdp-reshard",
             "--data", 'a "quoted"\\path\tx', "--logger", "tensorboard", "--rope-base", "500000")
    assert run_cli("train", *flags, "--print-config") == 0
    text = capsys.readouterr().out
    path = tmp_path / "run.toml"
    path.write_text(text)
    t, m = read_config(path)
    assert (t["steps"], t["lr"], t["fsdp_reshard"], t["data"], t["logger"]) == (7, 0.002, False,
                                                                                'a "quoted"\\path\tx', "tensorboard")
    assert (m["d_model"], m["routing"], m["rope_base"]) == (64, "token-rounding:up", 500000.0)
    assert "out_dir" not in t and "progress" not in t  # unset: a numbered run folder, a bar on a terminal only
    assert run_cli("train", "--config", str(path), "--print-config") == 0
    assert capsys.readouterr().out == text
    # flags override the file
    assert run_cli("train", "--config", str(path), "--steps", "9", "--print-config") == 0
    t2, _ = read_config(_write(tmp_path / "again.toml", capsys.readouterr().out))
    assert t2["steps"] == 9 and t2["lr"] == 0.002


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_a_config_file_trains(corpus, tmp_path):
    cfg = _write(tmp_path / "tiny.toml", f'data = "{corpus}"\nsteps = 2\nbatch_size = 4\nlr = 1\nmin_lr = 0\n'
                 f'out_dir = "{tmp_path / "out"}"\nseq_len = 16\nd_model = 16\nn_layers = 1\nn_heads = 2\nd_ff = 16\n'
                 "eval_tokens = 64\nthreads = 1\nwarmup_steps = 1\nprogress = false\n")
    assert run_cli("train", "--config", str(cfg), "--steps", "1") == 0  # --steps 1 over the file's 2
    assert [p.name for p in checkpoint.checkpoint_dirs(tmp_path / "out")] == ["step-000001"]


@pytest.mark.parametrize("text, message", [
    ("steps = 5\nbogus_key = 1\n", "unknown key 'bogus_key'"),
    ('steps = "many"\n', "steps must be a TOML int"),
    ("fsdp = 1\n", "fsdp must be a TOML bool"),
    ("[model]\nd_model = 64\n", "unknown key 'model'"),
    ("steps = \n", "not valid TOML"),
])
def test_bad_config_files_are_one_line_errors_naming_the_file(text, message, tmp_path, capsys):
    path = _write(tmp_path / "bad.toml", text)
    assert run_cli("train", "--config", str(path)) == 2
    err = capsys.readouterr().err
    assert message in err and str(path) in err and err.count("\n") == 1
    assert run_cli("train", "--config", str(tmp_path / "missing.toml")) == 2
    assert "missing.toml" in capsys.readouterr().err


# ----------------------------------------------------------------------------- --logger

def test_tensorboard_gets_the_metrics_rows(corpus, tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed (pip install tensorboard)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "tb"
    assert run_cli("train", "--data", str(corpus), "--steps", "4", "--eval-interval", "2", "--out-dir", str(out),
                   "--logger", "tensorboard", "--no-progress", *MICRO) == 0
    events = EventAccumulator(str(out))
    events.Reload()
    with open(out / "metrics.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    for column in ("loss", "lr", "tokens_per_s", "val_bpb", "load_ratio_max", "load_ratio_mean", "zero_load_experts"):
        logged = {e.step: e.value for e in events.Scalars(column)}
        written = {int(r["step"]): float(r[column]) for r in rows if r[column]}
        assert logged.keys() == written.keys(), column
        # the CSV's rounding (4 to 6 significant decimals) and TensorBoard's float32
        assert all(abs(logged[s] - v) <= 1e-4 * max(1.0, abs(v)) for s, v in written.items()), column


@pytest.mark.parametrize("logger, package", [("tensorboard", "tensorboard"), ("wandb", "wandb")])
def test_a_logger_without_its_package_is_a_one_line_error(logger, package, corpus, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, package, None)  # as if not installed
    monkeypatch.delitem(sys.modules, "torch.utils.tensorboard", raising=False)
    out = tmp_path / "out"
    assert run_cli("train", "--data", str(corpus), "--steps", "1", "--out-dir", str(out), "--logger", logger,
                   *MICRO) == 2
    err = capsys.readouterr().err
    assert f"--logger {logger} needs the {package} package" in err and f"pip install {package}" in err
    assert err.count("\n") == 1 and not out.exists()  # refused before anything was written


def test_wandb_gets_the_metrics_rows_and_a_resumed_run_continues_its_run(corpus, tmp_path, monkeypatch):
    """Against a recording stand-in for the ``wandb`` module (W&B needs an account or its offline files): the run
    moeblaze opens, the steps and numbers it logs (those of metrics.csv), and the run id a resumed run passes back."""
    recorded = []

    class Run:
        id = "abc123"

        def log(self, values, step):
            recorded.append(("log", step, values))

        def finish(self):
            recorded.append(("finish",))

    def init(**kwargs):
        recorded.append(("init", kwargs))
        return Run()

    monkeypatch.setitem(sys.modules, "wandb", type(sys)("wandb"))
    monkeypatch.setattr(sys.modules["wandb"], "init", init, raising=False)
    out = tmp_path / "wb"
    args = ("train", "--data", str(corpus), "--steps", "4", "--eval-interval", "2", "--checkpoint-interval", "2",
            "--out-dir", str(out), "--logger", "wandb", "--no-progress", *MICRO)
    assert run_cli(*args, "--stop-after", "2") == 0
    init_kw = recorded[0][1]
    assert (init_kw["project"], init_kw["name"], init_kw["dir"], init_kw["id"]) == ("moeblaze", "wb", str(out), None)
    assert init_kw["config"]["steps"] == 4 and init_kw["config"]["d_model"] == 16
    assert (out / "wandb-run-id").read_text() == "abc123" and recorded[-1] == ("finish",)
    with open(out / "metrics.csv", newline="") as fh:
        rows = {int(r["step"]): r for r in csv.DictReader(fh)}
    logged = {c[1]: c[2] for c in recorded if c[0] == "log"}
    assert logged.keys() == rows.keys() == {1, 2} and "val_bpb" in logged[2] and "val_bpb" not in logged[1]
    for step, values in logged.items():
        assert all(abs(v - float(rows[step][k])) <= 1e-4 * max(1.0, abs(v)) for k, v in values.items())
    recorded.clear()
    assert run_cli("train", "--resume", "--out-dir", str(out), "--no-progress") == 0  # the logger is the run's
    assert (recorded[0][1]["id"], recorded[0][1]["resume"]) == ("abc123", "allow")
    assert [c[1] for c in recorded if c[0] == "log"] == [3, 4]
