#!/bin/bash
# Replays a fuzz target's seed corpus: run_fuzzer_corpus.sh FUZZER CORPUS_DIR
#
# FUZZER is the target built without libFuzzer (its main() is fuzz_replay_main.cc). CORPUS_DIR
# is relative to the runfiles root under `bazel test`, else to the current directory. Fails
# when the corpus is missing or empty, or when the target fails on any input.
set -euo pipefail

if [[ $# -ne 2 ]]; then
  echo "usage: $0 FUZZER CORPUS_DIR" >&2
  exit 2
fi
fuzzer="$1"
if [[ -n "${TEST_SRCDIR:-}" ]]; then
  corpus="${TEST_SRCDIR}/vmm/$2"
else
  corpus="$2"
fi

if [[ ! -d "${corpus}" ]]; then
  echo "corpus directory ${corpus} not found" >&2
  exit 1
fi
count=$(find -L "${corpus}" -maxdepth 1 -type f | wc -l)
if [[ "${count}" -eq 0 ]]; then
  echo "corpus directory ${corpus} is empty" >&2
  exit 1
fi

echo "replaying ${count} inputs from ${corpus}"
"${fuzzer}" "${corpus}"
