#pragma once

// ggml tensor types as GGUF files store them: the type ids, the block layouts of the types we
// read (F32, F16, BF16, Q8_0, Q5_0, Q4_K, Q5_K, Q6_K), a scalar dequantizer written from the
// format definition (MODEL-SPEC 5.4; docs/gguf.md) and our own simple quantizers for the types
// hmoe-make-model writes (Q8_0, Q4_K, Q5_K, Q6_K).
//
// The dequantizer computes every value with the same float32 operations, in the same order, as
// the `gguf` Python package's gguf.quants.dequantize, so the two agree bit for bit (checked by
// tests/model/gguf_oracle_test.py). This file is compiled with -ffp-contract=off so that no
// multiply-add is fused.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "absl/status/status.h"

namespace hmoe {

// ggml_type ids (ggml.h / gguf-py GGMLQuantizationType).
enum class GgmlType : uint32_t {
  kF32 = 0,
  kF16 = 1,
  kQ4_0 = 2,
  kQ4_1 = 3,
  kQ5_0 = 6,
  kQ5_1 = 7,
  kQ8_0 = 8,
  kQ8_1 = 9,
  kQ2_K = 10,
  kQ3_K = 11,
  kQ4_K = 12,
  kQ5_K = 13,
  kQ6_K = 14,
  kQ8_K = 15,
  kIQ2_XXS = 16,
  kIQ2_XS = 17,
  kIQ3_XXS = 18,
  kIQ1_S = 19,
  kIQ4_NL = 20,
  kIQ3_S = 21,
  kIQ2_S = 22,
  kIQ4_XS = 23,
  kI8 = 24,
  kI16 = 25,
  kI32 = 26,
  kI64 = 27,
  kF64 = 28,
  kIQ1_M = 29,
  kBF16 = 30,
  kTQ1_0 = 34,
  kTQ2_0 = 35,
  kMXFP4 = 39,
};

// Weights per block of the k-quants.
inline constexpr int64_t kQK_K = 256;

// Block layouts, packed exactly as ggml stores them (little-endian; `d`, `dmin` are IEEE fp16).
struct BlockQ8_0 {  // y[i] = d * qs[i]
  uint16_t d;
  int8_t qs[32];
};
struct BlockQ5_0 {  // y[j] = d * ((qs[j] & 15 | bit j of qh << 4) - 16), y[j+16] with the high
                    // nibble
  uint16_t d;
  uint8_t qh[4];
  uint8_t qs[16];
};
struct BlockQ4_K {  // 8 sub-blocks of 32: y = d * sc * q - dmin * m, 6-bit (sc, m) packed in scales
  uint16_t d;
  uint16_t dmin;
  uint8_t scales[12];
  uint8_t qs[128];
};
struct BlockQ5_K {  // as Q4_K with a fifth bit per weight in qh (bit j of qh[l]: sub-block j)
  uint16_t d;
  uint16_t dmin;
  uint8_t scales[12];
  uint8_t qh[32];
  uint8_t qs[128];
};
struct BlockQ6_K {  // 16 sub-blocks of 16: y = d * scales[i / 16] * (q - 32), q 6 bits
  uint8_t ql[128];
  uint8_t qh[64];
  int8_t scales[16];
  uint16_t d;
};
static_assert(sizeof(BlockQ8_0) == 34);
static_assert(sizeof(BlockQ5_0) == 22);
static_assert(sizeof(BlockQ4_K) == 144);
static_assert(sizeof(BlockQ5_K) == 176);
static_assert(sizeof(BlockQ6_K) == 210);

// Weights per block and bytes per block of a ggml type.
struct GgmlTypeSize {
  int64_t block_size = 1;
  int64_t type_size = 0;
};
// Every type id ggml defines (so a file holding other types still parses); nullopt for an id
// that is not a ggml type.
std::optional<GgmlTypeSize> GgmlTypeSizeOf(uint32_t type);
// "Q4_K", "BF16", ...; "type <id>" for an unknown id.
std::string GgmlTypeName(uint32_t type);
// Whether DequantizeGgml supports the type: F32, F16, BF16, Q8_0, Q5_0, Q4_K, Q5_K, Q6_K.
bool GgmlTypeDequantizable(uint32_t type);
// Whether QuantizeGgml supports the type: F32, F16, BF16, Q8_0, Q4_K, Q5_K, Q6_K.
bool GgmlTypeQuantizable(uint32_t type);

// Bytes of `n` elements of `type`. InvalidArgument when the type is unknown or `n` is not a
// multiple of its block size.
absl::Status GgmlBytes(uint32_t type, int64_t n, size_t* bytes);

// Dequantizes `n` elements (a multiple of the block size) from `src` (any alignment) to `dst`.
// InvalidArgument naming the type when it is not supported or `n` is not a block multiple.
absl::Status DequantizeGgml(uint32_t type, const void* src, int64_t n, float* dst);

// Quantizes `n` elements (a multiple of the block size) of `src` into `dst` (GgmlBytes bytes).
// Simple round-to-nearest quantizers (no search for the best scale as llama.cpp's quantize does);
// each keeps every weight within a stated bound of its input (finite inputs):
//   Q8_0: d = amax/127 (fp16, rounded up), q = round(x/d): |err| <= d/2.
//   Q6_K: per 16 weights s = amax/31; d = max s / 127 (fp16, rounded up), sc = ceil(s/d) <= 127,
//         q = round(x/(d*sc)) in [-31, 31]: |err| <= d*sc/2.
//   Q4_K / Q5_K: per 32 weights lo = min(0, min x), s = (max x - lo)/L (L = 15 / 31);
//         d = max s / 63, dmin = max(-lo) / 63 (fp16, rounded up); sc = ceil(s/d) <= 63,
//         m = round(-lo/dmin) <= 63, q = clamp(round((x + dmin*m)/(d*sc)), 0, L):
//         |err| <= d*sc/2 + dmin/2.
//   F32 / F16 / BF16: conversion with round to nearest even.
// InvalidArgument for other types or a bad `n`.
absl::Status QuantizeGgml(uint32_t type, const float* src, int64_t n, void* dst);

}  // namespace hmoe
