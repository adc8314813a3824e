// The plugin's joining of a MemPool over another allocator's figures with libvmm's
// (torch_plugin/csrc/joint_peaks.h): the whole of allocated and reserved bytes keeps libvmm's
// joint peak (no second peak added on top), other figures add up, and parts peak no higher
// than their whole.
#include "torch_plugin/csrc/joint_peaks.h"

#include <array>
#include <cstdint>

#include "allocator/stat.h"
#include "gtest/gtest.h"

namespace vmm_torch {
namespace {

using Group = std::array<vmm::Stat, 3>;  // all, small pool, large pool

// The groups of PyTorch's DeviceStats that HoldPartsWithinJointPeaks reads.
struct Stats {
  Group allocated_bytes, reserved_bytes, requested_bytes, segment;
};

vmm::Stat S(int64_t current, int64_t peak, int64_t allocated = 0, int64_t freed = 0) {
  vmm::Stat s;
  s.current = current;
  s.peak = peak;
  s.allocated = allocated;
  s.freed = freed;
  return s;
}

// libvmm's figures: 256 MiB allocated at its peak, now freed; its joint peak already counts
// the 256 MiB the other allocator's pool holds now, so the sum is not 512.
TEST(JointPeaksTest, TheWholeOfAJointGroupKeepsLibvmmsPeak) {
  constexpr int64_t kMiB = int64_t{1} << 20;
  Stats gpu;
  gpu.allocated_bytes = {S(0, 256 * kMiB, 256 * kMiB, 256 * kMiB), S(0, 0),
                         S(0, 256 * kMiB, 256 * kMiB, 256 * kMiB)};
  const Group pool = {S(256 * kMiB, 256 * kMiB, 256 * kMiB), S(0, 0),
                      S(256 * kMiB, 256 * kMiB, 256 * kMiB)};
  AddGroup(pool, gpu.allocated_bytes, /*joint=*/true);
  EXPECT_EQ(gpu.allocated_bytes[kAll].current, 256 * kMiB);
  EXPECT_EQ(gpu.allocated_bytes[kAll].peak, 256 * kMiB) << "not the sum of the two peaks";
  EXPECT_EQ(gpu.allocated_bytes[kAll].allocated, 512 * kMiB);
  EXPECT_EQ(gpu.allocated_bytes[kAll].freed, 256 * kMiB);
  // The large pool's part is a sum of peaks (512 MiB) until held within the whole.
  EXPECT_EQ(gpu.allocated_bytes[2].peak, 512 * kMiB);
  HoldPartsWithinJointPeaks(gpu);
  EXPECT_EQ(gpu.allocated_bytes[2].peak, 256 * kMiB);
  EXPECT_EQ(gpu.allocated_bytes[kAll].peak, 256 * kMiB);
}

// Groups that are not joint (counts, requested bytes) add their peaks: at least the true
// peak, as before.
TEST(JointPeaksTest, OtherGroupsAddTheirPeaks) {
  Stats gpu;
  gpu.segment = {S(1, 3), S(0, 1), S(1, 2)};
  AddGroup(Group{S(2, 2), S(1, 1), S(1, 1)}, gpu.segment, /*joint=*/false);
  EXPECT_EQ(gpu.segment[kAll].current, 3);
  EXPECT_EQ(gpu.segment[kAll].peak, 5);
  EXPECT_EQ(gpu.segment[1].peak, 2);
}

// Figures read apart: the currents summed may pass libvmm's joint peak (a block the other
// pool handed out between the two reads); the whole's peak then covers its current, and a
// part's peak is never below its own current, whatever the whole.
TEST(JointPeaksTest, PeaksCoverCurrentsReadApartAndPartsStayWithinTheWhole) {
  Stats gpu;
  gpu.allocated_bytes = {S(100, 100), S(10, 10), S(90, 90)};
  gpu.reserved_bytes = {S(200, 200), S(20, 20), S(180, 180)};
  gpu.requested_bytes = {S(90, 95), S(9, 9), S(81, 86)};
  AddGroup(Group{S(50, 60), S(0, 0), S(50, 60)}, gpu.allocated_bytes, /*joint=*/true);
  AddGroup(Group{S(64, 64), S(0, 0), S(64, 64)}, gpu.reserved_bytes, /*joint=*/true);
  AddGroup(Group{S(40, 200), S(0, 0), S(40, 200)}, gpu.requested_bytes, /*joint=*/false);
  HoldPartsWithinJointPeaks(gpu);
  EXPECT_EQ(gpu.allocated_bytes[kAll].peak, 150) << "covers 100 + 50 allocated now";
  EXPECT_EQ(gpu.reserved_bytes[kAll].peak, 264);
  EXPECT_EQ(gpu.allocated_bytes[2].peak, 150) << "150 (the sum 90 + 60) within 150";
  EXPECT_EQ(gpu.reserved_bytes[2].peak, 244);
  // Requested bytes peak within allocated bytes of the same pool type.
  EXPECT_EQ(gpu.requested_bytes[kAll].peak, 150);
  EXPECT_EQ(gpu.requested_bytes[2].peak, 150);
  EXPECT_EQ(gpu.requested_bytes[1].peak, 9);
  for (const Group* g : {&gpu.allocated_bytes, &gpu.reserved_bytes, &gpu.requested_bytes}) {
    for (const vmm::Stat& s : *g) EXPECT_GE(s.peak, s.current);
  }
}

}  // namespace
}  // namespace vmm_torch
