#include "allocator/capture_window.h"
#include "allocator/pool.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <utility>

#include "absl/base/attributes.h"
#include "absl/base/optimization.h"
#include "absl/container/inlined_vector.h"
#include "absl/strings/str_cat.h"
#include "allocator/byte_size.h"
#include "allocator/growth_policy.h"
#include "allocator/handle_probe.h"
#include "allocator/log.h"
#include "allocator/reclaim_policy.h"
#include "allocator/status_macros.h"

namespace vmm {
namespace {

// Every block is a multiple of this, and so aligned to it.
constexpr size_t kMinBlock = 512;

inline size_t RoundUp(size_t n, size_t multiple) {
  return (n + multiple - 1) / multiple * multiple;
}

// Pool::ThreadGrowths: the calling thread's allocations that grew a pool.
thread_local uint64_t thread_growths = 0;

}  // namespace

uint64_t Pool::ThreadGrowths() { return thread_growths; }

namespace {

// FormatBytes of a request, which may be past what int64_t holds.
std::string RequestBytes(size_t size) {
  return size <= static_cast<size_t>(std::numeric_limits<int64_t>::max())
             ? FormatBytes(static_cast<int64_t>(size))
             : std::string("over 8 EiB");
}

}  // namespace

absl::Status CheckRequestSize(size_t size) {
  if (size < kMaxRequestBytes) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "requested ", size, " bytes (", RequestBytes(size), "), more than any device holds (",
      FormatBytes(kMaxRequestBytes), ", the whole address space)"));
}

absl::StatusOr<std::unique_ptr<Pool>> Pool::Create(Driver* driver, const PoolOptions& options,
                                                    ExportObserver* observer) {
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
  const bool exportable = observer != nullptr;
  VMM_RETURN_IF_ERROR(CheckPoolOptions(options, exportable));
  const PoolOptions resolved = ResolveAutoSizes(options, exportable);
  std::unique_ptr<Pool> pool(new Pool(driver, resolved, observer));
  VMM_RETURN_IF_ERROR(pool->Init());
  return pool;
}

namespace {
std::atomic<uint64_t> next_pool_id{1};
}  // namespace

Pool::Pool(Driver* driver, const PoolOptions& options, ExportObserver* observer)
    : driver_(driver),
      observer_(observer),
      id_(next_pool_id.fetch_add(1)),
      fork_generation_(ForkGeneration()),
      options_(options) {}

absl::StatusOr<Pool::RangeLayout> Pool::LayOutRange(size_t basis, size_t extra,
                                                    size_t small_floor) const {
  RangeLayout layout;
  // The large arena takes the basis and the extra but an eighth of the basis; the small arena
  // that eighth, or `small_floor`, and at least one small chunk.
  const size_t eighth = RoundUp(basis / 8, granularity_);
  layout.small = std::max({options_.small_chunk, eighth, RoundUp(small_floor, granularity_)});
  // Sizes that would leave an arena unable to serve what it is sent (pool_options.h): every
  // such request failed as out of memory ("no gap") on an empty device. A small chunk of more
  // than half the range (both rounded up to granules) makes the small arena larger than the
  // large one, which serves every request above small_size (a small_chunk past the whole range
  // left it one granule); a request of up to small_size must fit the small arena's range.
  // Judged by the basis, so that what is accepted does not depend on the extra range the
  // driver grants.
  const size_t small_chunk_bound = RoundUp(RoundUp(basis, granularity_) / 2, granularity_);
  if (options_.small_chunk > small_chunk_bound) {
    return absl::InvalidArgumentError(absl::StrCat(
        "small_chunk ", options_.small_chunk, " is more than half of the pool's reserved range, ",
        small_chunk_bound, " bytes (", FormatBytes(small_chunk_bound),
        ", rounded up to the granularity; by default twice the memory of its GPU): the large ",
        "arena would be left smaller than the small one"));
  }
  const size_t small_bound = std::max(options_.small_chunk, eighth);  // small_floor aside
  if (options_.small_size > small_bound) {
    return absl::InvalidArgumentError(absl::StrCat(
        "small_size ", options_.small_size, " is more than the small arena's least range, ",
        small_bound, " bytes (", FormatBytes(small_bound),
        ": an eighth of the reserved range, by default of twice the memory of its GPU, at least ",
        "small_chunk): requests up to small_size go to the small arena, and larger ones might ",
        "never be served there"));
  }
  const size_t whole = basis + extra;  // at most 2^49 (Init)
  layout.size = layout.small + std::max(granularity_, RoundUp(whole - std::min(whole, small_bound),
                                                               granularity_));
  return layout;
}

absl::Status Pool::Init() {
  const int device = options_.device;
  VMM_ASSIGN_OR_RETURN(granularity_, driver_->Granularity(device));
  VMM_ASSIGN_OR_RETURN(device_uuid_, driver_->DeviceUuid(device));
  VMM_ASSIGN_OR_RETURN(handle_type_,
                       ResolveHandleType(*driver_, device, granularity_, options_.handle_type));
  options_.max_chunk = std::max(granularity_, options_.max_chunk / granularity_ * granularity_);
  options_.small_chunk = RoundUp(options_.small_chunk, granularity_);
  // A threshold past what a signed byte count holds keeps everything, as SIZE_MAX does (the
  // trims compare it with signed counts, where it would read as negative: release all).
  if (options_.release_threshold > static_cast<size_t>(INT64_MAX)) {
    options_.release_threshold = SIZE_MAX;
  }
  // By default a pool without pages switches to pages of kAutoPressurePage, at most
  // max_chunk; one with pages has none to switch to (pool_options.h pressure_page).
  if (options_.pressure_page == kAutoSize) {
    options_.pressure_page =
        options_.large_page == 0 ? std::min(kAutoPressurePage, options_.max_chunk) : 0;
  }
  if (options_.large_page != 0) options_.pressure_page = 0;
  // Create compared the values given; rounded (pages up, max_chunk down) a page may still
  // pass max_chunk: 3 MiB each is a 4 MiB page and a 2 MiB max_chunk at 2 MiB granules.
  using NamedPage = std::pair<const char*, size_t*>;
  for (auto [name, page] : {NamedPage{"large_page", &options_.large_page},
                            NamedPage{"pressure_page", &options_.pressure_page}}) {
    *page = RoundUp(*page, granularity_);
    if (*page > options_.max_chunk) {
      return absl::InvalidArgumentError(absl::StrCat(
          name, " ", *page, " is larger than max_chunk ", options_.max_chunk,
          " once both are rounded to the granularity of ", granularity_, " bytes (", name,
          " up, max_chunk down): a page is one physical chunk"));
    }
  }
  // Whole pages, at least one and at most what max_chunk holds; by default 32 MiB (at least a
  // page), or one page for a pool made to export (pool_options.h). Nothing without pages.
  if (options_.large_page == 0) {
    options_.growth_page = 0;
    options_.growth_page_from = 0;
  } else {
    const size_t page = options_.large_page;  // at most 2^48 (Create)
    if (options_.growth_page == kAutoSize) {
      options_.growth_page = observer_ ? page : std::max(page, kAutoGrowthPage);
    }
    options_.growth_page =
        std::clamp(options_.growth_page, page, std::max(page, options_.max_chunk)) / page * page;
    if (options_.growth_page_from == kAutoSize) {
      // growth_page may be as large as max_chunk, which is not bounded: no wrap.
      options_.growth_page_from = options_.growth_page > SIZE_MAX / kMultiPageRequestChunks
                                      ? SIZE_MAX
                                      : kMultiPageRequestChunks * options_.growth_page;
    }
  }
  VMM_ASSIGN_OR_RETURN(MemInfo info, driver_->GetMemInfo(device));
  // By default kPagedRangeDevices times the memory of the device where the large arena moves
  // pages or may come to (pressure_page), else twice (pool_options.h reserve_size): the
  // arenas' sizes and the option bounds are those of twice (the basis), the rest goes to the
  // large arena, and where the driver or the process's address space refuses that much (out
  // of memory, or a size it takes for invalid), kPagedRangeFallbackDevices times, then twice.
  // Each figure at most kMaxOptionBytes (a device of more than 2^43 bytes would take the
  // multiple past what any address range holds).
  auto times_memory = [&](size_t k) {
    return info.total > kMaxOptionBytes / k ? kMaxOptionBytes : k * info.total;
  };
  const bool auto_range = options_.reserve_size == 0;
  const size_t basis = auto_range ? times_memory(2) : options_.reserve_size;
  // The extra range for the large arena, widest first (0: the basis alone).
  absl::InlinedVector<size_t, 3> extras;
  if (auto_range && (options_.large_page != 0 || options_.pressure_page != 0)) {
    for (size_t k : {kPagedRangeDevices, kPagedRangeFallbackDevices}) {
      const size_t wide = times_memory(k);
      extras.push_back(wide - std::min(wide, basis));
    }
  }
  extras.push_back(0);
  // A default range (or one that grows) gives the small arena the memory of its GPU: every
  // small chunk the GPU could hold fits it, wherever its live blocks keep chunks, so with
  // small chunks of one granule (the default) it cannot fill while memory is left. It was an
  // eighth of twice the memory, a quarter, and a program whose blocks of up to small_size
  // held more failed with "no gap" on a GPU three quarters free. A range that grows
  // lengthens only the large arena, at the range's end (ExtendRange). Not for a device of
  // more than 2^44 bytes, whose range is capped at kMaxOptionBytes already.
  const size_t small_floor =
      (auto_range || options_.range_grows) && info.total <= kMaxOptionBytes / 16 ? info.total : 0;
  // What to ask the driver for, first to last.
  struct Ask {
    size_t basis;
    size_t extra;
    size_t small_floor;
  };
  absl::InlinedVector<Ask, 6> asks;
  for (size_t extra : extras) asks.push_back(Ask{basis, extra, small_floor});
  if (auto_range || options_.range_grows) {
    // A range that grows where it fills (ExtendRange) may start smaller where the process's
    // address space is short (many pools: the plugin's private pools, a CUDA graph each, at
    // 2.75 times the GPU's memory apiece): an eighth, then a sixty-fourth, of what it asked.
    for (size_t div : {size_t{8}, size_t{64}}) {
      const size_t smaller = RoundUp(basis / div, granularity_);
      if (smaller >= kLeastGrowingRange) {
        asks.push_back(Ask{smaller, 0, RoundUp(small_floor / div, granularity_)});
      }
    }
  }
  RangeLayout layout;
  absl::StatusOr<DevPtr> base = absl::InternalError("no range asked for");
  for (size_t i = 0; i < asks.size(); ++i) {
    absl::StatusOr<RangeLayout> asked = LayOutRange(asks[i].basis, asks[i].extra,
                                                    asks[i].small_floor);
    // The options' bounds are judged by the first basis: they fail first. A smaller range
    // they do not fit is not asked for; the refusal before it stands.
    if (i == 0 || asks[i].basis == basis) VMM_RETURN_IF_ERROR(asked.status());
    if (!asked.ok()) break;
    absl::StatusOr<DevPtr> got = driver_->Reserve(asked->size, granularity_);
    if (i > 0 && got.ok()) {
      LogWarningOnce("wide-range",
                     absl::StrCat("reserving ", FormatBytes(layout.size),
                                  " of address space failed (", base.status().message(),
                                  "); the pool reserved ", FormatBytes(asked->size)));
    }
    layout = *asked;
    base = std::move(got);
    const bool refused =
        absl::IsResourceExhausted(base.status()) || absl::IsInvalidArgument(base.status());
    if (base.ok() || !refused) break;
  }
  VMM_RETURN_IF_ERROR(base.status());
  const size_t small = layout.small;
  const bool grows = auto_range || options_.range_grows;
  // A range that grows serves up to the GPU's memory past its first size (ExtendRange),
  // as far as the most address space it may reach; one that does not, what its large arena
  // holds (requests up to small_size fit the small arena, which is at least that long).
  max_request_ = grows ? std::min(info.total, kMaxOptionBytes - std::min(kMaxOptionBytes, small))
                       : std::min(std::max(layout.size - small, options_.small_size), info.total);
  range_bounds_requests_ = !grows && max_request_ < info.total;
  device_total_ = info.total;
  base_ = static_cast<uintptr_t>(*base);
  range_end_.store(base_ + layout.size, std::memory_order_release);
  // Allocated blocks of the large arena are larger than small_size, or alone in a chunk, so
  // they start at least this far apart (a power of two, at least 512).
  int large_shift = 9;
  while ((size_t{2} << large_shift) <= std::min(options_.small_size + 1, granularity_)) {
    ++large_shift;
  }
  ChunkMap::Config chunks;
  chunks.driver = driver_;
  chunks.device = device;
  chunks.handle_bits = HandleTypeBit(handle_type_);
  chunks.max_chunk = options_.max_chunk;
  chunks.access.push_back(device);
  for (int peer : options_.peer_devices) chunks.access.push_back(peer);
  chunks.large_base = base_ + small;
  MutexLock lock(&mu_);
  page_ = options_.large_page;
  reserve_size_ = layout.size;
  reservations_.emplace_back(base_, reserve_size_);
  range_grows_ = grows;
  range_step_ = reserve_size_ - small;
  chunks_.Init(std::move(chunks));
  reclaim_.Init(driver_, device);
  small_.Init(base_, small, /*slot_shift=*/9);
  large_.Init(base_ + small, reserve_size_ - small, large_shift);
  large_base_ = base_ + small;
  memory_limit_ = options_.memory_limit;
  return absl::OkStatus();
}

Pool::~Pool() {
  MutexLock lock(&mu_);
  absl::Status sync = SynchronizeDevices();
  if (!sync.ok()) LogError(absl::StrCat("pool teardown: ", sync.message()));
  if (const size_t live = small_.live().count() + large_.live().count(); live > 0) {
    LogWarning(absl::StrCat("pool on device ", options_.device, " destroyed with ", live,
                            " live block(s); their memory is released"));
  }
  if (device_cap_ != nullptr) device_cap_->allocated().Add(-stats_.allocated_bytes.current);
  chunks_.ReleaseAll([&](const Chunk& chunk) {
    if (chunk.exported && observer_ != nullptr) observer_->ChunkReleased(id_, chunk.id);
  });
  reclaim_.DestroyEvents();
  if (observer_ != nullptr) observer_->PoolDestroyed(id_);
  for (const auto& [at, size] : reservations_) {
    absl::Status s = driver_->Unreserve(at, size);
    if (!s.ok()) LogError(absl::StrCat("pool teardown: ", s.message()));
  }
}

absl::Status Pool::ExtendRange(size_t n) {
  const size_t step =
      std::max(range_step_, RoundUp(n, std::max(granularity_, page_)));
  const uintptr_t at = base_ + reserve_size_;
  if (step > kMaxOptionBytes || reserve_size_ > kMaxOptionBytes - step || at + step < at) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the range would pass ", FormatBytes(kMaxOptionBytes), " of address space"));
  }
  VMM_ASSIGN_OR_RETURN(DevPtr got, driver_->ReserveAt(at, step));
  if (got != at) {  // a driver that ignored the address: give it back
    absl::Status freed = driver_->Unreserve(got, step);
    if (!freed.ok()) LogError(absl::StrCat("giving back a misplaced range: ", freed.message()));
    return absl::ResourceExhaustedError(
        absl::StrCat("the driver reserved ", absl::Hex(got), " instead of ", absl::Hex(at)));
  }
  reservations_.emplace_back(at, step);
  large_.ExtendRange(step);
  chunks_.AddSeam(at);
  reserve_size_ += step;
  range_end_.store(base_ + reserve_size_, std::memory_order_release);
  ++stats_.num_range_extensions;
  return absl::OkStatus();
}

// Both pick an arena by table lookup rather than a branch: sizes and addresses come in no
// predictable order, and a mispredicted branch costs more than the whole lookup.
Arena& Pool::ArenaFor(size_t rounded) { return *arenas_[rounded > options_.small_size]; }

size_t Pool::SpillSize() const { return RoundUp(options_.small_size + 1, kMinBlock); }

Arena& Pool::ArenaOf(uintptr_t addr) { return *arenas_[addr >= large_base_]; }

Block* Pool::LiveBlock(const void* ptr) {
  const auto addr = reinterpret_cast<uintptr_t>(ptr);
  return ArenaOf(addr).live().Find(addr);
}

absl::StatusOr<Block*> Pool::LiveBlockFor(const void* ptr, const char* what) {
  Block* block = LiveBlock(ptr);
  if (block != nullptr) return block;
  return absl::InvalidArgumentError(
      absl::StrCat(what, " of ", absl::Hex(reinterpret_cast<uintptr_t>(ptr)),
                   ", which is not the start of a live block of this pool"));
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
  if (device_cap_ != nullptr) device_cap_->allocated().Add(bytes);
  ArenaStats& split = stats_.arena[&arena == &large_ ? kLargeArena : kSmallArena];
  split.allocated_bytes.Increase(bytes);
  split.requested_bytes.Increase(static_cast<int64_t>(requested));
  split.allocation.Increase(1);
}

ABSL_ATTRIBUTE_ALWAYS_INLINE inline void Pool::Cache(Arena& arena, Block* block) {
  arena.AddFree(block, block->stream, ++free_seq_);
}

absl::StatusOr<void*> Pool::Allocate(size_t size, Stream stream) {
  MutexLock lock(&mu_);
  // The cached path: a fit in the cache, nothing pending, and this is the process that made
  // the pool (AllocateLocked says why not, after a fork()); not in a no_split pool, whose
  // blocks are taken whole.
  if (ABSL_PREDICT_TRUE(!reclaim_.has_pending() && size <= reserve_size_ &&
                        !made_before_fork() && !no_split_)) {
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
  // A pool belongs to the process that made it (fork_guard.h).
  if (ABSL_PREDICT_FALSE(made_before_fork())) return ForkedError("pool");
  // Before anything is reclaimed, trimmed or mapped: no freeing would make room for it.
  if (size > max_request_) {
    ++stats_.num_ooms;  // no memory for it, ever (pool.h)
    VMM_RETURN_IF_ERROR(CheckRequestSize(size));
    if (range_bounds_requests_ && size <= device_total_) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "out of memory: requested ", size, " bytes (", RequestBytes(size), ") on ",
          driver_->Name(), " device ", options_.device, ", more than the pool's address range ",
          "holds (", FormatBytes(max_request_), "), which does not grow; ", Summary()));
    }
    const size_t device_bound = range_bounds_requests_ ? device_total_ : max_request_;
    return absl::InvalidArgumentError(absl::StrCat(
        "requested ", size, " bytes (", RequestBytes(size),
        "), more than the whole memory of the device (", FormatBytes(device_bound), ")"));
  }
  size_t n = RoundUp(std::max<size_t>(size, 1), kMinBlock);  // larger if it spills, below
  if (reclaim_.fences() > 0) {
    // A free whose stream took no event and could not be synchronised waits on a fence that
    // only a synchronisation of the devices completes (FreeInUse): try again now, rather than
    // leave its memory pending and the cached path closed until EmptyCache. Not while a graph
    // is captured (capture_window.h): the synchronisation would invalidate it.
    const WorkOutsideCapture syncing(/*wanted=*/true);
    if (absl::Status synced = syncing.entered() ? SynchronizeAll() : absl::OkStatus();
        !synced.ok()) {
      LogWarningOnce("fence-sync",
                     absl::StrCat("a free still waits for a device: ", synced.message()));
    }
  }
  if (reclaim_.has_pending()) VMM_RETURN_IF_ERROR(ProcessPending());
  // Blocks with chunks of their own (shareable; every block of a no_split pool) are in the
  // large arena.
  Arena* arena = shareable || no_split_ ? &large_ : &ArenaFor(n);
  // A spare chunk serves a request it fits closely (an eighth of it, or a granule, left), and
  // any it fits once the spare chunks pass what the pool keeps of them (below).
  size_t spare_slack = std::max(n / 8, granularity_);
  // What the spare chunks and this request's bytes hold beyond twice the most the pool has
  // had allocated (0: within it). Past it, idle spare chunks serve requests they do not fit
  // closely, or go back before a send grows: a stream of sends of varying sizes, each spare
  // chunk waiting for a send of its own size, grew reserved memory without bound.
  auto spare_past_high = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) -> size_t {
    const size_t high = static_cast<size_t>(
        std::max<int64_t>(std::max(allocated_high_, stats_.allocated_bytes.peak), 0));
    const size_t kept = spare_.bytes() + n;
    return kept / 2 > high ? kept - 2 * high : 0;
  };
  // A no_split pool's blocks are taken whole: one much larger than the request would keep
  // the rest from every other (PyTorch keeps small requests to small segments), so a block
  // past an eighth over the request rounded to the granularity serves it only once memory is
  // short (the retry below).
  auto whole_fit = [&](Block* b) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) -> Block* {
    if (b == nullptr || !no_split_ || shareable) return b;
    const size_t chunk = RoundUp(n, granularity_);
    return b->size <= chunk + chunk / 8 ? b : nullptr;
  };
  Block* block = shareable ? TakeSpareChunk(n, spare_slack, stream, /*for_send=*/true)
                           : whole_fit(arena->BestFit(stream, n));
  bool reopened_spare = false;  // a spare chunk taken as plain memory
  bool grew = false;            // the block comes from a growth (Grow)
  const size_t small_n = n;     // what the small arena would give a request it spills (below)
  bool spilled = false;
  // The cached block that fits once blocks every stream may use have joined this stream's
  // neighbouring blocks. Shareable blocks keep chunks of their own, never cached space.
  auto cached_fit = [&](bool any_size = false) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) -> Block* {
    if (shareable) return nullptr;
    arena->NarrowAnyTo(stream);
    Block* b = arena->BestFit(stream, n);
    return any_size ? b : whole_fit(b);
  };
  // A small request spills into the large arena, as a block just past small_size (the large
  // arena's least; pool.h): where the small arena's range is full (a range given in the
  // options, a private pool's that does not grow, one cut where the address space was short),
  // or, below, where it is out of memory and a cached large block holds the request.
  auto spill = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    arena = &large_;
    n = SpillSize();
    spare_slack = std::max(n / 8, granularity_);
    spilled = true;
  };
  // A spilled request goes back to the small arena where that holds it after all: a block
  // other streams freed, now known complete, or a gap a release left.
  auto back_to_small = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    arena = &small_;
    n = small_n;
    spare_slack = std::max(n / 8, granularity_);
    spilled = false;
  };
  auto small_fit_after_all = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    small_.NarrowAnyTo(stream);
    if (small_.BestFit(stream, small_n) != nullptr) back_to_small();
  };
  if (block == nullptr && arena == &small_ && !shareable &&
      !small_.HasGrowthRoomFor(n, stream, granularity_)) {
    // At once, before other streams' blocks are reclaimed: a spill this stream freed is
    // reused as the cached path reuses any block (a spill that first reclaimed other streams'
    // frees merged its own with theirs, and two streams taking turns grew the pool at every
    // other turn), and a fragmented small arena is not searched again at every spill.
    spill();
    block = arena->BestFit(stream, n);
  }
  if (block == nullptr && !shareable) {
    // Blocks other streams freed may be done with (for a spill, in the small arena too: the
    // reclaim only adds room, so a request that did not spill above needs no second look).
    VMM_RETURN_IF_ERROR(ReclaimOtherStreams(stream));
    if (spilled) small_fit_after_all();
    block = cached_fit();
    if (block == nullptr && arena == &large_ && !spare_.empty() && !no_split_) {
      // Memory a send left behind, before growing (file comment, "Reusing exported chunks"):
      // one it fills closely, else, past what the pool keeps, the smallest it fits (its rest
      // free memory).
      const size_t slack = spare_past_high() > 0 ? SIZE_MAX : spare_slack;
      block = TakeSpareChunk(n, slack, stream, /*for_send=*/false);
      reopened_spare = block != nullptr;
    }
  }
  if (block == nullptr && shareable && !spare_.empty() && !keep_memory_) {
    // A send that no spare chunk fits closely grows a chunk of its own; past what the pool
    // keeps, the oldest spare chunks go back first. Not during a capture (the unmaps are kept
    // out of it, capture_window.h). A trim that fails leaves the growth to go on.
    if (const size_t excess = spare_past_high(); excess > 0) {
      const WorkOutsideCapture releasing(/*wanted=*/true);
      if (releasing.entered()) {
        if (absl::Status trimmed = ReleaseSpareChunks(excess); !trimmed.ok()) {
          LogWarningOnce("spare-trim", absl::StrCat("releasing spare exported chunks before a "
                                                    "send grows: ", trimmed.message()));
        }
      }
    }
  }
  if (block == nullptr) {
    absl::StatusOr<Block*> grown = Grow(*arena, n, stream, shareable);
    bool capturing = false;
    if (!grown.ok() && absl::IsResourceExhausted(grown.status())) {
      // Not while a capture is under way: the synchronisation and the unmaps would invalidate
      // it (capture_window.h); the request fails instead, as with PyTorch's allocator. A
      // window that opens meanwhile waits for the retry.
      const WorkOutsideCapture retry(/*wanted=*/true);
      capturing = !retry.entered();
      if (!capturing) {
        // Trim everything that is free, then try once more. Memory is tight: from now on
        // paged growth is in single pages, which strand the least (GrowthChunk).
        short_of_memory_ = true;
        ++stats_.num_alloc_retries;
        VMM_RETURN_IF_ERROR(SynchronizeAndRetag());
        // The synchronisation made every stream's cached blocks usable by this one: one may
        // fit the request as it lies, taken as the cached path would (before the release
        // below, which would unmap its whole chunks only for the growth to make them again);
        // after the release, what is left of them (in chunks that hold live blocks) may. A
        // growth would not find it: a plan beside a free block that already holds the request
        // has nothing to map, and is none (Arena::PlanGrowth).
        if (spilled) small_fit_after_all();
        Block* cached = cached_fit(/*any_size=*/true);
        if (cached == nullptr) {
          VMM_RETURN_IF_ERROR(ReleaseKeptExports());
          VMM_RETURN_IF_ERROR(ReleaseFreeChunks(/*any_stream=*/true, SIZE_MAX));
          if (spilled && small_.HasGrowthRoomFor(small_n, stream, granularity_)) back_to_small();
          cached = cached_fit(/*any_size=*/true);
        }
        if (cached != nullptr) {
          grown = cached;
        } else {
          grown = Grow(*arena, n, stream, shareable, /*to_granularity=*/true);
        }
      }
    }
    if (!grown.ok() && absl::IsResourceExhausted(grown.status()) && arena == &small_ &&
        !shareable) {
      // Short of memory rather than of range: a cached block of the large arena this stream
      // may use may still hold the request as a spill (after the retry, what the release left
      // in chunks that hold live blocks; during a capture, or in a pool that keeps its
      // memory, whatever is cached).
      large_.NarrowAnyTo(stream);
      if (Block* cached = large_.BestFit(stream, SpillSize()); cached != nullptr) {
        spill();
        grown = cached;
      }
    }
    if (!grown.ok()) {
      if (!absl::IsResourceExhausted(grown.status())) return grown.status();
      ++stats_.num_ooms;
      return absl::ResourceExhaustedError(absl::StrCat(
          "out of memory: requested ", size, " bytes (", FormatBytes(size), ") on ",
          driver_->Name(), " device ", options_.device, ": ", grown.status().message(),
          spilled ? absl::StrCat(" (the small arena's range is full: the large arena was asked "
                                 "for a block of ", FormatBytes(n), ")")
                  : "",
          capturing ? " (no cached memory is released while a CUDA graph capture is under way)"
                    : "",
          "; ", Summary()));
    }
    block = *grown;
    grew = true;
    ++thread_growths;
  }
  if (spilled) ++stats_.num_small_spills;
  TakeBlock(*arena, block, no_split_ && !shareable ? block->size : n, size, stream);
  // A block that does not fill the chunks of several pages it was grown in (a request that is
  // not a whole number of granules, one that joined a free neighbour) leaves their rest
  // pinned at once (pool.h pinned_in_chunks_).
  if (grew && made_several_pages_ && !pinned_in_chunks_ && arena == &large_ &&
      PinnedBytes(chunks_, block, page_) != 0) {
    pinned_in_chunks_ = true;
  }
  // Active (allocated + pending) peaks here; the cached path runs only with none pending.
  if (pending_.blocks > 0) NoteActivePeak();
  if (shareable && block->next != nullptr && block->next->state == BlockState::kFree &&
      chunks_.OverlapsExported(block->next->addr, block->next->end())) {
    // The rest of its own chunk is never handed out.
    retired_bytes_ += static_cast<int64_t>(block->next->size);
    arena->Retire(block->next);
  } else if (reopened_spare && block->next != nullptr &&
             block->next->state == BlockState::kFree &&
             chunks_.Containing(block->next->addr) == chunks_.Containing(block->addr)) {
    // Reopen left the chunk apart from its neighbours; the rest of it is plain free memory
    // and joins a free neighbour of its tag.
    arena->Retag(block->next, block->next->stream);
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
  if (device_cap_ != nullptr) device_cap_->allocated().Add(-static_cast<int64_t>(block->size));
  ArenaStats& split = stats_.arena[&arena == &large_ ? kLargeArena : kSmallArena];
  split.allocated_bytes.Decrease(static_cast<int64_t>(block->size));
  split.requested_bytes.Decrease(static_cast<int64_t>(block->requested));
  split.allocation.Decrease(1);
  if (ABSL_PREDICT_TRUE(block->stream_uses.empty() &&
                        !chunks_.OverlapsExported(block->addr, block->end()))) {
    Cache(arena, block);
  } else if (absl::Status in_use = FreeInUse(block); !in_use.ok()) {
    // Freed all the same (pool.h): the threshold still applies.
    if (options_.release_threshold != SIZE_MAX) ApplyReleaseThreshold().IgnoreError();
    return in_use;
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
  const bool exported = chunks_.OverlapsExported(block->addr, block->end());
  std::vector<Stream> streams = std::move(block->stream_uses);
  block->stream_uses.clear();
  if (exported) streams.push_back(block->stream);
  block->state = BlockState::kPendingFree;
  CountPending(block, +1);
  if (!reclaim_.RecordUses(block, streams, stats_)) {
    // A stream took no event and could not be synchronised (gone or broken): the block waits
    // on a fence that only a synchronisation of the devices completes, so wait for them now.
    // If that fails, or a capture is under way (a synchronisation would end it), the block
    // stays pending, and the next synchronisation that succeeds (the next allocation that is
    // not served by the cached path, EmptyCache) recycles it.
    // `block` must not be touched after this.
    const WorkOutsideCapture syncing(/*wanted=*/true);
    if (!syncing.entered()) return absl::OkStatus();
    return SynchronizeAll();
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
  if (keep_memory_) return absl::OkStatus();  // it would release nothing
  // Spare chunks are cached memory too (counted as retired), and go first.
  int64_t cached = stats_.reserved_bytes.current - stats_.allocated_bytes.current -
                   pending_.bytes - retired_bytes_ + static_cast<int64_t>(spare_.bytes());
  if (cached <= static_cast<int64_t>(options_.release_threshold)) return absl::OkStatus();
  // Its event queries would invalidate a capture under way (capture_window.h), and its unmaps
  // are kept out of captures too; a later free trims. A
  // window that opens meanwhile waits for the trim.
  const WorkOutsideCapture trimming(/*wanted=*/true);
  if (!trimming.entered()) return absl::OkStatus();
  const size_t spare_before = spare_.bytes();
  VMM_RETURN_IF_ERROR(
      ReleaseSpareChunks(static_cast<size_t>(cached) - options_.release_threshold));
  cached -= static_cast<int64_t>(spare_before - spare_.bytes());
  if (cached <= static_cast<int64_t>(options_.release_threshold)) return absl::OkStatus();
  VMM_RETURN_IF_ERROR(ReclaimOtherStreams());
  return ReleaseFreeChunks(/*any_stream=*/false,
                           static_cast<size_t>(cached) - options_.release_threshold);
}

void Pool::Recycle(Block* block) {
  if (block->state == BlockState::kPendingFree) CountPending(block, -1);
  Arena& arena = ArenaOf(block->addr);
  if (!chunks_.OverlapsExported(block->addr, block->end())) {
    Cache(arena, block);
    return;
  }
  const Stream tag = block->stream;
  // Split along chunk boundaries: parts in exported chunks retire, the rest is cached.
  const uintptr_t start = block->addr;
  const uintptr_t end = block->end();
  for (Block* piece = block; piece != nullptr;) {
    auto chunk = chunks_.Containing(piece->addr);
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
  if (StreamHandle(stream) != StreamHandle(block->stream) &&
      std::find(block->stream_uses.begin(), block->stream_uses.end(), stream) ==
          block->stream_uses.end()) {
    block->stream_uses.push_back(stream);
  }
  return absl::OkStatus();
}

bool Pool::SmallArenaSurplus() const {
  // Cached bytes only: pending and retired blocks are neither allocated nor free to take.
  const int64_t free = small_.free_blocks().byte_stat().current;
  return free >= kSmallSurplusChunks * static_cast<int64_t>(options_.small_chunk) &&
         free >= stats_.arena[kSmallArena].allocated_bytes.current;
}

absl::StatusOr<Block*> Pool::Grow(Arena& arena, size_t n, Stream stream, bool dedicated,
                                  bool to_granularity) {
  // The large arena grows in chunks of whole pages (large_page; several pages until the first
  // move, GrowthChunk), planned in half pages (growth_policy.h PlanUnit: the last chunk may be
  // half a page), which a later miss may move (reclaim_policy.h); blocks with chunks of their
  // own keep one chunk of up to max_chunk. Where the large arena grows in pages, a growth of
  // either arena may move free chunks of both (reclaim_policy.h).
  // A chunk of its own: for a shareable block (`dedicated`: marked exported from the start),
  // or any block of a no_split pool, there between two unmapped granules (`guard`, SetNoSplit),
  // so that no two of its blocks ever touch.
  const bool alone = dedicated || no_split_;
  const size_t guard = no_split_ ? granularity_ : 0;
  if (page_ == 0 && options_.pressure_page != 0 && !alone && &arena == &large_) {
    SwitchToPagesUnderPressure(n);
  }
  const bool paged = !alone && &arena == &large_ && page_ != 0;
  const bool moves = !alone && page_ != 0;
  bool in_units = moves;  // planned in whole units (PlanUnit, or granules in the small arena)
  // Where to grow, by what a miss could move there (reclaim_policy.h: GrowthCost).
  // Not while the pool keeps its memory, nor while a capture is under way anywhere in the
  // process: the synchronisation of the requester's stream a move may need would invalidate
  // it, and unmaps are kept out of captures too (capture_window.h). The moves are
  // background work to the capture window, so that one opening meanwhile waits for them.
  const WorkOutsideCapture moving(moves && !keep_memory_);
  const bool may_move = moving.entered();
  ReclaimRequest request;
  request.arena = &large_;
  if (may_move && SmallArenaSurplus()) request.small_arena = &small_;
  request.page = granularity_;
  request.chunks = &chunks_;
  request.requester = stream;
  // Chunks of several pages only while the blocks grown in them fill them (pool.h): a miss
  // looks for free memory pinned in one until it finds some.
  const bool watch_pinned = made_several_pages_ && !pinned_in_chunks_ && paged;
  if (watch_pinned) request.count_pinned_above = page_;
  MovableMemory movable;
  if (may_move) movable = FindMovable(request);
  if (movable.pinned != 0) pinned_in_chunks_ = true;
  // (Every new high of allocated bytes shows in the peak statistic, which only a reset of the
  // peaks lowers.)
  if (stats_.allocated_bytes.peak > allocated_high_) {
    allocated_high_ = stats_.allocated_bytes.peak;
    moved_since_high_ = 0;
  }
  const int64_t reserved = std::max<int64_t>(stats_.reserved_bytes.current, 0);
  const bool new_high = stats_.allocated_bytes.current + static_cast<int64_t>(n) > allocated_high_;
  // Settling creates rather than moves, within what the pool may still create (`room`: its
  // memory limit, its GPU's memory fraction; a plan past them would fail, and the retry
  // release the cache), and not once a growth has failed for lack of memory.
  size_t room = SIZE_MAX;
  if (memory_limit_ != 0) {
    room = memory_limit_ - std::min(memory_limit_, static_cast<size_t>(reserved));
  }
  if (device_cap_ != nullptr && device_cap_->limited()) {
    const size_t limit = device_cap_->limit();
    room = std::min(room, limit - std::min(limit, static_cast<size_t>(std::max<int64_t>(
                                                     device_cap_->held(), 0))));
  }
  const bool settle = !short_of_memory_ && !new_high &&
                      moved_since_high_ / kSettleMoves >= static_cast<size_t>(reserved);
  auto cost = [&](const Arena::GrowthPlan& p) {
    return may_move ? GrowthCost(movable, p, settle, room) : p.len;
  };
  const size_t whole_unit =
      paged && !to_granularity ? PlanUnit(page_, granularity_) : granularity_;
  size_t unit = whole_unit;
  // Near a limit the rounding to half pages can take a plan past what the pool may create
  // where the same request planned in granules fits: then that plan (its moves too).
  auto past_room = [&](const Arena::GrowthPlan& p) {
    return may_move ? cost(p) >= kPastRoom : p.len > room;
  };
  auto plan_in_units = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    unit = whole_unit;
    std::optional<Arena::GrowthPlan> p =
        arena.PlanGrowth(n + 2 * guard, stream, unit, alone, cost);
    if (p && paged && unit != granularity_ && past_room(*p)) {
      std::optional<Arena::GrowthPlan> fine =
          arena.PlanGrowth(n, stream, granularity_, alone, cost);
      if (fine && !past_room(*fine)) {
        p = fine;
        unit = granularity_;
      }
    }
    return p;
  };
  std::optional<Arena::GrowthPlan> plan = plan_in_units();
  if (!plan && paged) {
    // No gap holds the request in whole units (a small range): plan it to granularity, the
    // last chunk shorter than a unit, and move nothing for it.
    unit = granularity_;
    in_units = false;
    plan = arena.PlanGrowth(n, stream, unit, alone);
  }
  if (!plan && range_grows_ && &arena == &large_ && range_refused_.ok()) {
    // No gap holds the request at all: the range grows, and the request goes where any
    // would. A refusal stands until EmptyCache: the address space after the range is seldom
    // given back, and each miss would ask again. Errors other than a refusal are the driver's.
    absl::Status lengthened = ExtendRange(n + 2 * guard);
    if (lengthened.ok()) {
      in_units = moves;
      plan = plan_in_units();
    } else if (absl::IsResourceExhausted(lengthened)) {
      range_refused_ = lengthened;
    } else {
      return lengthened;
    }
  }
  if (!plan) {
    const std::string why =
        range_grows_ && !range_refused_.ok()
            ? absl::StrCat(" (lengthening it was refused: ", range_refused_.message(), ")")
            : "";
    return absl::ResourceExhaustedError(absl::StrCat(
        "no gap of ", FormatBytes(n + 2 * guard), " left in the pool's reserved address range",
        why));
  }
  if (guard != 0) {  // the middle of the plan: a granule stays a gap on each side
    plan->addr += guard;
    plan->len -= 2 * guard;
  }
  ReclaimChoice reclaim;
  if (may_move && in_units) {
    request.exclude_lo = plan->gap->prev;
    request.exclude_hi = plan->gap->next;
    request.needed = plan->len;
    reclaim = ChooseReclaim(request, movable);
  }
  const size_t needed = plan->len;
  const size_t moved = reclaim.bytes;
  const Arena::GrowthPlan exact = *plan;  // before Extend: the retry below maps just this
  if (!alone && moved < needed) {
    GrowthRequest growth;
    growth.small_arena = &arena == &small_;
    // The whole plan, moved bytes included: a small-arena growth comes to small_chunk with
    // them, so what moves is not created as well.
    growth.needed = needed;
    growth.reserved = static_cast<size_t>(stats_.reserved_bytes.current);
    growth.granularity = granularity_;
    growth.paged = paged;
    Arena::Extend(*plan, GrowthExtra(options_, growth) / unit * unit);
  }
  // The new bytes (if any) go after the moved pages: [addr + moved, addr + len).
  std::vector<ChunkMap::Stranded> stranded;
  auto try_map = [&](const Arena::GrowthPlan& p) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const size_t fresh = p.len - moved;
    if (fresh == 0) return absl::OkStatus();
    if (device_cap_ != nullptr && !device_cap_->Allows(fresh)) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "growing by ", FormatBytes(fresh), " would pass the memory fraction of its GPU, ",
          FormatBytes(device_cap_->limit()), " (its pools hold ",
          FormatBytes(static_cast<size_t>(std::max<int64_t>(device_cap_->held(), 0))), ")"));
    }
    if (memory_limit_ != 0 &&
        static_cast<size_t>(stats_.reserved_bytes.current) + fresh > memory_limit_) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "growing by ", FormatBytes(fresh), " would pass the pool's memory limit of ",
          FormatBytes(memory_limit_)));
    }
    return chunks_.MapRange(p.addr + moved, fresh, dedicated, stats_,
                            paged ? GrowthChunk(n, in_units, fresh) : 0, &stranded);
  };
  absl::Status mapped = try_map(*plan);
  if (!mapped.ok() && plan->len > needed && stranded.empty()) {
    // Retry with exactly what the request needs, in the same place (the moves chosen for it).
    plan = exact;
    mapped = try_map(*plan);
  }
  // Chunks a failed growth could not unmap hold memory where the arena has a gap: free
  // memory there if they can be used (the plan is spent: the growth fails).
  for (const ChunkMap::Stranded& c : stranded) PlaceStranded(c);
  VMM_RETURN_IF_ERROR(mapped);
  if (!reclaim.chunks.empty()) {
    absl::Status s = MoveChunks(reclaim, plan->addr, stream);
    if (!s.ok()) {
      // Give back what was created for this growth; the arena never saw it.
      std::vector<uintptr_t> fresh;
      for (auto c = chunks_.lower_bound(plan->addr + moved);
           c != chunks_.end() && c->first < plan->addr + plan->len; ++c) {
        fresh.push_back(c->first);
      }
      for (uintptr_t addr : fresh) {
        const size_t size = chunks_.find(addr)->second.size;
        absl::StatusOr<Chunk> released = chunks_.Release(addr, stats_);
        if (released.ok()) continue;
        // Still mapped (and granted): keep it as free memory rather than a chunk in a gap.
        LogError(absl::StrCat("rolling back a growth: ", released.status().message(),
                              "; its memory stays in the pool, free"));
        AdoptStranded(addr, size);
      }
      return s;
    }
  }
  if (plan->len > moved) ++stats_.num_device_alloc;
  moved_since_high_ += moved;
  return arena.CommitGrowth(*plan, stream, alone);
}

size_t Pool::GrowthChunk(size_t n, bool in_units, size_t fresh) {
  const size_t page = page_;
  if (options_.large_page == 0) {
    // Switched to pages under pressure (pool_options.h pressure_page): the fewest pages, in a
    // power of two, that make the request at most kPressureGrowthChunks chunks.
    size_t chunk = page;
    while ((n + chunk - 1) / chunk > kPressureGrowthChunks && chunk <= options_.max_chunk / 2) {
      chunk *= 2;
    }
    return chunk;
  }
  // A growth planned to granularity (no gap held the request in whole units) stays in pages.
  if (short_of_memory_ || pinned_in_chunks_ || !in_units || options_.growth_page <= page) {
    return page;
  }
  // Single pages for a request below growth_page_from, and once memory has moved, for one of
  // fewer than kLargeRequestChunks growth chunks (pool_options.h growth_page).
  if (n < options_.growth_page_from) return page;
  if (moved_memory_ && n / kLargeRequestChunks < options_.growth_page) return page;
  // The largest power-of-two number of pages within the request and growth_page (the last
  // chunk of the growth is what is left, a whole number of plan units: half pages). Splitting
  // that last one into powers of two too made more chunks and stranded more
  // (inference_varying 1.0080 -> 1.0094 mean peak ratio over eight seeds, host replay).
  size_t chunk = page;
  while (chunk * 2 <= std::min(n, options_.growth_page)) chunk *= 2;
  if (chunk == page) return page;  // nothing to decide: no need to ask the driver below
  // A chunk of several pages moves and is released only whole, so a small block left in one
  // keeps the rest of it: made only while the pool, grown, holds at most half of what it may.
  if (PastHalfOfAllowed(fresh)) return page;
  made_several_pages_ = true;
  return chunk;
}

bool Pool::PastHalfOfAllowed(size_t fresh) {
  const size_t reserved = static_cast<size_t>(stats_.reserved_bytes.current);
  size_t allowed = SIZE_MAX;
  if (memory_limit_ != 0) allowed = memory_limit_;
  if (device_cap_ != nullptr && device_cap_->limited()) {
    const size_t held = static_cast<size_t>(std::max<int64_t>(device_cap_->held(), 0));
    const size_t limit = device_cap_->limit();
    allowed = std::min(allowed, reserved + (limit > held ? limit - held : 0));
  }
  const size_t grown = fresh > SIZE_MAX - reserved ? SIZE_MAX : reserved + fresh;
  if (grown > allowed / 2) return true;
  // What the GPU has free last: the one figure that costs a driver call.
  if (absl::StatusOr<MemInfo> info = driver_->GetMemInfo(options_.device); info.ok()) {
    allowed = std::min(allowed, reserved + static_cast<size_t>(info->free));
  }
  return grown > allowed / 2;
}

void Pool::SwitchToPagesUnderPressure(size_t n) {
  // A pool that keeps its memory moves nothing: pages would only be more chunks.
  if (keep_memory_ || (!short_of_memory_ && !PastHalfOfAllowed(n))) return;
  page_ = options_.pressure_page;
  ++stats_.num_page_switches;
}

size_t Pool::page() const {
  MutexLock lock(&mu_);
  return page_;
}

absl::Status Pool::MoveChunks(const ReclaimChoice& reclaim, uintptr_t to, Stream stream) {
  if (reclaim.sync_requester) {
    // The requester's own free blocks: its queued work may still use them (invariant 3).
    ++stats_.num_sync_stream;
    VMM_RETURN_IF_ERROR(driver_->SynchronizeStream(stream));
  }
  std::vector<ChunkMap::Moved> moved;
  std::vector<ChunkMap::Moved> lost;  // chunks gone from where the arena has them
  std::vector<ChunkMap::Stranded> stranded;  // chunks that could not be unmapped
  absl::Status s = chunks_.Move(reclaim.chunks, to, stats_, &moved, &lost, &stranded);
  if (s.ok()) s = chunks_.GrantAccess(to, reclaim.bytes, stats_);
  if (!s.ok()) {
    // Move back what moved; a chunk that cannot go back is released.
    for (const ChunkMap::Moved& m : moved) {
      std::vector<ChunkMap::Moved> moved_back;  // m itself, once back
      std::vector<ChunkMap::Moved> gone;
      const uintptr_t at[] = {m.to};
      absl::Status back = chunks_.Move(at, m.from, stats_, &moved_back, &gone, &stranded);
      if (back.ok()) back = chunks_.GrantAccess(m.from, m.size, stats_);
      if (back.ok()) continue;
      if (gone.empty()) {
        auto c = chunks_.find(m.to);
        const bool at_destination = c != chunks_.end();
        if (!at_destination) c = chunks_.find(m.from);
        if (c != chunks_.end() && !chunks_.Release(c->first, stats_).ok()) {
          // Neither back nor released (its unmap failed): free memory where it is, if it can
          // be used there, rather than a chunk the arena does not know.
          PlaceStranded({at_destination ? m.to : m.from, m.size});
          if (!at_destination) continue;  // the arena has it where it is (or a gap now)
        }
      }
      lost.push_back(m);
    }
    for (const ChunkMap::Moved& m : lost) {
      ArenaOf(m.from).MakeGap(m.from, m.size);
      ++stats_.num_device_free;
    }
    for (const ChunkMap::Stranded& c : stranded) PlaceStranded(c);
    return s;
  }
  for (const ChunkMap::Moved& m : moved) ArenaOf(m.from).MakeGap(m.from, m.size);
  moved_memory_ = true;  // the workload churns: growth in single pages (GrowthChunk)
  stats_.num_chunk_moves += static_cast<int64_t>(moved.size());
  stats_.moved_bytes += static_cast<int64_t>(reclaim.bytes);
  return absl::OkStatus();
}

void Pool::PlaceStranded(const ChunkMap::Stranded& chunk) {
  Arena& arena = ArenaOf(chunk.addr);
  const Block* b = arena.BlockContaining(chunk.addr);
  const bool in_gap = b != nullptr && b->state == BlockState::kUnmapped;
  if (absl::Status access = chunks_.GrantAccess(chunk.addr, chunk.size, stats_); access.ok()) {
    if (in_gap) AdoptStranded(chunk.addr, chunk.size);
    LogError(absl::StrCat(FormatBytes(chunk.size), " the pool could not unmap stay in it, free, ",
                          "at ", absl::Hex(chunk.addr)));
    return;
  }
  if (!in_gap) arena.MakeGap(chunk.addr, chunk.size);
  LogError(absl::StrCat(FormatBytes(chunk.size), " at ", absl::Hex(chunk.addr),
                        " can be neither used nor unmapped"));
}

void Pool::AdoptStranded(uintptr_t addr, size_t size) {
  Arena& arena = ArenaOf(addr);
  Block* gap = arena.BlockContaining(addr);
  if (gap == nullptr || gap->state != BlockState::kUnmapped || gap->end() < addr + size) {
    LogError(absl::StrCat("a chunk at ", absl::Hex(addr), " is mapped where the pool has no gap"));
    return;
  }
  Arena::GrowthPlan range;
  range.gap = gap;
  range.addr = addr;
  range.len = size;
  arena.CommitGrowth(range, kAnyStream, /*alone=*/false);
}

absl::Status Pool::ReleaseChunks(absl::Span<const uintptr_t> addrs) {
  // Callers check keep_memory_ first; a release that got here anyway fails CheckInvariants.
  if (ABSL_PREDICT_FALSE(keep_memory_)) released_while_kept_ += static_cast<int64_t>(addrs.size());
  std::vector<std::pair<uintptr_t, Chunk>> released;
  absl::Status s = chunks_.Release(addrs, stats_, &released);
  for (const auto& [addr, chunk] : released) {
    ArenaOf(addr).MakeGap(addr, chunk.size);
    ++stats_.num_device_free;
    if (chunk.exported) retired_bytes_ -= static_cast<int64_t>(chunk.size);
    if (chunk.observed && observer_ != nullptr) observer_->ChunkReleased(id_, chunk.id);
  }
  return s;
}

absl::Status Pool::ReleaseFreeChunks(bool any_stream, size_t target) {
  if (keep_memory_) return absl::OkStatus();
  size_t released = 0;
  for (Arena* arena : {&small_, &large_}) {
    // The free blocks that may hold a whole chunk (of at least a granule), from the free bins
    // rather than a walk of every block (which made each free with caching off, or over a
    // release threshold, cost a pass over all live blocks), in address order as before.
    std::vector<const Block*> candidates;
    auto add = [&](const Block* b) {
      if (b->size >= granularity_) candidates.push_back(b);
    };
    const FreeBlocks& free = arena->free_blocks();
    if (any_stream) {
      free.ForEachStream([&](Stream s) { free.ForEachAtLeast(s, granularity_, add); });
    } else {
      free.ForEachAtLeast(kAnyStream, granularity_, add);
    }
    std::sort(candidates.begin(), candidates.end(),
              [](const Block* a, const Block* b) { return a->addr < b->addr; });
    std::vector<uintptr_t> doomed;
    for (const Block* b : candidates) {
      for (auto c = chunks_.lower_bound(b->addr);
           c != chunks_.end() && c->first + c->second.size <= b->end(); ++c) {
        doomed.push_back(c->first);
      }
    }
    size_t count = 0;  // the chunks that reach the target
    while (count < doomed.size() && released < target) {
      released += chunks_.find(doomed[count++])->second.size;
    }
    VMM_RETURN_IF_ERROR(ReleaseChunks(absl::MakeConstSpan(doomed.data(), count)));
    if (released >= target) return absl::OkStatus();
  }
  return absl::OkStatus();
}

void Pool::RetireChunkSpace(uintptr_t chunk_addr) {
  const uintptr_t chunk_end = chunk_addr + chunks_.find(chunk_addr)->second.size;
  retired_bytes_ += static_cast<int64_t>(ArenaOf(chunk_addr).RetireFree(chunk_addr, chunk_end));
}

namespace {

// Whether `b` is free space (or a block freed while other streams used it, whose events cover
// those streams, not its own) that work of its own stream, other than `exporter`, may still
// use.
bool FreedOnAnotherStream(const Block* b, Stream exporter) {
  const bool freed = b->state == BlockState::kFree || b->state == BlockState::kPendingFree;
  return freed && b->stream != kAnyStream && b->stream != exporter;
}

}  // namespace

absl::Status Pool::WaitForSpaceBeforeExport(uintptr_t addr, uintptr_t end, Stream exporter) {
  // Every chunk first exported now, all waited for before any is marked: a failed wait
  // leaves the export undone.
  absl::InlinedVector<Stream, 2> streams;
  for (auto c = std::as_const(chunks_).FirstEndingAfter(addr);
       c != chunks_.end() && c->first < end; ++c) {
    if (c->second.exported) continue;
    const uintptr_t chunk_end = c->first + c->second.size;
    for (const Block* b = ArenaOf(c->first).BlockContaining(c->first);
         b != nullptr && b->addr < chunk_end; b = b->next) {
      if (FreedOnAnotherStream(b, exporter) &&
          std::find(streams.begin(), streams.end(), b->stream) == streams.end()) {
        streams.push_back(b->stream);
      }
    }
  }
  if (streams.empty()) return absl::OkStatus();
  // A synchronisation would invalidate a capture under way (capture_window.h): then the space
  // waits for its streams as pending frees instead, and a window that opens during the
  // synchronisations below waits for them.
  const WorkOutsideCapture syncing(/*wanted=*/true);
  if (!syncing.entered()) {
    HoldSpaceForItsStreams(addr, end, exporter);
    return absl::OkStatus();
  }
  for (Stream s : streams) {
    if (IsForeignStream(s)) {  // perhaps gone (driver.h): never called on
      ++stats_.num_sync_all_streams;
      return SynchronizeDevices();
    }
    ++stats_.num_sync_stream;
    if (driver_->SynchronizeStream(s).ok()) continue;
    // Gone or broken: wait for everything instead (not SynchronizeAll: recycling pending
    // blocks here could release chunks the caller is about to export).
    ++stats_.num_sync_all_streams;
    return SynchronizeDevices();
  }
  return absl::OkStatus();
}

void Pool::HoldSpaceForItsStreams(uintptr_t addr, uintptr_t end, Stream exporter) {
  for (auto c = chunks_.FirstEndingAfter(addr); c != chunks_.end() && c->first < end; ++c) {
    if (c->second.exported) continue;
    Arena& arena = ArenaOf(c->first);
    const uintptr_t chunk_end = c->first + c->second.size;
    for (Block* b = arena.BlockContaining(c->first); b != nullptr && b->addr < chunk_end;
         b = b->next) {
      if (!FreedOnAnotherStream(b, exporter)) continue;
      if (b->state == BlockState::kFree) {
        // Only the part in this chunk: the rest stays cached.
        if (b->addr < c->first) b = arena.Split(b, c->first);
        if (b->end() > chunk_end) arena.Split(b, chunk_end);
        arena.Hold(b);
        CountHeld(b);
      }
      // An event on its own stream, recorded once the capture is over (stream_reclaim.h), or
      // a fence for a foreign stream, which the next synchronisation of the devices
      // completes; the block retires when it is done (Recycle), not with the chunk's free
      // space (RetireChunkSpace).
      reclaim_.RecordUses(b, {b->stream}, stats_);
    }
  }
}

absl::Status Pool::SynchronizeDevices() {
  VMM_RETURN_IF_ERROR(driver_->SynchronizeDevice(options_.device));
  for (int peer : options_.peer_devices) {
    VMM_RETURN_IF_ERROR(driver_->SynchronizeDevice(peer));
  }
  return absl::OkStatus();
}

absl::Status Pool::ReleaseRetiredChunks(uintptr_t addr, uintptr_t end, bool release_parked) {
  std::vector<uintptr_t> candidates;
  for (auto c = std::as_const(chunks_).FirstEndingAfter(addr);
       c != chunks_.end() && c->first < end; ++c) {
    if (c->second.exported && !c->second.spare) candidates.push_back(c->first);
  }
  std::vector<uintptr_t> doomed;
  for (uintptr_t at : candidates) {
    auto c = chunks_.find(at);
    Chunk& chunk = c->second;
    const Block* b = ArenaOf(c->first).BlockContaining(c->first);
    if (b == nullptr || b->state != BlockState::kRetired || b->addr > c->first ||
        b->end() < c->first + chunk.size) {
      continue;  // something in it is still allocated or pending
    }
    // Parking serves reuse only: a chunk of the large arena may become spare (up to
    // spare_export_bytes); one of the small arena, where sends go in place, free memory of
    // that arena again once no receiver maps it. Others go as soon as they are free.
    const bool spare_able = at >= large_base_ && chunk.size <= options_.spare_export_bytes;
    // So may one of a no_split pool's own chunks (not a shareable block's): whole, between its
    // guards, it shows no neighbour, and is that pool's free memory again.
    const bool reopenable = (at < large_base_ && !options_.isolate_sends) ||
                            (no_split_ && !chunk.dedicated);
    if (chunk.untracked || !(spare_able || reopenable)) {
      doomed.push_back(c->first);
    } else if (chunk.importers > 0) {
      if (!release_parked) continue;  // parked: receivers have not reported yet
      chunk.untracked = true;           // given up: their reports will find it gone
      doomed.push_back(c->first);
    } else if (reopenable) {  // NoReceiverLeft, by the branches above
      UnmarkChunk(c);
    } else if (chunk.size <= options_.spare_export_bytes - spare_.bytes()) {
      chunk.spare = true;
      spare_.Add(c->first, chunk.size);
      // A fresh id at once: from now on no descriptor of its sends fetches it (fds re-keyed),
      // so nobody can map it between now and its reuse.
      const uint64_t old_id = chunk.id;
      const uint64_t new_id = chunks_.Renumber(c);
      if (observer_ != nullptr) observer_->ChunkRenamed(id_, old_id, new_id);
    } else {
      doomed.push_back(c->first);
    }
  }
  // Kept memory: the doomed chunks stay retired (parked) until the pool stops keeping it.
  if (keep_memory_) return absl::OkStatus();
  return ReleaseChunks(doomed);
}

Block* Pool::TakeSpareChunk(size_t n, size_t max_slack, Stream stream, bool for_send) {
  // The smallest spare chunk that fits (of equals, the newest).
  const uintptr_t addr = spare_.TakeFit(n, max_slack);
  if (addr == 0) return nullptr;
  auto c = chunks_.find(addr);
  Chunk& chunk = c->second;
  Block* block = ArenaOf(addr).Reopen(addr, addr + chunk.size, stream);
  if (block == nullptr) {  // cannot happen: a spare chunk stays wholly retired
    spare_.Add(addr, chunk.size);
    return nullptr;
  }
  retired_bytes_ -= static_cast<int64_t>(chunk.size);
  chunk.spare = false;  // renumbered when it became spare
  // For a send it holds the shareable block alone, as a chunk AllocateShareable makes does:
  // its mark stays while that block lives (SettleExport unmarks only shared chunks).
  if (for_send) chunk.dedicated = true;
  if (!for_send) {
    // Plain memory again (nothing maps it elsewhere): its blocks take the cached paths and
    // its free space is handed out; the observer keeps its handle for a later send of it.
    chunks_.UnmarkExported(c, stats_);
    chunk.dedicated = false;
  }
  ++stats_.num_export_reuses;
  return block;
}

absl::Status Pool::ReleaseKeptExports() {
  if (keep_memory_) return absl::OkStatus();
  // Retired chunks first: one that this pass makes spare goes with the spare ones.
  VMM_RETURN_IF_ERROR(
      ReleaseRetiredChunks(base_, base_ + reserve_size_, /*release_parked=*/true));
  return ReleaseSpareChunks(SIZE_MAX);
}

absl::Status Pool::ReleaseSpareChunks(size_t target) {
  // The oldest first, until `target` bytes went.
  std::vector<uintptr_t> spare;
  for (size_t bytes = 0; !spare_.empty() && bytes < target;) {
    const auto [addr, size] = spare_.TakeOldest();
    spare.push_back(addr);
    bytes += size;
  }
  absl::Status first;
  for (uintptr_t addr : spare) {
    auto c = chunks_.find(addr);
    if (c == chunks_.end()) continue;
    c->second.spare = false;
    // Untracked: released now, or, if that fails, by a later ReleaseRetiredChunks.
    c->second.untracked = true;
    absl::Status released = ReleaseChunk(addr);
    if (!released.ok() && first.ok()) first = released;
  }
  return first;
}

void Pool::SettleExport(const std::vector<ExportedChunk>& exported, bool released) {
  MutexLock lock(&mu_);
  for (const ExportedChunk& e : exported) {
    auto c = chunks_.find(e.addr);
    if (c == chunks_.end() || c->second.id != e.id) continue;  // released or reused since
    Chunk& chunk = c->second;
    if (released) {
      if (chunk.importers > 0) --chunk.importers;
    } else {
      chunk.untracked = true;
    }
    absl::Status s = ReleaseRetiredChunks(e.addr, e.addr + chunk.size);
    if (!s.ok()) LogError(absl::StrCat("releasing exported memory: ", s.message()));
    // Not released, spare or parked: live blocks remain in it (file comment).
    c = chunks_.find(e.addr);
    if (released && c != chunks_.end() && NoReceiverLeft(c->second) && !c->second.spare &&
        !c->second.dedicated) {
      UnmarkChunk(c);
    }
  }
}

bool Pool::NoReceiverLeft(const Chunk& chunk) const {
  return chunk.exported && chunk.importers == 0 && !chunk.untracked && !options_.isolate_sends;
}

void Pool::UnmarkChunk(ChunkMap::Map::iterator c) {
  const uintptr_t lo = c->first;
  const uintptr_t hi = lo + c->second.size;
  const uint64_t old_id = c->second.id;
  const uint64_t new_id = chunks_.Renumber(c);
  if (observer_ != nullptr) observer_->ChunkRenamed(id_, old_id, new_id);
  chunks_.UnmarkExported(c, stats_);
  ++stats_.num_export_reuses;
  Arena& arena = ArenaOf(lo);
  for (Block* b = arena.BlockContaining(lo); b != nullptr && b->addr < hi;) {
    if (b->state != BlockState::kRetired) {
      b = b->next;
      continue;
    }
    // Retired neighbours merge across chunks: only this chunk's part comes back.
    if (b->addr < lo) b = arena.Split(b, lo);
    if (b->end() > hi) arena.Split(b, hi);
    retired_bytes_ -= static_cast<int64_t>(b->size);
    b = arena.AddFree(b, c->second.marked_by, ++free_seq_)->next;
  }
}

absl::Status Pool::ProcessPending(bool device_synced) {
  return reclaim_.ProcessPending(
      [this](Block* block) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { Recycle(block); }, stats_,
      device_synced);
}

absl::Status Pool::ReclaimOtherStreams(Stream requester) {
  VMM_ASSIGN_OR_RETURN(const bool reclaimed,
                       reclaim_.Reclaim(arenas_, requester, free_seq_, stats_));
  if (!reclaimed) return SynchronizeAndRetag();
  return absl::OkStatus();
}

absl::Status Pool::SynchronizeAndRetag() {
  VMM_RETURN_IF_ERROR(SynchronizeAll());
  reclaim_.RetagAll(arenas_);
  return absl::OkStatus();
}

absl::Status Pool::SynchronizeAll() {
  ++stats_.num_sync_all_streams;
  VMM_RETURN_IF_ERROR(SynchronizeDevices());
  // Every event recorded so far is complete, and so is every fence (stream_reclaim.h).
  return ProcessPending(/*device_synced=*/true);
}

absl::Status Pool::EmptyCache() {
  MutexLock lock(&mu_);
  range_refused_ = absl::OkStatus();  // the range may grow again (Grow)
  // Every mapped byte in a live block (allocated bytes drop at the free, so nothing is pending,
  // retired, spare or cached): nothing to give back, and no driver call. As PyTorch's
  // allocator, which then makes no CUDA call either: after a device-side assert it returns.
  if (stats_.reserved_bytes.current == stats_.allocated_bytes.current) return absl::OkStatus();
  // The synchronisation and the unmaps would invalidate a capture under way
  // (capture_window.h); a window that opens meanwhile waits for them.
  const WorkOutsideCapture emptying(/*wanted=*/true);
  if (!emptying.entered()) {
    LogWarningOnce("empty-cache-capture",
                   "empty_cache during a CUDA graph capture releases nothing (its device "
                   "synchronisation would invalidate the capture); call it again after the "
                   "capture");
    return absl::OkStatus();
  }
  VMM_RETURN_IF_ERROR(SynchronizeAndRetag());
  VMM_RETURN_IF_ERROR(ReleaseKeptExports());
  return ReleaseFreeChunks(/*any_stream=*/true, SIZE_MAX);
}

void Pool::ShareDeviceCap(std::shared_ptr<DeviceCap> cap) {
  MutexLock lock(&mu_);
  if (device_cap_ != nullptr || cap == nullptr) return;
  device_cap_ = std::move(cap);
  chunks_.ShareCap(device_cap_.get());
  device_cap_->AddMapped(stats_.reserved_bytes.current);
  device_cap_->allocated().Add(stats_.allocated_bytes.current);
}

void Pool::SetMappingListener(MappingListener* listener, MappingSource source) {
  MutexLock lock(&mu_);
  chunks_.SetListener(listener, source);
}

void Pool::DetachMappingListener() {
  MutexLock lock(&mu_);
  chunks_.DetachListener();
}

void Pool::SetMemoryLimit(size_t bytes) {
  MutexLock lock(&mu_);
  memory_limit_ = bytes;
}

void Pool::SetKeepMemory(bool keep) {
  MutexLock lock(&mu_);
  keep_memory_ = keep;
}

bool Pool::keeps_memory() const {
  MutexLock lock(&mu_);
  return keep_memory_;
}

absl::Status Pool::SetNoSplit() {
  MutexLock lock(&mu_);
  if (chunks_.size() != 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "no_split: the pool on device ", options_.device, " already holds memory (",
        FormatBytes(stats_.reserved_bytes.current), "); it applies to a fresh pool"));
  }
  no_split_ = true;
  return absl::OkStatus();
}

absl::Status Pool::CheckAllocateAtRange(uintptr_t addr, size_t size) {
  if (size == 0 || size % kMinBlock != 0 || addr % kMinBlock != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "allocation at ", absl::Hex(addr), " of ", size, " bytes: the address and the size must ",
        "be multiples of ", kMinBlock, " bytes, and the size positive"));
  }
  if (!Contains(reinterpret_cast<const void*>(addr)) || size > base_ + reserve_size_ - addr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "allocation at ", absl::Hex(addr), " of ", size, " bytes: outside the pool's range"));
  }
  const Arena& arena = ArenaOf(addr);
  if (size > arena.base() + arena.size() - addr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "allocation at ", absl::Hex(addr), " of ", size,
        " bytes: the range crosses from the small arena into the large one"));
  }
  if (&ArenaFor(size) != &arena) {
    return absl::InvalidArgumentError(absl::StrCat(
        "allocation at ", absl::Hex(addr), " of ", size, " bytes: a block of that size lives in ",
        "the ", &arena == &small_ ? "large" : "small", " arena (small_size is ",
        options_.small_size, "), not at that address"));
  }
  return absl::OkStatus();
}

absl::StatusOr<void*> Pool::AllocateAt(uintptr_t addr, size_t size, Stream stream) {
  if (ABSL_PREDICT_FALSE(made_before_fork())) return ForkedError("pool");
  MutexLock lock(&mu_);
  VMM_RETURN_IF_ERROR(CheckAllocateAtRange(addr, size));
  Arena& arena = ArenaOf(addr);
  const uintptr_t end = addr + size;
  // The free block holding the whole range that `stream` may take, or null. Walks the blocks
  // (a slow path: restoring a checkpoint).
  auto covering = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) -> Block* {
    Block* b = arena.BlockContaining(addr);
    const bool usable = b != nullptr && b->state == BlockState::kFree && b->end() >= end &&
                        (b->stream == stream || b->stream == kAnyStream);
    return usable ? b : nullptr;
  };
  // FailedPrecondition if anything in the range is neither free nor freed while streams still
  // use it (allocated, retired, unmapped).
  auto check_free = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) -> absl::Status {
    for (const Block* b = arena.BlockContaining(addr); b != nullptr && b->addr < end;
         b = b->next) {
      if (b->state != BlockState::kFree && b->state != BlockState::kPendingFree) {
        return absl::FailedPreconditionError(absl::StrCat(
            "allocation at ", absl::Hex(addr), " of ", size, " bytes: the pool's block at ",
            absl::Hex(b->addr), " (", b->size, " bytes) in that range is ",
            BlockStateName(b->state), ", not free memory of the pool"));
      }
    }
    return absl::OkStatus();
  };
  Block* block = covering();
  if (block == nullptr) {
    // Free space tagged for other streams, split by tags, or freed while streams still use it
    // becomes one block that any stream may take once the device is idle (a pending block in
    // an exported chunk retires instead: checked again).
    VMM_RETURN_IF_ERROR(check_free());
    {
      // Not during a capture anywhere in the process: the synchronisation would invalidate
      // it (capture_window.h); a window that opens meanwhile waits for it.
      const WorkOutsideCapture syncing(/*wanted=*/true);
      if (!syncing.entered()) {
        return absl::FailedPreconditionError(absl::StrCat(
            "allocation at ", absl::Hex(addr), " of ", size, " bytes: the range holds memory ",
            "other streams freed, which only a device synchronisation makes free, and a CUDA ",
            "graph capture is under way; try again after the capture"));
      }
      VMM_RETURN_IF_ERROR(SynchronizeAndRetag());
    }
    VMM_RETURN_IF_ERROR(check_free());
    block = covering();
    if (block == nullptr) {
      return absl::InternalError(absl::StrCat("allocation at ", absl::Hex(addr), " of ", size,
                                              " bytes: the free range did not coalesce"));
    }
  }
  if (block->addr < addr) block = arena.Split(block, addr);
  if (block->end() > end) arena.Split(block, end);
  TakeBlock(arena, block, size, size, stream);
  if (pending_.blocks > 0) NoteActivePeak();
  return reinterpret_cast<void*>(block->addr);
}

absl::StatusOr<ExportedBlock> Pool::Export(void* ptr, HandleType type, ChunkVisitor visit,
                                           ExportNeighbours neighbours, ExportUse use) {
  if (made_before_fork()) return ForkedError("pool");
  MutexLock lock(&mu_);
  const Block* block = LiveBlock(ptr);
  if (block == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("export of ", absl::Hex(reinterpret_cast<uintptr_t>(ptr)),
                     ", which is not the start of a live block of this pool"));
  }
  if (handle_type_ == HandleType::kNone) {
    return absl::FailedPreconditionError(
        "this pool's memory is not exportable (it was created with handle type none, or no "
        "handle type could be created on its device)");
  }
  if (type == HandleType::kNone) type = handle_type_;
  if (type != handle_type_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "this pool's memory is exportable as ", HandleTypeName(handle_type_), ", not as ",
        HandleTypeName(type)));
  }
  if (neighbours == ExportNeighbours::kRefuse) {
    VMM_ASSIGN_OR_RETURN(bool shares, SharesChunksLocked(block));
    if (shares) {
      return absl::FailedPreconditionError(absl::StrCat(
          "export of the block at ", absl::Hex(block->addr),
          " alone: a physical chunk it spans also holds another live block"));
    }
  }
  ExportedBlock out;
  out.handle_type = type;
  out.size = block->requested;
  auto c = chunks_.Containing(block->addr);
  out.offset = block->addr - c->first;
  VMM_RETURN_IF_ERROR(WaitForSpaceBeforeExport(block->addr, block->end(), block->stream));
  for (; c != chunks_.end() && c->first < block->end(); ++c) {
    const bool newly_marked = chunks_.MarkExported(c, stats_);
    if (newly_marked) {
      c->second.marked_by = block->stream;
      RetireChunkSpace(c->first);
    }
    // Conservative at once: if the export fails half way, some chunks may be out already.
    if (use == ExportUse::kUntracked) c->second.untracked = true;
    ExportedChunk e;
    e.newly_marked = newly_marked;
    e.id = c->second.id;
    e.addr = c->first;
    e.size = c->second.size;
    e.handle = c->second.handle;
    bool called_driver = false;
    absl::Status visited = visit(e, &called_driver);
    if (called_driver) ++stats_.driver_export;
    VMM_RETURN_IF_ERROR(visited);
    e.handle = 0;
    out.chunks.push_back(e);
  }
  if (use == ExportUse::kTracked) {
    // Counted only for a whole export: a failed one reaches no receiver that would report.
    for (const ExportedChunk& e : out.chunks) ++chunks_.find(e.addr)->second.importers;
  }
  ++stats_.num_exports;
  return out;
}

absl::StatusOr<ExportedBlock> Pool::Export(void* ptr, HandleType type,
                                           ExportNeighbours neighbours, ExportUse use) {
  return Export(
      ptr, type, [](const ExportedChunk&, bool*) { return absl::OkStatus(); }, neighbours, use);
}

namespace {

// Whether `block` holds bytes of a block that callers still use: allocated, or freed while
// other streams still use it.
bool Occupied(const Block* block) {
  return block->state == BlockState::kAllocated || block->state == BlockState::kPendingFree;
}

}  // namespace

absl::StatusOr<bool> Pool::SharesChunks(const void* ptr) {
  MutexLock lock(&mu_);
  VMM_ASSIGN_OR_RETURN(const Block* block, LiveBlockFor(ptr, "SharesChunks"));
  return SharesChunksLocked(block);
}

absl::StatusOr<bool> Pool::SharesChunksLocked(const Block* block) const {
  // Chunks between the first and the last are covered by the block alone; only those two can
  // hold others. Blocks tile the arena in address order, so the neighbours inside them are
  // next to the block in its list.
  auto first = std::as_const(chunks_).Containing(block->addr);
  auto last = std::as_const(chunks_).Containing(block->end() - 1);
  if (first == chunks_.end() || last == chunks_.end()) {
    return absl::InternalError(absl::StrCat("SharesChunks: the live block at ",
                                            absl::Hex(block->addr), " is not backed by chunks"));
  }
  const uintptr_t lo = first->first;
  const uintptr_t hi = last->first + last->second.size;
  for (const Block* b = block->prev; b != nullptr && b->end() > lo; b = b->prev) {
    if (Occupied(b)) return true;
  }
  for (const Block* b = block->next; b != nullptr && b->addr < hi; b = b->next) {
    if (Occupied(b)) return true;
  }
  return false;
}

absl::StatusOr<size_t> Pool::BlockSize(const void* ptr) {
  MutexLock lock(&mu_);
  VMM_ASSIGN_OR_RETURN(const Block* block, LiveBlockFor(ptr, "BlockSize"));
  return block->requested;
}

}  // namespace vmm
