"""How the launchers are called: through their ``torch.library`` custom op only while torch.compile traces.

Every public launcher (dispatch build, the four expert ops) is registered as a custom op with a fake
implementation so ``torch.compile(fullgraph=True)`` sees one opaque node. In eager mode the op dispatch
is pure host overhead (~14 µs per call on a 2-core CPU, torch 2.13: comparable to a whole small
dispatch build), so eager invocations go straight to the plain function.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["call_op"]


def call_op(op: Callable[..., Any], impl: Callable[..., Any], *args: Any,
            mutated: Sequence[torch.Tensor] = ()) -> Any:
    """``op(*args)`` while torch.compile traces, else ``impl(*args)``.

    Args:
        op: the registered custom op. impl: the function it wraps. args: their arguments.
        mutated: arguments the function writes in place. The op (declared ``mutates_args``) bumps their
            autograd version counters itself; a kernel writing through a pointer does not, so the eager
            path bumps them here, and autograd still refuses a backward through an overwritten tensor.
    """
    if torch.compiler.is_compiling():
        return op(*args)
    out = impl(*args)
    for t in mutated:
        torch.autograd.graph.increment_version(t)
    return out
