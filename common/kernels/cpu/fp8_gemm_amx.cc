// AMX-BF16 variant of Fp8Gemm (CpuIsa::kAmx): every token sees exactly the tile operations of the
// amx Fp8Gemv (fp8_amx_impl.h), so the results are bitwise the GEMV's. Blocking: a panel of up to
// 128 rows (one scale block) and a slab of up to kSlabCols columns is expanded once into the
// scratch as A tiles (256 KiB, L2); every pair of 16-token tiles then runs over pairs of 16-row
// groups with 2 x 2 C tiles, and the scaled block sums accumulate in an F32 buffer per (token
// tile, row group) that persists across slabs. Activations are packed in AMX's VNNI layout: per
// tile of 16 tokens, row j (64 bytes) holds dword j of each token's avx512bf16 packing.
// Compiled with its own ISA flags (CMakeLists.txt); reached only through the dispatcher.
#include "common/kernels/cpu/fp8_amx_impl.h"
#include "common/kernels/cpu/fp8_gemm.h"
#include "common/kernels/cpu/fp8_gemm_internal.h"

namespace hmoe::cpu::internal {
namespace {

constexpr int kTokenTile = 16;
constexpr int64_t kPanelRows = 128;  // one scale block
constexpr int kPanelGroups = kPanelRows / kAmxRows;
constexpr int64_t kSlabCols = 1024;  // 8 scale blocks
constexpr int64_t kSlabChunks = kSlabCols / kChunk;
constexpr int64_t kChunkTileBytes = 2048;  // two A (or B) tiles: halves A and B of a chunk
constexpr int64_t kExpandedBytes = kPanelGroups * kSlabChunks * kChunkTileBytes;  // 256 KiB
constexpr int64_t kAccTileBytes = kAmxRows * 16 * 4;  // 16 rows x 16 tokens of F32

int64_t Dwords(int64_t k) { return (k + kChunk - 1) / kChunk * (kChunk / 2); }
// Bytes of one packed tile of 16 tokens.
int64_t TileBytes(int64_t k) { return Dwords(k) * 4 * kTokenTile; }

struct MicroArgs {
  const std::byte* a0;  // expanded A of row group g0 at the slab's first chunk
  const std::byte* a1;  // ... of g1
  const std::byte* b0;  // packed B of token tile t0 at the slab's first chunk
  const std::byte* b1;  // ... of t1
  float* acc[2][2];     // [g][t] accumulators (16 rows x 16 tokens)
  const float* scales;  // the panel's scale row at the slab's first block
  int64_t k_rest;       // columns of the slab
  float* cbuf;          // 4 C tiles
};

HMOE_AMX_INLINE void ScaleInto(const float* c, float scale, float* acc) {
  const __m512 s = _mm512_set1_ps(scale);
  HMOE_AMX_UNROLL
  for (int r = 0; r < kAmxRows; ++r) {
    _mm512_store_ps(acc + r * 16,
                    _mm512_fmadd_ps(_mm512_load_ps(c + r * 16), s, _mm512_load_ps(acc + r * 16)));
  }
}

// One chunk half: C(g, t) += A(g) * B(t) for the G x T tiles (tmm0 = (0,0), tmm1 = (0,1),
// tmm2 = (1,0), tmm3 = (1,1); A in tmm4/5, B in tmm6/7).
template <int G, int T>
HMOE_AMX_INLINE void HalfDots(const std::byte* a0, const std::byte* a1, const std::byte* b0,
                              const std::byte* b1) {
  HMOE_TILE_LOAD(4, a0, kAmxHalfBytes);
  HMOE_TILE_LOAD(6, b0, 64);
  if constexpr (T == 2) HMOE_TILE_LOAD(7, b1, 64);
  if constexpr (G == 2) HMOE_TILE_LOAD(5, a1, kAmxHalfBytes);
  HMOE_TILE_DP(0, 4, 6);
  if constexpr (T == 2) HMOE_TILE_DP(1, 4, 7);
  if constexpr (G == 2) HMOE_TILE_DP(2, 5, 6);
  if constexpr (G == 2 && T == 2) HMOE_TILE_DP(3, 5, 7);
}

template <int G, int T>
__attribute__((noinline)) void Micro(const MicroArgs& m) {
  const int64_t blocks = (m.k_rest + kScaleBlock - 1) / kScaleBlock;
  for (int64_t kb = 0; kb < blocks; ++kb) {
    const int64_t rest = m.k_rest - kb * kScaleBlock;
    const int chunks = rest > kChunk ? 2 : 1;
    HMOE_TILE_ZERO(0);
    if constexpr (T == 2) HMOE_TILE_ZERO(1);
    if constexpr (G == 2) HMOE_TILE_ZERO(2);
    if constexpr (G == 2 && T == 2) HMOE_TILE_ZERO(3);
    for (int c = 0; c < chunks; ++c) {
      const int64_t off = (2 * kb + c) * kChunkTileBytes;
      HalfDots<G, T>(m.a0 + off, m.a1 + off, m.b0 + off, m.b1 + off);
      HalfDots<G, T>(m.a0 + off + 1024, m.a1 + off + 1024, m.b0 + off + 1024, m.b1 + off + 1024);
    }
    const float s = m.scales[kb];
    HMOE_TILE_STORE(0, m.cbuf, 64);
    ScaleInto(m.cbuf, s, m.acc[0][0]);
    if constexpr (T == 2) {
      HMOE_TILE_STORE(1, m.cbuf + 256, 64);
      ScaleInto(m.cbuf + 256, s, m.acc[0][1]);
    }
    if constexpr (G == 2) {
      HMOE_TILE_STORE(2, m.cbuf + 512, 64);
      ScaleInto(m.cbuf + 512, s, m.acc[1][0]);
    }
    if constexpr (G == 2 && T == 2) {
      HMOE_TILE_STORE(3, m.cbuf + 768, 64);
      ScaleInto(m.cbuf + 768, s, m.acc[1][1]);
    }
  }
}

class AmxFp8Gemm final : public Fp8Gemm {
 public:
  // `gemv`: the amx Fp8Gemv (packs each token); not owned, outlives this object.
  explicit AmxFp8Gemm(const Fp8Gemv* gemv) : gemv_(gemv) {}

  CpuIsa isa() const override { return CpuIsa::kAmx; }
  int64_t TokenTile() const override { return kTokenTile; }
  int64_t PackedBytes(int64_t m, int64_t k) const override {
    return (m + kTokenTile - 1) / kTokenTile * TileBytes(k);
  }

  void Pack(const float* x, int64_t x_stride, int64_t m, int64_t k, int64_t t_begin, int64_t t_end,
            std::byte* packed) const override {
    const int64_t dwords = Dwords(k);
    uint32_t* one = reinterpret_cast<uint32_t*>(AmxScratch(gemv_->PackedBytes(k)));
    int64_t t = t_begin;
    for (; t < t_end; ++t) {
      gemv_->Pack(x + t * x_stride, k, 0, k, reinterpret_cast<std::byte*>(one));
      uint32_t* tile = reinterpret_cast<uint32_t*>(packed + t / kTokenTile * TileBytes(k));
      const int64_t lane = t % kTokenTile;
      for (int64_t j = 0; j < dwords; ++j) tile[j * kTokenTile + lane] = one[j];
    }
    if (t_end == m) {  // zero the rest of the last tile
      for (; t % kTokenTile != 0; ++t) {
        uint32_t* tile = reinterpret_cast<uint32_t*>(packed + t / kTokenTile * TileBytes(k));
        const int64_t lane = t % kTokenTile;
        for (int64_t j = 0; j < dwords; ++j) tile[j * kTokenTile + lane] = 0;
      }
    }
  }

  int64_t ScratchBytes(int64_t m, int64_t) const override {
    const int64_t tiles = (m + kTokenTile - 1) / kTokenTile;
    return kExpandedBytes + tiles * kPanelGroups * kAccTileBytes + 4 * kAccTileBytes;
  }

  void Run(const Fp8MatrixView& w, const std::byte* packed, int64_t m, int64_t r_begin,
           int64_t r_end, float* y, int64_t y_stride, std::byte* scratch) const override {
    if (m <= 0 || r_begin >= r_end) return;
    AmxConfigure(kGemmConfig);
    const int64_t tiles = (m + kTokenTile - 1) / kTokenTile;
    std::byte* expanded = scratch;
    float* acc = reinterpret_cast<float*>(scratch + kExpandedBytes);
    float* cbuf = acc + tiles * kPanelGroups * (kAccTileBytes / 4);
    const int64_t tile_bytes = TileBytes(w.cols);
    const Expander ex;
    for (int64_t r0 = r_begin; r0 < r_end;) {
      int64_t r1 = (r0 / kScaleBlock + 1) * kScaleBlock;  // panels never cross a scale block
      if (r1 > r_end) r1 = r_end;
      const int groups = static_cast<int>((r1 - r0 + kAmxRows - 1) / kAmxRows);
      std::memset(acc, 0, tiles * kPanelGroups * kAccTileBytes);
      const float* scales = w.scale_inv + (r0 / kScaleBlock) * w.scale_stride;
      for (int64_t c0 = 0; c0 < w.cols; c0 += kSlabCols) {
        const int64_t cols = w.cols - c0 < kSlabCols ? w.cols - c0 : kSlabCols;
        const int64_t chunks = (cols + kChunk - 1) / kChunk;
        // Expand the panel's slab: group g, chunk c at (g * kSlabChunks + c) * 2 KiB.
        for (int g = 0; g < groups; ++g) {
          const int64_t g0 = r0 + g * kAmxRows;
          const int rows = static_cast<int>(r1 - g0 < kAmxRows ? r1 - g0 : kAmxRows);
          const uint8_t* wg = w.data + g0 * w.row_stride;
          for (int64_t c = 0; c < chunks; ++c) {
            std::byte* out = expanded + (g * kSlabChunks + c) * kChunkTileBytes;
            const int64_t col = c0 + c * kChunk;
            if (w.cols - col >= kChunk) {
              ExpandChunk<false>(ex, wg, w.row_stride, rows, col, 0, out);
            } else {
              ExpandChunk<true>(ex, wg, w.row_stride, rows, col, ChunkMask(w.cols - col), out);
            }
          }
        }
        MicroArgs a{};
        a.scales = scales + c0 / kScaleBlock;
        a.k_rest = cols;
        a.cbuf = cbuf;
        const int64_t b_off = c0 / kChunk * kChunkTileBytes;
        for (int64_t t = 0; t < tiles; t += 2) {
          const int nt = tiles - t >= 2 ? 2 : 1;
          a.b0 = packed + t * tile_bytes + b_off;
          a.b1 = a.b0 + tile_bytes;
          for (int g = 0; g < groups; g += 2) {
            const int ng = groups - g >= 2 ? 2 : 1;
            a.a0 = expanded + g * kSlabChunks * kChunkTileBytes;
            a.a1 = a.a0 + kSlabChunks * kChunkTileBytes;
            for (int i = 0; i < ng; ++i) {
              for (int j = 0; j < nt; ++j) {
                a.acc[i][j] = acc + ((t + j) * kPanelGroups + g + i) * (kAccTileBytes / 4);
              }
            }
            if (ng == 2 && nt == 2) {
              Micro<2, 2>(a);
            } else if (ng == 2) {
              Micro<2, 1>(a);
            } else if (nt == 2) {
              Micro<1, 2>(a);
            } else {
              Micro<1, 1>(a);
            }
          }
        }
      }
      // Write the panel: acc tile (t, g) row r, lane l -> token 16t + l, row r0 + 16g + r.
      for (int64_t t = 0; t < tiles; ++t) {
        const int lanes =
            static_cast<int>(m - t * kTokenTile < kTokenTile ? m - t * kTokenTile : kTokenTile);
        for (int g = 0; g < groups; ++g) {
          const int64_t g0 = r0 + g * kAmxRows;
          const int rows = static_cast<int>(r1 - g0 < kAmxRows ? r1 - g0 : kAmxRows);
          const float* at = acc + (t * kPanelGroups + g) * (kAccTileBytes / 4);
          for (int l = 0; l < lanes; ++l) {
            float* yt = y + (t * kTokenTile + l) * y_stride + (g0 - r_begin);
            for (int r = 0; r < rows; ++r) yt[r] = at[r * 16 + l];
          }
        }
      }
      r0 = r1;
    }
  }

 private:
  const Fp8Gemv* const gemv_;
};

}  // namespace

Fp8Gemm* NewAmxFp8Gemm(const Fp8Gemv* gemv) { return new AmxFp8Gemm(gemv); }

}  // namespace hmoe::cpu::internal
