#!/usr/bin/env bash
# tests/gpu/dropin/run.sh, ended from outside, leaves none of its cases running: each case runs
# under its own `timeout`, in a process group the ending signal does not reach, and a case left
# running would share the GPU with whatever the caller starts next. Runs the runner with a fake
# python3 (the probes answer as torch would; a case sleeps) on the host, ends it twice (its
# whole process group through `timeout`, then the runner's process alone) and looks for the
# sleeping cases.
set -uo pipefail
runner="$(pwd)/tests/gpu/dropin/run.sh"
work="${TEST_TMPDIR:-$(mktemp -d)}/dropin_stop"
mkdir -p "$work/bin" "$work/site/vmm_torch"
touch "$work/site/vmm_torch/__init__.py"
tag="dropin_fake_case_$$"
cat >"$work/bin/python3" <<FAKE
#!/usr/bin/env bash
if [[ \$1 == -c ]]; then
  if [[ -n \${VMM_TORCH_ENABLE:-} ]]; then echo "vmm_cuda_allocator 0"; else echo "native 0"; fi
  exit 0
fi
exec -a $tag sleep 300
FAKE
chmod +x "$work/bin/python3"
export PATH="$work/bin:$PATH" OUT="$work/out"
cases=(ab_cow_lazy_clone ab_cudnn_rnn_packed mp_put_del_before_read snapshot_consistency)
fail=0

# How many fake cases run (read from /proc: no procps needed).
running() { grep -l -a "^$tag" /proc/[0-9]*/cmdline 2>/dev/null | wc -l; }
left() { sleep 1; running; }
stop_fakes() {
  local f pid
  for f in $(grep -l -a "^$tag" /proc/[0-9]*/cmdline 2>/dev/null); do
    pid=${f#/proc/}; kill "${pid%/cmdline}" 2>/dev/null
  done
}
# What was left, for a failure's log.
show() {
  echo "pid files: $(ls "$OUT/dropin/running" 2>/dev/null | tr '\n' ' ')"
  echo "fake cases running: $(running)"
}

# 1. A caller's `timeout`: the runner's process group gets the signal.
timeout 4 "$runner" "$work/site" "${cases[@]}" >"$work/log1" 2>&1
rc=$?
n=$(left)
if [[ $rc -ne 124 || $n -ne 0 ]]; then
  echo "FAIL: after timeout (rc $rc): $n cases still running"; show; cat "$work/log1"; fail=1
fi
stop_fakes

# 2. The runner's process alone.
setsid "$runner" "$work/site" "${cases[@]}" >"$work/log2" 2>&1 &
pid=$!
for _ in $(seq 50); do [[ $(running) -gt 0 ]] && break; sleep 0.1; done
[[ $(running) -gt 0 ]] || { echo "FAIL: no case began"; cat "$work/log2"; fail=1; }
kill -TERM "$pid"
wait "$pid"
rc=$?
n=$(left)
if [[ $rc -ne 143 || $n -ne 0 ]]; then
  echo "FAIL: after TERM to the runner (rc $rc): $n cases still running"; show; cat "$work/log2"; fail=1
fi
stop_fakes
[[ $fail -eq 0 ]] && echo PASS
exit $fail
