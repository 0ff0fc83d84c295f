#!/usr/bin/env bash
# Runs ON the GPU machine, from the repository root, with the binaries that tools/build-gpu-bin.sh
# gathered into gpu-bin/ (it builds nothing: that machine has no clang). Steps:
#   gpu          nvidia-smi's name of the GPU
#   gpu tests    gpupool_tests "[gpu]~[long]"
#   gpu tests, long
#                gpupool_tests "[gpu][long]" (the kernel cases that sweep many shapes)
#   gpu tests mma the kernel tests again with GPUPOOL_WGMMA=0 (the mma.sync kernels where wgmma
#                ones would run; the switch changes nothing else)
#   memcheck     each [gpu] test case on its own under compute-sanitizer --tool memcheck (if
#                installed), at most GPU_CHECK_SANITIZER_CASE_SECONDS a case (default 150) and
#                GPU_CHECK_SANITIZER_SECONDS in all (default 540), the cases of the test spec
#                GPU_CHECK_SANITIZER_SPEC (default [gpu]; the GPU_CHECK_MEMCHECK_* names still
#                work); fails on a memory error or a failed case, and says which cases the time
#                cut short or left out
#   racecheck, synccheck, initcheck
#                the same with compute-sanitizer's other tools (shared-memory races, invalid
#                synchronisation, reads of uninitialised device memory), each only when
#                GPU_CHECK_STEPS names it
#   pool_bench, kernel_bench, batching_bench, matrix_traffic_bench, read_floor_bench
#                gpu-bin/<bench> (if built); with GPU_CHECK_JSON=1
#                also --json $OUT/<bench>.json (the device tool returns at most 8 files)
#   peers        python3 bench/peers/*.py, torch_knn.py first (issue 4's peer), at most
#                GPU_CHECK_PEERS_SECONDS each, default 240; PyTorch is installed there
# GPU_CHECK_STEPS=tests, =long, =mma, =memcheck, =racecheck, =synccheck, =initcheck or =benchmarks runs
# one part of these (see below).
# Each step prints its seconds as it ends, so a run cut off at the device tool's 600 s still
# says where its time went.
# and a table with one row per step: pass, FAIL or absent, and seconds. Output goes to $OUT too
# when it is set (the device tool's folder of files that come back). Exits non-zero if a step
# failed or the test binary is missing.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bin="gpu-bin"
# gpu-bin/lib (libfmt, ...), then the machine's CUDA 13 toolkit (cuBLAS; cudart is static).
libpath="$root/$bin/lib"
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
  [ -d "$d" ] && libpath="$libpath:$d"
done
export LD_LIBRARY_PATH="$libpath${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# Libraries still not found (no toolkit copy of cuBLAS, say): look in python3's pip CUDA packages
# (PyTorch's nvidia-* wheels), the same libraries of the same CUDA major version.
find_missing_libs() {
  local exe missing lib dir sites
  for exe in "$bin"/*; do
    [ -f "$exe" ] && [ -x "$exe" ] || continue
    missing=$(ldd "$exe" 2>/dev/null | awk '/not found/ { print $1 }')
    [ -n "$missing" ] || continue
    sites=$(python3 -c 'import site; print(" ".join(site.getsitepackages()))' 2>/dev/null) || sites=""
    for lib in $missing; do
      dir=$(find $sites -path '*nvidia*' -name "$lib" -printf '%h\n' 2>/dev/null | head -n 1)
      if [ -n "$dir" ]; then
        LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$dir"
        echo "gpu-check: $lib from $dir"
      else
        echo "gpu-check: $exe needs $lib, which is nowhere here" >&2
      fi
    done
  done
  export LD_LIBRARY_PATH
}
find_missing_libs
out="${OUT:-}"
[ -n "$out" ] && mkdir -p "$out"

names=() states=() times=()
# GPU_CHECK_STEPS: all (default: tests, long, mma, memcheck, benchmarks), tests (the [gpu] tests
# but the [long] ones), long (the three [long] kernel cases, each sweeping many shapes against an
# fp64 reference), mma (the kernel tests with GPUPOOL_WGMMA=0), memcheck, racecheck, synccheck,
# initcheck, or benchmarks (the benchmarks and peers). Each part fits the device tool's 10 minutes
# a command; together they do not (on an H200 the whole [gpu] suite took 535 s, of which the
# [long] cases 337 s, and memcheck of the whole suite outlasts 600 s), so a check there takes a
# call a part.
steps="${GPU_CHECK_STEPS:-all}"
case "$steps" in all | tests | long | mma | memcheck | racecheck | synccheck | initcheck | benchmarks) ;; *)
  echo "gpu-check: GPU_CHECK_STEPS=$steps; expected all, tests, long, mma, memcheck, racecheck," \
    "synccheck, initcheck or benchmarks" >&2
  exit 2 ;;
esac
wants() { [ "$steps" = all ] || [ "$steps" = "$1" ]; }
failed=0
now() { date +%s.%N; }

# step NAME LOGFILE COMMAND...: runs the command, its output on the terminal and in $OUT/LOGFILE.
step() {
  local name="$1" log="$2"; shift 2
  echo
  echo "=== $name: $* ==="
  local start rc
  start=$(now)
  if [ -n "$out" ] && [ -n "$log" ]; then
    "$@" 2>&1 | tee "$out/$log"
    rc=${PIPESTATUS[0]}
  else
    "$@" 2>&1
    rc=$?
  fi
  record "$name" "$([ "$rc" -eq 0 ] && echo pass || echo "FAIL ($rc)")" "$start"
  [ "$rc" -eq 0 ] || failed=1
}

# record NAME STATE [START]: also prints the step's seconds.
record() {
  names+=("$1") states+=("$2")
  if [ -n "${3:-}" ]; then
    times+=("$(awk -v a="$3" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }')")
    echo "--- $1: $2 in ${times[-1]} s"
  else
    times+=("-")
  fi
}

absent() { echo; echo "=== $1: absent ($2) ==="; record "$1" absent; }

# A benchmark's table goes to the terminal and $OUT/NAME.txt, its rows to $OUT/NAME.json
# (benchmarks take --json FILE); at most GPU_CHECK_BENCH_SECONDS (default 240) each.
bench() {
  local name="$1" exe="$bin/$1"
  if [ ! -x "$exe" ]; then absent "$name" "no $exe"; return; fi
  echo
  echo "=== $name: $exe ==="
  local start rc limit="${GPU_CHECK_BENCH_SECONDS:-240}"
  start=$(now)
  local json=()
  [ "${GPU_CHECK_JSON:-0}" = 1 ] && [ -n "$out" ] && json=(--json "$out/$name.json")
  if [ -n "$out" ]; then
    timeout "$limit" "$exe" "${json[@]}" 2>&1 | tee "$out/$name.txt"
    rc=${PIPESTATUS[0]}
  else
    timeout "$limit" "$exe"
    rc=$?
  fi
  record "$name" "$([ "$rc" -eq 0 ] && echo pass || echo "FAIL ($rc)")" "$start"
  [ "$rc" -eq 0 ] || failed=1
}

gpu_name() { nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader; }

# --- steps ---------------------------------------------------------------------------------------
if command -v nvidia-smi >/dev/null 2>&1; then
  step "gpu" "" gpu_name
else
  absent "gpu" "no nvidia-smi"
fi

[ -f "$bin/MANIFEST" ] && { echo; echo "=== gpu-bin/MANIFEST ==="; cat "$bin/MANIFEST"; }

tests="$bin/gpupool_tests"
if wants tests; then
  if [ -x "$tests" ]; then
    step "gpu tests" "gpu-tests.txt" "$tests" "[gpu]~[long]" -r compact
  else
    absent "gpu tests" "no $tests: run tools/build-gpu-bin.sh where the build works, carry gpu-bin"
    failed=1
  fi
fi

if wants long && [ -x "$tests" ]; then
  step "gpu tests, long" "gpu-tests-long.txt" "$tests" "[gpu][long]" -r compact
fi

if wants mma && [ -x "$tests" ]; then
  # The kernel tests with the resident (wgmma) kernels switched off, so that the mma.sync kernels
  # they replace on this GPU stay tested for the shapes where the dispatch rules pick the wgmma ones.
  step "gpu tests mma" "gpu-tests-mma.txt" env GPUPOOL_WGMMA=0 "$tests" "[gpu][kernels]" -r compact
elif wants mma; then
  absent "gpu tests mma" "no $tests"
  failed=1
fi

# sanitizer_cases SANITIZER TOOL: every case of the test spec under compute-sanitizer's TOOL
# (memcheck, racecheck, synccheck, initcheck), one run a case (a case's name is its test spec,
# commas escaped), each bounded, all within the step's time. API errors are not reported: the
# tests provoke some on purpose (out-of-memory, double free) and check them themselves. A hazard
# the tool counts as an error, or a failed case, fails the step; racecheck's warnings (possible
# hazards it cannot prove) are counted, not failed.
sanitizer_cases() {
  local sanitizer="$1" tool="$2" total="${GPU_CHECK_SANITIZER_SECONDS:-${GPU_CHECK_MEMCHECK_SECONDS:-540}}"
  local per="${GPU_CHECK_SANITIZER_CASE_SECONDS:-${GPU_CHECK_MEMCHECK_CASE_SECONDS:-150}}"
  # initcheck makes an event query wait for its event: cases that watch a stream held back by
  # host work ([blocking]) would wait out their gate, so it leaves them out by default.
  local default_spec="[gpu]"
  [ "$tool" = initcheck ] && default_spec="[gpu]~[blocking]"
  local spec="${GPU_CHECK_SANITIZER_SPEC:-${GPU_CHECK_MEMCHECK_SPEC:-$default_spec}}"
  local start name rc left limit log errors
  local clean=0 bad=0 cut=0 skipped=0
  start=$(date +%s)
  log=$(mktemp)
  while IFS= read -r name; do
    [ -n "$name" ] || continue
    left=$((total - ($(date +%s) - start)))
    if [ "$left" -lt 10 ]; then
      echo "not run (no time left): $name"
      skipped=$((skipped + 1))
      continue
    fi
    limit=$per
    [ "$left" -lt "$limit" ] && limit=$left
    timeout "$limit" "$sanitizer" --tool "$tool" --report-api-errors no --error-exitcode 86 \
      "$tests" "${name//,/\\,}" -r compact >"$log" 2>&1
    rc=$?
    errors=0
    # The tool's own lines only (a test's message may say "cudaErrorInvalidValue").
    grep -qE "^========= (Invalid|.*ERROR SUMMARY: [1-9]|.*\(([1-9][0-9]*) errors?,)" "$log" && errors=1
    if [ "$errors" -eq 1 ] || { [ "$rc" -ne 0 ] && [ "$rc" -ne 124 ]; }; then
      echo "FAIL ($rc): $name"
      tail -n 20 "$log"
      bad=$((bad + 1))
    elif [ "$rc" -eq 124 ]; then
      echo "cut at ${limit} s, no error until then: $name"
      cut=$((cut + 1))
    else
      echo "clean: $name $(grep -oE "RACECHECK SUMMARY: .*" "$log" | head -n 1)"
      clean=$((clean + 1))
    fi
  done < <("$tests" "$spec" --list-test-names-only)
  rm -f "$log"
  echo "$tool: $clean cases clean, $bad with errors or failures, $cut cut short by time, $skipped not run"
  [ "$bad" -eq 0 ]
}

sanitizer=""
if [ -x /usr/local/cuda/bin/compute-sanitizer ]; then
  sanitizer=/usr/local/cuda/bin/compute-sanitizer
elif command -v compute-sanitizer >/dev/null 2>&1; then
  sanitizer=$(command -v compute-sanitizer)
fi
for tool in memcheck racecheck synccheck initcheck; do
  # "all" runs memcheck; the other tools run when asked for by name (each takes a call).
  if [ "$tool" = memcheck ] && wants memcheck || [ "$steps" = "$tool" ]; then
    if [ -z "$sanitizer" ]; then
      absent "$tool" "no compute-sanitizer"
    elif [ ! -x "$tests" ]; then
      absent "$tool" "no $tests"
      failed=1
    else
      step "$tool" "$tool.txt" sanitizer_cases "$sanitizer" "$tool"
    fi
  fi
done

if wants benchmarks; then
  bench pool_bench
  bench kernel_bench
  bench batching_bench
  bench matrix_traffic_bench
  bench read_floor_bench

  shopt -s nullglob
  peers=(bench/peers/torch_knn.py bench/peers/*.py)
  shopt -u nullglob
  declare -A seen_peer=()
  unique=()
  for script in "${peers[@]}"; do
    [ -f "$script" ] && [ -z "${seen_peer[$script]:-}" ] && unique+=("$script") && seen_peer[$script]=1
  done
  peers=("${unique[@]}")
  if ((${#peers[@]})); then
    run_peers() {
      local rc=0 script
      for script in "${peers[@]}"; do
        echo "--- python3 $script"
        PYTHONUNBUFFERED=1 timeout "${GPU_CHECK_PEERS_SECONDS:-240}" python3 "$script" ||
          { echo "--- $script failed ($?)"; rc=1; }
      done
      return "$rc"
    }
    step "peers" "peers.txt" run_peers
  else
    absent "peers" "no bench/peers/*.py"
  fi
fi  # benchmarks

# --- summary -------------------------------------------------------------------------------------
summary() {
  echo
  printf '%-14s %-10s %9s\n' step result seconds
  printf '%-14s %-10s %9s\n' -------------- ---------- ---------
  local i
  for i in "${!names[@]}"; do
    printf '%-14s %-10s %9s\n' "${names[$i]}" "${states[$i]}" "${times[$i]}"
  done
  echo
  if ((failed)); then echo "gpu-check: FAILED"; else echo "gpu-check: all steps that ran passed"; fi
}
if [ -n "$out" ]; then summary | tee "$out/summary.txt"; else summary; fi
exit "$failed"
