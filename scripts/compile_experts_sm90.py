"""Compile every expert-kernel variant for sm_90 (H100/H200) on a machine without a GPU.

Catches what the Triton interpreter does not (e.g. non-constexpr globals, type errors in loops) and
reports, per variant, shared memory, whether ``wgmma`` and ``cp.async`` pipelining are used, and
registers, stack frame and local memory (spills) of the cubin Triton built for sm_90a, as its bundled
``cuobjdump`` reports them (a kernel that spills looks fine in the PTX: ptxas allocates the registers).
Pointers and most integers are marked 16-divisible, as Triton specialises them at launch when d and h are
multiples of 16. Run without TRITON_INTERPRET:

    env -u TRITON_INTERPRET python scripts/compile_experts_sm90.py [bf16|fp16|fp32|fp8] [--tuned] [--tf32]

For the figures of the GPU runs' triton (3.6) run it under that version, e.g. ``PYTHONPATH=src
/tmp/t36/bin/python scripts/compile_experts_sm90.py`` in a venv with ``triton==3.6.0`` and a CPU torch: register
allocation differs between triton versions (triton 3.9 and 3.6 gave other stack frames).

``--tf32`` (with fp32): the TF32 variants (``DOT_PREC="tf32"``, F1's ``act`` and B1's ``dpre`` stored rounded).
``fp8``: the FP8 layer's variants (e4m3 operands, bf16 outputs; F1 writing the kept ``pre`` in e4m3; the activation
backward reading it and writing B3's e4m3 ``dpre``).
"""

from __future__ import annotations

import sys
import time

import triton
from gluon_sm90_compile import resource_usage  # this script's folder: sys.path[0] when run as a script
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from moeblaze.fp8 import KEPT_TILE
from moeblaze.kernels.act_bwd import act_bwd_rows_kernel
from moeblaze.kernels.act_math import ACTIVATION_CODES
from moeblaze.kernels.bias_grad import segment_sum_kernel
from moeblaze.kernels.combine import gather_sum_kernel
from moeblaze.kernels.grouped_gemm import (
    B_DESC_INTERLEAVED,
    B_DESC_KN,
    B_DESC_NK,
    B_DESC_NONE,
    B_DESC_PAIRED,
    EPILOGUE_ACT_FWD,
    EPILOGUE_PLAIN,
    grouped_gemm_kernel,
)
from moeblaze.kernels.pair_list import (
    _place_block_t,
    pair_weights_bwd_kernel,
    rounding_pad_count_kernel,
    rounding_pad_place_kernel,
    rounding_place_kernel,
)
from moeblaze.kernels.rounding import (
    GROUP,
    _keys_block,
    _select_warps,
    rounding_keys_kernel,
    rounding_select_kernel,
)
from moeblaze.kernels.router import (
    _block_t,
    _topk_warps,
    router_loss_kernel,
    router_topk_bwd_kernel,
    router_topk_kernel,
)
from moeblaze.kernels.tuning import act_bwd_configs, gather_sum_configs, gemm_configs, prune_gemm_configs, wgrad_configs
from moeblaze.kernels.wgrad import grouped_wgrad_kernel

# The kernel variants by name (moeblaze.kernels.grouped_gemm), as the launcher passes them.
PLAIN, ACT_FWD = EPILOGUE_PLAIN.value, EPILOGUE_ACT_FWD.value
NONE, NK, KN, PAIRED, INTERLEAVED = (m.value for m in (B_DESC_NONE, B_DESC_NK, B_DESC_KN, B_DESC_PAIRED,
                                                         B_DESC_INTERLEAVED))

TARGET = GPUTarget("cuda", 90, 32)
NOT_DIVISIBLE = {"max_tiles", "NUM_EXPERTS", "T", "K"}


def compile_one(fn, ptr_types, consts, num_warps, num_stages, label):
    sig = {n: "constexpr" if n in consts else ptr_types.get(n, "i32") for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if sig[n] != "constexpr" and n not in NOT_DIVISIBLE}
    t = time.time()
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs), target=TARGET,
                       options={"num_warps": num_warps, "num_stages": num_stages})
    ptx = k.asm["ptx"]
    print(f"{label:<70} {time.time() - t:4.1f}s shared={k.metadata.shared:>6} wgmma={'wgmma' in ptx} "
          f"cp.async={'cp.async' in ptx} {resource_usage(k.asm['cubin'])}", flush=True)


def main() -> None:
    dt = next((a for a in sys.argv[1:] if not a.startswith("--")), "bf16")
    if dt == "fp8":
        compile_fp8("--tuned" in sys.argv)
        return
    tuned = "--tuned" in sys.argv
    T = f"*{dt}"
    kind = "fixed32" if dt == "fp32" else ("tuned16" if tuned else "fixed16")
    tf32 = dt == "fp32" and "--tf32" in sys.argv
    prec = "ieee" if dt == "fp32" and not tf32 else "tf32"
    compile_gemms(T, kind, prec, tf32)
    compile_wgrads(T, kind, prec)
    compile_act_bwd(T, kind, tf32)
    compile_combine(T, kind)
    compile_router()
    compile_rounding()
    compile_bias_grads(T)


def compile_gemms(T: str, kind: str, prec: str, tf32: bool) -> None:
    """F1, F2, B1 and B3 on ``grouped_gemm_kernel``: each launcher variant over its configs."""
    code = ACTIVATION_CODES
    gemm_ptrs = {n: T for n in ("a_ptr", "b_ptr", "c_ptr", "aux_ptr")}
    gemm_ptrs.update(scale_ptr="*fp32", offsets_ptr="*i32", indices_ptr="*i32", tile_expert_ptr="*i32",
                     tile_row_ptr="*i32", num_tiles_ptr="*i32", bias_ptr=T, alpha="fp32", limit="fp32")
    base = dict(GATHER_A=False, SCATTER_C=False, SCALE_C=False, EPILOGUE=PLAIN, ACTIVATION=0, DUAL=False,
                STORE_PRE=False, STORE_AUX=False, DOT_PREC=prec, EVEN_K=True, EVEN_N=True,
                BLOCK_M=128, stride_a_k=1, stride_b_k=1, A_DESC=False, B_DESC=NONE, HAS_BIAS=False, PRE_STEP=1,
                TF32_ACT=False, FP8=False, PRE_FP8=0)
    k_contig_b = dict(stride_b_k=None, stride_b_n=1)
    variants = {
        "F1 swiglu": dict(GATHER_A=True, EPILOGUE=ACT_FWD, DUAL=True, STORE_PRE=True, STORE_AUX=True, B_DESC=PAIRED),
        "F1 swiglu, w1 transposed": dict(GATHER_A=True, EPILOGUE=ACT_FWD, DUAL=True, STORE_PRE=True, STORE_AUX=True,
                                         B_DESC=KN, **k_contig_b),
        "F1 gelu, act only, odd": dict(GATHER_A=True, EPILOGUE=ACT_FWD, ACTIVATION=code["gelu"], STORE_AUX=True,
                                       EVEN_K=False, EVEN_N=False),
        "F1 gpt-oss (interleaved box, bias)": dict(GATHER_A=True, EPILOGUE=ACT_FWD, DUAL=True, STORE_PRE=True,
                                                   STORE_AUX=True, B_DESC=INTERLEAVED,
                                                   ACTIVATION=code["swiglu_clamped"], HAS_BIAS=True, PRE_STEP=2,
                                                   **k_contig_b),
        "F1 gpt-oss pointers, odd": dict(GATHER_A=True, EPILOGUE=ACT_FWD, DUAL=True, STORE_PRE=True, STORE_AUX=True,
                                         ACTIVATION=code["swiglu_clamped"], HAS_BIAS=True, PRE_STEP=2,
                                         EVEN_K=False, EVEN_N=False, stride_b_k=None, stride_b_n=None),
        "F1 geglu_tanh + relu2 bias": dict(GATHER_A=True, EPILOGUE=ACT_FWD, DUAL=True, STORE_PRE=True, STORE_AUX=True,
                                           B_DESC=PAIRED, ACTIVATION=code["geglu_tanh"], HAS_BIAS=True),
        "F1 relu2": dict(GATHER_A=True, EPILOGUE=ACT_FWD, ACTIVATION=code["relu2"], STORE_PRE=True, STORE_AUX=True,
                         B_DESC=NK),
        "F2 y": dict(A_DESC=True, B_DESC=NK),
        "F2 y bias": dict(A_DESC=True, B_DESC=NK, HAS_BIAS=True),
        "F2 K=1 scatter bias": dict(SCATTER_C=True, SCALE_C=True, EVEN_N=False, HAS_BIAS=True),
        "F2 K=1 scatter": dict(SCATTER_C=True, SCALE_C=True, EVEN_N=False),
        "B1 dact'": dict(GATHER_A=True, B_DESC=KN, **k_contig_b),
        "B1 dact' odd": dict(GATHER_A=True, EVEN_K=False, EVEN_N=False, **k_contig_b),
        "B3": dict(A_DESC=True, B_DESC=KN, **k_contig_b),
    }
    for name, v in variants.items():
        c0 = {k: val for k, val in {**base, **v}.items() if val is not None}
        c0["TF32_ACT"] = tf32 and c0["EPILOGUE"] == ACT_FWD
        for cfg in prune_gemm_configs(gemm_configs(kind), {}, DUAL=c0["DUAL"]):
            compile_one(grouped_gemm_kernel, gemm_ptrs, {**c0, **cfg.kwargs}, cfg.num_warps, cfg.num_stages,
                        f"gemm {name} {cfg.kwargs} w{cfg.num_warps} s{cfg.num_stages}")


def compile_wgrads(T: str, kind: str, prec: str) -> None:
    """B2 and B4 on ``grouped_wgrad_kernel``."""
    wg_ptrs = dict(a_ptr=T, b_ptr=T, c_ptr=T, offsets_ptr="*i32", indices_ptr="*i32")
    wbase = dict(DOT_PREC=prec, GATHER_A=True, stride_a_p=1, stride_b_q=1, E_POW2=128)
    slots_contiguous = dict(GATHER_A=False, B_DESC=False, stride_a_m=1, stride_b_m=1, stride_a_p=None,
                            stride_b_q=None)  # the padded TF32 copies
    for name, v in {"B4 (transposed store)": dict(B_DESC=True, stride_c_p=1), "B2": dict(B_DESC=True, stride_c_q=1),
                    "B2 pointers": dict(B_DESC=False, stride_c_q=1),
                    "B2 padded copies": dict(stride_c_q=1, **slots_contiguous)}.items():
        consts = {k: val for k, val in {**wbase, **v}.items() if val is not None}
        for cfg in wgrad_configs(kind):
            if cfg.kwargs["PERSISTENT"] and not consts["GATHER_A"]:  # the launcher never pairs them (16-bit only)
                continue
            compile_one(grouped_wgrad_kernel, wg_ptrs, {**consts, **cfg.kwargs}, cfg.num_warps,
                        cfg.num_stages, f"wgrad {name} {cfg.kwargs} w{cfg.num_warps} s{cfg.num_stages}")


def compile_act_bwd(T: str, kind: str, tf32: bool) -> None:
    """The 16-bit activation backward, per activation."""
    code = ACTIVATION_CODES
    rows_ptrs = dict(dact_ptr=T, pre_ptr=T, pre_s_ptr="*fp32", dpre_ptr=T, scale_ptr="*fp32", dtw_ptr="*fp32",
                     limit_ptr="*i32", dpre_q_ptr=T, dpre_s_ptr="*fp32", alpha="fp32", limit="fp32", tiny="fp32")
    for act, step, limited in (("swiglu", 1, False), ("silu", 1, False), ("swiglu_clamped", 2, True),
                               ("gelu_tanh", 1, False), ("relu2", 1, True)):
        for cfg in act_bwd_configs(kind):
            compile_one(act_bwd_rows_kernel, rows_ptrs,
                        dict(ACTIVATION=code[act], STORE_PART=True, STORE_WACT=True, PRE_STEP=step,
                             HAS_LIMIT=limited, TF32_DPRE=tf32, **ACT_BWD_16BIT, **cfg.kwargs), cfg.num_warps,
                        cfg.num_stages, f"act_bwd {act} step={step} limit={limited} {cfg.kwargs} w{cfg.num_warps}")


def compile_combine(T: str, kind: str) -> None:
    """The combine (gather-sum over a token's K slots)."""
    for limited, csr in ((False, False), (True, False), (False, True)):
        for cfg in gather_sum_configs(kind):
            compile_one(gather_sum_kernel, dict(src_ptr=T, w_ptr="*fp32", map_ptr="*i32", out_ptr=T,
                                                limit_ptr="*i32", pair_off_ptr="*i32"),
                        dict(K=8, HAS_W=True, HAS_LIMIT=limited, CSR=csr, stride_w_k=1, stride_map_k=1,
                             **cfg.kwargs),
                        cfg.num_warps, cfg.num_stages,
                        f"combine K=8 limit={limited} csr={csr} {cfg.kwargs} w{cfg.num_warps}")


def compile_bias_grads(T: str) -> None:
    """The bias gradients' segment sums."""
    seg_ptrs = dict(src_ptr=T, scale_ptr="*fp32", offsets_ptr="*i32", indices_ptr="*i32", out_ptr=T)
    for gather in (False, True):
        cfg = triton.Config({"BLOCK_S": 32, "BLOCK_D": 128}, num_warps=4, num_stages=1)
        compile_one(segment_sum_kernel, seg_ptrs, dict(GATHER=gather, SCALE=gather, **cfg.kwargs), cfg.num_warps,
                    cfg.num_stages, f"bias grad gather={gather} {cfg.kwargs} w{cfg.num_warps}")


ACT_BWD_16BIT = dict(QUANT=False, POW2=False, PRE_E4M3=False, PRE_TILE=1, QMAX=448.0)  # act_bwd's FP8 flags off


def compile_fp8(tuned: bool) -> None:
    """The FP8 layer's grouped-GEMM variants (moeblaze.kernels.fp8_experts) and its activation backward."""
    kind, e4, bf = ("tuned8" if tuned else "fixed8"), "*fp8e4nv", "*bf16"
    ptrs = dict(a_ptr=e4, b_ptr=e4, c_ptr=bf, aux_ptr=bf, scale_ptr="*fp32", a_scale_ptr="*fp32",
                b_scale_ptr="*fp32", offsets_ptr="*i32", indices_ptr="*i32", tile_expert_ptr="*i32",
                tile_row_ptr="*i32", num_tiles_ptr="*i32", bias_ptr=bf, alpha="fp32", limit="fp32")
    base = dict(GATHER_A=False, SCATTER_C=False, SCALE_C=False, EPILOGUE=PLAIN, ACTIVATION=0, DUAL=False,
                STORE_PRE=False, STORE_AUX=False, DOT_PREC="tf32", EVEN_K=True, EVEN_N=True, BLOCK_M=128,
                stride_a_k=1, stride_b_k=1, A_DESC=False, B_DESC=NK, HAS_BIAS=False, PRE_STEP=1, TF32_ACT=False,
                FP8=True, PRE_FP8=0)
    f1 = dict(GATHER_A=True, EPILOGUE=ACT_FWD, DUAL=True, STORE_PRE=True, STORE_AUX=True, B_DESC=PAIRED)
    variants = {  # name: (constexprs, pointer types)
        "F1 kept pre e4m3": ({**f1, "PRE_FP8": 1}, {"c_ptr": e4}),
        "F1 kept pre e4m3, pow2 scales, gelu, odd": ({**f1, "DUAL": False, "ACTIVATION": ACTIVATION_CODES["gelu"],
                                                      "B_DESC": NK, "PRE_FP8": 2, "EVEN_N": False}, {"c_ptr": e4}),
        "F1 pre in bf16 (save=input)": ({**f1, "STORE_AUX": False}, {}),
        "F2": ({"A_DESC": True}, {}),
        "F2 K=1 scatter": ({"SCATTER_C": True, "SCALE_C": True, "EVEN_N": False}, {}),
        "B1": ({"GATHER_A": True}, {}),
        "B3": ({"A_DESC": True}, {}),
    }
    for name, (v, types) in variants.items():
        consts = {**base, **v}
        for cfg in prune_gemm_configs(gemm_configs(kind), {}, DUAL=consts["DUAL"], PRE_FP8=consts["PRE_FP8"]):
            compile_one(grouped_gemm_kernel, {**ptrs, **types}, {**consts, **cfg.kwargs}, cfg.num_warps,
                        cfg.num_stages, f"gemm fp8 {name} {cfg.kwargs} w{cfg.num_warps} s{cfg.num_stages}")
    rows_ptrs = dict(dact_ptr=bf, pre_ptr=e4, pre_s_ptr="*fp32", dpre_ptr=bf, scale_ptr="*fp32", dtw_ptr="*fp32",
                     limit_ptr="*i32", dpre_q_ptr=e4, dpre_s_ptr="*fp32", alpha="fp32", limit="fp32", tiny="fp32")
    for act in ("swiglu", "gelu"):
        for quant in (False, True):
            for cfg in act_bwd_configs("fixed16"):
                compile_one(act_bwd_rows_kernel, rows_ptrs,
                            dict(ACTIVATION=ACTIVATION_CODES[act], STORE_PART=True, STORE_WACT=True, PRE_STEP=1,
                                 HAS_LIMIT=False, TF32_DPRE=False, QUANT=quant, POW2=False, PRE_E4M3=True,
                                 PRE_TILE=KEPT_TILE, QMAX=448.0, **cfg.kwargs), cfg.num_warps, cfg.num_stages,
                            f"act_bwd fp8 {act} quant={quant} {cfg.kwargs} w{cfg.num_warps}")


def compile_router() -> None:
    """The fused router's three kernels (moeblaze.kernels.router) at E 8, 128 and 1024."""
    f32 = "*fp32"
    topk_ptrs = dict(logits_ptr=f32, ids_ptr="*i32", weights_ptr=f32, probs_ptr=f32, lse_ptr=f32, part_ptr=f32,
                     scale="fp32")
    bwd_ptrs = dict(probs_ptr=f32, ids_ptr="*i32", dw_ptr=f32, dprobs_ptr=f32, counts_ptr=f32, lse_ptr=f32,
                    daux_ptr=f32, dz_ptr=f32, dlogits_ptr=f32, scale="fp32", aux_c="fp32", z_c="fp32",
                    pair_offsets_ptr="*i32", expert_idx_ptr="*i32")
    for E, K in ((8, 2), (128, 8), (256, 4), (1024, 10)):
        bt, be, kp = _block_t(E), triton.next_power_of_2(E), triton.next_power_of_2(K)
        for renorm in (False, True):
            compile_one(router_topk_kernel, topk_ptrs, dict(K=K, KP=kp, RENORM=renorm, BLOCK_T=bt, BLOCK_E=be),
                        _topk_warps(E), 1, f"router top-k E={E} K={K} renorm={renorm}")
            compile_one(router_topk_bwd_kernel, bwd_ptrs,
                        dict(K=K, KP=kp, RENORM=renorm, HAS_DW=not renorm, PAIRS=renorm, PADS_UNROLLED=2,
                             HAS_DPROBS=renorm, HAS_DAUX=True, HAS_DZ=True, BLOCK_T=bt, BLOCK_E=be), 4, 1,
                        f"router backward E={E} K={K} renorm={renorm} pairs={renorm}")
        compile_one(router_loss_kernel, dict(part_ptr=f32, counts_ptr=f32, dot_ptr=f32, aux_ptr=f32, z_ptr=f32,
                                             aux_c="fp32", z_c="fp32"),
                    dict(BLOCK_B=32, BLOCK_E=min(32, be)), 4, 1, f"router losses E={E}")


def compile_rounding() -> None:
    """Token rounding's selection and placement kernels (moeblaze.kernels.rounding, .pair_list) at the issue's
    shapes."""
    for T, E, K, dt in ((16384, 128, 2, "*bf16"), (16384, 256, 4, "*fp32"), (65536, 512, 10, "*fp32")):
        nb = triton.cdiv(T, GROUP)
        ptrs = dict(scores_ptr=dt, ids_ptr="*i32", weights_ptr=dt, counts_ptr="*fp32", rand_ptr="*fp32",
                    target_ptr="*i32",
                    bmax_ptr="*i32", cand_ptr="*i32", kept_ptr="*i32", pad_mask_ptr="*u8", pad_tok_ptr="*i32",
                    pads_ptr="*i32", block_pads_ptr="*i32", token_idx_ptr="*i32", expert_idx_ptr="*i32",
                    pair_offsets_ptr="*i32", dw_ptr=dt, dtopk_ptr=dt, dscores_ptr=dt, scale="fp32", topk_w_ptr=dt,
                    w_ptr=dt)
        bt, be = _keys_block(E)
        compile_one(rounding_keys_kernel, ptrs, dict(MODE=0, K=K, GROUP=GROUP, BLOCK_T=bt, BLOCK_E=be), 4, 1,
                    f"rounding keys E={E} K={K}")
        compile_one(rounding_select_kernel, ptrs, dict(K=K, GROUP=GROUP, BLOCK_NB=triton.next_power_of_2(nb),
                                                       CAND=256, BLOCK_J=64, MODE=3),
                    _select_warps(nb), 1, f"rounding select T={T} K={K}")
        pt, pe = _place_block_t(E), triton.next_power_of_2(E)
        compile_one(rounding_pad_count_kernel, ptrs, dict(BLOCK_T=pt, BLOCK_E=pe), 4, 1, f"rounding pad count E={E}")
        compile_one(rounding_place_kernel, ptrs, dict(K=K, BLOCK_T=pt, BLOCK_NBT=triton.next_power_of_2(T // pt),
                                                      BLOCK_TAIL=128), 4, 1, f"rounding place T={T} K={K}")
        compile_one(pair_weights_bwd_kernel, ptrs, dict(K=K, BLOCK_T=max(1, min(128, 8192 // pe)), BLOCK_E=pe), 4, 1,
                    f"pair weights backward E={E} K={K}")
        compile_one(rounding_pad_place_kernel, ptrs, dict(BLOCK_J=64, CHUNK_E=min(pe, 32)), 4, 1,
                    f"rounding pad place E={E}")

if __name__ == "__main__":
    main()
