# tests/tagged_processes.sh: processes a test started under a name of its own (`exec -a TAG`),
# found through /proc (no procps needed). Sourced by the tests of the GPU scripts' stopping.

# tagged_count TAG: how many processes run whose command line begins with TAG.
tagged_count() { grep -l -a "^$1" /proc/[0-9]*/cmdline 2>/dev/null | wc -l; }

# tagged_stop TAG: ends them (a failed test's leftovers).
tagged_stop() {
  local f pid
  for f in $(grep -l -a "^$1" /proc/[0-9]*/cmdline 2>/dev/null); do
    pid=${f#/proc/}
    kill "${pid%/cmdline}" 2>/dev/null
  done
}
