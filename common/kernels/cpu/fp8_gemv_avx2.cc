// AVX2 + FMA + F16C variant of Fp8Gemv, for CPUs without AVX-512 BF16. Compiled with -mavx2 -mfma
// -mf16c (this file only); reached only through the dispatcher after a CPU check. Keep
// standard-library templates out of this file (see fp8_gemv_avx512.cc).
//
// An E4M3 code shifted into an IEEE half is exactly the code's value times 2^-8: the 4-bit
// exponent lands in the low bits of the half's 5-bit exponent, whose bias is 8 larger, and E4M3
// subnormals become half subnormals. vcvtph2ps then gives F32, the 2^8 is folded into the block
// scale, and the dot products run in F32 FMAs against the BF16-rounded activation (stored as F32,
// natural order). Products are exact, so only the summation order differs from the reference.

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

#include "common/kernels/cpu/fp8_gemv.h"
#include "common/kernels/cpu/fp8_gemv_internal.h"

#define HMOE_AVX2_INLINE inline __attribute__((always_inline))

namespace hmoe::cpu::internal {
namespace {

constexpr int64_t kScaleBlock = 128;

// float -> BF16 bits, round to nearest even, NaN stays quiet NaN. A private copy of
// kernels::FloatToBf16Bits: an inline function from a shared header compiled here could be the
// copy every other file links to.
uint16_t ToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

float FromBf16(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}
constexpr int64_t kStep = 16;  // weight bytes per step

struct TileArgs {
  const uint8_t* w;
  int64_t row_stride;
  int64_t k;
  const float* scales;
  const float* x;
  int64_t x_stride;  // floats between tokens
  float* y;
  int64_t y_stride;
  const uint8_t* pf;
  const uint8_t* pf_end;
};

// 16 FP8 codes -> 16 floats (value * 2^-8), NaN codes -> NaN.
HMOE_AVX2_INLINE void Expand(__m128i codes, __m256* lo, __m256* hi) {
  const __m256i w = _mm256_cvtepu8_epi16(codes);
  const __m256i mag = _mm256_and_si256(w, _mm256_set1_epi16(0x7f));
  __m256i h = _mm256_or_si256(_mm256_slli_epi16(mag, 7),
                              _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8));
  const __m256i nan = _mm256_cmpeq_epi16(mag, _mm256_set1_epi16(0x7f));
  h = _mm256_or_si256(h, _mm256_and_si256(nan, _mm256_set1_epi16(0x7e00)));
  *lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
  *hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
}

template <int R, int N>
HMOE_AVX2_INLINE void Step(const TileArgs& a, int64_t k0, int64_t valid, __m256 (&acc)[R][N]) {
  for (int r = 0; r < R; ++r) {
    const uint8_t* p = a.w + r * a.row_stride + k0;
    __m128i codes;
    if (valid >= kStep) {
      codes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    } else {
      alignas(16) uint8_t tail[kStep] = {};
      std::memcpy(tail, p, static_cast<size_t>(valid));
      codes = _mm_load_si128(reinterpret_cast<const __m128i*>(tail));
    }
    __m256 lo, hi;
    Expand(codes, &lo, &hi);
    for (int t = 0; t < N; ++t) {
      const float* x = a.x + t * a.x_stride + k0;
      acc[r][t] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(x), acc[r][t]);
      acc[r][t] = _mm256_fmadd_ps(hi, _mm256_loadu_ps(x + 8), acc[r][t]);
    }
  }
}

template <int R, int N>
__attribute__((noinline)) void Tile(const TileArgs& a) {
  __m256 total[R][N];
  for (int r = 0; r < R; ++r) {
    for (int t = 0; t < N; ++t) total[r][t] = _mm256_setzero_ps();
  }
  int64_t pf_step = 0;
  for (int64_t k0 = 0; k0 < a.k; k0 += kScaleBlock) {
    __m256 blk[R][N];
    for (int r = 0; r < R; ++r) {
      for (int t = 0; t < N; ++t) blk[r][t] = _mm256_setzero_ps();
    }
    const int64_t k1 = k0 + kScaleBlock < a.k ? k0 + kScaleBlock : a.k;
    for (int64_t k = k0; k < k1; k += kStep) {
      Step<R, N>(a, k, k1 - k, blk);
      // One 64-byte line per row every four steps keeps the linear prefetch at the rows' pace.
      if ((pf_step++ & 3) == 0) {
        for (int r = 0; r < R; ++r) {
          const uint8_t* line = a.pf + (pf_step / 4) * (R * 64) + r * 64;
          if (line < a.pf_end) _mm_prefetch(reinterpret_cast<const char*>(line), _MM_HINT_T0);
        }
      }
    }
    const __m256 s = _mm256_set1_ps(a.scales[k0 / kScaleBlock] * 256.0f);
    for (int r = 0; r < R; ++r) {
      for (int t = 0; t < N; ++t) total[r][t] = _mm256_fmadd_ps(blk[r][t], s, total[r][t]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int t = 0; t < N; ++t) {
      const __m128 v =
          _mm_add_ps(_mm256_castps256_ps128(total[r][t]), _mm256_extractf128_ps(total[r][t], 1));
      const __m128 h = _mm_add_ps(v, _mm_movehl_ps(v, v));
      a.y[t * a.y_stride + r] = _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
    }
  }
}

template <int N>
void MatVecN(const Fp8MatrixView& w, const float* x, int64_t x_stride, int64_t m_begin,
             int64_t m_end, float* y, int64_t y_stride, int64_t prefetch_bytes) {
  constexpr int R = N <= 2 ? 2 : 1;
  TileArgs a{};
  a.row_stride = w.row_stride;
  a.k = w.cols;
  a.x = x;
  a.x_stride = x_stride;
  a.y_stride = y_stride;
  a.pf_end = prefetch_bytes >= 0 ? w.data + m_end * w.row_stride : nullptr;
  for (int64_t m = m_begin; m < m_end;) {
    const int64_t block_end = (m / kScaleBlock + 1) * kScaleBlock;
    const int64_t tile_end = block_end < m_end ? block_end : m_end;
    a.scales = w.scale_inv + (m / kScaleBlock) * w.scale_stride;
    for (; m + R <= tile_end; m += R) {
      a.w = w.data + m * w.row_stride;
      a.y = y + (m - m_begin);
      a.pf = a.w + R * w.row_stride + (prefetch_bytes > 0 ? prefetch_bytes : 0);
      Tile<R, N>(a);
    }
    for (; m < tile_end; ++m) {
      a.w = w.data + m * w.row_stride;
      a.y = y + (m - m_begin);
      a.pf = a.w + w.row_stride + (prefetch_bytes > 0 ? prefetch_bytes : 0);
      Tile<1, N>(a);
    }
  }
}

class Avx2Fp8Gemv final : public Fp8Gemv {
 public:
  explicit Avx2Fp8Gemv(int64_t prefetch_bytes) : prefetch_bytes_(prefetch_bytes) {}

  CpuIsa isa() const override { return CpuIsa::kAvx2; }

  int64_t PackedBytes(int64_t k) const override {
    const int64_t bytes = (k + kPackGroup - 1) / kPackGroup * kPackGroup * 4;
    // Pad to 4 * odd cache lines: then the packed tokens of a batch, read side by side, fall into
    // different L1 sets (a multiple of 4 KiB would put them all in the same few sets).
    int64_t lines = (bytes + 63) / 64;
    lines = (lines + 3) / 4 * 4;
    if (lines % 8 == 0) lines += 4;
    return lines * 64;
  }

  void Pack(const float* x, int64_t k, int64_t k_begin, int64_t k_end,
            std::byte* packed) const override {
    float* out = reinterpret_cast<float*>(packed);
    for (int64_t i = k_begin; i < k_end; ++i) {
      out[i] = FromBf16(ToBf16(x[i - k_begin]));
    }
    if (k_end == k) {
      const int64_t padded = (k + kPackGroup - 1) / kPackGroup * kPackGroup;
      for (int64_t i = k; i < padded; ++i) out[i] = 0.0f;
      std::memset(packed + padded * 4, 0, PackedBytes(k) - padded * 4);
    }
  }

  void MatVec(const Fp8MatrixView& w, const std::byte* packed, int64_t packed_stride, int n,
              int64_t m_begin, int64_t m_end, float* y, int64_t y_stride) const override {
    const float* x = reinterpret_cast<const float*>(packed);
    const int64_t xs = packed_stride / 4;
    const int64_t pf = prefetch_bytes_;
    switch (n) {
      case 1:
        return MatVecN<1>(w, x, xs, m_begin, m_end, y, y_stride, pf);
      case 2:
        return MatVecN<2>(w, x, xs, m_begin, m_end, y, y_stride, pf);
      case 3:
        return MatVecN<3>(w, x, xs, m_begin, m_end, y, y_stride, pf);
      case 4:
        return MatVecN<4>(w, x, xs, m_begin, m_end, y, y_stride, pf);
      case 5:
        return MatVecN<5>(w, x, xs, m_begin, m_end, y, y_stride, pf);
      case 6:
        return MatVecN<6>(w, x, xs, m_begin, m_end, y, y_stride, pf);
      case 7:
        return MatVecN<7>(w, x, xs, m_begin, m_end, y, y_stride, pf);
      case 8:
        return MatVecN<8>(w, x, xs, m_begin, m_end, y, y_stride, pf);
      default:
        __builtin_trap();  // the interface allows 1..kMaxMatVecTokens
    }
  }

 private:
  const int64_t prefetch_bytes_;
};

}  // namespace

Fp8Gemv* NewAvx2Fp8Gemv(int64_t prefetch_bytes) { return new Avx2Fp8Gemv(prefetch_bytes); }

}  // namespace hmoe::cpu::internal
