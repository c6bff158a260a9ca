#pragma once

// The native handle behind a Stream, for libraries that enqueue their own work on a device's
// streams (NCCL collectives in common/comm). Portable header: no CUDA includes.

#include "common/device/device.h"

namespace hmoe {

// The cudaStream_t of a CudaDevice stream (as void*); null for any other stream (CpuDevice) and
// in builds without CUDA. The handle stays owned by the Stream.
void* NativeCudaStream(Stream& stream);

}  // namespace hmoe
