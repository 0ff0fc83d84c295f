#!/usr/bin/env bash
# Builds the CUDA preset HERE (the GPU machine has no clang, so nothing is built there) and gathers
# what tools/gpu-check.sh runs into gpu-bin/ (git-ignored), to be carried to the GPU machine:
#   gpu-bin/gpupool_tests        the test binary (with the [gpu] suites)
#   gpu-bin/<bench>              every benchmark executable of build/cuda/bench
#   gpu-bin/gpupool              the command line tool
#   gpu-bin/data/                Fashion-MNIST's images, for the knn job on the GPU
#   gpu-bin/lib/                 shared libraries the binaries need beyond the base system and
#                                the CUDA toolkit (libfmt, ...); gpu-check.sh puts it on
#                                LD_LIBRARY_PATH
#   gpu-bin/MANIFEST             what was built, from which commit, when
# cudart is linked statically; libc, libstdc++, the CUDA driver and the CUDA toolkit's shared
# libraries (cuBLAS) come from the GPU machine.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
PATH="$("$root/tools/setup.sh"):$PATH"
export PATH

cmake --preset cuda
cmake --build --preset cuda -j2

out="$root/gpu-bin"
rm -rf "$out"
mkdir -p "$out/lib"

binaries=()
add() {  # add FILE: copy an executable into gpu-bin/, without its symbol tables (a quarter of the
         # size: the carried tree is capped at 64 MiB)
  cp "$1" "$out/"
  strip --strip-unneeded "$out/$(basename "$1")"
  binaries+=("$out/$(basename "$1")")
}
is_elf_executable() { [ -f "$1" ] && [ -x "$1" ] && [ "$(head -c 4 "$1" | od -An -c | tr -d ' ')" = "177ELF" ]; }

[ -x build/cuda/tests/gpupool_tests ] && add build/cuda/tests/gpupool_tests
if [ -d build/cuda/bench ]; then
  while IFS= read -r -d '' f; do
    is_elf_executable "$f" && add "$f"
  done < <(find build/cuda/bench -maxdepth 1 -type f -print0 | sort -z)
fi
[ -x build/cuda/tools/gpupool ] && add build/cuda/tools/gpupool

# The default job's data (Debian's dataset-fashion-mnist) for bench/peers/knn_job.py, ~30 MiB.
fashion=/usr/share/datasets/fashion-mnist
if [ -f "$fashion/train-images-idx3-ubyte.gz" ]; then
  mkdir -p "$out/data"
  cp "$fashion"/train-images-idx3-ubyte.gz "$fashion"/t10k-images-idx3-ubyte.gz "$out/data/"
fi

if ((${#binaries[@]} == 0)); then
  echo "build-gpu-bin: the build produced no executables (is GPUPOOL_TESTS off?)" >&2
  exit 1
fi

# Shared libraries beyond the base system: the C runtime, libstdc++/libgcc (newer on the GPU
# machine), the CUDA driver (libcuda, the machine's own) and the CUDA 13 toolkit's libraries
# (cuBLAS & co., hundreds of MiB; that machine has the same toolkit, and gpu-check.sh finds them)
# are left to the machine.
system_lib='^(linux-vdso|ld-linux|libc|libm|libdl|librt|libpthread|libstdc\+\+|libgcc_s|libcu[A-Za-z]*|libnv[A-Za-z]*)[.-]'
for bin in "${binaries[@]}"; do
  ldd "$bin" | awk '$2 == "=>" && $3 ~ /^\// { print $1, $3 }' | while read -r name path; do
    [[ "$name" =~ $system_lib ]] && continue
    [ -e "$out/lib/$name" ] || cp -L "$path" "$out/lib/$name"
  done
done

{
  echo "built:  $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -m)"
  echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD -- 2>/dev/null || echo ' (+ uncommitted changes)')"
  echo "preset: cuda ($(grep -E '^CMAKE_CUDA_ARCHITECTURES' build/cuda/CMakeCache.txt | cut -d= -f2))"
  echo "files:"
  (cd "$out" && find . -type f ! -name MANIFEST | sort | sed 's|^\./|  |')
} >"$out/MANIFEST"

size_kib=$(du -sk "$out" | cut -f1)
echo "build-gpu-bin: gpu-bin/ holds ${#binaries[@]} executable(s), $((size_kib / 1024)) MiB (${size_kib} KiB):"
sed -n '/^files:/,$p' "$out/MANIFEST" | tail -n +2
limit_kib=$((60 * 1024))
if ((size_kib > limit_kib)); then
  echo "build-gpu-bin: gpu-bin/ is over 60 MiB; the device tool carries at most 64 MiB with the tree" >&2
  exit 1
fi
