#include "common/ops/cpu/quantized_linear.h"

#include <cstdlib>
#include <string_view>
#include <vector>

#include "common/base/logging.h"
#include "common/kernels/cpu/f32_ops.h"
#include "common/model/gguf_quants.h"

namespace hmoe::cpu {

bool IsQuantizedLinearDType(DType dtype) { return IsBlockDType(dtype) || dtype == DType::kF16; }

const char* QuantActivationsName(QuantActivations mode) {
  return mode == QuantActivations::kF32 ? "f32" : "q8k";
}

QuantActivations DefaultQuantActivations() {
  static const QuantActivations kMode = [] {
    const char* env = std::getenv("HMOE_QUANT_ACTIVATIONS");
    if (env == nullptr || *env == '\0') return QuantActivations::kQ8K;
    const std::string_view v(env);
    if (v == "f32") return QuantActivations::kF32;
    if (v != "q8k") {
      HMOE_LOG(WARNING) << "HMOE_QUANT_ACTIVATIONS=" << v << " is not f32 or q8k; using q8k";
    }
    return QuantActivations::kQ8K;
  }();
  return kMode;
}

bool UsesQ8KActivations(DType dtype, QuantActivations mode) {
  return mode == QuantActivations::kQ8K && IsBlockDType(dtype) &&
         QuantGemvSupportsType(static_cast<uint32_t>(GgmlTypeIdOf(dtype)));
}

void QuantizeActivationsQ8K(const float* x, int64_t x_stride, int64_t n, int64_t cols,
                            BlockQ8K* out, int64_t out_stride) {
  for (int64_t t = 0; t < n; ++t) QuantizeQ8K(x + t * x_stride, cols, out + t * out_stride);
}

void QuantizedLinearRowsQ8K(const QuantGemv& kernels, const QuantizedMatrixView& w,
                            const BlockQ8K* xq, int64_t xq_stride, int64_t n, int64_t m_begin,
                            int64_t m_end, float* y, int64_t y_stride) {
  if (m_begin >= m_end || n <= 0) return;
  QuantMatrixView v;
  v.type = static_cast<uint32_t>(GgmlTypeIdOf(w.dtype));
  v.data = reinterpret_cast<const uint8_t*>(w.data);
  v.rows = w.rows;
  v.cols = w.cols;
  v.row_stride = DTypeBytes(w.dtype, w.row_stride);
  if (n <= kMaxMatVecTokens) {
    kernels.MatVec(v, xq, xq_stride, static_cast<int>(n), m_begin, m_end, y, y_stride);
  } else {
    kernels.GemmRows(v, xq, xq_stride, n, m_begin, m_end, y, y_stride);
  }
}

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
