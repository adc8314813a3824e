#!/usr/bin/env bash
# The GPU machine's half of the tests and the benchmarks, in one time-boxed script.
#
#   tests/gpu/run.sh PHASE...     (after tests/gpu/prepare.sh here; .gpu/ carried there)
#
# Phases, run in the order given:
#   tests    the C++ suites on the CUDA backend (VMM_TEST_BACKEND=cuda: conformance, CUDA
#            driver, pool, pool reuse, sharing) and the demo; first without an IMEX channel (channel 0
#            removed if an earlier run made it: the POSIX fd fallback), then with one (fabric);
#            then tests/gpu/capture_safe_calls.py (which calls a CUDA graph capture survives).
#   python   pip-installs vmm_torch against the machine's torch and runs the Python suite, with
#            an IMEX channel (PYTEST_ARGS: what pytest runs, default tests/python but the
#            parity suite; PYTEST_LIMIT_S: its time limit, default 570 s, since the whole
#            suite runs 7 to 8.5 minutes on an H200; REUSE_PLUGIN=1 keeps an install an
#            earlier call on the same machine made).
#   dropin   tests/gpu/dropin/run.sh: small PyTorch programs run with PyTorch's allocator and
#            with vmm, with an IMEX channel; the case table goes to the summary, the cases'
#            logs to logs.tgz (5 to 6 minutes with the install, so run it on its own; under
#            DEADLINE the cases not begun in time report not-run; known_gaps.txt lists what vmm
#            is known to fail).
#   parity   the torch.multiprocessing parity suite (tests/python/test_mp_parity.py) in its
#            five modes (native-cpu, vmm-host, native, vmm-fabric, vmm-fd; VMM_PARITY_MODES
#            picks some), with an IMEX channel; the case x mode table goes to $OUT/parity.md.
#   bench    the benchmarks, side by side with PyTorch; BENCH names the parts (default all):
#              alloc    cached alloc+free pair, trace replay, growth and import
#                       (bench/run_gpu_bench.sh), and pool_bench;
#              traces   every trace of bench/traces.py replayed by vmm, PyTorch native,
#                       expandable segments and cudaMallocAsync (bench/trace_suite.sh;
#                       TRACES names some, or variants such as @bench/trace_variants.txt,
#                       TRACE_SCALE shortens them, TRACE_ROUNDS replays each that many
#                       times, medians reported); traces_report.md and
#                       the JSON lines (traces/) in $OUT;
#              latency  share latency (with its breakdown) and imported bandwidth per mode,
#                       without an IMEX channel, then with one, then SHARE_ROUNDS (3) rounds in
#                       all of vmm fabric and PyTorch native (SHARE_REPS repetitions, 7);
#              fanout   one producer, 4 consumers, fabric and fds;
#              chain    bench/mp_chain.py: CHAIN_COUNT (100000) small tensors through three
#                       processes (create, clone and forward, sum) in native, vmm-fabric (with
#                       an IMEX channel) and vmm-fd, each mode stopped after CHAIN_TIMEOUT (120)
#                       s and reported as not finished; chain.json and chain.md in $OUT
#                       (CHAIN_PROFILE=1: each process's cProfile summary in
#                       $OUT/chain-profile/);
#              dist     vmm_torch.distributed against torch.distributed, 4 ranks on the GPU;
#              train    the training loop under native (twice), expandable-segments and vmm
#                       (single-chunk growth, the plugin's default, and large_page=4M, the
#                       C++ pools' pages),
#                       TRAIN_STEPS (300) steps, TRAIN_ROUNDS (1) interleaved rounds, compared;
#                       then the stats tools on vmm's dump.
#   compare  this build against .gpu/before (built by `BEFORE=<git-rev> tests/gpu/prepare.sh`),
#            interleaved, which goes first alternating: the cached alloc+free pair (pool_bench,
#            COMPARE_ROUNDS (3) rounds), then share latency of vmm fabric handles at 64 MiB /
#            1 GiB / 8 GiB (each build's own share_latency.py and package, SHARE_COMPARE_ROUNDS
#            (2) rounds of SHARE_REPS (7); COMPARE_IMEX=0: without an IMEX channel, POSIX fds):
#            after / before ratios from one run. Without .gpu/before, this build alone.
#   multi    two GPUs (the nvidia-h200-x2 machine): the C++ two-device tests (peer access of
#            pools, imports on the other GPU, process A on GPU 0 / process B on GPU 1) and
#            tests/gpu/multi_gpu.py (a cuda:0 tensor opened on cuda:1 by another process;
#            imported peer-memory read bandwidth against PyTorch's peer copy), without then
#            with an IMEX channel. With one GPU the C++ tests report SKIPPED and the script a
#            skip line.
# DEADLINE (seconds since the start) skips the steps that would begin after it and shortens
# the last ones, e.g. `DEADLINE=390 BENCH="latency fanout dist train" TRAIN_STEPS=200
# tests/gpu/run.sh bench` for one bounded run of the Python benchmarks.
# Each step runs under its own time limit through bench/bounded.sh: this script, ended from
# outside, ends the step running too (and the drop-in runner ends its cases).
# Logs and results go to $OUT (one summary, results.log with every step's log as it ends, a
# tarball of logs, and the key result files). Keep one invocation under 10 minutes:
# `python` alone takes about 9 minutes on an H200 (install and the whole suite), so run it on
# its own; `bench` with every part takes longer, so split it with BENCH.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
root=$PWD
OUT=${OUT:-/tmp/vmm_out}
logs=/tmp/vmm_logs
mkdir -p "$OUT" "$logs"
summary="$OUT/summary.txt"
export PATH="/opt/torch/.venv/bin:$PATH" PYTHONUNBUFFERED=1 OUT
export LD_LIBRARY_PATH="$root/.gpu/lib:${LD_LIBRARY_PATH:-}"
bin="$root/.gpu/bin"
# shellcheck source=bench/bounded.sh
source "$root/bench/bounded.sh"
site=/tmp/vmm_site  # where vmm_torch is pip-installed
channel=/dev/nvidia-caps-imex-channels/channel0

# --- Shared steps ------------------------------------------------------------------------------

# note TEXT...: one line in the summary (and on stdout).
note() { echo "$*" | tee -a "$summary"; }

# step NAME SECONDS COMMAND...: output to $logs/NAME.log, one line in the summary, and the log
# appended to $OUT/results.log at once (so that it comes back even if the run is cut short).
# With DEADLINE set (seconds since the start), steps that would begin after it are skipped.
step() {
  local name=$1 limit=$2
  shift 2
  if [[ -n "${DEADLINE:-}" && $SECONDS -ge $DEADLINE ]]; then
    note "$name: skipped (deadline)"
    return
  fi
  if [[ -n "${DEADLINE:-}" && $((SECONDS + limit)) -gt $((DEADLINE + 60)) ]]; then
    limit=$((DEADLINE + 60 - SECONDS))
  fi
  local start=$SECONDS
  bounded "$limit" "$@" >"$logs/$name.log" 2>&1  # ends with this script (bench/bounded.sh)
  local rc=$?
  local line="$name: rc=$rc ($((SECONDS - start)) s)"
  local tests
  tests=$(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$logs/$name.log" | tr '\n' ' ')
  [[ -n "$tests" ]] && line="$line $tests"
  note "$line"
  [[ $rc -eq 0 ]] || tail -n 8 "$logs/$name.log" | sed 's/^/    /' | tee -a "$summary"
  { echo "===== $name (rc=$rc)"; tail -c 20000 "$logs/$name.log"; } >>"$OUT/results.log"
}

# The machine starts without an IMEX channel; with_imex_channel creates channel 0 (fabric
# handles work from then on, in this call and in later calls while the machine stays up) and
# without_imex_channel removes it again (vmm then falls back to POSIX fds).
with_imex_channel() {
  local major
  major=$(awk '/nvidia-caps-imex-channels/{print $1}' /proc/devices)
  [[ -n "$major" ]] || { note "no nvidia-caps-imex-channels device"; return 1; }
  mkdir -p "$(dirname "$channel")"
  [[ -e $channel ]] || mknod "$channel" c "$major" 0
  note "IMEX channel 0 created (major $major)"
}

without_imex_channel() {
  if [[ -e $channel ]]; then
    rm -f "$channel"
    note "IMEX channel 0 removed"
  else
    note "no IMEX channel"
  fi
}

# each_channel FUNCTION: FUNCTION no_imex without an IMEX channel, then FUNCTION imex with one.
each_channel() {
  without_imex_channel
  "$1" no_imex
  if with_imex_channel; then "$1" imex; fi
}

gpu_info() {
  nvidia-smi --query-gpu=index,name,driver_version,pci.bus_id,memory.total \
    --format=csv,noheader | tee -a "$summary"
}

# The CPUs local to GPU 0 (the NUMA node of its PCI device), e.g. 0-7; empty if unknown.
gpu_local_cpus() {
  local bus
  bus=$(nvidia-smi --query-gpu=pci.bus_id --format=csv,noheader 2>/dev/null | head -n 1 |
    tr 'A-Z' 'a-z' | sed 's/^0000\([0-9a-f]\{4\}:\)/\1/')
  cat "/sys/bus/pci/devices/$bus/local_cpulist" 2>/dev/null
}

# vmm_torch pip-installed from this tree into $site (afresh, once per call) and on PYTHONPATH.
plugin_ready=
install_plugin() {
  [[ -z "$plugin_ready" ]] || return 0
  plugin_ready=1
  export PYTHONPATH="$site:${PYTHONPATH:-}"
  # REUSE_PLUGIN=1: keep an install an earlier call on this machine made (same .gpu/).
  if [[ -n "${REUSE_PLUGIN:-}" && -e "$site/vmm_torch/_C.so" ]]; then
    note "vmm_torch: reusing the install in $site"
    return 0
  fi
  rm -rf "$site"
  step pip_install 300 env VMM_LIB="$root/.gpu/lib/libvmm.so" python3 -m pip install -q \
    --no-build-isolation --no-deps --no-index --target "$site" ./torch_plugin/python
  # Without _cuda_allocator.so (it did not compile against this torch) vmm_torch falls back to
  # CUDAPluggableAllocator: said here, since pip -q hides the build's warning.
  if compgen -G "$site/vmm_torch/_cuda_allocator*.so" >/dev/null; then
    note "vmm_torch: _cuda_allocator built"
  else
    note "vmm_torch: _cuda_allocator NOT built (the CUDAPluggableAllocator fallback runs)"
  fi
}

# cxx_suites TAG [GTEST_FILTER]: the C++ suites on the CUDA backend; with a filter, only the
# matching tests of the suites that have device-pair tests (no CUDA driver suite, no demo).
cxx_suites() {
  local tag=$1 filter=${2:-}
  local args=(${filter:+"$filter"})
  step "conformance_$tag" 180 env VMM_TEST_BACKEND=cuda "$bin/driver_conformance_test" "${args[@]}"
  step "pool_$tag" 120 env VMM_TEST_BACKEND=cuda "$bin/pool_test" "${args[@]}"
  step "pool_reuse_$tag" 60 env VMM_TEST_BACKEND=cuda "$bin/pool_reuse_test" "${args[@]}"
  step "pool_no_split_$tag" 60 env VMM_TEST_BACKEND=cuda "$bin/pool_no_split_test" "${args[@]}"
  step "sharing_$tag" 180 env VMM_TEST_BACKEND=cuda "$bin/sharing_test" "${args[@]}"
  [[ -z "$filter" ]] || return 0
  step "cuda_driver_$tag" 60 "$bin/cuda_driver_test"
  step "demo_$tag" 60 env VMM_BACKEND=cuda "$bin/vmm_demo" --size=256M --out="$logs/demo_$tag.json"
}

# --- tests -------------------------------------------------------------------------------------

phase_tests() {
  gpu_info
  each_channel cxx_suites
  # Which driver calls a capture survives (what capture_window.h keeps out of captures), with
  # fabric handles where the machine has an IMEX channel: one verdict per call, in the summary.
  step capture_safe_calls 120 python3 tests/gpu/capture_safe_calls.py \
    "$([[ -e $channel ]] && echo 8 || echo 1)"
  sed 's/^/    /' "$logs/capture_safe_calls.log" | tee -a "$summary"
}

# --- python ------------------------------------------------------------------------------------

phase_python() {
  with_imex_channel  # the fabric tests need it
  install_plugin
  # shellcheck disable=SC2086  # PYTEST_ARGS is a list of words
  step pytest "${PYTEST_LIMIT_S:-570}" python3 -m pytest -v -rfE \
    ${PYTEST_ARGS:-tests/python --ignore=tests/python/test_mp_parity.py}
}

# --- dropin ------------------------------------------------------------------------------------

phase_dropin() {
  with_imex_channel  # sends use fabric handles, as where IMEX runs
  install_plugin
  # Runs that would begin in the last 75 s of the step's time are not begun (each takes at
  # most 60 s), so the case table is written even when DEADLINE cuts the step short. The
  # cases' logs go to $logs/dropin (in logs.tgz): loose, they are 8 files a case in $OUT.
  local limit=480
  if [[ -n "${DEADLINE:-}" && $((DEADLINE + 60 - SECONDS)) -lt $limit ]]; then
    limit=$((DEADLINE + 60 - SECONDS))
  fi
  step dropin "$limit" env OUT="$logs" DROPIN_UNTIL=$(($(date +%s) + limit - 75)) \
    tests/gpu/dropin/run.sh "$site"
  sed -n '/^case /,/^$/p;/^summary:/p' "$logs/dropin.log" | tee -a "$summary"
}

# --- parity ------------------------------------------------------------------------------------

phase_parity() {
  with_imex_channel  # vmm-fabric needs it
  install_plugin
  step parity 540 env VMM_PARITY_TABLE="$OUT/parity.md" \
    VMM_PARITY_MODE_LIMIT="${VMM_PARITY_MODE_LIMIT:-240}" VMM_PARITY_PARALLEL="${VMM_PARITY_PARALLEL:-1}" \
    python3 -m pytest -v -rfEs tests/python/test_mp_parity.py
  [[ ! -e "$OUT/parity.md" ]] || tee -a "$summary" <"$OUT/parity.md"
}

# --- bench -------------------------------------------------------------------------------------

bench_alloc() {
  step bench_alloc 540 bench/run_gpu_bench.sh "$bin" "$root/.gpu/trace.txt" "$logs/bench"
  step pool_bench 120 "$bin/pool_bench" --benchmark_min_time=0.5 \
    --benchmark_out="$logs/pool_bench.json" --benchmark_out_format=json
  cp "$logs/bench/report.md" "$OUT/bench_report.md" 2>/dev/null
  cp "$logs/bench/import.jsonl" "$OUT/import.jsonl" 2>/dev/null
}

# Every trace of bench/traces.py through vmm and the peers, one process per trace and
# allocator; the torch_peer_bench an alloc part built on this machine is reused.
bench_traces() {
  local envs=() tpb="$logs/bench/torch_peer_bench"
  [[ -x "$tpb" ]] && envs+=(TORCH_PEER_BENCH="$tpb")
  rm -rf "$logs/traces"
  # shellcheck disable=SC2086  # TRACES is a list of names
  step bench_traces 540 env "${envs[@]}" bench/trace_suite.sh "$bin" "$logs/traces" ${TRACES:-}
  mkdir -p "$OUT/traces"
  cp "$logs/traces"/*.jsonl "$OUT/traces/" 2>/dev/null
  if [[ -e "$logs/traces/report.md" ]]; then
    cp "$logs/traces/report.md" "$OUT/traces_report.md"
    tee -a "$summary" <"$OUT/traces_report.md"
  fi
}

# share_modes TAG MODES...: share_latency.py (with --breakdown) for each mode, one step each,
# on the CPUs local to the GPU.
share_modes() {
  local tag=$1 mode cpus
  shift
  cpus=$(gpu_local_cpus)
  for mode in "$@"; do
    step "share_${tag}_$mode" 120 python3 bench/share_latency.py --breakdown --modes "$mode" \
      --sizes 64M,1G,8G --reps "${SHARE_REPS:-7}" ${cpus:+--cpus "$cpus"} --out "$OUT/share.jsonl"
  done
}

# The modes of each channel state: without one, vmm's probe falls back to POSIX fds
# (vmm-auto); with one, fabric, fds forced and the automatic choice.
latency_modes() {
  if [[ $1 == no_imex ]]; then
    share_modes "$1" vmm-auto torch-native torch-expandable
  else
    share_modes "$1" vmm-fabric vmm-auto vmm-fd torch-native torch-expandable
  fi
}

# Each run is a new pair of processes: the later rounds show how much a figure moves between
# runs.
bench_latency() {
  note "CPUs local to the GPU: $(gpu_local_cpus) of $(nproc); $(lscpu | grep -i 'numa node(s)')"
  each_channel latency_modes
  local round
  for ((round = 2; round <= ${SHARE_ROUNDS:-3}; round++)); do
    share_modes "imex_round$round" vmm-fabric torch-native
  done
}

bench_fanout() {
  with_imex_channel
  local type
  for type in fabric posix_fd; do
    step "fanout_$type" 90 python3 bench/fanout.py --handle-type "$type" --sizes 64M,1G,8G
  done
}

# Three modes in one step, each bounded by CHAIN_TIMEOUT (native PyTorch passed 100,000 tensors
# in about 41 s on an H200, about 2,400 a second); a mode that does not finish in it is reported
# as such. Lower CHAIN_COUNT rather than raise the timeout past the 10 minutes of one call.
bench_chain() {
  with_imex_channel
  local limit=${CHAIN_TIMEOUT:-120}
  step chain $((3 * (limit + 40))) python3 bench/mp_chain.py --modes native,vmm-fabric,vmm-fd \
    --count "${CHAIN_COUNT:-100000}" --timeout "$limit" --json "$OUT/chain.json" \
    --markdown "$OUT/chain.md" ${CHAIN_PROFILE:+--profile "$OUT/chain-profile"}
  [[ -e "$OUT/chain.md" ]] && tee -a "$summary" <"$OUT/chain.md"
}

bench_dist() {
  step dist 300 python3 bench/dist_bench.py --ranks 4 --sizes 64M,1G
}

# train_run LABEL ENV... -- ARGS...: one training run, results in $logs/train_LABEL.json.
train_run() {
  local label=$1 envs=()
  shift
  while [[ $1 != -- ]]; do envs+=("$1"); shift; done
  shift
  step "train_$label" 300 env "${envs[@]}" python3 bench/train_loop.py --label "$label" \
    --steps "${TRAIN_STEPS:-300}" --out "$logs/train_$label.json" "$@"
}

# Deterministic kernels: vmm's losses must equal native's bit for bit. Native runs twice:
# native_repeat shows whether native itself is reproducible, the comparison's noise floor.
# TRAIN_ROUNDS=N (default 1) runs the allocators N times, interleaved (round r > 1 labels its
# runs LABEL_rR): a slow spell of the machine then falls on every allocator alike, and the
# comparison gives each one's fastest round over native's.
bench_train() {
  rm -f "$logs"/train_*.json
  local round sfx
  for ((round = 1; round <= ${TRAIN_ROUNDS:-1}; round++)); do
    sfx=
    ((round == 1)) || sfx=_r$round
    train_run native$sfx -u PYTORCH_CUDA_ALLOC_CONF -- --allocator native
    ((round > 1)) ||
      train_run native_repeat -u PYTORCH_CUDA_ALLOC_CONF -- --allocator native
    train_run expandable$sfx PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True -- \
      --allocator expandable
    if ((round == 1)); then
      train_run vmm -u PYTORCH_CUDA_ALLOC_CONF -- --allocator vmm --dump "$logs/vmm_dump.json"
    else
      train_run vmm$sfx -u PYTORCH_CUDA_ALLOC_CONF -- --allocator vmm
    fi
    train_run vmm_large_page_4M$sfx -u PYTORCH_CUDA_ALLOC_CONF -- --allocator vmm \
      --vmm-option large_page=4M
  done
  step train_compare 20 python3 bench/compare_training.py "$logs"/train_*.json
  step stats_summary 60 python3 -m vmm_torch.stats summarize "$logs/vmm_dump.json"
  step stats_render 60 python3 -m vmm_torch.stats render "$logs/vmm_dump.json" \
    -o "$OUT/vmm_stats.html"
  step stats_torch_viz 120 python3 -m vmm_torch.stats torch-viz "$logs/vmm_dump.json" \
    -o "$OUT/torch_viz.html"
  cp "$logs/vmm_dump.json" "$OUT/vmm_dump.json" 2>/dev/null
}

phase_bench() {
  gpu_info
  local part parts=${BENCH:-alloc traces latency fanout chain dist train}
  for part in $parts; do
    if [[ $(type -t "bench_$part") != function ]]; then
      note "bench: unknown part '$part' (alloc traces latency fanout chain dist train)"
      continue
    fi
    [[ $part == alloc || $part == traces ]] || install_plugin
    note "--- bench $part"
    "bench_$part"
  done
}

# --- compare -----------------------------------------------------------------------------------

# The cached alloc+free pair of pool_bench for this build (after) and .gpu/before (before),
# interleaved round by round, which of the two goes first alternating; bench/pair_ratio.py
# gives each build's median and after / before.
phase_compare() {
  local dir="$logs/compare" builds=(after) round b
  rm -rf "$dir" && mkdir -p "$dir"
  gpu_info
  if [[ -x "$root/.gpu/before/bin/pool_bench" ]]; then
    builds+=(before)
    note "before: $(cat "$root/.gpu/before/REVISION" 2>/dev/null || echo '(revision unknown)')"
  else
    note "compare: no .gpu/before (BEFORE=<git-rev> tests/gpu/prepare.sh builds one):" \
      "this build alone"
  fi
  for ((round = 1; round <= ${COMPARE_ROUNDS:-3}; round++)); do
    local order=("${builds[@]}")
    ((round % 2 == 0 && ${#builds[@]} == 2)) && order=(before after)
    for b in "${order[@]}"; do
      local exe="$bin/pool_bench"
      [[ $b == before ]] && exe="$root/.gpu/before/bin/pool_bench"
      step "compare_${b}_$round" 120 "$exe" --benchmark_filter=BM_CachedAllocFreePair \
        --benchmark_min_time=0.5 --benchmark_repetitions=3 \
        --benchmark_out="$dir/${b}_$round.json" --benchmark_out_format=json
    done
  done
  local before_files=("$dir"/before_*.json)
  [[ -e ${before_files[0]} ]] || before_files=()
  python3 bench/pair_ratio.py --after "$dir"/after_*.json --before "${before_files[@]}" \
    >"$OUT/compare.md" 2>>"$summary"
  tee -a "$summary" <"$OUT/compare.md"
  # SHARE_COMPARE_ROUNDS=0: the cached pair only (no installs, no share latency).
  if ((${SHARE_COMPARE_ROUNDS:-2} > 0)); then
    compare_share "$dir"
  else
    note "compare_share: skipped (SHARE_COMPARE_ROUNDS=0)"
  fi
}

# compare_share DIR: share latency (vmm fabric) of this build and of .gpu/before, each with its
# own package (pip-installed into its own folder) and its own share_latency.py.
compare_share() {
  local dir=$1 before_site=/tmp/vmm_site_before builds=(after) round b cpus mode=vmm-fabric
  # COMPARE_IMEX=0: without an IMEX channel, where vmm shares through POSIX fds (vmm-auto).
  if [[ ${COMPARE_IMEX:-1} == 0 ]]; then
    without_imex_channel
    mode=vmm-auto
  else
    with_imex_channel
  fi
  install_plugin
  if [[ -d "$root/.gpu/before/src/torch_plugin/python" ]]; then
    rm -rf "$before_site"
    step pip_install_before 300 env VMM_LIB="$root/.gpu/before/lib/libvmm.so" python3 -m pip \
      install -q --no-build-isolation --no-deps --no-index --target "$before_site" \
      "$root/.gpu/before/src/torch_plugin/python"
    builds+=(before)
  fi
  cpus=$(gpu_local_cpus)
  for ((round = 1; round <= ${SHARE_COMPARE_ROUNDS:-2}; round++)); do
    local order=("${builds[@]}")
    ((round % 2 == 0 && ${#builds[@]} == 2)) && order=(before after)
    for b in "${order[@]}"; do
      local script=bench/share_latency.py path=$site
      if [[ $b == before ]]; then
        script="$root/.gpu/before/src/bench/share_latency.py"
        path=$before_site
      fi
      step "compare_share_${b}_$round" 150 env PYTHONPATH="$path" python3 "$script" \
        --modes "$mode" --sizes 64M,1G,8G --reps "${SHARE_REPS:-7}" ${cpus:+--cpus "$cpus"} \
        --out "$dir/share_$b.jsonl"
    done
  done
  local before_file=()
  [[ -e "$dir/share_before.jsonl" ]] && before_file=(--before "$dir/share_before.jsonl")
  python3 bench/share_ratio.py --after "$dir/share_after.jsonl" "${before_file[@]}" \
    >"$OUT/compare_share.md" 2>>"$summary"
  tee -a "$summary" <"$OUT/compare_share.md"
}

# --- multi -------------------------------------------------------------------------------------

# The C++ tests that need two devices (named TwoDevice*, plus HasAccess on one) and
# multi_gpu.py, with the handle type of the channel state.
multi_checks() {
  local tag=$1 type=posix_fd
  [[ $tag == imex ]] && type=fabric
  cxx_suites "multi_$tag" '--gtest_filter=*TwoDevice*:*HasAccess*'
  step "multi_gpu_$type" 240 python3 tests/gpu/multi_gpu.py --handle-type "$type" \
    --out "$logs/multi_gpu.jsonl"
}

phase_multi() {
  gpu_info
  nvidia-smi topo -m 2>/dev/null | head -n 3 | tee -a "$summary"
  local gpus
  gpus=$(nvidia-smi --query-gpu=index --format=csv,noheader | wc -l)
  [[ $gpus -ge 2 ]] || note "multi: $gpus GPU(s): the two-GPU checks will skip"
  install_plugin
  rm -f "$logs/multi_gpu.jsonl"
  each_channel multi_checks
  grep -hE '"test": "(share_on_peer|bandwidth_summary|multi_gpu)"' "$logs/multi_gpu.jsonl" \
    2>/dev/null | tee -a "$summary"
  cp "$logs/multi_gpu.jsonl" "$OUT/multi_gpu.jsonl" 2>/dev/null
}

# --- main --------------------------------------------------------------------------------------

: >"$summary"
for phase in "$@"; do
  if [[ $(type -t "phase_$phase") != function ]]; then
    note "unknown phase '$phase' (tests python dropin parity bench compare multi)"
    continue
  fi
  note "=== phase $phase"
  "phase_$phase"
done
tar czf "$OUT/logs.tgz" -C "$logs" . 2>/dev/null
note "done"
