#pragma once

// Move-only owners of CUDA runtime and cuBLAS handles, in the manner of ggml-cpp.h: a unique_ptr
// with a deleter that logs failures (docs/style.md §4). Host code of the CUDA backend only.
// Streams are non-blocking and events do no timing (docs/style.md §6).

#include <memory>

#include "absl/status/statusor.h"
#include <cuda_runtime_api.h>

#include "common/device/cuda_check.h"

#include <cublas_v2.h>

namespace hmoe {

struct CudaStreamDeleter {
  void operator()(cudaStream_t s) const { HMOE_CUDA_LOG_IF_ERROR(cudaStreamDestroy(s)); }
};
struct CudaEventDeleter {
  void operator()(cudaEvent_t e) const { HMOE_CUDA_LOG_IF_ERROR(cudaEventDestroy(e)); }
};
struct CublasHandleDeleter {
  void operator()(cublasHandle_t h) const { HMOE_CUBLAS_LOG_IF_ERROR(cublasDestroy(h)); }
};

using UniqueCudaStream = std::unique_ptr<CUstream_st, CudaStreamDeleter>;
using UniqueCudaEvent = std::unique_ptr<CUevent_st, CudaEventDeleter>;
using UniqueCublasHandle = std::unique_ptr<cublasContext, CublasHandleDeleter>;

// A non-blocking stream (no implicit ordering with the legacy default stream) on the current
// device.
inline absl::StatusOr<UniqueCudaStream> NewCudaStream() {
  cudaStream_t stream = nullptr;
  HMOE_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  return UniqueCudaStream(stream);
}

// An event without timing (cheaper to record and wait on) on the current device.
inline absl::StatusOr<UniqueCudaEvent> NewCudaEvent() {
  cudaEvent_t event = nullptr;
  HMOE_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  return UniqueCudaEvent(event);
}

// A cuBLAS handle on the current device whose work is enqueued on `stream` for its whole life,
// with the default (IEEE, no TF32) math mode.
inline absl::StatusOr<UniqueCublasHandle> NewCublasHandle(cudaStream_t stream) {
  cublasHandle_t handle = nullptr;
  HMOE_CUBLAS_RETURN_IF_ERROR(cublasCreate(&handle));
  UniqueCublasHandle owned(handle);
  HMOE_CUBLAS_RETURN_IF_ERROR(cublasSetStream(handle, stream));
  HMOE_CUBLAS_RETURN_IF_ERROR(cublasSetMathMode(handle, CUBLAS_DEFAULT_MATH));
  return owned;
}

}  // namespace hmoe
