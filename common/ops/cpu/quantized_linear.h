#pragma once

// The CPU's products with GGML block-quantized weights (GGUF models, issue 18): every
// CpuDevice::Linear, MLA projection and grouped-expert product whose weight is Q8_0, Q5_0, Q4_K,
// Q5_K, Q6_K (or F16) ends here. Two ways, chosen per process (QuantActivationsMode):
//
// - q8k (the default; what llama.cpp computes for a Q4_K_M model): the activation row is rounded
//   once to Q8_K (cpu::QuantizeQ8K, common/kernels/cpu/quant_gemv.h) and reused for every weight
//   row (CpuDevice also reuses it across consecutive products with the same input, e.g. an
//   expert's gate and up), then the integer kernels of DefaultQuantGemv() (AVX-512 VNNI / AVX2 /
//   scalar) take the dot products: QuantizeActivationsQ8K + QuantizedLinearRowsQ8K. F16 weights
//   have no such kernel and take the f32 way.
// - f32 (HMOE_QUANT_ACTIVATIONS=f32, for accuracy comparisons): each weight row is dequantized
//   with DequantizeGgml (bit for bit the gguf package's values) into an F32 scratch row, then
//   dotted with every token's F32 activations (cpu::DotF32): the FP32 reference's result on the
//   dequantized weights up to the F32 summation order (QuantizedLinearRows). Scalar: far from
//   the memory bound on real models.

#include <cstddef>
#include <cstdint>

#include "common/kernels/cpu/quant_gemv.h"
#include "common/model/dtype.h"

namespace hmoe::cpu {

// How a product with a block-type weight treats its F32 activations (see above).
enum class QuantActivations {
  kF32,  // dequantize the weight row, F32 dot products
  kQ8K,  // round the activations to Q8_K, integer kernels
};
// "f32" / "q8k".
const char* QuantActivationsName(QuantActivations mode);
// The process's mode: HMOE_QUANT_ACTIVATIONS (f32 | q8k), read once; q8k when unset; an unknown
// value logs a warning and gives q8k. Every CpuDevice takes this unless its options say otherwise.
QuantActivations DefaultQuantActivations();
// Whether products with `dtype` weights round their activations to Q8_K under `mode`: q8k and a
// GGML block type (F16 never: no kernel).
bool UsesQ8KActivations(DType dtype, QuantActivations mode);

// A weight W [rows, cols] of a block type (or F16) in host memory: row r starts at
// data + DTypeBytes(dtype, r * row_stride); row_stride and cols are in elements and are whole
// blocks (multiples of DTypeBlockElements). Any alignment.
struct QuantizedMatrixView {
  DType dtype = DType::kQ4_K;
  const std::byte* data = nullptr;
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t row_stride = 0;
};

// Whether QuantizedLinearRows computes with `dtype`: F16, Q8_0, Q5_0, Q4_K, Q5_K, Q6_K.
bool IsQuantizedLinearDType(DType dtype);

// y[t * y_stride + (m - m_begin)] = sum_c W[m][c] * x[t * x_stride + c] for t < n and
// m in [m_begin, m_end). Single-threaded (callers split the rows over their threads); uses a
// thread-local scratch row. The view must be valid (CpuDevice checks it).
void QuantizedLinearRows(const QuantizedMatrixView& w, const float* x, int64_t x_stride, int64_t n,
                         int64_t m_begin, int64_t m_end, float* y, int64_t y_stride);

// Rounds rows x[t * x_stride ..+ cols] (t < n) to Q8_K: Q8KBlocks(cols) blocks each at
// out + t * out_stride (out_stride in blocks, >= Q8KBlocks(cols)).
void QuantizeActivationsQ8K(const float* x, int64_t x_stride, int64_t n, int64_t cols,
                            BlockQ8K* out, int64_t out_stride);

// The same contract as QuantizedLinearRows from the Q8_K activations xq[t * xq_stride] of
// QuantizeActivationsQ8K (UsesQ8KActivations(w.dtype, kQ8K) must hold), on `kernels`: MatVec for
// up to kMaxMatVecTokens tokens, GemmRows (bitwise the same per token) above. Results: the exact
// product of the dequantized weights and the dequantized Q8_K activations within the kernels'
// bound (quant_gemv.h: (cols/32 + 8) * 2^-24 * S).
void QuantizedLinearRowsQ8K(const QuantGemv& kernels, const QuantizedMatrixView& w,
                            const BlockQ8K* xq, int64_t xq_stride, int64_t n, int64_t m_begin,
                            int64_t m_end, float* y, int64_t y_stride);

// Row r of W as F32 (dst: w.cols floats): EmbeddingGather and the router read rows this way.
void DequantizeRow(const QuantizedMatrixView& w, int64_t r, float* dst);

}  // namespace hmoe::cpu
