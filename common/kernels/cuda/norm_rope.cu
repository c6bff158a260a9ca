// RMSNorm and interleaved RoPE: one thread block per token row, the math of
// common/kernels/shared_math.h (RmsNormInvRms / RmsNormApply, RopeCosSin / RopeRotatePair).

#include "common/kernels/cuda/cuda_kernels.h"
#include "common/kernels/shared_math.h"

namespace hmoe::cuda {
namespace {

constexpr int kThreads = 256;

unsigned RowBlocks(int64_t rows) { return static_cast<unsigned>(rows < 65535 ? rows : 65535); }

// No __restrict__ on x/y: y may alias x. Every thread reads its elements of x for the sum, the
// block synchronizes (the reduction), then each thread writes only the elements it read.
__global__ void __launch_bounds__(kThreads)
    RmsNormKernel(const float* x, int64_t x_stride, int64_t n, int64_t dim, const void* weight,
                  kernels::ElemType weight_type, float eps, float* y, int64_t y_stride) {
  __shared__ double partial[kThreads];
  __shared__ float inv_rms;
  for (int64_t t = blockIdx.x; t < n; t += gridDim.x) {
    const float* xt = x + t * x_stride;
    double sum = 0.0;
    for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) {
      const double v = xt[i];
      sum += v * v;
    }
    partial[threadIdx.x] = sum;
    __syncthreads();
    // Tree reduction over the block (blockDim.x is a power of two).
    for (unsigned half = blockDim.x / 2; half > 0; half /= 2) {
      if (threadIdx.x < half) partial[threadIdx.x] += partial[threadIdx.x + half];
      __syncthreads();
    }
    if (threadIdx.x == 0) inv_rms = kernels::RmsNormInvRms(partial[0], dim, eps);
    __syncthreads();
    const float inv = inv_rms;
    float* yt = y + t * y_stride;
    for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) {
      yt[i] =
          kernels::RmsNormApply(xt[i], inv, kernels::LoadElementAsFloat(weight_type, weight, i));
    }
    __syncthreads();  // `partial` and `inv_rms` are reused by the next row
  }
}

// Dynamic shared memory: 2 * half doubles (cos, sin of each pair).
__global__ void __launch_bounds__(kThreads)
    RopeInterleavedKernel(float* x, int64_t x_stride, int64_t n, int64_t num_heads,
                          int64_t head_stride, int64_t half, const int32_t* __restrict__ positions,
                          const float* __restrict__ inv_freq, float attention_factor) {
  extern __shared__ double cos_sin[];
  for (int64_t t = blockIdx.x; t < n; t += gridDim.x) {
    const int64_t pos = positions[t];
    for (int64_t i = threadIdx.x; i < half; i += blockDim.x) {
      kernels::RopeCosSin(pos, inv_freq[i], attention_factor, &cos_sin[2 * i], &cos_sin[2 * i + 1]);
    }
    __syncthreads();
    for (int64_t k = threadIdx.x; k < num_heads * half; k += blockDim.x) {
      const int64_t h = k / half;
      const int64_t i = k - h * half;
      float* v = x + t * x_stride + h * head_stride + 2 * i;
      kernels::RopeRotatePair(&v[0], &v[1], cos_sin[2 * i], cos_sin[2 * i + 1]);
    }
    __syncthreads();  // cos_sin is reused by the next token
  }
}

}  // namespace

cudaError_t LaunchRmsNorm(const float* x, int64_t x_stride, int64_t n, int64_t dim,
                          const void* weight, kernels::ElemType weight_type, float eps, float* y,
                          int64_t y_stride, cudaStream_t stream) {
  if (n <= 0 || dim <= 0) return cudaSuccess;
  RmsNormKernel<<<RowBlocks(n), kThreads, 0, stream>>>(x, x_stride, n, dim, weight, weight_type,
                                                       eps, y, y_stride);
  return cudaGetLastError();
}

cudaError_t LaunchRopeInterleaved(float* x, int64_t x_stride, int64_t n, int64_t num_heads,
                                  int64_t head_stride, int64_t rope_dim, const int32_t* positions,
                                  const float* inv_freq, float attention_factor,
                                  cudaStream_t stream) {
  if (n <= 0 || num_heads <= 0 || rope_dim <= 0) return cudaSuccess;
  if (rope_dim % 2 != 0 || rope_dim > 4096) return cudaErrorInvalidValue;
  const int64_t half = rope_dim / 2;
  const size_t shared_bytes = static_cast<size_t>(2 * half) * sizeof(double);
  RopeInterleavedKernel<<<RowBlocks(n), kThreads, shared_bytes, stream>>>(
      x, x_stride, n, num_heads, head_stride, half, positions, inv_freq, attention_factor);
  return cudaGetLastError();
}

}  // namespace hmoe::cuda
