// pool_stream.h: the stream of an allocation as vmm's pools take it.
//
// PoolStream marks a stream foreign (VMM_FOREIGN_STREAM_BIT, vmm_c.h) unless PyTorch owns it,
// so that vmm never calls CUDA on a stream whose owner may have destroyed it (a block keeps
// its stream while cached; a call on a destroyed stream is a call on a dead handle). PyTorch
// owns the default streams and the streams of its stream pools, which live as long as the
// process. A current stream whose id is even and not 0 is a torch.cuda.ExternalStream (c10
// gives one its handle as its id, and its own streams odd ids). A stream that is not the
// current one (a raw allocation on a given stream) is taken as foreign: its cached blocks then
// stay its own until a device synchronisation (as PyTorch's allocator keeps every stream's),
// never a call on a dead handle. Nothing here fails.
#ifndef VMM_TORCH_PLUGIN_CSRC_POOL_STREAM_H_
#define VMM_TORCH_PLUGIN_CSRC_POOL_STREAM_H_

#include <cstdint>

#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include "torch_plugin/vmm_c.h"

namespace vmm_torch {

inline void* PoolStream(cudaStream_t stream, int device) {
  if (stream == nullptr || stream == cudaStreamLegacy || stream == cudaStreamPerThread) {
    return stream;
  }
  const c10::cuda::CUDAStream current =
      c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device));
  const c10::StreamId id = current.id();
  const bool owned = current.stream() == stream && (id == 0 || (id & 1) != 0);
  if (owned) return stream;
  return reinterpret_cast<void*>(reinterpret_cast<uintptr_t>(stream) | VMM_FOREIGN_STREAM_BIT);
}

}  // namespace vmm_torch

#endif  // VMM_TORCH_PLUGIN_CSRC_POOL_STREAM_H_
