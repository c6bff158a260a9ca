#pragma once

// Internals of CpuDevice shared between its source files: linear kernels over a LinearWeight of
// any supported dtype, scratch memory, and the MLA attention implementation.

#include <cstddef>
#include <cstdint>
#include <memory>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"

#include "common/device/device.h"
#include "common/kernels/cpu/bf16_gemv.h"
#include "common/kernels/cpu/fp8_gemm.h"
#include "common/kernels/cpu/fp8_gemv.h"
#include "common/ops/cpu/quantized_linear.h"

namespace hmoe::internal {

// The kernels a CpuDevice computes with.
struct CpuKernels {
  const cpu::Fp8Gemv* fp8 = nullptr;
  const cpu::Bf16Gemv* bf16 = nullptr;
  // FP8 products of at least gemm_min_tokens tokens run on `gemm` (same ISA as `fp8`).
  const cpu::Fp8Gemm* gemm = nullptr;
  int64_t gemm_min_tokens = INT64_MAX;
  // Non-null: products with a GGML block-type weight round their activations to Q8_K (the packed
  // rows) and run on these kernels; null: QuantizedLinearRows (dequantized rows, F32 dots).
  const cpu::QuantGemv* quant = nullptr;
};

// Runs job(thread, num_threads) on every thread of the device's pool (or on the caller alone).
using ParallelRunner = absl::FunctionRef<void(absl::FunctionRef<void(int, int)>)>;

// InvalidArgument unless `w` is a usable FP8 / BF16 / F32 weight view, or F16 / a GGML block
// type with whole blocks per row (cols and row_stride multiples of the block).
absl::Status CheckLinearWeight(const LinearWeight& w, const char* what);
// The view QuantizedLinearRows reads of a checked F16 / block-type weight.
cpu::QuantizedMatrixView QuantizedView(const LinearWeight& w);

// InvalidArgument unless `a` is a well-formed MLA call on any device (dimensions, q/out strides,
// W_UK^T and kv_b shapes, cache view, segments). `partial`: MlaAttentionPartial, which neither
// projects (kv_b) nor writes `out`. Device-specific limits are the device's own checks.
absl::Status CheckMlaAttentionArgs(const MlaAttentionArgs& a, bool partial);

// Bytes of one packed activation row of w.cols elements for `w`'s dtype (0 for F32 and for the
// F32 path of block types: they read the activations directly). Block types with k.quant: the
// row's Q8_K blocks (Q8KBlocks(w.cols) * sizeof(BlockQ8K), not rounded up).
int64_t PackedRowBytes(const CpuKernels& k, const LinearWeight& w);
// Packs rows x[t * x_stride ..+ w.cols] for t < n into packed + t * packed_stride.
void PackRows(const CpuKernels& k, const LinearWeight& w, const float* x, int64_t x_stride,
              int64_t n, std::byte* packed, int64_t packed_stride);
// y[t * y_stride + (m - m_begin)] = (W x_t)[m] for t < n and m in [m_begin, m_end), from the
// packed rows (FP8/BF16, Q8_K) or x itself (F32). Single-threaded.
void LinearRows(const CpuKernels& k, const LinearWeight& w, const std::byte* packed,
                int64_t packed_stride, const float* x, int64_t x_stride, int64_t n, int64_t m_begin,
                int64_t m_end, float* y, int64_t y_stride);

// A 64-byte aligned buffer that grows on demand (per thread; never shrinks).
class ScratchBuffer {
 public:
  std::byte* Get(size_t bytes);

 private:
  struct Free {
    void operator()(std::byte* p) const;
  };
  std::unique_ptr<std::byte, Free> data_;
  size_t size_ = 0;
};

// Weight-absorbed MLA attention (both device ops). `decode` groups single queries of different
// segments (up to 8 per group) so W_UK^T/W_UV are read once per group; otherwise queries are
// grouped per segment in tiles of 32 and keys are processed block by block with an online softmax
// (no N x N scores).
// With `partial`: MlaAttentionPartial (key ranges, the result merged into the state, no
// projection).
absl::Status CpuMlaAttention(const CpuKernels& kernels, ParallelRunner run,
                             const MlaAttentionArgs& args, bool decode,
                             const MlaPartialState* partial = nullptr);

// MlaProjectLatent: the same packing and kernels as the projection inside CpuMlaAttention.
absl::Status CpuMlaProjectLatent(const CpuKernels& kernels, ParallelRunner run,
                                 const MlaDimensions& dims, const LinearWeight& kv_b,
                                 const float* u, int64_t n, float* out, int64_t out_stride);

}  // namespace hmoe::internal
