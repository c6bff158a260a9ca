#pragma once

// FP8 E4M3 x BF16 matrix-vector products on the CPU, for the decode path's routed experts.
//
// The weight W [M, K] is read in place: row-major FP8 E4M3FN bytes (as stored in the checkpoint and
// in weightd's shared mapping) plus the F32 block-scale tensor scale_inv [ceil(M/128),
// ceil(K/128)] (multiply to dequantize). The kernels compute, for each token t and row m,
//
//   y[t][m] = sum_{kb} scale_inv[m/128][kb] * sum_{k in block kb} fp8(W[m][k]) * bf16(x[t][k])
//
// i.e. the activation is rounded to BF16 (round to nearest even), each 128-wide block of a row is
// summed in F32 and scaled once ("post-scaling"), then the blocks are summed in F32. Variants add
// in different orders, so results agree to F32 rounding (about 1e-6 of sum |w*x*s|), not bitwise.
//
// Variants (one interface, chosen at run time by CPU features): a scalar reference (the oracle of
// the tests), AVX2+F16C+FMA, AVX-512 (FP8 -> BF16 by two vpermi2b table lookups, then exact F32
// FMAs), AVX-512 BF16 (the same expansion, vdpbf16ps dot products) and AMX-BF16 (the same
// expansion into 16-row x 32-column BF16 tiles in L1, TDPBF16PS against the tokens' activations
// as the B tile, so 1..8 tokens cost about what one does; per 128-column block the tile's F32 sums
// are stored and post-scaled with one FMA per (row, token); fp8_amx_impl.h has the exact order:
// every token gets the same tile operations whatever its batch, so a token's result is bitwise the
// same alone or batched, and the amx Fp8Gemm is bitwise this GEMV); the SIMD variants use
// software prefetch. Kernels never start threads: callers split the rows
// [0, M) into ranges and call MatVec on each range from their own threads.
//
// NaN codes (0x7F, 0xFF; real checkpoints never contain them): every variant decodes them to NaN,
// so a row holding one yields NaN for every token. The AVX-512 BF16 and AMX variants flush BF16
// activations below 2^-126 in magnitude to zero (vdpbf16ps and TDPBF16PS have DAZ semantics); FP8
// subnormals are BF16 normals and are not affected. Products of an FP8 weight and a BF16 activation
// are exact in F32 in every variant.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string_view>

#include "absl/status/statusor.h"

namespace hmoe::cpu {

// In order of preference (a larger value is faster where supported).
enum class CpuIsa : uint8_t {
  kScalar = 0,      // portable C++, the reference
  kAvx2 = 1,        // AVX2 + FMA + F16C
  kAvx512 = 2,      // AVX-512 F/BW/VL/VBMI (e.g. Ice Lake): BF16 expansion, F32 FMAs
  kAvx512Bf16 = 3,  // the above + AVX512_BF16 (Zen 4/5, Sapphire Rapids): vdpbf16ps
  // The above + AMX-TILE/AMX-BF16 (Sapphire Rapids and later Xeons), when the OS grants the tile
  // state (arch_prctl ARCH_REQ_XCOMP_PERM): the FP8 GEMV and GEMM run TDPBF16PS; every other
  // kernel family treats it as kAvx512Bf16.
  kAmx = 4,
};

// "scalar", "avx2", "avx512", "avx512bf16", "amx".
std::string_view CpuIsaName(CpuIsa isa);
// Whether this CPU (and OS) can run `isa`.
bool CpuSupports(CpuIsa isa);
// The fastest variant this CPU supports. The environment variable HMOE_CPU_ISA (one of the names
// above) lowers the choice, e.g. to test the AVX2 path on an AVX-512 machine; an unsupported or
// unknown value is ignored with a warning. Decided (and logged) once per process; every CPU
// kernel family dispatches by it (FP8 and BF16 GEMV, the F32 ops of f32_ops.h).
CpuIsa BestCpuIsa();

// A read-only view of a row-major FP8 E4M3 matrix with 128x128 block scales. Does not own memory.
// Element (r, c) is data[r * row_stride + c]; the scale of block (i, j) is
// scale_inv[i * scale_stride + j]. `data` may have any alignment; `scale_inv` must be 4-byte
// aligned.
struct Fp8MatrixView {
  const uint8_t* data = nullptr;
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t row_stride = 0;  // bytes between rows, >= cols
  const float* scale_inv = nullptr;
  int64_t scale_stride = 0;  // floats between rows of scale blocks, >= ceil(cols / 128)

  // A dense [rows, cols] matrix with a dense [ceil(rows/128), ceil(cols/128)] scale tensor.
  static Fp8MatrixView Dense(const uint8_t* data, const float* scale_inv, int64_t rows,
                             int64_t cols);
  // Rows [begin, end) / columns [begin, end) as a view of their own (NUMA slices of an expert).
  // `begin` must be a multiple of 128 so the slice starts on a scale block (checked).
  Fp8MatrixView RowSlice(int64_t begin, int64_t end) const;
  Fp8MatrixView ColSlice(int64_t begin, int64_t end) const;
};

// Largest number of tokens one MatVec call takes (the decode batch); GemmRows loops over more.
inline constexpr int kMaxMatVecTokens = 8;
// Activation ranges given to Pack start on multiples of this many elements.
inline constexpr int64_t kPackGroup = 64;

struct Fp8GemvOptions {
  // Software prefetch of the weights (SIMD variants). While a tile of rows is read, the next tile
  // is prefetched `prefetch_bytes` ahead of the current column (measurements and defaults in
  // docs/PERFORMANCE.md).
  bool prefetch = true;
  int64_t prefetch_bytes = -1;  // -1: the variant's default
  // AVX-512 variants, for tuning: prefetch the next tile of dense rows as one linear stream
  // instead of row by row (row by row was faster on Ice Lake; column slices are always prefetched
  // row by row), and the prefetch instruction (0: prefetcht0, 1: prefetcht1, 2: prefetchnta).
  // prefetcht1 (into L2) is the default: on Zen 4 it raised the cold expert GEMV from ~0.55 to
  // ~0.9 of the read bandwidth, on Ice Lake it was as good as prefetcht0 (docs/PERFORMANCE.md).
  bool prefetch_linear = false;
  int prefetch_hint = 1;
};

// One variant of the kernels. Immutable after creation, thread-safe: every method may be called
// concurrently on disjoint outputs.
class Fp8Gemv {
 public:
  virtual ~Fp8Gemv();
  Fp8Gemv(const Fp8Gemv&) = delete;
  Fp8Gemv& operator=(const Fp8Gemv&) = delete;

  virtual CpuIsa isa() const = 0;

  // Bytes of one token's packed activation of length k (a multiple of 64, padded so that tokens
  // placed at this stride do not alias in L1). Packed activations are the variant's private
  // layout (BF16 in a permuted order, or F32), padded with zeros up to a multiple of 64 elements;
  // bytes beyond that are never read.
  virtual int64_t PackedBytes(int64_t k) const = 0;

  // Packs elements [k_begin, k_end) of one token's activation of length k into `packed` (the
  // token's PackedBytes(k) bytes, 64-byte alignment recommended), rounding to BF16; x points at
  // element k_begin. k_begin must be a multiple of kPackGroup and k_end <= k; when k_end == k the
  // zero padding is written too. Disjoint ranges may be packed concurrently.
  virtual void Pack(const float* x, int64_t k, int64_t k_begin, int64_t k_end,
                    std::byte* packed) const = 0;

  // y[t * y_stride + (m - m_begin)] = (W x_t)[m] for t in [0, n) and m in [m_begin, m_end), with
  // x_t the activation packed at packed + t * packed_stride (packed_stride >= PackedBytes(w.cols)).
  // 1 <= n <= kMaxMatVecTokens. Rows outside the range are not touched. Ranges starting on a
  // multiple of 128 rows keep every tile inside one scale block (any range is correct).
  virtual void MatVec(const Fp8MatrixView& w, const std::byte* packed, int64_t packed_stride, int n,
                      int64_t m_begin, int64_t m_end, float* y, int64_t y_stride) const = 0;

  // The fused first half of an expert: h = SiLU(W_gate x) * (W_up x) for rows [m_begin, m_end)
  // of gate and up (same shape), written PACKED for the down projection: token t's h goes to
  // h_packed + t * h_packed_stride, elements [m_begin, m_end) of a vector of length gate.rows.
  // m_begin must be a multiple of kPackGroup; 1 <= n <= kMaxMatVecTokens. When h_float is not
  // null the F32 values are also stored at h_float[t * h_float_stride + (m - m_begin)].
  void GateUpSilu(const Fp8MatrixView& gate, const Fp8MatrixView& up, const std::byte* packed,
                  int64_t packed_stride, int n, int64_t m_begin, int64_t m_end, std::byte* h_packed,
                  int64_t h_packed_stride, float* h_float = nullptr,
                  int64_t h_float_stride = 0) const;

  // Prefill-sized products: y[t * y_stride + (m - m_begin)] for any number of tokens n >= 1 and
  // rows [m_begin, m_end).
  // Blocked so a block of weight rows is read from memory once and reused from L2 for every group
  // of kMaxMatVecTokens tokens.
  void GemmRows(const Fp8MatrixView& w, const std::byte* packed, int64_t packed_stride, int64_t n,
                int64_t m_begin, int64_t m_end, float* y, int64_t y_stride) const;

 protected:
  // Out of line (fp8_gemv.cc), so the ISA-specific files never emit shared inline code.
  Fp8Gemv();
};

// The variant for `isa`; Unavailable when this CPU does not support it.
absl::StatusOr<std::unique_ptr<Fp8Gemv>> NewFp8Gemv(CpuIsa isa, const Fp8GemvOptions& options = {});
// The variant for BestCpuIsa(), with default options. Never null; the instance lives forever.
const Fp8Gemv& DefaultFp8Gemv();

// out[i] = SiLU(gate[i]) * up[i] = gate[i] / (1 + exp(-gate[i])) * up[i], for i < n.
void SiluMul(const float* gate, const float* up, int64_t n, float* out);

}  // namespace hmoe::cpu
