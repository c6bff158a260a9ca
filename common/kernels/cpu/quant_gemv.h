#pragma once

// Quantized (GGUF block type) x Q8_K matrix-vector products on the CPU, for GGUF models (issue
// 18): the weights are read in place, in the ggml block layouts of common/model/gguf_quants.h
// (Q4_K, Q5_K, Q6_K, Q8_0, Q5_0; a Q4_K_M model is Q4_K gate/up and Q6_K down), and the
// activation is quantized once per token to Q8_K (QuantizeQ8K), our private activation format.
//
// Q8_K (MODEL-SPEC 5.4): blocks of 256 values, `float d; int8 qs[256]; int16 bsums[16]`, value
// = d * qs[i], bsums[j] = sum of qs[16j .. 16j+15]. QuantizeQ8K defines it as: amax = max |x|
// over the block; amax == 0 gives d = 0 and qs = 0; otherwise d = amax / 127 and
// qs[i] = nearbyint(x[i] * (127 / amax)) (round half to even; |qs| <= 127, never -128). A vector
// of k values takes Q8KBlocks(k) = ceil(k / 256) blocks; the last block is zero-padded, so rows
// of any multiple of 32 columns (Q8_0, Q5_0) dot against it.
//
// Numerics, every variant: within each 32-weight (Q4_K, Q5_K, Q8_0, Q5_0) or 16-weight (Q6_K)
// sub-block the products of weight quants and activation quants, with the sub-block's integer
// scale applied and the offsets of the types with a zero point (Q4_K/Q5_K mins, Q6_K's -32,
// Q5_0's -16, through bsums), are summed EXACTLY in int32. Only the float scales are applied in
// F32: the block scale product d_w * d_x (and dmin_w * d_x) rounds once, the integer partial sums
// convert to F32 (exact below 2^24), and the per-block terms are summed in F32 in an order that
// differs between variants. With u = 2^-24 and S = sum over columns of
// (|d*sc*q| + |dmin*m|) * |d_x*q_x| (the magnitudes of the two parts of each dequantized weight
// times the dequantized activation), every variant's result lies within (cols/32 + 8) * u * S of
// the exact product of the dequantized weights and the dequantized Q8_K activation
// (tests/kernels/quant_gemv_test.cc checks each variant against that oracle in double).
//
// Variants (one interface, chosen at run time by BestCpuIsa()): a scalar reference; AVX2
// (vpmaddubsw + vpmaddwd, the sub-block scale applied in the 16-bit multiply-add; for Zen 3 and
// other CPUs without AVX-512) and AVX-512 (AVX-512 BW + VNNI + GFNI: GF2P8AFFINEQB unpacks the
// quants, vpmaddubsw + vpdpwssd; vpdpbusd for Q8_0). Every variant takes every supported type.
// Kernels never start threads: callers split the rows [0, rows) into ranges and call MatVec on
// each range from their own threads.
//
// Use (the engine, per layer and expert):
//   std::vector<BlockQ8K> xq(n * Q8KBlocks(cols));        // once per layer and token
//   for (t) QuantizeQ8K(x + t * cols, cols, xq.data() + t * Q8KBlocks(cols));
//   QuantMatrixView w = ...;  // MakeQuantMatrixView(type, data, rows, cols) checks the shape
//   DefaultQuantGemv().MatVec(w, xq.data(), Q8KBlocks(cols), n, m_begin, m_end, y, y_stride);

#include <cstddef>
#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"

#include "common/kernels/cpu/fp8_gemv.h"

namespace hmoe::cpu {

// ggml type ids (as in common/model/gguf_quants.h's GgmlType) of the weight types the kernels
// take.
inline constexpr uint32_t kGgmlQ5_0 = 6;
inline constexpr uint32_t kGgmlQ8_0 = 8;
inline constexpr uint32_t kGgmlQ4_K = 12;
inline constexpr uint32_t kGgmlQ5_K = 13;
inline constexpr uint32_t kGgmlQ6_K = 14;

// Whether the kernels take weights of ggml type `type`.
bool QuantGemvSupportsType(uint32_t type);

// One Q8_K block (292 bytes, packed like ggml's block_q8_K).
struct BlockQ8K {
  float d;
  int8_t qs[256];
  int16_t bsums[16];
};
static_assert(sizeof(BlockQ8K) == 292);

inline constexpr int64_t kQ8KBlockSize = 256;
// Blocks of a Q8_K vector of k values: ceil(k / 256).
inline int64_t Q8KBlocks(int64_t k) { return (k + kQ8KBlockSize - 1) / kQ8KBlockSize; }

// Quantizes x[0, k) to Q8KBlocks(k) blocks at `out` (definition above; the last block padded with
// zeros). Vectorized where the quantized kernels run AVX-512, bitwise QuantizeQ8KReference.
// Non-finite input is defined, not undefined: a block holding a NaN gets d = NaN and qs = 0 (its
// dot products are NaN); a block holding an infinity (and no NaN) gets d = +inf, qs = +-127 at
// the infinities and 0 elsewhere (its dot products are +-inf, or NaN where weights cancel).
void QuantizeQ8K(const float* x, int64_t k, BlockQ8K* out);
// The scalar definition (for tests and the variants' fallback).
void QuantizeQ8KReference(const float* x, int64_t k, BlockQ8K* out);

// A read-only view of a row-major matrix of ggml blocks. Does not own memory. Row r starts at
// data + r * row_stride and holds cols / block_size blocks of `type` (any alignment).
struct QuantMatrixView {
  uint32_t type = 0;
  const uint8_t* data = nullptr;
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t row_stride = 0;  // bytes between rows, >= the bytes of a row's blocks

  // Rows [begin, end) as a view of their own (any begin; checked).
  QuantMatrixView RowSlice(int64_t begin, int64_t end) const;
};

// A dense [rows, cols] matrix of `type` (a GGUF 2-D tensor with ne = [cols, rows], or one expert
// of a 3-D one). InvalidArgument naming the problem for a type the kernels do not take, or cols
// not a positive multiple of the type's block size (256 for the K types, 32 for Q8_0 / Q5_0).
absl::StatusOr<QuantMatrixView> MakeQuantMatrixView(uint32_t type, const void* data, int64_t rows,
                                                    int64_t cols);
// Bytes of one row of `cols` values of a supported type (cols a multiple of its block size).
int64_t QuantRowBytes(uint32_t type, int64_t cols);

// One variant of the kernels. Immutable after creation, thread-safe: every method may be called
// concurrently on disjoint outputs.
class QuantGemv {
 public:
  virtual ~QuantGemv();
  QuantGemv(const QuantGemv&) = delete;
  QuantGemv& operator=(const QuantGemv&) = delete;

  virtual CpuIsa isa() const = 0;

  // y[t * y_stride + (m - m_begin)] = (W x_t)[m] for t in [0, n) and m in [m_begin, m_end), with
  // x_t the Q8_K vector at x + t * x_stride (x_stride in blocks, >= Q8KBlocks(w.cols)).
  // 1 <= n <= kMaxMatVecTokens; w.type supported (MakeQuantMatrixView checked it). Rows outside
  // the range are not touched. A token's result does not depend on the other tokens of the call.
  virtual void MatVec(const QuantMatrixView& w, const BlockQ8K* x, int64_t x_stride, int n,
                      int64_t m_begin, int64_t m_end, float* y, int64_t y_stride) const = 0;

  // Any number of tokens n >= 1 (prefill): over blocks of rows small enough to stay in L2, the
  // variant's GEMM kernel where it has one for w.type (GemmBlock), else MatVec for every group of
  // kMaxMatVecTokens tokens. Results bitwise equal to MatVec's for each token alone (the batch
  // invariance the engine relies on: a token's KV never depends on the rest of its batch).
  void GemmRows(const QuantMatrixView& w, const BlockQ8K* x, int64_t x_stride, int64_t n,
                int64_t m_begin, int64_t m_end, float* y, int64_t y_stride) const;

 protected:
  // Out of line (quant_gemv.cc), so the ISA-specific files never emit shared inline code.
  QuantGemv();

  // The variant's GEMM for rows [m_begin, m_end) (a block GemmRows chose) and n >= 1 tokens,
  // results as MatVec's token by token: a weight block unpacked once for several tokens, the
  // tokens' activations tiled for L1. Returns false (writing nothing) where the variant has no
  // GEMM kernel for w.type; the default has none.
  virtual bool GemmBlock(const QuantMatrixView& w, const BlockQ8K* x, int64_t x_stride, int64_t n,
                         int64_t m_begin, int64_t m_end, float* y, int64_t y_stride) const;
};

// Whether GemmRows uses the variants' GEMM kernels: true unless HMOE_QUANT_GEMM=0 (read once;
// for before/after comparisons in one binary: the results are the same either way).
bool QuantGemmKernelsEnabled();

// The variant for `isa`: kScalar, kAvx2, or (kAvx512 and kAvx512Bf16 alike) the AVX-512 VNNI
// variant. Unavailable when this CPU does not support it (AVX-512 also needs AVX512_VNNI and
// GFNI).
absl::StatusOr<std::unique_ptr<QuantGemv>> NewQuantGemv(CpuIsa isa);
// The variant for BestCpuIsa() (AVX2 where BestCpuIsa() is an AVX-512 level this CPU runs
// without VNNI or GFNI). Never null; the instance lives forever.
const QuantGemv& DefaultQuantGemv();

}  // namespace hmoe::cpu
