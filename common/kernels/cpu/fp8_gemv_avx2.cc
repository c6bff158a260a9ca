// AVX2 + FMA + F16C variant of Fp8Gemv, for CPUs without AVX-512 (Zen 3 and older Intel cores).
// Compiled with -mavx2 -mfma -mf16c (this file only); reached only through the dispatcher after
// a CPU check. Keep standard-library templates out of this file (see fp8_gemv_avx512.cc).
//
// An E4M3 code shifted into an IEEE half is exactly the code's value times 2^-8: the 4-bit
// exponent lands in the low bits of the half's 5-bit exponent, whose bias is 8 larger, and E4M3
// subnormals become half subnormals. Per 32 weight bytes (one load) the conversion is integer
// work on 16-bit words, without byte shuffles: a word holds an even-column code in its low byte
// and an odd-column code in its high byte; (word >>arith 1) & 0xBF80 is the odd code's half,
// ((word << 8) >>arith 1) & 0xBF80 the even code's. Four vcvtph2ps give F32; the 2^8 is folded
// into the block scale; the dot products run in F32 FMAs against the BF16-rounded activation,
// which Pack stores (as F32) in the matching order: per 32 columns [even 0..14][odd 1..15]
// [even 16..30][odd 17..31]. Products are exact, so only the summation order differs from the
// reference: per (row, token) two accumulators (even and odd columns) per 128-column block, added
// and scaled at the block's end, the same whatever the tile's rows and tokens (a token's result
// does not depend on the other tokens of the call).
//
// Schedule: for one and two tokens PipelinedTile converts a 128-column block of the tile's rows
// to halves in a small L1 buffer (the even halves by vpmaddubsw: 128 * sext(code) equals
// (word << 8) >>arith 1) while the FMAs of the previous block read theirs with vcvtph2ps from
// memory (on Zen 5 the register form costs about twice the shift/shuffle-pipe time, and those pipes
// bounded the one-pass loop); from 3 tokens on Tile converts in registers. Both give the same
// FMAs per accumulator in the same order: bitwise the same results.
//
// NaN codes (0x7F, 0xFF) are not decoded in the inner loop: a tile ORs every code with 0x80 and
// keeps the byte-wise maximum; a maximum of 0xFF (rare: real checkpoints have no NaN) sends the
// tile's rows through a scalar scan that sets the rows holding one to NaN.
//
// Prefetch: while a tile of rows is read, every 64 columns prefetch the same columns of the next
// tile's rows `prefetch_bytes` ahead (row by row: R more streams in flight, what a single core
// needs to approach its bandwidth, as in the AVX-512 variants).

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
// Fully unrolls the loops over a tile's rows and tokens so the accumulators live in registers
// (GCC 12 at -O2 keeps them on the stack otherwise: measured 2x slower for 2 tokens).
#define HMOE_UNROLL _Pragma("GCC unroll 16")

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
constexpr int64_t kStep = 32;  // weight bytes per step (one load)

struct TileArgs {
  const uint8_t* w;
  int64_t row_stride;
  int64_t k;
  const float* scales;
  const float* x;
  int64_t x_stride;  // floats between tokens
  float* y;
  int64_t y_stride;
  const uint8_t* pf;      // the next tile's first row, plus the prefetch distance
  const uint8_t* pf_end;  // nullptr: no prefetch
};

struct Consts {
  __m256i half_mask = _mm256_set1_epi16(static_cast<short>(0xBF80));
  __m256i high_bit = _mm256_set1_epi8(static_cast<char>(0x80));
};

// acc0 += even columns * x, acc1 += odd columns * x for the 32 codes `c` at packed activation x.
template <int N>
HMOE_AVX2_INLINE void Dot32(__m256i c, const Consts& k, const float* x, int64_t x_stride,
                            __m256 (&acc0)[N], __m256 (&acc1)[N]) {
  const __m256i odd = _mm256_and_si256(_mm256_srai_epi16(c, 1), k.half_mask);
  const __m256i even = _mm256_and_si256(_mm256_srai_epi16(_mm256_slli_epi16(c, 8), 1), k.half_mask);
  const __m256 e0 = _mm256_cvtph_ps(_mm256_castsi256_si128(even));
  const __m256 o0 = _mm256_cvtph_ps(_mm256_castsi256_si128(odd));
  const __m256 e1 = _mm256_cvtph_ps(_mm256_extracti128_si256(even, 1));
  const __m256 o1 = _mm256_cvtph_ps(_mm256_extracti128_si256(odd, 1));
  HMOE_UNROLL
  for (int t = 0; t < N; ++t) {
    const float* xt = x + t * x_stride;
    acc0[t] = _mm256_fmadd_ps(e0, _mm256_loadu_ps(xt), acc0[t]);
    acc1[t] = _mm256_fmadd_ps(o0, _mm256_loadu_ps(xt + 8), acc1[t]);
    acc0[t] = _mm256_fmadd_ps(e1, _mm256_loadu_ps(xt + 16), acc0[t]);
    acc1[t] = _mm256_fmadd_ps(o1, _mm256_loadu_ps(xt + 24), acc1[t]);
  }
}

HMOE_AVX2_INLINE float ReduceAdd(__m256 v) {
  const __m128 q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 h = _mm_add_ps(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

// The 32 codes at p; fewer than 32 columns left (`left`): the rest are zero codes.
HMOE_AVX2_INLINE __m256i LoadCodes(const uint8_t* p, int64_t left) {
  if (left >= kStep) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  alignas(32) uint8_t tail[kStep] = {};
  std::memcpy(tail, p, static_cast<size_t>(left));
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(tail));
}

// vcvtph2ps with a memory operand (the compiler folds the load).
HMOE_AVX2_INLINE __m256 CvtHalves(const uint16_t* h) {
  return _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(h)));
}

// One line of each row of the next tile, at column c.
template <int R>
HMOE_AVX2_INLINE void PrefetchNext(const TileArgs& a, int64_t c) {
  HMOE_UNROLL
  for (int r = 0; r < R; ++r) {
    const uint8_t* line = a.pf + r * a.row_stride + c;
    if (line < a.pf_end) _mm_prefetch(reinterpret_cast<const char*>(line), _MM_HINT_T0);
  }
}

bool IsNanCode(uint8_t c) { return (c & 0x7f) == 0x7f; }

// A byte maximum of 0xFF over (code | 0x80): some row of the tile holds a NaN code; those rows'
// results become NaN.
template <int R, int N>
HMOE_AVX2_INLINE void FinishNan(const TileArgs& a, __m256i nan_max) {
  const __m256i all_ones = _mm256_cmpeq_epi8(nan_max, nan_max);
  if (_mm256_movemask_epi8(_mm256_cmpeq_epi8(nan_max, all_ones)) == 0) return;
  HMOE_UNROLL
  for (int r = 0; r < R; ++r) {
    const uint8_t* row = a.w + r * a.row_stride;
    bool nan = false;
    for (int64_t c = 0; c < a.k && !nan; ++c) nan = IsNanCode(row[c]);
    if (!nan) continue;
    HMOE_UNROLL
    for (int t = 0; t < N; ++t) a.y[t * a.y_stride + r] = __builtin_nanf("");
  }
}

// R rows x N tokens over all K columns, one step per 32 columns (kept as it was: the reference
// schedule, and the kernel for 3 or more tokens).
template <int R, int N>
__attribute__((noinline)) void Tile(const TileArgs& a) {
  const Consts k;
  __m256 total[R][N];
  HMOE_UNROLL
  for (int r = 0; r < R; ++r) {
    HMOE_UNROLL
    for (int t = 0; t < N; ++t) total[r][t] = _mm256_setzero_ps();
  }
  __m256i nan_max = _mm256_setzero_si256();
  for (int64_t k0 = 0; k0 < a.k; k0 += kScaleBlock) {
    const int64_t k1 = k0 + kScaleBlock < a.k ? k0 + kScaleBlock : a.k;
    __m256 acc0[R][N], acc1[R][N];
    HMOE_UNROLL
    for (int r = 0; r < R; ++r) {
      HMOE_UNROLL
      for (int t = 0; t < N; ++t) acc0[r][t] = acc1[r][t] = _mm256_setzero_ps();
    }
    for (int64_t c = k0; c < k1; c += kStep) {
      const float* x = a.x + c;
      HMOE_UNROLL
      for (int r = 0; r < R; ++r) {
        const uint8_t* p = a.w + r * a.row_stride + c;
        __m256i codes;
        if (k1 - c >= kStep) {
          codes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
        } else {
          alignas(32) uint8_t tail[kStep] = {};
          std::memcpy(tail, p, static_cast<size_t>(k1 - c));
          codes = _mm256_load_si256(reinterpret_cast<const __m256i*>(tail));
        }
        nan_max = _mm256_max_epu8(nan_max, _mm256_or_si256(codes, k.high_bit));
        Dot32<N>(codes, k, x, a.x_stride, acc0[r], acc1[r]);
      }
      // Every 64 columns, one line of each row of the next tile.
      if (a.pf_end != nullptr && ((c - k0) & 63) == 0) {
        HMOE_UNROLL
        for (int r = 0; r < R; ++r) {
          const uint8_t* line = a.pf + r * a.row_stride + c;
          if (line < a.pf_end) _mm_prefetch(reinterpret_cast<const char*>(line), _MM_HINT_T0);
        }
      }
    }
    const __m256 s = _mm256_set1_ps(a.scales[k0 / kScaleBlock] * 256.0f);
    HMOE_UNROLL
    for (int r = 0; r < R; ++r) {
      HMOE_UNROLL
      for (int t = 0; t < N; ++t) {
        total[r][t] = _mm256_fmadd_ps(_mm256_add_ps(acc0[r][t], acc1[r][t]), s, total[r][t]);
      }
    }
  }
  HMOE_UNROLL
  for (int r = 0; r < R; ++r) {
    HMOE_UNROLL
    for (int t = 0; t < N; ++t) a.y[t * a.y_stride + r] = ReduceAdd(total[r][t]);
  }
  FinishNan<R, N>(a, nan_max);
}

// Halves of columns [k0, k1) (one 128-column block or the last, shorter one) of the tile's R
// rows into out[r]: per 32 columns 16 even halves, then 16 odd halves. kFull: k1 - k0 == 128.
template <int R, bool kFull>
HMOE_AVX2_INLINE void ConvertBlock(const TileArgs& a, const Consts& k, int64_t k0, int64_t k1,
                                   uint16_t (*out)[kScaleBlock], __m256i& nan_max) {
  const __m256i even_times_128 = _mm256_set1_epi16(0x0080);  // bytes (128, 0)
  const int64_t steps = kFull ? kScaleBlock / kStep : (k1 - k0 + kStep - 1) / kStep;
  HMOE_UNROLL
  for (int64_t i = 0; i < steps; ++i) {
    const int64_t c = k0 + i * kStep;
    HMOE_UNROLL
    for (int r = 0; r < R; ++r) {
      const uint8_t* p = a.w + r * a.row_stride + c;
      const __m256i codes =
          kFull ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)) : LoadCodes(p, k1 - c);
      nan_max = _mm256_max_epu8(nan_max, _mm256_or_si256(codes, k.high_bit));
      // 128 * sext(even code) == (word << 8) >>arith 1: the low 7 bits are already zero.
      const __m256i even =
          _mm256_and_si256(_mm256_maddubs_epi16(even_times_128, codes), k.half_mask);
      const __m256i odd = _mm256_and_si256(_mm256_srai_epi16(codes, 1), k.half_mask);
      _mm256_store_si256(reinterpret_cast<__m256i*>(out[r] + i * kStep), even);
      _mm256_store_si256(reinterpret_cast<__m256i*>(out[r] + i * kStep + 16), odd);
    }
    // Every 64 columns, one line of each row of the next tile.
    if (a.pf_end != nullptr && (i & 1) == 0) PrefetchNext<R>(a, c);
  }
}

// acc0 / acc1 of the tile's rows and tokens over the block [k0, k1) whose halves are in `in`.
template <int R, int N, bool kFull>
HMOE_AVX2_INLINE void DotBlock(const TileArgs& a, int64_t k0, int64_t k1,
                               const uint16_t (*in)[kScaleBlock], __m256 (&acc0)[R][N],
                               __m256 (&acc1)[R][N]) {
  const int64_t steps = kFull ? kScaleBlock / kStep : (k1 - k0 + kStep - 1) / kStep;
  HMOE_UNROLL
  for (int64_t i = 0; i < steps; ++i) {
    const float* x = a.x + k0 + i * kStep;
    HMOE_UNROLL
    for (int r = 0; r < R; ++r) {
      const uint16_t* h = in[r] + i * kStep;
      const __m256 e0 = CvtHalves(h);
      const __m256 o0 = CvtHalves(h + 16);
      const __m256 e1 = CvtHalves(h + 8);
      const __m256 o1 = CvtHalves(h + 24);
      HMOE_UNROLL
      for (int t = 0; t < N; ++t) {
        const float* xt = x + t * a.x_stride;
        acc0[r][t] = _mm256_fmadd_ps(e0, _mm256_loadu_ps(xt), acc0[r][t]);
        acc1[r][t] = _mm256_fmadd_ps(o0, _mm256_loadu_ps(xt + 8), acc1[r][t]);
        acc0[r][t] = _mm256_fmadd_ps(e1, _mm256_loadu_ps(xt + 16), acc0[r][t]);
        acc1[r][t] = _mm256_fmadd_ps(o1, _mm256_loadu_ps(xt + 24), acc1[r][t]);
      }
    }
  }
}

// The same arithmetic as Tile<R, N>, scheduled in two passes per 128-column block, software
// pipelined: while the FMAs run over block b, the codes of block b + 1 are turned into halves and
// stored to a small L1 buffer, and the FMAs read their weights with vcvtph2ps from memory. On
// Zen 5 vcvtph2ps from a register costs about twice the shift/shuffle-pipe time of the memory
// form, and the one-pass loop was bound by those two pipes (~5.3 weight bytes per cycle from L1);
// here they see 4 conversions and one shift per 32 bytes (the even halves come from vpmaddubsw,
// on the multiply pipes), and 4 rows give the FMAs 8 independent chains. Each accumulator still
// receives exactly the FMAs of Tile<R, N>, in the same order: the results are bitwise Tile's.
// (Interleaving the two passes step by step instead of block by block measured slower on Zen 5:
// ~25.5 against ~27.5 GB/s from L2.)
template <int R, int N>
__attribute__((noinline)) void PipelinedTile(const TileArgs& a) {
  const Consts k;
  alignas(32) uint16_t halves[2][R][kScaleBlock];
  alignas(32) float total[R][N][8];
  HMOE_UNROLL
  for (int r = 0; r < R; ++r) {
    HMOE_UNROLL
    for (int t = 0; t < N; ++t) _mm256_store_ps(total[r][t], _mm256_setzero_ps());
  }
  __m256i nan_max = _mm256_setzero_si256();
  const int64_t full_end = a.k / kScaleBlock * kScaleBlock;  // end of the full blocks
  if (full_end > 0) {
    ConvertBlock<R, true>(a, k, 0, kScaleBlock, halves[0], nan_max);
  } else if (a.k > 0) {
    ConvertBlock<R, false>(a, k, 0, a.k, halves[0], nan_max);
  }
  int cur = 0;
  for (int64_t k0 = 0; k0 < a.k; k0 += kScaleBlock) {
    const int64_t k1 = k0 + kScaleBlock < a.k ? k0 + kScaleBlock : a.k;
    if (k1 < full_end) {
      ConvertBlock<R, true>(a, k, k1, k1 + kScaleBlock, halves[cur ^ 1], nan_max);
    } else if (k1 < a.k) {
      ConvertBlock<R, false>(a, k, k1, a.k, halves[cur ^ 1], nan_max);
    }
    __m256 acc0[R][N], acc1[R][N];
    HMOE_UNROLL
    for (int r = 0; r < R; ++r) {
      HMOE_UNROLL
      for (int t = 0; t < N; ++t) acc0[r][t] = acc1[r][t] = _mm256_setzero_ps();
    }
    if (k1 - k0 == kScaleBlock) {
      DotBlock<R, N, true>(a, k0, k1, halves[cur], acc0, acc1);
    } else {
      DotBlock<R, N, false>(a, k0, k1, halves[cur], acc0, acc1);
    }
    const __m256 s = _mm256_set1_ps(a.scales[k0 / kScaleBlock] * 256.0f);
    HMOE_UNROLL
    for (int r = 0; r < R; ++r) {
      HMOE_UNROLL
      for (int t = 0; t < N; ++t) {
        _mm256_store_ps(total[r][t], _mm256_fmadd_ps(_mm256_add_ps(acc0[r][t], acc1[r][t]), s,
                                                     _mm256_load_ps(total[r][t])));
      }
    }
    cur ^= 1;
  }
  HMOE_UNROLL
  for (int r = 0; r < R; ++r) {
    HMOE_UNROLL
    for (int t = 0; t < N; ++t) a.y[t * a.y_stride + r] = ReduceAdd(_mm256_load_ps(total[r][t]));
  }
  FinishNan<R, N>(a, nan_max);
}

template <int N>
void MatVecN(const Fp8MatrixView& w, const float* x, int64_t x_stride, int64_t m_begin,
             int64_t m_end, float* y, int64_t y_stride, int64_t prefetch_bytes) {
  // One or two tokens: the pipelined tile, 4 rows for one token (8 accumulators: enough
  // independent FMA chains), 2 for two. From 3 tokens on the FMAs bound the kernel, not the
  // conversion: one row per tile (2 x N block accumulators and N totals in 16 ymm registers).
  constexpr int R = N == 1 ? 4 : N == 2 ? 2 : 1;
  constexpr bool kPipelined = N <= 2;
  TileArgs a{};
  a.row_stride = w.row_stride;
  a.k = w.cols;
  a.x = x;
  a.x_stride = x_stride;
  a.y_stride = y_stride;
  a.pf_end = prefetch_bytes >= 0 ? w.data + m_end * w.row_stride : nullptr;
  const int64_t pf = prefetch_bytes > 0 ? prefetch_bytes : 0;
  for (int64_t m = m_begin; m < m_end;) {
    const int64_t block_end = (m / kScaleBlock + 1) * kScaleBlock;
    const int64_t tile_end = block_end < m_end ? block_end : m_end;
    a.scales = w.scale_inv + (m / kScaleBlock) * w.scale_stride;
    for (; m + R <= tile_end; m += R) {
      a.w = w.data + m * w.row_stride;
      a.y = y + (m - m_begin);
      a.pf = a.w + R * w.row_stride + pf;
      if constexpr (kPipelined) {
        PipelinedTile<R, N>(a);
      } else {
        Tile<R, N>(a);
      }
    }
    for (; m < tile_end; ++m) {
      a.w = w.data + m * w.row_stride;
      a.y = y + (m - m_begin);
      a.pf = a.w + w.row_stride + pf;
      if constexpr (kPipelined) {
        PipelinedTile<1, N>(a);
      } else {
        Tile<1, N>(a);
      }
    }
  }
}

// Position of column j (0..31) of a 32-column chunk in the packed activation.
constexpr int64_t PackedPosition(int64_t j) {
  const int64_t q = j % 16;
  return (j / 16) * 16 + (q % 2) * 8 + q / 2;
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
    // k_begin is a multiple of 64: whole 32-column chunks are permuted within themselves.
    for (int64_t i = k_begin; i < k_end; ++i) {
      out[i - i % 32 + PackedPosition(i % 32)] = FromBf16(ToBf16(x[i - k_begin]));
    }
    if (k_end == k) {
      const int64_t padded = (k + kPackGroup - 1) / kPackGroup * kPackGroup;
      for (int64_t i = k; i < padded; ++i) out[i - i % 32 + PackedPosition(i % 32)] = 0.0f;
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

#undef HMOE_AVX2_INLINE
#undef HMOE_UNROLL
