// Weight and activation conversions around the cuBLAS GEMMs (FP8 -> BF16 dequantization,
// weight packing, F32 -> BF16 activations, the block-scale combine of FP8 products) and the
// SiLU * up activation.

#include "common/kernels/cuda/cuda_kernels.h"
#include "common/kernels/shared_math.h"

namespace hmoe::cuda {
namespace {

constexpr int kThreads = 256;

unsigned BlocksFor(int64_t n, int threads) {
  const int64_t blocks = (n + threads - 1) / threads;
  return static_cast<unsigned>(blocks < 65535 ? blocks : 65535);
}

// Rows row_begin + blockIdx.y (+ k * gridDim.y) < row_begin + num_rows of an FP8 weight as BF16
// bits of code * scale (round to nearest even): kPer consecutive columns per thread. kPer = 16:
// one 16-byte load of codes and two 16-byte stores (the caller checked the alignment); 16 columns
// starting at a multiple of 16 share one 128-column scale block.
template <int kPer>
__global__ void Fp8ToScaledBf16Kernel(const uint8_t* __restrict__ data, int64_t row_stride,
                                      const float* __restrict__ scale_inv, int64_t scale_stride,
                                      int64_t cols, int64_t row_begin, int64_t num_rows,
                                      uint16_t* __restrict__ out, int64_t out_stride) {
  const int64_t c0 = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * kPer;
  if (c0 >= cols) return;
  for (int64_t r = blockIdx.y; r < num_rows; r += gridDim.y) {
    const int64_t wr = row_begin + r;
    const float scale = scale_inv[(wr / 128) * scale_stride + c0 / 128];
    const uint8_t* src = data + wr * row_stride + c0;
    uint16_t* dst = out + r * out_stride + c0;
    if constexpr (kPer == 16) {
      const uint4 codes = *reinterpret_cast<const uint4*>(src);
      const uint32_t words[4] = {codes.x, codes.y, codes.z, codes.w};
      uint32_t packed[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        // Little endian: code j of the 16 is byte j % 4 of word j / 4; BF16 value j is the
        // low (even j) or high (odd j) half of packed[j / 2].
        const uint32_t pair = words[i / 2] >> (16 * (i % 2));
        const uint32_t lo = kernels::FloatToBf16Bits(
            kernels::Fp8E4M3ToFloatBits(static_cast<uint8_t>(pair & 0xffu)) * scale);
        const uint32_t hi = kernels::FloatToBf16Bits(
            kernels::Fp8E4M3ToFloatBits(static_cast<uint8_t>((pair >> 8) & 0xffu)) * scale);
        packed[i] = lo | (hi << 16);
      }
      reinterpret_cast<uint4*>(dst)[0] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
      reinterpret_cast<uint4*>(dst)[1] = make_uint4(packed[4], packed[5], packed[6], packed[7]);
    } else {
      for (int j = 0; j < kPer && c0 + j < cols; ++j) {
        dst[j] = kernels::FloatToBf16Bits(kernels::Fp8E4M3ToFloatBits(src[j]) * scale);
      }
    }
  }
}

// Weight blockIdx.y (descs[blockIdx.y], or `single` when descs is null, restricted to its rows
// row_begin .. row_begin + num_rows) into out + blockIdx.y * item_stride, compact with out_cols
// columns (zero past the weight's).
__global__ void PackWeightsKernel(WeightDesc single, const WeightDesc* __restrict__ descs,
                                  int64_t row_begin, int64_t num_rows, int64_t out_cols, void* out,
                                  int64_t item_stride, PackMode mode) {
  const WeightDesc d = descs != nullptr ? descs[blockIdx.y] : single;
  const int64_t r0 = descs != nullptr ? 0 : row_begin;
  const int64_t rows = descs != nullptr ? d.rows : num_rows;
  const int64_t cols = descs != nullptr ? d.cols : out_cols;
  const int64_t n = rows * cols;
  const int64_t base = static_cast<int64_t>(blockIdx.y) * item_stride;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    const int64_t r = i / cols;
    const int64_t c = i - r * cols;
    float v = 0.0f;
    if (c < d.cols) {
      if (mode == PackMode::kFp8CodesBf16) {
        v = kernels::Fp8E4M3ToFloatBits(
            static_cast<const uint8_t*>(d.data)[(r0 + r) * d.row_stride + c]);
      } else {
        v = kernels::WeightElement(d.type, d.data, d.row_stride, d.scale_inv, d.scale_stride,
                                   r0 + r, c);
      }
    }
    if (mode == PackMode::kF32) {
      static_cast<float*>(out)[base + i] = v;
    } else {
      static_cast<uint16_t*>(out)[base + i] = kernels::FloatToBf16Bits(v);
    }
  }
}

__global__ void F32ToBf16Kernel(const float* __restrict__ src, int64_t src_stride, int64_t rows,
                                int64_t cols, uint16_t* __restrict__ dst, int64_t dst_stride,
                                int64_t dst_cols) {
  const int64_t n = rows * dst_cols;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    const int64_t r = i / dst_cols;
    const int64_t c = i - r * dst_cols;
    dst[r * dst_stride + c] = c < cols ? kernels::FloatToBf16Bits(src[r * src_stride + c]) : 0;
  }
}

// The same with 4 columns per thread (one 16-byte load, one 8-byte store; the caller checked the
// alignment, cols and dst_cols multiples of 4): row blockIdx.y (+ k * gridDim.y), no division.
__global__ void F32ToBf16Vec4Kernel(const float* __restrict__ src, int64_t src_stride, int64_t rows,
                                    int64_t cols, uint16_t* __restrict__ dst, int64_t dst_stride,
                                    int64_t dst_cols) {
  const int64_t c0 = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * 4;
  if (c0 >= dst_cols) return;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    uint2 packed = make_uint2(0u, 0u);
    if (c0 < cols) {
      const float4 v = *reinterpret_cast<const float4*>(src + r * src_stride + c0);
      packed.x = kernels::FloatToBf16Bits(v.x) | (uint32_t{kernels::FloatToBf16Bits(v.y)} << 16);
      packed.y = kernels::FloatToBf16Bits(v.z) | (uint32_t{kernels::FloatToBf16Bits(v.w)} << 16);
    }
    *reinterpret_cast<uint2*>(dst + r * dst_stride + c0) = packed;
  }
}

__global__ void RoundToBf16Kernel(float* __restrict__ x, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    x[i] = kernels::Bf16BitsToFloat(kernels::FloatToBf16Bits(x[i]));
  }
}

__global__ void BlockScaleCombineKernel(const float* __restrict__ partials, int64_t num_blocks,
                                        int64_t rows, int64_t cols,
                                        const float* __restrict__ scale_inv, int64_t scale_stride,
                                        int64_t row_begin, float* __restrict__ y,
                                        int64_t y_stride) {
  const int64_t n = rows * cols;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    const int64_t t = i / cols;
    const int64_t r = i - t * cols;
    const float* scales = scale_inv + ((row_begin + r) / 128) * scale_stride;
    float acc = 0.0f;
    for (int64_t b = 0; b < num_blocks; ++b) acc += scales[b] * partials[b * n + i];
    y[t * y_stride + r] = acc;
  }
}

// No __restrict__: `out` may alias `gate` or `up` (each element is read before it is written, by
// the same thread).
__global__ void SiluMulKernel(const float* gate, const float* up, float* out, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    out[i] = kernels::SiluMul(gate[i], up[i]);
  }
}

}  // namespace

cudaError_t LaunchDequantFp8ToBf16(const uint8_t* w, const float* scale_inv, int64_t rows,
                                   int64_t cols, uint16_t* out, cudaStream_t stream) {
  WeightDesc d;
  d.data = w;
  d.scale_inv = scale_inv;
  d.rows = rows;
  d.cols = cols;
  d.row_stride = cols;
  d.scale_stride = (cols + 127) / 128;
  d.type = kernels::ElemType::kF8E4M3;
  return LaunchFp8ToScaledBf16(d, 0, rows, out, cols, stream);
}

cudaError_t LaunchFp8ToScaledBf16(const WeightDesc& w, int64_t row_begin, int64_t num_rows,
                                  uint16_t* out, int64_t out_stride, cudaStream_t stream) {
  if (num_rows <= 0 || w.cols <= 0) return cudaSuccess;
  if (w.type != kernels::ElemType::kF8E4M3 || out_stride < w.cols || row_begin < 0 ||
      row_begin + num_rows > w.rows) {
    return cudaErrorInvalidValue;
  }
  const auto* data = static_cast<const uint8_t*>(w.data);
  const bool vec = w.cols % 16 == 0 && w.row_stride % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(data) % 16 == 0 && out_stride % 8 == 0 &&
                   reinterpret_cast<uintptr_t>(out) % 16 == 0;
  constexpr int kColThreads = 128;
  const int64_t per = vec ? 16 : 1;
  const int64_t groups = (w.cols + per - 1) / per;
  const dim3 grid(static_cast<unsigned>((groups + kColThreads - 1) / kColThreads),
                  static_cast<unsigned>(num_rows < 65535 ? num_rows : 65535));
  if (vec) {
    Fp8ToScaledBf16Kernel<16><<<grid, kColThreads, 0, stream>>>(data, w.row_stride, w.scale_inv,
                                                                w.scale_stride, w.cols, row_begin,
                                                                num_rows, out, out_stride);
  } else {
    Fp8ToScaledBf16Kernel<1><<<grid, kColThreads, 0, stream>>>(data, w.row_stride, w.scale_inv,
                                                               w.scale_stride, w.cols, row_begin,
                                                               num_rows, out, out_stride);
  }
  return cudaGetLastError();
}

cudaError_t LaunchPackWeight(const WeightDesc& w, int64_t row_begin, int64_t num_rows,
                             int64_t out_cols, void* out, PackMode mode, cudaStream_t stream) {
  if (num_rows <= 0 || out_cols <= 0) return cudaSuccess;
  if (out_cols < w.cols ||
      (mode == PackMode::kFp8CodesBf16 && w.type != kernels::ElemType::kF8E4M3)) {
    return cudaErrorInvalidValue;
  }
  PackWeightsKernel<<<BlocksFor(num_rows * out_cols, kThreads), kThreads, 0, stream>>>(
      w, nullptr, row_begin, num_rows, out_cols, out, 0, mode);
  return cudaGetLastError();
}

cudaError_t LaunchPackWeights(const WeightDesc* descs, int count, int64_t max_elements, void* out,
                              int64_t item_stride, PackMode mode, cudaStream_t stream) {
  if (count <= 0 || max_elements <= 0) return cudaSuccess;
  if (count > 65535) return cudaErrorInvalidValue;
  const dim3 grid(BlocksFor(max_elements, kThreads), static_cast<unsigned>(count));
  PackWeightsKernel<<<grid, kThreads, 0, stream>>>(WeightDesc{}, descs, 0, 0, 0, out, item_stride,
                                                   mode);
  return cudaGetLastError();
}

cudaError_t LaunchF32ToBf16(const float* src, int64_t src_stride, int64_t rows, int64_t cols,
                            uint16_t* dst, int64_t dst_stride, int64_t dst_cols,
                            cudaStream_t stream) {
  if (rows <= 0 || dst_cols <= 0) return cudaSuccess;
  if (dst_cols < cols) return cudaErrorInvalidValue;
  if (cols % 4 == 0 && dst_cols % 4 == 0 && src_stride % 4 == 0 && dst_stride % 4 == 0 &&
      reinterpret_cast<uintptr_t>(src) % 16 == 0 && reinterpret_cast<uintptr_t>(dst) % 8 == 0) {
    constexpr int kColThreads = 128;
    const int64_t groups = dst_cols / 4;
    const dim3 grid(static_cast<unsigned>((groups + kColThreads - 1) / kColThreads),
                    static_cast<unsigned>(rows < 65535 ? rows : 65535));
    F32ToBf16Vec4Kernel<<<grid, kColThreads, 0, stream>>>(src, src_stride, rows, cols, dst,
                                                          dst_stride, dst_cols);
    return cudaGetLastError();
  }
  F32ToBf16Kernel<<<BlocksFor(rows * dst_cols, kThreads), kThreads, 0, stream>>>(
      src, src_stride, rows, cols, dst, dst_stride, dst_cols);
  return cudaGetLastError();
}

cudaError_t LaunchRoundToBf16(float* x, int64_t n, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  RoundToBf16Kernel<<<BlocksFor(n, kThreads), kThreads, 0, stream>>>(x, n);
  return cudaGetLastError();
}

cudaError_t LaunchBlockScaleCombine(const float* partials, int64_t num_blocks, int64_t rows,
                                    int64_t cols, const float* scale_inv, int64_t scale_stride,
                                    int64_t row_begin, float* y, int64_t y_stride,
                                    cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return cudaSuccess;
  BlockScaleCombineKernel<<<BlocksFor(rows * cols, kThreads), kThreads, 0, stream>>>(
      partials, num_blocks, rows, cols, scale_inv, scale_stride, row_begin, y, y_stride);
  return cudaGetLastError();
}

cudaError_t LaunchSiluMul(const float* gate, const float* up, float* out, int64_t n,
                          cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  SiluMulKernel<<<BlocksFor(n, kThreads), kThreads, 0, stream>>>(gate, up, out, n);
  return cudaGetLastError();
}

}  // namespace hmoe::cuda
