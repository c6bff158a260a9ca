// AVX2 variant of QuantGemv (Zen 3 and other CPUs without AVX-512). Compiled with -mavx2 -mfma
// -mf16c (this file only); reached only through the dispatcher after a CPU check. Keep
// standard-library templates out of this file (see fp8_gemv_avx512.cc).
//
// Per 32 weights (one ymm of unsigned quants: 4 bits for Q4_K, 5 for Q5_K, 6 for Q6_K) and a
// token: vpmaddubsw with the Q8_K quants gives 16 exact int16 pair sums (at most 2 * 63 * 127),
// vpmaddwd with the sub-block's integer scale broadcast in 16-bit words gives 8 exact int32 sums,
// added per block in int32. The offsets go through Q8_K's bsums: Q4_K/Q5_K's mins as
// vpmaddwd(mins, bsums) scaled by dmin, Q6_K's -32 as 32 * vpmaddwd(scales, bsums) subtracted in
// int32. Each block ends with one F32 multiply-add of d_w * d_x into 8 lanes per token; the lanes
// are added once per row. Q8_0 and Q5_0: quant_gemv_q8_0_impl.h.
//
// The quants of a block are unpacked once and used for every token of the call; the loops over
// tokens are unrolled for each count (template) so the accumulators stay in registers.

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

#define HMOE_QAVX2_INLINE inline __attribute__((always_inline))
#define HMOE_UNROLL _Pragma("GCC unroll 16")

namespace hmoe::cpu::internal {
namespace {

// Software prefetch distance (bytes ahead of the block being read; rows are contiguous, so this
// runs into the next rows).
constexpr int64_t kPrefetchBytes = 1024;

HMOE_QAVX2_INLINE float Half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

HMOE_QAVX2_INLINE float HorizontalSum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

HMOE_QAVX2_INLINE __m256i Load(const void* p) {
  return _mm256_loadu_si256(static_cast<const __m256i*>(p));
}

HMOE_QAVX2_INLINE void Prefetch(const uint8_t* p) {
  _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0);
}

// The 6-bit scales and mins of a Q4_K / Q5_K block (MODEL-SPEC 5.4) as 16 bytes: sc[0..7],
// m[0..7]. Bytes 0-3 hold sc0-3 and the top bits of sc4-7, bytes 4-7 m0-3 and the top bits of
// m4-7, bytes 8-11 the low nibbles of sc4-7 (low) and m4-7 (high). Computed in 64-bit general
// registers as sc0-3, m0-3, sc4-7, m4-7 (the empty asm keeps GCC from moving it into vector
// instructions, which compete with the dot products), then reordered by one vpshufb.
HMOE_QAVX2_INLINE __m128i ScalesMinsK4(const uint8_t* s) {
  uint64_t u01;
  uint32_t u2;
  std::memcpy(&u01, s, 8);
  std::memcpy(&u2, s + 8, 4);
  uint64_t lo = u01 & 0x3f3f3f3f3f3f3f3fULL;
  uint64_t hi = ((uint64_t{u2} | (uint64_t{u2 >> 4} << 32)) & 0x0f0f0f0f0f0f0f0fULL) |
                (((u01 >> 6) & 0x0303030303030303ULL) << 4);
  asm("" : "+r"(lo), "+r"(hi));
  return _mm_shuffle_epi8(_mm_set_epi64x(static_cast<int64_t>(hi), static_cast<int64_t>(lo)),
                          _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15));
}

// Q4_K (kHighBits = false) and Q5_K (true): 32 quants of sub-block j per ymm.
template <int N, bool kHighBits>
void RowsK4(const QuantMatrixView& w, const BlockQ8K* x, int64_t x_stride, int64_t m_begin,
            int64_t m_end, float* y, int64_t y_stride) {
  constexpr int64_t kBlockBytes = kHighBits ? 176 : 144;
  constexpr int64_t kQsOffset = kHighBits ? 48 : 16;
  const int64_t nb = w.cols / 256;
  const __m256i low4 = _mm256_set1_epi8(0x0f);
  const __m256i one = _mm256_set1_epi8(1);
  // Word j of the 8 scale words, in every word: bytes (2j, 2j + 1).
  const __m128i dup_mins =
      _mm_setr_epi8(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15);
  for (int64_t m = m_begin; m < m_end; ++m) {
    const uint8_t* row = w.data + m * w.row_stride;
    __m256 acc[N];
    HMOE_UNROLL for (int t = 0; t < N; ++t) acc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = row + b * kBlockBytes;
      Prefetch(blk + kPrefetchBytes);
      Prefetch(blk + kPrefetchBytes + 64);
      Prefetch(blk + kPrefetchBytes + 128);
      const __m128i scm = ScalesMinsK4(blk + 4);
      // sc0..sc7 as words in both lanes; mins duplicated per pair of bsums.
      const __m256i sc_words = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(scm));
      const __m256i min_words = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(scm, dup_mins));
      __m256i qh;
      if constexpr (kHighBits) qh = Load(blk + 16);
      __m256i isum[N];
      HMOE_UNROLL for (int t = 0; t < N; ++t) isum[t] = _mm256_setzero_si256();
      HMOE_UNROLL for (int c = 0; c < 4; ++c) {
        const __m256i q = Load(blk + kQsOffset + 32 * c);
        __m256i lo = _mm256_and_si256(q, low4);
        __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low4);
        if constexpr (kHighBits) {
          // Bit j of qh[l] is the fifth bit of weight l of sub-block j.
          const __m256i hq = _mm256_srli_epi16(qh, 2 * c);
          lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(hq, one), 4));
          hi = _mm256_or_si256(
              hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hq, 1), one), 4));
        }
        const __m256i s_lo = _mm256_shuffle_epi8(
            sc_words, _mm256_set1_epi16(static_cast<int16_t>(((4 * c + 1) << 8) | (4 * c))));
        const __m256i s_hi = _mm256_shuffle_epi8(
            sc_words, _mm256_set1_epi16(static_cast<int16_t>(((4 * c + 3) << 8) | (4 * c + 2))));
        HMOE_UNROLL for (int t = 0; t < N; ++t) {
          const int8_t* xq = x[t * x_stride + b].qs + 64 * c;
          const __m256i p_lo = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, Load(xq)), s_lo);
          const __m256i p_hi = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, Load(xq + 32)), s_hi);
          isum[t] = _mm256_add_epi32(isum[t], _mm256_add_epi32(p_lo, p_hi));
        }
      }
      const float d = Half(blk), dmin = Half(blk + 2);
      HMOE_UNROLL for (int t = 0; t < N; ++t) {
        const BlockQ8K& a = x[t * x_stride + b];
        const __m256i msum = _mm256_madd_epi16(min_words, Load(a.bsums));
        acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d * a.d), _mm256_cvtepi32_ps(isum[t]), acc[t]);
        acc[t] = _mm256_fnmadd_ps(_mm256_set1_ps(dmin * a.d), _mm256_cvtepi32_ps(msum), acc[t]);
      }
    }
    HMOE_UNROLL for (int t = 0; t < N; ++t) y[t * y_stride + (m - m_begin)] = HorizontalSum(acc[t]);
  }
}

// Q6_K: per half n of the block (128 weights), four ymm of 32 quants, each two sub-blocks of 16
// (low lane, high lane).
template <int N>
void RowsQ6K(const QuantMatrixView& w, const BlockQ8K* x, int64_t x_stride, int64_t m_begin,
             int64_t m_end, float* y, int64_t y_stride) {
  const int64_t nb = w.cols / 256;
  const __m256i low4 = _mm256_set1_epi8(0x0f);
  const __m256i bits45 = _mm256_set1_epi8(0x30);
  for (int64_t m = m_begin; m < m_end; ++m) {
    const uint8_t* row = w.data + m * w.row_stride;
    __m256 acc[N];
    HMOE_UNROLL for (int t = 0; t < N; ++t) acc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = row + b * 210;
      Prefetch(blk + kPrefetchBytes);
      Prefetch(blk + kPrefetchBytes + 64);
      Prefetch(blk + kPrefetchBytes + 128);
      Prefetch(blk + kPrefetchBytes + 192);
      const __m256i sc16 =
          _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192)));
      __m256i isum[N];
      HMOE_UNROLL for (int t = 0; t < N; ++t) isum[t] = _mm256_setzero_si256();
      HMOE_UNROLL for (int n = 0; n < 2; ++n) {
        // Scale words 8n..8n+7 in both lanes; pair k = sub-blocks 8n+2k (low lane), 8n+2k+1.
        // Two literal immediates: at -O0 (the ASan build) `n` is not folded into one.
        const __m256i sc_half = n == 0 ? _mm256_permute2x128_si256(sc16, sc16, 0x00)
                                       : _mm256_permute2x128_si256(sc16, sc16, 0x11);
        const __m256i ql0 = Load(blk + 64 * n);
        const __m256i ql1 = Load(blk + 64 * n + 32);
        const __m256i qh = Load(blk + 128 + 32 * n);
        __m256i q[4];
        q[0] = _mm256_or_si256(_mm256_and_si256(ql0, low4),
                               _mm256_and_si256(_mm256_slli_epi16(qh, 4), bits45));
        q[1] = _mm256_or_si256(_mm256_and_si256(ql1, low4),
                               _mm256_and_si256(_mm256_slli_epi16(qh, 2), bits45));
        q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), low4),
                               _mm256_and_si256(qh, bits45));
        q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), low4),
                               _mm256_and_si256(_mm256_srli_epi16(qh, 2), bits45));
        HMOE_UNROLL for (int k = 0; k < 4; ++k) {
          const __m256i s = _mm256_shuffle_epi8(
              sc_half, _mm256_set_m128i(
                           _mm_set1_epi16(static_cast<int16_t>(((4 * k + 3) << 8) | (4 * k + 2))),
                           _mm_set1_epi16(static_cast<int16_t>(((4 * k + 1) << 8) | (4 * k)))));
          HMOE_UNROLL for (int t = 0; t < N; ++t) {
            const int8_t* xq = x[t * x_stride + b].qs + 128 * n + 32 * k;
            isum[t] = _mm256_add_epi32(isum[t],
                                       _mm256_madd_epi16(_mm256_maddubs_epi16(q[k], Load(xq)), s));
          }
        }
      }
      const float d = Half(blk + 208);
      HMOE_UNROLL for (int t = 0; t < N; ++t) {
        const BlockQ8K& a = x[t * x_stride + b];
        // The quants are stored + 32: subtract 32 * sum_i sc_i * bsums_i.
        const __m256i offset = _mm256_slli_epi32(_mm256_madd_epi16(sc16, Load(a.bsums)), 5);
        acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d * a.d),
                                 _mm256_cvtepi32_ps(_mm256_sub_epi32(isum[t], offset)), acc[t]);
      }
    }
    HMOE_UNROLL for (int t = 0; t < N; ++t) y[t * y_stride + (m - m_begin)] = HorizontalSum(acc[t]);
  }
}

#define HMOE_QIMPL_INLINE HMOE_QAVX2_INLINE
#define HMOE_QIMPL_VNNI 0
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

// ---- GEMM for Q8_0 (QuantGemv::GemmRows)
// ---------------------------------------------------------
//
// RowsQ8_0's arithmetic per (row, token), so bitwise its result: per 32-weight block one ymm of 8
// exact int32 sums of 4 products each (|w| * sign(x, w): vpmaddubsw + vpmaddwd, or, where the CPU
// has AVX-VNNI, one vpdpbusd, the same sums: no pair sum of vpmaddubsw saturates), then
// acc += (d_w * d_x) * float(sums) in 8 lanes. For 8 tokens per weight block: |w| once, d_w * d_x
// one vector multiply for the 8 tokens, broadcast to the FMA from memory (inline asm: GCC
// otherwise broadcasts on the shuffle port); the tokens' activations tiled 32 blocks deep (8 KB,
// in L1 while 64 rows pass), the accumulators parked between tiles (blocks still in order).
constexpr int kGemmTokens = 8;
constexpr int64_t kGemmRows = 64;
constexpr int64_t kGemmBlocks = 32;  // Q8_0 blocks per tile (4 Q8_K blocks)

struct alignas(64) GemmQ8Tile {
  __m256 acc[kGemmRows * kGemmTokens];
  float dx[kGemmBlocks / 8 * kGemmTokens];  // d_x of token t of Q8_K block jb: dx[jb * 8 + t]
  int8_t xq[kGemmBlocks][kGemmTokens][32];  // token t's quants of block j (in the tile): xq[j][t]
};

HMOE_QAVX2_INLINE __m256 BroadcastFrom(const float* p) {
  __m256 r;
  asm("vbroadcastss %1, %0" : "=x"(r) : "m"(*p));
  return r;
}

#define HMOE_GEMM_Q8_0_BODY(DOT)                                                                \
  const __m256i ones = _mm256_set1_epi16(1);                                                    \
  (void)x;                                                                                      \
  (void)x_stride;                                                                               \
  (void)ones;                                                                                   \
  for (int64_t m = m_begin; m < m_end; ++m) {                                                   \
    const uint8_t* row = w.data + m * w.row_stride;                                             \
    __m256* acc_out = tile.acc + (m - m_begin) * kGemmTokens;                                   \
    __m256 acc[N];                                                                              \
    HMOE_UNROLL for (int t = 0; t < N; ++t) acc[t] = acc_out[t];                                \
    for (int64_t j = j0; j < j1; ++j) {                                                         \
      const uint8_t* blk = row + j * 34;                                                        \
      const __m256i q = Load(blk + 2);                                                          \
      const __m256i aq = _mm256_abs_epi8(q);                                                    \
      alignas(32) float sd[kGemmTokens];                                                        \
      _mm256_store_ps(sd, _mm256_mul_ps(_mm256_set1_ps(Half(blk)),                              \
                                        _mm256_load_ps(tile.dx + (j - j0) / 8 * kGemmTokens))); \
      HMOE_UNROLL for (int t = 0; t < N; ++t) {                                                 \
        const __m256i sx = _mm256_sign_epi8(Load(tile.xq[j - j0][t]), q);                       \
        const __m256i dot = DOT;                                                                \
        acc[t] = _mm256_fmadd_ps(BroadcastFrom(&sd[t]), _mm256_cvtepi32_ps(dot), acc[t]);       \
      }                                                                                         \
    }                                                                                           \
    HMOE_UNROLL for (int t = 0; t < N; ++t) acc_out[t] = acc[t];                                \
  }

template <int N>
void GemmQ8_0Rows(const QuantMatrixView& w, const BlockQ8K* x, int64_t x_stride, int64_t j0,
                  int64_t j1, int64_t m_begin, int64_t m_end, GemmQ8Tile& tile) {
  HMOE_GEMM_Q8_0_BODY(_mm256_madd_epi16(_mm256_maddubs_epi16(aq, sx), ones))
}

template <int N>
__attribute__((target("avxvnni"))) void GemmQ8_0RowsVnni(const QuantMatrixView& w,
                                                         const BlockQ8K* x, int64_t x_stride,
                                                         int64_t j0, int64_t j1, int64_t m_begin,
                                                         int64_t m_end, GemmQ8Tile& tile) {
  HMOE_GEMM_Q8_0_BODY(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), aq, sx))
}

#undef HMOE_GEMM_Q8_0_BODY

using GemmQ8RowsFn = void (*)(const QuantMatrixView&, const BlockQ8K*, int64_t, int64_t, int64_t,
                              int64_t, int64_t, GemmQ8Tile&);

template <int N>
GemmQ8RowsFn GemmQ8RowsFor(bool vnni) {
  return vnni ? GemmQ8_0RowsVnni<N> : GemmQ8_0Rows<N>;
}

GemmQ8RowsFn GemmQ8RowsForTokens(int n, bool vnni) {
  switch (n) {
    case 1:
      return GemmQ8RowsFor<1>(vnni);
    case 2:
      return GemmQ8RowsFor<2>(vnni);
    case 3:
      return GemmQ8RowsFor<3>(vnni);
    case 4:
      return GemmQ8RowsFor<4>(vnni);
    case 5:
      return GemmQ8RowsFor<5>(vnni);
    case 6:
      return GemmQ8RowsFor<6>(vnni);
    case 7:
      return GemmQ8RowsFor<7>(vnni);
    default:
      return GemmQ8RowsFor<8>(vnni);
  }
}

void GemmQ8_0(const QuantMatrixView& w, const BlockQ8K* x, int64_t x_stride, int64_t n,
              int64_t m_begin, int64_t m_end, float* y, int64_t y_stride, bool vnni) {
  const int64_t nb = w.cols / 32;
  GemmQ8Tile tile;
  for (int64_t r0 = m_begin; r0 < m_end; r0 += kGemmRows) {
    const int64_t r1 = r0 + kGemmRows < m_end ? r0 + kGemmRows : m_end;
    for (int64_t t0 = 0; t0 < n; t0 += kGemmTokens) {
      const int nt = static_cast<int>(n - t0 < kGemmTokens ? n - t0 : kGemmTokens);
      const BlockQ8K* xt = x + t0 * x_stride;
      const GemmQ8RowsFn fn = GemmQ8RowsForTokens(nt, vnni);
      for (int64_t i = 0; i < (r1 - r0) * kGemmTokens; ++i) tile.acc[i] = _mm256_setzero_ps();
      for (int64_t j0 = 0; j0 < nb; j0 += kGemmBlocks) {
        const int64_t j1 = j0 + kGemmBlocks < nb ? j0 + kGemmBlocks : nb;
        for (int64_t jb = j0 / 8; jb * 8 < j1; ++jb) {
          for (int t = 0; t < kGemmTokens; ++t) {
            tile.dx[(jb - j0 / 8) * kGemmTokens + t] = t < nt ? xt[t * x_stride + jb].d : 0.0f;
          }
        }
        for (int64_t j = j0; j < j1; ++j) {
          for (int t = 0; t < nt; ++t) {
            std::memcpy(tile.xq[j - j0][t], xt[t * x_stride + j / 8].qs + (j % 8) * 32, 32);
          }
        }
        fn(w, xt, x_stride, j0, j1, r0, r1, tile);
      }
      for (int t = 0; t < nt; ++t) {
        for (int64_t m = r0; m < r1; ++m) {
          y[(t0 + t) * y_stride + (m - m_begin)] =
              HorizontalSum(tile.acc[(m - r0) * kGemmTokens + t]);
        }
      }
    }
  }
}

class Avx2QuantGemv final : public QuantGemv {
 public:
  explicit Avx2QuantGemv(bool use_avx_vnni)
      : vnni_(use_avx_vnni && __builtin_cpu_supports("avxvnni")) {}
  CpuIsa isa() const override { return CpuIsa::kAvx2; }

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
    if (w.type != kGgmlQ8_0) return false;
    GemmQ8_0(w, x, x_stride, n, m_begin, m_end, y, y_stride, vnni_);
    return true;
  }

 private:
  const bool vnni_;  // the Q8_0 GEMM's dot products by AVX-VNNI vpdpbusd (same sums)
};

}  // namespace

QuantGemv* NewAvx2QuantGemv(bool use_avx_vnni) { return new Avx2QuantGemv(use_avx_vnni); }

}  // namespace hmoe::cpu::internal
