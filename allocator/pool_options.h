// pool_options.h: what a pool can be told, and the one parser of option text.
//
//   VMM_ASSIGN_OR_RETURN(PoolOptions o, ParsePoolOptions("handle_type=posix_fd,memory_limit=40G"));
//
// Option text is "key=value" pairs separated by commas (whitespace around keys and values is
// ignored). Keys are the field names below; sizes are read by ParseByteSize (K, M, G, T
// suffixes, powers of 1024; small_size, large_page, growth_page, growth_page_from and
// pressure_page also take "auto", spare_export_bytes "unlimited"); handle_type is
// auto|none|posix_fd|fabric; growth_fraction a number in [0, 1]; peer_devices device indices
// separated by ':' ("1:2"); isolate_sends 0, 1, false or true. An unknown key, a repeated
// key, a pair without '=', or a malformed value is InvalidArgument naming it.
#ifndef VMM_ALLOCATOR_POOL_OPTIONS_H_
#define VMM_ALLOCATOR_POOL_OPTIONS_H_

#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "allocator/handle_probe.h"

namespace vmm {

// A size option whose value the pool picks when it is created (option text: "auto"); see
// small_size and large_page.
inline constexpr size_t kAutoSize = std::numeric_limits<size_t>::max();
// The most bytes a size option that the pool rounds up or adds up may give (small_chunk,
// reserve_size, large_page, pressure_page): 2^48, 256 TiB, beyond any device and address
// range. More is InvalidArgument, from ParsePoolOptions and from Pool::Create.
inline constexpr size_t kMaxOptionBytes = size_t{1} << 48;
// A paged growth is made of chunks of several pages (growth_page) only for a request of at
// least growth_page_from bytes (by default kMultiPageRequestChunks growth chunks), and after
// the pool has moved memory only for one of at least kLargeRequestChunks growth chunks
// (PoolOptions::growth_page).
inline constexpr size_t kMultiPageRequestChunks = 4;
inline constexpr size_t kLargeRequestChunks = 32;
// reserve_size's default where the large arena grows in pages, in multiples of the GPU's
// memory (PoolOptions::reserve_size), and what is asked next where the driver refuses it.
inline constexpr size_t kPagedRangeDevices = 32;
inline constexpr size_t kPagedRangeFallbackDevices = 8;
// A range that grows (the default one, and range_grows) where even twice the GPU's memory is
// refused (the process's address space taken by many pools) is asked for an eighth, then a
// sixty-fourth, of its first size, each at least this much.
inline constexpr size_t kLeastGrowingRange = size_t{64} << 20;
// growth_page's default where the pool pages (and does not export): 32 MiB.
inline constexpr size_t kAutoGrowthPage = size_t{32} << 20;
// The pages a pool without pages switches to by default (pressure_page), and the most chunks
// a growth of one request makes there (its chunks are whole pages, a power of two of them).
inline constexpr size_t kAutoPressurePage = size_t{4} << 20;
inline constexpr size_t kPressureGrowthChunks = 64;

struct PoolOptions {
  int device = 0;
  HandleRequest handle_type = HandleRequest::kAuto;
  // Virtual address space to reserve; 0 (the default) means kPagedRangeDevices times the memory of
  // the device where the large arena grows in pages (large_page) or may come to (pressure_page,
  // the default for a pool without pages), else twice it
  // (kPagedRangeFallbackDevices times, then twice, where the driver or the process's address space
  // refuses the larger range: out of memory, or a size it takes for invalid), for the large arena
  // but an eighth of twice the memory, and the GPU's memory for the small arena, which then
  // holds every small chunk the device could (32.75 or 2.75 times the memory in all). The bounds on
  // small_chunk and small_size are those of twice in both cases (small_size at most an eighth of
  // it). An explicit reserve_size is the whole range: an eighth of it is the small arena's. Address
  // space is cheap, and a pool that moves pages needs much more of it than it holds: a block goes
  // where the address range has a gap as long as it, whatever physical memory is free elsewhere,
  // and the blocks that live on (a KV cache, a hidden state) are left scattered across the range as
  // memory moves around them. With twice the GPU's memory, 26 of 110 traces failed with "no gap"
  // on a device 1.1 times their peak (host replay; long_prefill with 10.1 GiB of a 17 GiB device in
  // the pool), none with eight times; but a long run of bench/traces.py mixed_lifetimes (8 and 32
  // times its length) still spread its long-lived blocks across eight times, and needs 14-16 and
  // 16-21 times its peak for its large arena (docs/DESIGN.md §2b, "Address space";
  // bench/address_space_test.sh). The range spent grows with a run's length there: a longer one may
  // still fill it, unless it grows (range_grows).
  size_t reserve_size = 0;
  // A range chosen by default (reserve_size 0) grows once no gap of it holds a request of
  // the large arena: the pool reserves more address space right after it (the large arena's
  // first size at a time, at least the request) and goes on, rather than fail with "no gap"
  // where memory could serve the request. Where the driver gives no address space there
  // (another mapping took it), the request fails as before. An explicit reserve_size is a
  // bound, unless `range_grows` is set, which also gives the small arena the GPU's memory
  // (the large arena keeping reserve_size but an eighth of it), as a default range does. Not
  // an option of the text: callers set it (the PyTorch plugin's private pools, which choose
  // their size). A range that grows, default or not, where the driver refuses even the size
  // above (the process's address space taken by many pools) starts at an eighth, then a
  // sixty-fourth, of it (kLeastGrowingRange at least), and grows from there.
  bool range_grows = false;
  // Most physical bytes the pool may hold; 0 means no limit beyond the size of the device.
  size_t memory_limit = 0;
  // Free bytes the pool keeps cached when it could release memory on Free; SIZE_MAX (or any
  // value past 2^63 - 1) keeps all.
  size_t release_threshold = SIZE_MAX;
  // Requests up to this many bytes are served by the small arena. Its chunks are shared by
  // many blocks, so one block that lives on keeps a whole chunk. kAutoSize (the default):
  // 256 KiB where the large arena grows in pages, else 1 MiB (PyTorch's small-block limit).
  // With pages, blocks of a few hundred KiB (KV-cache pages, per-step activations of a small
  // batch) go to the large arena, whose pages move once free (bench/traces.py rl_phases:
  // peak reserved / peak allocated 1.086 with 1 MiB, 1.021 with 256 KiB); without pages such
  // a block would pin the free space of a whole large chunk instead.
  // At most the small arena's least range (an eighth of reserve_size, by default of twice
  // the GPU's memory whatever the multiple, at least small_chunk): a request routed there
  // that the range cannot hold could never be served. More is InvalidArgument (Pool::Create).
  size_t small_size = kAutoSize;
  // The small arena grows by this much at a time (rounded up to granularity). At most half
  // the reserved range (rounded up to granularity): the small arena's range is at least one
  // small chunk, and a larger one would leave the large arena, which serves every request
  // above small_size, smaller than it (past the whole range, one granule). More is
  // InvalidArgument (Pool::Create).
  size_t small_chunk = size_t{2} << 20;
  // Growth in the large arena, where it does not grow in pages (large_page 0, and before a
  // switch to pressure_page), is at least this fraction of the bytes already reserved...
  // (On the training trace, bench/training_trace.py, 0.05 and 64 MiB give peak reserved / peak
  // allocated 1.0034 with 98 growths; exact growth (0) gives 1.0000 with 112. bench/README.md.)
  double growth_fraction = 0.05;
  // ...but never more than this many bytes beyond what the request needs.
  size_t max_growth_extra = size_t{64} << 20;
  // Largest single physical allocation (a growth without pages, AllocateShareable's block, a
  // small-arena chunk). A growth is one chunk up to this size: fewer chunks
  // make fewer driver calls, and an importer maps and grants access to one allocation much
  // faster than to several (on an H200, SetAccess over 8 GiB took 0.32 ms as one allocation,
  // 0.70 ms as eight of 1 GiB). The cost is that a chunk is released only when all of it is free.
  size_t max_chunk = size_t{64} << 30;
  // Size of the physical chunks behind the large arena's growth, its pages (rounded to
  // granularity; 0: off, growths are chunks of up to max_chunk, grown by growth_fraction; see
  // also growth_page). Memory in such chunks is what a miss can take from free space elsewhere
  // in the pool instead of growing it (reclaim_policy.h): a chunk wholly inside a free block
  // is unmapped there and mapped where the request goes; paged growth is exact
  // (growth_fraction and max_growth_extra do not apply). Smaller pages leave less free memory
  // stranded in partly used chunks; larger ones make fewer driver calls per byte grown or
  // moved, and give an exported block fewer handles. A growth is planned in half pages
  // (growth_policy.h PlanUnit; whole pages where half a page is not whole granules): its last
  // chunk may end in half a page.
  // kAutoSize (the default): 4 MiB for a pool made without an export observer (Pool::Create),
  // 0 for one made to export (CreateExportablePool, the PyTorch plugin's pools): an exported
  // block carries one handle per chunk it spans, and an importer's cost and open files grow
  // with them (3 GiB in 4 MiB pages is 768 handles). With 4 MiB pages (and growth_page_from)
  // peak reserved / peak allocated stayed within 1.0156 on 89 traces of 18 workload shapes,
  // host replay (docs/results/2026-12-04.md, "4 MiB pages"); 8 MiB pages passed 1.02 on 6 of
  // 61 of them (to 1.0318) for about half the driver calls.
  // Blocks from AllocateShareable keep chunks of their own (max_chunk at most).
  // At most max_chunk, compared as the pool uses them: large_page rounded up and max_chunk
  // rounded down to the granularity (max_chunk=3M,large_page=3M is a 4 MiB page and a
  // 2 MiB max_chunk at 2 MiB granules). More is InvalidArgument (Pool::Create).
  size_t large_page = kAutoSize;
  // Largest chunk of a paged growth made before the pool first moves memory (large_page set;
  // rounded down to whole pages, at least one, at most max_chunk; 0 without pages). A pool
  // that has never needed to move memory is filling up (a model loading, the first steps of
  // a loop) and what it frees serves its later requests as it lies, so its growths are made
  // of chunks of the largest power-of-two number of pages within the request and this size
  // (the last one what is left): on the GPU the driver's cost is per physical allocation (an
  // H200 spent about 30 us granting access and 15-35 us creating per chunk, whatever its
  // size: bench/replay's driver_ns), so fewer, larger chunks grow the pool several times
  // faster. Such a chunk
  // moves and is released only whole, so a small block left in one keeps the rest of it:
  // once a miss has moved memory (the workload churns), once a growth has failed for lack of
  // memory, and for any growth that would take the pool past half of what it may hold (its
  // memory_limit, its share of a memory fraction, the GPU's free memory), growth is in
  // single pages, which strand the least. The switch is never undone (not by EmptyCache).
  // After a move, a request of kLargeRequestChunks growth chunks or more (1 GiB by default)
  // still grows in them: such a block's end chunks hold at most a sixteenth of it, and its
  // chunks, once free, move at a quarter of the calls. Once a miss finds free memory in such a
  // chunk beside a live block (a block that did not fill its chunks, or one carved out of what
  // a freed block left in them), growth is in single pages for good: blocks of other sizes
  // reuse the chunks, and each one they share keeps its rest from moving (bench/traces.py
  // hf_generate, a prefill's K and V cache carved out of its freed temporaries of 1-3 GiB:
  // 1.0118-1.0577 over seeds 0-7 before, 1.0046-1.0102 after; the training trace, whose blocks
  // fill their chunks, still grows in them).
  // kAutoSize (the default): 32 MiB (kAutoGrowthPage, at least a page), one page for a pool
  // made to export (an exported block retires the whole of the chunks it spans); large_page
  // or less: every chunk one page. growth_page_from says for which requests.
  // (bench/traces.py, host replay at seed 0: the training trace grows with 1,338 driver calls
  // instead of 4,816; the other traces' peak ratios move by at most 0.003. Large requests in
  // growth chunks after a move, seeds 0-7: long_prefill 24,542-30,272 -> 16,113-21,742 calls
  // at peak ratios of 1.0016-1.0064 (from 1.0005-1.0037); rl_phases 7-8% fewer calls at two
  // seeds, the same ratios; the other traces unchanged. From 512 MiB on, churn passed 1.02 at
  // every seed, 1.043 at worst.)
  size_t growth_page = kAutoSize;
  // The smallest request whose growth is made of growth_page chunks (before the pool first
  // moves memory); smaller ones grow in single pages. A chunk of several pages made for a
  // block of a few of them outlives it: later blocks that do not fill it pin the rest (a
  // training loop whose activations are rarely whole pages stranded 2-3% that way, seed 1 of
  // bench/traces.py asr_training: 1.0318 with chunks of up to four 8 MiB pages for any
  // request, 1.0125 with single 4 MiB pages below 128 MiB). kAutoSize (the default):
  // kMultiPageRequestChunks growth chunks (128 MiB); 0: any request.
  size_t growth_page_from = kAutoSize;
  // Pages that a pool without pages (large_page 0) grows its large arena in once a growth
  // would take it past half of what it may hold (its memory_limit, its share of a memory
  // fraction, the GPU's free memory), and once a growth has failed for lack of memory; 0:
  // never, the large arena grows in single chunks for good. Single chunks give an exported
  // block one handle, but a chunk goes back only once all of it is free: blocks that reuse
  // part of what a freed one left, or that join a free neighbour in another chunk, pin chunk
  // after chunk, and near the GPU's capacity a request then finds no memory that a release
  // could take back (bench/traces.py mixed_lifetimes, host replay: out of memory at 1.1-1.3
  // times its peak, where PyTorch's allocator, whose segments never join, runs). From the
  // switch on the pool grows and moves as one with large_page set to this (exact growth:
  // growth_fraction no longer applies), so memory freed in the pages grown since can serve
  // any request again; what it holds in single chunks stays as it is. A growth there is made
  // of chunks of the fewest pages, a power of two, that keep it within kPressureGrowthChunks
  // (64) chunks: a block grown since and sent in place carries a handle per chunk it spans,
  // a handful where it was grown for itself (19,539 for a buffer of 55% of an H200 in single
  // 4 MiB pages, past the 16,384 one import maps), and a huge growth costs tens of driver
  // calls, not tens of thousands. Host replay: with single pages, churn at 1.12 times its
  // peak ran out of memory where chunks of up to 64 a growth ran it (1.0546), with a quarter
  // to a half of the calls on mixed_lifetimes (docs/results/2026-12-05.md). Not while the
  // pool keeps its memory (SetKeepMemory: nothing would move), so never in the plugin's
  // private pools. "Failed" is any growth that the retry after a release had to make (no
  // memory, or no gap). Counted in num_page_switches; never undone. Below half, each
  // large-arena growth asks the driver how much of the GPU is free (where no memory limit or
  // fraction decides it first). Such a pool reserves the range of one that moves pages
  // (reserve_size).
  // kAutoSize (the default): 4 MiB (kAutoPressurePage, at most max_chunk) where large_page is
  // 0. Where large_page is set there is nothing to switch to: pressure_page is not used (0).
  // Rounded up to the granularity; given, at most max_chunk (Pool::Create: InvalidArgument).
  size_t pressure_page = kAutoSize;
  // Other devices granted read-write access to every range the pool maps: each growth's
  // SetAccess lists the pool's device and these, so every chunk, also those mapped long after
  // the pool was made (and again after EmptyCache), can be used by kernels and copies on them
  // directly. Each must be another device of the driver (Pool::Create: InvalidArgument). On
  // CUDA the devices must be peer capable; where they are not, the growth's SetAccess fails and
  // so does the allocation that needed it. Driver::HasAccess tells what a chunk was granted.
  std::vector<int> peer_devices;
  // How many bytes of exported chunks are kept, once nothing in them is allocated and every
  // receiver of their sends has released its mapping, for the next shareable block (a send)
  // or allocation that fits one, instead of being released: that send then costs
  // no chunk creation, mapping, access grant or export (pool.h, "Reusing exported chunks").
  // Spare chunks are cached memory, as free blocks are: EmptyCache and a growth that fails
  // for lack of memory release them, and past twice the pool's allocated high a send that fits
  // none releases the oldest (pool.h). The default keeps all within that (SIZE_MAX;
  // "unlimited" in option text); a chunk larger than the cap is released once free; 0 turns
  // the reuse off.
  size_t spare_export_bytes = SIZE_MAX;
  // How a process's sends (torch.multiprocessing, vmm_export_send) carry a block that shares
  // a physical chunk with other live blocks. false (the default, PyTorch's model): in place,
  // the chunks exported with their neighbours, whose bytes the receiver can read, as a
  // receiver of PyTorch's IPC maps a whole cudaMalloc segment; the tensor keeps its address.
  // The chunks' free space retires while receivers map them and comes back once every
  // receiver has reported its release (Pool::SettleExport). true: such a block is first
  // moved to chunks of its own (a copy, and a new address: torch_plugin/process_state.h), so
  // a receiver sees no other tensor's bytes. Option text: 0, 1, false or true.
  bool isolate_sends = false;
};

// ParsePoolOptions applies option text (see the file comment) to `defaults` and returns the
// result. `device` is not an option: callers set it. Empty text gives `defaults`.
[[nodiscard]] absl::StatusOr<PoolOptions> ParsePoolOptions(absl::string_view text,
                                                           const PoolOptions& defaults = {});

// `options` with its kAutoSize fields decided (Pool::Create calls it): large_page 4 MiB, or 0
// for a pool made to export (`exportable`); small_size 256 KiB where the large arena then
// pages, else 1 MiB. Fields given explicitly are kept. growth_page and pressure_page stay
// kAutoSize: the pool decides them once its pages are rounded to the granularity (Pool::Init).
PoolOptions ResolveAutoSizes(const PoolOptions& options, bool exportable);

// The checks of `options` that need no driver (Pool::Create makes them first, and
// vmm_check_pool_options before any pool exists), InvalidArgument naming what is wrong:
// growth_fraction within [0, 1]; small_size, small_chunk and max_chunk positive; small_chunk
// and reserve_size at most kMaxOptionBytes; large_page, and pressure_page in a pool without
// pages, at most max_chunk (as ResolveAutoSizes decides them for `exportable`). The device,
// its peers and the granularity are checked when a pool is made.
absl::Status CheckPoolOptions(const PoolOptions& options, bool exportable);

// The keys ParsePoolOptions accepts, comma separated, for messages and documentation.
absl::string_view PoolOptionKeys();

}  // namespace vmm

#endif  // VMM_ALLOCATOR_POOL_OPTIONS_H_
