#!/usr/bin/env bash
# Issue 24 on one GPU, in at most ~9.5 minutes (BUDGET): the gpu tests of CUDA-graph capture and of the
# small-T bucket (every failure printed), the expert-kernel regressions, a cProfile of one eager layer step's
# host path and the host cost of each of its parts (bench_host.py --parts), then the model-shaped sweep (rows
# appended as they come, so a cut run keeps what it measured).
#   bash benchmarks/gpu_issue24.sh                    # everything, writes under $RESULTS (default /tmp/issue24)
#   PART="parts sweep" bash benchmarks/gpu_issue24.sh  # any of: tests (the gpu tests), parts (cProfile and
#                                                     # --parts), wgrad (the weight gradients timed with
#                                                     # every tuned config), sweep; PART=all: all four
#   SHAPES=qwen3-30b-a3b,olmoe-1b-7b ...              # the sweep's shapes (default: those two and deepseek-v3)
#   BUDGET=300 ...                                    # seconds the script may take (default 560)
#   COMMIT=abc1234 ...                                # the code version the rows record (git's HEAD otherwise)
set -u
RESULTS=${RESULTS:-/tmp/issue24}
mkdir -p "$RESULTS"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
start=$(date +%s)
left() { echo $(( ${BUDGET:-560} - ($(date +%s) - start) )); }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$RESULTS/device.txt"
PART=${PART:-all}
[ "$PART" = all ] && PART="tests parts wgrad sweep"
has() { [[ " $PART " == *" $1 "* ]]; }

if has tests; then
echo "== capture + small-T gpu tests"
timeout 240 python3 -m pytest -q -m gpu -rf tests/test_graphs.py tests/test_small_tokens.py 2>&1 | tee "$RESULTS/tests.log" | tail -40
echo "== regressions (expert kernels, layer, routing)"
timeout $(( $(left) > 150 ? 150 : $(left) )) python3 -m pytest -q -m gpu -rf tests/test_experts_triton.py tests/test_layer.py \
    tests/test_routing.py 2>&1 | tee "$RESULTS/regress.log" | tail -15
fi

if has parts; then
# fixed kernel configs: host time does not depend on them, and autotuning every shape and T took the whole
# minute of the profile and cut --parts short (H100)
echo "== host path of one eager layer step (qwen3-30b-a3b, T 4096), cProfile"
MOEBLAZE_AUTOTUNE=0 timeout 60 python3 benchmarks/bench_host.py --shapes qwen3-30b-a3b --tokens 4096 --steps 20 \
    --profile 35 2>&1 | tee "$RESULTS/profile.txt" | tail -45
echo "== host µs per call of each part of a layer step (a launch, an ATen op, the router's GEMMs and backward, ...)"
MOEBLAZE_AUTOTUNE=0 timeout 120 python3 benchmarks/bench_host.py --parts --shapes qwen3-30b-a3b,olmoe-1b-7b \
    --tokens 512,4096 2>&1 | tee "$RESULTS/parts.txt"
fi

if has wgrad; then
echo "== the weight gradients B2, B4 replayed with every tuned config (few and many slots per expert)"
for T in 2048 32768; do
    timeout 150 python3 benchmarks/profile_kernels.py --configs qwen3-30b-a3b \
        --tokens $T --all-configs B2,B4 2>&1 | tee "$RESULTS/wgrad-$T.txt" | grep -v "^      " | tail -25
done
fi

has sweep || exit 0
# L=8 stacks (deepseek-v3: one layer), eager and graph-replayed; moeblaze, the conventional layer and SonicMoE
# (autotuned; its first step compiles, with QuACK's kernel cache from .peers/ as scripts/gpu_suite.sh bench
# does) side by side per shape
source scripts/quack_cache.sh
sonic_peers
sweep() {  # shape impls: rows appended to $RESULTS/results-stack.csv as they are measured
    t=$(left); [ "$t" -lt 20 ] && return
    echo "== sweep $1: $2 ($t s left)"
    timeout "$t" python3 benchmarks/bench_host.py --shapes "$1" --stack 8 --tokens 2048,4096,8192,16384,32768 \
        --impls "$2" --graph --steps 10 --csv "$RESULTS/results-stack.csv" ${COMMIT:+--commit "$COMMIT"} 2>&1 | grep -v "^ " | tail -20
}
for shape in $(echo "${SHAPES:-qwen3-30b-a3b,olmoe-1b-7b,deepseek-v3}" | tr , ' '); do
    case $shape in deepseek-v3) sweep "$shape" moeblaze,conventional ;; *) sweep "$shape" sonicmoe,moeblaze,conventional ;; esac
done
save_quack_cache "$RESULTS"
python3 benchmarks/bench_host.py --plot-from "$RESULTS/results-stack.csv" --plot "$RESULTS/stack-time-per-token.png" 2>&1 | tail -3
ls -la "$RESULTS"
