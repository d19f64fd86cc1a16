"""The ``moeblaze`` command: ``moeblaze train``, ``sample``, ``plot`` and ``export`` (and ``bench``/``memory`` when
present).

Every field of :class:`moeblaze.training.train.TrainConfig` and :class:`moeblaze.training.model.ModelConfig` is a flag
(``steps`` -> ``--steps``, ``d_model`` -> ``--d-model``) and a key of ``--config FILE.toml``
(:mod:`moeblaze.training.config_file`); a flag given on the command line overrides the file, and both override
the default — or, with ``--resume``, the configuration stored in the checkpoint. ``--print-config`` writes the
resolved configuration as TOML and exits. Without ``--out-dir`` each run goes to a new numbered folder
``moeblaze-out/run_N``, and ``--resume``, ``sample``, ``export`` and ``plot`` take the newest
(:mod:`moeblaze.training.run_dirs`). ``moeblaze --version`` prints the package's version.
Errors in the input (a missing ``--data`` path, an unknown device, nothing to resume, a bad flag or a
checkpoint that cannot be loaded) print one line to stderr and exit with status 2, without a traceback.
``moeblaze train`` exits 0 when the run is complete (or was already complete), 1 on a non-finite loss,
128 + the signal's number (130 for Ctrl-C, 143 for SIGTERM) when a signal stopped it after writing a
checkpoint (a second Ctrl-C exits at once with 130, without one), and 3 when another rank of the job was lost
(:mod:`moeblaze.training.heartbeat`: one line names it; continue with ``--resume``).
``moeblaze export --checkpoint OUT --out model.safetensors`` writes a checkpoint's weights as safetensors
(:mod:`moeblaze.training.export`).
"""

from __future__ import annotations

import argparse
import contextlib
import re
import signal
import sys
from dataclasses import MISSING, fields, replace

from . import __version__, settings
from .activations import ACTIVATIONS
from .training.checkpoint import CheckpointError
from .training.config_file import dump_config, read_config
from .training.data import DataError
from .training.evaluate import sample
from .training.export import DEFAULT_MAX_SHARD_SIZE, export
from .training.heartbeat import EXIT_PEER_LOST, PeerLostError
from .training.model import ModelConfig
from .training.resume import load_run_config
from .training.run_dirs import ROOT, holds_metrics, new_run_dir, newest_run, resolve_run
from .training.train import ConfigError, NonFiniteLossError, TrainConfig, train

__all__ = ["PRESETS", "main"]

# ``--preset NAME``: default flag values for a model size (flags given on the command line still win).
# "1b": about 1.05e9 parameters (168M active per token; d 1024, E 64, K 8, h 512, 10 layers, 1024-byte
# context), for GPU runs and the multi-GPU throughput check of scripts/gpu_suite.sh multigpu; a lower peak
# learning rate than the small default suits the larger model. Under --fsdp its 2 GB of bf16 parameters stay
# gathered from forward to backward and gradients reduce in bf16: on 2 H200s 129,242 tokens/s per GPU against
# 104,206 with FSDP2's defaults, one GPU 118,686-120,328 (docs/results-train-multigpu.csv,
# RUNS="fsdp2 1" bash benchmarks/multigpu.sh train with and without EXTRA="--no-fsdp-reshard --fsdp-reduce-dtype bf16").
PRESETS = {
    "small": {},
    "1b": {"d_model": 1024, "n_layers": 10, "n_heads": 16, "d_ff": 512, "num_experts": 64, "top_k": 8,
           "seq_len": 1024, "lr": 1e-3, "min_lr": 1e-4, "fsdp_reshard": False, "fsdp_reduce_dtype": "bf16"},
}

_MODEL_HELP = {
    "vocab_size": "vocabulary size (256: bytes)", "seq_len": "context length in bytes",
    "d_model": "model dimension d", "n_layers": "transformer blocks", "n_heads": "attention heads",
    "d_ff": "expert intermediate size h", "num_experts": "experts per layer E", "top_k": "experts per token K",
    "activation": f"expert activation ({', '.join(ACTIVATIONS)})",
    "score_func": "router scores (softmax, sigmoid)",
    "save": "what the experts keep for backward (preact, input)", "backend": "expert backend (auto, torch, triton)",
    "aux_loss_coef": "load-balancing loss coefficient (0: none)", "z_loss_coef": "router z-loss coefficient",
    "aux_loss_type": "load-balancing loss: switch (each rank's batch), seq (DeepSeek-V3's per sequence) or global "
                     "(Qwen's: expert frequencies summed over all ranks)",
    "expert_bias_rate": "DeepSeek-V3's auxiliary-loss-free balancing: each step, every expert's routing bias moves "
                        "by this much toward the mean load (1e-3 in DeepSeek-V3; 0: off)",
    "tie_embeddings": "share the embedding with the output head", "rope_base": "rotary frequency base",
    "routing": "topk, or token-rounding[:nr|up|down|sr] (SonicMoE token rounding in training; eval: top-k)",
    "rounding_tile": "token rounding's multiple (0: the kernels' M tile, 128 on GPUs; smaller: few tokens per expert)",
}


def _add_dataclass_flags(parser: argparse.ArgumentParser, cls, helps: dict[str, str] | None = None) -> None:
    """One flag per dataclass field; defaults are SUPPRESSed so only flags actually given appear."""
    group = parser.add_argument_group(f"{cls.__name__} (defaults shown)")
    for f in fields(cls):
        default = f.default if f.default is not MISSING else None
        help_text = (helps or {}).get(f.name) or f.metadata.get("help", "")
        kw = {"default": argparse.SUPPRESS, "help": f"{help_text} [default: {default}]"}
        if f.metadata.get("choices"):
            kw["choices"] = f.metadata["choices"]
        flag = "--" + f.name.replace("_", "-")
        if isinstance(default, bool) or str(f.type).startswith("bool"):  # `bool | None`: --x, --no-x or neither
            group.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
        else:
            metavar = "{" + ",".join(kw["choices"]) + "}" if "choices" in kw else f.name.upper()
            group.add_argument(flag, type=type(default) if default is not None else str, metavar=metavar, **kw)


def _split(args: argparse.Namespace, cls) -> dict:
    return {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}


def _given(args: argparse.Namespace) -> tuple[dict, dict]:
    """The TrainConfig and ModelConfig values given: the ``--config`` file's, overridden by the flags given."""
    file_t, file_m = read_config(args.config) if getattr(args, "config", None) else ({}, {})
    return file_t | _split(args, TrainConfig), file_m | _split(args, ModelConfig)


def _configs(args: argparse.Namespace) -> tuple[TrainConfig, ModelConfig]:
    """The run's configurations: defaults < ``--preset`` < given (:func:`_given`); with ``--resume``, the
    checkpoint's < given."""
    given_t, given_m = _given(args)
    preset = PRESETS[getattr(args, "preset", "small")]
    try:
        if given_t.get("resume"):
            if given_t.get("overwrite"):
                raise ConfigError("--resume and --overwrite exclude each other")
            if hasattr(args, "preset"):
                raise ConfigError("--preset sets up a fresh run; --resume continues the checkpoint's configuration")
            out_dir = given_t["out_dir"] if "out_dir" in given_t else str(newest_run(ROOT))
            saved_t, saved_m, _ = load_run_config(out_dir)
            # Continue the stored run; per-invocation options start from their defaults.
            per_run = {"stop_after": 0, "progress": TrainConfig.progress, "overwrite": False, "out_dir": out_dir,
                       "profile_steps": 0}
            if given_t.get("ep", saved_t.ep) == 1 and "ep_exchange" not in given_t:
                per_run["ep_exchange"] = "auto"  # an expert-parallel run resumed without EP: no exchange to pick
            base = replace(saved_t, **per_run)
            return replace(base, **given_t), replace(saved_m, **given_m)
        return (TrainConfig(**{**_split(argparse.Namespace(**preset), TrainConfig), **given_t}),
                ModelConfig(**{**_split(argparse.Namespace(**preset), ModelConfig), **given_m}))
    except ConfigError:
        raise
    except (TypeError, ValueError) as err:
        raise ConfigError(_as_flag(str(err))) from None


def _as_flag(message: str) -> str:
    """A configuration error as the command line names it: ``routing must be ...`` -> ``--routing must be ...``,
    ``top_k=8 must be <= num_experts=4`` -> ``--top-k 8 must be <= --num-experts 4`` (a field's name leading the
    message or followed by ``=``; elsewhere it may be a plain word)."""
    names = {f.name for f in fields(TrainConfig) + fields(ModelConfig)}

    def flag(m: re.Match) -> str:
        if m.group(1) not in names or (m.start() > 0 and m.group(2) is None):
            return m.group(0)
        return "--" + m.group(1).replace("_", "-") + (f" {m.group(2)}" if m.group(2) is not None else "")

    return re.sub(r"\b([a-z][a-z0-9_]*)(?:=(\S+))?", flag, message)


def _cmd_train(args: argparse.Namespace) -> int:
    cfg, mcfg = _configs(args)
    numbered = "out_dir" not in _given(args)[0] and not cfg.resume
    if args.print_config:  # a numbered folder is chosen when the run starts: out_dir stays unset in the file
        note = {"out_dir": f"a new numbered folder {ROOT}/run_N when the run starts"}
        sys.stdout.write(dump_config(cfg, mcfg, omit=note if numbered else None))
        return 0
    claimed = None
    if numbered:
        # one process claims its folder (mkdir); the ranks of a job each name the same next number instead, and their
        # configurations are compared before rank 0 creates it
        single = int(settings.launcher_env().get("WORLD_SIZE", "1")) == 1
        claimed = new_run_dir(ROOT, claim=single)
        cfg = replace(cfg, out_dir=str(claimed))
    try:
        result = train(cfg, mcfg)
    except BaseException:
        if claimed is not None:  # the empty folder of a run that never started (a bad device, ...): not left behind
            with contextlib.suppress(OSError):
                claimed.rmdir()
        raise
    if result.status in ("SIGINT", "SIGTERM"):
        return 128 + getattr(signal, result.status)
    return 0


def _cmd_sample(args: argparse.Namespace) -> int:
    top_k = args.top_k if args.top_k > 0 else None
    text = sample(resolve_run(args.checkpoint), args.prompt, args.max_new_tokens, args.temperature, top_k, args.seed,
                  args.device)
    sys.stdout.write(text + "\n")
    return 0


def _cmd_plot(args: argparse.Namespace) -> int:
    from .training.plot import compare_table, plot_compare, plot_run, read_runs

    runs = [resolve_run(d, holds_metrics) for d in args.out_dir or [ROOT]]
    if len(runs) > 1 or args.out is not None or args.labels:  # labels name the curves of a comparison
        read = read_runs(runs, args.labels.split(",") if args.labels else None)
        print(f"wrote {plot_compare(read, args.out or 'loss-compare.png')}")
        print(compare_table(read))
        return 0
    paths = plot_run(runs[0])
    print(f"wrote {', '.join(p.name for p in paths)} in {paths[0].parent}")
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    size = int(args.max_shard_size) if args.max_shard_size.isdigit() else args.max_shard_size
    for path in export(resolve_run(args.checkpoint), args.out, size):
        print(f"wrote {path} ({path.stat().st_size:,} bytes)")
    return 0


class _Replaced(argparse.Action):
    """A flag that was replaced: giving it is an error that names the flag to use instead (hidden from --help)."""

    def __init__(self, option_strings, dest, replacement: str, **kwargs) -> None:
        self.replacement = replacement
        super().__init__(option_strings, dest, help=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        # one line, as the training command's other flag errors (argparse's error() prints the usage first)
        parser.exit(2, f"{parser.prog}: error: {option_string} was replaced by {self.replacement}\n")


def build_parser() -> argparse.ArgumentParser:
    """The ``moeblaze`` argument parser; each subcommand sets ``func(args) -> int`` as its default."""
    parser = argparse.ArgumentParser(prog="moeblaze", description="Memory-lean Mixture-of-Experts training.")
    parser.add_argument("--version", action="version", version=f"moeblaze {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p_train = subparsers.add_parser(
        "train", help="train a byte-level MoE transformer (default data: the Python standard library)",
        description="Train a small MoE transformer on bytes; prints loss, validation bits/byte, "
                    "tokens/s and the MoE layers' bytes saved for backward; checkpoints to --out-dir.")
    p_train.add_argument("--preset", choices=sorted(PRESETS), default=argparse.SUPPRESS,
                         help="model size: small (the CPU-friendly default) or 1b (~1B parameters, E 64, K 8, "
                              "for GPUs); flags given as well override it [default: small]")
    p_train.add_argument("--config", metavar="FILE.toml", default=argparse.SUPPRESS,
                         help="read the configuration from a TOML file of key = value lines, the keys being these "
                              "flags' names with _ for - (steps = 100, d_model = 256); flags given as well override it")
    p_train.add_argument("--print-config", action="store_true",
                         help="write the resolved configuration as TOML (for --config) to stdout and exit")
    _add_dataclass_flags(p_train, TrainConfig)
    _add_dataclass_flags(p_train, ModelConfig, _MODEL_HELP)
    p_train.add_argument("--dtype", action=_Replaced, default=argparse.SUPPRESS, dest="replaced_dtype",
                         replacement="--precision {bf16-mixed,bf16,fp32,fp8-mixed} "
                                     "(--dtype bfloat16 is --precision bf16)")
    p_train.set_defaults(func=_cmd_train)

    p_sample = subparsers.add_parser("sample", help="generate text from a checkpoint",
                                     description="Continue --prompt with bytes sampled from a trained model (a run, a "
                                                 "checkpoint or an exported .safetensors file).")
    p_sample.add_argument("--checkpoint", default=ROOT,
                          help="a run's --out-dir, a step-* folder, or exported .safetensors; a folder of numbered "
                               "runs: its newest run with a checkpoint [%(default)s]")
    p_sample.add_argument("--prompt", default="def ", help="text to continue [%(default)r]")
    p_sample.add_argument("--max-new-tokens", type=int, default=256, help="bytes to generate [%(default)s]")
    p_sample.add_argument("--temperature", type=float, default=0.8, help="<= 0 for greedy [%(default)s]")
    p_sample.add_argument("--top-k", type=int, default=0,
                          help="sample from the k likeliest bytes; 0 = all [%(default)s]")
    p_sample.add_argument("--seed", type=int, default=0, help="sampler seed [%(default)s]")
    p_sample.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N [%(default)s]")
    p_sample.set_defaults(func=_cmd_sample)

    p_plot = subparsers.add_parser("plot", help="draw a run's loss and expert-load curves (metrics.csv) as PNG files",
                                   description="Read OUT_DIR/metrics.csv of a moeblaze train run and write "
                                               "loss.png and expert_load.png into OUT_DIR; with several OUT_DIRs "
                                               "(or --out), their loss curves in one figure and a table of their "
                                               "final losses, runs of one label summarised by mean and range "
                                               "(needs matplotlib).")
    p_plot.add_argument("out_dir", metavar="OUT_DIR", nargs="*",
                        help=f"the --out-dir of a moeblaze train run; a folder of numbered runs: its newest run with "
                             f"a metrics.csv [{ROOT}]")
    p_plot.add_argument("--out", default=None, metavar="FILE",
                        help="the PNG of the runs' loss curves together [loss-compare.png with several runs]")
    p_plot.add_argument("--labels", default=None, metavar="A,B,...",
                        help="comma-separated legend names, one per run; runs given one name are one group "
                             "(seeds of one setting) [the folder names]")
    p_plot.set_defaults(func=_cmd_plot)

    p_export = subparsers.add_parser(
        "export", help="write a checkpoint's weights as safetensors (one file, or shards and an index)",
        description="Write the weights of a checkpoint (any number of ranks, any --ep) as safetensors with the model "
                    "configuration in each file's metadata, as transformers' save_pretrained shards them.")
    p_export.add_argument("--checkpoint", default=ROOT,
                          help="a run's --out-dir (its newest complete checkpoint) or a step-* folder; a folder of "
                               "numbered runs: its newest run with a checkpoint [%(default)s]")
    p_export.add_argument("--out", required=True, help="the .safetensors file to write (shards go beside it)")
    p_export.add_argument("--max-shard-size", default=DEFAULT_MAX_SHARD_SIZE,
                          help="bytes per file: an integer, or e.g. 5GB (1e9 bytes per GB), 2GiB [%(default)s]")
    p_export.set_defaults(func=_cmd_export)

    # ---- HOOK: more subcommands (`moeblaze bench`, `moeblaze memory`) live in moeblaze.bench.cli.
    # register(subparsers) adds parsers there; each must set_defaults(func=callable(args) -> int | None).
    try:
        from moeblaze.bench.cli import register
    except ImportError:
        pass
    else:
        register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``moeblaze`` console script; exits with the command's status."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # named by the subcommand's parser, whose usage lists the flags it takes
        commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        commands.choices[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        settings.check_environment()
    except ValueError as err:
        print(f"moeblaze {args.command}: error: {err}", file=sys.stderr)
        sys.exit(2)
    try:
        status = args.func(args)
    except (ConfigError, DataError, CheckpointError) as err:
        print(f"moeblaze {args.command}: error: {err}", file=sys.stderr)
        sys.exit(2)
    except NonFiniteLossError as err:
        print(f"moeblaze {args.command}: error: {err}", file=sys.stderr)
        sys.exit(1)
    except PeerLostError as err:
        print(f"moeblaze {args.command}: error: {err}", file=sys.stderr)
        sys.exit(EXIT_PEER_LOST)
    except KeyboardInterrupt:
        print(f"moeblaze {args.command}: interrupted", file=sys.stderr)
        sys.exit(130)
    except SystemExit as err:
        if isinstance(err.code, str):  # a command's one-line usage error (bench, memory): exit 2, as argparse's
            print(err.code, file=sys.stderr)
            sys.exit(2)
        raise
    sys.exit(status or 0)


if __name__ == "__main__":
    main()
