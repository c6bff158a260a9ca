#pragma once

// The AMX-BF16 building blocks of the `amx` Fp8Gemv (fp8_gemv_amx.cc) and Fp8Gemm
// (fp8_gemm_amx.cc), included by exactly those two files, both compiled with the AVX-512 BF16 and
// AMX flags (CMakeLists.txt). It includes the AVX-512 GEMV templates for their FP8 -> BF16
// expansion and activation packing (the `avx512bf16` layout is the AMX one too).
//
// Arithmetic (the same for every token, whatever the batch). AMX computes C^T = W X^T with the
// weights as the A operand in their natural row-major order: an A tile is 16 weight rows x 32 K as
// BF16 (one Expander half-vector per row), a B tile is the matching 16 K-pairs x N tokens in the
// VNNI layout (row kp holds, per token, the BF16 pair of the packed activation's dword kp), a C
// tile is 16 rows x N tokens of F32. Per 128-column scale block kb, in increasing kb:
//   C = 0; for each 64-column chunk c of the block (1 or 2), for the halves h = A, B of the
//   Expander order: C += TDPBF16PS(A(c, h), B(c, h));  acc = fma(C, scale_inv[kb], acc).
// Each C element depends only on its A row and B column (TDPBF16PS is elementwise in (row, token)),
// so a token's result is the same whether it is computed alone (N = 1), in a GEMV batch of up to
// 8 tokens or in a GEMM tile of 16, and the GEMM is bitwise the GEMV. Ragged rows are computed on
// zero rows and not stored; ragged K uses zero weights and the packed activation's zero padding.
//
// Tile registers and the per-thread configuration: see AmxConfigure. Keep standard-library
// templates out of here (see fp8_gemv_avx512_impl.h).

#define HMOE_FP8_AVX512_BF16 1
#include "common/kernels/cpu/fp8_gemv_avx512_impl.h"
#include "common/kernels/cpu/fp8_gemv_internal.h"

#define HMOE_AMX_INLINE inline __attribute__((always_inline))
#define HMOE_AMX_UNROLL _Pragma("GCC unroll 16")

// GCC 12's <amxtileintrin.h> macros have no "memory" clobber, so the compiler could move our
// stores to the tile buffers past a TILELOADD that reads them: these wrappers declare the memory
// access. Tile numbers must be literals.
#define HMOE_TILE_LOAD(tmm, base, stride)                                                        \
  asm volatile("tileloadd (%0,%1,1), %%tmm" #tmm ::"r"((const void*)(base)), "r"((long)(stride)) \
               : "memory")
#define HMOE_TILE_STORE(tmm, base, stride)                                                     \
  asm volatile("tilestored %%tmm" #tmm ", (%0,%1,1)" ::"r"((void*)(base)), "r"((long)(stride)) \
               : "memory")
#define HMOE_TILE_ZERO(tmm) asm volatile("tilezero %%tmm" #tmm ::)
// c += a * b (A operand a: weights, B operand b: activations).
#define HMOE_TILE_DP(c, a, b) asm volatile("tdpbf16ps %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::)

namespace hmoe::cpu::internal {
namespace {

constexpr int kAmxRows = 16;           // rows of every tile
constexpr int64_t kAmxHalfBytes = 64;  // one A tile row: 32 BF16 (half of a 64-column chunk)

struct alignas(64) AmxTileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
static_assert(sizeof(AmxTileConfig) == 64);

// Configuration ids (AmxLoadedConfig): 1..8 the GEMV for that many tokens; kGemmConfig the GEMM.
constexpr int kGemmConfig = 100;

// Loads the configuration `id` unless this thread has it loaded already. GEMV (id = n tokens):
// tmm0/tmm5 C (16 x 4n bytes, even/odd scale blocks), tmm1/tmm2 and tmm6/tmm7 A (16 x 64 bytes,
// halves of chunks 0 and 1), tmm3/tmm4 B (16 x 4n bytes). GEMM: all eight 16 x 64 bytes: tmm0-3 C
// (2 row groups x 2 token tiles), tmm4/5 A, tmm6/7 B.
HMOE_AMX_INLINE void AmxConfigure(int id) {
  int& loaded = AmxLoadedConfig();
  if (loaded == id) return;
  AmxTileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = kAmxRows;
    cfg.colsb[t] = 64;
  }
  if (id != kGemmConfig) {
    const uint16_t cols = static_cast<uint16_t>(4 * id);
    cfg.colsb[0] = cfg.colsb[5] = cfg.colsb[3] = cfg.colsb[4] = cols;
  }
  asm volatile("ldtilecfg %0" ::"m"(cfg) : "memory");
  loaded = id;
}

// Expands rows [0, rows) (rows <= 16) of the 64-column chunk at column `col` (cols <= 64 valid
// columns) into two A tiles: half A at out, half B at out + 1 KiB (16 rows x 64 bytes each). Rows
// >= `rows` are left as they are (their C rows are never stored).
template <bool kMasked>
HMOE_AMX_INLINE void ExpandChunk(const Expander& ex, const uint8_t* w, int64_t row_stride, int rows,
                                 int64_t col, __mmask64 mask, std::byte* out) {
  HMOE_AMX_UNROLL
  for (int r = 0; r < kAmxRows; ++r) {
    if (r < rows) {
      const uint8_t* p = w + r * row_stride + col;
      const __m512i v = kMasked ? _mm512_maskz_loadu_epi8(mask, p) : _mm512_loadu_si512(p);
      __m512i a, b;
      ex.Expand(v, &a, &b);
      _mm512_store_si512(out + r * kAmxHalfBytes, a);
      _mm512_store_si512(out + kAmxRows * kAmxHalfBytes + r * kAmxHalfBytes, b);
    }
  }
}

HMOE_AMX_INLINE __mmask64 ChunkMask(int64_t cols) {
  return cols >= 64 ? ~0ull : (1ull << cols) - 1;
}

}  // namespace
}  // namespace hmoe::cpu::internal
