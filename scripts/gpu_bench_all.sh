#!/usr/bin/env bash
# One device call: the torch.compile GPU test, then `moeblaze bench --suite all` (dispatch
# micro-benchmark, train throughput, every layer config) without SonicMoE, whose CuTe-DSL compile did
# not finish within 170 s on sonicmoe-7b (H200, 2026-11-22). Packed into $OUT/bench_all.tgz.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
W=/tmp/bench_all; mkdir -p "$W"
trap 'tar -czf "$OUT/bench_all.tgz" -C "$W" .' EXIT
timeout 90 python3 -m pytest -m gpu -q -p no:logging -p no:cacheprovider --tb=short \
  tests/test_experts_triton.py -k compile 2>&1 | grep -v DEBUG | tail -8 | tee "$W/compile_test.txt"
source .peers/install.sh /tmp/peers >/dev/null
cd "$W"
timeout "${SUITE_S:-450}" python3 -m moeblaze.cli bench --suite all --budget-s "${BUDGET_S:-380}" \
  --impls moeblaze,moeblaze-torch,conventional,hf-loop,liger --out results 2>&1 | tail -75
