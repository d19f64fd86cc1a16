"""Weights out of a run: ``moeblaze export`` writes a checkpoint's weights as safetensors, and :func:`load_model`
reads them back (or a checkpoint itself) as a :class:`moeblaze.training.model.MoETransformer`.

A checkpoint (:mod:`moeblaze.training.checkpoint`) holds DCP shards, one file per rank, expert weights under their
global ``[E, ...]`` shape (:mod:`moeblaze.parallel.state_dict`). :func:`export` loads it into a plain model in this one
process — DCP reads any layout into full tensors without a process group, whatever the world size and ``--ep`` of
the run — and writes the model's parameters under their own names (``blocks.0.moe.w_gate_up [E, 2h, d]``, ...)
in the dtype they were trained in, through ``huggingface_hub.save_torch_state_dict``, which writes what
transformers' ``save_pretrained`` writes: ``model.safetensors``, or above ``max_shard_size``
``model-00001-of-0000N.safetensors`` ... and ``model.safetensors.index.json`` (``{"metadata": {"total_size"},
"weight_map": {name: file}}``). With tied embeddings (the default) ``head.weight`` is ``embed.weight`` and is
stored once, as transformers stores tied weights.

The model configuration travels with the weights: the metadata key ``moeblaze_model_config`` holds
:class:`moeblaze.training.model.ModelConfig` as JSON (and ``moeblaze_step`` the step) — in the safetensors header of a
single file, in the index's ``"metadata"`` of a sharded export (where huggingface_hub puts a caller's metadata;
the shards carry ``{"format": "pt"}``). Read with ``safetensors`` alone::

    from safetensors import safe_open
    with safe_open("model.safetensors", "pt") as f:
        config = json.loads(f.metadata()["moeblaze_model_config"])
        tensors = {name: f.get_tensor(name) for name in f.keys()}
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, fields
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from . import checkpoint
from .checkpoint import CheckpointError
from .model import ModelConfig, MoETransformer

__all__ = ["CONFIG_KEY", "DEFAULT_MAX_SHARD_SIZE", "export", "load_model"]

CONFIG_KEY = "moeblaze_model_config"
DEFAULT_MAX_SHARD_SIZE = "5GB"  # huggingface_hub's default for save_torch_state_dict
_SUFFIX = ".safetensors"
_INDEX = ".index.json"


def _checked_out(out: str | Path) -> Path:
    path = Path(out).expanduser()
    if not path.name.endswith(_SUFFIX) or path.name == _SUFFIX:
        raise CheckpointError(f"--out must name a {_SUFFIX} file (e.g. model{_SUFFIX}), got {str(out)!r}")
    if path.parent.exists() and not path.parent.is_dir():
        raise CheckpointError(f"--out {out}: {path.parent} is not a directory")
    return path


def _checkpoint_model(folder: Path, dtype: torch.dtype | None = None) -> tuple[MoETransformer, int]:
    """The model of a verified checkpoint folder, its weights loaded, in the dtype they were saved in (or ``dtype``);
    and the checkpoint's step."""
    state = checkpoint.read_state(folder, check=False)
    model = MoETransformer(ModelConfig(**state["model_config"]))
    saved = checkpoint.saved_dtype(folder, "model." + next(name for name, _ in model.named_parameters()))
    model = model.to(dtype or saved or torch.float32)
    checkpoint.load(folder, model)
    return model, int(state["step"])


def export(checkpoint_path: str | Path, out: str | Path,
           max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> list[Path]:
    """Write the weights of a checkpoint as safetensors (module docstring); returns the files written.

    Args:
        checkpoint_path: a run's ``--out-dir`` (its newest complete checkpoint) or one ``step-*`` folder, written
            by any number of ranks with any ``--fsdp`` / ``--ep``.
        out: the ``.safetensors`` file to write (its folder is created); sharded output goes beside it.
        max_shard_size: bytes per file (an int, or transformers' strings: ``"5GB"`` = 5e9, ``"2GiB"`` = 2 * 2^30).

    Raises:
        CheckpointError: no usable checkpoint, or ``out`` is not a ``.safetensors`` path.
    """
    from huggingface_hub import save_torch_state_dict

    path = _checked_out(out)
    folder = checkpoint.resolve(checkpoint_path)
    model, step = _checkpoint_model(folder)
    tensors = {name: p.detach().contiguous() for name, p in model.named_parameters()}  # tied: stored once
    meta = {CONFIG_KEY: json.dumps(asdict(model.cfg), sort_keys=True), "moeblaze_step": str(step)}
    path.parent.mkdir(parents=True, exist_ok=True)
    pattern = path.name[: -len(_SUFFIX)] + "{suffix}" + _SUFFIX
    try:
        save_torch_state_dict(tensors, path.parent, filename_pattern=pattern, max_shard_size=max_shard_size,
                              metadata=meta)
    except ValueError as err:  # a malformed max_shard_size
        raise CheckpointError(f"--max-shard-size {max_shard_size!r}: {err}") from None
    index = path.parent / (path.name + _INDEX)
    files = [path]
    if index.is_file():
        files = [index, *sorted(path.parent / f for f in set(json.loads(index.read_text())["weight_map"].values()))]
    # the files as the umask leaves a new file (huggingface_hub writes through a private temporary file: 0600)
    mask = os.umask(0)
    os.umask(mask)
    for f in files:
        os.chmod(f, 0o666 & ~mask)
    return files


def _safetensors_files(path: Path) -> tuple[list[Path], dict]:
    """The files of an export and its metadata: ``path`` itself and its header's, or the shards its index
    (``path``, or ``path + .index.json`` beside a sharded export's file name) lists and the index's."""
    index = path if path.name.endswith(_INDEX) else path.parent / (path.name + _INDEX)
    if path.is_file() and not path.name.endswith(_INDEX):
        try:
            with safe_open(str(path), "pt") as f:
                return [path], f.metadata() or {}
        except (OSError, SafetensorError) as err:
            raise CheckpointError(f"{path}: not a readable safetensors file ({err})") from None
    if not index.is_file():
        raise CheckpointError(f"{path}: no such file (nor an index {index.name} beside it)")
    try:
        data = json.loads(index.read_text())
        names, meta = sorted(set(data["weight_map"].values())), dict(data.get("metadata") or {})
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise CheckpointError(f"{index}: not a safetensors index ({type(err).__name__}: {err})") from None
    return [index.parent / name for name in names], meta


def _config_of(where: Path, meta: dict) -> ModelConfig:
    raw = meta.get(CONFIG_KEY)
    if raw is None:
        raise CheckpointError(f"{where}: no {CONFIG_KEY} in its metadata (not written by moeblaze export)")
    known = {f.name for f in fields(ModelConfig)}
    try:
        return ModelConfig(**{k: v for k, v in json.loads(raw).items() if k in known})
    except (ValueError, TypeError) as err:
        raise CheckpointError(f"{where}: bad {CONFIG_KEY} ({err})") from None


def load_model(path: str | Path, device: str | torch.device = "cpu") -> MoETransformer:
    """A :class:`MoETransformer` in eval mode on ``device`` from exported weights (``model.safetensors``, its index
    or the file name of a sharded export) or from a checkpoint (a run's ``--out-dir`` or a ``step-*`` folder).

    Raises:
        CheckpointError: nothing usable at ``path`` (the message names the file and the problem).
    """
    p = Path(path).expanduser()
    if not (p.name.endswith(_SUFFIX) or p.name.endswith(_INDEX)):
        model, _ = _checkpoint_model(checkpoint.resolve(p), torch.float32)
        return model.to(device).eval()
    files, meta = _safetensors_files(p)
    model = MoETransformer(_config_of(p, meta))
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            tensors.update(load_file(str(file)))
        except (OSError, SafetensorError) as err:
            raise CheckpointError(f"{file}: cannot read ({err})") from None
    if model.cfg.tie_embeddings and "embed.weight" in tensors:
        tensors["head.weight"] = tensors["embed.weight"]
    dtype = next(iter(tensors.values())).dtype if tensors else torch.float32
    model = model.to(dtype)
    try:
        model.load_state_dict(tensors, strict=True)
    except RuntimeError as err:
        raise CheckpointError(f"{p}: weights do not fit the model of its configuration ({str(err).splitlines()[0]}"
                              ")") from None
    return model.to(device).eval()
