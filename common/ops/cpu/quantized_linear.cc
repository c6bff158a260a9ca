#include "common/ops/cpu/quantized_linear.h"

#include <vector>

#include "common/base/logging.h"
#include "common/kernels/cpu/f32_ops.h"
#include "common/model/gguf_quants.h"

namespace hmoe::cpu {

bool IsQuantizedLinearDType(DType dtype) { return IsBlockDType(dtype) || dtype == DType::kF16; }

void DequantizeRow(const QuantizedMatrixView& w, int64_t r, float* dst) {
  const int ggml = GgmlTypeIdOf(w.dtype);
  const absl::Status s = DequantizeGgml(
      static_cast<uint32_t>(ggml), w.data + DTypeBytes(w.dtype, r * w.row_stride), w.cols, dst);
  HMOE_CHECK(s.ok()) << "dequantize a row of a checked " << DTypeName(w.dtype) << " weight: " << s;
}

void QuantizedLinearRows(const QuantizedMatrixView& w, const float* x, int64_t x_stride, int64_t n,
                         int64_t m_begin, int64_t m_end, float* y, int64_t y_stride) {
  if (m_begin >= m_end || n <= 0) return;
  thread_local std::vector<float> row;
  if (row.size() < static_cast<size_t>(w.cols)) row.resize(static_cast<size_t>(w.cols));
  for (int64_t m = m_begin; m < m_end; ++m) {
    DequantizeRow(w, m, row.data());
    for (int64_t t = 0; t < n; ++t) {
      y[t * y_stride + (m - m_begin)] = DotF32(row.data(), x + t * x_stride, w.cols);
    }
  }
}

}  // namespace hmoe::cpu
