// Tests of BufferDescriptor: the validation of FromHandles(), the canonical encoding, and
// Decode() on hostile bytes (truncations, corrupted fields, overflowing sums, limits).
#include "allocator/descriptor.h"

#include <cstdint>
#include <limits>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/status_matchers.h"

namespace vmm {

// Readable failure output for descriptors.
void PrintTo(const BufferDescriptor& d, std::ostream* os) {
  *os << "{type " << HandleTypeName(d.handle_type()) << ", " << d.handles().size()
      << " handles, sizes [" << absl::StrJoin(d.sizes(), ", ") << "], size " << d.size()
      << ", offset " << d.offset() << ", " << d.OwnerForMessages() << "}";
}

namespace {

using ::testing::ElementsAre;
using ::testing::SizeIs;

constexpr uint64_t kMiB = uint64_t{1} << 20;
constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();
constexpr uint64_t kUint64Max = std::numeric_limits<uint64_t>::max();

// Header field offsets, as in the layout of descriptor.h.
constexpr size_t kVersionAt = 4;
constexpr size_t kTypeAt = 6;
constexpr size_t kFlagsAt = 7;
constexpr size_t kCountAt = 8;
constexpr size_t kOwnerLengthAt = 12;
constexpr size_t kSizeAt = 16;
constexpr size_t kOffsetAt = 24;
constexpr size_t kSizesAt = 32;

// A failed StatusOr whose status is InvalidArgument with exactly `message`.
auto FailsWith(const std::string& message) {
  return StatusIs(absl::StatusCode::kInvalidArgument, message);
}

auto IsInvalidArgument() { return StatusIs(absl::StatusCode::kInvalidArgument); }

// A distinct 64-byte handle for each seed.
std::string TestHandle(int seed) {
  std::string handle(kDescriptorHandleSize, '\0');
  for (size_t i = 0; i < handle.size(); ++i) handle[i] = static_cast<char>(seed * 37 + i);
  return handle;
}

std::vector<std::string> TestHandles(int count) {
  std::vector<std::string> handles;
  for (int i = 0; i < count; ++i) handles.push_back(TestHandle(i));
  return handles;
}

// Overwrites `bytes` little-endian bytes of `encoding` at `at` with `value`.
void Patch(std::string& encoding, size_t at, uint64_t value, int bytes) {
  for (int i = 0; i < bytes; ++i) encoding[at + i] = static_cast<char>((value >> (8 * i)) & 0xff);
}

BufferDescriptor MustBuild(absl::StatusOr<BufferDescriptor> descriptor) {
  EXPECT_TRUE(descriptor.ok()) << descriptor.status();
  return *std::move(descriptor);
}

// Fabric descriptor over `sizes` with distinct handles and no owner.
BufferDescriptor Fabric(std::vector<int64_t> sizes, std::optional<int64_t> size = std::nullopt,
                        std::optional<std::string> owner = std::nullopt, int64_t offset = 0) {
  return MustBuild(FabricBufferDescriptor::FromHandles(
      TestHandles(static_cast<int>(sizes.size())), sizes, size, std::move(owner), offset));
}

// A spread of valid descriptors: 0, 1 and many handles, both types, with and without owner,
// with and without offset.
std::vector<BufferDescriptor> SampleDescriptors() {
  std::vector<BufferDescriptor> samples;
  samples.push_back(Fabric({}));
  samples.push_back(MustBuild(PosixFdBufferDescriptor::FromHandles({}, {}, 0, "GPU-0")));
  samples.push_back(Fabric({2 * kMiB}));
  samples.push_back(MustBuild(PosixFdBufferDescriptor::FromHandles(
      TestHandles(1), {4096}, 100, "GPU-6c1b9a5e-8d2f-4b3a-9e7c-0123456789ab", 8)));
  samples.push_back(Fabric({2 * kMiB, 4 * kMiB, 2 * kMiB}, 5 * kMiB, "GPU-abc", 4096));
  samples.push_back(MustBuild(PosixFdBufferDescriptor::FromHandles(
      TestHandles(5), {1, 2, 3, 4, 5}, std::nullopt, std::string(), 3)));
  std::vector<int64_t> many(100, 2 * kMiB);
  samples.push_back(Fabric(many, std::nullopt, std::string(kMaxOwnerUuidBytes, '\xfe')));
  return samples;
}

// ---- FromHandles(): the errors descriptor.h lists (docs/DESIGN.md §1), one test each. ----

TEST(FromHandlesTest, CountsDiffer) {
  EXPECT_THAT(FabricBufferDescriptor::FromHandles(TestHandles(2), {64, 64, 64}),
              FailsWith("2 handles but 3 sizes"));
  EXPECT_THAT(FabricBufferDescriptor::FromHandles(TestHandles(1), {}),
              FailsWith("1 handle but 0 sizes"));
}

TEST(FromHandlesTest, ShortHandle) {
  std::vector<std::string> handles = TestHandles(3);
  handles[2].pop_back();
  EXPECT_THAT(FabricBufferDescriptor::FromHandles(handles, {64, 64, 64}),
              FailsWith("handle 2 is 63 bytes, expected 64"));
}

TEST(FromHandlesTest, EmptyHandle) {
  std::vector<std::string> handles = TestHandles(2);
  handles[0].clear();
  EXPECT_THAT(PosixFdBufferDescriptor::FromHandles(handles, {64, 64}),
              FailsWith("handle 0 is 0 bytes, expected 64"));
}

TEST(FromHandlesTest, LongHandle) {
  std::vector<std::string> handles = TestHandles(2);
  handles[1].push_back('x');
  EXPECT_THAT(FabricBufferDescriptor::FromHandles(handles, {64, 64}),
              FailsWith("handle 1 is 65 bytes, expected 64"));
}

TEST(FromHandlesTest, ZeroAllocationSize) {
  EXPECT_THAT(FabricBufferDescriptor::FromHandles(TestHandles(2), {64, 0}),
              FailsWith("allocation size 1 is 0, expected a positive integer"));
}

TEST(FromHandlesTest, NegativeAllocationSize) {
  EXPECT_THAT(FabricBufferDescriptor::FromHandles(TestHandles(2), {64, -5}),
              FailsWith("allocation size 1 is -5, expected a positive integer"));
}

TEST(FromHandlesTest, AllocationSizesOverflow) {
  EXPECT_THAT(FabricBufferDescriptor::FromHandles(TestHandles(3), {kInt64Max, kInt64Max, 2}),
              FailsWith("allocation sizes overflow"));
}

TEST(FromHandlesTest, LargeSumThatFitsIsAccepted) {
  // 2 * INT64_MAX = 2^64 - 2 fits the unsigned sum.
  BufferDescriptor d = Fabric({kInt64Max, kInt64Max});
  EXPECT_EQ(d.mapped_size(), kUint64Max - 1);
  EXPECT_EQ(d.size(), kUint64Max - 1);
}

TEST(FromHandlesTest, SizeAboveSum) {
  EXPECT_THAT(FabricBufferDescriptor::FromHandles(TestHandles(1), {64}, 100),
              FailsWith("size 100 is outside [0, 64]"));
  EXPECT_THAT(FabricBufferDescriptor::FromHandles(TestHandles(1), {64}, 65),
              FailsWith("size 65 is outside [0, 64]"));
}

TEST(FromHandlesTest, NegativeSize) {
  EXPECT_THAT(FabricBufferDescriptor::FromHandles(TestHandles(1), {64}, -1),
              FailsWith("size -1 is outside [0, 64]"));
}

TEST(FromHandlesTest, NegativeOffset) {
  EXPECT_THAT(FabricBufferDescriptor::FromHandles(TestHandles(1), {64}, 8, std::nullopt, -1),
              FailsWith("offset -1 is outside [0, 64]"));
}

TEST(FromHandlesTest, OffsetAboveSum) {
  EXPECT_THAT(
      FabricBufferDescriptor::FromHandles(TestHandles(1), {64}, std::nullopt, std::nullopt, 65),
      FailsWith("offset 65 is outside [0, 64]"));
}

TEST(FromHandlesTest, OffsetPlusSizeAboveSum) {
  EXPECT_THAT(FabricBufferDescriptor::FromHandles(TestHandles(1), {64}, 64, std::nullopt, 16),
              FailsWith("offset 16 + size 64 is beyond the 64 bytes of the allocations"));
  EXPECT_THAT(FabricBufferDescriptor::FromHandles(TestHandles(2), {64, 64}, 65, std::nullopt, 64),
              FailsWith("offset 64 + size 65 is beyond the 128 bytes of the allocations"));
}

TEST(FromHandlesTest, OffsetPlusSizeAtTheTopOfTheRange) {
  // Allocation sums beyond INT64_MAX are fine; the buffer must still end inside them.
  BufferDescriptor d = Fabric({kInt64Max, kInt64Max}, kInt64Max, std::nullopt, kInt64Max);
  EXPECT_EQ(d.offset() + d.size(), d.mapped_size());
  EXPECT_THAT(FabricBufferDescriptor::FromHandles(TestHandles(2), {kInt64Max, kInt64Max - 1},
                                                  kInt64Max, std::nullopt, kInt64Max),
              FailsWith("offset 9223372036854775807 + size 9223372036854775807 is beyond the "
                        "18446744073709551613 bytes of the allocations"));
}

TEST(FromHandlesTest, OwnerUuidTooLong) {
  EXPECT_THAT(FabricBufferDescriptor::FromHandles(TestHandles(1), {64}, std::nullopt,
                                                  std::string(kMaxOwnerUuidBytes + 1, 'u')),
              FailsWith("owner UUID is 257 bytes, at most 256 are allowed"));
  EXPECT_TRUE(FabricBufferDescriptor::FromHandles(TestHandles(1), {64}, std::nullopt,
                                                  std::string(kMaxOwnerUuidBytes, 'u'))
                  .ok());
}

TEST(FromHandlesTest, UnshareableHandleType) {
  EXPECT_THAT(BufferDescriptor::FromHandles(HandleType::kNone, TestHandles(1), {64}),
              FailsWith("handle type 0 (none) cannot describe an exported buffer, expected "
                        "posix_fd or fabric"));
  EXPECT_THAT(BufferDescriptor::FromHandles(static_cast<HandleType>(7), TestHandles(1), {64}),
              IsInvalidArgument());
}

TEST(FromHandlesTest, FirstErrorIsReported) {
  // Counts are checked before handles, handles before sizes, sizes before size.
  EXPECT_THAT(FabricBufferDescriptor::FromHandles({"short"}, {0, 0}),
              FailsWith("1 handle but 2 sizes"));
  EXPECT_THAT(FabricBufferDescriptor::FromHandles({"short"}, {0}),
              FailsWith("handle 0 is 5 bytes, expected 64"));
  EXPECT_THAT(FabricBufferDescriptor::FromHandles(TestHandles(1), {0}, 100),
              FailsWith("allocation size 0 is 0, expected a positive integer"));
}

// ---- FromHandles(): defaults and attributes. ----

TEST(FromHandlesTest, NoHandlesIsAnEmptyBuffer) {
  BufferDescriptor d = Fabric({});
  EXPECT_THAT(d.handles(), SizeIs(0));
  EXPECT_EQ(d.size(), 0u);
  EXPECT_EQ(d.mapped_size(), 0u);
  EXPECT_THAT(FabricBufferDescriptor::FromHandles({}, {}, 1),
              FailsWith("size 1 is outside [0, 0]"));
}

TEST(FromHandlesTest, Defaults) {
  BufferDescriptor d = Fabric({64, 128});
  EXPECT_EQ(d.size(), 192u);
  EXPECT_EQ(d.offset(), 0u);
  EXPECT_EQ(d.owner_uuid(), std::nullopt);
  EXPECT_EQ(d.OwnerForMessages(), "an unknown owner");
}

TEST(FromHandlesTest, DefaultSizeIsWhatFollowsTheOffset) {
  BufferDescriptor d = Fabric({64, 128}, std::nullopt, std::nullopt, 40);
  EXPECT_EQ(d.offset(), 40u);
  EXPECT_EQ(d.size(), 152u);
  EXPECT_EQ(d.mapped_size(), 192u);
  EXPECT_EQ(Fabric({64}, std::nullopt, std::nullopt, 64).size(), 0u);
}

TEST(FromHandlesTest, Attributes) {
  std::vector<std::string> handles = TestHandles(3);
  BufferDescriptor d = MustBuild(FabricBufferDescriptor::FromHandles(
      handles, {2 * kMiB, 4 * kMiB, 2 * kMiB}, 5 * kMiB, "GPU-1234", 4096));
  EXPECT_EQ(d.handle_type(), HandleType::kFabric);
  ASSERT_THAT(d.handles(), SizeIs(3));
  for (size_t i = 0; i < handles.size(); ++i) {
    EXPECT_EQ(std::string(d.handles()[i].begin(), d.handles()[i].end()), handles[i]);
  }
  EXPECT_THAT(d.sizes(), ElementsAre(2 * kMiB, 4 * kMiB, 2 * kMiB));
  EXPECT_EQ(d.size(), 5 * kMiB);
  EXPECT_EQ(d.offset(), 4096u);
  EXPECT_EQ(d.mapped_size(), 8 * kMiB);
  EXPECT_EQ(d.owner_uuid(), "GPU-1234");
  EXPECT_EQ(d.OwnerForMessages(), "the owner GPU-1234");
}

TEST(FromHandlesTest, OwnerForMessagesOfEmptyOrBinaryOwner) {
  EXPECT_EQ(Fabric({64}, std::nullopt, std::string()).OwnerForMessages(), "an unknown owner");
  EXPECT_EQ(Fabric({64}, std::nullopt, std::string("G\x01\n", 3)).OwnerForMessages(),
            "the owner G\\x01\\n");
}

TEST(FromHandlesTest, FabricAndPosixFdTypes) {
  BufferDescriptor fabric =
      MustBuild(FabricBufferDescriptor::FromHandles(TestHandles(1), {64}));
  BufferDescriptor posix_fd =
      MustBuild(PosixFdBufferDescriptor::FromHandles(TestHandles(1), {64}));
  EXPECT_EQ(fabric.handle_type(), HandleType::kFabric);
  EXPECT_EQ(posix_fd.handle_type(), HandleType::kPosixFd);
  EXPECT_NE(fabric, posix_fd);
  const std::string fabric_bytes = fabric.Encode();
  const std::string posix_fd_bytes = posix_fd.Encode();
  EXPECT_EQ(fabric_bytes[kTypeAt], 2);
  EXPECT_EQ(posix_fd_bytes[kTypeAt], 1);
  EXPECT_EQ(fabric_bytes.substr(kTypeAt + 1), posix_fd_bytes.substr(kTypeAt + 1));
}

// ---- Encode() and Decode(): round trips and canonical bytes. ----

TEST(EncodingTest, GoldenBytes) {
  std::string handle;
  for (int i = 0; i < 64; ++i) handle.push_back(static_cast<char>(i));
  BufferDescriptor d =
      MustBuild(FabricBufferDescriptor::FromHandles({handle}, {4096}, 100, "ab", 8));
  const std::string expected = absl::StrCat(
      "VMMD", absl::HexStringToBytes("0100"     // version 1
                                     "02"       // fabric
                                     "01"       // has owner
                                     "01000000"  // 1 allocation
                                     "02000000"  // owner UUID of 2 bytes
                                     "6400000000000000"    // size 100
                                     "0800000000000000"    // offset 8
                                     "0010000000000000"),  // allocation size 4096
      handle, "ab", std::string(6, '\0'));                 // 106 bytes padded to 112
  EXPECT_EQ(absl::BytesToHexString(d.Encode()), absl::BytesToHexString(expected));
}

TEST(EncodingTest, LengthIsAMultipleOfEight) {
  for (size_t owner = 0; owner <= 17; ++owner) {
    const std::string bytes = Fabric({64}, std::nullopt, std::string(owner, 'o')).Encode();
    EXPECT_EQ(bytes.size() % 8, 0u);
    EXPECT_EQ(bytes.size(), (32 + 8 + 64 + owner + 7) / 8 * 8);
  }
}

TEST(EncodingTest, RoundTrip) {
  for (const BufferDescriptor& d : SampleDescriptors()) {
    SCOPED_TRACE(::testing::PrintToString(d));
    absl::StatusOr<BufferDescriptor> decoded = BufferDescriptor::Decode(d.Encode());
    ASSERT_TRUE(decoded.ok()) << decoded.status();
    EXPECT_EQ(*decoded, d);
    EXPECT_EQ(decoded->mapped_size(), d.mapped_size());
  }
}

TEST(EncodingTest, EmptyOwnerIsNotNoOwner) {
  BufferDescriptor none = Fabric({64});
  BufferDescriptor empty = Fabric({64}, std::nullopt, std::string());
  EXPECT_NE(none, empty);
  EXPECT_NE(none.Encode(), empty.Encode());
  absl::StatusOr<BufferDescriptor> decoded = BufferDescriptor::Decode(empty.Encode());
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(decoded->owner_uuid(), std::string());
}

TEST(EncodingTest, SameContentSameBytes) {
  for (const BufferDescriptor& d : SampleDescriptors()) {
    std::vector<std::string> handles;
    for (const auto& h : d.handles()) handles.emplace_back(h.begin(), h.end());
    std::vector<int64_t> sizes(d.sizes().begin(), d.sizes().end());
    BufferDescriptor rebuilt = MustBuild(BufferDescriptor::FromHandles(
        d.handle_type(), handles, sizes, static_cast<int64_t>(d.size()), d.owner_uuid(),
        static_cast<int64_t>(d.offset())));
    EXPECT_EQ(rebuilt, d);
    EXPECT_EQ(rebuilt.Encode(), d.Encode());
  }
}

TEST(EncodingTest, DecodeThenEncodeGivesTheSameBytes) {
  for (const BufferDescriptor& d : SampleDescriptors()) {
    const std::string bytes = d.Encode();
    absl::StatusOr<BufferDescriptor> decoded = BufferDescriptor::Decode(bytes);
    ASSERT_TRUE(decoded.ok()) << decoded.status();
    EXPECT_EQ(decoded->Encode(), bytes);
  }
}

TEST(EncodingTest, HugeSumsDecodeOnlyUnderAHigherLimit) {
  BufferDescriptor d = Fabric({kInt64Max, kInt64Max});
  EXPECT_THAT(BufferDescriptor::Decode(d.Encode()),
              FailsWith(absl::StrCat("allocation sizes total ", kUint64Max - 1,
                                     " bytes, above the limit of ", uint64_t{1} << 50)));
  DecodeLimits limits;
  limits.max_total_size = kUint64Max;
  absl::StatusOr<BufferDescriptor> decoded = BufferDescriptor::Decode(d.Encode(), limits);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(*decoded, d);
}

// ---- Decode() of hostile bytes. ----

TEST(DecodeTest, EveryTruncationFails) {
  for (const BufferDescriptor& d : SampleDescriptors()) {
    const std::string bytes = d.Encode();
    for (size_t length = 0; length < bytes.size(); ++length) {
      EXPECT_THAT(BufferDescriptor::Decode(absl::string_view(bytes).substr(0, length)),
                  IsInvalidArgument())
          << "length " << length << " of " << bytes.size();
    }
  }
}

TEST(DecodeTest, ShorterThanHeader) {
  EXPECT_THAT(BufferDescriptor::Decode(""),
              FailsWith("descriptor is 0 bytes, shorter than its 32-byte header"));
  EXPECT_THAT(BufferDescriptor::Decode(Fabric({}).Encode().substr(0, 31)),
              FailsWith("descriptor is 31 bytes, shorter than its 32-byte header"));
}

TEST(DecodeTest, TruncatedBody) {
  const std::string bytes = Fabric({64, 64}).Encode();  // 32 + 2 * 72 = 176 bytes
  EXPECT_THAT(BufferDescriptor::Decode(bytes.substr(0, 100)),
              FailsWith("descriptor is 100 bytes, expected 176 for 2 allocations and an owner "
                        "UUID of 0 bytes"));
}

TEST(DecodeTest, TrailingBytes) {
  const std::string bytes = Fabric({64}).Encode();  // 104 bytes
  EXPECT_THAT(BufferDescriptor::Decode(bytes + std::string(8, '\0')),
              FailsWith("descriptor is 112 bytes, expected 104 for 1 allocation and an owner "
                        "UUID of 0 bytes"));
  EXPECT_THAT(BufferDescriptor::Decode(bytes + "x"), IsInvalidArgument());
}

TEST(DecodeTest, BadMagic) {
  std::string bytes = Fabric({64}).Encode();
  bytes[3] = 'X';
  EXPECT_THAT(BufferDescriptor::Decode(bytes),
              FailsWith("descriptor magic is \"VMMX\", expected \"VMMD\""));
  bytes[0] = '\0';
  EXPECT_THAT(BufferDescriptor::Decode(bytes),
              FailsWith("descriptor magic is \"\\x00MMX\", expected \"VMMD\""));
}

TEST(DecodeTest, WrongVersion) {
  std::string bytes = Fabric({64}).Encode();
  Patch(bytes, kVersionAt, 2, 2);
  EXPECT_THAT(BufferDescriptor::Decode(bytes),
              FailsWith("unsupported descriptor version 2 (this build reads 1)"));
  Patch(bytes, kVersionAt, 0, 2);
  EXPECT_THAT(BufferDescriptor::Decode(bytes),
              FailsWith("unsupported descriptor version 0 (this build reads 1)"));
  Patch(bytes, kVersionAt, 0x0100, 2);  // a big-endian 1
  EXPECT_THAT(BufferDescriptor::Decode(bytes),
              FailsWith("unsupported descriptor version 256 (this build reads 1)"));
}

TEST(DecodeTest, UnknownHandleType) {
  std::string bytes = Fabric({64}).Encode();
  for (int type : {0, 3, 255}) {
    Patch(bytes, kTypeAt, type, 1);
    EXPECT_THAT(BufferDescriptor::Decode(bytes),
                FailsWith(absl::StrCat("unknown handle type ", type,
                                       ", expected 1 (posix_fd) or 2 (fabric)")));
  }
}

TEST(DecodeTest, UnknownFlags) {
  std::string bytes = Fabric({64}).Encode();
  Patch(bytes, kFlagsAt, 0x02, 1);
  EXPECT_THAT(BufferDescriptor::Decode(bytes),
              FailsWith("unknown descriptor flag bits set: 0x2"));
  Patch(bytes, kFlagsAt, 0x81, 1);
  EXPECT_THAT(BufferDescriptor::Decode(bytes),
              FailsWith("unknown descriptor flag bits set: 0x80"));
}

TEST(DecodeTest, OwnerLengthWithoutOwnerFlag) {
  std::string bytes = Fabric({64}, std::nullopt, "GPU-1").Encode();
  Patch(bytes, kFlagsAt, 0, 1);
  EXPECT_THAT(BufferDescriptor::Decode(bytes),
              FailsWith("owner UUID length is 5 but the has-owner flag is clear"));
}

TEST(DecodeTest, TooManyHandles) {
  std::string bytes = Fabric({64, 64, 64}).Encode();
  DecodeLimits limits;
  limits.max_handles = 2;
  EXPECT_THAT(BufferDescriptor::Decode(bytes, limits),
              FailsWith("3 allocations exceed the limit of 2"));
  limits.max_handles = 3;
  EXPECT_TRUE(BufferDescriptor::Decode(bytes, limits).ok());
}

TEST(DecodeTest, HugeCountFailsBeforeAllocating) {
  std::string bytes = Fabric({64}).Encode();
  Patch(bytes, kCountAt, 0xFFFFFFFF, 4);
  EXPECT_THAT(BufferDescriptor::Decode(bytes),
              FailsWith("4294967295 allocations exceed the limit of 1048576"));
  // Even with no handle limit, the length check comes before any vector is sized: reserving
  // 2^32 entries would abort the test.
  DecodeLimits limits;
  limits.max_handles = std::numeric_limits<uint32_t>::max();
  EXPECT_THAT(BufferDescriptor::Decode(bytes, limits),
              FailsWith("descriptor is 104 bytes, expected 309237645272 for 4294967295 "
                        "allocations and an owner UUID of 0 bytes"));
}

TEST(DecodeTest, OwnerUuidTooLong) {
  std::string bytes = Fabric({64}, std::nullopt, "GPU-1").Encode();
  Patch(bytes, kOwnerLengthAt, kMaxOwnerUuidBytes + 1, 4);
  EXPECT_THAT(BufferDescriptor::Decode(bytes),
              FailsWith("owner UUID is 257 bytes, at most 256 are allowed"));
  Patch(bytes, kOwnerLengthAt, 0xFFFFFFFF, 4);
  EXPECT_THAT(BufferDescriptor::Decode(bytes),
              FailsWith("owner UUID is 4294967295 bytes, at most 256 are allowed"));
}

TEST(DecodeTest, OwnerLengthDisagreesWithLength) {
  std::string bytes = Fabric({64}, std::nullopt, "GPU-1").Encode();  // 109 -> 112 bytes
  Patch(bytes, kOwnerLengthAt, 9, 4);                                // 113 -> 120 bytes
  EXPECT_THAT(BufferDescriptor::Decode(bytes),
              FailsWith("descriptor is 112 bytes, expected 120 for 1 allocation and an owner "
                        "UUID of 9 bytes"));
}

TEST(DecodeTest, ZeroAllocationSize) {
  std::string bytes = Fabric({64, 64}, 0).Encode();
  Patch(bytes, kSizesAt + 8, 0, 8);
  EXPECT_THAT(BufferDescriptor::Decode(bytes),
              FailsWith("allocation size 1 is 0, expected a positive integer"));
}

TEST(DecodeTest, AllocationSizesOverflow) {
  std::string bytes = Fabric({64, 64, 64}, 0).Encode();
  Patch(bytes, kSizesAt, uint64_t{1} << 63, 8);
  Patch(bytes, kSizesAt + 8, uint64_t{1} << 63, 8);
  DecodeLimits limits;
  limits.max_total_size = kUint64Max;
  EXPECT_THAT(BufferDescriptor::Decode(bytes, limits), FailsWith("allocation sizes overflow"));
  EXPECT_THAT(BufferDescriptor::Decode(bytes), FailsWith("allocation sizes overflow"));
  Patch(bytes, kSizesAt, kUint64Max, 8);
  Patch(bytes, kSizesAt + 8, 1, 8);
  EXPECT_THAT(BufferDescriptor::Decode(bytes, limits), FailsWith("allocation sizes overflow"));
}

TEST(DecodeTest, Granularity) {
  DecodeLimits limits;
  limits.granularity = 2 * kMiB;
  EXPECT_TRUE(BufferDescriptor::Decode(Fabric({2 * kMiB, 4 * kMiB}).Encode(), limits).ok());
  EXPECT_THAT(BufferDescriptor::Decode(Fabric({2 * kMiB, 3 * kMiB}).Encode(), limits),
              FailsWith("allocation size 1 is 3145728, not a multiple of the granularity "
                        "2097152"));
  EXPECT_THAT(BufferDescriptor::Decode(Fabric({4096}).Encode(), limits),
              FailsWith("allocation size 0 is 4096, not a multiple of the granularity 2097152"));
  // The buffer's own size and offset need not be multiples.
  EXPECT_TRUE(
      BufferDescriptor::Decode(Fabric({2 * kMiB}, 1000, std::nullopt, 24).Encode(), limits)
          .ok());
}

TEST(DecodeTest, ZeroGranularityIsRejected) {
  DecodeLimits limits;
  limits.granularity = 0;
  EXPECT_THAT(BufferDescriptor::Decode(Fabric({64}).Encode(), limits),
              FailsWith("decode limits: granularity must be positive"));
}

TEST(DecodeTest, MaxTotalSize) {
  DecodeLimits limits;
  limits.max_total_size = 4 * kMiB;
  EXPECT_TRUE(BufferDescriptor::Decode(Fabric({2 * kMiB, 2 * kMiB}).Encode(), limits).ok());
  EXPECT_THAT(BufferDescriptor::Decode(Fabric({2 * kMiB, 2 * kMiB, 1}).Encode(), limits),
              FailsWith("allocation sizes total 4194305 bytes, above the limit of 4194304"));
  // The default limit is 1 PiB.
  EXPECT_THAT(BufferDescriptor::Decode(Fabric({int64_t{1} << 50, 2 * kMiB}).Encode()),
              FailsWith("allocation sizes total 1125899908939776 bytes, above the limit of "
                        "1125899906842624"));
}

TEST(DecodeTest, SizeAndOffsetBounds) {
  const std::string valid = Fabric({64}).Encode();
  std::string bytes = valid;
  Patch(bytes, kSizeAt, 100, 8);
  EXPECT_THAT(BufferDescriptor::Decode(bytes), FailsWith("size 100 is outside [0, 64]"));
  bytes = valid;
  Patch(bytes, kOffsetAt, 65, 8);
  EXPECT_THAT(BufferDescriptor::Decode(bytes), FailsWith("offset 65 is outside [0, 64]"));
  bytes = valid;
  Patch(bytes, kOffsetAt, 16, 8);
  EXPECT_THAT(BufferDescriptor::Decode(bytes),
              FailsWith("offset 16 + size 64 is beyond the 64 bytes of the allocations"));
  bytes = valid;
  Patch(bytes, kSizeAt, kUint64Max, 8);
  Patch(bytes, kOffsetAt, kUint64Max, 8);
  EXPECT_THAT(BufferDescriptor::Decode(bytes),
              FailsWith("offset 18446744073709551615 is outside [0, 64]"));
}

TEST(DecodeTest, OffsetPlusSizeThatWouldWrapIsRejected) {
  std::string bytes = Fabric({kInt64Max, kInt64Max}).Encode();
  Patch(bytes, kOffsetAt, kUint64Max - 1, 8);  // == the sum
  Patch(bytes, kSizeAt, 2, 8);                 // offset + size wraps to 0
  DecodeLimits limits;
  limits.max_total_size = kUint64Max;
  EXPECT_THAT(BufferDescriptor::Decode(bytes, limits),
              FailsWith("offset 18446744073709551614 + size 2 is beyond the "
                        "18446744073709551614 bytes of the allocations"));
}

TEST(DecodeTest, NonzeroPadding) {
  // 32 + 72 + 3 = 107 bytes, padded with 5 zeros to 112.
  const std::string valid = Fabric({64}, std::nullopt, "abc").Encode();
  ASSERT_EQ(valid.size(), 112u);
  for (size_t at = 107; at < 112; ++at) {
    std::string bytes = valid;
    bytes[at] = '\x01';
    EXPECT_THAT(BufferDescriptor::Decode(bytes),
                FailsWith(absl::StrCat("padding byte at offset ", at, " is 0x01, expected 0")));
  }
}

TEST(DecodeTest, EverySingleBitFlipFailsOrStaysCanonical) {
  for (const BufferDescriptor& d : SampleDescriptors()) {
    const std::string valid = d.Encode();
    for (size_t at = 0; at < valid.size(); ++at) {
      for (int bit = 0; bit < 8; ++bit) {
        std::string bytes = valid;
        bytes[at] = static_cast<char>(bytes[at] ^ (1 << bit));
        absl::StatusOr<BufferDescriptor> decoded = BufferDescriptor::Decode(bytes);
        if (decoded.ok()) {
          ASSERT_EQ(decoded->Encode(), bytes) << "byte " << at << " bit " << bit;
        } else {
          ASSERT_EQ(decoded.status().code(), absl::StatusCode::kInvalidArgument)
              << decoded.status();
        }
      }
    }
  }
}

}  // namespace
}  // namespace vmm
