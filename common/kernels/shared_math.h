#pragma once

// Scalar math shared by the CPU kernels and the CUDA kernels. Everything here compiles as host
// code with g++ and as __host__ __device__ code with nvcc, so the CPU tests exercise exactly the
// arithmetic the GPU kernels run. No CUDA or absl headers; no tables (device code cannot read
// host tables), only bit manipulation.

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define HMOE_HOST_DEVICE __host__ __device__
#else
#define HMOE_HOST_DEVICE
#endif

namespace hmoe::kernels {

HMOE_HOST_DEVICE inline float BitsToFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

HMOE_HOST_DEVICE inline uint32_t FloatToBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

// FP8 E4M3FN (bias 7, no infinities, NaN = S.1111.111) -> float, exact for every code.
// Normal codes map to float by re-biasing the exponent (7 -> 127); subnormal codes (exponent 0)
// are m/8 * 2^-6, computed exactly as m * 2^-9.
HMOE_HOST_DEVICE inline float Fp8E4M3ToFloatBits(uint8_t code) {
  const uint32_t sign = static_cast<uint32_t>(code & 0x80u) << 24;
  const uint32_t exponent = (code >> 3) & 0xfu;
  const uint32_t mantissa = code & 0x7u;
  if (exponent == 0xfu && mantissa == 0x7u) return BitsToFloat(sign | 0x7fc00000u);  // NaN
  if (exponent == 0) {
    const float magnitude = static_cast<float>(mantissa) * 0.001953125f;  // 2^-9
    return sign != 0 ? -magnitude : magnitude;
  }
  return BitsToFloat(sign | ((exponent + 120u) << 23) | (mantissa << 20));
}

// float -> BF16 bits, round to nearest even; NaN stays a quiet NaN.
HMOE_HOST_DEVICE inline uint16_t FloatToBf16Bits(float f) {
  uint32_t u = FloatToBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

HMOE_HOST_DEVICE inline float Bf16BitsToFloat(uint16_t b) {
  return BitsToFloat(static_cast<uint32_t>(b) << 16);
}

// SiLU(g) * u, the gated activation of every DeepSeek-V3 MLP and expert.
HMOE_HOST_DEVICE inline float SiluMul(float g, float u) {
#if defined(__CUDA_ARCH__)
  return g / (1.0f + __expf(-g)) * u;
#else
  return g / (1.0f + __builtin_expf(-g)) * u;
#endif
}

// Dequantized element (row, col) of a block-scaled FP8 matrix with `scale_cols` scale blocks per
// row of blocks: w = fp8(code) * scale_inv[row / 128][col / 128].
HMOE_HOST_DEVICE inline float DequantFp8Element(uint8_t code, const float* scale_inv,
                                                int64_t scale_cols, int64_t row, int64_t col) {
  return Fp8E4M3ToFloatBits(code) * scale_inv[(row / 128) * scale_cols + (col / 128)];
}

}  // namespace hmoe::kernels
