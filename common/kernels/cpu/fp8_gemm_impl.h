#pragma once

// The AVX-512 variants of Fp8Gemm (fp8_gemm.h) as one template, included by exactly one file per
// variant, each compiled with its own ISA flags into an anonymous namespace (the copies never meet
// at link time). Keep standard-library templates out of here: an inline function instantiated with
// AVX-512 flags could be the copy the linker keeps for the whole program. (The AVX2 variant is its
// own file, fp8_gemm_avx2.cc; the AMX one is fp8_gemm_amx.cc.)
//
// Before including, define HMOE_FP8_GEMM_VARIANT: 2 = AVX-512 F/BW/VL/VBMI (F32 FMA), 3 = AVX-512
// BF16 (vdpbf16ps).

// GCC 12 reports its own _mm*_undefined_*() helpers as uninitialized (GCC bug 105593) when they
// are inlined into our functions; the location is inside the intrinsics headers.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "common/kernels/cpu/fp8_gemm.h"
#include "common/kernels/cpu/fp8_gemv.h"

#if !defined(HMOE_FP8_GEMM_VARIANT) || (HMOE_FP8_GEMM_VARIANT != 2 && HMOE_FP8_GEMM_VARIANT != 3)
#error "define HMOE_FP8_GEMM_VARIANT (2 or 3) before including fp8_gemm_impl.h"
#endif

#define HMOE_GEMM_INLINE inline __attribute__((always_inline))
// Fully unrolls the loops over a micro-tile's rows and token vectors so the accumulators live in
// registers (see fp8_gemv_avx512_impl.h for what happens otherwise).
#define HMOE_GEMM_UNROLL _Pragma("GCC unroll 16")

namespace hmoe::cpu::internal {
namespace {

constexpr bool kBf16 = HMOE_FP8_GEMM_VARIANT == 3;
constexpr int64_t kBlock = 128;  // scale block (rows and columns)

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// BF16 bit pattern of the E4M3FN magnitude `code` (0..127); 0x7F is NaN.
constexpr uint16_t E4M3MagnitudeToBf16(int code) {
  const int exponent = code >> 3;
  const int mantissa = code & 7;
  if (exponent == 15 && mantissa == 7) return 0x7fc0;
  if (exponent == 0) {
    if (mantissa == 0) return 0;
    // mantissa * 2^-9 = 1.f * 2^(p - 9) with p the top set bit of the mantissa.
    const int p = mantissa >= 4 ? 2 : (mantissa >= 2 ? 1 : 0);
    const int fraction = (mantissa - (1 << p)) << (7 - p);
    return static_cast<uint16_t>(((127 + p - 9) << 7) | fraction);
  }
  return static_cast<uint16_t>(((exponent + 120) << 7) | (mantissa << 4));
}

struct alignas(64) Bf16Tables {
  uint8_t lo[128];
  uint8_t hi[128];
};

constexpr Bf16Tables MakeTables() {
  Bf16Tables t{};
  for (int i = 0; i < 128; ++i) {
    t.lo[i] = static_cast<uint8_t>(E4M3MagnitudeToBf16(i) & 0xff);
    t.hi[i] = static_cast<uint8_t>(E4M3MagnitudeToBf16(i) >> 8);
  }
  return t;
}

constexpr Bf16Tables kTables = MakeTables();

// ------------------------------------------------------------------------- GEMV-exact kernel
//
// The AVX-512 variants compute, for every token, exactly the operations of the same variant of
// Fp8Gemv (fp8_gemv_avx512_impl.h) in the same order, so results are bitwise equal to the GEMV's
// and do not depend on the batch: the activations are packed by the GEMV itself; per row, each
// 64-column chunk's weights are expanded into the GEMV's A/B lane order (BF16); F32 lane j of a
// block accumulator sums chunk 0 A, chunk 0 B, chunk 1 A, chunk 1 B (vdpbf16ps, or the even/odd
// F32 FMAs); the block is scaled into a 16-lane total by one FMA; at the end the 16 lanes are
// summed by the GEMV's shuffle tree. What changes is the reuse: a panel of rows is expanded once
// into L2 and every token tile reads it from there, R rows x T tokens per micro-kernel with the
// weight vectors in registers.

constexpr int64_t kExpBlockBytes = 256;              // c0A c0B c1A c1B, 32 BF16 each
constexpr int64_t kXBlockBytes = kBf16 ? 256 : 512;  // GEMV-packed activation per block
constexpr int kExactRows = 3;                        // R
constexpr int kExactTokens =
    kBf16 ? 4 : 3;  // T (the F32 variant needs 6 registers per row for the weights)

// The GEMV's lane sum (same shuffles, same order).
HMOE_GEMM_INLINE float ReduceAdd(__m512 v) {
  v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0x4e));
  v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0xb1));
  v = _mm512_add_ps(v, _mm512_permute_ps(v, 0x4e));
  v = _mm512_add_ps(v, _mm512_permute_ps(v, 0xb1));
  return _mm512_cvtss_f32(v);
}

// Rows [0, rows) x all k columns of w into out (row r, block kb at out + (r * blocks + kb) *
// kExpBlockBytes), BF16 in the GEMV's A/B order; chunks past k are zero.
void ExpandRowsAB(const uint8_t* w, int64_t row_stride, int rows, int64_t k, std::byte* out) {
  const __m512i lo0 = _mm512_load_si512(kTables.lo);
  const __m512i lo1 = _mm512_load_si512(kTables.lo + 64);
  const __m512i hi0 = _mm512_load_si512(kTables.hi);
  const __m512i hi1 = _mm512_load_si512(kTables.hi + 64);
  const __m512i sign = _mm512_set1_epi8(static_cast<char>(0x80));
  const int64_t chunks = CeilDiv(k, 128) * 2;
  for (int r = 0; r < rows; ++r) {
    const uint8_t* src = w + r * row_stride;
    std::byte* dst = out + r * chunks * 128;
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t cols = k - c * 64;
      const __mmask64 mask = cols >= 64 ? ~0ull : (cols <= 0 ? 0ull : (1ull << cols) - 1);
      const __m512i codes = _mm512_maskz_loadu_epi8(mask, src + c * 64);
      const __m512i lo = _mm512_permutex2var_epi8(lo0, codes, lo1);
      const __m512i hi =
          _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(hi0, codes, hi1), codes, sign, 0xf8);
      _mm512_store_si512(dst + c * 128, _mm512_unpacklo_epi8(lo, hi));
      _mm512_store_si512(dst + c * 128 + 64, _mm512_unpackhi_epi8(lo, hi));
    }
  }
}

struct ExactArgs {
  const std::byte* w;   // expanded rows of the micro-tile
  int64_t w_row_bytes;  // bytes between expanded rows
  const std::byte* x;   // GEMV-packed activation of token 0
  int64_t x_stride;     // bytes between tokens
  const float* scales;  // the rows' scale blocks
  int64_t blocks;       // 128-column blocks
  bool last_has_two;    // whether the last block has a second chunk (k % 128 == 0 or > 64)
  float* y;             // (token 0, row 0)
  int64_t y_stride;
};

template <int R, int T>
__attribute__((noinline)) void ExactMicro(const ExactArgs& a) {
  __m512 total[R][T];
  HMOE_GEMM_UNROLL
  for (int r = 0; r < R; ++r) {
    HMOE_GEMM_UNROLL
    for (int t = 0; t < T; ++t) total[r][t] = _mm512_setzero_ps();
  }
#if HMOE_FP8_GEMM_VARIANT == 2
  const __m512i high_words = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
#endif
  for (int64_t kb = 0; kb < a.blocks; ++kb) {
    __m512 acc[R][T];
    HMOE_GEMM_UNROLL
    for (int r = 0; r < R; ++r) {
      HMOE_GEMM_UNROLL
      for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
    }
    const int halves = (kb + 1 < a.blocks || a.last_has_two) ? 4 : 2;
    for (int u = 0; u < halves; ++u) {
      __m512i wr[R];
      HMOE_GEMM_UNROLL
      for (int r = 0; r < R; ++r) {
        wr[r] = _mm512_load_si512(a.w + r * a.w_row_bytes + kb * kExpBlockBytes + u * 64);
      }
#if HMOE_FP8_GEMM_VARIANT == 3
      HMOE_GEMM_UNROLL
      for (int t = 0; t < T; ++t) {
        const __m512i xv = _mm512_loadu_si512(a.x + t * a.x_stride + kb * kXBlockBytes + u * 64);
        HMOE_GEMM_UNROLL
        for (int r = 0; r < R; ++r) {
          acc[r][t] = _mm512_dpbf16_ps(acc[r][t], (__m512bh)wr[r], (__m512bh)xv);
        }
      }
#else
      __m512 even[R], odd[R];
      HMOE_GEMM_UNROLL
      for (int r = 0; r < R; ++r) {
        even[r] = _mm512_castsi512_ps(_mm512_slli_epi32(wr[r], 16));
        odd[r] = _mm512_castsi512_ps(_mm512_and_si512(wr[r], high_words));
      }
      HMOE_GEMM_UNROLL
      for (int t = 0; t < T; ++t) {
        const float* xt =
            reinterpret_cast<const float*>(a.x + t * a.x_stride + kb * kXBlockBytes + u * 128);
        const __m512 xe = _mm512_loadu_ps(xt);
        const __m512 xo = _mm512_loadu_ps(xt + 16);
        HMOE_GEMM_UNROLL
        for (int r = 0; r < R; ++r) {
          acc[r][t] = _mm512_fmadd_ps(even[r], xe, acc[r][t]);
          acc[r][t] = _mm512_fmadd_ps(odd[r], xo, acc[r][t]);
        }
      }
#endif
    }
    const __m512 s = _mm512_set1_ps(a.scales[kb]);
    HMOE_GEMM_UNROLL
    for (int r = 0; r < R; ++r) {
      HMOE_GEMM_UNROLL
      for (int t = 0; t < T; ++t) total[r][t] = _mm512_fmadd_ps(acc[r][t], s, total[r][t]);
    }
  }
  HMOE_GEMM_UNROLL
  for (int r = 0; r < R; ++r) {
    HMOE_GEMM_UNROLL
    for (int t = 0; t < T; ++t) a.y[t * a.y_stride + r] = ReduceAdd(total[r][t]);
  }
}

template <int R>
void ExactMicroT(int tokens, const ExactArgs& a) {
  switch (tokens) {
    case 1:
      return ExactMicro<R, 1>(a);
    case 2:
      return ExactMicro<R, 2>(a);
    case 3:
      return ExactMicro<R, 3>(a);
    case 4:
      return ExactMicro<R, 4>(a);
    default:
      __builtin_trap();
  }
}

// Rows per expanded panel: at most 48 (16 micro-tiles) and about 1 MiB of expanded weights, so
// the panel stays in L2 while every token tile passes over it.
int64_t ExactPanelRows(int64_t k) {
  const int64_t bytes_per_row = CeilDiv(k, 128) * kExpBlockBytes;
  int64_t rows = (int64_t{1} << 20) / bytes_per_row / kExactRows * kExactRows;
  if (rows < kExactRows) rows = kExactRows;
  return rows > 48 ? 48 : rows;
}

// m tokens packed by the GEMV at x (x_stride bytes apart) times rows [r_begin, r_end) of w.
void ExactRun(const Fp8MatrixView& w, const std::byte* x, int64_t x_stride, int64_t m,
              int64_t r_begin, int64_t r_end, float* y, int64_t y_stride, std::byte* scratch) {
  const int64_t blocks = CeilDiv(w.cols, kBlock);
  const int64_t rest = w.cols - (blocks - 1) * kBlock;
  const int64_t panel = ExactPanelRows(w.cols);
  ExactArgs a{};
  a.w_row_bytes = blocks * kExpBlockBytes;
  a.x_stride = x_stride;
  a.blocks = blocks;
  a.last_has_two = rest > 64;
  a.y_stride = y_stride;
  for (int64_t r0 = r_begin; r0 < r_end;) {
    int64_t r1 = (r0 / kBlock + 1) * kBlock;  // panels never cross a scale block
    if (r1 > r_end) r1 = r_end;
    if (r1 > r0 + panel) r1 = r0 + panel;
    const int rows = static_cast<int>(r1 - r0);
    ExpandRowsAB(w.data + r0 * w.row_stride, w.row_stride, rows, w.cols, scratch);
    a.scales = w.scale_inv + (r0 / kBlock) * w.scale_stride;
    for (int64_t t0 = 0; t0 < m; t0 += kExactTokens) {
      const int tokens = static_cast<int>(m - t0 < kExactTokens ? m - t0 : kExactTokens);
      a.x = x + t0 * x_stride;
      int r = 0;
      for (; r + kExactRows <= rows; r += kExactRows) {
        a.w = scratch + r * a.w_row_bytes;
        a.y = y + t0 * y_stride + (r0 - r_begin) + r;
        ExactMicroT<kExactRows>(tokens, a);
      }
      for (; r < rows; ++r) {
        a.w = scratch + r * a.w_row_bytes;
        a.y = y + t0 * y_stride + (r0 - r_begin) + r;
        ExactMicroT<1>(tokens, a);
      }
    }
    r0 = r1;
  }
}

class SimdFp8Gemm final : public Fp8Gemm {
 public:
  // `gemv`: the Fp8Gemv of the same ISA (packs the activations); not owned, outlives this object.
  explicit SimdFp8Gemm(const Fp8Gemv* gemv) : gemv_(gemv) {}

  CpuIsa isa() const override { return kBf16 ? CpuIsa::kAvx512Bf16 : CpuIsa::kAvx512; }

  int64_t TokenTile() const override { return 1; }
  int64_t PackedBytes(int64_t m, int64_t k) const override { return m * gemv_->PackedBytes(k); }
  void Pack(const float* x, int64_t x_stride, int64_t, int64_t k, int64_t t_begin, int64_t t_end,
            std::byte* packed) const override {
    const int64_t stride = gemv_->PackedBytes(k);
    for (int64_t t = t_begin; t < t_end; ++t) {
      gemv_->Pack(x + t * x_stride, k, 0, k, packed + t * stride);
    }
  }
  int64_t ScratchBytes(int64_t, int64_t k) const override {
    return ExactPanelRows(k) * CeilDiv(k, kBlock) * kExpBlockBytes;
  }
  void Run(const Fp8MatrixView& w, const std::byte* packed, int64_t m, int64_t r_begin,
           int64_t r_end, float* y, int64_t y_stride, std::byte* scratch) const override {
    if (m <= 0 || r_begin >= r_end) return;
    ExactRun(w, packed, gemv_->PackedBytes(w.cols), m, r_begin, r_end, y, y_stride, scratch);
  }

 private:
  const Fp8Gemv* const gemv_;
};

}  // namespace
}  // namespace hmoe::cpu::internal

#undef HMOE_GEMM_INLINE
#undef HMOE_GEMM_UNROLL
