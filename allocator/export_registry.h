// export_registry.h: the sharing side of exported pool memory, one per process.
//
//   VMM_ASSIGN_OR_RETURN(auto pool, CreateExportablePool(driver, options));   // sharing.h
//   VMM_ASSIGN_OR_RETURN(BufferDescriptor d, ExportBuffer(*pool, ptr));
//
// The pool marks exported chunks and keeps the export invariant; the registry turns those
// chunks into what travels. For each exported chunk it makes the shareable handle once and
// caches it until the chunk goes back to the driver:
//   - fabric: the driver's 64-byte handle;
//   - POSIX fd: the driver's fd, handed to this process's FdServer (fd_share.h; the one fd the
//     process holds for the chunk), described by a 64-byte FdToken.
// It is the ExportObserver of every pool created to export (CreateExportablePool), so when a
// chunk is released its cached handle is dropped and its fd closed: a descriptor parked in a
// queue pins nothing. A pool's first fd export also holds the process's FdExportAnchors entry
// for its device (fd_export_anchor.h), dropped when the pool is destroyed.
//
// Thread safety: thread safe. Lock order: a pool's lock, then the registry's (the pool calls
// the registry with its lock held; the registry never calls a pool while holding its own).
// The registry's lock is held across fork() (fork_guard.h, ForkLevel::kExports), as is that of
// its FdExportAnchors: a forked child exports from pools of its own through them.
#ifndef VMM_ALLOCATOR_EXPORT_REGISTRY_H_
#define VMM_ALLOCATOR_EXPORT_REGISTRY_H_

#include <array>
#include <cstdint>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "allocator/descriptor.h"
#include "allocator/export_observer.h"
#include "allocator/fd_export_anchor.h"
#include "allocator/fork_guard.h"
#include "allocator/mutex.h"
#include "allocator/pool.h"

namespace vmm {

class ExportRegistry final : public ExportObserver {
 public:
  // The process's registry (never destroyed).
  static ExportRegistry& Process();

  // Export describes the live block starting at `ptr` of `pool`, which must have been created
  // with this registry as its observer (FailedPrecondition otherwise). Errors: InvalidArgument
  // (not a live block), FailedPrecondition (memory not exportable), the driver's export error,
  // or the FdServer's (Unavailable when it cannot listen). `neighbours` as Pool::Export's:
  // kRefuse fails with FailedPrecondition, exporting nothing, when the block shares a chunk
  // with another live block.
  // `use` as Pool::Export's; `chunks`, when given, receives the exported chunks (what
  // Pool::SettleExport takes back for a kTracked export).
  absl::StatusOr<BufferDescriptor> Export(Pool& pool, void* ptr,
                                          ExportNeighbours neighbours = ExportNeighbours::kAllow,
                                          ExportUse use = ExportUse::kUntracked,
                                          std::vector<ExportedChunk>* chunks = nullptr);

  void ChunkReleased(uint64_t pool_id, uint64_t chunk_id) override;
  // Keeps the cached handle under the new id; an fd is registered afresh (FdServer::Rekey),
  // so a token of the old id fetches nothing. If that fails the fd is closed, as on release.
  void ChunkRenamed(uint64_t pool_id, uint64_t old_id, uint64_t new_id) override;
  void PoolDestroyed(uint64_t pool_id) override;

  // Cached chunk handles (tests and stats).
  size_t cached_handles() const;
  // Fd export anchors alive (tests).
  size_t fd_anchors() const { return anchors_.size(); }

 private:
  ExportRegistry() = default;
  struct Cached {
    std::array<uint8_t, kDescriptorHandleSize> handle{};  // fabric bytes, or an encoded FdToken
    uint64_t fd_key = 0;                                  // FdServer key (POSIX fd), else 0
  };
  using Key = std::pair<uint64_t, uint64_t>;  // pool id, chunk id

  // The descriptor handle of `chunk`, made and cached on first use. Runs under the pool's lock
  // (Pool::Export's visitor); sets `*called_driver` when it called Driver::Export.
  absl::Status HandleFor(Pool& pool, HandleType type, const ExportedChunk& chunk,
                         std::array<uint8_t, kDescriptorHandleSize>& out, bool* called_driver);

  mutable Mutex mu_;
  absl::flat_hash_map<Key, Cached> cached_ ABSL_GUARDED_BY(mu_);
  FdExportAnchors anchors_;
  ForkRegistration fork_{ForkLevel::kExports, ForkHandlers::Lock(&mu_)};  // last
};

}  // namespace vmm

#endif  // VMM_ALLOCATOR_EXPORT_REGISTRY_H_
