#include "common/kernels/cpu/fp8_gemm.h"

#include <algorithm>
#include <array>
#include <cstdlib>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"

#include "common/base/logging.h"
#include "common/kernels/cpu/fp8_gemm_internal.h"
#include "common/kernels/shared_math.h"

namespace hmoe::cpu {
namespace {

constexpr int64_t kScaleBlock = 128;

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The portable fallback: plain loops over the definition in the header, activations packed as
// BF16-rounded F32 rows.
class ScalarFp8Gemm final : public Fp8Gemm {
 public:
  ScalarFp8Gemm() {
    for (int i = 0; i < 256; ++i) table_[i] = kernels::Fp8E4M3ToFloatBits(static_cast<uint8_t>(i));
  }

  CpuIsa isa() const override { return CpuIsa::kScalar; }
  int64_t TokenTile() const override { return 1; }
  int64_t PackedBytes(int64_t m, int64_t k) const override { return m * k * 4; }

  void Pack(const float* x, int64_t x_stride, int64_t m, int64_t k, int64_t t_begin, int64_t t_end,
            std::byte* packed) const override {
    HMOE_CHECK(0 <= t_begin && t_begin <= t_end && t_end <= m);
    float* out = reinterpret_cast<float*>(packed);
    for (int64_t t = t_begin; t < t_end; ++t) {
      for (int64_t i = 0; i < k; ++i) {
        out[t * k + i] = kernels::Bf16BitsToFloat(kernels::FloatToBf16Bits(x[t * x_stride + i]));
      }
    }
  }

  int64_t ScratchBytes(int64_t) const override { return 0; }

  void Run(const Fp8MatrixView& w, const std::byte* packed, int64_t m, int64_t r_begin,
           int64_t r_end, float* y, int64_t y_stride, std::byte*) const override {
    const float* xs = reinterpret_cast<const float*>(packed);
    for (int64_t r = r_begin; r < r_end; ++r) {
      const uint8_t* row = w.data + r * w.row_stride;
      const float* scales = w.scale_inv + (r / kScaleBlock) * w.scale_stride;
      for (int64_t t = 0; t < m; ++t) {
        const float* x = xs + t * w.cols;
        float total = 0.0f;
        for (int64_t k0 = 0; k0 < w.cols; k0 += kScaleBlock) {
          const int64_t k1 = std::min(w.cols, k0 + kScaleBlock);
          float block = 0.0f;
          for (int64_t k = k0; k < k1; ++k) block += table_[row[k]] * x[k];
          total += block * scales[k0 / kScaleBlock];
        }
        y[t * y_stride + (r - r_begin)] = total;
      }
    }
  }

 private:
  std::array<float, 256> table_;
};

// A per-thread 64-byte aligned buffer that grows on demand.
struct ThreadScratch {
  std::byte* data = nullptr;
  int64_t size = 0;
  ~ThreadScratch() { std::free(data); }
  std::byte* Get(int64_t bytes) {
    if (bytes > size) {
      std::free(data);
      size = std::max<int64_t>(4096, CeilDiv(bytes, 4096) * 4096);
      data = static_cast<std::byte*>(std::aligned_alloc(64, static_cast<size_t>(size)));
      HMOE_CHECK(data != nullptr) << "fp8 gemm scratch of " << size << " bytes";
    }
    return data;
  }
};

}  // namespace

Fp8Gemm::Fp8Gemm() = default;
Fp8Gemm::~Fp8Gemm() = default;

void Fp8Gemm::Multiply(const Fp8MatrixView& w, const std::byte* packed, int64_t m, int64_t r_begin,
                       int64_t r_end, float* y, int64_t y_stride) const {
  HMOE_CHECK(m >= 0 && 0 <= r_begin && r_begin <= r_end && r_end <= w.rows)
      << "fp8 gemm: m " << m << ", rows [" << r_begin << ", " << r_end << ") of " << w.rows;
  if (m == 0 || r_begin == r_end) return;
  thread_local ThreadScratch scratch;
  Run(w, packed, m, r_begin, r_end, y, y_stride, scratch.Get(ScratchBytes(m)));
}

absl::StatusOr<std::unique_ptr<Fp8Gemm>> NewFp8Gemm(CpuIsa isa) {
  if (!CpuSupports(isa)) {
    return absl::UnavailableError(
        absl::StrCat("fp8 gemm ", std::string(CpuIsaName(isa)), ": not supported by this CPU"));
  }
  switch (isa) {
    case CpuIsa::kScalar:
      return std::unique_ptr<Fp8Gemm>(new ScalarFp8Gemm());
    case CpuIsa::kAvx2:
      return std::unique_ptr<Fp8Gemm>(internal::NewAvx2Fp8Gemm());
    case CpuIsa::kAvx512:
      return std::unique_ptr<Fp8Gemm>(internal::NewAvx512Fp8Gemm());
    case CpuIsa::kAvx512Bf16:
      return std::unique_ptr<Fp8Gemm>(internal::NewAvx512Bf16Fp8Gemm());
  }
  return absl::InvalidArgumentError("fp8 gemm: unknown isa");
}

const Fp8Gemm& DefaultFp8Gemm() {
  static const Fp8Gemm* const kDefault = [] {
    absl::StatusOr<std::unique_ptr<Fp8Gemm>> gemm = NewFp8Gemm(BestCpuIsa());
    HMOE_CHECK_OK(gemm.status());
    return gemm->release();
  }();
  return *kDefault;
}

int64_t Fp8GemmMinTokens(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kScalar:
      return INT64_MAX;  // the GEMV's GemmRows is as good
    default:
      return 16;
  }
}

}  // namespace hmoe::cpu
