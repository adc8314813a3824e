// The GPU's statistics where vmm's pools and the MemPools over other allocators meet
// (foreign_segments.h): PyTorch keeps one set of figures per GPU over every pool, so the
// peaks of allocated and reserved bytes are of their sum, which only libvmm can keep (its
// DeviceCap's joint figures: the plugin tells it each such pool's blocks and segments,
// vmm_device_hold_allocated / vmm_device_hold). getDeviceStats adds such a pool's figures to
// libvmm's with AddGroup, then calls HoldPartsWithinJointPeaks.
//
// Header only and free of PyTorch, so that the host tests can check it
// (tests/joint_peaks_test.cc): it works on any statistic with `current`, `peak`,
// `allocated` and `freed` (PyTorch's c10::CachingAllocator::Stat, vmm::Stat), in arrays
// indexed as PyTorch's StatType (kAll first). Nothing fails.
#ifndef VMM_TORCH_PLUGIN_CSRC_JOINT_PEAKS_H_
#define VMM_TORCH_PLUGIN_CSRC_JOINT_PEAKS_H_

#include <algorithm>
#include <cstddef>
#include <initializer_list>

#include "allocator/stat.h"

namespace vmm_torch {

inline constexpr size_t kAll = 0;  // PyTorch's StatType::AGGREGATE, vmm's VMM_STAT_ALL

// Adds `from`, one group of a pool over another allocator, to `to`, the GPU's: currents and
// totals, and peaks but for the whole of a `joint` group (allocated or reserved bytes), whose
// peak libvmm already gives of the sum.
template <typename ToArray, typename FromArray>
void AddGroup(const FromArray& from, ToArray& to, bool joint) {
  for (size_t i = 0; i < from.size() && i < to.size(); ++i) {
    to[i].current += from[i].current;
    if (!(joint && i == kAll)) to[i].peak += from[i].peak;
    to[i].allocated += from[i].allocated;
    to[i].freed += from[i].freed;
  }
}

// After AddGroup: the joint peaks cover the currents they now add up to (read apart from
// them), and the peaks of their parts (small and large pool, requested bytes), sums of the
// pools' peaks, are held within them, as libvmm holds its own.
template <typename Stats>
void HoldPartsWithinJointPeaks(Stats& out) {
  for (auto* whole : {&out.allocated_bytes, &out.reserved_bytes}) {
    (*whole)[kAll].peak = std::max((*whole)[kAll].peak, (*whole)[kAll].current);
  }
  for (size_t i = 0; i < out.allocated_bytes.size(); ++i) {
    if (i != kAll) {
      vmm::HoldPeakWithin(out.allocated_bytes[i], out.allocated_bytes[kAll]);
      vmm::HoldPeakWithin(out.reserved_bytes[i], out.reserved_bytes[kAll]);
    }
    vmm::HoldPeakWithin(out.requested_bytes[i], out.allocated_bytes[i]);
  }
}

}  // namespace vmm_torch

#endif  // VMM_TORCH_PLUGIN_CSRC_JOINT_PEAKS_H_
