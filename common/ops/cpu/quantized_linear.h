#pragma once

// The CPU's ONE product with GGML block-quantized weights (GGUF models, issue 18): every
// CpuDevice::Linear, MLA projection and grouped-expert product whose weight is Q8_0, Q5_0, Q4_K,
// Q5_K, Q6_K (or F16) ends here, so a faster kernel (Q4_K/Q6_K x Q8_K dot products) replaces
// this one function's body and nothing else.
//
// Today: each weight row is dequantized with DequantizeGgml (bit for bit the gguf package's
// values) into an F32 scratch row, then dotted with every token's F32 activations (cpu::DotF32).
// So the result is the FP32 reference's on the dequantized weights up to the F32 summation order
// (no BF16 rounding of the activations, unlike the FP8/BF16 paths). Scalar dequantization: about
// as fast as the memory for small models, far from it for real ones (docs/gguf.md).

#include <cstddef>
#include <cstdint>

#include "common/model/dtype.h"

namespace hmoe::cpu {

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

// Row r of W as F32 (dst: w.cols floats): EmbeddingGather and the router read rows this way.
void DequantizeRow(const QuantizedMatrixView& w, int64_t r, float* dst);

}  // namespace hmoe::cpu
