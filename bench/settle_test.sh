#!/usr/bin/env bash
# A working set that keeps missing below its allocated high settles (allocator/reclaim_policy.h
# GrowthCost, kSettleMoves): inference_varying at seed 1, replayed from a warm cache 36 and 48
# times on the host backend with the default pool, makes no driver call in its last twelve
# replays (with no settling, 320 in each), also when the pool's peak statistics are reset
# before each replay (as a training loop that logs a peak per step does: the high that
# settling counts from is not that statistic), and also under a memory limit 2.1% above its
# peak allocated bytes (7,900 MiB), where a settling miss takes only plans that create within
# the limit (with 8 MiB pages and every plan weighed alike there, 688 calls a replay); and its
# cold peak ratio is 1.0016 (with 8 MiB pages and chunks of several pages for any request
# before the first move, 1.0018).
set -euo pipefail

here=${TEST_SRCDIR:-.}/${TEST_WORKSPACE:-vmm}/bench
tmp=${TEST_TMPDIR:-$(mktemp -d)}
python3 "$here/traces.py" inference_varying --seed 1 >"$tmp/trace.txt"

# The replay's mean driver calls per warm replay, after $1 warm replays; $2: more flags.
warm_calls() {
  local out="$tmp/out.$1.${2//[^a-z0-9]/_}" mean
  "$here/replay" --trace="$tmp/trace.txt" --backend=host --warm_reps="$1" ${2:-} >"$out" 2>&1 ||
    { echo "replay --warm_reps=$1 ${2:-} failed:" >&2; cat "$out" >&2; return 1; }
  mean=$(grep -o '"metric": "driver_calls_warm", "value": [0-9.]*' "$out" | grep -o '[0-9.]*$') ||
    { echo "replay --warm_reps=$1 ${2:-} reported no driver_calls_warm:" >&2; cat "$out" >&2; return 1; }
  echo "$mean"
}
for flags in "" "--reset_peaks" "--options=memory_limit=7900M"; do
  mean36=$(warm_calls 36 "$flags")
  mean48=$(warm_calls 48 "$flags")
  late=$(python3 -c "print(round(48 * $mean48 - 36 * $mean36))")
  [[ $late -eq 0 ]] || {
    echo "replays 37-48 ${flags:-(peaks kept)} made $late driver calls (means: $mean36 over 36, $mean48 over 48)"
    exit 1
  }
done
cold=$("$here/replay" --trace="$tmp/trace.txt" --backend=host --warm_reps=0 2>&1 | tail -1)
grep -q "ratio=1.0016 " <<<"$cold" || { echo "cold replay: $cold"; exit 1; }
