#pragma once

// The AVX-512 variants of Bf16Gemv, included by exactly two files compiled with their own ISA
// flags (see CMakeLists.txt): bf16_gemv_avx512bf16.cc (vdpbf16ps) and bf16_gemv_avx512.cc
// (AVX-512 F/BW: each 32-bit lane's two BF16 split into exact F32 even/odd halves, two FMAs).
// Reached only through NewBf16Gemv after a CPU check. No standard-library templates here: an
// inline function instantiated with AVX-512 flags could be the copy the linker keeps for the whole
// program. Define HMOE_BF16_DPBF16 to 0 or 1 before including.

#ifndef HMOE_BF16_DPBF16
#error "define HMOE_BF16_DPBF16 before including bf16_gemv_avx512_impl.h"
#endif

// GCC 12 reports its own _mm*_undefined_*() helpers as uninitialized (GCC bug 105593).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop

#include <cstddef>
#include <cstdint>

#include "common/kernels/cpu/bf16_gemv.h"

namespace hmoe::cpu::internal {
namespace {

#define HMOE_BF16_INLINE inline __attribute__((always_inline))
// Fully unrolls the loops over a tile's rows and tokens so the accumulators stay in registers
// (GCC 12 otherwise keeps the arrays on the stack; see fp8_gemv_avx512_impl.h).
#define HMOE_BF16_UNROLL _Pragma("GCC unroll 16")

// Prefetch distance beyond the start of the next tile of rows, in bytes.
constexpr int64_t kPrefetchBytes = 1024;

struct Args {
  const std::byte* w;   // first row of the tile
  int64_t row_bytes;    // bytes between rows
  int64_t k;            // columns
  const std::byte* x;   // packed activation of token 0
  int64_t x_stride;     // bytes between tokens
  float* y;             // output of (row 0, token 0)
  int64_t y_stride;     // floats between tokens
  const std::byte* pf;  // prefetch stream of this tile
  const std::byte* pf_end;
};

HMOE_BF16_INLINE float ReduceAdd(__m512 v) {
  v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0x4e));
  v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0xb1));
  v = _mm512_add_ps(v, _mm512_permute_ps(v, 0x4e));
  v = _mm512_add_ps(v, _mm512_permute_ps(v, 0xb1));
  return _mm512_cvtss_f32(v);
}

// acc += the dot products of the 32 BF16 pairs of w and x.
HMOE_BF16_INLINE __m512 Dot(__m512 acc, __m512i w, __m512i x) {
#if HMOE_BF16_DPBF16
  return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)x);
#else
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  acc = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(w, 16)),
                        _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)), acc);
  return _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(w, high)),
                         _mm512_castsi512_ps(_mm512_and_si512(x, high)), acc);
#endif
}

template <int R, int N>
__attribute__((noinline)) void Tile(const Args& a) {
  __m512 acc[R][N];
  HMOE_BF16_UNROLL
  for (int r = 0; r < R; ++r) {
    HMOE_BF16_UNROLL
    for (int t = 0; t < N; ++t) acc[r][t] = _mm512_setzero_ps();
  }
  const int64_t full = a.k / 32;
  for (int64_t c = 0; c < full; ++c) {
    HMOE_BF16_UNROLL
    for (int r = 0; r < R; ++r) {
      const __m512i wv = _mm512_loadu_si512(a.w + r * a.row_bytes + c * 64);
      HMOE_BF16_UNROLL
      for (int t = 0; t < N; ++t) {
        const __m512i xv = _mm512_loadu_si512(a.x + t * a.x_stride + c * 64);
        acc[r][t] = Dot(acc[r][t], wv, xv);
      }
    }
    const std::byte* pf = a.pf + c * R * 64;
    HMOE_BF16_UNROLL
    for (int r = 0; r < R; ++r) {
      if (pf + r * 64 < a.pf_end)
        _mm_prefetch(reinterpret_cast<const char*>(pf + r * 64), _MM_HINT_T0);
    }
  }
  const int64_t rest = a.k - full * 32;
  if (rest > 0) {
    const __mmask32 mask = static_cast<__mmask32>((1ull << rest) - 1);
    HMOE_BF16_UNROLL
    for (int r = 0; r < R; ++r) {
      const __m512i wv = _mm512_maskz_loadu_epi16(mask, a.w + r * a.row_bytes + full * 64);
      HMOE_BF16_UNROLL
      for (int t = 0; t < N; ++t) {
        const __m512i xv = _mm512_loadu_si512(a.x + t * a.x_stride + full * 64);
        acc[r][t] = Dot(acc[r][t], wv, xv);
      }
    }
  }
  HMOE_BF16_UNROLL
  for (int r = 0; r < R; ++r) {
    HMOE_BF16_UNROLL
    for (int t = 0; t < N; ++t) a.y[t * a.y_stride + r] = ReduceAdd(acc[r][t]);
  }
}

template <int N>
constexpr int TileRows() {
  return N <= 2 ? 4 : (N <= 4 ? 2 : 1);
}

template <int N>
void MatVecN(const Bf16MatrixView& w, const std::byte* x, int64_t x_stride, int64_t m_begin,
             int64_t m_end, float* y, int64_t y_stride) {
  constexpr int R = TileRows<N>();
  Args a;
  a.row_bytes = 2 * w.row_stride;
  a.k = w.cols;
  a.x = x;
  a.x_stride = x_stride;
  a.y_stride = y_stride;
  a.pf_end = w.data + m_end * a.row_bytes;
  int64_t m = m_begin;
  for (; m + R <= m_end; m += R) {
    a.w = w.data + m * a.row_bytes;
    a.y = y + (m - m_begin);
    a.pf = a.w + R * a.row_bytes + kPrefetchBytes;
    Tile<R, N>(a);
  }
  for (; m < m_end; ++m) {
    a.w = w.data + m * a.row_bytes;
    a.y = y + (m - m_begin);
    a.pf = a.w + a.row_bytes + kPrefetchBytes;
    Tile<1, N>(a);
  }
}

class Avx512Bf16Gemv final : public Bf16Gemv {
 public:
  CpuIsa isa() const override { return HMOE_BF16_DPBF16 ? CpuIsa::kAvx512Bf16 : CpuIsa::kAvx512; }

  void MatVec(const Bf16MatrixView& w, const std::byte* packed, int64_t packed_stride, int n,
              int64_t m_begin, int64_t m_end, float* y, int64_t y_stride) const override {
    switch (n) {
      case 1:
        return MatVecN<1>(w, packed, packed_stride, m_begin, m_end, y, y_stride);
      case 2:
        return MatVecN<2>(w, packed, packed_stride, m_begin, m_end, y, y_stride);
      case 3:
        return MatVecN<3>(w, packed, packed_stride, m_begin, m_end, y, y_stride);
      case 4:
        return MatVecN<4>(w, packed, packed_stride, m_begin, m_end, y, y_stride);
      case 5:
        return MatVecN<5>(w, packed, packed_stride, m_begin, m_end, y, y_stride);
      case 6:
        return MatVecN<6>(w, packed, packed_stride, m_begin, m_end, y, y_stride);
      case 7:
        return MatVecN<7>(w, packed, packed_stride, m_begin, m_end, y, y_stride);
      case 8:
        return MatVecN<8>(w, packed, packed_stride, m_begin, m_end, y, y_stride);
      default:
        __builtin_trap();  // the interface allows 1..kMaxMatVecTokens
    }
  }
};

}  // namespace
}  // namespace hmoe::cpu::internal

#undef HMOE_BF16_INLINE
#undef HMOE_BF16_UNROLL
