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

// ---- GEMM (many tokens; QuantGemv::GemmRows) ----------------------------------------------------
//
// The same arithmetic as RowsK4 / RowsQ6K per (row, token), so each token's result is bitwise the
// MatVec's: the int32 lanes are exact (one accumulator per token instead of two changes no lane's
// value), and the F32 operations per block (d_w * d_x rounded once, the lanes' conversion, the
// fused multiply-adds into 16 lanes in block order, the final _mm512_reduce_add_ps) are the same
// operations on the same values. What changes is the loop nest, so the work per token shrinks to
// the dot products and the epilogue:
// - a row's block is unpacked once (quants, scale words, mins) for kGemmTokens tokens;
// - the tokens' d_x of a tile of blocks are gathered once, so d_w * d_x is one vector multiply
//   per block for all tokens and reaches the FMA as a broadcast memory operand (no shuffle);
// - Q6_K's -32 offset starts the int32 accumulator (-32 * sc as int16 words, one vpmaddwd)
//   instead of a shift and a subtraction at the end;
// - the loops tile kGemmKBlocks blocks of kGemmTokens tokens' activations (18.7 KB: in L1 while
//   kGemmRows rows pass over them), the per-(row, token) accumulators wait in a buffer between
//   block tiles (the sums still run over the blocks in order).
// A float broadcast to 16 lanes by the load unit (vbroadcastss zmm, m32; asm, since GCC otherwise
// keeps the value in a register and broadcasts it on the shuffle port, which the unpacking and
// vpmaddubsw need).
HMOE_Q512_INLINE __m512 BroadcastFrom(const float* p) {
  __m512 r;
  asm("vbroadcastss %1, %0" : "=v"(r) : "m"(*p));
  return r;
}

constexpr int kGemmTokens = 8;
constexpr int64_t kGemmKBlocks = 8;
constexpr int64_t kGemmRows = 64;

// Per block tile: d_x of token t of block b at dx[b * kGemmTokens + t] (0 for absent tokens).
struct alignas(64) GemmTile {
  __m512 acc[kGemmRows * kGemmTokens];
  float dx[kGemmKBlocks * kGemmTokens];
  // The tile's activations, block-major: token t of block b at xt[b * kGemmTokens + t] (so a
  // token's block is a constant displacement from the block's pointer, no index arithmetic).
  BlockQ8K xt[kGemmKBlocks * kGemmTokens];
};

template <int N, bool kHighBits>
void GemmK4Rows(const QuantMatrixView& w, const BlockQ8K* x, int64_t x_stride, int64_t b0,
                int64_t b1, int64_t m_begin, int64_t m_end, GemmTile& tile) {
  constexpr int64_t kBlockBytes = kHighBits ? 176 : 144;
  constexpr int64_t kQsOffset = kHighBits ? 48 : 16;
  (void)x;  // the tile holds the activations
  (void)x_stride;
  const __m512i nibbles = Halves(kLowNibble, kHighNibble);
  const __m128i dup_mins = _mm_setr_epi8(4, 4, 5, 5, 6, 6, 7, 7, 12, 12, 13, 13, 14, 14, 15, 15);
  for (int64_t m = m_begin; m < m_end; ++m) {
    const uint8_t* row = w.data + m * w.row_stride;
    __m512* acc_out = tile.acc + (m - m_begin) * kGemmTokens;
    __m512 acc[N];
    HMOE_UNROLL for (int t = 0; t < N; ++t) acc[t] = acc_out[t];
    for (int64_t b = b0; b < b1; ++b) {
      const uint8_t* blk = row + b * kBlockBytes;
      const __m128i scm = ScalesMinsK4(blk + 4);
      const __m512i sc_words = _mm512_castsi256_si512(_mm256_cvtepu8_epi16(scm));
      const __m256i min_words = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(scm, dup_mins));
      __m512i qh;
      if constexpr (kHighBits) qh = Broadcast256(blk + 16);
      __m512i q[4], s[4];
      HMOE_UNROLL for (int c = 0; c < 4; ++c) {
        q[c] = _mm512_gf2p8affine_epi64_epi8(Broadcast256(blk + kQsOffset + 32 * c), nibbles, 0);
        if constexpr (kHighBits) {
          q[c] = _mm512_or_si512(q[c], _mm512_gf2p8affine_epi64_epi8(
                                           qh, Halves(Bits(2 * c, -1), Bits(2 * c + 1, -1)), 0));
        }
        s[c] = _mm512_permutexvar_epi16(HalvesIndex(ScaleIndex(2 * c), ScaleIndex(2 * c + 1)),
                                        sc_words);
      }
      uint32_t d_dmin;
      std::memcpy(&d_dmin, blk, 4);
      const __m128 scales = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(d_dmin)));
      const __m256 dxv = _mm256_load_ps(tile.dx + (b - b0) * kGemmTokens);
      alignas(32) float sd[kGemmTokens], smin[kGemmTokens];
      _mm256_store_ps(sd, _mm256_mul_ps(_mm256_broadcastss_ps(scales), dxv));
      _mm256_store_ps(smin, _mm256_mul_ps(_mm256_broadcastss_ps(_mm_movehdup_ps(scales)), dxv));
      const BlockQ8K* xb = tile.xt + (b - b0) * kGemmTokens;
      HMOE_UNROLL for (int t = 0; t < N; ++t) {
        const BlockQ8K& a = xb[t];
        __m512i isum = _mm512_dpwssd_epi32(_mm512_setzero_si512(),
                                           _mm512_maddubs_epi16(q[0], Load512(a.qs)), s[0]);
        HMOE_UNROLL for (int c = 1; c < 4; ++c) {
          isum =
              _mm512_dpwssd_epi32(isum, _mm512_maddubs_epi16(q[c], Load512(a.qs + 64 * c)), s[c]);
        }
        const __m256i msum = _mm256_madd_epi16(min_words, Load256(a.bsums));
        acc[t] = _mm512_fmadd_ps(BroadcastFrom(&sd[t]), _mm512_cvtepi32_ps(isum), acc[t]);
        acc[t] = _mm512_fnmadd_ps(BroadcastFrom(&smin[t]), CvtZext(msum), acc[t]);
      }
    }
    HMOE_UNROLL for (int t = 0; t < N; ++t) acc_out[t] = acc[t];
  }
}

template <int N>
void GemmQ6KRows(const QuantMatrixView& w, const BlockQ8K* x, int64_t x_stride, int64_t b0,
                 int64_t b1, int64_t m_begin, int64_t m_end, GemmTile& tile) {
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  const __m512i high_nibble = _mm512_set1_epi64(kHighNibble);
  const __m512i qh_lo = Halves(Bits(0, 1), Bits(2, 3));
  const __m512i qh_hi = Halves(Bits(4, 5), Bits(6, 7));
  (void)x;  // the tile holds the activations
  (void)x_stride;
  const __m256i minus32 = _mm256_set1_epi16(-32);
  for (int64_t m = m_begin; m < m_end; ++m) {
    const uint8_t* row = w.data + m * w.row_stride;
    __m512* acc_out = tile.acc + (m - m_begin) * kGemmTokens;
    __m512 acc[N];
    HMOE_UNROLL for (int t = 0; t < N; ++t) acc[t] = acc_out[t];
    for (int64_t b = b0; b < b1; ++b) {
      const uint8_t* blk = row + b * 210;
      const __m256i sc16 =
          _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192)));
      const __m512i sc_words = _mm512_castsi256_si512(sc16);
      // -32 * sc (|.| <= 4096): the offset of the stored quants, as the accumulator's start.
      const __m256i offset_words = _mm256_mullo_epi16(sc16, minus32);
      __m512i q[4], s[4];
      HMOE_UNROLL for (int n = 0; n < 2; ++n) {
        const __m512i ql = Load512(blk + 64 * n);
        const __m512i qh = Broadcast256(blk + 128 + 32 * n);
        q[2 * n] =
            _mm512_ternarylogic_epi32(ql, low4, _mm512_gf2p8affine_epi64_epi8(qh, qh_lo, 0), 0xEA);
        q[2 * n + 1] = _mm512_or_si512(_mm512_gf2p8affine_epi64_epi8(ql, high_nibble, 0),
                                       _mm512_gf2p8affine_epi64_epi8(qh, qh_hi, 0));
        HMOE_UNROLL for (int h = 0; h < 2; ++h) {
          s[2 * n + h] = _mm512_permutexvar_epi16(LanesIndex(8 * n + 4 * h), sc_words);
        }
      }
      const float d = Half(blk + 208);
      const __m256 dxv = _mm256_load_ps(tile.dx + (b - b0) * kGemmTokens);
      alignas(32) float sd[kGemmTokens];
      _mm256_store_ps(sd, _mm256_mul_ps(_mm256_set1_ps(d), dxv));
      const BlockQ8K* xb = tile.xt + (b - b0) * kGemmTokens;
      HMOE_UNROLL for (int t = 0; t < N; ++t) {
        const BlockQ8K& a = xb[t];
        __m512i isum = _mm512_zextsi256_si512(_mm256_madd_epi16(offset_words, Load256(a.bsums)));
        HMOE_UNROLL for (int c = 0; c < 4; ++c) {
          isum =
              _mm512_dpwssd_epi32(isum, _mm512_maddubs_epi16(q[c], Load512(a.qs + 64 * c)), s[c]);
        }
        acc[t] = _mm512_fmadd_ps(BroadcastFrom(&sd[t]), _mm512_cvtepi32_ps(isum), acc[t]);
      }
    }
    HMOE_UNROLL for (int t = 0; t < N; ++t) acc_out[t] = acc[t];
  }
}

// Q8_0: two rows per zmm (row m in the low 256 bits, m + 1 in the high ones), each half exactly
// RowsQ8_0's ymm for that row: the biased quants of both rows' blocks against the token's 32
// activations broadcast to both halves (vpdpbusd started from the token's -128 * activation sum
// in lanes 0 and 8, built once per token tile), the scale (d_m * d_x | d_m+1 * d_x) one multiply
// by the token's d_x from memory, one FMA. 4 operations per 64 multiply-adds instead of 3 per 32.
struct alignas(64) GemmQ8Tile {
  static constexpr int64_t kBlocks = 32;  // Q8_0 blocks (1024 columns) per tile
  __m512 acc[kGemmRows / 2 * kGemmTokens];
  __m512i init[kBlocks * kGemmTokens];
  // Token t's 32 activation quants of block j at xq[j][t], its d_x at dx[j][t] (j in the tile).
  int8_t xq[kBlocks][kGemmTokens][32];
  float dx[kBlocks][kGemmTokens];
};

template <int N>
void GemmQ8_0Rows(const QuantMatrixView& w, const BlockQ8K* x, int64_t x_stride, int64_t j0,
                  int64_t j1, int64_t m_begin, int64_t m_end, GemmQ8Tile& tile) {
  (void)x;  // the tile holds the activations
  (void)x_stride;
  const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t m = m_begin; m < m_end; m += 2) {
    const uint8_t* row_a = w.data + m * w.row_stride;
    const uint8_t* row_b = m + 1 < m_end ? row_a + w.row_stride : row_a;
    __m512* acc_out = tile.acc + (m - m_begin) / 2 * kGemmTokens;
    __m512 acc[N];
    HMOE_UNROLL for (int t = 0; t < N; ++t) acc[t] = acc_out[t];
    for (int64_t j = j0; j < j1; ++j) {
      const uint8_t* blk_a = row_a + j * 34;
      const uint8_t* blk_b = row_b + j * 34;
      const __m512i u = _mm512_xor_si512(
          _mm512_inserti64x4(_mm512_castsi256_si512(Load256(blk_a + 2)), Load256(blk_b + 2), 1),
          bias);
      const __m512 d =
          _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_set1_ps(Half(blk_a))),
                                              _mm256_castps_pd(_mm256_set1_ps(Half(blk_b))), 1));
      const __m512i* init = tile.init + (j - j0) * kGemmTokens;
      const int8_t(*xq)[32] = tile.xq[j - j0];
      const float* dx = tile.dx[j - j0];
      HMOE_UNROLL for (int t = 0; t < N; ++t) {
        const __m512i dot = _mm512_dpbusd_epi32(init[t], u, Broadcast256(xq[t]));
        acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(d, BroadcastFrom(&dx[t])), _mm512_cvtepi32_ps(dot),
                                 acc[t]);
      }
    }
    HMOE_UNROLL for (int t = 0; t < N; ++t) acc_out[t] = acc[t];
  }
}

using GemmQ8RowsFn = void (*)(const QuantMatrixView&, const BlockQ8K*, int64_t, int64_t, int64_t,
                              int64_t, int64_t, GemmQ8Tile&);

GemmQ8RowsFn GemmQ8RowsForTokens(int n) {
  switch (n) {
    case 1:
      return GemmQ8_0Rows<1>;
    case 2:
      return GemmQ8_0Rows<2>;
    case 3:
      return GemmQ8_0Rows<3>;
    case 4:
      return GemmQ8_0Rows<4>;
    case 5:
      return GemmQ8_0Rows<5>;
    case 6:
      return GemmQ8_0Rows<6>;
    case 7:
      return GemmQ8_0Rows<7>;
    default:
      return GemmQ8_0Rows<8>;
  }
}

HMOE_Q512_INLINE float HorizontalSum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

void GemmQ8_0(const QuantMatrixView& w, const BlockQ8K* x, int64_t x_stride, int64_t n,
              int64_t m_begin, int64_t m_end, float* y, int64_t y_stride) {
  const int64_t nb = w.cols / 32;
  GemmQ8Tile tile;
  for (int64_t r0 = m_begin; r0 < m_end; r0 += kGemmRows) {
    const int64_t r1 = r0 + kGemmRows < m_end ? r0 + kGemmRows : m_end;
    const int64_t pairs = (r1 - r0 + 1) / 2;
    for (int64_t t0 = 0; t0 < n; t0 += kGemmTokens) {
      const int nt = static_cast<int>(n - t0 < kGemmTokens ? n - t0 : kGemmTokens);
      const BlockQ8K* xt = x + t0 * x_stride;
      const GemmQ8RowsFn fn = GemmQ8RowsForTokens(nt);
      for (int64_t i = 0; i < pairs * kGemmTokens; ++i) tile.acc[i] = _mm512_setzero_ps();
      for (int64_t j0 = 0; j0 < nb; j0 += GemmQ8Tile::kBlocks) {
        const int64_t j1 = j0 + GemmQ8Tile::kBlocks < nb ? j0 + GemmQ8Tile::kBlocks : nb;
        for (int64_t j = j0; j < j1; ++j) {
          for (int t = 0; t < nt; ++t) {
            const BlockQ8K& a = xt[t * x_stride + j / 8];
            const int sum = -128 * (a.bsums[2 * (j % 8)] + a.bsums[2 * (j % 8) + 1]);
            tile.init[(j - j0) * kGemmTokens + t] =
                _mm512_maskz_set1_epi32(static_cast<__mmask16>(0x0101), sum);
            std::memcpy(tile.xq[j - j0][t], a.qs + (j % 8) * 32, 32);
            tile.dx[j - j0][t] = a.d;
          }
        }
        fn(w, xt, x_stride, j0, j1, r0, r1, tile);
      }
      for (int t = 0; t < nt; ++t) {
        for (int64_t m = r0; m < r1; ++m) {
          const __m512 acc = tile.acc[(m - r0) / 2 * kGemmTokens + t];
          const __m256 half =
              (m - r0) % 2 == 0
                  ? _mm512_castps512_ps256(acc)
                  : _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1));
          y[(t0 + t) * y_stride + (m - m_begin)] = HorizontalSum256(half);
        }
      }
    }
  }
}

using GemmRowsFn = void (*)(const QuantMatrixView&, const BlockQ8K*, int64_t, int64_t, int64_t,
                            int64_t, int64_t, GemmTile&);

template <int N>
GemmRowsFn GemmRowsFor(uint32_t type) {
  switch (type) {
    case kGgmlQ4_K:
      return GemmK4Rows<N, false>;
    case kGgmlQ5_K:
      return GemmK4Rows<N, true>;
    case kGgmlQ6_K:
      return GemmQ6KRows<N>;
    default:
      return nullptr;
  }
}

GemmRowsFn GemmRowsForTokens(uint32_t type, int n) {
  switch (n) {
    case 1:
      return GemmRowsFor<1>(type);
    case 2:
      return GemmRowsFor<2>(type);
    case 3:
      return GemmRowsFor<3>(type);
    case 4:
      return GemmRowsFor<4>(type);
    case 5:
      return GemmRowsFor<5>(type);
    case 6:
      return GemmRowsFor<6>(type);
    case 7:
      return GemmRowsFor<7>(type);
    default:
      return GemmRowsFor<8>(type);
  }
}

// Rows [m_begin, m_end) x n tokens of a Q4_K / Q5_K / Q6_K / Q8_0 weight; false for other types.
bool GemmK(const QuantMatrixView& w, const BlockQ8K* x, int64_t x_stride, int64_t n,
           int64_t m_begin, int64_t m_end, float* y, int64_t y_stride) {
  if (w.type == kGgmlQ8_0) {
    GemmQ8_0(w, x, x_stride, n, m_begin, m_end, y, y_stride);
    return true;
  }
  if (GemmRowsForTokens(w.type, kGemmTokens) == nullptr) return false;
  const int64_t nb = w.cols / 256;
  GemmTile tile;
  for (int64_t r0 = m_begin; r0 < m_end; r0 += kGemmRows) {
    const int64_t r1 = r0 + kGemmRows < m_end ? r0 + kGemmRows : m_end;
    for (int64_t t0 = 0; t0 < n; t0 += kGemmTokens) {
      const int nt = static_cast<int>(n - t0 < kGemmTokens ? n - t0 : kGemmTokens);
      const BlockQ8K* xt = x + t0 * x_stride;
      const GemmRowsFn fn = GemmRowsForTokens(w.type, nt);
      for (int64_t i = 0; i < (r1 - r0) * kGemmTokens; ++i) tile.acc[i] = _mm512_setzero_ps();
      for (int64_t b0 = 0; b0 < nb; b0 += kGemmKBlocks) {
        const int64_t b1 = b0 + kGemmKBlocks < nb ? b0 + kGemmKBlocks : nb;
        for (int64_t b = b0; b < b1; ++b) {
          for (int t = 0; t < kGemmTokens; ++t) {
            tile.dx[(b - b0) * kGemmTokens + t] = t < nt ? xt[t * x_stride + b].d : 0.0f;
            if (t < nt) {
              std::memcpy(&tile.xt[(b - b0) * kGemmTokens + t], &xt[t * x_stride + b],
                          sizeof(BlockQ8K));
            }
          }
        }
        fn(w, xt, x_stride, b0, b1, r0, r1, tile);
      }
      for (int t = 0; t < nt; ++t) {
        for (int64_t m = r0; m < r1; ++m) {
          y[(t0 + t) * y_stride + (m - m_begin)] =
              _mm512_reduce_add_ps(tile.acc[(m - r0) * kGemmTokens + t]);
        }
      }
    }
  }
  return true;
}

#define HMOE_QIMPL_INLINE HMOE_Q512_INLINE
#define HMOE_QIMPL_VNNI 1
#include "common/kernels/cpu/quant_gemv_q8_0_impl.h"

// Q8_0 GEMV in zmm: two rows per pass (row m in the low 256 bits, m + 1 in the high ones), each
// half exactly RowsQ8_0's ymm for its row (the same vpdpbusd on the biased quants from -128 * the
// block's activation sum in lane 0, the same d_w * d_x product and FMA per block, the same
// horizontal sum), so the result is bitwise RowsQ8_0's and GemmQ8_0's. The token's 32 activation
// quants are loaded once for both rows. While a pair runs, the next pair's rows are prefetched
// (prefetcht1, one per row per 34-byte block), a whole row of lookahead as in the FP8 GEMV: on
// the 2026-11-28 Sapphire Rapids measurement (docs/PERFORMANCE.md) it beat prefetcht0 of the
// next rows and prefetcht0 at 1, 2 or 4 KiB ahead in the same rows.
template <int N>
void RowsQ8_0Pairs(const QuantMatrixView& w, const BlockQ8K* x, int64_t x_stride, int64_t m_begin,
                   int64_t m_end, float* y, int64_t y_stride) {
  const int64_t nb = w.cols / 32;
  const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
  const __mmask16 lanes_0_8 = 0x0101;
  for (int64_t m = m_begin; m < m_end; m += 2) {
    const uint8_t* row_a = w.data + m * w.row_stride;
    const uint8_t* row_b = m + 1 < m_end ? row_a + w.row_stride : row_a;
    // The next pair (or, for the last pair, these rows again: the prefetches are then no-ops).
    const uint8_t* next_a = m + 2 < m_end ? row_a + 2 * w.row_stride : row_a;
    const uint8_t* next_b = m + 3 < m_end ? row_a + 3 * w.row_stride : next_a;
    __m512 acc[N];
    HMOE_UNROLL for (int t = 0; t < N; ++t) acc[t] = _mm512_setzero_ps();
    for (int64_t j = 0; j < nb; ++j) {
      const uint8_t* blk_a = row_a + j * 34;
      const uint8_t* blk_b = row_b + j * 34;
      _mm_prefetch(reinterpret_cast<const char*>(next_a + j * 34), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(next_b + j * 34), _MM_HINT_T1);
      const __m512i u = _mm512_xor_si512(
          _mm512_inserti64x4(_mm512_castsi256_si512(Load256(blk_a + 2)), Load256(blk_b + 2), 1),
          bias);
      const __m512 d =
          _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_set1_ps(Half(blk_a))),
                                              _mm256_castps_pd(_mm256_set1_ps(Half(blk_b))), 1));
      HMOE_UNROLL for (int t = 0; t < N; ++t) {
        const BlockQ8K& a = x[t * x_stride + j / 8];
        const int sum = -128 * (a.bsums[2 * (j % 8)] + a.bsums[2 * (j % 8) + 1]);
        const __m512i dot = _mm512_dpbusd_epi32(_mm512_maskz_set1_epi32(lanes_0_8, sum), u,
                                                Broadcast256(a.qs + (j % 8) * 32));
        acc[t] =
            _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(a.d)), _mm512_cvtepi32_ps(dot), acc[t]);
      }
    }
    HMOE_UNROLL for (int t = 0; t < N; ++t) {
      y[t * y_stride + (m - m_begin)] = HorizontalSumQ(_mm512_castps512_ps256(acc[t]));
      if (m + 1 < m_end) {
        y[t * y_stride + (m + 1 - m_begin)] =
            HorizontalSumQ(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[t]), 1)));
      }
    }
  }
}

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
      return RowsQ8_0Pairs<N>;
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

 protected:
  bool GemmBlock(const QuantMatrixView& w, const BlockQ8K* x, int64_t x_stride, int64_t n,
                 int64_t m_begin, int64_t m_end, float* y, int64_t y_stride) const override {
    return GemmK(w, x, x_stride, n, m_begin, m_end, y, y_stride);
  }
};

}  // namespace

QuantGemv* NewAvx512VnniQuantGemv() { return new Avx512VnniQuantGemv(); }

void QuantizeQ8KAvx512(const float* x, int64_t k, BlockQ8K* out) {
  const int64_t full = k / kQ8KBlockSize;
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
  for (int64_t b = 0; b < full; ++b) {
    const float* v = x + b * kQ8KBlockSize;
    __m512 amax = _mm512_setzero_ps();
    __mmask16 nan = 0;
    for (int i = 0; i < 16; ++i) {
      const __m512 xi = _mm512_loadu_ps(v + 16 * i);
      nan |= _mm512_cmp_ps_mask(xi, xi, _CMP_UNORD_Q);
      amax = _mm512_max_ps(amax, _mm512_abs_ps(xi));
    }
    const float m = _mm512_reduce_max_ps(amax);
    // NaN, infinity, zero and subnormal-amax blocks: the reference's special cases.
    if (nan != 0 || !(m >= 1e-30f && m <= 3.4028234663852886e38f)) {
      QuantizeQ8KReference(v, kQ8KBlockSize, out + b);
      continue;
    }
    BlockQ8K& blk = out[b];
    blk.d = m / 127.0f;
    const __m512 iscale = _mm512_set1_ps(127.0f / m);
    alignas(64) int32_t sums[16];
    for (int i = 0; i < 16; ++i) {
      // vcvtps2dq rounds half to even under the default MXCSR, as nearbyint does.
      __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(v + 16 * i), iscale));
      q = _mm512_min_epi32(_mm512_max_epi32(q, lo), hi);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(blk.qs + 16 * i), _mm512_cvtepi32_epi8(q));
      sums[i] = _mm512_reduce_add_epi32(q);
    }
    for (int j = 0; j < 16; ++j) blk.bsums[j] = static_cast<int16_t>(sums[j]);
  }
  if (full * kQ8KBlockSize < k) {
    QuantizeQ8KReference(x + full * kQ8KBlockSize, k - full * kQ8KBlockSize, out + full);
  }
}

}  // namespace hmoe::cpu::internal
