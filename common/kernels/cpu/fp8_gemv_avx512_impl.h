#pragma once

// The AVX-512 variants of Fp8Gemv, as templates included by exactly two files:
// fp8_gemv_avx512.cc (AVX-512 F/BW/VL/VBMI: F32 FMAs) and fp8_gemv_avx512bf16.cc (plus
// AVX512_BF16: vdpbf16ps). Each file compiles them with its own ISA flags into an anonymous
// namespace, so the two copies never meet at link time. Keep standard-library templates out of
// here: an inline function instantiated with AVX-512 flags could be the copy the linker keeps for
// the whole program.
//
// Expansion (both variants): per 64 weight bytes, two vpermi2b lookups give the low and the high
// byte of each weight's BF16 (tables indexed by the 7 magnitude bits), one vpternlogd adds the
// sign, and vpunpck{l,h}bw interleave the bytes into two vectors A and B of 32 BF16. Per 128-bit
// lane L they hold the weights 16L..16L+7 (A) and 16L+8..16L+15 (B). Pack stores the activation in
// that order, so no weight needs un-permuting:
// - BF16 variant: per 64 columns, 32 BF16 matching A then 32 matching B (128 bytes);
//   vdpbf16ps multiplies pairs and accumulates into F32.
// - F32 variant (CPUs without AVX512_BF16, e.g. Ice Lake): the BF16 words of A are split into the
//   even words (<< 16) and odd words (& 0xffff0000), both exact F32, and multiplied by F32
//   activations stored as [A even 16][A odd 16][B even 16][B odd 16] (256 bytes per 64 columns).
// Each 128-wide block of a row accumulates in F32 and is scaled once ("post-scaling").
//
// Tiles: up to 2 tokens, R rows (4; 8 for one token on the BF16 variant) run over all K with their
// accumulators in registers while the next R rows are prefetched row by row (Fp8GemvOptions;
// measurements in docs/PERFORMANCE.md). From 3 tokens on, WideTile keeps 16 rows' totals in L1 and
// walks K blocks outermost, so the activations stay in L1. Rows are never reordered: the
// checkpoint's row-major bytes are read in place.
//
// Before including, define HMOE_FP8_AVX512_BF16 to 0 or 1.

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

#ifndef HMOE_FP8_AVX512_BF16
#error "define HMOE_FP8_AVX512_BF16 before including fp8_gemv_avx512_impl.h"
#endif

#define HMOE_AVX512_INLINE inline __attribute__((always_inline))
// Fully unrolls the loops over a tile's rows and tokens, so the accumulator arrays live in zmm
// registers: without it GCC 12 keeps them on the stack and every vdpbf16ps waits for a
// store-to-load round trip (measured 3x slower on Zen 4, docs/PERFORMANCE.md).
#define HMOE_UNROLL _Pragma("GCC unroll 16")

namespace hmoe::cpu::internal {
namespace {

constexpr bool kBf16Dot = HMOE_FP8_AVX512_BF16 != 0;
constexpr int64_t kScaleBlock = 128;
constexpr int64_t kChunk = 64;  // weight bytes per vector
// Bytes of packed activation per 64 columns.
constexpr int64_t kPackedChunkBytes = kBf16Dot ? 128 : 256;

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

float Bf16ToFloat(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

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

struct Expander {
  __m512i lo0, lo1, hi0, hi1, sign, high_words;

  HMOE_AVX512_INLINE Expander()
      : lo0(_mm512_load_si512(kTables.lo)),
        lo1(_mm512_load_si512(kTables.lo + 64)),
        hi0(_mm512_load_si512(kTables.hi)),
        hi1(_mm512_load_si512(kTables.hi + 64)),
        sign(_mm512_set1_epi8(static_cast<char>(0x80))),
        high_words(_mm512_set1_epi32(static_cast<int>(0xffff0000u))) {}

  // 64 FP8 codes -> two vectors of 32 BF16 (see the file comment for the order).
  HMOE_AVX512_INLINE void Expand(__m512i w, __m512i* a, __m512i* b) const {
    // vpermi2b overwrites its index operand. Through the intrinsic GCC 12 reloads the weights from
    // memory for each use (three loads per vector). The empty asm makes `w` a value the compiler
    // cannot re-load, so the copies below become register moves.
    asm("" : "+v"(w));
    __m512i lo = w;
    __m512i hi = w;
    asm("vpermi2b %2, %1, %0" : "+v"(lo) : "v"(lo0), "v"(lo1));
    asm("vpermi2b %2, %1, %0" : "+v"(hi) : "v"(hi0), "v"(hi1));
    hi = _mm512_ternarylogic_epi32(hi, w, sign, 0xf8);  // hi | (w & sign)
    *a = _mm512_unpacklo_epi8(lo, hi);
    *b = _mm512_unpackhi_epi8(lo, hi);
  }

  // acc += dot(weights of `wv`, activations at x) for 32 BF16 weights; x is this half's packed
  // activation (64 bytes of BF16, or 128 bytes of F32 for the F32 variant).
  HMOE_AVX512_INLINE __m512 Dot(__m512 acc, __m512i wv, const std::byte* x) const {
#if HMOE_FP8_AVX512_BF16
    return _mm512_dpbf16_ps(acc, (__m512bh)wv, (__m512bh)_mm512_loadu_si512(x));
#else
    const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(wv, 16));
    const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(wv, high_words));
    acc = _mm512_fmadd_ps(even, _mm512_loadu_ps(reinterpret_cast<const float*>(x)), acc);
    return _mm512_fmadd_ps(odd, _mm512_loadu_ps(reinterpret_cast<const float*>(x) + 16), acc);
#endif
  }
};

struct TileArgs {
  const uint8_t* w;       // first row of the tile
  int64_t row_stride;     // bytes
  int64_t k;              // columns
  const float* scales;    // the tile's row of scale blocks
  const std::byte* x;     // packed activation of token 0
  int64_t x_stride;       // bytes between tokens
  float* y;               // output of (row 0, token 0)
  int64_t y_stride;       // floats between tokens
  const uint8_t* pf;      // where this tile's prefetch stream starts
  const uint8_t* pf_end;  // no prefetch at or beyond this address
  int64_t pf_step;        // prefetch stream advance per 64-column step
  int64_t pf_row;         // distance between the R lines prefetched per step
  int pf_hint;            // 0: prefetcht0, 1: prefetcht1, 2: prefetchnta
};

// Prefetches the cache line at `line` with instruction `hint` (0: prefetcht0, 1: prefetcht1,
// 2: prefetchnta).
HMOE_AVX512_INLINE void Prefetch(const uint8_t* line, int hint) {
  if (hint == 1) {
    _mm_prefetch(reinterpret_cast<const char*>(line), _MM_HINT_T1);
  } else if (hint == 0) {
    _mm_prefetch(reinterpret_cast<const char*>(line), _MM_HINT_T0);
  } else {
    _mm_prefetch(reinterpret_cast<const char*>(line), _MM_HINT_NTA);
  }
}

// One 64-column step of an R-row x N-token tile; kMasked loads only `mask`'s bytes.
template <int R, int N, bool kMasked>
HMOE_AVX512_INLINE void Step(const TileArgs& a, const Expander& ex, int64_t c, __mmask64 mask,
                             __m512 (&acc)[R][N]) {
  const std::byte* xc = a.x + c * kPackedChunkBytes;
  HMOE_UNROLL
  for (int r = 0; r < R; ++r) {
    const uint8_t* p = a.w + r * a.row_stride + c * kChunk;
    const __m512i w = kMasked ? _mm512_maskz_loadu_epi8(mask, p) : _mm512_loadu_si512(p);
    __m512i wa, wb;
    ex.Expand(w, &wa, &wb);
    HMOE_UNROLL
    for (int t = 0; t < N; ++t) {
      const std::byte* xt = xc + t * a.x_stride;
      acc[r][t] = ex.Dot(acc[r][t], wa, xt);
      acc[r][t] = ex.Dot(acc[r][t], wb, xt + kPackedChunkBytes / 2);
    }
  }
  // Prefetch of the next tile's rows: R lines per step keeps pace with the R rows (see MatVecN).
  if (a.pf_end == nullptr) return;  // prefetch off (or done by the caller)
  const uint8_t* pf = a.pf + c * a.pf_step;
  HMOE_UNROLL
  for (int r = 0; r < R; ++r) {
    const uint8_t* line = pf + r * a.pf_row;
    if (line < a.pf_end) Prefetch(line, a.pf_hint);
  }
}

// Sum of the 16 lanes. (_mm512_reduce_add_ps trips GCC 12's -Wuninitialized.)
HMOE_AVX512_INLINE float ReduceAdd(__m512 v) {
  v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0x4e));  // + the other 256-bit half
  v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0xb1));  // + the neighbouring 128-bit lane
  v = _mm512_add_ps(v, _mm512_permute_ps(v, 0x4e));        // + the other 64 bits of the lane
  v = _mm512_add_ps(v, _mm512_permute_ps(v, 0xb1));        // + the neighbouring float
  return _mm512_cvtss_f32(v);
}

template <int R, int N>
HMOE_AVX512_INLINE void ScaleInto(const __m512 (&blk)[R][N], float scale, __m512 (&total)[R][N]) {
  const __m512 s = _mm512_set1_ps(scale);
  HMOE_UNROLL
  for (int r = 0; r < R; ++r) {
    HMOE_UNROLL
    for (int t = 0; t < N; ++t) total[r][t] = _mm512_fmadd_ps(blk[r][t], s, total[r][t]);
  }
}

template <int R, int N>
HMOE_AVX512_INLINE void ZeroAcc(__m512 (&acc)[R][N]) {
  HMOE_UNROLL
  for (int r = 0; r < R; ++r) {
    HMOE_UNROLL
    for (int t = 0; t < N; ++t) acc[r][t] = _mm512_setzero_ps();
  }
}

// R rows x N tokens over all K columns.
template <int R, int N>
__attribute__((noinline)) void Tile(const TileArgs& a) {
  const Expander ex;
  __m512 total[R][N];
  __m512 blk[R][N];
  ZeroAcc(total);
  const int64_t full_blocks = a.k / kScaleBlock;
  for (int64_t kb = 0; kb < full_blocks; ++kb) {
    ZeroAcc(blk);
    Step<R, N, false>(a, ex, 2 * kb, 0, blk);
    Step<R, N, false>(a, ex, 2 * kb + 1, 0, blk);
    ScaleInto(blk, a.scales[kb], total);
  }
  const int64_t rest = a.k - full_blocks * kScaleBlock;  // 0..127 columns in a last block
  if (rest > 0) {
    ZeroAcc(blk);
    const int64_t c = 2 * full_blocks;
    if (rest >= kChunk) {
      Step<R, N, false>(a, ex, c, 0, blk);
      if (rest > kChunk) Step<R, N, true>(a, ex, c + 1, (1ull << (rest - kChunk)) - 1, blk);
    } else {
      Step<R, N, true>(a, ex, c, (1ull << rest) - 1, blk);
    }
    ScaleInto(blk, a.scales[full_blocks], total);
  }
  HMOE_UNROLL
  for (int r = 0; r < R; ++r) {
    HMOE_UNROLL
    for (int t = 0; t < N; ++t) a.y[t * a.y_stride + r] = ReduceAdd(total[r][t]);
  }
}

// Rows per tile for N tokens: R * N block accumulators plus as many totals must fit in 32 zmm
// registers next to the tables and the activation vectors. One token on the BF16 variant reads
// 8 rows side by side (8 demand streams plus the next tile's 8 prefetched ones): with 4, its
// shorter loop (one vdpbf16ps per 32 weights) left the memory idle between misses on Zen 5
// (cold expert GEMV at 0.73-0.80 of the best read vs 0.91-1.03 with 8; docs/PERFORMANCE.md).
// Per-row arithmetic does not depend on R, so results are bitwise the same.
template <int N>
constexpr int TileRows() {
  if constexpr (N == 1 && kBf16Dot) return 8;
  return N <= 2 ? 4 : (N <= 4 ? 2 : 1);
}

// From this many tokens on, the activations of all tokens (N * 28 KiB for K = 7168 in the F32
// layout) no longer fit in L1, and a row-by-row tile would re-read them from L2 for every row
// (the L2 traffic, not the weights, then bounds the speed). The wide tile instead walks
// 128-column blocks in the outer loop and kWideRows rows in the inner one, so each block of
// activations is read from L1 while the rows' weights stream past; the per-row totals live in
// an L1 buffer.
constexpr int kWideMinTokens = 3;
constexpr int kWideRows = 16;  // divides 128: a wide tile never crosses a scale block

template <int N>
__attribute__((noinline)) void WideTile(const TileArgs& a, int rows, int64_t pf_bytes) {
  const Expander ex;
  alignas(64) __m512 total[kWideRows][N];
  for (int r = 0; r < rows; ++r) {
    HMOE_UNROLL
    for (int t = 0; t < N; ++t) total[r][t] = _mm512_setzero_ps();
  }
  TileArgs row = a;
  row.pf_end = nullptr;  // this tile prefetches on its own below
  const int64_t blocks = (a.k + kScaleBlock - 1) / kScaleBlock;
  for (int64_t kb = 0; kb < blocks; ++kb) {
    const int64_t k0 = kb * kScaleBlock;
    const int64_t rest = a.k - k0 < kScaleBlock ? a.k - k0 : kScaleBlock;
    const __m512 s = _mm512_set1_ps(a.scales[kb]);
    for (int r = 0; r < rows; ++r) {
      row.w = a.w + r * a.row_stride;
      __m512 acc[1][N];
      ZeroAcc(acc);
      if (rest == kScaleBlock) {
        Step<1, N, false>(row, ex, 2 * kb, 0, acc);
        Step<1, N, false>(row, ex, 2 * kb + 1, 0, acc);
      } else if (rest > kChunk) {
        Step<1, N, false>(row, ex, 2 * kb, 0, acc);
        Step<1, N, true>(row, ex, 2 * kb + 1, (1ull << (rest - kChunk)) - 1, acc);
      } else if (rest == kChunk) {
        Step<1, N, false>(row, ex, 2 * kb, 0, acc);
      } else {
        Step<1, N, true>(row, ex, 2 * kb, (1ull << rest) - 1, acc);
      }
      HMOE_UNROLL
      for (int t = 0; t < N; ++t) total[r][t] = _mm512_fmadd_ps(acc[0][t], s, total[r][t]);
      // Each row is its own stream: prefetch it pf_bytes ahead, continuing into the same row of
      // the next wide tile past the end of this one.
      if (a.pf_end != nullptr) {
        const int64_t col = k0 + pf_bytes;
        const uint8_t* line =
            col < a.k ? row.w + col : row.w + kWideRows * a.row_stride + (col - a.k);
        if (line < a.pf_end) Prefetch(line, a.pf_hint);
        if (line + kChunk < a.pf_end) Prefetch(line + kChunk, a.pf_hint);
      }
    }
  }
  for (int r = 0; r < rows; ++r) {
    HMOE_UNROLL
    for (int t = 0; t < N; ++t) a.y[t * a.y_stride + r] = ReduceAdd(total[r][t]);
  }
}

template <int N>
void MatVecN(const Fp8MatrixView& w, const std::byte* x, int64_t x_stride, int64_t m_begin,
             int64_t m_end, float* y, int64_t y_stride, int64_t prefetch_bytes,
             const Fp8GemvOptions& options) {
  constexpr int R = TileRows<N>();
  TileArgs a{};
  a.row_stride = w.row_stride;
  a.k = w.cols;
  a.x = x;
  a.x_stride = x_stride;
  a.y_stride = y_stride;
  a.pf_end = options.prefetch ? w.data + m_end * w.row_stride : nullptr;
  // While a tile of R rows is read, prefetch the next tile: per step, each of its R rows at the
  // current column plus the distance (R more streams in flight, which a single core needs to
  // approach its bandwidth). Optionally, for dense rows, the next tile as one linear stream.
  const bool per_row = w.row_stride != w.cols || !options.prefetch_linear;
  a.pf_hint = options.prefetch_hint;
  if constexpr (N >= kWideMinTokens) {
    // Two 64-byte lines per row and step; the distance shrinks because 16 rows stream at once.
    const int64_t pf = (prefetch_bytes / 4 + kScaleBlock - 1) / kScaleBlock * kScaleBlock;
    for (int64_t m = m_begin; m < m_end;) {
      const int64_t block_end = (m / kScaleBlock + 1) * kScaleBlock;
      const int64_t tile_end = block_end < m_end ? block_end : m_end;
      const int rows = static_cast<int>(tile_end - m < kWideRows ? tile_end - m : kWideRows);
      a.scales = w.scale_inv + (m / kScaleBlock) * w.scale_stride;
      a.w = w.data + m * w.row_stride;
      a.y = y + (m - m_begin);
      WideTile<N>(a, rows, pf > 0 ? pf : kScaleBlock);
      m += rows;
    }
    return;
  }
  for (int64_t m = m_begin; m < m_end;) {
    const int64_t block_end = (m / kScaleBlock + 1) * kScaleBlock;
    const int64_t tile_end = block_end < m_end ? block_end : m_end;
    a.scales = w.scale_inv + (m / kScaleBlock) * w.scale_stride;
    for (; m + R <= tile_end; m += R) {
      a.w = w.data + m * w.row_stride;
      a.y = y + (m - m_begin);
      a.pf = a.w + R * w.row_stride + prefetch_bytes;
      a.pf_step = per_row ? kChunk : R * kChunk;
      a.pf_row = per_row ? w.row_stride : kChunk;
      Tile<R, N>(a);
    }
    for (; m < tile_end; ++m) {
      a.w = w.data + m * w.row_stride;
      a.y = y + (m - m_begin);
      a.pf = a.w + w.row_stride + prefetch_bytes;
      a.pf_step = kChunk;
      a.pf_row = kChunk;
      Tile<1, N>(a);
    }
  }
}

// Position of column j (0..63) of a chunk in the packed chunk, in elements of the packed type.
constexpr int64_t PackedPosition(int64_t j) {
  const int64_t lane = j / 16;
  const int64_t q = j % 16;
  const int64_t half = q < 8 ? 0 : 1;     // A or B
  const int64_t word = 8 * lane + q % 8;  // position within A or B (32 BF16)
  if constexpr (kBf16Dot) return 32 * half + word;
  // F32 variant: [even words 16][odd words 16] per half.
  return 32 * half + (word % 2) * 16 + word / 2;
}

class Avx512Fp8Gemv final : public Fp8Gemv {
 public:
  explicit Avx512Fp8Gemv(const Fp8GemvOptions& options) : options_(options) {}

  CpuIsa isa() const override { return kBf16Dot ? CpuIsa::kAvx512Bf16 : CpuIsa::kAvx512; }

  int64_t PackedBytes(int64_t k) const override {
    const int64_t bytes = (k + kChunk - 1) / kChunk * kPackedChunkBytes;
    // Pad to 4 * odd cache lines: then the packed tokens of a batch, read side by side, fall into
    // different L1 sets (a multiple of 4 KiB would put them all in the same few sets).
    int64_t lines = (bytes + 63) / 64;
    lines = (lines + 3) / 4 * 4;
    if (lines % 8 == 0) lines += 4;
    return lines * 64;
  }

  void Pack(const float* x, int64_t k, int64_t k_begin, int64_t k_end,
            std::byte* packed) const override {
    const int64_t padded_end = k_end == k ? (k + kChunk - 1) / kChunk * kChunk : k_end;
    int64_t i = k_begin;
#if HMOE_FP8_AVX512_BF16
    // Whole 64-column chunks: vcvtne2ps2bf16 (round to nearest even, like ToBf16; it flushes F32
    // subnormals to zero, which vdpbf16ps would do with their BF16 anyway), then two word
    // permutes into the A/B order of PackedPosition.
    {
      alignas(64) static constexpr uint16_t kIndexA[32] = {
          0,  1,  2,  3,  4,  5,  6,  7,  16, 17, 18, 19, 20, 21, 22, 23,
          32, 33, 34, 35, 36, 37, 38, 39, 48, 49, 50, 51, 52, 53, 54, 55};
      alignas(64) static constexpr uint16_t kIndexB[32] = {
          8,  9,  10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31,
          40, 41, 42, 43, 44, 45, 46, 47, 56, 57, 58, 59, 60, 61, 62, 63};
      const __m512i index_a = _mm512_load_si512(kIndexA);
      const __m512i index_b = _mm512_load_si512(kIndexB);
      for (; i + kChunk <= k_end; i += kChunk) {
        const float* xi = x + (i - k_begin);
        const __m512i p =
            (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(xi + 16), _mm512_loadu_ps(xi));
        const __m512i q =
            (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(xi + 48), _mm512_loadu_ps(xi + 32));
        std::byte* out = packed + i / kChunk * kPackedChunkBytes;
        _mm512_storeu_si512(out, _mm512_permutex2var_epi16(p, index_a, q));
        _mm512_storeu_si512(out + 64, _mm512_permutex2var_epi16(p, index_b, q));
      }
    }
#endif
    for (; i < padded_end; ++i) {
      const int64_t pos = (i - i % kChunk) + PackedPosition(i % kChunk);
      const uint16_t b = i < k_end ? ToBf16(x[i - k_begin]) : 0;
      if constexpr (kBf16Dot) {
        reinterpret_cast<uint16_t*>(packed)[pos] = b;
      } else {
        reinterpret_cast<float*>(packed)[pos] = Bf16ToFloat(b);
      }
    }
    if (k_end == k) {
      const int64_t used = padded_end / kChunk * kPackedChunkBytes;
      std::memset(packed + used, 0, PackedBytes(k) - used);
    }
  }

  void MatVec(const Fp8MatrixView& w, const std::byte* packed, int64_t packed_stride, int n,
              int64_t m_begin, int64_t m_end, float* y, int64_t y_stride) const override {
    const int64_t pf = options_.prefetch_bytes;
    switch (n) {
      case 1:
        return MatVecN<1>(w, packed, packed_stride, m_begin, m_end, y, y_stride, pf, options_);
      case 2:
        return MatVecN<2>(w, packed, packed_stride, m_begin, m_end, y, y_stride, pf, options_);
      case 3:
        return MatVecN<3>(w, packed, packed_stride, m_begin, m_end, y, y_stride, pf, options_);
      case 4:
        return MatVecN<4>(w, packed, packed_stride, m_begin, m_end, y, y_stride, pf, options_);
      case 5:
        return MatVecN<5>(w, packed, packed_stride, m_begin, m_end, y, y_stride, pf, options_);
      case 6:
        return MatVecN<6>(w, packed, packed_stride, m_begin, m_end, y, y_stride, pf, options_);
      case 7:
        return MatVecN<7>(w, packed, packed_stride, m_begin, m_end, y, y_stride, pf, options_);
      case 8:
        return MatVecN<8>(w, packed, packed_stride, m_begin, m_end, y, y_stride, pf, options_);
      default:
        __builtin_trap();  // the interface allows 1..kMaxMatVecTokens
    }
  }

 private:
  const Fp8GemvOptions options_;
};

}  // namespace
}  // namespace hmoe::cpu::internal

#undef HMOE_AVX512_INLINE
#undef HMOE_UNROLL
