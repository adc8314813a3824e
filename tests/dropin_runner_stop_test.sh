#!/usr/bin/env bash
# tests/gpu/dropin/run.sh, ended from outside, leaves none of its cases running: each case runs
# under its own `timeout`, in a process group the ending signal does not reach, and a case left
# running would share the GPU with whatever the caller starts next. Runs the runner with a fake
# python3 (the probes answer as torch would; a case sleeps) on the host and ends it four times:
# its whole process group through `timeout`, the runner's process alone, the runner alone
# while it runs a case marked EXCLUSIVE, and the runner alone while a probe (the check that
# torch runs in both modes, before any case) hangs; then looks for the sleeping processes.
set -uo pipefail
runner="$(pwd)/tests/gpu/dropin/run.sh"
if [[ -d /opt/torch/.venv/bin ]]; then
  # The runner puts that torch first on PATH, ahead of the fake python3.
  echo "SKIP: /opt/torch/.venv/bin exists (a GPU machine); this test is for the host"
  exit 0
fi
work="${TEST_TMPDIR:-$(mktemp -d)}/dropin_stop"
mkdir -p "$work/bin" "$work/site/vmm_torch"
touch "$work/site/vmm_torch/__init__.py"
tag="dropin_fake_case_$$"
cat >"$work/bin/python3" <<FAKE
#!/usr/bin/env bash
if [[ \$1 == -c ]]; then
  [[ -n \${FAKE_PROBE_HANGS:-} ]] && exec -a $tag sleep 300
  if [[ -n \${VMM_TORCH_ENABLE:-} ]]; then echo "vmm_cuda_allocator 0"; else echo "native 0"; fi
  exit 0
fi
exec -a $tag sleep 300
FAKE
chmod +x "$work/bin/python3"
export PATH="$work/bin:$PATH" OUT="$work/out"
cases=(ab_cow_lazy_clone ab_cudnn_rnn_packed mp_put_del_before_read snapshot_consistency)
exclusive=api_mem_get_info_accounting  # marked "# EXCLUSIVE": run alone, after the others
grep -q '^# EXCLUSIVE' "tests/gpu/dropin/case_$exclusive.py" || { echo "FAIL: $exclusive is not EXCLUSIVE"; exit 1; }
fail=0

# shellcheck source=tests/tagged_processes.sh
source tests/tagged_processes.sh
running() { tagged_count "$tag"; }
stop_fakes() { tagged_stop "$tag"; }
# Whether any run began (its output file is made as it starts), so that a check of none left
# running is not passed by a runner ended before it began any.
began() { compgen -G "$OUT/dropin/${began_glob:-case_*.out}" >/dev/null; }
# check WHAT RC WANT_RC LOG: none left running, the exit status as expected, a run began.
check() {
  local n
  n=$(running)
  if [[ $2 -ne $3 || $n -ne 0 ]] || ! began; then
    echo "FAIL: $1 (rc $2, expected $3): $n cases still running; began: $(began && echo yes || echo no)"
    cat "$4"; fail=1
  fi
  stop_fakes
}
# end_alone LOG CASES...: the runner in a session of its own, ended by a TERM to it alone once a
# case runs; its exit status (bounded: a runner that does not end is killed and fails).
end_alone() {
  local log=$1 pid i
  shift
  setsid "$runner" "$work/site" "$@" >"$log" 2>&1 &
  pid=$!
  for i in $(seq 100); do [[ $(running) -gt 0 ]] && break; sleep 0.1; done
  kill -TERM "$pid"
  for i in $(seq 150); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  if kill -0 "$pid" 2>/dev/null; then
    echo "FAIL: the runner did not end within 15 s of a TERM"; kill -KILL -- "-$pid"; fail=1
  fi
  wait "$pid"
}

# 1. A caller's `timeout`: the runner's process group gets the signal.
timeout 4 "$runner" "$work/site" "${cases[@]}" >"$work/log1" 2>&1
check "after a caller's timeout" $? 124 "$work/log1"

# 2. The runner's process alone.
end_alone "$work/log2" "${cases[@]}"
check "after a TERM to the runner" $? 143 "$work/log2"

# 3. The same while it runs a case alone.
end_alone "$work/log3" "$exclusive"
check "after a TERM to the runner during an EXCLUSIVE case" $? 143 "$work/log3"

# 4. The runner alone while a probe hangs (no case has begun; the probe's output file has).
FAKE_PROBE_HANGS=1 end_alone "$work/log4" "${cases[@]}"
began_glob=probe.native.out check "after a TERM to the runner during a probe" $? 143 "$work/log4"

[[ $fail -eq 0 ]] && echo PASS
exit $fail
