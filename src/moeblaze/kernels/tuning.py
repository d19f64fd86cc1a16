"""Launch configurations of the expert kernels: autotuned on the GPU, fixed when asked or interpreted.

Autotuning is keyed on the problem's (d, h, E), the tensor dtypes and, for the grouped GEMMs and the weight
gradients, a coarse bucket of the token count (:func:`tokens_bucket`: mean slots per expert rounded down to a
power of 4), so a new batch size re-tunes only when it crosses a bucket. A key first launched inside a CUDA-graph
capture is not tuned (the autotuner synchronises): it takes the fixed default configuration for good
(:mod:`moeblaze.graphs`). Environment:

``MOEBLAZE_AUTOTUNE=0``  use one fixed default configuration per kernel (no benchmarking at first call);
                         ``MOEBLAZE_DETERMINISTIC=1`` (:mod:`moeblaze.training.determinism`) does the same.
``TRITON_INTERPRET=1``   (CPU interpreter) small fixed configurations; autotuning is always off.

Chosen here by device and shape, with no setting: the launch shape of the grouped GEMMs and weight gradients
(the autotuner tries per-tile and persistent launches: :func:`_gemm_launch`), TMA descriptor reads
(:func:`tma_enabled`: sm90+), the warp-specialized Gluon kernels (:func:`ws_enabled`: sm90, triton 3.6) and
the M tile (:func:`block_m`).

Because the tuned block sizes change the fp32 summation order, results are bitwise reproducible run to
run within a process (and across processes with ``MOEBLAZE_AUTOTUNE=0``), not across different tunings.
"""

from __future__ import annotations

import functools

import torch
import triton

from .. import settings
from ..graphs import capturing
from . import direct

# BLOCK_M is chosen by the launcher from the token-count bucket (the tile schedule depends on it), not by the
# autotuner; it is part of the GEMM's autotune key, so each bucket tunes its own configs.
BLOCK_M_GPU = 128
BLOCK_M_INTERPRET = 32


def interpreting() -> bool:
    """True under the Triton CPU interpreter (``TRITON_INTERPRET=1``)."""
    return settings.interpreting()


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` of host integers, as ``triton.cdiv``. Why not that one: since triton 3.5 it is a
    ``ConstexprFunction`` whose call costs 1.5 µs of Python against 0.05 µs here (a 2-core CPU, ``python3 -m
    timeit``), and the launchers of a layer step call it a few dozen times."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (0 for 0), as ``triton.next_power_of_2`` (see :func:`cdiv`)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def autotune_enabled() -> bool:
    """Autotuning is on unless ``MOEBLAZE_AUTOTUNE=0``, the setting ``deterministic`` is on (the autotuner picks
    configurations by timing, and the block sizes set the fp32 summation order) or the interpreter runs."""
    return settings.get("autotune") and not interpreting() and not settings.get("deterministic")


def _index(device: torch.device) -> int:
    """The CUDA device index of ``device`` (``cuda`` alone: the current device)."""
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.cache
def _sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def tma_enabled(device: torch.device) -> bool:
    """Kernels may read through TMA descriptors on ``device``: an sm90+ GPU or the interpreter (elsewhere they
    read through pointers). Launchers look it up through this module: tests replace it to run the pointer paths
    (and with them no Gluon kernel, :func:`ws_enabled`) where TMA would serve."""
    if interpreting():
        return True
    return device.type == "cuda" and _sm90(_index(device))


@functools.cache
def _ws_supported(index: int) -> bool:
    # Gluon's API is experimental and changed after triton 3.6 (tma.async_copy_global_to_shared was renamed in
    # 3.9); wgmma exists on sm90 only (Blackwell has tcgen05 instead).
    return triton.__version__.startswith("3.6.") and torch.cuda.get_device_capability(index) == (9, 0)


def ws_enabled(device: torch.device) -> bool:
    """The warp-specialized Gluon kernels (:mod:`moeblaze.kernels.ws_wgrad`, :mod:`moeblaze.kernels.ws_gemm`) may
    run on ``device``: an sm90 GPU, triton 3.6, not the interpreter, and :func:`tma_enabled` (they read through
    TMA only). Each launcher adds its shape checks (``kernels/launch.py``)."""
    if device.type != "cuda" or interpreting() or not tma_enabled(device):
        return False
    return _ws_supported(_index(device))


def _gemm_launch() -> str:
    """The grouped GEMMs' launch shapes, a part of their autotune kind: ``"auto"``, the tuned list holds per-tile
    and persistent configs and the autotuner picks (the fixed configuration runs per tile, the interpreter's
    persistent). Tests replace it (the launcher looks it up through this module) by ``"1"`` (persistent only)
    or ``"0"`` (per tile only) to check both launches bitwise on the same configurations."""
    return "auto"


def _wgrad_launch() -> str:
    """The weight gradients' launch shapes, as :func:`_gemm_launch` (fixed and interpreted configs: per tile)."""
    return "auto"


def _kept(configs: list[triton.Config], mode: str) -> list[triton.Config]:
    """The configs of a tuned list holding both launches that launch mode ``mode`` keeps: ``1`` the persistent
    ones, ``0`` the per-tile ones, ``auto`` all."""
    keep = {"0": (False,), "1": (True,)}.get(mode, (False, True))
    return [c for c in configs if c.kwargs["PERSISTENT"] in keep]


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA ``device`` (its index, or the current device's; cached)."""
    return _sm_count(_index(device))


def num_programs(device: torch.device) -> int:
    """Programs of a persistent launch: one per SM (the GEMM tiles hold one CTA per SM: 96-192 KB of
    shared memory); 4 under the interpreter (several tiles per program, cheap to run)."""
    return sm_count(device) if device.type == "cuda" else 4


def block_m(num_pairs: int | None = None, num_experts: int | None = None) -> int:
    """M-tile height (slots of one expert per program) for N = ``num_pairs`` slots over E = ``num_experts``: the
    one function that chooses it. The Triton backend's plan (:meth:`moeblaze.backends.TritonBackend.block_m`),
    the ops' schedule of an index that came without one, the launchers' ``BLOCK_M`` and token rounding's tile
    (:func:`moeblaze.tile_multiple`) call it, through this module, so they never disagree.

    Two token-count buckets (never T itself, DESIGN.md §5): 128 (32 under the interpreter), and half of it
    when an expert gets fewer than half a tile on average (N < 64 E): few tokens per expert, where a 128-row
    tile would compute mostly padding while the weight is read once per tile either way. Without N and E:
    the large bucket.
    """
    base = BLOCK_M_INTERPRET if interpreting() else BLOCK_M_GPU
    if num_pairs is None or num_experts is None:
        return base
    return base // 2 if num_pairs < (base // 2) * num_experts else base


def tokens_bucket(num_pairs: int, num_experts: int) -> int:
    """Autotune bucket of the grouped GEMMs and weight gradients: the mean slots per expert ``N / E`` rounded down
    to a power of 4 (at least 1), so 2k-32k tokens of Qwen3-30B-A3B (128-2,048 slots per expert) tune three
    times, not once.

    Why: configs tuned at one token count lost 4% at another. Qwen3-30B-A3B at T 32,768, one layer
    tuned at T 2,048 first: 16.56 ms per step against 15.82-15.92 ms tuned at 32,768 (OLMoE 19.94 against
    19.16-19.27; H100, ``python3 benchmarks/bench_host.py --shapes qwen3-30b-a3b,olmoe-1b-7b
    --stack 1 --tokens 2048,32768`` against ``--tokens 32768``).
    """
    per_expert = max(1, num_pairs // max(1, num_experts))
    return 1 << (2 * ((per_expert.bit_length() - 1) // 2))


def _cfg(num_warps: int, num_stages: int, **kw) -> triton.Config:
    return triton.Config(kw, num_warps=num_warps, num_stages=num_stages)


def _bits(dtype: torch.dtype) -> str:
    """The config lists' name for operands of ``dtype``: ``32`` fp32, ``8`` e4m3, ``16`` fp16 / bf16."""
    return {torch.float32: "32", torch.float8_e4m3fn: "8"}.get(dtype, "16")


def gemm_configs(kind: str, persistent: str = "auto") -> list[triton.Config]:
    """Grouped-GEMM configs; ``kind`` is ``tuned16``, ``tuned32``, ``tuned8``, ``fixed16``, ``fixed32``, ``fixed8``
    or ``interpret``,
    ``persistent`` the launch mode of :func:`_gemm_launch` (``PERSISTENT`` of the configs: ``1`` all, ``0`` none,
    ``auto``: the tuned list holds both launch shapes, fixed configs are per tile, the interpreter persistent).

    Why both (H200, autotuned, ``benchmarks/profile_layer.py``): persistent GEMMs took
    8.7 vs 9.6 ms per step on qwen3-30b (K_DIM 768-2048: the next tile's loads overlap this tile's
    epilogue) and 11.4 vs 11.9 ms on olmoe, but 43.0 vs 41.4 ms on conf4 (K_DIM 2048-16384). Since the
    gated F1 runs one wide MMA (``B_DESC_PAIRED``), the tuner picks its persistent launch on conf4, conf7, olmoe
    and qwen3-30b (H200, ``python3 benchmarks/profile_kernels.py --configs conf4-swiglu`` prints the
    tuned config of each launch).

    ``tuned32`` / ``fixed32``: fp32 operands, see :func:`fp32_gemm_configs`. ``tuned8`` / ``fixed8``: e4m3
    operands, the 16-bit tiles with BLOCK_K 128 (the same bytes per stage; not tuned on a GPU yet).
    """
    if kind == "tuned32":
        return fp32_gemm_configs(persistent)
    if kind == "interpret":
        base = [_cfg(1, 1, BLOCK_N=64, BLOCK_K=64, GROUP_M=4)]
    elif kind == "fixed32":  # an IEEE-sized tile (see fp32_gemm_configs), right for TF32 too
        base = [_cfg(8, 2, BLOCK_N=64, BLOCK_K=16, GROUP_M=8)]
    elif kind in ("fixed16", "fixed8"):
        base = [_cfg(8, 3, BLOCK_N=128, BLOCK_K=128 if kind == "fixed8" else 64, GROUP_M=8)]
    else:
        bk = 128 if kind == "tuned8" else 64
        shapes = ((64, 4, 4), (64, 8, 3), (64, 8, 4), (128, 4, 3), (128, 8, 3), (128, 8, 4), (256, 8, 3))
        per_tile = [_cfg(w, s, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, PERSISTENT=False) for bn, w, s in shapes]
        # persistent: the large tiles only (one CTA per SM; these won a block-shape sweep of every GEMM,
        # H200, docs/benchmarks.md "Tried and dropped")
        steady = [_cfg(w, s, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, PERSISTENT=True) for bn, w, s in shapes[4:]]
        return _kept(per_tile + steady, persistent)
    flag = persistent == "1" or (persistent == "auto" and kind == "interpret")
    for c in base:
        c.kwargs["PERSISTENT"] = flag
    return base


def fp32_gemm_configs(persistent: str = "auto") -> list[triton.Config]:
    """The ``tuned32`` grouped-GEMM list: TF32 tiles and IEEE tiles, told apart by BLOCK_K (16: IEEE).

    :func:`prune_fp32_tiles` keeps the tiles of a launch's ``DOT_PREC`` (also in the autotune key, so each
    precision tunes its own). TF32 (tensor cores): BLOCK_K 32, as an fp32 tile of 32 columns holds the bytes
    of a 16-bit tile of 64; fewer stages for wide tiles. IEEE (``tl.dot`` as FMA loops): every thread holds
    its rows of A and columns of B for all of BLOCK_K in registers besides its accumulators, so BLOCK_K 16
    and 8 warps per 128-row tile (the fixed 128x64x32 4-warp tile ran at 1.1 TFLOP/s on an H100, issue 27).
    Not yet measured: ``benchmarks/bench_precision.py --parts fp32`` reports what the tuner reaches.
    """
    tf32 = ((64, 32, 4, 3), (64, 32, 4, 4), (128, 32, 4, 3), (128, 32, 8, 3), (128, 32, 8, 4), (256, 32, 8, 3),
            (128, 64, 8, 2))
    ieee = ((32, 16, 4, 2), (32, 16, 8, 2), (64, 16, 4, 2), (64, 16, 8, 2), (128, 16, 8, 2))
    per_tile = [_cfg(w, s, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, PERSISTENT=False) for bn, bk, w, s in tf32 + ieee]
    steady = [_cfg(w, s, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, PERSISTENT=True) for bn, bk, w, s in tf32[3:6]]
    return _kept(per_tile + steady, persistent)


def prune_fp32_tiles(configs, named_args, **kwargs):
    """Of a list holding BLOCK_K 16 (IEEE) tiles, keep those for ``DOT_PREC="ieee"`` and the others for TF32;
    other lists pass unchanged."""
    ieee_tiles = [c for c in configs if c.kwargs.get("BLOCK_K") == 16]
    if not ieee_tiles or len(ieee_tiles) == len(configs):
        return configs
    if kwargs.get("DOT_PREC", named_args.get("DOT_PREC")) == "ieee":
        return ieee_tiles
    return [c for c in configs if c.kwargs.get("BLOCK_K") != 16]


def prune_gemm_configs(configs, named_args, **kwargs):
    """Keep the fp32 tiles of the launch's precision (:func:`prune_fp32_tiles`), and drop ``BLOCK_N = 256``
    for the dual-accumulator (gated F1) launch: two 128x256 fp32 accumulators spill and its pipeline
    buffers exceed shared memory."""
    configs = prune_fp32_tiles(configs, named_args, **kwargs)
    dual = kwargs.get("DUAL", named_args.get("DUAL", False))
    kept = [c for c in configs if not (dual and c.kwargs.get("BLOCK_N", 0) > 128)]
    return kept or configs


def wgrad_configs(kind: str, persistent: str = "auto") -> list[triton.Config]:
    """Weight-gradient configs (``BLOCK_P x BLOCK_Q`` output tile, ``BLOCK_K`` slots per step) of the
    launch mode ``persistent`` (:func:`_wgrad_launch`): ``auto`` lets the tuned 16-bit list hold both launches, ``1``
    keeps the persistent ones (a one-config kind: made persistent), ``0`` the per-tile ones. fp32 lists are per
    tile (the persistent loop reads A through the index: 16-bit operands only).

    The persistent 16-bit tiles are those that beat the per-tile best on an H200 at few slots per expert
    (Qwen3-30B-A3B shape, T 2,048, ``python3 benchmarks/profile_kernels.py --configs qwen3-30b-a3b
    --tokens 2048 --all-configs B2,B4``): 128x256 1.26x (B2) and 1.27x (B4), 256x128 1.06x and 1.10x. A persistent
    128x128 tile was 0.86-0.93x (docs/benchmarks.md, "Tried and dropped"): not kept.
    The persistent 128x256 tile also runs 128 slots per step (two stages of 96 KiB): half the steps of a tile of
    few slots, so half its per-step waits. H200, ``python3 benchmarks/profile_kernels.py --configs
    1536:1024:128:2 --tokens 16384 --all-configs B2,B4`` (256 slots per expert): B2 0.316 against 0.351 ms at 64
    slots per step, B4 0.615 against 0.684; ``--configs qwen3-30b-a3b --tokens 2048`` (128 slots): B2 0.220
    against 0.237, B4 0.430 against 0.466. Launched per tile it ran at 0.79x (nothing hides its two-stage
    prologue), and the 4-stage twin of the 64-slot tile matched the 3-stage one (0.997x): neither is listed.
    """
    if kind == "interpret":
        base = [_cfg(1, 1, BLOCK_P=64, BLOCK_Q=64, BLOCK_K=32, GROUP_M=4, PERSISTENT=persistent == "1")]
    elif kind == "fixed32":  # IEEE-sized (see fp32_gemm_configs), right for TF32 too
        return [_cfg(8, 2, BLOCK_P=64, BLOCK_Q=64, BLOCK_K=16, GROUP_M=8, PERSISTENT=False)]
    elif kind == "fixed16":
        base = [_cfg(8, 3, BLOCK_P=128, BLOCK_Q=128, BLOCK_K=64, GROUP_M=8, PERSISTENT=persistent == "1")]
    elif kind == "tuned32":  # TF32: BLOCK_K 32 slots (the bytes of 64 in 16 bits); IEEE: BLOCK_K 16, small tiles
        return [_cfg(w, s, BLOCK_P=bp, BLOCK_Q=bq, BLOCK_K=bk, GROUP_M=8, PERSISTENT=False)
                for bp, bq, bk, w, s in ((128, 128, 32, 8, 3), (128, 128, 32, 8, 4), (128, 256, 32, 8, 3),
                                         (256, 128, 32, 8, 3), (64, 128, 32, 4, 4), (128, 64, 32, 4, 4),
                                         (64, 64, 16, 8, 2), (64, 32, 16, 4, 2), (32, 64, 16, 4, 2),
                                         (128, 64, 16, 8, 2))]
    else:
        per_tile = ((128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 256, 64, 8, 3), (128, 256, 64, 8, 4),
                    (256, 128, 64, 8, 3), (64, 128, 64, 4, 4), (128, 64, 64, 4, 4))
        steady = ((128, 256, 64, 8, 3), (128, 256, 128, 8, 2), (256, 128, 64, 8, 3))
        base = _kept([_cfg(w, s, BLOCK_P=bp, BLOCK_Q=bq, BLOCK_K=bk, GROUP_M=8, PERSISTENT=f)
                      for f, tiles in ((False, per_tile), (True, steady)) for bp, bq, bk, w, s in tiles], persistent)
    return base


def act_bwd_configs(kind: str) -> list[triton.Config]:
    """Row-streaming B1 activation-backward configs (``BLOCK_R`` rows x ``BLOCK_H`` columns per step)."""
    if kind == "interpret":
        return [_cfg(1, 1, BLOCK_R=4, BLOCK_H=32)]
    if kind in ("fixed32", "fixed16"):
        return [_cfg(8, 1, BLOCK_R=32, BLOCK_H=256)]
    # more bytes in flight per SM than the fixed config (3.0 TB/s on an H200, olmoe shape); the last two hold rows
    # of h <= 1,024 whole (ROW_WHOLE), so the FP8 layer's e4m3 dpre comes from the registers: at N 262,144 (H200,
    # FP8 layer's launch) h 768 0.728 ms against 0.828 for the best of the first five, h 1,024 0.817 against 1.075;
    # the bf16 launch 0.582 / 0.767 against 0.603 / 0.809 (python3 benchmarks/bench_small_kernels.py --kernels
    # act_bwd, docs/results-small-kernels.csv)
    return [_cfg(w, 1, BLOCK_R=r, BLOCK_H=bh)
            for r, bh, w in ((32, 256, 8), (16, 256, 4), (8, 512, 4), (64, 128, 8), (16, 128, 4), (2, 1024, 4),
                             (1, 1024, 4))]


def gather_sum_configs(kind: str) -> list[triton.Config]:
    """Gather-sum combine configs (``BLOCK_T`` tokens x ``BLOCK_D`` columns per program)."""
    if kind == "interpret":
        return [_cfg(1, 1, BLOCK_T=8, BLOCK_D=32)]
    if kind in ("fixed32", "fixed16"):
        return [_cfg(4, 1, BLOCK_T=8, BLOCK_D=256)]
    # Fewer tokens per program keep more slot-row loads in flight per SM: at T 32768, K 8 (Qwen3-30B-A3B) one token
    # by 1024 columns took 0.116 ms on a 768-column chunk and 0.286 on whole 2048-column rows, against 0.125 and
    # 0.304 for the best of the first five configs; 8 x 256 (the fixed config) 0.117 and 0.292 (H200,
    # CUDA-graph replay, ``python3 benchmarks/bench_small_kernels.py --kernels gather_sum``)
    return [_cfg(w, 1, BLOCK_T=t, BLOCK_D=bd)
            for t, bd, w in ((16, 256, 4), (32, 256, 8), (8, 512, 4), (16, 512, 8), (64, 128, 8), (8, 256, 4),
                             (4, 512, 4), (1, 1024, 4))]


def _capturing(args: tuple, kwargs: dict) -> bool:
    """The launch is being captured into a CUDA graph (its first tensor argument tells the device)."""
    first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
    return first is not None and capturing(first)


# Every Launchable in creation order: module import order, the same in every process of a job, so (name, position)
# names one across ranks (tuned_choices / adopt_choices).
_LAUNCHABLES: list[Launchable] = []


def tuned_choices() -> dict[tuple, tuple]:
    """The configurations autotuning chose so far in this process: ``{(launchable, tune key): (kwargs, num_warps,
    num_stages, num_ctas, maxnreg)}`` (picklable; :func:`adopt_choices` takes them)."""
    return {(lb.name, key): (dict(c.kwargs), c.num_warps, c.num_stages, c.num_ctas, c.maxnreg)
            for lb in _LAUNCHABLES for key, c in lb._best.items() if key[0].startswith("tuned")}


def adopt_choices(choices: dict[tuple, tuple]) -> int:
    """Take ``choices`` (another process's :func:`tuned_choices`) as this process's: later launches of those keys run
    those configurations, without benchmarking. Returns how many keys changed."""
    by_name = {lb.name: lb for lb in _LAUNCHABLES}
    changed = 0
    for (name, key), (kwargs, warps, stages, ctas, maxnreg) in choices.items():
        lb = by_name.get(name)
        if lb is None:
            continue
        old = lb._best.get(key)
        if old is None or (dict(old.kwargs), old.num_warps, old.num_stages) != (kwargs, warps, stages):
            lb._best[key] = triton.Config(dict(kwargs), num_warps=warps, num_stages=stages, num_ctas=ctas,
                                          maxnreg=maxnreg)
            lb._ready.pop(key, None)
            changed += 1
    return changed


class Launchable:
    """A jitted kernel, autotuned on the first launch of each key and launched directly afterwards.

    ``launch(dtype, grid, *args, **kwargs)`` runs the kernel through ``triton.autotune`` +
    ``triton.heuristics`` (built lazily, once per kind) the first time a key is seen, remembers the
    chosen config, and from then on invokes the jitted kernel itself with that config and the heuristic
    flags computed here. Why: the two wrappers cost host time on every launch (about 40 µs per launch
    under cProfile on an H200's host, 14 launches per layer step: a quarter of the host time of a
    step at 8k tokens, which is bound by host time).

    Args:
        fn: the ``@triton.jit`` kernel.
        configs: ``kind -> list[triton.Config]`` (see :func:`gemm_configs`).
        key: autotune key (kernel argument names; the dtypes of all tensor arguments are added).
        heuristics: constexpr name -> function of a dict holding the key arguments and the config's
            values (e.g. ``EVEN_K`` from ``K_DIM`` and ``BLOCK_K``); may read nothing else.
        prune: ``early_config_prune(configs, named_args, **kwargs) -> configs`` of ``triton.autotune``.
        restore: arguments the kernel overwrites in place; autotuning restores them after each trial.
        variant: ``() -> str`` read at every launch (the launch shapes, :func:`_gemm_launch`), passed to
            ``configs`` as its second argument and made part of the kind: changing it picks other configs.
        bucket: ``kwargs -> int`` of a keyword launch (e.g. :func:`tokens_bucket` of its slot count), made
            part of the key; each bucket has an autotuner of its own, so a new bucket benchmarks afresh.
    """

    def __init__(self, fn, configs, key: list[str], heuristics: dict | None = None, prune=None,
                 restore: list[str] | None = None, variant=None, bucket=None) -> None:
        self.fn, self.configs, self.key, self.heuristics = fn, configs, key, heuristics or {}
        self.prune, self.restore, self.variant, self.bucket = prune, restore, variant, bucket
        self.name = (getattr(fn, "__name__", type(fn).__name__), len(_LAUNCHABLES))
        _LAUNCHABLES.append(self)
        self._cache: dict[str, object] = {}
        self._best: dict[tuple, triton.Config] = {}
        self._ready: dict[tuple, tuple[triton.Config, dict]] = {}  # key -> (its config, the launch kwargs)
        names = list(fn.arg_names)
        self._key_pos = [(k, names.index(k)) for k in key]
        # the tensor arguments, whose dtypes join the key: the kernels name exactly them ``*_ptr``
        self._ptr_pos = [(k, i) for i, k in enumerate(names) if k.endswith("_ptr")]

    def kind(self, dtype: torch.dtype) -> tuple[str, ...]:
        """``(base kind, *variant)``: base ``interpret``, or ``tuned`` / ``fixed`` and the bits of ``dtype`` (32, 16,
        8 for e4m3)."""
        base = "interpret" if interpreting() else ("tuned" if autotune_enabled() else "fixed") + _bits(dtype)
        return (base, self.variant()) if self.variant else (base,)

    def tuner(self, dtype: torch.dtype, bucket: int | None = None):
        """The ``triton.autotune``-wrapped kernel for ``dtype``'s kind and the launch's ``bucket``
        (``tuner(dtype, bucket)[grid](*args)``): one per pair, as triton's autotuner keeps one config per key."""
        kind = (*self.kind(dtype), bucket)
        if kind not in self._cache:
            fn = triton.heuristics(self.heuristics)(self.fn) if self.heuristics else self.fn
            prune = {"early_config_prune": self.prune} if self.prune else None
            self._cache[kind] = triton.autotune(configs=self.configs(*kind[:-1]), key=self.key,
                                                prune_configs_by=prune, restore_value=self.restore)(fn)
        return self._cache[kind]

    def _key_args(self, args: tuple, kwargs: dict) -> dict:
        """The values of the key arguments of a launch, by name."""
        return {k: (args[i] if i < len(args) else kwargs[k]) for k, i in self._key_pos}

    def tune_key(self, dtype: torch.dtype, args: tuple, kwargs: dict) -> tuple:
        """The autotune key of a launch: kind, the key arguments' values, every tensor argument's dtype and the
        bucket (None without one)."""
        n = len(args)
        named = [args[i] if i < n else kwargs[k] for k, i in self._key_pos]
        bucket = self.bucket(kwargs) if self.bucket else None
        return (*self.kind(dtype), *named, *[(args[i] if i < n else kwargs[k]).dtype for k, i in self._ptr_pos],
                bucket)

    def default_config(self, dtype: torch.dtype, args: tuple, kwargs: dict) -> triton.Config:
        """The configuration a launch takes without autotuning: the first of the fixed list (``MOEBLAZE_AUTOTUNE=0``),
        after the pruning of the launch's arguments."""
        base = "fixed" + _bits(dtype)
        return self.pruned((base, self.variant()) if self.variant else (base,), args, kwargs)[0]

    def pruned(self, kind: tuple[str, ...], args: tuple, kwargs: dict) -> list[triton.Config]:
        """The configs of ``kind`` (``(base, *variant)``, as :meth:`kind` returns) that a launch with these
        arguments chooses from, after its pruning (``benchmarks/profile_kernels.py --all-configs`` replays them)."""
        configs = self.configs(*kind)
        if self.prune:
            configs = self.prune(configs, {**dict(zip(self.fn.arg_names, args)), **kwargs}, **kwargs)
        return configs

    def _launch_kwargs(self, config: triton.Config, args: tuple, kwargs: dict) -> dict:
        """The keyword arguments a config adds to a launch: its meta-parameters, options and heuristic flags."""
        meta = {**self._key_args(args, kwargs), **config.kwargs}
        return {**{name: f(meta) for name, f in self.heuristics.items()}, **config.all_kwargs()}

    def run(self, config: triton.Config, grid, *args, **kwargs) -> None:
        """Launch the jitted kernel itself with ``config`` and the heuristic flags (no autotuner)."""
        self._go(grid, args, kwargs, self._launch_kwargs(config, args, kwargs))

    def _go(self, grid, args: tuple, kwargs: dict, extra: dict) -> None:
        """Launch with a known configuration: :func:`moeblaze.kernels.direct.launch` (keyword arguments)."""
        if args:
            self.fn[grid](*args, **kwargs, **extra)
        else:
            direct.launch(self.fn, grid, **kwargs, **extra)

    def launch(self, dtype: torch.dtype, grid, *args, **kwargs) -> None:
        """Launch on ``grid`` (a tuple or a function of the launch's meta-parameters)."""
        key = self.tune_key(dtype, args, kwargs)
        config = self._best.get(key)
        ready = self._ready.get(key)
        if ready is not None and ready[0] is config:  # the common case: everything known for this key
            self._go(grid, args, kwargs, ready[1])
            return
        if config is None and _capturing(args, kwargs):  # no timing inside a CUDA-graph capture (moeblaze.graphs)
            config = self._best[key] = self.default_config(dtype, args, kwargs)
        if config is None:
            tuner = self.tuner(dtype, key[-1])
            tuner[grid](*args, **kwargs)
            self._best[key] = tuner.best_config
            return
        extra = self._launch_kwargs(config, args, kwargs)  # a function of the key alone (see heuristics)
        self._ready[key] = (config, extra)
        self._go(grid, args, kwargs, extra)
