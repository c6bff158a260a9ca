#include "common/kernels/cpu/fp8_gemm.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"

#include "common/base/logging.h"
#include "common/kernels/cpu/fp8_gemm_internal.h"
#include "common/kernels/shared_math.h"

namespace hmoe::cpu {
namespace {

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The portable fallback: activations packed as BF16-rounded F32 rows of k floats, multiplied by the
// scalar Fp8Gemv's loops (GemmRows over unpadded rows: the same sums in the same order per token).
class ScalarFp8Gemm final : public Fp8Gemm {
 public:
  ScalarFp8Gemm() : gemv_(*NewFp8Gemv(CpuIsa::kScalar)) {}

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

  int64_t ScratchBytes(int64_t, int64_t) const override { return 0; }

  void Run(const Fp8MatrixView& w, const std::byte* packed, int64_t m, int64_t r_begin,
           int64_t r_end, float* y, int64_t y_stride, std::byte*) const override {
    if (m == 0) return;  // GemmRows wants at least one token
    gemv_->GemmRows(w, packed, w.cols * static_cast<int64_t>(sizeof(float)), m, r_begin, r_end, y,
                    y_stride);
  }

 private:
  const std::unique_ptr<Fp8Gemv> gemv_;
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

// An ISA variant together with the Fp8Gemv it packs with (owned here, so the ISA-specific files
// never instantiate std::unique_ptr).
class OwningFp8Gemm final : public Fp8Gemm {
 public:
  OwningFp8Gemm(std::unique_ptr<Fp8Gemv> gemv, Fp8Gemm* (*factory)(const Fp8Gemv*))
      : gemv_(std::move(gemv)), gemm_(factory(gemv_.get())) {}

  CpuIsa isa() const override { return gemm_->isa(); }
  int64_t TokenTile() const override { return gemm_->TokenTile(); }
  int64_t PackedBytes(int64_t m, int64_t k) const override { return gemm_->PackedBytes(m, k); }
  void Pack(const float* x, int64_t x_stride, int64_t m, int64_t k, int64_t t_begin, int64_t t_end,
            std::byte* packed) const override {
    HMOE_CHECK(0 <= t_begin && t_begin <= t_end && t_end <= m && t_begin % TokenTile() == 0 &&
               (t_end == m || t_end % TokenTile() == 0))
        << "fp8 gemm pack: tokens [" << t_begin << ", " << t_end << ") of " << m;
    gemm_->Pack(x, x_stride, m, k, t_begin, t_end, packed);
  }
  int64_t ScratchBytes(int64_t m, int64_t k) const override { return gemm_->ScratchBytes(m, k); }
  void Run(const Fp8MatrixView& w, const std::byte* packed, int64_t m, int64_t r_begin,
           int64_t r_end, float* y, int64_t y_stride, std::byte* scratch) const override {
    gemm_->Run(w, packed, m, r_begin, r_end, y, y_stride, scratch);
  }

 private:
  const std::unique_ptr<Fp8Gemv> gemv_;
  const std::unique_ptr<Fp8Gemm> gemm_;
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
  Run(w, packed, m, r_begin, r_end, y, y_stride, scratch.Get(ScratchBytes(m, w.cols)));
}

absl::StatusOr<std::unique_ptr<Fp8Gemm>> NewFp8Gemm(CpuIsa isa) {
  if (!CpuSupports(isa)) {
    return absl::UnavailableError(
        absl::StrCat("fp8 gemm ", std::string(CpuIsaName(isa)), ": not supported by this CPU"));
  }
  if (isa == CpuIsa::kScalar) return std::unique_ptr<Fp8Gemm>(new ScalarFp8Gemm());
  absl::StatusOr<std::unique_ptr<Fp8Gemv>> gemv = NewFp8Gemv(isa);
  if (!gemv.ok()) return gemv.status();
  switch (isa) {
    case CpuIsa::kScalar:
      break;
    case CpuIsa::kAvx2:
      return std::unique_ptr<Fp8Gemm>(
          new OwningFp8Gemm(*std::move(gemv), &internal::NewAvx2Fp8Gemm));
    case CpuIsa::kAvx512:
      return std::unique_ptr<Fp8Gemm>(
          new OwningFp8Gemm(*std::move(gemv), &internal::NewAvx512Fp8Gemm));
    case CpuIsa::kAvx512Bf16:
      return std::unique_ptr<Fp8Gemm>(
          new OwningFp8Gemm(*std::move(gemv), &internal::NewAvx512Bf16Fp8Gemm));
    case CpuIsa::kAmx:
      return std::unique_ptr<Fp8Gemm>(
          new OwningFp8Gemm(*std::move(gemv), &internal::NewAmxFp8Gemm));
  }
  return absl::InvalidArgumentError("fp8 gemm: unknown isa");
}

const Fp8Gemm& DefaultFp8Gemm() {
  static const Fp8Gemm* const kDefault = &Fp8GemmForIsa(BestCpuIsa());
  return *kDefault;
}

const Fp8Gemm& Fp8GemmForIsa(CpuIsa isa) {
  // One instance per variant, created on first use (thread-safe statics).
  static const Fp8Gemm* const kVariants[5] = {
      [] {
        auto g = NewFp8Gemm(CpuIsa::kScalar);
        return g.ok() ? g->release() : nullptr;
      }(),
      [] {
        auto g = NewFp8Gemm(CpuIsa::kAvx2);
        return g.ok() ? g->release() : nullptr;
      }(),
      [] {
        auto g = NewFp8Gemm(CpuIsa::kAvx512);
        return g.ok() ? g->release() : nullptr;
      }(),
      [] {
        auto g = NewFp8Gemm(CpuIsa::kAvx512Bf16);
        return g.ok() ? g->release() : nullptr;
      }(),
      [] {
        auto g = NewFp8Gemm(CpuIsa::kAmx);
        return g.ok() ? g->release() : nullptr;
      }(),
  };
  const Fp8Gemm* g = kVariants[static_cast<int>(isa)];
  HMOE_CHECK(g != nullptr) << "fp8 gemm " << CpuIsaName(isa) << ": not supported by this CPU";
  return *g;
}

// AMX: the GEMM expands each weight once per call, the GEMV's GemmRows once per 8 tokens. Measured
// (hmoe_gemm_bench, expert gate 2048 x 7168, 1 thread, Sapphire Rapids): 8 tokens GEMV 0.95 ms vs
// GEMM 1.37 ms; 12 tokens GEMV 2.29 ms vs GEMM 1.37 ms (docs/PERFORMANCE.md).
constexpr int64_t kAmxGemmMinTokens = 9;

int64_t Fp8GemmMinTokens(CpuIsa isa) {
  // Measured with hmoe_gemm_bench (expert gate shape 2048 x 7168, one thread, CPU time, Sapphire
  // Rapids; docs/PERFORMANCE.md). AVX-512 BF16: the GEMM overtakes the GEMV's GemmRows between 16
  // and 24 tokens. AVX-512F: the GEMV-exact GEMM never beats that GEMV (its F32 expansion needs
  // two vectors per weight vector and the GEMV hides it already). AVX2: the GEMV-exact GEMM
  // (fp8_gemm_avx2.cc) does not beat the GEMV yet: 0.40-0.49 of the F32 FMA ymm peak vs the GEMV's
  // 0.52-0.57 for 16-512 tokens (AMD EPYC Zen 5, forced avx2, 1 thread, docs/PERFORMANCE.md).
  switch (isa) {
    case CpuIsa::kScalar:
    case CpuIsa::kAvx512:
    case CpuIsa::kAvx2:
      return INT64_MAX;
    case CpuIsa::kAvx512Bf16:
      return 24;
    case CpuIsa::kAmx:
      return kAmxGemmMinTokens;
  }
  return INT64_MAX;
}

bool Fp8GemmMatchesGemv(CpuIsa isa) {
  // The AVX2 and AVX-512 variants replay the GEMV's per-token operations (fp8_gemm_avx2.cc,
  // fp8_gemm_impl.h), the AMX one its tile operations (fp8_amx_impl.h). Checked bitwise by
  // tests/kernels/fp8_gemm_test.cc.
  return isa == CpuIsa::kAvx2 || isa == CpuIsa::kAvx512 || isa == CpuIsa::kAvx512Bf16 ||
         isa == CpuIsa::kAmx;
}

}  // namespace hmoe::cpu
