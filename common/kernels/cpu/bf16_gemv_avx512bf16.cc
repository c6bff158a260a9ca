// AVX-512 BF16 variant of Bf16Gemv (vdpbf16ps); see bf16_gemv_avx512_impl.h.
#define HMOE_BF16_DPBF16 1
#include "common/kernels/cpu/bf16_gemv_avx512_impl.h"

namespace hmoe::cpu::internal {

Bf16Gemv* NewAvx512Bf16Bf16Gemv() { return new Avx512Bf16Gemv(); }

}  // namespace hmoe::cpu::internal
