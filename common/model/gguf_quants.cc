#include "common/model/gguf_quants.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"

#include "common/model/dtype.h"

namespace hmoe {
namespace {

struct TypeEntry {
  GgmlType type;
  const char* name;
  int64_t block_size;
  int64_t type_size;
};

// ggml's type table (ggml.c type_traits; gguf-py GGML_QUANT_SIZES).
constexpr TypeEntry kTypes[] = {
    {GgmlType::kF32, "F32", 1, 4},
    {GgmlType::kF16, "F16", 1, 2},
    {GgmlType::kQ4_0, "Q4_0", 32, 18},
    {GgmlType::kQ4_1, "Q4_1", 32, 20},
    {GgmlType::kQ5_0, "Q5_0", 32, 22},
    {GgmlType::kQ5_1, "Q5_1", 32, 24},
    {GgmlType::kQ8_0, "Q8_0", 32, 34},
    {GgmlType::kQ8_1, "Q8_1", 32, 40},
    {GgmlType::kQ2_K, "Q2_K", 256, 84},
    {GgmlType::kQ3_K, "Q3_K", 256, 110},
    {GgmlType::kQ4_K, "Q4_K", 256, 144},
    {GgmlType::kQ5_K, "Q5_K", 256, 176},
    {GgmlType::kQ6_K, "Q6_K", 256, 210},
    {GgmlType::kQ8_K, "Q8_K", 256, 292},
    {GgmlType::kIQ2_XXS, "IQ2_XXS", 256, 66},
    {GgmlType::kIQ2_XS, "IQ2_XS", 256, 74},
    {GgmlType::kIQ3_XXS, "IQ3_XXS", 256, 98},
    {GgmlType::kIQ1_S, "IQ1_S", 256, 50},
    {GgmlType::kIQ4_NL, "IQ4_NL", 32, 18},
    {GgmlType::kIQ3_S, "IQ3_S", 256, 110},
    {GgmlType::kIQ2_S, "IQ2_S", 256, 82},
    {GgmlType::kIQ4_XS, "IQ4_XS", 256, 136},
    {GgmlType::kI8, "I8", 1, 1},
    {GgmlType::kI16, "I16", 1, 2},
    {GgmlType::kI32, "I32", 1, 4},
    {GgmlType::kI64, "I64", 1, 8},
    {GgmlType::kF64, "F64", 1, 8},
    {GgmlType::kIQ1_M, "IQ1_M", 256, 56},
    {GgmlType::kBF16, "BF16", 1, 2},
    {GgmlType::kTQ1_0, "TQ1_0", 256, 54},
    {GgmlType::kTQ2_0, "TQ2_0", 256, 66},
    {GgmlType::kMXFP4, "MXFP4", 32, 17},
};

const TypeEntry* FindType(uint32_t type) {
  for (const TypeEntry& e : kTypes) {
    if (static_cast<uint32_t>(e.type) == type) return &e;
  }
  return nullptr;
}

uint16_t LoadU16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

// The 6-bit scale and min of sub-block j of a Q4_K/Q5_K block (MODEL-SPEC 5.4).
void ScaleMinK4(int j, const uint8_t* q, uint8_t* sc, uint8_t* m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = static_cast<uint8_t>((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
    *m = static_cast<uint8_t>((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
  }
}

// Float operations below mirror gguf.quants (numpy float32): each product is rounded on its own.
void DequantQ8_0(const uint8_t* src, int64_t nb, float* y) {
  for (int64_t b = 0; b < nb; ++b, src += sizeof(BlockQ8_0), y += 32) {
    const float d = F16ToFloat(LoadU16(src));
    for (int i = 0; i < 32; ++i) y[i] = static_cast<float>(static_cast<int8_t>(src[2 + i])) * d;
  }
}

void DequantQ5_0(const uint8_t* src, int64_t nb, float* y) {
  for (int64_t b = 0; b < nb; ++b, src += sizeof(BlockQ5_0), y += 32) {
    const float d = F16ToFloat(LoadU16(src));
    uint32_t qh;
    std::memcpy(&qh, src + 2, 4);
    const uint8_t* qs = src + 6;
    for (int j = 0; j < 16; ++j) {
      const int lo = (qs[j] & 15) | static_cast<int>(((qh >> j) & 1) << 4);
      const int hi = (qs[j] >> 4) | static_cast<int>(((qh >> (j + 16)) & 1) << 4);
      y[j] = d * static_cast<float>(lo - 16);
      y[j + 16] = d * static_cast<float>(hi - 16);
    }
  }
}

void DequantQ4_K(const uint8_t* src, int64_t nb, float* y) {
  for (int64_t b = 0; b < nb; ++b, src += sizeof(BlockQ4_K), y += kQK_K) {
    const float d = F16ToFloat(LoadU16(src));
    const float dmin = F16ToFloat(LoadU16(src + 2));
    const uint8_t* scales = src + 4;
    const uint8_t* qs = src + 16;
    for (int j = 0; j < 8; ++j) {
      uint8_t sc, m;
      ScaleMinK4(j, scales, &sc, &m);
      const float dl = d * static_cast<float>(sc);
      const float ml = dmin * static_cast<float>(m);
      const uint8_t* q = qs + 32 * (j / 2);
      const int shift = 4 * (j % 2);
      for (int l = 0; l < 32; ++l) {
        const float prod = dl * static_cast<float>((q[l] >> shift) & 15);
        y[32 * j + l] = prod - ml;
      }
    }
  }
}

void DequantQ5_K(const uint8_t* src, int64_t nb, float* y) {
  for (int64_t b = 0; b < nb; ++b, src += sizeof(BlockQ5_K), y += kQK_K) {
    const float d = F16ToFloat(LoadU16(src));
    const float dmin = F16ToFloat(LoadU16(src + 2));
    const uint8_t* scales = src + 4;
    const uint8_t* qh = src + 16;
    const uint8_t* qs = src + 48;
    for (int j = 0; j < 8; ++j) {
      uint8_t sc, m;
      ScaleMinK4(j, scales, &sc, &m);
      const float dl = d * static_cast<float>(sc);
      const float ml = dmin * static_cast<float>(m);
      const uint8_t* q = qs + 32 * (j / 2);
      const int shift = 4 * (j % 2);
      for (int l = 0; l < 32; ++l) {
        const int v = ((q[l] >> shift) & 15) | (((qh[l] >> j) & 1) << 4);
        const float prod = dl * static_cast<float>(v);
        y[32 * j + l] = prod - ml;
      }
    }
  }
}

void DequantQ6_K(const uint8_t* src, int64_t nb, float* y) {
  for (int64_t b = 0; b < nb; ++b, src += sizeof(BlockQ6_K), y += kQK_K) {
    const uint8_t* ql = src;
    const uint8_t* qh = src + 128;
    const int8_t* sc = reinterpret_cast<const int8_t*>(src + 192);
    const float d = F16ToFloat(LoadU16(src + 208));
    for (int half = 0; half < 2; ++half) {
      for (int u = 0; u < 4; ++u) {  // 32-weight groups of this half: low/high nibble x 2 rows
        const int shift = 4 * (u / 2);
        const uint8_t* l4 = ql + 64 * half + 32 * (u % 2);
        const uint8_t* h2 = qh + 32 * half;
        for (int l = 0; l < 32; ++l) {
          const int i = 128 * half + 32 * u + l;
          const int q = (((l4[l] >> shift) & 15) | (((h2[l] >> (2 * u)) & 3) << 4)) - 32;
          const float ds = d * static_cast<float>(sc[i / 16]);
          y[i] = ds * static_cast<float>(q);
        }
      }
    }
  }
}

// fp16 of `v` (>= 0), rounded up so that the stored scale is never below `v`.
uint16_t F16RoundUp(float v) {
  uint16_t h = FloatToF16(v);
  if (F16ToFloat(h) < v && h < 0x7BFF) ++h;
  return h;
}

void StoreU16(uint8_t* p, uint16_t v) { std::memcpy(p, &v, 2); }

void QuantQ8_0(const float* x, int64_t nb, uint8_t* dst) {
  for (int64_t b = 0; b < nb; ++b, x += 32, dst += sizeof(BlockQ8_0)) {
    float amax = 0.0f;
    for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[i]));
    const uint16_t dh = F16RoundUp(amax / 127.0f);
    const float d = F16ToFloat(dh);
    StoreU16(dst, dh);
    for (int i = 0; i < 32; ++i) {
      const float q = d > 0.0f ? std::nearbyint(x[i] / d) : 0.0f;
      dst[2 + i] = static_cast<uint8_t>(static_cast<int8_t>(std::clamp(q, -127.0f, 127.0f)));
    }
  }
}

void QuantQ6_K(const float* x, int64_t nb, uint8_t* dst) {
  for (int64_t b = 0; b < nb; ++b, x += kQK_K, dst += sizeof(BlockQ6_K)) {
    float s[16];
    float smax = 0.0f;
    for (int j = 0; j < 16; ++j) {
      float amax = 0.0f;
      for (int l = 0; l < 16; ++l) amax = std::max(amax, std::fabs(x[16 * j + l]));
      s[j] = amax / 31.0f;
      smax = std::max(smax, s[j]);
    }
    const uint16_t dh = F16RoundUp(smax / 127.0f);
    const float d = F16ToFloat(dh);
    uint8_t* ql = dst;
    uint8_t* qh = dst + 128;
    int8_t* sc = reinterpret_cast<int8_t*>(dst + 192);
    std::memset(dst, 0, sizeof(BlockQ6_K));
    StoreU16(dst + 208, dh);
    uint8_t q[kQK_K];
    for (int j = 0; j < 16; ++j) {
      const float scj = d > 0.0f ? std::min(127.0f, std::ceil(s[j] / d)) : 0.0f;
      sc[j] = static_cast<int8_t>(scj);
      const float step = d * scj;
      for (int l = 0; l < 16; ++l) {
        const float v = step > 0.0f ? std::nearbyint(x[16 * j + l] / step) : 0.0f;
        q[16 * j + l] = static_cast<uint8_t>(std::clamp(v, -32.0f, 31.0f) + 32.0f);
      }
    }
    for (int half = 0; half < 2; ++half) {
      for (int u = 0; u < 4; ++u) {
        const int shift = 4 * (u / 2);
        uint8_t* l4 = ql + 64 * half + 32 * (u % 2);
        uint8_t* h2 = qh + 32 * half;
        for (int l = 0; l < 32; ++l) {
          const uint8_t v = q[128 * half + 32 * u + l];
          l4[l] |= static_cast<uint8_t>((v & 15) << shift);
          h2[l] |= static_cast<uint8_t>((v >> 4) << (2 * u));
        }
      }
    }
  }
}

// Q4_K (levels 15) and Q5_K (levels 31).
void QuantK4K5(const float* x, int64_t nb, uint8_t* dst, bool five_bits) {
  const float levels = five_bits ? 31.0f : 15.0f;
  const size_t block_bytes = five_bits ? sizeof(BlockQ5_K) : sizeof(BlockQ4_K);
  for (int64_t b = 0; b < nb; ++b, x += kQK_K, dst += block_bytes) {
    float s[8], lo[8];
    float smax = 0.0f, mmax = 0.0f;
    for (int j = 0; j < 8; ++j) {
      float mn = 0.0f, mx = 0.0f;
      for (int l = 0; l < 32; ++l) {
        mn = std::min(mn, x[32 * j + l]);
        mx = std::max(mx, x[32 * j + l]);
      }
      lo[j] = mn;
      s[j] = (mx - mn) / levels;
      smax = std::max(smax, s[j]);
      mmax = std::max(mmax, -mn);
    }
    const uint16_t dh = F16RoundUp(smax / 63.0f);
    const uint16_t mh = F16RoundUp(mmax / 63.0f);
    const float d = F16ToFloat(dh), dmin = F16ToFloat(mh);
    std::memset(dst, 0, block_bytes);
    StoreU16(dst, dh);
    StoreU16(dst + 2, mh);
    uint8_t* scales = dst + 4;
    uint8_t* qh = five_bits ? dst + 16 : nullptr;
    uint8_t* qs = dst + (five_bits ? 48 : 16);
    for (int j = 0; j < 8; ++j) {
      const uint8_t sc =
          static_cast<uint8_t>(d > 0.0f ? std::min(63.0f, std::ceil(s[j] / d)) : 0.0f);
      const uint8_t m =
          static_cast<uint8_t>(dmin > 0.0f ? std::min(63.0f, std::nearbyint(-lo[j] / dmin)) : 0.0f);
      if (j < 4) {
        scales[j] |= sc;
        scales[j + 4] |= m;
      } else {
        scales[j + 4] = static_cast<uint8_t>((sc & 15) | ((m & 15) << 4));
        scales[j - 4] |= static_cast<uint8_t>((sc >> 4) << 6);
        scales[j] |= static_cast<uint8_t>((m >> 4) << 6);
      }
      const float step = d * static_cast<float>(sc);
      const float offset = dmin * static_cast<float>(m);
      uint8_t* q = qs + 32 * (j / 2);
      const int shift = 4 * (j % 2);
      for (int l = 0; l < 32; ++l) {
        const float v = step > 0.0f ? std::nearbyint((x[32 * j + l] + offset) / step) : 0.0f;
        const uint8_t qi = static_cast<uint8_t>(std::clamp(v, 0.0f, levels));
        q[l] |= static_cast<uint8_t>((qi & 15) << shift);
        if (five_bits) qh[l] |= static_cast<uint8_t>((qi >> 4) << j);
      }
    }
  }
}

}  // namespace

std::optional<GgmlTypeSize> GgmlTypeSizeOf(uint32_t type) {
  const TypeEntry* e = FindType(type);
  if (e == nullptr) return std::nullopt;
  return GgmlTypeSize{e->block_size, e->type_size};
}

std::string GgmlTypeName(uint32_t type) {
  const TypeEntry* e = FindType(type);
  return e != nullptr ? std::string(e->name) : absl::StrCat("type ", type);
}

bool GgmlTypeDequantizable(uint32_t type) {
  switch (static_cast<GgmlType>(type)) {
    case GgmlType::kF32:
    case GgmlType::kF16:
    case GgmlType::kBF16:
    case GgmlType::kQ8_0:
    case GgmlType::kQ5_0:
    case GgmlType::kQ4_K:
    case GgmlType::kQ5_K:
    case GgmlType::kQ6_K:
      return true;
    default:
      return false;
  }
}

bool GgmlTypeQuantizable(uint32_t type) {
  return GgmlTypeDequantizable(type) && type != static_cast<uint32_t>(GgmlType::kQ5_0);
}

absl::Status GgmlBytes(uint32_t type, int64_t n, size_t* bytes) {
  const TypeEntry* e = FindType(type);
  if (e == nullptr) return absl::InvalidArgumentError(absl::StrCat("unknown ggml type ", type));
  if (n < 0 || n % e->block_size != 0) {
    return absl::InvalidArgumentError(absl::StrCat(n, " elements are not a whole number of ",
                                                   e->name, " blocks of ", e->block_size));
  }
  *bytes = static_cast<size_t>(n / e->block_size) * static_cast<size_t>(e->type_size);
  return absl::OkStatus();
}

absl::Status DequantizeGgml(uint32_t type, const void* src, int64_t n, float* dst) {
  if (!GgmlTypeDequantizable(type)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ggml type ", GgmlTypeName(type),
        " is not supported (supported: F32, F16, BF16, Q8_0, Q5_0, Q4_K, Q5_K, Q6_K)"));
  }
  size_t bytes = 0;
  if (absl::Status s = GgmlBytes(type, n, &bytes); !s.ok()) return s;
  const auto* p = static_cast<const uint8_t*>(src);
  const int64_t nb = n / GgmlTypeSizeOf(type)->block_size;
  switch (static_cast<GgmlType>(type)) {
    case GgmlType::kF32:
      std::memcpy(dst, src, bytes);
      break;
    case GgmlType::kF16:
      return ConvertToFloat(DType::kF16, src, static_cast<size_t>(n), dst);
    case GgmlType::kBF16:
      return ConvertToFloat(DType::kBF16, src, static_cast<size_t>(n), dst);
    case GgmlType::kQ8_0:
      DequantQ8_0(p, nb, dst);
      break;
    case GgmlType::kQ5_0:
      DequantQ5_0(p, nb, dst);
      break;
    case GgmlType::kQ4_K:
      DequantQ4_K(p, nb, dst);
      break;
    case GgmlType::kQ5_K:
      DequantQ5_K(p, nb, dst);
      break;
    case GgmlType::kQ6_K:
      DequantQ6_K(p, nb, dst);
      break;
    default:
      break;
  }
  return absl::OkStatus();
}

absl::Status QuantizeGgml(uint32_t type, const float* src, int64_t n, void* dst) {
  if (!GgmlTypeQuantizable(type)) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot quantize to ggml type ", GgmlTypeName(type),
                     " (supported: F32, F16, BF16, Q8_0, Q4_K, Q5_K, Q6_K)"));
  }
  size_t bytes = 0;
  if (absl::Status s = GgmlBytes(type, n, &bytes); !s.ok()) return s;
  auto* out = static_cast<uint8_t*>(dst);
  const int64_t nb = n / GgmlTypeSizeOf(type)->block_size;
  switch (static_cast<GgmlType>(type)) {
    case GgmlType::kF32:
      std::memcpy(dst, src, bytes);
      break;
    case GgmlType::kF16:
      for (int64_t i = 0; i < n; ++i) StoreU16(out + 2 * i, FloatToF16(src[i]));
      break;
    case GgmlType::kBF16:
      for (int64_t i = 0; i < n; ++i) StoreU16(out + 2 * i, FloatToBf16(src[i]));
      break;
    case GgmlType::kQ8_0:
      QuantQ8_0(src, nb, out);
      break;
    case GgmlType::kQ4_K:
      QuantK4K5(src, nb, out, /*five_bits=*/false);
      break;
    case GgmlType::kQ5_K:
      QuantK4K5(src, nb, out, /*five_bits=*/true);
      break;
    case GgmlType::kQ6_K:
      QuantQ6_K(src, nb, out);
      break;
    default:
      break;
  }
  return absl::OkStatus();
}

}  // namespace hmoe
