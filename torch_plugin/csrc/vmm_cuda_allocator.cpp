// vmm as a full PyTorch CUDA allocator (CUDA builds of PyTorch 2.3 and later): the Python module
// vmm_torch._cuda_allocator.
//
// CUDAPluggableAllocator over C functions (what vmm_ops.cpp offers) covers malloc and free
// only: torch.cuda.memory_stats(), memory_snapshot(), _record_memory_history(), CUDA graph
// pools, CUDA graph trees (torch.compile mode="reduce-overhead") and OOM observers all raise
// or do nothing there. This file subclasses it and answers them from libvmm:
//   - statistics (getDeviceStats, reset*): vmm_device_torch_stats, PyTorch's fields;
//   - snapshot(): the segments and blocks of vmm's device pools and private pools
//     (vmm_snapshot_get), with the stack of each live block's allocation while history is
//     recorded, and the trace of allocations and frees (recordHistory: PyTorch's own context
//     recorder gathers the stacks; nothing is recorded, and nothing costs, while it is off);
//   - private pools (CUDA graphs, torch.cuda.MemPool): beginAllocateToPool routes the
//     allocations its filter accepts to a vmm private pool (vmm_private_pool_use), whose
//     memory no other allocation gets and none of which goes back to the driver while the pool
//     is in use; releasePool drops a use; checkPoolLiveAllocations and the checkpoints of graph
//     trees (getCheckpointState / setCheckpointPoolState) from the pool's live blocks
//     (vmm_pool_live_blocks, vmm_pool_alloc_at);
//   - a MemPool over another allocator (torch.cuda.MemPool(CUDAPluggableAllocator...)): its
//     allocations come from segments that allocator gives, split and cached as PyTorch's
//     allocator does (foreign_segments.h), counted in the statistics and the snapshot;
//   - out of memory: the observers attached are called, an "oom" trace entry is recorded, and
//     c10::OutOfMemoryError (torch.cuda.OutOfMemoryError) carries vmm's message.
// Everything else (malloc bookkeeping, record_stream, raw_alloc) is CUDAPluggableAllocator's.
//
// The module is built by `pip install` only where torch has CUDA (setup.py); a torch whose
// allocator interface differs fails to build it, and vmm_torch then falls back to
// CUDAPluggableAllocator over vmm_ops.cpp's functions (vmm_torch.allocator).
//
// Module functions:
//   bind(libvmm_path): looks up libvmm.so's functions (the instance Python loaded).
//   install(): makes a VmmAllocator PyTorch's CUDA allocator (before CUDA is initialised).
//   pool_allocator(options): a VmmAllocator object (torch._C._cuda_CUDAAllocator) for
//     torch.cuda.MemPool: the private pools made for it take `options`.
//   pool_ids(allocator, device, id0, id1): vmm's ids of the pools behind a MemPool.
//   prepare_send(t), export_send(t): the steps of a send of a CUDA tensor (send_steps.h);
//   record_ready(t), wait_ready(t), discard_ready(t): its ready events (ready_events.h).
#include <dlfcn.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <initializer_list>
#include <iterator>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include <c10/core/Allocator.h>
#include <c10/core/impl/GPUTrace.h>
#include <c10/cuda/CUDACachingAllocator.h>
#if __has_include(<c10/cuda/CUDAAllocatorConfig.h>)
#include <c10/cuda/CUDAAllocatorConfig.h>
#define VMM_TORCH_HAS_ALLOCATOR_CONFIG 1
#endif
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>
#include <pybind11/stl.h>
#include <torch/extension.h>
#include <torch/version.h>
// c10::AcceleratorError (torch.AcceleratorError): what PyTorch raises for a failing CUDA call
// since torch 2.8; before, RuntimeError.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 8)
#define VMM_TORCH_HAS_ACCELERATOR_ERROR 1
#endif

#include "torch_plugin/csrc/alloc_history.h"
#include "torch_plugin/csrc/foreign_index.h"
#include "torch_plugin/csrc/foreign_segments.h"
#include "torch_plugin/csrc/foreign_source.h"
#include "torch_plugin/csrc/joint_peaks.h"
#include "torch_plugin/csrc/legacy_ipc.h"
#include "torch_plugin/csrc/pool_stream.h"
#include "torch_plugin/csrc/ready_events.h"
#include "torch_plugin/csrc/send_steps.h"
#include "torch_plugin/csrc/libvmm_symbols.h"
#include "torch_plugin/vmm_c.h"

namespace {

namespace cca = c10::cuda::CUDACachingAllocator;
namespace cda = c10::CachingDeviceAllocator;
using Pluggable = torch::cuda::CUDAPluggableAllocator::CUDAPluggableAllocator;
using c10::cuda::MempoolId_t;

// Runs a blocking wait of the send steps without the GIL (send_steps.h).
struct WithoutGil {
  template <typename F>
  void operator()(F&& wait) const {
    py::gil_scoped_release unlocked;
    wait();
  }
};

void RequireBound() {
  TORCH_CHECK(libvmm.alloc != nullptr, "vmm: call vmm_torch._cuda_allocator.bind first");
}

// Throws what libvmm's last failure says, as PyTorch's allocator raises through the same
// entry points: c10::OutOfMemoryError for VMM_RESOURCE_EXHAUSTED, else c10::Error
// (RuntimeError), bad arguments included. PyTorch's allocator raises RuntimeError for a handle
// it cannot open, a pool or pointer it does not know, and a program catches that; vmm's own
// API (vmm_ops.cpp) raises ValueError for bad arguments, this interface does not.
// A failure of a CUDA driver call (libvmm's last driver error; out of memory aside) is
// c10::AcceleratorError with the driver's code where torch has it, as PyTorch raises for a
// failing CUDA call: after a device-side assert a call that synchronises or waits on the GPU
// fails so (mapping new memory may not), and programs catch torch.AcceleratorError. The driver's codes for the errors of a broken
// context (700-720: illegal address, assert, launch failure...) are the runtime's too.
[[noreturn]] void ThrowLastError(const std::string& what) {
  const int code = libvmm.last_error_code();
  const std::string message = libvmm.last_error();
  TORCH_CHECK_WITH(OutOfMemoryError, code != VMM_RESOURCE_EXHAUSTED,
                   "CUDA out of memory. vmm: ", what, ": ", message);
#ifdef VMM_TORCH_HAS_ACCELERATOR_ERROR
  if (const int driver_error = libvmm.last_driver_error(); driver_error != 0) {
    throw c10::AcceleratorError({__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
                                driver_error, "CUDA error: vmm: " + what + ": " + message);
  }
#endif
  TORCH_CHECK(false, "vmm: ", what, ": ", message);
}

// "8.00 GiB", as PyTorch's out-of-memory messages give sizes.
std::string FormatSize(size_t bytes) {
  static const char* const kUnits[] = {"bytes", "KiB", "MiB", "GiB", "TiB", "PiB"};
  if (bytes < 1024) return std::to_string(bytes) + " bytes";
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1024.0 && unit < 5) {
    value /= 1024.0;
    ++unit;
  }
  char text[32];
  std::snprintf(text, sizeof(text), "%.2f %s", value, kUnits[unit]);
  return text;
}

void CheckOk(int rc, const std::string& what) {
  if (rc != 0) ThrowLastError(what);
}

c10::CachingAllocator::Stat ToStat(const vmm_stat& s) {
  c10::CachingAllocator::Stat out;
  out.current = s.current;
  out.peak = s.peak;
  out.allocated = s.allocated;
  out.freed = s.freed;
  return out;
}

void ToStatArray(const vmm_stat (&in)[VMM_STAT_TYPES], c10::CachingAllocator::StatArray* out) {
  for (size_t i = 0; i < VMM_STAT_TYPES && i < out->size(); ++i) (*out)[i] = ToStat(in[i]);
}

// A checkpoint of a private pool (CUDA graph trees): its live blocks when it was taken.
struct VmmPoolState : cca::AllocatorState {
  c10::DeviceIndex device = 0;
  MempoolId_t id{0, 0};
  std::vector<vmm_block_entry> live;
};

// The live blocks of vmm pool `pool`, in address order.
std::vector<vmm_block_entry> LiveBlocks(int64_t pool) {
  std::vector<vmm_block_entry> blocks(64);
  for (;;) {
    const int64_t n = libvmm.pool_live_blocks(pool, blocks.data(), blocks.size());
    if (n < 0) ThrowLastError("listing a private pool's live blocks");
    if (static_cast<size_t>(n) <= blocks.size()) {
      blocks.resize(static_cast<size_t>(n));
      return blocks;
    }
    blocks.resize(static_cast<size_t>(n));
  }
}

struct MempoolIdHash {
  size_t operator()(const std::pair<int, MempoolId_t>& key) const {
    return std::hash<uint64_t>()(key.second.first * 1000003u ^ key.second.second) ^
           static_cast<size_t>(key.first);
  }
};

// Whether config class C has a static per_process_memory_fraction() (PYTORCH_CUDA_ALLOC_CONF's
// per_process_memory_fraction, in newer torch releases).
template <typename C, typename = void>
struct HasProcessFraction : std::false_type {};
template <typename C>
struct HasProcessFraction<C, std::void_t<decltype(C::per_process_memory_fraction())>>
    : std::true_type {};
template <typename Config>
double ProcessFractionOf() {
  if constexpr (HasProcessFraction<Config>::value) {
    return Config::per_process_memory_fraction();
  } else {
    return 1.0;
  }
}

// The memory fraction PYTORCH_CUDA_ALLOC_CONF gives every GPU (1.0 where it gives none or the
// torch does not read one). Its first call parses the variable, as PyTorch's allocator's first
// use does, and throws what that parse throws for a bad value.
double ConfiguredFraction() {
#ifdef VMM_TORCH_HAS_ALLOCATOR_CONFIG
  return ProcessFractionOf<c10::cuda::CUDACachingAllocator::CUDAAllocatorConfig>();
#else
  return 1.0;
#endif
}

// PYTORCH_CUDA_ALLOC_CONF's pinned-memory settings, which PyTorch's host allocator applies
// under vmm too: what a snapshot reports in allocator_settings (0 and false where this torch
// has no such settings).
struct PinnedSettings {
  size_t register_threads = 0;
  bool host_register = false;
};
template <typename C, typename = void>
struct HasPinnedSettings : std::false_type {};
template <typename C>
struct HasPinnedSettings<C, std::void_t<decltype(C::pinned_num_register_threads()),
                                        decltype(C::pinned_use_cuda_host_register())>>
    : std::true_type {};
template <typename Config>
PinnedSettings PinnedSettingsOf() {
  if constexpr (HasPinnedSettings<Config>::value) {
    return {static_cast<size_t>(Config::pinned_num_register_threads()),
            static_cast<bool>(Config::pinned_use_cuda_host_register())};
  } else {
    return {};
  }
}
PinnedSettings ConfiguredPinnedSettings() {
#ifdef VMM_TORCH_HAS_ALLOCATOR_CONFIG
  return PinnedSettingsOf<c10::cuda::CUDACachingAllocator::CUDAAllocatorConfig>();
#else
  return {};
#endif
}

// Set once Python has finished (Py_AtExit: the end of its finalisation; an atexit handler
// too, for a process that exits without finalising Python; both registered by Install): the
// process is exiting. What C++ code frees from then on (thread_local and static destructors:
// PyTorch's holds the storages it kept for CUDA IPC receivers that never released them) is
// not given back, and imports are not closed: the CUDA driver is shutting down, and the
// memory goes with the process. Such frees crashed a process (case
// u_shared_storage_odd_handles; the double free most likely libvmm's error record, written
// after its destruction, vmm_c.cc). Trivially destructible: read after every destructor.
std::atomic<bool> process_exiting{false};

void MarkProcessExiting() { process_exiting.store(true, std::memory_order_relaxed); }

// PyTorch's CUDA allocator over libvmm (see the file comment).
class VmmAllocator : public Pluggable {
 public:
  // `options`: the vmm options of the private pools made for MemPools of this allocator
  // ("" for the device pools' options).
  explicit VmmAllocator(std::string options)
      : Pluggable([](size_t, int, cudaStream_t) -> void* { return nullptr; },
                  [](void*, size_t, int, cudaStream_t) {}),
        options_(std::move(options)) {
    alloc_fn_ = [this](size_t size, int device, cudaStream_t stream) {
      return Malloc(size, device, stream);
    };
    free_fn_ = [this](void* ptr, size_t size, int device, cudaStream_t stream) {
      Free(ptr, size, device, stream);
    };
    // A CUDA error raises, as PyTorch's allocator's synchronisation raises it (a program's
    // error handler after a device-side assert calls empty_cache); vmm's own failures warn.
    reset_fn_ = [] {
      if (libvmm.empty_cache(-1) == 0) return;
      if (libvmm.last_driver_error() != 0) ThrowLastError("empty_cache");
      TORCH_WARN("vmm: empty_cache failed: ", libvmm.last_error());
    };
    memory_fraction_fn_ = [this](double fraction, int device) {
      CheckDevice(device, "set_per_process_memory_fraction");
      // RuntimeError, as PyTorch's allocator refuses it (torch.cuda's own check lets NaN by);
      // checked here so that the message names the range.
      TORCH_CHECK(fraction >= 0 && fraction <= 1, "vmm: invalid memory fraction ", fraction,
                  ": set_per_process_memory_fraction takes one within [0, 1]");
      // Under mu_ with the libvmm call, as ApplyConfiguredFraction: the fraction set last is
      // the one both keep.
      std::lock_guard<std::mutex> lock(mu_);
      CheckOk(libvmm.set_memory_fraction(fraction, device), "set_per_process_memory_fraction");
      fractions_[device] = fraction;
      // Set by the program: the variable's fraction no longer applies to this GPU.
      if (device >= 0 && device < kFractionDevices) {
        fraction_read_[device].store(true, std::memory_order_release);
      }
    };
    record_stream_fn_ = [this](void* ptr, cudaStream_t stream) {
      // A block of a MemPool over another allocator keeps the stream until its free (asked
      // first: that allocator's memory may be vmm's own). Memory vmm does not own (an import,
      // DLPack) is left alone, as PyTorch's allocator ignores pointers it did not allocate.
      const vmm_torch::ForeignIndex::Owner owner = foreign_index_.Find(ptr);
      if (owner.pool != nullptr &&
          owner.pool->RecordStream(ptr, reinterpret_cast<uintptr_t>(stream))) {
        return;
      }
      if (libvmm.record_stream(ptr, stream) == 0) return;
      if (libvmm.last_error_code() != VMM_INVALID_ARGUMENT) ThrowLastError("record_stream");
    };
  }

  // Closes the pools of its own (their memory goes back once their last blocks are freed).
  ~VmmAllocator() override { Close(); }

  // Closes the pools of its own now (vmm_torch.MemPool's end; the allocator object itself
  // lives on, since PyTorch may still free segments through it): cached memory goes back,
  // blocks still live go when freed; later allocations through it fail as out of memory.
  void Close() {
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = true;
    for (const auto& [device, pool] : own_pools_) libvmm.pool_destroy(pool);
    own_pools_.clear();
  }

  const std::string& options() const { return options_; }

  // An allocator for torch.cuda.MemPool: while another allocator is current (PyTorch's own),
  // that allocator asks this one for its pool's segments, which come from vmm pools of this
  // allocator's own (one per device, with its options) instead of the device pools.
  void UseOwnPools() { own_pools_only_ = true; }

  // vmm's ids of the pools behind MemPool `id` on `device`: the private pool where this
  // allocator is current, and its own pools.
  std::vector<int64_t> PoolIds(c10::DeviceIndex device, MempoolId_t id) {
    std::vector<int64_t> out;
    const int64_t pool = libvmm.private_pool_find(device, id.first, id.second);
    if (pool >= 0) out.push_back(pool);
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [d, own] : own_pools_) {
      if (d == device) out.push_back(own);
    }
    return out;
  }

  std::string name() override { return "vmm"; }

  // --- Statistics ---------------------------------------------------------------------

  cda::DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    CheckDevice(device, "memory_stats");
    vmm_torch_stats s{};
    CheckOk(libvmm.device_torch_stats(device, &s), "memory_stats");
    cda::DeviceStats out;
    ToStatArray(s.allocation, &out.allocation);
    ToStatArray(s.segment, &out.segment);
    ToStatArray(s.active, &out.active);
    ToStatArray(s.inactive_split, &out.inactive_split);
    ToStatArray(s.allocated_bytes, &out.allocated_bytes);
    ToStatArray(s.reserved_bytes, &out.reserved_bytes);
    ToStatArray(s.active_bytes, &out.active_bytes);
    ToStatArray(s.inactive_split_bytes, &out.inactive_split_bytes);
    ToStatArray(s.requested_bytes, &out.requested_bytes);
    out.num_alloc_retries = s.num_alloc_retries;
    out.num_ooms = s.num_ooms;
    out.oversize_allocations = ToStat(s.oversize_allocations);
    out.oversize_segments = ToStat(s.oversize_segments);
    out.num_sync_all_streams = s.num_sync_all_streams;
    out.num_device_alloc = s.num_device_alloc;
    out.num_device_free = s.num_device_free;
    out.max_split_size = s.max_split_size;
    for (const auto& pool : ForeignPools(device)) AddForeignStats(pool->segments->Stats(), out);
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = foreign_retired_.find(device);
      if (it != foreign_retired_.end()) AddForeignStats(it->second, out);
    }
    vmm_torch::HoldPartsWithinJointPeaks(out);
    return out;
  }

  void resetPeakStats(c10::DeviceIndex device) override {
    CheckDevice(device, "reset_peak_memory_stats");
    CheckOk(libvmm.reset_peak_stats(device), "reset_peak_memory_stats");
    for (const auto& pool : ForeignPools(device)) pool->segments->ResetPeaks();
    std::lock_guard<std::mutex> lock(mu_);
    foreign_retired_[device].ForEachGroup([](vmm_torch::ForeignStats::Group& g) {
      for (vmm_torch::ForeignStat& s : g) s.peak = 0;  // a dropped pool holds nothing now
    });
  }

  void resetAccumulatedStats(c10::DeviceIndex device) override {
    CheckDevice(device, "reset_accumulated_memory_stats");
    CheckOk(libvmm.reset_accumulated_stats(device), "reset_accumulated_memory_stats");
    for (const auto& pool : ForeignPools(device)) pool->segments->ResetAccumulated();
    std::lock_guard<std::mutex> lock(mu_);
    vmm_torch::ForeignStats& retired = foreign_retired_[device];
    retired.ForEachGroup([](vmm_torch::ForeignStats::Group& g) {
      for (vmm_torch::ForeignStat& s : g) s.allocated = s.freed = 0;
    });
    retired.num_device_alloc = retired.num_device_free = retired.num_ooms = 0;
  }

  // --- Snapshot and history -----------------------------------------------------------

  cca::SnapshotInfo snapshot(MempoolId_t mempool_id, bool include_traces) override {
    const uint64_t growth_mark = history_.GrowthMark();  // before the segments are read
    // The segments and the trace agree: PyTorch's memory viewer rebuilds the segments of each
    // moment from the snapshot's, back through the trace's segment entries (segment_map and
    // segment_unmap; segment_alloc and segment_free of MemPools over other allocators), and
    // fails on a mapping that lies in no segment. Where a pool mapped, unmapped, got or gave
    // back memory between the two reads, both are read again (kSnapshotReads at most; then
    // as read).
    const bool all_pools = mempool_id.first == 0 && mempool_id.second == 0;
    std::unique_ptr<vmm_snapshot_entries, decltype(libvmm.snapshot_release)> owned(
        nullptr, libvmm.snapshot_release);
    std::vector<cda::SegmentInfo> foreign;  // the segments of MemPools over other allocators
    std::vector<std::vector<cda::TraceEntry>> traces;
    for (int read = 1;; ++read) {
      const uint64_t serial = history_.SegmentSerial();
      vmm_snapshot_entries* read_entries = nullptr;
      CheckOk(libvmm.snapshot_get(&read_entries), "memory_snapshot");
      owned.reset(read_entries);
      foreign.clear();
      for (const auto& pool : ForeignPools(-1)) AddForeignSegments(*pool, &foreign);
      if (!include_traces) break;
      uint64_t serial_after = 0;
      traces = history_.Traces(0, &serial_after);
      if (serial_after == serial) break;
      if (read == kSnapshotReads) {
        TORCH_WARN_ONCE("vmm: memory snapshot: the pools kept mapping memory while it was read ",
                        kSnapshotReads, " times; its segments and trace may disagree");
        break;
      }
    }
    const vmm_snapshot_entries* entries = owned.get();
    cca::SnapshotInfo out;
    int devices = 0;
    std::vector<std::pair<size_t, size_t>> mapped;  // every segment's address and size
    for (size_t i = 0; i < entries->num_segments; ++i) {
      const vmm_segment_entry& s = entries->segments[i];
      mapped.emplace_back(s.address, s.total_size);
      const MempoolId_t owner{s.mempool_id[0], s.mempool_id[1]};
      const bool private_pool = owner.first != 0 || owner.second != 0;
      if (s.pool != 0 && !private_pool) continue;  // an explicit pool: not PyTorch's memory
      if (!all_pools && owner != mempool_id) continue;
      cda::SegmentInfo segment;
      segment.device = static_cast<c10::DeviceIndex>(s.device);
      devices = std::max(devices, s.device + 1);
      segment.address = s.address;
      segment.total_size = s.total_size;
      segment.requested_size = s.requested_size;
      segment.allocated_size = s.allocated_size;
      segment.active_size = s.active_size;
      segment.stream = reinterpret_cast<void*>(s.stream);
      segment.is_large = s.is_large != 0;
      segment.is_expandable = true;  // mapped chunks of a reserved range, grown in place
      segment.owner_private_pool_id = owner;
      for (size_t b = 0; b < s.num_blocks; ++b) {
        const vmm_block_entry& e = s.blocks[b];
        cda::BlockInfo block;
        block.size = e.size;
        block.requested_size = e.requested_size;
        block.allocated = e.state == VMM_BLOCK_ACTIVE_ALLOCATED;
        block.active = e.state != VMM_BLOCK_INACTIVE;
        segment.blocks.push_back(std::move(block));
      }
      out.segments.push_back(std::move(segment));
    }
    for (cda::SegmentInfo& segment : foreign) {
      mapped.emplace_back(segment.address, segment.total_size);
      if (!all_pools && segment.owner_private_pool_id != mempool_id) continue;
      devices = std::max(devices, segment.device + 1);
      out.segments.push_back(std::move(segment));
    }
    // Each segment the stack of the allocation that grew it (its lowest, where vmm's segment
    // is a run of several growths), each live block its own, while history records stacks.
    vmm_torch::AddStacks(history_, &out.segments);
    std::sort(mapped.begin(), mapped.end());
    history_.KeepGrowthsIn(mapped, growth_mark);
    if (include_traces) {
      traces.resize(std::max(traces.size(), static_cast<size_t>(std::max(devices, 1))));
      // Each device's active blocks (the viewer draws those), by address.
      std::vector<std::vector<std::pair<size_t, size_t>>> blocks(traces.size());
      for (const cda::SegmentInfo& segment : out.segments) {
        if (segment.device < 0 || static_cast<size_t>(segment.device) >= blocks.size()) continue;
        size_t addr = segment.address;
        for (const cda::BlockInfo& block : segment.blocks) {
          if (block.active) blocks[segment.device].emplace_back(addr, block.size);
          addr += block.size;
        }
      }
      for (size_t d = 0; d < traces.size(); ++d) {
        std::sort(blocks[d].begin(), blocks[d].end());
        vmm_torch::KeepWhatTheViewerCanWalk(blocks[d], &traces[d]);
      }
      out.device_traces = std::move(traces);
    }
    vmm_torch::AddAnnotations(history_.Annotations(), &out);  // with traces or not, as PyTorch's
    out.config_metadata.garbage_collection_threshold = 0;
    out.config_metadata.max_split_size = SIZE_MAX;
    out.config_metadata.expandable_segments = true;
    out.config_metadata.release_lock_on_malloc = false;
    // Pinned host memory stays PyTorch's under vmm: its settings are the configuration's.
    const PinnedSettings pinned = ConfiguredPinnedSettings();
    out.config_metadata.pinned_num_register_threads = pinned.register_threads;
    out.config_metadata.pinned_use_host_register = pinned.host_register;
    out.config_metadata.graph_capture_record_stream_reuse = false;
    out.config_metadata.last_allocator_settings = "vmm";
    return out;
  }

  bool isHistoryEnabled() override { return history_.on(); }

  void recordHistory(bool enabled, cca::CreateContextFn context_recorder,
                     size_t alloc_trace_max_entries, cca::RecordContext when,
                     bool clear_history, const std::vector<std::string>& skip_actions) override {
    history_.Configure(enabled, context_recorder, alloc_trace_max_entries, when, clear_history,
                       skip_actions);
  }

  // PyTorch's virtuals where this torch has them (hence no `override`: with a torch whose
  // allocator interface lacks them they are plain members, unused).
  void setUserMetadata(const std::string& metadata) {
    history_.SetUserMetadata(c10::cuda::current_device(), metadata);
  }
  std::string getUserMetadata() { return history_.UserMetadata(c10::cuda::current_device()); }
  void pushCompileContext(std::string& md) {
    history_.PushCompileContext(c10::cuda::current_device(), md);
  }
  void popCompileContext() { history_.PopCompileContext(c10::cuda::current_device()); }

  // torch.profiler.record_function's regions while history is recorded (PyTorch's hooks call
  // it with {"name", ...}, {"stage", "START" or "END"}): the snapshot's external_annotations.
  void recordAnnotation(const std::vector<std::pair<std::string, std::string>>& metadata) {
    history_.Annotate(c10::cuda::current_device(), metadata);
  }

  void attachOutOfMemoryObserver(cca::OutOfMemoryObserver observer) override {
    std::lock_guard<std::mutex> lock(mu_);
    oom_observers_.push_back(std::move(observer));
  }

  void attachAllocatorTraceTracker(cca::AllocatorTraceTracker tracker) override {
    history_.AddTracker(std::move(tracker));
  }

  // vmm_set_mapping_callback's callback (Install): a range a device pool or private pool
  // mapped or unmapped, told with that pool's lock held. While history is recorded it is a
  // segment_map / segment_unmap entry, as PyTorch's expandable segments record theirs.
  static void TellMapping(const vmm_mapping_event* event, void* self) {
    vmm_torch::History& history = static_cast<VmmAllocator*>(self)->history_;
    if (!history.on()) return;
    history.RecordSegment(
        event->mapped != 0 ? cda::TraceEntry::SEGMENT_MAP : cda::TraceEntry::SEGMENT_UNMAP,
        static_cast<c10::DeviceIndex>(event->device), event->address, event->size,
        /*stream=*/nullptr, MempoolId_t{event->mempool_id[0], event->mempool_id[1]});
  }

  // --- Private pools ------------------------------------------------------------------

  // A route is open from before a CUDA graph's capture begins to after it ends (and for a
  // MemPool's context): imports dropped meanwhile are closed after it, since closing one
  // synchronizes the devices, which would invalidate a capture in CUDA's global mode
  // (vmm_imports_hold_closing waits for a close already running).
  void beginAllocateToPool(c10::DeviceIndex device, MempoolId_t mempool_id,
                           std::function<bool(cudaStream_t)> filter) override {
    CheckDevice(device, "use_mem_pool");
    // A MemPool over another allocator keeps being served by it; any other pool is vmm's.
    std::shared_ptr<ForeignPool> foreign = UseForeignPool(device, mempool_id, nullptr);
    const int64_t pool = foreign != nullptr ? -1 : UsePool(device, mempool_id, nullptr);
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (const Route& route : routes_) {
        TORCH_CHECK(!(route.device == device && route.id == mempool_id),
                    "vmm: beginAllocateToPool: already allocating to pool (", mempool_id.first,
                    ", ", mempool_id.second, ")");
      }
      routes_.push_back(Route{device, mempool_id, std::move(filter), pool, std::move(foreign)});
      routes_empty_.store(false, std::memory_order_relaxed);
    }
    libvmm.imports_hold_closing();
  }

  void endAllocateToPool(c10::DeviceIndex device, MempoolId_t mempool_id) override {
    CheckDevice(device, "use_mem_pool");
    TORCH_CHECK(EndRoute(device, mempool_id), "vmm: endAllocateToPool: not allocating to pool (",
                mempool_id.first, ", ", mempool_id.second, ")");
  }

  void releasePool(c10::DeviceIndex device, MempoolId_t mempool_id) override {
    if (getPoolUseCount(device, mempool_id) == 1) {
      // An open route holds a use of its pool (beginAllocateToPool), so at the pool's last
      // use a route still open is that of a capture that failed (cudaStreamEndCapture raised
      // before the route ended): ended here, before the pool's memory goes, so that the
      // capture window does not stay open for good. The route of a MemPool's context or of a
      // capture under way, whose pool has other uses, stays (a graph of the pool reset
      // inside the context).
      EndRoute(device, mempool_id);
    }
    if (ReleaseForeignPool(device, mempool_id)) return;
    const int left = libvmm.private_pool_release(device, mempool_id.first, mempool_id.second);
    if (left < 0) ThrowLastError("releasing a private pool");
    if (left == 0) {
      std::lock_guard<std::mutex> lock(mu_);
      pools_.erase({device, mempool_id});
    }
  }

  int getPoolUseCount(c10::DeviceIndex device, MempoolId_t mempool_id) override {
    CheckDevice(device, "MemPool.use_count");
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = foreign_.find({device, mempool_id});
      if (it != foreign_.end()) return it->second->uses;
    }
    return libvmm.private_pool_use_count(device, mempool_id.first, mempool_id.second);
  }

  // A MemPool over vmm's allocator (vmm_torch.MemPool), or none, is a vmm private pool; over
  // another allocator (a CUDAPluggableAllocator), that allocator's segments serve it.
  void createOrIncrefPool(c10::DeviceIndex device, MempoolId_t mempool_id,
                          std::shared_ptr<cca::CUDAAllocator> allocator) override {
    CheckDevice(device, "MemPool");
    auto* mine = dynamic_cast<VmmAllocator*>(allocator.get());
    if (allocator != nullptr && mine == nullptr) {
      UseForeignPool(device, mempool_id, std::move(allocator));
      return;
    }
    if (UseForeignPool(device, mempool_id, nullptr) != nullptr) return;
    UsePool(device, mempool_id, mine);
  }

  void setUseOnOOM(c10::DeviceIndex device, MempoolId_t mempool_id, bool use_on_oom) override {
    CheckDevice(device, "MemPool use_on_oom");
    std::lock_guard<std::mutex> lock(mu_);
    if (auto f = foreign_.find({device, mempool_id}); f != foreign_.end()) {
      f->second->use_on_oom = use_on_oom;
      return;
    }
    auto it = pools_.find({device, mempool_id});
    TORCH_CHECK(it != pools_.end(), "vmm: setUseOnOOM: no pool (", mempool_id.first, ", ",
                mempool_id.second, ") on device ", device);
    it->second.use_on_oom = use_on_oom;
  }

  // No two blocks of the pool share a segment from now on, as with PyTorch's allocator
  // (MemPool(no_split=True), which sets it as the pool is made). A pool over another allocator
  // stops splitting its segments; a vmm private pool gives each block a chunk of its own, whole
  // (vmm_pool_set_no_split). One that already holds memory is warned about and keeps splitting.
  void setNoSplit(c10::DeviceIndex device, MempoolId_t mempool_id) override {
    CheckDevice(device, "MemPool no_split");
    std::shared_ptr<ForeignPool> foreign;
    int64_t vmm_pool = -1;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (auto f = foreign_.find({device, mempool_id}); f != foreign_.end()) {
        foreign = f->second;
      } else if (auto it = pools_.find({device, mempool_id}); it != pools_.end()) {
        vmm_pool = it->second.vmm_pool;
      }
    }
    if (foreign != nullptr) {
      foreign->segments->set_no_split(true);
      return;
    }
    TORCH_CHECK(vmm_pool > 0, "vmm: setNoSplit: no pool (", mempool_id.first, ", ",
                mempool_id.second, ") on device ", device);
    if (libvmm.pool_set_no_split(vmm_pool) == 0) return;
    if (libvmm.last_error_code() != VMM_FAILED_PRECONDITION) ThrowLastError("MemPool no_split");
    TORCH_WARN("vmm: MemPool no_split not honoured: ", libvmm.last_error());
  }

  bool checkPoolLiveAllocations(c10::DeviceIndex device, MempoolId_t mempool_id,
                                const std::unordered_set<void*>& expected) override {
    const int64_t pool = libvmm.private_pool_find(device, mempool_id.first, mempool_id.second);
    if (pool < 0) return expected.empty();
    size_t matched = 0;
    for (const vmm_block_entry& block : LiveBlocks(pool)) {
      if (block.state != VMM_BLOCK_ACTIVE_ALLOCATED) continue;
      if (expected.count(reinterpret_cast<void*>(block.address)) == 0) return false;
      ++matched;
    }
    return matched == expected.size();
  }

  std::shared_ptr<cca::AllocatorState> getCheckpointState(c10::DeviceIndex device,
                                                          MempoolId_t id) override {
    auto state = std::make_shared<VmmPoolState>();
    state->device = device;
    state->id = id;
    const int64_t pool = libvmm.private_pool_find(device, id.first, id.second);
    TORCH_CHECK(pool >= 0, "vmm: getCheckpointState: no pool (", id.first, ", ", id.second,
                ") on device ", device);
    for (const vmm_block_entry& block : LiveBlocks(pool)) {
      if (block.state == VMM_BLOCK_ACTIVE_ALLOCATED) state->live.push_back(block);
    }
    return state;
  }

  // Frees every live block of the pool, then allocates the checkpoint's live blocks again at
  // their addresses: the blocks freed and the new data pointers go back to PyTorch, which
  // moves the live storages onto them.
  cca::CheckpointDelta setCheckpointPoolState(
      c10::DeviceIndex device, std::shared_ptr<cca::AllocatorState> pps) override {
    auto* state = dynamic_cast<VmmPoolState*>(pps.get());
    TORCH_CHECK(state != nullptr && state->device == device,
                "vmm: setCheckpointPoolState: not a vmm checkpoint of device ", device);
    const int64_t pool = libvmm.private_pool_find(device, state->id.first, state->id.second);
    TORCH_CHECK(pool >= 0, "vmm: setCheckpointPoolState: the pool (", state->id.first, ", ",
                state->id.second, ") is gone");
    cca::CheckpointDelta delta;
    for (const vmm_block_entry& block : LiveBlocks(pool)) {
      if (block.state != VMM_BLOCK_ACTIVE_ALLOCATED) continue;
      void* ptr = reinterpret_cast<void*>(block.address);
      cudaStream_t stream = reinterpret_cast<cudaStream_t>(block.stream);
      {
        std::lock_guard<std::mutex> lock(allocator_mutex_);
        allocation_metadata_.erase(ptr);
      }
      {
        std::lock_guard<std::mutex> lock(mu_);
        restored_.erase(ptr);
      }
      Free(ptr, block.size, device, stream);
      delta.ptrs_freed.push_back(ptr);
    }
    for (const vmm_block_entry& block : state->live) {
      cudaStream_t stream = reinterpret_cast<cudaStream_t>(block.stream);
      void* ptr = libvmm.pool_alloc_at(pool, block.address, block.size, stream);
      if (ptr == nullptr) ThrowLastError("restoring a CUDA graph pool's checkpoint");
      TellTools(ptr, static_cast<int64_t>(block.size), device);  // its free is told too
      // PyTorch's own deleter (graph trees check it, and free through raw_delete), with the
      // block in restored_: the base class's bookkeeping of allocations cannot be extended
      // from here (its entries' type is not exported), so raw_delete looks there first.
      {
        std::lock_guard<std::mutex> lock(mu_);
        restored_[ptr] = Restored{block.size, device, stream};
        any_restored_.store(true, std::memory_order_relaxed);
      }
      delta.dataptrs_allocd.emplace_back(ptr, ptr, raw_deleter(),
                                         c10::Device(c10::DeviceType::CUDA, device));
    }
    return delta;
  }

  // A zero-byte raw request gets the null pointer and no bookkeeping, and deleting the null
  // pointer does nothing, however often (PyTorch's allocator; bridges such as CuPy's hand
  // every pointer they got back, null included).
  void* raw_alloc(size_t nbytes) override {
    return nbytes == 0 ? nullptr : Pluggable::raw_alloc(nbytes);
  }
  void* raw_alloc_with_stream(size_t nbytes, cudaStream_t stream) override {
    return nbytes == 0 ? nullptr : Pluggable::raw_alloc_with_stream(nbytes, stream);
  }

  // Blocks a checkpoint restored (setCheckpointPoolState) are freed here; the others by the
  // base class, which knows them.
  void raw_delete(void* ptr) override {
    if (ptr == nullptr) return;
    std::optional<Restored> restored;
    if (any_restored_.load(std::memory_order_relaxed)) {  // no lock on the common path
      std::lock_guard<std::mutex> lock(mu_);
      auto it = restored_.find(ptr);
      if (it != restored_.end()) {
        restored = it->second;
        restored_.erase(it);
      }
    }
    if (restored.has_value()) {
      Free(ptr, restored->size, restored->device, restored->stream);
      return;
    }
    Pluggable::raw_delete(ptr);
  }

  // PyTorch's own CUDA IPC of a storage (UntypedStorage._share_cuda_ and _new_shared_cuda,
  // which torch.multiprocessing uses for storages it sends itself, and programs call): the
  // handle is the block's vmm descriptor, and the receiver imports it (its device is the
  // current one, which PyTorch sets to the sender's). PyTorch's reference counting of sent
  // storages keeps the sender's block until the receivers release it, as with its own
  // allocator; the import lives as long as the pointer returned. A storage received from
  // another process (an import) is forwarded: its handle maps the first exporter's memory, as
  // vmm's sends forward (PyTorch's allocator refuses to share a received storage).
  cca::ShareableHandle shareIpcHandle(void* ptr) override {
    RequireBound();
    // A block of a MemPool over another allocator is shared as PyTorch's allocator shares
    // it: a CUDA IPC handle of its segment, and its offset there (legacy_ipc.h).
    if (const vmm_torch::ForeignIndex::Segment segment = foreign_index_.FindSegment(ptr);
        segment.base != nullptr) {
      cudaIpcMemHandle_t handle;
      const cudaError_t error = cudaIpcGetMemHandle(&handle, const_cast<void*>(segment.base));
      if (error != cudaSuccess) {
        (void)cudaGetLastError();  // not a sticky error: clear it
        TORCH_CHECK(false,
                    "vmm: sharing a tensor of a MemPool over another allocator: "
                    "cudaIpcGetMemHandle of its segment failed (",
                    cudaGetErrorString(error),
                    "); memory of the CUDA virtual memory API (as NCCL's and vLLM's allocators "
                    "make) cannot be shared by CUDA IPC, with PyTorch's allocator either; send "
                    "a clone made outside that pool");
      }
      return cca::ShareableHandle{
          static_cast<ptrdiff_t>(static_cast<const char*>(ptr) -
                                 static_cast<const char*>(segment.base)),
          vmm_torch::EncodeLegacyIpcHandle(&handle)};
    }
    uint8_t* bytes = nullptr;
    size_t len = 0;
    CheckOk(libvmm.export_block(ptr, &bytes, &len), "sharing a CUDA storage (_share_cuda_)");
    std::string handle(reinterpret_cast<const char*>(bytes), len);
    libvmm.release_buffer(bytes);
    return cca::ShareableHandle{0, std::move(handle)};
  }

  std::shared_ptr<void> getIpcDevPtr(std::string handle) override {
    RequireBound();
    const int device = c10::cuda::current_device();
    // PyTorch's own handles: a MemPool over another allocator's block (shareIpcHandle), or a
    // storage from a process whose allocator is PyTorch's.
    const vmm_torch::ParsedIpcHandle parsed = vmm_torch::ParseIpcHandle(handle);
    if (parsed.kind == vmm_torch::IpcHandleKind::kCudaMalloc) {
      return LegacyIpc().Open(parsed.raw, device);
    }
    TORCH_CHECK(parsed.kind != vmm_torch::IpcHandleKind::kExpandable,
                "vmm: this CUDA storage was shared from an expandable segment of PyTorch's own "
                "allocator, which vmm does not open; enable vmm (VMM_TORCH_ENABLE) in the "
                "sending process too");
    const int64_t id = libvmm.import_descriptor(reinterpret_cast<const uint8_t*>(handle.data()),
                                             handle.size(), device, VMM_BACKEND_DEFAULT, 0);
    if (id < 0) ThrowLastError("opening a shared CUDA storage (_new_shared_cuda)");
    uint64_t ptr = 0;
    size_t size = 0;
    int mapped_on = 0;
    if (libvmm.import_info(id, &ptr, &size, &mapped_on) != 0) {
      const std::string message = libvmm.last_error();
      libvmm.import_release(reinterpret_cast<void*>(static_cast<intptr_t>(id)));
      TORCH_CHECK(false, "vmm: opening a shared CUDA storage: ", message);
    }
    return std::shared_ptr<void>(reinterpret_cast<void*>(ptr), [id](void*) {
      if (process_exiting.load(std::memory_order_relaxed)) return;  // as Free
      libvmm.import_release(reinterpret_cast<void*>(static_cast<intptr_t>(id)));
    });
  }

  // The segments opened from PyTorch's CUDA IPC handles, one mapping per handle for the
  // process (legacy_ipc.h), never destroyed: storages may outlive the allocator at exit.
  static vmm_torch::LegacyIpcMappings& LegacyIpc() {
    static_assert(sizeof(cudaIpcMemHandle_t) == vmm_torch::kCudaIpcHandleSize);
    static auto* mappings = new vmm_torch::LegacyIpcMappings(
        [](const std::string& raw, int device) -> void* {
          c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
          cudaIpcMemHandle_t handle;
          std::memcpy(&handle, raw.data(), sizeof(handle));
          void* ptr = nullptr;
          C10_CUDA_CHECK(cudaIpcOpenMemHandle(&ptr, handle, cudaIpcMemLazyEnablePeerAccess));
          return ptr;
        },
        [](void* ptr, int device) {  // must not throw (legacy_ipc.h)
          if (process_exiting.load(std::memory_order_relaxed)) return;  // as Free
          int current = 0;
          if (cudaGetDevice(&current) != cudaSuccess || cudaSetDevice(device) != cudaSuccess) {
            (void)cudaGetLastError();
            return;  // CUDA is going (the process exits): the driver drops the mapping
          }
          C10_CUDA_CHECK_WARN(cudaIpcCloseMemHandle(ptr));
          (void)cudaSetDevice(current);
        });
    return *mappings;
  }

  // The largest block an allocation could get now (cuDNN sizes its workspace by it), as
  // PyTorch's allocator answers: the larger of what the device has free (which vmm can map,
  // within the memory fraction set for the device) and the largest block vmm has cached.
  void cacheInfo(c10::DeviceIndex device, size_t* largest_block) override {
    c10::cuda::CUDAGuard guard(device);
    size_t device_free = 0, device_total = 0;
    C10_CUDA_CHECK(cudaMemGetInfo(&device_free, &device_total));
    size_t largest = device_free;
    int64_t allocated = 0;
    int64_t reserved_now = 0;
    if (libvmm.device_usage(device, &allocated, &reserved_now) == 0) {
      const auto cap = static_cast<size_t>(getMemoryFraction(device) * device_total);
      const auto reserved = static_cast<size_t>(std::max<int64_t>(reserved_now, 0));
      largest = std::min(largest, cap > reserved ? cap - reserved : 0);
    }
    uint64_t cached = 0;
    if (libvmm.device_largest_free_block(device, &cached) == 0) {
      largest = std::max(largest, static_cast<size_t>(cached));
    }
    *largest_block = largest;
  }

  // torch.cuda.memory.caching_allocator_enable / caching_allocator_disabled(): with caching
  // off, or with PYTORCH_NO_CUDA_MEMORY_CACHING=1 (ForceUncached), every free gives the GPU
  // pools' free memory back at once (Free), where PyTorch's allocator frees each block with
  // cudaFree. Blocks are still vmm's, so statistics, snapshots and sends work as with caching
  // on.
  void enable(bool value) override { caching_.store(value, std::memory_order_relaxed); }
  bool isEnabled() const override { return caching_.load(std::memory_order_relaxed); }

  double getMemoryFraction(c10::DeviceIndex device) override {
    CheckDevice(device, "get_per_process_memory_fraction");
    ApplyConfiguredFraction(device);
    std::lock_guard<std::mutex> lock(mu_);
    auto it = fractions_.find(device);
    return it == fractions_.end() ? 1.0 : it->second;
  }

  void emptyCache(MempoolId_t mempool_id) override {
    if (mempool_id.first == 0 && mempool_id.second == 0) {
      Pluggable::emptyCache(mempool_id);
      // The cache of MemPools over other allocators that are no longer used, as PyTorch's
      // allocator frees the cached blocks of private pools whose use count is 0.
      ReleaseUnusedForeignPools();
      return;
    }
    // A MemPool over another allocator gives its cache back only once nothing uses it (a
    // CUDA graph captured into it replays into its memory), as PyTorch's allocator does.
    for (const auto& pool : ForeignPools(-1)) {
      if (pool->id != mempool_id) continue;
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (pool->uses > 0) continue;
      }
      pool->segments->ReleaseCached();
      DropForeignIfUnused(pool);
    }
    // On every device, as PyTorch's allocator empties a pool (a pool id is per device here).
    for (int device = 0; device < c10::cuda::device_count(); ++device) {
      const int64_t pool = libvmm.private_pool_find(device, mempool_id.first, mempool_id.second);
      if (pool >= 0) CheckOk(libvmm.pool_empty_cache(pool), "empty_cache of a pool");
    }
  }

 private:
  // A device index the program gave (torch.cuda's statistics, resets, memory fraction and
  // use_mem_pool pass it through unchecked) must name one of the process's GPUs: PyTorch's
  // allocator raises "Invalid device argument" (RuntimeError) for any other, where libvmm
  // would answer for an unused GPU (its figures zero, a fraction kept for a GPU that does not
  // exist) or refuse a private pool. releasePool is left to libvmm (it
  // follows a use that was checked, and may run in a destructor).
  static void CheckDevice(int device, const char* what) {
    const int count = c10::cuda::device_count();
    TORCH_CHECK(device >= 0 && device < count, "Invalid device argument ", device, ": vmm's ",
                what, " on a process with ", count, count == 1 ? " GPU" : " GPUs");
  }

  // Ends the route of (device, mempool_id), if one is open, and then, with mu_ no longer held,
  // the capture window it opened (vmm_imports_release_closing); whether there was one. Closing
  // the last window runs what was kept back during it (imports closed, pools destroyed: device
  // synchronisations and unmaps), which must not hold up every other user of mu_, nor wait on
  // GPU work whose host callback needs mu_ (a free).
  bool EndRoute(c10::DeviceIndex device, MempoolId_t mempool_id) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = std::find_if(routes_.begin(), routes_.end(), [&](const Route& route) {
        return route.device == device && route.id == mempool_id;
      });
      if (it == routes_.end()) return false;
      routes_.erase(it);
      routes_empty_.store(routes_.empty(), std::memory_order_relaxed);
    }
    libvmm.imports_release_closing();
    return true;
  }

  // A MemPool over another allocator (createOrIncrefPool): its segments, and PyTorch's use
  // count (the pool's blocks go back at empty_cache once it is 0).
  struct ForeignPool {
    c10::DeviceIndex device = 0;
    MempoolId_t id{0, 0};
    std::unique_ptr<vmm_torch::ForeignSegments> segments;
    int uses = 0;             // guarded by mu_
    bool use_on_oom = false;  // guarded by mu_
  };
  struct Route {
    c10::DeviceIndex device;
    MempoolId_t id;
    std::function<bool(cudaStream_t)> filter;
    int64_t pool;  // vmm's id of the private pool (-1 for a pool over another allocator)
    std::shared_ptr<ForeignPool> foreign;  // the pool over another allocator, if it is one
  };
  struct PoolInfo {
    int64_t vmm_pool = 0;
    bool use_on_oom = false;
  };
  struct Restored {  // a block setCheckpointPoolState allocated again
    size_t size;
    int device;
    cudaStream_t stream;
  };

  // Adds a use of private pool `id` (created with `owner`'s options, or this allocator's).
  int64_t UsePool(c10::DeviceIndex device, MempoolId_t id, VmmAllocator* owner) {
    const std::string& options = owner != nullptr ? owner->options() : options_;
    const int64_t pool = libvmm.private_pool_use(VMM_BACKEND_CUDA, device, id.first, id.second,
                                              options.c_str());
    if (pool < 0) ThrowLastError("creating a private pool");
    std::lock_guard<std::mutex> lock(mu_);
    pools_[{device, id}].vmm_pool = pool;
    return pool;
  }

  // What a MemPool over another allocator on `device` counts its segments with against the
  // memory fraction (vmm_device_hold). A segment the fraction refuses is an out of memory at
  // once: the pool is routed to while it allocates, and PyTorch's allocator frees no cache
  // while any pool is.
  static vmm_torch::AllocatorSource::Hold HoldOnDevice(c10::DeviceIndex device) {
    return [device](int64_t delta, std::string* why) {
      if (libvmm.device_hold(device, delta) == 0) return true;
      if (why != nullptr) *why = libvmm.last_error();
      if (delta < 0) TORCH_WARN("vmm: ", libvmm.last_error());  // a bad device only
      return false;
    };
  }

  static vmm_torch::AllocatorSource::Count CountOnDevice(c10::DeviceIndex device) {
    return [device](int64_t delta) {
      // Fails only for a bad device or a count the pool's own figures would not allow (a
      // forked child freeing a block of its parent's pool: the child counts from zero).
      if (libvmm.device_hold_allocated(device, delta) != 0) {
        TORCH_WARN_ONCE("vmm: ", libvmm.last_error());
      }
    };
  }

  // Adds a use of the MemPool over another allocator `id` on `device`, made over `allocator`
  // if it is new; null if there is none and `allocator` is null.
  std::shared_ptr<ForeignPool> UseForeignPool(c10::DeviceIndex device, MempoolId_t id,
                                              std::shared_ptr<cca::CUDAAllocator> allocator) {
    std::lock_guard<std::mutex> lock(mu_);
    std::shared_ptr<ForeignPool>& pool = foreign_[{device, id}];
    if (pool == nullptr && allocator == nullptr) {
      foreign_.erase({device, id});
      return nullptr;
    }
    if (pool == nullptr) {
      pool = std::make_shared<ForeignPool>();
      pool->device = device;
      pool->id = id;
      auto source = std::make_unique<vmm_torch::AllocatorSource>(
          std::move(allocator), device, HoldOnDevice(device), CountOnDevice(device),
          &foreign_index_);
      vmm_torch::AllocatorSource* const source_of_pool = source.get();
      pool->segments =
          std::make_unique<vmm_torch::ForeignSegments>(std::move(source), /*no_split=*/false);
      source_of_pool->set_owner(pool->segments.get(), std::weak_ptr<void>(pool));
      // Its segments in the allocation history, as PyTorch's allocator records a MemPool
      // allocator's segments (segment_alloc with the allocation's stack, segment_free).
      source_of_pool->set_tell([this, device, id](bool made, void* segment, size_t size,
                                                  uintptr_t stream) {
        if (made) ++SegmentsMadeByThisThread();
        if (!history_.on()) return;
        // Caught here: the pool is between getting (or handing back) the segment and taking
        // it in, which a throw would leave half done (the segment lost to the pool).
        try {
          history_.RecordSegment(
              made ? cda::TraceEntry::SEGMENT_ALLOC : cda::TraceEntry::SEGMENT_FREE, device,
              reinterpret_cast<size_t>(segment), size, reinterpret_cast<cudaStream_t>(stream),
              id);
        } catch (const std::exception& error) {
          TORCH_WARN("vmm: recording a segment of a MemPool over another allocator failed: ",
                     error.what());
        }
      });
      any_foreign_.store(true, std::memory_order_relaxed);  // foreign_ is not empty
    }
    ++pool->uses;
    return pool;
  }

  // Drops a use of MemPool `id` if it is over another allocator (false if it is not): at the
  // last, its cached segments go back, and the pool goes once it holds none. Not while a
  // route is open (a CUDA graph capture may be under way, which the device synchronisation
  // before the segments go back would invalidate): then at the next empty_cache or out of
  // memory, as PyTorch's allocator always defers it.
  bool ReleaseForeignPool(c10::DeviceIndex device, MempoolId_t id) {
    std::shared_ptr<ForeignPool> pool;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = foreign_.find({device, id});
      if (it == foreign_.end()) return false;
      TORCH_CHECK(it->second->uses > 0, "vmm: releasePool: pool (", id.first, ", ", id.second,
                  ") is not in use");
      if (--it->second->uses > 0 || !routes_.empty()) return true;
      pool = it->second;
    }
    pool->segments->ReleaseCached();
    DropForeignIfUnused(pool);
    return true;
  }

  // Hands back the cache of the MemPools over other allocators that nobody uses; the number
  // of segments handed back.
  size_t ReleaseUnusedForeignPools() {
    size_t released = 0;
    for (const auto& pool : ForeignPools(-1)) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (pool->uses > 0) continue;
      }
      released += pool->segments->ReleaseCached();
      DropForeignIfUnused(pool);
    }
    return released;
  }

  // Forgets a MemPool over another allocator that nobody uses and that holds no segment; its
  // totals and peaks stay in the GPU's statistics (foreign_retired_).
  void DropForeignIfUnused(const std::shared_ptr<ForeignPool>& pool) {
    if (!pool->segments->Empty()) return;
    const vmm_torch::ForeignStats stats = pool->segments->Stats();
    std::lock_guard<std::mutex> lock(mu_);
    auto it = foreign_.find({pool->device, pool->id});
    if (it == foreign_.end() || it->second != pool || pool->uses != 0) return;
    foreign_.erase(it);
    any_foreign_.store(!foreign_.empty(), std::memory_order_relaxed);
    vmm_torch::ForeignStats& retired = foreign_retired_[pool->device];
    for (auto group : vmm_torch::ForeignStats::kGroups) {
      const vmm_torch::ForeignStats::Group& from = stats.*group;
      vmm_torch::ForeignStats::Group& to = retired.*group;
      for (size_t i = 0; i < from.size(); ++i) {
        to[i].allocated += from[i].allocated;
        to[i].freed += from[i].freed;
        to[i].peak = std::max(to[i].peak, from[i].peak);
      }
    }
    retired.num_device_alloc += stats.num_device_alloc;
    retired.num_device_free += stats.num_device_free;
    retired.num_ooms += stats.num_ooms;
  }

  // The MemPools over other allocators on `device` (every device for -1).
  std::vector<std::shared_ptr<ForeignPool>> ForeignPools(int device) {
    std::vector<std::shared_ptr<ForeignPool>> out;
    if (!any_foreign_.load(std::memory_order_relaxed)) return out;
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [key, pool] : foreign_) {
      if (device < 0 || key.first == device) out.push_back(pool);
    }
    return out;
  }

  static_assert(vmm_torch::kAll == static_cast<size_t>(VMM_STAT_ALL));

  static void AddForeignStats(const vmm_torch::ForeignStats& f, cda::DeviceStats& out) {
    // DeviceStats' groups in ForeignStats::kGroups' order.
    static constexpr c10::CachingAllocator::StatArray cda::DeviceStats::*kTorchGroups[] = {
        &cda::DeviceStats::allocation,      &cda::DeviceStats::segment,
        &cda::DeviceStats::active,          &cda::DeviceStats::inactive_split,
        &cda::DeviceStats::allocated_bytes, &cda::DeviceStats::reserved_bytes,
        &cda::DeviceStats::active_bytes,    &cda::DeviceStats::inactive_split_bytes,
        &cda::DeviceStats::requested_bytes};
    static_assert(std::size(kTorchGroups) == std::size(vmm_torch::ForeignStats::kGroups));
    for (size_t g = 0; g < std::size(kTorchGroups); ++g) {
      const vmm_torch::ForeignStats::Group& from = f.*(vmm_torch::ForeignStats::kGroups[g]);
      c10::CachingAllocator::StatArray& to = out.*(kTorchGroups[g]);
      // The GPU's allocated and reserved bytes peak jointly: libvmm counts these pools' blocks
      // and segments in its figures' peaks (CountOnDevice, HoldOnDevice), not their currents.
      const bool joint = kTorchGroups[g] == &cda::DeviceStats::allocated_bytes ||
                         kTorchGroups[g] == &cda::DeviceStats::reserved_bytes;
      vmm_torch::AddGroup(from, to, joint);
    }
    out.num_device_alloc += f.num_device_alloc;
    out.num_device_free += f.num_device_free;
    out.num_ooms += f.num_ooms;
  }

  static void AddForeignSegments(const ForeignPool& pool, std::vector<cda::SegmentInfo>* out) {
    for (const vmm_torch::ForeignSegmentInfo& s : pool.segments->Snapshot()) {
      cda::SegmentInfo segment;
      segment.device = pool.device;
      segment.address = s.address;
      segment.total_size = s.size;
      segment.stream = reinterpret_cast<void*>(s.stream);
      segment.is_large = !s.small;
      segment.is_expandable = false;
      segment.owner_private_pool_id = pool.id;
      for (const vmm_torch::ForeignBlockInfo& b : s.blocks) {
        cda::BlockInfo block;
        block.size = b.size;
        block.requested_size = b.requested;
        block.allocated = b.allocated;
        block.active = b.active;
        if (b.allocated) {
          segment.allocated_size += b.size;
          segment.requested_size += b.requested;
        }
        if (b.active) segment.active_size += b.size;
        segment.blocks.push_back(std::move(block));
      }
      out->push_back(std::move(segment));
    }
  }

  // Where an allocation goes when a route's filter takes its stream (the newest route first).
  struct RouteTarget {
    MempoolId_t id;
    int64_t pool;  // vmm's id of the private pool, or -1
    std::shared_ptr<ForeignPool> foreign;
  };
  std::optional<RouteTarget> RouteFor(int device, cudaStream_t stream) {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = routes_.rbegin(); it != routes_.rend(); ++it) {
      if (it->device == device && it->filter(stream)) {
        return RouteTarget{it->id, it->pool, it->foreign};
      }
    }
    return std::nullopt;
  }

  void* Malloc(size_t size, int device, cudaStream_t stream) {
    // An empty tensor gets no memory and counts in no statistic, as with PyTorch's own
    // allocator (its storage's pointer is null; Free ignores null).
    if (size == 0) return nullptr;
    RequireBound();
    // The driver calls of a growth must not be captured (nor refused) when the stream
    // captures a CUDA graph: as PyTorch's allocator does around cudaMalloc. (Setting the
    // configured fraction may ask the driver for the GPU's memory too.)
    c10::cuda::CUDAStreamCaptureModeGuard relaxed(cudaStreamCaptureModeRelaxed);
    if (C10_UNLIKELY(device < 0 || device >= kFractionDevices ||
                     !fraction_read_[device].load(std::memory_order_acquire))) {
      ApplyConfiguredFraction(device);
    }
    MempoolId_t pool_id{0, 0};
    void* ptr = nullptr;
    void* const pool_stream = vmm_torch::PoolStream(stream, device);
    // While history is recorded, whether this allocation maps memory (this thread's growths,
    // before and after): the segment_map entries of that memory then get its stream and, with
    // stacks, its stack, which is also that segment's (snapshot "frames").
    const bool recorded = history_.on();
    const uint64_t growths_before = recorded ? libvmm.thread_growths() : 0;
    std::optional<RouteTarget> route;
    if (!routes_empty_.load(std::memory_order_relaxed)) route = RouteFor(device, stream);
    if (route.has_value() && route->foreign != nullptr) {
      return AllocateForeign(*route->foreign, size, device, stream);
    }
    if (route.has_value()) {
      pool_id = route->id;
      ptr = libvmm.pool_alloc(route->pool, size, pool_stream, 0);
    } else if (own_pools_only_) {
      const int64_t own = OwnPool(device);
      ptr = own < 0 ? nullptr : libvmm.pool_alloc(own, size, pool_stream, 0);
    } else {
      ptr = libvmm.alloc(size, device, pool_stream);
    }
    if (ptr == nullptr && own_pools_only_) {
      // A MemPool's segment asked for by PyTorch's own allocator: it expects null, then
      // frees its cache, retries, and reports the out of memory itself (also for more than
      // the device holds, or a closed MemPool).
      return nullptr;
    }
    if (ptr == nullptr && libvmm.last_error_code() == VMM_RESOURCE_EXHAUSTED &&
        routes_empty_.load(std::memory_order_relaxed) && ReleaseUnusedForeignPools() > 0) {
      // The cache of MemPools over other allocators that nobody uses went back to them, as
      // PyTorch's allocator frees the cached blocks of unused pools before it gives up; not
      // while any route is open (PyTorch's neither: a capture may be under way, which the
      // device synchronisation before the segments go back would invalidate).
      ptr = libvmm.alloc(size, device, pool_stream);
    }
    if (ptr == nullptr && libvmm.last_error_code() == VMM_RESOURCE_EXHAUSTED && !route) {
      ptr = AllocateOnOom(size, device, stream, &pool_id);
    }
    if (ptr == nullptr) OutOfMemory(size, device, stream, pool_id);
    RecordAlloc(ptr, size, device, stream, pool_id,
                recorded && libvmm.thread_growths() != growths_before);
    return ptr;
  }

  // PyTorch's allocator sets each GPU's memory fraction from PYTORCH_CUDA_ALLOC_CONF's
  // per_process_memory_fraction when it sets that GPU up; vmm does at the GPU's first
  // allocation or fraction query (getMemoryFraction), unless the program set one first
  // (set_per_process_memory_fraction). Read once per GPU: a later change of the variable is
  // not read, as by PyTorch. Not for the allocators of MemPools (UseOwnPools): the fraction
  // is the GPU's, set once by the installed allocator. A bad value throws what PyTorch's
  // parse throws, at each use until fixed, as PyTorch's allocator does.
  void ApplyConfiguredFraction(int device) {
    if (device < 0 || device >= kFractionDevices) return;
    std::atomic<bool>& read = fraction_read_[device];
    if (read.load(std::memory_order_acquire)) return;
    // Read outside mu_: the first read parses the variable through PyTorch.
    const double fraction = own_pools_only_ ? 1.0 : ConfiguredFraction();
    if (fraction != 1.0) {
      // Under mu_ with the libvmm call, as memory_fraction_fn_: a fraction the program sets
      // meanwhile is either seen here or set after this one.
      std::lock_guard<std::mutex> lock(mu_);
      if (fractions_.count(device) == 0) {
        CheckOk(libvmm.set_memory_fraction(fraction, device),
                "per_process_memory_fraction of PYTORCH_CUDA_ALLOC_CONF");
        fractions_.emplace(device, fraction);
      }
    }
    read.store(true, std::memory_order_release);
  }

  void RecordAlloc(void* ptr, size_t size, int device, cudaStream_t stream, MempoolId_t pool,
                   bool grew = false) {
    if (history_.on()) {
      history_.Record(cda::TraceEntry::ALLOC, static_cast<c10::DeviceIndex>(device),
                      reinterpret_cast<size_t>(ptr), size, stream, pool, grew);
    }
    // A MemPool's segment asked for by PyTorch's own allocator (own pools only) is no tensor:
    // PyTorch tells the tools of the blocks it makes of it.
    if (!own_pools_only_) TellTools(ptr, static_cast<int64_t>(size), device);
  }

  // What PyTorch's allocator tells the tools at each allocation (delta > 0) and free: the
  // GPU trace's callbacks (torch.cuda._gpu_trace, the CUDA sanitizer; TellTrace) and the
  // profiler's memory events (torch.profiler's profile_memory; TellProfiler). Off, two cheap
  // checks. An allocation is told once its block is handed out; Free tells both before the
  // block goes back, so that no other thread's allocation of the address comes first.
  static void TellTools(void* ptr, int64_t delta, int device) {
    TellTrace(ptr, delta > 0);
    TellProfiler(ptr, delta, device);
  }
  static void TellTrace(void* ptr, bool allocated) {
    if (const c10::impl::PyInterpreter* trace = c10::impl::GPUTrace::get_trace();
        C10_UNLIKELY(trace != nullptr)) {
      if (allocated) {
        (*trace)->trace_gpu_memory_allocation(c10::kCUDA, reinterpret_cast<uintptr_t>(ptr));
      } else {
        (*trace)->trace_gpu_memory_deallocation(c10::kCUDA, reinterpret_cast<uintptr_t>(ptr));
      }
    }
  }
  // With the GPU's figures after the allocation or free, as PyTorch's allocator reports them
  // (vmm_device_usage: read at every allocation, so not summed over the private pools).
  // `pending` is what the event's own change has yet to do to the allocated figure read now:
  // a free is told before its block goes back (Free).
  static void TellProfiler(void* ptr, int64_t delta, int device, int64_t pending = 0) {
    if (C10_UNLIKELY(c10::memoryProfilingEnabled())) {
      int64_t allocated = 0;
      int64_t reserved = 0;
      (void)libvmm.device_usage(device, &allocated, &reserved);
      allocated += pending;
      c10::reportMemoryUsageToProfiler(
          ptr, delta, static_cast<size_t>(std::max<int64_t>(allocated, 0)),
          static_cast<size_t>(std::max<int64_t>(reserved, 0)),
          c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(device)));
    }
  }

  // An allocation of a MemPool over another allocator; out of memory when that allocator has
  // nothing more even after the pool's cache went back to it.
  void* AllocateForeign(ForeignPool& pool, size_t size, int device, cudaStream_t stream) {
    const uint64_t segments_before = SegmentsMadeByThisThread();
    void* ptr = pool.segments->Allocate(size, reinterpret_cast<uintptr_t>(stream));
    if (ptr == nullptr) {
      OutOfMemory(size, device, stream, pool.id, VMM_RESOURCE_EXHAUSTED,
                  vmm_torch::AllocatorSource::LastFailure());
    }
    RecordAlloc(ptr, size, device, stream, pool.id,
                /*grew=*/SegmentsMadeByThisThread() != segments_before);
    return ptr;
  }
  // How many segments MemPools over other allocators got from them on this thread (their
  // Tell counts them): an allocation that made one grew its pool.
  static uint64_t& SegmentsMadeByThisThread() {
    thread_local uint64_t made = 0;
    return made;
  }

  // This allocator's own pool on `device`, created with its options on first use; -1 once
  // closed (Close).
  int64_t OwnPool(int device) {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) return -1;
    auto it = own_pools_.find(device);
    if (it != own_pools_.end()) return it->second;
    const int64_t pool = libvmm.pool_create(VMM_BACKEND_CUDA, device, options_.c_str());
    if (pool < 0) ThrowLastError("creating the pool of a MemPool");
    own_pools_[device] = pool;
    return pool;
  }

  // The last resort of a failed allocation: the pools set to be used on OOM (setUseOnOOM).
  void* AllocateOnOom(size_t size, int device, cudaStream_t stream, MempoolId_t* pool_id) {
    std::vector<std::pair<MempoolId_t, int64_t>> candidates;
    std::vector<std::shared_ptr<ForeignPool>> foreign;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (const auto& [key, info] : pools_) {
        if (key.first == device && info.use_on_oom) candidates.push_back({key.second, info.vmm_pool});
      }
      for (const auto& [key, pool] : foreign_) {
        if (key.first == device && pool->use_on_oom) foreign.push_back(pool);
      }
    }
    void* const pool_stream = vmm_torch::PoolStream(stream, device);
    for (const auto& [id, pool] : candidates) {
      void* ptr = libvmm.pool_alloc(pool, size, pool_stream, 0);
      if (ptr != nullptr) {
        *pool_id = id;
        return ptr;
      }
    }
    for (const auto& pool : foreign) {  // a cached block only, as PyTorch's allocator takes
      void* ptr = pool->segments->Allocate(size, reinterpret_cast<uintptr_t>(stream),
                                           /*may_grow=*/false);
      if (ptr != nullptr) {
        *pool_id = pool->id;
        return ptr;
      }
    }
    return nullptr;
  }

  // Tells the observers, records an "oom" trace entry and throws (OutOfMemoryError when the
  // memory ran out, else what failed).
  [[noreturn]] void OutOfMemory(size_t size, int device, cudaStream_t stream, MempoolId_t pool) {
    OutOfMemory(size, device, stream, pool, libvmm.last_error_code(), libvmm.last_error());
  }
  [[noreturn]] void OutOfMemory(size_t size, int device, cudaStream_t stream, MempoolId_t pool,
                                int code, const std::string& message) {
    size_t device_free = 0, device_total = 0;
    {
      c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
      if (cudaMemGetInfo(&device_free, &device_total) != cudaSuccess) (void)cudaGetLastError();
    }
    // More than the device holds is out of memory too, as with PyTorch's allocator (vmm
    // calls it an invalid argument: no freeing would ever make room).
    if (code == VMM_RESOURCE_EXHAUSTED ||
        (code == VMM_INVALID_ARGUMENT && device_total != 0 && size > device_total)) {
      // The GPU's figures, MemPools over other allocators included, as PyTorch's.
      int64_t allocated_now = 0;
      int64_t reserved_now = 0;
      (void)libvmm.device_usage(device, &allocated_now, &reserved_now);
      const auto allocated = static_cast<size_t>(std::max<int64_t>(allocated_now, 0));
      if (history_.on()) {
        history_.Record(cda::TraceEntry::OOM, static_cast<c10::DeviceIndex>(device),
                        device_free, size, stream, pool);
      }
      c10::reportOutOfMemoryToProfiler(
          static_cast<int64_t>(size), allocated,
          static_cast<size_t>(std::max<int64_t>(reserved_now, 0)),
          c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(device)));
      std::vector<cca::OutOfMemoryObserver> observers;
      {
        std::lock_guard<std::mutex> lock(mu_);
        observers = oom_observers_;
      }
      // As PyTorch's allocator calls them: the bytes asked for, and the GPU's memory (its
      // memory fraction's share where one is set).
      const auto allowed = static_cast<size_t>(
          getMemoryFraction(static_cast<c10::DeviceIndex>(device)) *
          static_cast<double>(device_total));
      for (const cca::OutOfMemoryObserver& observer : observers) {
        observer(device, size, allowed, device_free);
      }
      // Worded as PyTorch's allocator words it: programs and libraries (Accelerate, toma,
      // Lightning) recognise an out of memory by "CUDA out of memory." in the message.
      TORCH_CHECK_WITH(OutOfMemoryError, false, "CUDA out of memory. Tried to allocate ",
                       FormatSize(size), ". GPU ", device, " has a total capacity of ",
                       FormatSize(device_total), " of which ", FormatSize(device_free),
                       " is free. Of the allocated memory ", FormatSize(allocated),
                       " is allocated by PyTorch (through vmm). vmm: ", message);
    }
    CheckOk(-1, "allocation of " + std::to_string(size) + " bytes on device " +
                    std::to_string(device));
    TORCH_CHECK(false, "unreachable");
  }

  void Free(void* ptr, size_t size, int device, cudaStream_t stream) {
    if (ptr == nullptr) return;  // an empty tensor's (Malloc)
    if (C10_UNLIKELY(process_exiting.load(std::memory_order_relaxed))) return;
    // Recorded and told before the block goes back: from then on another thread may be handed
    // its address and report that allocation, which must come after this free in the trace
    // and the tools' callbacks (PyTorch's allocator records under its lock, and calls the
    // GPU trace before the block goes back). vmm orders the free after the stream's work
    // itself, so it is complete here too.
    if (history_.on()) {
      history_.Record(cda::TraceEntry::FREE_REQUESTED, static_cast<c10::DeviceIndex>(device),
                      reinterpret_cast<size_t>(ptr), size, stream, {0, 0});
      history_.Record(cda::TraceEntry::FREE_COMPLETED, static_cast<c10::DeviceIndex>(device),
                      reinterpret_cast<size_t>(ptr), size, stream, {0, 0});
    } else if (C10_UNLIKELY(history_.holds_contexts())) {
      history_.Forget(reinterpret_cast<size_t>(ptr));  // made while recording, freed after
    }
    // A MemPool over another allocator first (that allocator's memory may be vmm's own).
    const vmm_torch::ForeignIndex::Owner owner = foreign_index_.Find(ptr);
    if (!own_pools_only_) {
      TellTrace(ptr, /*allocated=*/false);
      // The GPU's allocated figure as it will be once the block is back: less the block, its
      // size rounded as vmm's pools round it (to 512 bytes; a small block that spilled into
      // the large arena is larger, pool.h, which this one event's figure leaves in), or as
      // the MemPool over another allocator that holds it counts it.
      size_t freed = 0;
      if (C10_UNLIKELY(c10::memoryProfilingEnabled())) {
        freed = owner.pool != nullptr ? owner.pool->AllocatedSize(ptr)
                                      : (size + 511) & ~size_t{511};
      }
      TellProfiler(ptr, -static_cast<int64_t>(size), device, -static_cast<int64_t>(freed));
    }
    if (!(owner.pool != nullptr && owner.pool->Free(ptr)) && libvmm.free(ptr, device) != 0) {
      TORCH_WARN("vmm: free failed: ", libvmm.last_error());
    }
    if (C10_UNLIKELY(!caching_.load(std::memory_order_relaxed) || ForceUncached()) &&
        routes_empty_.load(std::memory_order_relaxed)) {
      // Caching off: the GPU's pools give back what is free now, after a device
      // synchronisation (vmm_empty_cache), as cudaFree waits for the device. Not while a
      // route is open (a capture may be under way, which a synchronisation would break): the
      // memory then goes back at a later free or empty_cache.
      if (libvmm.empty_cache(device) != 0) {
        TORCH_WARN("vmm: giving memory back with caching off failed: ", libvmm.last_error());
      }
    }
  }

  // PYTORCH_NO_CUDA_MEMORY_CACHING=1, read once, when first needed (PyTorch reads it at its
  // first allocation, as a boolean flag: "1" turns caching off, "0" or another value not).
  static bool ForceUncached() {
    static const bool force = [] {
      const char* value = std::getenv("PYTORCH_NO_CUDA_MEMORY_CACHING");
      return value != nullptr && std::strcmp(value, "1") == 0;
    }();
    return force;
  }

  const std::string options_;
  vmm_torch::History history_;
  std::mutex mu_;  // guards what follows (never held while calling PyTorch or the GIL)
  std::vector<Route> routes_;
  std::atomic<bool> routes_empty_{true};  // routes_.empty(), for the allocation path's check
  std::unordered_map<std::pair<int, MempoolId_t>, PoolInfo, MempoolIdHash> pools_;
  vmm_torch::ForeignIndex foreign_index_;  // foreign_'s segments, by address (frees ask it)
  std::unordered_map<std::pair<int, MempoolId_t>, std::shared_ptr<ForeignPool>, MempoolIdHash>
      foreign_;
  std::atomic<bool> any_foreign_{false};  // !foreign_.empty()
  std::unordered_map<int, vmm_torch::ForeignStats> foreign_retired_;  // dropped pools' figures
  std::vector<cca::OutOfMemoryObserver> oom_observers_;
  bool own_pools_only_ = false;                  // set before the allocator is handed out
  std::atomic<bool> caching_{true};              // enable() / isEnabled()
  bool closed_ = false;                          // Close() ran: no own pool any more
  std::unordered_map<int, int64_t> own_pools_;  // device -> vmm pool (UseOwnPools)
  std::unordered_map<void*, Restored> restored_;
  std::atomic<bool> any_restored_{false};  // restored_ was ever used (raw_delete's check)
  std::unordered_map<int, double> fractions_;  // set_per_process_memory_fraction's, by device
  // Per GPU: whether the variable's fraction was read (ApplyConfiguredFraction), or the
  // program set one. GPUs past kFractionDevices are not read.
  static constexpr int kFractionDevices = 64;
  std::array<std::atomic<bool>, kFractionDevices> fraction_read_{};
  // How many times a snapshot reads its segments and trace at most to have the two agree.
  static constexpr int kSnapshotReads = 8;
};

// The installed allocator, never destroyed: storages PyTorch keeps for CUDA IPC receivers
// that never released them are freed by its static destructors at exit, after this module's
// statics are gone (a destroyed allocator crashed such a process: "pure virtual method
// called", case u_shared_storage_odd_handles).
std::shared_ptr<VmmAllocator>& installed = *new std::shared_ptr<VmmAllocator>();

// Whether config class C has a public static instance() (its first call parses the variable).
template <typename C, typename = void>
struct HasInstance : std::false_type {};
template <typename C>
struct HasInstance<C, std::void_t<decltype(C::instance())>> : std::true_type {};

// PyTorch parses PYTORCH_CUDA_ALLOC_CONF on first use, and a `backend:` there must name the
// allocator current at that moment (an internal assertion): parsed once vmm was current,
// `backend:native` or `backend:cudaMallocAsync` failed at the program's first tensor. So where
// the variable names a backend (which PyTorch reads when it loads: it was set before), it is
// parsed here, before vmm is made current, against the allocator PyTorch chose then. Otherwise
// it is left to PyTorch's first use, so that a program may still set it after importing torch
// (its pinned-memory options apply under vmm too; docs/DESIGN.md §2g). A torch without that
// class, or without a public instance(), is left as it is (a template, so that the call is
// not compiled there).
template <typename Config>
void ParseConfig() {
  if constexpr (HasInstance<Config>::value) (void)Config::instance();
}
void ParseAllocatorConfigNow() {
#ifdef VMM_TORCH_HAS_ALLOCATOR_CONFIG
  bool names_backend = false;
  for (const char* name : {"PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"}) {
    const char* value = std::getenv(name);
    if (value != nullptr && std::strstr(value, "backend") != nullptr) names_backend = true;
  }
  if (names_backend) ParseConfig<c10::cuda::CUDACachingAllocator::CUDAAllocatorConfig>();
#endif
}

void Install() {
  RequireBound();
  TORCH_CHECK(installed == nullptr, "vmm: the allocator is installed already");
  ParseAllocatorConfigNow();
  auto allocator = std::make_shared<VmmAllocator>("");
  torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator(allocator);
  // changeCurrentAllocator swaps what torch.cuda reaches; c10's registry of device allocators
  // (torch.accelerator's memory API, storages made by device type) must name vmm too, or they
  // would reach PyTorch's own allocator beside it.
  c10::SetAllocator(c10::DeviceType::CUDA, allocator.get());
  installed = allocator;
  // The pools' mappings go to its history (never destroyed: `installed`).
  libvmm.set_mapping_callback(&VmmAllocator::TellMapping, allocator.get());
  // Once (Install runs once; a failed one registered nothing). Py_AtExit may refuse (its
  // table is small), and a process may exit without finalising Python; the atexit handler
  // then runs before the static destructors of what was built before install (torch's
  // libraries' globals), not of what was built after.
  (void)Py_AtExit(&MarkProcessExiting);
  std::atexit(&MarkProcessExiting);
}

}  // namespace

PYBIND11_MODULE(_cuda_allocator, m) {
  m.doc() = "vmm as PyTorch's CUDA allocator (statistics, snapshots, graph pools, MemPool)";
  m.def("bind", &Bind, "Looks up libvmm.so's functions (the path Python loaded).");
  m.def("install", &Install, "Makes vmm PyTorch's CUDA allocator (before CUDA is used).");
  m.def(
      "pool_allocator",
      [](const std::string& options) -> std::shared_ptr<cca::CUDAAllocator> {
        RequireBound();
        auto allocator = std::make_shared<VmmAllocator>(options);
        allocator->UseOwnPools();
        // PyTorch's MemPool and its private pool keep a raw pointer to the allocator, which
        // tensors of the pool may outlive: each one lives as long as the process.
        static std::mutex kept_mu;
        static auto* kept = new std::vector<std::shared_ptr<VmmAllocator>>();
        std::lock_guard<std::mutex> lock(kept_mu);
        kept->push_back(allocator);
        return allocator;
      },
      "A vmm allocator for torch.cuda.MemPool whose pools take `options`.");
  m.def(
      "close_pool_allocator",
      [](const std::shared_ptr<cca::CUDAAllocator>& allocator) {
        auto* mine = dynamic_cast<VmmAllocator*>(allocator.get());
        TORCH_CHECK_VALUE(mine != nullptr, "vmm: not a vmm allocator");
        mine->Close();
      },
      "Closes the vmm pools of a MemPool's allocator (pool_allocator).");
  m.def(
      "pool_ids",
      [](const std::shared_ptr<cca::CUDAAllocator>& allocator, int device, uint64_t id0,
         uint64_t id1) {
        std::vector<int64_t> ids;
        if (installed != nullptr) {
          ids = installed->PoolIds(static_cast<c10::DeviceIndex>(device), {id0, id1});
        }
        auto* mine = dynamic_cast<VmmAllocator*>(allocator.get());
        TORCH_CHECK_VALUE(mine != nullptr, "vmm: not a vmm allocator");
        for (int64_t id : mine->PoolIds(static_cast<c10::DeviceIndex>(device), {id0, id1})) {
          if (std::find(ids.begin(), ids.end(), id) == ids.end()) ids.push_back(id);
        }
        return ids;
      },
      "vmm's ids of the pools behind MemPool (id0, id1) of `allocator` on `device`.");
  m.def("is_installed", [] { return installed != nullptr; });
  // The two steps of a send (send_steps.h) and their events (ready_events.h): one object
  // for the process, never destroyed (the CUDA context may be gone at exit).
  static auto* ready = new vmm_torch::ReadyEvents();
  m.def(
      "prepare_send",
      [](const at::Tensor& t) {
        RequireBound();
        return vmm_torch::PrepareSend(t, libvmm.send_prepare, ready);
      },
      "Queue.put's step for a tensor: (kind, storage address); a CUDA tensor of memory sent "
      "as it is gets its ready event. Kind -1: a non-leaf tensor that requires grad.");
  m.def(
      "export_send",
      [](const at::Tensor& t) -> py::tuple {
        RequireBound();
        const vmm_torch::Exported out = vmm_torch::ExportSend(
            t, libvmm.send_kind, libvmm.export_send, libvmm.release_buffer, ready, WithoutGil());
        if (!out.bytes) return py::make_tuple(out.kind, py::none(), py::none());
        return py::make_tuple(out.kind, py::bytes(out.bytes->first),
                              py::bytes(out.bytes->second));
      },
      "The feeder thread's step for a tensor: (kind, descriptor, ticket), waiting for its "
      "ready events first; descriptor None unless it went as it is (and was exported: "
      "else libvmm's last error says why).");
  m.def(
      "record_ready",
      [](const at::Tensor& t) {
        const vmm_torch::StorageKey key = vmm_torch::StorageOf(t);
        TORCH_CHECK_VALUE(t.is_cuda() && key.base != 0, "vmm: not a CUDA tensor with storage");
        ready->Record(key, t.device().index());
      },
      "Records a ready event for the storage of CUDA tensor `t` on the current stream.");
  m.def(
      "wait_ready",
      [](const at::Tensor& t) { return ready->Wait(vmm_torch::StorageOf(t), WithoutGil()); },
      "Waits for the ready events of the storage of `t` and reuses them; False if none.");
  m.def(
      "discard_ready",
      [](const at::Tensor& t) { ready->Discard(vmm_torch::StorageOf(t)); },
      "Reuses the ready events of the storage of `t` without waiting.");
}
