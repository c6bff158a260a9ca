#pragma once

// Factories of the ISA-specific variants of Fp8Gemm, each in a file compiled with its own ISA
// flags: only the dispatcher in fp8_gemm.cc may call them, after checking CpuSupports(). They
// return an owning raw pointer for the reason given in fp8_gemv_internal.h.

#include "common/kernels/cpu/fp8_gemm.h"
#include "common/kernels/cpu/fp8_gemv.h"

namespace hmoe::cpu::internal {

// `gemv`: the Fp8Gemv of the same ISA (not owned; must outlive the result).
Fp8Gemm* NewAvx2Fp8Gemm(const Fp8Gemv* gemv);
Fp8Gemm* NewAvx512Fp8Gemm(const Fp8Gemv* gemv);
Fp8Gemm* NewAvx512Bf16Fp8Gemm(const Fp8Gemv* gemv);
Fp8Gemm* NewAmxFp8Gemm(const Fp8Gemv* gemv);

}  // namespace hmoe::cpu::internal
