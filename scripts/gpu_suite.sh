#!/usr/bin/env bash
# The GPU suite: environment, GPU tests (bf16), dispatch and layer benchmarks.
# Usage (repo root, on a GPU host): scripts/gpu_suite.sh STAGE...   with STAGE in
#   tests      pytest -m gpu $TESTS_ARGS (gpu-marked tests, all unless TESTS_ARGS names files; fixed
#              kernel configs, MOEBLAZE_AUTOTUNE=0); TESTS_JOBS=n deals them to n pytest processes side by side;
#              TESTS_SHARD=k/n keeps the k-th of n interleaved parts of them (the whole suite, 631 tests, takes
#              more than 10 minutes in one process: most of a test is Triton compiling; H200)
#   dispatch   benchmarks/bench_dispatch.py
#   experts    benchmarks/bench_experts.py
#   bench      moeblaze bench $BENCH_ARGS (default --suite all; peers installed from .peers/ when present, QuACK's
#              kernel cache taken from .peers/quack_cache.tgz and left in $RESULTS/quack_cache.tgz)
#   precision  benchmarks/bench_precision.py $PRECISION_ARGS (AMP, fp32 TF32/IEEE, the train preset per --precision)
#   train      moeblaze train on the GPU, torch vs triton backend loss curves ($TRAIN_BACKENDS: which of the two, default both)
#   multigpu   2 GPUs: pytest -m multigpu (EP and FSDP2 equalities in bf16, NCCL; torchtitan's EP layer against
#              moeblaze's where torchtitan imports: the wheels in .whl/ go to /tmp/site), then benchmarks/bench_ep.py
#              under torchrun --nproc-per-node 2 ($EP_BENCH_ARGS, default the Qwen3-30B-A3B shape) -> ep.csv,
#              then moeblaze train --fsdp --preset 1b under torchrun on 1 GPU, 2 GPUs, 2 GPUs with --ep 2
#              (16 sequences of 1024 bytes per GPU, $TRAIN_1B_STEPS steps) -> steady tokens/s per GPU, train_1b.txt;
#              time limits per part: TESTS_TIMEOUT, EP_BENCH_TIMEOUT, TRAIN_1B_TIMEOUT (seconds, default 420, 600, 600)
#   multigpu_train  only that last part (three runs of ~1-3 min)
#   tr         benchmarks/bench_token_rounding.py speed (token rounding vs top-k vs the ceiling, SonicMoE fed the same pairs)
#   trq        benchmarks/bench_token_rounding.py quality (moeblaze train with top-k and with token rounding nr)
#   rounding   benchmarks/bench_token_rounding.py rounding (round_tokens alone: wall and GPU kernel time)
#   chunks     moeblaze bench with F2/F3 and B3/B5 in one chunk and in column chunks (setting chunk_cols off / auto, alternating,
#              fixed configs): layer time and peak at $CHUNKS_CONFIGS (default qwen3-30b-a3b,olmoe-1b-7b,sonicmoe-7b)
#              and $CHUNKS_TOKENS tokens (default 65536)
#   balance    issue 61: moeblaze train --preset 1b, $BALANCE_STEPS (1000) steps, auxiliary-loss-free (--expert-bias-rate
#              1e-3 --aux-loss-coef 0) and with the Switch loss (0.01), then benchmarks/bench_balance.py -> balance.png,
#              balance.txt and both metrics.csv (BALANCE_TIMEOUT per run, default 290 s: both runs within 10 minutes)
#   fp8        the FP8 kernels: pytest -m gpu tests/test_fp8_kernels.py tests/test_fp8.py tests/test_fp8_backward.py
#              tests/test_fp8_api.py tests/test_fp8_quant.py tests/test_fp8_baseline.py, then
#              benchmarks/bench_fp8_kernels.py $FP8_ARGS -> fp8_kernels.csv and benchmarks/bench_fp8_quant.py ->
#              fp8_quant.csv (FP8_TIMEOUT each, default 420 s)
#   fp8_ws     tests/test_ws_kernels.py -k fp8 (the Gluon FP8 kernels against the Triton ones, bitwise), then
#              benchmarks/bench_ws.py --fp8 --check at $FP8_WS_SHAPES (Qwen3-30B-A3B and OLMoE-1B-7B, T 32,768) -> ws.csv
#   fp8_train  moeblaze train --preset 1b in bf16-mixed, then fp8-mixed ($FP8_TRAIN_STEPS, default 1000; same seed
#              and batches; FP8_TRAIN_TIMEOUT per run, default 290 s), for each seed of $FP8_TRAIN_SEEDS (default 1337:
#              one run of a seed ends 2-3% from another, so a 1% comparison takes several) -> each metrics.csv,
#              fp8-training.png and fp8_train_plot.txt (moeblaze plot's table: mean and range per precision)
#   hf         benchmarks/bench_hf.py $HF_ARGS (default: the transformers Qwen3-MoE with grouped_mm, SonicMoE and
#              moeblaze, 150 steps; e.g. HF_ARGS="--impls grouped_mm,moeblaze --batch-size 32 --steps 20" for the
#              peak memory at 32 x 2048 tokens per step), SonicMoE from .peers/ with its QuACK cache
# Logs, CSVs and plots go to /tmp/gpu_out ($LOGS), packed at the end into one archive, $RESULTS/gpu_results.tgz
# (RESULTS: a folder, default ./gpu_out); the bench and hf stages leave QuACK's kernel cache beside it.
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS="${RESULTS:-./gpu_out}"
LOGS=/tmp/gpu_out
rm -rf "$LOGS"  # /tmp may hold an earlier run's files: none of them in this run's archive
mkdir -p "$LOGS" "$RESULTS"
trap 'tar -czf "$RESULTS/gpu_results.tgz" -C "$LOGS" .' EXIT
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# NVLink multicast off: a fault in it can take the host's GPUs out of service
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; date -u
} 2>&1 | tee "$LOGS/env.txt"
status=0
run() {  # run NAME CMD...: tee the output to $LOGS/NAME.txt, remember a failure
  local name=$1; shift
  echo "=== $name: $*"
  "$@" 2>&1 | tee "$LOGS/$name.txt"
  local rc=${PIPESTATUS[0]}
  echo "=== $name exit $rc"
  status=$(( status | rc ))
}
multigpu_train() {  # moeblaze train --fsdp --preset 1b on 1 and 2 GPUs under torchrun
  # issue 23's target: per-GPU tokens/s on 2 GPUs >= 90% of 1 GPU (weak scaling: the same rows per GPU)
  for spec in "1 train_1b_1gpu" "2 train_1b_2gpu" "2 train_1b_2gpu_ep2 --ep 2"; do
    read -r n name extra <<< "$spec"
    # shellcheck disable=SC2086
    run "$name" timeout "${TRAIN_1B_TIMEOUT:-600}" python3 -m torch.distributed.run --nproc-per-node "$n" -m moeblaze.cli train --fsdp \
      --preset 1b --batch-size $((16 * n)) --steps "${TRAIN_1B_STEPS:-30}" --warmup-steps 5 --eval-interval 100000 \
      --eval-tokens 16384 --checkpoint-interval 0 --checkpoint-minutes 0 --keep-checkpoints 1 --device cuda \
      --no-progress --overwrite --out-dir "/tmp/run_$name" $extra
    rm -rf "/tmp/run_$name"  # a 1B checkpoint with AdamW state is ~12.6 GB
  done
  python3 - "$LOGS" <<'PY' | tee "$LOGS/train_1b.txt"
import pathlib, re, sys
rates = {}
for f in sorted(pathlib.Path(sys.argv[1]).glob("train_1b_*.txt")):
    m = re.search(r"([\d,]+) tokens/s per GPU", f.read_text())
    rates[f.stem] = float(m.group(1).replace(",", "")) if m else None
    print(f"{f.stem}: {rates[f.stem] or 'no result'} tokens/s per GPU")
one = rates.get("train_1b_1gpu")
for name in ("train_1b_2gpu", "train_1b_2gpu_ep2"):
    if one and rates.get(name):
        print(f"{name}: {100 * rates[name] / one:.1f}% of the 1-GPU tokens/s per GPU (target >= 90%)")
PY
}
source scripts/quack_cache.sh  # sonic_peers, save_quack_cache
titan_peer() {  # torchtitan 0.3.0 for bench_ep.py and tests/test_ep_baselines.py, from the wheels in .whl/ if there
  compgen -G ".whl/torchtitan-*.whl" > /dev/null || { echo "=== no .whl/torchtitan-*.whl: torchtitan rows skipped"; return; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
}
gpu_tests_parallel() {  # the gpu tests dealt round-robin to $TESTS_JOBS pytest processes on the one GPU
  # Most of a gpu test's time is Triton compiling on the CPU (16 cores), so processes side by side finish the
  # suite in a fraction of the time of one; each gets the whole timeout.
  # shellcheck disable=SC2086
  python3 -m pytest -m gpu -q --collect-only -p no:cacheprovider ${TESTS_ARGS:-} | grep '::' > /tmp/gpu_all_ids.txt
  local k=${TESTS_SHARD%/*} n=${TESTS_SHARD#*/}
  awk -v k="$k" -v n="$n" '(NR - 1) % n == k - 1' /tmp/gpu_all_ids.txt > /tmp/gpu_ids.txt
  echo "=== gpu_tests: $(wc -l < /tmp/gpu_ids.txt) tests (shard $TESTS_SHARD) in $TESTS_JOBS processes"
  local i pids=()
  for (( i = 0; i < TESTS_JOBS; i++ )); do
    awk -v n="$TESTS_JOBS" -v i="$i" '(NR - 1) % n == i' /tmp/gpu_ids.txt > "/tmp/gpu_ids_$i.txt"
    MOEBLAZE_AUTOTUNE=0 timeout "${TESTS_TIMEOUT:-420}" xargs -a "/tmp/gpu_ids_$i.txt" -d '\n' python3 -m pytest \
      -m gpu -q -rfEs -p no:cacheprovider --durations=5 > "$LOGS/gpu_tests_$i.txt" 2>&1 &
    pids+=($!)
  done
  for (( i = 0; i < TESTS_JOBS; i++ )); do
    wait "${pids[$i]}"; local rc=$?
    echo "=== gpu_tests_$i exit $rc: $(tail -n 1 "$LOGS/gpu_tests_$i.txt")"
    status=$(( status | rc ))
  done
}
for stage in "$@"; do
  case "$stage" in
    # shellcheck disable=SC2086
    tests) if (( ${TESTS_JOBS:-1} > 1 )) || [[ -n "${TESTS_SHARD:-}" ]]; then TESTS_JOBS=${TESTS_JOBS:-1} \
          TESTS_SHARD=${TESTS_SHARD:-1/1} gpu_tests_parallel; else
          MOEBLAZE_AUTOTUNE=0 run gpu_tests timeout "${TESTS_TIMEOUT:-420}" python3 -m pytest -m gpu -q -rfEs \
          -p no:cacheprovider --durations=15 ${TESTS_ARGS:-}; fi ;;
    dispatch) run bench_dispatch python3 benchmarks/bench_dispatch.py --no-torch --out "$LOGS/dispatch.csv" ;;
    experts) run bench_experts python3 benchmarks/bench_experts.py --out "$LOGS/experts.csv" ;;
    # shellcheck disable=SC2086
    precision) run bench_precision python3 benchmarks/bench_precision.py --out "$LOGS/precision.csv" ${PRECISION_ARGS:-} ;;
    bench)  # BENCH_ARGS overrides what to run; SonicMoE is measured in a child process (--isolate auto)
      sonic_peers
      # shellcheck disable=SC2086
      run bench python3 -m moeblaze.cli bench ${BENCH_ARGS:---suite all} --out "$LOGS/bench"
      save_quack_cache "$RESULTS" ;;
    train)
      for b in ${TRAIN_BACKENDS:-torch triton}; do
        run "train_$b" timeout "${TRAIN_TIMEOUT:-600}" python3 -m moeblaze.cli train --device cuda --backend "$b" --no-progress --overwrite --out-dir "/tmp/run_$b"
      done ;;
    multigpu)
      titan_peer
      MOEBLAZE_AUTOTUNE=0 run multigpu_tests timeout "${TESTS_TIMEOUT:-420}" python3 -m pytest -m multigpu -q -rfEs \
        -p no:cacheprovider tests/test_parallel.py tests/test_train_dist.py tests/test_ep_baselines.py
      # shellcheck disable=SC2086
      run bench_ep timeout "${EP_BENCH_TIMEOUT:-600}" python3 -m torch.distributed.run --nproc-per-node 2 benchmarks/bench_ep.py ${EP_BENCH_ARGS:-} --out "$LOGS/ep.csv"
      multigpu_train
      ;;
    multigpu_train) multigpu_train ;;
    tr)  # SonicMoE's moe_general_routing_inputs row needs .peers/ (and its QuACK cache, as the bench stage)
      sonic_peers
      run bench_tr timeout "${TR_TIMEOUT:-580}" python3 benchmarks/bench_token_rounding.py speed --out "$LOGS/token_rounding.csv" ;;
    chunks)
      for spec in ${CHUNKS_SPECS:-1:off 2:auto 3:off 4:auto}; do
        run "bench_chunks_${spec/:/_}" env MOEBLAZE_CHUNK_COLS="${spec#*:}" MOEBLAZE_AUTOTUNE=0 python3 -m moeblaze.cli \
          bench --configs "${CHUNKS_CONFIGS:-qwen3-30b-a3b,olmoe-1b-7b,sonicmoe-7b}" --tokens "${CHUNKS_TOKENS:-65536}" \
          --impls moeblaze --target-s 0.5 --out "$LOGS/chunks_${spec/:/_}"
      done ;;
    fp8)
      MOEBLAZE_AUTOTUNE=0 run fp8_tests timeout "${TESTS_TIMEOUT:-420}" python3 -m pytest -m gpu -q -rfEs -p no:cacheprovider \
        tests/test_fp8_kernels.py tests/test_fp8.py tests/test_fp8_backward.py tests/test_fp8_api.py tests/test_fp8_quant.py \
        tests/test_fp8_baseline.py
      # shellcheck disable=SC2086
      run bench_fp8 timeout "${FP8_TIMEOUT:-420}" python3 benchmarks/bench_fp8_kernels.py ${FP8_ARGS:-} --out "$LOGS/fp8_kernels.csv"
      run bench_fp8_quant timeout "${FP8_TIMEOUT:-420}" python3 benchmarks/bench_fp8_quant.py --out "$LOGS/fp8_quant.csv" ;;
    fp8_ws)  # the Gluon FP8 GEMM (F2, B3): its tests, then it against the Triton kernel and the bf16 kernels
      MOEBLAZE_AUTOTUNE=0 run fp8_ws_tests timeout "${TESTS_TIMEOUT:-420}" python3 -m pytest -m gpu -q -rfEs \
        -p no:cacheprovider tests/test_ws_kernels.py -k "fp8"
      run bench_fp8_ws timeout "${FP8_TIMEOUT:-420}" python3 benchmarks/bench_ws.py --fp8 --check \
        --shapes "${FP8_WS_SHAPES:-32768:2048:768:128:8,32768:2048:1024:64:8}" --out "$LOGS/ws.csv" ;;
    rounding) run bench_rounding python3 benchmarks/bench_token_rounding.py rounding --out "$LOGS/rounding.csv" ;;
    hf)
      sonic_peers
      # shellcheck disable=SC2086
      run bench_hf timeout "${HF_TIMEOUT:-580}" python3 benchmarks/bench_hf.py ${HF_ARGS:---steps 150 --warmup 10} \
        --out "$LOGS/hf_train.csv"
      save_quack_cache "$RESULTS" ;;
    balance)
      for spec in "aux-free --expert-bias-rate 1e-3 --aux-loss-coef 0" "switch --aux-loss-type switch --aux-loss-coef 0.01"; do
        read -r name flags <<< "$spec"
        # shellcheck disable=SC2086
        run "balance_$name" timeout "${BALANCE_TIMEOUT:-290}" python3 -m moeblaze.cli train --preset 1b --device cuda \
          --steps "${BALANCE_STEPS:-1000}" --checkpoint-interval 0 --checkpoint-minutes 0 --keep-checkpoints 1 \
          --no-progress --overwrite --out-dir "/tmp/balance/$name" $flags
        cp "/tmp/balance/$name/metrics.csv" "$LOGS/balance_${name}_metrics.csv"
        rm -rf "/tmp/balance/$name/checkpoints"  # a 1B checkpoint with AdamW state is ~12.6 GB
      done
      run balance python3 benchmarks/bench_balance.py /tmp/balance/aux-free /tmp/balance/switch \
        --labels "aux-free u=1e-3" "switch 0.01" --out "$LOGS/balance.png" ;;
    trq) run tr_quality timeout "${TRAIN_TIMEOUT:-580}" python3 benchmarks/bench_token_rounding.py quality \
          --out-dir "$LOGS/tr_quality" ;;
    fp8_train)  # issue 59: the 1b preset in bf16-mixed and fp8-mixed, same seeds and batches, and the loss curves
      runs=() labels=()
      for seed in ${FP8_TRAIN_SEEDS:-1337}; do
        for precision in bf16-mixed fp8-mixed; do
          run "train_${precision}_$seed" timeout "${FP8_TRAIN_TIMEOUT:-290}" python3 -m moeblaze.cli train --preset 1b \
            --device cuda --precision "$precision" --steps "${FP8_TRAIN_STEPS:-1000}" --seed "$seed" \
            --eval-interval 250 --checkpoint-interval 0 --checkpoint-minutes 0 --no-final-checkpoint --no-progress \
            --overwrite --out-dir "/tmp/fp8_train/$precision-$seed"
          cp "/tmp/fp8_train/$precision-$seed/metrics.csv" "$LOGS/fp8_train_${precision}_${seed}_metrics.csv"
          runs+=("/tmp/fp8_train/$precision-$seed") labels+=("$precision")
        done
      done
      run fp8_train_plot python3 -m moeblaze.cli plot "${runs[@]}" --labels "$(IFS=,; echo "${labels[*]}")" \
        --out "$LOGS/fp8-training.png" ;;
    *) echo "unknown stage $stage"; status=2 ;;
  esac
done
exit "$status"
