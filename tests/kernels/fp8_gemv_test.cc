#include "common/kernels/cpu/fp8_gemv.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include <gtest/gtest.h>

#include "common/kernels/shared_math.h"

namespace hmoe::cpu {
namespace {

using kernels::Bf16BitsToFloat;
using kernels::FloatToBf16Bits;
using kernels::Fp8E4M3ToFloatBits;

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

bool IsNanCode(uint8_t c) { return (c & 0x7f) == 0x7f; }

// A dense random FP8 matrix with its scales, owning its memory.
struct TestMatrix {
  int64_t rows = 0;
  int64_t cols = 0;
  std::vector<uint8_t> data;
  std::vector<float> scales;

  Fp8MatrixView view() const {
    return Fp8MatrixView::Dense(data.data(), scales.data(), rows, cols);
  }
};

TestMatrix RandomMatrix(int64_t rows, int64_t cols, std::mt19937& rng) {
  TestMatrix m;
  m.rows = rows;
  m.cols = cols;
  m.data.resize(rows * cols);
  std::uniform_int_distribution<int> code(0, 255);
  for (uint8_t& b : m.data) {
    do {
      b = static_cast<uint8_t>(code(rng));
    } while (IsNanCode(b));
  }
  // Scales as in real checkpoints: around 448^-1 * max|w|, spread over a few octaves.
  std::uniform_real_distribution<float> scale(1e-4f, 4e-3f);
  m.scales.resize(CeilDiv(rows, 128) * CeilDiv(cols, 128));
  for (float& s : m.scales) s = scale(rng);
  return m;
}

std::vector<float> RandomActivations(int64_t n, int64_t k, std::mt19937& rng) {
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> x(n * k);
  for (float& v : x) v = dist(rng);
  return x;
}

// Packs n tokens of length k (rows of x) for `gemv`, 64-byte aligned.
struct Packed {
  std::vector<std::byte> storage;
  std::byte* data = nullptr;
  int64_t stride = 0;
};

Packed PackAll(const Fp8Gemv& gemv, const std::vector<float>& x, int64_t n, int64_t k) {
  Packed p;
  p.stride = gemv.PackedBytes(k);
  p.storage.resize(n * p.stride + 64);
  p.data = p.storage.data() + (64 - reinterpret_cast<uintptr_t>(p.storage.data()) % 64) % 64;
  for (int64_t t = 0; t < n; ++t) gemv.Pack(x.data() + t * k, k, 0, k, p.data + t * p.stride);
  return p;
}

// FP64 reference of the header's definition (activation rounded to BF16), plus the magnitude
// sum |w * x * s| that bounds rounding errors.
struct RefResult {
  std::vector<double> y;
  std::vector<double> magnitude;
};

RefResult ReferenceFp64(const Fp8MatrixView& w, const std::vector<float>& x, int64_t n) {
  static const std::vector<double> decode = [] {
    std::vector<double> d(256);
    for (int i = 0; i < 256; ++i) d[i] = Fp8E4M3ToFloatBits(static_cast<uint8_t>(i));
    return d;
  }();
  RefResult r;
  r.y.assign(n * w.rows, 0.0);
  r.magnitude.assign(n * w.rows, 0.0);
  std::vector<double> xs(w.cols);
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t k = 0; k < w.cols; ++k)
      xs[k] = Bf16BitsToFloat(FloatToBf16Bits(x[t * w.cols + k]));
    for (int64_t m = 0; m < w.rows; ++m) {
      const uint8_t* row = w.data + m * w.row_stride;
      const float* scales = w.scale_inv + (m / 128) * w.scale_stride;
      double sum = 0.0;
      double mag = 0.0;
      for (int64_t k0 = 0; k0 < w.cols; k0 += 128) {
        const int64_t k1 = std::min(w.cols, k0 + 128);
        double block = 0.0, block_mag = 0.0;
        for (int64_t k = k0; k < k1; ++k) {
          const double p = decode[row[k]] * xs[k];
          block += p;
          block_mag += std::fabs(p);
        }
        sum += block * scales[k0 / 128];
        mag += block_mag * std::fabs(scales[k0 / 128]);
      }
      r.y[t * w.rows + m] = sum;
      r.magnitude[t * w.rows + m] = mag;
    }
  }
  return r;
}

std::unique_ptr<Fp8Gemv> MakeOrNull(CpuIsa isa, int64_t prefetch_bytes = -1, bool linear = false) {
  if (!CpuSupports(isa)) return nullptr;
  Fp8GemvOptions options;
  options.prefetch = prefetch_bytes != -2;
  options.prefetch_bytes = prefetch_bytes;
  options.prefetch_linear = linear;
  auto gemv = NewFp8Gemv(isa, options);
  EXPECT_TRUE(gemv.ok()) << gemv.status();
  return gemv.ok() ? std::move(*gemv) : nullptr;
}

class Fp8GemvVariantTest : public ::testing::TestWithParam<CpuIsa> {
 protected:
  void SetUp() override {
    gemv_ = MakeOrNull(GetParam());
    if (gemv_ == nullptr) GTEST_SKIP() << CpuIsaName(GetParam()) << " not supported by this CPU";
    reference_ = MakeOrNull(CpuIsa::kScalar);
  }

  std::unique_ptr<Fp8Gemv> gemv_;
  std::unique_ptr<Fp8Gemv> reference_;
};

TEST(CpuFeaturesTest, ScalarAlwaysSupportedAndBestIsSupported) {
  EXPECT_TRUE(CpuSupports(CpuIsa::kScalar));
  EXPECT_TRUE(CpuSupports(BestCpuIsa()));
  EXPECT_EQ(DefaultFp8Gemv().isa(), BestCpuIsa());
  EXPECT_EQ(CpuIsaName(CpuIsa::kAvx512Bf16), "avx512bf16");
  EXPECT_EQ(CpuIsaName(CpuIsa::kAmx), "amx");
  // AMX needs everything avx512bf16 needs.
  if (CpuSupports(CpuIsa::kAmx)) {
    EXPECT_TRUE(CpuSupports(CpuIsa::kAvx512Bf16));
  }
}

// HMOE_CPU_ISA lowers the dispatch (ctest runs this binary again with HMOE_CPU_ISA=avx2 on
// AVX-512 machines, label cpu_isa).
TEST(CpuFeaturesTest, TheIsaOverrideIsHonored) {
  const char* env = std::getenv("HMOE_CPU_ISA");
  if (env == nullptr || *env == '\0') GTEST_SKIP() << "HMOE_CPU_ISA is not set";
  for (CpuIsa isa :
       {CpuIsa::kScalar, CpuIsa::kAvx2, CpuIsa::kAvx512, CpuIsa::kAvx512Bf16, CpuIsa::kAmx}) {
    if (CpuIsaName(isa) != env) continue;
    if (!CpuSupports(isa)) GTEST_SKIP() << env << " is not supported by this CPU";
    EXPECT_EQ(BestCpuIsa(), isa);
    EXPECT_EQ(DefaultFp8Gemv().isa(), isa);
    return;
  }
  GTEST_SKIP() << "HMOE_CPU_ISA=" << env << " names no variant";
}

TEST(Fp8MatrixViewTest, SlicesPointAtTheirBlocks) {
  std::vector<uint8_t> data(384 * 300);
  std::vector<float> scales(3 * 3);
  const Fp8MatrixView v = Fp8MatrixView::Dense(data.data(), scales.data(), 384, 300);
  EXPECT_EQ(v.scale_stride, 3);
  const Fp8MatrixView rows = v.RowSlice(128, 384);
  EXPECT_EQ(rows.data, data.data() + 128 * 300);
  EXPECT_EQ(rows.scale_inv, scales.data() + 3);
  EXPECT_EQ(rows.rows, 256);
  const Fp8MatrixView cols = v.ColSlice(256, 300);
  EXPECT_EQ(cols.data, data.data() + 256);
  EXPECT_EQ(cols.scale_inv, scales.data() + 2);
  EXPECT_EQ(cols.cols, 44);
  EXPECT_EQ(cols.row_stride, 300);
}

// Row m holds code m in every column; x = 1 and scale = 1, so y[m] = K * value(code m) exactly in
// any summation order (all partial sums are small multiples of a 4-bit-mantissa value).
TEST_P(Fp8GemvVariantTest, DecodesAll256CodesExactly) {
  for (int64_t k : {128, 192, 77}) {
    TestMatrix w;
    w.rows = 256;
    w.cols = k;
    w.data.resize(256 * k);
    for (int64_t m = 0; m < 256; ++m) {
      std::fill(w.data.begin() + m * k, w.data.begin() + (m + 1) * k, static_cast<uint8_t>(m));
    }
    w.scales.assign(2 * CeilDiv(k, 128), 1.0f);
    // One token, and the multi-token paths (wide tiles from 3 tokens, GemmRows beyond 8).
    for (int n : {1, 2, 3, 8, 11}) {
      const std::vector<float> x(n * k, 1.0f);
      const Packed p = PackAll(*gemv_, x, n, k);
      std::vector<float> y(n * 256, -1.0f);
      gemv_->GemmRows(w.view(), p.data, p.stride, n, 0, 256, y.data(), 256);
      for (int t = 0; t < n; ++t) {
        for (int m = 0; m < 256; ++m) {
          const float want = static_cast<float>(k) * Fp8E4M3ToFloatBits(static_cast<uint8_t>(m));
          const float got = y[t * 256 + m];
          if (IsNanCode(static_cast<uint8_t>(m))) {
            EXPECT_TRUE(std::isnan(got)) << "code " << m << " k " << k << " n " << n;
          } else {
            EXPECT_EQ(got, want) << "code " << m << " k " << k << " n " << n << " token " << t;
          }
        }
      }
    }
  }
}

// Random shapes with ragged edges, every batch size, random row ranges: equals the scalar
// reference to F32 rounding, and leaves rows outside the range alone.
TEST_P(Fp8GemvVariantTest, MatchesReferenceOnRaggedShapes) {
  std::mt19937 rng(1234);
  const std::pair<int64_t, int64_t> shapes[] = {{1, 1},     {3, 64},    {5, 65},    {7, 127},
                                                {129, 130}, {200, 300}, {257, 383}, {128, 128},
                                                {64, 1000}, {131, 256}, {9, 200}};
  for (auto [rows, cols] : shapes) {
    const TestMatrix w = RandomMatrix(rows, cols, rng);
    for (int n = 1; n <= kMaxMatVecTokens; ++n) {
      const std::vector<float> x = RandomActivations(n, cols, rng);
      const Packed p = PackAll(*gemv_, x, n, cols);
      const Packed pr = PackAll(*reference_, x, n, cols);
      const RefResult exact = ReferenceFp64(w.view(), x, n);
      std::uniform_int_distribution<int64_t> row(0, rows);
      int64_t m_begin = row(rng);
      int64_t m_end = row(rng);
      if (m_begin > m_end) std::swap(m_begin, m_end);
      if (n == 1) m_begin = 0, m_end = rows;  // also cover the full range
      const int64_t len = m_end - m_begin;
      constexpr float kSentinel = 12345.0f;
      std::vector<float> y(n * (len + 2), kSentinel);
      std::vector<float> yr(n * (len + 2), kSentinel);
      // Output rows at y[t * (len + 2) + 1 + i]; one sentinel on each side.
      gemv_->MatVec(w.view(), p.data, p.stride, n, m_begin, m_end, y.data() + 1, len + 2);
      reference_->MatVec(w.view(), pr.data, pr.stride, n, m_begin, m_end, yr.data() + 1, len + 2);
      for (int t = 0; t < n; ++t) {
        EXPECT_EQ(y[t * (len + 2)], kSentinel);
        EXPECT_EQ(y[t * (len + 2) + len + 1], kSentinel);
        for (int64_t i = 0; i < len; ++i) {
          const int64_t m = m_begin + i;
          const double tol = 1e-6 * exact.magnitude[t * rows + m] + 1e-30;
          const float got = y[t * (len + 2) + 1 + i];
          const float want = yr[t * (len + 2) + 1 + i];
          ASSERT_NEAR(got, want, 2 * tol)
              << "shape " << rows << "x" << cols << " n " << n << " token " << t << " row " << m;
          ASSERT_NEAR(want, exact.y[t * rows + m], tol) << "reference vs fp64";
        }
      }
    }
  }
}

// A NUMA-style slice (row_stride > cols, offset scale pointer) reads the right bytes and scales.
TEST_P(Fp8GemvVariantTest, SlicedViewMatchesDenseCopy) {
  std::mt19937 rng(77);
  const TestMatrix big = RandomMatrix(384, 640, rng);
  const Fp8MatrixView slice = big.view().RowSlice(128, 384).ColSlice(256, 600);
  TestMatrix dense;
  dense.rows = slice.rows;
  dense.cols = slice.cols;
  for (int64_t r = 0; r < slice.rows; ++r) {
    for (int64_t c = 0; c < slice.cols; ++c) dense.data.push_back(slice.data[r * 640 + c]);
  }
  for (int64_t i = 0; i < CeilDiv(slice.rows, 128); ++i) {
    for (int64_t j = 0; j < CeilDiv(slice.cols, 128); ++j) {
      dense.scales.push_back(slice.scale_inv[i * slice.scale_stride + j]);
    }
  }
  const int n = 3;
  const std::vector<float> x = RandomActivations(n, slice.cols, rng);
  const Packed p = PackAll(*gemv_, x, n, slice.cols);
  std::vector<float> y(n * slice.rows), want(n * slice.rows);
  gemv_->MatVec(slice, p.data, p.stride, n, 0, slice.rows, y.data(), slice.rows);
  const RefResult exact = ReferenceFp64(dense.view(), x, n);
  for (size_t i = 0; i < y.size(); ++i) {
    ASSERT_NEAR(y[i], exact.y[i], 1e-6 * exact.magnitude[i]) << i;
  }
}

// Prefetch distance changes speed, never results.
TEST_P(Fp8GemvVariantTest, PrefetchDistanceDoesNotChangeResults) {
  if (GetParam() == CpuIsa::kScalar) GTEST_SKIP() << "the scalar variant does not prefetch";
  std::mt19937 rng(5);
  const TestMatrix w = RandomMatrix(300, 520, rng);
  const std::vector<float> x = RandomActivations(2, 520, rng);
  std::vector<float> first;
  for (int64_t pf : {-2 /* off */, 0, 64, 4096, 1 << 20}) {
    const std::unique_ptr<Fp8Gemv> g = MakeOrNull(GetParam(), pf, /*linear=*/pf == 64);
    ASSERT_NE(g, nullptr);
    const Packed p = PackAll(*g, x, 2, 520);
    std::vector<float> y(2 * 300);
    g->MatVec(w.view(), p.data, p.stride, 2, 0, 300, y.data(), 300);
    if (first.empty()) {
      first = y;
    } else {
      EXPECT_EQ(y, first) << "prefetch " << pf;
    }
  }
}

// Packing in pieces (what the fused gate/up tasks do) equals packing at once.
TEST_P(Fp8GemvVariantTest, PackingInRangesEqualsPackingWhole) {
  std::mt19937 rng(9);
  const int64_t k = 300;
  const std::vector<float> x = RandomActivations(1, k, rng);
  const Packed whole = PackAll(*gemv_, x, 1, k);
  std::vector<std::byte> pieces(gemv_->PackedBytes(k), std::byte{0xAB});
  gemv_->Pack(x.data() + 128, k, 128, 256, pieces.data());
  gemv_->Pack(x.data(), k, 0, 64, pieces.data());
  gemv_->Pack(x.data() + 256, k, 256, k, pieces.data());
  gemv_->Pack(x.data() + 64, k, 64, 128, pieces.data());
  EXPECT_TRUE(std::equal(pieces.begin(), pieces.end(), whole.data));
}

// The acceptance check: a real-shaped expert matrix (DeepSeek-V3 / Kimi-K2 gate/up, 2048 x 7168)
// against FP64, within 1e-5 of sum |w*x*s|, for every SIMD variant this CPU runs (one matrix and
// one reference for all of them; the scalar variant is checked against FP64 on smaller shapes).
TEST(Fp8GemvRealShapeTest, EverySimdVariantWithin1e5OfFp64) {
  TestMatrix w;
  w.rows = 2048;
  w.cols = 7168;
  w.data.resize(w.rows * w.cols);
  uint64_t state = 2024;
  for (uint8_t& b : w.data) {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    b = static_cast<uint8_t>(state >> 24);
    if (IsNanCode(b)) b ^= 1;
  }
  std::mt19937 rng(2024);
  std::uniform_real_distribution<float> scale(1e-4f, 4e-3f);
  w.scales.resize(16 * 56);
  for (float& v : w.scales) v = scale(rng);
  const std::vector<float> x = RandomActivations(1, 7168, rng);
  const RefResult exact = ReferenceFp64(w.view(), x, 1);
  int tested = 0;
  for (CpuIsa isa : {CpuIsa::kAvx2, CpuIsa::kAvx512, CpuIsa::kAvx512Bf16, CpuIsa::kAmx}) {
    const std::unique_ptr<Fp8Gemv> gemv = MakeOrNull(isa);
    if (gemv == nullptr) continue;
    const Packed p = PackAll(*gemv, x, 1, 7168);
    std::vector<float> y(2048);
    gemv->MatVec(w.view(), p.data, p.stride, 1, 0, 2048, y.data(), 2048);
    double worst = 0.0;
    for (int64_t m = 0; m < 2048; ++m) {
      worst = std::max(worst, std::fabs(y[m] - exact.y[m]) / exact.magnitude[m]);
    }
    EXPECT_LT(worst, 1e-5) << CpuIsaName(isa);
    RecordProperty(absl::StrCat("worst_relative_error_", std::string(CpuIsaName(isa))),
                   absl::StrCat(worst));
    ++tested;
  }
  if (tested == 0) GTEST_SKIP() << "no SIMD variant on this CPU";
}

TEST_P(Fp8GemvVariantTest, GateUpSiluMatchesUnfusedReference) {
  std::mt19937 rng(31);
  const int64_t inter = 320, hidden = 200;
  const TestMatrix gate = RandomMatrix(inter, hidden, rng);
  const TestMatrix up = RandomMatrix(inter, hidden, rng);
  const TestMatrix down = RandomMatrix(hidden, inter, rng);
  for (int n : {1, 3, 8}) {
    // Activations large enough that SiLU sees both signs well away from zero.
    std::vector<float> x = RandomActivations(n, hidden, rng);
    for (float& v : x) v *= 300.0f;
    const Packed p = PackAll(*gemv_, x, n, hidden);
    // Fused, in two row ranges as two tasks would.
    const int64_t h_stride = gemv_->PackedBytes(inter);
    std::vector<std::byte> h_packed(n * h_stride);
    std::vector<float> h(n * inter);
    gemv_->GateUpSilu(gate.view(), up.view(), p.data, p.stride, n, 0, 192, h_packed.data(),
                      h_stride, h.data(), inter);
    gemv_->GateUpSilu(gate.view(), up.view(), p.data, p.stride, n, 192, inter, h_packed.data(),
                      h_stride, h.data() + 192, inter);
    // Unfused reference.
    const RefResult g = ReferenceFp64(gate.view(), x, n);
    const RefResult u = ReferenceFp64(up.view(), x, n);
    std::vector<float> h_ref(n * inter);
    for (int64_t i = 0; i < n * inter; ++i) {
      const double sg = g.y[i] / (1.0 + std::exp(-g.y[i]));
      h_ref[i] = static_cast<float>(sg * u.y[i]);
      const double tol =
          1e-5 * (std::fabs(sg) * u.magnitude[i] + g.magnitude[i] * std::fabs(u.y[i]));
      ASSERT_NEAR(h[i], h_ref[i], tol + 1e-30) << "element " << i << " n " << n;
    }
    // The packed h feeds the down projection like a packed reference h.
    std::vector<float> y(n * hidden), y_ref(n * hidden);
    gemv_->MatVec(down.view(), h_packed.data(), h_stride, n, 0, hidden, y.data(), hidden);
    const RefResult yr = ReferenceFp64(down.view(), h, n);
    for (int64_t i = 0; i < n * hidden; ++i) {
      ASSERT_NEAR(y[i], yr.y[i], 1e-6 * yr.magnitude[i] + 1e-30) << i;
    }
  }
}

TEST_P(Fp8GemvVariantTest, GemmRowsMatchesPerTokenMatVec) {
  std::mt19937 rng(8);
  const TestMatrix w = RandomMatrix(300, 260, rng);
  const int64_t n = 21;
  const std::vector<float> x = RandomActivations(n, 260, rng);
  const Packed p = PackAll(*gemv_, x, n, 260);
  std::vector<float> y(n * 250);
  gemv_->GemmRows(w.view(), p.data, p.stride, n, 50, 300, y.data(), 250);
  const RefResult exact = ReferenceFp64(w.view(), x, n);
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t m = 50; m < 300; ++m) {
      ASSERT_NEAR(y[t * 250 + m - 50], exact.y[t * 300 + m], 1e-6 * exact.magnitude[t * 300 + m])
          << t << " " << m;
    }
  }
}

// A token's result does not depend, bitwise, on the other tokens of the call, on the row range
// the call covers, nor on MatVec vs GemmRows: the engine's prefill (grouped experts, any number
// of tokens per expert) and decode (executor, up to kMaxMatVecTokens) paths, and the SLP runner
// against the resident engine, rely on it.
TEST_P(Fp8GemvVariantTest, TokenResultsDoNotDependOnBatchOrRowRange) {
  std::mt19937 rng(4242);
  for (auto [rows, cols] : {std::pair<int64_t, int64_t>{300, 256}, {131, 200}, {64, 1000}}) {
    const TestMatrix w = RandomMatrix(rows, cols, rng);
    const int64_t n = 45;
    const std::vector<float> x = RandomActivations(n, cols, rng);
    const Packed p = PackAll(*gemv_, x, n, cols);
    // Alone: one token, all rows.
    std::vector<float> alone(n * rows);
    for (int64_t t = 0; t < n; ++t) {
      gemv_->MatVec(w.view(), p.data + t * p.stride, p.stride, 1, 0, rows, alone.data() + t * rows,
                    rows);
    }
    // Every batch size, rows in ragged ranges (odd starts and ends).
    for (int nb = 2; nb <= kMaxMatVecTokens; ++nb) {
      std::vector<float> y(n * rows, -1.0f);
      for (int64_t t0 = 0; t0 < n; t0 += nb) {
        const int nt = static_cast<int>(std::min<int64_t>(nb, n - t0));
        for (int64_t m0 = 0; m0 < rows;) {
          const int64_t m1 = std::min<int64_t>(rows, m0 + 1 + (m0 * 7 + nb) % 37);
          gemv_->MatVec(w.view(), p.data + t0 * p.stride, p.stride, nt, m0, m1,
                        y.data() + t0 * rows + m0, rows);
          m0 = m1;
        }
      }
      ASSERT_EQ(0, std::memcmp(y.data(), alone.data(), y.size() * sizeof(float)))
          << rows << "x" << cols << " batches of " << nb;
    }
    std::vector<float> g(n * rows, -1.0f);
    gemv_->GemmRows(w.view(), p.data, p.stride, n, 0, rows, g.data(), rows);
    ASSERT_EQ(0, std::memcmp(g.data(), alone.data(), g.size() * sizeof(float)))
        << rows << "x" << cols << " GemmRows";
  }
}

// The multi-token path (GemmRows: prefill chunks, experts with many tokens) for M = 1..600
// tokens on ragged shapes and row ranges, against the scalar reference: both within 1e-6 of
// sum |w * x * s| of the FP64 result (F32 rounding of 128-term block sums and the block sum).
TEST_P(Fp8GemvVariantTest, GemmRowsMatchesReferenceFrom1To600Tokens) {
  std::mt19937 rng(600);
  constexpr int64_t kMaxTokens = 600;
  for (auto [rows, cols] : {std::pair<int64_t, int64_t>{37, 200}, {131, 77}}) {
    const TestMatrix w = RandomMatrix(rows, cols, rng);
    const std::vector<float> x = RandomActivations(kMaxTokens, cols, rng);
    const Packed p = PackAll(*gemv_, x, kMaxTokens, cols);
    const Packed pr = PackAll(*reference_, x, kMaxTokens, cols);
    const RefResult exact = ReferenceFp64(w.view(), x, kMaxTokens);
    std::vector<int64_t> counts;
    for (int64_t n = 1; n <= 17; ++n) counts.push_back(n);
    for (int64_t n : {31, 64, 129, 257, 600}) counts.push_back(n);
    for (int64_t n : counts) {
      const int64_t m_begin = n % 2 == 0 ? 0 : 5;  // ragged row ranges too
      const int64_t len = rows - m_begin;
      std::vector<float> y(n * len), yr(n * len);
      gemv_->GemmRows(w.view(), p.data, p.stride, n, m_begin, rows, y.data(), len);
      reference_->GemmRows(w.view(), pr.data, pr.stride, n, m_begin, rows, yr.data(), len);
      for (int64_t t = 0; t < n; ++t) {
        for (int64_t i = 0; i < len; ++i) {
          const int64_t m = m_begin + i;
          const double tol = 1e-6 * exact.magnitude[t * rows + m] + 1e-30;
          ASSERT_NEAR(y[t * len + i], yr[t * len + i], 2 * tol)
              << rows << "x" << cols << " n " << n << " token " << t << " row " << m;
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllIsas, Fp8GemvVariantTest,
                         ::testing::Values(CpuIsa::kScalar, CpuIsa::kAvx2, CpuIsa::kAvx512,
                                           CpuIsa::kAvx512Bf16, CpuIsa::kAmx),
                         [](const ::testing::TestParamInfo<CpuIsa>& info) {
                           return std::string(CpuIsaName(info.param));
                         });

TEST(SiluMulTest, MatchesDefinition) {
  const float gate[] = {0.0f, 1.0f, -1.0f, 20.0f, -20.0f, 100.0f, -100.0f, 0.5f};
  const float up[] = {1.0f, 2.0f, 3.0f, -1.0f, 5.0f, 0.25f, 7.0f, -4.0f};
  float out[8];
  SiluMul(gate, up, 8, out);
  for (int i = 0; i < 8; ++i) {
    const double g = gate[i];
    const double want = g / (1.0 + std::exp(-g)) * up[i];
    EXPECT_NEAR(out[i], want, 1e-6 * std::fabs(want) + 1e-30) << i;
  }
  EXPECT_EQ(out[0], 0.0f);
}

}  // namespace
}  // namespace hmoe::cpu
