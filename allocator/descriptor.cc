// descriptor.cc: building, encoding and decoding buffer descriptors (see descriptor.h).
//
// FromHandles() and Decode() share the checks on allocation sizes, offset and size, so that
// whatever Decode() accepts, FromHandles() accepts from the same parts, and both say the same
// thing about the same mistake.
#include "allocator/descriptor.h"

#include <algorithm>
#include <limits>

#include "absl/status/status.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "allocator/status_macros.h"

namespace vmm {
namespace {

constexpr absl::string_view kMagic = "VMMD";
constexpr size_t kHeaderSize = 32;
// Encodings are zero-padded to a multiple of this.
constexpr uint64_t kEncodingAlignment = 8;
constexpr uint8_t kFlagHasOwner = 1u << 0;
constexpr uint8_t kKnownFlags = kFlagHasOwner;

// Appends little-endian fields to a string, whatever the host's byte order.
class LittleEndianWriter {
 public:
  explicit LittleEndianWriter(std::string* out) : out_(out) {}

  void U8(uint8_t value) { Unsigned(value, 1); }
  void U16(uint16_t value) { Unsigned(value, 2); }
  void U32(uint32_t value) { Unsigned(value, 4); }
  void U64(uint64_t value) { Unsigned(value, 8); }
  void Bytes(absl::string_view bytes) { out_->append(bytes.data(), bytes.size()); }

  // Appends zero bytes until the length is a multiple of `alignment`.
  void PadTo(uint64_t alignment) {
    out_->append((alignment - out_->size() % alignment) % alignment, '\0');
  }

 private:
  void Unsigned(uint64_t value, int bytes) {
    for (int i = 0; i < bytes; ++i) {
      out_->push_back(static_cast<char>((value >> (8 * i)) & 0xff));
    }
  }

  std::string* out_;
};

// Reads little-endian fields front to back. Reading past the end never touches memory
// outside `bytes`: it yields zeros (or an empty view) and clears ok(). Decode() checks
// lengths before it reads, so ok() is a safety net, not the way errors are found.
class LittleEndianReader {
 public:
  explicit LittleEndianReader(absl::string_view bytes) : bytes_(bytes) {}

  uint8_t U8() { return static_cast<uint8_t>(Unsigned(1)); }
  uint16_t U16() { return static_cast<uint16_t>(Unsigned(2)); }
  uint32_t U32() { return static_cast<uint32_t>(Unsigned(4)); }
  uint64_t U64() { return Unsigned(8); }

  // The next `count` bytes, or an empty view when fewer remain.
  absl::string_view Bytes(uint64_t count) {
    if (count > remaining()) {
      ok_ = false;
      pos_ = bytes_.size();
      return {};
    }
    absl::string_view out = bytes_.substr(pos_, count);
    pos_ += count;
    return out;
  }

  size_t position() const { return pos_; }
  size_t remaining() const { return bytes_.size() - pos_; }
  bool ok() const { return ok_; }

 private:
  uint64_t Unsigned(int bytes) {
    absl::string_view field = Bytes(bytes);
    uint64_t value = 0;
    for (size_t i = 0; i < field.size(); ++i) {
      value |= uint64_t{static_cast<uint8_t>(field[i])} << (8 * i);
    }
    return value;
  }

  absl::string_view bytes_;
  size_t pos_ = 0;
  bool ok_ = true;
};

// The fixed 32 bytes at the start of every encoding.
struct Header {
  absl::string_view magic;
  uint16_t version = 0;
  uint8_t handle_type = 0;
  uint8_t flags = 0;
  uint32_t count = 0;
  uint32_t owner_length = 0;
  uint64_t size = 0;
  uint64_t offset = 0;
};

Header ReadHeader(LittleEndianReader& reader) {
  Header header;
  header.magic = reader.Bytes(kMagic.size());
  header.version = reader.U16();
  header.handle_type = reader.U8();
  header.flags = reader.U8();
  header.count = reader.U32();
  header.owner_length = reader.U32();
  header.size = reader.U64();
  header.offset = reader.U64();
  return header;
}

// "1 handle", "3 handles".
std::string Count(uint64_t n, absl::string_view noun) {
  return absl::StrCat(n, " ", noun, n == 1 ? "" : "s");
}

bool IsShareableType(HandleType type) {
  return type == HandleType::kFabric || type == HandleType::kPosixFd;
}

// Adds an allocation's size to `*total`; fails instead of wrapping around.
absl::Status AddAllocationSize(uint64_t size, uint64_t* total) {
  if (size > std::numeric_limits<uint64_t>::max() - *total) {
    return absl::InvalidArgumentError("allocation sizes overflow");
  }
  *total += size;
  return absl::OkStatus();
}

// `name` (offset or size) must lie in [0, total]. Signed so that FromHandles() can report a
// negative value as given; Decode() passes values it has already checked to fit.
absl::Status CheckInRange(absl::string_view name, int64_t value, uint64_t total) {
  if (value < 0 || static_cast<uint64_t>(value) > total) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, " ", value, " is outside [0, ", total, "]"));
  }
  return absl::OkStatus();
}

absl::Status CheckInRange(absl::string_view name, uint64_t value, uint64_t total) {
  if (value > total) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, " ", value, " is outside [0, ", total, "]"));
  }
  return absl::OkStatus();
}

// With offset and size each in [0, total], the buffer must end inside the allocations.
// Compares without adding, so nothing can overflow.
absl::Status CheckBufferFits(uint64_t offset, uint64_t size, uint64_t total) {
  if (size > total - offset) {
    return absl::InvalidArgumentError(
        absl::StrCat("offset ", offset, " + size ", size, " is beyond the ", total,
                     " bytes of the allocations"));
  }
  return absl::OkStatus();
}

absl::Status CheckOwnerLength(uint64_t length) {
  if (length > kMaxOwnerUuidBytes) {
    return absl::InvalidArgumentError(absl::StrCat("owner UUID is ", length,
                                                   " bytes, at most ", kMaxOwnerUuidBytes,
                                                   " are allowed"));
  }
  return absl::OkStatus();
}

// The exact length of an encoding with `count` allocations and an owner UUID of
// `owner_length` bytes. Both are 32-bit, so the 64-bit arithmetic cannot overflow.
uint64_t EncodedLength(uint32_t count, uint32_t owner_length) {
  uint64_t length = kHeaderSize + uint64_t{count} * (sizeof(uint64_t) + kDescriptorHandleSize) +
                    owner_length;
  return (length + kEncodingAlignment - 1) / kEncodingAlignment * kEncodingAlignment;
}

// The checks of Decode() that need only the header, in the order the file comment gives.
absl::Status CheckHeader(const Header& header, size_t actual_length,
                         const DecodeLimits& limits) {
  if (header.magic != kMagic) {
    return absl::InvalidArgumentError(absl::StrCat("descriptor magic is \"",
                                                   absl::CHexEscape(header.magic),
                                                   "\", expected \"", kMagic, "\""));
  }
  if (header.version != kDescriptorVersion) {
    return absl::InvalidArgumentError(
        absl::StrCat("unsupported descriptor version ", header.version, " (this build reads ",
                     kDescriptorVersion, ")"));
  }
  const auto type = static_cast<HandleType>(header.handle_type);
  if (!IsShareableType(type)) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown handle type ", int{header.handle_type}, ", expected ",
                     static_cast<int>(HandleType::kPosixFd), " (posix_fd) or ",
                     static_cast<int>(HandleType::kFabric), " (fabric)"));
  }
  if ((header.flags & ~kKnownFlags) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "unknown descriptor flag bits set: 0x", absl::Hex(header.flags & ~kKnownFlags)));
  }
  if ((header.flags & kFlagHasOwner) == 0 && header.owner_length != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "owner UUID length is ", header.owner_length, " but the has-owner flag is clear"));
  }
  if (header.count > limits.max_handles) {
    return absl::InvalidArgumentError(absl::StrCat(Count(header.count, "allocation"),
                                                   " exceed the limit of ",
                                                   limits.max_handles));
  }
  VMM_RETURN_IF_ERROR(CheckOwnerLength(header.owner_length));
  const uint64_t expected_length = EncodedLength(header.count, header.owner_length);
  if (actual_length != expected_length) {
    return absl::InvalidArgumentError(absl::StrCat(
        "descriptor is ", actual_length, " bytes, expected ", expected_length, " for ",
        Count(header.count, "allocation"), " and an owner UUID of ", header.owner_length,
        " bytes"));
  }
  return absl::OkStatus();
}

// Reads `count` allocation sizes, each positive and a multiple of `granularity`, and returns
// their sum, which must not overflow nor exceed `max_total_size`.
absl::StatusOr<uint64_t> ReadAllocationSizes(LittleEndianReader& reader, uint32_t count,
                                             const DecodeLimits& limits,
                                             std::vector<uint64_t>* sizes) {
  sizes->reserve(count);
  uint64_t total = 0;
  for (uint32_t i = 0; i < count; ++i) {
    const uint64_t size = reader.U64();
    if (size == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("allocation size ", i, " is 0, expected a positive integer"));
    }
    if (size % limits.granularity != 0) {
      return absl::InvalidArgumentError(absl::StrCat("allocation size ", i, " is ", size,
                                                     ", not a multiple of the granularity ",
                                                     limits.granularity));
    }
    VMM_RETURN_IF_ERROR(AddAllocationSize(size, &total));
    sizes->push_back(size);
  }
  if (total > limits.max_total_size) {
    return absl::InvalidArgumentError(absl::StrCat("allocation sizes total ", total,
                                                   " bytes, above the limit of ",
                                                   limits.max_total_size));
  }
  return total;
}

// The rest of the encoding after the owner UUID must be zero.
absl::Status CheckPadding(LittleEndianReader& reader) {
  const size_t start = reader.position();
  const absl::string_view padding = reader.Bytes(reader.remaining());
  for (size_t i = 0; i < padding.size(); ++i) {
    if (padding[i] != '\0') {
      return absl::InvalidArgumentError(
          absl::StrCat("padding byte at offset ", start + i, " is 0x",
                       absl::Hex(static_cast<uint8_t>(padding[i]), absl::kZeroPad2),
                       ", expected 0"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<BufferDescriptor> BufferDescriptor::FromHandles(
    HandleType type, absl::Span<const std::string> handles, absl::Span<const int64_t> sizes,
    std::optional<int64_t> size, std::optional<std::string> owner_uuid, int64_t offset) {
  if (!IsShareableType(type)) {
    return absl::InvalidArgumentError(
        absl::StrCat("handle type ", static_cast<int>(type), " (", HandleTypeName(type),
                     ") cannot describe an exported buffer, expected posix_fd or fabric"));
  }
  if (handles.size() != sizes.size()) {
    return absl::InvalidArgumentError(absl::StrCat(Count(handles.size(), "handle"), " but ",
                                                   Count(sizes.size(), "size")));
  }
  if (handles.size() > std::numeric_limits<uint32_t>::max()) {
    return absl::InvalidArgumentError(absl::StrCat(
        Count(handles.size(), "handle"), " do not fit the encoding's 32-bit count"));
  }
  for (size_t i = 0; i < handles.size(); ++i) {
    if (handles[i].size() != kDescriptorHandleSize) {
      return absl::InvalidArgumentError(absl::StrCat("handle ", i, " is ", handles[i].size(),
                                                     " bytes, expected ",
                                                     kDescriptorHandleSize));
    }
  }
  uint64_t total = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (sizes[i] <= 0) {
      return absl::InvalidArgumentError(absl::StrCat("allocation size ", i, " is ", sizes[i],
                                                     ", expected a positive integer"));
    }
    VMM_RETURN_IF_ERROR(AddAllocationSize(static_cast<uint64_t>(sizes[i]), &total));
  }
  VMM_RETURN_IF_ERROR(CheckInRange("offset", offset, total));
  const uint64_t buffer_offset = static_cast<uint64_t>(offset);
  uint64_t buffer_size = total - buffer_offset;
  if (size.has_value()) {
    VMM_RETURN_IF_ERROR(CheckInRange("size", *size, total));
    buffer_size = static_cast<uint64_t>(*size);
    VMM_RETURN_IF_ERROR(CheckBufferFits(buffer_offset, buffer_size, total));
  }
  if (owner_uuid.has_value()) VMM_RETURN_IF_ERROR(CheckOwnerLength(owner_uuid->size()));

  BufferDescriptor descriptor;
  descriptor.type_ = type;
  descriptor.handles_.resize(handles.size());
  for (size_t i = 0; i < handles.size(); ++i) {
    std::copy(handles[i].begin(), handles[i].end(), descriptor.handles_[i].begin());
  }
  descriptor.sizes_.assign(sizes.begin(), sizes.end());
  descriptor.size_ = buffer_size;
  descriptor.offset_ = buffer_offset;
  descriptor.mapped_size_ = total;
  descriptor.owner_uuid_ = std::move(owner_uuid);
  return descriptor;
}

std::string BufferDescriptor::Encode() const {
  const uint32_t owner_length =
      owner_uuid_.has_value() ? static_cast<uint32_t>(owner_uuid_->size()) : 0;
  std::string out;
  out.reserve(EncodedLength(static_cast<uint32_t>(handles_.size()), owner_length));
  LittleEndianWriter writer(&out);
  writer.Bytes(kMagic);
  writer.U16(kDescriptorVersion);
  writer.U8(static_cast<uint8_t>(type_));
  writer.U8(owner_uuid_.has_value() ? kFlagHasOwner : 0);
  writer.U32(static_cast<uint32_t>(handles_.size()));
  writer.U32(owner_length);
  writer.U64(size_);
  writer.U64(offset_);
  for (uint64_t size : sizes_) writer.U64(size);
  for (const Handle& handle : handles_) {
    writer.Bytes(absl::string_view(reinterpret_cast<const char*>(handle.data()), handle.size()));
  }
  if (owner_uuid_.has_value()) writer.Bytes(*owner_uuid_);
  writer.PadTo(kEncodingAlignment);
  return out;
}

absl::StatusOr<BufferDescriptor> BufferDescriptor::Decode(absl::string_view bytes,
                                                          const DecodeLimits& limits) {
  if (limits.granularity == 0) {
    return absl::InvalidArgumentError("decode limits: granularity must be positive");
  }
  if (bytes.size() < kHeaderSize) {
    return absl::InvalidArgumentError(absl::StrCat(
        "descriptor is ", bytes.size(), " bytes, shorter than its ", kHeaderSize,
        "-byte header"));
  }
  LittleEndianReader reader(bytes);
  const Header header = ReadHeader(reader);
  // From here on the length is exactly what the header says, so every read below is in
  // bounds and every reservation is bounded by the input's length.
  VMM_RETURN_IF_ERROR(CheckHeader(header, bytes.size(), limits));

  BufferDescriptor descriptor;
  descriptor.type_ = static_cast<HandleType>(header.handle_type);
  VMM_ASSIGN_OR_RETURN(
      descriptor.mapped_size_,
      ReadAllocationSizes(reader, header.count, limits, &descriptor.sizes_));
  VMM_RETURN_IF_ERROR(CheckInRange("offset", header.offset, descriptor.mapped_size_));
  VMM_RETURN_IF_ERROR(CheckInRange("size", header.size, descriptor.mapped_size_));
  VMM_RETURN_IF_ERROR(CheckBufferFits(header.offset, header.size, descriptor.mapped_size_));
  descriptor.offset_ = header.offset;
  descriptor.size_ = header.size;

  descriptor.handles_.resize(header.count);
  for (Handle& handle : descriptor.handles_) {
    const absl::string_view field = reader.Bytes(kDescriptorHandleSize);
    std::copy(field.begin(), field.end(), handle.begin());
  }
  if ((header.flags & kFlagHasOwner) != 0) {
    descriptor.owner_uuid_ = std::string(reader.Bytes(header.owner_length));
  }
  VMM_RETURN_IF_ERROR(CheckPadding(reader));
  if (!reader.ok()) {
    // Unreachable: CheckHeader() fixed the length. Kept so that a future layout change that
    // forgets a length check fails cleanly instead of decoding zeros.
    return absl::InternalError("descriptor decoder read past the end of its input");
  }
  return descriptor;
}

std::string OwnerForMessages(const std::optional<std::string>& owner_uuid) {
  if (!owner_uuid.has_value() || owner_uuid->empty()) return "an unknown owner";
  return absl::StrCat("the owner ", absl::CHexEscape(*owner_uuid));
}

std::string BufferDescriptor::OwnerForMessages() const {
  return vmm::OwnerForMessages(owner_uuid_);
}

}  // namespace vmm
