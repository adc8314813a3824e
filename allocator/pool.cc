#include "allocator/pool.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <utility>

#include "absl/base/attributes.h"
#include "absl/base/optimization.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "allocator/log.h"
#include "allocator/status_macros.h"

namespace vmm {
namespace {

// Every block is a multiple of this, and so aligned to it.
constexpr size_t kMinBlock = 512;

inline size_t RoundUp(size_t n, size_t multiple) {
  return (n + multiple - 1) / multiple * multiple;
}

std::string Bytes(int64_t n) {
  const double b = static_cast<double>(n);
  if (n >= (int64_t{1} << 30)) return absl::StrFormat("%.2f GiB", b / (1 << 30));
  if (n >= (int64_t{1} << 20)) return absl::StrFormat("%.2f MiB", b / (1 << 20));
  if (n >= (int64_t{1} << 10)) return absl::StrFormat("%.2f KiB", b / (1 << 10));
  return absl::StrCat(n, " B");
}

// Creates and releases one granule exportable as `type`: the only reliable test (fabric is
// reported as supported but needs an IMEX channel).
absl::Status ProbeCreate(Driver& driver, int device, size_t granularity, HandleType type) {
  VMM_ASSIGN_OR_RETURN(bool supported, driver.SupportsHandleType(device, type));
  if (!supported) {
    return absl::UnimplementedError(
        absl::StrCat("device ", device, " does not support ", HandleTypeName(type), " handles"));
  }
  VMM_ASSIGN_OR_RETURN(PhysHandle handle,
                       driver.Create(device, granularity, HandleTypeBit(type)));
  return driver.Release(handle);
}

absl::StatusOr<HandleType> ResolveHandleType(Driver& driver, int device, size_t granularity,
                                             HandleRequest request) {
  switch (request) {
    case HandleRequest::kNone:
      return HandleType::kNone;
    case HandleRequest::kPosixFd:
    case HandleRequest::kFabric: {
      const HandleType type =
          request == HandleRequest::kFabric ? HandleType::kFabric : HandleType::kPosixFd;
      absl::Status probe = ProbeCreate(driver, device, granularity, type);
      if (!probe.ok()) {
        return absl::FailedPreconditionError(absl::StrCat(
            HandleTypeName(type), " handles are unavailable on ", driver.Name(), " device ",
            device, ": ", probe.message()));
      }
      return type;
    }
    case HandleRequest::kAuto:
      break;
  }
  absl::Status fabric = ProbeCreate(driver, device, granularity, HandleType::kFabric);
  if (fabric.ok()) return HandleType::kFabric;
  absl::Status fd = ProbeCreate(driver, device, granularity, HandleType::kPosixFd);
  if (fd.ok()) {
    LogWarningOnce("fabric-fallback",
                   absl::StrCat("fabric handles are unavailable (", fabric.message(),
                                "); sharing uses POSIX file descriptors"));
    return HandleType::kPosixFd;
  }
  LogWarningOnce("no-sharing", absl::StrCat("memory is not shareable: fabric: ",
                                            fabric.message(), "; posix_fd: ", fd.message()));
  return HandleType::kNone;
}

}  // namespace

std::optional<HandleRequest> ParseHandleRequest(absl::string_view name) {
  if (name == "auto") return HandleRequest::kAuto;
  const std::optional<HandleType> type = ParseHandleType(name);
  if (!type) return std::nullopt;
  switch (*type) {
    case HandleType::kNone:
      return HandleRequest::kNone;
    case HandleType::kPosixFd:
      return HandleRequest::kPosixFd;
    case HandleType::kFabric:
      return HandleRequest::kFabric;
  }
  return std::nullopt;
}

absl::StatusOr<std::unique_ptr<Pool>> Pool::Create(Driver* driver, const PoolOptions& options) {
  if (driver == nullptr) return absl::InvalidArgumentError("Pool::Create: no driver");
  const int devices = driver->DeviceCount();
  if (options.device < 0 || options.device >= devices) {
    return absl::InvalidArgumentError(absl::StrCat("device ", options.device, " is out of range: ",
                                                   driver->Name(), " has ", devices,
                                                   " device(s)"));
  }
  for (int peer : options.peer_devices) {
    if (peer < 0 || peer >= devices || peer == options.device) {
      return absl::InvalidArgumentError(
          absl::StrCat("peer device ", peer, " is not another device of ", driver->Name()));
    }
  }
  if (!(options.growth_fraction >= 0 && options.growth_fraction <= 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("growth_fraction ", options.growth_fraction, " is outside [0, 1]"));
  }
  if (options.small_size == 0 || options.small_chunk == 0 || options.max_chunk == 0) {
    return absl::InvalidArgumentError("small_size, small_chunk and max_chunk must be positive");
  }
  std::unique_ptr<Pool> pool(new Pool(driver, options));
  VMM_RETURN_IF_ERROR(pool->Init());
  return pool;
}

namespace {
std::atomic<uint64_t> next_pool_id{1};
}  // namespace

Pool::Pool(Driver* driver, const PoolOptions& options)
    : driver_(driver), id_(next_pool_id.fetch_add(1)), options_(options) {}

absl::Status Pool::Init() {
  const int device = options_.device;
  VMM_ASSIGN_OR_RETURN(granularity_, driver_->Granularity(device));
  VMM_ASSIGN_OR_RETURN(device_uuid_, driver_->DeviceUuid(device));
  VMM_ASSIGN_OR_RETURN(handle_type_,
                       ResolveHandleType(*driver_, device, granularity_, options_.handle_type));
  options_.max_chunk = std::max(granularity_, options_.max_chunk / granularity_ * granularity_);
  options_.small_chunk = RoundUp(options_.small_chunk, granularity_);
  size_t reserve = options_.reserve_size;
  if (reserve == 0) {
    VMM_ASSIGN_OR_RETURN(MemInfo info, driver_->GetMemInfo(device));
    reserve = 2 * info.total;
  }
  // The small arena takes an eighth of the range, at least one small chunk.
  const size_t small = std::max(options_.small_chunk, RoundUp(reserve / 8, granularity_));
  reserve_size_ = small + std::max(granularity_, RoundUp(reserve - std::min(reserve, small),
                                                          granularity_));
  VMM_ASSIGN_OR_RETURN(DevPtr base, driver_->Reserve(reserve_size_, granularity_));
  base_ = static_cast<uintptr_t>(base);
  access_devices_.push_back(device);
  for (int peer : options_.peer_devices) access_devices_.push_back(peer);
  // Allocated blocks of the large arena are larger than small_size, or alone in a chunk, so
  // they start at least this far apart (a power of two, at least 512).
  int large_shift = 9;
  while ((size_t{2} << large_shift) <= std::min(options_.small_size + 1, granularity_)) {
    ++large_shift;
  }
  MutexLock lock(&mu_);
  small_.Init(base_, small, /*slot_shift=*/9);
  large_.Init(base_ + small, reserve_size_ - small, large_shift);
  large_base_ = base_ + small;
  memory_limit_ = options_.memory_limit;
  return absl::OkStatus();
}

Pool::~Pool() {
  MutexLock lock(&mu_);
  absl::Status sync = driver_->SynchronizeDevice(options_.device);
  if (!sync.ok()) LogError(absl::StrCat("pool teardown: ", sync.message()));
  if (const size_t live = small_.live().count() + large_.live().count(); live > 0) {
    LogWarning(absl::StrCat("pool on device ", options_.device, " destroyed with ", live,
                            " live block(s); their memory is released"));
  }
  for (auto& [addr, chunk] : chunks_) {
    absl::Status s = driver_->Unmap(addr, chunk.size);
    if (s.ok()) s = driver_->Release(chunk.handle);
    if (!s.ok()) LogError(absl::StrCat("pool teardown: ", s.message()));
    if (chunk.exported) {
      for (auto& listener : release_listeners_) listener(chunk.id);
    }
  }
  chunks_.clear();
  for (const Pending& p : pending_) spare_events_.push_back(p.event);
  for (auto& [stream, reclaim] : reclaim_) {
    if (reclaim.event != 0) spare_events_.push_back(reclaim.event);
  }
  for (Event e : spare_events_) (void)driver_->DestroyEvent(e);
  if (fd_anchor_.has_value()) {
    fd_anchor_->fd.fd.reset();  // the fd first, then the allocation it exports
    absl::Status s = driver_->Release(fd_anchor_->handle);
    if (!s.ok()) LogError(absl::StrCat("pool teardown: ", s.message()));
  }
  if (base_ != 0) {
    absl::Status s = driver_->Unreserve(base_, reserve_size_);
    if (!s.ok()) LogError(absl::StrCat("pool teardown: ", s.message()));
  }
}

// Both pick an arena by table lookup rather than a branch: sizes and addresses come in no
// predictable order, and a mispredicted branch costs more than the whole lookup.
Arena& Pool::ArenaFor(size_t rounded) { return *arenas_[rounded > options_.small_size]; }

Arena& Pool::ArenaOf(uintptr_t addr) { return *arenas_[addr >= large_base_]; }

Block* Pool::LiveBlock(const void* ptr) {
  const auto addr = reinterpret_cast<uintptr_t>(ptr);
  return ArenaOf(addr).live().Find(addr);
}

ABSL_ATTRIBUTE_ALWAYS_INLINE inline void Pool::TakeBlock(Arena& arena, Block* block, size_t n,
                                                         size_t requested, Stream stream) {
  arena.Take(block, n, kMinBlock);
  block->stream = stream;
  block->requested = requested;
  arena.live().Insert(block);
  const auto bytes = static_cast<int64_t>(block->size);
  stats_.allocated_bytes.Increase(bytes);
  stats_.requested_bytes.Increase(static_cast<int64_t>(requested));
  stats_.allocation.Increase(1);
}

ABSL_ATTRIBUTE_ALWAYS_INLINE inline void Pool::Cache(Arena& arena, Block* block) {
  arena.AddFree(block, block->stream, ++free_seq_);
}

absl::StatusOr<void*> Pool::Allocate(size_t size, Stream stream) {
  MutexLock lock(&mu_);
  // The cached path: a fit in the cache, nothing pending.
  if (ABSL_PREDICT_TRUE(pending_.empty() && size <= reserve_size_)) {
    const size_t n = RoundUp(std::max<size_t>(size, 1), kMinBlock);
    Arena& arena = ArenaFor(n);
    if (Block* block = arena.BestFit(stream, n); ABSL_PREDICT_TRUE(block != nullptr)) {
      TakeBlock(arena, block, n, size, stream);
      return reinterpret_cast<void*>(block->addr);
    }
  }
  return AllocateLocked(size, stream, /*shareable=*/false);
}

absl::StatusOr<void*> Pool::AllocateShareable(size_t size, Stream stream) {
  MutexLock lock(&mu_);
  if (handle_type_ == HandleType::kNone) {
    return absl::FailedPreconditionError(
        "AllocateShareable: this pool's memory is not exportable (handle type none)");
  }
  return AllocateLocked(size, stream, /*shareable=*/true);
}

absl::StatusOr<void*> Pool::AllocateLocked(size_t size, Stream stream, bool shareable) {
  if (size > reserve_size_) {
    ++stats_.num_ooms;
    return absl::ResourceExhaustedError(
        absl::StrCat("out of memory: requested ", size, " bytes (", Bytes(size),
                     "), more than the pool's whole address range; ", Summary()));
  }
  const size_t n = RoundUp(std::max<size_t>(size, 1), kMinBlock);
  if (!pending_.empty()) VMM_RETURN_IF_ERROR(ProcessPending());
  Arena& arena = shareable ? large_ : ArenaFor(n);
  Block* block = shareable ? nullptr : arena.BestFit(stream, n);
  if (block == nullptr && !shareable) {
    // Blocks other streams freed may be done with; blocks every stream may use can join
    // this stream's neighbouring blocks.
    VMM_RETURN_IF_ERROR(ReclaimOtherStreams(stream));
    arena.NarrowAnyTo(stream);
    block = arena.BestFit(stream, n);
  }
  if (block == nullptr) {
    absl::StatusOr<Block*> grown = Grow(arena, n, stream, shareable);
    if (!grown.ok() && absl::IsResourceExhausted(grown.status())) {
      // Trim everything that is free, then try once more.
      ++stats_.num_alloc_retries;
      VMM_RETURN_IF_ERROR(SynchronizeAll());
      RetagAllFree();
      VMM_RETURN_IF_ERROR(ReleaseFreeChunks(/*any_stream=*/true, SIZE_MAX));
      grown = Grow(arena, n, stream, shareable);
    }
    if (!grown.ok()) {
      if (!absl::IsResourceExhausted(grown.status())) return grown.status();
      ++stats_.num_ooms;
      return absl::ResourceExhaustedError(absl::StrCat(
          "out of memory: requested ", size, " bytes (", Bytes(size), ") on ", driver_->Name(),
          " device ", options_.device, ": ", grown.status().message(), "; ", Summary()));
    }
    block = *grown;
  }
  TakeBlock(arena, block, n, size, stream);
  if (pending_blocks_ > 0) {
    // Active (allocated + pending) peaks here; the cached path runs only with none pending.
    active_bytes_peak_ =
        std::max(active_bytes_peak_, stats_.allocated_bytes.current + pending_bytes_);
    active_peak_ = std::max(active_peak_, stats_.allocation.current + pending_blocks_);
  }
  if (shareable && block->next != nullptr && block->next->state == BlockState::kFree &&
      OverlapsExported(block->next->addr, block->next->end())) {
    // The rest of its own chunk is never handed out.
    retired_bytes_ += static_cast<int64_t>(block->next->size);
    arena.Retire(block->next);
  }
  return reinterpret_cast<void*>(block->addr);
}

absl::Status Pool::Free(void* ptr) {
  MutexLock lock(&mu_);
  const auto addr = reinterpret_cast<uintptr_t>(ptr);
  Arena& arena = ArenaOf(addr);
  Block* block = arena.live().Find(addr);
  if (ABSL_PREDICT_FALSE(block == nullptr)) return NotLive(addr);
  arena.live().Erase(block);
  stats_.allocated_bytes.Decrease(static_cast<int64_t>(block->size));
  stats_.requested_bytes.Decrease(static_cast<int64_t>(block->requested));
  stats_.allocation.Decrease(1);
  if (ABSL_PREDICT_TRUE(block->stream_uses.empty() &&
                        (exported_chunks_ == 0 || !OverlapsExported(block->addr, block->end())))) {
    Cache(arena, block);
  } else {
    VMM_RETURN_IF_ERROR(FreeInUse(block));
  }
  if (ABSL_PREDICT_FALSE(options_.release_threshold != SIZE_MAX)) return ApplyReleaseThreshold();
  return absl::OkStatus();
}

absl::Status Pool::NotLive(uintptr_t addr) const {
  return absl::InvalidArgumentError(absl::StrCat(
      "free of ", absl::Hex(addr), ", which is not a live block of the pool on device ",
      options_.device, " (double free, or a pointer from elsewhere)"));
}

absl::Status Pool::FreeInUse(Block* block) {
  // Other streams (or, for memory that will be unmapped, its own stream) may still use it.
  const bool exported = exported_chunks_ > 0 && OverlapsExported(block->addr, block->end());
  std::vector<Stream> streams = std::move(block->stream_uses);
  block->stream_uses.clear();
  if (exported) streams.push_back(block->stream);
  block->state = BlockState::kPendingFree;
  pending_bytes_ += static_cast<int64_t>(block->size);
  ++pending_blocks_;
  bool lost_stream = false;
  for (Stream s : streams) {
    VMM_ASSIGN_OR_RETURN(Event event, GetEvent());
    ++stats_.driver_event;
    absl::Status recorded = driver_->RecordEvent(event, s);
    if (!recorded.ok()) {
      spare_events_.push_back(event);
      lost_stream = true;
      continue;
    }
    pending_.push_back(Pending{event, block});
    ++block->pending_events;
  }
  if (lost_stream) {
    // A stream is gone (or broken): wait for the whole device instead. That completes the
    // events recorded above as well, and ProcessPending recycles the block if it has any,
    // so it must not be recycled twice (nor touched: recycling may merge it away).
    const bool has_events = block->pending_events > 0;
    VMM_RETURN_IF_ERROR(SynchronizeAll());
    if (!has_events) Recycle(block);
    return absl::OkStatus();
  }
  if (block->pending_events == 0) {
    Recycle(block);
    return absl::OkStatus();
  }
  // Often the streams are done already (idle, or synchronised by the program): then the
  // block is recycled (or its exported chunk released) now rather than at a later call.
  // `block` must not be touched after this.
  return ProcessPending();
}

absl::Status Pool::ApplyReleaseThreshold() {
  const int64_t cached = stats_.reserved_bytes.current - stats_.allocated_bytes.current -
                         pending_bytes_ - retired_bytes_;
  if (cached <= static_cast<int64_t>(options_.release_threshold)) return absl::OkStatus();
  VMM_RETURN_IF_ERROR(ReclaimOtherStreams());
  return ReleaseFreeChunks(/*any_stream=*/false,
                           static_cast<size_t>(cached) - options_.release_threshold);
}

void Pool::Recycle(Block* block) {
  if (block->state == BlockState::kPendingFree) {
    pending_bytes_ -= static_cast<int64_t>(block->size);
    --pending_blocks_;
  }
  Arena& arena = ArenaOf(block->addr);
  if (exported_chunks_ == 0 || !OverlapsExported(block->addr, block->end())) {
    Cache(arena, block);
    return;
  }
  const Stream tag = block->stream;
  // Split along chunk boundaries: parts in exported chunks retire, the rest is cached.
  const uintptr_t start = block->addr;
  const uintptr_t end = block->end();
  for (Block* piece = block; piece != nullptr;) {
    auto chunk = std::prev(chunks_.upper_bound(piece->addr));
    const bool exported = chunk->second.exported;
    uintptr_t piece_end = chunk->first + chunk->second.size;
    while (piece_end < piece->end()) {
      auto next = chunks_.find(piece_end);
      if (next == chunks_.end() || next->second.exported != exported) break;
      piece_end += next->second.size;
    }
    Block* rest = piece_end < piece->end() ? arena.Split(piece, piece_end) : nullptr;
    if (exported) {
      retired_bytes_ += static_cast<int64_t>(piece->size);
      arena.Retire(piece);
    } else {
      arena.AddFree(piece, tag, ++free_seq_);
    }
    piece = rest;
  }
  absl::Status released = ReleaseRetiredChunks(start, end);
  if (!released.ok()) LogError(absl::StrCat("releasing exported memory: ", released.message()));
}

absl::Status Pool::RecordStream(void* ptr, Stream stream) {
  MutexLock lock(&mu_);
  Block* block = LiveBlock(ptr);
  if (block == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("record_stream on ", absl::Hex(reinterpret_cast<uintptr_t>(ptr)),
                     ", which is not a live block of this pool"));
  }
  if (stream != block->stream &&
      std::find(block->stream_uses.begin(), block->stream_uses.end(), stream) ==
          block->stream_uses.end()) {
    block->stream_uses.push_back(stream);
  }
  return absl::OkStatus();
}

absl::StatusOr<Block*> Pool::Grow(Arena& arena, size_t n, Stream stream, bool dedicated) {
  std::optional<Arena::GrowthPlan> plan = arena.PlanGrowth(n, stream, granularity_, dedicated);
  if (!plan) {
    return absl::ResourceExhaustedError(
        absl::StrCat("no gap of ", Bytes(n), " left in the pool's reserved address range"));
  }
  const size_t needed = plan->len;
  if (!dedicated) {
    size_t extra = 0;
    if (&arena == &small_) {
      extra = options_.small_chunk > needed ? options_.small_chunk - needed : 0;
    } else {
      const double quantum =
          options_.growth_fraction * static_cast<double>(stats_.reserved_bytes.current);
      extra = std::min(options_.max_growth_extra, static_cast<size_t>(quantum));
      extra = extra / granularity_ * granularity_;
    }
    Arena::Extend(*plan, extra);
  }
  auto try_map = [&](const Arena::GrowthPlan& p) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (memory_limit_ != 0 &&
        static_cast<size_t>(stats_.reserved_bytes.current) + p.len > memory_limit_) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "growing by ", Bytes(p.len), " would pass the pool's memory limit of ",
          Bytes(memory_limit_)));
    }
    return MapRange(p.addr, p.len, dedicated);
  };
  absl::Status mapped = try_map(*plan);
  if (!mapped.ok() && plan->len > needed) {
    // Retry with exactly what the request needs.
    plan = arena.PlanGrowth(n, stream, granularity_, dedicated);
    mapped = try_map(*plan);
  }
  VMM_RETURN_IF_ERROR(mapped);
  ++stats_.num_device_alloc;
  return arena.CommitGrowth(*plan, stream, dedicated);
}

absl::Status Pool::MapRange(uintptr_t addr, size_t len, bool dedicated) {
  const uint32_t bits = HandleTypeBit(handle_type_);
  struct Piece {
    uintptr_t addr;
    size_t size;
    PhysHandle handle;
    bool mapped;
  };
  std::vector<Piece> pieces;
  auto rollback = [&](absl::Status cause) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (const Piece& p : pieces) {
      if (p.mapped) {
        ++stats_.driver_unmap;
        (void)driver_->Unmap(p.addr, p.size);
      }
      ++stats_.driver_release;
      (void)driver_->Release(p.handle);
    }
    return cause;
  };
  for (uintptr_t a = addr; a < addr + len;) {
    const size_t size = std::min(options_.max_chunk, addr + len - a);
    ++stats_.driver_create;
    absl::StatusOr<PhysHandle> handle = driver_->Create(options_.device, size, bits);
    if (!handle.ok()) return rollback(handle.status());
    pieces.push_back(Piece{a, size, *handle, false});
    ++stats_.driver_map;
    absl::Status mapped = driver_->Map(a, size, *handle);
    if (!mapped.ok()) return rollback(mapped);
    pieces.back().mapped = true;
    a += size;
  }
  ++stats_.driver_set_access;
  absl::Status access = driver_->SetAccess(addr, len, access_devices_);
  if (!access.ok()) return rollback(access);
  for (const Piece& p : pieces) {
    Chunk& chunk = chunks_[p.addr];
    chunk.id = next_chunk_id_++;
    chunk.size = p.size;
    chunk.handle = p.handle;
    chunk.dedicated = dedicated;
    chunk.exported = dedicated;
    if (dedicated) {
      ++exported_chunks_;
      stats_.exported_bytes.Increase(static_cast<int64_t>(p.size));
      stats_.exported_chunks.Increase(1);
    }
  }
  stats_.reserved_bytes.Increase(static_cast<int64_t>(len));
  stats_.segment.Increase(static_cast<int64_t>(pieces.size()));
  return absl::OkStatus();
}

absl::Status Pool::ReleaseChunk(uintptr_t addr) {
  auto it = chunks_.find(addr);
  Chunk& chunk = it->second;
  ++stats_.driver_unmap;
  VMM_RETURN_IF_ERROR(driver_->Unmap(addr, chunk.size));
  ++stats_.driver_release;
  absl::Status released = driver_->Release(chunk.handle);
  if (!released.ok()) LogError(absl::StrCat("releasing a chunk: ", released.message()));
  ArenaOf(addr).MakeGap(addr, chunk.size);
  const auto size = static_cast<int64_t>(chunk.size);
  stats_.reserved_bytes.Decrease(size);
  stats_.segment.Decrease(1);
  ++stats_.num_device_free;
  const uint64_t id = chunk.id;
  const bool exported = chunk.exported;
  if (exported) {
    --exported_chunks_;
    retired_bytes_ -= size;
    stats_.exported_bytes.Decrease(size);
    stats_.exported_chunks.Decrease(1);
  }
  chunks_.erase(it);
  if (exported) {
    for (auto& listener : release_listeners_) listener(id);
  }
  return absl::OkStatus();
}

absl::Status Pool::ReleaseFreeChunks(bool any_stream, size_t target) {
  size_t released = 0;
  for (Arena* arena : {&small_, &large_}) {
    std::vector<uintptr_t> doomed;
    for (Block* b = arena->head(); b != nullptr; b = b->next) {
      if (b->state != BlockState::kFree || (!any_stream && b->stream != kAnyStream)) continue;
      for (auto c = chunks_.lower_bound(b->addr);
           c != chunks_.end() && c->first + c->second.size <= b->end(); ++c) {
        doomed.push_back(c->first);
      }
    }
    for (uintptr_t addr : doomed) {
      if (released >= target) return absl::OkStatus();
      released += chunks_.find(addr)->second.size;
      VMM_RETURN_IF_ERROR(ReleaseChunk(addr));
    }
  }
  return absl::OkStatus();
}

bool Pool::OverlapsExported(uintptr_t addr, uintptr_t end) const {
  auto c = chunks_.upper_bound(addr);
  if (c != chunks_.begin()) --c;
  for (; c != chunks_.end() && c->first < end; ++c) {
    if (c->second.exported && c->first + c->second.size > addr) return true;
  }
  return false;
}

void Pool::RetireChunkSpace(uintptr_t chunk_addr) {
  const uintptr_t chunk_end = chunk_addr + chunks_.find(chunk_addr)->second.size;
  Arena& arena = ArenaOf(chunk_addr);
  Block* b = arena.BlockContaining(chunk_addr);
  while (b != nullptr && b->addr < chunk_end) {
    Block* next = b->next;
    if (b->state == BlockState::kFree) {
      if (b->addr < chunk_addr) {
        b = arena.Split(b, chunk_addr);
        next = b->next;
      }
      if (b->end() > chunk_end) {
        arena.Split(b, chunk_end);
        next = nullptr;
      }
      retired_bytes_ += static_cast<int64_t>(b->size);
      arena.Retire(b);
    }
    b = next;
  }
}

absl::Status Pool::ReleaseRetiredChunks(uintptr_t addr, uintptr_t end) {
  std::vector<uintptr_t> doomed;
  auto c = chunks_.upper_bound(addr);
  if (c != chunks_.begin()) --c;
  for (; c != chunks_.end() && c->first < end; ++c) {
    if (!c->second.exported) continue;
    const Block* b = ArenaOf(c->first).BlockContaining(c->first);
    if (b != nullptr && b->state == BlockState::kRetired && b->addr <= c->first &&
        b->end() >= c->first + c->second.size) {
      doomed.push_back(c->first);
    }
  }
  for (uintptr_t chunk : doomed) VMM_RETURN_IF_ERROR(ReleaseChunk(chunk));
  return absl::OkStatus();
}

absl::StatusOr<Event> Pool::GetEvent() {
  if (!spare_events_.empty()) {
    Event e = spare_events_.back();
    spare_events_.pop_back();
    return e;
  }
  return driver_->CreateEvent(options_.device);
}

absl::Status Pool::ProcessPending() {
  size_t kept = 0;
  for (size_t i = 0; i < pending_.size(); ++i) {
    Pending p = pending_[i];
    ++stats_.driver_event;
    VMM_ASSIGN_OR_RETURN(bool done, driver_->EventDone(p.event));
    if (!done) {
      pending_[kept++] = p;
      continue;
    }
    spare_events_.push_back(p.event);
    if (--p.block->pending_events == 0) Recycle(p.block);
  }
  pending_.resize(kept);
  return absl::OkStatus();
}

absl::Status Pool::ReclaimOtherStreams(Stream requester) {
  // Streams that have cached blocks only they may use.
  std::vector<Stream> streams;
  for (const Arena* arena : {&small_, &large_}) {
    arena->free_blocks().ForEachStream([&](Stream s) {
      if (s != kAnyStream && s != requester &&
          std::find(streams.begin(), streams.end(), s) == streams.end()) {
        streams.push_back(s);
      }
    });
  }
  for (Stream s : streams) {
    StreamReclaim& r = reclaim_[s];
    if (!r.in_flight) {
      if (r.event == 0) {
        VMM_ASSIGN_OR_RETURN(r.event, GetEvent());
      }
      ++stats_.driver_event;
      absl::Status recorded = driver_->RecordEvent(r.event, s);
      if (!recorded.ok()) {
        LogWarningOnce("reclaim-record", absl::StrCat("stream ordering: ", recorded.message(),
                                                      "; synchronising the device instead"));
        VMM_RETURN_IF_ERROR(SynchronizeAll());
        RetagAllFree();
        return absl::OkStatus();
      }
      r.seq = free_seq_;
      r.in_flight = true;
    }
    ++stats_.driver_event;
    VMM_ASSIGN_OR_RETURN(bool done, driver_->EventDone(r.event));
    if (!done) continue;
    r.in_flight = false;
    for (Arena* arena : {&small_, &large_}) {
      for (Block* b : arena->free_blocks().BlocksOf(s)) {
        if (b->free_seq <= r.seq && b->state == BlockState::kFree && b->stream == s) {
          arena->Retag(b, kAnyStream);
        }
      }
    }
  }
  // Forget streams with nothing cached (they may be long gone), keeping their events.
  for (auto it = reclaim_.begin(); it != reclaim_.end();) {
    const bool cached = it->first == requester ||
                        std::find(streams.begin(), streams.end(), it->first) != streams.end();
    if (!cached && !it->second.in_flight) {
      if (it->second.event != 0) spare_events_.push_back(it->second.event);
      reclaim_.erase(it++);
    } else {
      ++it;
    }
  }
  return absl::OkStatus();
}

void Pool::RetagAllFree() {
  for (Arena* arena : {&small_, &large_}) {
    std::vector<Stream> streams;
    arena->free_blocks().ForEachStream([&](Stream s) {
      if (s != kAnyStream) streams.push_back(s);
    });
    for (Stream s : streams) {
      for (Block* b : arena->free_blocks().BlocksOf(s)) {
        // Earlier retags may have merged `b` away; BlocksOf is re-read per stream, and a
        // merged block keeps its own tag, so only blocks still tagged `s` are touched.
        if (b->state == BlockState::kFree && b->stream == s) arena->Retag(b, kAnyStream);
      }
    }
  }
  for (auto& [stream, r] : reclaim_) r.in_flight = false;
}

absl::Status Pool::SynchronizeAll() {
  ++stats_.num_sync_all_streams;
  VMM_RETURN_IF_ERROR(driver_->SynchronizeDevice(options_.device));
  return ProcessPending();
}

absl::Status Pool::EmptyCache() {
  MutexLock lock(&mu_);
  VMM_RETURN_IF_ERROR(SynchronizeAll());
  RetagAllFree();
  VMM_RETURN_IF_ERROR(ReleaseFreeChunks(/*any_stream=*/true, SIZE_MAX));
  return ReleaseRetiredChunks(base_, base_ + reserve_size_);
}

void Pool::SetMemoryLimit(size_t bytes) {
  MutexLock lock(&mu_);
  memory_limit_ = bytes;
}

absl::StatusOr<ExportedBlock> Pool::Export(void* ptr, HandleType type) {
  MutexLock lock(&mu_);
  const Block* block = LiveBlock(ptr);
  if (block == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("export of ", absl::Hex(reinterpret_cast<uintptr_t>(ptr)),
                     ", which is not the start of a live block of this pool"));
  }
  if (type == HandleType::kNone) type = handle_type_;
  if (handle_type_ == HandleType::kNone || type != handle_type_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "this pool's memory is exportable as ", HandleTypeName(handle_type_), ", not as ",
        HandleTypeName(type)));
  }
  if (type == HandleType::kPosixFd && !fd_anchor_tried_) AnchorFdExports();
  ExportedBlock out;
  out.handle_type = type;
  out.size = block->requested;
  auto c = std::prev(chunks_.upper_bound(block->addr));
  out.offset = block->addr - c->first;
  for (; c != chunks_.end() && c->first < block->end(); ++c) {
    Chunk& chunk = c->second;
    if (!chunk.exported) {
      chunk.exported = true;
      ++exported_chunks_;
      stats_.exported_bytes.Increase(static_cast<int64_t>(chunk.size));
      stats_.exported_chunks.Increase(1);
      RetireChunkSpace(c->first);
    }
    if (chunk.shared == nullptr) {
      ++stats_.driver_export;
      VMM_ASSIGN_OR_RETURN(ShareableHandle shared, driver_->Export(chunk.handle, type));
      chunk.shared = std::make_unique<ShareableHandle>(std::move(shared));
    }
    ExportedChunk e;
    e.id = chunk.id;
    e.addr = c->first;
    e.size = chunk.size;
    e.fabric = chunk.shared->fabric;
    e.fd = chunk.shared->fd.get();
    out.chunks.push_back(e);
  }
  ++stats_.num_exports;
  return out;
}

void Pool::AnchorFdExports() {
  fd_anchor_tried_ = true;
  absl::StatusOr<PhysHandle> handle =
      driver_->Create(options_.device, granularity_, HandleTypeBit(HandleType::kPosixFd));
  absl::StatusOr<ShareableHandle> fd =
      handle.ok() ? driver_->Export(*handle, HandleType::kPosixFd) : handle.status();
  if (fd.ok()) {
    fd_anchor_ = FdExportAnchor{*handle, *std::move(fd)};
    return;
  }
  LogWarning(absl::StrCat("POSIX fd exports stay unanchored (each may be slower): ",
                          fd.status().message()));
  if (handle.ok()) {
    absl::Status released = driver_->Release(*handle);
    if (!released.ok()) {
      LogError(absl::StrCat("releasing the fd export anchor: ", released.message()));
    }
  }
}

void Pool::AddChunkReleaseListener(std::function<void(uint64_t chunk_id)> listener) {
  MutexLock lock(&mu_);
  release_listeners_.push_back(std::move(listener));
}

void Pool::UpdateDerivedStats(PoolStats& stats) const {
  // Active = allocated + freed blocks still used by streams (pending). It rises only when a
  // block is allocated, so its peak is allocated's peak or one recorded while blocks were
  // pending (AllocateLocked); it falls when a block is freed unused or leaves pending.
  auto derive_active = [](const Stat& allocated, int64_t pending, int64_t pending_at_reset,
                          int64_t pending_peak, Stat& active) {
    active.current = allocated.current + pending;
    active.peak = std::max(allocated.peak, pending_peak);
    active.allocated = allocated.allocated;
    active.freed = allocated.freed - (pending - pending_at_reset);
  };
  derive_active(stats_.allocated_bytes, pending_bytes_, pending_bytes_at_reset_,
                active_bytes_peak_, stats.active_bytes);
  derive_active(stats_.allocation, pending_blocks_, pending_blocks_at_reset_, active_peak_,
                stats.active);
  size_t free_bytes = 0;
  size_t free_count = 0;
  size_t largest = 0;
  for (const Arena* arena : {&small_, &large_}) {
    arena->free_blocks().ForEach([&](const Block* b) {
      free_bytes += b->size;
      ++free_count;
      largest = std::max(largest, b->size);
    });
  }
  stats.inactive_split_bytes.current = static_cast<int64_t>(free_bytes);
  stats.inactive_split_bytes.peak =
      std::max(stats.inactive_split_bytes.peak, stats.inactive_split_bytes.current);
  stats.inactive_split.current = static_cast<int64_t>(free_count);
  stats.inactive_split.peak = std::max(stats.inactive_split.peak, stats.inactive_split.current);
  stats.largest_free_block = static_cast<int64_t>(largest);
  stats.fragmentation =
      free_bytes == 0 ? 0.0 : 1.0 - static_cast<double>(largest) / static_cast<double>(free_bytes);
}

PoolStats Pool::GetStats() const {
  MutexLock lock(&mu_);
  PoolStats stats = stats_;
  UpdateDerivedStats(stats);
  return stats;
}

void Pool::ResetPeakStats() {
  MutexLock lock(&mu_);
#define VMM_RESET_PEAK(name, key, what) stats_.name.ResetPeak();
  VMM_BYTE_STATS(VMM_RESET_PEAK)
  VMM_COUNT_STATS(VMM_RESET_PEAK)
#undef VMM_RESET_PEAK
  active_bytes_peak_ = stats_.allocated_bytes.current + pending_bytes_;
  active_peak_ = stats_.allocation.current + pending_blocks_;
}

void Pool::ResetAccumulatedStats() {
  MutexLock lock(&mu_);
#define VMM_RESET_ACC(name, key, what) stats_.name.ResetAccumulated();
  VMM_BYTE_STATS(VMM_RESET_ACC)
  VMM_COUNT_STATS(VMM_RESET_ACC)
#undef VMM_RESET_ACC
  pending_bytes_at_reset_ = pending_bytes_;
  pending_blocks_at_reset_ = pending_blocks_;
#define VMM_RESET_COUNTER(name, key, what) stats_.name = 0;
  VMM_COUNTERS(VMM_RESET_COUNTER)
#undef VMM_RESET_COUNTER
}

Snapshot Pool::GetSnapshot() const {
  MutexLock lock(&mu_);
  Snapshot snap;
  snap.device = options_.device;
  snap.backend = std::string(driver_->Name());
  snap.device_uuid = device_uuid_;
  snap.reserved_base = base_;
  snap.reserved_size = reserve_size_;
  snap.granularity = granularity_;
  for (const Arena* arena : {&small_, &large_}) {
    SegmentInfo* seg = nullptr;
    for (const Block* b = arena->head(); b != nullptr; b = b->next) {
      if (b->state == BlockState::kUnmapped) {
        seg = nullptr;
        continue;
      }
      if (seg == nullptr) {
        snap.segments.emplace_back();
        seg = &snap.segments.back();
        seg->addr = b->addr;
      }
      seg->size += b->size;
      seg->blocks.push_back(BlockInfo{b->addr, b->size, b->requested, b->state, b->stream});
    }
  }
  for (SegmentInfo& seg : snap.segments) {
    for (auto c = chunks_.lower_bound(seg.addr);
         c != chunks_.end() && c->first < seg.addr + seg.size; ++c) {
      seg.chunks.push_back(
          ChunkInfo{c->first, c->second.size, c->second.exported, c->second.dedicated});
    }
  }
  return snap;
}

std::string Pool::Summary() const {
  PoolStats stats = stats_;
  UpdateDerivedStats(stats);
  std::string out = absl::StrCat(
      "pool: reserved ", Bytes(stats.reserved_bytes.current), " in ", chunks_.size(),
      " chunk(s), allocated ", Bytes(stats.allocated_bytes.current), " in ",
      stats.allocation.current, " block(s), cached free ",
      Bytes(stats.inactive_split_bytes.current), " (largest block ",
      Bytes(stats.largest_free_block), "), peak reserved ", Bytes(stats.reserved_bytes.peak));
  if (memory_limit_ != 0) absl::StrAppend(&out, ", limit ", Bytes(memory_limit_));
  absl::StatusOr<MemInfo> info = driver_->GetMemInfo(options_.device);
  if (info.ok()) {
    absl::StrAppend(&out, "; device free ", Bytes(static_cast<int64_t>(info->free)), " of ",
                    Bytes(static_cast<int64_t>(info->total)));
  }
  return out;
}

absl::Status Pool::CheckInvariants() const {
  MutexLock lock(&mu_);
  auto fail = [](auto&&... parts) {
    return absl::InternalError(absl::StrCat("pool invariant: ", parts...));
  };
  int64_t allocated = 0, active = 0, retired = 0, requested = 0, live = 0, pending_blocks = 0;
  int64_t pending_events = 0;
  for (const Arena* arena : {&small_, &large_}) {
    if (std::string err = arena->CheckInvariants(); !err.empty()) return fail(err);
    for (const Block* b = arena->head(); b != nullptr; b = b->next) {
      // Which chunks lie under the block: none for a gap, full cover otherwise.
      uintptr_t covered = b->addr;
      bool any_exported = false, all_exported = true;
      auto c = chunks_.upper_bound(b->addr);
      if (c != chunks_.begin() && std::prev(c)->first + std::prev(c)->second.size > b->addr) --c;
      for (; c != chunks_.end() && c->first < b->end(); ++c) {
        if (b->state == BlockState::kUnmapped) {
          return fail("chunk at ", absl::Hex(c->first), " inside a gap");
        }
        if (c->first > covered) return fail("unbacked bytes at ", absl::Hex(covered));
        covered = c->first + c->second.size;
        any_exported |= c->second.exported;
        all_exported &= c->second.exported;
      }
      if (b->state != BlockState::kUnmapped && covered < b->end()) {
        return fail("unbacked bytes at ", absl::Hex(covered));
      }
      switch (b->state) {
        case BlockState::kFree:
          if (any_exported) return fail("cached block ", absl::Hex(b->addr), " in exported chunk");
          break;
        case BlockState::kRetired:
          if (!all_exported) return fail("retired block ", absl::Hex(b->addr), " outside export");
          retired += static_cast<int64_t>(b->size);
          break;
        case BlockState::kAllocated: {
          if (arena->live().Find(b->addr) != b) {
            return fail("allocated block ", absl::Hex(b->addr), " missing from the index");
          }
          allocated += static_cast<int64_t>(b->size);
          active += static_cast<int64_t>(b->size);
          requested += static_cast<int64_t>(b->requested);
          ++live;
          break;
        }
        case BlockState::kPendingFree:
          if (b->pending_events <= 0) return fail("pending block without events");
          active += static_cast<int64_t>(b->size);
          pending_events += b->pending_events;
          ++pending_blocks;
          break;
        case BlockState::kUnmapped:
          break;
      }
    }
  }
  int64_t reserved = 0, exported = 0, exported_count = 0;
  for (const auto& [addr, chunk] : chunks_) {
    reserved += static_cast<int64_t>(chunk.size);
    if (chunk.exported) {
      exported += static_cast<int64_t>(chunk.size);
      ++exported_count;
    }
  }
  if (live != static_cast<int64_t>(small_.live().count() + large_.live().count())) {
    return fail("the live-block index has extras");
  }
  if (pending_events != static_cast<int64_t>(pending_.size())) return fail("pending list");
  if (allocated != stats_.allocated_bytes.current) return fail("allocated_bytes");
  if (requested != stats_.requested_bytes.current) return fail("requested_bytes");
  if (active != stats_.allocated_bytes.current + pending_bytes_) return fail("active_bytes");
  if (live != stats_.allocation.current) return fail("allocation count");
  if (pending_blocks != pending_blocks_) return fail("pending block count");
  if (reserved != stats_.reserved_bytes.current) return fail("reserved_bytes");
  if (static_cast<int64_t>(chunks_.size()) != stats_.segment.current) return fail("segments");
  if (exported != stats_.exported_bytes.current) return fail("exported_bytes");
  if (exported_count != exported_chunks_) return fail("exported chunk count");
  if (retired != retired_bytes_) return fail("retired bytes");
  return absl::OkStatus();
}

}  // namespace vmm
