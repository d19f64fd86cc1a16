#!/usr/bin/env bash
# Multi-GPU scaling of `moeblaze train --preset 1b` and the expert-parallel layer (benchmarks/bench_ep.py), with
# each run's step breakdown (compute, communication, exposed communication, device idle, host syncs).
#
#   RESULTS=dir RUNS="1 fsdp2 fsdp4 ep4" STEPS=40 PROFILE=5 bash benchmarks/multigpu.sh train
#   RESULTS=dir EP_WORLDS="2 4" bash benchmarks/multigpu.sh ep
#
# RUNS names runs: `1` (one GPU under torchrun --fsdp), `fsdpN` (N GPUs, FSDP2), `epP` (P GPUs, FSDP2 + --ep P),
# `epP-N` (N GPUs, --ep P: a 2-D mesh); they run in the order given, so alternating them (`1 fsdp4 1 fsdp4`) shows
# the spread. Each writes its log, metrics.csv and breakdown.csv under RESULTS/<run>-<i>/ and one line of
# RESULTS/train.csv. A run's options follow its name after "+" (the 1b preset keeps the gathered parameters until
# the backward and reduces in bf16): `uN` --fsdp-blocks-per-unit N, `r` --fsdp-reshard, `fp32` --fsdp-reduce-dtype
# fp32, `np` --no-fsdp-prefetch, `c` --compile (`RUNS="fsdp2 fsdp2+u2 fsdp2+c"`). EXTRA adds flags to every train run.
# NVLink multicast stays off.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
RESULTS=${RESULTS:?set RESULTS to a folder for the logs and CSVs}
mkdir -p "$RESULTS"
STEPS=${STEPS:-40}
PROFILE=${PROFILE:-5}
EXTRA=${EXTRA:-}
if compgen -G ".whl/*.whl" > /dev/null; then  # the peers' wheels (torchtitan and what it needs), where present
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi

train_run() {  # $1 run name, $2 index
  local name=$1 i=$2 gpus ep=1 flags="" opt base=${1%%+*}
  for opt in $(echo "$name" | tr '+' ' ' | cut -s -d' ' -f2-); do  # name+u2+r: this run's options
    case $opt in
      u[0-9]*) flags="$flags --fsdp-blocks-per-unit ${opt#u}" ;;
      r) flags="$flags --fsdp-reshard" ;;
      np) flags="$flags --no-fsdp-prefetch" ;;
      fp32) flags="$flags --fsdp-reduce-dtype fp32" ;;
      c) flags="$flags --compile" ;;
      *) echo "unknown option $opt of run $name"; return 1 ;;
    esac
  done
  case $base in
    1) gpus=1 ;;
    fsdp*) gpus=${base#fsdp} ;;
    ep*-*) ep=${base#ep}; gpus=${ep#*-}; ep=${ep%-*} ;;
    ep*) ep=${base#ep}; gpus=$ep ;;
    *) echo "unknown run $name"; return 1 ;;
  esac
  local dir="$RESULTS/${name//+/_}-$i"
  rm -rf "$dir"
  local cmd="torchrun --nproc-per-node $gpus -m moeblaze.cli train --fsdp --preset 1b --batch-size $((16 * gpus)) --no-final-checkpoint
    --steps $STEPS --warmup-steps 5 --eval-interval 100000 --eval-tokens 16384 --checkpoint-interval 0
    --checkpoint-minutes 0 --device cuda --no-progress --ep $ep --profile-steps $PROFILE --out-dir $dir$flags $EXTRA"
  echo "== $name ($i): $cmd"
  timeout 900 $cmd > "$dir.log" 2>&1
  local rc=$?
  grep -E "profiled|steady state|Error|error:" "$dir.log" | tail -4
  local steady
  steady=$(grep -oE "[0-9,]+ tokens/s per GPU" "$dir.log" | tail -1 | tr -d ',' | cut -d' ' -f1)
  echo "$(date +%F),$name,$i,$gpus,$ep,$STEPS,${steady:-},$rc,\"$(echo $cmd | tr -s ' ')\"" >> "$RESULTS/train.csv"
}

case ${1:-train} in
  train)
    [ -f "$RESULTS/train.csv" ] || echo "date,run,index,gpus,ep,steps,steady_tokens_per_s_per_gpu,rc,command" \
      > "$RESULTS/train.csv"
    i=0
    for run in ${RUNS:-1 fsdp2 fsdp4 ep4}; do
      i=$((i + 1))
      train_run "$run" "$i"
    done ;;
  ep)
    for w in ${EP_WORLDS:-2 4}; do
      echo "== bench_ep on $w GPUs"
      timeout "${EP_TIMEOUT:-900}" torchrun --nproc-per-node "$w" benchmarks/bench_ep.py --out "$RESULTS/ep.csv" \
        --breakdown "$PROFILE" ${EP_FLAGS:-} 2>&1 | tee "$RESULTS/ep-$w.log" | grep -vE "^\s*$" | tail -8
    done ;;
  tests)
    last=$(( $(nvidia-smi -L | wc -l) - 1 ))
    ( CUDA_VISIBLE_DEVICES=$last timeout "${GPU_TESTS_TIMEOUT:-240}" python3 -m pytest -q -m gpu -p no:cacheprovider \
        -rfEs ${GPU_TESTS:-tests/test_balance.py tests/test_deterministic.py} > "$RESULTS/gpu_tests.log" 2>&1 ) &
    timeout "${MG_TESTS_TIMEOUT:-300}" python3 -m pytest -q -m multigpu -p no:cacheprovider -rfEs \
      ${MG_TESTS:-tests/test_ep_exchange.py} > "$RESULTS/multigpu_tests.log" 2>&1
    wait
    tail -n 4 "$RESULTS/multigpu_tests.log" "$RESULTS/gpu_tests.log" ;;
  *) echo "usage: bash benchmarks/multigpu.sh train|ep|tests"; exit 2 ;;
esac
