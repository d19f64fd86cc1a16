"""Named benchmark configurations, suites, filters and the FLOP / byte formulas (DESIGN.md §1, §4-6).

A configuration is one MoE layer shape ``(T, d, h, E, K, activation)``. Groups:

* ``paper``  — MoEBlaze Table 1, conf1-conf7 (FFN h = 4d, tokens = batch x seq), SiLU and SwiGLU;
* ``sweep``  — the MoEBlaze poster's token sweep on the conf1 shape (d 512, h 2048, E 4, K 1), SwiGLU,
  T = 8k, 32k, 128k, 512k, 2M;
* ``models`` — the open-model shapes of DESIGN.md §6 (SwiGLU, T = 32768; SonicMoE-7B at T = 24576);
* ``smoke``  — three small shapes for a quick check.

Suites name what ``moeblaze bench --suite`` runs; ``all`` is ordered so that the figures DESIGN.md §6
anchors come first (a global time budget cuts the tail, not the head).
"""

from __future__ import annotations

import fnmatch
from dataclasses import asdict, dataclass

from ..activations import check_activation, is_gated

__all__ = ["BenchConfig", "CONFIGS", "SUITES", "LAYER_SUITES", "get_configs", "filter_configs", "parse_list",
           "parse_tokens", "parse_shape", "config_named", "layer_flops", "expected_saved_bytes", "index_bytes"]


@dataclass(frozen=True)
class BenchConfig:
    """One MoE layer shape to benchmark.

    Attributes:
        name: unique name (``conf3-swiglu``, ``olmoe-1b-7b``, ``sweep-2m`` ...).
        group: ``paper``, ``sweep``, ``models`` or ``smoke`` (plots are drawn per group).
        T: tokens; d: model dim; h: expert intermediate dim; E: experts; K: experts per token.
        activation: ``swiglu``, ``silu``, ... (see :mod:`moeblaze.activations`).

    Raises:
        ValueError: a size below 1, ``K > E``, or an unknown activation.
    """

    name: str
    group: str
    T: int
    d: int
    h: int
    E: int
    K: int
    activation: str = "swiglu"

    def __post_init__(self) -> None:
        check_activation(self.activation)
        for k in ("T", "d", "h", "E", "K"):
            if getattr(self, k) < 1:
                raise ValueError(f"{self.name}: {k} must be >= 1, got {getattr(self, k)}")
        if self.K > self.E:
            raise ValueError(f"{self.name}: K={self.K} > E={self.E}")

    @property
    def N(self) -> int:
        """Routed pairs N = T*K."""
        return self.T * self.K

    @property
    def gated(self) -> bool:
        return is_gated(self.activation)

    @property
    def flops(self) -> int:
        """Forward+backward FLOPs of the experts (router excluded), see :func:`layer_flops`."""
        return layer_flops(self.T, self.d, self.h, self.K, self.activation)

    @property
    def shape(self) -> str:
        """``T=.. d=.. h=.. E=.. K=..`` for tables."""
        return f"T={self.T} d={self.d} h={self.h} E={self.E} K={self.K}"

    def with_tokens(self, T: int) -> BenchConfig:
        """The same layer at another token count (name suffixed ``@T``)."""
        return BenchConfig(f"{self.name}@{T}", self.group, T, self.d, self.h, self.E, self.K, self.activation)

    def as_dict(self) -> dict:
        return asdict(self)


def layer_flops(T: int, d: int, h: int, K: int, activation: str = "swiglu") -> int:
    """FLOPs of one forward+backward of the routed experts: ``18*N*d*h`` gated, ``12*N*d*h`` non-gated.

    Forward is 3 (gated: up 2h, down h) or 2 GEMM-equivalents of ``2*N*d*h`` FLOPs each, backward twice
    that (DESIGN.md §5; SonicMoE and Liger report the same count). N = T*K.
    """
    return (18 if is_gated(activation) else 12) * T * K * d * h


def index_bytes(T: int, E: int, K: int) -> int:
    """Bytes of the dispatch index of DESIGN.md §3: ``4*(E+1) + 12*N`` (three int32 arrays of N, offsets)."""
    return 4 * (E + 1) + 12 * T * K


def expected_saved_bytes(T: int, d: int, h: int, E: int, K: int, activation: str = "swiglu",
                         save: str = "preact", elt: int = 2) -> int:
    """Bytes :func:`moeblaze.moe_experts` keeps for backward, its inputs and weights not counted.

    DESIGN.md §4: ``save="preact"`` keeps the pre-activation ``[N, 2h]`` (``[N, h]`` non-gated) and the
    index; ``save="input"`` keeps the index only. Add ``elt*T*d`` for ``x`` (the "2Td" of DESIGN.md)
    when the input is counted.

    Args:
        T, d, h, E, K: the layer shape (d does not enter: x is not counted here).
        activation: gated activations have a ``2h``-wide pre-activation.
        save: ``"preact"`` or ``"input"``.
        elt: bytes per element of the activations (2 for bf16/fp16, 4 for fp32).

    Raises:
        ValueError: unknown ``save``.
    """
    if save not in ("preact", "input"):
        raise ValueError(f"save must be 'preact' or 'input', got {save!r}")
    rows = 2 * h if is_gated(activation) else h
    pre = T * K * rows * elt if save == "preact" else 0
    return pre + index_bytes(T, E, K)


def _paper() -> list[BenchConfig]:
    table1 = [(1, 512, 4, 1, 65536), (2, 1024, 8, 2, 65536), (3, 1024, 16, 4, 65536), (4, 2048, 16, 4, 32768),
              (5, 512, 16, 4, 32768), (6, 1024, 16, 4, 16384), (7, 2048, 8, 4, 8192)]
    return [BenchConfig(f"conf{i}-{act}", "paper", T, d, 4 * d, E, K, act)
            for act in ("swiglu", "silu") for i, d, E, K, T in table1]


def _sweep() -> list[BenchConfig]:
    tokens = [("8k", 8192), ("32k", 32768), ("128k", 131072), ("512k", 524288), ("2m", 2097152)]
    return [BenchConfig(f"sweep-{tag}", "sweep", T, 512, 2048, 4, 1, "swiglu") for tag, T in tokens]


def _models() -> list[BenchConfig]:
    shapes = [("sonicmoe-7b", 24576, 1536, 256, 128, 8), ("olmoe-1b-7b", 32768, 2048, 1024, 64, 8),
              ("qwen3-30b-a3b", 32768, 2048, 768, 128, 8), ("qwen3-235b-a22b", 32768, 4096, 1536, 128, 8),
              ("deepseek-v3", 32768, 7168, 2048, 256, 8), ("gpt-oss-20b", 32768, 2880, 2880, 32, 4),
              ("mixtral-8x7b", 32768, 4096, 14336, 8, 2)]
    return [BenchConfig(n, "models", T, d, h, E, K, "swiglu") for n, T, d, h, E, K in shapes]


def _smoke() -> list[BenchConfig]:
    return [BenchConfig("smoke-olmoe", "smoke", 4096, 2048, 1024, 64, 8, "swiglu"),
            BenchConfig("smoke-conf5", "smoke", 8192, 512, 2048, 16, 4, "swiglu"),
            BenchConfig("smoke-conf5-silu", "smoke", 8192, 512, 2048, 16, 4, "silu")]


CONFIGS: dict[str, BenchConfig] = {c.name: c for c in _models() + _paper() + _sweep() + _smoke()}

# Layer suites: lists of config names, in run order.
LAYER_SUITES: dict[str, list[str]] = {
    "smoke": [c.name for c in _smoke()],
    "models": [c.name for c in _models()],
    "paper": [c.name for c in _paper()],
    "sweep": [c.name for c in _sweep()],
    # The six layer configs of DESIGN.md §6 and its paper conf7, in the README table's order.
    "readme": ["sonicmoe-7b", "olmoe-1b-7b", "qwen3-30b-a3b", "conf3-swiglu", "conf4-swiglu", "conf7-swiglu",
               "sweep-2m"],
}
LAYER_SUITES["layers"] = (LAYER_SUITES["models"] + [n for n in LAYER_SUITES["paper"] if n.endswith("swiglu")]
                          + LAYER_SUITES["sweep"] + [n for n in LAYER_SUITES["paper"] if n.endswith("silu")])
# Every suite: its layer configs and whether it runs the dispatch / train benchmarks.
SUITES: dict[str, dict] = {name: {"layers": names, "dispatch": False, "train": False}
                           for name, names in LAYER_SUITES.items()}
SUITES["dispatch"] = {"layers": [], "dispatch": True, "train": False}
SUITES["train"] = {"layers": [], "dispatch": False, "train": True}
SUITES["all"] = {"layers": LAYER_SUITES["layers"], "dispatch": True, "train": True}


def parse_list(text: str | None) -> list[str]:
    """``"a, b,c"`` -> ``["a", "b", "c"]``; ``None`` or ``""`` -> ``[]``."""
    return [s.strip() for s in (text or "").split(",") if s.strip()]


def parse_tokens(text: str | None) -> list[int]:
    """``"8k,32768,2M"`` -> ``[8192, 32768, 2097152]`` (suffixes k and M are powers of two).

    Raises:
        ValueError: a value that is not a positive integer with an optional k/M suffix.
    """
    out = []
    for item in parse_list(text):
        mult = {"k": 1 << 10, "m": 1 << 20}.get(item[-1].lower(), 1)
        digits = item[:-1] if mult > 1 else item
        if not digits.isdigit() or int(digits) < 1:
            raise ValueError(f"bad token count {item!r}: expected a positive integer such as 32768, 32k or 2M")
        out.append(int(digits) * mult)
    return out


def parse_shape(text: str, tokens: list[int] | None = None) -> list[BenchConfig]:
    """``"d:h:E:K[:activation]"`` -> a ``custom`` config per token count (default T = 32768).

    Raises:
        ValueError: not four positive integers and an optional activation.
    """
    parts = text.split(":")
    try:
        d, h, E, K = (int(v) for v in parts[:4])
        act = parts[4] if len(parts) > 4 else "swiglu"
        if len(parts) not in (4, 5):
            raise ValueError
        base = BenchConfig(f"custom-d{d}-h{h}-E{E}-K{K}-{act}", "custom", 32768, d, h, E, K, act)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"bad shape {text!r}: expected d:h:E:K[:activation], e.g. 2048:1024:64:8:swiglu "
                         f"({exc})") from exc
    return [base.with_tokens(T) for T in tokens] if tokens else [base]


def config_named(name: str, tokens: int = 0) -> BenchConfig:
    """A config of ``CONFIGS`` by name, or a ``custom`` one from a ``"d:h:E:K[:activation]"`` shape; at
    ``tokens`` tokens if given (else the config's own T; 32768 for a shape).

    Raises:
        ValueError: neither a known config name nor a shape (the message lists the names).
    """
    if name in CONFIGS:
        cfg = CONFIGS[name]
    elif ":" in name:
        cfg = parse_shape(name)[0]
    else:
        raise ValueError(f"unknown config {name!r}: expected one of {', '.join(sorted(CONFIGS))} "
                         "or a shape d:h:E:K[:activation]")
    return cfg.with_tokens(tokens) if tokens else cfg


def filter_configs(configs: list[BenchConfig], patterns: list[str] | None = None,
                   activation: str | None = None) -> list[BenchConfig]:
    """Keep configs whose name or group matches any glob in ``patterns`` (all if empty) and ``activation``."""
    keep = []
    for c in configs:
        if patterns and not any(fnmatch.fnmatchcase(c.name, p) or c.group == p for p in patterns):
            continue
        if activation and c.activation != activation:
            continue
        keep.append(c)
    return keep


def get_configs(suite: str | None = "smoke", patterns: list[str] | None = None, tokens: list[int] | None = None,
                activation: str | None = None) -> list[BenchConfig]:
    """The layer configs to run: a suite's configs (or, with ``suite=None``, every named config), then
    filtered by ``patterns``/``activation``, then expanded over ``tokens`` when given.

    Raises:
        ValueError: unknown suite, or a filter that matches nothing.
    """
    if suite is not None and suite not in SUITES:
        raise ValueError(f"unknown suite {suite!r}; choose from {sorted(SUITES)}")
    names = SUITES[suite]["layers"] if suite is not None else list(CONFIGS)
    configs = filter_configs([CONFIGS[n] for n in names], patterns, activation)
    if not configs and (patterns or activation):
        raise ValueError(f"no config matches {patterns or ''} {activation or ''}; see `moeblaze bench --list`")
    if tokens:
        configs = [c.with_tokens(T) for c in configs for T in tokens]
    return configs
