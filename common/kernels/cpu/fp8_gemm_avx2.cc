// The avx2 variant of Fp8Gemm: a GEMV-exact kernel. Compiled with -mavx2 -mfma -mf16c (this file
// only, CMakeLists.txt); reached only through the dispatcher in fp8_gemm.cc after a CPU check. Keep
// standard-library templates out of this file (see fp8_gemv_avx512.cc).
//
// For every token it computes exactly the operations of the AVX2 Fp8Gemv (fp8_gemv_avx2.cc) in the
// same order, so results are bitwise the GEMV's and do not depend on the batch:
// - the activations are packed by the GEMV itself (F32 of the BF16-rounded value, per 32 columns
//   [even 0..14][odd 1..15][even 16..30][odd 17..31], zero past k);
// - per 32 weight codes the GEMV's integer shifts give the halves of the even and odd columns and
//   four vcvtph2ps give e0, o0, e1, o1 (each code's value times 2^-8); here they are computed once
//   per weight and stored as F32 in that order (the "expanded panel"), in the GEMV they are
//   recomputed for every group of <= 8 tokens;
// - per (row, token) and 128-column block: acc0 += e0 * x0, acc1 += o0 * x1, acc0 += e1 * x2,
//   acc1 += o1 * x3 per 32 columns, for exactly the GEMV's steps (a ragged last step runs on
//   zero-padded codes and activations, as in the GEMV); then total = fma(acc0 + acc1, scale * 256,
//   total); at the end the GEMV's 8-lane sum;
// - a row holding a NaN code (0x7F, 0xFF) gives the GEMV's NaN for every token: the codes are
//   checked while the panel is expanded (their shifted values are finite and end up overridden).
// What changes is the reuse. A panel of up to kPanelRows rows (inside one scale block) is expanded
// once, chunk by chunk when the first group of tokens reaches the chunk: chunk c (columns
// [c * kChunk, (c + 1) * kChunk)) holds the panel's rows kChunk floats apart, 12 KiB, in L1 while
// a group runs over it (with more than one group, every chunk is kept for the later groups: 32
// * kPanelRows bytes per column, from L2). For each group of up to kGroupTokens tokens the block
// totals (8 lanes per (row, token)) live in the scratch; chunk by chunk, every tile of kTokens
// tokens (its activations in L1, the next tile's prefetched) runs kRows x kTokens micro-kernels
// over the chunk's rows: 2 accumulators per (row, token) = 12 ymm registers, plus the kRows weight
// vectors and one activation vector. The totals go through memory once per block (the same FMA, on
// a loaded operand).

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
#include "common/kernels/cpu/fp8_gemm_internal.h"
#include "common/kernels/cpu/fp8_gemv.h"

#define HMOE_AVX2_INLINE inline __attribute__((always_inline))
// Fully unrolls the loops over a micro-tile's rows, tokens and vectors so the accumulators live in
// registers.
#define HMOE_UNROLL _Pragma("GCC unroll 16")

namespace hmoe::cpu::internal {
namespace {

constexpr int64_t kBlock = 128;  // scale block (rows and columns)
constexpr int64_t kStep = 32;    // columns per GEMV step (one load of codes)
constexpr int64_t kChunk = 128;  // columns per chunk (a multiple of kBlock)
constexpr int64_t kChunkBlocks = kChunk / kBlock;
constexpr int kPanelRows = 24;  // rows expanded at once (kPanelRows * kChunk * 4 B in L1)
constexpr int kRows = 2;        // rows per micro-tile
constexpr int kTokens = 3;      // tokens per micro-tile
constexpr int64_t kGroupTokens =
    96;  // tokens whose totals live in the scratch (multiple of kTokens)
constexpr int64_t kTotalFloats = 8;  // one ymm of block totals per (row, token)

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
int64_t Min(int64_t a, int64_t b) { return a < b ? a : b; }

int64_t PanelFloats(int64_t k) { return CeilDiv(k, kChunk) * kPanelRows * kChunk; }

// The GEMV's lane sum (same adds, same order).
HMOE_AVX2_INLINE float ReduceAdd(__m256 v) {
  const __m128 q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 h = _mm_add_ps(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

// Rows [0, rows) x columns [c0, c1) (c1 <= c0 + kChunk) of w, a matrix of k columns, into one chunk
// of the panel (row r, column c at out[r * kChunk + c - c0], the 32 columns of a step as e0 o0 e1
// o1, codes past k as zero). Returns a bit per row holding a NaN code in these columns.
uint32_t ExpandChunk(const uint8_t* w, int64_t row_stride, int rows, int64_t c0, int64_t c1,
                     int64_t k, float* out) {
  const __m256i half_mask = _mm256_set1_epi16(static_cast<short>(0xBF80));
  const __m256i high_bit = _mm256_set1_epi8(static_cast<char>(0x80));
  const __m256i all_ones = _mm256_set1_epi8(static_cast<char>(0xFF));
  uint32_t nan_rows = 0;
  for (int r = 0; r < rows; ++r) {
    const uint8_t* src = w + r * row_stride;
    __m256i nan_max = _mm256_setzero_si256();
    for (int64_t c = c0; c < c1; c += kStep) {
      __m256i codes;
      if (k - c >= kStep) {
        codes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + c));
      } else {
        alignas(32) uint8_t tail[kStep] = {};
        std::memcpy(tail, src + c, static_cast<size_t>(k - c));
        codes = _mm256_load_si256(reinterpret_cast<const __m256i*>(tail));
      }
      nan_max = _mm256_max_epu8(nan_max, _mm256_or_si256(codes, high_bit));
      const __m256i odd = _mm256_and_si256(_mm256_srai_epi16(codes, 1), half_mask);
      const __m256i even =
          _mm256_and_si256(_mm256_srai_epi16(_mm256_slli_epi16(codes, 8), 1), half_mask);
      float* dst = out + r * kChunk + (c - c0);
      _mm256_store_ps(dst, _mm256_cvtph_ps(_mm256_castsi256_si128(even)));
      _mm256_store_ps(dst + 8, _mm256_cvtph_ps(_mm256_castsi256_si128(odd)));
      _mm256_store_ps(dst + 16, _mm256_cvtph_ps(_mm256_extracti128_si256(even, 1)));
      _mm256_store_ps(dst + 24, _mm256_cvtph_ps(_mm256_extracti128_si256(odd, 1)));
    }
    if (_mm256_movemask_epi8(_mm256_cmpeq_epi8(nan_max, all_ones)) != 0) nan_rows |= 1u << r;
  }
  return nan_rows;
}

struct MicroArgs {
  const float* w;    // the micro-tile's first row at the chunk's first column (rows kChunk apart)
  const float* x;    // token 0's packed activation at the chunk's first column
  int64_t x_stride;  // floats between tokens
  float* totals;     // (row 0, token 0); rows kTotalFloats apart
  int64_t t_stride;  // floats between tokens' totals
  const float* scales;  // the scale of the chunk's first block
  int blocks;           // blocks of the chunk
  int last_steps;       // GEMV steps of the chunk's last block (1..4)
};

// R rows x T tokens over the blocks of one chunk.
template <int R, int T>
__attribute__((noinline)) void Micro(const MicroArgs& a) {
  for (int b = 0; b < a.blocks; ++b) {
    __m256 acc0[R][T], acc1[R][T];
    HMOE_UNROLL
    for (int r = 0; r < R; ++r) {
      HMOE_UNROLL
      for (int t = 0; t < T; ++t) acc0[r][t] = acc1[r][t] = _mm256_setzero_ps();
    }
    const float* wb = a.w + b * kBlock;
    const float* xb = a.x + b * kBlock;
    const int steps = b + 1 < a.blocks ? static_cast<int>(kBlock / kStep) : a.last_steps;
    for (int s = 0; s < steps; ++s) {
      HMOE_UNROLL
      for (int j = 0; j < 4; ++j) {  // e0 o0 e1 o1
        const int64_t off = s * kStep + j * 8;
        __m256 wv[R];
        HMOE_UNROLL
        for (int r = 0; r < R; ++r) wv[r] = _mm256_load_ps(wb + r * kChunk + off);
        HMOE_UNROLL
        for (int t = 0; t < T; ++t) {
          const __m256 xv = _mm256_loadu_ps(xb + t * a.x_stride + off);
          HMOE_UNROLL
          for (int r = 0; r < R; ++r) {
            if (j % 2 == 0) {
              acc0[r][t] = _mm256_fmadd_ps(wv[r], xv, acc0[r][t]);
            } else {
              acc1[r][t] = _mm256_fmadd_ps(wv[r], xv, acc1[r][t]);
            }
          }
        }
      }
    }
    const __m256 sc = _mm256_set1_ps(a.scales[b] * 256.0f);
    HMOE_UNROLL
    for (int r = 0; r < R; ++r) {
      HMOE_UNROLL
      for (int t = 0; t < T; ++t) {
        float* p = a.totals + t * a.t_stride + r * kTotalFloats;
        _mm256_store_ps(
            p, _mm256_fmadd_ps(_mm256_add_ps(acc0[r][t], acc1[r][t]), sc, _mm256_load_ps(p)));
      }
    }
  }
}

template <int R>
void MicroT(int tokens, const MicroArgs& a) {
  switch (tokens) {
    case 1:
      return Micro<R, 1>(a);
    case 2:
      return Micro<R, 2>(a);
    case 3:
      return Micro<R, 3>(a);
    default:
      __builtin_trap();
  }
}

// Prefetches lines [l0, l1) of the next token tile's activations (`lines` per token, from x).
HMOE_AVX2_INLINE void PrefetchX(const float* x, int64_t x_stride, int64_t tokens, int64_t lines,
                                int64_t l0, int64_t l1) {
  for (int64_t l = l0; l < l1; ++l) {
    const int64_t t = l / lines;
    if (t >= tokens) return;
    _mm_prefetch(reinterpret_cast<const char*>(x + t * x_stride + (l % lines) * 16), _MM_HINT_T0);
  }
}

// m tokens packed by the GEMV (x_stride floats apart) times rows [r_begin, r_end) of w.
void ExactRun(const Fp8MatrixView& w, const float* x, int64_t x_stride, int64_t m, int64_t r_begin,
              int64_t r_end, float* y, int64_t y_stride, std::byte* scratch) {
  const int64_t k = w.cols;
  const int64_t blocks = CeilDiv(k, kBlock);
  const int64_t chunks = CeilDiv(k, kChunk);
  const int last_steps = static_cast<int>(CeilDiv(k - (blocks - 1) * kBlock, kStep));
  float* panel = reinterpret_cast<float*>(scratch);
  float* totals = panel + PanelFloats(k);
  const int64_t t_stride = kPanelRows * kTotalFloats;
  MicroArgs a{};
  a.x_stride = x_stride;
  a.t_stride = t_stride;
  for (int64_t r0 = r_begin; r0 < r_end;) {
    int64_t r1 = (r0 / kBlock + 1) * kBlock;  // panels never cross a scale block
    r1 = Min(r1, Min(r_end, r0 + kPanelRows));
    const int rows = static_cast<int>(r1 - r0);
    uint32_t nan_rows = 0;
    const float* scales = w.scale_inv + (r0 / kBlock) * w.scale_stride;
    for (int64_t g0 = 0; g0 < m; g0 += kGroupTokens) {
      const int64_t g1 = Min(m, g0 + kGroupTokens);
      std::memset(totals, 0, static_cast<size_t>((g1 - g0) * t_stride) * sizeof(float));
      for (int64_t c = 0; c < chunks; ++c) {
        // Chunk c of the panel; a single group of tokens needs one chunk at a time.
        float* chunk_panel = panel + (m <= kGroupTokens ? 0 : c) * kPanelRows * kChunk;
        if (g0 == 0) {  // expanded when the first group reaches it, into L1
          nan_rows |= ExpandChunk(w.data + r0 * w.row_stride, w.row_stride, rows, c * kChunk,
                                  Min(k, (c + 1) * kChunk), k, chunk_panel);
        }
        a.blocks = static_cast<int>(Min(kChunkBlocks, blocks - c * kChunkBlocks));
        a.last_steps = c + 1 < chunks ? static_cast<int>(kBlock / kStep) : last_steps;
        a.scales = scales + c * kChunkBlocks;
        const int64_t lines = a.blocks * kBlock / 16;  // cache lines of a token's chunk
        for (int64_t t0 = g0; t0 < g1; t0 += kTokens) {
          const int tokens = static_cast<int>(Min(kTokens, g1 - t0));
          a.x = x + t0 * x_stride + c * kChunk;
          // The next token tile's chunk (or the next chunk's first tile) is prefetched across
          // this tile's micro-kernels.
          const float* next_x = nullptr;
          int64_t next_tokens = 0;
          if (t0 + kTokens < g1) {
            next_x = a.x + kTokens * x_stride;
            next_tokens = Min(kTokens, g1 - t0 - kTokens);
          } else if (c + 1 < chunks) {
            next_x = x + g0 * x_stride + (c + 1) * kChunk;
            next_tokens = Min(kTokens, g1 - g0);
          }
          const int64_t pf_lines = next_tokens * lines;
          const int tiles = (rows + kRows - 1) / kRows;
          int r = 0;
          for (int i = 0; r < rows; ++i) {
            if (next_x != nullptr) {
              PrefetchX(next_x, x_stride, next_tokens, lines, pf_lines * i / tiles,
                        pf_lines * (i + 1) / tiles);
            }
            a.w = chunk_panel + r * kChunk;
            a.totals = totals + (t0 - g0) * t_stride + r * kTotalFloats;
            if (rows - r >= kRows) {
              MicroT<kRows>(tokens, a);
              r += kRows;
            } else {
              MicroT<1>(tokens, a);
              r += 1;
            }
          }
        }
      }
      for (int64_t t = g0; t < g1; ++t) {
        float* out = y + t * y_stride + (r0 - r_begin);
        const float* tt = totals + (t - g0) * t_stride;
        for (int r = 0; r < rows; ++r) {
          out[r] = (nan_rows >> r & 1u) != 0 ? __builtin_nanf("")
                                             : ReduceAdd(_mm256_load_ps(tt + r * kTotalFloats));
        }
      }
    }
    r0 = r1;
  }
}

class Avx2Fp8Gemm final : public Fp8Gemm {
 public:
  // `gemv`: the AVX2 Fp8Gemv (packs the activations); not owned, outlives this object.
  explicit Avx2Fp8Gemm(const Fp8Gemv* gemv) : gemv_(gemv) {}

  CpuIsa isa() const override { return CpuIsa::kAvx2; }
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
    return (PanelFloats(k) + kGroupTokens * kPanelRows * kTotalFloats) * 4;
  }
  void Run(const Fp8MatrixView& w, const std::byte* packed, int64_t m, int64_t r_begin,
           int64_t r_end, float* y, int64_t y_stride, std::byte* scratch) const override {
    if (m <= 0 || r_begin >= r_end) return;
    ExactRun(w, reinterpret_cast<const float*>(packed), gemv_->PackedBytes(w.cols) / 4, m, r_begin,
             r_end, y, y_stride, scratch);
  }

 private:
  const Fp8Gemv* const gemv_;
};

}  // namespace

Fp8Gemm* NewAvx2Fp8Gemm(const Fp8Gemv* gemv) { return new Avx2Fp8Gemm(gemv); }

}  // namespace hmoe::cpu::internal

#undef HMOE_AVX2_INLINE
#undef HMOE_UNROLL
