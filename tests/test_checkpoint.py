"""Checkpoints that survive faults (issue 28): SIGKILL after every file operation of a checkpoint write,
SIGTERM/SIGINT mid-run, corrupt files, a fresh run into a finished run's folder, non-finite losses.

The fault runs need processes that can be killed. Starting one Python per run costs seconds (importing
torch), so one helper process is started per scenario group and forks a child per run (the helper
itself runs no torch op before its forks, so the forked children start with clean thread pools); every
join has a timeout, and so has the helper.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from moeblaze.cli import main
from moeblaze.training import checkpoint
from moeblaze.training.checkpoint import CheckpointError, StopOnSignal
from moeblaze.training.model import MoETransformer
from moeblaze.training.train import NonFiniteLossError, TrainConfig, load_run_config, make_optimizer, train

MICRO = ["--seq-len", "16", "--d-model", "16", "--n-layers", "1", "--n-heads", "2", "--d-ff", "16",
         "--num-experts", "4", "--top-k", "2", "--batch-size", "4", "--eval-tokens", "64",
         "--eval-interval", "1000", "--warmup-steps", "2", "--no-progress", "--threads", "1"]

# Runs in a fresh interpreter: forks one child per training run (fault injected by patching the
# writer's file operations), then compares every resumed run with the uninterrupted one. Prints JSON.
HELPER = r'''
import json, multiprocessing, os, signal, sys
from pathlib import Path

import torch._dynamo  # noqa: F401  (imported lazily by the optimizer: once here, not in every child)
from moeblaze.training import checkpoint
from moeblaze.cli import main

ctx = multiprocessing.get_context("fork")
spec = json.loads(sys.argv[1])
root = Path(spec["root"])


def child(argv, log, kill_after=0, ops_log=None, signum=None):
    sys.stdout = sys.stderr = open(log, "a", buffering=1)
    count = 0
    if signum is not None:  # the signal arrives from outside while step 3 runs
        import moeblaze.training.train as train_mod

        real_step, steps_run = train_mod.train_step, []

        def step_with_signal(*args, **kwargs):
            steps_run.append(1)
            if len(steps_run) == 3:
                os.kill(os.getpid(), signum)
            return real_step(*args, **kwargs)

        train_mod.train_step = step_with_signal

    def wrap(fn):
        def op(*args, **kwargs):
            nonlocal count
            result = fn(*args, **kwargs)
            count += 1
            if count == kill_after:
                os.kill(os.getpid(), signal.SIGKILL)
            return result
        return op

    for name in checkpoint.FILE_OPS:
        setattr(checkpoint, name, wrap(getattr(checkpoint, name)))
    save = checkpoint.save

    def counted_save(*args, **kwargs):
        out = save(*args, **kwargs)
        if ops_log:
            with open(ops_log, "a") as f:
                f.write(f"{count}\n")
        return out

    checkpoint.save = counted_save
    main(argv)


def run(argv, name, kill_after=0, ops_log=None, signum=None, timeout=120):
    log = root / f"{name}.log"
    p = ctx.Process(target=child, args=(argv, log, kill_after, ops_log, signum))
    p.start()
    p.join(timeout)
    if p.is_alive():
        p.kill()
        p.join(10)
        return "timeout"
    return p.exitcode


def compare(a, b):
    import torch
    from moeblaze.training.model import MoETransformer
    from moeblaze.training.train import load_run_config, make_optimizer

    states = []
    for out_dir in (a, b):
        path = checkpoint.find_latest(out_dir, warn=None)
        if path is None:
            return f"no checkpoint in {out_dir}"
        tcfg, mcfg, step = load_run_config(str(path))
        model = MoETransformer(mcfg)
        opt = make_optimizer(model, tcfg)
        checkpoint.load(path, model, opt)
        states.append((step, model.state_dict(), opt.state_dict()["state"]))
    (sa, ma, oa), (sb, mb, ob) = states
    if sa != sb:
        return f"step {sa} != {sb}"
    for k in ma:
        if not torch.equal(ma[k], mb[k]):
            return f"weight {k} differs"
    for i in oa:
        for k in oa[i]:
            if not torch.equal(oa[i][k], ob[i][k]):
                return f"optimizer state {i}.{k} differs"
    leftovers = [p.name for p in (Path(b) / "checkpoints").iterdir() if p.name.startswith(".")]
    if leftovers:
        return f"left behind: {leftovers}"
    pointer = (Path(b) / "checkpoints" / "latest").read_text().strip()
    return None if pointer == checkpoint.find_latest(b, warn=None).name else f"latest points to {pointer}"


result = {}
common = spec["argv"]
if spec["mode"] == "kill":
    ops_log = root / "ops.txt"
    result["ref"] = run(common + ["--out-dir", str(root / "ref")], "ref", ops_log=ops_log)
    counts = [int(x) for x in ops_log.read_text().split()]
    result["counts"] = counts
    first, second = counts[0], counts[1]
    result["cases"] = {}
    for i in range(first + 1, second + 1):
        out = str(root / f"kill{i}")
        killed = run(common + ["--out-dir", out], f"kill{i}", kill_after=i)
        resumed = run(["train", "--resume", "--out-dir", out, "--no-progress"], f"resume{i}")
        result["cases"][i] = [killed, resumed]
    for i in result["cases"]:
        result["cases"][i].append(compare(str(root / "ref"), str(root / f"kill{i}")))
else:
    result["ref"] = run(common + ["--out-dir", str(root / "ref")], "ref")
    result["cases"] = {}
    for name in ("SIGTERM", "SIGINT"):
        out = str(root / name)
        stopped = run(common + ["--out-dir", out], name, signum=getattr(signal, name))
        log = (root / f"{name}.log").read_text()
        resumed = run(["train", "--resume", "--out-dir", out, "--no-progress"], f"resume-{name}")
        result["cases"][name] = [stopped, resumed, log]
    for name in result["cases"]:
        result["cases"][name].append(compare(str(root / "ref"), str(root / name)))
print(json.dumps(result))
'''


@pytest.fixture(scope="module")
def small_text(tmp_path_factory) -> Path:
    """~60 kB of real Python source as one file."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    data = b"".join((stdlib / n).read_bytes() for n in ("textwrap.py", "string.py", "bisect.py", "heapq.py"))
    path = tmp_path_factory.mktemp("data") / "corpus.py"
    path.write_bytes(data)
    return path


def _run_helper(spec: dict) -> dict:
    proc = subprocess.run([sys.executable, "-c", HELPER, json.dumps(spec)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_cli(*args: str) -> int:
    with pytest.raises(SystemExit) as exc:
        main(list(args))
    return exc.value.code


# ----------------------------------------------------------------------------- faults in a running process

def test_sigkill_after_every_file_operation_resumes_bitwise(small_text, tmp_path):
    """Kill right after each file operation of the second checkpoint write (which has a predecessor and
    deletes it: --keep-checkpoints 1); every `--resume` must end with the uninterrupted run's weights and
    AdamW state, and leave no temporary file behind."""
    argv = ["train", "--data", str(small_text), "--steps", "4", "--checkpoint-interval", "2",
            "--keep-checkpoints", "1", *MICRO]
    result = _run_helper({"mode": "kill", "root": str(tmp_path), "argv": argv})
    assert result["ref"] == 0
    first, second = result["counts"][:2]
    assert second - first >= 15  # mkdir, DCP, state, 3 fsyncs, manifest, fsyncs, renames, pointer, delete
    assert len(result["cases"]) == second - first
    for i, (killed, resumed, problem) in result["cases"].items():
        assert killed == -signal.SIGKILL, (i, killed)
        assert resumed == 0, (i, (tmp_path / f"resume{i}.log").read_text()[-2000:])
        assert problem is None, (i, problem)


def test_sigterm_and_sigint_checkpoint_and_resume_bitwise(small_text, tmp_path):
    """Default checkpoint settings (none due within the run): a signal during step 3 makes the run finish
    that step, write a checkpoint, say so and exit 128 + signum; --resume then ends bitwise equal."""
    argv = ["train", "--data", str(small_text), "--steps", "40", *MICRO]
    result = _run_helper({"mode": "signal", "root": str(tmp_path), "argv": argv})
    assert result["ref"] == 0
    for name, (stopped, resumed, log, problem) in result["cases"].items():
        assert stopped == 128 + getattr(signal, name), (name, stopped, log[-2000:])
        assert f"{name} received" in log and f"stopped by {name} after step 3" in log, log[-2000:]
        assert resumed == 0 and problem is None, (name, resumed, problem)


def test_second_ctrl_c_exits_at_once():
    with StopOnSignal() as stop:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.signum == signal.SIGINT  # the first only asks to stop
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


# ----------------------------------------------------------------------------- a finished run's folder

@pytest.fixture(scope="module")
def finished_run(small_text, tmp_path_factory) -> Path:
    """A finished 4-step run with checkpoints at steps 2 and 4."""
    out = tmp_path_factory.mktemp("finished")
    assert run_cli("train", "--data", str(small_text), "--steps", "4", "--checkpoint-interval", "2",
                   "--out-dir", str(out), *MICRO) == 0
    assert [p.name for p in checkpoint.checkpoint_dirs(out)] == ["step-000002", "step-000004"]
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-000004"
    return out


def _digest(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_fresh_run_into_a_finished_run_refuses_and_keeps_it(finished_run, small_text, capsys):
    before = _digest(finished_run)
    assert run_cli("train", "--data", str(small_text), "--steps", "3", "--out-dir", str(finished_run), *MICRO) == 2
    err = capsys.readouterr().err
    assert "--resume" in err and "--overwrite" in err and err.count("\n") == 1
    assert _digest(finished_run) == before


def test_overwrite_replaces_the_old_run(finished_run, small_text, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    assert run_cli("train", "--data", str(small_text), "--steps", "1", "--overwrite", "--out-dir", str(out),
                   *MICRO) == 0
    assert [p.name for p in checkpoint.checkpoint_dirs(out)] == ["step-000001"]


def test_resume_of_a_finished_run_says_so_and_exits_0(finished_run, capsys):
    assert run_cli("train", "--resume", "--out-dir", str(finished_run), "--no-progress") == 0
    out = capsys.readouterr().out
    assert "already finished" in out and "step 4" in out and "nan" not in out


def test_resume_with_a_stop_after_already_reached_says_so_and_exits_0(finished_run, capsys):
    assert run_cli("train", "--resume", "--out-dir", str(finished_run), "--steps", "8", "--stop-after", "3",
                   "--no-progress") == 0
    out = capsys.readouterr().out
    assert "at or past --stop-after 3" in out and "nothing to do" in out and "nan" not in out


def test_sample_reads_a_run_or_a_checkpoint_folder(finished_run, capsys):
    assert run_cli("sample", "--checkpoint", str(finished_run), "--max-new-tokens", "8", "--prompt", "def ") == 0
    assert capsys.readouterr().out.startswith("def ")
    step2 = finished_run / "checkpoints" / "step-000002"
    assert run_cli("sample", "--checkpoint", str(step2), "--max-new-tokens", "8", "--prompt", "x") == 0


# ----------------------------------------------------------------------------- corrupt checkpoints

def _truncate(f: Path) -> None:
    f.write_bytes(f.read_bytes()[:-100])


def _flip_byte(f: Path) -> None:
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    f.write_bytes(bytes(raw))


CORRUPTIONS = {
    "truncated shard": ("__0_0.distcp", _truncate, "bytes, the manifest says"),
    "flipped byte in shard": ("__0_0.distcp", _flip_byte, "SHA-256"),
    "missing DCP metadata": (".metadata", Path.unlink, "missing"),
    "bad state.json": ("state.json", lambda f: f.write_text("{not json"), "state.json"),
    "bad manifest": ("manifest.json", lambda f: f.write_text("[1, 2"), "unreadable"),
    "no manifest (incomplete)": ("manifest.json", Path.unlink, "missing"),
    "manifest of another step": ("manifest.json",
                                 lambda f: f.write_text(f.read_text().replace('"step": 4', '"step": 2')),
                                 "does not match the folder name"),
}


@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_corrupt_newest_checkpoint_is_named_and_the_previous_one_used(case, finished_run, tmp_path, capsys):
    name, damage, problem = CORRUPTIONS[case]
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    damage(out / "checkpoints" / "step-000004" / name)
    assert run_cli("train", "--resume", "--out-dir", str(out), "--no-progress") == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("warning:")]
    assert len(lines) == 1 and "step-000004" in lines[0] and name in lines[0] and problem in lines[0], lines
    assert checkpoint.find_latest(out, warn=None).name == "step-000004"  # rewritten by the resumed run
    a = checkpoint.read_state(finished_run / "checkpoints" / "step-000004")
    assert a["rng"] == checkpoint.read_state(out / "checkpoints" / "step-000004")["rng"]


@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_corrupt_only_checkpoint_is_a_one_line_error_naming_the_file(case, finished_run, tmp_path, capsys):
    name, damage, problem = CORRUPTIONS[case]
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    shutil.rmtree(out / "checkpoints" / "step-000002")
    damage(out / "checkpoints" / "step-000004" / name)
    assert run_cli("train", "--resume", "--out-dir", str(out), "--no-progress") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and name in err and problem in err and "Traceback" not in err, err


def test_non_finite_weights_in_a_checkpoint_are_refused(finished_run, tmp_path, capsys):
    out = tmp_path / "run"
    tcfg, mcfg, _ = load_run_config(str(finished_run))
    model = MoETransformer(mcfg)
    opt = make_optimizer(model, tcfg)
    checkpoint.load(finished_run / "checkpoints" / "step-000004", model, opt)
    with torch.no_grad():
        model.blocks[0].moe.w_down[0, 0, 0] = float("nan")
    state = checkpoint.read_state(finished_run / "checkpoints" / "step-000004")
    checkpoint.save(out, 4, model, opt, {k: v for k, v in state.items() if k != "step"}, keep=1)
    assert run_cli("train", "--resume", "--steps", "6", "--out-dir", str(out), "--no-progress") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "step-000004" in err and "w_down" in err and "non-finite" in err, err
    with pytest.raises(CheckpointError, match="w_down"):
        checkpoint.load(out / "checkpoints" / "step-000004", MoETransformer(mcfg))


# ----------------------------------------------------------------------------- non-finite losses

@pytest.mark.parametrize("which", ["LM loss", "auxiliary loss"])
def test_non_finite_loss_stops_without_writing(which, small_text, tmp_path, monkeypatch):
    """The first non-finite loss (at step 3) stops the run with the step and the loss named; the optimizer
    does not step on it and the step-2 checkpoint stays the newest, with finite weights."""
    import moeblaze.training.step as step_mod  # train_step, where aux_loss is looked up

    counts = {"n": 0}
    real_aux, real_forward = step_mod.aux_loss, MoETransformer.forward

    def poisoned(x):
        counts["n"] += 1
        return x * math.nan if counts["n"] == 3 else x

    if which == "LM loss":
        monkeypatch.setattr(MoETransformer, "forward", lambda self, idx: poisoned(real_forward(self, idx)))
    else:
        monkeypatch.setattr(step_mod, "aux_loss", lambda model: poisoned(real_aux(model)))
    cfg = TrainConfig(data=str(small_text), out_dir=str(tmp_path), steps=5, checkpoint_interval=2, batch_size=4,
                      eval_interval=1000, eval_tokens=64, warmup_steps=2, progress=False, threads=1)
    from moeblaze.training.model import ModelConfig

    mcfg = ModelConfig(seq_len=16, d_model=16, n_layers=1, n_heads=2, d_ff=16, num_experts=4, top_k=2)
    with pytest.raises(NonFiniteLossError, match=f"step 3: {which}") as exc:
        train(cfg, mcfg, log=lambda *_: None)
    assert "\n" not in str(exc.value) and "step-000002" in str(exc.value)
    assert [p.name for p in checkpoint.checkpoint_dirs(tmp_path)] == ["step-000002"]
    model = MoETransformer(mcfg)
    checkpoint.load(tmp_path / "checkpoints" / "step-000002", model)  # raises on non-finite weights


def test_agree_without_a_process_group_is_the_local_flag():
    assert checkpoint.agree(True) is True and checkpoint.agree(False) is False
    assert checkpoint.agree_all(True, False) == (True, False)


# ------------------------------------------------------- a GPU run, a refused write, when to checkpoint

@pytest.mark.gpu
def test_gpu_bf16_checkpoint_round_trip_and_resume(small_text, tmp_path):
    """On CUDA (bf16 parameters, Triton backend): a checkpoint loads back exactly (weights, AdamW state,
    CUDA RNG), and a run stopped at step 2 resumes to the end."""
    argv = ["train", "--data", str(small_text), "--steps", "4", "--device", "cuda", "--backend", "triton",
            "--out-dir", str(tmp_path), *MICRO]
    assert run_cli(*argv, "--stop-after", "2") == 0
    path = checkpoint.find_latest(tmp_path)
    tcfg, mcfg, step = load_run_config(str(tmp_path))
    assert step == 2 and path.name == "step-000002"
    model = MoETransformer(mcfg).to(device="cuda", dtype=torch.bfloat16)
    opt = make_optimizer(model, tcfg)
    checkpoint.load(path, model, opt)
    copy_dir = tmp_path / "copy"
    checkpoint.save(copy_dir, 2, model, opt, {"note": "round trip"}, keep=1)
    again = MoETransformer(mcfg).to(device="cuda", dtype=torch.bfloat16)
    again_opt = make_optimizer(again, tcfg)
    checkpoint.load(checkpoint.find_latest(copy_dir), again, again_opt)
    for (name, a), b in zip(model.state_dict().items(), again.state_dict().values()):
        assert a.dtype == torch.bfloat16 and a.is_cuda and torch.equal(a, b), name
    for i, s in opt.state_dict()["state"].items():
        for k, v in s.items():
            assert torch.equal(v, again_opt.state_dict()["state"][i][k]), (i, k)
    assert run_cli("train", "--resume", "--out-dir", str(tmp_path), "--no-progress") == 0
    assert checkpoint.find_latest(tmp_path).name == "step-000004"


def test_a_refused_write_is_a_one_line_error_and_keeps_the_last_checkpoint(finished_run, tmp_path, capsys,
                                                                            monkeypatch):
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    before = _digest(out / "checkpoints" / "step-000004")

    def disk_full(path, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint, "_write_file", disk_full)
    assert run_cli("train", "--resume", "--steps", "5", "--out-dir", str(out), "--no-progress") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "step 5" in err and "No space left on device" in err, err
    assert checkpoint.find_latest(out).name == "step-000004" and _digest(out / "checkpoints" / "step-000004") == before


def test_checkpoint_by_minutes_and_keep_the_newest(small_text, tmp_path):
    """``--checkpoint-minutes`` tiny: a checkpoint after every step; ``--keep-checkpoints 2`` leaves the last two."""
    assert run_cli("train", "--data", str(small_text), "--steps", "3", "--checkpoint-interval", "0",
                   "--checkpoint-minutes", "1e-9", "--keep-checkpoints", "2", "--out-dir", str(tmp_path), *MICRO) == 0
    assert [p.name for p in checkpoint.checkpoint_dirs(tmp_path)] == ["step-000002", "step-000003"]
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step-000003"
