// AVX-512 F/BW variant of Bf16Gemv (exact F32 FMAs); see bf16_gemv_avx512_impl.h.
#define HMOE_BF16_DPBF16 0
#include "common/kernels/cpu/bf16_gemv_avx512_impl.h"

namespace hmoe::cpu::internal {

Bf16Gemv* NewAvx512Bf16Gemv() { return new Avx512Bf16Gemv(); }

}  // namespace hmoe::cpu::internal
