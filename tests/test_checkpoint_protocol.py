"""The checkpoint write protocol (issue 28): the fsync and rename order that makes the rename the commit, what
``verify`` refuses, newer steps removed on an older save, and the rank contract on two gloo processes."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moeblaze.training import checkpoint


def _tiny_model():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    return model, torch.optim.AdamW(model.parameters())


def test_write_order_makes_the_rename_the_commit(tmp_path, monkeypatch):
    """Every file of the folder is fsynced, the manifest written and fsynced last, and the folder fsynced,
    before the rename that makes the checkpoint visible; the ``latest`` pointer goes through its own fsynced
    temporary file. (A kill cannot show a missing fsync or a reordered rename: the page cache survives it.)"""
    ops = []
    for name in ("_write_file", "_fsync", "_rename", "_mkdir"):
        real = getattr(checkpoint, name)

        def logged(*args, _name=name, _real=real):
            ops.append((_name, *(Path(a).relative_to(tmp_path).as_posix() for a in args if isinstance(a, Path))))
            return _real(*args)
        monkeypatch.setattr(checkpoint, name, logged)
    model, opt = _tiny_model()
    final = checkpoint.save(tmp_path, 3, model, opt)
    tmp, done = "checkpoints/.step-000003.tmp", "checkpoints/step-000003"
    commit = ops.index(("_rename", tmp, done))
    files = sorted(p.name for p in final.iterdir())
    for f in files:  # fsynced under the temporary name, before the commit
        assert ops.index(("_fsync", f"{tmp}/{f}")) < commit, f
    manifest_write = ops.index(("_write_file", f"{tmp}/manifest.json"))
    assert all(ops.index(("_fsync", f"{tmp}/{f}")) < manifest_write for f in files if f != "manifest.json")
    assert manifest_write < ops.index(("_fsync", f"{tmp}/manifest.json")) < ops.index(("_fsync", tmp)) < commit
    assert ops.index(("_fsync", "checkpoints"), commit) > commit  # the rename itself made durable
    pointer = ops.index(("_rename", "checkpoints/.latest.tmp", "checkpoints/latest"))
    assert commit < ops.index(("_fsync", "checkpoints/.latest.tmp")) < pointer


def test_a_state_file_of_another_step_is_refused(tmp_path):
    """A checkpoint assembled from two steps (step 2's state.json in step 4's folder, its manifest entry
    rewritten to match) does not verify."""
    model, opt = _tiny_model()
    two, four = checkpoint.save(tmp_path, 2, model, opt, keep=2), checkpoint.save(tmp_path, 4, model, opt, keep=2)
    (four / "state.json").write_bytes((two / "state.json").read_bytes())
    manifest = json.loads((four / "manifest.json").read_text())
    manifest["files"]["state.json"] = {"size": (four / "state.json").stat().st_size,
                                       "sha256": checkpoint._sha256(four / "state.json")}
    (four / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(checkpoint.CheckpointError, match="state.json: step 2, the manifest says 4"):
        checkpoint.verify(four)


def test_verify_names_a_folder_that_is_not_a_step_folder(tmp_path):
    """verify() of a run's output folder (or a copied checkpoint renamed) says which folder it wants, instead of
    blaming the manifest."""
    model, opt = _tiny_model()
    step = checkpoint.save(tmp_path, 2, model, opt)
    copy = shutil.copytree(step, tmp_path / "my-copy")
    for folder in (tmp_path, copy):
        with pytest.raises(checkpoint.CheckpointError, match="not a checkpoint folder .expected a step-\\* folder"):
            checkpoint.verify(folder)
    assert checkpoint.verify(step)["step"] == 2


def test_saving_an_older_step_removes_the_newer_ones(tmp_path):
    """A run resumed from step 2 (step 4 did not verify) saves step 3: step 4 must go, or it would shadow the
    new checkpoints as the newest."""
    model, opt = _tiny_model()
    for step in (2, 4):
        checkpoint.save(tmp_path, step, model, opt, keep=5)
    checkpoint.save(tmp_path, 3, model, opt, keep=5)
    assert [p.name for p in checkpoint.checkpoint_dirs(tmp_path)] == ["step-000002", "step-000003"]
    assert checkpoint.find_latest(tmp_path).name == "step-000003"


# ----------------------------------------------------------------------------- two ranks

DIST_HELPER = r'''
import json, multiprocessing, sys
from pathlib import Path

import torch
import torch.distributed as dist

from moeblaze.training import checkpoint

root = Path(sys.argv[1])


def build():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def rank_main(rank):
    dist.init_process_group("gloo", init_method=f"file://{root}/store", rank=rank, world_size=2)
    torch.set_num_threads(1)
    model, opt = build()
    model(torch.ones(4, 8)).sum().backward()
    opt.step()
    checkpoint.save(root / "run", 1, model, opt, {"note": "two ranks"}, keep=1)
    found = checkpoint.find_latest(root / "run")
    fresh, fresh_opt = build()
    checkpoint.load(found, fresh, fresh_opt)
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))
    stop = checkpoint.agree(rank == 1)
    both = checkpoint.agree_all(rank == 0, False, rank == 1, timeout=60)
    dist.destroy_process_group()
    sys.exit(0 if same and stop and both == (True, False, True) and found.name == "step-000001" else 3)


ctx = multiprocessing.get_context("fork")
procs = [ctx.Process(target=rank_main, args=(r,)) for r in range(2)]
for p in procs:
    p.start()
for p in procs:
    p.join(120)
codes = [p.exitcode if not p.is_alive() else "timeout" for p in procs]
for p in procs:
    if p.is_alive():
        p.kill()
# one process, no process group: the same checkpoint loads and holds the weights every rank had
model, opt = build()
model(torch.ones(4, 8)).sum().backward()
opt.step()
fresh, fresh_opt = build()
path = checkpoint.find_latest(root / "run")
checkpoint.load(path, fresh, fresh_opt)
same = all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))
steps = [s["step"].item() for s in fresh_opt.state_dict()["state"].values()]
listed = sorted(json.loads((path / "manifest.json").read_text())["files"])
present = sorted(p.name for p in path.iterdir() if p.name != "manifest.json")
print(json.dumps({"codes": codes, "single_process_same": same, "steps": steps,
                  "state": checkpoint.read_state(path), "listed": listed, "present": present}))
'''


def test_two_ranks_save_and_one_process_loads(tmp_path):
    """The rank contract on 2 gloo ranks: both call save/find_latest/load/agree; rank 0 alone writes the
    manifest; the checkpoint then loads in a single process without a process group."""
    proc = subprocess.run([sys.executable, "-c", DIST_HELPER, str(tmp_path)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["codes"] == [0, 0] and result["single_process_same"], result
    assert result["steps"] == [1.0] * 4 and result["state"] == {"step": 1, "note": "two ranks"}
    assert result["listed"] == result["present"] and "__1_0.distcp" in result["listed"], result
