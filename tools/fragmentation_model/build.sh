#!/usr/bin/env bash
# Builds the fragmentation model (model.cpp) against the pool's own arena and page table: their
# module files become headers in a scratch folder. Output: ${1:-/tmp/fragmentation_model}.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
pool="$here/../../pool"
out="${1:-/tmp/fragmentation_model}"
headers="$(mktemp -d)"
trap 'rm -rf "$headers"' EXIT
as_header() {  # a module partition as a header: no module lines, its imports as includes
  { echo '#pragma once'; sed -e '/^module;/d' -e '/^module gpupool/d' "$@"; } 
}
as_header "$pool/size_classes.cppm" > "$headers/size_classes.hpp"
as_header -e 's/^import :size_classes;/#include "size_classes.hpp"/' "$pool/segment_arena.cppm" \
  > "$headers/segment_arena.hpp"
# The model keeps no physical pages: a PhysicalPage is an empty handle.
as_header -e 's/^import :device;/namespace gpupool { struct PhysicalPage {}; }/' \
  -e 's/^import :segment_arena;/#include "segment_arena.hpp"/' \
  -e 's/const SegmentArena& arena/const auto\& arena/g' "$pool/virtual_pages.cppm" \
  > "$headers/virtual_pages.hpp"
clang++-19 -std=c++23 -O2 -Wall -Wextra -I"$headers" -o "$out" "$here/model.cpp"
echo "$out"
