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
// about (128 + ceil(k/128) + 1) * 2^-24 * sum |w * x * s| (the bound tests/kernels/fp8_gemm_test.cc
// checks).
//
// Variants and blocking:
// - AVX-512 BF16 (vdpbf16ps) and AVX-512 F/BW/VL/VBMI (F32 FMA): for every token exactly the
//   operations of the same Fp8Gemv variant, in the same order, so the results are bitwise the
//   GEMV's (Fp8GemmMatchesGemv) and a token's result never depends on its batch. The activations
//   are packed by that GEMV; a panel of up to 48 rows (one scale block at most, ~1 MiB) is
//   expanded once into the GEMV's BF16 lane order in L2; micro-kernels of 3 rows x 4 tokens keep
//   the expanded weight vectors in registers and run the whole K loop with 16-lane block sums and
//   totals, then the GEMV's lane-sum tree (fp8_gemm_impl.h).
// - AMX-BF16 (TDPBF16PS): per token exactly the amx GEMV's tile operations (fp8_amx_impl.h), so
//   bitwise the GEMV too. Tokens are packed in tiles of 16 in AMX's VNNI layout; a panel of up to
//   128 rows (one scale block) x 1024 columns is expanded once into L2 as BF16 A tiles, then
//   every pair of token tiles runs over pairs of 16-row groups (2 x 2 C tiles), the scaled block
//   sums accumulating in an F32 buffer in the scratch.
// - AVX2+FMA+F16C: for every token exactly the AVX2 GEMV's operations in its order (E4M3 -> F16 by
//   integer shifts, vcvtph2ps, even/odd F32 FMAs into two accumulators per 128-column block, the
//   2^8 factor folded into the block scale, the GEMV's 8-lane sum), so bitwise the GEMV too. The
//   activations are packed by the GEMV; a panel of up to 24 rows is expanded once to F32 in the
//   GEMV's lane order, chunk-major (128 columns of the panel's rows, 12 KiB, stay in L1); for
//   groups of up to 96 tokens, chunk by chunk, micro-kernels of 2 rows x 3 tokens (12 ymm
//   accumulators) add each block into 8-lane totals kept in the scratch (fp8_gemm_avx2.cc).
// - scalar: the portable fallback.
// Chosen by BestCpuIsa(), which honors HMOE_CPU_ISA. NaN codes (0x7F, 0xFF) decode to NaN in every
// variant. The AVX-512 BF16 and AMX variants flush BF16 activations below 2^-126 to zero (DAZ).
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
  // the m tokens packed for w.cols columns. Thread-safe; uses a per-thread scratch buffer
  // (ScratchBytes: about 1 MiB on AVX-512, about 96 * k + 72 KiB on AVX2, 256 KiB + 512 * m
  // bytes on AMX).
  void Multiply(const Fp8MatrixView& w, const std::byte* packed, int64_t m, int64_t r_begin,
                int64_t r_end, float* y, int64_t y_stride) const;

  // Scratch bytes Run needs for m tokens of length k.
  virtual int64_t ScratchBytes(int64_t m, int64_t k) const = 0;
  // Multiply with the caller's 64-byte aligned scratch of ScratchBytes(m, w.cols) bytes.
  virtual void Run(const Fp8MatrixView& w, const std::byte* packed, int64_t m, int64_t r_begin,
                   int64_t r_end, float* y, int64_t y_stride, std::byte* scratch) const = 0;

 protected:
  Fp8Gemm();
};

// The variant for `isa`; Unavailable when this CPU does not support it.
absl::StatusOr<std::unique_ptr<Fp8Gemm>> NewFp8Gemm(CpuIsa isa);
// The variant for BestCpuIsa(). Never null; the instance lives forever.
const Fp8Gemm& DefaultFp8Gemm();
// The variant for `isa` (which this CPU must support: checked); the instance lives forever.
const Fp8Gemm& Fp8GemmForIsa(CpuIsa isa);

// Fewest tokens for which Fp8Gemm beats Fp8Gemv::MatVec/GemmRows on the same rows, per variant
// (measured with hmoe_gemm_bench, docs/PERFORMANCE.md); INT64_MAX for the scalar variant.
int64_t Fp8GemmMinTokens(CpuIsa isa);

// Whether the `isa` variant of Fp8Gemm gives bitwise the results of the same variant of Fp8Gemv
// (MatVec / GemmRows) for every token. The engine relies on a token's result not depending on
// the batch it is computed in (SLP vs resident, DSLP ranks vs one process, a sequence alone or
// batched: docs/decode_worker.md), so CpuDevice only switches to the GEMM by default where this
// holds: the AVX2, AVX-512 and AMX variants.
bool Fp8GemmMatchesGemv(CpuIsa isa);

}  // namespace hmoe::cpu
