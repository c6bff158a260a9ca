// Quantized GEMV (issue 18): every variant this CPU runs against an oracle that shares no code
// with the kernels: the weights dequantized by common/model's DequantizeGgml (bit-exact against
// the gguf Python package) and the Q8_K activation dequantized here (d * qs), dotted in double.
//
// Error bound (quant_gemv.h): the kernels' integer sums are exact; what remains is F32 rounding
// of the block scale products (1 rounding each), of the integer partial sums' conversion to F32
// (1), and of the F32 additions (at most cols/32 + 4 levels of any summation tree over the
// per-block, per-lane terms, plus the mins). The oracle's own error: a dequantized weight is
// fl(fl(fl(d * sc) * q) - fl(dmin * m)) (3 roundings on the two parts), an activation fl(d * q)
// (1), products and sums in double (negligible). All are bounded relative to
// S = sum_k (|a_k| + |b_k|) |x_k|, with a_k the weight's quant part (d * sc * q, q as stored,
// unsigned) and b_k its offset part (dmin * m, or the stored offset 32 * d * sc for Q6_K, 16 * d
// for Q5_0, and 128 * d for Q8_0 so a variant may bias its signed quants), so
//   |kernel - oracle| <= (cols/32 + 8) u S + 4 u S,  u = 2^-24,
// the tolerance below. S's parts are obtained from DequantizeGgml too, on copies of each block
// with one scale zeroed or every quant set to "offset + 1".

#include "common/kernels/cpu/quant_gemv.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include <gtest/gtest.h>

#include "common/kernels/cpu/quant_gemv_internal.h"
#include "common/model/gguf_quants.h"

namespace hmoe::cpu {
namespace {

constexpr double kU = 1.0 / (1 << 24);

struct TypeParams {
  uint32_t type;
  int64_t block;  // weights per block
  int64_t bytes;  // bytes per block
  const char* name;
};

constexpr TypeParams kTypes[] = {
    {kGgmlQ4_K, 256, 144, "Q4_K"}, {kGgmlQ6_K, 256, 210, "Q6_K"}, {kGgmlQ5_K, 256, 176, "Q5_K"},
    {kGgmlQ8_0, 32, 34, "Q8_0"},   {kGgmlQ5_0, 32, 22, "Q5_0"},
};

uint16_t ToHalf(float f) {
  uint16_t h;
  EXPECT_TRUE(QuantizeGgml(static_cast<uint32_t>(GgmlType::kF16), &f, 1, &h).ok());
  return h;
}

// Byte offsets of a block's fp16 scales (d, then dmin where the type has one).
std::vector<int> HalfOffsets(uint32_t type) {
  switch (type) {
    case kGgmlQ4_K:
    case kGgmlQ5_K:
      return {0, 2};
    case kGgmlQ6_K:
      return {208};
    default:
      return {0};
  }
}

void SetHalf(uint8_t* p, float v) {
  const uint16_t h = ToHalf(v);
  std::memcpy(p, &h, 2);
}

// A matrix of random blocks: random quant and scale bytes, then finite fp16 scales.
struct Matrix {
  TypeParams tp;
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t row_stride = 0;
  std::vector<uint8_t> data;

  QuantMatrixView view() const {
    QuantMatrixView v;
    v.type = tp.type;
    v.data = data.data();
    v.rows = rows;
    v.cols = cols;
    v.row_stride = row_stride;
    return v;
  }
  uint8_t* block(int64_t r, int64_t b) { return data.data() + r * row_stride + b * tp.bytes; }
};

// Row stride padded by `pad` bytes (a view of a larger tensor).
Matrix RandomMatrix(const TypeParams& tp, int64_t rows, int64_t cols, std::mt19937& rng,
                    int64_t pad = 0) {
  Matrix m;
  m.tp = tp;
  m.rows = rows;
  m.cols = cols;
  m.row_stride = cols / tp.block * tp.bytes + pad;
  m.data.resize(rows * m.row_stride);
  std::uniform_int_distribution<int> byte(0, 255);
  for (uint8_t& b : m.data) b = static_cast<uint8_t>(byte(rng));
  std::uniform_real_distribution<float> scale(-0.02f, 0.02f);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < cols / tp.block; ++b) {
      for (int off : HalfOffsets(tp.type)) SetHalf(m.block(r, b) + off, scale(rng));
    }
  }
  return m;
}

// Q8_K activations of n tokens of length k at a stride of `stride` blocks.
struct Activations {
  int64_t k = 0;
  int64_t stride = 0;
  int n = 0;
  std::vector<BlockQ8K> blocks;
  const BlockQ8K* token(int t) const { return blocks.data() + t * stride; }
};

Activations QuantizedActivations(int n, int64_t k, int64_t stride, std::mt19937& rng) {
  Activations a;
  a.k = k;
  a.n = n;
  a.stride = stride;
  a.blocks.resize(n * stride);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> x(k);
  for (int t = 0; t < n; ++t) {
    for (float& v : x) v = dist(rng) * (t + 1);
    QuantizeQ8K(x.data(), k, a.blocks.data() + t * stride);
  }
  return a;
}

std::vector<double> DequantizedActivation(const BlockQ8K* x, int64_t k) {
  std::vector<double> out(k);
  for (int64_t i = 0; i < k; ++i) {
    out[i] = static_cast<double>(x[i / 256].d * static_cast<float>(x[i / 256].qs[i % 256]));
  }
  return out;
}

std::vector<float> Dequantize(uint32_t type, const uint8_t* row, int64_t cols) {
  std::vector<float> out(cols);
  const absl::Status s = DequantizeGgml(type, row, cols, out.data());
  EXPECT_TRUE(s.ok()) << s;
  return out;
}

// |a_k| + |b_k| of every weight of one row (see the header comment).
std::vector<double> Magnitudes(const TypeParams& tp, const uint8_t* row, int64_t cols) {
  const std::vector<float> w = Dequantize(tp.type, row, cols);
  std::vector<uint8_t> copy(row, row + cols / tp.block * tp.bytes);
  std::vector<double> mag(cols);
  const int64_t nb = cols / tp.block;
  if (tp.type == kGgmlQ4_K || tp.type == kGgmlQ5_K) {
    std::vector<uint8_t> no_min = copy, no_d = copy;
    for (int64_t b = 0; b < nb; ++b) {
      std::memset(no_min.data() + b * tp.bytes + 2, 0, 2);
      std::memset(no_d.data() + b * tp.bytes, 0, 2);
    }
    const std::vector<float> a = Dequantize(tp.type, no_min.data(), cols);
    const std::vector<float> b = Dequantize(tp.type, no_d.data(), cols);
    for (int64_t k = 0; k < cols; ++k) mag[k] = std::fabs(a[k]) + std::fabs(b[k]);
    return mag;
  }
  // Every quant set to offset + 1: the dequantized value is the weight's scale s_k.
  double offset = 0;
  for (int64_t b = 0; b < nb; ++b) {
    uint8_t* blk = copy.data() + b * tp.bytes;
    if (tp.type == kGgmlQ6_K) {
      std::memset(blk, 0x11, 128);       // low nibbles 1
      std::memset(blk + 128, 0xAA, 64);  // high bits 2: q = 33
      offset = 32;
    } else if (tp.type == kGgmlQ8_0) {
      std::memset(blk + 2, 1, 32);
      offset = 128;
    } else {                           // Q5_0
      std::memset(blk + 2, 0xFF, 4);   // fifth bits set
      std::memset(blk + 6, 0x11, 16);  // q = 17
      offset = 16;
    }
  }
  const std::vector<float> s = Dequantize(tp.type, copy.data(), cols);
  for (int64_t k = 0; k < cols; ++k) {
    const double sk = std::fabs(static_cast<double>(s[k]));
    if (tp.type == kGgmlQ8_0) {
      mag[k] = std::fabs(static_cast<double>(w[k])) + offset * sk;
    } else {
      mag[k] =
          std::fabs(static_cast<double>(w[k]) + offset * static_cast<double>(s[k])) + offset * sk;
    }
  }
  return mag;
}

std::vector<std::unique_ptr<QuantGemv>> Variants() {
  std::vector<std::unique_ptr<QuantGemv>> out;
  for (CpuIsa isa : {CpuIsa::kScalar, CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    auto g = NewQuantGemv(isa);
    if (g.ok()) {
      out.push_back(std::move(*g));
    } else {
      EXPECT_EQ(g.status().code(), absl::StatusCode::kUnavailable) << g.status();
    }
  }
  // The AVX2 variant without AVX-VNNI too (its Q8_0 GEMM takes vpdpbusd where the CPU has it).
  if (CpuSupports(CpuIsa::kAvx2)) {
    out.push_back(std::unique_ptr<QuantGemv>(internal::NewAvx2QuantGemv(false)));
  }
  return out;
}

// Runs every variant on rows [m_begin, m_end) of `w` for all tokens of `x` and compares each
// output with the oracle within the bound.
// With `gemm`, through GemmRows (any number of tokens) instead of MatVec.
void CheckAgainstOracle(const Matrix& w, const Activations& x, int64_t m_begin, int64_t m_end,
                        const std::string& what, bool gemm = false) {
  const int64_t rows = m_end - m_begin;
  const int64_t y_stride = rows + 3;
  std::vector<double> want(x.n * rows), tol(x.n * rows);
  for (int t = 0; t < x.n; ++t) {
    const std::vector<double> xd = DequantizedActivation(x.token(t), w.cols);
    for (int64_t m = m_begin; m < m_end; ++m) {
      const uint8_t* row = w.data.data() + m * w.row_stride;
      const std::vector<float> wd = Dequantize(w.tp.type, row, w.cols);
      const std::vector<double> mag = Magnitudes(w.tp, row, w.cols);
      double sum = 0, s = 0;
      for (int64_t k = 0; k < w.cols; ++k) {
        sum += static_cast<double>(wd[k]) * xd[k];
        s += mag[k] * std::fabs(xd[k]);
      }
      want[t * rows + (m - m_begin)] = sum;
      tol[t * rows + (m - m_begin)] = (static_cast<double>(w.cols) / 32 + 12) * kU * s;
    }
  }
  for (const auto& gemv : Variants()) {
    std::vector<float> y(x.n * y_stride, -12345.0f);
    if (gemm) {
      gemv->GemmRows(w.view(), x.blocks.data(), x.stride, x.n, m_begin, m_end, y.data(), y_stride);
    } else {
      gemv->MatVec(w.view(), x.blocks.data(), x.stride, x.n, m_begin, m_end, y.data(), y_stride);
    }
    for (int t = 0; t < x.n; ++t) {
      for (int64_t i = 0; i < rows; ++i) {
        ASSERT_NEAR(y[t * y_stride + i], want[t * rows + i], tol[t * rows + i])
            << CpuIsaName(gemv->isa()) << " " << w.tp.name << " " << what << " token " << t
            << " row " << m_begin + i;
      }
      for (int64_t i = rows; i < y_stride; ++i) {
        ASSERT_EQ(y[t * y_stride + i], -12345.0f) << "wrote beyond the range";
      }
    }
  }
}

TEST(QuantGemvTest, Q8KQuantizerMatchesItsDefinition) {
  std::mt19937 rng(1);
  std::normal_distribution<float> dist(0.0f, 3.0f);
  for (int64_t k : {1, 31, 256, 300, 512, 7168}) {
    std::vector<float> x(k);
    for (float& v : x) v = dist(rng);
    if (k >= 300) std::fill(x.begin(), x.begin() + 256, 0.0f);  // an all-zero block
    if (k >= 512) x[300] = 1e6f;                                // one outlier
    std::vector<BlockQ8K> q(Q8KBlocks(k) + 1);
    std::memset(q.data(), 0x5a, q.size() * sizeof(BlockQ8K));
    QuantizeQ8K(x.data(), k, q.data());
    ASSERT_EQ(Q8KBlocks(k), (k + 255) / 256);
    for (int64_t b = 0; b < Q8KBlocks(k); ++b) {
      float amax = 0;
      for (int64_t i = b * 256; i < std::min(k, b * 256 + 256); ++i) {
        amax = std::max(amax, std::fabs(x[i]));
      }
      const BlockQ8K& blk = q[b];
      EXPECT_EQ(blk.d, amax / 127.0f) << "k " << k << " block " << b;
      for (int i = 0; i < 256; ++i) {
        const int64_t idx = b * 256 + i;
        int want = 0;
        if (idx < k && amax > 0) {
          want = static_cast<int>(std::nearbyint(x[idx] * (127.0f / amax)));
          want = std::clamp(want, -127, 127);
          // Within half a step of the value (plus the rounding of the scale products).
          EXPECT_LE(std::fabs(x[idx] - blk.d * blk.qs[i]), blk.d * 0.5f * (1 + 1e-5f) + 1e-30f);
        }
        ASSERT_EQ(blk.qs[i], want) << "k " << k << " index " << idx;
      }
      for (int j = 0; j < 16; ++j) {
        int sum = 0;
        for (int i = 0; i < 16; ++i) sum += blk.qs[16 * j + i];
        EXPECT_EQ(blk.bsums[j], sum);
      }
    }
    // Nothing written past the last block.
    const auto* guard = reinterpret_cast<const uint8_t*>(&q[Q8KBlocks(k)]);
    for (size_t i = 0; i < sizeof(BlockQ8K); ++i) ASSERT_EQ(guard[i], 0x5a);
  }
}

// QuantizeQ8K (vectorized where the kernels run AVX-512) bitwise against the scalar definition:
// random data of several magnitudes, exact rounding ties (amax 127: iscale 1, values k + 0.5),
// zero, tiny and huge blocks, lengths with a partial last block.
TEST(QuantGemvTest, Q8KQuantizerIsBitwiseItsScalarDefinition) {
  std::mt19937 rng(8);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  for (int64_t k : {256, 7168, 7200, 300, 2048}) {
    for (float scale : {1.0f, 1e-3f, 1e30f, 1e-35f, 0.0f}) {
      std::vector<float> x(k);
      for (float& v : x) v = dist(rng) * scale;
      if (k >= 512 && scale == 1.0f) {
        // Block 1: ties at every half integer, amax exactly 127.
        for (int i = 0; i < 256; ++i) x[256 + i] = static_cast<float>(i % 254) - 126.5f;
        x[256 + 7] = 127.0f;
      }
      std::vector<BlockQ8K> got(Q8KBlocks(k)), want(Q8KBlocks(k));
      QuantizeQ8K(x.data(), k, got.data());
      QuantizeQ8KReference(x.data(), k, want.data());
      ASSERT_EQ(std::memcmp(got.data(), want.data(), got.size() * sizeof(BlockQ8K)), 0)
          << "k " << k << " scale " << scale;
    }
  }
}

// Non-finite input is defined (quant_gemv.h): a NaN block dots to NaN, an infinite one to inf.
TEST(QuantGemvTest, Q8KQuantizerDefinesNonFiniteInput) {
  std::vector<float> x(768, 0.5f);
  x[3] = std::numeric_limits<float>::quiet_NaN();
  x[256 + 5] = std::numeric_limits<float>::infinity();
  x[256 + 6] = -std::numeric_limits<float>::infinity();
  x[512 + 1] = std::numeric_limits<float>::infinity();
  x[512 + 2] = std::numeric_limits<float>::quiet_NaN();
  for (bool reference : {false, true}) {
    std::vector<BlockQ8K> q(3);
    if (reference) {
      QuantizeQ8KReference(x.data(), 768, q.data());
    } else {
      QuantizeQ8K(x.data(), 768, q.data());
    }
    EXPECT_TRUE(std::isnan(q[0].d));
    EXPECT_TRUE(std::isnan(q[2].d));
    for (int i = 0; i < 256; ++i) {
      ASSERT_EQ(q[0].qs[i], 0);
      ASSERT_EQ(q[2].qs[i], 0);
      ASSERT_EQ(q[1].qs[i], i == 5 ? 127 : i == 6 ? -127 : 0) << i;
    }
    EXPECT_TRUE(std::isinf(q[1].d) && q[1].d > 0);
    EXPECT_EQ(q[1].bsums[0], 0);
    // Through a kernel: the NaN block gives NaN, the infinite one inf or NaN, never a crash.
    std::mt19937 rng(9);
    const Matrix w = RandomMatrix(kTypes[0], 2, 768, rng);
    for (const auto& gemv : Variants()) {
      float y[2];
      gemv->MatVec(w.view(), q.data(), 3, 1, 0, 2, y, 2);
      EXPECT_TRUE(std::isnan(y[0]) && std::isnan(y[1])) << CpuIsaName(gemv->isa());
    }
  }
}

TEST(QuantGemvTest, RandomBlocksAgreeWithTheDequantizedOracle) {
  std::mt19937 rng(2);
  for (const TypeParams& tp : kTypes) {
    std::vector<int64_t> cols_list = {256, 768, 2304};
    if (tp.block == 32) cols_list = {32, 96, 288, 2304};
    for (int64_t cols : cols_list) {
      const Matrix w = RandomMatrix(tp, 37, cols, rng, /*pad=*/cols == 768 ? 64 : 0);
      for (int n : {1, 2, 3, 8}) {
        const Activations x =
            QuantizedActivations(n, cols, Q8KBlocks(cols) + (n == 3 ? 2 : 0), rng);
        CheckAgainstOracle(w, x, 0, w.rows, absl::StrCat("cols ", cols, " n ", n));
        CheckAgainstOracle(w, x, 5, 22, absl::StrCat("rows [5, 22) cols ", cols, " n ", n));
      }
    }
  }
}

// Weights written by our quantizer (realistic scales, mins and Q6_K's signed scales).
TEST(QuantGemvTest, QuantizedWeightsAgreeWithTheDequantizedOracle) {
  std::mt19937 rng(3);
  std::normal_distribution<float> dist(0.0f, 0.05f);
  for (const TypeParams& tp : kTypes) {
    if (tp.type == kGgmlQ5_0) continue;  // our quantizer does not write Q5_0
    const int64_t rows = 19, cols = 1024;
    std::vector<float> f(rows * cols);
    for (float& v : f) v = dist(rng);
    Matrix w;
    w.tp = tp;
    w.rows = rows;
    w.cols = cols;
    w.row_stride = cols / tp.block * tp.bytes;
    w.data.resize(rows * w.row_stride);
    ASSERT_TRUE(QuantizeGgml(tp.type, f.data(), rows * cols, w.data.data()).ok());
    const Activations x = QuantizedActivations(4, cols, Q8KBlocks(cols), rng);
    CheckAgainstOracle(w, x, 0, rows, "quantized");
  }
}

// Every quant at its maximum or minimum with the largest scales, activations at +-127, and zero
// scales: the integer paths' extremes (no saturation, no int32 overflow).
TEST(QuantGemvTest, ExtremeBlocks) {
  std::mt19937 rng(4);
  for (const TypeParams& tp : kTypes) {
    const int64_t cols = 512, rows = 9;
    for (int fill : {0x00, 0xFF, 0x80, 0x7F}) {
      for (float d : {1.0f, 0.0f, -3.0f}) {
        Matrix w = RandomMatrix(tp, rows, cols, rng);
        std::fill(w.data.begin(), w.data.end(), static_cast<uint8_t>(fill));
        for (int64_t r = 0; r < rows; ++r) {
          for (int64_t b = 0; b < cols / tp.block; ++b) {
            for (int off : HalfOffsets(tp.type)) SetHalf(w.block(r, b) + off, d);
          }
        }
        for (int xv : {127, -127}) {
          Activations x;
          x.k = cols;
          x.n = 2;
          x.stride = Q8KBlocks(cols);
          x.blocks.resize(x.n * x.stride);
          for (int t = 0; t < 2; ++t) {
            for (int64_t b = 0; b < x.stride; ++b) {
              BlockQ8K& blk = x.blocks[t * x.stride + b];
              blk.d = 0.5f;
              const int v = t == 0 ? xv : (b % 2 ? 127 : -127);
              std::memset(blk.qs, static_cast<uint8_t>(static_cast<int8_t>(v)), 256);
              for (int j = 0; j < 16; ++j) blk.bsums[j] = static_cast<int16_t>(16 * v);
            }
          }
          CheckAgainstOracle(w, x, 0, rows, absl::StrCat("fill ", fill, " d ", d, " x ", xv));
        }
      }
    }
  }
}

TEST(QuantGemvTest, GemmRowsEqualsMatVecPerToken) {
  std::mt19937 rng(5);
  for (const TypeParams& tp : kTypes) {
    const int64_t cols = tp.block == 32 ? 512 : 1024;
    const Matrix w = RandomMatrix(tp, 300, cols, rng);
    const int n = 19;
    const Activations x = QuantizedActivations(n, cols, Q8KBlocks(cols), rng);
    for (const auto& gemv : Variants()) {
      std::vector<float> gemm(n * 290), one(290);
      gemv->GemmRows(w.view(), x.blocks.data(), x.stride, n, 3, 293, gemm.data(), 290);
      for (int t = 0; t < n; ++t) {
        gemv->MatVec(w.view(), x.token(t), x.stride, 1, 3, 293, one.data(), 290);
        for (int i = 0; i < 290; ++i) {
          ASSERT_EQ(gemm[t * 290 + i], one[i]) << CpuIsaName(gemv->isa()) << " " << tp.name;
        }
      }
    }
  }
}

// The GEMM kernels (GemmRows: AVX-512's for the K types, MatVec groups elsewhere) against each
// variant's own MatVec of one token, bitwise, over ragged shapes: token counts around the token
// tile (8) up to 601, row ranges across the 64-row tile and not starting at 0, column counts
// across the 8-block tile, a padded row stride, an activation stride above the minimum; rows
// outside the range and padding between outputs untouched.
TEST(QuantGemvTest, GemmRowsIsBitwiseMatVecPerTokenOnRaggedShapes) {
  std::mt19937 rng(6);
  struct Shape {
    int64_t rows, cols_blocks, m_begin, m_end, pad;
    std::vector<int> tokens;
  };
  const std::vector<Shape> shapes = {
      {1, 1, 0, 1, 0, {1, 9, 64}},
      {131, 9, 2, 130, 16, {1, 7, 8, 9, 17, 33}},
      {70, 17, 0, 70, 0, {2, 15, 16, 65}},
      {66, 4, 1, 66, 0, {601}},
  };
  for (const TypeParams& tp : kTypes) {
    for (const Shape& sh : shapes) {
      // Q8_0 / Q5_0: 8 blocks of 32 per "K block", so both kinds see the same row lengths.
      const int64_t cols = sh.cols_blocks * 256;
      const Matrix w = RandomMatrix(tp, sh.rows, cols, rng, sh.pad);
      for (int n : sh.tokens) {
        const int64_t x_stride = Q8KBlocks(cols) + (n % 2);
        const Activations x = QuantizedActivations(n, cols, x_stride, rng);
        const int64_t rows = sh.m_end - sh.m_begin;
        const int64_t y_stride = rows + 5;
        for (const auto& gemv : Variants()) {
          const std::string what = absl::StrCat(std::string(CpuIsaName(gemv->isa())), " ", tp.name,
                                                " rows ", sh.rows, " cols ", cols, " n ", n);
          std::vector<float> gemm(n * y_stride, -12345.0f), one(y_stride, -12345.0f);
          gemv->GemmRows(w.view(), x.blocks.data(), x.stride, n, sh.m_begin, sh.m_end, gemm.data(),
                         y_stride);
          for (int t = 0; t < n; ++t) {
            gemv->MatVec(w.view(), x.token(t), x.stride, 1, sh.m_begin, sh.m_end, one.data(),
                         y_stride);
            for (int64_t i = 0; i < rows; ++i) {
              ASSERT_EQ(std::bit_cast<uint32_t>(gemm[t * y_stride + i]),
                        std::bit_cast<uint32_t>(one[i]))
                  << what << " token " << t << " row " << sh.m_begin + i;
            }
            for (int64_t i = rows; i < y_stride; ++i) {
              ASSERT_EQ(gemm[t * y_stride + i], -12345.0f) << what << ": wrote beyond the range";
            }
          }
        }
      }
    }
  }
}

// GemmRows against the dequantized oracle directly (not only through MatVec), within the
// kernels' bound, on a shape that crosses every tile of the GEMM kernels.
TEST(QuantGemvTest, GemmRowsAgreesWithTheDequantizedOracle) {
  std::mt19937 rng(7);
  for (const TypeParams& tp : kTypes) {
    const Matrix w = RandomMatrix(tp, 67, 2304, rng, 8);
    for (int n : {11, 24}) {
      const Activations x = QuantizedActivations(n, 2304, Q8KBlocks(2304) + 1, rng);
      CheckAgainstOracle(w, x, 1, 67, absl::StrCat("gemm n ", n), /*gemm=*/true);
    }
  }
}

TEST(QuantGemvTest, MatrixViewChecksTypeAndShape) {
  uint8_t data[1024] = {};
  auto bad_type = MakeQuantMatrixView(2 /* Q4_0 */, data, 1, 256);
  ASSERT_FALSE(bad_type.ok());
  EXPECT_EQ(bad_type.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad_type.status().message().find("ggml type 2 is not supported"), std::string::npos)
      << bad_type.status();
  auto bad_cols = MakeQuantMatrixView(kGgmlQ4_K, data, 1, 128);
  ASSERT_FALSE(bad_cols.ok());
  EXPECT_NE(bad_cols.status().message().find("multiple of 256"), std::string::npos)
      << bad_cols.status();
  auto ok = MakeQuantMatrixView(kGgmlQ6_K, data, 3, 512);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->row_stride, 420);
  EXPECT_EQ(QuantRowBytes(kGgmlQ8_0, 64), 68);
  const QuantMatrixView slice = ok->RowSlice(1, 3);
  EXPECT_EQ(slice.data, data + 420);
  EXPECT_EQ(slice.rows, 2);
  EXPECT_TRUE(QuantGemvSupportsType(kGgmlQ5_0));
  EXPECT_FALSE(QuantGemvSupportsType(static_cast<uint32_t>(GgmlType::kQ8_K)));
}

TEST(QuantGemvTest, DispatchFollowsBestCpuIsa) {
  const CpuIsa best = BestCpuIsa();
  const CpuIsa got = DefaultQuantGemv().isa();
  if (best == CpuIsa::kAvx512 || best == CpuIsa::kAvx512Bf16 || best == CpuIsa::kAmx) {
    EXPECT_TRUE(got == CpuIsa::kAvx512 || got == CpuIsa::kAvx2) << CpuIsaName(got);
  } else {
    EXPECT_EQ(got, best);
  }
  // ctest runs this binary again with HMOE_CPU_ISA=avx2 on AVX-512 machines.
  const char* env = std::getenv("HMOE_CPU_ISA");
  if (env != nullptr && std::string(env) == "avx2") {
    EXPECT_EQ(got, CpuIsa::kAvx2);
  }
}

}  // namespace
}  // namespace hmoe::cpu
