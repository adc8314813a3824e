#!/usr/bin/env bash
# bench/bounded.sh (the time-boxed steps of tests/gpu/run.sh and bench/step.sh): a command under
# `bounded` ends with the script that runs it, ended through a caller's `timeout` (the script's
# whole group) or by a signal to the script alone; otherwise its status is the command's (124
# past the limit) and the traps are cleared after it.
set -uo pipefail
root=$(pwd)
work="${TEST_TMPDIR:-$(mktemp -d)}/bounded"
mkdir -p "$work/out"
tag="bounded_fake_step_$$"
printf '#!/usr/bin/env bash\nexec -a %s sleep 300\n' "$tag" >"$work/sleeper"
chmod +x "$work/sleeper"
fail=0
# shellcheck source=tests/tagged_processes.sh
source tests/tagged_processes.sh
running() { tagged_count "$tag"; }
stop_fakes() { tagged_stop "$tag"; }
expect() {  # WHAT GOT WANT
  if [[ $2 != "$3" ]]; then echo "FAIL: $1: got '$2', expected '$3'"; fail=1; fi
}
# A script that runs the sleeper as a step, through bounded directly or through bench/step.sh.
cat >"$work/direct.sh" <<EOF2
source "$root/bench/bounded.sh"
bounded 60 "$work/sleeper"
echo "not reached: \$?"
EOF2
cat >"$work/via_step.sh" <<EOF2
out="$work/out" status=0
source "$root/bench/step.sh"
step sleeper 60 "$work/sleeper"
EOF2

for script in direct via_step; do
  # 1. A caller's timeout.
  timeout 2 bash "$work/$script.sh" >"$work/$script.log" 2>&1
  rc=$?
  sleep 0.5
  expect "$script: status after a caller's timeout" "$rc" 124
  expect "$script: steps left after a caller's timeout" "$(running)" 0
  stop_fakes
  # 2. The script alone.
  setsid bash "$work/$script.sh" >"$work/$script.log" 2>&1 &
  pid=$!
  for _ in $(seq 50); do [[ $(running) -gt 0 ]] && break; sleep 0.1; done
  expect "$script: step began" "$(running)" 1
  kill -TERM "$pid"
  for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  kill -0 "$pid" 2>/dev/null && { echo "FAIL: $script did not end"; kill -KILL -- "-$pid"; fail=1; }
  wait "$pid"
  expect "$script: status after a TERM to it" "$?" 143
  sleep 0.2
  expect "$script: steps left after a TERM to it" "$(running)" 0
  stop_fakes
done

# 3. Statuses, and the traps cleared afterwards.
source "$root/bench/bounded.sh"
bounded 5 true; expect "status of true" $? 0
bounded 5 sh -c 'exit 3'; expect "status of exit 3" $? 3
bounded 1 sleep 5; expect "status past the limit" $? 124
expect "TERM trap after bounded" "$(trap -p TERM)" ""

[[ $fail -eq 0 ]] && echo PASS
exit $fail
