// AVX-512 BF16 variant of Fp8Gemv: vdpbf16ps. Compiled with its own ISA flags (see
// CMakeLists.txt); reached only through the dispatcher after a CPU check.
#define HMOE_FP8_AVX512_BF16 1
#include "common/kernels/cpu/fp8_gemv_avx512_impl.h"
#include "common/kernels/cpu/fp8_gemv_internal.h"

namespace hmoe::cpu::internal {

Fp8Gemv* NewAvx512Bf16Fp8Gemv(const Fp8GemvOptions& options) { return new Avx512Fp8Gemv(options); }

}  // namespace hmoe::cpu::internal
