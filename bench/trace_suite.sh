#!/usr/bin/env bash
# Replays every trace of bench/traces.py through vmm and its peers, and writes one report.
#
#   bench/trace_suite.sh BIN_DIR OUT_DIR [NAME...]
#
# BIN_DIR holds replay and vmm_peer_bench (`bazel build -c opt //bench/...`; .gpu/bin after
# tests/gpu/prepare.sh). NAMEs pick workloads (default: all of `traces.py --list`); a NAME of
# the form WORKLOAD:PARAM=VALUE[:PARAM=VALUE...] is a variant of a workload, its parameters
# set with `traces.py --set` (e.g. churn:max_bytes=67108864, long_prefill:contexts=16384,32768),
# reported as WORKLOAD.PARAM-VALUE... (commas become underscores); a NAME with an empty part or
# a '/' is refused (logged, and the exit status is 1) and the others still run; @FILE reads
# NAMEs from FILE, one a line, '#' starting a comment (bench/trace_variants.txt). Each trace
# is generated into a temporary folder (TRACE_DIR: this folder instead, kept) and replayed,
# each program in a process of its own and under `timeout`, by:
#   vmm                 replay (the default growth policy; REPLAY_ARGS adds flags, e.g. a sweep)
#   cuda_malloc_async   vmm_peer_bench --allocators=cuda_malloc_async
#   torch_native        torch_peer_bench, PYTORCH_CUDA_ALLOC_CONF unset
#   torch_expandable    torch_peer_bench, PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
# The replay workload (bench/alloc_workloads.h) gives, per trace and allocator, peak reserved
# over peak allocated, growths and releases (num_device_alloc / num_device_free), driver
# calls, and ns per operation cold and warm. OUT_DIR gets NAME.ALLOCATOR.jsonl and .log per
# run and report.md (bench/report.py: one row per trace and metric, one column per allocator).
#
# Environment: BACKEND=cuda (default) or host: on the host backend only vmm runs (no GPU
# needed); TRACE_ROUNDS (1, at most 999): replay each trace that many times through every
# allocator, the allocators in turn within a round (files of rounds after the first:
# NAME.ALLOCATOR.rK.jsonl; a trace's files of an earlier run into OUT_DIR are removed first),
# and report.py gives the median of the rounds (of an even number, the mean of the middle two;
# a round that failed gives no figures): an H200's cold time of one replay spread up to 2x
# between processes on one machine (docs/results/2026-12-04.md, run CC); TRACE_SEED (0),
# TRACE_SCALE (1), WARM_REPS (3), STEP_LIMIT (seconds per run, 180), PYTHON (python3),
# TORCH_PEER_BENCH (a torch_peer_bench already built; else it is built into OUT_DIR by
# build_torch_peer.sh). A failing run is logged and the others still run; the exit status is
# that of the first failure.
set -uo pipefail

usage="usage: $0 BIN_DIR OUT_DIR [NAME...]"
bin=${1:?$usage}
out=${2:?$usage}
shift 2
here=$(cd "$(dirname "$0")" && pwd)
python=${PYTHON:-python3}
backend=${BACKEND:-cuda}
limit=${STEP_LIMIT:-180}
warm=${WARM_REPS:-3}
rounds=${TRACE_ROUNDS:-1}
if [[ ! $rounds =~ ^[1-9][0-9]{0,2}$ ]]; then
  echo "trace_suite.sh: TRACE_ROUNDS=$rounds: not a whole number of rounds from 1 to 999" >&2
  exit 2
fi
status=0
mkdir -p "$out"
out=$(cd "$out" && pwd)

# shellcheck source=bench/step.sh
source "$here/step.sh"

# run NAME COMMAND...: a step of STEP_LIMIT seconds (bench/step.sh).
run() {
  local name=$1
  shift
  step "$name" "$limit" "$@"
}

names=()
for arg in "$@"; do
  if [[ $arg == @* ]]; then
    # @FILE: its NAMEs, one a line; '#' starts a comment.
    [[ -r ${arg#@} ]] || { echo "trace_suite.sh: cannot read ${arg#@}" >&2; exit 2; }
    mapfile -t -O "${#names[@]}" names < <(sed 's/#.*//' "${arg#@}" | awk 'NF {print $1}')
  else
    names+=("$arg")
  fi
done
if [[ $# -eq 0 ]]; then
  mapfile -t names < <("$python" "$here/traces.py" --list | awk '{print $1}')
fi
if [[ -n "${TRACE_DIR:-}" ]]; then
  traces=$TRACE_DIR
  mkdir -p "$traces"
else
  traces=$(mktemp -d)
  trap 'rm -rf "$traces"' EXIT
fi

torch_peer=
if [[ $backend == cuda ]]; then
  torch_peer=${TORCH_PEER_BENCH:-}
  if [[ -z "$torch_peer" ]]; then
    run build_torch_peer "$here/build_torch_peer.sh" "$out/torch_peer_bench"
    rm -f "$out/build_torch_peer.jsonl"
    torch_peer=$out/torch_peer_bench
  fi
  if [[ ! -x "$torch_peer" ]]; then
    echo "no torch_peer_bench: PyTorch's allocators are skipped"
    torch_peer=
  fi
else
  echo "backend $backend: vmm only (the peers need a GPU)"
fi

for spec in "${names[@]}"; do
  # WORKLOAD[:PARAM=VALUE...]: the workload, its --set arguments, and the name of its files.
  if [[ -z $spec || $spec == :* || $spec == *: || $spec == *::* || $spec == */* ]]; then
    echo "== trace '$spec': not WORKLOAD[:PARAM=VALUE...] (an empty part, or a '/')"
    [[ $status -ne 0 ]] || status=1
    continue
  fi
  IFS=: read -r -a parts <<<"$spec"
  workload=${parts[0]}
  sets=()
  name=$workload
  for param in "${parts[@]:1}"; do
    sets+=(--set "$param")
    name+=".${param/=/-}"
  done
  name=${name//,/_}
  trace=$traces/$name.txt
  echo "== trace $name (seed ${TRACE_SEED:-0}, scale ${TRACE_SCALE:-1})"
  if ! "$python" "$here/traces.py" "$workload" "${sets[@]}" --seed "${TRACE_SEED:-0}" \
      --scale "${TRACE_SCALE:-1}" >"$trace"; then
    echo "   generating $name failed"
    [[ $status -ne 0 ]] || status=1
    continue
  fi
  # This trace's results of an earlier run into OUT_DIR (more rounds) would join the medians.
  for allocator in vmm cuda_malloc_async torch_native torch_expandable; do
    rm -f "$out/$name.$allocator.jsonl" "$out/$name.$allocator".r[0-9]*.jsonl
  done
  for ((round = 1; round <= rounds; round++)); do
    suffix=
    [[ $round -eq 1 ]] || suffix=.r$round
    # shellcheck disable=SC2086  # REPLAY_ARGS is a list of words
    run "$name.vmm$suffix" "$bin/replay" --backend="$backend" --trace="$trace" \
      --warm_reps="$warm" ${REPLAY_ARGS:-}
    [[ $backend == cuda ]] || continue
    run "$name.cuda_malloc_async$suffix" "$bin/vmm_peer_bench" \
      --allocators=cuda_malloc_async --live= --warm_reps="$warm" --trace="$trace"
    if [[ -n "$torch_peer" ]]; then
      run "$name.torch_native$suffix" env -u PYTORCH_CUDA_ALLOC_CONF -u PYTORCH_ALLOC_CONF \
        "$torch_peer" --live= --warm_reps="$warm" --trace="$trace"
      run "$name.torch_expandable$suffix" env -u PYTORCH_ALLOC_CONF \
        PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "$torch_peer" --live= \
        --warm_reps="$warm" --trace="$trace"
    fi
  done
done

# One row per trace and metric (report.py names the rows after the trace files).
if "$python" "$here/report.py" "$out"/*.jsonl >"$out/report.md"; then
  cat "$out/report.md"
else
  [[ $status -ne 0 ]] || status=1
fi
exit "$status"
