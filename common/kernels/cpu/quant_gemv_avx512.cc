// AVX-512 variant of QuantGemv: AVX-512 F/BW/VL + VNNI (Ice Lake, Sapphire Rapids, Zen 4/5).
// Compiled with its own ISA flags (see CMakeLists.txt); reached only through the dispatcher after
// a CPU check. Keep standard-library templates out of this file (see fp8_gemv_avx512.cc).
//
// Per 64 weights (one zmm of unsigned quants, two 32-weight sub-blocks of Q4_K/Q5_K or four
// 16-weight sub-blocks of Q6_K, one per 128-bit lane) and a token: vpmaddubsw with the Q8_K
// quants gives 32 exact int16 pair sums, and VNNI's vpdpwssd multiplies them by the sub-blocks'
// integer scales (16-bit words placed by vpermw) and accumulates in int32, two accumulators per
// token to halve the dependency chain. Why not vpdpbusd: the scale of a sub-block must be applied
// before its sums mix with other sub-blocks', which after vpdpbusd costs a vpmulld (2 uops) per
// vector; vpmaddubsw + vpdpwssd is 2 uops with the scale included. The offsets (Q4_K/Q5_K mins,
// Q6_K's -32) go through Q8_K's bsums as in the AVX2 variant; each block ends with one F32
// multiply-add of d_w * d_x per token into 16 lanes, added once per row.
//
// Unpacking: Q4_K's 32 bytes of chunk c hold sub-block 2c in the low nibbles and 2c+1 in the high
// ones; a 256-bit broadcast load and one vpsrlvq (0 bits in the low half, 4 in the high half)
// lay out 64 consecutive weights. Q6_K's 64 ql bytes hold 64 consecutive low nibbles and the 64
// next weights' high nibbles; the two high bits come from a broadcast of 32 qh bytes shifted per
// half (vpsllvq / vpsrlvq). Q8_0 and Q5_0: quant_gemv_q8_0_impl.h.

// GCC 12 reports its own _mm*_undefined_*() helpers as uninitialized (GCC bug 105593).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "common/kernels/cpu/quant_gemv.h"
#include "common/kernels/cpu/quant_gemv_internal.h"

#define HMOE_Q512_INLINE inline __attribute__((always_inline))
#define HMOE_UNROLL _Pragma("GCC unroll 16")

namespace hmoe::cpu::internal {
namespace {

constexpr int64_t kPrefetchBytes = 1024;

HMOE_Q512_INLINE float Half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

HMOE_Q512_INLINE __m256i Load256(const void* p) {
  return _mm256_loadu_si256(static_cast<const __m256i*>(p));
}
HMOE_Q512_INLINE __m512i Load512(const void* p) { return _mm512_loadu_si512(p); }
// 32 bytes in both halves of a zmm.
HMOE_Q512_INLINE __m512i Broadcast256(const void* p) { return _mm512_broadcast_i64x4(Load256(p)); }

HMOE_Q512_INLINE void Prefetch(const uint8_t* p) {
  _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0);
}

// The 6-bit scales and mins of a Q4_K / Q5_K block (MODEL-SPEC 5.4, as in quant_gemv_avx2.cc) as
// 16 bytes: sc0-3, m0-3, sc4-7, m4-7. Bytes 0-3 of the packed scales hold sc0-3 and the top bits
// of sc4-7, bytes 4-7 m0-3 and the top bits of m4-7, bytes 8-11 the low nibbles of sc4-7 (low)
// and m4-7 (high). In 64-bit general registers: the empty asm keeps GCC from moving this into
// vector instructions, which compete with the dot products for the two AVX-512 ports.
HMOE_Q512_INLINE __m128i ScalesMinsK4(const uint8_t* s) {
  uint64_t u01;
  uint32_t u2;
  std::memcpy(&u01, s, 8);
  std::memcpy(&u2, s + 8, 4);
  uint64_t lo = u01 & 0x3f3f3f3f3f3f3f3fULL;
  uint64_t hi = ((uint64_t{u2} | (uint64_t{u2 >> 4} << 32)) & 0x0f0f0f0f0f0f0f0fULL) |
                (((u01 >> 6) & 0x0303030303030303ULL) << 4);
  asm("" : "+r"(lo), "+r"(hi));
  return _mm_set_epi64x(static_cast<int64_t>(hi), static_cast<int64_t>(lo));
}
// Word (or byte) index of sc_j in ScalesMinsK4's layout; m_j is at ScaleIndex(j) + 4.
constexpr int ScaleIndex(int j) { return j < 4 ? j : j + 4; }

// GF2P8AFFINEQB matrices (one per 64-bit lane): result bit i of a byte is the parity of
// (byte & matrix byte 7 - i). kLowNibble keeps bits 0-3, kHighNibble moves bits 4-7 to 0-3;
// Bits(a, b) moves bit a to bit 4 and (b >= 0) bit b to bit 5, clearing the rest.
constexpr int64_t kLowNibble = 0x0102040800000000LL;
constexpr int64_t kHighNibble = 0x1020408000000000LL;
constexpr int64_t Bits(int a, int b) {
  return (int64_t{1} << a) << 24 | (b >= 0 ? (int64_t{1} << b) << 16 : 0);
}
// A matrix for the low 256 bits and one for the high 256 bits.
HMOE_Q512_INLINE __m512i Halves(int64_t lo, int64_t hi) {
  return _mm512_set_epi64(hi, hi, hi, hi, lo, lo, lo, lo);
}

// Word indices for vpermw: words [0, 16) take `lo`, [16, 32) take `hi`.
HMOE_Q512_INLINE __m512i HalvesIndex(int lo, int hi) {
  return _mm512_inserti64x4(_mm512_set1_epi16(static_cast<int16_t>(lo)),
                            _mm256_set1_epi16(static_cast<int16_t>(hi)), 1);
}
// Word indices for vpermw: the 8 words of 128-bit lane k take first + k.
HMOE_Q512_INLINE __m512i LanesIndex(int first) {
  return _mm512_set_epi64(0x0001000100010001LL * (first + 3), 0x0001000100010001LL * (first + 3),
                          0x0001000100010001LL * (first + 2), 0x0001000100010001LL * (first + 2),
                          0x0001000100010001LL * (first + 1), 0x0001000100010001LL * (first + 1),
                          0x0001000100010001LL * first, 0x0001000100010001LL * first);
}

HMOE_Q512_INLINE __m512 CvtZext(__m256i v) { return _mm512_cvtepi32_ps(_mm512_zextsi256_si512(v)); }

// Q4_K (kHighBits = false) and Q5_K (true).
template <int N, bool kHighBits>
void RowsK4(const QuantMatrixView& w, const BlockQ8K* x, int64_t x_stride, int64_t m_begin,
            int64_t m_end, float* y, int64_t y_stride) {
  constexpr int64_t kBlockBytes = kHighBits ? 176 : 144;
  constexpr int64_t kQsOffset = kHighBits ? 48 : 16;
  const int64_t nb = w.cols / 256;
  // 32 bytes of chunk c broadcast to both halves: low nibbles (sub-block 2c) in the low half,
  // high nibbles (2c + 1) in the high half.
  const __m512i nibbles = Halves(kLowNibble, kHighNibble);
  // m_j twice each, for the pairs of bsums of sub-block j.
  const __m128i dup_mins = _mm_setr_epi8(4, 4, 5, 5, 6, 6, 7, 7, 12, 12, 13, 13, 14, 14, 15, 15);
  for (int64_t m = m_begin; m < m_end; ++m) {
    const uint8_t* row = w.data + m * w.row_stride;
    __m512 acc[N];
    HMOE_UNROLL for (int t = 0; t < N; ++t) acc[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = row + b * kBlockBytes;
      Prefetch(blk + kPrefetchBytes);
      Prefetch(blk + kPrefetchBytes + 64);
      Prefetch(blk + kPrefetchBytes + 128);
      const __m128i scm = ScalesMinsK4(blk + 4);
      const __m512i sc_words = _mm512_castsi256_si512(_mm256_cvtepu8_epi16(scm));
      const __m256i min_words = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(scm, dup_mins));
      __m512i qh;
      if constexpr (kHighBits) qh = Broadcast256(blk + 16);
      __m512i isum[N][2];
      HMOE_UNROLL for (int t = 0; t < N; ++t) {
        isum[t][0] = _mm512_setzero_si512();
        isum[t][1] = _mm512_setzero_si512();
      }
      HMOE_UNROLL for (int c = 0; c < 4; ++c) {
        // Weights 64c .. 64c + 63: sub-block 2c (low half), 2c + 1 (high half).
        __m512i q =
            _mm512_gf2p8affine_epi64_epi8(Broadcast256(blk + kQsOffset + 32 * c), nibbles, 0);
        if constexpr (kHighBits) {
          // Bit j of qh[l] is the fifth bit of weight l of sub-block j.
          q = _mm512_or_si512(q, _mm512_gf2p8affine_epi64_epi8(
                                     qh, Halves(Bits(2 * c, -1), Bits(2 * c + 1, -1)), 0));
        }
        const __m512i s = _mm512_permutexvar_epi16(
            HalvesIndex(ScaleIndex(2 * c), ScaleIndex(2 * c + 1)), sc_words);
        HMOE_UNROLL for (int t = 0; t < N; ++t) {
          const __m512i p = _mm512_maddubs_epi16(q, Load512(x[t * x_stride + b].qs + 64 * c));
          isum[t][c & 1] = _mm512_dpwssd_epi32(isum[t][c & 1], p, s);
        }
      }
      uint32_t d_dmin;
      std::memcpy(&d_dmin, blk, 4);
      const __m128 scales = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(d_dmin)));
      HMOE_UNROLL for (int t = 0; t < N; ++t) {
        const BlockQ8K& a = x[t * x_stride + b];
        const __m256i msum = _mm256_madd_epi16(min_words, Load256(a.bsums));
        const __m128 sd = _mm_mul_ps(scales, _mm_set1_ps(a.d));  // d * d_x, dmin * d_x
        acc[t] =
            _mm512_fmadd_ps(_mm512_broadcastss_ps(sd),
                            _mm512_cvtepi32_ps(_mm512_add_epi32(isum[t][0], isum[t][1])), acc[t]);
        acc[t] =
            _mm512_fnmadd_ps(_mm512_broadcastss_ps(_mm_movehdup_ps(sd)), CvtZext(msum), acc[t]);
      }
    }
    HMOE_UNROLL for (int t = 0; t < N; ++t) {
      y[t * y_stride + (m - m_begin)] = _mm512_reduce_add_ps(acc[t]);
    }
  }
}

template <int N>
void RowsQ6K(const QuantMatrixView& w, const BlockQ8K* x, int64_t x_stride, int64_t m_begin,
             int64_t m_end, float* y, int64_t y_stride) {
  const int64_t nb = w.cols / 256;
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  const __m512i high_nibble = _mm512_set1_epi64(kHighNibble);
  // qh bits 0-1 (low half) and 2-3 (high half) to bits 4-5; bits 4-5 and 6-7 likewise.
  const __m512i qh_lo = Halves(Bits(0, 1), Bits(2, 3));
  const __m512i qh_hi = Halves(Bits(4, 5), Bits(6, 7));
  for (int64_t m = m_begin; m < m_end; ++m) {
    const uint8_t* row = w.data + m * w.row_stride;
    __m512 acc[N];
    HMOE_UNROLL for (int t = 0; t < N; ++t) acc[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = row + b * 210;
      Prefetch(blk + kPrefetchBytes);
      Prefetch(blk + kPrefetchBytes + 64);
      Prefetch(blk + kPrefetchBytes + 128);
      Prefetch(blk + kPrefetchBytes + 192);
      const __m256i sc16 =
          _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192)));
      const __m512i sc_words = _mm512_castsi256_si512(sc16);
      __m512i isum[N][2];
      HMOE_UNROLL for (int t = 0; t < N; ++t) {
        isum[t][0] = _mm512_setzero_si512();
        isum[t][1] = _mm512_setzero_si512();
      }
      HMOE_UNROLL for (int n = 0; n < 2; ++n) {
        const __m512i ql = Load512(blk + 64 * n);
        const __m512i qh = Broadcast256(blk + 128 + 32 * n);
        __m512i q[2];
        // (ql & 0x0f) | high bits: vpternlogd 0xEA is (A & B) | C.
        q[0] =
            _mm512_ternarylogic_epi32(ql, low4, _mm512_gf2p8affine_epi64_epi8(qh, qh_lo, 0), 0xEA);
        q[1] = _mm512_or_si512(_mm512_gf2p8affine_epi64_epi8(ql, high_nibble, 0),
                               _mm512_gf2p8affine_epi64_epi8(qh, qh_hi, 0));
        HMOE_UNROLL for (int h = 0; h < 2; ++h) {
          // Weights 128n + 64h .. + 63: sub-blocks 8n + 4h + k in 128-bit lane k.
          const __m512i s = _mm512_permutexvar_epi16(LanesIndex(8 * n + 4 * h), sc_words);
          HMOE_UNROLL for (int t = 0; t < N; ++t) {
            const __m512i p =
                _mm512_maddubs_epi16(q[h], Load512(x[t * x_stride + b].qs + 128 * n + 64 * h));
            isum[t][h] = _mm512_dpwssd_epi32(isum[t][h], p, s);
          }
        }
      }
      const float d = Half(blk + 208);
      HMOE_UNROLL for (int t = 0; t < N; ++t) {
        const BlockQ8K& a = x[t * x_stride + b];
        // The quants are stored + 32: subtract 32 * sum_i sc_i * bsums_i.
        const __m256i offset = _mm256_slli_epi32(_mm256_madd_epi16(sc16, Load256(a.bsums)), 5);
        const __m512i total = _mm512_sub_epi32(_mm512_add_epi32(isum[t][0], isum[t][1]),
                                               _mm512_zextsi256_si512(offset));
        acc[t] = _mm512_fmadd_ps(_mm512_set1_ps(d * a.d), _mm512_cvtepi32_ps(total), acc[t]);
      }
    }
    HMOE_UNROLL for (int t = 0; t < N; ++t) {
      y[t * y_stride + (m - m_begin)] = _mm512_reduce_add_ps(acc[t]);
    }
  }
}

#define HMOE_QIMPL_INLINE HMOE_Q512_INLINE
#define HMOE_QIMPL_VNNI 1
#include "common/kernels/cpu/quant_gemv_q8_0_impl.h"

using RowsFn = void (*)(const QuantMatrixView&, const BlockQ8K*, int64_t, int64_t, int64_t, float*,
                        int64_t);

template <int N>
RowsFn RowsFor(uint32_t type) {
  switch (type) {
    case kGgmlQ4_K:
      return RowsK4<N, false>;
    case kGgmlQ5_K:
      return RowsK4<N, true>;
    case kGgmlQ6_K:
      return RowsQ6K<N>;
    case kGgmlQ8_0:
      return RowsQ8_0<N>;
    case kGgmlQ5_0:
      return RowsQ5_0<N>;
    default:
      return nullptr;
  }
}

class Avx512VnniQuantGemv final : public QuantGemv {
 public:
  CpuIsa isa() const override { return CpuIsa::kAvx512; }

  void MatVec(const QuantMatrixView& w, const BlockQ8K* x, int64_t x_stride, int n, int64_t m_begin,
              int64_t m_end, float* y, int64_t y_stride) const override {
    CheckQuantMatVecArgs(w, x_stride, n, m_begin, m_end);
    RowsFn fn = nullptr;
    switch (n) {
      case 1:
        fn = RowsFor<1>(w.type);
        break;
      case 2:
        fn = RowsFor<2>(w.type);
        break;
      case 3:
        fn = RowsFor<3>(w.type);
        break;
      case 4:
        fn = RowsFor<4>(w.type);
        break;
      case 5:
        fn = RowsFor<5>(w.type);
        break;
      case 6:
        fn = RowsFor<6>(w.type);
        break;
      case 7:
        fn = RowsFor<7>(w.type);
        break;
      default:
        fn = RowsFor<8>(w.type);
        break;
    }
    if (fn == nullptr) {
      ScalarQuantMatVec(w, x, x_stride, n, m_begin, m_end, y, y_stride);
      return;
    }
    fn(w, x, x_stride, m_begin, m_end, y, y_stride);
  }
};

}  // namespace

QuantGemv* NewAvx512VnniQuantGemv() { return new Avx512VnniQuantGemv(); }

}  // namespace hmoe::cpu::internal
