// AMX-BF16 variant of Fp8Gemv (CpuIsa::kAmx): TDPBF16PS on FP8 weights expanded to BF16 tiles in
// L1 (the arithmetic and its batch invariance: fp8_amx_impl.h). Compiled with its own ISA flags
// (CMakeLists.txt); reached only through the dispatcher after a CPU (and OS permission) check.
#include "common/kernels/cpu/fp8_amx_impl.h"

namespace hmoe::cpu::internal {
namespace {

struct AmxGemvArgs {
  const uint8_t* w;       // first row of the tile
  int64_t row_stride;     // bytes
  int rows;               // valid rows of the tile (<= 16)
  int64_t k;              // columns
  const float* scales;    // the tile's row of scale blocks
  const std::byte* bx;    // B operand: the activations' dwords interleaved by token (4n bytes each)
  int n;                  // tokens
  float* y;               // output of (row 0, token 0)
  int64_t y_stride;       // floats between tokens
  const uint8_t* pf_end;  // no prefetch at or beyond this address (nullptr: prefetch off)
  int64_t pf_bytes;       // per-row prefetch distance
  int pf_hint;
  bool pf_next_tile;  // dense rows: prefetch the next tile as one linear stream instead
};

// Prefetches, for each row of the tile, the line pf_bytes past column `col`, continuing into the
// same row of the next tile past the end of the row.
HMOE_AMX_INLINE void PrefetchRows(const AmxGemvArgs& a, int64_t col) {
  if (a.pf_end == nullptr) return;
  if (a.pf_next_tile) {
    // 16 lines per 64-column step: over the tile's K / 64 steps, the 16 * K bytes of the next tile
    // (contiguous when row_stride == k).
    const uint8_t* base = a.w + kAmxRows * a.row_stride + col * kAmxRows;
    HMOE_AMX_UNROLL
    for (int r = 0; r < kAmxRows; ++r) {
      const uint8_t* line = base + r * 64;
      if (line < a.pf_end) Prefetch(line, a.pf_hint);
    }
    return;
  }
  const int64_t ahead = col + a.pf_bytes;
  const int64_t offset = ahead < a.k ? ahead : kAmxRows * a.row_stride + (ahead - a.k);
  HMOE_AMX_UNROLL
  for (int r = 0; r < kAmxRows; ++r) {
    const uint8_t* line = a.w + r * a.row_stride + offset;
    if (line < a.pf_end) Prefetch(line, a.pf_hint);
  }
}

// C (tmm0 for even blocks, tmm5 for odd ones) = the block sums of scale block kb.
template <int kOdd>
HMOE_AMX_INLINE void BlockSums(const AmxGemvArgs& a, const Expander& ex, int64_t kb,
                               std::byte* abuf) {
  const int64_t k0 = kb * kScaleBlock;
  const int64_t rest = a.k - k0 < kScaleBlock ? a.k - k0 : kScaleBlock;
  const int64_t b_half = kAmxRows * 4 * a.n;  // bytes of one B tile
  const int64_t b_stride = 4 * a.n;
  const std::byte* b0 = a.bx + (2 * kb) * 2 * b_half;  // chunk 2kb: halves A, B
  if constexpr (kOdd == 0) {
    HMOE_TILE_ZERO(0);
  } else {
    HMOE_TILE_ZERO(5);
  }
  // Chunk 0 of the block.
  if (rest >= kChunk) {
    ExpandChunk<false>(ex, a.w, a.row_stride, a.rows, k0, 0, abuf);
  } else {
    ExpandChunk<true>(ex, a.w, a.row_stride, a.rows, k0, ChunkMask(rest), abuf);
  }
  PrefetchRows(a, k0);
  HMOE_TILE_LOAD(1, abuf, kAmxHalfBytes);
  HMOE_TILE_LOAD(2, abuf + 1024, kAmxHalfBytes);
  HMOE_TILE_LOAD(3, b0, b_stride);
  HMOE_TILE_LOAD(4, b0 + b_half, b_stride);
  if constexpr (kOdd == 0) {
    HMOE_TILE_DP(0, 1, 3);
    HMOE_TILE_DP(0, 2, 4);
  } else {
    HMOE_TILE_DP(5, 1, 3);
    HMOE_TILE_DP(5, 2, 4);
  }
  if (rest <= kChunk) return;
  // Chunk 1.
  std::byte* abuf1 = abuf + 2048;
  if (rest == kScaleBlock) {
    ExpandChunk<false>(ex, a.w, a.row_stride, a.rows, k0 + kChunk, 0, abuf1);
  } else {
    ExpandChunk<true>(ex, a.w, a.row_stride, a.rows, k0 + kChunk, ChunkMask(rest - kChunk), abuf1);
  }
  PrefetchRows(a, k0 + kChunk);
  HMOE_TILE_LOAD(6, abuf1, kAmxHalfBytes);
  HMOE_TILE_LOAD(7, abuf1 + 1024, kAmxHalfBytes);
  HMOE_TILE_LOAD(3, b0 + 2 * b_half, b_stride);
  HMOE_TILE_LOAD(4, b0 + 3 * b_half, b_stride);
  if constexpr (kOdd == 0) {
    HMOE_TILE_DP(0, 6, 3);
    HMOE_TILE_DP(0, 7, 4);
  } else {
    HMOE_TILE_DP(5, 6, 3);
    HMOE_TILE_DP(5, 7, 4);
  }
}

// acc[r] = fma(C[r], scale, acc[r]) for the 16 rows (lanes >= n stay 0).
HMOE_AMX_INLINE void ScaleRows(const float* cbuf, float scale, __mmask16 nmask,
                               __m512 (&acc)[kAmxRows]) {
  const __m512 s = _mm512_set1_ps(scale);
  HMOE_AMX_UNROLL
  for (int r = 0; r < kAmxRows; ++r) {
    acc[r] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(nmask, cbuf + r * 16), s, acc[r]);
  }
}

// 16 (or fewer) rows x n tokens over all K.
__attribute__((noinline)) void AmxTile(const AmxGemvArgs& a, std::byte* abuf, float* cbuf) {
  const Expander ex;
  const __mmask16 nmask = static_cast<__mmask16>((1u << a.n) - 1);
  __m512 acc[kAmxRows];
  HMOE_AMX_UNROLL
  for (int r = 0; r < kAmxRows; ++r) acc[r] = _mm512_setzero_ps();
  const int64_t blocks = (a.k + kScaleBlock - 1) / kScaleBlock;
  int64_t kb = 0;
  for (; kb + 1 < blocks; kb += 2) {
    BlockSums<0>(a, ex, kb, abuf);
    HMOE_TILE_STORE(0, cbuf, 64);
    ScaleRows(cbuf, a.scales[kb], nmask, acc);
    BlockSums<1>(a, ex, kb + 1, abuf + 4096);
    HMOE_TILE_STORE(5, cbuf + 256, 64);
    ScaleRows(cbuf + 256, a.scales[kb + 1], nmask, acc);
  }
  if (kb < blocks) {
    BlockSums<0>(a, ex, kb, abuf);
    HMOE_TILE_STORE(0, cbuf, 64);
    ScaleRows(cbuf, a.scales[kb], nmask, acc);
  }
  alignas(64) float out[kAmxRows][16];
  HMOE_AMX_UNROLL
  for (int r = 0; r < kAmxRows; ++r) _mm512_store_ps(out[r], acc[r]);
  for (int t = 0; t < a.n; ++t) {
    for (int r = 0; r < a.rows; ++r) a.y[t * a.y_stride + r] = out[r][t];
  }
}

// dst[j * N + t] = dword j of token t's packed activation, for j < dwords.
template <int N>
void Interleave(const std::byte* packed, int64_t packed_stride, int64_t dwords, uint32_t* dst) {
  const uint32_t* src[N];
  for (int t = 0; t < N; ++t)
    src[t] = reinterpret_cast<const uint32_t*>(packed + t * packed_stride);
  for (int64_t j = 0; j < dwords; ++j) {
    HMOE_AMX_UNROLL
    for (int t = 0; t < N; ++t) dst[j * N + t] = src[t][j];
  }
}

class AmxFp8Gemv final : public Fp8Gemv {
 public:
  explicit AmxFp8Gemv(const Fp8GemvOptions& options) : options_(options), packer_(options) {}

  CpuIsa isa() const override { return CpuIsa::kAmx; }
  int64_t PackedBytes(int64_t k) const override { return packer_.PackedBytes(k); }
  void Pack(const float* x, int64_t k, int64_t k_begin, int64_t k_end,
            std::byte* packed) const override {
    packer_.Pack(x, k, k_begin, k_end, packed);
  }

  void MatVec(const Fp8MatrixView& w, const std::byte* packed, int64_t packed_stride, int n,
              int64_t m_begin, int64_t m_end, float* y, int64_t y_stride) const override {
    if (n < 1 || n > kMaxMatVecTokens) __builtin_trap();  // the interface allows 1..8
    if (m_begin >= m_end) return;
    // The B operand: for one token the packed activation itself (its dwords at stride 4); for
    // more, the tokens' dwords interleaved (stride 4n).
    const int64_t dwords = (w.cols + kChunk - 1) / kChunk * (kChunk / 2);
    const std::byte* bx = packed;
    if (n > 1) {
      uint32_t* dst = reinterpret_cast<uint32_t*>(AmxScratch(dwords * 4 * n));
      switch (n) {
        case 2:
          Interleave<2>(packed, packed_stride, dwords, dst);
          break;
        case 3:
          Interleave<3>(packed, packed_stride, dwords, dst);
          break;
        case 4:
          Interleave<4>(packed, packed_stride, dwords, dst);
          break;
        case 5:
          Interleave<5>(packed, packed_stride, dwords, dst);
          break;
        case 6:
          Interleave<6>(packed, packed_stride, dwords, dst);
          break;
        case 7:
          Interleave<7>(packed, packed_stride, dwords, dst);
          break;
        default:
          Interleave<8>(packed, packed_stride, dwords, dst);
          break;
      }
      bx = reinterpret_cast<const std::byte*>(dst);
    }
    AmxConfigure(n);
    alignas(64) std::byte abuf[8192];  // A tiles: 2 blocks x 2 chunks x 2 halves x 1 KiB
    alignas(64) float cbuf[2 * kAmxRows * 16];
    AmxGemvArgs a{};
    a.row_stride = w.row_stride;
    a.k = w.cols;
    a.bx = bx;
    a.n = n;
    a.y_stride = y_stride;
    a.pf_end = options_.prefetch ? w.data + m_end * w.row_stride : nullptr;
    // 16 rows stream at once: each row's distance is a quarter of the configured one (as the
    // AVX-512 wide tile), rounded to whole blocks.
    const int64_t pf = (options_.prefetch_bytes / 4 + kScaleBlock - 1) / kScaleBlock * kScaleBlock;
    a.pf_bytes = pf > 0 ? pf : kScaleBlock;
    a.pf_hint = options_.prefetch_hint;
    a.pf_next_tile = options_.prefetch_linear && w.row_stride == w.cols;
    for (int64_t m = m_begin; m < m_end;) {
      const int64_t block_end = (m / kScaleBlock + 1) * kScaleBlock;
      const int64_t tile_end = block_end < m_end ? block_end : m_end;
      a.rows = static_cast<int>(tile_end - m < kAmxRows ? tile_end - m : kAmxRows);
      a.scales = w.scale_inv + (m / kScaleBlock) * w.scale_stride;
      a.w = w.data + m * w.row_stride;
      a.y = y + (m - m_begin);
      AmxTile(a, abuf, cbuf);
      m += a.rows;
    }
  }

 private:
  const Fp8GemvOptions options_;
  const Avx512Fp8Gemv packer_;  // the avx512bf16 packing (its BF16 order is the A tiles' order)
};

}  // namespace

Fp8Gemv* NewAmxFp8Gemv(const Fp8GemvOptions& options) { return new AmxFp8Gemv(options); }

}  // namespace hmoe::cpu::internal
