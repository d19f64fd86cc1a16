"""The main job: data, model, `moeblaze train` / `moeblaze sample`, checkpoint-resume, saved-bytes helper."""

from __future__ import annotations

import contextlib
import math
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch

from moeblaze.cli import main
from moeblaze.memory import SavedTensorCounter, saved_bytes
from moeblaze.training import checkpoint
from moeblaze.training.data import DataError, eval_windows, get_batch, load_corpus, unigram_entropy
from moeblaze.training.model import ModelConfig, MoETransformer, Rotary
from moeblaze.training.train import TrainConfig, load_run_config, make_optimizer, sample, train

TINY = ["--seq-len", "32", "--d-model", "32", "--n-layers", "1", "--n-heads", "2", "--d-ff", "32",
        "--num-experts", "4", "--top-k", "2", "--batch-size", "8", "--eval-tokens", "512",
        "--warmup-steps", "2", "--no-progress", "--threads", "2"]


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> Path:
    """~200 kB of real Python source (a few standard-library modules), as one file."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    names = ["textwrap.py", "string.py", "bisect.py", "heapq.py", "fnmatch.py", "glob.py", "shlex.py",
             "difflib.py"]
    data = b"".join((stdlib / n).read_bytes() for n in names if (stdlib / n).exists())
    path = tmp_path_factory.mktemp("data") / "corpus.py"
    path.write_bytes(data)
    return path


def run_cli(*args: str) -> int:
    with pytest.raises(SystemExit) as exc:
        main(list(args))
    return exc.value.code


# ----------------------------------------------------------------------------- memory helper

def test_saved_bytes_counts_unique_storages():
    a = torch.randn(100, requires_grad=True)
    b = torch.randn(100, requires_grad=True)
    assert saved_bytes(lambda: (a * b).sum()) == 2 * 100 * 4  # mul saves both operands
    assert saved_bytes(lambda: (a * b).sum(), exclude=[a]) == 100 * 4
    assert saved_bytes(lambda: (a * a).sum()) == 100 * 4  # same storage saved twice counts once
    assert saved_bytes(lambda: (a[:10] * b[:10]).sum()) == 2 * 100 * 4  # a view keeps its whole storage
    assert saved_bytes(lambda: torch.exp(a.double()).sum(), exclude=[a]) == 100 * 8  # exp saves its output
    with torch.no_grad():
        assert saved_bytes(lambda: (a * b).sum()) == 0


def test_counting_a_forward_only_graph_frees_it():
    """A saved output (softmax keeps its result) must not outlive the graph: the counter would otherwise
    leak one forward graph per measurement (and inflate the peaks measured after it)."""
    import gc
    import weakref

    x = torch.randn(64, 32, requires_grad=True)
    with SavedTensorCounter() as c:
        y = torch.softmax(x * 2, dim=-1)
    ref = weakref.ref(y)
    del y
    gc.collect()
    assert c.bytes == 64 * 32 * 4 and ref() is None  # softmax's output only (x * 2 saves no tensor)


def test_saved_tensor_counter_tracks_only_chosen_modules():
    lin1, lin2 = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
    x = torch.randn(4, 8)
    params = [*lin1.parameters(), *lin2.parameters()]
    with SavedTensorCounter(params).track([lin2]) as c:
        y = lin2(torch.tanh(lin1(x)))  # lin2 saves its input (the tanh output): 4*8 floats
    del y
    assert c.bytes == 4 * 8 * 4 and c.count == 1


# ----------------------------------------------------------------------------- data

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("max_norm", [0.0, 0.5, 1e6])
def test_clip_grad_norm_matches_torch(dtype, max_norm):
    """The FSDP2 loop's gradient norm and clipping (foreach ops over the local shards; one process here, so no
    all-reduce) give torch.nn.utils.clip_grad_norm_'s norm and gradients, mixed shapes and dtypes included."""
    from moeblaze.parallel.runtime import DistEnv
    from moeblaze.training.job import Job, clip_grad_norm

    def params():
        torch.manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(*shape, dtype=dtype)) for shape in ((3, 4), (7,), (2, 2, 5))]
        ps.append(torch.nn.Parameter(torch.randn(6)))  # an fp32 one beside
        for p in ps:
            p.grad = torch.randn_like(p)
        return ps

    ours, ref = params(), params()
    job = Job(DistEnv(0, 1, 0, torch.device("cpu"), None))
    norm = clip_grad_norm(ours, max_norm, job)
    want = (torch.nn.utils.clip_grad_norm_(ref, max_norm) if max_norm > 0
            else torch.nn.utils.get_total_norm([p.grad for p in ref]))
    assert norm.dtype == torch.float32 and math.isclose(norm.item(), want.item(), rel_tol=1e-6)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=0)
    assert max_norm != 0.5 or math.isclose(torch.nn.utils.get_total_norm([p.grad for p in ours]).item(), 0.5,
                                           rel_tol=1e-5)


def test_unigram_entropy():
    assert unigram_entropy(np.arange(256, dtype=np.uint8)) == pytest.approx(8.0)
    assert unigram_entropy(np.zeros(10, dtype=np.uint8)) == 0.0
    assert unigram_entropy(np.frombuffer(b"abab", dtype=np.uint8)) == pytest.approx(1.0)


def test_load_corpus_file_dir_and_missing(tmp_path, text_file):
    c = load_corpus(str(text_file), val_fraction=0.1)
    assert len(c.train) + len(c.val) == text_file.stat().st_size
    assert c.val.tobytes() == text_file.read_bytes()[len(c.train):]  # split by position
    for i in range(30):
        (tmp_path / f"f{i:02d}.txt").write_bytes(b"hello world %d\n" % i * 200)
    (tmp_path / "blob.bin").write_bytes(b"\0\1\2" * 100)  # not text: skipped
    c = load_corpus(str(tmp_path), val_fraction=0.2)
    assert c.num_files == 30 and len(c.train) > 0 and len(c.val) > 0
    assert load_corpus(str(tmp_path), val_fraction=0.2).val.tobytes() == c.val.tobytes()  # deterministic
    with pytest.raises(DataError, match="does-not-exist"):
        load_corpus(str(tmp_path / "does-not-exist"))


def test_default_corpus_is_stdlib_split_by_file():
    c = load_corpus(None)
    assert c.num_files > 100 and len(c.val) > 100_000 and len(c.train) > 5 * len(c.val)
    assert 4.0 < unigram_entropy(c.val) < 5.5


def test_batches_are_step_indexed_and_shifted(text_file):
    data = load_corpus(str(text_file)).train
    x, y = get_batch(data, 7, 4, 16, seed=3)
    x2, y2 = get_batch(data, 7, 4, 16, seed=3)
    assert x.shape == y.shape == (4, 16) and x.dtype == torch.int64
    assert torch.equal(x, x2) and torch.equal(y, y2) and torch.equal(x[:, 1:], y[:, :-1])
    assert not torch.equal(x, get_batch(data, 8, 4, 16, seed=3)[0])
    windows = list(eval_windows(data, 100, 16, 3))
    assert sum(w[0].shape[0] for w in windows) == math.ceil(100 / 16)


# ----------------------------------------------------------------------------- model

def test_model_is_causal_and_generates():
    torch.manual_seed(0)
    cfg = ModelConfig(seq_len=16, d_model=32, n_layers=2, n_heads=2, d_ff=32, num_experts=4, top_k=2)
    model = MoETransformer(cfg).eval()
    idx = torch.randint(0, 256, (2, 16))
    logits = model(idx)
    assert logits.shape == (2, 16, 256) and logits.dtype == torch.float32
    idx2 = idx.clone()
    idx2[:, 10:] = (idx2[:, 10:] + 1) % 256
    torch.testing.assert_close(model(idx2)[:, :10], logits[:, :10])
    out = model.generate(idx[:, :3], 20, temperature=1.0, top_k=5)  # runs past seq_len: context is cropped
    assert out.shape == (2, 23) and torch.equal(out[:, :3], idx[:, :3])
    # generation, one length after the other, keeps one angle table per block (not one per length)
    assert all(len(b.attn.rotary._tables) == 1 for b in model.blocks)
    # inside a compiled graph nothing is kept (a graph's output kept as state is overwritten by CUDA-graph replays)
    rotary = Rotary(8, 10000.0)
    with mock.patch.object(torch.compiler, "is_compiling", return_value=True):
        cos, sin = rotary.tables(5, torch.device("cpu"))
    assert cos.shape == sin.shape == (5, 4) and not rotary._tables
    torch.testing.assert_close((cos, sin), rotary.tables(5, torch.device("cpu")), rtol=0, atol=0)
    with pytest.raises(ValueError, match="seq_len"):
        model(torch.zeros(1, 17, dtype=torch.long))


# ----------------------------------------------------------------------------- training

def test_training_loss_falls(text_file, tmp_path):
    cfg = TrainConfig(data=str(text_file), out_dir=str(tmp_path), steps=60, batch_size=8, lr=3e-3,
                      warmup_steps=5, eval_interval=1000, eval_tokens=2048, progress=False, threads=2)
    mcfg = ModelConfig(seq_len=64, d_model=48, n_layers=1, n_heads=2, d_ff=64, num_experts=4, top_k=2)
    result = train(cfg, mcfg, log=lambda *_: None)
    first, last = np.mean(result.losses[:5]), np.mean(result.losses[-5:])
    assert last < first - 1.0, (first, last)
    assert result.val_bpb < result.unigram_bpb + 0.5 and math.isfinite(result.val_bpb)
    assert result.moe_saved_bytes > 0 and result.tokens_per_s > 0
    assert result.status == "done" and result.checkpoint.endswith("step-000060")
    assert checkpoint.find_latest(tmp_path).name == "step-000060"


def test_the_run_line_says_when_warmup_outlasts_the_run():
    from moeblaze.parallel.runtime import DistEnv
    from moeblaze.training.job import Job
    from moeblaze.training.train import _describe

    job = Job(DistEnv(0, 1, 0, torch.device("cpu"), None))
    short, long = (_describe(1, ModelConfig(), TrainConfig(steps=s, warmup_steps=50), torch.device("cpu"), "fp32", 2,
                             job) for s in (20, 50))
    assert "lr 0.003 (--warmup-steps 50 > --steps 20: never reached), device cpu" in short
    assert "lr 0.003, device cpu" in long


def test_each_step_is_timed_with_its_own_work(text_file, tmp_path, monkeypatch):
    """metrics.csv's step_s holds the step's own work, evaluated steps included: each step here sleeps 50 ms inside
    train_step (an evaluated step was timed ~0 s and the next one twice, when the CPU read a step a step late)."""
    import csv

    import moeblaze.training.train as train_mod

    real = train_mod.train_step

    def slow_step(*args, **kwargs):
        time.sleep(0.05)
        return real(*args, **kwargs)

    monkeypatch.setattr(train_mod, "train_step", slow_step)
    cfg = TrainConfig(data=str(text_file), out_dir=str(tmp_path), steps=6, batch_size=4, warmup_steps=1,
                      eval_interval=2, eval_tokens=256, progress=False, threads=2)
    train(cfg, ModelConfig(seq_len=16, d_model=16, n_layers=1, n_heads=2, d_ff=16, num_experts=4, top_k=2),
          log=lambda *_: None)
    with open(tmp_path / "metrics.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    times = [float(r["step_s"]) for r in rows]
    assert len(times) == 6 and min(times) >= 0.05, times
    assert sum(bool(r["val_bpb"]) for r in rows) == 3


@pytest.mark.parametrize("balance", [[], ["--expert-bias-rate", "1e-2", "--aux-loss-type", "seq"]])
def test_resume_is_bitwise_identical(text_file, tmp_path, balance):
    """Also with the auxiliary-loss-free expert biases (buffers, saved by DCP with the weights) and the
    sequence-wise loss."""
    full, split = tmp_path / "full", tmp_path / "split"
    common = ["train", "--data", str(text_file), "--steps", "8", "--eval-interval", "3", *TINY, *balance]
    assert run_cli(*common, "--out-dir", str(full)) == 0
    assert run_cli(*common, "--out-dir", str(split), "--stop-after", "4") == 0
    assert checkpoint.read_state(checkpoint.find_latest(split))["step"] == 4
    assert run_cli("train", "--resume", "--out-dir", str(split), "--no-progress") == 0
    (ma, oa), (mb, ob) = _load_final(full), _load_final(split)
    assert ma.keys() == mb.keys()
    biases = [k for k in ma if k.endswith("e_score_correction_bias")]
    assert len(biases) == (1 if balance else 0) and all(ma[k].abs().sum() > 0 for k in biases)
    for k in ma:
        assert torch.equal(ma[k], mb[k]), k
    for i in oa:
        for k in oa[i]:
            assert torch.equal(oa[i][k], ob[i][k]), (i, k)


def test_compile_flag_compiles_the_sharded_model(text_file, tmp_path, monkeypatch, capsys):
    """``--compile`` invokes :meth:`MoETransformer.compile_blocks` once, after FSDP2 and expert parallelism are
    applied (``Job.shard``), and leaves the saved bytes unmeasured (compiled blocks save outside the layers' hooks);
    the compiled blocks' numerics: tests/test_graphs.py (CPU) and the GPU training tests."""
    from moeblaze.training.job import Job

    order, shard = [], Job.shard
    monkeypatch.setattr(MoETransformer, "compile_blocks", lambda self: order.append("compile"))
    monkeypatch.setattr(Job, "shard", lambda self, *a, **k: order.append("shard") or shard(self, *a, **k))
    common = ["train", "--data", str(text_file), "--steps", "1", "--eval-interval", "100", *TINY]
    assert run_cli(*common, "--out-dir", str(tmp_path / "eager")) == 0 and order == ["shard"]
    assert "MoE layers saved for backward" in capsys.readouterr().out
    assert run_cli(*common, "--out-dir", str(tmp_path / "compiled"), "--compile") == 0
    assert order == ["shard", "shard", "compile"]
    out = capsys.readouterr().out
    assert "MoE layers saved" not in out and "MoE saved" not in out and "blocks compiled" in out


def test_compile_blocks_leaves_expert_parallel_layers_eager():
    """Under expert parallelism only a block's attention is compiled (the exchange's collectives and hooks stay
    eager); nothing compiles before the first forward."""
    model = MoETransformer(ModelConfig(seq_len=16, d_model=32, n_layers=2, n_heads=2, d_ff=32, num_experts=4,
                                       top_k=2))
    model.blocks[1].moe.ep = object()  # stands for an ExpertParallel: only its presence is read
    model.compile_blocks()
    plain, ep = model.blocks
    assert plain._compiled_call_impl is not None and plain.attn._compiled_call_impl is None
    assert ep._compiled_call_impl is None and ep.attn._compiled_call_impl is not None
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in MoETransformer(model.cfg).named_parameters()]


def _load_final(out_dir: Path) -> tuple[dict, dict]:
    """Weights and AdamW state of the newest checkpoint in ``out_dir``."""
    tcfg, mcfg, _ = load_run_config(str(out_dir))
    model = MoETransformer(mcfg)
    opt = make_optimizer(model, tcfg)
    checkpoint.load(checkpoint.find_latest(out_dir), model, opt)
    return model.state_dict(), opt.state_dict()["state"]


def test_rounding_tile_reaches_the_layers():
    cfg = ModelConfig(seq_len=16, d_model=16, n_layers=2, n_heads=2, d_ff=16, num_experts=4, top_k=2,
                      routing="token-rounding:up", rounding_tile=8)
    moes = [b.moe for b in MoETransformer(cfg).blocks]
    assert [(m.token_rounding, m.rounding_tile) for m in moes] == [("up", 8), ("up", 8)]
    assert MoETransformer(ModelConfig(routing="token-rounding")).blocks[0].moe.rounding_tile is None
    with pytest.raises(ValueError, match="rounding_tile must be an int >= 0"):
        ModelConfig(rounding_tile=-1)


def test_sample_refuses_negative_lengths(tmp_path, capsys):
    assert run_cli("sample", "--checkpoint", str(tmp_path), "--max-new-tokens", "-5") == 2
    assert "--max-new-tokens must be an integer >= 0, got -5" in capsys.readouterr().err


def test_sample_from_checkpoint(text_file, tmp_path, capsys):
    assert run_cli("train", "--data", str(text_file), "--steps", "3", "--out-dir", str(tmp_path), *TINY) == 0
    capsys.readouterr()
    assert run_cli("sample", "--checkpoint", str(tmp_path), "--prompt", "def ", "--max-new-tokens", "40") == 0
    assert capsys.readouterr().out.startswith("def ")
    text = sample(str(tmp_path), "import ", max_new_tokens=10, temperature=0)
    assert text.startswith("import ") and text == sample(str(tmp_path), "import ", max_new_tokens=10, temperature=0)


# ----------------------------------------------------------------------------- errors

def _cli_subprocess(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moeblaze.cli", *args], capture_output=True, text=True, timeout=120)


def test_missing_data_path_is_a_clear_error(tmp_path):
    missing = str(tmp_path / "no-such-corpus.txt")
    proc = _cli_subprocess("train", "--data", missing, "--out-dir", str(tmp_path / "out"))
    assert proc.returncode != 0
    assert missing in proc.stderr and "Traceback" not in proc.stderr


def test_bad_device_and_nothing_to_resume_are_clear_errors(tmp_path, capsys):
    assert run_cli("train", "--device", "tpu", "--out-dir", str(tmp_path)) != 0
    assert "tpu" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert run_cli("train", "--device", "cuda", "--out-dir", str(tmp_path)) != 0
        assert "CUDA is not available" in capsys.readouterr().err
    assert run_cli("train", "--resume", "--out-dir", str(tmp_path / "empty")) != 0
    assert "no checkpoint" in capsys.readouterr().err
    assert run_cli("sample", "--checkpoint", str(tmp_path / "empty")) != 0
    assert "no checkpoint" in capsys.readouterr().err
    assert run_cli("train", "--n-heads", "3", "--out-dir", str(tmp_path)) != 0  # d_model=128 not divisible
    assert "must be --n-heads 3 times an even head size" in capsys.readouterr().err


@pytest.mark.parametrize("flags,message", [
    (["--eval-interval", "0"], "--eval-interval"),
    (["--activation", "tanh"], "--activation must be one of"),
    (["--routing", "foo"], "--routing must be"),
    (["--d-ff", "0"], "--d-ff must be"),
    (["--lr", "-1"], "--lr"),
    (["--fsdp-blocks-per-unit", "0"], "--fsdp-blocks-per-unit must be an integer >= 1, got 0"),
    (["--stepz", "2"], "moeblaze train: error: unrecognized arguments: --stepz 2"),
    (["--num-experts", "4", "--top-k", "5"], "moeblaze train: error: --top-k 5 must be <= --num-experts 4\n"),
])
def test_bad_options_exit_with_a_message(flags, message, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "moeblaze.cli", "train", *flags, "--out-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr


def test_train_step_skips_a_non_finite_step_on_the_device(monkeypatch):
    """The step launches without reading its loss: fused AdamW's found_inf skips a non-finite step (weights and
    AdamW state as before), the host learns of it when it reads the outcome, and a finite step then trains."""
    from moeblaze.training.train import NonFiniteLossError, train_step

    torch.manual_seed(0)
    model = MoETransformer(ModelConfig(seq_len=8, d_model=16, n_layers=1, n_heads=2, d_ff=8, num_experts=4, top_k=2,
                                       backend="torch"))
    opt = make_optimizer(model, TrainConfig())
    x = torch.randint(0, 256, (2, 8))
    train_step(model, opt, x, x.roll(-1, 1), 1e-2, 1.0).result()  # a finite step: AdamW's state exists
    before = [p.detach().clone() for p in model.parameters()]
    state = [(s["step"].clone(), s["exp_avg"].clone()) for s in opt.state.values()]
    real = MoETransformer.forward
    monkeypatch.setattr(MoETransformer, "forward", lambda self, idx: real(self, idx) * math.nan)
    outcome = train_step(model, opt, x, x.roll(-1, 1), 1e-2, 1.0)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(torch.equal(a, s["step"]) and torch.equal(m, s["exp_avg"]) for (a, m), s in zip(state,
                                                                                               opt.state.values()))
    with pytest.raises(NonFiniteLossError, match="LM loss"):
        outcome.result()
    monkeypatch.setattr(MoETransformer, "forward", real)
    loss, _ = train_step(model, opt, x, x.roll(-1, 1), 1e-2, 1.0).result()
    assert math.isfinite(loss) and not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_set_fp8_sets_every_moe_layer_and_rejects_other_values():
    from moeblaze.fp8 import Float8Recipe

    model = MoETransformer(ModelConfig(seq_len=8, d_model=16, n_layers=2, n_heads=2, d_ff=8, num_experts=4, top_k=2))
    recipe = Float8Recipe("blockwise")
    model.set_fp8(recipe)
    assert [moe.fp8 for moe in model.moe_layers()] == [recipe, recipe]
    with pytest.raises(TypeError, match="fp8 must be None or a moeblaze.fp8.Float8Recipe"):
        model.set_fp8("rowwise")
    assert [moe.fp8 for moe in model.moe_layers()] == [recipe, recipe]  # unchanged by the refused value
    model.set_fp8(None)
    assert [moe.fp8 for moe in model.moe_layers()] == [None, None]


def _step_params(micro_batches: int, fp8=None, dtype=torch.float64) -> tuple[list[torch.Tensor], float]:
    """One SGD train_step of a small model (no auxiliary losses: they depend on the batch's routing statistics)."""
    from moeblaze.training.train import train_step

    torch.manual_seed(0)
    model = MoETransformer(ModelConfig(seq_len=8, d_model=16, n_layers=2, n_heads=2, d_ff=8, num_experts=4, top_k=2,
                                       backend="torch", aux_loss_coef=0.0, z_loss_coef=0.0)).to(dtype)
    model.set_fp8(fp8)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x = torch.randint(0, 256, (4, 8), generator=torch.Generator().manual_seed(1))
    loss, _ = train_step(model, opt, x, x.roll(-1, 1), 0.5, 0.0, micro_batches=micro_batches).result()
    return [p.detach().clone() for p in model.parameters()], loss


def test_micro_batches_sum_to_the_batch_step():
    """--grad-accum: a step over 2 or 4 equal micro-batches is the one-batch step (a float64 model, to fp32
    rounding: the cross-entropy and the routers' logits run in fp32), the reported loss their mean; a count not
    dividing the batch is an error."""
    from moeblaze.training.train import train_step

    want, want_loss = _step_params(1)
    for parts in (2, 4):
        got, loss = _step_params(parts)
        assert abs(loss - want_loss) <= 1e-6 * abs(want_loss)
        for a, b in zip(got, want):
            assert torch.allclose(a, b, rtol=1e-6, atol=1e-9)
    with pytest.raises(ValueError, match="micro_batches 3"):
        model = MoETransformer(ModelConfig(seq_len=8, d_model=16, n_layers=1, n_heads=2, d_ff=8, num_experts=4,
                                           top_k=2, backend="torch"))
        x = torch.randint(0, 256, (4, 8))
        train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), x, x, 0.1, 0.0, micro_batches=3)


def test_micro_batches_quantize_fp8_weights_once(monkeypatch):
    """FP8 layers under --grad-accum: each expert weight quantized once per layout and step (not once per
    micro-batch), the step bitwise that of quantizing every micro-batch."""
    from moeblaze.fp8 import Float8Recipe
    from moeblaze.training import step

    quantized = []
    real = Float8Recipe.quantize_weight
    monkeypatch.setattr(Float8Recipe, "quantize_weight", lambda self, w, reduce_cols: quantized.append(
        reduce_cols) or real(self, w, reduce_cols))
    got, _ = _step_params(2, Float8Recipe(), torch.float32)
    assert len(quantized) == 2 * 4  # two layers, w1 and w2 along both dimensions
    quantized.clear()
    monkeypatch.setattr(step, "reuse_weights", contextlib.nullcontext)  # every micro-batch quantizes
    want, _ = _step_params(2, Float8Recipe(), torch.float32)
    assert len(quantized) == 2 * 4 * 2
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_grad_accum_flag_trains_and_checks_the_batch(text_file, tmp_path, capsys):
    """moeblaze train --grad-accum: a run trains; a --batch-size it does not divide is a one-line error."""
    assert run_cli("train", "--data", str(text_file), "--out-dir", str(tmp_path / "a"), "--steps", "2",
                   "--batch-size", "4", "--grad-accum", "2", "--seq-len", "32", "--d-model", "32", "--n-layers", "1",
                   "--n-heads", "2", "--d-ff", "16", "--num-experts", "4", "--eval-tokens", "256",
                   "--no-progress") == 0
    assert "per micro-batch" in capsys.readouterr().out
    assert run_cli("train", "--out-dir", str(tmp_path / "b"), "--batch-size", "6", "--grad-accum", "4") == 2
    assert "--batch-size 6 must be a multiple of --grad-accum 4" in capsys.readouterr().err


@pytest.mark.parametrize("steps, said", [(4, "--profile-steps 2: not profiled, the run takes 4 more steps and the "
                                              "profile needs 5"), (5, "profiled 2 steps: step ")])
def test_profile_steps_profiles_or_says_why_not(text_file, tmp_path, steps, said):
    """``--profile-steps N`` profiles steps 4 .. 3 + N; a run too short for them says so instead of nothing."""
    lines = []
    cfg = TrainConfig(data=str(text_file), out_dir=str(tmp_path), steps=steps, batch_size=4, warmup_steps=1,
                      eval_interval=1000, eval_tokens=256, progress=False, threads=2, profile_steps=2)
    train(cfg, ModelConfig(seq_len=16, d_model=16, n_layers=1, n_heads=2, d_ff=16, num_experts=4, top_k=2),
          log=lines.append)
    assert sum(line.startswith(said) for line in lines) == 1, lines
    assert (tmp_path / "breakdown.csv").exists() == (steps == 5)
    assert steps == 4 or "traced on CUDA only" in next(line for line in lines if line.startswith(said))
