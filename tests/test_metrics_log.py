"""``<out_dir>/metrics.csv`` of ``moeblaze train``: a row per step, resume-safe, never fatal."""

from __future__ import annotations

import csv
import math
import sysconfig
from pathlib import Path

import pytest

from moeblaze.training.metrics_log import COLUMNS, MetricsLog
from moeblaze.training.train import TrainConfig, train
from test_train import TINY, run_cli


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> Path:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    data = b"".join((stdlib / n).read_bytes() for n in ("textwrap.py", "string.py", "difflib.py"))
    path = tmp_path_factory.mktemp("data") / "corpus.py"
    path.write_bytes(data)
    return path


def _rows(out_dir: Path) -> list[dict[str, str]]:
    with open(out_dir / "metrics.csv", newline="") as fh:
        return list(csv.DictReader(fh))


def test_a_row_per_step_with_the_losses_and_evaluations(text_file, tmp_path):
    from moeblaze.training.model import ModelConfig

    cfg = TrainConfig(data=str(text_file), out_dir=str(tmp_path), steps=7, batch_size=4, eval_interval=3,
                      eval_tokens=256, warmup_steps=2, progress=False, threads=2)
    mcfg = ModelConfig(seq_len=32, d_model=32, n_layers=1, n_heads=2, d_ff=32, num_experts=4, top_k=2)
    result = train(cfg, mcfg, log=lambda *_: None)
    rows = _rows(tmp_path)
    assert tuple(rows[0]) == COLUMNS
    assert [int(r["step"]) for r in rows] == list(range(1, 8))
    assert [float(r["loss"]) for r in rows] == pytest.approx(result.losses, abs=1e-6)
    assert all(float(r["bits_per_byte"]) == pytest.approx(float(r["loss"]) / math.log(2), abs=1e-5) for r in rows)
    assert [r["step"] for r in rows if r["val_bpb"]] == ["3", "6", "7"]
    assert float(rows[-1]["val_bpb"]) == pytest.approx(result.val_bpb, abs=1e-6)
    assert all(float(r["step_s"]) > 0 and float(r["tokens_per_s"]) > 0 and float(r["lr"]) > 0 for r in rows)
    # the expert load of every step: max / mean tokens per expert (>= 1), experts without a token (of 4)
    assert all(float(r["load_ratio_max"]) >= float(r["load_ratio_mean"]) >= 1.0 for r in rows)
    assert all(float(r["load_ratio_max"]) <= 4.0 and 0 <= int(r["zero_load_experts"]) < 4 for r in rows)


def test_rows_of_an_older_file_are_kept_with_empty_load_columns(tmp_path):
    """A run resumed by this version from a file written before the load columns existed keeps its rows."""
    (tmp_path / "metrics.csv").write_text("step,loss,bits_per_byte,lr,step_s,tokens_per_s,val_bpb\n"
                                          "1,5.0,7.2,0.001,0.1,100.0,\n2,4.0,5.7,0.001,0.1,100.0,6.0\n"
                                          "3,3.0,4.3,0.001,0.1,100.0,\n")
    log = MetricsLog(tmp_path, 2, print)
    log.write(3, 2.5, 1e-3, 0.1, 100.0, load=(1.75, 1.25, 2))
    rows = _rows(tmp_path)
    assert tuple(rows[0]) == COLUMNS and [r["step"] for r in rows] == ["1", "2", "3"]
    assert [r["val_bpb"] for r in rows] == ["", "6.0", ""] and rows[1]["load_ratio_max"] == ""
    assert (rows[2]["loss"], rows[2]["load_ratio_max"], rows[2]["load_ratio_mean"], rows[2]["zero_load_experts"]) \
        == ("2.500000", "1.7500", "1.2500", "2")


def test_resume_after_a_kill_keeps_each_step_once(text_file, tmp_path):
    """Killed after step 5's row (checkpoint at 4) and in the middle of step 6's: the resumed run's file
    holds steps 1-8 once each, with the losses of an uninterrupted run."""
    full, split = tmp_path / "full", tmp_path / "split"
    common = ["train", "--data", str(text_file), "--steps", "8", "--eval-interval", "3", *TINY]
    assert run_cli(*common, "--out-dir", str(full)) == 0
    assert run_cli(*common, "--out-dir", str(split), "--stop-after", "4") == 0
    with open(split / "metrics.csv", "a") as fh:
        fh.write("5,9.0,13.0,0.001,0.1,100.0,\n6,9.0,13")  # a lost step's row, then a row cut by the kill
    assert run_cli("train", "--resume", "--out-dir", str(split), "--no-progress") == 0
    a, b = _rows(full), _rows(split)
    assert [int(r["step"]) for r in b] == list(range(1, 9))
    assert [r["loss"] for r in a] == [r["loss"] for r in b]  # resume is bitwise, so are the printed losses
    # the same evaluations, and one more: the --stop-after run evaluated at its last step, 4
    assert [r["val_bpb"] for r in a if r["step"] != "4"] == [r["val_bpb"] for r in b if r["step"] != "4"]
    assert b[3]["val_bpb"] and not a[3]["val_bpb"]


def test_an_unwritable_file_warns_once_and_training_goes_on(text_file, tmp_path):
    (tmp_path / "metrics.csv").mkdir()  # opening it for writing fails (IsADirectoryError, an OSError)
    lines = []
    from moeblaze.training.model import ModelConfig

    cfg = TrainConfig(data=str(text_file), out_dir=str(tmp_path), steps=3, batch_size=4, eval_interval=100,
                      eval_tokens=256, warmup_steps=1, progress=False, threads=2)
    mcfg = ModelConfig(seq_len=32, d_model=32, n_layers=1, n_heads=2, d_ff=32, num_experts=4, top_k=2)
    result = train(cfg, mcfg, log=lines.append)
    assert result.status == "done" and len(result.losses) == 3
    warnings = [m for m in lines if "metrics" in m and "warning" in m]
    assert len(warnings) == 1 and "training goes on" in warnings[0]


def test_a_failed_append_disables_the_log(tmp_path, monkeypatch):
    lines = []
    log = MetricsLog(tmp_path, None, lines.append)
    log.write(1, 2.0, 1e-3, 0.5, 100.0)

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("builtins.open", full_disk)
    log.write(2, 2.0, 1e-3, 0.5, 100.0)
    log.write(3, 2.0, 1e-3, 0.5, 100.0)
    monkeypatch.undo()
    assert not log.enabled and len(lines) == 1 and "No space left" in lines[0]
    assert [r["step"] for r in _rows(tmp_path)] == ["1"]


def test_a_damaged_file_on_resume_keeps_its_good_rows(tmp_path):
    """A non-UTF-8 byte, a row of too many or too few fields, a foreign row: dropped, not fatal."""
    header = ",".join(COLUMNS)
    good = ["1,2.0,2.885390,0.001,0.5,100.0,,1.5,1.25,0", "2,1.9,2.741120,0.001,0.5,100.0,7.5,1.4,1.2,1"]
    (tmp_path / "metrics.csv").write_bytes(
        "\n".join([header, good[0], "x,1,2", good[1], "3,1.8,2.6,0.001,0.5,100.0,,1.3,1.1,0,extra", "4,1.7"]).encode()
        + b"\n5,1.6,\xff,0.001,0.5,100.0,,1.2,1.1,0\n6,1.5,2.1,0.001,0.5,100.0,,1.2,1.1,0\n")
    lines = []
    MetricsLog(tmp_path, 5, lines.append)
    assert not lines and [r["step"] for r in _rows(tmp_path)] == ["1", "2"]
    assert _rows(tmp_path)[1]["val_bpb"] == "7.5" and _rows(tmp_path)[1]["zero_load_experts"] == "1"


def test_an_unreadable_file_on_resume_warns_and_training_goes_on(tmp_path):
    (tmp_path / "metrics.csv").mkdir()
    lines = []
    log = MetricsLog(tmp_path, 3, lines.append)
    log.write(4, 2.0, 1e-3, 0.5, 100.0)
    assert not log.enabled and len(lines) == 1 and "training goes on" in lines[0]
    assert not (tmp_path / "metrics.csv.tmp").exists()


def test_a_failed_rewrite_leaves_no_temporary_file(tmp_path, monkeypatch):
    def refuse(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("moeblaze.training.metrics_log.os.replace", refuse)
    lines = []
    assert not MetricsLog(tmp_path, None, lines.append).enabled and len(lines) == 1
    assert not (tmp_path / "metrics.csv.tmp").exists()


def test_other_ranks_write_nothing(tmp_path):
    log = MetricsLog(tmp_path, None, print, enabled=False)
    log.write(1, 2.0, 1e-3, 0.5, 100.0)
    assert not (tmp_path / "metrics.csv").exists()


def test_plot_of_several_runs_is_one_figure_of_their_losses(tmp_path, monkeypatch, capsys):
    """``moeblaze plot A B``: both runs' curves in one PNG (default name in the working directory, or --out), legend
    names from --labels; a wrong label count and a folder without metrics.csv are one-line errors."""
    pytest.importorskip("matplotlib")
    header = "step,loss,bits_per_byte,lr,step_s,tokens_per_s,val_bpb\n"
    for name, scale in (("bf16", 1.0), ("fp8", 1.02)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.csv").write_text(header + "".join(
            f"{s},{5 * scale / s:.4f},{7 * scale / s:.4f},0.001,0.1,100.0,{'' if s % 2 else 7 * scale / s}\n"
            for s in range(1, 7)))
    monkeypatch.chdir(tmp_path)
    assert run_cli("plot", "bf16", "fp8") == 0
    assert (tmp_path / "loss-compare.png").stat().st_size > 1000
    assert not (tmp_path / "bf16" / "loss.png").exists()
    out = tmp_path / "curves.png"
    assert run_cli("plot", "bf16", "fp8", "--out", str(out), "--labels", "bf16-mixed,fp8-mixed") == 0
    assert out.stat().st_size > 1000 and str(out) in capsys.readouterr().out
    assert run_cli("plot", "bf16", "fp8", "--out", str(out), "--labels", "one") == 2
    assert "--labels: 1 given for 2 runs" in capsys.readouterr().err
    assert run_cli("plot", "bf16", "--labels", "a,b") == 2  # one run: labels go to a comparison, not ignored
    assert "--labels: 2 given for 1 runs" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert run_cli("plot", "bf16", "empty") == 2
    assert "cannot read" in capsys.readouterr().err


def test_plot_of_groups_of_runs_tables_their_final_losses(tmp_path, monkeypatch, capsys):
    """``moeblaze plot A1 A2 B --labels a,a,b``: one curve color per label and a table of the groups: runs, the mean
    of each run's last 10 training losses with their range, the last validation's mean and range, and each group's
    mean over the first group's."""
    pytest.importorskip("matplotlib")
    from moeblaze.training.plot import compare_table, final_metrics, read_metrics, read_runs

    header = "step,loss,bits_per_byte,lr,step_s,tokens_per_s,val_bpb\n"
    finals = {"a1": 1.0, "a2": 1.2, "b": 1.21}
    for name, last in finals.items():
        (tmp_path / name).mkdir()
        rows = [f"{s},{9.0 if s <= 5 else last},1.0,0.001,0.1,100.0,{last + 0.5 if s == 15 else ''}\n"
                for s in range(1, 16)]
        (tmp_path / name / "metrics.csv").write_text(header + "".join(rows))
    assert final_metrics(read_metrics(tmp_path / "a1")) == (1.0, 1.5)  # steps 6-15: the last 10 losses
    table = compare_table(read_runs([tmp_path / n for n in finals], ["a", "a", "b"])).splitlines()
    assert len(table) == 3 and table[0].split()[:2] == ["label", "runs"]
    assert table[1].split() == ["a", "2", "1.1000", "(1.0000-1.2000)", "1.6000", "(1.5000-1.7000)", "1.0000"]
    assert table[2].split() == ["b", "1", "1.2100", "1.7100", "1.1000"]
    monkeypatch.chdir(tmp_path)
    assert run_cli("plot", "a1", "a2", "b", "--labels", "a,a,b") == 0
    out = capsys.readouterr().out
    assert (tmp_path / "loss-compare.png").stat().st_size > 1000 and "(1.0000-1.2000)" in out
