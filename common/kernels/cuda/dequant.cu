#include "common/kernels/cuda/cuda_kernels.h"
#include "common/kernels/shared_math.h"

namespace hmoe::cuda {
namespace {

__global__ void DequantFp8ToBf16Kernel(const uint8_t* __restrict__ w,
                                       const float* __restrict__ scale_inv, int64_t rows,
                                       int64_t cols, int64_t scale_cols,
                                       uint16_t* __restrict__ out) {
  const int64_t n = rows * cols;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    const int64_t r = i / cols;
    const int64_t c = i - r * cols;
    out[i] =
        kernels::FloatToBf16Bits(kernels::DequantFp8Element(w[i], scale_inv, scale_cols, r, c));
  }
}

__global__ void SiluMulKernel(const float* __restrict__ gate, const float* __restrict__ up,
                              float* __restrict__ out, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    out[i] = kernels::SiluMul(gate[i], up[i]);
  }
}

unsigned BlocksFor(int64_t n, int threads) {
  const int64_t blocks = (n + threads - 1) / threads;
  return static_cast<unsigned>(blocks < 65535 ? blocks : 65535);
}

}  // namespace

cudaError_t LaunchDequantFp8ToBf16(const uint8_t* w, const float* scale_inv, int64_t rows,
                                   int64_t cols, uint16_t* out, cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return cudaSuccess;
  constexpr int kThreads = 256;
  const int64_t scale_cols = (cols + 127) / 128;
  DequantFp8ToBf16Kernel<<<BlocksFor(rows * cols, kThreads), kThreads, 0, stream>>>(
      w, scale_inv, rows, cols, scale_cols, out);
  return cudaGetLastError();
}

cudaError_t LaunchSiluMul(const float* gate, const float* up, float* out, int64_t n,
                          cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  constexpr int kThreads = 256;
  SiluMulKernel<<<BlocksFor(n, kThreads), kThreads, 0, stream>>>(gate, up, out, n);
  return cudaGetLastError();
}

}  // namespace hmoe::cuda
