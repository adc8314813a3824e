// Fuzz target for BufferDescriptor::Decode(), which reads bytes from other processes.
//
// Beyond "does not crash" (with ASan and UBSan), every input that decodes must be canonical:
// Encode() gives back exactly the input, and FromHandles() on the decoded parts accepts them
// and builds an equal descriptor. A violation traps, so libFuzzer records the input.
//
// Built with --config=fuzz this links libFuzzer; otherwise fuzz_replay_main.cc supplies a
// main() that runs the target over files (see descriptor_fuzzer_corpus_test).
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "allocator/descriptor.h"

namespace vmm {
namespace {

void Fail(const char* what) {
  std::fprintf(stderr, "descriptor_fuzzer: %s\n", what);
  __builtin_trap();
}

void Check(bool condition, const char* what) {
  if (!condition) Fail(what);
}

// Builds the same descriptor again from its parts, as an importer would from a transport
// other than the binary encoding.
void CheckFromHandlesAgrees(const BufferDescriptor& decoded) {
  constexpr uint64_t kInt64Max = std::numeric_limits<int64_t>::max();
  std::vector<std::string> handles;
  handles.reserve(decoded.handles().size());
  for (const BufferDescriptor::Handle& handle : decoded.handles()) {
    handles.emplace_back(handle.begin(), handle.end());
  }
  std::vector<int64_t> sizes;
  sizes.reserve(decoded.sizes().size());
  for (uint64_t size : decoded.sizes()) {
    // The default total limit (1 PiB) keeps every value within int64_t.
    Check(size <= kInt64Max, "decoded allocation size above INT64_MAX");
    sizes.push_back(static_cast<int64_t>(size));
  }
  Check(decoded.size() <= kInt64Max && decoded.offset() <= kInt64Max,
        "decoded size or offset above INT64_MAX");
  absl::StatusOr<BufferDescriptor> rebuilt = BufferDescriptor::FromHandles(
      decoded.handle_type(), handles, sizes, static_cast<int64_t>(decoded.size()),
      decoded.owner_uuid(), static_cast<int64_t>(decoded.offset()));
  Check(rebuilt.ok(), "FromHandles rejects the parts of a decoded descriptor");
  Check(*rebuilt == decoded, "FromHandles builds a different descriptor");
  Check(rebuilt->mapped_size() == decoded.mapped_size(), "mapped sizes differ");
  Check(rebuilt->Encode() == decoded.Encode(), "rebuilt descriptor encodes differently");
}

void FuzzDecode(absl::string_view bytes, const DecodeLimits& limits) {
  absl::StatusOr<BufferDescriptor> decoded = BufferDescriptor::Decode(bytes, limits);
  if (!decoded.ok()) {
    Check(decoded.status().code() == absl::StatusCode::kInvalidArgument,
          "Decode failed with a code other than InvalidArgument");
    Check(!decoded.status().message().empty(), "Decode failed without a message");
    return;
  }
  Check(decoded->Encode() == bytes, "Encode(Decode(bytes)) != bytes");
  Check(decoded->offset() <= decoded->mapped_size() &&
            decoded->size() <= decoded->mapped_size() - decoded->offset(),
        "decoded buffer lies outside its allocations");
  CheckFromHandlesAgrees(*decoded);
}

}  // namespace
}  // namespace vmm

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const absl::string_view bytes(reinterpret_cast<const char*>(data), size);
  vmm::FuzzDecode(bytes, vmm::DecodeLimits{});
  // An importer passes its allocation granularity (2 MiB on current GPUs).
  vmm::DecodeLimits gpu_limits;
  gpu_limits.granularity = uint64_t{2} << 20;
  vmm::FuzzDecode(bytes, gpu_limits);
  return 0;
}
