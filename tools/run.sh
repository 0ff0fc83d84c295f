#!/usr/bin/env bash
# The main job: builds the gpupool command (release preset, CUDA when nvcc and a GPU are there)
# and runs it with the given arguments (none: the default job).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
PATH="$("$root/tools/setup.sh"):$PATH"
preset=release
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
  preset=cuda
fi
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
if ! { cmake --preset "$preset" && cmake --build --preset "$preset" --target gpupool_cli; } >"$log" 2>&1; then
  cat "$log" >&2
  echo "run.sh: building the gpupool command failed (log above)" >&2
  exit 1
fi
"build/$preset/tools/gpupool" "$@"
