#include "allocator/export_registry.h"

#include <atomic>
#include <cstring>
#include <string>
#include <vector>

#include "allocator/fd_share.h"
#include "allocator/log.h"
#include "allocator/status_macros.h"

namespace vmm {

ExportRegistry& ExportRegistry::Process() {
  // Never destroyed; not a function's static (fork_guard.h PublishOnce).
  static std::atomic<ExportRegistry*> registry{nullptr};
  return PublishOnce(registry, [] { return new ExportRegistry(); });
}

absl::Status ExportRegistry::HandleFor(Pool& pool, HandleType type, const ExportedChunk& chunk,
                                       std::array<uint8_t, kDescriptorHandleSize>& out,
                                       bool* called_driver) {
  const Key key{pool.id(), chunk.id};
  {
    MutexLock lock(&mu_);
    auto it = cached_.find(key);
    if (it != cached_.end()) {
      out = it->second.handle;
      return absl::OkStatus();
    }
  }
  // The chunk cannot go away meanwhile: the caller holds the pool's lock.
  if (type == HandleType::kPosixFd) {
    anchors_.Hold(pool.id(), pool.driver(), pool.device(), pool.granularity());
  }
  *called_driver = true;
  VMM_ASSIGN_OR_RETURN(ShareableHandle shared, pool.driver()->Export(chunk.handle, type));
  Cached cached;
  if (type == HandleType::kFabric) {
    std::memcpy(cached.handle.data(), shared.fabric.data(), kFabricHandleSize);
  } else {
    VMM_ASSIGN_OR_RETURN(FdToken token, FdServer::Get().Register(std::move(shared.fd)));
    cached.handle = token.Encode();
    cached.fd_key = token.key;
  }
  MutexLock lock(&mu_);
  cached_[key] = cached;
  out = cached.handle;
  return absl::OkStatus();
}

absl::StatusOr<BufferDescriptor> ExportRegistry::Export(Pool& pool, void* ptr,
                                                        ExportNeighbours neighbours,
                                                        ExportUse use,
                                                        std::vector<ExportedChunk>* chunks) {
  if (pool.observer() != this) {
    return absl::FailedPreconditionError(
        "this pool was not created for export: create it with vmm::CreateExportablePool "
        "(sharing.h), so that released memory is never pinned by a cached handle");
  }
  std::vector<std::string> handles;
  std::vector<int64_t> sizes;
  const HandleType type = pool.handle_type();
  auto visit = [&](const ExportedChunk& chunk, bool* called_driver) {
    std::array<uint8_t, kDescriptorHandleSize> handle;
    VMM_RETURN_IF_ERROR(HandleFor(pool, type, chunk, handle, called_driver));
    handles.emplace_back(reinterpret_cast<const char*>(handle.data()), handle.size());
    sizes.push_back(static_cast<int64_t>(chunk.size));
    return absl::OkStatus();
  };
  VMM_ASSIGN_OR_RETURN(ExportedBlock block,
                       pool.Export(ptr, HandleType::kNone, visit, neighbours, use));
  if (chunks != nullptr) *chunks = block.chunks;
  return BufferDescriptor::FromHandles(block.handle_type, handles, sizes,
                                       static_cast<int64_t>(block.size), pool.device_uuid(),
                                       static_cast<int64_t>(block.offset));
}

void ExportRegistry::ChunkReleased(uint64_t pool_id, uint64_t chunk_id) {
  uint64_t fd_key = 0;
  {
    MutexLock lock(&mu_);
    auto it = cached_.find(Key{pool_id, chunk_id});
    if (it == cached_.end()) return;
    fd_key = it->second.fd_key;
    cached_.erase(it);
  }
  if (fd_key != 0) FdServer::Get().Unregister(fd_key);
}

void ExportRegistry::ChunkRenamed(uint64_t pool_id, uint64_t old_id, uint64_t new_id) {
  Cached cached;
  {
    MutexLock lock(&mu_);
    auto it = cached_.find(Key{pool_id, old_id});
    if (it == cached_.end()) return;
    cached = it->second;
    cached_.erase(it);
  }
  if (cached.fd_key != 0) {
    absl::StatusOr<FdToken> token = FdServer::Get().Rekey(cached.fd_key);
    if (!token.ok()) {
      FdServer::Get().Unregister(cached.fd_key);
      return;  // exported afresh on next use
    }
    cached.fd_key = token->key;
    cached.handle = token->Encode();
  }
  MutexLock lock(&mu_);
  cached_[Key{pool_id, new_id}] = cached;
}

void ExportRegistry::PoolDestroyed(uint64_t pool_id) { anchors_.Drop(pool_id); }

size_t ExportRegistry::cached_handles() const {
  MutexLock lock(&mu_);
  return cached_.size();
}

}  // namespace vmm
