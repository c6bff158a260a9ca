#pragma once

// Element types of checkpoint tensors and exact scalar conversions between them.

#include <bit>
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "absl/status/statusor.h"

namespace hmoe {

enum class DType : uint8_t {
  kF8E4M3 = 0,  // safetensors "F8_E4M3" (torch.float8_e4m3fn): bias 7, no inf, NaN = 0x7F/0xFF
  kBF16 = 1,
  kF16 = 2,
  kF32 = 3,
  kF64 = 4,
  kI8 = 5,
  kU8 = 6,
  kI16 = 7,
  kI32 = 8,
  kI64 = 9,
  kBool = 10,
  kF8E5M2 = 11,
};

// Bytes per element.
size_t DTypeSize(DType t);
// safetensors spelling: "F8_E4M3", "BF16", "F16", "F32", ...
std::string_view DTypeName(DType t);
// Parses a safetensors dtype string; InvalidArgument naming it for an unknown one.
absl::StatusOr<DType> ParseDType(std::string_view name);

// FP8 E4M3FN -> float, exact for all 256 codes (0x7F and 0xFF decode to quiet NaN).
inline float Fp8E4M3ToFloat(uint8_t code);
// The 256-entry decode table behind Fp8E4M3ToFloat.
const float* Fp8E4M3Table();
// float -> nearest FP8 E4M3FN code, ties to even; saturates to +-448; NaN -> 0x7F.
uint8_t FloatToFp8E4M3(float f);

inline float Bf16ToFloat(uint16_t b) {
  return std::bit_cast<float>(static_cast<uint32_t>(b) << 16);
}
// float -> BF16, round to nearest even; NaN stays NaN (quiet).
inline uint16_t FloatToBf16(float f) {
  uint32_t u = std::bit_cast<uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
// IEEE half -> float, exact (subnormals, inf, NaN).
float F16ToFloat(uint16_t h);
// float -> IEEE half, round to nearest even.
uint16_t FloatToF16(float f);

inline float Fp8E4M3ToFloat(uint8_t code) { return Fp8E4M3Table()[code]; }

// Converts `n` elements of `src` (of type `t`, any alignment) to float. Supports F8E4M3, BF16,
// F16, F32 and F64; InvalidArgument otherwise.
absl::Status ConvertToFloat(DType t, const void* src, size_t n, float* dst);

}  // namespace hmoe
