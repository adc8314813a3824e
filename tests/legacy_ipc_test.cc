// PyTorch's CUDA IPC handles of memory vmm did not allocate (torch_plugin/csrc/legacy_ipc.h):
// the handle as PyTorch writes and reads it, and one mapping per handle, opened by the first
// storage and closed by the last, whatever the order and however many threads.
#include "torch_plugin/csrc/legacy_ipc.h"

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace vmm_torch {
namespace {

std::string RawHandle(char fill) { return std::string(kCudaIpcHandleSize, fill); }

TEST(LegacyIpcTest, HandlesReadAsPyTorchReadsThem) {
  const std::string raw = RawHandle('\x07');
  const std::string encoded = EncodeLegacyIpcHandle(raw.data());
  ASSERT_EQ(encoded.size(), 2 + kCudaIpcHandleSize);
  EXPECT_EQ(encoded[0], 1) << "a version every PyTorch receiver takes";
  EXPECT_EQ(encoded[1], 'c');
  EXPECT_EQ(encoded.substr(2), raw);

  ParsedIpcHandle parsed = ParseIpcHandle(encoded);
  EXPECT_EQ(parsed.kind, IpcHandleKind::kCudaMalloc);
  EXPECT_EQ(parsed.raw, raw);
  // PyTorch's own version byte (2 in torch 2.11) reads the same.
  std::string v2 = encoded;
  v2[0] = 2;
  EXPECT_EQ(ParseIpcHandle(v2).raw, raw);
  // A bare handle (releases before the version byte), whatever its second byte.
  std::string bare = RawHandle('e');
  parsed = ParseIpcHandle(bare);
  EXPECT_EQ(parsed.kind, IpcHandleKind::kCudaMalloc);
  EXPECT_EQ(parsed.raw, bare);
  // PyTorch's expandable segments are not opened here.
  EXPECT_EQ(ParseIpcHandle(std::string("\x02" "e", 2) + std::string(40, 'x')).kind,
            IpcHandleKind::kExpandable);
  // vmm's descriptors, and anything else, go to vmm's import (which says what is wrong).
  EXPECT_EQ(ParseIpcHandle("VMMD" + std::string(100, '\0')).kind, IpcHandleKind::kVmm);
  EXPECT_EQ(ParseIpcHandle("VMMD" + std::string(60, 'c')).kind, IpcHandleKind::kVmm)
      << "a 64-byte descriptor is still vmm's";
  EXPECT_EQ(ParseIpcHandle("").kind, IpcHandleKind::kVmm);
  EXPECT_EQ(ParseIpcHandle(std::string("\x02" "c", 2) + "short").kind, IpcHandleKind::kVmm);
}

TEST(LegacyIpcTest, OneMappingPerHandleClosedWithItsLastStorage) {
  int opens = 0, closes = 0;
  std::vector<char> memory(2);
  LegacyIpcMappings mappings(
      [&](const std::string& raw, int) -> void* {
        if (raw == RawHandle('!')) throw std::runtime_error("invalid handle");
        ++opens;
        return &memory[raw == RawHandle('a') ? 0 : 1];
      },
      [&](void*, int) { ++closes; });
  std::shared_ptr<void> first = mappings.Open(RawHandle('a'), 0);
  std::shared_ptr<void> second = mappings.Open(RawHandle('a'), 0);
  EXPECT_EQ(first.get(), second.get()) << "two tensors of one segment share its mapping";
  EXPECT_EQ(opens, 1);
  std::shared_ptr<void> other = mappings.Open(RawHandle('b'), 0);
  EXPECT_NE(other.get(), first.get());
  EXPECT_EQ(opens, 2);
  EXPECT_EQ(mappings.size(), 2u);
  first.reset();
  EXPECT_EQ(closes, 0) << "another storage still uses the segment";
  second.reset();
  EXPECT_EQ(closes, 1);
  EXPECT_EQ(mappings.size(), 1u);
  // Opened again after its last storage went: a fresh mapping.
  std::shared_ptr<void> again = mappings.Open(RawHandle('a'), 0);
  EXPECT_EQ(opens, 3);
  // A handle the opener refuses keeps nothing and can be retried.
  EXPECT_THROW(mappings.Open(RawHandle('!'), 0), std::runtime_error);
  EXPECT_EQ(mappings.size(), 2u);
  again.reset();
  other.reset();
  EXPECT_EQ(closes, 3);
  EXPECT_EQ(mappings.size(), 0u);
}

// A close that throws (CUDA going at exit) is dropped: it ran in a shared_ptr's deleter,
// where an exception ends the process.
TEST(LegacyIpcTest, ACloserThatThrowsDoesNotEndTheProcess) {
  char memory = 0;
  int closes = 0;
  LegacyIpcMappings mappings([&](const std::string&, int) -> void* { return &memory; },
                             [&](void*, int) {
                               ++closes;
                               throw std::runtime_error("CUDA driver shutting down");
                             });
  std::shared_ptr<void> p = mappings.Open(RawHandle('a'), 0);
  p.reset();
  EXPECT_EQ(closes, 1);
  EXPECT_EQ(mappings.size(), 0u);
}

// Threads opening and dropping storages of the same few handles: the driver never sees a
// handle opened twice at once, and every open is closed.
TEST(LegacyIpcTest, ThreadsOpeningAndDroppingOneHandleNeverOpenItTwice) {
  std::mutex mu;
  std::map<std::string, int> open_now;
  std::atomic<int> opens{0}, closes{0}, twice{0};
  std::vector<char> memory(4);
  LegacyIpcMappings mappings(
      [&](const std::string& raw, int) -> void* {
        std::lock_guard<std::mutex> lock(mu);
        if (open_now[raw]++ > 0) ++twice;
        ++opens;
        return &memory[static_cast<unsigned char>(raw[0]) % memory.size()];
      },
      [&](void* ptr, int) {
        std::lock_guard<std::mutex> lock(mu);
        for (auto& entry : open_now) {
          if (&memory[static_cast<unsigned char>(entry.first[0]) % memory.size()] == ptr &&
              entry.second > 0) {
            --entry.second;
            break;
          }
        }
        ++closes;
      });
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 2000; ++i) {
        std::shared_ptr<void> a = mappings.Open(RawHandle(static_cast<char>('a' + (i + t) % 3)), 0);
        std::shared_ptr<void> b = mappings.Open(RawHandle(static_cast<char>('a' + i % 3)), 0);
        EXPECT_NE(a.get(), nullptr);
        EXPECT_NE(b.get(), nullptr);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(twice.load(), 0);
  EXPECT_EQ(opens.load(), closes.load());
  EXPECT_GT(opens.load(), 0);
  EXPECT_EQ(mappings.size(), 0u);
}

}  // namespace
}  // namespace vmm_torch
