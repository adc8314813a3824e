#!/usr/bin/env bash
# Installs what vmm builds and tests with, from Debian 12's packages (nothing else is
# downloaded): Bazel, Abseil, GoogleTest, Google Benchmark, nlohmann/json, LibTorch and
# PyTorch for the plugin's tests, clang for the sanitizer and fuzzer builds.
# The CUDA toolkit's headers are expected at $CUDA_PATH or /usr/local/cuda (no driver needed).
set -euo pipefail

packages=(
  bazel-bootstrap bazel-platforms bazel-rules-java
  g++ clang libclang-rt-14-dev
  libabsl-dev libgtest-dev libgmock-dev libbenchmark-dev nlohmann-json3-dev
  libtorch-dev python3-torch python3-pytest python3-numpy
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  sudo=""
  [[ $(id -u) -eq 0 ]] || sudo="sudo"
  $sudo apt-get update -q
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

cuda="${CUDA_PATH:-/usr/local/cuda}"
if [[ ! -f "$cuda/include/cuda.h" ]]; then
  echo "setup: warning: no CUDA toolkit headers at $cuda (set CUDA_PATH); the CUDA backend" \
       "cannot be built" >&2
fi
echo "setup: ready"
