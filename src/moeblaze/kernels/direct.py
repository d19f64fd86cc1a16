"""Launch compiled Triton kernels without ``JITFunction.run``'s per-call work (issue 24's host path).

``kernel[grid](**kwargs)`` binds every argument by keyword, specialises each one, formats the compile
options into a string for its cache key, checks the kernel's globals and only then invokes the compiled
kernel's C launcher. A layer step launches about 16 kernels of 10-45 arguments each, and on a GPU the step
at a few thousand tokens is bound by that host time (issue 24: 4.6-7.7 ms per layer step on an H100,
``benchmarks/bench_host.py``). :func:`launch` does that work once per *signature* — the values of
the constexpr arguments and, for the others, exactly what Triton specialises on (dtype and 16-byte
alignment of tensors; type, ``== 1`` and divisibility by 16 of integers) — keeps the compiled kernel Triton
returned, and later launches of the same signature call its launcher directly with the arguments in order.
Repeats are found by a cheaper, finer key first (:func:`_fast_key`: the integers' values themselves): 9.5 µs
against 17.8 µs per grouped-GEMM launch for the signature, on the host CPU of an H200
(``python3 benchmarks/bench_host.py --parts`` prints the key's cost), 16 launches per layer step.

The first launch of a signature goes through ``kernel[grid]`` unchanged, so compilation, the compile cache
and CUDA-graph capture behave as with Triton's own launch; so does every launch under the CPU interpreter, in
Triton's debug mode, while a launch hook is installed (e.g. by a profiler) or for a kernel with pre-run hooks
(:func:`launch`). Measured on an H100 (``benchmarks/bench_host.py --launch direct,triton``, rows
in ``docs/results-stack.csv``): 0.3-1.0 ms less host time per layer step in 9 of 14 same-run A/B pairs; the
other 5 inside the run-to-run noise (about a quarter) or reversed.
"""

from __future__ import annotations

import operator

import torch
import triton
from triton.runtime import driver
from triton.runtime.interpreter import InterpretedFunction

_I32, _U64 = 2**31, 2**63  # Triton's integer argument types: i32 below the first, i64 below the second, else u64
# Launch options a keyword launch may add to the kernel's arguments (JITFunction.run's compile options); any
# other extra keyword takes Triton's own launch, which reports it.
_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg", "enable_fp_fusion", "launch_cooperative_grid",
            "launch_pdl", "debug")
# A kernel keeps at most this many fast keys (integer values are part of them: a run whose token count changes
# every step would otherwise grow the table without bound); past it the table starts afresh.
MAX_FAST_KEYS = 1024


def _getter(positions: list[int]):
    """``values -> tuple(values[i] for i in positions)`` at C speed."""
    if len(positions) > 1:
        return operator.itemgetter(*positions)
    return (lambda v: (v[positions[0]],)) if positions else (lambda v: ())


class _Plan:
    """Argument names of one jitted kernel, in order, and its compiled kernels by launch signature."""

    def __init__(self, fn) -> None:
        self.fn = fn  # held: the table is keyed by the function, whose id a freed function could hand on
        # the CPU interpreter's kernels (TRITON_INTERPRET=1 when they were decorated) launch through Triton
        self.interpreted = isinstance(fn, InterpretedFunction)
        self.names = list(fn.arg_names)
        self.options = tuple(o for o in _OPTIONS if o not in self.names)  # Gluon kernels take num_warps as an argument
        self.defaults = {} if self.interpreted else {p.name: p.default for p in fn.params if p.has_default}
        self.constexpr = [] if self.interpreted else [p.is_constexpr for p in fn.params]
        self.layouts: dict[tuple, tuple | None] = {}  # argument types -> getters of what Triton reads
        self.kernels: dict[tuple, tuple] = {}  # signature -> (launcher, function, packed metadata)
        self.fast: dict[tuple, tuple] = {}  # fast key -> the same, for launches seen before (see _fast_key)

    def layout(self, types: tuple) -> tuple | None:
        """Getters of the constexpr values, the tensors, the integers and the host tensor descriptors of a launch
        with these argument types (None: an argument of a type Triton specialises otherwise)."""
        if types not in self.layouts:
            const, tensors, ints, descs, other = [], [], [], [], False
            for i, (t, is_const) in enumerate(zip(types, self.constexpr)):
                if is_const:
                    const.append(i)
                elif issubclass(t, torch.Tensor):
                    tensors.append(i)
                elif t is int:
                    ints.append(i)
                elif t.__name__ == "TensorDescriptor":  # Gluon's and triton.tools' host descriptors
                    descs.append(i)
                elif t not in (bool, float, type(None)):
                    other = True
            self.layouts[types] = None if other else (_getter(const), _getter(tensors), _getter(ints), _getter(descs))
        return self.layouts[types]


_PLANS: dict[object, _Plan] = {}  # jitted function -> its plan


def _desc_types(descs: tuple) -> tuple:
    """What a launch's host tensor descriptors compile to: their base's dtype, block shape, shared layout and padding
    (the launcher reads base, shape and strides at each launch)."""
    return tuple([(d.base.dtype, tuple(d.block_shape), d.layout, d.padding) for d in descs])


def _fast_key(plan: _Plan, values: list, kwargs: dict, device: int, given: int) -> tuple:
    """A key finer than :func:`_signature` at a third of its host time: the integers' values themselves instead of
    what Triton reads from them, the launch options by name. ``()`` where no direct launch applies: an argument of
    another type, or an extra keyword that is not a launch option (``given``: how many of the kernel's arguments
    ``kwargs`` holds, the others left to their defaults)."""
    types = tuple(map(type, values))
    layout = plan.layout(types)
    if layout is None:
        return ()
    opts = tuple(map(kwargs.get, plan.options))
    if len(kwargs) - given != len(opts) - opts.count(None):
        return ()
    consts, tensors, ints, descs = layout
    ts = tensors(values)
    return (device, opts, types, consts(values), ints(values), tuple([t.dtype for t in ts]),
            tuple([t.data_ptr() & 15 for t in ts]),
            _desc_types(descs(values)))


def _signature(plan: _Plan, values: list, kwargs: dict, device: int) -> tuple:
    """The signature of a launch: what Triton specialises on — launch options, argument types, constexpr
    values, tensor dtypes and 16-byte alignment, integers' ``== 1``, divisibility by 16 and type (i32, i64,
    u64 by range), and a host tensor descriptor's type (its base's dtype, block shape and shared layout: the
    launcher reads its base, shape and strides at each launch)."""
    types = tuple(map(type, values))
    consts, tensors, ints, descs = plan.layout(types)
    return (device, tuple(map(kwargs.get, plan.options)), types, consts(values),
            tuple((t.dtype, t.data_ptr() % 16 == 0) for t in tensors(values)),
            tuple((v == 1, v % 16 == 0, -_I32 <= v < _I32, v < _U64) for v in ints(values)),
            _desc_types(descs(values)))


def _hooked() -> bool:
    """Launch through ``kernel[grid]`` always: a Triton without ``triton.knobs`` (before 3.4), Triton's debug mode,
    or a launch hook installed (a hook, or in newer Tritons a non-empty ``HookChain``), whose invocations the
    direct path would skip."""
    knobs = getattr(triton, "knobs", None)
    if knobs is None or getattr(knobs.runtime, "debug", False):
        return True
    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    return any(h is not None and bool(getattr(h, _HOOK_LIST, True)) for h in hooks)


def _hook_list_name() -> str:
    """The attribute in which Triton's ``HookChain`` keeps its hooks, found on an empty one ("" where there is no
    such class: every hook then counts). Looked up once: ``_hooked`` runs at every launch."""
    chain = getattr(getattr(triton, "knobs", None), "HookChain", None)
    try:
        return next(k for k, v in vars(chain()).items() if isinstance(v, list))
    except (TypeError, StopIteration):
        return ""


_HOOK_LIST = _hook_list_name()


def launch(fn, grid, **kwargs) -> None:
    """Launch the ``@triton.jit`` kernel ``fn`` on ``grid`` with keyword arguments: the kernel's arguments
    (every one given: a grid function reads them from the keyword dict, as Triton's reads its bound
    arguments) plus launch options (``num_warps``, ``num_stages``, ...), which are part of the signature.
    Kernels of the CPU interpreter and kernels with ``pre_run_hooks`` always take Triton's launch, which runs
    them."""
    plan = _PLANS.get(fn)
    if plan is None:
        plan = _PLANS[fn] = _Plan(fn)
    if plan.interpreted or getattr(fn, "pre_run_hooks", None) or _hooked():
        fn[grid](**kwargs)
        return
    try:
        values = [kwargs[n] for n in plan.names]
        given = len(values)
    except KeyError:  # an argument left to its default
        values = [kwargs.get(n, plan.defaults.get(n)) for n in plan.names]
        given = sum(n in kwargs for n in plan.names)
    device = torch.cuda.current_device()
    key = _fast_key(plan, values, kwargs, device, given)
    ready = plan.fast.get(key)
    if ready is None and key:  # new integer values: the signature Triton specialises on may still be known
        sig = _signature(plan, values, kwargs, device)
        ready = plan.kernels.get(sig)
        if ready is None:
            kernel = fn[grid](**kwargs)
            if kernel is not None and hasattr(kernel, "packed_metadata"):
                plan.kernels[sig] = (kernel.run, kernel.function, kernel.packed_metadata)
            return
        if len(plan.fast) >= MAX_FAST_KEYS:
            plan.fast.clear()
        plan.fast[key] = ready
    if ready is None:
        fn[grid](**kwargs)
        return
    grid = grid(kwargs) if callable(grid) else grid
    run, function, packed = ready
    try:
        run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
            driver.active.get_current_stream(device), function, packed, None, None, None, *values)
    except TypeError:  # a Triton whose launcher takes other arguments (checked before anything launches)
        _disable(plan)
        fn[grid](**kwargs)


def _disable(plan: _Plan) -> None:
    """Stop direct launches of this kernel: Triton's own launch from now on (nothing is kept in its tables)."""
    plan.kernels, plan.fast = _NeverReady(), _NeverReady()


class _NeverReady(dict):
    """A signature table that keeps nothing."""

    def __setitem__(self, key, value) -> None:
        pass


def direct_signatures() -> int:
    """How many launch signatures are launched directly so far (0 under the interpreter, before a second
    launch of any signature, or where Triton's launcher convention differs: benchmarks report it)."""
    return sum(len(p.kernels) for p in _PLANS.values())
