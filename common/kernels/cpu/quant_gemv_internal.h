#pragma once

// Factories of the ISA-specific variants of QuantGemv, and the scalar code they fall back to for
// types without SIMD code. Each variant lives in a source file compiled with its own ISA flags
// (see CMakeLists.txt), so only the dispatcher in quant_gemv.cc may call the factories, and only
// after checking the CPU. They return an owning raw pointer on purpose (see fp8_gemv_internal.h).

#include <cstdint>

#include "common/kernels/cpu/quant_gemv.h"

namespace hmoe::cpu::internal {

QuantGemv* NewScalarQuantGemv();
// use_avx_vnni: the GEMM may use AVX-VNNI where the CPU has it (false: tests of the plain path).
QuantGemv* NewAvx2QuantGemv(bool use_avx_vnni = true);
QuantGemv* NewAvx512VnniQuantGemv();

// The scalar MatVec (any supported type), compiled without ISA flags.
void ScalarQuantMatVec(const QuantMatrixView& w, const BlockQ8K* x, int64_t x_stride, int n,
                       int64_t m_begin, int64_t m_end, float* y, int64_t y_stride);

// QuantizeQ8K in AVX-512 (F + BW): full finite blocks vectorized, the rest (a partial last block,
// a block with a NaN or an infinity) through QuantizeQ8KReference; bitwise its blocks.
void QuantizeQ8KAvx512(const float* x, int64_t k, BlockQ8K* out);

// The argument checks of QuantGemv::MatVec (aborts with a message on a violation), out of line so
// the ISA-specific files need no logging code.
void CheckQuantMatVecArgs(const QuantMatrixView& w, int64_t x_stride, int n, int64_t m_begin,
                          int64_t m_end);

}  // namespace hmoe::cpu::internal
