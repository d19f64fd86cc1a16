"""Every bad input of issue 28 gets a one-line error naming the argument (or file), before anything runs."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

import moeblaze
from moeblaze import MoE, build_dispatch, moe_experts
from moeblaze.cli import main
from moeblaze.training.data import DataError, load_corpus


def run_cli(*args: str) -> int:
    with pytest.raises(SystemExit) as exc:
        main(list(args))
    return exc.value.code


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> Path:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    path = tmp_path_factory.mktemp("data") / "corpus.py"
    path.write_bytes((stdlib / "textwrap.py").read_bytes() + (stdlib / "string.py").read_bytes())
    return path


# ----------------------------------------------------------------------------- flags

BAD_FLAGS = [
    (["--lr", "inf"], "--lr"),
    (["--lr", "nan"], "--lr"),
    (["--min-lr", "0.1", "--lr", "0.01"], "--min-lr"),
    (["--weight-decay", "nan"], "--weight-decay"),
    (["--beta1", "2.0"], "--beta1"),
    (["--beta2", "-0.5"], "--beta2"),
    (["--grad-clip", "inf"], "--grad-clip"),
    (["--seed", "-1"], "--seed"),
    (["--val-fraction", "1.5"], "--val-fraction"),
    (["--checkpoint-minutes", "nan"], "--checkpoint-minutes"),
    (["--checkpoint-interval", "-3"], "--checkpoint-interval"),
    (["--keep-checkpoints", "0"], "--keep-checkpoints"),
    (["--peak-tflops", "inf"], "--peak-tflops"),
    (["--rope-base", "0"], "--rope-base"),
    (["--rope-base", "nan"], "--rope-base"),
    (["--vocab-size", "100"], "--vocab-size"),
    (["--aux-loss-coef", "-0.01"], "--aux-loss-coef"),
    (["--z-loss-coef", "inf"], "--z-loss-coef"),
    (["--resume", "--overwrite"], "--overwrite"),
    (["--ep-exchange", "padded"], "--ep-exchange padded"),
]


@pytest.mark.parametrize("flags,name", BAD_FLAGS, ids=[" ".join(f) for f, _ in BAD_FLAGS])
def test_bad_flag_is_a_one_line_error_before_anything_runs(flags, name, tmp_path, capsys):
    out = tmp_path / "out"
    assert run_cli("train", *flags, "--out-dir", str(out), "--no-progress") == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and name in captured.err, captured.err
    assert captured.out == "" and not out.exists()  # nothing loaded, built or created


def test_replaced_dtype_flag_names_its_replacement(tmp_path, capsys):
    out = tmp_path / "out"
    assert run_cli("train", "--dtype", "bfloat16", "--out-dir", str(out), "--no-progress") == 2
    err = capsys.readouterr().err
    assert "--dtype was replaced by --precision" in err and "--precision bf16" in err, err
    assert err.count("\n") == 1 and not out.exists()


def test_backend_triton_on_cpu_is_a_clear_error(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert run_cli("train", "--backend", "triton", "--device", "cpu", "--out-dir", str(tmp_path)) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and "--backend triton" in captured.err and captured.out == ""


def test_nvshmem_exchange_off_cuda_is_a_clear_error():
    """Checked before the run starts (under torchrun every rank says it in one line, not a traceback)."""
    from moeblaze.training.train import _check_exchange
    from moeblaze.training.train_config import ConfigError, TrainConfig

    with pytest.raises(ConfigError, match="--ep-exchange nvshmem moves rows through CUDA symmetric memory") as exc:
        _check_exchange(TrainConfig(fsdp=True, ep=2, ep_exchange="nvshmem"), torch.device("cpu"))
    assert "\n" not in str(exc.value)
    _check_exchange(TrainConfig(fsdp=True, ep=2, ep_exchange="padded"), torch.device("cpu"))


def test_backend_triton_without_triton_says_to_install_it(tmp_path, capsys, monkeypatch):
    """A CPU install has no triton: the hint is to install it, not TRITON_INTERPRET (which needs it too)."""
    import moeblaze.backends
    import moeblaze.training.train

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(moeblaze.training.train, "triton_available", lambda: False)
    assert run_cli("train", "--backend", "triton", "--device", "cpu", "--out-dir", str(tmp_path)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs triton, and its kernels do not import here" in err, err
    instance = moeblaze.backends._instance

    def no_triton(name):
        if name == "triton":
            raise ImportError("No module named 'triton'")
        return instance(name)
    monkeypatch.setattr(moeblaze.backends, "_instance", no_triton)
    with pytest.raises(ValueError, match="backend='triton' needs triton, .*No module named 'triton'") as exc:
        MoE(8, 6, 4, 2, backend="triton")(torch.randn(5, 8))
    assert "\n" not in str(exc.value)


@pytest.mark.parametrize("kind", ["a file", "under a file", "read-only filesystem"])
def test_unwritable_out_dir_fails_before_training(kind, tmp_path, text_file, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    out = {"a file": blocker, "under a file": blocker / "out", "read-only filesystem": Path("/proc/moeblaze-out")}
    assert run_cli("train", "--data", str(text_file), "--out-dir", str(out[kind]), "--no-progress") == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and str(out[kind]) in captured.err and "--out-dir" in captured.err
    assert "data:" not in captured.out  # stopped before the data was loaded and the model built


# ----------------------------------------------------------------------------- data

def test_data_folder_skips_fifos_and_other_non_regular_files(tmp_path):
    """Run in a subprocess with a timeout: reading a FIFO would block forever."""
    for i in range(12):
        (tmp_path / f"f{i:02d}.txt").write_bytes(b"hello world %d\n" % i * 200)
    os.mkfifo(tmp_path / "pipe.txt")
    code = f"from moeblaze.training.data import load_corpus; print(load_corpus({str(tmp_path)!r}, 0.2).num_files)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "12", proc.stderr


def test_data_fifo_or_binary_file_is_refused(tmp_path):
    os.mkfifo(tmp_path / "pipe")
    with pytest.raises(DataError, match="pipe.*neither a regular file nor a directory"):
        load_corpus(str(tmp_path / "pipe"))
    (tmp_path / "blob.bin").write_bytes(bytes(range(256)) * 100)
    with pytest.raises(DataError, match="blob.bin is not text"):
        load_corpus(str(tmp_path / "blob.bin"))


# ----------------------------------------------------------------------------- Python API

def _experts_inputs(T=12, d=8, h=6, E=4, K=2, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, d, generator=g, dtype=dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)
    w = torch.rand(T, K, generator=g)
    w1 = torch.randn(E, 2 * h, d, generator=g, dtype=dtype) * 0.3
    w2 = torch.randn(E, d, h, generator=g, dtype=dtype) * 0.3
    return x, ids, w, w1, w2


def _other_ids():
    x, ids, w, w1, w2 = _experts_inputs()
    return moe_experts(x, ids, w, w1, w2, backend="torch", index=build_dispatch((ids + 1) % 4, 4))


def _modified_in_place():
    x, ids, w, w1, w2 = _experts_inputs()
    index = build_dispatch(ids, 4)
    ids[0] = ids[0].flip(0)
    return moe_experts(x, ids, w, w1, w2, backend="torch", index=index)


def _bf16_interpreted():
    x, ids, w, w1, w2 = _experts_inputs(dtype=torch.bfloat16)
    os.environ["TRITON_INTERPRET"] = "1"
    return moe_experts(x, ids, w, w1, w2, backend="triton")


def _wrong_x():
    x, ids, w, w1, w2 = _experts_inputs()
    return moe_experts(x[:, :7], ids, w, w1, w2, backend="torch")


def _wrong_w_down(shape):
    x, ids, w, w1, _ = _experts_inputs()
    return moe_experts(x, ids, w, w1, torch.randn(*shape), backend="torch")


def _reference(**change):
    x, ids, w, w1, w2 = _experts_inputs()
    args = {"x": x, "topk_ids": ids, "topk_weights": w, "w_gate_up": w1, "w_down": w2, **change}
    return moeblaze.moe_experts_reference(**args)


API_CASES = {
    "index from other ids": (_other_ids, "index was built from other topk_ids"),
    "ids modified after the index": (_modified_in_place, "topk_ids was modified in place"),
    "block_m 2.5": (lambda: build_dispatch(torch.tensor([[0, 1]] * 5), 4, block_m=2.5), "block_m"),
    "block_m 0": (lambda: build_dispatch(torch.tensor([[0, 1]] * 5), 4, block_m=0), "block_m"),
    "bf16 under TRITON_INTERPRET": (_bf16_interpreted, "TRITON_INTERPRET"),
    "wrong last dim of x": (_wrong_x, "x must have shape [T, d=8]"),
    "w_down wrong d": (lambda: _wrong_w_down((4, 9, 6)), "w_down"),
    "w_down wrong h": (lambda: _wrong_w_down((4, 8, 5)), "w_down"),
    "w_down wrong E": (lambda: _wrong_w_down((3, 8, 6)), "w_down"),
    "aux_loss_coef str": (lambda: MoE(8, 6, 4, 2, aux_loss_coef="0.01"), "aux_loss_coef"),
    "aux_loss_coef negative": (lambda: MoE(8, 6, 4, 2, aux_loss_coef=-0.1), "aux_loss_coef"),
    "z_loss_coef nan": (lambda: MoE(8, 6, 4, 2, z_loss_coef=math.nan), "z_loss_coef"),
    "0-d input": (lambda: MoE(8, 6, 4, 2)(torch.tensor(1.0)), "MoE input"),
    "reference float ids": (lambda: _reference(topk_ids=torch.zeros(12, 2)), "topk_ids must be an integer"),
    "reference negative id": (lambda: _reference(topk_ids=torch.full((12, 2), -1)), "expert ids >= 0"),
    "reference weights shape": (lambda: _reference(topk_weights=torch.rand(12, 3)), "topk_weights must have"),
    "reference w_down d": (lambda: _reference(w_down=torch.randn(4, 9, 6)), "w_gate_up must be [E, 2h|h, d]"),
    "reference w_gate_up h": (lambda: _reference(w_gate_up=torch.randn(4, 7, 8)), "w_gate_up must be [E, 2h|h, d]"),
    "reference activation, no tokens": (lambda: _reference(x=torch.randn(0, 8), topk_ids=torch.zeros(0, 2).long(),
                                                            topk_weights=torch.rand(0, 2), activation="swish"),
                                        "activation must be one of"),
    "expert biases of no counting router": (lambda: moeblaze.update_expert_biases(MoE(8, 6, 4, 2)),
                                            "expert_bias_update_rate > 0"),
}


@pytest.mark.parametrize("case", list(API_CASES))
def test_bad_api_input_is_a_one_line_error_naming_the_argument(case, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "0"))  # restored afterwards
    fn, message = API_CASES[case]
    with pytest.raises((ValueError, TypeError)) as exc:
        fn()
    assert message in str(exc.value) and "\n" not in str(exc.value), str(exc.value)


def test_index_check_accepts_the_same_routing():
    """Free for the ids tensor the index was built from; a different tensor with the same ids also passes."""
    x, ids, w, w1, w2 = _experts_inputs()
    expected = moe_experts(x, ids, w, w1, w2, backend="torch")
    for same in (ids, ids.clone().long()):
        out = moe_experts(x, same, w, w1, w2, backend="torch", index=build_dispatch(ids, 4, block_m=4))
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
    with torch.inference_mode():
        frozen = ids.clone()
        moe_experts(x, frozen, w, w1, w2, backend="torch", index=build_dispatch(frozen, 4))


# ----------------------------------------------------------------------------- issue 58: the last six

def _index_of_another_type():
    x, ids, w, w1, w2 = _experts_inputs()
    return moe_experts(x, ids, w, w1, w2, backend="torch", index=build_dispatch(ids, 4).tensors())


def _one_expert_too_many():
    x, ids, w, w1, _ = _experts_inputs()
    return moe_experts(x, ids, w, w1, torch.randn(5, 8, 6), backend="torch")


def _w_gate_up_off_the_index():
    """With an index of E = 4, a w_gate_up of 5 experts is the odd one: named, not w_down."""
    x, ids, w, _, w2 = _experts_inputs()
    return moe_experts(x, ids, w, torch.randn(5, 12, 8), w2, backend="torch", index=build_dispatch(ids, 4))


ISSUE_58 = {  # (call, error type, how the message starts: the argument it names)
    "x as a list (moe_experts)": (lambda: moe_experts(*[a.tolist() if i == 0 else a for i, a in
                                                        enumerate(_experts_inputs())], backend="torch"),
                                  TypeError, "x must be a torch.Tensor"),
    "x as a list (MoE)": (lambda: MoE(8, 6, 4, 2)([[0.0] * 8] * 3), TypeError, "MoE input x must be a torch.Tensor"),
    "topk_ids as a list": (lambda: moe_experts(*[a.tolist() if i == 1 else a for i, a in
                                                 enumerate(_experts_inputs())], backend="torch"),
                           TypeError, "topk_ids must be a torch.Tensor, got list"),
    "topk_weights as a list": (lambda: moe_experts(*[a.tolist() if i == 2 else a for i, a in
                                                     enumerate(_experts_inputs())], backend="torch"),
                               TypeError, "topk_weights must be a torch.Tensor, got list"),
    "index of another type": (_index_of_another_type, TypeError, "index must be a DispatchIndex"),
    "renormalize='no'": (lambda: MoE(8, 6, 4, 2, renormalize="no"), TypeError, "renormalize must be None, True or"),
    "dtype=torch.int32": (lambda: MoE(8, 6, 4, 2, dtype=torch.int32), TypeError, "dtype must be None or a floating"),
    "w_down with one expert too many": (_one_expert_too_many, ValueError, "w_down [E, d, h] must have E=4 experts"),
    "w_gate_up off the index": (_w_gate_up_off_the_index, ValueError, "w_gate_up [E, 2h, d] must have E=4 experts"),
    "fp64 x into an fp32 MoE": (lambda: MoE(8, 6, 4, 2)(torch.randn(3, 8, dtype=torch.float64)), TypeError,
                                "x has dtype torch.float64; expected the weights' dtype torch.float32"),
}


@pytest.mark.parametrize("case", list(ISSUE_58))
def test_issue_58_inputs_name_the_argument(case):
    fn, kind, start = ISSUE_58[case]
    with pytest.raises(kind) as exc:
        fn()
    assert type(exc.value) is kind and str(exc.value).startswith(start) and "\n" not in str(exc.value), str(exc.value)


def test_renormalize_and_dtype_still_take_their_values():
    assert MoE(8, 6, 4, 2, renormalize=True).router.renormalize is True
    assert MoE(8, 6, 4, 2, dtype=torch.float64).w_down.dtype == torch.float64
