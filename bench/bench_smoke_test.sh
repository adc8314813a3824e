#!/usr/bin/env bash
# Smoke test of the benchmark programs on the host backend: each runs briefly and prints the
# JSON results bench/report.py expects.
set -euo pipefail

bin=${TEST_SRCDIR:-.}/${TEST_WORKSPACE:-vmm}/bench
tmp=${TEST_TMPDIR:-$(mktemp -d)}

# A small trace: 50 steps of 8 blocks of 2..16 MiB, freed in reverse order.
awk 'BEGIN { id = 0; for (s = 0; s < 50; s++) { for (k = 0; k < 8; k++) {
  printf "a %d %d\n", id + k, (2 + (s * 7 + k * 3) % 15) * 1048576 }
  for (k = 7; k >= 0; k--) printf "f %d\n", id + k; id += 8 } }' >"$tmp/trace.txt"

expect() {  # expect FILE METRIC: FILE has a result line for METRIC
  grep -q "\"metric\": \"$2\"" "$1" || { echo "no $2 in $1:"; cat "$1"; exit 1; }
}

"$bin/replay" --trace="$tmp/trace.txt" --backend=host --warm_reps=1 \
  --large_page_mib=0 --growth_fraction=0,0.05 --max_growth_extra_mib=64,inf >"$tmp/replay.jsonl"
expect "$tmp/replay.jsonl" peak_reserved_over_peak_allocated
expect "$tmp/replay.jsonl" num_device_alloc_plus_free
expect "$tmp/replay.jsonl" ns_per_op_warm
[[ $(grep -c peak_reserved_over_peak_allocated "$tmp/replay.jsonl") -eq 4 ]]

"$bin/growth_bench" --backend=host --reps=2 --grow_mib=64 --chunk_mib=0,2 >"$tmp/growth.jsonl"
expect "$tmp/growth.jsonl" grow_over_bare

"$bin/move_bench" --backend=host --reps=2 --chunks=4 --chunk_mib=2,8 >"$tmp/move.jsonl"
expect "$tmp/move.jsonl" caller_us_per_chunk
expect "$tmp/move.jsonl" release_us_per_chunk
expect "$tmp/move.jsonl" create_us
[[ $(grep -c '"metric": "us_per_chunk"' "$tmp/move.jsonl") -eq 12 ]] ||
  { echo "expected 12 us_per_chunk lines:"; cat "$tmp/move.jsonl"; exit 1; }
if "$bin/move_bench" --backend=host --chunk_mib=3 >/dev/null 2>"$tmp/bad_chunk.log"; then
  echo "move_bench accepted --chunk_mib=3"; exit 1
fi
grep -q "'3' is not a positive multiple of the granularity" "$tmp/bad_chunk.log" ||
  { cat "$tmp/bad_chunk.log"; exit 1; }

"$bin/vmm_peer_bench" --allocators=vmm --backend=host --live=8 --iters=1000 --reps=2 \
  --warm_reps=1 --trace="$tmp/trace.txt" >"$tmp/peer.jsonl"
expect "$tmp/peer.jsonl" ns_per_pair
expect "$tmp/peer.jsonl" peak_reserved_over_peak_allocated

"$bin/import_bench" --backend=host --sizes=8M --reps=2 --chunk_sizes=whole,2M --threads=2 \
  >"$tmp/import.jsonl"
expect "$tmp/import.jsonl" critical_path_ns
expect "$tmp/import.jsonl" set_access_ns
expect "$tmp/import.jsonl" xproc_import_buffer_ns
expect "$tmp/import.jsonl" xproc_fd_fetch_ns
# Both handle types, both chunkings, and the import_map variant ran, and nothing failed.
[[ $(grep -c '"metric": "critical_path_ns"' "$tmp/import.jsonl") -eq 12 ]] ||
  { echo "expected 12 critical_path_ns lines:"; cat "$tmp/import.jsonl"; exit 1; }
if grep -q '"error"' "$tmp/import.jsonl"; then cat "$tmp/import.jsonl"; exit 1; fi
# The variant with a wider reservation, with one exported fd held throughout.
"$bin/import_bench" --backend=host --sizes=8M --reps=2 --chunk_sizes=whole --threads=1 \
  --handle_types=posix_fd --reserve_alignments=64M --keep_exported_fd --vmm_path=false \
  >"$tmp/import_align.jsonl"
grep -q '"allocator": "bare_driver/align=64MiB", "metric": "critical_path_ns"' \
  "$tmp/import_align.jsonl" || { cat "$tmp/import_align.jsonl"; exit 1; }

# A malformed size is refused with a message naming it.
if "$bin/import_bench" --backend=host --sizes=8Q --reps=1 >/dev/null 2>"$tmp/bad_size.log"; then
  echo "import_bench accepted --sizes=8Q"; exit 1
fi
grep -q "'8Q' is not a size in bytes" "$tmp/bad_size.log" || { cat "$tmp/bad_size.log"; exit 1; }

# A malformed trace is refused with a message naming the line.
printf 'a 1 100\nf 2\n' >"$tmp/bad.txt"
if "$bin/replay" --trace="$tmp/bad.txt" --backend=host 2>"$tmp/bad.log"; then
  echo "replay accepted a free of an unknown ID"; exit 1
fi
grep -q "bad.txt:2" "$tmp/bad.log"
echo PASS
