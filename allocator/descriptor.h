// descriptor.h: plain-data descriptors of exported buffers, and their binary encoding.
//
// A buffer exported by vmm spans one or more physical allocations. Its descriptor holds one
// opaque 64-byte handle per allocation, in address order, each allocation's size, the buffer's
// size, the buffer's byte offset inside the first allocation, and the UUID of the exporting device.
// Two kinds share one shape:
//   - FabricBufferDescriptor: CUDA fabric handles (valid across processes and, with an NVLink
//     fabric, nodes). Nothing is pinned: a descriptor parked in a queue keeps no memory alive.
//   - PosixFdBufferDescriptor: 64-byte tokens that name a file descriptor held by the exporting
//     process, which the importer fetches over a Unix socket (see sharing.h).
//
// FromHandles() builds a descriptor from parts received through any transport and fails with
// InvalidArgument when: the counts of handles and sizes differ, a handle is not 64 bytes, an
// allocation size is not positive, `size` is outside [0, sum(sizes)], or `offset + size`
// exceeds sum(sizes) (`size` defaults to sum(sizes) - offset). The owner UUID is at most
// kMaxOwnerUuidBytes long.
//
// Encode() gives the one canonical encoding (same content, same bytes). Decode() treats its
// input as hostile: magic, version, handle type, unknown flag bits, exact length, zero padding,
// count and size limits and overflow-safe sums are all checked, and any failure is
// InvalidArgument saying what was wrong. Decode(Encode(d)) == d and Encode(Decode(b)) == b.
//
// Encoding, version 1, little-endian:
//   0  "VMMD"   4  u16 version   6  u8 handle type   7  u8 flags (bit 0: has owner UUID)
//   8  u32 count of allocations   12 u32 owner UUID length   16 u64 size   24 u64 offset
//   32 count x u64 allocation sizes, then count x 64-byte handles, then the owner UUID bytes,
//   then zero bytes up to a multiple of 8.
// The handle type byte is the HandleType value (1 posix_fd, 2 fabric). Flag bit 0 clear means
// no owner UUID (its length must then be 0); set with length 0 is an empty owner UUID. Other
// flag bits are reserved and must be 0.
#ifndef VMM_ALLOCATOR_DESCRIPTOR_H_
#define VMM_ALLOCATOR_DESCRIPTOR_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "allocator/driver.h"

namespace vmm {

inline constexpr uint16_t kDescriptorVersion = 1;
inline constexpr size_t kDescriptorHandleSize = 64;
inline constexpr size_t kMaxOwnerUuidBytes = 256;

// Limits Decode() enforces on untrusted bytes.
struct DecodeLimits {
  uint32_t max_handles = 1u << 20;
  uint64_t max_total_size = uint64_t{1} << 50;  // 1 PiB
  // Every allocation size must be a multiple of this (an importer passes its granularity).
  // Must be positive; Decode() rejects limits with granularity 0.
  uint64_t granularity = 1;
};

class BufferDescriptor {
 public:
  using Handle = std::array<uint8_t, kDescriptorHandleSize>;

  // Builds a descriptor of `type` (kFabric or kPosixFd) from received parts; see the file
  // comment for the errors. `handles` are raw byte strings so that a wrong length is caught.
  static absl::StatusOr<BufferDescriptor> FromHandles(
      HandleType type, absl::Span<const std::string> handles, absl::Span<const int64_t> sizes,
      std::optional<int64_t> size = std::nullopt,
      std::optional<std::string> owner_uuid = std::nullopt, int64_t offset = 0);

  // Parses the canonical encoding; see the file comment.
  static absl::StatusOr<BufferDescriptor> Decode(absl::string_view bytes,
                                                 const DecodeLimits& limits = {});

  // The canonical encoding.
  std::string Encode() const;

  HandleType handle_type() const { return type_; }
  const std::vector<Handle>& handles() const { return handles_; }
  const std::vector<uint64_t>& sizes() const { return sizes_; }
  // Bytes of the buffer.
  uint64_t size() const { return size_; }
  // Where the buffer starts inside the mapping of all allocations.
  uint64_t offset() const { return offset_; }
  // Sum of the allocation sizes: the bytes an importer maps.
  uint64_t mapped_size() const { return mapped_size_; }
  const std::optional<std::string>& owner_uuid() const { return owner_uuid_; }
  // The backend that exported the buffer, read from the owner UUID (BackendOfDeviceUuid);
  // nullopt when the owner is absent or not a UUID either backend gives.
  std::optional<Backend> backend() const {
    return owner_uuid_.has_value() ? BackendOfDeviceUuid(*owner_uuid_) : std::nullopt;
  }
  // "the owner GPU-..." or "an unknown owner" (no or empty owner UUID), for error messages.
  // Unprintable bytes of the UUID are escaped.
  std::string OwnerForMessages() const;

  friend bool operator==(const BufferDescriptor& a, const BufferDescriptor& b) {
    return a.type_ == b.type_ && a.handles_ == b.handles_ && a.sizes_ == b.sizes_ &&
           a.size_ == b.size_ && a.offset_ == b.offset_ && a.owner_uuid_ == b.owner_uuid_;
  }
  friend bool operator!=(const BufferDescriptor& a, const BufferDescriptor& b) {
    return !(a == b);
  }

 private:
  BufferDescriptor() = default;

  HandleType type_ = HandleType::kNone;
  std::vector<Handle> handles_;
  std::vector<uint64_t> sizes_;  // each > 0; same length as handles_
  uint64_t size_ = 0;            // offset_ + size_ <= mapped_size_
  uint64_t offset_ = 0;
  uint64_t mapped_size_ = 0;     // sum of sizes_, no overflow
  std::optional<std::string> owner_uuid_;
};

// "the owner GPU-..." or "an unknown owner", as BufferDescriptor::OwnerForMessages gives it,
// for a buffer known only by its owner UUID.
std::string OwnerForMessages(const std::optional<std::string>& owner_uuid);

// The descriptor of a buffer exported with fabric handles (handle_type() == kFabric).
struct FabricBufferDescriptor {
  static absl::StatusOr<BufferDescriptor> FromHandles(
      absl::Span<const std::string> handles, absl::Span<const int64_t> sizes,
      std::optional<int64_t> size = std::nullopt,
      std::optional<std::string> owner_uuid = std::nullopt, int64_t offset = 0) {
    return BufferDescriptor::FromHandles(HandleType::kFabric, handles, sizes, size,
                                         std::move(owner_uuid), offset);
  }
};

// Its twin for buffers exported as POSIX file descriptors (handle_type() == kPosixFd).
struct PosixFdBufferDescriptor {
  static absl::StatusOr<BufferDescriptor> FromHandles(
      absl::Span<const std::string> handles, absl::Span<const int64_t> sizes,
      std::optional<int64_t> size = std::nullopt,
      std::optional<std::string> owner_uuid = std::nullopt, int64_t offset = 0) {
    return BufferDescriptor::FromHandles(HandleType::kPosixFd, handles, sizes, size,
                                         std::move(owner_uuid), offset);
  }
};

}  // namespace vmm

#endif  // VMM_ALLOCATOR_DESCRIPTOR_H_
