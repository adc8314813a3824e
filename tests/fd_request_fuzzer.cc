// Fuzz target for what the fd server reads from other processes: a request
// (fd_share_internal::DecodeFdRequest), and for the importer, an error reply
// (DecodeFdErrorReply) and a token (FdToken::Decode).
//
// Beyond "does not crash" (with ASan and UBSan): a request that decodes holds 1 to
// kMaxTokensPerRequest tokens and encodes back to exactly the input; a token likewise; a
// rejected request is InvalidArgument with a message; an error reply never reads as OK. A
// violation traps, so libFuzzer records the input.
//
// Built with --config=fuzz this links libFuzzer; otherwise fuzz_replay_main.cc supplies a
// main() that runs the target over files (see fd_request_fuzzer_corpus_test).
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "allocator/fd_share.h"
#include "allocator/fd_share_internal.h"

namespace vmm {
namespace {

void Check(bool condition, const char* what) {
  if (condition) return;
  std::fprintf(stderr, "fd_request_fuzzer: %s\n", what);
  __builtin_trap();
}

void FuzzRequest(absl::Span<const uint8_t> bytes) {
  absl::StatusOr<std::vector<fd_share_internal::FdRequestEntry>> entries =
      fd_share_internal::DecodeFdRequest(bytes);
  if (!entries.ok()) {
    Check(entries.status().code() == absl::StatusCode::kInvalidArgument,
          "DecodeFdRequest failed with a code other than InvalidArgument");
    Check(!entries.status().message().empty(), "DecodeFdRequest failed without a message");
    return;
  }
  Check(!entries->empty() && entries->size() <= fd_share_internal::kMaxTokensPerRequest,
        "a request of no tokens, or of more than one message's fds");
  const std::vector<uint8_t> encoded = fd_share_internal::EncodeFdRequest(*entries);
  Check(absl::MakeConstSpan(encoded) == bytes, "EncodeFdRequest(DecodeFdRequest(bytes)) != bytes");
}

void FuzzErrorReply(absl::Span<const uint8_t> bytes) {
  const std::optional<absl::Status> error = fd_share_internal::DecodeFdErrorReply(bytes);
  if (!error.has_value()) return;
  Check(!error->ok(), "an error reply read as OK");
  // What the server sends reads back as sent (the message up to 512 bytes).
  const std::vector<uint8_t> again = fd_share_internal::EncodeFdErrorReply(*error);
  Check(fd_share_internal::DecodeFdErrorReply(again) == error, "error reply does not round-trip");
}

void FuzzToken(absl::Span<const uint8_t> bytes) {
  absl::StatusOr<FdToken> token = FdToken::Decode(bytes);
  if (!token.ok()) {
    Check(token.status().code() == absl::StatusCode::kInvalidArgument,
          "FdToken::Decode failed with a code other than InvalidArgument");
    return;
  }
  const std::array<uint8_t, 64> encoded = token->Encode();
  Check(absl::MakeConstSpan(encoded) == bytes, "FdToken Encode(Decode(bytes)) != bytes");
}

}  // namespace
}  // namespace vmm

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const absl::Span<const uint8_t> bytes(data, size);
  vmm::FuzzRequest(bytes);
  vmm::FuzzErrorReply(bytes);
  vmm::FuzzToken(bytes);
  return 0;
}
