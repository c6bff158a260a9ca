// Tests of the dense CPU ops added for the engine (common/kernels/cpu/bf16_gemv.h, f32_ops.h):
// every variant against a plain loop.

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "common/kernels/cpu/bf16_gemv.h"
#include "common/kernels/cpu/f32_ops.h"
#include "common/kernels/shared_math.h"

namespace hmoe::cpu {
namespace {

std::vector<float> RandomFloats(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

float Bf16(float f) { return kernels::Bf16BitsToFloat(kernels::FloatToBf16Bits(f)); }

// HMOE_CPU_ISA reaches every kernel family: ctest runs this binary a second time with
// HMOE_CPU_ISA=avx2 on AVX-512 machines (label cpu_isa); without the variable, it checks the
// default dispatch.
TEST(CpuIsaOverrideTest, Bf16AndF32OpsFollowTheFp8Choice) {
  const CpuIsa isa = BestCpuIsa();
  const char* env = std::getenv("HMOE_CPU_ISA");
  if (env != nullptr && (std::strcmp(env, "avx2") == 0 || std::strcmp(env, "scalar") == 0)) {
    EXPECT_EQ(CpuIsaName(isa), env);
    EXPECT_FALSE(F32OpsUseAvx512());
  }
  // The BF16 GEMV has no AVX2 variant: AVX2 machines (and forced AVX2) use the scalar one.
  EXPECT_EQ(DefaultBf16Gemv().isa(), isa == CpuIsa::kAvx2 ? CpuIsa::kScalar : isa);
  if (isa >= CpuIsa::kAvx512) {
    EXPECT_TRUE(F32OpsUseAvx512());
  }
}

class Bf16GemvTest : public ::testing::TestWithParam<CpuIsa> {};

TEST_P(Bf16GemvTest, MatchesPlainLoop) {
  if (!CpuSupports(GetParam())) GTEST_SKIP() << "CPU lacks " << CpuIsaName(GetParam());
  auto gemv = NewBf16Gemv(GetParam());
  ASSERT_TRUE(gemv.ok()) << gemv.status();
  for (int64_t cols : {1, 31, 32, 100, 7168}) {
    for (int n : {1, 2, 3, 5, 8, 13}) {
      const int64_t rows = 37, stride = cols + 3;
      // Weights at an odd byte offset (checkpoint tensors may be unaligned).
      std::vector<std::byte> storage(2 * rows * stride + 1);
      std::byte* w = storage.data() + 1;
      const std::vector<float> wf = RandomFloats(rows * stride, 1);
      for (int64_t i = 0; i < rows * stride; ++i) {
        const uint16_t b = kernels::FloatToBf16Bits(wf[i]);
        std::memcpy(w + 2 * i, &b, 2);
      }
      const std::vector<float> x = RandomFloats(n * cols, 2);
      const int64_t packed_stride = Bf16Gemv::PackedBytes(cols) + 64;
      std::vector<std::byte> packed(n * packed_stride);
      for (int t = 0; t < n; ++t)
        Bf16Gemv::Pack(x.data() + t * cols, cols, packed.data() + t * packed_stride);
      const Bf16MatrixView view{w, rows, cols, stride};
      std::vector<float> y(n * rows, -1.0f);
      // Rows [3, rows) only.
      (*gemv)->GemmRows(view, packed.data(), packed_stride, n, 3, rows, y.data(), rows);
      for (int t = 0; t < n; ++t) {
        for (int64_t r = 3; r < rows; ++r) {
          double want = 0, mag = 0;
          for (int64_t k = 0; k < cols; ++k) {
            const double p = static_cast<double>(Bf16(wf[r * stride + k])) * Bf16(x[t * cols + k]);
            want += p;
            mag += std::abs(p);
          }
          ASSERT_NEAR(y[t * rows + (r - 3)], want, 1e-5 * mag + 1e-6)
              << "cols " << cols << " n " << n << " t " << t << " r " << r;
        }
      }
      EXPECT_EQ(y[(n - 1) * rows + rows - 3], -1.0f);  // beyond the range: untouched
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Variants, Bf16GemvTest,
                         ::testing::Values(CpuIsa::kScalar, CpuIsa::kAvx512, CpuIsa::kAvx512Bf16),
                         [](const auto& info) { return std::string(CpuIsaName(info.param)); });

TEST(F32OpsTest, DotAxpyAndMatVecMatchPlainLoops) {
  for (int64_t n : {1, 15, 16, 17, 64, 577}) {
    const std::vector<float> a = RandomFloats(4 * n, 3), b = RandomFloats(n, 4);
    double want = 0;
    for (int64_t i = 0; i < n; ++i) want += static_cast<double>(a[i]) * b[i];
    EXPECT_NEAR(DotF32(a.data(), b.data(), n), want, 1e-4 * std::sqrt(n));
    float four[4];
    Dot4F32(a.data(), n, b.data(), n, four);
    for (int j = 0; j < 4; ++j) {
      double w = 0;
      for (int64_t i = 0; i < n; ++i) w += static_cast<double>(a[j * n + i]) * b[i];
      EXPECT_NEAR(four[j], w, 1e-4 * std::sqrt(n));
      // Bitwise DotF32: a query's score must not depend on its group (batch-independent
      // attention).
      const float single = DotF32(a.data() + j * n, b.data(), n);
      EXPECT_EQ(0, std::memcmp(&four[j], &single, sizeof(float))) << n << " " << j;
    }
    std::vector<float> y = a;
    AxpyF32(0.5f, b.data(), y.data(), n);
    // Fused: exactly one rounding per element, in every variant.
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(y[i], std::fma(0.5f, b[i], a[i])) << i;
    y = a;
    const float coef[4] = {1.0f, -2.0f, 0.25f, 3.0f};
    Axpy4F32(coef, b.data(), y.data(), n, n);
    for (int j = 0; j < 4; ++j) {
      for (int64_t i = 0; i < n; ++i) {
        ASSERT_EQ(y[j * n + i], std::fma(coef[j], b[i], a[j * n + i])) << j << " " << i;
      }
    }
    // BF16 weights with F32 activations (exact conversion).
    std::vector<uint16_t> wb(n);
    double want_bf = 0;
    for (int64_t i = 0; i < n; ++i) {
      wb[i] = kernels::FloatToBf16Bits(a[i]);
      want_bf += static_cast<double>(kernels::Bf16BitsToFloat(wb[i])) * b[i];
    }
    EXPECT_NEAR(DotBf16F32(reinterpret_cast<const std::byte*>(wb.data()), b.data(), n), want_bf,
                1e-4 * std::sqrt(n));
  }
  // MatVecF32: 5 tokens (a group of four and one), rows [1, 3).
  const std::vector<float> w = RandomFloats(3 * 10, 5), x = RandomFloats(5 * 12, 6);
  std::vector<float> y(5 * 2);
  MatVecF32(w.data(), 10, 9, x.data(), 12, 5, 1, 3, y.data(), 2);
  for (int t = 0; t < 5; ++t) {
    for (int r = 1; r < 3; ++r) {
      double want = 0;
      for (int k = 0; k < 9; ++k) want += static_cast<double>(w[r * 10 + k]) * x[t * 12 + k];
      EXPECT_NEAR(y[t * 2 + r - 1], want, 1e-5);
    }
  }
}

}  // namespace
}  // namespace hmoe::cpu
