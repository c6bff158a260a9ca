// Fp8Gemm (issue #15): every variant this CPU supports against an FP64 oracle that shares no code
// with the kernels: E4M3 decoded from its definition, BF16 rounding written out here.
//
// Tolerance. Every product fp8(w) * bf16(x) is exact in F32 (4 + 8 significant bits). A variant
// sums at most 128 products of a block in F32 (vdpbf16ps adds a pair, then the accumulator: at most
// one rounding per product), scales the block once and adds at most nb = ceil(k / 128) block sums,
// so by the standard bound on recursive summation |y - exact| <= (128 + nb + 1) * 2^-24 *
// sum |w * x * s| (to first order). The oracle computes that exact value in FP64 (error far below
// the bound). Activations are kept out of the BF16 subnormal range, which vdpbf16ps flushes.

#include "common/kernels/cpu/fp8_gemm.h"

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

namespace hmoe::cpu {
namespace {

// E4M3FN from its definition: 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0
// is subnormal (m / 8 * 2^-6); S.1111.111 is NaN; no infinities.
double OracleE4M3(uint8_t code) {
  const int sign = code >> 7;
  const int e = (code >> 3) & 15;
  const int m = code & 7;
  if (e == 15 && m == 7) return std::numeric_limits<double>::quiet_NaN();
  const double mag = e == 0 ? std::ldexp(m / 8.0, -6) : std::ldexp(1.0 + m / 8.0, e - 7);
  return sign ? -mag : mag;
}

// Round an F32 to BF16 (nearest, ties to even) and back, for finite inputs.
double OracleBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t low = u & 0xffff;
  uint32_t high = u >> 16;
  if (low > 0x8000 || (low == 0x8000 && (high & 1))) ++high;
  const uint32_t r = high << 16;
  float out;
  std::memcpy(&out, &r, 4);
  return out;
}

struct Problem {
  int64_t rows = 0, cols = 0, row_stride = 0, scale_stride = 0;
  std::vector<uint8_t> w;
  std::vector<float> scales;
  int64_t m = 0, x_stride = 0;
  std::vector<float> x;

  Fp8MatrixView View() const {
    Fp8MatrixView v;
    v.data = w.data();
    v.rows = rows;
    v.cols = cols;
    v.row_stride = row_stride;
    v.scale_inv = scales.data();
    v.scale_stride = scale_stride;
    return v;
  }
};

// Weights cycle through all 254 non-NaN codes (offset by row so every code meets every column
// phase); activations are BF16-normal values of mixed sign and magnitude.
Problem MakeProblem(int64_t rows, int64_t cols, int64_t m, uint32_t seed) {
  Problem p;
  p.rows = rows;
  p.cols = cols;
  p.row_stride = cols + 7;  // not a multiple of anything
  p.scale_stride = (cols + 127) / 128 + 1;
  p.m = m;
  p.x_stride = cols + 3;
  std::mt19937 rng(seed);
  p.w.resize(rows * p.row_stride, 0x7f);  // NaN in the padding: must never be read
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      int code = static_cast<int>((r * 37 + c + rng() % 3) % 254);
      if (code >= 0x7f) ++code;  // skip 0x7F; 0xFF is 255, never reached
      p.w[r * p.row_stride + c] = static_cast<uint8_t>(code);
    }
  }
  std::uniform_real_distribution<float> scale(0.25f, 4.0f);
  p.scales.resize(((rows + 127) / 128) * p.scale_stride, std::nanf(""));
  for (int64_t i = 0; i < (rows + 127) / 128; ++i) {
    for (int64_t j = 0; j < (cols + 127) / 128; ++j) p.scales[i * p.scale_stride + j] = scale(rng);
  }
  std::uniform_real_distribution<float> mag(-3.0f, 3.0f);
  p.x.resize(m * p.x_stride, std::nanf(""));
  for (int64_t t = 0; t < m; ++t) {
    for (int64_t c = 0; c < cols; ++c) {
      const float v = std::ldexp(1.0f + (rng() % 1000) / 1000.0f, static_cast<int>(mag(rng)));
      p.x[t * p.x_stride + c] = (rng() & 1) ? -v : v;
    }
  }
  return p;
}

// The exact result and the tolerance of every (token, row).
struct Expected {
  std::vector<double> y, tol;
};

Expected Oracle(const Problem& p) {
  Expected e;
  e.y.resize(p.m * p.rows);
  e.tol.resize(p.m * p.rows);
  const int64_t nb = (p.cols + 127) / 128;
  std::vector<double> xb(p.cols);
  for (int64_t t = 0; t < p.m; ++t) {
    for (int64_t c = 0; c < p.cols; ++c) xb[c] = OracleBf16(p.x[t * p.x_stride + c]);
    for (int64_t r = 0; r < p.rows; ++r) {
      double sum = 0, abs_sum = 0;
      for (int64_t c = 0; c < p.cols; ++c) {
        const double s = p.scales[(r / 128) * p.scale_stride + c / 128];
        const double v = OracleE4M3(p.w[r * p.row_stride + c]) * xb[c] * s;
        sum += v;
        abs_sum += std::fabs(v);
      }
      e.y[t * p.rows + r] = sum;
      e.tol[t * p.rows + r] = (128 + nb + 1) * std::ldexp(abs_sum, -24) + 1e-30;
    }
  }
  return e;
}

std::vector<CpuIsa> SupportedIsas() {
  std::vector<CpuIsa> out;
  for (CpuIsa isa :
       {CpuIsa::kScalar, CpuIsa::kAvx2, CpuIsa::kAvx512, CpuIsa::kAvx512Bf16, CpuIsa::kAmx}) {
    if (CpuSupports(isa)) out.push_back(isa);
  }
  return out;
}

struct AlignedFree {
  void operator()(std::byte* p) const { std::free(p); }
};
using Buffer = std::unique_ptr<std::byte, AlignedFree>;

Buffer Allocate(int64_t bytes) {
  return Buffer(static_cast<std::byte*>(std::aligned_alloc(64, (bytes + 63) / 64 * 64 + 64)));
}

// Packs the first m tokens in pieces of `piece` tiles (as concurrent callers would).
Buffer PackTokens(const Fp8Gemm& g, const Problem& p, int64_t m, int64_t piece_tiles) {
  Buffer packed = Allocate(g.PackedBytes(m, p.cols));
  // Garbage first: Pack must write every byte the kernel reads.
  std::memset(packed.get(), 0x7f, g.PackedBytes(m, p.cols));
  const int64_t step = g.TokenTile() * piece_tiles;
  for (int64_t t0 = 0; t0 < m; t0 += step) {
    g.Pack(p.x.data(), p.x_stride, m, p.cols, t0, std::min(m, t0 + step), packed.get());
  }
  return packed;
}

// Runs rows [r_begin, r_end) for the first m tokens and checks them; returns the failures.
int Check(const Fp8Gemm& g, const Problem& p, const Expected& e, int64_t m, int64_t r_begin,
          int64_t r_end, int64_t piece_tiles = 1) {
  Buffer packed = PackTokens(g, p, m, piece_tiles);
  const int64_t y_stride = r_end - r_begin + 5;
  std::vector<float> y(m * y_stride, -12345.0f);
  g.Multiply(p.View(), packed.get(), m, r_begin, r_end, y.data(), y_stride);
  int failures = 0;
  for (int64_t t = 0; t < m; ++t) {
    for (int64_t r = r_begin; r < r_end; ++r) {
      const double want = e.y[t * p.rows + r];
      const double got = y[t * y_stride + (r - r_begin)];
      if (!(std::fabs(got - want) <= e.tol[t * p.rows + r]) && failures++ < 5) {
        ADD_FAILURE() << CpuIsaName(g.isa()) << " [" << p.rows << " x " << p.cols << "] m " << m
                      << " rows [" << r_begin << ", " << r_end << ") token " << t << " row " << r
                      << ": got " << got << ", want " << want << " +- " << e.tol[t * p.rows + r];
      }
    }
    // Columns past the range are untouched.
    for (int64_t j = r_end - r_begin; j < y_stride; ++j) {
      if (y[t * y_stride + j] != -12345.0f && failures++ < 5) {
        ADD_FAILURE() << CpuIsaName(g.isa()) << ": wrote outside the row range";
      }
    }
  }
  return failures;
}

TEST(Fp8GemmTest, EveryVariantMatchesTheOracleOnRaggedShapes) {
  const struct {
    int64_t rows, cols, m;
  } kShapes[] = {{1, 1, 1},       {5, 37, 3},      {17, 128, 17},   {128, 128, 64}, {130, 200, 65},
                 {257, 129, 100}, {300, 1000, 70}, {64, 2048, 129}, {3, 300, 600}};
  for (const auto& s : kShapes) {
    const Problem p = MakeProblem(s.rows, s.cols, s.m, static_cast<uint32_t>(s.rows * 7 + s.cols));
    const Expected e = Oracle(p);
    for (CpuIsa isa : SupportedIsas()) {
      SCOPED_TRACE(std::string(CpuIsaName(isa)));
      auto g = NewFp8Gemm(isa);
      ASSERT_TRUE(g.ok()) << g.status();
      EXPECT_EQ(Check(**g, p, e, s.m, 0, s.rows), 0);
      // A range starting mid scale block and crossing one, packed in larger pieces.
      if (s.rows > 3) {
        EXPECT_EQ(Check(**g, p, e, s.m, 1, s.rows - 1, 2), 0);
      }
    }
  }
}

TEST(Fp8GemmTest, EveryTokenCountFrom1To600) {
  const Problem p = MakeProblem(19, 150, 600, 11);
  const Expected e = Oracle(p);
  for (CpuIsa isa : SupportedIsas()) {
    SCOPED_TRACE(std::string(CpuIsaName(isa)));
    auto g = NewFp8Gemm(isa);
    ASSERT_TRUE(g.ok()) << g.status();
    int failures = 0;
    for (int64_t m = 1; m <= 600 && failures == 0; ++m) failures += Check(**g, p, e, m, 0, 19);
    EXPECT_EQ(failures, 0);
  }
}

TEST(Fp8GemmTest, All256CodesAndNaN) {
  // Row r holds code (r + c) % 256 at column c: every code at every position of a 128-block and
  // of a vector. Rows containing 0x7F or 0xFF must give NaN for every token; the oracle skips them.
  const int64_t rows = 256, cols = 256, m = 40;
  Problem p = MakeProblem(rows, cols, m, 5);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) p.w[r * p.row_stride + c] = static_cast<uint8_t>(r + c);
  }
  // A second problem without NaN codes (0x7F -> 0x7E, 0xFF -> 0xFE) for the numeric check.
  Problem q = p;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      uint8_t& b = q.w[r * q.row_stride + c];
      if ((b & 0x7f) == 0x7f) --b;
    }
  }
  const Expected e = Oracle(q);
  for (CpuIsa isa : SupportedIsas()) {
    SCOPED_TRACE(std::string(CpuIsaName(isa)));
    auto g = NewFp8Gemm(isa);
    ASSERT_TRUE(g.ok()) << g.status();
    EXPECT_EQ(Check(**g, q, e, m, 0, rows), 0);
    Buffer packed = PackTokens(**g, p, m, 1);
    std::vector<float> y(m * rows);
    (*g)->Multiply(p.View(), packed.get(), m, 0, rows, y.data(), rows);
    for (int64_t t = 0; t < m; ++t) {
      for (int64_t r = 0; r < rows; ++r) ASSERT_TRUE(std::isnan(y[t * rows + r])) << t << " " << r;
    }
  }
}

// The first m tokens of p packed by the GEMV, PackedBytes(p.cols) apart.
Buffer PackWithGemv(const Fp8Gemv& gemv, const Problem& p, int64_t m) {
  const int64_t stride = gemv.PackedBytes(p.cols);
  Buffer xg = Allocate(stride * m);
  for (int64_t t = 0; t < m; ++t) {
    gemv.Pack(p.x.data() + t * p.x_stride, p.cols, 0, p.cols, xg.get() + t * stride);
  }
  return xg;
}

// Where Fp8GemmMatchesGemv says so, the GEMM's results are bitwise the GEMV's (MatVec for up to
// kMaxMatVecTokens tokens, GemmRows beyond): every k % 128 class (0, < 64, 64, > 64) and k % 32
// class, ragged rows, k on both sides of the amx GEMV's expand-whole-rows limit (2048) and across
// the avx2 GEMM's 512-column chunks, row ranges off the scale blocks and the panels, and token
// counts across the GEMM's tiles and token groups (avx2: 3 and 96).
TEST(Fp8GemmTest, MatchesTheGemvBitwiseWhereItSaysSo) {
  const struct {
    int64_t rows, cols, m;
  } kShapes[] = {{7, 128, 5},     {130, 200, 9},     {257, 129, 13},     {64, 192, 4},
                 {300, 1000, 33}, {50, 64, 1},       {129, 7 * 128, 40}, {40, 2200, 11},
                 {17, 2049, 3},   {20, 16 * 128, 6}, {23, 530, 200},     {11, 1100, 97},
                 {9, 17, 100}};
  int checked = 0;
  for (CpuIsa isa : SupportedIsas()) {
    if (!Fp8GemmMatchesGemv(isa)) continue;
    SCOPED_TRACE(std::string(CpuIsaName(isa)));
    auto gemm = NewFp8Gemm(isa);
    auto gemv = NewFp8Gemv(isa);
    ASSERT_TRUE(gemm.ok() && gemv.ok());
    for (const auto& s : kShapes) {
      const Problem p = MakeProblem(s.rows, s.cols, s.m, static_cast<uint32_t>(s.cols + s.m));
      const int64_t stride = (*gemv)->PackedBytes(s.cols);
      Buffer xg = PackWithGemv(**gemv, p, s.m);
      for (const auto& [r0, r1] : {std::pair<int64_t, int64_t>{0, s.rows}, {1, s.rows - 2}}) {
        std::vector<float> want(s.m * s.rows), got(s.m * s.rows);
        if (s.m <= kMaxMatVecTokens) {
          (*gemv)->MatVec(p.View(), xg.get(), stride, static_cast<int>(s.m), r0, r1, want.data(),
                          s.rows);
        } else {
          (*gemv)->GemmRows(p.View(), xg.get(), stride, s.m, r0, r1, want.data(), s.rows);
        }
        Buffer packed = PackTokens(**gemm, p, s.m, 1);
        (*gemm)->Multiply(p.View(), packed.get(), s.m, r0, r1, got.data(), s.rows);
        ASSERT_EQ(std::memcmp(want.data(), got.data(), want.size() * sizeof(float)), 0)
            << s.rows << " x " << s.cols << ", m " << s.m << ", rows [" << r0 << ", " << r1 << ")";
        ++checked;
      }
    }
  }
  if (checked == 0) GTEST_SKIP() << "no variant here claims GEMV-exact results";
}

// Every token count from 1 to 600 (avx2: every remainder of the 3-token tiles and the 96-token
// groups), bitwise against the GEMV's results for the same tokens (which do not depend on the
// GEMV's batch either), on a matrix with two 512-column chunks and a ragged last block and step.
TEST(Fp8GemmTest, MatchesTheGemvBitwiseForEveryTokenCountFrom1To600) {
  const int64_t rows = 19, cols = 700, max_m = 600;
  const Problem p = MakeProblem(rows, cols, max_m, 17);
  int checked = 0;
  for (CpuIsa isa : SupportedIsas()) {
    if (!Fp8GemmMatchesGemv(isa)) continue;
    SCOPED_TRACE(std::string(CpuIsaName(isa)));
    auto gemm = NewFp8Gemm(isa);
    auto gemv = NewFp8Gemv(isa);
    ASSERT_TRUE(gemm.ok() && gemv.ok());
    const int64_t stride = (*gemv)->PackedBytes(cols);
    Buffer xg = PackWithGemv(**gemv, p, max_m);
    std::vector<float> want(max_m * rows);
    (*gemv)->GemmRows(p.View(), xg.get(), stride, max_m, 0, rows, want.data(), rows);
    Buffer packed = PackTokens(**gemm, p, max_m, 1);
    std::vector<float> got(max_m * rows);
    for (int64_t m = 1; m <= max_m; ++m) {
      // Packing m tokens gives the first m of the 600 (the layouts are per token or padded
      // tiles, so pack again only where the tile padding matters).
      Buffer pm = (*gemm)->TokenTile() == 1 ? nullptr : PackTokens(**gemm, p, m, 1);
      (*gemm)->Multiply(p.View(), pm ? pm.get() : packed.get(), m, 0, rows, got.data(), rows);
      ASSERT_EQ(std::memcmp(want.data(), got.data(), m * rows * sizeof(float)), 0) << "m " << m;
      ++checked;
    }
  }
  if (checked == 0) GTEST_SKIP() << "no variant here claims GEMV-exact results";
}

// Rows holding NaN codes give the GEMV's NaN, bit for bit, and the other rows its numbers: every
// code at every position of a 32-column step and a 128-column block, k ragged.
TEST(Fp8GemmTest, NaNCodesMatchTheGemvBitwise) {
  const int64_t rows = 256, cols = 300, m = 13;
  Problem p = MakeProblem(rows, cols, m, 23);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      // Codes (r + c) % 256, but only every third row keeps its NaN codes.
      uint8_t b = static_cast<uint8_t>(r + c);
      if (r % 3 != 0 && (b & 0x7f) == 0x7f) --b;
      p.w[r * p.row_stride + c] = b;
    }
  }
  int checked = 0;
  for (CpuIsa isa : SupportedIsas()) {
    if (!Fp8GemmMatchesGemv(isa)) continue;
    SCOPED_TRACE(std::string(CpuIsaName(isa)));
    auto gemm = NewFp8Gemm(isa);
    auto gemv = NewFp8Gemv(isa);
    ASSERT_TRUE(gemm.ok() && gemv.ok());
    const int64_t stride = (*gemv)->PackedBytes(cols);
    Buffer xg = PackWithGemv(**gemv, p, m);
    std::vector<float> want(m * rows), got(m * rows);
    (*gemv)->GemmRows(p.View(), xg.get(), stride, m, 0, rows, want.data(), rows);
    Buffer packed = PackTokens(**gemm, p, m, 1);
    (*gemm)->Multiply(p.View(), packed.get(), m, 0, rows, got.data(), rows);
    ASSERT_EQ(std::memcmp(want.data(), got.data(), want.size() * sizeof(float)), 0);
    int nan_rows = 0;
    for (int64_t r = 0; r < rows; ++r) nan_rows += std::isnan(got[r]) ? 1 : 0;
    EXPECT_GT(nan_rows, 0);
    EXPECT_LT(nan_rows, rows);
    ++checked;
  }
  if (checked == 0) GTEST_SKIP() << "no variant here claims GEMV-exact results";
}

// Batch invariance inside the GEMM itself: each of 8 tokens (and of 37, across token tiles) gives
// bitwise the result it gives alone (m = 1), wherever the variant claims GEMV-exact results.
TEST(Fp8GemmTest, ATokensResultDoesNotDependOnTheOtherTokensOfTheCall) {
  int checked = 0;
  for (CpuIsa isa : SupportedIsas()) {
    if (!Fp8GemmMatchesGemv(isa)) continue;
    SCOPED_TRACE(std::string(CpuIsaName(isa)));
    auto gemm = NewFp8Gemm(isa);
    ASSERT_TRUE(gemm.ok());
    const Fp8Gemm& g = **gemm;
    for (const int64_t m : {8, 37}) {
      const Problem p = MakeProblem(150, 333, m, static_cast<uint32_t>(m));
      Buffer packed = PackTokens(g, p, m, 1);
      std::vector<float> all(m * p.rows);
      g.Multiply(p.View(), packed.get(), m, 0, p.rows, all.data(), p.rows);
      for (int64_t t = 0; t < m; ++t) {
        Buffer one = Allocate(g.PackedBytes(1, p.cols));
        g.Pack(p.x.data() + t * p.x_stride, p.x_stride, 1, p.cols, 0, 1, one.get());
        std::vector<float> alone(p.rows);
        g.Multiply(p.View(), one.get(), 1, 0, p.rows, alone.data(), p.rows);
        ASSERT_EQ(std::memcmp(alone.data(), all.data() + t * p.rows, p.rows * sizeof(float)), 0)
            << "token " << t << " of " << m;
        ++checked;
      }
    }
  }
  if (checked == 0) GTEST_SKIP() << "no variant here claims GEMV-exact results";
}

TEST(Fp8GemmTest, ZeroTokensOrRowsIsANoOp) {
  const Problem p = MakeProblem(8, 64, 1, 3);
  const Fp8Gemm& g = DefaultFp8Gemm();
  float y = 7.0f;
  g.Multiply(p.View(), nullptr, 0, 0, 8, &y, 8);
  g.Multiply(p.View(), nullptr, 1, 4, 4, &y, 8);
  EXPECT_EQ(y, 7.0f);
}

TEST(Fp8GemmTest, DefaultIsTheBestVariant) {
  EXPECT_EQ(DefaultFp8Gemm().isa(), BestCpuIsa());
  for (CpuIsa isa :
       {CpuIsa::kScalar, CpuIsa::kAvx2, CpuIsa::kAvx512, CpuIsa::kAvx512Bf16, CpuIsa::kAmx}) {
    EXPECT_EQ(NewFp8Gemm(isa).ok(), CpuSupports(isa));
  }
}

}  // namespace
}  // namespace hmoe::cpu
