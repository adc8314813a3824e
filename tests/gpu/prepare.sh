#!/usr/bin/env bash
# Builds (here, with Bazel) everything the GPU machine runs, into .gpu/ — the folder the
# device run carries (it is git-ignored). Then, on the GPU machine: tests/gpu/run.sh.
#
#   tests/gpu/prepare.sh
#   BEFORE=<git-rev> tests/gpu/prepare.sh
#
# With BEFORE, that revision is also built, in a temporary git worktree (its own Bazel
# workspace, removed afterwards): pool_bench into .gpu/before/bin/, libvmm.so into
# .gpu/before/lib/, and its Python package sources and share_latency.py into .gpu/before/src/
# (pip-installed there), with the revision in .gpu/before/REVISION: `tests/gpu/run.sh compare`
# then runs both builds' cached alloc+free pair and share latency side by side.
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
targets=(
  //tests:driver_conformance_test //tests:cuda_driver_test //tests:pool_test //tests:sharing_test
  //tests:pool_reuse_test //tests:pool_no_split_test
  //tools:vmm_demo //tools:vmm_peer
  //bench:pool_bench //bench:replay //bench:growth_bench //bench:vmm_peer_bench //bench:import_bench
  //bench:move_bench
  //torch_plugin:python/vmm_torch/libvmm.so
)

# build_before_at REV DIR: pool_bench (DIR/bin), libvmm.so (DIR/lib) and the Python package
# sources with share_latency.py (DIR/src) of revision REV.
build_before_at() {
  local rev=$1 dir=$2 commit tmp
  commit=$(git rev-parse --verify "$rev^{commit}") ||
    { echo "prepare.sh: BEFORE=$rev is not a revision of this repository" >&2; return 1; }
  tmp=$(mktemp -d)
  git worktree add --detach "$tmp/src" "$commit" >/dev/null
  [[ ! -f user.bazelrc ]] || cp user.bazelrc "$tmp/src/"
  local status=0
  (
    cd "$tmp/src" &&
      bazel build -c opt --strip=always //bench:pool_bench \
        //torch_plugin:python/vmm_torch/libvmm.so &&
      mkdir -p "$dir/bin" "$dir/lib" "$dir/src/bench" &&
      install -m 0755 "$(bazel info -c opt bazel-bin 2>/dev/null)/bench/pool_bench" "$dir/bin/" &&
      install -m 0644 \
        "$(bazel info -c opt bazel-bin 2>/dev/null)/torch_plugin/python/vmm_torch/libvmm.so" \
        "$dir/lib/" &&
      git archive HEAD torch_plugin | tar -x -C "$dir/src" &&
      find "$dir/src" -name "BUILD*" -delete &&
      cp bench/share_latency.py "$dir/src/bench/"
  ) || status=$?
  # That workspace's Bazel server and output base go with it.
  (cd "$tmp/src" && bazel clean --expunge >/dev/null 2>&1) || true
  git worktree remove --force "$tmp/src"
  rm -rf "$tmp"
  [[ $status -eq 0 ]] || { echo "prepare.sh: building $rev failed" >&2; return 1; }
  echo "$rev = $(git log -1 --format='%h %s' "$commit")" >"$dir/REVISION"
}

bazel build -c opt --strip=always "${targets[@]}"
bin=$(bazel info -c opt bazel-bin 2>/dev/null)
rm -rf .gpu && mkdir -p .gpu/bin .gpu/lib
for t in driver_conformance_test cuda_driver_test pool_test sharing_test pool_reuse_test \
  pool_no_split_test; do
  install -m 0755 "$bin/tests/$t" .gpu/bin/
done
# vmm_peer, the second process of the tests, the demo and import_bench, sits beside them
# (where they look for it when they are not run by Bazel: tests/subprocess.h).
install -m 0755 "$bin/tools/vmm_demo" "$bin/tools/vmm_peer" .gpu/bin/
install -m 0755 "$bin/bench/pool_bench" "$bin/bench/replay" "$bin/bench/growth_bench" \
  "$bin/bench/vmm_peer_bench" "$bin/bench/import_bench" "$bin/bench/move_bench" .gpu/bin/
install -m 0644 "$bin/torch_plugin/python/vmm_torch/libvmm.so" .gpu/lib/
if [[ -n "${BEFORE:-}" ]]; then
  build_before_at "$BEFORE" "$root/.gpu/before"
fi
# Debian's shared libraries the programs need that the GPU machine lacks (Abseil, Benchmark).
for f in .gpu/bin/* .gpu/before/bin/* .gpu/lib/libvmm.so .gpu/before/lib/libvmm.so; do
  [[ -e "$f" ]] || continue
  ldd "$f" | awk '/libabsl|libbenchmark/ {print $3}'
done | sort -u | xargs -r cp -L -t .gpu/lib/
python3 bench/training_trace.py > .gpu/trace.txt
du -sh .gpu
