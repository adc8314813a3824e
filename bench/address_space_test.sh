#!/usr/bin/env bash
# A pool that moves pages reserves address space enough that the blocks left scattered across
# it do not refuse a request that memory could serve (allocator/pool_options.h reserve_size).
# A long-context prefill of a 4-layer model (bench/traces.py long_prefill, 16k and 32k tokens:
# peak 1.52 GiB) on a host device of 2 GiB: with twice the GPU's memory reserved (the range
# of before) a score matrix of 896 MiB found no gap of its length with 670 MiB in the pool;
# with the default range the replay ends, within 1.02 (1.0077 when written).
set -euo pipefail

here=${TEST_SRCDIR:-.}/${TEST_WORKSPACE:-vmm}/bench
tmp=${TEST_TMPDIR:-$(mktemp -d)}
python3 "$here/traces.py" long_prefill --set layers=4 --set contexts=16384,32768 >"$tmp/trace.txt"

# replay FLAGS...: the replay's output on the 2 GiB device, and its exit status.
replay() {
  "$here/replay" --trace="$tmp/trace.txt" --backend=host --warm_reps=2 --host_capacity_gib=2 "$@" \
    >"$tmp/out" 2>&1
}

if replay --options=reserve_size=4G; then
  echo "with twice the GPU's memory reserved the replay was expected to run out of address space:"
  tail -3 "$tmp/out"
  exit 1
fi
grep -q "no gap of 896.00 MiB left in the pool's reserved address range" "$tmp/out" || {
  echo "with twice the GPU's memory reserved the replay failed otherwise:"
  tail -3 "$tmp/out"
  exit 1
}
replay || { echo "with the default range the replay failed:"; tail -3 "$tmp/out"; exit 1; }
ratio=$(grep -o 'ratio=[0-9.]*' "$tmp/out" | tail -1 | cut -d= -f2)
python3 -c "import sys; sys.exit(0 if 0 < float('${ratio:-0}') <= 1.02 else 1)" ||
  { echo "default range: peak ratio ${ratio:-none} above 1.02: $(tail -1 "$tmp/out")"; exit 1; }
