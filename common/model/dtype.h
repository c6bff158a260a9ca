#pragma once

// Element types of checkpoint tensors and exact scalar conversions between them.

#include <bit>
#include <cstddef>
#include <cstdint>
#include <span>
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
  // GGML block types (GGUF models, docs/gguf.md): a row of n elements (n a multiple of
  // DTypeBlockElements) is n / DTypeBlockElements blocks of DTypeBlockBytes bytes, laid out as
  // ggml stores them (common/model/gguf_quants.h). Never in a safetensors file.
  kQ8_0 = 12,  // 32 elements in 34 bytes
  kQ5_0 = 13,  // 32 elements in 22 bytes
  kQ4_K = 14,  // 256 elements in 144 bytes
  kQ5_K = 15,  // 256 elements in 176 bytes
  kQ6_K = 16,  // 256 elements in 210 bytes
};

// Bytes per element; 0 for the block types (use DTypeBytes).
size_t DTypeSize(DType t);
// Whether `t` is a GGML block type (kQ8_0 ... kQ6_K).
bool IsBlockDType(DType t);
// Elements per block: 1 for element types.
int64_t DTypeBlockElements(DType t);
// Bytes per block: DTypeSize for element types.
size_t DTypeBlockBytes(DType t);
// Bytes of `n` consecutive elements (for a block type, n must be a multiple of the block).
inline size_t DTypeBytes(DType t, int64_t n) {
  return static_cast<size_t>(n / DTypeBlockElements(t)) * DTypeBlockBytes(t);
}
// Bytes of a row-major tensor of `shape` (for a block type the last dimension must be a multiple
// of the block: rows are whole blocks). False on overflow, a negative dimension or a last
// dimension that is not whole blocks.
bool TensorBytes(DType t, std::span<const int64_t> shape, uint64_t* bytes);
// The ggml type id of a GGUF-representable dtype (F32, F16, BF16 and the block types); -1
// otherwise.
int GgmlTypeIdOf(DType t);
// The dtype of ggml type id `ggml_type` when hybridmoe computes with it (F32, F16, BF16, Q8_0,
// Q5_0, Q4_K, Q5_K, Q6_K); InvalidArgument otherwise.
absl::StatusOr<DType> DTypeOfGgmlTypeId(uint32_t ggml_type);
// safetensors spelling: "F8_E4M3", "BF16", "F16", "F32", ...; ggml's for block types ("Q4_K").
std::string_view DTypeName(DType t);
// Parses a safetensors dtype string; InvalidArgument naming it for an unknown one (block type
// names included: safetensors has none).
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
// F16, F32, F64 and the block types (n a multiple of the block; DequantizeGgml, bit-exact with
// the gguf package); InvalidArgument otherwise.
absl::Status ConvertToFloat(DType t, const void* src, size_t n, float* dst);

}  // namespace hmoe
