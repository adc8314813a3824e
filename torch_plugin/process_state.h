// process_state.h: the pools and imports of one process, behind the C interface (vmm_c.h).
//
//   ProcessState& state = ProcessState::Get();
//   VMM_ASSIGN_OR_RETURN(Pool* pool, state.DevicePool(0));       // what PyTorch allocates from
//   VMM_ASSIGN_OR_RETURN(int64_t id, state.CreatePool(Backend::kHost, 0, "memory_limit=1G"));
//
// It holds:
//   - one device pool per device, created on first use with the options Configure set (device
//     pools grow by exactly what a request needs unless configured otherwise: in PyTorch
//     training that gave the smallest peak reserved) and living as long as the process;
//   - explicit pools, by id: ClosePool closes one, and it is destroyed once its last block is
//     freed (BlockFreed), so tensors outlive the Python object that made them;
//   - private pools (CUDA graph pools, torch.cuda.MemPool): explicit pools named by PyTorch's
//     MempoolId and a device, with a use count. While it is used the pool keeps all its memory
//     (Pool::SetKeepMemory: a captured graph replays into its blocks, free or not); the last
//     ReleasePrivatePool closes it: its cached memory goes at once, the rest with its last
//     block (as ClosePool). Its id works with every call that takes a pool id, except
//     ClosePool. The MempoolId -> pool map has a lock of its own (private_mu_, taken before
//     mu_);
//   - imported buffers, by id, reference counted (a tensor's storage holds one reference);
//   - sends (process_sends.cc): exports for one receiver, held until it acknowledges them or
//     their lease ends (SendLedger): a pool block's free is deferred meanwhile (BlockHolds), an
//     import keeps one more reference. A block that shares a physical chunk with another
//     live block is not sent in place (its receiver would see that block's bytes): the caller
//     moves it to a block of its own (AllocateBeside) first. Imports are forwarded with this
//     process's handles (ReExportImport).
// Every pool is made by CreateExportablePool (sharing.h), so every block can be exported.
//
// fork(): a forked child gets device pools of its own on its first allocation; its parent's
// stay, never used for allocation again, so that blocks made before the fork can still be
// freed (and read: on the host backend they are the parent's memory, shared). Explicit pools
// made before the fork refuse to allocate or export in the child (Pool: FailedPrecondition).
// The child's per-GPU state (memory-fraction caps, joint peaks, the totals of gone pools,
// other allocators' holdings) starts empty at its first pool of any kind, a private pool
// included, and its statistics count only pools it made (AdoptForkLocked). Every lock of the
// state (and of its BlockHolds) is held across fork() (allocator/fork_guard.h: private_mu_ at
// ForkLevel::kPrivatePools, stats_mu_ at kStatistics, mu_ at kProcessState, released_mu_ and
// budget_mu_ at kProcessSends), so that a child forked while other threads of its parent use
// the state finds them free.
//
// Errors: InvalidArgument for bad ids, devices, options and pointers; FailedPrecondition for
// calls in the wrong state (Configure after the first allocation); the pools' and the driver's
// errors otherwise. Thread safe: one mutex guards the maps; device pools are found without it.
// Pools handed out by AllPools() stay alive while the caller holds the returned PoolRefs.
#ifndef VMM_TORCH_PLUGIN_PROCESS_STATE_H_
#define VMM_TORCH_PLUGIN_PROCESS_STATE_H_

#include <array>
#include <atomic>
#include <deque>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/base/optimization.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "allocator/descriptor.h"
#include "allocator/driver.h"
#include "allocator/fork_guard.h"
#include "allocator/mapping_listener.h"
#include "allocator/mutex.h"
#include "allocator/pool.h"
#include "allocator/send_ledger.h"
#include "allocator/sharing.h"
#include "torch_plugin/block_holds.h"

namespace vmm {

class ProcessState {
 public:
  static constexpr int kMaxDevices = 64;
  // The address space the explicit and private pools alive (not the device pools) may hold
  // before a new one is made with a smaller default range: a private pool a quarter of the
  // GPU's memory, which does not grow (an eighth of that, then a sixty-fourth, where the
  // driver refuses it; UsePrivatePool); an explicit one twice the GPU's memory, which grows
  // where it can, rather than the paged default (CreatePool).
  static constexpr size_t kPoolRangeBudget = size_t{32} << 40;

  // A pool made by CreatePool or UsePrivatePool: it lives until it is closed and its last
  // block is freed.
  struct ExplicitPool {
    // Destroys the pool, after the capture window if one is open (RunOutsideCapture).
    ~ExplicitPool();
    std::unique_ptr<Pool> pool;
    std::atomic<int64_t> live{0};  // blocks handed out (or being allocated) and not yet freed
    bool closed = false;           // read and written only under ProcessState::mu_
    // Set when the pool is registered (under mu_), constant after: its id, and for a private
    // pool its MempoolId (such a pool is closed by ReleasePrivatePool only).
    int64_t id = 0;
    bool is_private = false;
    uint64_t mempool_id[2] = {0, 0};
  };
  // A pool handed out by AllPools or Owner; `keep` holds an explicit pool alive (null for
  // device pools, which never go away).
  struct PoolRef {
    Pool* pool = nullptr;
    std::shared_ptr<ExplicitPool> keep;
  };

  // The process's state (never destroyed: tensors may be freed during interpreter exit).
  static ProcessState& Get();

  ProcessState();
  ~ProcessState();
  ProcessState(const ProcessState&) = delete;
  ProcessState& operator=(const ProcessState&) = delete;

  // --- Device pools -------------------------------------------------------------------------
  // Options of device pools created from now on (ParsePoolOptions text). FailedPrecondition
  // once a device pool exists.
  absl::Status Configure(absl::string_view options);
  // The device pool of `device` (default backend), created on first use.
  absl::StatusOr<Pool*> DevicePool(int device);
  // The device pool of `device` if it exists, else null.
  Pool* DevicePoolIfAny(int device) const;
  // Allocates from the device pool of `device` (created on first use). A request no device
  // could hold (CheckRequestSize) is InvalidArgument before the pool is created.
  absl::StatusOr<void*> DeviceAllocate(int device, size_t size, Stream stream);
  // InvalidArgument for a device outside [0, kMaxDevices) or, once a driver is loaded, one it
  // does not have (loading CUDA's for the check would run cuInit for the caller).
  static absl::Status CheckDevice(int device);
  // Caps `device`'s pool at `fraction` (0 <= fraction <= 1; 0 lets nothing more be mapped) of
  // the memory of the device, now or when the pool is created. InvalidArgument for a fraction
  // outside [0, 1] or a device the default driver does not have (only the range where no
  // driver is loaded yet: loading CUDA's runs cuInit).
  absl::Status SetMemoryFraction(double fraction, int device);
  // Counts `delta` bytes that another allocator holds for PyTorch on GPU `device` (a
  // torch.cuda.MemPool over a CUDAPluggableAllocator) in the GPU's cap, as PyTorch's
  // allocator counts such segments against the memory fraction: a delta > 0 that would pass
  // the fraction is refused (ResourceExhausted) and not counted; a delta < 0 gives bytes back
  // (InvalidArgument, nothing changed, for more than was held, and a delta > 0 for a device
  // the default driver does not have).
  absl::Status HoldExternal(int device, int64_t delta);
  // Counts `delta` bytes of blocks handed out (> 0) or taken back (< 0) in such segments in
  // the GPU's joint allocated figure, so that its peak (max_memory_allocated) is the highest
  // that vmm's pools and those blocks reached together, as PyTorch's one set of statistics
  // per GPU gives (reserved bytes: HoldExternal's). InvalidArgument, nothing changed, for a
  // delta > 0 on a device the default driver does not have, more than was counted given
  // back, or past 2^56 bytes.
  absl::Status CountExternalAllocated(int device, int64_t delta);

  // --- Explicit pools -----------------------------------------------------------------------
  // Creates a pool on `backend`'s `device` (the host backend has one device unless
  // VMM_HOST_DEVICES says more). Returns its id (> 0). Past kPoolRangeBudget, one without
  // a reserve_size gets twice the GPU's memory of address space, which grows where it can.
  absl::StatusOr<int64_t> CreatePool(Backend backend, int device, absl::string_view options);
  // Closes pool `id`; it is destroyed now if no block of it is live, else with its last one.
  absl::Status ClosePool(int64_t id);
  // The open pool `id`.
  absl::StatusOr<std::shared_ptr<ExplicitPool>> FindPool(int64_t id);
  // Allocates from pool `id`, counting the block as live (errors as DeviceAllocate's).
  absl::StatusOr<void*> PoolAllocate(int64_t id, size_t size, Stream stream, bool shareable);
  // Allocates exactly [addr, addr + size) of pool `id` (Pool::AllocateAt), counting the block
  // as live.
  absl::StatusOr<void*> PoolAllocateAt(int64_t id, uintptr_t addr, size_t size, Stream stream);
  // The live blocks of pool `id` in address order (Pool::LiveBlocks).
  absl::StatusOr<std::vector<BlockInfo>> PoolLiveBlocks(int64_t id);

  // --- Private pools ------------------------------------------------------------------------
  // Adds one use of private pool (id0, id1) on `device`, creating it on first use through
  // `backend`'s driver (nullopt: the default one) with the device pools' options (Configure),
  // `options` applied on top; returns its id. A later use returns the same id (`backend` and
  // `options` ignored). A pool made before a fork() is not this process's: the child makes a
  // fresh one.
  absl::StatusOr<int64_t> UsePrivatePool(std::optional<Backend> backend, int device,
                                         uint64_t id0, uint64_t id1, absl::string_view options);
  // Tests: the budget of address space of the explicit and private pools (kPoolRangeBudget).
  void SetPoolRangeBudgetForTesting(size_t bytes) {
    MutexLock lock(&mu_);
    pool_range_budget_ = bytes;
  }
  // Tests: a function Retire calls (null: none) as it starts, before any lock, and once the
  // pool's figures are frozen, under stats_mu_ (a reset on another thread waits then).
  enum class RetireStage { kStarting, kFrozen };
  using RetireHook = void (*)(ProcessState& state, int device, RetireStage stage);
  void SetRetireHookForTesting(RetireHook hook) { retire_hook_.store(hook); }
  // Tests: a function AllocateBeside calls (null: none) once it has found the pool of `ptr`,
  // before it counts the new block there.
  using BesideHook = void (*)(ProcessState& state, const void* ptr);
  void SetBesideHookForTesting(BesideHook hook) { beside_hook_.store(hook); }
  // Drops one use; returns the uses left. At zero the pool stops keeping its memory, releases
  // what is cached (errors are logged) and closes; a later UsePrivatePool of the same MempoolId
  // makes a fresh pool. NotFound for an unknown one.
  absl::StatusOr<int> ReleasePrivatePool(int device, uint64_t id0, uint64_t id1);
  // Uses of the private pool (0 if there is none).
  int PrivatePoolUses(int device, uint64_t id0, uint64_t id1);
  // The id of the private pool, or NotFound.
  absl::StatusOr<int64_t> FindPrivatePool(int device, uint64_t id0, uint64_t id1);

  // --- Devices ------------------------------------------------------------------------------
  // The pools of `device`: its device pool (if any), then the private pools on it (open,
  // closed with live blocks, or going: Retire) of the same backend (the default one if there
  // is no device pool).
  // `retired`, if given: the totals of its private pools that are gone (retired_), and
  // `peak_floor` the peaks its figures had reached when one went (peak_floor_), read under the
  // same lock as the list.
  std::vector<PoolRef> DevicePools(int device, PoolStats* retired = nullptr,
                                   PoolStats* peak_floor = nullptr) ABSL_LOCKS_EXCLUDED(mu_);
  // Their statistics as one (AddPoolStats); zeros for an unused device. The peaks of
  // allocated_bytes and reserved_bytes are the GPU's (DeviceCap's joint figures: the
  // highest the pools held together, kept when a pool is gone, with other allocators' blocks
  // and segments counted by CountExternalAllocated and HoldExternal, whose current bytes are
  // not in these figures); those of their parts (each arena's, requested_bytes) are the sum
  // of the pools' peaks held within them; the other peaks are the sum of the pools' (at
  // least the GPU's), and no lower than that sum was when a private pool went (peak_floor_):
  // no peak falls but at ResetDevicePeaks.
  PoolStats DeviceStats(int device) ABSL_LOCKS_EXCLUDED(mu_);
  // DeviceStats(device)'s allocated_bytes.current and reserved_bytes.current, read from the
  // GPU's DeviceCap (what its pools add as they hand blocks out and map memory) rather than
  // summed over its pools, so that its cost does not grow with the private pools alive: the
  // profiler's memory events report both at every allocation and free. They differ from
  // DeviceStats's only while a released private pool's teardown waits for a capture to end
  // (Retire has moved its totals aside; its memory is still mapped and counted here), and in
  // that allocated is held within reserved where a free and the release of its memory fall
  // between the two reads, and by what other allocators hold (HoldExternal,
  // CountExternalAllocated), which these count, as PyTorch's figures count every pool of the
  // GPU. Where no cap is made yet, DeviceStats's.
  struct Usage {
    int64_t allocated = 0;
    int64_t reserved = 0;
  };
  Usage DeviceUsage(int device) ABSL_LOCKS_EXCLUDED(mu_);
  // Resets the cumulative figures and counters of the pools of `device`, and those that
  // private pools that are gone left in its statistics: one step for a private pool that goes
  // meanwhile (stats_mu_), whose figures join those totals before it or after it.
  void ResetDeviceAccumulated(int device) ABSL_LOCKS_EXCLUDED(stats_mu_, mu_);
  // Resets the peaks of the pools of `device`, of those that are gone and the GPU's joint
  // peaks to what is held now, as one step for a private pool that goes meanwhile.
  void ResetDevicePeaks(int device) ABSL_LOCKS_EXCLUDED(stats_mu_, mu_);

  // --- Any pool -----------------------------------------------------------------------------
  // The pool whose range holds `ptr`, or a null PoolRef.
  PoolRef Owner(const void* ptr);
  // Every pool, device pools first (then explicit and private pools by id).
  std::vector<PoolRef> AllPools();
  // Snapshots of AllPools(), each tagged with its pool's id (0 for device pools) and, for a
  // private pool, its MempoolId.
  std::vector<Snapshot> Snapshots();
  // Frees a block of any pool (an explicit pool closed and left empty is destroyed).
  absl::Status FreeBlock(void* ptr);
  // From now on `listener` (null: none) hears of every chunk the device pools and private
  // pools map or unmap, those made before included: the memory Snapshots() shows as
  // PyTorch's (explicit pools are not told; a private pool that goes is told unmapped whole
  // as it leaves Snapshots(), Pool::DetachMappingListener). MappingSource::owner is a private
  // pool's MempoolId, {0, 0} for a device pool. Called with the pool's lock held
  // (allocator/mapping_listener.h). A listener once set must live as long as the process: a
  // pool may still be calling it after it is replaced.
  void TellMappingsTo(MappingListener* listener) {
    mappings_.target.store(listener, std::memory_order_release);
  }

  // --- Sharing ------------------------------------------------------------------------------
  // Exports the live block starting at `ptr` of any pool, or forwards the import whose buffer
  // starts at `ptr` (ForwardImport): the caller keeps the block or the import alive while the
  // descriptor may be imported (PyTorch's reference counting of a storage sent through
  // `_share_cuda_` does). InvalidArgument for anything else.
  absl::StatusOr<BufferDescriptor> Export(const void* ptr);
  // Imports `descriptor` (decoded once, here) on `device` (-1: the owner's) through the
  // driver of `backend` (nullopt: the descriptor's own backend, else the default one); returns
  // an import id holding one reference.
  absl::StatusOr<int64_t> Import(absl::string_view descriptor, int device,
                                 std::optional<Backend> backend, bool pidfd);
  struct ImportInfo {
    DevPtr ptr = 0;
    size_t size = 0;
    int device = -1;  // the CUDA device it is mapped on, -1 for the host backend
  };
  // InvalidArgument for an unknown id.
  absl::StatusOr<ImportInfo> GetImportInfo(int64_t id);
  // Adds `delta` references to import `id`; the mapping goes with the last one: closed on the
  // closing thread (import_closer.h) if it maps at most kCloseInlineBytes or a capture window
  // is open (capture_window.h), else here.
  // InvalidArgument for an unknown id.
  absl::Status AddImportRef(int64_t id, int delta);
  // A small tensor's chunk and a little more: there the unmap is a large part of a receiver's
  // time per tensor; beyond, it would overlap the receiver's next import (measured slower).
  static constexpr size_t kCloseInlineBytes = size_t{16} << 20;
  // Imports alive (tests).
  size_t import_count();

  // --- Sends (process_sends.cc) ------------------------------------------------------------
  // How a pool block is sent depends on its pool's `isolate_sends` (pool_options.h). Off (the
  // default): every block of a pool that exports is kInPlace, its chunks exported with any
  // neighbours they hold (the receiver can read their bytes, as with PyTorch's IPC). On: a
  // block that shares a chunk with another live block, and any block of the small arena, is
  // kRelocate: the caller moves it to chunks of its own first (AllocateBeside, a copy), so
  // that its receiver sees no other tensor's bytes.
  enum class SendKind { kNotVmm, kInPlace, kRelocate, kImport, kNotExportable };
  // How the storage starting at `ptr` can be sent (never fails: kNotVmm for what vmm does not
  // know, or an address inside a block; kNotExportable for a block of a pool without handles).
  // In a forked child a block of a pool its parent made reads as in the parent, and its
  // export is refused (FailedPrecondition: the plugin then sends it as PyTorch sends a CPU
  // tensor, tests/python/test_fork.py).
  SendKind KindOfSend(const void* ptr);
  // KindOfSend, and in a pool that isolates sends, for a block alone in its chunks, marks
  // those chunks exported (their free space retired) so that no block can land beside it
  // before it is sent: kInPlace then stays true until it is freed. What the sending thread
  // calls before handing a tensor to another thread that sends it (a queue's feeder).
  SendKind PrepareSend(const void* ptr);
  // A block of at least `size` bytes in chunks of its own from the pool that owns `ptr`, for
  // `stream` (where a kRelocate block moves to), also where that pool is closed (it goes with
  // its last block). InvalidArgument if no pool owns `ptr` (its pool gone meanwhile too).
  absl::StatusOr<void*> AllocateBeside(const void* ptr, size_t size, Stream stream);
  struct Send {
    BufferDescriptor descriptor;
    SendLedger::Ticket ticket{};
  };
  // Exports the storage starting at `ptr` (kInPlace or kImport) for one receiver and holds it
  // until the ticket is acknowledged or the lease ends. Errors: FailedPrecondition, in a pool
  // that isolates sends, for a block that shares its chunks with another live block (checked
  // with the export, under the pool's lock; the caller moves it, vmm_alloc_beside, and sends
  // again), or for a pool that cannot export; InvalidArgument for a pointer that is neither a
  // pool block nor an import; for an import, ReExportImport's errors (sharing.h:
  // FailedPrecondition when the driver exports no imported handle or the process keeps no fds
  // for the import), naming the pointer; the export's driver error; those of the send ledger
  // and the fd server (SendLedger::Hold: the failed system call's when the server cannot
  // start; Unavailable when it cannot listen).
  absl::StatusOr<Send> ExportSend(const void* ptr);
  // The receiver's half: import `import_id` (of this state) holds a send's `ticket`. Queues
  // the ack, and the report that the memory is no longer mapped here (kReleased, or
  // kForwarded if it was sent on) for when the import's mapping is unmapped; an unknown id
  // is reported released at once (nothing of it is mapped).
  void ReceivedSend(int64_t import_id, const SendLedger::Ticket& ticket);
  // Before importing a send: NotFound if this process already imported `ticket` (of another
  // process) and has since unmapped it (the sender may have reused the memory for another
  // tensor: a send is imported once). Remembers the last kReleasedTicketsKept such tickets.
  absl::Status CheckSendNotReleased(const SendLedger::Ticket& ticket);
  static constexpr size_t kReleasedTicketsKept = 16384;
  // The send budget: how many bytes this process's unacknowledged sends may hold (the ledger's
  // held_bytes: whole chunks), with the blocks moved for a send and not yet exported (a
  // queue's feeder thread may lag behind Queue.put), before a sender waits. A small tensor sent alone takes a whole
  // chunk (2 MiB on an H200), so a producer far ahead of its consumers would otherwise hold a
  // chunk per tensor queued.
  // Default 1 GiB, or VMM_SEND_BUDGET (read once, when the state is made: bytes, K/M/G/T
  // suffixes; 0: no budget; malformed: warned once, the default). OverSendBudget: whether
  // they hold more now (no wait). WaitForSendRoom: waits while they hold more and memory keeps
  // coming back (SendLedger::Progress: acknowledgements, lease ends); it stops once none
  // came for `stall` and does not wait again until some comes, so receivers that do not read
  // (a program that fills a queue before starting its consumers) never stop a sender for
  // long. Returns whether it waited.
  // Sends not acknowledged within kSendBudgetWindow stop counting: their receivers are not
  // reading (dead, or a queue nobody reads), and waiting for them would slow every later put.
  static constexpr absl::Duration kSendBudgetWindow = absl::Seconds(5);
  void SetSendBudget(uint64_t bytes) { send_budget_.store(bytes, std::memory_order_relaxed); }
  uint64_t send_budget() const { return send_budget_.load(std::memory_order_relaxed); }
  bool OverSendBudget();
  bool WaitForSendRoom(absl::Duration stall);
  // The free path: nullopt when `ptr` is held by no send (free it now); else OK when its
  // free now waits for the last release, and InvalidArgument for a second free of it (the
  // caller must not free it either way). One atomic load while nothing is held.
  std::optional<absl::Status> DeferFreeIfHeld(const void* ptr) {
    if (ABSL_PREDICT_TRUE(!holds_.any())) return std::nullopt;
    return DeferredFree(ptr, holds_.DeferFree(ptr));
  }
  BlockHolds& block_holds() { return holds_; }

 private:
  // DeferFreeIfHeld's answer for what BlockHolds said of `ptr`.
  static std::optional<absl::Status> DeferredFree(const void* ptr, HeldFree verdict);
  struct OpenImport {
    std::unique_ptr<ImportedBuffer> buffer;
    bool host = false;  // imported through the host backend (CPU memory)
    int64_t refs = 1;
    // What was imported: forwarded as it is where the driver cannot export imported handles
    // (CUDA fabric handles; see ExportSend).
    std::shared_ptr<const BufferDescriptor> received;
  };

  // KindOfSend of `ptr` in `pool`, the pool that owns it.
  SendKind KindOfSendIn(Pool& pool, const void* ptr);
  // Frees a block of any pool, held or not (FreeBlock without the hold check).
  absl::Status FreeBlockNow(void* ptr);
  // A send of the block at `ptr` ended (acknowledged or expired): drops its hold and frees the
  // block if its owner freed it meanwhile.
  void ReleaseBlockHold(const void* ptr);
  // The import whose buffer starts at `ptr`, with one more reference (0 if none).
  int64_t RetainImportAt(const void* ptr);
  // A descriptor that maps the memory of import `id` (held by the caller) in another process:
  // this process's handles of it (ReExportImport), or, where the driver exports no imported
  // handle, the exporter's own fabric handles. The import is marked forwarded (its exporter no
  // longer counts its receivers). ReExportImport's errors, naming the import.
  absl::StatusOr<BufferDescriptor> ForwardImport(int64_t id, const void* ptr);

  // CheckDeviceExists(device, may_load=true) for another allocator's bytes on `device`
  // (HoldExternal, CountExternalAllocated), asked of the driver once per device: a MemPool
  // over another allocator counts every block it hands out, cached ones included.
  absl::Status CheckExternalDevice(int device) ABSL_LOCKS_EXCLUDED(mu_);

  // The cap of GPU `device` (caps_), made on first use.
  std::shared_ptr<DeviceCap> CapForLocked(int device) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The same for another allocator's memory (HoldExternal, CountExternalAllocated), in this
  // process's fork generation: a cap made now gets the GPU's memory fraction, if one was set.
  std::shared_ptr<DeviceCap> ExternalCapLocked(int device) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether `pool` is of another backend than the device pool of `device` (the host backend's,
  // in tests on a GPU machine): it holds none of that GPU's memory, so neither its memory
  // fraction nor its statistics count it.
  bool OfAnotherBackendLocked(int device, const Pool& pool) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The cap of `device` if it has one (none made), else null.
  std::shared_ptr<DeviceCap> CapOf(int device) ABSL_LOCKS_EXCLUDED(mu_);
  // Sets caps_[device]'s limit from fractions_[device] and the GPU's memory as the default
  // driver reports it (left as it was if that fails).
  void SetCapFromDefaultDriverLocked(int device) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Makes `pool` (the device pool or a private pool of `device`) count against the cap of
  // its GPU, whose limit follows the fraction set for the device (measured by the pool's driver).
  absl::Status ShareCapLocked(int device, Pool& pool) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether the explicit and private pools alive hold more address space than
  // pool_range_budget_ (kPoolRangeBudget).
  bool PastPoolRangeBudget() ABSL_LOCKS_EXCLUDED(mu_);
  // The open pool `id` (explicit or private), or InvalidArgument.
  absl::StatusOr<std::shared_ptr<ExplicitPool>> FindOpenLocked(int64_t id)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Closes the open pool `entry` (removed now if it has no live block, else by BlockGone).
  void CloseLocked(const std::shared_ptr<ExplicitPool>& entry,
                   std::shared_ptr<ExplicitPool>* doomed) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Registers `pool` under a fresh id.
  std::shared_ptr<ExplicitPool> Register(std::unique_ptr<Pool> pool, bool is_private,
                                         uint64_t id0, uint64_t id1);
  // The device pools' options for `device` (Configure's, its own device not a peer).
  PoolOptions DevicePoolOptions(int device) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A block of `entry` went (freed, or its allocation failed): destroys the pool if it was
  // closed and this was its last block.
  void BlockGone(const std::shared_ptr<ExplicitPool>& entry);
  // A pool taken out of explicit_ to be destroyed (`doomed`, null for none): a private
  // pool's totals stay in its GPU's statistics (retired_; PyTorch's never fall). Its figures
  // are frozen (Pool::FreezeStats), then it leaves retiring_, where CloseLocked and BlockGone
  // put it, as they join retired_, under one lock; the GPU's peaks read with it still counted
  // raise peak_floor_. The whole under stats_mu_, so that a reset of the GPU's figures does
  // not fall between the freeze and the join (it would clear retired_, then the figures of
  // before it would be added). Reading the GPU's peaks visits every pool of the GPU, as
  // DeviceStats does: its cost grows with the pools alive, and it waits for a pool whose lock
  // is held through a device synchronisation (a sweep's EmptyCache), as a reset does.
  void Retire(const std::shared_ptr<ExplicitPool>& doomed) ABSL_LOCKS_EXCLUDED(stats_mu_, mu_);
  // In a forked child: moves the parent's device pools to abandoned_ and drops the parent's
  // caps, retired totals, peak floors and other allocators' holdings.
  void AbandonParentsDevicePools() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // AbandonParentsDevicePools once, the first time a forked child reads or makes per-GPU
  // state (a cap, the retired totals, other allocators' holdings), whichever pool it makes
  // first: a private pool made before the child's first device pool must not count against
  // the parent's cap, nor the child's statistics include the parent's.
  void AdoptForkLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  std::array<std::atomic<Pool*>, kMaxDevices> device_pools_{};
  // The listener of every device pool and private pool from its creation: passes each range
  // on to TellMappingsTo's listener, if any.
  struct MappingRelay : MappingListener {
    std::atomic<MappingListener*> target{nullptr};
    void RangeMapped(const MappingSource& source, uintptr_t addr, size_t size,
                     bool mapped) override {
      MappingListener* to = target.load(std::memory_order_acquire);
      if (to != nullptr) to->RangeMapped(source, addr, size, mapped);
    }
  };
  MappingRelay mappings_;
  // Held by the resets of a GPU's figures across their pools and retired_, and by Retire from
  // a pool's freeze to its figures joining retired_; taken before mu_ and any pool's lock.
  // Only these take it, never under another lock of the state.
  Mutex stats_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  mutable Mutex mu_;
  PoolOptions options_ ABSL_GUARDED_BY(mu_);
  bool any_device_pool_ ABSL_GUARDED_BY(mu_) = false;
  // set_per_process_memory_fraction's, by device: in [0, 1], or kNoFraction where none was set.
  static constexpr double kNoFraction = -1;
  std::array<double, kMaxDevices> fractions_ ABSL_GUARDED_BY(mu_);
  // The cap set_per_process_memory_fraction puts on each GPU's device pool and private
  // pools together (allocator/device_cap.h); made with the first such pool of the GPU.
  std::array<std::shared_ptr<DeviceCap>, kMaxDevices> caps_ ABSL_GUARDED_BY(mu_){};
  // Devices CheckExternalDevice found the default driver has: its device count does not change
  // in a process, nor in a forked child (a test that switches VMM_BACKEND between calls keeps
  // the first driver's answer). The flags publish nothing else.
  std::array<std::atomic<bool>, kMaxDevices> external_device_known_{};
  // What other allocators hold in caps_, by device (HoldExternal).
  std::array<int64_t, kMaxDevices> external_held_ ABSL_GUARDED_BY(mu_){};
  // What other allocators' blocks in those hold in caps_' allocated bytes, by device
  // (CountExternalAllocated).
  std::array<int64_t, kMaxDevices> external_allocated_ ABSL_GUARDED_BY(mu_){};
  // What private pools that are gone left in their GPU's statistics, by device (Retire).
  std::array<PoolStats, kMaxDevices> retired_ ABSL_GUARDED_BY(mu_){};
  // The peaks of each GPU's figures (DeviceStats) just before a private pool went (Retire),
  // the highest since ResetDevicePeaks: a gone pool's peak leaves the sums of peaks, which
  // stay at least these. Only the peaks are used.
  std::array<PoolStats, kMaxDevices> peak_floor_ ABSL_GUARDED_BY(mu_){};
  // Private pools out of explicit_ whose totals are not in retired_ yet (Retire): DevicePools
  // still lists them.
  std::vector<std::shared_ptr<ExplicitPool>> retiring_ ABSL_GUARDED_BY(mu_);
  std::atomic<RetireHook> retire_hook_{nullptr};  // SetRetireHookForTesting
  std::atomic<BesideHook> beside_hook_{nullptr};  // SetBesideHookForTesting
  // The fork generation (allocator/fork_guard.h) caps_, external_held_, external_allocated_,
  // retired_ and peak_floor_ belong to.
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = ForkGeneration();
  int64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<int64_t, std::shared_ptr<ExplicitPool>> explicit_ ABSL_GUARDED_BY(mu_);
  size_t pool_range_budget_ ABSL_GUARDED_BY(mu_) = kPoolRangeBudget;
  // The same pools by the start of their reserved range, for Owner: a scan of explicit_ made
  // every free and record_stream cost a pass over all pools (a program with a thousand graph
  // pools: 15 µs an allocation and free).
  std::map<uintptr_t, std::shared_ptr<ExplicitPool>> explicit_by_base_ ABSL_GUARDED_BY(mu_);
  // Private pools by (device, MempoolId): the pool (also in explicit_) and its uses (> 0).
  struct PrivateUse {
    std::shared_ptr<ExplicitPool> entry;
    int uses = 0;
  };
  using PrivateKey = std::tuple<int, uint64_t, uint64_t>;
  Mutex private_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  std::map<PrivateKey, PrivateUse> private_ ABSL_GUARDED_BY(private_mu_);
  std::map<int64_t, OpenImport> imports_ ABSL_GUARDED_BY(mu_);
  // Imports by buffer address (several imports of one buffer share an address), ordered by id
  // within one: a (address, id) set, so dropping any one of K imports of a buffer and asking
  // whether an address has one cost log K (a multimap's walk of the equal range cost 197 µs a
  // release with 30,000 imports of one buffer).
  std::set<std::pair<DevPtr, int64_t>> imports_by_ptr_ ABSL_GUARDED_BY(mu_);
  // The oldest import at `ptr`, 0 when there is none.
  int64_t ImportAtLocked(const void* ptr) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  BlockHolds holds_;  // blocks held by sends, and blocks moved for a send (AllocateBeside)
  // An import of the send `ticket` was unmapped: false while other imports of it are left;
  // else remembers it released (CheckSendNotReleased) and returns true (report it).
  bool UnmappedSend(const SendLedger::Ticket& ticket);

  // Sends imported here: how many imports of each are mapped, and those unmapped since
  // (CheckSendNotReleased), oldest first.
  Mutex released_mu_;
  absl::flat_hash_map<SendLedger::Ticket, int> live_tickets_ ABSL_GUARDED_BY(released_mu_);
  absl::flat_hash_set<SendLedger::Ticket> released_ ABSL_GUARDED_BY(released_mu_);
  std::deque<SendLedger::Ticket> released_order_ ABSL_GUARDED_BY(released_mu_);
  std::atomic<uint64_t> send_budget_;
  Mutex budget_mu_;
  bool budget_stalled_ ABSL_GUARDED_BY(budget_mu_) = false;  // the last wait saw no progress
  uint64_t stalled_at_ ABSL_GUARDED_BY(budget_mu_) = 0;       // ...at this Progress()
  // Held by sends' release callbacks (weakly): a state destroyed first (tests) is not touched.
  std::shared_ptr<ProcessState*> self_ = std::make_shared<ProcessState*>(this);
  // Device pools of the parent of this forked process: found by Owner for frees, never freed.
  std::vector<Pool*> abandoned_ ABSL_GUARDED_BY(mu_);

  // The locks above, held across fork() in the order of allocator/fork_guard.h. Last, so that
  // they unregister before the rest goes.
  ForkRegistration fork_private_{ForkLevel::kPrivatePools, ForkHandlers::Lock(&private_mu_)};
  ForkRegistration fork_stats_{ForkLevel::kStatistics, ForkHandlers::Lock(&stats_mu_)};
  ForkRegistration fork_state_{ForkLevel::kProcessState, ForkHandlers::Lock(&mu_)};
  ForkRegistration fork_released_{ForkLevel::kProcessSends, ForkHandlers::Lock(&released_mu_)};
  ForkRegistration fork_budget_{ForkLevel::kProcessSends, ForkHandlers::Lock(&budget_mu_)};
};

}  // namespace vmm

#endif  // VMM_TORCH_PLUGIN_PROCESS_STATE_H_
