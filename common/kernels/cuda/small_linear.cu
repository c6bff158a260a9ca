// Linear layers of few tokens straight from FP8/BF16/F32 weights (the decode path of CudaDevice's
// Linear and of MLA's per-head projections): one warp per output row, every token of the call at
// once, so the weight is streamed once per group of kTokenGroup tokens with no dequantized copy.
// The arithmetic is CpuDevice's: BF16-rounded activations, FP8 summed per 128-column block over
// the exact code values and then scaled (kernels::Fp8E4M3ToFloatBits, the block scale).

#include "common/kernels/cuda/cuda_kernels.h"
#include "common/kernels/shared_math.h"

namespace hmoe::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kTokenGroup = 8;

__device__ float WarpSum(float v) {
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

__global__ void __launch_bounds__(kThreads)
    SmallLinearKernel(WeightDesc single, const WeightDesc* __restrict__ descs, int64_t row_base,
                      int64_t row_step, int64_t rows, const float* __restrict__ x,
                      int64_t x_batch_stride, int64_t x_stride, int64_t n, bool round_bf16,
                      float* __restrict__ y, int64_t y_batch_stride, int64_t y_stride) {
  const int64_t b = blockIdx.y;
  const WeightDesc w = descs != nullptr ? descs[b] : single;
  const bool fp8 = w.type == kernels::ElemType::kF8E4M3;
  const bool f32 = w.type == kernels::ElemType::kF32;
  const bool bf16_aligned =
      w.type == kernels::ElemType::kBF16 && reinterpret_cast<uintptr_t>(w.data) % 2 == 0;
  const float* xb = x + b * x_batch_stride;
  float* yb = y + b * y_batch_stride;
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int64_t warp_id = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  const int64_t warp_count = static_cast<int64_t>(gridDim.x) * kWarps;
  for (int64_t r = warp_id; r < rows; r += warp_count) {  // uniform across the warp
    const int64_t row = row_base + b * row_step + r;
    for (int64_t t0 = 0; t0 < n; t0 += kTokenGroup) {
      const int64_t tn = n - t0 < kTokenGroup ? n - t0 : kTokenGroup;
      float total[kTokenGroup];
#pragma unroll
      for (int t = 0; t < kTokenGroup; ++t) total[t] = 0.0f;
      for (int64_t c0 = 0; c0 < w.cols; c0 += 128) {
        const int64_t c1 = c0 + 128 < w.cols ? c0 + 128 : w.cols;
        float part[kTokenGroup];
#pragma unroll
        for (int t = 0; t < kTokenGroup; ++t) part[t] = 0.0f;
        for (int64_t c = c0 + lane; c < c1; c += 32) {
          const int64_t i = row * w.row_stride + c;
          float wv;
          if (fp8) {
            wv = kernels::Fp8E4M3ToFloatBits(static_cast<const uint8_t*>(w.data)[i]);
          } else if (bf16_aligned) {
            wv = kernels::Bf16BitsToFloat(static_cast<const uint16_t*>(w.data)[i]);
          } else if (f32) {
            wv = static_cast<const float*>(w.data)[i];  // F32 weights are 4-byte aligned
          } else {
            wv = kernels::LoadElementAsFloat(w.type, w.data, i);  // unaligned BF16: bytes
          }
#pragma unroll
          for (int t = 0; t < kTokenGroup; ++t) {
            if (t < tn) {
              float xv = xb[(t0 + t) * x_stride + c];
              if (round_bf16) xv = kernels::Bf16BitsToFloat(kernels::FloatToBf16Bits(xv));
              part[t] += wv * xv;
            }
          }
        }
        const float scale = fp8 ? w.scale_inv[(row / 128) * w.scale_stride + c0 / 128] : 1.0f;
#pragma unroll
        for (int t = 0; t < kTokenGroup; ++t) {
          if (t < tn) total[t] += scale * WarpSum(part[t]);  // tn is uniform across the warp
        }
      }
#pragma unroll
      for (int t = 0; t < kTokenGroup; ++t) {
        if (lane == 0 && t < tn) yb[(t0 + t) * y_stride + r] = total[t];
      }
    }
  }
}

}  // namespace

cudaError_t LaunchSmallLinear(const WeightDesc& single, const WeightDesc* descs, int64_t batch,
                              int64_t row_base, int64_t row_step, int64_t rows, const float* x,
                              int64_t x_batch_stride, int64_t x_stride, int64_t n, bool round_bf16,
                              float* y, int64_t y_batch_stride, int64_t y_stride,
                              cudaStream_t stream) {
  if (batch <= 0 || rows <= 0 || n <= 0) return cudaSuccess;
  if (batch > 65535) return cudaErrorInvalidValue;
  const int64_t blocks = (rows + kWarps - 1) / kWarps;
  const dim3 grid(static_cast<unsigned>(blocks < 65535 ? blocks : 65535),
                  static_cast<unsigned>(batch));
  SmallLinearKernel<<<grid, kThreads, 0, stream>>>(single, descs, row_base, row_step, rows, x,
                                                   x_batch_stride, x_stride, n, round_bf16, y,
                                                   y_batch_stride, y_stride);
  return cudaGetLastError();
}

}  // namespace hmoe::cuda
