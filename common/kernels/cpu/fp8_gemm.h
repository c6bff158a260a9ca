#pragma once

// FP8 E4M3 x BF16 matrix-matrix products on the CPU (issue #15): prefill chunks, the dense
// projections of many tokens and experts that see many tokens. The same weights and numerics as
// Fp8Gemv (fp8_gemv.h), organized so each FP8 weight is expanded once per call and reused across
// all M tokens:
//
//   y[t][r] = sum_{kb} scale_inv[r/128][kb] * sum_{k in block kb} fp8(W[r][k]) * bf16(x[t][k])
//
// The activations are rounded to BF16 (round to nearest even) once, when packed; each 128-wide
// block of a row is summed in F32 and scaled once ("post-scaling"); the blocks are summed in F32
// in increasing kb. Products of an FP8 weight and a BF16 activation are exact in F32, so variants
// (and the GEMV) differ only in the order of the F32 additions inside a block: |difference| <=
// about 2 * 128 * 2^-24 * sum |w * x * s| (docs/kernels_cpu.md states the bound the tests use).
//
// Blocking (SIMD variants): the rows of one 128-row scale block form a panel; for each 128-column
// block of the panel the FP8 weights are expanded once into an L1/L2-resident buffer (BF16 in
// natural order for vdpbf16ps, F32 otherwise), then every tile of tokens (64 on AVX-512, 16 on
// AVX2; its 128-column block of activations stays in L1) runs a register-blocked micro-kernel of
// R rows x the tile's tokens: tokens lie in the vector lanes, each weight (pair) is broadcast.
// The block's F32 sums are scaled and added into a per-panel F32 buffer [rows][tokens] that is
// written to y transposed at the end of the panel.
//
// Variants: scalar (the portable fallback), AVX2+FMA+F16C (E4M3 -> F16 by integer shifts,
// vcvtph2ps, F32 FMA, the 2^8 factor folded into the block scale), AVX-512 F/BW/VL/VBMI (BF16
// expansion by vpermi2b, widened to F32, F32 FMA) and AVX-512 BF16 (vdpbf16ps). Chosen by
// BestCpuIsa(), which honors HMOE_CPU_ISA. NaN codes (0x7F, 0xFF) decode to NaN in every variant.
// The AVX-512 BF16 variant flushes BF16 activations below 2^-126 to zero (vdpbf16ps DAZ).
//
// Kernels never start threads: callers pack once, then split the rows [0, rows) into ranges and
// call Multiply on each range from their own threads (ranges starting on multiples of 128 rows
// waste no work).

#include <cstddef>
#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"

#include "common/kernels/cpu/fp8_gemv.h"

namespace hmoe::cpu {

class Fp8Gemm {
 public:
  virtual ~Fp8Gemm();
  Fp8Gemm(const Fp8Gemm&) = delete;
  Fp8Gemm& operator=(const Fp8Gemm&) = delete;

  virtual CpuIsa isa() const = 0;

  // Tokens per packed tile: Pack's token ranges start on multiples of this.
  virtual int64_t TokenTile() const = 0;
  // Bytes of the packed activations of m tokens of length k (the variant's private layout).
  virtual int64_t PackedBytes(int64_t m, int64_t k) const = 0;
  // Packs tokens [t_begin, t_end) of the m tokens x[t * x_stride .. + k] into `packed` (64-byte
  // aligned, PackedBytes(m, k) bytes), rounding to BF16. t_begin must be a multiple of
  // TokenTile() and t_end a multiple of it or m; the padding of a tile (tokens past m, columns
  // past k) is written by the call that packs the tile's last token. Disjoint ranges may be
  // packed concurrently.
  virtual void Pack(const float* x, int64_t x_stride, int64_t m, int64_t k, int64_t t_begin,
                    int64_t t_end, std::byte* packed) const = 0;

  // y[t * y_stride + (r - r_begin)] = (W x_t)[r] for t in [0, m) and r in [r_begin, r_end), from
  // the m tokens packed for w.cols columns. Thread-safe; uses a per-thread scratch buffer of
  // about 64 KiB + 512 * m bytes.
  void Multiply(const Fp8MatrixView& w, const std::byte* packed, int64_t m, int64_t r_begin,
                int64_t r_end, float* y, int64_t y_stride) const;

  // Scratch bytes Run needs for m tokens.
  virtual int64_t ScratchBytes(int64_t m) const = 0;
  // Multiply with the caller's 64-byte aligned scratch of ScratchBytes(m) bytes.
  virtual void Run(const Fp8MatrixView& w, const std::byte* packed, int64_t m, int64_t r_begin,
                   int64_t r_end, float* y, int64_t y_stride, std::byte* scratch) const = 0;

 protected:
  Fp8Gemm();
};

// The variant for `isa`; Unavailable when this CPU does not support it.
absl::StatusOr<std::unique_ptr<Fp8Gemm>> NewFp8Gemm(CpuIsa isa);
// The variant for BestCpuIsa(). Never null; the instance lives forever.
const Fp8Gemm& DefaultFp8Gemm();

// Fewest tokens for which Fp8Gemm beats Fp8Gemv::MatVec/GemmRows on the same rows, per variant
// (measured with hmoe_kernels_bench's GEMM section, docs/PERFORMANCE.md).
int64_t Fp8GemmMinTokens(CpuIsa isa);

}  // namespace hmoe::cpu
