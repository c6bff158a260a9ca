#include "common/model/dtype.h"

#include <array>
#include <cmath>
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"

#include "common/model/gguf_quants.h"

namespace hmoe {
namespace {

struct DTypeInfo {
  DType type;
  std::string_view name;
  size_t size;
};

constexpr DTypeInfo kDTypes[] = {
    {DType::kF8E4M3, "F8_E4M3", 1}, {DType::kBF16, "BF16", 2}, {DType::kF16, "F16", 2},
    {DType::kF32, "F32", 4},        {DType::kF64, "F64", 8},   {DType::kI8, "I8", 1},
    {DType::kU8, "U8", 1},          {DType::kI16, "I16", 2},   {DType::kI32, "I32", 4},
    {DType::kI64, "I64", 8},        {DType::kBool, "BOOL", 1}, {DType::kF8E5M2, "F8_E5M2", 1},
};

struct BlockDTypeInfo {
  DType type;
  std::string_view name;
  int64_t elements;
  size_t bytes;
  GgmlType ggml;
};

constexpr BlockDTypeInfo kBlockDTypes[] = {
    {DType::kQ8_0, "Q8_0", 32, 34, GgmlType::kQ8_0},
    {DType::kQ5_0, "Q5_0", 32, 22, GgmlType::kQ5_0},
    {DType::kQ4_K, "Q4_K", 256, 144, GgmlType::kQ4_K},
    {DType::kQ5_K, "Q5_K", 256, 176, GgmlType::kQ5_K},
    {DType::kQ6_K, "Q6_K", 256, 210, GgmlType::kQ6_K},
};

const BlockDTypeInfo* BlockInfo(DType t) {
  for (const BlockDTypeInfo& info : kBlockDTypes) {
    if (info.type == t) return &info;
  }
  return nullptr;
}

float DecodeE4M3(uint8_t code) {
  const bool negative = (code & 0x80) != 0;
  const int exponent = (code >> 3) & 0xf;
  const int mantissa = code & 0x7;
  float v;
  if (exponent == 0xf && mantissa == 0x7) {
    return std::numeric_limits<float>::quiet_NaN();
  } else if (exponent == 0) {
    v = std::ldexp(static_cast<float>(mantissa) / 8.0f, -6);
  } else {
    v = std::ldexp(1.0f + static_cast<float>(mantissa) / 8.0f, exponent - 7);
  }
  return negative ? -v : v;
}

const std::array<float, 256> kE4M3Table = [] {
  std::array<float, 256> t{};
  for (int i = 0; i < 256; ++i) t[i] = DecodeE4M3(static_cast<uint8_t>(i));
  return t;
}();

}  // namespace

size_t DTypeSize(DType t) {
  for (const DTypeInfo& info : kDTypes) {
    if (info.type == t) return info.size;
  }
  return 0;
}

bool IsBlockDType(DType t) { return BlockInfo(t) != nullptr; }

int64_t DTypeBlockElements(DType t) {
  const BlockDTypeInfo* b = BlockInfo(t);
  return b != nullptr ? b->elements : 1;
}

size_t DTypeBlockBytes(DType t) {
  const BlockDTypeInfo* b = BlockInfo(t);
  return b != nullptr ? b->bytes : DTypeSize(t);
}

bool TensorBytes(DType t, std::span<const int64_t> shape, uint64_t* bytes) {
  const int64_t block = DTypeBlockElements(t);
  if (block > 1 && (shape.empty() || shape.back() % block != 0)) return false;
  unsigned __int128 n = DTypeBlockBytes(t);
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] < 0) return false;
    n *= static_cast<uint64_t>(i + 1 == shape.size() ? shape[i] / block : shape[i]);
    if (n > std::numeric_limits<uint64_t>::max()) return false;
  }
  *bytes = static_cast<uint64_t>(n);
  return true;
}

int GgmlTypeIdOf(DType t) {
  if (const BlockDTypeInfo* b = BlockInfo(t); b != nullptr) return static_cast<int>(b->ggml);
  switch (t) {
    case DType::kF32:
      return static_cast<int>(GgmlType::kF32);
    case DType::kF16:
      return static_cast<int>(GgmlType::kF16);
    case DType::kBF16:
      return static_cast<int>(GgmlType::kBF16);
    default:
      return -1;
  }
}

absl::StatusOr<DType> DTypeOfGgmlTypeId(uint32_t ggml_type) {
  switch (static_cast<GgmlType>(ggml_type)) {
    case GgmlType::kF32:
      return DType::kF32;
    case GgmlType::kF16:
      return DType::kF16;
    case GgmlType::kBF16:
      return DType::kBF16;
    default:
      break;
  }
  for (const BlockDTypeInfo& info : kBlockDTypes) {
    if (static_cast<uint32_t>(info.ggml) == ggml_type) return info.type;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("ggml type ", GgmlTypeName(ggml_type),
                   " is not supported (supported: F32, F16, BF16, Q8_0, Q5_0, Q4_K, Q5_K, Q6_K)"));
}

std::string_view DTypeName(DType t) {
  for (const DTypeInfo& info : kDTypes) {
    if (info.type == t) return info.name;
  }
  if (const BlockDTypeInfo* b = BlockInfo(t); b != nullptr) return b->name;
  return "?";
}

absl::StatusOr<DType> ParseDType(std::string_view name) {
  for (const DTypeInfo& info : kDTypes) {
    if (info.name == name) return info.type;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown dtype \"", absl::string_view(name.data(), name.size()), "\""));
}

const float* Fp8E4M3Table() { return kE4M3Table.data(); }

uint8_t FloatToFp8E4M3(float f) {
  if (std::isnan(f)) return 0x7f;
  const uint8_t sign = std::signbit(f) ? 0x80 : 0x00;
  const float a = std::fabs(f);
  if (a >= 448.0f) return sign | 0x7e;
  // Codes 0x00..0x7E are monotone in value: binary-search the first code >= a, then pick the
  // nearer neighbour (ties to the even code, i.e. an even mantissa).
  int lo = 0, hi = 0x7e;
  while (lo < hi) {  // first code with value >= a
    const int mid = (lo + hi) / 2;
    if (kE4M3Table[mid] < a) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  int code = lo;
  if (code > 0) {
    const float above = kE4M3Table[code];
    const float below = kE4M3Table[code - 1];
    const float d_above = above - a;
    const float d_below = a - below;
    if (d_below < d_above || (d_below == d_above && ((code - 1) & 1) == 0)) code = code - 1;
  }
  return sign | static_cast<uint8_t>(code);
}

float F16ToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const int exponent = (h >> 10) & 0x1f;
  const uint32_t mantissa = h & 0x3ff;
  if (exponent == 0) {
    const float v = std::ldexp(static_cast<float>(mantissa), -24);
    return sign ? -v : v;
  }
  if (exponent == 0x1f) {
    return std::bit_cast<float>(sign | 0x7f800000u | (mantissa << 13));
  }
  return std::bit_cast<float>(sign | (static_cast<uint32_t>(exponent - 15 + 127) << 23) |
                              (mantissa << 13));
}

uint16_t FloatToF16(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7e00;   // NaN
  if (abs >= 0x477ff000u) return sign | 0x7c00;  // rounds to inf (>= 65520)
  if (abs < 0x38800000u) {                       // subnormal half (< 2^-14)
    // value / 2^-24, rounded to nearest even.
    const float scaled = std::bit_cast<float>(abs) * 16777216.0f;
    const float r = std::nearbyint(scaled);  // default rounding mode: nearest even
    return sign | static_cast<uint16_t>(r);
  }
  uint32_t m = abs + 0xfffu + ((abs >> 13) & 1u);  // round mantissa to 10 bits, ties to even
  m -= (127u - 15u) << 23;
  return sign | static_cast<uint16_t>(m >> 13);
}

absl::Status ConvertToFloat(DType t, const void* src, size_t n, float* dst) {
  const auto* bytes = static_cast<const uint8_t*>(src);
  switch (t) {
    case DType::kF8E4M3:
      for (size_t i = 0; i < n; ++i) dst[i] = kE4M3Table[bytes[i]];
      return absl::OkStatus();
    case DType::kBF16:
      for (size_t i = 0; i < n; ++i) {
        uint16_t v;
        std::memcpy(&v, bytes + 2 * i, 2);
        dst[i] = Bf16ToFloat(v);
      }
      return absl::OkStatus();
    case DType::kF16:
      for (size_t i = 0; i < n; ++i) {
        uint16_t v;
        std::memcpy(&v, bytes + 2 * i, 2);
        dst[i] = F16ToFloat(v);
      }
      return absl::OkStatus();
    case DType::kF32:
      std::memcpy(dst, bytes, n * 4);
      return absl::OkStatus();
    case DType::kF64:
      for (size_t i = 0; i < n; ++i) {
        double v;
        std::memcpy(&v, bytes + 8 * i, 8);
        dst[i] = static_cast<float>(v);
      }
      return absl::OkStatus();
    default: {
      if (const BlockDTypeInfo* b = BlockInfo(t); b != nullptr) {
        return DequantizeGgml(static_cast<uint32_t>(b->ggml), src, static_cast<int64_t>(n), dst);
      }
      const std::string_view name = DTypeName(t);
      return absl::InvalidArgumentError(absl::StrCat(
          "cannot convert dtype ", absl::string_view(name.data(), name.size()), " to float"));
    }
  }
}

}  // namespace hmoe
