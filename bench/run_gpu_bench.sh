#!/usr/bin/env bash
# Runs every benchmark of bench/ on the GPU machine, one step after another, each time-boxed,
# and writes JSON lines, logs and a Markdown report (report.md) to OUT_DIR.
#
#   bench/run_gpu_bench.sh BIN_DIR TRACE OUT_DIR
#
# BIN_DIR holds replay, growth_bench, move_bench, vmm_peer_bench and import_bench built on the Debian
# machine with `bazel build -c opt //bench/...` (see bench/README.md); TRACE is the training trace
# (python3 training_trace.py > trace.txt). torch_peer_bench is built here, against the
# installed torch. A failing step is logged and the others still run; the exit status is
# that of the first failure.
set -uo pipefail

bin=${1:?usage: $0 BIN_DIR TRACE OUT_DIR}
trace=${2:?usage: $0 BIN_DIR TRACE OUT_DIR}
out=${3:?usage: $0 BIN_DIR TRACE OUT_DIR}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
status=0

# shellcheck source=bench/step.sh
source "$here/step.sh"

step build_torch_peer 300 "$here/build_torch_peer.sh" "$out/torch_peer_bench"
step vmm_peer 300 "$bin/vmm_peer_bench" --trace="$trace"
if [[ -x "$out/torch_peer_bench" ]]; then
  step torch_native 240 env -u PYTORCH_CUDA_ALLOC_CONF -u PYTORCH_ALLOC_CONF \
    "$out/torch_peer_bench" --trace="$trace"
  step torch_expandable 240 env -u PYTORCH_ALLOC_CONF \
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "$out/torch_peer_bench" --trace="$trace"
fi
step growth 180 "$bin/growth_bench" --backend=cuda
step move 120 "$bin/move_bench" --backend=cuda
step replay_sweep 240 "$bin/replay" --backend=cuda --trace="$trace" \
  --large_page_mib=0 --growth_fraction=0,0.01,0.02,0.05 --max_growth_extra_mib=64,128,inf

rm -f "$out/build_torch_peer.jsonl"
python3 "$here/report.py" "$out"/*.jsonl >"$out/report.md" && cat "$out/report.md"
# Where the time of sharing a buffer goes (import.jsonl; not in report.md). Last, so that its
# time box cannot cost the report; fabric is skipped unless an IMEX channel exists.
step import 240 "$bin/import_bench" --backend=cuda
exit "$status"
