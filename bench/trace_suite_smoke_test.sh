#!/usr/bin/env bash
# Smoke test of trace_suite.sh on the host backend: every trace of traces.py, at a small
# scale, replayed by vmm, with a row of report.md per trace; then a variant of a workload
# (WORKLOAD:PARAM=VALUE) beside a malformed NAME, which is refused while the variant still runs.
set -euo pipefail

here=${TEST_SRCDIR:-.}/${TEST_WORKSPACE:-vmm}/bench
tmp=${TEST_TMPDIR:-$(mktemp -d)}

BACKEND=host TRACE_SCALE=0.05 WARM_REPS=1 STEP_LIMIT=60 TRACE_DIR="$tmp/traces" \
  "$here/trace_suite.sh" "$here" "$tmp/out" >"$tmp/suite.log" 2>&1 ||
  { cat "$tmp/suite.log"; exit 1; }
names=$(python3 "$here/traces.py" --list | awk '{print $1}')
[[ $(wc -w <<<"$names") -ge 6 ]] || { echo "traces.py --list: $names"; exit 1; }
for name in $names; do
  [[ -s "$tmp/traces/$name.txt" ]] || { echo "no trace $name"; exit 1; }
  grep -q '"metric": "ns_per_op_warm"' "$tmp/out/$name.vmm.jsonl" ||
    { echo "no replay results for $name:"; cat "$tmp/out/$name.vmm.jsonl"; exit 1; }
  for row in "peak_reserved_over_peak_allocated (x) | [0-9.]*" "driver_map | [0-9,]*" \
    "moved_bytes | [0-9.,]* [GM]iB" "driver_calls_warm | [0-9.,]*" \
    "driver_ns_per_op_cold (ns) | [0-9.,]*[1-9][0-9.,]*"; do
    grep -q "^| trace_replay/$name | $row |" "$tmp/out/report.md" ||
      { echo "no row '$row' for $name:"; cat "$tmp/out/report.md"; exit 1; }
  done
done
# A variant is named WORKLOAD.PARAM-VALUE, a training variant keeps the training target, and a
# malformed NAME fails the run (exit status 1) without stopping the others; @FILE adds the
# NAMEs of a file (here the project's list of variants, each of which must replay).
status=0
BACKEND=host TRACE_SCALE=0.05 WARM_REPS=0 STEP_LIMIT=60 \
  "$here/trace_suite.sh" "$here" "$tmp/variants" "churn:" "training:layers=4" \
  "@$here/trace_variants.txt" >"$tmp/variants.log" 2>&1 || status=$?
[[ $status -eq 1 ]] ||
  { echo "a malformed NAME gave exit status $status"; cat "$tmp/variants.log"; exit 1; }
grep -q "trace 'churn:': not WORKLOAD" "$tmp/variants.log" ||
  { echo "no refusal of 'churn:'"; cat "$tmp/variants.log"; exit 1; }
training_row="^| trace_replay/training.layers-4 | peak_reserved_over_peak_allocated (x) |"
training_row+=" [0-9.]* | ≤ 1.01"
grep -q "$training_row" "$tmp/variants/report.md" ||
  { echo "no training variant row"; cat "$tmp/variants/report.md"; exit 1; }
listed=0
while read -r spec; do
  name=${spec%%:*}
  rest=${spec#"$name"}
  rest=${rest//:/.}
  rest=${rest//=/-}
  name+=${rest//,/_}
  grep -q "^| trace_replay/$name | driver_map | [0-9,]* |" "$tmp/variants/report.md" ||
    { echo "no row for $name ($spec)"; cat "$tmp/variants.log"; exit 1; }
  listed=$((listed + 1))
done < <(sed 's/#.*//' "$here/trace_variants.txt" | awk 'NF {print $1}')
[[ $listed -ge 10 ]] || { echo "trace_variants.txt lists $listed variants"; exit 1; }
# TRACE_ROUNDS=3: every allocator replays each trace three times (round K's files end in .rK),
# and the report has one row per trace and metric with the median of the rounds.
TRACE_ROUNDS=3 BACKEND=host TRACE_SCALE=0.05 WARM_REPS=1 STEP_LIMIT=60 \
  "$here/trace_suite.sh" "$here" "$tmp/rounds" training kv_serving >"$tmp/rounds.log" 2>&1 ||
  { cat "$tmp/rounds.log"; exit 1; }
for f in training.vmm training.vmm.r2 training.vmm.r3; do
  grep -q '"metric": "ns_per_op_cold"' "$tmp/rounds/$f.jsonl" ||
    { echo "round file $f.jsonl:"; ls "$tmp/rounds"; exit 1; }
done
[[ ! -e "$tmp/rounds/training.vmm.r4.jsonl" ]] || { echo "a fourth round ran"; exit 1; }
[[ $(grep -c "^| trace_replay/training | ns_per_op_cold (ns) |" "$tmp/rounds/report.md") -eq 1 ]] ||
  { echo "not one cold row:"; cat "$tmp/rounds/report.md"; exit 1; }
python3 - "$tmp/rounds" <<'PY' || exit 1
import json, re, statistics, sys
d = sys.argv[1]
def cold(f):
    for line in open(f"{d}/{f}.jsonl"):
        if line.startswith("{"):
            o = json.loads(line)
            if o.get("metric") == "ns_per_op_cold":
                return o["value"]
want = statistics.median(cold(f) for f in ["training.vmm", "training.vmm.r2", "training.vmm.r3"])
prefix = "| trace_replay/training | ns_per_op_cold"
row = next(l for l in open(f"{d}/report.md") if l.startswith(prefix))
got = float(re.match(r"\| [^|]+\| [^|]+\| ([0-9.,]+)", row).group(1).replace(",", ""))
if abs(got - want) > max(1.0, 0.001 * want):
    sys.exit(f"cold row {got} is not the median of the rounds, {want}: {row}")
PY
# An earlier run's later rounds do not join a run with fewer.
TRACE_ROUNDS=1 BACKEND=host TRACE_SCALE=0.05 WARM_REPS=1 STEP_LIMIT=60 \
  "$here/trace_suite.sh" "$here" "$tmp/rounds" training kv_serving >"$tmp/rounds1.log" 2>&1 ||
  { cat "$tmp/rounds1.log"; exit 1; }
[[ ! -e "$tmp/rounds/training.vmm.r2.jsonl" && -s "$tmp/rounds/training.vmm.jsonl" ]] ||
  { echo "round files left from the run of three rounds:"; ls "$tmp/rounds"; exit 1; }
for bad in 0 x -1 1000 18446744073709551616; do
  rc=0
  TRACE_ROUNDS=$bad BACKEND=host "$here/trace_suite.sh" "$here" "$tmp/bad" training \
    >"$tmp/bad.log" 2>&1 || rc=$?
  [[ $rc -eq 2 ]] && grep -q -- "TRACE_ROUNDS=$bad: not a whole number" "$tmp/bad.log" ||
    { echo "TRACE_ROUNDS=$bad gave $rc:"; cat "$tmp/bad.log"; exit 1; }
done
echo PASS
