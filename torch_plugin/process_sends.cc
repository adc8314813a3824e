// ProcessState's sends (process_state.h): exports held for one receiver.
#include <unistd.h>

#include <algorithm>
#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "allocator/driver_error.h"
#include "allocator/fork_guard.h"
#include "allocator/log.h"
#include "allocator/send_acker.h"
#include "allocator/status_macros.h"
#include "torch_plugin/process_state.h"

namespace vmm {
namespace {

// The bytes a send holds. Whole chunks where they are the send's alone (a block isolated
// for its send, a small tensor moved holding a chunk of its own; a forwarded import).
// Otherwise its block's bytes, or, where more, the chunks this send was the first to export:
// their free space retires while the receiver maps them, so a producer that sends each fresh
// small tensor in place pins a chunk per tensor in flight (later sends from a chunk already
// exported add only their blocks, as in PyTorch, where a send holds its block).
uint64_t HeldBytes(const BufferDescriptor& d, bool whole_chunks,
                   const std::vector<ExportedChunk>& chunks = {}) {
  uint64_t bytes = 0;
  if (whole_chunks) {
    for (uint64_t size : d.sizes()) bytes += size;
    return bytes;
  }
  for (const ExportedChunk& c : chunks) {
    if (c.newly_marked) bytes += c.size;
  }
  return std::max<uint64_t>(bytes, d.size());
}

// FailedPrecondition for a block that shares a chunk with another live block; the caller moves
// it (vmm_alloc_beside) and sends again on this code.
absl::Status SharedChunkError(const void* ptr) {
  return absl::FailedPreconditionError(absl::StrCat(
      "sending the block at ", absl::Hex(reinterpret_cast<uintptr_t>(ptr)),
      ": it shares a physical chunk with another live block, whose bytes its receiver "
      "would see; move it to a block of its own first (vmm_alloc_beside)"));
}

}  // namespace

ProcessState::SendKind ProcessState::KindOfSend(const void* ptr) {
  if (ptr == nullptr) return SendKind::kNotVmm;
  PoolRef owner = Owner(ptr);
  if (owner.pool != nullptr) return KindOfSendIn(*owner.pool, ptr);
  MutexLock lock(&mu_);
  return ImportAtLocked(ptr) != 0 ? SendKind::kImport : SendKind::kNotVmm;
}

ProcessState::SendKind ProcessState::KindOfSendIn(Pool& pool, const void* ptr) {
  // Only the start of a live block is vmm's to send, whatever its pool.
  if (!pool.BlockSize(ptr).ok()) return SendKind::kNotVmm;
  if (pool.handle_type() == HandleType::kNone) return SendKind::kNotExportable;
  if (!pool.options().isolate_sends) return SendKind::kInPlace;
  absl::StatusOr<bool> shares = pool.SharesChunks(ptr);
  if (!shares.ok()) return SendKind::kNotVmm;  // freed meanwhile
  return *shares || pool.InSmallArena(ptr) ? SendKind::kRelocate : SendKind::kInPlace;
}

ProcessState::SendKind ProcessState::PrepareSend(const void* ptr) {
  PoolRef owner = ptr != nullptr ? Owner(ptr) : PoolRef{};
  if (owner.pool == nullptr) return KindOfSend(ptr);  // an import, or not vmm memory
  // Sent in place with its neighbours (nothing to keep away meanwhile), or not at all; a
  // small block moves to a chunk of its own (a spare one, usually: pool.h) rather than
  // retire the rest of its small chunk.
  if (!owner.pool->options().isolate_sends || owner.pool->handle_type() == HandleType::kNone ||
      owner.pool->InSmallArena(ptr)) {
    return KindOfSendIn(*owner.pool, ptr);
  }
  // One step under the pool's lock: marked if alone, refused (nothing marked) if not, or not
  // the start of a live block.
  absl::StatusOr<ExportedBlock> marked = owner.pool->Export(
      const_cast<void*>(ptr), HandleType::kNone, ExportNeighbours::kRefuse, ExportUse::kMark);
  if (marked.ok()) return SendKind::kInPlace;
  return absl::IsFailedPrecondition(marked.status()) ? SendKind::kRelocate : SendKind::kNotVmm;
}

absl::StatusOr<void*> ProcessState::AllocateBeside(const void* ptr, size_t size,
                                                   Stream stream) {
  VMM_RETURN_IF_ERROR(CheckRequestSize(size));
  PoolRef owner = Owner(ptr);
  if (owner.pool == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "allocating beside ", absl::Hex(reinterpret_cast<uintptr_t>(ptr)),
        ", which no vmm pool allocated"));
  }
  if (BesideHook hook = beside_hook_.load(); hook != nullptr) hook(*this, ptr);
  if (owner.keep != nullptr) {
    // An explicit pool counts its live blocks and is destroyed with the last once closed:
    // counted under the lock that closes and destroys it, and only while it is still
    // registered (BlockGone drops it from explicit_ under that lock as its last block goes),
    // so that a free on another thread cannot destroy it under the new block. A closed pool
    // (destroyed with live blocks, a released MemPool) still takes a block moved beside one
    // of its own: it stays its pool's, with its backend and options, and the pool goes with
    // its last block.
    MutexLock lock(&mu_);
    auto it = explicit_.find(owner.keep->id);
    if (it == explicit_.end() || it->second != owner.keep) {
      return absl::InvalidArgumentError(absl::StrCat(
          "allocating beside ", absl::Hex(reinterpret_cast<uintptr_t>(ptr)),
          ", which no vmm pool allocated (its pool went with its last block)"));
    }
    ++owner.keep->live;
  }
  absl::StatusOr<void*> block = owner.pool->AllocateShareable(size, stream);
  if (!block.ok() && owner.keep != nullptr) BlockGone(owner.keep);
  if (block.ok()) {
    const size_t g = owner.pool->granularity();
    holds_.Moved(*block, (size + g - 1) / g * g);  // whole chunks of its own, until sent
  }
  return block;
}

int64_t ProcessState::RetainImportAt(const void* ptr) {
  MutexLock lock(&mu_);
  const int64_t id = ImportAtLocked(ptr);
  if (id != 0) ++imports_.at(id).refs;
  return id;
}

absl::StatusOr<ProcessState::Send> ProcessState::ExportSend(const void* ptr) {
  std::weak_ptr<ProcessState*> self = self_;
  PoolRef owner = Owner(ptr);
  if (owner.pool != nullptr) {
    // Isolated: the export refuses a block with live neighbours under the pool's lock, so
    // none can be allocated beside it between the check and the marking.
    const bool isolated = owner.pool->options().isolate_sends;
    std::vector<ExportedChunk> chunks;
    absl::StatusOr<BufferDescriptor> d = ExportBuffer(
        *owner.pool, const_cast<void*>(ptr),
        isolated ? ExportNeighbours::kRefuse : ExportNeighbours::kAllow, ExportUse::kTracked,
        &chunks);
    if (!d.ok()) {
      absl::StatusOr<bool> shares_now = owner.pool->SharesChunks(ptr);
      if (d.status().code() == absl::StatusCode::kFailedPrecondition && shares_now.ok() &&
          *shares_now) {
        return SharedChunkError(ptr);
      }
      return d.status();
    }
    holds_.Hold(ptr);
    // The chunks are reused for later sends only once this send's receiver has unmapped
    // them (settle); `keep` keeps an explicit pool alive until then.
    absl::StatusOr<SendLedger::Ticket> ticket = SendLedger::Get().Hold(
        HeldBytes(*d, isolated, chunks),
        [self, ptr, keep = owner.keep]() {
          if (auto state = self.lock()) (*state)->ReleaseBlockHold(ptr);
        },
        [self, pool = owner.pool, keep = owner.keep, chunks](bool released) {
          // A device pool goes with its state (which tests make and drop; `keep` holds only
          // an explicit pool): as for the release, a state destroyed first is not touched.
          if (keep == nullptr && self.expired()) return;
          pool->SettleExport(chunks, released);
        });
    if (!ticket.ok()) {
      owner.pool->SettleExport(chunks, /*released=*/false);
      ReleaseBlockHold(ptr);
      return ticket.status();
    }
    return Send{*std::move(d), *ticket};
  }
  const int64_t id = RetainImportAt(ptr);
  if (id == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "sending ", absl::Hex(reinterpret_cast<uintptr_t>(ptr)),
        ": neither a vmm pool block nor an imported buffer"));
  }
  absl::StatusOr<BufferDescriptor> d = ForwardImport(id, ptr);
  if (!d.ok()) {
    (void)AddImportRef(id, -1);
    return WithContext(d.status(), "sending");
  }
  absl::StatusOr<SendLedger::Ticket> ticket =
      SendLedger::Get().Hold(HeldBytes(*d, /*whole_chunks=*/true), [self, id]() {
        if (auto state = self.lock()) (void)(*state)->AddImportRef(id, -1);
      });
  if (!ticket.ok()) {
    (void)AddImportRef(id, -1);
    return ticket.status();
  }
  return Send{*std::move(d), *ticket};
}

absl::StatusOr<BufferDescriptor> ProcessState::ForwardImport(int64_t id, const void* ptr) {
  ImportedBuffer* buffer = nullptr;
  std::shared_ptr<const BufferDescriptor> received;
  {
    MutexLock lock(&mu_);
    const OpenImport& import = imports_.at(id);  // alive: the caller's reference holds it
    buffer = import.buffer.get();
    received = import.received;
  }
  absl::StatusOr<BufferDescriptor> d = ReExportImport(*buffer);
  if (!d.ok() && d.status().code() == absl::StatusCode::kFailedPrecondition &&
      received->handle_type() == HandleType::kFabric) {
    // The CUDA driver exports no imported handle; the exporter's fabric handles stay
    // importable while the memory lives, which the caller's hold on this import guarantees.
    d = *received;
  }
  if (!d.ok()) {
    return WithContext(d.status(), absl::StrCat("the imported buffer at ",
                                                absl::Hex(reinterpret_cast<uintptr_t>(ptr))));
  }
  // Its next receiver is counted by nobody: the sender of this import must not reuse the
  // memory (marked only once the descriptor exists: a failed forward leaves the import as it was).
  buffer->MarkForwarded();
  return d;
}

absl::Status ProcessState::CheckSendNotReleased(const SendLedger::Ticket& ticket) {
  // This process's own sends are exempt: a re-import of one here exposes nothing to another
  // process, and the sender may still hold the tensor (a benchmark unpickling one payload).
  absl::StatusOr<FdToken> token = FdToken::Decode(ticket);
  if (token.ok() && token->pid == static_cast<uint32_t>(getpid())) return absl::OkStatus();
  MutexLock lock(&released_mu_);
  if (released_.count(ticket) == 0) return absl::OkStatus();
  return absl::NotFoundError(
      "this send was already imported here and released since: a send is imported once (its "
      "sender may have reused the memory); send the tensor again instead");
}

bool ProcessState::OverSendBudget() {
  const uint64_t budget = send_budget();
  return budget != 0 && SendLedger::Get().RecentHeldBytes(kSendBudgetWindow) +
                              holds_.moved_bytes() >
                          budget;
}

bool ProcessState::WaitForSendRoom(absl::Duration stall) {
  if (!OverSendBudget()) return false;
  SendLedger& ledger = SendLedger::Get();
  {
    MutexLock lock(&budget_mu_);
    if (budget_stalled_ && ledger.Progress() == stalled_at_) return false;  // still stalled
    budget_stalled_ = false;
  }
  bool waited = false;
  for (;;) {
    const uint64_t seen = ledger.Progress();
    if (!OverSendBudget()) break;  // checked after reading the count: no wake-up is lost
    waited = true;
    if (!ledger.WaitForProgress(seen, stall)) {
      MutexLock lock(&budget_mu_);
      budget_stalled_ = true;
      stalled_at_ = seen;
      break;
    }
  }
  return waited;
}

void ProcessState::ReceivedSend(int64_t import_id, const SendLedger::Ticket& ticket) {
  AckSendLater(ticket);
  {
    MutexLock lock(&mu_);
    auto it = imports_.find(import_id);
    if (it != imports_.end()) {
      {
        MutexLock tickets(&released_mu_);
        ++live_tickets_[ticket];
      }
      // The release report goes with the mapping, after the unmap (queued under the lock, so
      // the import cannot go in between), once no import of the same send is left here. Only
      // by this process: a forked child's copy of the import is its parent's to report. And
      // host-backend memory stays mapped in children forked since (MAP_SHARED), which nobody
      // counts (a CUDA mapping is unusable in a forked child).
      it->second.buffer->OnUnmapped(
          [self = std::weak_ptr<ProcessState*>(self_), ticket, host = it->second.host,
           generation = ForkGeneration(), forks = ForksMade()](bool forwarded) {
            if (ForkGeneration() != generation) return;
            auto state = self.lock();
            if (state != nullptr && !(*state)->UnmappedSend(ticket)) return;
            if (host && ForksMade() != forks) forwarded = true;
            ReportSendLater(ticket,
                            forwarded ? SendReport::kForwarded : SendReport::kReleased);
          });
      return;
    }
  }
  ReportSendLater(ticket, SendReport::kReleased);  // nothing of it is mapped here
}

bool ProcessState::UnmappedSend(const SendLedger::Ticket& ticket) {
  MutexLock lock(&released_mu_);
  auto live = live_tickets_.find(ticket);
  if (live != live_tickets_.end() && --live->second > 0) return false;
  if (live != live_tickets_.end()) live_tickets_.erase(live);
  if (released_.insert(ticket).second) {
    released_order_.push_back(ticket);
    if (released_order_.size() > kReleasedTicketsKept) {
      released_.erase(released_order_.front());
      released_order_.pop_front();
    }
  }
  return true;
}

void ProcessState::ReleaseBlockHold(const void* ptr) {
  if (!holds_.Release(ptr)) return;
  absl::Status freed = FreeBlockNow(const_cast<void*>(ptr));
  if (!freed.ok()) LogError(freed.message());
}

}  // namespace vmm
