#!/usr/bin/env bash
# GPU check of the Triton expert backend; results go to $OUT (default ./gpu_out).
# Usage: scripts/gpu_experts_check.sh [small|gpu|bench|all] [extra bench_experts.py args...]
#   small  the CPU-sized tests (fp32/fp16) on CUDA, fixed configs (MOEBLAZE_AUTOTUNE=0)
#   gpu    pytest -m gpu tests/test_experts_triton.py (bf16, autotuned, saved bytes, torch.compile)
#   bench  benchmarks/bench_experts.py (forward+backward vs the conventional grouped_mm layer)
#   e.g. scripts/gpu_experts_check.sh bench --configs sonic7b,olmoe,qwen3_30b
# Each part alone should fit a 10-minute command; "all" runs the three in a row.
set -uo pipefail
cd "$(dirname "$0")/.."
what="${1:-all}"
shift || true
OUT="${OUT:-./gpu_out}"
mkdir -p "$OUT"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true
python -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" \
  | tee "$OUT/versions.txt"
status=0
if [[ "$what" == "small" || "$what" == "all" ]]; then
  MOEBLAZE_AUTOTUNE=0 python -m pytest tests/test_experts_triton.py -m "not gpu" -q -rfEs -p no:cacheprovider \
    2>&1 | tee "$OUT/pytest_experts_small.txt"
  status=$(( status | PIPESTATUS[0] ))
fi
if [[ "$what" == "gpu" || "$what" == "all" ]]; then
  python -m pytest -m gpu tests/test_experts_triton.py -q -rfEs -p no:cacheprovider --durations=10 \
    2>&1 | tee "$OUT/pytest_experts_gpu.txt"
  status=$(( status | PIPESTATUS[0] ))
fi
if [[ "$what" == "bench" || "$what" == "all" ]]; then
  python benchmarks/bench_experts.py --out "$OUT/bench_experts.csv" "$@" 2>&1 | tee "$OUT/bench_experts.txt"
  status=$(( status | PIPESTATUS[0] ))
fi
exit "$status"
