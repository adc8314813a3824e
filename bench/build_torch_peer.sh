#!/usr/bin/env bash
# Builds bench/torch_peer_bench.cpp against the LibTorch of the python3 that has torch (the GPU
# machine: /opt/torch/.venv), with g++, without Bazel.
#
#   bench/build_torch_peer.sh OUTPUT        e.g. bench/build_torch_peer.sh "$OUT/torch_peer_bench"
#
# Environment: PYTHON (default python3), CXX (default /opt/gcc/bin/g++ if present, else g++),
# CUDA_HOME (default /usr/local/cuda).
set -euo pipefail

out=${1:?usage: $0 OUTPUT}
here=$(cd "$(dirname "$0")" && pwd)
python=${PYTHON:-python3}
if [[ -z "${CXX:-}" ]]; then
  if [[ -x /opt/gcc/bin/g++ ]]; then CXX=/opt/gcc/bin/g++; else CXX=g++; fi
fi
cuda=${CUDA_HOME:-/usr/local/cuda}

# torch's header and library folders, and the C++ ABI its libraries were built with.
read -r -a torch_inc < <("$python" -c \
  "from torch.utils import cpp_extension as c; print(' '.join(c.include_paths()))")
read -r -a torch_lib < <("$python" -c \
  "from torch.utils import cpp_extension as c; print(' '.join(c.library_paths()))")
abi=$("$python" -c "import torch; print(int(torch._C._GLIBCXX_USE_CXX11_ABI))")

# C++20: torch 2.12 and later require it; 2.11 builds with it too.
flags=(-std=c++20 -O2 -DNDEBUG "-D_GLIBCXX_USE_CXX11_ABI=${abi}" -I"${cuda}/include")
for d in "${torch_inc[@]}"; do flags+=(-I"$d"); done
libs=()
for d in "${torch_lib[@]}" "${cuda}/lib64"; do libs+=(-L"$d" "-Wl,-rpath,$d"); done
# --no-as-needed: keep every torch library loaded even where no symbol is used directly, as
# LibTorch's own CMake config does.
libs+=("-Wl,--no-as-needed" -ltorch -ltorch_cpu -lc10_cuda -lc10 "-Wl,--as-needed" -lcudart)

mkdir -p "$(dirname "$out")"
set -x
"$CXX" "${flags[@]}" "$here/torch_peer_bench.cpp" -o "$out" "${libs[@]}"
