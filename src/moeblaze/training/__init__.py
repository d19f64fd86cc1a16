"""The training application around the library: ``moeblaze train`` / ``sample`` / ``export`` / ``plot``.

A byte-level MoE transformer (:mod:`.model`) trained on real text (:mod:`.data`) by a loop (:mod:`.train`, configured
by :mod:`.train_config` and :mod:`.config_file`; its optimizer step :mod:`.step`, its run folder :mod:`.resume`, its
evaluation and ``sample`` :mod:`.evaluate`) with atomic, verified checkpoints (:mod:`.checkpoint`,
:mod:`.checkpoint_manifest`, :mod:`.run_control`), a per-step metrics file (:mod:`.metrics_log`, :mod:`.plot`),
numbered run folders (:mod:`.run_dirs`), weights exported as safetensors (:mod:`.export`), bitwise runs on request
(:mod:`.determinism`) and the ranks of a torchrun job (:mod:`.job`, :mod:`.heartbeat`). It builds on the layer
(:mod:`moeblaze`) and on :mod:`moeblaze.parallel`; neither imports anything from here.
"""

from .evaluate import sample
from .export import load_model
from .step import NonFiniteLossError
from .train_config import ConfigError, TrainConfig, TrainResult

# the loop itself is moeblaze.training.train.train: a package-level ``train`` would hide that module
__all__ = ["ConfigError", "NonFiniteLossError", "TrainConfig", "TrainResult", "load_model", "sample"]
