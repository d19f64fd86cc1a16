#!/usr/bin/env bash
# One device call: the torch.compile GPU test, SonicMoE side by side on sonicmoe-7b (hard time limit,
# its CuTe-DSL compile can run for minutes), then `moeblaze bench` on the model,
# paper (SwiGLU) and poster-sweep configs without SonicMoE.
# Everything is packed into $OUT/bench.tgz (the device tool brings back at most 8 files).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
W=/tmp/bench_work; mkdir -p "$W"
trap 'tar -czf "$OUT/bench.tgz" -C "$W" .' EXIT
timeout 90 python3 -m pytest -m gpu -q -p no:logging -p no:cacheprovider --tb=short \
  tests/test_experts_triton.py -k compile 2>&1 | grep -v DEBUG | tail -25 | tee "$W/compile_test.txt"
source .peers/install.sh /tmp/peers >/dev/null
cd "$W"
timeout "${SONIC_S:-170}" python3 -m moeblaze.cli bench --configs sonicmoe-7b \
  --impls moeblaze,conventional,sonicmoe --out sonic 2>&1 | tail -12
timeout "${SUITE_S:-330}" python3 -m moeblaze.cli bench --budget-s "${BUDGET_S:-290}" \
  --configs "sonicmoe-7b,olmoe-1b-7b,qwen3-30b-a3b,gpt-oss-20b,conf*-swiglu,sweep-*" \
  --impls moeblaze,conventional,liger --out results 2>&1 | tail -60
