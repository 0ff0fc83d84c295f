#!/usr/bin/env bash
# The whole test suite, as CI runs it: dev, ASan+UBSan and TSan suites; the installed package with
# the example consumer; the fuzz targets for a bounded time; the default job (kNN on Fashion-MNIST)
# checked against an fp64 loop; and, where nvcc exists, the cuda build.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
PATH="$("$root/tools/setup.sh"):$PATH"
export PATH
fuzz_seconds="${GPUPOOL_FUZZ_SECONDS:-60}"
started=$(date +%s)
step() { echo; echo "=== $* ($(( $(date +%s) - started )) s) ==="; }

for preset in dev asan tsan; do
  step "suite: $preset"
  cmake --workflow --preset "$preset"
done

step "installed package + example consumer"
cmake --install build/dev --prefix "$root/build/install" >/dev/null
cmake -S examples/consumer -B build/consumer -G Ninja -DCMAKE_BUILD_TYPE=Debug \
  -DCMAKE_CXX_COMPILER=clang++-19 -DCMAKE_CXX_COMPILER_CLANG_SCAN_DEPS=clang-scan-deps-19 \
  -DCMAKE_PREFIX_PATH="$root/build/install" >/dev/null
cmake --build build/consumer
build/consumer/gpupool_consumer

# Runs one fuzz target for fuzz_seconds on its corpus: the run's figures (the target prints its
# operations and their rate), or the end of its log when it fails.
run_fuzzer() {
  local target="$1" name log flags=()
  name=$(basename "$target")
  mkdir -p "build/fuzz-corpus/$name"
  log="build/fuzz-corpus/$name.log"
  if [ -f "fuzz/$name.options" ]; then mapfile -t flags < <(grep -v '^#' "fuzz/$name.options"); fi
  # timeout: a crash report under TSan can deadlock in libFuzzer's death callback.
  if timeout $((fuzz_seconds + 120)) "$target" -max_total_time="$fuzz_seconds" -print_final_stats=1 \
       "${flags[@]}" "build/fuzz-corpus/$name" "fuzz/corpus/$name" >"$log" 2>&1; then
    grep -E "^(Done|stat::number_of_executed_units|$name:)" "$log" || true
  else
    tail -n 80 "$log"
    echo "$name failed (log: $log)"
    return 1
  fi
}

if [ -d fuzz ] && ls fuzz/*.cpp >/dev/null 2>&1; then
  step "fuzz targets, ASan + UBSan (${fuzz_seconds} s each)"
  cmake --workflow --preset fuzz
  for target in build/fuzz/fuzz/fuzz_*; do
    if [ -x "$target" ]; then run_fuzzer "$target"; fi
  done
  step "threaded pool fuzz target, TSan (${fuzz_seconds} s)"
  cmake --workflow --preset fuzz-tsan
  TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1" run_fuzzer build/fuzz-tsan/fuzz/fuzz_pool_threads
fi

step "default job: gpupool knn on Fashion-MNIST (release), checked against an fp64 loop"
cmake --preset release >/dev/null
cmake --build --preset release --target gpupool_cli
rm -rf build/default-run && mkdir -p build/default-run
(cd build/default-run && ../release/tools/gpupool)
GPUPOOL_KNN_DEFAULT_PREFIX="$root/build/default-run/out/fashion-mnist.l2.k100" \
  build/dev/tests/gpupool_tests "[default-run]"

if command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then
  step "cuda preset build (sm_90a + PTX)"
  cmake --workflow --preset cuda
fi
step "all suites passed"
