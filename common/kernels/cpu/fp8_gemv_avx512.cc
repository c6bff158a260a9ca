// AVX-512 (F/BW/VL/VBMI) variant of Fp8Gemv: F32 FMAs. Compiled with its own ISA flags (see
// CMakeLists.txt); reached only through the dispatcher after a CPU check.
#define HMOE_FP8_AVX512_BF16 0
#include "common/kernels/cpu/fp8_gemv_avx512_impl.h"
#include "common/kernels/cpu/fp8_gemv_internal.h"

namespace hmoe::cpu::internal {

Fp8Gemv* NewAvx512Fp8Gemv(const Fp8GemvOptions& options) { return new Avx512Fp8Gemv(options); }

}  // namespace hmoe::cpu::internal
