#pragma once

// BF16 x BF16 matrix-vector products on the CPU (lm_head, the router, BF16 checkpoints).
//
// The weight W [M, K] is read in place: row-major BF16 (as stored in the checkpoint; any
// alignment). The kernels compute, for each token t and row m,
//
//   y[t][m] = sum_k W[m][k] * bf16(x[t][k])
//
// with the activation rounded to BF16 (round to nearest even) and the products accumulated in
// F32 in an order that depends on the variant (results agree to F32 rounding, not bitwise).
// Variants: a scalar reference, AVX2+FMA and AVX-512 F/BW (each BF16 pair widened to exact F32,
// FMAs) and AVX-512 BF16 (vdpbf16ps, which flushes BF16 subnormals to zero). Kernels never start
// threads: callers split the rows into ranges.

#include <cstddef>
#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"

#include "common/kernels/cpu/fp8_gemv.h"

namespace hmoe::cpu {

// A read-only view of a row-major BF16 matrix. Does not own memory. Element (r, c) is the 16-bit
// little-endian value at data + 2 * (r * row_stride + c).
struct Bf16MatrixView {
  const std::byte* data = nullptr;
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t row_stride = 0;  // elements between rows, >= cols
};

// One variant. Immutable, thread-safe.
class Bf16Gemv {
 public:
  virtual ~Bf16Gemv();
  Bf16Gemv(const Bf16Gemv&) = delete;
  Bf16Gemv& operator=(const Bf16Gemv&) = delete;

  virtual CpuIsa isa() const = 0;

  // Bytes of one token's packed activation of length k: BF16 in natural order, zero-padded to a
  // multiple of 32 elements.
  static int64_t PackedBytes(int64_t k) { return (k + 31) / 32 * 32 * 2; }
  // Packs x[0, k) (rounded to BF16) and the zero padding into `packed` (PackedBytes(k) bytes).
  static void Pack(const float* x, int64_t k, std::byte* packed);

  // y[t * y_stride + (m - m_begin)] = (W x_t)[m] for t in [0, n), m in [m_begin, m_end), with x_t
  // packed at packed + t * packed_stride. 1 <= n <= kMaxMatVecTokens.
  virtual void MatVec(const Bf16MatrixView& w, const std::byte* packed, int64_t packed_stride,
                      int n, int64_t m_begin, int64_t m_end, float* y, int64_t y_stride) const = 0;

  // Any number of tokens n >= 1; weight rows are reused from cache across token groups.
  void GemmRows(const Bf16MatrixView& w, const std::byte* packed, int64_t packed_stride, int64_t n,
                int64_t m_begin, int64_t m_end, float* y, int64_t y_stride) const;

 protected:
  Bf16Gemv();
};

// kScalar always; kAvx2 / kAvx512 / kAvx512Bf16 when supported; Unavailable otherwise.
absl::StatusOr<std::unique_ptr<Bf16Gemv>> NewBf16Gemv(CpuIsa isa);
// The fastest variant for BestCpuIsa(). Never null; lives forever.
const Bf16Gemv& DefaultBf16Gemv();

namespace internal {
Bf16Gemv* NewScalarBf16Gemv();
Bf16Gemv* NewAvx2Bf16Gemv();        // only after a CPU check
Bf16Gemv* NewAvx512Bf16Gemv();      // only after a CPU check
Bf16Gemv* NewAvx512Bf16Bf16Gemv();  // only after a CPU check
}  // namespace internal

}  // namespace hmoe::cpu
