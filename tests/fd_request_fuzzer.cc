// Fuzz target for what the fd server reads from other processes: a fetch request
// (fd_share_internal::DecodeFdRequest) and a report request of any kind (DecodeAckRequest:
// "VMMACKRQ" acks, "VMMRELRQ" release and "VMMFWDRQ" forward reports); and for the importer
// and the acknowledging receiver, an error reply (DecodeFdErrorReply), an ack reply
// (DecodeAckReply) and a token or ticket (FdToken::Decode).
//
// Beyond "does not crash" (with ASan and UBSan): a request of any kind that decodes holds 1
// to kMaxTokensPerRequest tokens and encodes back, with its kind (AckRequestKind), to exactly
// the input; a token and an ack reply likewise; a rejected request is InvalidArgument with a
// message; an error reply never reads as OK. A violation traps, so libFuzzer records the input.
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

void FuzzAckRequest(absl::Span<const uint8_t> bytes) {
  absl::StatusOr<std::vector<fd_share_internal::FdRequestEntry>> entries =
      fd_share_internal::DecodeAckRequest(bytes);
  if (!entries.ok()) {
    Check(entries.status().code() == absl::StatusCode::kInvalidArgument,
          "DecodeAckRequest failed with a code other than InvalidArgument");
    Check(!entries.status().message().empty(), "DecodeAckRequest failed without a message");
    return;
  }
  const std::optional<SendReport> kind = fd_share_internal::AckRequestKind(bytes);
  Check(kind.has_value(), "an ack request the server would not route");
  Check(fd_share_internal::IsAckRequest(bytes), "IsAckRequest disagrees with AckRequestKind");
  Check(!entries->empty() && entries->size() <= fd_share_internal::kMaxTokensPerRequest,
        "an ack request of no tokens, or of more than a request holds");
  const std::vector<uint8_t> encoded = fd_share_internal::EncodeAckRequest(*entries, *kind);
  Check(absl::MakeConstSpan(encoded) == bytes,
        "EncodeAckRequest(DecodeAckRequest(bytes), AckRequestKind(bytes)) != bytes");
  // A fetch request never reads as a report, nor the other way round.
  Check(!fd_share_internal::DecodeFdRequest(bytes).ok(), "a report that is also a fetch");
}

// An ack reply read for the count its header claims (and for one entry).
void FuzzAckReply(absl::Span<const uint8_t> bytes) {
  std::vector<size_t> counts = {1};
  if (bytes.size() >= 12) {
    counts.push_back(size_t{bytes[8]} | size_t{bytes[9]} << 8 | size_t{bytes[10]} << 16 |
                     size_t{bytes[11]} << 24);
  }
  for (size_t count : counts) {
    absl::StatusOr<std::vector<bool>> acknowledged =
        fd_share_internal::DecodeAckReply(bytes, count);
    if (!acknowledged.ok()) {
      Check(acknowledged.status().code() == absl::StatusCode::kInvalidArgument,
            "DecodeAckReply failed with a code other than InvalidArgument");
      continue;
    }
    Check(acknowledged->size() == count, "an ack reply of another count than asked");
    const std::vector<uint8_t> encoded = fd_share_internal::EncodeAckReply(*acknowledged);
    Check(absl::MakeConstSpan(encoded) == bytes, "EncodeAckReply(DecodeAckReply(bytes)) != bytes");
  }
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
  vmm::FuzzAckRequest(bytes);
  vmm::FuzzAckReply(bytes);
  vmm::FuzzErrorReply(bytes);
  vmm::FuzzToken(bytes);
  return 0;
}
