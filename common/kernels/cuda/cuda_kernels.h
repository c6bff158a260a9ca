#pragma once

// Kernel launchers of the CUDA backend. Each returns the launch's cudaError_t; callers
// (common/device's CUDA device) turn it into absl::Status. Only CUDA-aware host code includes
// this header. The per-element math lives in common/kernels/shared_math.h, shared with (and tested
// through) the CPU kernels.

#include <cstdint>

#include <cuda_runtime_api.h>

namespace hmoe::cuda {

// out[r*cols + c] = bf16(fp8(w[r*cols + c]) * scale_inv[(r/128)*ceil(cols/128) + c/128]).
cudaError_t LaunchDequantFp8ToBf16(const uint8_t* w, const float* scale_inv, int64_t rows,
                                   int64_t cols, uint16_t* out, cudaStream_t stream);

// out[i] = silu(gate[i]) * up[i] for n floats.
cudaError_t LaunchSiluMul(const float* gate, const float* up, float* out, int64_t n,
                          cudaStream_t stream);

}  // namespace hmoe::cuda
