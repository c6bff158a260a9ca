#pragma once

// CUDA and cuBLAS errors turned into absl::Status (docs/style.md §3). Host code of the CUDA
// backend only (includes CUDA headers): cuda_device.cc and its helpers, never a portable header.
// A CUDA failure is Internal (a bug, or a sticky device error after which the worker exits);
// messages name the call, the error and the source location.

#include <cublas_api.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include <cuda_runtime_api.h>

#include "common/base/logging.h"

namespace hmoe::internal {

// Also clears the runtime's last-error state (for a non-sticky error), so that the failure, now
// reported as a Status, does not resurface at the next launch's cudaGetLastError check.
inline absl::Status CudaStatus(cudaError_t err, const char* expr, const char* file, int line) {
  cudaGetLastError();
  return absl::InternalError(absl::StrCat(expr, " failed: ", cudaGetErrorName(err), " (",
                                          cudaGetErrorString(err), ") at ", file, ":", line));
}

inline absl::Status CublasStatus(cublasStatus_t st, const char* expr, const char* file, int line) {
  return absl::InternalError(absl::StrCat(expr, " failed: ", cublasGetStatusName(st), " (",
                                          cublasGetStatusString(st), ") at ", file, ":", line));
}

}  // namespace hmoe::internal

// Returns Internal from the enclosing function when `expr` (a cudaError_t) is not cudaSuccess.
#define HMOE_CUDA_RETURN_IF_ERROR(expr)                                               \
  do {                                                                                \
    if (const cudaError_t hmoe_cuda_err_ = (expr); hmoe_cuda_err_ != cudaSuccess) {   \
      return ::hmoe::internal::CudaStatus(hmoe_cuda_err_, #expr, __FILE__, __LINE__); \
    }                                                                                 \
  } while (false)

// Logs (ERROR) a failed `expr`; for destructors and other places that cannot return a Status.
#define HMOE_CUDA_LOG_IF_ERROR(expr)                                                      \
  do {                                                                                    \
    if (const cudaError_t hmoe_cuda_err_ = (expr); hmoe_cuda_err_ != cudaSuccess) {       \
      HMOE_LOG(ERROR) << #expr << " failed: " << cudaGetErrorName(hmoe_cuda_err_) << " (" \
                      << cudaGetErrorString(hmoe_cuda_err_) << ")";                       \
    }                                                                                     \
  } while (false)

// Returns Internal when `expr` (a cublasStatus_t) is not CUBLAS_STATUS_SUCCESS.
#define HMOE_CUBLAS_RETURN_IF_ERROR(expr)                                                          \
  do {                                                                                             \
    if (const cublasStatus_t hmoe_cublas_st_ = (expr); hmoe_cublas_st_ != CUBLAS_STATUS_SUCCESS) { \
      return ::hmoe::internal::CublasStatus(hmoe_cublas_st_, #expr, __FILE__, __LINE__);           \
    }                                                                                              \
  } while (false)

#define HMOE_CUBLAS_LOG_IF_ERROR(expr)                                                             \
  do {                                                                                             \
    if (const cublasStatus_t hmoe_cublas_st_ = (expr); hmoe_cublas_st_ != CUBLAS_STATUS_SUCCESS) { \
      HMOE_LOG(ERROR) << #expr << " failed: " << cublasGetStatusName(hmoe_cublas_st_);             \
    }                                                                                              \
  } while (false)
