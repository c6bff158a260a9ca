// The avx512 variant of Fp8Gemm: fp8_gemm_impl.h compiled with this file's ISA flags
// (CMakeLists.txt); reached only through the dispatcher in fp8_gemm.cc after a CPU check.
#define HMOE_FP8_GEMM_VARIANT 2
#include "common/kernels/cpu/fp8_gemm_impl.h"
#include "common/kernels/cpu/fp8_gemm_internal.h"

namespace hmoe::cpu::internal {
Fp8Gemm* NewAvx512Fp8Gemm(const Fp8Gemv* gemv) { return new SimdFp8Gemm(gemv); }
}  // namespace hmoe::cpu::internal
