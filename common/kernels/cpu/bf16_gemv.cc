#include "common/kernels/cpu/bf16_gemv.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"

#include "common/base/logging.h"
#include "common/kernels/shared_math.h"

namespace hmoe::cpu {
namespace {

float LoadBf16(const std::byte* p) {
  uint16_t b;
  std::memcpy(&b, p, sizeof(b));
  return kernels::Bf16BitsToFloat(b);
}

// The reference: one F32 sum per (token, row) in column order.
class ScalarBf16Gemv final : public Bf16Gemv {
 public:
  CpuIsa isa() const override { return CpuIsa::kScalar; }

  void MatVec(const Bf16MatrixView& w, const std::byte* packed, int64_t packed_stride, int n,
              int64_t m_begin, int64_t m_end, float* y, int64_t y_stride) const override {
    HMOE_CHECK(n >= 1 && n <= kMaxMatVecTokens);
    HMOE_CHECK(0 <= m_begin && m_begin <= m_end && m_end <= w.rows);
    for (int t = 0; t < n; ++t) {
      const std::byte* x = packed + t * packed_stride;
      for (int64_t m = m_begin; m < m_end; ++m) {
        const std::byte* row = w.data + 2 * m * w.row_stride;
        float acc = 0.0f;
        for (int64_t k = 0; k < w.cols; ++k) acc += LoadBf16(row + 2 * k) * LoadBf16(x + 2 * k);
        y[t * y_stride + (m - m_begin)] = acc;
      }
    }
  }
};

}  // namespace

Bf16Gemv::Bf16Gemv() = default;
Bf16Gemv::~Bf16Gemv() = default;

void Bf16Gemv::Pack(const float* x, int64_t k, std::byte* packed) {
  uint16_t* out = reinterpret_cast<uint16_t*>(packed);
  const int64_t padded = PackedBytes(k) / 2;
  for (int64_t i = 0; i < k; ++i) out[i] = kernels::FloatToBf16Bits(x[i]);
  for (int64_t i = k; i < padded; ++i) out[i] = 0;
}

void Bf16Gemv::GemmRows(const Bf16MatrixView& w, const std::byte* packed, int64_t packed_stride,
                        int64_t n, int64_t m_begin, int64_t m_end, float* y,
                        int64_t y_stride) const {
  HMOE_CHECK(n >= 1);
  // A block of rows that stays in L2 while every group of tokens passes over it.
  const int64_t block_rows =
      std::clamp<int64_t>((256 * 1024 / std::max<int64_t>(2 * w.cols, 1)) / 16 * 16, 16, 128);
  for (int64_t r0 = m_begin; r0 < m_end; r0 += block_rows) {
    const int64_t r1 = std::min(m_end, r0 + block_rows);
    for (int64_t t0 = 0; t0 < n; t0 += kMaxMatVecTokens) {
      const int nt = static_cast<int>(std::min<int64_t>(kMaxMatVecTokens, n - t0));
      MatVec(w, packed + t0 * packed_stride, packed_stride, nt, r0, r1,
             y + t0 * y_stride + (r0 - m_begin), y_stride);
    }
  }
}

absl::StatusOr<std::unique_ptr<Bf16Gemv>> NewBf16Gemv(CpuIsa isa) {
  if (isa == CpuIsa::kScalar) return std::unique_ptr<Bf16Gemv>(internal::NewScalarBf16Gemv());
  if (isa == CpuIsa::kAmx && CpuSupports(isa)) isa = CpuIsa::kAvx512Bf16;  // no AMX variant
  if (isa == CpuIsa::kAvx512Bf16 && CpuSupports(isa)) {
    return std::unique_ptr<Bf16Gemv>(internal::NewAvx512Bf16Bf16Gemv());
  }
  if (isa == CpuIsa::kAvx512 && CpuSupports(isa)) {
    return std::unique_ptr<Bf16Gemv>(internal::NewAvx512Bf16Gemv());
  }
  if (isa == CpuIsa::kAvx2 && CpuSupports(isa)) {
    return std::unique_ptr<Bf16Gemv>(internal::NewAvx2Bf16Gemv());
  }
  return absl::UnavailableError(
      absl::StrCat("bf16 gemv: no ", std::string(CpuIsaName(isa)), " variant on this CPU"));
}

const Bf16Gemv& DefaultBf16Gemv() {
  static const Bf16Gemv* const kDefault = [] {
    absl::StatusOr<std::unique_ptr<Bf16Gemv>> gemv = NewBf16Gemv(BestCpuIsa());
    HMOE_CHECK_OK(gemv.status());
    return gemv->release();
  }();
  return *kDefault;
}

namespace internal {
Bf16Gemv* NewScalarBf16Gemv() { return new ScalarBf16Gemv(); }
}  // namespace internal

}  // namespace hmoe::cpu
