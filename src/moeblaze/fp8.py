"""FP8 training recipes for the expert GEMMs: e4m3 operands with fp32 scales (DESIGN.md §8, issue 59).

A :class:`Float8Recipe` says how each operand of a grouped GEMM is scaled before its cast to
``torch.float8_e4m3fn`` (largest finite value 448). Every operand is scaled along the GEMM's *reduction*
dimension, so that a scale is constant over each slice the tensor cores sum and can be applied once per
block of partial sums in fp32 (DeepSeek-V3, arXiv 2412.19437 §3.3.2, "fine-grained quantization"):

- ``"blockwise"`` (DeepSeek-V3 §3.3.2, as DeepGEMM): activation-like operands in ``1 x B`` tiles (one
  row, B consecutive elements of the reduction dimension), weights in ``B x B`` blocks, B = 128. One
  quantized copy of a weight serves the forward GEMM and the backward one that reduces over its other
  dimension, since a square block is a tile along either.
- ``"rowwise"`` (torchao's FP8 rowwise MoE training): one scale per row of each operand along the reduction
  dimension — a whole row of an activation, a row of a weight in the forward GEMM and a column of it in the
  input-gradient GEMM.

The weight-gradient GEMMs (B2, B4) reduce over the slots of one expert: blockwise scales their operands over
runs of ``B`` slots of one expert, never across two experts (:func:`quantize_fp8_slots`); rowwise runs them in
16 bits (:mod:`moeblaze.ops_fp8`, DESIGN.md §8 says why).

A block's scale is ``amax / 448`` (``amax`` its largest magnitude), so that its largest element lands on
448; the scaled values are clamped to ``[-448, 448]`` (rounding in the division may pass 448 by an ulp)
and rounded to nearest even by the cast. A block of zeros gets scale 1 (not 0: no ``0/0``); a block whose
``amax / 448`` is below the smallest normal fp32 number gets that number, so the scale is never
subnormal. A block holding NaN or Inf dequantizes to NaN throughout, as the GEMM on it would.
With ``pow2_scales`` each scale is rounded *up* to a power of two (DeepSeek-V3's later UE8M0 scales,
torchao's ``round_scales_to_power_of_2``): the division is then exact and the largest element lands in
``(224, 448]``, one bit of range given up for exact rescaling.

Sizes that are not multiples of the block: the last block of a dimension is shorter (it covers what is
left). That is what zero padding to the next multiple gives, since zeros do not change a block's ``amax``,
and what a kernel's out-of-bounds zero-filled tile loads compute; it lets shapes as gpt-oss-20b's
d = 2880 = 22.5 x 128 run without a copy. Scales have ``ceil(size / B)`` entries along a blocked dimension.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

import torch
from torch import Tensor
from torch.optim.optimizer import register_optimizer_step_post_hook

__all__ = ["E4M3", "E4M3_MAX", "GRANULARITIES", "SCALE_FLOOR", "KEPT_TILE", "Float8Recipe", "Float8Slots",
           "Float8Tensor", "quantize_fp8", "quantize_kept", "quantize_fp8_slots", "slot_tiles", "check_fp8_backend",
           "check_fp8_recipe", "reuse_weights", "weight_copy"]

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
GRANULARITIES = ("blockwise", "rowwise")
SCALE_FLOOR = torch.finfo(torch.float32).tiny  # smallest normal fp32: the floor of a nonzero block's scale
# columns of a tile of the pre kept for backward (Float8Recipe.quantize_kept): F1's output tiles (64-256 columns) hold
# whole ones, so its epilogue quantizes them where it computes them
KEPT_TILE = 64


@dataclass(frozen=True)
class Float8Recipe:
    """How the expert GEMMs quantize their operands to e4m3 (see the module docstring).

    Args:
        granularity: ``"rowwise"`` (one scale per row along the reduction dimension; torchao; the recipe the
            Triton kernels run) or ``"blockwise"`` (1 x ``block_size`` activation tiles, ``block_size`` x
            ``block_size`` weight blocks; DeepSeek-V3 §3.3.2; emulated on ``backend="torch"``).
        block_size: B, elements per tile along the reduction dimension (blockwise; and slots per tile of the
            weight-gradient GEMMs). A power of two >= 16; DeepSeek-V3 and DeepGEMM use 128.
        pow2_scales: round every scale up to a power of two (exact rescaling, one bit of range less).

    Raises:
        ValueError: an unknown ``granularity``, a ``block_size`` that is not a power of two >= 16.
        TypeError: ``block_size`` not an int, ``pow2_scales`` not a bool.
    """

    granularity: str = "rowwise"
    block_size: int = 128
    pow2_scales: bool = False

    def __post_init__(self) -> None:
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"Float8Recipe granularity must be one of {GRANULARITIES}, got {self.granularity!r}")
        if not isinstance(self.block_size, int) or isinstance(self.block_size, bool):
            raise TypeError(f"Float8Recipe block_size must be an int, got {type(self.block_size).__name__}")
        if self.block_size < 16 or self.block_size & (self.block_size - 1):
            raise ValueError(f"Float8Recipe block_size must be a power of two >= 16, got {self.block_size}")
        if not isinstance(self.pow2_scales, bool):
            raise TypeError(f"Float8Recipe pow2_scales must be a bool, got {type(self.pow2_scales).__name__}")

    def row_block(self, cols: int) -> tuple[int, int]:
        """The tile of an activation-like operand with ``cols`` columns: ``(1, B)`` blockwise, ``(1, cols)``
        rowwise."""
        return (1, self.block_size if self.granularity == "blockwise" else max(cols, 1))

    def quantize_rows(self, t: Tensor) -> Float8Tensor:
        """An activation-like operand ``t [rows, cols]`` reduced along ``cols`` (x in F1, act in F2, dout in
        B1, dpre in B3): tiles of :meth:`row_block`."""
        return quantize_fp8(t, self.row_block(t.shape[-1]), self.pow2_scales)

    def quantize_kept(self, pre: Tensor, gated: bool) -> Float8Tensor:
        """The pre-activation ``pre [N, 2h|h]`` kept for backward (``save="preact"``) in ``1 x KEPT_TILE`` (64)
        tiles along each half, gate and up (``gated``), as DeepSeek-V3 caches the SwiGLU inputs in FP8 (§3.3.3):
        ``data [N, 2|1, h]`` (a view of ``[N, 2h|h]``), ``scale [N, 2|1, ceil(h/64)]``. Not a GEMM operand (the
        activation backward reads it), so its tiles need not follow the granularity; 64 columns divide every
        output tile of F1, whose epilogue quantizes them where it computes them (:mod:`moeblaze.kernels.
        fp8_experts`), 4 bytes of scale per 64 of data."""
        return quantize_kept(pre, gated, self.pow2_scales)

    def quantize_weight(self, w: Tensor, reduce_cols: bool) -> Float8Tensor:
        """A weight ``w [E, rows, cols]``: reduced along ``cols`` (``reduce_cols``, the forward GEMMs: F1 reads
        ``w_gate_up [E, 2h, d]``, F2 ``w_down [E, d, h]``) or along ``rows`` (the input-gradient GEMMs B1, B3).
        Blockwise ``B x B`` blocks either way; rowwise a scale per row, or per column."""
        if self.granularity == "blockwise":
            return quantize_fp8(w, (self.block_size, self.block_size), self.pow2_scales)
        block = (1, w.shape[-1]) if reduce_cols else (w.shape[-2], 1)
        return quantize_fp8(w, block, self.pow2_scales)

    def quantize_slots(self, t: Tensor, offsets: Tensor) -> Float8Slots:
        """An operand of a weight-gradient GEMM (B2, B4), ``t [N, C]`` reduced over each expert's slots:
        runs of B slots of one expert blockwise, all of an expert's slots rowwise (:func:`quantize_fp8_slots`)."""
        block = self.block_size if self.granularity == "blockwise" else None
        return quantize_fp8_slots(t, offsets, block, self.pow2_scales)


def check_fp8_recipe(fp8) -> None:
    """Raise ``TypeError`` unless ``fp8`` (the ``fp8`` argument of the public API) is None or a recipe."""
    if fp8 is not None and not isinstance(fp8, Float8Recipe):
        raise TypeError(f"fp8 must be None or a moeblaze.fp8.Float8Recipe (e.g. Float8Recipe('rowwise')), "
                        f"got {type(fp8).__name__}")


def check_fp8_backend(backend: str, dtype: torch.dtype, device: torch.device,
                      recipe: Float8Recipe | None = None) -> None:
    """Whether the experts can run an FP8 recipe on ``backend`` (``"torch"`` or ``"triton"``) for ``x`` of
    ``dtype`` on ``device``; with ``recipe``, that recipe (the Triton kernels run the rowwise one).

    Raises:
        TypeError: ``dtype`` neither fp32, fp16 nor bf16 (the recipe quantizes what a GPU run would; fp64 is the
            reference's dtype).
        ValueError: the Triton backend on a CUDA device older than Hopper (sm90), naming the device.
        NotImplementedError: the Triton backend with a recipe other than rowwise (its backward kernels do not
            exist; the torch backend emulates it).
    """
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"fp8 quantizes fp32, fp16 or bf16 x; got {dtype} (run fp64 without fp8)")
    if backend != "triton":
        return
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if major < 9:
            raise ValueError(f"fp8 on backend='triton' needs a Hopper GPU (sm90+); {device} is "
                             f"{torch.cuda.get_device_name(device)} (sm{major}{minor}): pass fp8=None, or "
                             "backend='torch' for the recipe's PyTorch emulation")
    if recipe is not None and recipe.granularity != "rowwise":
        raise NotImplementedError(f"fp8 on backend='triton' runs Float8Recipe('rowwise'); the {recipe.granularity} "
                                  "recipe's backward kernels are not written (backend='torch' emulates it)")


class Float8Tensor(NamedTuple):
    """A tensor quantized in tiles of ``block = (rows, cols)`` of its last two dimensions.

    ``data [..., R, C]`` float8_e4m3fn; ``scale [..., ceil(R / rows), ceil(C / cols)]`` fp32, so that
    ``t ~= data * scale`` tile by tile.
    """

    data: Tensor
    scale: Tensor
    block: tuple[int, int]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """``data * scale`` (each tile times its scale, in fp32) as ``dtype``, shape of ``data``."""
        return (self.data.float() * _expand(self.scale, self.block, self.data.shape)).to(dtype)


class Float8Slots(NamedTuple):
    """An ``[N, C]`` slot tensor quantized per column over runs of slots (:func:`quantize_fp8_slots`).

    ``data [N, C]`` float8_e4m3fn; ``scale [tiles, C]`` fp32; ``tile [N]`` int64, the run of each slot.
    """

    data: Tensor
    scale: Tensor
    tile: Tensor

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """``data[s] * scale[tile[s]]`` as ``dtype``, ``[N, C]``."""
        return (self.data.float() * self.scale.index_select(0, self.tile)).to(dtype)


def _expand(scale: Tensor, block: tuple[int, int], shape: torch.Size) -> Tensor:
    """``scale [..., nR, nC]`` repeated to the elements of its tiles, ``shape [..., R, C]``."""
    rows, cols = shape[-2], shape[-1]
    s = scale.repeat_interleave(block[0], dim=-2)[..., :rows, :]
    return s.repeat_interleave(block[1], dim=-1)[..., :cols]


def _scales(amax: Tensor, pow2: bool) -> Tensor:
    """fp32 scales from the blocks' largest magnitudes: ``amax / 448``, 1 for a zero block, at least the
    smallest normal fp32, rounded up to a power of two with ``pow2`` (NaN and Inf kept)."""
    # a 0-dim tensor divisor, not the float: PyTorch's CUDA division by a Python scalar multiplies by its
    # reciprocal, 1 ulp off the division (and the kernels') for some amax
    scale = torch.where(amax == 0, 1.0, (amax / amax.new_tensor(E4M3_MAX)).clamp(min=SCALE_FLOOR))
    if pow2:
        # frexp: scale = m 2^e, m in [0.5, 1); the next power of two at or above is 2^(e-1) when m = 0.5, else 2^e
        m, e = torch.frexp(scale)
        up = torch.ldexp(torch.ones_like(scale), e - (m == 0.5).to(e.dtype))
        scale = torch.where(torch.isfinite(scale), up, scale)
    return scale


def _cast(scaled: Tensor) -> Tensor:
    """e4m3 of values already divided by their scale, saturated at 448 explicitly: torch 2.13's cast saturates
    on its own, but not every conversion does (Triton's interpreter wraps past 448), so it is part of the recipe."""
    return scaled.clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


def quantize_fp8(t: Tensor, block: tuple[int, int], pow2_scales: bool = False) -> Float8Tensor:
    """Quantize ``t`` to e4m3 with one fp32 scale per ``block`` tile of its last two dimensions
    (DeepSeek-V3 §3.3.2; this module's docstring for the scale rule and the short last tiles).

    Args:
        t: ``[..., R, C]`` float tensor (fp32, bf16, fp16), at least 2-D.
        block: ``(rows, cols)`` of a tile, positive ints: ``(1, 128)`` the activation tiles, ``(128, 128)`` the
            weight blocks, ``(1, C)`` a scale per row, ``(R, 1)`` a scale per column.
        pow2_scales: round the scales up to powers of two.

    Returns:
        :class:`Float8Tensor`: ``data [..., R, C]`` float8_e4m3fn, ``scale [..., ceil(R/rows), ceil(C/cols)]``
        fp32.

    Raises:
        TypeError: ``t`` not a floating-point tensor. ValueError: ``t`` below 2-D, or a bad ``block``.
    """
    if not isinstance(t, Tensor) or not t.is_floating_point():
        raise TypeError(f"quantize_fp8 takes a floating-point tensor, got {getattr(t, 'dtype', type(t).__name__)}")
    if t.dim() < 2:
        raise ValueError(f"quantize_fp8 takes a tensor of at least 2 dimensions [..., R, C], got {tuple(t.shape)}")
    if len(block) != 2 or any(not isinstance(b, int) or b < 1 for b in block):
        raise ValueError(f"block must be two positive ints (rows, cols), got {block!r}")
    *lead, rows, cols = t.shape
    nr, nc = -(-rows // block[0]), -(-cols // block[1])
    # zero padding to whole tiles: zeros leave each tile's amax as it is (the short last tiles)
    padded = torch.nn.functional.pad(t.float(), (0, nc * block[1] - cols, 0, nr * block[0] - rows))
    tiles = padded.view(*lead, nr, block[0], nc, block[1])
    scale = _scales(tiles.abs().amax(dim=(-3, -1)), pow2_scales)  # [..., nr, nc]
    data = _cast(tiles / scale[..., :, None, :, None]).view(*lead, nr * block[0], nc * block[1])
    # a copy where tiles were padded: a view would keep the padded storage alive (and saved for backward)
    return Float8Tensor(data[..., :rows, :cols].contiguous(), scale, (block[0], block[1]))


def quantize_kept(pre: Tensor, gated: bool, pow2_scales: bool = False) -> Float8Tensor:
    """:meth:`Float8Recipe.quantize_kept`: ``pre [N, 2h|h]`` in ``1 x KEPT_TILE`` tiles of each half (gate and up when
    ``gated``): ``data [N, 2|1, h]`` (a view of ``[N, 2h|h]``), ``scale [N, 2|1, ceil(h/KEPT_TILE)]``."""
    halves = 2 if gated else 1  # the width by name: a -1 is ambiguous for N = 0
    return quantize_fp8(pre.reshape(pre.shape[0], halves, pre.shape[1] // halves), (1, KEPT_TILE), pow2_scales)


def slot_tiles(offsets: Tensor, num_slots: int, block: int | None) -> tuple[Tensor, int]:
    """``(tile [N] int64, tiles)``: the run of slots each slot is scaled with, and a bound on the runs.

    Slots ``offsets[e]:offsets[e+1]`` of expert e form runs of ``block`` slots from the expert's first slot
    (``block`` None: one run per expert); slots past ``offsets[-1]`` (another rank's experts) share one last
    run of their own, so their contents never reach a local expert's scale. ``tiles = N // block + E + 1``
    (``E + 1`` rowwise) bounds the count without a host read. ``offsets [E+1]`` int.
    """
    E = offsets.numel() - 1
    off = offsets.long()
    slot = torch.arange(num_slots, device=offsets.device)
    expert = torch.searchsorted(off[1:], slot, right=True)  # [N] in [0, E]; E: past the local slots
    if block is None:
        return expert, E + 1
    tiles = num_slots // block + E + 1
    runs = (off[1:] - off[:-1] + block - 1) // block  # [E] runs per expert
    first = runs.cumsum(0) - runs
    local = expert.clamp(max=E - 1)
    tile = first.index_select(0, local) + (slot - off.index_select(0, local)) // block
    return torch.where(expert < E, tile, tiles - 1), tiles


def quantize_fp8_slots(t: Tensor, offsets: Tensor, block: int | None, pow2_scales: bool = False) -> Float8Slots:
    """Quantize the slot rows ``t [N, C]`` to e4m3 with one fp32 scale per column and run of slots of one
    expert — the operands of the weight-gradient GEMMs, which reduce over an expert's slots (DESIGN.md §5 B2,
    B4; DeepSeek-V3 §3.3.2 tiles along the reduction dimension; torchao's per-group column scales when
    ``block`` is None). No host synchronisation.

    Args:
        t: ``[N, C]`` float tensor, rows in slot order (DESIGN.md §3).
        offsets: ``[E+1]`` int ``expert_token_offsets`` (the local experts'; slots past ``offsets[E]`` are
            another rank's, scaled apart).
        block: slots per run (blockwise), or None for all of an expert's slots (rowwise).
        pow2_scales: round the scales up to powers of two.

    Returns:
        :class:`Float8Slots`: ``data [N, C]`` float8_e4m3fn, ``scale [tiles, C]`` fp32 (runs past the last
        used one have scale 1), ``tile [N]`` int64.

    Raises:
        TypeError: ``t`` not a floating-point tensor. ValueError: ``t`` not 2-D.
    """
    if not isinstance(t, Tensor) or not t.is_floating_point():
        raise TypeError(f"quantize_fp8_slots takes a floating-point tensor, got {getattr(t, 'dtype', type(t))}")
    if t.dim() != 2:
        raise ValueError(f"quantize_fp8_slots takes slot rows [N, C], got {tuple(t.shape)}")
    tile, tiles = slot_tiles(offsets, t.shape[0], block)
    magnitude = t.float().abs()
    amax = magnitude.new_zeros(tiles, t.shape[1]).scatter_reduce_(0, tile[:, None].expand_as(magnitude),
                                                                  magnitude, "amax")
    scale = _scales(amax, pow2_scales)
    return Float8Slots(_cast(t.float() / scale.index_select(0, tile)), scale, tile)


# ---------------------------------------------------------------- weight copies kept over micro-batches

_Copy = TypeVar("_Copy")
_SCOPES = [0, None]  # open reuse_weights() contexts; the optimizer-step hook's handle while one is open
_COPIES: dict[tuple, tuple[weakref.ref, int, object]] = {}  # key -> (the weight, its version, the copy)
_KEPT: dict[int, weakref.ref] = {}  # id -> the tensor copies in _COPIES: weights themselves (one lookup, no scan)


@contextlib.contextmanager
def reuse_weights() -> Iterator[None]:
    """Quantize each FP8 layer's expert weights once per parameter update, not once per micro-batch: inside this
    context the e4m3 copies of a weight (each layout a GEMM reads: rows for F1 / F2, the transposed copy for B1 /
    B3; of an fp32 master weight under autocast, made from it directly) are kept and reused by every forward and
    backward until the weight changes. For gradient accumulation, as Transformer Engine's
    first-micro-batch flag and DeepSeek-V3's weights quantized once per step::

        with moeblaze.fp8.reuse_weights():
            for micro in batches:
                loss_fn(model(micro)).backward()
        optimizer.step()

    A copy is reused while its weight (an ``nn.Parameter``, or a view of one) is the same tensor at the same
    autograd version; an in-place update makes a new one, and any ``torch.optim`` optimizer's ``step()`` inside
    the context drops every copy (so parameters written without a version change, as a sharded gather may write
    them, are never stale).
    Not while ``torch.compile`` traces or a CUDA graph is captured (there each call quantizes, so a replay reads the
    weights of its own time), nor for weights that reach the layer as new tensors each forward (the local expert
    shards of expert parallelism under FSDP2, :mod:`moeblaze.parallel.fsdp`). Contexts nest; the copies are freed
    when the outermost one exits.

    Memory: the copies of every FP8 layer stay alive inside the context, about as many bytes as the 16-bit
    weights (e4m3 rows and transposed copy); under
    FSDP2 they are copies of the gathered, unsharded weights.
    """
    if _SCOPES[0] == 0:
        _SCOPES[1] = register_optimizer_step_post_hook(lambda *_: _clear_copies())
    _SCOPES[0] += 1
    try:
        yield
    finally:
        _SCOPES[0] -= 1
        if _SCOPES[0] == 0:
            _SCOPES[1].remove()
            _SCOPES[1] = None
            _clear_copies()


def _clear_copies() -> None:
    _COPIES.clear()
    _KEPT.clear()


def copies_kept() -> bool:
    """Whether :func:`weight_copy` keeps copies now: inside :func:`reuse_weights`, neither compiling nor capturing
    a CUDA graph (the compiling test first: the trace reads no module state)."""
    return not torch.compiler.is_compiling() and bool(_SCOPES[0]) and not (
        torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def weight_copy(w: Tensor, tag: tuple, make: Callable[[], _Copy]) -> _Copy:
    """``make()``, a copy of the weight ``w`` (``tag`` names which: layout, dtype, recipe); inside
    :func:`reuse_weights` the copy made earlier for the same ``w`` and ``tag`` while ``w`` is unchanged. ``w``
    qualifies when it (or the tensor it views) is an ``nn.Parameter`` or a copy kept here (a weight regrouped for
    the kernels, :func:`moeblaze.experts._as_gate_up_blocks`: kept while its parameter is unchanged); anything else
    (its storage may be reused), and any call outside the context, while compiling or while capturing a CUDA graph,
    is ``make()``."""
    if not copies_kept():
        return make()
    base = w if w._base is None else w._base
    kept = _KEPT.get(id(base))
    if not isinstance(base, torch.nn.Parameter) and (kept is None or kept() is not base):
        return make()
    key = (id(base), tuple(w.shape), w.stride(), w.storage_offset(), w.dtype, tag)
    hit = _COPIES.get(key)
    if hit is not None and hit[0]() is base and hit[1] == base._version:
        return hit[2]
    copy = make()
    _COPIES[key] = (weakref.ref(base), base._version, copy)
    if isinstance(copy, Tensor):
        _KEPT[id(copy)] = weakref.ref(copy)
    for k in [k for k, v in _COPIES.items() if v[0]() is None]:  # copies of a replaced parameter
        del _COPIES[k]
    for k in [k for k, r in _KEPT.items() if r() is None]:
        del _KEPT[k]
    return copy
