// FetchFds(kPidfd) and its slots check (fd_slots.h) under stale and forged tokens, exporters
// that exit or fork, churn and many registrations, with exporters forked from this test
// program (written by a tester against the first slots file; the first three failed there).
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "allocator/fd_share.h"
#include "allocator/unique_fd.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/status_matchers.h"

namespace vmm {
namespace {

using ::testing::HasSubstr;

// A memfd holding `marker` at offset 0.
UniqueFd Marked(uint8_t marker) {
  UniqueFd fd(memfd_create("attack", MFD_CLOEXEC));
  if (pwrite(fd.get(), &marker, 1, 0) != 1) _exit(90);
  return fd;
}

int FirstByte(int fd) {
  uint8_t byte = 0;
  return pread(fd, &byte, 1, 0) == 1 ? byte : -1;
}

bool WriteAll(int fd, const void* p, size_t n) {
  return write(fd, p, n) == static_cast<ssize_t>(n);
}
bool ReadAll(int fd, void* p, size_t n) {
  size_t got = 0;
  while (got < n) {
    const ssize_t r = read(fd, static_cast<char*>(p) + got, n - got);
    if (r <= 0) return false;
    got += static_cast<size_t>(r);
  }
  return true;
}

void SendToken(int out, const FdToken& t) {
  const std::array<uint8_t, 64> bytes = t.Encode();
  if (!WriteAll(out, bytes.data(), bytes.size())) _exit(91);
}
FdToken ReadToken(int in) {
  std::array<uint8_t, 64> bytes{};
  EXPECT_TRUE(ReadAll(in, bytes.data(), bytes.size()));
  absl::StatusOr<FdToken> t = FdToken::Decode(bytes);
  EXPECT_OK(t);
  return t.ok() ? *t : FdToken{};
}

// A forked exporter: `body(to_parent, from_parent)` runs in the child, then it _exits(0).
struct Forked {
  pid_t pid = -1;
  int from_child = -1;
  int to_child = -1;
  template <typename F>
  explicit Forked(F body) {
    int up[2], down[2];
    EXPECT_EQ(pipe2(up, O_CLOEXEC), 0);
    EXPECT_EQ(pipe2(down, O_CLOEXEC), 0);
    pid = fork();
    if (pid == 0) {
      close(up[0]);
      close(down[1]);
      body(up[1], down[0]);
      _exit(0);
    }
    close(up[1]);
    close(down[0]);
    from_child = up[0];
    to_child = down[1];
  }
  void Go() {
    const char c = 'g';
    EXPECT_TRUE(WriteAll(to_child, &c, 1));
  }
  int Wait() {
    close(to_child);
    close(from_child);
    int status = 0;
    waitpid(pid, &status, 0);
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }
};

void WaitForGo(int in) {
  char c;
  if (read(in, &c, 1) != 1) _exit(0);
}

// Whether a pidfd fetch from a forked exporter works here (ptrace rights, a kernel with
// pidfd_getfd): the tests skip where it does not.
bool PidfdUsable() {
  Forked e([](int out, int in) {
    absl::StatusOr<FdToken> t = FdServer::Get().Register(Marked(1));
    if (!t.ok()) _exit(97);
    SendToken(out, *t);
    WaitForGo(in);
  });
  const FdToken t = ReadToken(e.from_child);
  const bool ok = FetchFds({t}, FdFetch::kPidfd).ok();
  e.Go();
  e.Wait();
  return ok;
}

size_t OpenFds() {
  size_t n = 0;
  for (auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) {
    (void)entry;
    ++n;
  }
  return n;
}

// 1. The exporter has exited (a zombie not yet reaped by its parent): Unavailable ("gone"),
// as the socket transport says, not NotFound.
TEST(FdPidfdTest, AnExporterThatExitedIsUnavailableNotStale) {
  if (!PidfdUsable()) GTEST_SKIP() << "no ptrace rights";
  Forked e([](int out, int) {
    FdToken t = *FdServer::Get().Register(Marked(7));
    SendToken(out, t);
  });
  const FdToken t = ReadToken(e.from_child);
  char c;
  ASSERT_EQ(read(e.from_child, &c, 1), 0);  // its end of the pipe closed: it is exiting
  siginfo_t info{};
  ASSERT_EQ(waitid(P_PID, e.pid, &info, WEXITED | WNOWAIT), 0);  // exited, not reaped
  EXPECT_THAT(FetchFds({t}), StatusIs(absl::StatusCode::kUnavailable));
  EXPECT_THAT(FetchFds({t}, FdFetch::kPidfd), StatusIs(absl::StatusCode::kUnavailable));
  e.Wait();
}

// 2. A forged token whose slots_fd names a file the importer can write (the memfd of memory
// it imported, a slot written into it, not the trailer) fetches no file the exporter never
// registered. (An importer that wrote the trailer too would pass: it holds pidfd_getfd rights
// over the exporter, and could take any fd of it anyway.)
TEST(FdPidfdTest, ASlotsFdNamingAnImportedChunkFetchesNoOtherFile) {
  if (!PidfdUsable()) GTEST_SKIP() << "no ptrace rights";
  Forked e([](int out, int in) {
    UniqueFd secret = Marked(99);  // never exported
    const uint32_t secret_fd = static_cast<uint32_t>(secret.get());
    FdToken t = *FdServer::Get().Register(Marked(5));
    SendToken(out, t);
    if (!WriteAll(out, &secret_fd, 4)) _exit(92);
    WaitForGo(in);
  });
  const FdToken chunk = ReadToken(e.from_child);
  uint32_t secret_fd = 0;
  ASSERT_TRUE(ReadAll(e.from_child, &secret_fd, 4));
  ASSERT_OK_AND_ASSIGN(std::vector<UniqueFd> got, FetchFds({chunk}, FdFetch::kPidfd));
  ASSERT_EQ(got.size(), 1u);
  // The importer writes a slot into the memory it imported.
  FdToken forged = chunk;
  forged.fd = secret_fd;
  forged.slots_fd = static_cast<int32_t>(chunk.fd);
  forged.key = 777;
  forged.nonce.fill(0x55);
  std::array<uint8_t, 32> slot{};
  std::memcpy(slot.data(), forged.nonce.data(), 16);
  std::memcpy(slot.data() + 16, &forged.key, 8);
  ASSERT_EQ(pwrite(got[0].get(), slot.data(), 32, off_t{secret_fd} * 32), 32);
  absl::StatusOr<std::vector<UniqueFd>> stolen = FetchFds({forged}, FdFetch::kPidfd);
  if (stolen.ok()) {
    ADD_FAILURE() << "a forged token fetched the exporter's fd " << secret_fd
                  << " holding marker " << FirstByte((*stolen)[0].get());
  } else {
    EXPECT_THAT(stolen, StatusIs(absl::StatusCode::kNotFound));
  }
  e.Go();
  EXPECT_EQ(e.Wait(), 0);
}

// 3. The exporter forks after registering: the child shares the parent's slots file (one
// memfd) but has its own copy of the fd table. The parent ends the registration and
// registers another file at the same number; the new token, its pid changed to the child's,
// fetches nothing (the slots file names the parent), not the child's copy of the old file.
TEST(FdPidfdTest, AForkedExportersChildFetchesNoFileForItsParentsToken) {
  if (!PidfdUsable()) GTEST_SKIP() << "no ptrace rights";
  Forked e([](int out, int in) {
    FdToken first = *FdServer::Get().Register(Marked(1));
    const pid_t child = fork();
    if (child == 0) {
      char c;
      while (read(in, &c, 1) > 0) {
      }
      _exit(0);
    }
    FdServer::Get().Unregister(first.key);
    FdToken second = *FdServer::Get().Register(Marked(2));
    SendToken(out, first);
    SendToken(out, second);
    const uint32_t c = static_cast<uint32_t>(child);
    if (!WriteAll(out, &c, 4)) _exit(93);
    WaitForGo(in);
    kill(child, SIGKILL);
    waitpid(child, nullptr, 0);
  });
  const FdToken first = ReadToken(e.from_child);
  const FdToken second = ReadToken(e.from_child);
  uint32_t child = 0;
  ASSERT_TRUE(ReadAll(e.from_child, &child, 4));
  ASSERT_EQ(first.fd, second.fd) << "the number was reused";
  ASSERT_OK_AND_ASSIGN(std::vector<UniqueFd> right, FetchFds({second}, FdFetch::kPidfd));
  EXPECT_EQ(FirstByte(right[0].get()), 2);
  FdToken at_child = second;
  at_child.pid = child;
  absl::StatusOr<std::vector<UniqueFd>> got = FetchFds({at_child}, FdFetch::kPidfd);
  if (got.ok()) {
    EXPECT_EQ(FirstByte((*got)[0].get()), 2)
        << "the token of the file marked 2 fetched another file from pid " << child;
  }
  e.Go();
  EXPECT_EQ(e.Wait(), 0);
}

// 4. slots_fd naming files of every kind: NotFound each, no fd left behind.
TEST(FdPidfdTest, SlotsFdOfEveryKindIsStaleAndLeaksNothing) {
  if (!PidfdUsable()) GTEST_SKIP() << "no ptrace rights";
  Forked e([](int out, int in) {
    int p[2];
    pipe2(p, O_CLOEXEC);
    int s[2];
    socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, s);
    std::vector<int> fds = {p[0],
                            p[1],
                            s[0],
                            open("/", O_RDONLY | O_DIRECTORY | O_CLOEXEC),
                            open("/proc/self/mem", O_RDONLY | O_CLOEXEC),
                            open("/tmp", O_PATH | O_CLOEXEC),
                            open("/dev/null", O_WRONLY | O_CLOEXEC),
                            open("/dev/zero", O_RDONLY | O_CLOEXEC),
                            static_cast<int>(syscall(SYS_pidfd_open, getpid(), 0))};
    FdToken t = *FdServer::Get().Register(Marked(5));
    SendToken(out, t);
    const uint32_t n = fds.size();
    WriteAll(out, &n, 4);
    WriteAll(out, fds.data(), 4 * n);
    WaitForGo(in);
  });
  const FdToken t = ReadToken(e.from_child);
  uint32_t n = 0;
  ASSERT_TRUE(ReadAll(e.from_child, &n, 4));
  std::vector<int32_t> fds(n);
  ASSERT_TRUE(ReadAll(e.from_child, fds.data(), 4 * n));
  const size_t before = OpenFds();
  std::vector<int32_t> all = fds;
  all.push_back(static_cast<int32_t>(t.fd));
  all.push_back((1 << 24) - 2);
  all.push_back(1 << 20);
  all.push_back(-1);  // none: refused as such (FailedPrecondition), not checked
  for (int32_t slots : all) {
    FdToken forged = t;
    forged.slots_fd = slots;
    EXPECT_THAT(FetchFds({forged}, FdFetch::kPidfd),
                StatusIs(slots < 0 ? absl::StatusCode::kFailedPrecondition
                                   : absl::StatusCode::kNotFound))
        << "slots_fd " << slots;
    // Through Encode/Decode, as a descriptor carries it.
    const std::array<uint8_t, 64> bytes = forged.Encode();
    ASSERT_OK_AND_ASSIGN(FdToken back, FdToken::Decode(bytes));
    EXPECT_EQ(back.slots_fd, slots);
    EXPECT_EQ(back.Encode(), bytes);
  }
  for (uint32_t fd : {0x7fffffffu, 0xffffffffu, (1u << 22), (1u << 22) - 1}) {
    FdToken forged = t;
    forged.fd = fd;
    EXPECT_THAT(FetchFds({forged}, FdFetch::kPidfd), StatusIs(absl::StatusCode::kNotFound))
        << "fd " << fd;
  }
  EXPECT_EQ(OpenFds(), before) << "fds left behind by failed fetches";
  ASSERT_OK_AND_ASSIGN(std::vector<UniqueFd> ok, FetchFds({t}, FdFetch::kPidfd));
  EXPECT_EQ(FirstByte(ok[0].get()), 5);
  ASSERT_OK_AND_ASSIGN(std::vector<UniqueFd> sock, FetchFds({t}));
  EXPECT_EQ(FirstByte(sock[0].get()), 5);
  e.Go();
  EXPECT_EQ(e.Wait(), 0);
}

// 5. Churn: a thread of the exporter registers, rekeys and unregisters without pause (4 live
// at a time) while the importer asks for its newest token and fetches it by pidfd: every fetch
// that succeeds gives the token's own file.
TEST(FdPidfdTest, ChurnNeverYieldsAnotherFile) {
  if (!PidfdUsable()) GTEST_SKIP() << "no ptrace rights";
  Forked e([](int out, int in) {
    std::atomic<bool> stop{false};
    std::mutex mu;
    FdToken newest;
    uint32_t newest_marker = 0;
    std::thread churn([&] {
      std::vector<uint64_t> live;
      for (uint32_t i = 1; !stop; ++i) {
        UniqueFd fd(memfd_create("churn", MFD_CLOEXEC));
        if (pwrite(fd.get(), &i, 4, 0) != 4) _exit(94);
        FdToken t = *FdServer::Get().Register(std::move(fd));
        if (i % 3 == 0) t = *FdServer::Get().Rekey(t.key);
        {
          std::lock_guard<std::mutex> lock(mu);
          newest = t;
          newest_marker = i;
        }
        live.push_back(t.key);
        if (live.size() > 4) {
          FdServer::Get().Unregister(live.front());
          live.erase(live.begin());
        }
      }
    });
    char c;
    while (read(in, &c, 1) == 1) {
      FdToken t;
      uint32_t m;
      {
        std::lock_guard<std::mutex> lock(mu);
        t = newest;
        m = newest_marker;
      }
      SendToken(out, t);
      if (!WriteAll(out, &m, 4)) break;
    }
    stop = true;
    churn.join();
  });
  const size_t before = OpenFds();
  int ok = 0, stale = 0;
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (std::chrono::steady_clock::now() < end) {
    e.Go();
    FdToken t = ReadToken(e.from_child);
    uint32_t want = 0;
    ASSERT_TRUE(ReadAll(e.from_child, &want, 4));
    if (want == 0) continue;
    for (int k = 0; k < 4; ++k) {
      absl::StatusOr<std::vector<UniqueFd>> got = FetchFds({t}, FdFetch::kPidfd);
      if (got.ok()) {
        uint32_t have = 0;
        ASSERT_EQ(pread((*got)[0].get(), &have, 4, 0), 4);
        ASSERT_EQ(have, want) << "token of registration " << want << " fetched another file";
        ++ok;
      } else {
        ASSERT_THAT(got, StatusIs(absl::StatusCode::kNotFound));
        ++stale;
      }
    }
  }
  EXPECT_EQ(OpenFds(), before);
  EXPECT_EQ(e.Wait(), 0);
  EXPECT_GT(ok, 0) << "no fetch succeeded: nothing was checked";
  std::printf("ok=%d stale=%d\n", ok, stale);
}

// 6. Many thousands of registrations: fd numbers grow; each fetches its own file.
TEST(FdPidfdTest, ThousandsOfRegistrations) {
  if (!PidfdUsable()) GTEST_SKIP() << "no ptrace rights";
  constexpr int kN = 15000;
  rlimit limit{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &limit), 0);
  if (limit.rlim_max != RLIM_INFINITY && limit.rlim_max < kN + 1000) {
    GTEST_SKIP() << "the fd limit " << limit.rlim_max << " is below " << kN + 1000;
  }
  Forked e([](int out, int in) {
    rlimit raised{};
    getrlimit(RLIMIT_NOFILE, &raised);
    raised.rlim_cur = raised.rlim_max == RLIM_INFINITY ? kN + 1000 : raised.rlim_max;
    if (setrlimit(RLIMIT_NOFILE, &raised) != 0) _exit(94);
    std::vector<FdToken> tokens;
    for (uint32_t i = 0; i < kN; ++i) {
      UniqueFd fd(memfd_create("many", MFD_CLOEXEC));
      if (pwrite(fd.get(), &i, 4, 0) != 4) _exit(95);
      absl::StatusOr<FdToken> t = FdServer::Get().Register(std::move(fd));
      if (!t.ok()) _exit(96);
      tokens.push_back(*t);
    }
    for (uint32_t i = 0; i < kN; i += 997) SendToken(out, tokens[i]);
    WaitForGo(in);
  });
  for (uint32_t i = 0; i < kN; i += 997) {
    const FdToken t = ReadToken(e.from_child);
    ASSERT_OK_AND_ASSIGN(std::vector<UniqueFd> got, FetchFds({t}, FdFetch::kPidfd));
    uint32_t have = 0;
    ASSERT_EQ(pread(got[0].get(), &have, 4, 0), 4);
    EXPECT_EQ(have, i);
  }
  e.Go();
  EXPECT_EQ(e.Wait(), 0) << "(exit 95/96: register failed; raise the fd limit?)";
}

// 8. Rekey across processes: the old token goes stale, even once its number is reused.
TEST(FdPidfdTest, RekeyedOldTokenIsStaleNewOneFetches) {
  if (!PidfdUsable()) GTEST_SKIP() << "no ptrace rights";
  Forked e([](int out, int in) {
    FdToken old_token = *FdServer::Get().Register(Marked(8));
    FdToken new_token = *FdServer::Get().Rekey(old_token.key);
    FdToken other = *FdServer::Get().Register(Marked(9));  // takes the old number
    SendToken(out, old_token);
    SendToken(out, new_token);
    SendToken(out, other);
    WaitForGo(in);
  });
  const FdToken old_token = ReadToken(e.from_child);
  const FdToken new_token = ReadToken(e.from_child);
  const FdToken other = ReadToken(e.from_child);
  EXPECT_EQ(other.fd, old_token.fd);
  for (FdFetch how : {FdFetch::kPidfd, FdFetch::kSocket}) {
    EXPECT_THAT(FetchFds({old_token}, how), StatusIs(absl::StatusCode::kNotFound));
    ASSERT_OK_AND_ASSIGN(std::vector<UniqueFd> got, FetchFds({new_token, other}, how));
    EXPECT_EQ(FirstByte(got[0].get()), 8);
    EXPECT_EQ(FirstByte(got[1].get()), 9);
  }
  e.Go();
  EXPECT_EQ(e.Wait(), 0);
}

// 7. Decode is canonical on random bytes.
TEST(FdPidfdTest, DecodeIsCanonical) {
  std::mt19937 rng(7);
  FdToken base;
  base.boot_hash = BootHash();
  std::array<uint8_t, 64> header = base.Encode();
  for (int i = 0; i < 100000; ++i) {
    std::array<uint8_t, 64> bytes = header;
    for (size_t b = 12; b < 64; ++b) bytes[b] = static_cast<uint8_t>(rng());
    bytes[60] &= 1;
    ASSERT_OK_AND_ASSIGN(FdToken t, FdToken::Decode(bytes));
    ASSERT_EQ(t.Encode(), bytes);
  }
}

}  // namespace
}  // namespace vmm
