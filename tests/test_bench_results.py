"""The results file (``moeblaze.bench.results``): appending a run's rows, picking same-run rows per config,
the README table rewritten in place between its markers, the plots, and both through ``moeblaze bench``."""

import argparse
from pathlib import Path

import pytest

from moeblaze.bench.cli import register
from moeblaze.bench.results import (
    RESULT_COLUMNS,
    TABLE_END,
    TABLE_START,
    Call,
    append_results,
    call_of,
    git_commit,
    make_report,
    pick_rows,
    read_results,
    readme_table,
    rewrite_readme,
)
from moeblaze.bench.runner import Row

REPO = Path(__file__).resolve().parents[1]


def _row(config, impl, ms, peak=1000.0, status="ok", group="paper", T=32768):
    ok = status == "ok"
    return Row(group, config, impl, T, 2048, 8192, 16, 4, "swiglu", "bf16", status, ms if ok else None,
               600.0 * 60.0 / ms if ok else None, 100.0 if ok else None, peak if ok else None, None, 5, 1.0)


def _call(date, clock, command="moeblaze bench --configs conf4-swiglu", device="NVIDIA H200"):
    return Call(date, clock, device, "abc1234", "2.11.0+cu130", "3.6.0", command)


def test_call_of_meta_and_git_commit(tmp_path):
    meta = {"date": "2026-11-24 12:16 UTC", "device": "NVIDIA H200", "torch": "2.11.0", "triton": "3.6.0",
            "command": "moeblaze bench --configs conf4-swiglu"}
    assert call_of(meta, "1cd64fd") == Call("2026-11-24", "12:16", "NVIDIA H200", "1cd64fd", "2.11.0", "3.6.0",
                                            "moeblaze bench --configs conf4-swiglu")
    assert git_commit(tmp_path) == ""  # not a checkout
    head = git_commit(REPO)
    if (REPO / ".git").exists():
        assert len(head.split("+")[0]) >= 7


def test_append_creates_then_appends_and_reads_back(tmp_path):
    path = tmp_path / "results.csv"
    first = [_row("conf4-swiglu", "moeblaze", 66.15), _row("conf4-swiglu", "conventional", 84.25),
             _row("conf4-swiglu", "sonicmoe", 0.0, status="skipped")]
    append_results(path, first, _call("2026-11-23", "18:44"))
    append_results(path, [_row("conf4-swiglu", "moeblaze", 65.0)], _call("2026-11-24", "12:16"))
    assert path.read_text().splitlines()[0] == ",".join(RESULT_COLUMNS)
    back = read_results(path)
    assert [(c.date, r.impl, r.status, r.time_ms) for c, r in back] == [
        ("2026-11-23", "moeblaze", "ok", 66.15), ("2026-11-23", "conventional", "ok", 84.25),
        ("2026-11-23", "sonicmoe", "skipped", None), ("2026-11-24", "moeblaze", "ok", 65.0)]
    assert back[0][1] == first[0] and back[0][0].commit == "abc1234"
    bad = tmp_path / "bad.csv"
    bad.write_text("config,impl,status,time_ms\nx,y,ok,1\n")
    with pytest.raises(ValueError, match="not a results file"):
        append_results(bad, first, _call("2026-11-24", "12:16"))
    with pytest.raises(ValueError, match="missing columns"):
        read_results(bad)


def _results():
    """conf4: an older run with moeblaze, conventional and SonicMoE, a newer one with Liger instead of SonicMoE;
    conf7: two runs with the three, the later with Liger too;
    an H100 run that must not mix with the H200 rows."""
    old, new, c7a, c7b = (_call("2026-11-23", "10:58"), _call("2026-11-24", "09:00"),
                          _call("2026-11-22", "10:00", "c7 a"), _call("2026-11-24", "12:16", "c7 b"))
    h100 = _call("2026-11-20", "08:00", "h100", device="NVIDIA H100")
    return [(old, _row("conf4-swiglu", "moeblaze", 70.0, 8648)), (old, _row("conf4-swiglu", "conventional", 87.5,
                                                                              15301)),
            (old, _row("conf4-swiglu", "sonicmoe", 63.0, 12757)),
            (new, _row("conf4-swiglu", "moeblaze", 66.0)), (new, _row("conf4-swiglu", "conventional", 84.0)),
            (new, _row("conf4-swiglu", "liger", 150.0)),
            (c7a, _row("conf7-swiglu", "moeblaze", 18.0)), (c7a, _row("conf7-swiglu", "conventional", 20.0)),
            (c7a, _row("conf7-swiglu", "sonicmoe", 16.0)),
            (c7b, _row("conf7-swiglu", "moeblaze", 17.0)), (c7b, _row("conf7-swiglu", "conventional", 20.2)),
            (c7b, _row("conf7-swiglu", "sonicmoe", 16.2)), (c7b, _row("conf7-swiglu", "liger", 34.0, 3000)),
            (h100, _row("olmoe-1b-7b", "moeblaze", 30.0, group="models"))]


def test_pick_rows_takes_the_latest_run_with_the_most_implementations():
    picked = pick_rows(_results(), ["olmoe-1b-7b", "conf4-swiglu", "conf7-swiglu"])
    assert [(cfg, call.time_utc, sorted(rows)) for cfg, call, rows in picked] == [
        ("conf4-swiglu", "10:58", ["conventional", "moeblaze", "sonicmoe"]),
        ("conf7-swiglu", "12:16", ["conventional", "liger", "moeblaze", "sonicmoe"])]  # olmoe: H100 only
    assert [cfg for cfg, _, _ in pick_rows(_results(), ["olmoe-1b-7b"], device="NVIDIA H100")] == ["olmoe-1b-7b"]
    # a later run on another device that measured moeblaze alone keeps the table on the complete runs' device
    later = _call("2026-11-25", "12:18", "h100 later", device="NVIDIA H100")
    picked = pick_rows(_results() + [(later, _row("conf4-swiglu", "moeblaze", 60.0))], ["conf4-swiglu"])
    assert [(cfg, call.device, call.time_utc) for cfg, call, _ in picked] == [("conf4-swiglu", "NVIDIA H200", "10:58")]
    # among runs with the same three, one that measured Liger too wins over a later one without it
    c7c = _call("2026-11-26", "08:00", "c7 c")
    later_three = [(c7c, _row("conf7-swiglu", i, 17.0)) for i in ("moeblaze", "conventional", "sonicmoe")]
    assert [call.command for _, call, _ in pick_rows(_results() + later_three, ["conf7-swiglu"])] == ["c7 b"]
    # a run with SonicMoE (the conventional layer out of memory) wins over a later one of three without it
    a, b = _call("2026-11-26", "08:00", "a"), _call("2026-11-27", "08:00", "b")
    rows = [(a, _row("conf3-swiglu", "moeblaze", 37.0)), (a, _row("conf3-swiglu", "sonicmoe", 34.0)),
            (a, _row("conf3-swiglu", "conventional", 0.0, status="OOM"))]
    rows += [(b, _row("conf3-swiglu", i, 40.0)) for i in ("moeblaze", "conventional", "liger")]
    assert [call.command for _, call, _ in pick_rows(rows, ["conf3-swiglu"])] == ["a"]


def test_readme_table_has_same_run_ratios_and_its_runs():
    table = readme_table(pick_rows(_results(), ["conf4-swiglu", "conf7-swiglu"]))
    lines = table.splitlines()
    assert lines[0].endswith("| run |")  # the column numbering the runs listed below the table
    assert lines[2].startswith("| paper conf4 (32768, 2048, 8192, 16, 4) | 70.00 ms · 514 TF/s | 87.50 ms")
    assert "| 0.90x | 1.25x | — | 8,648 / 15,301 / 12,757 / — | 1 |" in lines[2]  # 63/70, 87.5/70; no Liger row
    assert "| 34.00 ms · 1059 TF/s | 0.95x | 1.19x | 2.00x | 1,000 / 1,000 / 1,000 / 3,000 |" in lines[3]  # 16.2/17,
    assert lines[3].endswith("| 2 |")  # 20.2/17, 34/17
    assert lines[0].startswith("| config (T, d, h, E, K) | moeblaze | conventional | SonicMoE | Liger | speed vs "
                               "SonicMoE | speed vs conventional | speed vs Liger | peak MiB: moeblaze / conventional")
    without = readme_table(pick_rows(_results(), ["conf4-swiglu"])).splitlines()  # no Liger: no Liger columns
    assert "Liger" not in without[0] and without[1] == "|---" * 8 + "|" and without[2].count("|") == 9
    assert "1. 2026-11-23, NVIDIA H200 (torch 2.11.0+cu130, triton 3.6.0; commit abc1234): " \
           "`moeblaze bench --configs conf4-swiglu`" in table
    assert "2. 2026-11-24, NVIDIA H200" in table and "`c7 b`" in table


def test_rewrite_readme_between_markers_only(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"# title\n\nintro\n{TABLE_START}\nold table\n{TABLE_END}\n\nafter\n")
    rewrite_readme(readme, "| new |")
    rewrite_readme(readme, "| newer |")  # idempotent: the markers stay
    assert readme.read_text() == f"# title\n\nintro\n{TABLE_START}\n| newer |\n{TABLE_END}\n\nafter\n"
    readme.write_text("no markers\n")
    with pytest.raises(ValueError, match="marker"):
        rewrite_readme(readme, "| x |")


def test_make_report_plots(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "results.csv"
    for call, row in _results():
        append_results(path, [row], call)
    sweep = _call("2026-11-23", "18:44", "sweep")
    append_results(path, [_row(f"sweep-{t}", i, t / 1000 * (1 if i == "moeblaze" else 1.5), group="sweep", T=t)
                          for t in (8192, 32768) for i in ("moeblaze", "conventional")], sweep)
    table, plots = make_report(path, None, tmp_path / "plots", ["conf4-swiglu", "conf7-swiglu"])
    assert {p.name for p in plots} == {"speedup.png", "memory.png", "tokens.png"}
    for p in plots:
        assert p.read_bytes()[:4] == b"\x89PNG"
    assert "paper conf7" in table
    with pytest.raises(ValueError, match="no moeblaze row"):
        make_report(path, None, None, ["nope"])


def test_cli_append_and_report(tmp_path, capsys):
    """``--append-results`` on a CPU run (``--device cpu`` is for tests only), then ``--report`` on a copy."""
    p = argparse.ArgumentParser(prog="moeblaze")
    register(p.add_subparsers(dest="command"))
    results = tmp_path / "results.csv"
    argv = ["bench", "--device", "cpu", "--shape", "32:48:4:2", "--tokens", "16", "--impls", "moeblaze-torch",
            "--dtype", "fp32", "--no-flush", "--min-reps", "1", "--max-reps", "1", "--out", str(tmp_path / "run"),
            "--append-results", str(results), "--commit", "feedbee"]
    for _ in range(2):
        args = p.parse_args(argv)
        assert args.func(args) == 0
    back = read_results(results)
    assert [(c.commit, r.impl, r.status) for c, r in back] == [("feedbee", "moeblaze-torch", "ok")] * 2
    assert "--append-results" in back[0][0].command and back[0][0].device.startswith("CPU")
    readme = tmp_path / "README.md"
    readme.write_text(f"{TABLE_START}\n{TABLE_END}\n")
    args = p.parse_args(["bench", "--report", str(results), "--readme", str(readme)])
    with pytest.raises(SystemExit, match="no moeblaze row"):  # the README configs, not this CPU shape
        args.func(args)
    readme.write_text((REPO / "README.md").read_text())  # the real README, on a copy
    args = p.parse_args(["bench", "--report", str(REPO / "docs" / "results.csv"), "--readme", str(readme),
                         "--plots-dir", str(tmp_path / "plots")])
    assert args.func(args) == 0
    text = readme.read_text()
    assert "| paper conf4 (32768, 2048, 8192, 16, 4) |" in text and "NVIDIA H200" in text
    assert text.count(TABLE_START) == 1 and "wrote" in capsys.readouterr().out
