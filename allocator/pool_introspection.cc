// pool_introspection.cc: what a pool tells about itself: statistics, snapshots, a summary for
// error messages, and the check of every bookkeeping invariant. Nothing here changes memory.
#include <algorithm>
#include <string>

#include "absl/strings/str_cat.h"
#include "allocator/byte_size.h"
#include "allocator/pool.h"

namespace vmm {

namespace {

// Active = allocated + freed blocks still used by streams (pending). It rises when a block is
// allocated, or when free space is held for its stream (`held`, since the last reset: counted
// as allocated), so its peak is allocated's peak or one recorded while blocks were pending
// (NoteActivePeak); it falls when a block is freed unused or leaves pending.
void DeriveActive(const Stat& allocated, int64_t pending, int64_t pending_at_reset,
                  int64_t held, int64_t pending_peak, Stat& active) {
  active.current = allocated.current + pending;
  active.peak = std::max(allocated.peak, pending_peak);
  active.allocated = allocated.allocated + held;
  active.freed = allocated.freed + held - (pending - pending_at_reset);
}

}  // namespace

void Pool::CountPending(const Block* block, int sign) {
  const int64_t bytes = sign * static_cast<int64_t>(block->size);
  for (Pending* p : {&pending_, &arena_pending_[ArenaKindOf(block->addr)]}) {
    p->bytes += bytes;
    p->blocks += sign;
  }
}

void Pool::CountHeld(const Block* block) {
  CountPending(block, +1);
  for (Pending* p : {&pending_, &arena_pending_[ArenaKindOf(block->addr)]}) {
    p->held_bytes += static_cast<int64_t>(block->size);
    ++p->held_blocks;
  }
  NoteActivePeak();
}

void Pool::NoteActivePeak() {
  auto note = [](const Stat& allocated_bytes, const Stat& allocation, Pending& p) {
    p.active_bytes_peak = std::max(p.active_bytes_peak, allocated_bytes.current + p.bytes);
    p.active_peak = std::max(p.active_peak, allocation.current + p.blocks);
  };
  note(stats_.allocated_bytes, stats_.allocation, pending_);
  for (int a = 0; a < kNumArenas; ++a) {
    note(stats_.arena[a].allocated_bytes, stats_.arena[a].allocation, arena_pending_[a]);
  }
}

void Pool::UpdateDerivedStats(PoolStats& stats) const {
  auto derive = [](const Pending& p, const Stat& allocated_bytes, const Stat& allocation,
                   Stat& active_bytes, Stat& active) {
    DeriveActive(allocated_bytes, p.bytes, p.bytes_at_reset,
                 p.held_bytes - p.held_bytes_at_reset, p.active_bytes_peak, active_bytes);
    DeriveActive(allocation, p.blocks, p.blocks_at_reset, p.held_blocks - p.held_blocks_at_reset,
                 p.active_peak, active);
  };
  derive(pending_, stats_.allocated_bytes, stats_.allocation, stats.active_bytes, stats.active);
  // inactive_split(_bytes): cached blocks, counted by each arena's free set as they are filed
  // (FreeBlocks); the pool's are the arenas' summed, its peak the sum of their peaks (at least
  // the true one: the cached path pays for one count only).
  stats.inactive_split = Stat{};
  stats.inactive_split_bytes = Stat{};
  size_t largest = 0;
  for (int a = 0; a < kNumArenas; ++a) {
    ArenaStats& split = stats.arena[a];
    derive(arena_pending_[a], split.allocated_bytes, split.allocation, split.active_bytes,
           split.active);
    const FreeBlocks& free = arenas_[a]->free_blocks();
    split.inactive_split = free.block_stat();
    split.inactive_split_bytes = free.byte_stat();
    AddStat(split.inactive_split, stats.inactive_split);
    AddStat(split.inactive_split_bytes, stats.inactive_split_bytes);
    largest = std::max(largest, free.Largest());
  }
  const auto free_bytes = static_cast<size_t>(stats.inactive_split_bytes.current);
  stats.largest_free_block = static_cast<int64_t>(largest);
  stats.fragmentation =
      free_bytes == 0 ? 0.0 : 1.0 - static_cast<double>(largest) / static_cast<double>(free_bytes);
}

PoolStats Pool::FreezeStats() {
  MutexLock lock(&mu_);
  if (!frozen_stats_.has_value()) {
    PoolStats stats = stats_;
    UpdateDerivedStats(stats);
    frozen_stats_ = stats;
  }
  return *frozen_stats_;
}

PoolStats Pool::GetStats() const {
  MutexLock lock(&mu_);
  if (frozen_stats_.has_value()) return *frozen_stats_;
  PoolStats stats = stats_;
  UpdateDerivedStats(stats);
  return stats;
}

void Pool::ResetPeakStats() {
  MutexLock lock(&mu_);
  if (frozen_stats_.has_value()) ResetPeaks(*frozen_stats_);
  ResetPeaks(stats_);
  auto reset = [](const Stat& allocated_bytes, const Stat& allocation, Pending& p) {
    p.active_bytes_peak = allocated_bytes.current + p.bytes;
    p.active_peak = allocation.current + p.blocks;
  };
  reset(stats_.allocated_bytes, stats_.allocation, pending_);
  for (int a = 0; a < kNumArenas; ++a) {
    ArenaStats& split = stats_.arena[a];
    reset(split.allocated_bytes, split.allocation, arena_pending_[a]);
    arenas_[a]->ResetFreeStatPeaks();
  }
}

void Pool::ResetAccumulatedStats() {
  MutexLock lock(&mu_);
  ResetAccumulated(stats_);
  if (frozen_stats_.has_value()) ResetAccumulated(*frozen_stats_);
  for (int a = 0; a < kNumArenas; ++a) arenas_[a]->ResetFreeStatAccumulated();
  for (Pending* p : {&pending_, &arena_pending_[kSmallArena], &arena_pending_[kLargeArena]}) {
    p->bytes_at_reset = p->bytes;
    p->blocks_at_reset = p->blocks;
    p->held_bytes_at_reset = p->held_bytes;
    p->held_blocks_at_reset = p->held_blocks;
  }
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
        seg->large = arena == &large_;
      }
      seg->size += b->size;
      seg->blocks.push_back(
          BlockInfo{b->addr, b->size, b->requested, b->state, ReportedStream(b->stream)});
    }
  }
  for (SegmentInfo& seg : snap.segments) {
    for (auto c = chunks_.lower_bound(seg.addr);
         c != chunks_.end() && c->first < seg.addr + seg.size; ++c) {
      seg.chunks.push_back(
          ChunkInfo{c->first, c->second.size, c->second.exported, c->second.dedicated,
                    c->second.observed});
    }
  }
  return snap;
}

std::vector<BlockInfo> Pool::LiveBlocks() const {
  MutexLock lock(&mu_);
  std::vector<BlockInfo> out;
  out.reserve(small_.live().count() + large_.live().count() +
              static_cast<size_t>(pending_.blocks));
  for (const Arena* arena : {&small_, &large_}) {  // the small arena lies below the large one
    for (const Block* b = arena->head(); b != nullptr; b = b->next) {
      if (b->state == BlockState::kAllocated || b->state == BlockState::kPendingFree) {
        out.push_back(BlockInfo{b->addr, b->size, b->requested, b->state, b->stream});
      }
    }
  }
  return out;
}

std::string Pool::Summary() const {
  PoolStats stats = stats_;
  UpdateDerivedStats(stats);
  std::string out = absl::StrCat(
      "pool: reserved ", FormatBytes(stats.reserved_bytes.current), " in ", chunks_.size(),
      " chunk(s), allocated ", FormatBytes(stats.allocated_bytes.current), " in ",
      stats.allocation.current, " block(s), cached free ",
      FormatBytes(stats.inactive_split_bytes.current), " (largest block ",
      FormatBytes(stats.largest_free_block), "), peak reserved ", FormatBytes(stats.reserved_bytes.peak));
  if (memory_limit_ != 0) absl::StrAppend(&out, ", limit ", FormatBytes(memory_limit_));
  absl::StatusOr<MemInfo> info = driver_->GetMemInfo(options_.device);
  if (info.ok()) {
    absl::StrAppend(&out, "; device free ", FormatBytes(static_cast<int64_t>(info->free)), " of ",
                    FormatBytes(static_cast<int64_t>(info->total)));
  }
  return out;
}

size_t Pool::SendBytesInUse() const {
  MutexLock lock(&mu_);
  size_t bytes = 0;
  for (const auto& [addr, chunk] : chunks_) {
    if (chunk.exported && !chunk.spare && !chunk.untracked) bytes += chunk.size;
  }
  return bytes;
}

absl::Status Pool::CheckInvariants() const {
  MutexLock lock(&mu_);
  auto fail = [](auto&&... parts) {
    return absl::InternalError(absl::StrCat("pool invariant: ", parts...));
  };
  int64_t allocated = 0, active = 0, retired = 0, requested = 0, live = 0, pending_blocks = 0;
  int64_t pending_events = 0;
  // What each arena's statistics (stats_.arena, arena_pending_) must say.
  struct ArenaTotals {
    int64_t allocated = 0, requested = 0, live = 0, pending_bytes = 0, pending_blocks = 0;
    int64_t reserved = 0, segments = 0, free_bytes = 0, free_blocks = 0;
  } by_arena[kNumArenas];
  for (const Arena* arena : {&small_, &large_}) {
    if (std::string err = arena->CheckInvariants(); !err.empty()) return fail(err);
    ArenaTotals& totals = by_arena[arena == &large_ ? kLargeArena : kSmallArena];
    for (const Block* b = arena->head(); b != nullptr; b = b->next) {
      // Which chunks lie under the block: none for a gap, full cover otherwise.
      uintptr_t covered = b->addr;
      bool any_exported = false, all_exported = true;
      for (auto c = chunks_.FirstEndingAfter(b->addr); c != chunks_.end() && c->first < b->end();
           ++c) {
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
          totals.free_bytes += static_cast<int64_t>(b->size);
          ++totals.free_blocks;
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
          totals.allocated += static_cast<int64_t>(b->size);
          totals.requested += static_cast<int64_t>(b->requested);
          ++totals.live;
          break;
        }
        case BlockState::kPendingFree:
          if (b->pending_events <= 0) return fail("pending block without events");
          active += static_cast<int64_t>(b->size);
          pending_events += b->pending_events;
          ++pending_blocks;
          totals.pending_bytes += static_cast<int64_t>(b->size);
          ++totals.pending_blocks;
          break;
        case BlockState::kUnmapped:
          break;
      }
    }
  }
  int64_t reserved = 0, exported = 0, exported_count = 0;
  size_t spare = 0, spare_count = 0;
  for (const auto& [addr, chunk] : chunks_) {
    reserved += static_cast<int64_t>(chunk.size);
    by_arena[ArenaKindOf(addr)].reserved += static_cast<int64_t>(chunk.size);
    ++by_arena[ArenaKindOf(addr)].segments;
    if (chunk.exported) {
      exported += static_cast<int64_t>(chunk.size);
      ++exported_count;
    }
    if (chunk.untracked) {
      if (!chunk.exported) return fail("untracked chunk ", absl::Hex(addr), " not exported");
    }
    if (chunk.spare) {
      // Spare: exported, wholly retired, no receiver left, in the large arena's spare list.
      if (!chunk.exported || chunk.untracked || chunk.importers != 0 || addr < large_base_) {
        return fail("spare chunk ", absl::Hex(addr), " is not a reusable export");
      }
      if (!spare_.Contains(addr)) {
        return fail("spare chunk ", absl::Hex(addr), " missing from the spare list");
      }
      const Block* b = large_.BlockContaining(addr);
      if (b == nullptr || b->state != BlockState::kRetired || b->end() < addr + chunk.size) {
        return fail("spare chunk ", absl::Hex(addr), " is not wholly retired");
      }
      spare += chunk.size;
      ++spare_count;
    }
  }
  if (spare_count != spare_.count()) return fail("spare list");
  if (spare != spare_.bytes()) return fail("spare bytes");
  if (live != static_cast<int64_t>(small_.live().count() + large_.live().count())) {
    return fail("the live-block index has extras");
  }
  if (pending_events != static_cast<int64_t>(reclaim_.pending_events())) return fail("pending list");
  if (allocated != stats_.allocated_bytes.current) return fail("allocated_bytes");
  if (requested != stats_.requested_bytes.current) return fail("requested_bytes");
  if (active != stats_.allocated_bytes.current + pending_.bytes) return fail("active_bytes");
  if (live != stats_.allocation.current) return fail("allocation count");
  if (pending_blocks != pending_.blocks) return fail("pending block count");
  if (reserved != stats_.reserved_bytes.current) return fail("reserved_bytes");
  if (static_cast<int64_t>(chunks_.size()) != stats_.segment.current) return fail("segments");
  if (exported != stats_.exported_bytes.current) return fail("exported_bytes");
  if (exported_count != chunks_.exported_count()) return fail("exported chunk count");
  if (retired != retired_bytes_) return fail("retired bytes");
  for (int a = 0; a < kNumArenas; ++a) {
    const ArenaTotals& t = by_arena[a];
    const ArenaStats& split = stats_.arena[a];
    const std::string name = absl::StrCat(ArenaName(a), " arena ");
    if (t.allocated != split.allocated_bytes.current) return fail(name, "allocated_bytes");
    if (t.requested != split.requested_bytes.current) return fail(name, "requested_bytes");
    if (t.live != split.allocation.current) return fail(name, "allocation count");
    if (t.pending_bytes != arena_pending_[a].bytes) return fail(name, "pending bytes");
    if (t.pending_blocks != arena_pending_[a].blocks) return fail(name, "pending block count");
    if (t.reserved != split.reserved_bytes.current) return fail(name, "reserved_bytes");
    if (t.segments != split.segment.current) return fail(name, "segments");
    const FreeBlocks& free = arenas_[a]->free_blocks();
    if (t.free_bytes != free.byte_stat().current) return fail(name, "cached bytes");
    if (t.free_blocks != free.block_stat().current) return fail(name, "cached blocks");
  }

  if (released_while_kept_ != 0) {
    return fail(released_while_kept_, " chunk(s) released while the pool kept its memory");
  }
  return absl::OkStatus();
}

}  // namespace vmm
