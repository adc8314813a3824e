// sharing.h: exporting pool blocks as descriptors, and importing descriptors as mappings.
//
//   // Exporter:
//   VMM_ASSIGN_OR_RETURN(std::unique_ptr<Pool> pool, CreateExportablePool(driver, options));
//   VMM_ASSIGN_OR_RETURN(void* ptr, pool->Allocate(size, stream));
//   VMM_ASSIGN_OR_RETURN(BufferDescriptor d, ExportBuffer(*pool, ptr));
//   send(d.Encode());                      // plain bytes, any transport
//   // Importer (another process):
//   VMM_ASSIGN_OR_RETURN(BufferDescriptor d, BufferDescriptor::Decode(bytes));
//   VMM_ASSIGN_OR_RETURN(auto buffer, ImportBuffer(driver, d));
//   use(buffer->ptr(), buffer->size());    // unmapped when `buffer` goes away
//
// Export marks the chunks the block spans as exported (the pool's export invariant) and
// describes them: one handle per chunk in address order, the chunk sizes, the block's offset
// in the first chunk, its size, and the UUID of the exporting device. Fabric handles are the
// driver's bytes; POSIX fds are registered with this process's FdServer and described by
// tokens (fd_share.h); ExportRegistry (export_registry.h) caches both per chunk. Nothing is
// pinned: once the exporter frees the block and its chunks go back to the driver, the
// descriptor is stale.
//
// Import reserves exactly the bytes it maps, maps every handle in order as one contiguous
// range, and sets access once (for ImportOptions::device and peer_devices). The mapping holds
// the memory: from then on the importer is independent of the exporter. It also keeps, until
// it is unmapped, what sending the buffer on needs (kept_handles.h: the fds it fetched, up to
// a process-wide cap, or the imported fabric handles), so ReExportImport can describe the
// same memory to a third process after the exporter has freed it or exited. Importing the same handles again in this
// process, for the same device and peers, while a mapping is open shares that mapping (and
// what it keeps); another device or peer list maps them again.
// Every failure — stale, forged or malformed descriptors, a gone exporter, driver errors — is
// a clean status whose message names the owner (descriptor's owner UUID), and leaves nothing
// mapped or reserved: the mapped part of the range is unmapped in one call (on the host
// backend one mmap of the reservation's filler, which cannot fail for lack of map entries),
// then the range is unreserved.
//
// What one import may map is bounded before anything is fetched, reserved or mapped, so that
// a hostile descriptor (one live handle repeated 70,000 times, say) cannot use up the
// process's map entries or fds and leave it unable to allocate, create pools or start threads:
//   - at most kMaxImportHandles handles (InvalidArgument naming the count and the cap): each
//     costs a driver import and a map (cuMemMap on CUDA, a kernel map entry on the host), and
//     vmm's own exports carry one handle per chunk, a handful per block;
//   - the mappings must fit under the process's map limit (/proc/sys/vm/max_map_count) beside
//     the maps it has (/proc/self/maps), leaving kMapCountHeadroom free for everything else
//     (ResourceExhausted naming the count and the limit: the process is too full now);
//   - the fds the mapping keeps (one per handle for POSIX-fd descriptors, the fds fetched; on
//     the host backend one per handle for fabric ones too, the imported files) must likewise
//     fit under the open-file limit (RLIMIT_NOFILE) beside the fds open, leaving kFdHeadroom
//     (ResourceExhausted).
// The last two are counted only for imports of more than kUncountedImportHandles handles;
// smaller ones fit in the headroom, and reading /proc would slow every import down.
#ifndef VMM_ALLOCATOR_SHARING_H_
#define VMM_ALLOCATOR_SHARING_H_

#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/status/statusor.h"
#include "allocator/descriptor.h"
#include "allocator/driver.h"
#include "allocator/fd_share.h"
#include "allocator/pool.h"

namespace vmm {

// Creates a pool whose blocks ExportBuffer can export: its observer is the process's
// ExportRegistry (export_registry.h). Errors as Pool::Create.
absl::StatusOr<std::unique_ptr<Pool>> CreateExportablePool(Driver* driver,
                                                           const PoolOptions& options);

// Exports the live block starting at `ptr` of a pool made by CreateExportablePool. Errors:
// InvalidArgument (not a live block), FailedPrecondition (the pool's memory is not shareable,
// or the pool was not made to export, or, with ExportNeighbours::kRefuse, the block shares a
// chunk with another live block: Pool::Export), or the driver's export error.
// `use` and `chunks` as ExportRegistry::Export's (export_registry.h).
absl::StatusOr<BufferDescriptor> ExportBuffer(
    Pool& pool, void* ptr, ExportNeighbours neighbours = ExportNeighbours::kAllow,
    ExportUse use = ExportUse::kUntracked, std::vector<ExportedChunk>* chunks = nullptr);

// The most handles one import maps (see the file comment).
inline constexpr size_t kMaxImportHandles = 16384;
// Map entries an import leaves free under vm.max_map_count, for threads, malloc and libraries.
inline constexpr size_t kMapCountHeadroom = 4096;
// Fds an import of POSIX-fd handles leaves free under RLIMIT_NOFILE.
inline constexpr size_t kFdHeadroom = 256;
// Imports of at most this many handles skip counting the process's maps and fds.
inline constexpr size_t kUncountedImportHandles = 64;

struct ImportOptions {
  // Device to map on; -1: the local device whose UUID is the owner's, else device 0. It may
  // be another device than the one holding the memory (the exporter's): the mapping is then
  // granted to this device only (unless listed in peer_devices), and its reads and writes go
  // over the peer link. Out of range: InvalidArgument. On CUDA the two devices must be peer
  // capable, else SetAccess fails and so does the import. Use ImportedBuffer::device() to
  // pick the stream or torch device that works on the buffer.
  int device = -1;
  // Further devices granted access to the mapping (the exporter's device among them, if it
  // should have access too). A bad index fails the import (InvalidArgument).
  std::vector<int> peer_devices;
  FdFetch fd_fetch = FdFetch::kSocket;
  // Share an open mapping of the same handles instead of mapping them again.
  bool share_mappings = true;
  // The process's map limit the budget check uses; 0: /proc/sys/vm/max_map_count. Tests set
  // a small one to reach the limit without exhausting the process.
  size_t max_map_count = 0;
};

class ImportedBuffer {
 public:
  ~ImportedBuffer();
  ImportedBuffer(const ImportedBuffer&) = delete;
  ImportedBuffer& operator=(const ImportedBuffer&) = delete;

  // First byte of the buffer (the mapping's start plus the descriptor's offset).
  DevPtr ptr() const;
  size_t size() const { return size_; }
  int device() const;
  // The whole mapping (all the chunks).
  DevPtr mapping_base() const;
  size_t mapped_size() const;
  // Whether this import shares another import's mapping.
  bool shared() const { return shared_; }
  // The handle type of the imported descriptor.
  HandleType handle_type() const;
  // The owner UUID of the imported descriptor (the device that first exported the memory).
  const std::optional<std::string>& owner_uuid() const { return owner_uuid_; }
  // Runs `done(forwarded)` once the mapping this import shares has been unmapped: after every
  // import sharing it is gone, on the thread that dropped the last, no lock held. `forwarded`
  // is true if any of them was sent on (MarkForwarded, ReExportImport) or the range was left
  // mapped (Close could not synchronize). What a receiver reports to a sender (send_ledger.h).
  void OnUnmapped(absl::AnyInvocable<void(bool forwarded) &&> done);
  // Records that the memory was sent on to another process, which nobody counts.
  void MarkForwarded();

  class Mapping;

 private:
  friend absl::StatusOr<std::unique_ptr<ImportedBuffer>> ImportBuffer(
      Driver* driver, const BufferDescriptor& descriptor, const ImportOptions& options);
  friend absl::StatusOr<BufferDescriptor> ReExportImport(ImportedBuffer& buffer);
  ImportedBuffer(std::shared_ptr<Mapping> mapping, size_t offset, size_t size, bool shared,
                 std::optional<std::string> owner_uuid)
      : mapping_(std::move(mapping)),
        offset_(offset),
        size_(size),
        shared_(shared),
        owner_uuid_(std::move(owner_uuid)) {}

  std::shared_ptr<Mapping> mapping_;
  size_t offset_;
  size_t size_;
  bool shared_;
  std::optional<std::string> owner_uuid_;
};

// Imports `descriptor` through `driver`; see the file comment. The buffer is unmapped when
// the returned object (and every other import sharing its mapping) is destroyed.
absl::StatusOr<std::unique_ptr<ImportedBuffer>> ImportBuffer(
    Driver* driver, const BufferDescriptor& descriptor, const ImportOptions& options = {});

// Describes the imported buffer for another process: the same chunks (sizes, offset, size,
// owner UUID) with handles this process exports from its own import: fabric bytes, or POSIX fds
// registered with this process's FdServer (tokens naming this process). Cached per mapping: the
// first call exports, later ones reuse; the fds are unregistered when the mapping goes.
// Errors: FailedPrecondition (the import's handle type is none / the driver cannot export
// imported handles / the process keeps no fds for this import, too many imports being open
// (kept_handles.h: the kept-fd cap) — say which), the driver's export error.
//
// The receiver imports the descriptor as any other; the memory is the original exporter's,
// held by this process's mapping, so it works after that exporter has freed the buffer or
// exited, and goes stale (NotFound, or Unavailable once this process has exited) when every
// import sharing the mapping here is gone. POSIX-fd buffers forward the fds the import fetched
// (no driver call, so also on CUDA, whose driver refuses to export an imported handle); fabric
// buffers are exported by the driver from the kept imported handles (the host backend does; on
// CUDA that refusal is FailedPrecondition). Every error names the owner. On success the import
// is marked forwarded (MarkForwarded); a failure leaves it as it was. Thread safe.
absl::StatusOr<BufferDescriptor> ReExportImport(ImportedBuffer& buffer);

// Open mappings made by ImportBuffer in this process (tests and stats).
size_t OpenImportMappings();

}  // namespace vmm

#endif  // VMM_ALLOCATOR_SHARING_H_
