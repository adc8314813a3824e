# bench/bounded.sh: one command under a time limit that ends with the script that runs it
# (sourced by bench/step.sh, tests/gpu/run.sh and tests/gpu/dropin/run.sh).

# bounded SECONDS COMMAND...: COMMAND under `timeout SECONDS`; its status (124 past the limit).
# `timeout` runs COMMAND in a process group of its own, which a signal to the calling script's
# group does not reach: ended meanwhile (TERM, INT or HUP, as a caller's own `timeout` does),
# the calling shell ends that group too and waits for it before it exits (143), so that no
# step outlives the script and shares the GPU with what its caller starts next. Sets and then
# clears the shell's traps for those signals. With `bounded_pid_file` set (a variable of the
# caller's), the pid of that `timeout` (the group's leader) is written there while it runs, for
# a parent that is ended alone to end the group (tests/gpu/dropin/run.sh).
bounded() {
  local limit=$1 rc
  shift
  timeout "$limit" "$@" &
  bounded_pid=$!
  [[ -n ${bounded_pid_file:-} ]] && echo "$bounded_pid" >"$bounded_pid_file"
  # Ignoring the signals while it works: a caller's `timeout` signals its child and then the
  # child's whole group, and the second signal would end the handler half done.
  trap 'trap "" TERM INT HUP; kill -TERM -- "$bounded_pid" "-$bounded_pid" 2>/dev/null;
        wait "$bounded_pid"; exit 143' TERM INT HUP
  # A trapped signal interrupts `wait`; until then, wait until the command has ended.
  while wait "$bounded_pid"; rc=$?; kill -0 "$bounded_pid" 2>/dev/null; do :; done
  trap - TERM INT HUP
  [[ -n ${bounded_pid_file:-} ]] && rm -f "$bounded_pid_file"
  bounded_pid=
  return "$rc"
}
