#!/usr/bin/env bash
# pool_on_quiet_core.sh POOL_BENCH [ARGS...]: runs the pool benchmark pinned to the core whose core
# check is fastest right now.
#
# Why: on a GPU host shared with other tenants, a core's other hardware thread may be busy with
# work outside this machine; a single-thread row (pair, trace) then runs up to twice as slow, and
# the core check (pool_bench --core-check) shows the same slowdown. Picking the core with the
# fastest check just before the run measures the allocator, not its neighbour. Each row still
# prints the check measured just before it, so a row that ran on a core that turned busy shows.
#
#   bench/pool_on_quiet_core.sh gpu-bin/pool_bench --only pair --quick
set -euo pipefail
if [ $# -lt 1 ] || [ ! -x "$1" ]; then
  echo "usage: $0 POOL_BENCH [ARGS...] (POOL_BENCH: the pool_bench executable)" >&2
  exit 2
fi
bench="$1"; shift
best_core=""; best_ns=""
for core in $(taskset -pc $$ | sed 's/.*: //' | tr ',' '\n' | while IFS=- read -r a b; do seq "$a" "${b:-$a}"; done); do
  ns=$(taskset -c "$core" "$bench" --core-check | awk '{print $3}')
  if [ -z "$best_ns" ] || awk -v a="$ns" -v b="$best_ns" 'BEGIN { exit !(a < b) }'; then
    best_core=$core; best_ns=$ns
  fi
done
echo "pool_on_quiet_core: core $best_core (core check $best_ns ns)"
exec taskset -c "$best_core" "$bench" "$@"
