#!/usr/bin/env bash
# Builds (here, with Bazel) everything the GPU machine runs, into .gpu/ — the folder the
# device run carries (it is git-ignored). Then, on the GPU machine: tests/gpu/run.sh.
#
#   tests/gpu/prepare.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
targets=(
  //tests:driver_conformance_test //tests:cuda_driver_test //tests:pool_test //tests:sharing_test
  //tools:vmm_demo //tools:vmm_peer
  //bench:pool_bench //bench:replay //bench:growth_bench //bench:vmm_peer_bench //bench:import_bench
  //torch_plugin:python/vmm_torch/libvmm.so
)
bazel build -c opt --strip=always "${targets[@]}"
bin=$(bazel info -c opt bazel-bin 2>/dev/null)
rm -rf .gpu && mkdir -p .gpu/bin .gpu/lib
for t in driver_conformance_test cuda_driver_test pool_test sharing_test; do
  install -m 0755 "$bin/tests/$t" .gpu/bin/
done
# vmm_peer, the second process of the tests, the demo and import_bench, sits beside them
# (where they look for it when they are not run by Bazel: tests/subprocess.h).
install -m 0755 "$bin/tools/vmm_demo" "$bin/tools/vmm_peer" .gpu/bin/
install -m 0755 "$bin/bench/pool_bench" "$bin/bench/replay" "$bin/bench/growth_bench" \
  "$bin/bench/vmm_peer_bench" "$bin/bench/import_bench" .gpu/bin/
install -m 0644 "$bin/torch_plugin/python/vmm_torch/libvmm.so" .gpu/lib/
# Debian's shared libraries the programs need that the GPU machine lacks (Abseil, Benchmark).
for f in .gpu/bin/* .gpu/lib/libvmm.so; do
  ldd "$f" | awk '/libabsl|libbenchmark/ {print $3}'
done | sort -u | xargs -r cp -L -t .gpu/lib/
python3 bench/training_trace.py > .gpu/trace.txt
du -sh .gpu
