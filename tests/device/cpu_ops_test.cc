// Tests of the dense CPU ops added for the engine (common/kernels/cpu/bf16_gemv.h, f32_ops.h):
// every variant against a plain loop.

#include <bit>
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
    EXPECT_EQ(F32OpsIsa(), isa);  // the AVX2 F32 ops, not the portable loops, under avx2
  }
  // The BF16 GEMV has a variant per level except AMX: amx machines use the avx512bf16 one.
  EXPECT_EQ(DefaultBf16Gemv().isa(), isa == CpuIsa::kAmx ? CpuIsa::kAvx512Bf16 : isa);
  if (isa >= CpuIsa::kAvx512) {
    EXPECT_TRUE(F32OpsUseAvx512());
    EXPECT_EQ(F32OpsIsa(), CpuIsa::kAvx512);
  } else if (isa == CpuIsa::kAvx2) {
    EXPECT_NE(F32OpsIsa(), CpuIsa::kScalar);
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
      // A token's result does not depend on the other tokens of the call (the engine's batch
      // invariance): each token alone gives the same bits.
      for (int t = 0; t < n; ++t) {
        std::vector<float> alone(rows, -1.0f);
        (*gemv)->MatVec(view, packed.data() + t * packed_stride, packed_stride, 1, 3, rows,
                        alone.data(), rows);
        for (int64_t r = 3; r < rows; ++r) {
          ASSERT_EQ(std::bit_cast<uint32_t>(alone[r - 3]),
                    std::bit_cast<uint32_t>(y[t * rows + (r - 3)]))
              << "cols " << cols << " n " << n << " t " << t << " r " << r;
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Variants, Bf16GemvTest,
                         ::testing::Values(CpuIsa::kScalar, CpuIsa::kAvx2, CpuIsa::kAvx512,
                                           CpuIsa::kAvx512Bf16),
                         [](const auto& info) { return std::string(CpuIsaName(info.param)); });

// One F32-ops variant's entry points (f32_ops.h internal).
struct F32Variant {
  CpuIsa isa;
  float (*dot)(const float*, const float*, int64_t);
  void (*dot4)(const float*, int64_t, const float*, int64_t, float*);
  void (*axpy)(float, const float*, float*, int64_t);
  void (*axpy4)(const float*, const float*, float*, int64_t, int64_t);
  void (*axpy_tile4)(const float*, int64_t, const float* const*, int64_t, float*, int64_t, int64_t);
  float (*dot_bf16)(const std::byte*, const float*, int64_t);
};

F32Variant VariantOf(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kAvx2:
      return {isa,
              internal::DotF32Avx2,
              internal::Dot4F32Avx2,
              internal::AxpyF32Avx2,
              internal::Axpy4F32Avx2,
              internal::AxpyTile4F32Avx2,
              internal::DotBf16F32Avx2};
    case CpuIsa::kAvx512:
      return {isa,
              internal::DotF32Avx512,
              internal::Dot4F32Avx512,
              internal::AxpyF32Avx512,
              internal::Axpy4F32Avx512,
              internal::AxpyTile4F32Avx512,
              internal::DotBf16F32Avx512};
    default:
      return {CpuIsa::kScalar,           internal::DotF32Scalar,   internal::Dot4F32Scalar,
              internal::AxpyF32Scalar,   internal::Axpy4F32Scalar, internal::AxpyTile4F32Scalar,
              internal::DotBf16F32Scalar};
  }
}

// The error bound of any order of summation of n F32 products (Higham, Accuracy and Stability,
// §3.1): |fl(sum) - sum| <= gamma_n * sum |a_i b_i|, gamma_n = n u / (1 - n u), u = 2^-24 (each
// term sees one rounding of its product and at most n - 1 of the additions; a fused multiply-add
// only removes roundings). The oracle sums in double (error ~2^-53 n, negligible).
double DotBound(int64_t n, double magnitude) {
  const double u = std::ldexp(1.0, -24);
  const double nu = static_cast<double>(n) * u;
  return nu / (1.0 - nu) * magnitude;
}

class F32OpsVariantTest : public ::testing::TestWithParam<CpuIsa> {};

// Every variant against a double-precision loop on ragged lengths 1..600, with strided and
// unaligned operands; the four-query dot product bitwise the single one of the same variant;
// the AXPYs bitwise std::fma (the same in every variant).
TEST_P(F32OpsVariantTest, MatchesDoubleOracleOnRaggedLengths) {
  const CpuIsa isa = GetParam();
  const bool supported =
      isa == CpuIsa::kScalar ||
      (isa == CpuIsa::kAvx2 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) ||
      (isa == CpuIsa::kAvx512 && __builtin_cpu_supports("avx512f") &&
       __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl"));
  if (!supported) GTEST_SKIP() << "CPU lacks " << CpuIsaName(isa);
  const F32Variant v = VariantOf(isa);
  std::mt19937 rng(7);
  std::vector<int64_t> lengths;
  for (int64_t n = 1; n <= 40; ++n) lengths.push_back(n);
  for (int64_t n : {63, 64, 65, 127, 128, 129, 511, 512, 513, 576, 577, 600}) lengths.push_back(n);
  for (int i = 0; i < 20; ++i) lengths.push_back(1 + static_cast<int64_t>(rng() % 600));
  for (const int64_t n : lengths) {
    const int64_t stride = n + 3;  // queries not 32-byte aligned relative to each other
    // +1: operands one float past a 64-byte boundary.
    const std::vector<float> qs = RandomFloats(4 * stride + 1, static_cast<uint32_t>(n));
    const std::vector<float> ks = RandomFloats(n + 1, static_cast<uint32_t>(n + 1000));
    const float* q = qs.data() + 1;
    const float* k = ks.data() + 1;
    float four[4];
    v.dot4(q, stride, k, n, four);
    for (int j = 0; j < 4; ++j) {
      double want = 0, mag = 0;
      for (int64_t i = 0; i < n; ++i) {
        const double p = static_cast<double>(q[j * stride + i]) * k[i];
        want += p;
        mag += std::abs(p);
      }
      const float single = v.dot(q + j * stride, k, n);
      ASSERT_LE(std::abs(single - want), DotBound(n, mag)) << "n " << n << " j " << j;
      // Bitwise: a query's score must not depend on its group (batch-independent attention).
      ASSERT_EQ(0, std::memcmp(&four[j], &single, sizeof(float))) << "n " << n << " j " << j;
    }
    std::vector<float> y(qs.begin(), qs.end());
    v.axpy(0.5f, k, y.data() + 1, n);
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(y[1 + i], std::fma(0.5f, k[i], q[i])) << i;
    EXPECT_EQ(y[0], qs[0]);
    EXPECT_EQ(y[n + 1], qs[n + 1]);  // past the masked tail: untouched
    y.assign(qs.begin(), qs.end());
    const float coef[4] = {1.0f, -2.0f, 0.25f, 3.0f};
    v.axpy4(coef, k, y.data() + 1, stride, n);
    for (int j = 0; j < 4; ++j) {
      for (int64_t i = 0; i < stride; ++i) {
        const float want = i < n ? std::fma(coef[j], k[i], q[j * stride + i]) : q[j * stride + i];
        ASSERT_EQ(y[1 + j * stride + i], want) << "n " << n << " j " << j << " i " << i;
      }
    }
    // The P V tile: 4 rows, nk keys at scattered addresses, each element updated by std::fma in
    // key order (the oracle: a plain loop, no vector code).
    for (const int64_t nk : {int64_t{1}, int64_t{3}, int64_t{16}}) {
      const int64_t p_stride = 17;
      const std::vector<float> p = RandomFloats(4 * p_stride, static_cast<uint32_t>(n + nk));
      std::vector<std::vector<float>> keys;
      std::vector<const float*> key_ptrs;
      for (int64_t j = 0; j < nk; ++j) {
        keys.push_back(RandomFloats(n + 1, static_cast<uint32_t>(7 * n + j)));
      }
      for (int64_t j = 0; j < nk; ++j) key_ptrs.push_back(keys[j].data() + 1);
      y.assign(qs.begin(), qs.end());
      v.axpy_tile4(p.data() + 1, p_stride, key_ptrs.data(), nk, y.data() + 1, stride, n);
      for (int r = 0; r < 4; ++r) {
        for (int64_t i = 0; i < stride; ++i) {
          float want = q[r * stride + i];
          for (int64_t j = 0; i < n && j < nk; ++j) {
            want = std::fma(p[1 + r * p_stride + j], key_ptrs[j][i], want);
          }
          ASSERT_EQ(y[1 + r * stride + i], want)
              << "n " << n << " nk " << nk << " r " << r << " i " << i;
        }
      }
    }
    // BF16 weights (odd byte offset) with F32 activations: the conversion is exact.
    std::vector<std::byte> wb(2 * n + 1);
    double want_bf = 0, mag_bf = 0;
    for (int64_t i = 0; i < n; ++i) {
      const uint16_t b = kernels::FloatToBf16Bits(q[i]);
      std::memcpy(wb.data() + 1 + 2 * i, &b, 2);
      const double p = static_cast<double>(kernels::Bf16BitsToFloat(b)) * k[i];
      want_bf += p;
      mag_bf += std::abs(p);
    }
    ASSERT_LE(std::abs(v.dot_bf16(wb.data() + 1, k, n) - want_bf), DotBound(n, mag_bf)) << n;
  }
}

INSTANTIATE_TEST_SUITE_P(Variants, F32OpsVariantTest,
                         ::testing::Values(CpuIsa::kScalar, CpuIsa::kAvx2, CpuIsa::kAvx512),
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
