"""Forward+backward of one MoE expert layer: moeblaze (Triton) vs a conventional grouped_mm layer.

Router EXCLUDED: both sides get the same fixed top-k routing (uniform random ids, softmax-like
weights); the dispatch work IS included (moeblaze builds its index; the conventional layer argsorts).
Both run in ONE process on the same inputs. Per config and implementation it records the median time
of forward+backward (``triton.testing.do_bench``), TFLOP/s = 18*N*d*h / time (DESIGN.md §5-6; SwiGLU),
the bytes autograd saves for backward (saved-tensor hooks, unique storages, the input x and the
parameters not counted, as DESIGN.md §6) and the peak memory of forward+backward above the inputs.

Configs: DESIGN.md §6 and the MoEBlaze paper's Table 1 (FFN h = 4d). A cell that runs out of memory is
recorded with a note instead of a time.

Usage: python benchmarks/bench_experts.py [--configs sonic7b,olmoe] [--impls moeblaze,torch]
       [--save preact] [--dtype bf16] [--out results.csv]
"""

from __future__ import annotations

import argparse
import csv
import datetime
import sys

import torch
import torch.nn.functional as F

CONFIGS = {  # name: (T, d, h, E, K)
    "sonic7b": (24576, 1536, 256, 128, 8),
    "olmoe": (32768, 2048, 1024, 64, 8),
    "qwen3_30b": (32768, 2048, 768, 128, 8),
    "conf1": (65536, 512, 2048, 4, 1),
    "conf2": (65536, 1024, 4096, 8, 2),
    "conf3": (65536, 1024, 4096, 16, 4),
    "conf4": (32768, 2048, 8192, 16, 4),
    "conf5": (32768, 512, 2048, 16, 4),
    "conf6": (16384, 1024, 4096, 16, 4),
    "conf7": (8192, 2048, 8192, 8, 4),
    "poster": (2097152, 512, 2048, 4, 1),
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def conventional_layer(x, topk_ids, topk_weights, w_gate_up, w_down):
    """The usual PyTorch MoE: argsort permute, gathered input materialised, grouped_mm, index_add."""
    T, K = topk_ids.shape
    E = w_down.shape[0]
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token = order // K
    offs = torch.bincount(flat, minlength=E).cumsum(0).to(torch.int32)
    xg = x.index_select(0, token)  # [N, d] routing buffer
    pre = F.grouped_mm(xg, w_gate_up.transpose(-2, -1), offs=offs)
    gate, up = pre.chunk(2, dim=-1)
    act = F.silu(gate) * up
    y = F.grouped_mm(act, w_down.transpose(-2, -1), offs=offs)
    y = y * topk_weights.reshape(-1)[order, None].to(y.dtype)
    return torch.zeros_like(x).index_add(0, token, y)


def moeblaze_layer(save):
    from moeblaze import build_dispatch, moe_experts

    def run(x, topk_ids, topk_weights, w_gate_up, w_down):
        index = build_dispatch(topk_ids, w_down.shape[0], validate=False)
        return moe_experts(x, topk_ids, topk_weights, w_gate_up, w_down, "swiglu", save, "triton", index)

    return run


def make_inputs(T, d, h, E, K, dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.rand(T, E, device="cuda", generator=g).topk(K, dim=1).indices.to(torch.int32)
    tw = torch.rand(T, K, device="cuda", generator=g) + 0.1
    tw = (tw / tw.sum(1, keepdim=True)).requires_grad_()
    x = torch.randn(T, d, device="cuda", dtype=dtype, generator=g).requires_grad_()
    w1 = torch.nn.Parameter(torch.randn(E, 2 * h, d, device="cuda", dtype=dtype, generator=g) * d**-0.5)
    w2 = torch.nn.Parameter(torch.randn(E, d, h, device="cuda", dtype=dtype, generator=g) * h**-0.5)
    return x, ids, tw, w1, w2


def saved_bytes(fn, exclude):
    """Unique storages autograd saves during ``fn()`` (parameters and ``exclude`` tensors not counted)."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if not isinstance(t, torch.nn.Parameter) and ptr not in skip:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


def measure(layer, inputs, dout, rep_ms):
    import triton.testing

    x, ids, tw, w1, w2 = inputs
    leaves = [x, tw, w1, w2]

    def step():
        layer(x, ids, tw, w1, w2).backward(dout)

    step()  # compile / autotune outside the timed region
    for t in leaves:
        t.grad = None
    torch.cuda.synchronize()
    ms = triton.testing.do_bench(step, warmup=max(25, rep_ms // 4), rep=rep_ms, grad_to_none=leaves,
                                 return_mode="median")
    for t in leaves:
        t.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out, saved = saved_bytes(lambda: layer(x, ids, tw, w1, w2), exclude=[x])
    out.backward(dout)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    for t in leaves:
        t.grad = None
    return ms, saved, peak


def agreement(impls, inputs, dout):
    """Relative error of moeblaze's out and dx against the conventional layer (a bf16 sanity check)."""
    x, ids, tw, w1, w2 = inputs
    res = []
    for layer in (impls["moeblaze"], impls["torch"]):
        out = layer(x, ids, tw, w1, w2)
        (dx,) = torch.autograd.grad(out, [x], dout)
        res.append((out.detach().float(), dx.float()))
        del out
    (o1, g1), (o2, g2) = res
    return float((o1 - o2).norm() / o2.norm()), float((g1 - g2).norm() / g2.norm())


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma list of {', '.join(CONFIGS)}")
    p.add_argument("--impls", default="moeblaze,torch", help="comma list of moeblaze, torch")
    p.add_argument("--save", default="preact", choices=["preact", "input"])
    p.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    p.add_argument("--rep-ms", type=int, default=300, help="do_bench measuring time per cell (ms)")
    p.add_argument("--out", default=None, help="CSV file to write")
    p.add_argument("--no-check", dest="check", action="store_false",
                   help="skip the relative-error check of moeblaze against the conventional layer")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_experts.py needs a CUDA GPU")
    names = [c for c in args.configs.split(",") if c]
    unknown = [c for c in names if c not in CONFIGS]
    if unknown:
        sys.exit(f"unknown configs {unknown}; known: {list(CONFIGS)}")
    impls = {"moeblaze": moeblaze_layer(args.save), "torch": conventional_layer}
    device = torch.cuda.get_device_name()
    stamp = datetime.datetime.now().isoformat(timespec="seconds")
    rows = []
    print(f"# {device}, torch {torch.__version__}, {stamp}, {args.dtype}, save={args.save}, router excluded")
    print(f"{'config':<10} {'impl':<9} {'ms':>8} {'TFLOP/s':>8} {'saved MiB':>10} {'peak MiB':>9}  note")
    for name in names:
        T, d, h, E, K = CONFIGS[name]
        flops = 18 * T * K * d * h
        for impl in args.impls.split(","):
            row = {"config": name, "impl": impl, "T": T, "d": d, "h": h, "E": E, "K": K, "dtype": args.dtype,
                   "save": args.save if impl == "moeblaze" else "", "device": device, "date": stamp,
                   "ms": "", "tflops": "", "saved_mib": "", "peak_mib": "", "note": ""}
            try:
                inputs = make_inputs(T, d, h, E, K, DTYPES[args.dtype])
                dout = torch.randn(T, d, device="cuda", dtype=DTYPES[args.dtype])
                if impl == "moeblaze" and args.check and "torch" in impls:
                    err_out, err_dx = agreement(impls, inputs, dout)
                    row["note"] = f"vs torch: out {err_out:.1e} dx {err_dx:.1e}"
                    torch.cuda.empty_cache()
                ms, saved, peak = measure(impls[impl], inputs, dout, args.rep_ms)
                row.update(ms=f"{ms:.3f}", tflops=f"{flops / ms / 1e9:.1f}", saved_mib=f"{saved / 2**20:.0f}",
                           peak_mib=f"{peak / 2**20:.0f}")
            except torch.cuda.OutOfMemoryError:
                row["note"] = (row["note"] + "; OOM").lstrip("; ")
            except Exception as exc:  # record and go on: one broken cell must not lose the table
                row["note"] = (row["note"] + f"; error: {type(exc).__name__}: {str(exc)[:160]}").lstrip("; ")
            inputs = dout = None
            torch.cuda.empty_cache()
            rows.append(row)
            print(f"{name:<10} {impl:<9} {row['ms']:>8} {row['tflops']:>8} {row['saved_mib']:>10} "
                  f"{row['peak_mib']:>9}  {row['note']}", flush=True)
    if args.out:
        with open(args.out, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    by = {(r["config"], r["impl"]): r for r in rows}
    for name in names:
        a, b = by.get((name, "moeblaze")), by.get((name, "torch"))
        if a and b and a["ms"] and b["ms"]:
            print(f"{name}: moeblaze speed-up over conventional {float(b['ms']) / float(a['ms']):.2f}x")


if __name__ == "__main__":
    main()
