// fork() while other threads of the process are inside vmm (host backend). fork() copies only
// the thread that calls it, so a lock another thread held at that moment would stay held for
// good in the child, which would hang at its first use of it (a receiver forked from a process
// whose second thread allocates or exports: torch.multiprocessing's default on Linux). Every
// process-wide lock a child may take is held across fork() (fork_guard.h, ForkLevel); here
// threads of the parent hammer those locks while the main thread forks again and again, and
// each child goes through the same paths itself (pools, exports, imports, sends, private
// pools, the host driver's memory, streams and events, logging) and must be done within a
// deadline (an alarm kills a child that hangs).
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "allocator/driver.h"
#include "allocator/fd_share.h"
#include "allocator/fork_guard.h"
#include "allocator/host_driver.h"
#include "allocator/log.h"
#include "allocator/pool.h"
#include "allocator/send_ledger.h"
#include "gtest/gtest.h"
#include "tests/sanitizers.h"
#include "tests/subprocess.h"
#include "torch_plugin/process_state.h"

#if VMM_UNDER_TSAN
// The children start threads (the fd server's, a stream's): ThreadSanitizer refuses that in a
// child forked from a process with threads unless told to go on (it cannot follow them; the
// child's own checks still run). TSAN_OPTIONS from the environment still apply on top.
extern "C" const char* __tsan_default_options() { return "die_after_fork=0"; }
#endif

namespace vmm {
namespace {

constexpr size_t kMiB = size_t{1} << 20;
constexpr int kForks = 100;
// A child needs milliseconds; one that hangs is killed (SIGALRM) after this.
constexpr unsigned kChildDeadlineSeconds = 20;
constexpr char kPoolOptions[] = "reserve_size=64M,handle_type=posix_fd";

// The host stream the driver thread uses (0 until made): children synchronise it too.
std::atomic<Stream> parents_stream{0};

// One round of what the process-wide state does: a pool registered, a block allocated,
// exported, imported and sent (then withdrawn), a private pool used; nonzero says which step
// failed. Run by the parent's threads and, once, by every child.
int UseProcessState(uint64_t private_id) {
  ProcessState& state = ProcessState::Get();
  absl::StatusOr<int64_t> pool = state.CreatePool(Backend::kHost, 0, kPoolOptions);
  if (!pool.ok()) return 10;
  absl::StatusOr<void*> p = state.PoolAllocate(*pool, kMiB, 0, /*shareable=*/true);
  if (!p.ok()) return 11;
  std::memset(*p, 0x5a, 4096);
  absl::StatusOr<BufferDescriptor> d = state.Export(*p);
  if (!d.ok()) return 12;
  absl::StatusOr<int64_t> imported = state.Import(d->Encode(), -1, Backend::kHost, false);
  if (!imported.ok()) return 13;
  absl::StatusOr<ProcessState::ImportInfo> info = state.GetImportInfo(*imported);
  if (!info.ok() || reinterpret_cast<const uint8_t*>(info->ptr)[4095] != 0x5a) return 14;
  if (!state.AddImportRef(*imported, -1).ok()) return 15;
  absl::StatusOr<ProcessState::Send> send = state.ExportSend(*p);
  if (!send.ok()) return 16;
  if (!CancelSend(send->ticket).ok()) return 17;
  (void)state.OverSendBudget();
  if (!state.FreeBlock(*p).ok()) return 18;
  if (!state.ClosePool(*pool).ok()) return 19;
  absl::StatusOr<int64_t> priv = state.UsePrivatePool(Backend::kHost, 0, 0xf04c, private_id,
                                                      kPoolOptions);
  if (!priv.ok()) return 20;
  absl::StatusOr<void*> q = state.PoolAllocate(*priv, kMiB, 0, /*shareable=*/false);
  if (!q.ok()) return 21;
  if (!state.FreeBlock(*q).ok()) return 22;
  if (!state.ReleasePrivatePool(0, 0xf04c, private_id).ok()) return 23;
  return 0;
}

// One round of the host driver's own calls: a reservation, a physical allocation mapped and
// exported, stream work and an event; nonzero says which step failed.
int UseHostDriver(Stream stream) {
  Driver* driver = GetHostDriver();
  const size_t g = size_t{2} << 20;
  absl::StatusOr<DevPtr> va = driver->Reserve(2 * g, 0);
  if (!va.ok()) return 30;
  absl::StatusOr<PhysHandle> h = driver->Create(0, g, kPosixFdBit);
  if (!h.ok()) return 31;
  if (!driver->Map(*va, g, *h).ok()) return 32;
  const int device = 0;
  if (!driver->SetAccess(*va, g, absl::MakeConstSpan(&device, 1)).ok()) return 33;
  if (!driver->Export(*h, HandleType::kPosixFd).ok()) return 34;
  absl::StatusOr<Event> event = driver->CreateEvent(0);
  if (!event.ok()) return 35;
  if (!driver->MemsetAsync(*va, 0x11, g, stream).ok()) return 36;
  if (!driver->RecordEvent(*event, stream).ok()) return 37;
  if (!driver->SynchronizeEvent(*event).ok()) return 38;
  if (*reinterpret_cast<const uint8_t*>(*va + g - 1) != 0x11) return 39;
  if (!driver->DestroyEvent(*event).ok()) return 40;
  if (!driver->Unmap(*va, g).ok()) return 41;
  if (!driver->Release(*h).ok()) return 42;
  if (!driver->Unreserve(*va, 2 * g).ok()) return 43;
  LogWarningOnce("fork-locks-test", "fork_locks_test: LogWarningOnce, once per process");
  return 0;
}

// Calls that hold a process-wide lock only briefly (the send ledger's, the fd server's, the
// state's block holds, LogWarningOnce's); an import of an open mapping (the mapping cache).
int UseQuickLocks(const std::string& descriptor) {
  ProcessState& state = ProcessState::Get();
  for (int i = 0; i < 20; ++i) {
    (void)SendLedger::Get().GetStats();
    (void)FdServer::Get().size();
    (void)state.block_holds().held();
    LogWarningOnce("fork-locks-test", "fork_locks_test: LogWarningOnce, once per process");
  }
  if (descriptor.empty()) return 0;
  absl::StatusOr<int64_t> imported = state.Import(descriptor, -1, Backend::kHost, false);
  if (!imported.ok()) return 60;
  if (!state.AddImportRef(*imported, -1).ok()) return 61;
  return 0;
}

// Whether fork `i`'s child, which exited with `rc`, finished (0); else a failure that says
// how it ended.
bool ChildFinished(int i, int rc) {
  EXPECT_EQ(rc, 0) << "fork " << i << ": the child "
                   << (rc == 128 + SIGALRM
                           ? absl::StrCat("hung (killed after ", kChildDeadlineSeconds, " s)")
                           : absl::StrCat("failed at step ", rc));
  return rc == 0;
}

// The child: every path once, within the deadline.
int Child() {
  alarm(kChildDeadlineSeconds);
  if (int failed = UseQuickLocks(""); failed != 0) return failed;
  Driver* driver = GetHostDriver();
  // The parent's stream and every stream of the device: the parent's work is the parent's.
  if (!driver->SynchronizeStream(parents_stream.load()).ok()) return 50;
  if (!driver->SynchronizeDevice(0).ok()) return 51;
  absl::StatusOr<Stream> stream = driver->CreateStream(0);
  if (!stream.ok()) return 52;
  if (int failed = UseHostDriver(*stream); failed != 0) return failed;
  if (int failed = UseProcessState(static_cast<uint64_t>(getpid())); failed != 0) return failed;
  if (!driver->DestroyStream(*stream).ok()) return 53;
  return 0;
}

TEST(ForkLocksTest, ChildrenForkedWhileOtherThreadsUseVmmFinishTheirOwnUse) {
  Driver* driver = GetHostDriver();
  absl::StatusOr<Stream> stream = driver->CreateStream(0);
  ASSERT_TRUE(stream.ok()) << stream.status();
  parents_stream.store(*stream);
  // The paths run once here first, so that whatever they make once per process exists.
  ASSERT_EQ(UseHostDriver(*stream), 0);
  ASSERT_EQ(UseProcessState(1), 0);

  // A buffer kept exported and imported: further imports of it share the open mapping.
  ProcessState& state = ProcessState::Get();
  absl::StatusOr<int64_t> kept_pool = state.CreatePool(Backend::kHost, 0, kPoolOptions);
  ASSERT_TRUE(kept_pool.ok()) << kept_pool.status();
  absl::StatusOr<void*> kept = state.PoolAllocate(*kept_pool, kMiB, 0, /*shareable=*/true);
  ASSERT_TRUE(kept.ok()) << kept.status();
  absl::StatusOr<BufferDescriptor> kept_d = state.Export(*kept);
  ASSERT_TRUE(kept_d.ok()) << kept_d.status();
  const std::string descriptor = kept_d->Encode();
  absl::StatusOr<int64_t> kept_import = state.Import(descriptor, -1, Backend::kHost, false);
  ASSERT_TRUE(kept_import.ok()) << kept_import.status();

  std::atomic<bool> stop{false};
  std::atomic<int> failure{0};
  std::atomic<uint64_t> rounds{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 2; ++t) {
    threads.emplace_back([&, t] {
      while (!stop.load()) {
        if (int failed = UseProcessState(100 + t); failed != 0) failure.store(failed);
        rounds.fetch_add(1);
      }
    });
  }
  threads.emplace_back([&] {
    while (!stop.load()) {
      if (int failed = UseHostDriver(*stream); failed != 0) failure.store(failed);
      rounds.fetch_add(1);
    }
  });
  threads.emplace_back([&] {
    while (!stop.load()) {
      if (int failed = UseQuickLocks(descriptor); failed != 0) failure.store(failed);
      rounds.fetch_add(1);
    }
  });

  int hung = 0;
  for (int i = 0; i < kForks && hung == 0; ++i) {
    // Let the threads get going again between forks.
    const uint64_t seen = rounds.load();
    while (rounds.load() < seen + 2 && failure.load() == 0) std::this_thread::yield();
    const int rc = InForkedChild(&Child);
    if (!ChildFinished(i, rc)) ++hung;
  }
  stop.store(true);
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(failure.load(), 0) << "a thread of the parent failed at step " << failure.load();
  EXPECT_TRUE(driver->DestroyStream(*stream).ok());
  EXPECT_TRUE(state.AddImportRef(*kept_import, -1).ok());
  EXPECT_TRUE(state.FreeBlock(*kept).ok());
  EXPECT_TRUE(state.ClosePool(*kept_pool).ok());
}

// A pool's own lock too: a child frees blocks its parent made in a pool that a thread of the
// parent keeps allocating from and freeing to, and reads its statistics.
TEST(ForkLocksTest, AChildFreesItsParentsBlocksWhileAThreadOfTheParentUsesThePool) {
  PoolOptions options;
  options.reserve_size = 256 * kMiB;
  absl::StatusOr<std::unique_ptr<Pool>> made = Pool::Create(GetHostDriver(), options);
  ASSERT_TRUE(made.ok()) << made.status();
  Pool& pool = **made;
  std::vector<void*> blocks;
  for (int i = 0; i < kForks; ++i) {
    absl::StatusOr<void*> p = pool.Allocate(64 * 1024, 0);
    ASSERT_TRUE(p.ok()) << p.status();
    blocks.push_back(*p);
  }
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> rounds{0};
  std::thread user([&] {
    size_t size = 4096;
    while (!stop.load()) {
      absl::StatusOr<void*> p = pool.Allocate(size, 0);
      if (p.ok()) (void)pool.Free(*p);
      (void)pool.EmptyCache();
      size = size * 3 % (8 * kMiB) + 4096;
      rounds.fetch_add(1);
    }
  });
  int hung = 0;
  for (int i = 0; i < kForks && hung == 0; ++i) {
    const uint64_t seen = rounds.load();
    while (rounds.load() < seen + 2) std::this_thread::yield();
    void* block = blocks[i];
    const int rc = InForkedChild([&pool, block] {
      alarm(kChildDeadlineSeconds);
      if (!pool.Free(block).ok()) return 1;
      (void)pool.GetStats();
      return 0;
    });
    if (!ChildFinished(i, rc)) ++hung;
  }
  stop.store(true);
  user.join();
  for (void* b : blocks) EXPECT_TRUE(pool.Free(b).ok());
}

}  // namespace
}  // namespace vmm
