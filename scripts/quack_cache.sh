# SonicMoE 0.1.2 from .peers/ with QuACK's kernel cache kept from one run to the next; sourced by
# scripts/gpu_suite.sh and benchmarks/gpu_issue24.sh (repo root as the working directory).
sonic_peers() {  # SonicMoE 0.1.2 from .peers/ (when present) with the QuACK kernel cache of an earlier run
  if [[ -f .peers/install.sh ]]; then source .peers/install.sh /tmp/peers >/dev/null; fi
  # SonicMoE's first step compiles for > 500 s on an empty QuACK cache (H200; 425 s on an H100,
  # benchmarks/bench_hf.py --batch-size 32): reuse the cache of an earlier run
  # (.peers/quack_cache.tgz, as save_quack_cache leaves it). One directory named for QuACK holds both its
  # compiled kernels and its autotuning results; its GEMM autotune compiles in parallel.
  export QUACK_COMPILE_WORKERS="${QUACK_COMPILE_WORKERS:-16}" QUACK_CACHE_DIR="${QUACK_CACHE_DIR:-/tmp/quack_cache}" \
    QUACK_CACHE_AUTOTUNING=1
  mkdir -p "$QUACK_CACHE_DIR"
  if [[ -f .peers/quack_cache.tgz ]]; then tar -xzf .peers/quack_cache.tgz -C "$QUACK_CACHE_DIR"; fi
}
save_quack_cache() { tar -czf "$1/quack_cache.tgz" -C "$QUACK_CACHE_DIR" .; }  # into folder $1, for the next run's .peers/
