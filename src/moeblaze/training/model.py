"""A small decoder-only MoE transformer over bytes: the model ``moeblaze train`` trains.

Pre-norm blocks ``x = x + attn(norm(x)); x = x + moe(norm(x))`` (out of place) with RMSNorm, causal multi-head attention
through ``scaled_dot_product_attention`` with rotary positions (RoPE, Su et al. 2021), and a
:class:`moeblaze.MoE` feed-forward layer in every block. Token embedding over 256 byte values; the
output head is tied to the embedding by default.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..activations import ACTIVATIONS, is_gated
from ..backends import create_backends
from ..balance import AUX_LOSS_TYPES
from ..experts import BACKENDS, SAVE_MODES
from ..fp8 import Float8Recipe, check_fp8_recipe
from ..layer import MoE
from ..routing import SCORE_FUNCS
from ..token_rounding import ROUNDING_MODES

__all__ = ["ModelConfig", "MoETransformer"]


@dataclass
class ModelConfig:
    """Sizes and options of :class:`MoETransformer` (notation of DESIGN.md §1).

    Attributes:
        vocab_size: 256 for bytes.
        seq_len: the longest context (rotary tables are built for it).
        d_model: d. n_layers: blocks. n_heads: attention heads (must divide d).
        d_ff: h, each expert's intermediate size. num_experts: E. top_k: K.
        activation, score_func, save, backend: passed to :class:`moeblaze.MoE`.
        aux_loss_coef, z_loss_coef: router loss coefficients (per layer).
        aux_loss_type: the load-balancing loss, ``switch``, ``seq`` or ``global`` (:class:`moeblaze.MoE`).
        expert_bias_rate: u of DeepSeek-V3's auxiliary-loss-free balancing (0 = off): the MoE layers'
            ``expert_bias_update_rate``; ``moeblaze train`` invokes :func:`moeblaze.update_expert_biases` after
            each optimizer step.
        tie_embeddings: share the embedding matrix with the output head.
        rope_base: rotary frequency base.
        routing: ``"topk"`` or ``"token-rounding[:mode]"`` (mode ``nr`` (default), ``up``, ``down``, ``sr``):
            the MoE layers' ``token_rounding`` in training (:mod:`moeblaze.token_rounding`).
        rounding_tile: the multiple token rounding rounds each expert's count to (0: the backend's M tile,
            :func:`moeblaze.tile_multiple`; a smaller one keeps more pairs at few tokens per expert).

    Raises:
        ValueError: a size not a positive int, ``vocab_size < 256``, a coefficient negative or not finite,
            ``d_model`` not ``n_heads`` times an even head size, ``top_k > num_experts``, or an option outside
            its choices (the message names the field).
    """

    vocab_size: int = 256
    seq_len: int = 256
    d_model: int = 128
    n_layers: int = 3
    n_heads: int = 4
    d_ff: int = 256
    num_experts: int = 4
    top_k: int = 2
    activation: str = "swiglu"
    score_func: str = "softmax"
    save: str = "preact"
    backend: str = "auto"
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.001
    aux_loss_type: str = field(default="switch", metadata={"choices": AUX_LOSS_TYPES})
    expert_bias_rate: float = 0.0
    tie_embeddings: bool = True
    rope_base: float = 10000.0
    routing: str = "topk"
    rounding_tile: int = 0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads", "d_ff", "num_experts", "top_k"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive int, got {getattr(self, name)!r}")
        if self.vocab_size < 256:
            raise ValueError(f"vocab_size must be >= 256 (the model reads bytes 0..255), got {self.vocab_size}")
        for name, lo, strict in (("rope_base", 1.0, True), ("aux_loss_coef", 0.0, False), ("z_loss_coef", 0.0, False),
                                 ("expert_bias_rate", 0.0, False)):
            v = getattr(self, name)
            number = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            if not number or v < lo or (strict and v == lo):
                raise ValueError(f"{name} must be a finite number {'>' if strict else '>='} {lo:g}, got {v!r}")
        if self.d_model % self.n_heads or (self.d_model // self.n_heads) % 2:
            raise ValueError(f"d_model={self.d_model} must be n_heads={self.n_heads} times an even head size")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k={self.top_k} must be <= num_experts={self.num_experts}")
        token_rounding_mode(self.routing)
        if not isinstance(self.rounding_tile, int) or isinstance(self.rounding_tile, bool) or self.rounding_tile < 0:
            raise ValueError(f"rounding_tile must be an int >= 0 (0: the backend's M tile), got {self.rounding_tile!r}")
        for name, allowed in (("activation", ACTIVATIONS), ("score_func", SCORE_FUNCS), ("save", SAVE_MODES),
                              ("backend", BACKENDS), ("aux_loss_type", AUX_LOSS_TYPES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")

    def active_params_per_token(self) -> int:
        """Weights one token multiplies through (embedding lookup excluded, head included)."""
        d, h = self.d_model, self.d_ff
        expert = (3 if is_gated(self.activation) else 2) * d * h
        per_layer = 4 * d * d + d * self.num_experts + self.top_k * expert
        return self.n_layers * per_layer + self.vocab_size * d

    def train_flops_per_token(self, seq_len: int | None = None) -> int:
        """Training FLOPs per token: ``6 * active_params + 12 * n_layers * d * seq_len``.

        The first term is forward (2 FLOPs per multiply-add) plus backward (twice forward) through
        the weights (Kaplan et al. 2020; PaLM App. B); the second is attention's ``QK^T`` and ``AV``,
        counted without the causal discount, as PaLM does.
        """
        s = self.seq_len if seq_len is None else seq_len
        return 6 * self.active_params_per_token() + 12 * self.n_layers * self.d_model * s


class Rotary(nn.Module):
    """Rotary positions: rotates pairs ``(x[..., i], x[..., i + head_dim/2])`` by ``pos * base^(-2i/head_dim)``.

    The angle tables (``S x head_dim/2`` values) are built in fp32, so casting the model to bf16 never rounds them,
    and the last ones built are kept per device: training passes one S every step, so they are built once (they
    took 14 of a block's launches per forward, and the training step is bound by the host's launches), while
    generation, one S after the other, keeps one table at a time. The rotation itself runs in fp32.
    """

    def __init__(self, head_dim: int, base: float) -> None:
        super().__init__()
        self.head_dim, self.base = head_dim, base
        self._tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def tables(self, S: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)``, each ``[S, head_dim/2]`` fp32 on ``device``."""
        if torch.compiler.is_compiling():
            # In a compiled graph the tables fuse into the rotation's kernel; kept from one forward to the next, they
            # would be one graph's outputs fed to the next, which CUDA graphs (mode="reduce-overhead") overwrite.
            return self._build(S, device)
        kept = self._tables.get(device)
        if kept is None or kept[0].shape[0] != S:
            kept = self._tables[device] = self._build(S, device)
        return kept

    def _build(self, S: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        dims = torch.arange(0, self.head_dim, 2, device=device, dtype=torch.float32)
        inv_freq = 1.0 / self.base ** (dims / self.head_dim)
        angles = torch.outer(torch.arange(S, device=device, dtype=torch.float32), inv_freq)
        return angles.cos(), angles.sin()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Rotate ``x [..., S, head_dim]`` by position; returns the same shape and dtype."""
        cos, sin = self.tables(x.shape[-2], x.device)
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).to(x.dtype)


class Attention(nn.Module):
    """Causal multi-head self-attention: ``[B, S, d] -> [B, S, d]``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.rotary = Rotary(cfg.d_model // cfg.n_heads, cfg.rope_base)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, d = x.shape
        qkv = self.qkv(x).view(B, S, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        q, k = self.rotary(qkv[:2])  # q and k in one rotation: half the launches of two
        y = F.scaled_dot_product_attention(q, k, qkv[2], is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, S, d))


def token_rounding_mode(routing: str) -> str | None:
    """``--routing`` -> the MoE layer's ``token_rounding``: ``"topk"`` -> None, ``"token-rounding[:mode]"`` -> mode.

    Raises:
        ValueError: any other value.
    """
    name, _, mode = str(routing).partition(":")
    if routing == "topk":
        return None
    if name == "token-rounding" and (mode or "nr") in ROUNDING_MODES:
        return mode or "nr"
    raise ValueError(f"routing must be 'topk' or 'token-rounding[:mode]' with mode in {ROUNDING_MODES}, "
                     f"got {routing!r}")


class Block(nn.Module):
    """``x + attn(norm(x))``, then ``x + moe(norm(x))``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm1 = nn.RMSNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.norm2 = nn.RMSNorm(cfg.d_model)
        self.moe = MoE(cfg.d_model, cfg.d_ff, cfg.num_experts, cfg.top_k, activation=cfg.activation,
                       score_func=cfg.score_func, save=cfg.save, aux_loss_coef=cfg.aux_loss_coef,
                       z_loss_coef=cfg.z_loss_coef, backend=cfg.backend,
                       token_rounding=token_rounding_mode(cfg.routing), rounding_tile=cfg.rounding_tile or None,
                       aux_loss_type=cfg.aux_loss_type, expert_bias_update_rate=cfg.expert_bias_rate,
                       track_expert_load=True)  # the expert load of every step goes to metrics.csv

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.moe(self.norm2(x))


class MoETransformer(nn.Module):
    """Decoder-only byte-level MoE transformer.

    Forward: ``idx [B, S]`` int64 byte values (``S <= seq_len``) -> logits ``[B, S, vocab_size]`` in
    the parameters' dtype. After a training-mode forward, :func:`moeblaze.aux_loss` of the model is
    the sum of the layers' router losses.

    Raises:
        ValueError: ``S > seq_len`` or a non-2-D input.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self._init_weights()
        if cfg.tie_embeddings:
            self.head.weight = self.embed.weight

    def _init_weights(self) -> None:
        # GPT-2 / nanoGPT: N(0, 0.02), residual projections scaled by 1/sqrt(2 * n_layers).
        # The MoE layers keep their own (nn.Linear-like) initialisation.
        for name, p in self.named_parameters():
            if name.endswith(("qkv.weight", "embed.weight", "head.weight")):
                nn.init.normal_(p, std=0.02)
            elif name.endswith("proj.weight"):
                nn.init.normal_(p, std=0.02 / (2 * self.cfg.n_layers) ** 0.5)

    def compile_blocks(self, **options) -> None:
        """``torch.compile`` each block in place (``nn.Module.compile``: parameter names and checkpoints unchanged),
        as torchtitan compiles its blocks; ``options`` go to ``torch.compile``. One graph per block where the layer's
        kernels are custom ops (the Triton backend; the torch backend's per-expert loop breaks the graph). Under
        expert parallelism only the attention is compiled: the exchange's collectives and the hooks that hand the
        layer its local experts run eagerly. Call it after FSDP2 and expert parallelism are applied."""
        create_backends()
        for block in self.blocks:
            (block.attn if block.moe.ep is not None else block).compile(**options)

    def moe_layers(self) -> list[MoE]:
        """The :class:`moeblaze.MoE` module of every block."""
        return [b.moe for b in self.blocks]

    def set_fp8(self, fp8: Float8Recipe | None) -> None:
        """Run every MoE layer's expert GEMMs under the recipe ``fp8`` (:class:`moeblaze.fp8.Float8Recipe`, DESIGN.md
        §8), or in 16 bits with None, as ``moeblaze train --precision fp8-mixed`` does.

        Raises:
            TypeError: ``fp8`` neither None nor a recipe."""
        check_fp8_recipe(fp8)
        for moe in self.moe_layers():
            moe.fp8 = fp8

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if idx.dim() != 2 or idx.shape[1] > self.cfg.seq_len:
            raise ValueError(f"idx must be [B, S] with S <= seq_len={self.cfg.seq_len}, got {tuple(idx.shape)}")
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
        """Sample ``max_new_tokens`` bytes after ``idx [B, S0]``; returns ``[B, S0 + max_new_tokens]`` int64.

        The context is cropped to the last ``seq_len`` bytes. ``temperature <= 0`` means greedy.
        """
        for _ in range(max_new_tokens):
            logits = self(idx[:, -self.cfg.seq_len:])[:, -1, :].float()
            if temperature <= 0:
                nxt = logits.argmax(-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None and top_k < logits.shape[-1]:
                    kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                probs = torch.softmax(logits, dim=-1)
                nxt = torch.multinomial(probs, 1, generator=generator)
            idx = torch.cat((idx, nxt), dim=1)
        return idx
