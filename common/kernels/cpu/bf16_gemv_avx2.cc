// AVX2 + FMA variant of Bf16Gemv (lm_head, the router, BF16 checkpoints on CPUs without AVX-512,
// e.g. AMD Zen 3). Compiled with -mavx2 -mfma (CMakeLists.txt); reached only through NewBf16Gemv
// after a CPU check. The arithmetic of the AVX-512 F/BW variant at half the width: each 32-bit
// lane holds a BF16 pair, split into its exact F32 even half (shift left 16) and odd half (mask
// the high 16 bits), two FMAs per 16 weights and token into 8-lane accumulators, then one lane-sum
// tree per (row, token). A token's sums never depend on the other tokens of the call, so results
// do not depend on the batch. The last partial 16-column block is read through a zero-padded
// copy (AVX2 has no 16-bit masked loads); the packed activation is zero there already.
// No standard-library templates here (see bf16_gemv_avx512_impl.h for why).

// GCC 12 reports its own _mm*_undefined_*() helpers as uninitialized (GCC bug 105593).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "common/kernels/cpu/bf16_gemv.h"

namespace hmoe::cpu::internal {
namespace {

#define HMOE_BF16_INLINE inline __attribute__((always_inline))
// Fully unrolls the loops over a tile's rows and tokens so the accumulators stay in registers.
#define HMOE_BF16_UNROLL _Pragma("GCC unroll 16")

// Prefetch distance beyond the start of the next tile of rows, in bytes (as the AVX-512 variant).
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

HMOE_BF16_INLINE float ReduceAdd(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// acc += the products of the 16 BF16 weights of w and the 16 BF16 activations of x.
HMOE_BF16_INLINE __m256 Dot(__m256 acc, __m256i w, __m256i x) {
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  acc = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(w, 16)),
                        _mm256_castsi256_ps(_mm256_slli_epi32(x, 16)), acc);
  return _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(w, high)),
                         _mm256_castsi256_ps(_mm256_and_si256(x, high)), acc);
}

template <int R, int N>
__attribute__((noinline)) void Tile(const Args& a) {
  __m256 acc[R][N];
  HMOE_BF16_UNROLL
  for (int r = 0; r < R; ++r) {
    HMOE_BF16_UNROLL
    for (int t = 0; t < N; ++t) acc[r][t] = _mm256_setzero_ps();
  }
  const int64_t full = a.k / 16;
  for (int64_t c = 0; c < full; ++c) {
    HMOE_BF16_UNROLL
    for (int r = 0; r < R; ++r) {
      const __m256i wv =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.w + r * a.row_bytes + c * 32));
      HMOE_BF16_UNROLL
      for (int t = 0; t < N; ++t) {
        const __m256i xv =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.x + t * a.x_stride + c * 32));
        acc[r][t] = Dot(acc[r][t], wv, xv);
      }
    }
    // One 64-byte line per row every other block.
    if (c % 2 == 0) {
      const std::byte* pf = a.pf + c / 2 * R * 64;
      HMOE_BF16_UNROLL
      for (int r = 0; r < R; ++r) {
        if (pf + r * 64 < a.pf_end)
          _mm_prefetch(reinterpret_cast<const char*>(pf + r * 64), _MM_HINT_T0);
      }
    }
  }
  const int64_t rest = a.k - full * 16;
  if (rest > 0) {
    HMOE_BF16_UNROLL
    for (int r = 0; r < R; ++r) {
      alignas(32) std::byte tail[32] = {};
      std::memcpy(tail, a.w + r * a.row_bytes + full * 32, 2 * rest);
      const __m256i wv = _mm256_load_si256(reinterpret_cast<const __m256i*>(tail));
      HMOE_BF16_UNROLL
      for (int t = 0; t < N; ++t) {
        const __m256i xv =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.x + t * a.x_stride + full * 32));
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

// 16 ymm registers: R x N accumulators plus the weight and activation vectors.
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

class Avx2Bf16Gemv final : public Bf16Gemv {
 public:
  CpuIsa isa() const override { return CpuIsa::kAvx2; }

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

Bf16Gemv* NewAvx2Bf16Gemv() { return new Avx2Bf16Gemv(); }

}  // namespace hmoe::cpu::internal

#undef HMOE_BF16_INLINE
#undef HMOE_BF16_UNROLL
