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
  if (rows <= 0 || cols <= 0) return cudaSuccess;
  const int64_t scale_cols = (cols + 127) / 128;
  DequantFp8ToBf16Kernel<<<BlocksFor(rows * cols, kThreads), kThreads, 0, stream>>>(
      w, scale_inv, rows, cols, scale_cols, out);
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
