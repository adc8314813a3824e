#!/usr/bin/env bash
# A working set that keeps missing below its allocated high settles (allocator/reclaim_policy.h
# GrowthCost, kSettleMoves): inference_varying at seed 1, replayed from a warm cache 12 and 24
# times on the host backend, makes no driver call in its last twelve replays (weighing moves at
# a sixty-fourth below the high with no settling, it made 705 in each), and its cold peak
# ratio stays at what the one weight gives it (1.0018; 1.0070 with a half below the high).
set -euo pipefail

here=${TEST_SRCDIR:-.}/${TEST_WORKSPACE:-vmm}/bench
tmp=${TEST_TMPDIR:-$(mktemp -d)}
python3 "$here/traces.py" inference_varying --seed 1 >"$tmp/trace.txt"

# The replay's mean driver calls per warm replay, after $1 warm replays.
warm_calls() {
  "$here/replay" --trace="$tmp/trace.txt" --backend=host --warm_reps="$1" >"$tmp/out.$1" 2>&1 ||
    { cat "$tmp/out.$1"; exit 1; }
  grep -o '"metric": "driver_calls_warm", "value": [0-9.]*' "$tmp/out.$1" | grep -o '[0-9.]*$'
}
mean12=$(warm_calls 12)
mean24=$(warm_calls 24)
late=$(python3 -c "print(round(24 * $mean24 - 12 * $mean12))")
[[ $late -eq 0 ]] ||
  { echo "replays 13-24 made $late driver calls (means: $mean12 over 12, $mean24 over 24)"; exit 1; }
"$here/replay" --trace="$tmp/trace.txt" --backend=host --warm_reps=0 2>&1 | tail -1 |
  grep -q "ratio=1.0018 " ||
  { echo "cold replay:"; "$here/replay" --trace="$tmp/trace.txt" --backend=host --warm_reps=0 2>&1 | tail -1; exit 1; }
