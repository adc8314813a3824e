// Fuzz target for option text: vmm::ParsePoolOptions (pool_options.h) and vmm::ParseByteSize
// (byte_size.h), which read environment variables and arguments of the C interface.
//
// Beyond "does not crash" (with ASan and UBSan): every failure is InvalidArgument with a
// message; parsed options are in range (growth_fraction in [0, 1], device indices >= 0, the
// caller's device untouched); a size that parses reads the same from its decimal form, and the
// same as a size option's value. A violation traps, so libFuzzer records the input.
//
// Built with --config=fuzz this links libFuzzer; otherwise fuzz_replay_main.cc supplies a
// main() that runs the target over files (see pool_options_fuzzer_corpus_test).
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "allocator/byte_size.h"
#include "allocator/pool_options.h"

namespace vmm {
namespace {

void Check(bool condition, const char* what) {
  if (condition) return;
  std::fprintf(stderr, "pool_options_fuzzer: %s\n", what);
  __builtin_trap();
}

void CheckFailure(const absl::Status& status, const char* who) {
  Check(status.code() == absl::StatusCode::kInvalidArgument, who);
  Check(!status.message().empty(), "a failure without a message");
}

void FuzzPoolOptions(absl::string_view text) {
  PoolOptions defaults;
  defaults.device = 3;
  absl::StatusOr<PoolOptions> options = ParsePoolOptions(text, defaults);
  if (!options.ok()) {
    CheckFailure(options.status(),
                 "ParsePoolOptions failed with a code other than InvalidArgument");
    return;
  }
  Check(options->device == 3, "option text changed the device");
  Check(options->growth_fraction >= 0 && options->growth_fraction <= 1,
        "growth_fraction outside [0, 1]");
  for (int device : options->peer_devices) Check(device >= 0, "a negative peer device");
}

void FuzzByteSize(absl::string_view text) {
  absl::StatusOr<uint64_t> bytes = ParseByteSize(text);
  if (!bytes.ok()) {
    CheckFailure(bytes.status(), "ParseByteSize failed with a code other than InvalidArgument");
  } else {
    absl::StatusOr<uint64_t> again = ParseByteSize(absl::StrCat(*bytes));
    Check(again.ok() && *again == *bytes, "a size does not read the same from its decimal form");
    if (*bytes <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      Check(!FormatBytes(static_cast<int64_t>(*bytes)).empty(), "FormatBytes printed nothing");
    }
  }
  // A size option's value is read by ParseByteSize (commas would split the text into options).
  if (text.find(',') != absl::string_view::npos) return;
  absl::StatusOr<PoolOptions> options = ParsePoolOptions(absl::StrCat("max_chunk=", text));
  Check(options.ok() == bytes.ok(), "ParsePoolOptions and ParseByteSize disagree on a size");
  if (bytes.ok()) Check(options->max_chunk == *bytes, "a size option reads another value");
}

}  // namespace
}  // namespace vmm

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const absl::string_view text(reinterpret_cast<const char*>(data), size);
  vmm::FuzzPoolOptions(text);
  vmm::FuzzByteSize(text);
  return 0;
}
