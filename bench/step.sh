# bench/step.sh: one time-boxed step of a benchmark script (sourced by run_gpu_bench.sh and
# trace_suite.sh, which set $out, the output folder, and $status, 0 until a step fails).

# shellcheck source=bench/bounded.sh
source "$(dirname "${BASH_SOURCE[0]}")/bounded.sh"

# step NAME SECONDS COMMAND...: stdout to $out/NAME.jsonl, stderr to $out/NAME.log; says the
# exit status and the seconds taken, with the log's last lines on failure; the first failure's
# status is kept in $status.
step() {
  local name=$1 limit=$2
  shift 2
  echo "== $name: $*"
  local start=$SECONDS
  bounded "$limit" "$@" >"$out/$name.jsonl" 2>"$out/$name.log"
  local rc=$?
  echo "   rc=$rc, $((SECONDS - start)) s"
  if [[ $rc -ne 0 ]]; then
    tail -n 5 "$out/$name.log"
    [[ $status -ne 0 ]] || status=$rc
  fi
}
