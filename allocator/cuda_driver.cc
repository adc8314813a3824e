// cuda_driver.cc: the CUDA backend of the driver interface (see cuda_driver.h, driver.h).
//
// The only file of vmm that calls the CUDA driver. It is laid out as:
//   - CudaApi: the driver entry points vmm uses, listed once in VMM_CUDA_ENTRY_POINTS and
//     resolved once through cuGetProcAddress.
//   - LoadCudaApi(): dlopen("libcuda.so.1") and the resolution; FailedPrecondition when the
//     library or an entry point is missing.
//   - ScopedContext: makes a context current for one call and restores the previous one.
//   - CudaDriver: the Driver implementation.
//   - GetCudaDriver(): the process-wide instance.
//
// Contexts. The primary context of each device (the one the CUDA runtime and PyTorch use) is
// retained the first time a call needs it and kept for the life of the process; it is never
// released, so nothing is torn down at exit. Which context a call runs in:
//   - Calls that name a device (Create, GetMemInfo, CreateStream, CreateEvent,
//     SynchronizeDevice) run in the primary context of that device.
//   - Calls on an event, or on a stream that this backend created, run in the primary context
//     of the device it was created on (remembered in a small map).
//   - Calls that take only addresses or handles (Reserve, ReserveAt, Unreserve, Map, Unmap,
//     SetAccess, HasAccess, Release, Export, Import), and stream work on streams created elsewhere
//     (PyTorch's, or stream 0), run in the calling thread's current context when it has one:
//     virtual memory is process-wide, and a foreign stream belongs to whatever context the
//     caller works in.
//     A thread with no current context borrows a primary context: the lowest-numbered one
//     already retained, else device 0's. Borrowing one that exists avoids creating a context
//     (and the device memory it takes) on device 0 in a process that only uses device 3.
//   - Pure device queries (DeviceUuid, Granularity, SupportsHandleType) need no context and
//     use none, so looking at a device never creates a context on it.
// A context made current for a call is undone when the call returns, so the caller's thread
// state is left as it was.
//
// fork(): CUDA is not usable in a forked child, but vmm's code in a child may reach this
// backend's locks before it calls CUDA; it must then fail, not hang. mu_ guards maps only (no
// CUDA call is made under it) and is held across fork() (fork_guard.h, ForkLevel::kDriver).
// context_mu_ is held across cuDevicePrimaryCtxRetain and the making of the driver across
// cuInit: holding those across fork() could wait on CUDA's own fork handling, so they are not;
// the child, where none of the parent's threads runs, finds them free instead (reset by its
// fork handler; what they guard is published in one store).
//
// Streams: stream 0 is the legacy default stream of the context the call runs in; streams
// made by CreateStream are non-blocking (they do not synchronise with stream 0).
#include "allocator/cuda_driver.h"

#include <cuda.h>
#include <cudaTypedefs.h>
#include <dlfcn.h>
#include <fcntl.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/attributes.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "allocator/cuda_status.h"
#include "allocator/driver.h"
#include "allocator/driver_error.h"
#include "allocator/fork_guard.h"
#include "allocator/log.h"
#include "allocator/mutex.h"
#include "allocator/status_macros.h"
#include "allocator/unique_fd.h"

// Fabric handles (CU_MEM_HANDLE_TYPE_FABRIC) and cuGetProcAddress_v2 need CUDA 12.3 headers.
#if CUDA_VERSION < 12030
#error "vmm needs the CUDA 12.3 or newer toolkit headers (cuda.h, cudaTypedefs.h)"
#endif

namespace vmm {

// --- Status conversion (cuda_status.h) -----------------------------------------------------

absl::StatusCode CudaErrorCode(CUresult result) {
  switch (result) {
    case CUDA_SUCCESS:
      return absl::StatusCode::kOk;
    case CUDA_ERROR_OUT_OF_MEMORY:
      return absl::StatusCode::kResourceExhausted;
    case CUDA_ERROR_INVALID_VALUE:
    case CUDA_ERROR_INVALID_HANDLE:
    case CUDA_ERROR_INVALID_DEVICE:
    case CUDA_ERROR_NOT_FOUND:
      return absl::StatusCode::kInvalidArgument;
    case CUDA_ERROR_NOT_PERMITTED:
      return absl::StatusCode::kPermissionDenied;
    case CUDA_ERROR_NOT_SUPPORTED:
      return absl::StatusCode::kUnimplemented;
    case CUDA_ERROR_NOT_INITIALIZED:
    case CUDA_ERROR_DEINITIALIZED:
    case CUDA_ERROR_NO_DEVICE:
      return absl::StatusCode::kFailedPrecondition;
    case CUDA_ERROR_CAPTURED_EVENT:
    case CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED:
    case CUDA_ERROR_STREAM_CAPTURE_INVALIDATED:
    case CUDA_ERROR_STREAM_CAPTURE_MERGE:
    case CUDA_ERROR_STREAM_CAPTURE_UNMATCHED:
    case CUDA_ERROR_STREAM_CAPTURE_UNJOINED:
    case CUDA_ERROR_STREAM_CAPTURE_ISOLATION:
    case CUDA_ERROR_STREAM_CAPTURE_IMPLICIT:
    case CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD:
      return absl::StatusCode::kUnavailable;
    default:
      return absl::StatusCode::kInternal;
  }
}

absl::Status CudaErrorStatus(CUresult result, absl::string_view call, absl::string_view error_name,
                             absl::string_view description, absl::string_view context) {
  if (result == CUDA_SUCCESS) return absl::OkStatus();
  std::string message = absl::StrCat(call, ": ", error_name, " (", description, ")");
  if (!context.empty()) absl::StrAppend(&message, "; ", context);
  return WithDriverError(absl::Status(CudaErrorCode(result), message),
                         static_cast<int32_t>(result));
}

namespace {

// --- Entry points --------------------------------------------------------------------------

// cuCtxSynchronize took no argument until CUDA 13.0; asked for version 13.0 or later, a 13.0
// driver hands out cuCtxSynchronize_v2, which takes the context to synchronise. The table holds
// the signature of the headers' version; CudaDriver::CtxSynchronize() copes with older drivers.
#if CUDA_VERSION >= 13000
using CtxSynchronizeFn = PFN_cuCtxSynchronize_v13000;
#else
using CtxSynchronizeFn = PFN_cuCtxSynchronize_v2000;
#endif

// X(member, type): the driver function "cu" #member, called through a pointer of `type` (the
// typedef from cudaTypedefs.h of the version that cuGetProcAddress returns for CUDA_VERSION;
// the "_v2" functions such as cuMemGetInfo_v2 are looked up by their base name). Members drop
// the "cu" prefix because cuda.h defines several base names (cuMemGetInfo, cuStreamDestroy, ...)
// as macros.
#define VMM_CUDA_ENTRY_POINTS(X)                                             \
  X(Init, PFN_cuInit_v2000)                                                  \
  X(DriverGetVersion, PFN_cuDriverGetVersion_v2020)                          \
  X(GetErrorName, PFN_cuGetErrorName_v6000)                                  \
  X(GetErrorString, PFN_cuGetErrorString_v6000)                              \
  X(DeviceGet, PFN_cuDeviceGet_v2000)                                        \
  X(DeviceGetCount, PFN_cuDeviceGetCount_v2000)                              \
  X(DeviceGetUuid, PFN_cuDeviceGetUuid_v11040)                               \
  X(DeviceGetAttribute, PFN_cuDeviceGetAttribute_v2000)                      \
  X(DevicePrimaryCtxRetain, PFN_cuDevicePrimaryCtxRetain_v7000)              \
  X(DevicePrimaryCtxRelease, PFN_cuDevicePrimaryCtxRelease_v11000)           \
  X(CtxGetCurrent, PFN_cuCtxGetCurrent_v4000)                                \
  X(CtxSetCurrent, PFN_cuCtxSetCurrent_v4000)                                \
  X(CtxSynchronize, CtxSynchronizeFn)                                        \
  X(MemGetAllocationGranularity, PFN_cuMemGetAllocationGranularity_v10020)   \
  X(MemCreate, PFN_cuMemCreate_v10020)                                       \
  X(MemRelease, PFN_cuMemRelease_v10020)                                     \
  X(MemAddressReserve, PFN_cuMemAddressReserve_v10020)                       \
  X(MemAddressFree, PFN_cuMemAddressFree_v10020)                             \
  X(MemMap, PFN_cuMemMap_v10020)                                             \
  X(MemUnmap, PFN_cuMemUnmap_v10020)                                         \
  X(MemSetAccess, PFN_cuMemSetAccess_v10020)                                 \
  X(MemGetAccess, PFN_cuMemGetAccess_v10020)                                 \
  X(MemExportToShareableHandle, PFN_cuMemExportToShareableHandle_v10020)     \
  X(MemImportFromShareableHandle, PFN_cuMemImportFromShareableHandle_v10020) \
  X(MemGetInfo, PFN_cuMemGetInfo_v3020)                                      \
  X(StreamCreate, PFN_cuStreamCreate_v2000)                                  \
  X(StreamDestroy, PFN_cuStreamDestroy_v4000)                                \
  X(StreamSynchronize, PFN_cuStreamSynchronize_v2000)                        \
  X(StreamIsCapturing, PFN_cuStreamIsCapturing_v10000)                       \
  X(LaunchHostFunc, PFN_cuLaunchHostFunc_v10000)                             \
  X(EventCreate, PFN_cuEventCreate_v2000)                                    \
  X(EventDestroy, PFN_cuEventDestroy_v4000)                                  \
  X(EventRecord, PFN_cuEventRecord_v2000)                                    \
  X(EventQuery, PFN_cuEventQuery_v2000)                                      \
  X(EventSynchronize, PFN_cuEventSynchronize_v2000)                          \
  X(MemcpyAsync, PFN_cuMemcpyAsync_v4000)                                    \
  X(MemsetD8Async, PFN_cuMemsetD8Async_v3020)

// The resolved entry points. Filled once by LoadCudaApi() and read-only afterwards, so it is
// shared between threads without a lock. cuDevicePrimaryCtxRelease is resolved with the rest
// but not called: primary contexts are kept for the life of the process.
struct CudaApi {
#define VMM_CUDA_MEMBER(member, type) type member = nullptr;
  VMM_CUDA_ENTRY_POINTS(VMM_CUDA_MEMBER)
#undef VMM_CUDA_MEMBER
};

// The status for `result` from `call`, with the error's name and description from the driver.
// Works before cuInit (cuGetErrorName/cuGetErrorString need no initialisation) and for codes
// the driver does not know.
absl::Status ToStatus(const CudaApi& api, CUresult result, absl::string_view call,
                      absl::string_view context = {}) {
  if (result == CUDA_SUCCESS) return absl::OkStatus();
  const char* name = nullptr;
  const char* description = nullptr;
  if (api.GetErrorName == nullptr || api.GetErrorName(result, &name) != CUDA_SUCCESS) {
    name = nullptr;
  }
  if (api.GetErrorString == nullptr || api.GetErrorString(result, &description) != CUDA_SUCCESS) {
    description = nullptr;
  }
  const std::string unknown_name = absl::StrCat("CUresult ", static_cast<int>(result));
  return CudaErrorStatus(result, call, name != nullptr ? name : unknown_name,
                         description != nullptr ? description : "no description", context);
}

// "13.0" for 13000.
std::string VersionString(int version) {
  return absl::StrCat(version / 1000, ".", (version % 1000) / 10);
}

// Finds driver functions by name through cuGetProcAddress, the driver's own lookup, which
// picks the version of each function that matches the headers vmm was built with.
class ProcResolver {
 public:
  // Finds cuGetProcAddress in the opened library; FailedPrecondition when the driver is too
  // old to have it (before CUDA 11.3).
  static absl::StatusOr<ProcResolver> Open(void* library) {
    ProcResolver resolver;
    resolver.v2_ =
        reinterpret_cast<PFN_cuGetProcAddress_v12000>(dlsym(library, "cuGetProcAddress_v2"));
    if (resolver.v2_ == nullptr) {
      resolver.v1_ =
          reinterpret_cast<PFN_cuGetProcAddress_v11030>(dlsym(library, "cuGetProcAddress"));
    }
    if (resolver.v2_ == nullptr && resolver.v1_ == nullptr) {
      return absl::FailedPreconditionError(
          "no CUDA driver: libcuda.so.1 has no cuGetProcAddress (driver older than CUDA 11.3)");
    }
    return resolver;
  }

  // The address of `symbol` (a base name such as "cuMemGetInfo") in the version matching
  // CUDA_VERSION; nullptr when the driver has none, with the reason in `*why`.
  void* Find(const char* symbol, std::string* why) const {
    void* fn = nullptr;
    CUresult result;
    if (v2_ != nullptr) {
      CUdriverProcAddressQueryResult query = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
      result = v2_(symbol, &fn, CUDA_VERSION, CU_GET_PROC_ADDRESS_DEFAULT, &query);
      if (result == CUDA_SUCCESS && query != CU_GET_PROC_ADDRESS_SUCCESS) {
        *why = query == CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT
                   ? "the driver's version of it is older than the headers need"
                   : "symbol not found";
        return nullptr;
      }
    } else {
      result = v1_(symbol, &fn, CUDA_VERSION, CU_GET_PROC_ADDRESS_DEFAULT);
    }
    if (result != CUDA_SUCCESS || fn == nullptr) {
      *why = absl::StrCat("cuGetProcAddress returned CUresult ", static_cast<int>(result));
      return nullptr;
    }
    return fn;
  }

 private:
  PFN_cuGetProcAddress_v12000 v2_ = nullptr;
  PFN_cuGetProcAddress_v11030 v1_ = nullptr;
};

// Opens libcuda.so.1 and resolves every entry point. Calls only cuGetProcAddress and, for the
// message when an entry point is missing, cuDriverGetVersion: the driver is not yet initialised.
// The library stays loaded for the life of the process, also on failure: this runs at most
// once, and unloading a driver is never worth the risk.
absl::StatusOr<CudaApi> LoadCudaApi() {
  void* library = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (library == nullptr) {
    const char* error = dlerror();
    return absl::FailedPreconditionError(
        absl::StrCat("no CUDA driver: libcuda.so.1 could not be loaded (",
                     error != nullptr ? error : "unknown dlopen error", ")"));
  }
  VMM_ASSIGN_OR_RETURN(ProcResolver resolver, ProcResolver::Open(library));

  CudaApi api;
  std::string missing;  // "cuX (why)" for the first entry point that could not be found
#define VMM_CUDA_RESOLVE(member, type)                                               \
  if (missing.empty()) {                                                             \
    std::string why;                                                                 \
    api.member = reinterpret_cast<type>(resolver.Find("cu" #member, &why));          \
    if (api.member == nullptr) missing = absl::StrCat("cu" #member, " (", why, ")"); \
  }
  VMM_CUDA_ENTRY_POINTS(VMM_CUDA_RESOLVE)
#undef VMM_CUDA_RESOLVE

  if (!missing.empty()) {
    std::string version = "unknown";
    int driver_version = 0;
    if (api.DriverGetVersion != nullptr && api.DriverGetVersion(&driver_version) == CUDA_SUCCESS) {
      version = VersionString(driver_version);
    }
    return absl::FailedPreconditionError(absl::StrCat(
        "no CUDA driver: libcuda.so.1 (driver version ", version, ") lacks entry point ", missing,
        "; vmm was built against CUDA ", VersionString(CUDA_VERSION)));
  }
  return api;
}

// --- Contexts ------------------------------------------------------------------------------

// Makes a context current on the calling thread for the lifetime of the object, then restores
// the context that was current before. Enter() does nothing when the context is already
// current, so callers that already work in the right context (PyTorch's threads) pay one
// cuCtxGetCurrent and no switch.
class ScopedContext {
 public:
  explicit ScopedContext(const CudaApi& api) : api_(api) {}
  ~ScopedContext() {
    if (!switched_) return;
    CUresult result = api_.CtxSetCurrent(previous_);
    if (result != CUDA_SUCCESS) {
      LogError(
          ToStatus(api_, result, "cuCtxSetCurrent", "restoring the caller's context").ToString());
    }
  }
  ScopedContext(const ScopedContext&) = delete;
  ScopedContext& operator=(const ScopedContext&) = delete;

  // Makes `context` current. On failure the thread's context is unchanged.
  absl::Status Enter(CUcontext context) {
    CUcontext current = nullptr;
    VMM_RETURN_IF_ERROR(ToStatus(api_, api_.CtxGetCurrent(&current), "cuCtxGetCurrent"));
    if (current == context) return absl::OkStatus();
    VMM_RETURN_IF_ERROR(ToStatus(api_, api_.CtxSetCurrent(context), "cuCtxSetCurrent"));
    if (!switched_) {  // a second Enter() still restores the context from before the first
      previous_ = current;
      switched_ = true;
    }
    return absl::OkStatus();
  }

 private:
  const CudaApi& api_;
  bool switched_ = false;
  CUcontext previous_ = nullptr;
};

// --- Conversions ---------------------------------------------------------------------------

CUstream ToCuStream(Stream stream) { return reinterpret_cast<CUstream>(StreamHandle(stream)); }
CUevent ToCuEvent(Event event) { return reinterpret_cast<CUevent>(event); }

// The CUDA handle types for a mask of kPosixFdBit / kFabricBit.
CUmemAllocationHandleType ToCudaHandleTypes(uint32_t handle_types) {
  unsigned int types = CU_MEM_HANDLE_TYPE_NONE;
  if (handle_types & kPosixFdBit) types |= CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  if (handle_types & kFabricBit) types |= CU_MEM_HANDLE_TYPE_FABRIC;
  return static_cast<CUmemAllocationHandleType>(types);
}

// "none", "posix_fd", "fabric" or "posix_fd|fabric", for messages.
std::string HandleTypesName(uint32_t handle_types) {
  if (handle_types == (kPosixFdBit | kFabricBit)) return "posix_fd|fabric";
  if (handle_types == kPosixFdBit) return std::string(HandleTypeName(HandleType::kPosixFd));
  if (handle_types == kFabricBit) return std::string(HandleTypeName(HandleType::kFabric));
  return std::string(HandleTypeName(HandleType::kNone));
}

// Pinned device memory on `device`, exportable as `handle_types` (the CUDA mask).
CUmemAllocationProp DeviceAllocationProp(int device, CUmemAllocationHandleType handle_types) {
  CUmemAllocationProp prop;
  std::memset(&prop, 0, sizeof(prop));  // reserved fields and allocFlags must be zero
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.requestedHandleTypes = handle_types;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  return prop;
}

// "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" in lowercase hex, as nvidia-smi prints it.
std::string FormatUuid(const CUuuid& uuid) {
  std::string text = "GPU-";
  for (int i = 0; i < 16; ++i) {
    if (i == 4 || i == 6 || i == 8 || i == 10) text += '-';
    absl::StrAppendFormat(&text, "%02x", static_cast<unsigned char>(uuid.bytes[i]));
  }
  return text;
}

bool IsPowerOfTwo(size_t x) { return x != 0 && (x & (x - 1)) == 0; }

static_assert(sizeof(CUmemFabricHandle) == kFabricHandleSize,
              "FabricHandle must hold a CUmemFabricHandle exactly");
static_assert(sizeof(DevPtr) == sizeof(CUdeviceptr), "DevPtr must hold a CUdeviceptr");
static_assert(sizeof(PhysHandle) == sizeof(CUmemGenericAllocationHandle),
              "PhysHandle must hold a CUmemGenericAllocationHandle");
static_assert(sizeof(Stream) == sizeof(CUstream) && sizeof(Event) == sizeof(CUevent),
              "Stream and Event must hold CUstream and CUevent");

// --- The backend ---------------------------------------------------------------------------

class CudaDriver final : public Driver {
 public:
  // Loads the driver, initialises it and lists the devices. FailedPrecondition when there is
  // no driver or no device. The result is never deleted (see GetCudaDriver()).
  static absl::StatusOr<Driver*> Load();

  Backend backend() const override { return Backend::kCuda; }
  int DeviceCount() const override { return static_cast<int>(devices_.size()); }
  absl::StatusOr<std::string> DeviceUuid(int device) override;
  absl::StatusOr<size_t> Granularity(int device) override;
  absl::StatusOr<bool> SupportsHandleType(int device, HandleType type) override;
  absl::StatusOr<MemInfo> GetMemInfo(int device) override;

  absl::StatusOr<PhysHandle> Create(int device, size_t size, uint32_t handle_types) override;
  absl::Status Release(PhysHandle handle) override;

  absl::StatusOr<DevPtr> Reserve(size_t size, size_t alignment) override;
  absl::StatusOr<DevPtr> ReserveAt(DevPtr at, size_t size) override;
  absl::Status Unreserve(DevPtr ptr, size_t size) override;
  absl::Status Map(DevPtr ptr, size_t size, PhysHandle handle) override;
  absl::Status Unmap(DevPtr ptr, size_t size) override;
  absl::Status SetAccess(DevPtr ptr, size_t size, absl::Span<const int> devices) override;
  absl::StatusOr<bool> HasAccess(DevPtr ptr, int device) override;

  absl::StatusOr<ShareableHandle> Export(PhysHandle handle, HandleType type) override;
  absl::StatusOr<PhysHandle> Import(const ShareableHandle& handle) override;

  absl::StatusOr<Stream> CreateStream(int device) override;
  absl::Status DestroyStream(Stream stream) override;
  absl::Status SynchronizeStream(Stream stream) override;
  absl::StatusOr<bool> StreamCapturing(Stream stream) override;
  absl::Status SynchronizeDevice(int device) override;
  absl::StatusOr<Event> CreateEvent(int device) override;
  absl::Status DestroyEvent(Event event) override;
  absl::Status RecordEvent(Event event, Stream stream) override;
  absl::StatusOr<bool> EventDone(Event event) override;
  absl::Status SynchronizeEvent(Event event) override;

  absl::Status LaunchHostFunc(Stream stream, void (*fn)(void*), void* arg) override;
  absl::Status MemcpyAsync(DevPtr dst, DevPtr src, size_t bytes, Stream stream) override;
  absl::Status MemsetAsync(DevPtr dst, uint8_t value, size_t bytes, Stream stream) override;

 private:
  CudaDriver(const CudaApi& api, int driver_version, std::vector<CUdevice> devices)
      : api_(api),
        driver_version_(driver_version),
        devices_(std::move(devices)),
        contexts_(devices_.size(), nullptr),
        granularity_(devices_.size(), 0) {
    // Never destroyed (Load): registered for the life of the process (see the file comment).
    AtForkForever(ForkLevel::kDriver,
                  ForkHandlers{&LockForFork, &UnlockInParent, &UnlockInChild, this});
  }

  static void LockForFork(void* self) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    static_cast<CudaDriver*>(self)->mu_.Lock();
  }
  static void UnlockInParent(void* self) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    static_cast<CudaDriver*>(self)->mu_.Unlock();
  }
  static void UnlockInChild(void* self) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    auto* d = static_cast<CudaDriver*>(self);
    d->mu_.UnlockInForkChild();
    d->context_mu_.UnlockInForkChild();  // not held across fork(): reset (file comment)
  }

  // Synchronises `context`, which must be current, whichever cuCtxSynchronize the driver
  // handed out (see CtxSynchronizeFn).
  CUresult CtxSynchronize(CUcontext context) const;
  // The status for `result` from `call` (see ToStatus()).
  absl::Status Check(CUresult result, absl::string_view call,
                     absl::string_view context = {}) const {
    return ToStatus(api_, result, call, context);
  }
  // InvalidArgument unless 0 <= device < DeviceCount().
  absl::Status CheckDevice(int device) const;
  // InvalidArgument unless [ptr, ptr+size) is a nonempty range aligned to the granularity.
  // The driver's own answer to an unaligned size is not always CUDA_ERROR_INVALID_VALUE
  // (cuMemMap of half a granule gives CUDA_ERROR_NOT_SUPPORTED), hence the check up front.
  // Addresses carry no device, so device 0's granularity stands for all, as in Reserve().
  absl::Status CheckRange(absl::string_view call, DevPtr ptr, size_t size);
  // cuDeviceGetAttribute.
  absl::StatusOr<int> Attribute(int device, CUdevice_attribute attribute,
                                absl::string_view name) const;

  // The primary context of `device`, retained on first use and kept.
  absl::StatusOr<CUcontext> PrimaryContext(int device) ABSL_LOCKS_EXCLUDED(context_mu_);
  // Makes `device`'s primary context current within `scope`.
  absl::Status EnterDevice(int device, ScopedContext& scope) ABSL_LOCKS_EXCLUDED(context_mu_);
  // Leaves the thread's current context in place if there is one, else makes a borrowed
  // primary context current within `scope` (see the file comment).
  absl::Status EnterAnyContext(ScopedContext& scope) ABSL_LOCKS_EXCLUDED(context_mu_);
  // The context for work on `stream`: that of its device if this backend created it, else as
  // EnterAnyContext().
  absl::Status EnterStreamContext(Stream stream, ScopedContext& scope)
      ABSL_LOCKS_EXCLUDED(mu_, context_mu_);

  // The device a stream or event of this backend was created on; nullopt for others.
  std::optional<int> StreamDevice(Stream stream) ABSL_LOCKS_EXCLUDED(mu_);
  std::optional<int> EventDevice(Event event) ABSL_LOCKS_EXCLUDED(mu_);
  // EventDevice(), or InvalidArgument naming `call` for an event this backend did not create
  // (or already destroyed): such a handle is never given to the driver.
  absl::StatusOr<int> KnownEventDevice(Event event, absl::string_view call)
      ABSL_LOCKS_EXCLUDED(mu_);

  const CudaApi api_;
  const int driver_version_;             // e.g. 13000 for CUDA 13.0
  const std::vector<CUdevice> devices_;  // by ordinal; fixed at initialisation

  // Held while a primary context is retained, which can take a while; separate from mu_ so
  // that the stream and event maps stay quick meanwhile.
  Mutex context_mu_;
  std::vector<CUcontext> contexts_ ABSL_GUARDED_BY(context_mu_);  // nullptr until retained

  Mutex mu_;
  std::vector<size_t> granularity_ ABSL_GUARDED_BY(mu_);  // 0 until first asked for
  absl::flat_hash_map<Stream, int> stream_devices_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<Event, int> event_devices_ ABSL_GUARDED_BY(mu_);
  // The size of each allocation Create made and Release has not dropped, so that Map refuses
  // part of one itself (driver.h: a mapping is of a whole allocation). Imported handles carry
  // no size the driver tells; their Map goes to the driver as it is.
  absl::flat_hash_map<PhysHandle, size_t> created_sizes_ ABSL_GUARDED_BY(mu_);
};

absl::StatusOr<Driver*> CudaDriver::Load() {
  VMM_ASSIGN_OR_RETURN(CudaApi api, LoadCudaApi());

  CUresult result = api.Init(0);
  if (result != CUDA_SUCCESS) {
    return absl::FailedPreconditionError(
        absl::StrCat("no CUDA device: ", ToStatus(api, result, "cuInit").message()));
  }
  int driver_version = 0;
  VMM_RETURN_IF_ERROR(ToStatus(api, api.DriverGetVersion(&driver_version), "cuDriverGetVersion"));
  int count = 0;
  VMM_RETURN_IF_ERROR(ToStatus(api, api.DeviceGetCount(&count), "cuDeviceGetCount"));
  if (count <= 0) {
    return absl::FailedPreconditionError("no CUDA device: cuDeviceGetCount reported none");
  }
  std::vector<CUdevice> devices(count);
  for (int i = 0; i < count; ++i) {
    VMM_RETURN_IF_ERROR(
        ToStatus(api, api.DeviceGet(&devices[i], i), "cuDeviceGet", absl::StrCat("ordinal ", i)));
  }
  return new CudaDriver(api, driver_version, std::move(devices));
}

absl::Status CudaDriver::CheckDevice(int device) const {
  if (device >= 0 && device < DeviceCount()) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("CUDA device ", device, " out of range (", DeviceCount(), " devices)"));
}

absl::Status CudaDriver::CheckRange(absl::string_view call, DevPtr ptr, size_t size) {
  VMM_ASSIGN_OR_RETURN(size_t granularity, Granularity(0));
  if (ptr == 0 || size == 0 || ptr % granularity != 0 || size % granularity != 0 ||
      ptr + size < ptr) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: [0x%x, +%d) is not a nonempty range aligned to the granularity %d",
                        call, ptr, size, granularity));
  }
  return absl::OkStatus();
}

absl::StatusOr<int> CudaDriver::Attribute(int device, CUdevice_attribute attribute,
                                          absl::string_view name) const {
  int value = 0;
  VMM_RETURN_IF_ERROR(Check(api_.DeviceGetAttribute(&value, attribute, devices_[device]),
                            "cuDeviceGetAttribute", absl::StrCat(name, ", device ", device)));
  return value;
}

// --- Contexts --------------------------------------------------------------------------------

absl::StatusOr<CUcontext> CudaDriver::PrimaryContext(int device) {
  MutexLock lock(&context_mu_);
  if (contexts_[device] == nullptr) {
    CUcontext context = nullptr;
    VMM_RETURN_IF_ERROR(Check(api_.DevicePrimaryCtxRetain(&context, devices_[device]),
                              "cuDevicePrimaryCtxRetain", absl::StrCat("device ", device)));
    contexts_[device] = context;
  }
  return contexts_[device];
}

absl::Status CudaDriver::EnterDevice(int device, ScopedContext& scope) {
  VMM_ASSIGN_OR_RETURN(CUcontext context, PrimaryContext(device));
  return scope.Enter(context);
}

absl::Status CudaDriver::EnterAnyContext(ScopedContext& scope) {
  CUcontext current = nullptr;
  VMM_RETURN_IF_ERROR(Check(api_.CtxGetCurrent(&current), "cuCtxGetCurrent"));
  if (current != nullptr) return absl::OkStatus();
  CUcontext borrowed = nullptr;
  {
    MutexLock lock(&context_mu_);
    for (CUcontext context : contexts_) {
      if (context != nullptr) {
        borrowed = context;
        break;
      }
    }
  }
  if (borrowed == nullptr) {
    VMM_ASSIGN_OR_RETURN(borrowed, PrimaryContext(0));
  }
  return scope.Enter(borrowed);
}

absl::Status CudaDriver::EnterStreamContext(Stream stream, ScopedContext& scope) {
  if (std::optional<int> device = StreamDevice(stream)) return EnterDevice(*device, scope);
  return EnterAnyContext(scope);
}

std::optional<int> CudaDriver::StreamDevice(Stream stream) {
  stream = StreamHandle(stream);
  if (stream == 0) return std::nullopt;
  MutexLock lock(&mu_);
  auto it = stream_devices_.find(stream);
  if (it == stream_devices_.end()) return std::nullopt;
  return it->second;
}

std::optional<int> CudaDriver::EventDevice(Event event) {
  MutexLock lock(&mu_);
  auto it = event_devices_.find(event);
  if (it == event_devices_.end()) return std::nullopt;
  return it->second;
}

absl::StatusOr<int> CudaDriver::KnownEventDevice(Event event, absl::string_view call) {
  if (std::optional<int> device = EventDevice(event)) return *device;
  return absl::InvalidArgumentError(absl::StrFormat(
      "%s: event 0x%x was not created by this driver or was destroyed", call, event));
}

// --- Device queries ------------------------------------------------------------------------

absl::StatusOr<std::string> CudaDriver::DeviceUuid(int device) {
  VMM_RETURN_IF_ERROR(CheckDevice(device));
  CUuuid uuid;
  std::memset(&uuid, 0, sizeof(uuid));
  VMM_RETURN_IF_ERROR(Check(api_.DeviceGetUuid(&uuid, devices_[device]), "cuDeviceGetUuid",
                            absl::StrCat("device ", device)));
  return FormatUuid(uuid);
}

absl::StatusOr<size_t> CudaDriver::Granularity(int device) {
  VMM_RETURN_IF_ERROR(CheckDevice(device));
  {
    MutexLock lock(&mu_);
    if (granularity_[device] != 0) return granularity_[device];
  }
  // Two threads may both query on first use; they get the same answer.
  const CUmemAllocationProp prop = DeviceAllocationProp(device, CU_MEM_HANDLE_TYPE_NONE);
  size_t granularity = 0;
  VMM_RETURN_IF_ERROR(Check(
      api_.MemGetAllocationGranularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
      "cuMemGetAllocationGranularity", absl::StrCat("device ", device)));
  if (!IsPowerOfTwo(granularity)) {
    return absl::InternalError(absl::StrCat("cuMemGetAllocationGranularity: device ", device,
                                            " reported ", granularity,
                                            " bytes, not a power of two"));
  }
  MutexLock lock(&mu_);
  granularity_[device] = granularity;
  return granularity;
}

absl::StatusOr<bool> CudaDriver::SupportsHandleType(int device, HandleType type) {
  VMM_RETURN_IF_ERROR(CheckDevice(device));
  VMM_ASSIGN_OR_RETURN(int vmm,
                       Attribute(device, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                                 "VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED"));
  if (vmm == 0) return false;
  switch (type) {
    case HandleType::kNone:  // unshareable memory needs only virtual memory management
      return true;
    case HandleType::kPosixFd: {
      VMM_ASSIGN_OR_RETURN(
          int supported,
          Attribute(device, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
                    "HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED"));
      return supported != 0;
    }
    case HandleType::kFabric: {
      int supported = 0;
      CUresult result = api_.DeviceGetAttribute(
          &supported, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED, devices_[device]);
      // A driver that predates the attribute (before 12.3) rejects it: no fabric support.
      if (result == CUDA_ERROR_INVALID_VALUE) return false;
      VMM_RETURN_IF_ERROR(Check(result, "cuDeviceGetAttribute",
                                absl::StrCat("HANDLE_TYPE_FABRIC_SUPPORTED, device ", device)));
      return supported != 0;
    }
  }
  return absl::InvalidArgumentError(
      absl::StrCat("SupportsHandleType: unknown handle type ", static_cast<int>(type)));
}

absl::StatusOr<MemInfo> CudaDriver::GetMemInfo(int device) {
  VMM_RETURN_IF_ERROR(CheckDevice(device));
  ScopedContext scope(api_);
  VMM_RETURN_IF_ERROR(EnterDevice(device, scope));
  MemInfo info;
  VMM_RETURN_IF_ERROR(Check(api_.MemGetInfo(&info.free, &info.total), "cuMemGetInfo",
                            absl::StrCat("device ", device)));
  return info;
}

// --- Physical memory -----------------------------------------------------------------------

absl::StatusOr<PhysHandle> CudaDriver::Create(int device, size_t size, uint32_t handle_types) {
  VMM_RETURN_IF_ERROR(CheckDevice(device));
  if ((handle_types & ~(kPosixFdBit | kFabricBit)) != 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("Create: unknown handle type bits 0x%x", handle_types));
  }
  VMM_ASSIGN_OR_RETURN(size_t granularity, Granularity(device));
  if (size == 0 || size % granularity != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Create: size ", size, " is not a positive multiple of the granularity ", granularity));
  }
  ScopedContext scope(api_);
  VMM_RETURN_IF_ERROR(EnterDevice(device, scope));
  const CUmemAllocationProp prop = DeviceAllocationProp(device, ToCudaHandleTypes(handle_types));
  CUmemGenericAllocationHandle handle = 0;
  CUresult result = api_.MemCreate(&handle, size, &prop, 0);
  if (result == CUDA_SUCCESS) {
    MutexLock lock(&mu_);
    created_sizes_[PhysHandle{handle}] = size;
    return PhysHandle{handle};
  }

  std::string context = absl::StrCat("device ", device, ", ", size, " bytes, handle types ",
                                     HandleTypesName(handle_types));
  if (result == CUDA_ERROR_NOT_PERMITTED && (handle_types & kFabricBit) != 0) {
    absl::StrAppend(&context,
                    "; fabric-exportable memory needs access to an IMEX channel "
                    "(/dev/nvidia-caps-imex-channels/channel<N>), which this process lacks");
  }
  return Check(result, "cuMemCreate", context);
}

absl::Status CudaDriver::Release(PhysHandle handle) {
  if (handle == 0) return absl::InvalidArgumentError("Release: null handle");
  ScopedContext scope(api_);
  VMM_RETURN_IF_ERROR(EnterAnyContext(scope));
  VMM_RETURN_IF_ERROR(
      Check(api_.MemRelease(handle), "cuMemRelease", absl::StrFormat("handle 0x%x", handle)));
  MutexLock lock(&mu_);
  created_sizes_.erase(handle);
  return absl::OkStatus();
}

// --- Virtual address ranges ----------------------------------------------------------------

absl::StatusOr<DevPtr> CudaDriver::Reserve(size_t size, size_t alignment) {
  VMM_ASSIGN_OR_RETURN(size_t granularity, Granularity(0));
  if (size == 0 || size % granularity != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Reserve: size ", size, " is not a positive multiple of the granularity ", granularity));
  }
  if (alignment != 0 && !IsPowerOfTwo(alignment)) {
    return absl::InvalidArgumentError(
        absl::StrCat("Reserve: alignment ", alignment, " is not a power of two"));
  }
  if (alignment == 0) alignment = granularity;
  ScopedContext scope(api_);
  VMM_RETURN_IF_ERROR(EnterAnyContext(scope));
  CUdeviceptr ptr = 0;
  VMM_RETURN_IF_ERROR(Check(api_.MemAddressReserve(&ptr, size, alignment, 0, 0),
                            "cuMemAddressReserve",
                            absl::StrCat(size, " bytes, alignment ", alignment)));
  return DevPtr{ptr};
}

absl::StatusOr<DevPtr> CudaDriver::ReserveAt(DevPtr at, size_t size) {
  VMM_RETURN_IF_ERROR(CheckRange("ReserveAt", at, size));
  VMM_ASSIGN_OR_RETURN(size_t granularity, Granularity(0));
  ScopedContext scope(api_);
  VMM_RETURN_IF_ERROR(EnterAnyContext(scope));
  // cuMemAddressReserve takes the address as a request: where it is taken, the driver
  // reserves elsewhere, and that range is given back.
  CUdeviceptr ptr = 0;
  absl::Status reserved =
      Check(api_.MemAddressReserve(&ptr, size, granularity, at, 0), "cuMemAddressReserve",
            absl::StrFormat("at 0x%x, %d bytes", at, size));
  // The size and address were checked above: the driver refusing them means the address
  // space there is not to be had (driver.h: ResourceExhausted).
  if (absl::IsInvalidArgument(reserved)) {
    return absl::ResourceExhaustedError(absl::StrCat("ReserveAt: ", reserved.message()));
  }
  VMM_RETURN_IF_ERROR(reserved);
  if (ptr != at) {
    absl::Status freed = Check(api_.MemAddressFree(ptr, size), "cuMemAddressFree",
                               absl::StrFormat("0x%x, %d bytes", ptr, size));
    if (!freed.ok()) {
      return absl::InternalError(absl::StrFormat(
          "ReserveAt: the driver placed [0x%x, +%d) elsewhere, at 0x%x, and giving that back "
          "failed (the range stays reserved): %s",
          at, size, ptr, freed.message()));
    }
    return absl::ResourceExhaustedError(absl::StrFormat(
        "ReserveAt: [0x%x, +%d) is not free address space (the driver offered 0x%x)", at, size,
        ptr));
  }
  return DevPtr{ptr};
}

absl::Status CudaDriver::Unreserve(DevPtr ptr, size_t size) {
  VMM_RETURN_IF_ERROR(CheckRange("Unreserve", ptr, size));
  ScopedContext scope(api_);
  VMM_RETURN_IF_ERROR(EnterAnyContext(scope));
  return Check(api_.MemAddressFree(ptr, size), "cuMemAddressFree",
               absl::StrFormat("0x%x, %d bytes", ptr, size));
}

absl::Status CudaDriver::Map(DevPtr ptr, size_t size, PhysHandle handle) {
  VMM_RETURN_IF_ERROR(CheckRange("Map", ptr, size));
  if (handle == 0) return absl::InvalidArgumentError("Map: null handle");
  ScopedContext scope(api_);
  VMM_RETURN_IF_ERROR(EnterAnyContext(scope));
  {
    MutexLock lock(&mu_);
    auto it = created_sizes_.find(handle);
    if (it != created_sizes_.end()) {
      VMM_RETURN_IF_ERROR(CheckMapsWholeAllocation("Map", size, handle, it->second));
    }
  }
  std::string what = absl::StrFormat("0x%x, %d bytes, handle 0x%x", ptr, size, handle);
  const CUresult result = api_.MemMap(ptr, size, /*offset=*/0, handle, /*flags=*/0);
  if (result == CUDA_ERROR_NOT_SUPPORTED) {
    // How driver 580 refused part of an allocation; an imported one's size is not known here.
    absl::StrAppend(&what, "; is the size the whole allocation's?");
  }
  return Check(result, "cuMemMap", what);
}

absl::Status CudaDriver::Unmap(DevPtr ptr, size_t size) {
  VMM_RETURN_IF_ERROR(CheckRange("Unmap", ptr, size));
  ScopedContext scope(api_);
  VMM_RETURN_IF_ERROR(EnterAnyContext(scope));
  return Check(api_.MemUnmap(ptr, size), "cuMemUnmap",
               absl::StrFormat("0x%x, %d bytes", ptr, size));
}

absl::Status CudaDriver::SetAccess(DevPtr ptr, size_t size, absl::Span<const int> devices) {
  VMM_RETURN_IF_ERROR(CheckRange("SetAccess", ptr, size));
  if (devices.empty()) return absl::InvalidArgumentError("SetAccess: no devices given");
  std::vector<CUmemAccessDesc> descs;
  descs.reserve(devices.size());
  for (int device : devices) {
    VMM_RETURN_IF_ERROR(CheckDevice(device));
    bool seen = false;  // one descriptor per device, even if the caller repeats one
    for (const CUmemAccessDesc& desc : descs) seen = seen || desc.location.id == device;
    if (seen) continue;
    CUmemAccessDesc desc;
    std::memset(&desc, 0, sizeof(desc));
    desc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    desc.location.id = device;
    desc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    descs.push_back(desc);
  }
  ScopedContext scope(api_);
  VMM_RETURN_IF_ERROR(EnterAnyContext(scope));
  return Check(api_.MemSetAccess(ptr, size, descs.data(), descs.size()), "cuMemSetAccess",
               absl::StrFormat("0x%x, %d bytes, %d devices", ptr, size, descs.size()));
}

absl::StatusOr<bool> CudaDriver::HasAccess(DevPtr ptr, int device) {
  VMM_RETURN_IF_ERROR(CheckDevice(device));
  if (ptr == 0) return absl::InvalidArgumentError("HasAccess: null address");
  CUmemLocation location;
  std::memset(&location, 0, sizeof(location));
  location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  location.id = device;
  unsigned long long flags = 0;  // NOLINT(runtime/int): the driver's type
  ScopedContext scope(api_);
  VMM_RETURN_IF_ERROR(EnterAnyContext(scope));
  // An address that is not mapped gives CUDA_ERROR_INVALID_VALUE (InvalidArgument).
  VMM_RETURN_IF_ERROR(Check(api_.MemGetAccess(&flags, &location, ptr), "cuMemGetAccess",
                            absl::StrFormat("0x%x, device %d", ptr, device)));
  return flags == CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
}

// --- Sharing -------------------------------------------------------------------------------

absl::StatusOr<ShareableHandle> CudaDriver::Export(PhysHandle handle, HandleType type) {
  if (handle == 0) return absl::InvalidArgumentError("Export: null handle");
  if (type != HandleType::kPosixFd && type != HandleType::kFabric) {
    return absl::InvalidArgumentError(
        absl::StrCat("Export: cannot export as handle type ", HandleTypeName(type)));
  }
  ScopedContext scope(api_);
  VMM_RETURN_IF_ERROR(EnterAnyContext(scope));
  const std::string context =
      absl::StrFormat("handle 0x%x as %s (the type must have been requested at Create)", handle,
                      HandleTypeName(type));
  ShareableHandle out;
  out.type = type;
  if (type == HandleType::kPosixFd) {
    int fd = -1;
    VMM_RETURN_IF_ERROR(Check(
        api_.MemExportToShareableHandle(&fd, handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
        "cuMemExportToShareableHandle", context));
    out.fd.reset(fd);  // ours to close
    // Not passed to programs the process execs (the driver does not promise it): a copy there
    // would hold the allocation on the GPU for that program's life.
    if (::fcntl(fd, F_SETFD, FD_CLOEXEC) != 0) {
      const int err = errno;
      return absl::ErrnoToStatus(err, absl::StrCat("fcntl(F_SETFD, FD_CLOEXEC) on the fd of ",
                                                   context));
    }
  } else {
    CUmemFabricHandle fabric;
    std::memset(&fabric, 0, sizeof(fabric));
    VMM_RETURN_IF_ERROR(
        Check(api_.MemExportToShareableHandle(&fabric, handle, CU_MEM_HANDLE_TYPE_FABRIC, 0),
              "cuMemExportToShareableHandle", context));
    std::memcpy(out.fabric.data(), fabric.data, kFabricHandleSize);
  }
  return out;
}

absl::StatusOr<PhysHandle> CudaDriver::Import(const ShareableHandle& handle) {
  // The POSIX fd is passed by value in the pointer argument, as the driver API specifies; the
  // driver does not take ownership of it, so the caller still closes it.
  void* os_handle = nullptr;
  CUmemAllocationHandleType type = CU_MEM_HANDLE_TYPE_NONE;
  CUmemFabricHandle fabric;
  std::memset(&fabric, 0, sizeof(fabric));
  std::string context;
  switch (handle.type) {
    case HandleType::kPosixFd:
      if (!handle.fd.valid()) return absl::InvalidArgumentError("Import: invalid fd");
      os_handle = reinterpret_cast<void*>(static_cast<uintptr_t>(handle.fd.get()));
      type = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
      context = absl::StrCat("posix_fd ", handle.fd.get());
      break;
    case HandleType::kFabric:
      std::memcpy(fabric.data, handle.fabric.data(), kFabricHandleSize);
      os_handle = &fabric;
      type = CU_MEM_HANDLE_TYPE_FABRIC;
      context = "fabric handle";
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("Import: cannot import handle type ", HandleTypeName(handle.type)));
  }
  ScopedContext scope(api_);
  VMM_RETURN_IF_ERROR(EnterAnyContext(scope));
  CUmemGenericAllocationHandle imported = 0;
  CUresult result = api_.MemImportFromShareableHandle(&imported, os_handle, type);
  if (result == CUDA_SUCCESS) return PhysHandle{imported};

  if (handle.type == HandleType::kPosixFd) {
    // An fd that is not an exported allocation gives CUDA_ERROR_UNKNOWN on driver 580.
    absl::StrAppend(&context, "; is it a descriptor from cuMemExportToShareableHandle?");
  } else {
    if (result == CUDA_ERROR_NOT_PERMITTED) {
      absl::StrAppend(&context,
                      "; the importer needs access to the exporter's IMEX channel "
                      "(/dev/nvidia-caps-imex-channels/channel<N>)");
    } else if (result == CUDA_ERROR_NOT_SUPPORTED || result == CUDA_ERROR_INVALID_VALUE) {
      absl::StrAppend(&context,
                      "; the handle is stale (its memory was freed), forged, from outside this "
                      "IMEX domain, or fabric memory is not supported here");
    }
  }
  return Check(result, "cuMemImportFromShareableHandle", context);
}

// --- Streams and events --------------------------------------------------------------------

absl::StatusOr<Stream> CudaDriver::CreateStream(int device) {
  VMM_RETURN_IF_ERROR(CheckDevice(device));
  ScopedContext scope(api_);
  VMM_RETURN_IF_ERROR(EnterDevice(device, scope));
  CUstream stream = nullptr;
  VMM_RETURN_IF_ERROR(Check(api_.StreamCreate(&stream, CU_STREAM_NON_BLOCKING), "cuStreamCreate",
                            absl::StrCat("device ", device)));
  const Stream id = reinterpret_cast<Stream>(stream);
  MutexLock lock(&mu_);
  stream_devices_[id] = device;
  return id;
}

absl::Status CudaDriver::DestroyStream(Stream stream) {
  std::optional<int> device = StreamDevice(stream);
  if (!device.has_value()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "DestroyStream: stream 0x%x was not created by this driver or was destroyed", stream));
  }
  ScopedContext scope(api_);
  VMM_RETURN_IF_ERROR(EnterDevice(*device, scope));
  VMM_RETURN_IF_ERROR(Check(api_.StreamDestroy(ToCuStream(stream)), "cuStreamDestroy"));
  MutexLock lock(&mu_);
  stream_devices_.erase(StreamHandle(stream));
  return absl::OkStatus();
}

absl::Status CudaDriver::SynchronizeStream(Stream stream) {
  ScopedContext scope(api_);
  VMM_RETURN_IF_ERROR(EnterStreamContext(stream, scope));
  return Check(api_.StreamSynchronize(ToCuStream(stream)), "cuStreamSynchronize");
}

absl::StatusOr<bool> CudaDriver::StreamCapturing(Stream stream) {
  ScopedContext scope(api_);
  VMM_RETURN_IF_ERROR(EnterStreamContext(stream, scope));
  CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
  VMM_RETURN_IF_ERROR(
      Check(api_.StreamIsCapturing(ToCuStream(stream), &status), "cuStreamIsCapturing"));
  return status != CU_STREAM_CAPTURE_STATUS_NONE;
}

absl::Status CudaDriver::SynchronizeDevice(int device) {
  VMM_RETURN_IF_ERROR(CheckDevice(device));
  VMM_ASSIGN_OR_RETURN(CUcontext context, PrimaryContext(device));
  ScopedContext scope(api_);
  VMM_RETURN_IF_ERROR(scope.Enter(context));
  return Check(CtxSynchronize(context), "cuCtxSynchronize", absl::StrCat("device ", device));
}

CUresult CudaDriver::CtxSynchronize(CUcontext context) const {
#if CUDA_VERSION >= 13000
  if (driver_version_ >= 13000) return api_.CtxSynchronize(context);
  // A driver older than 13.0 handed out the version without an argument. (Converting through
  // void (*)(), the generic function pointer type, says that the type change is meant.)
  return reinterpret_cast<PFN_cuCtxSynchronize_v2000>(
      reinterpret_cast<void (*)()>(api_.CtxSynchronize))();
#else
  static_cast<void>(context);  // current already
  return api_.CtxSynchronize();
#endif
}

absl::StatusOr<Event> CudaDriver::CreateEvent(int device) {
  VMM_RETURN_IF_ERROR(CheckDevice(device));
  ScopedContext scope(api_);
  VMM_RETURN_IF_ERROR(EnterDevice(device, scope));
  CUevent event = nullptr;
  VMM_RETURN_IF_ERROR(Check(api_.EventCreate(&event, CU_EVENT_DISABLE_TIMING), "cuEventCreate",
                            absl::StrCat("device ", device)));
  const Event id = reinterpret_cast<Event>(event);
  MutexLock lock(&mu_);
  event_devices_[id] = device;
  return id;
}

absl::Status CudaDriver::DestroyEvent(Event event) {
  VMM_ASSIGN_OR_RETURN(int device, KnownEventDevice(event, "DestroyEvent"));
  ScopedContext scope(api_);
  VMM_RETURN_IF_ERROR(EnterDevice(device, scope));
  VMM_RETURN_IF_ERROR(Check(api_.EventDestroy(ToCuEvent(event)), "cuEventDestroy"));
  MutexLock lock(&mu_);
  event_devices_.erase(event);
  return absl::OkStatus();
}

absl::Status CudaDriver::RecordEvent(Event event, Stream stream) {
  VMM_ASSIGN_OR_RETURN(int device, KnownEventDevice(event, "RecordEvent"));
  ScopedContext scope(api_);
  VMM_RETURN_IF_ERROR(EnterDevice(device, scope));
  return Check(api_.EventRecord(ToCuEvent(event), ToCuStream(stream)), "cuEventRecord");
}

absl::StatusOr<bool> CudaDriver::EventDone(Event event) {
  VMM_ASSIGN_OR_RETURN(int device, KnownEventDevice(event, "EventDone"));
  ScopedContext scope(api_);
  VMM_RETURN_IF_ERROR(EnterDevice(device, scope));
  const CUresult result = api_.EventQuery(ToCuEvent(event));
  if (result == CUDA_SUCCESS) return true;
  if (result == CUDA_ERROR_NOT_READY) return false;
  return Check(result, "cuEventQuery");
}

absl::Status CudaDriver::SynchronizeEvent(Event event) {
  VMM_ASSIGN_OR_RETURN(int device, KnownEventDevice(event, "SynchronizeEvent"));
  ScopedContext scope(api_);
  VMM_RETURN_IF_ERROR(EnterDevice(device, scope));
  return Check(api_.EventSynchronize(ToCuEvent(event)), "cuEventSynchronize");
}

// --- Stream work ---------------------------------------------------------------------------

absl::Status CudaDriver::LaunchHostFunc(Stream stream, void (*fn)(void*), void* arg) {
  if (fn == nullptr) return absl::InvalidArgumentError("LaunchHostFunc: null function");
  ScopedContext scope(api_);
  VMM_RETURN_IF_ERROR(EnterStreamContext(stream, scope));
  return Check(api_.LaunchHostFunc(ToCuStream(stream), fn, arg), "cuLaunchHostFunc");
}

absl::Status CudaDriver::MemcpyAsync(DevPtr dst, DevPtr src, size_t bytes, Stream stream) {
  ScopedContext scope(api_);
  VMM_RETURN_IF_ERROR(EnterStreamContext(stream, scope));
  return Check(api_.MemcpyAsync(dst, src, bytes, ToCuStream(stream)), "cuMemcpyAsync",
               absl::StrFormat("0x%x <- 0x%x, %d bytes", dst, src, bytes));
}

absl::Status CudaDriver::MemsetAsync(DevPtr dst, uint8_t value, size_t bytes, Stream stream) {
  ScopedContext scope(api_);
  VMM_RETURN_IF_ERROR(EnterStreamContext(stream, scope));
  return Check(api_.MemsetD8Async(dst, value, bytes, ToCuStream(stream)), "cuMemsetD8Async",
               absl::StrFormat("0x%x, %d bytes", dst, bytes));
}

}  // namespace

namespace {

// The process-wide backend: made once, on first use, under cuda_driver_mu (not a function's
// static, whose initialisation a child forked meanwhile would find under way for good), and
// never destroyed: no destructor runs at exit, when the driver may already be shutting down.
// The lock is not held across fork() (it is held across cuInit: see the file comment); a
// child finds it free, and makes the backend itself if its parent had not finished.
ABSL_CONST_INIT Mutex cuda_driver_mu;
std::atomic<const absl::StatusOr<Driver*>*> cuda_driver{nullptr};
void ResetCudaDriverMuInChild(void*) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  cuda_driver_mu.UnlockInForkChild();
}
const bool cuda_driver_mu_reset_in_child = [] {
  ForkHandlers handlers;
  handlers.child = &ResetCudaDriverMuInChild;
  AtForkForever(ForkLevel::kDriverInit, handlers);
  return true;
}();

}  // namespace

absl::StatusOr<Driver*> GetCudaDriver() {
  (void)cuda_driver_mu_reset_in_child;
  if (const auto* driver = cuda_driver.load(std::memory_order_acquire)) return *driver;
  MutexLock lock(&cuda_driver_mu);
  const absl::StatusOr<Driver*>* driver = cuda_driver.load(std::memory_order_relaxed);
  if (driver == nullptr) {
    driver = new absl::StatusOr<Driver*>(CudaDriver::Load());
    cuda_driver.store(driver, std::memory_order_release);
  }
  return *driver;
}

const absl::StatusOr<Driver*>* LoadedCudaDriver() {
  return cuda_driver.load(std::memory_order_acquire);
}

}  // namespace vmm
