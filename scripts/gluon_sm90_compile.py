"""Compile moeblaze's warp-specialized Gluon kernels for sm90 without a GPU (a check before running them on one).

The kernels are written against triton 3.6's Gluon API (the triton of the GPU measurements). Triton compiles for
a target it is told (``GPUTarget("cuda", 90, 32)``) and ships its own ``ptxas``, so a triton 3.6 installed beside
the project's (no torch needed) compiles the kernels to a cubin on a machine without a GPU: compile errors, shared
memory, registers and spills show up without a GPU run, and the TTGIR and PTX can be read. This is how the hang of
``ws_wgrad``'s first version was found: its mma partition's TTGIR no longer carried the next tile's slot range
through the loop (the comment on ``pred`` in ``moeblaze.kernels.ws_wgrad``).

Usage (repo root)::

    python3 -m venv /tmp/t36 && /tmp/t36/bin/pip install triton==3.6.0
    /tmp/t36/bin/python scripts/gluon_sm90_compile.py [--dump DIR]

Prints one line per compiled variant (shared memory bytes, registers, spill bytes); ``--dump DIR`` writes each
variant's TTGIR and PTX there; ``--compare DIR`` says per variant whether its PTX is the one dumped in ``DIR`` (by
another version of the code), instruction by instruction with debug lines and register numbers left out: how a
refactor of the kernels is shown to compile to the same code.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import subprocess
import sys
import tempfile
import types

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource

# the kernels' modules without the package's __init__ (which imports torch)
_PKG = types.ModuleType("mbk")
_PKG.__path__ = [os.path.join(os.path.dirname(__file__), "..", "src", "moeblaze", "kernels")]
sys.modules["mbk"] = _PKG
DIV16 = [["tt.divisibility", 16]]  # what the JIT specialises a 16-byte aligned pointer or a multiple of 16 to


def _desc(dtype: str, block: list[int]) -> str:
    layout = gl.NVMMASharedLayout.get_default_for(block, {"bf16": gl.bfloat16, "fp16": gl.float16,
                                                          "fp8e4nv": gl.float8e4nv}[dtype])
    return f"tensordesc<{dtype}[{block[0]}, {block[1]}],{layout!r}>"


def _compile(fn, sig: dict, consts: dict, divisible: list[str], max_regs: int, num_warps: int = 8):
    names = list(sig)
    src = GluonASTSource(fn, sig, {(names.index(k),): v for k, v in consts.items()},
                         {(names.index(n),): DIV16 for n in divisible})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "maxnreg": max_regs})


def variants():
    """(name, compiled kernel) of the configurations the launchers use, bf16 operands."""
    wg = importlib.import_module("mbk.ws_wgrad")
    gm = importlib.import_module("mbk.ws_gemm")
    for gather_a in (True, False):
        for out in ("bf16", "bf16-tma", "fp32"):
            tma_store = out.endswith("-tma")  # whole tiles by TMA: the 16-bit output's default
            sig = {"g_ptr": "*bf16", "r_desc": _desc("bf16", [64, 256 if gather_a else 128]),
                   "c_ptr": f"*{out[:4]}", "c_desc": _desc("bf16", [128, 64]) if tma_store else "constexpr",
                   "offsets_ptr": "*i32", "indices_ptr": "*i32", "P": "i32", "Q": "i32", "NUM_EXPERTS": "i32",
                   "stride_g_t": "i32", "stride_c_e": "i32", "stride_c_p": "i32"}
            consts = dict(GATHER_A=gather_a, BLOCK_P=128, BLOCK_Q=256, BLOCK_K=64, NUM_STAGES=3, GROUP_M=8,
                          TMA_STORE=tma_store, num_warps=8)
            sig.update(dict.fromkeys(consts, "constexpr"))
            if not tma_store:
                consts["c_desc"] = None
            yield (f"ws_wgrad gather_a={gather_a} out={out}",
                   _compile(wg.ws_wgrad_kernel, sig, consts, ["g_ptr", "c_ptr", "offsets_ptr", "indices_ptr", "P", "Q",
                                                              "stride_g_t", "stride_c_e", "stride_c_p"], wg.MAX_REGS))
    for w_nk in (True, False):
        sig = {"a_desc": _desc("bf16", [128, 64]), "w_desc": _desc("bf16", [256, 64] if w_nk else [64, 256]),
               "c_ptr": "*bf16", "offsets_ptr": "*i32", "tile_expert_ptr": "*i32", "tile_row_ptr": "*i32",
               "num_tiles_ptr": "*i32", "K_DIM": "i32", "N_COLS": "i32", "N_EXT": "i32", "N_START": "i32",
               "stride_c_m": "i32"}
        consts = dict(W_NK=w_nk, BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, NUM_STAGES=3, GROUP_M=8, num_warps=8)
        sig.update(dict.fromkeys(consts, "constexpr"))
        yield (f"ws_gemm w_nk={w_nk}",
               _compile(gm.ws_gemm_kernel, sig, consts, ["c_ptr", "offsets_ptr", "tile_expert_ptr", "tile_row_ptr",
                                                         "num_tiles_ptr", "K_DIM", "N_COLS", "N_EXT", "stride_c_m"],
                        wg.MAX_REGS))
    f8 = importlib.import_module("mbk.fp8_ws_gemm")
    cfg = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=128, NUM_STAGES=3, GROUP_M=8)  # launch.WS_GEMM_FP8_CONFIG
    for gather_a in (False, True):
        sig = {"a_desc": "constexpr" if gather_a else _desc("fp8e4nv", [128, 128]), "a_ptr": "*fp8e4nv",
               "w_desc": _desc("fp8e4nv", [256, 128]), "c_ptr": "*bf16", "a_scale_ptr": "*fp32",
               "w_scale_ptr": "*fp32",
               "offsets_ptr": "*i32", "indices_ptr": "*i32", "tile_expert_ptr": "*i32", "tile_row_ptr": "*i32",
               "num_tiles_ptr": "*i32", "A_ROWS": "i32", "K_DIM": "i32", "N_COLS": "i32", "N_EXT": "i32",
               "N_START": "i32", "stride_c_m": "i32", "stride_ws_e": "i32", "stride_a_t": "i32",
               "GATHER_A": "constexpr"}
        consts = {**cfg, "GATHER_A": gather_a, **({"a_desc": None} if gather_a else {})}
        sig.update(dict.fromkeys(cfg, "constexpr"))
        yield (f"fp8_ws_gemm gather_a={gather_a}", _compile(f8.fp8_ws_gemm_kernel, sig, consts, [
            "a_ptr", "c_ptr", "a_scale_ptr", "w_scale_ptr", "offsets_ptr", "indices_ptr", "tile_expert_ptr",
            "tile_row_ptr", "num_tiles_ptr", "K_DIM", "N_COLS", "N_EXT", "stride_c_m", "stride_ws_e", "stride_a_t"],
            f8.MAX_REGS, num_warps=4))
    # F1's module imports the recipe's device functions through the package (torch needed: a CPU build does)
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
    up = importlib.import_module("moeblaze.kernels.fp8_ws_up")
    act = importlib.import_module("moeblaze.kernels.act_math")
    cfg = dict(up.CONFIG)
    for pow2 in (False, True):
        sig = {"a_ptr": "*fp8e4nv", "w_desc": _desc("fp8e4nv", [64, 128]), "pre_ptr": "*fp8e4nv", "pre_s_ptr": "*fp32",
               "act_ptr": "*bf16", "a_scale_ptr": "*fp32", "w_scale_ptr": "*fp32", "offsets_ptr": "*i32",
               "indices_ptr": "*i32", "tile_expert_ptr": "*i32", "tile_row_ptr": "*i32", "num_tiles_ptr": "*i32",
               **dict.fromkeys(["A_ROWS", "K_DIM", "N_COLS", "N_EXT", "UP_OFF", "stride_a_t", "stride_pre_m",
                                "stride_act_m", "stride_ws_e"], "i32"), "alpha": "fp32", "limit": "fp32",
               **dict.fromkeys(["ACTIVATION", "POW2", *cfg], "constexpr")}
        consts = {**cfg, "ACTIVATION": act.ACTIVATION_CODES["swiglu"], "POW2": pow2}
        yield (f"fp8_ws_up pow2={pow2}", _compile(up.fp8_ws_up_kernel, sig, consts, [
            "a_ptr", "pre_ptr", "pre_s_ptr", "act_ptr", "a_scale_ptr", "w_scale_ptr", "offsets_ptr", "indices_ptr",
            "tile_expert_ptr", "tile_row_ptr", "num_tiles_ptr", "K_DIM", "N_COLS", "N_EXT", "UP_OFF", "stride_a_t",
            "stride_pre_m", "stride_act_m", "stride_ws_e"], up.MAX_REGS, num_warps=4))


def resource_usage(cubin: bytes) -> str:
    """Registers, stack frame and local memory (spills) of a cubin, through the cuobjdump that ships with triton
    (also used by ``scripts/compile_experts_sm90.py``)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    return " ".join(w for line in out.splitlines() if "REG:" in line for w in line.split()
                    if w.startswith(("REG:", "STACK:", "LOCAL:")))


def instructions(ptx: str) -> list[str]:
    """``ptx``'s instructions and directives without debug information and comments, registers renamed in order of
    first use (``%r17`` -> ``%r_3``): two builds of the same code compare equal though their lines and register
    numbers moved."""
    names: dict[str, str] = {}

    def rename(m: re.Match) -> str:
        return names.setdefault(m.group(0), f"%{m.group(1)}_{len(names)}")

    out, debug = [], False
    for line in ptx.splitlines():
        t = re.sub(r"\s*//.*$", "", line).strip()
        debug = debug or (t.startswith(".section") and "debug" in t)
        if debug:
            debug = t != "}"
            continue
        if t and not t.startswith((".loc", ".file")) and not re.match(r"\$L__(tmp|func_end|info|debug)", t):
            out.append(re.sub(r"%(r|rd|p|f|fd|rs|h|hh)(\d+)\b", rename, re.sub(r"\s+", " ", t)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dump", help="folder for each variant's TTGIR and PTX")
    ap.add_argument("--compare", help="a --dump folder of another version: is each variant's PTX the same code?")
    args = ap.parse_args()
    if not triton.__version__.startswith("3.6."):
        sys.exit(f"needs triton 3.6 (the kernels' Gluon API), found {triton.__version__}")
    for name, kernel in variants():
        usage = resource_usage(kernel.asm["cubin"])
        print(f"{name}: shared {kernel.metadata.shared} bytes, {kernel.metadata.num_warps} warps, {usage}")
        regs = int(usage.split("REG:")[1].split()[0])
        if regs * kernel.metadata.num_warps * 32 > 65536:  # the launch fails with OutOfResources("threads")
            sys.exit(f"{name}: {regs} registers x {kernel.metadata.num_warps * 32} threads exceed the 65,536 of an SM")
        stem = name.replace(" ", "_").replace("=", "-")
        if args.compare:
            with open(os.path.join(args.compare, f"{stem}.ptx")) as f:
                same = instructions(f.read()) == instructions(kernel.asm["ptx"])
            print(f"  PTX {'the same as' if same else 'DIFFERENT from'} {args.compare}'s")
        if args.dump:
            os.makedirs(args.dump, exist_ok=True)
            for ext in ("ttgir", "ptx"):
                with open(os.path.join(args.dump, f"{stem}.{ext}"), "w") as f:
                    f.write(kernel.asm[ext])


if __name__ == "__main__":
    main()
