"""Routed experts with smart checkpointing (MoEBlaze §4.3, DESIGN.md §4-5).

``moe_experts`` runs the experts of a top-k MoE layer over the zero-buffer dispatch index. The
autograd graph is cut at the activation into two Functions (``save="preact"``) or fused into one
recompute Function (``save="input"``); each runs the expert ops of a backend object
(:mod:`moeblaze.backends`: ``torch`` or ``triton``), which also plans the index's tile schedule.
"""

from __future__ import annotations

import torch

from .activations import SWIGLU_ALPHA, SWIGLU_LIMIT, ActArgs
from .amp import autocast_off, autocast_target
from .backends import BACKENDS, Backend, get_backend
from .dispatch import DispatchIndex, TileSchedule, check_index_matches
from .expert_checks import SAVE_MODES, check_inputs, check_options
from .fp8 import Float8Recipe, Float8Tensor, check_fp8_backend, check_fp8_recipe, weight_copy
from .input_grad import SharedInputGrad
from .settings import carried_to_backward

__all__ = ["moe_experts", "SAVE_MODES", "BACKENDS"]


def _index_from(tensors, num_experts: int, block_m: int, foreign: bool) -> DispatchIndex:
    """The index from the Function arguments: its four arrays, its tile schedule's three when ``block_m``,
    then ``pair_offsets`` for an index of general routing inputs."""
    n = 7 if block_m else 4
    schedule = TileSchedule(block_m, *tensors[4:7]) if block_m else None
    pair_offsets = tensors[n] if len(tensors) > n else None
    return DispatchIndex(*tensors[:4], num_experts=num_experts, schedule=schedule, foreign_experts=foreign,
                         pair_offsets=pair_offsets)


def _index_args(index: DispatchIndex) -> tuple[int, tuple[torch.Tensor, ...]]:
    """``(block_m or 0, tensors)``: how an index travels through ``Function.apply`` (tensors, so saved-tensor
    hooks and torch.compile see them)."""
    general = (index.pair_offsets,) if index.pair_offsets is not None else ()
    if index.schedule is None:
        return 0, index.tensors() + general
    return index.schedule.block_m, index.tensors() + index.schedule.tensors() + general


class _UpProjection(torch.autograd.Function):
    """F1 / B3-B5: ``pre = x[token(s)] W_gate_up[e]^T (+ b_gate_up[e])`` and ``act = f(pre)`` (``act`` not
    differentiable).

    Saves ``x`` and the index; ``act`` is handed to :class:`_DownProjection` for its forward only.
    """

    @staticmethod
    @carried_to_backward
    @autocast_off
    def forward(ctx, x, w1, b1, backend, activation, act_args, num_experts, block_m, foreign, input_grad,
                *index_tensors):
        index = _index_from(index_tensors, num_experts, block_m, foreign)
        ctx.input_grad = input_grad.bind(x) if input_grad is not None else None
        w1c = w1.to(x.dtype)  # autocast's cast of the master weight (moeblaze.amp); else a no-op
        pre, act = backend.up_forward(x, w1c, index, activation, store_pre=True, store_act=True, b1=b1,
                                      act_args=act_args)
        ctx.save_for_backward(x, w1c, *index_tensors)
        ctx.backend, ctx.index_args, ctx.dw_dtype = backend, (num_experts, block_m, foreign), w1.dtype
        ctx.mark_non_differentiable(act)
        ctx.set_materialize_grads(False)  # else autograd fills a zero [N, h] gradient for act every step
        return pre, act

    @staticmethod
    @carried_to_backward
    @autocast_off
    def backward(ctx, dpre, _dact):
        x, w1, *index_tensors = ctx.saved_tensors
        if dpre is None:  # the output does not depend on pre (grads are not materialised)
            return (None,) * (10 + len(index_tensors))
        index = _index_from(index_tensors, *ctx.index_args)
        need = ctx.needs_input_grad
        dpre = dpre.contiguous()
        db1 = ctx.backend.bias_grad(dpre, index) if need[2] else None
        dx, dw1 = ctx.backend.up_backward(dpre, x, w1, index, need[0], need[1], dw_dtype=ctx.dw_dtype)
        if ctx.input_grad is not None:
            dx = ctx.input_grad.offer(dx)
        return (dx, dw1, db1) + (None,) * (7 + len(index_tensors))


class _DownProjection(torch.autograd.Function):
    """F2-F3 / B1-B2: ``out[t] = sum_k w[t,k] (act[s] W_down[e]^T + b_down[e])`` with ``s = map[t,k]``.

    Saves ``pre`` (not ``act``, not ``y``): backward recomputes ``act = f(pre)`` (N*h elementwise ops)
    and gets ``d topk_weights`` from ``<dout[t] W_down[e], act[s]> + <dout[t], b_down[e]>``, so no expert
    output is kept.
    """

    @staticmethod
    @carried_to_backward
    @autocast_off
    def forward(ctx, pre, act, w2, b2, topk_weights, backend, activation, act_args, num_experts, block_m, foreign,
                *index_tensors):
        index = _index_from(index_tensors, num_experts, block_m, foreign)
        w2c = w2.to(act.dtype)  # as w1 in _UpProjection
        out = backend.down_forward(act, w2c, topk_weights, index, b2=b2)
        ctx.save_for_backward(pre, w2c, b2, topk_weights, *index_tensors)
        ctx.backend, ctx.activation, ctx.act_args, ctx.dw_dtype = backend, activation, act_args, w2.dtype
        ctx.index_args = (num_experts, block_m, foreign)
        return out

    @staticmethod
    @carried_to_backward
    @autocast_off
    def backward(ctx, dout):
        pre, w2, b2, topk_weights, *index_tensors = ctx.saved_tensors
        index = _index_from(index_tensors, *ctx.index_args)
        need = ctx.needs_input_grad
        dout = dout.contiguous()
        db2 = ctx.backend.bias_grad(dout, index, topk_weights) if need[3] else None
        dpre, dw2, dtw = ctx.backend.down_backward(dout, pre, w2, topk_weights, index, ctx.activation, need[2],
                                                   need[4], b2=b2, act_args=ctx.act_args, dw_dtype=ctx.dw_dtype)
        return (dpre, None, dw2, db2, dtw) + (None,) * (6 + len(index_tensors))


class _ExpertsRecompute(torch.autograd.Function):
    """``save="input"``: the whole expert block, saving only ``x``, ``topk_weights`` and the index.

    Bytes saved versus ``"preact"``: the pre-activation, ``N*2h*elt`` (4Nh bytes in bf16; 256 MiB
    at T=32k, K=8, h=256). FLOPs added: the up-projection again in backward, ``4*N*d*h`` (+22% of the
    layer's 18*N*d*h forward+backward).
    """

    @staticmethod
    @carried_to_backward
    @autocast_off
    def forward(ctx, x, w1, b1, w2, b2, topk_weights, backend, activation, act_args, num_experts, block_m, foreign,
                input_grad, *index_tensors):
        index = _index_from(index_tensors, num_experts, block_m, foreign)
        ctx.input_grad = input_grad.bind(x) if input_grad is not None else None
        w1c, w2c = w1.to(x.dtype), w2.to(x.dtype)  # as in _UpProjection
        _, act = backend.up_forward(x, w1c, index, activation, store_pre=False, store_act=True, b1=b1,
                                    act_args=act_args)
        out = backend.down_forward(act, w2c, topk_weights, index, b2=b2)
        ctx.save_for_backward(x, w1c, b1, w2c, b2, topk_weights, *index_tensors)
        ctx.backend, ctx.activation, ctx.act_args = backend, activation, act_args
        ctx.dw_dtypes = (w1.dtype, w2.dtype)
        ctx.index_args = (num_experts, block_m, foreign)
        return out

    @staticmethod
    @carried_to_backward
    @autocast_off
    def backward(ctx, dout):
        x, w1, b1, w2, b2, topk_weights, *index_tensors = ctx.saved_tensors
        index = _index_from(index_tensors, *ctx.index_args)
        backend, need, act_args = ctx.backend, ctx.needs_input_grad, ctx.act_args
        dout = dout.contiguous()
        db2 = backend.bias_grad(dout, index, topk_weights) if need[4] else None
        pre, _ = backend.up_forward(x, w1, index, ctx.activation, store_pre=True, store_act=False, b1=b1,
                                    act_args=act_args)
        dpre, dw2, dtw = backend.down_backward(dout, pre, w2, topk_weights, index, ctx.activation, need[3], need[5],
                                               b2=b2, act_args=act_args, dw_dtype=ctx.dw_dtypes[1])
        del pre
        db1 = backend.bias_grad(dpre, index) if need[2] else None
        dx, dw1 = backend.up_backward(dpre, x, w1, index, need[0], need[1], dw_dtype=ctx.dw_dtypes[0])
        if ctx.input_grad is not None:
            dx = ctx.input_grad.offer(dx)
        return (dx, dw1, db1, dw2, db2, dtw) + (None,) * (7 + len(index_tensors))


class _Float8Experts(torch.autograd.Function):
    """The expert block under an FP8 recipe (:mod:`moeblaze.fp8`), both save modes, through the backend's FP8 ops
    ``ops`` (the recipe's PyTorch emulation :mod:`moeblaze.ops_fp8`, or the Triton kernels'
    :mod:`moeblaze.kernels.fp8_experts`).

    Saves ``x`` itself, as the 16-bit path does (the router's weight gradient keeps it anyway; B4 runs in 16 bits
    on it), and for ``save="preact"`` ``pre`` in e4m3 tiles (:meth:`moeblaze.fp8.Float8Recipe.quantize_kept`, written
    so by F1 on the Triton backend): half its 16-bit bytes and a scale per 64 of them; on the GPU also the weights'
    column maxima (``[E, d]`` and ``[E, h]`` fp32), from which the backward's transposed weight copies are made in
    one read of each weight. ``"input"``
    quantizes ``x`` again in backward and runs F1 on it (the forward's ``pre`` bitwise: the quantization is
    deterministic). The weights are kept as given (parameters: nothing new) and quantized again in backward, fp32
    masters under autocast as their casts to ``x``'s dtype without a 16-bit copy (inside
    :func:`moeblaze.fp8.reuse_weights` the e4m3 copies are made once per parameter version). Ops that read
    ``w_gate_up`` as a gate block and an up block only (``ops.INTERLEAVED_GATE_UP`` False: the Triton kernels) get
    GPT-OSS's alternating rows regrouped (:func:`_as_gate_up_blocks`), and the gradients of ``w_gate_up`` and
    ``b_gate_up`` are regrouped back.
    """

    @staticmethod
    @carried_to_backward
    @autocast_off
    def forward(ctx, x, w1, b1, w2, b2, topk_weights, recipe, ops, save, activation, act_args, num_experts, block_m,
                foreign, input_grad, *index_tensors):
        index = _index_from(index_tensors, num_experts, block_m, foreign)
        ctx.input_grad = input_grad.bind(x) if input_grad is not None else None
        # fp32 master weights under autocast (moeblaze.amp) are quantized as their casts to x's dtype: the ops round
        # inside the quantization, as the same call on 16-bit weights would quantize, with no 16-bit copy
        xq = ops.quantize_rows(recipe, x)
        keep = save == "preact"  # F1 writes pre in the kept e4m3 tiles (recipe.quantize_kept), not in 16 bits
        ctx.regroup = act_args.interleaved and not ops.INTERLEAVED_GATE_UP
        w1_ops, b1_ops, act_ops = _as_gate_up_blocks(w1, b1, act_args) if ctx.regroup else (w1, b1, act_args)
        # w1_amax, w2_amax: the weights' column maxima ([E, d], [E, h] fp32 on CUDA; empty or None where the ops take
        # none) from the forward's quantization, so that the backward's transposed copies read each weight once
        pq, act, w1_amax = ops.up_forward(recipe, xq, w1_ops, index, activation, b1=b1_ops, act_args=act_ops,
                                          keep=keep, dtype=x.dtype)
        out, w2_amax = ops.down_forward(recipe, act, w2, topk_weights, index, b2=b2, dtype=x.dtype)
        kept_pre = (pq.data, pq.scale) if keep else (None, None)
        ctx.save_for_backward(x, *kept_pre, w1, b1, w2, b2, topk_weights, w1_amax, w2_amax, *index_tensors)
        ctx.recipe, ctx.ops, ctx.activation, ctx.act_args, ctx.dtype = recipe, ops, activation, act_args, x.dtype
        ctx.pre_block = pq.block if keep else None
        ctx.index_args = (num_experts, block_m, foreign)
        # no second name for the output (a same-dtype .to() is one): torch 2.11's dynamo returns a traced forward's
        # tensors beside its output and gave the output's gradient to the alias, zeros to the backward
        return out if out.dtype == x.dtype else out.to(x.dtype)

    @staticmethod
    @carried_to_backward
    @autocast_off
    def backward(ctx, dout):
        if getattr(ctx, "pre_overwritten", False):  # before saved_tensors: hooks skip autograd's version check
            raise RuntimeError("moe_experts(fp8=..., save='preact'): a second backward through the same graph; the "
                               "first wrote B3's e4m3 dpre over the kept pre (save='input' keeps none)")
        x, pre_data, pre_scale, w1, b1, w2, b2, topk_weights, w1_amax, w2_amax, *index_tensors = ctx.saved_tensors
        index = _index_from(index_tensors, *ctx.index_args)
        recipe, ops, need, activation, dtype = ctx.recipe, ctx.ops, ctx.needs_input_grad, ctx.activation, ctx.dtype
        w1_ops, b1_ops, act_args = _as_gate_up_blocks(w1, b1, ctx.act_args) if ctx.regroup else (w1, b1, ctx.act_args)
        if pre_data is None:
            pre, _, _ = ops.up_forward(recipe, ops.quantize_rows(recipe, x), w1_ops, index, activation,
                                       store_act=False, b1=b1_ops, act_args=act_args, dtype=dtype)
        else:
            pre = Float8Tensor(pre_data, pre_scale, ctx.pre_block)
        dout = dout.contiguous()
        db2 = ops.bias_grad(dout, index, topk_weights) if need[4] else None
        reuse = None  # the kept e4m3 pre is dead once read: B3's rowwise e4m3 dpre goes into its storage
        kept_version = _version(pre_data)
        if pre_data is not None and need[0]:
            rows = pre_data.flatten(1)
            reuse = Float8Tensor(rows, pre_scale.new_empty(rows.shape[0], 1), (1, rows.shape[1]))
        dpre, dw2, dtw = ops.down_backward(recipe, dout, pre, w2, topk_weights, index, activation, need[3],
                                           need[5], b2=b2, act_args=act_args, dw_dtype=w2.dtype, dpre_q=reuse,
                                           dtype=dtype, w_amax=w2_amax)
        del pre
        db1 = ops.bias_grad(dpre, index).to(b1.dtype) if need[2] else None
        # B3 before B4, and the kept pre's storage (B3's e4m3 dpre by then) given back between them: the graph holds
        # a saved tensor until backward returns, and B4's dW_gate_up would otherwise be allocated beside it
        dx = dw1 = None
        if need[0]:
            dx, _ = ops.up_backward(recipe, dpre, x, w1_ops, index, True, False, reuse=reuse,
                                    quantized=reuse is not None, dtype=dtype, w_amax=w1_amax)
        if reuse is not None and _version(pre_data) != kept_version:  # the ops wrote B3's dpre into it
            ctx.pre_overwritten = True
            _release(pre_data, pre_scale)
        if need[1]:
            _, dw1 = ops.up_backward(recipe, dpre, x, w1_ops, index, False, True, dw_dtype=w1.dtype, dtype=dtype)
        if ctx.regroup:  # the gate and up blocks back to the parameters' alternating rows
            dw1, db1 = (None if g is None else _gate_up_alternating(g) for g in (dw1, db1))
        dx = dx.to(dtype) if dx is not None else None
        if ctx.input_grad is not None:
            dx = ctx.input_grad.offer(dx)
        return (dx, dw1, db1, dw2, db2, dtw) + (None,) * (9 + len(index_tensors))


def _version(t: torch.Tensor | None) -> int | None:
    """``t``'s version counter in eager mode (None for no tensor and inside a compiled graph, which frees its
    inputs itself: :func:`_release` is for eager)."""
    return None if t is None or torch.compiler.is_compiling() else t._version


def _release(*tensors: torch.Tensor) -> None:
    """Give the storage of saved tensors that backward has finished reading back to the allocator now, not when
    the graph lets go of them after backward. At Qwen3-30B-A3B (T 32,768) the kept e4m3 ``pre`` is 408 MiB beside
    B4's 768 MiB ``dW_gate_up`` (``benchmarks/profile_layer.py --peak``). Only a storage the tensor fills alone (a
    saved-tensor hook may return a view into a buffer of its own); a reference a hook kept holds no values after."""
    for t in tensors:
        storage = t.untyped_storage()
        if t.storage_offset() == 0 and storage.nbytes() == t.numel() * t.element_size():
            storage.resize_(0)


def _as_gate_up_blocks(w1: torch.Tensor, b1: torch.Tensor | None,
                       act_args: ActArgs) -> tuple[torch.Tensor, torch.Tensor | None, ActArgs]:
    """``(w_gate_up [E, 2h, d], b_gate_up [E, 2h] | None, act_args)`` with GPT-OSS's alternating gate and up rows
    regrouped into a gate block then an up block (copies; ``w_gate_up``'s once per parameter version inside
    :func:`moeblaze.fp8.reuse_weights`), ``act_args`` saying so: the layout the Triton FP8 kernels read, and the one
    of the ``pre`` and ``dpre`` they write."""
    w1_blocks = weight_copy(w1, ("gate_up_blocks",), lambda: _gate_up_blocks(w1))
    return w1_blocks, (None if b1 is None else _gate_up_blocks(b1)), act_args._replace(interleaved=False)


def _gate_up_blocks(t: torch.Tensor) -> torch.Tensor:
    """``t [E, 2h, ...]`` with alternating gate and up rows as its gate rows then its up rows (a copy)."""
    return t.unflatten(1, (-1, 2)).transpose(1, 2).reshape(t.shape)


def _gate_up_alternating(t: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`_gate_up_blocks`: ``t [E, 2h, ...]``'s gate block and up block as alternating rows."""
    return t.unflatten(1, (2, -1)).transpose(1, 2).reshape(t.shape)


def autocast_expert_operands(x, w_gate_up, w_down, b_gate_up, b_down):
    """``(x, w_gate_up, w_down, b_gate_up, b_down, autocast)``: under autocast ``x`` and the biases cast once to
    the autocast dtype (:func:`moeblaze.amp.autocast_operands`; biases that are None stay None), the weights
    checked but left to the experts' Functions to cast (:mod:`moeblaze.amp`), ``autocast`` True; outside
    autocast all unchanged and ``autocast`` False."""
    for name, t in (("x", x), ("w_gate_up", w_gate_up), ("w_down", w_down)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    biases = [(n, b) for n, b in (("b_gate_up", b_gate_up), ("b_down", b_down)) if isinstance(b, torch.Tensor)]
    dtype = autocast_target(x, ("w_gate_up", w_gate_up), ("w_down", w_down), *biases)
    if dtype is None:
        return x, w_gate_up, w_down, b_gate_up, b_down, False
    cast = {n: b.to(dtype) for n, b in biases}
    return x.to(dtype), w_gate_up, w_down, cast.get("b_gate_up", b_gate_up), cast.get("b_down", b_down), True


def moe_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    activation: str = "swiglu",
    save: str = "preact",
    backend: str = "auto",
    index: DispatchIndex | None = None,
    *,
    b_gate_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
    gate_up_interleaved: bool = False,
    swiglu_alpha: float = SWIGLU_ALPHA,
    swiglu_limit: float = SWIGLU_LIMIT,
    foreign_experts: bool = False,
    input_grad: SharedInputGrad | None = None,
    fp8: Float8Recipe | None = None,
) -> torch.Tensor:
    """Routed experts of a dropless top-k MoE layer: ``out[t] = sum_k w[t,k] * FFN_e(x[t])``.

    The MoEBlaze dataflow (arXiv 2601.05296 §4; DESIGN.md §2, §4, §5): experts read rows of the
    unpermuted ``x`` through the dispatch index; no gathered copy of ``x``, no activation and no expert
    output survives to the backward pass. With biases, ``FFN_e(x) = f(x W1[e]^T + b1[e]) W2[e]^T + b2[e]``
    (the down bias is weighted by the router weight, as transformers' GPT-OSS experts).

    Precision (the contract of ``torch.nn.Linear``; :mod:`moeblaze.amp`): under
    ``torch.autocast(x.device.type, dtype)`` (bf16 or fp16) the GEMMs run in the autocast dtype on casts of
    ``x``, ``w_gate_up``, ``w_down`` and the biases (each cast once per call, differentiable: fp32 parameters get fp32
    gradients, the weights' stored by the kernels directly) and the result is in the autocast dtype — bitwise the
    call on those casts outside autocast, gradients included.
    ``topk_weights`` is not cast (the combine sums in fp32). Outside autocast all three share one dtype;
    fp32 follows ``torch.get_float32_matmul_precision()`` as ``torch.matmul`` does (``"highest"``: IEEE
    fp32 products; ``"high"``/``"medium"``, i.e. ``torch.backends.cuda.matmul.allow_tf32``: TF32 tensor
    cores); every backend sums in fp32 (fp64 for fp64).

    Args:
        x: ``[T, d]`` tokens, fp32/fp16/bf16 (fp64 on the ``torch`` backend).
        topk_ids: ``[T, K]`` int32/int64 expert ids, distinct per row, in ``[0, E)`` (or ``>= E`` for
            foreign experts, see ``foreign_experts``).
        topk_weights: ``[T, K]`` float router weights (any float dtype; gets a gradient).
        w_gate_up: ``[E, 2h, d]`` (gate rows then up rows, or alternating with ``gate_up_interleaved``) for
            the gated activations; ``w_up [E, h, d]`` for the non-gated ones. Same dtype as ``x`` (under
            autocast: fp32/fp16/bf16); any strides (e.g. ``gate_up_proj.transpose(1, 2)`` of GPT-OSS's
            ``[E, d, 2h]``): read in place, never copied, and its gradient comes back in the same view.
        w_down: ``[E, d, h]``, same dtype as ``x`` (under autocast: fp32/fp16/bf16), any strides.
        activation: one of :data:`moeblaze.activations.ACTIVATIONS`: gated ``"swiglu"`` (default),
            ``"geglu"`` (erf GELU), ``"geglu_tanh"`` (tanh GELU), ``"swiglu_clamped"`` (GPT-OSS); non-gated
            ``"silu"``, ``"gelu"``, ``"gelu_tanh"``, ``"relu"``, ``"relu2"`` (squared ReLU).
        save: ``"preact"`` keeps ``x``, the pre-activation ``[N, 2h]`` and the index (2Td + 4Nh + O(N)
            bytes in bf16); ``"input"`` keeps ``x`` and the index only (2Td + O(N)) and recomputes the
            up-projection in backward (+4Ndh FLOPs).
        backend: ``"auto"`` (Triton on CUDA for fp16/bf16/fp32, else PyTorch; env
            ``MOEBLAZE_BACKEND=torch|triton`` overrides), ``"torch"`` or ``"triton"``. ``torch.compile(
            fullgraph=True)`` traces the Triton backend (its kernels are custom ops); the PyTorch backend loops over
            the experts with their slot counts read on the host, a graph break (``fullgraph=False`` compiles it).
        index: a prebuilt :class:`DispatchIndex` of ``topk_ids`` (built here when ``None``). One from
            :func:`build_dispatch` is checked to come from these ``topk_ids`` (free for the same, unmodified
            tensor; see ``DispatchIndex.built_from``).
        b_gate_up: ``[E, 2h]`` (gated, in ``w_gate_up``'s row order) / ``[E, h]`` expert bias of the
            up-projection, or None. Same dtype as ``x``; gets a gradient.
        b_down: ``[E, d]`` expert bias of the down-projection, or None.
        gate_up_interleaved: rows of ``w_gate_up`` alternate gate, up (GPT-OSS) instead of a gate block
            then an up block.
        swiglu_alpha, swiglu_limit: ``swiglu_clamped``'s ``act = (clamp(up, -limit, limit) + 1) * g *
            sigmoid(alpha * g)`` with ``g = min(gate, limit)`` (GPT-OSS: 1.702, 7.0).
        foreign_experts: ids ``>= E`` are experts of other ranks (transformers' expert-parallel sentinel):
            they contribute nothing to ``out`` and get no gradient (``dtopk_weights`` 0 there). Without
            it such ids are an error.
        input_grad: ``x``'s gradient shared with a router that reads the same ``x`` (a
            :class:`moeblaze.input_grad.SharedInputGrad` passed to both; :class:`moeblaze.MoE` does this): the two
            gradients are summed in place instead of by autograd's extra ``[T, d]`` addition. None: as usual.
        fp8: a :class:`moeblaze.fp8.Float8Recipe`: the expert GEMMs on e4m3 operands scaled along their reduction
            dimension (the rowwise recipe's weight gradients in 16 bits), fp32 sums, results in the dtypes above;
            ``pre`` kept for backward in e4m3 with fp32 scales for ``"preact"``, ``x`` as given (DESIGN.md §8).
            The ``torch`` backend runs the recipe's PyTorch emulation (:mod:`moeblaze.ops_fp8`), the Triton
            backend the rowwise recipe on its kernels (:mod:`moeblaze.kernels.fp8_experts`; sm90+). None: no FP8.

    Returns:
        ``[T, d]`` tensor in ``x.dtype`` (under autocast: the autocast dtype).

    Raises:
        ValueError: bad shapes, devices, activation, save mode, backend or options; ids out of range; an index
            built from other ids; bfloat16 on the Triton backend under ``TRITON_INTERPRET=1``.
        TypeError: dtype mismatch between ``x`` and the weights or biases, non-integer ``topk_ids``, fp64 with
            ``backend="triton"``, or an fp64 operand under autocast (autocast never casts fp64); ``fp8`` not a
            recipe, or with fp64 ``x``.
        NotImplementedError: ``fp8`` other than rowwise on the Triton backend (ValueError there on a CUDA GPU
            older than sm90).
    """
    check_fp8_recipe(fp8)
    x, w_gate_up, w_down, b_gate_up, b_down, autocast = autocast_expert_operands(x, w_gate_up, w_down, b_gate_up,
                                                                                  b_down)
    check_inputs(x, topk_ids, topk_weights, w_gate_up, w_down, activation, save, autocast, index)
    check_options(x, w_down, activation, b_gate_up, b_down, gate_up_interleaved, swiglu_alpha, swiglu_limit,
                   foreign_experts, index)
    E = w_down.shape[0]
    if index is not None:
        if index.num_experts != E or tuple(index.token_index_map.shape) != tuple(topk_ids.shape):
            raise ValueError(f"index was built for E={index.num_experts}, [T, K]={tuple(index.token_index_map.shape)}; "
                             f"expected E={E}, [T, K]={tuple(topk_ids.shape)}")
        check_index_matches(index, topk_ids)
    chosen = get_backend(backend, x)  # resolved once: it plans the index and runs the ops
    if index is None:
        index = chosen.plan(topk_ids, E, foreign_experts=foreign_experts)
    act_args = ActArgs(float(swiglu_alpha), float(swiglu_limit), bool(gate_up_interleaved))
    return run_experts(x, topk_weights, w_gate_up, w_down, b_gate_up, b_down, index, activation, save, chosen,
                       act_args, input_grad, fp8)


def run_experts(x: torch.Tensor, weights: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                b_gate_up: torch.Tensor | None, b_down: torch.Tensor | None, index: DispatchIndex, activation: str,
                save: str, backend: Backend, act_args: ActArgs, input_grad: SharedInputGrad | None = None,
                fp8: Float8Recipe | None = None) -> torch.Tensor:
    """The autograd Functions over a checked index: what :func:`moe_experts` (``weights [T, K]``),
    :func:`moeblaze.general_routing.moe_experts_general` (``weights [P]``) and :class:`moeblaze.MoE` run after
    their own checks. Nothing is checked or cast again here: ``x [T, d]`` is already in the compute dtype (the
    autocast dtype under autocast, ``b_gate_up`` and ``b_down`` with it), the weights in it or the fp32 master
    weights the Functions cast (:mod:`moeblaze.amp`), and ``backend`` the resolved :class:`Backend` (its
    :func:`get_backend` of ``x``). ``input_grad``: ``x``'s gradient shared with the router
    (:mod:`moeblaze.input_grad`), or None. ``fp8``: a recipe (:class:`_Float8Experts`), or None.

    Raises:
        TypeError, ValueError, NotImplementedError: ``fp8`` on a backend or dtype it cannot run
            (:func:`moeblaze.fp8.check_fp8_backend`).
    """
    if fp8 is not None:
        check_fp8_backend(backend.name, x.dtype, x.device, fp8)
    index = backend.scheduled(index)  # the GEMMs' tile schedule, built once for the ops (if not planned with it)
    bm, idx = _index_args(index)
    if fp8 is not None:
        return _Float8Experts.apply(x, w_gate_up, b_gate_up, w_down, b_down, weights, fp8, backend.fp8_ops, save,
                                    activation, act_args, w_down.shape[0], bm, index.foreign_experts, input_grad,
                                    *idx)
    common = (backend, activation, act_args, w_down.shape[0], bm, index.foreign_experts)
    if save == "input":
        return _ExpertsRecompute.apply(x, w_gate_up, b_gate_up, w_down, b_down, weights, *common, input_grad, *idx)
    pre, act = _UpProjection.apply(x, w_gate_up, b_gate_up, *common, input_grad, *idx)
    return _DownProjection.apply(pre, act, w_down, b_down, weights, *common, *idx)
