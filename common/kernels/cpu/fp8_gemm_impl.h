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

// Bytes between expanded rows: the blocks plus one cache line, so that the rows' lines spread over
// the L1 and L2 sets (an even number of lines, a power of two for k = 2048 or 16384, puts the
// rows of a panel into a few sets: measured 0.43 vs 0.6 of the peak for o_proj on Zen 5).
int64_t ExpandedRowBytes(int64_t k) { return CeilDiv(k, 128) * kExpBlockBytes + 64; }

// Rows [0, rows) x all k columns of w into out (row r, block kb at out + r * ExpandedRowBytes(k) +
// kb * kExpBlockBytes), BF16 in the GEMV's A/B order; chunks past k are zero.
void ExpandRowsAB(const uint8_t* w, int64_t row_stride, int rows, int64_t k, std::byte* out) {
  const __m512i lo0 = _mm512_load_si512(kTables.lo);
  const __m512i lo1 = _mm512_load_si512(kTables.lo + 64);
  const __m512i hi0 = _mm512_load_si512(kTables.hi);
  const __m512i hi1 = _mm512_load_si512(kTables.hi + 64);
  const __m512i sign = _mm512_set1_epi8(static_cast<char>(0x80));
  const int64_t chunks = CeilDiv(k, 128) * 2;
  for (int r = 0; r < rows; ++r) {
    const uint8_t* src = w + r * row_stride;
    std::byte* dst = out + r * ExpandedRowBytes(k);
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
  int64_t kb_begin;  // the blocks of this call: [kb_begin, kb_end)
  int64_t kb_end;
  float* totals;  // the running 16-lane totals of (row r, token t) at totals + (r * T + t) * 16
};

template <int R, int T>
__attribute__((noinline)) void ExactMicro(const ExactArgs& a) {
  __m512 total[R][T];
  HMOE_GEMM_UNROLL
  for (int r = 0; r < R; ++r) {
    HMOE_GEMM_UNROLL
    for (int t = 0; t < T; ++t) {
      total[r][t] =
          a.kb_begin == 0 ? _mm512_setzero_ps() : _mm512_load_ps(a.totals + (r * T + t) * 16);
    }
  }
#if HMOE_FP8_GEMM_VARIANT == 2
  const __m512i high_words = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
#endif
  for (int64_t kb = a.kb_begin; kb < a.kb_end; ++kb) {
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
  if (a.kb_end < a.blocks) {
    HMOE_GEMM_UNROLL
    for (int r = 0; r < R; ++r) {
      HMOE_GEMM_UNROLL
      for (int t = 0; t < T; ++t) _mm512_store_ps(a.totals + (r * T + t) * 16, total[r][t]);
    }
    return;
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

// Blocks (128 columns) per k chunk: a chunk of a token tile's activations (kExactTokens x 8 x
// kXBlockBytes, 8 KiB on avx512bf16) stays in L1 while every row group of the panel multiplies it.
// Measured (hmoe_gemm_bench, 1 thread, Zen 5, m = 512): without chunks expert_gate and q_a ran at
// 0.42 of the vdpbf16ps peak (4 tokens x 14 KiB of activations re-read from L2 by every row
// group), with 8 blocks 0.59-0.68, with 4 blocks 0.57-0.62, with 16 blocks 0.63-0.68.
constexpr int64_t kChunkBlocks = 8;

// Rows per expanded panel: at most 48 (16 micro-tiles) and about 1 MiB of expanded weights, so
// the panel stays in L2 while every token tile passes over it.
int64_t ExactPanelRows(int64_t k) {
  int64_t rows = (int64_t{1} << 20) / ExpandedRowBytes(k) / kExactRows * kExactRows;
  if (rows < kExactRows) rows = kExactRows;
  return rows > 48 ? 48 : rows;
}

// Bytes of a panel's running totals: 16 floats per (row, token of a tile).
int64_t TotalsBytes(int64_t k) { return ExactPanelRows(k) * kExactTokens * 64; }

// m tokens packed by the GEMV at x (x_stride bytes apart) times rows [r_begin, r_end) of w. Per
// panel and token tile, the k blocks are walked in chunks, each chunk by every row group of the
// panel in turn: the chunk's activations stay in L1 and only the expanded weights come from L2.
// The running totals of each (row, token) go through memory between chunks, which leaves every
// operation and its order as in the GEMV.
void ExactRun(const Fp8MatrixView& w, const std::byte* x, int64_t x_stride, int64_t m,
              int64_t r_begin, int64_t r_end, float* y, int64_t y_stride, std::byte* scratch) {
  const int64_t blocks = CeilDiv(w.cols, kBlock);
  const int64_t rest = w.cols - (blocks - 1) * kBlock;
  const int64_t panel = ExactPanelRows(w.cols);
  ExactArgs a{};
  a.w_row_bytes = ExpandedRowBytes(w.cols);
  a.x_stride = x_stride;
  a.blocks = blocks;
  a.last_has_two = rest > 64;
  a.y_stride = y_stride;
  float* totals = reinterpret_cast<float*>(scratch + panel * a.w_row_bytes);
  for (int64_t r0 = r_begin; r0 < r_end;) {
    int64_t r1 = (r0 / kBlock + 1) * kBlock;  // panels never cross a scale block
    if (r1 > r_end) r1 = r_end;
    if (r1 > r0 + panel) r1 = r0 + panel;
    const int rows = static_cast<int>(r1 - r0);
    ExpandRowsAB(w.data + r0 * w.row_stride, w.row_stride, rows, w.cols, scratch);
    a.scales = w.scale_inv + (r0 / kBlock) * w.scale_stride;
    // The next panel's FP8 rows are prefetched into L2 while this panel is multiplied, spread over
    // the micro-kernel calls (a burst would stall on the fill buffers): with few tokens (an
    // expert's ~16 in a prefill) reading the weights is a large part of the time.
    int64_t n1 = (r1 / kBlock + 1) * kBlock;
    if (n1 > r_end) n1 = r_end;
    if (n1 > r1 + panel) n1 = r1 + panel;
    const int64_t w_lines_per_row = CeilDiv(w.cols, 64);
    const int64_t w_lines = (n1 - r1) * w_lines_per_row;
    const int64_t calls =
        CeilDiv(m, kExactTokens) * CeilDiv(blocks, kChunkBlocks) * CeilDiv(rows, kExactRows);
    const int64_t w_per_call = CeilDiv(w_lines, calls);
    int64_t w_line = 0;
    const auto prefetch_weights = [&] {
      for (int64_t end = w_line + w_per_call < w_lines ? w_line + w_per_call : w_lines;
           w_line < end; ++w_line) {
        const uint8_t* p = w.data + (r1 + w_line / w_lines_per_row) * w.row_stride +
                           (w_line % w_lines_per_row) * 64;
        _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T1);
      }
    };
    for (int64_t t0 = 0; t0 < m; t0 += kExactTokens) {
      const int tokens = static_cast<int>(m - t0 < kExactTokens ? m - t0 : kExactTokens);
      a.x = x + t0 * x_stride;
      for (int64_t kb = 0; kb < blocks; kb += kChunkBlocks) {
        a.kb_begin = kb;
        a.kb_end = kb + kChunkBlocks < blocks ? kb + kChunkBlocks : blocks;
        // The next chunk's activations (this tile's next blocks, or the next tile's first ones)
        // are prefetched into L1 while this chunk is multiplied, a slice per row group: they come
        // from L3 or DRAM (a panel sees every token), and on demand they would arrive a line at a
        // time (measured, hmoe_gemm_bench, Zen 5, 1 thread, m = 512: o_proj, k = 16384, 0.41 ->
        // 0.48-0.50 of the peak; the shorter shapes are unchanged within the noise).
        const bool next_in_tile = a.kb_end < blocks;
        const int64_t next_t0 = next_in_tile ? t0 : t0 + kExactTokens;
        const int64_t next_tokens =
            next_t0 >= m ? 0 : (m - next_t0 < kExactTokens ? m - next_t0 : kExactTokens);
        const int64_t next_kb = next_in_tile ? a.kb_end : 0;
        const int64_t next_blocks =
            blocks - next_kb < kChunkBlocks ? blocks - next_kb : kChunkBlocks;
        const int64_t lines_per_token = next_blocks * kXBlockBytes / 64;
        const int64_t next_lines = next_tokens * lines_per_token;
        const int64_t groups = CeilDiv(rows, kExactRows);
        const int64_t per_group = CeilDiv(next_lines, groups);
        int64_t line = 0;
        const auto prefetch_slice = [&] {
          for (int64_t end = line + per_group < next_lines ? line + per_group : next_lines;
               line < end; ++line) {
            const int64_t t = line / lines_per_token;
            const std::byte* p = x + (next_t0 + t) * x_stride + next_kb * kXBlockBytes +
                                 (line % lines_per_token) * 64;
            _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0);
          }
        };
        int r = 0;
        for (; r + kExactRows <= rows; r += kExactRows) {
          prefetch_slice();
          prefetch_weights();
          a.w = scratch + r * a.w_row_bytes;
          a.y = y + t0 * y_stride + (r0 - r_begin) + r;
          a.totals = totals + r * kExactTokens * 16;
          ExactMicroT<kExactRows>(tokens, a);
        }
        for (; r < rows; ++r) {
          prefetch_slice();
          a.w = scratch + r * a.w_row_bytes;
          a.y = y + t0 * y_stride + (r0 - r_begin) + r;
          a.totals = totals + r * kExactTokens * 16;
          ExactMicroT<1>(tokens, a);
        }
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
    return ExactPanelRows(k) * ExpandedRowBytes(k) + TotalsBytes(k);
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
