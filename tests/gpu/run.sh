#!/usr/bin/env bash
# The GPU machine's half of the test suite and the benchmarks, in one time-boxed script.
#
#   tests/gpu/run.sh PHASES...     (after tests/gpu/prepare.sh here; .gpu/ carried there)
#
# Phases, run in the order given:
#   tests     C++ suites on the CUDA backend without an IMEX channel (POSIX fd fallback),
#             then with one (fabric handles): conformance, pool, sharing, the demo.
#   plugin    pip-installs vmm_torch against the machine's torch and runs its GPU tests.
#   bench     allocator benchmarks beside PyTorch and cudaMallocAsync (bench/run_gpu_bench.sh).
#   train     the training loop under native, expandable-segments and vmm allocators.
#   latency   share latency (with its breakdown) and imported bandwidth against
#             torch.multiprocessing, one step per mode: without an IMEX channel (vmm's automatic
#             choice, PyTorch native, expandable segments), then with one (vmm fabric, automatic,
#             fds; PyTorch native, expandable segments).
#   fanout    one producer, 4 consumers, fabric and fds.
#   dist      vmm_torch.distributed with several ranks on the GPU.
#   final     one bounded run (set DEADLINE) of what the Python issues must show: IMEX channel,
#             pip install, share latency per mode, fan-out, ranks, training.
#   pair      the cached alloc+free pair of every peer alone (builds torch_peer_bench).
#   multiprocess  the multi-process Python tests alone.
#   diag      whether an error thrown inside a LibTorch extension reaches Python in a fresh
#             process, per toolchain variant (tests/gpu/throw_min.py), and vmm's own extension.
#   throwcheck  vmm's extension shares torch's C++ runtime, raises cleanly from an op and
#             from the allocator hook (out of memory) (quick).
#   probe     where share latency goes, with an IMEX channel: the import's driver calls for
#             1 GiB and 8 GiB with the range reserved at wider alignments (import_bench), and
#             share_latency.py --breakdown for vmm fabric and PyTorch native through each queue,
#             with a consumer that sleeps until the tensor comes and one that polls.
#   multi     two GPUs (the nvidia-h200-x2 machine): the C++ two-device tests (peer access of
#             pools, imports on the other GPU, process A on GPU 0 / process B on GPU 1) without
#             and with an IMEX channel, and tests/gpu/multi_gpu.py (a cuda:0 tensor opened on
#             cuda:1 by another process; imported peer-memory read bandwidth against PyTorch's
#             peer copy). With one GPU the C++ tests report SKIPPED and the script a skip line.
# Logs and results go to $OUT (one summary, results.log with every step's log as it ends, a
# tarball of logs, and the key result files). Keep one call under the device's 10 minutes:
# `tests plugin train` and `final` each took 4 to 5 minutes on an H200.
set -uo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
OUT=${OUT:-/tmp/vmm_out}
logs=/tmp/vmm_logs
mkdir -p "$OUT" "$logs"
summary="$OUT/summary.txt"
export PATH="/opt/torch/.venv/bin:$PATH" PYTHONUNBUFFERED=1 OUT
export LD_LIBRARY_PATH="$root/.gpu/lib:${LD_LIBRARY_PATH:-}"
bin="$root/.gpu/bin"

# step NAME SECONDS COMMAND...: output to $logs/NAME.log, one line in the summary, and the log
# appended to $OUT/results.log at once (so that it comes back even if the run is cut short).
# With DEADLINE set (seconds since the start), steps that would begin after it are skipped.
step() {
  local name=$1 limit=$2
  shift 2
  if [[ -n "${DEADLINE:-}" && $SECONDS -ge $DEADLINE ]]; then
    echo "$name: skipped (deadline)" | tee -a "$summary"
    return
  fi
  if [[ -n "${DEADLINE:-}" && $((SECONDS + limit)) -gt $((DEADLINE + 60)) ]]; then
    limit=$((DEADLINE + 60 - SECONDS))
  fi
  local start=$SECONDS
  timeout "$limit" "$@" >"$logs/$name.log" 2>&1
  local rc=$?
  local line="$name: rc=$rc ($((SECONDS - start)) s)"
  local tests
  tests=$(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$logs/$name.log" | tr '\n' ' ')
  [[ -n "$tests" ]] && line="$line $tests"
  echo "$line" | tee -a "$summary"
  [[ $rc -eq 0 ]] || tail -n 8 "$logs/$name.log" | sed 's/^/    /' | tee -a "$summary"
  { echo "===== $name (rc=$rc)"; tail -c 20000 "$logs/$name.log"; } >>"$OUT/results.log"
}

imex_channel() {
  local major
  major=$(awk '/nvidia-caps-imex-channels/{print $1}' /proc/devices)
  [[ -n "$major" ]] || { echo "no nvidia-caps-imex-channels device" | tee -a "$summary"; return 1; }
  mkdir -p /dev/nvidia-caps-imex-channels
  [[ -e /dev/nvidia-caps-imex-channels/channel0 ]] ||
    mknod /dev/nvidia-caps-imex-channels/channel0 c "$major" 0
  echo "IMEX channel 0 created (major $major)" | tee -a "$summary"
}

cxx_suites() {
  local tag=$1
  step "conformance_$tag" 180 env VMM_TEST_BACKEND=cuda "$bin/driver_conformance_test"
  step "cuda_driver_$tag" 60 "$bin/cuda_driver_test"
  step "pool_$tag" 120 env VMM_TEST_BACKEND=cuda "$bin/pool_test"
  step "sharing_$tag" 180 env VMM_TEST_BACKEND=cuda "$bin/sharing_test"
  step "demo_$tag" 60 "$bin/vmm_demo" --size=256M --out="$logs/demo_$tag.json"
}

phase_tests() {
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$summary"
  ls /dev/nvidia-caps-imex-channels 2>/dev/null | sed 's/^/existing IMEX: /' | tee -a "$summary"
  cxx_suites no_imex
  imex_channel && cxx_suites imex
}

phase_plugin() {
  imex_channel  # the fabric tests need it whatever phases ran before
  step pip_install 300 env VMM_LIB="$root/.gpu/lib/libvmm.so" python3 -m pip install -q \
    --no-build-isolation --no-deps --no-index --target /tmp/vmm_site ./torch_plugin/python
  export PYTHONPATH="/tmp/vmm_site:${PYTHONPATH:-}"
  step pytest_gpu 330 python3 -m pytest -v -rfE tests/python
}

phase_bench() {
  step bench 540 bench/run_gpu_bench.sh "$bin" "$root/.gpu/trace.txt" "$logs/bench"
  step pool_bench 120 "$bin/pool_bench" --benchmark_min_time=0.5 \
    --benchmark_out="$logs/pool_bench.json" --benchmark_out_format=json
  cp "$logs/bench/report.md" "$OUT/bench_report.md" 2>/dev/null
  cp "$logs/bench/import.jsonl" "$OUT/import.jsonl" 2>/dev/null
}

# train_runs STEPS SECONDS: the training loop under each allocator, and their comparison
# (deterministic kernels: vmm's losses must equal native's bit for bit). Native runs twice:
# native_repeat shows whether native itself is reproducible, the comparison's noise floor.
train_runs() {
  local steps=$1 limit=$2
  step train_native "$limit" env -u PYTORCH_CUDA_ALLOC_CONF python3 tests/gpu/train_loop.py \
    --allocator native --steps "$steps" --out "$logs/train_native.json"
  step train_native_repeat "$limit" env -u PYTORCH_CUDA_ALLOC_CONF python3 tests/gpu/train_loop.py \
    --allocator native --label native_repeat --steps "$steps" --out "$logs/train_native_repeat.json"
  step train_expandable "$limit" env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 \
    tests/gpu/train_loop.py --allocator expandable --steps "$steps" --out "$logs/train_expandable.json"
  step train_vmm "$limit" python3 tests/gpu/train_loop.py --allocator vmm --steps "$steps" \
    --out "$logs/train_vmm.json" --dump "$logs/vmm_dump.json"
  step train_vmm_fraction "$limit" python3 tests/gpu/train_loop.py --allocator vmm \
    --label vmm_growth_fraction_0.05 --vmm-option growth_fraction=0.05 --steps "$steps" \
    --out "$logs/train_vmm_fraction.json"
  step train_compare 20 python3 tests/gpu/compare_training.py "$logs"/train_*.json
}

phase_train() {
  export PYTHONPATH="/tmp/vmm_site:${PYTHONPATH:-}"
  train_runs "${TRAIN_STEPS:-300}" 300
  step stats_summary 60 python3 -m vmm_torch.stats summarize "$logs/vmm_dump.json"
  step stats_render 60 python3 -m vmm_torch.stats render "$logs/vmm_dump.json" -o "$OUT/vmm_stats.html"
  step stats_torch_viz 120 python3 -m vmm_torch.stats torch-viz "$logs/vmm_dump.json" -o "$OUT/torch_viz.html"
  cp "$logs/vmm_dump.json" "$OUT/vmm_dump.json" 2>/dev/null
}

# The CPUs local to GPU 0 (its PCI device's NUMA node), e.g. 0-7; empty if unknown.
gpu_local_cpus() {
  local bus
  bus=$(nvidia-smi --query-gpu=pci.bus_id --format=csv,noheader 2>/dev/null | head -n 1 |
    tr 'A-Z' 'a-z' | sed 's/^0000\([0-9a-f]\{4\}:\)/\1/')
  cat "/sys/bus/pci/devices/$bus/local_cpulist" 2>/dev/null
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

# Share latency and imported bandwidth per mode, each in its own run of share_latency.py.
# Without an IMEX channel (channel 0 removed if an earlier phase made it): vmm's probe falls
# back to POSIX fds (vmm-auto); then with one: fabric, fds forced, and PyTorch's modes again;
# then vmm fabric and PyTorch native again, alternating, up to SHARE_ROUNDS (3) rounds in all
# (each run is a new pair of processes: how much a figure moves between runs).
phase_latency() {
  ensure_plugin
  echo "CPUs local to the GPU: $(gpu_local_cpus) of $(nproc); $(lscpu | grep -i 'numa node(s)')" |
    tee -a "$summary"
  rm -f /dev/nvidia-caps-imex-channels/channel0
  echo "IMEX channel 0 removed" | tee -a "$summary"
  share_modes no_imex vmm-auto torch-native torch-expandable
  imex_channel
  share_modes imex vmm-fabric vmm-auto vmm-fd torch-native torch-expandable
  local round
  for ((round = 2; round <= ${SHARE_ROUNDS:-3}; round++)); do
    share_modes "imex_round$round" vmm-fabric torch-native
  done
}

phase_fanout() {
  ensure_plugin
  imex_channel
  step fanout_fabric 90 python3 tests/gpu/fanout.py --handle-type fabric --sizes 64M,1G,8G
  step fanout_fd 90 python3 tests/gpu/fanout.py --handle-type posix_fd --sizes 64M,1G,8G
}

# The C++ tests that need two devices (named TwoDevice*), plus HasAccess on one.
multi_suites() {
  local tag=$1 filter='--gtest_filter=*TwoDevice*:*HasAccess*'
  step "multi_conformance_$tag" 120 env VMM_TEST_BACKEND=cuda "$bin/driver_conformance_test" "$filter"
  step "multi_pool_$tag" 90 env VMM_TEST_BACKEND=cuda "$bin/pool_test" "$filter"
  step "multi_sharing_$tag" 120 env VMM_TEST_BACKEND=cuda "$bin/sharing_test" "$filter"
}

# vmm_torch on PYTHONPATH, installed as phase_plugin does unless an earlier phase did.
ensure_plugin() {
  export PYTHONPATH="/tmp/vmm_site:${PYTHONPATH:-}"
  python3 -c "import vmm_torch" 2>/dev/null && return 0
  step pip_install 300 env VMM_LIB="$root/.gpu/lib/libvmm.so" python3 -m pip install -q \
    --no-build-isolation --no-deps --no-index --target /tmp/vmm_site ./torch_plugin/python
}

phase_multi() {
  nvidia-smi --query-gpu=index,name,pci.bus_id,memory.total --format=csv,noheader |
    tee -a "$summary"
  nvidia-smi topo -m 2>/dev/null | head -n 3 | tee -a "$summary"
  local gpus
  gpus=$(nvidia-smi --query-gpu=index --format=csv,noheader | wc -l)
  [[ $gpus -ge 2 ]] || echo "multi: $gpus GPU(s): the two-GPU checks will skip" | tee -a "$summary"
  multi_suites no_imex
  ensure_plugin
  step multi_gpu_posix_fd 240 python3 tests/gpu/multi_gpu.py --handle-type posix_fd \
    --out "$logs/multi_gpu.jsonl"
  if imex_channel; then
    multi_suites imex
    step multi_gpu_fabric 240 python3 tests/gpu/multi_gpu.py --handle-type fabric \
      --out "$logs/multi_gpu.jsonl"
  fi
  grep -hE '"test": "(share_on_peer|bandwidth_summary|multi_gpu)"' "$logs/multi_gpu.jsonl" \
    2>/dev/null | tee -a "$summary"
  cp "$logs/multi_gpu.jsonl" "$OUT/multi_gpu.jsonl" 2>/dev/null
}

# One bounded run of what the issues must show from Python: sharing latency and fan-out,
# ranks, and the training loop under each allocator (vmm with two growth policies).
phase_final() {
  DEADLINE=${DEADLINE:-390}
  SHARE_REPS=${SHARE_REPS:-3} phase_latency
  phase_fanout
  step dist 90 python3 tests/gpu/dist_bench.py --ranks 3 --sizes 64M,1G --reps 3 --time-limit 80
  train_runs "${TRAIN_STEPS:-200}" 60
}

# The cached alloc+free pair alone, every peer side by side (a short run).
phase_pair() {
  local b="$logs/pair"
  mkdir -p "$b"
  step build_torch_peer 150 bench/build_torch_peer.sh "$b/torch_peer_bench"
  step pair_vmm 60 sh -c "'$bin/vmm_peer_bench' --allocators=vmm,cuda_malloc_async > '$b/vmm.jsonl'"
  step pair_torch_native 40 sh -c "env -u PYTORCH_CUDA_ALLOC_CONF '$b/torch_peer_bench' > '$b/native.jsonl'"
  step pair_torch_expandable 40 sh -c "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True '$b/torch_peer_bench' > '$b/expandable.jsonl'"
  step pool_bench 40 "$bin/pool_bench" --benchmark_min_time=0.3
  python3 bench/report.py "$b"/*.jsonl >"$OUT/pair_report.md" 2>>"$summary"
  cat "$b"/*.jsonl >"$OUT/pair.jsonl"
}

phase_probe() {
  imex_channel
  ensure_plugin
  step import_align 120 sh -c "'$bin/import_bench' --backend=cuda --sizes=1G,8G \
    --handle_types=fabric --chunk_sizes=whole --threads=1 --reserve_alignments=512M,1G,8G \
    --reps=7 > '$OUT/import_align.jsonl'"
  local queue wait
  for queue in queue simple; do
    for wait in block poll; do
      step "share_${queue}_$wait" 150 python3 bench/share_latency.py --breakdown \
        --queue "$queue" --consumer-wait "$wait" --modes vmm-fabric,torch-native \
        --sizes 64M,1G,8G --reps 9 --out "$OUT/share.jsonl"
    done
  done
}

# Whether errors thrown inside vmm's extension reach Python: the extension must share torch's
# C++ runtime (it defines no __cxa_throw of its own), and a hostile view raises RuntimeError.
phase_throwcheck() {
  ensure_plugin
  step ext_runtime 20 sh -c 'so=$(ls /tmp/vmm_site/vmm_torch/_C*.so); ldd "$so" | grep stdc;
    n=$(nm -D --defined-only "$so" | grep -c __cxa_throw); echo "__cxa_throw defined: $n";
    [ "$n" -eq 0 ]'
  step throw_probe 60 python3 tests/gpu/throw_probe.py
  step throw_probe_after_torch_error 60 python3 tests/gpu/throw_probe.py --torch-error-first
  step oom_probe 60 python3 tests/gpu/oom_probe.py
}

# Which toolchains give LibTorch extensions whose errors reach Python (tests/gpu/throw_min.py),
# then the same for vmm's own extension.
phase_diag() {
  ensure_plugin
  step toolchain 30 sh -c 'which -a c++ g++; echo "CXX=${CXX:-}"; for f in libstdc++.so libstdc++.a; do echo "$f: $(c++ -print-file-name=$f)"; done; ldd "$(python3 -c "import torch,os;print(os.path.dirname(torch.__file__))")/lib/libc10.so" | grep -E "stdc|gcc"'
  step throw_min 300 python3 tests/gpu/throw_min.py
  phase_throwcheck
}

# The multi-process Python tests alone (quicker than `plugin` when only they changed).
phase_multiprocess() {
  ensure_plugin
  step pytest_multiprocess 150 python3 -m pytest -q -x tests/python/test_multiprocess.py
}

phase_dist() {
  export PYTHONPATH="/tmp/vmm_site:${PYTHONPATH:-}"
  step dist 300 python3 tests/gpu/dist_bench.py --ranks 4 --sizes 64M,1G
}

: >"$summary"
for phase in "$@"; do
  echo "=== phase $phase" | tee -a "$summary"
  "phase_$phase"
done
tar czf "$OUT/logs.tgz" -C "$logs" . 2>/dev/null
echo "done" | tee -a "$summary"
