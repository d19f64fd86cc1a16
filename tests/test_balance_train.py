"""Load balancing in ``moeblaze train`` (issue 61): the flags, the expert load in metrics.csv, ``moeblaze plot``,
``benchmarks/bench_balance.py`` on two tiny CPU runs, and resuming a checkpoint written before the flags."""

from __future__ import annotations

import importlib.util
import json
import math
import multiprocessing
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

import balance_workers as bw
import moeblaze
from dist_utils import run_ranks
from moeblaze.training import checkpoint
from moeblaze.training.model import ModelConfig, MoETransformer
from moeblaze.training.train import load_checkpoint, make_optimizer, train, train_step
from moeblaze.training.train_config import ConfigError, TrainConfig
from test_train import TINY, run_cli, text_file  # noqa: F401  (the fixture)
from train_workers import tiny_configs

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def two_runs(text_file, tmp_path_factory) -> tuple[Path, Path]:  # noqa: F811
    """4 steps each: auxiliary-loss-free (u = 0.05, no loss) and the Switch loss (0.01)."""
    root = tmp_path_factory.mktemp("runs")
    common = ["train", "--data", str(text_file), "--steps", "4", "--eval-interval", "2", *TINY]
    assert run_cli(*common, "--out-dir", str(root / "aux-free"), "--expert-bias-rate", "0.05",
                   "--aux-loss-coef", "0") == 0
    assert run_cli(*common, "--out-dir", str(root / "switch"), "--aux-loss-type", "switch",
                   "--aux-loss-coef", "0.01") == 0
    return root / "aux-free", root / "switch"


def test_the_flags_reach_the_layers_and_the_checkpoint(two_runs):
    cfg = json.loads((checkpoint.find_latest(two_runs[0]) / "state.json").read_text())["model_config"]
    assert (cfg["expert_bias_rate"], cfg["aux_loss_coef"], cfg["aux_loss_type"]) == (0.05, 0.0, "switch")
    moe = MoETransformer(ModelConfig(**cfg)).blocks[0].moe
    assert moe.router.expert_bias_update_rate == 0.05 and moe.router.tokens_per_expert is not None


def test_plot_writes_the_pngs_and_says_where(two_runs, capsys):
    assert run_cli("plot", str(two_runs[0])) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out == [f"wrote loss.png, expert_load.png in {two_runs[0]}"]
    for name in ("loss.png", "expert_load.png"):
        assert (two_runs[0] / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_of_a_folder_without_metrics_is_a_one_line_error(tmp_path, capsys):
    assert run_cli("plot", str(tmp_path)) == 2
    err = capsys.readouterr().err
    assert "metrics.csv" in err and "moeblaze train" in err and err.count("\n") == 1


def test_bench_balance_plots_two_runs_and_prints_the_summary(two_runs, tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("bench_balance", ROOT / "benchmarks" / "bench_balance.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    png = tmp_path / "balance.png"
    assert bench.main([*map(str, two_runs), "--labels", "aux-free", "switch", "--out", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line.split()[1:] for line in lines if line.startswith(("aux-free", "switch"))}
    for label, run in zip(("aux-free", "switch"), two_runs):
        s = bench.summary(moeblaze.training.plot.read_metrics(run))
        assert s["steps"] == 4 and s["final_load"] >= 1.0 and s["mean_load"] >= 1.0
        assert rows[label][:2] == ["4", f"{s['final_loss']:.4f}"]
        assert rows[label][3:5] == [f"{s['final_load']:.3f}", f"{s['mean_load']:.3f}"]
    assert lines[-1] == f"wrote {png}"


def test_bench_balance_takes_more_runs_and_names_a_label_mismatch(two_runs, tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("bench_balance", ROOT / "benchmarks" / "bench_balance.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    png = tmp_path / "three.png"
    runs = [*map(str, two_runs), str(two_runs[0])]
    assert bench.main([*runs, "--labels", "a", "b", "c", "--out", str(png)]) == 0
    assert png.exists() and [ln.split()[0] for ln in capsys.readouterr().out.splitlines()[1:4]] == ["a", "b", "c"]
    with pytest.raises(SystemExit):
        bench.main([*runs, "--labels", "a", "b", "--out", str(png)])
    assert "--labels needs one name per run (3), got 2" in capsys.readouterr().err


def test_train_step_updates_the_biases_after_the_step_and_reports_the_load():
    torch.manual_seed(0)
    mcfg = ModelConfig(seq_len=16, d_model=16, n_layers=2, n_heads=2, d_ff=16, num_experts=4, top_k=2,
                       aux_loss_coef=0.0, expert_bias_rate=0.5, backend="torch")
    model = MoETransformer(mcfg)
    opt = make_optimizer(model, TrainConfig())
    x = torch.randint(0, 256, (4, 16))
    _, load = train_step(model, opt, x, x.roll(-1, 1), 1e-3, 1.0).result()
    ratios = []
    for moe in model.moe_layers():
        counts = torch.bincount(moe.last_topk_ids.flatten().long(), minlength=4)
        ratios.append(float(counts.max()) * 4 / float(counts.sum()))
        want = 0.5 * torch.sign(counts.sum() - 4 * counts).float()
        assert torch.equal(moe.router.e_score_correction_bias, want)
        assert int(moe.router.tokens_per_expert.sum()) == 0
    assert load == pytest.approx((max(ratios), sum(ratios) / 2, 0))


def test_a_checkpoint_written_before_the_new_fields_resumes(text_file, tmp_path, monkeypatch):  # noqa: F811
    """A state.json without ``aux_loss_type`` / ``expert_bias_rate`` (an older version's) loads into the model
    with their defaults; a different value still fails."""
    assert run_cli("train", "--data", str(text_file), "--steps", "1", "--out-dir", str(tmp_path), *TINY) == 0
    path = checkpoint.find_latest(tmp_path)
    real = checkpoint.read_state

    def older(p, check=True):
        state = real(p, check)
        for key in ("aux_loss_type", "expert_bias_rate"):
            state["model_config"].pop(key)
        return state

    monkeypatch.setattr(checkpoint, "read_state", older)
    mcfg = ModelConfig(**older(path)["model_config"])
    model = MoETransformer(mcfg)
    assert load_checkpoint(path, model, None, torch.device("cpu")) == 1
    other = MoETransformer(ModelConfig(**{**asdict(mcfg), "aux_loss_type": "seq"}))
    with pytest.raises(ConfigError, match="aux_loss_type"):
        load_checkpoint(path, other, None, torch.device("cpu"))


def _biases(out_dir: Path, mcfg: ModelConfig) -> dict[str, torch.Tensor]:
    model = MoETransformer(mcfg)
    checkpoint.load(checkpoint.find_latest(out_dir), model)
    return {n: b for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")}


def test_fsdp_run_with_global_loss_and_biases_tracks_one_process_and_resumes_bitwise(text_file, tmp_path):  # noqa: F811
    """2 gloo ranks under FSDP2 with the global-batch loss (frequencies over both ranks) and the bias update (counts
    over both ranks): the one-process losses on the same global batch to 1e-4 and the same biases in the final
    checkpoint (saved from replicated buffers by DCP); stopped at step 4 and resumed: bitwise the whole run."""
    cfg, mcfg = tiny_configs(str(text_file), str(tmp_path / "one"))
    cfg = TrainConfig(**{**asdict(cfg), "steps": 8, "eval_interval": 4})
    mcfg = ModelConfig(**{**asdict(mcfg), "aux_loss_type": "global", "expert_bias_rate": 0.01})
    one = train(cfg, mcfg, log=lambda *_: None)
    with multiprocessing.Manager() as manager:
        results = manager.dict()
        run_ranks(bw.train_global, 2, str(text_file), str(tmp_path), results, timeout=240)
        r = dict(results)
    assert len(r["full"]) == 8 and all(math.isclose(a, b, rel_tol=1e-4) for a, b in zip(r["full"], one.losses)), \
        (r["full"], one.losses)
    assert math.isclose(r["full_val"], one.val_bpb, rel_tol=1e-4)
    assert r["resumed"] == r["full"][4:] and r["resumed_val"] == r["full_val"]
    ours, theirs = _biases(tmp_path / "fsdp", mcfg), _biases(tmp_path / "one", mcfg)
    assert len(ours) == 2 and all(torch.equal(ours[n], theirs[n]) and ours[n].abs().sum() > 0 for n in ours)
