// Linear layers of few tokens straight from FP8/BF16/F32 weights (the decode path of CudaDevice's
// Linear and of MLA's per-head projections): one warp per output row, every token of the call at
// once, so the weight is streamed once per group of kTokenGroup tokens with no dequantized copy.
// FP8 rows of whole 128-column blocks with 16-byte alignment (DeepSeek-V3's) are read 16 bytes per
// lane (Fp8RowVec16); other weights one element per lane.
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

// One row of an FP8 weight of whole 128-column blocks with 16-byte aligned rows, for tokens
// t0 .. t0 + tn: each lane loads 16 codes at once (one 16-byte load), 8 lanes cover one block and
// the warp 4 blocks per step. Per block and token, each lane sums its 16 products in column order,
// a butterfly over the block's 8 lanes gives the block sum (the same bits in all 8), and the sum
// times the block's scale is added to the token's total in increasing block order: CpuDevice's
// block structure (the order of the additions inside a block differs, as F32 summation may).
__device__ void Fp8RowVec16(const WeightDesc& w, int64_t row, const float* __restrict__ xb,
                            int64_t x_stride, bool x_vec, int64_t t0, int64_t tn, bool round_bf16,
                            int lane, float (&total)[kTokenGroup]) {
  const uint8_t* wrow = static_cast<const uint8_t*>(w.data) + row * w.row_stride;
  const float* scales = w.scale_inv + (row / 128) * w.scale_stride;
  for (int64_t c0 = 0; c0 < w.cols; c0 += 512) {  // uniform across the warp
    const int64_t c = c0 + lane * 16;
    const bool active = c < w.cols;  // whole groups of 8 lanes (w.cols % 128 == 0)
    float code[16];
    if (active) {
      const uint4 v = *reinterpret_cast<const uint4*>(wrow + c);
      const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        code[j] = kernels::Fp8E4M3ToFloatBits(
            static_cast<uint8_t>((words[j / 4] >> (8 * (j % 4))) & 0xffu));
      }
    } else {
#pragma unroll
      for (int j = 0; j < 16; ++j) code[j] = 0.0f;
    }
    float part[kTokenGroup];
#pragma unroll
    for (int t = 0; t < kTokenGroup; ++t) {
      part[t] = 0.0f;
      if (t < tn && active) {
        const float* xr = xb + (t0 + t) * x_stride + c;
        float xv[16];
        if (x_vec) {
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            const float4 f = reinterpret_cast<const float4*>(xr)[q];
            xv[4 * q] = f.x;
            xv[4 * q + 1] = f.y;
            xv[4 * q + 2] = f.z;
            xv[4 * q + 3] = f.w;
          }
        } else {
#pragma unroll
          for (int j = 0; j < 16; ++j) xv[j] = xr[j];
        }
#pragma unroll
        for (int j = 0; j < 16; ++j) {
          const float xj =
              round_bf16 ? kernels::Bf16BitsToFloat(kernels::FloatToBf16Bits(xv[j])) : xv[j];
          part[t] += code[j] * xj;
        }
      }
    }
#pragma unroll
    for (int t = 0; t < kTokenGroup; ++t) {
      for (int offset = 4; offset > 0; offset /= 2) {
        part[t] += __shfl_xor_sync(0xffffffffu, part[t], offset);
      }
    }
#pragma unroll
    for (int g = 0; g < 4; ++g) {
      if (c0 + 128 * g < w.cols) {  // uniform
        const float scale = scales[c0 / 128 + g];
#pragma unroll
        for (int t = 0; t < kTokenGroup; ++t) {
          const float block_sum = __shfl_sync(0xffffffffu, part[t], 8 * g);
          if (t < tn) total[t] += scale * block_sum;
        }
      }
    }
  }
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
  // 16 codes per lane: rows of whole 128-column blocks, 16-byte aligned.
  const bool fp8_vec16 = fp8 && w.cols % 128 == 0 && w.row_stride % 16 == 0 &&
                         reinterpret_cast<uintptr_t>(w.data) % 16 == 0;
  const bool x_vec =
      reinterpret_cast<uintptr_t>(x) % 16 == 0 && x_stride % 4 == 0 && x_batch_stride % 4 == 0;
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
      if (fp8_vec16) {
        Fp8RowVec16(w, row, xb, x_stride, x_vec, t0, tn, round_bf16, lane, total);
      }
      for (int64_t c0 = 0; !fp8_vec16 && c0 < w.cols; c0 += 128) {
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
