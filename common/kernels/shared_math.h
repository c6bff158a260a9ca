#pragma once

// Scalar math shared by the CPU kernels and the CUDA kernels. Everything here compiles as host
// code with g++ and as __host__ __device__ code with nvcc, so the CPU tests exercise exactly the
// arithmetic the GPU kernels run. No CUDA or absl headers; no tables (device code cannot read
// host tables), only bit manipulation.

#include <cmath>
#include <cstdint>
#include <cstring>

#include "common/kernels/op_params.h"

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

// ---------------------------------------------------------------------------------- libm

// The math library on either side: CUDA's device functions in device code, <cmath> on the host.
// Deliberately the accurate functions (no __expf): these feed routing and softmax decisions.
HMOE_HOST_DEVICE inline double ExpD(double x) {
#if defined(__CUDA_ARCH__)
  return ::exp(x);
#else
  return std::exp(x);
#endif
}

HMOE_HOST_DEVICE inline float ExpF(float x) {
#if defined(__CUDA_ARCH__)
  return ::expf(x);
#else
  return std::exp(x);
#endif
}

HMOE_HOST_DEVICE inline double SqrtD(double x) {
#if defined(__CUDA_ARCH__)
  return ::sqrt(x);
#else
  return std::sqrt(x);
#endif
}

HMOE_HOST_DEVICE inline double CosD(double x) {
#if defined(__CUDA_ARCH__)
  return ::cos(x);
#else
  return std::cos(x);
#endif
}

HMOE_HOST_DEVICE inline double SinD(double x) {
#if defined(__CUDA_ARCH__)
  return ::sin(x);
#else
  return std::sin(x);
#endif
}

HMOE_HOST_DEVICE inline float NegInfinity() { return BitsToFloat(0xff800000u); }

// ---------------------------------------------------------------------------------- elements

// Element types of weights as the kernels see them (a subset of hmoe::DType, which device code
// cannot include).
enum class ElemType : uint8_t { kF32 = 0, kBF16 = 1, kF16 = 2, kF8E4M3 = 3 };

// IEEE half -> float, exact for every code (subnormals, infinities, NaN payloads).
HMOE_HOST_DEVICE inline float F16BitsToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0) {
    const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-08f;  // 2^-24
    return sign != 0 ? -magnitude : magnitude;
  }
  if (exponent == 0x1fu) return BitsToFloat(sign | 0x7f800000u | (mantissa << 13));
  return BitsToFloat(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

// Element i of an array of `type` at `data` (any alignment: bytes are copied) as float. FP8 gives
// the unscaled code value.
HMOE_HOST_DEVICE inline float LoadElementAsFloat(ElemType type, const void* data, int64_t i) {
  const unsigned char* p = static_cast<const unsigned char*>(data);
  switch (type) {
    case ElemType::kF32: {
      float f;
      std::memcpy(&f, p + 4 * i, sizeof(f));
      return f;
    }
    case ElemType::kBF16: {
      uint16_t b;
      std::memcpy(&b, p + 2 * i, sizeof(b));
      return Bf16BitsToFloat(b);
    }
    case ElemType::kF16: {
      uint16_t h;
      std::memcpy(&h, p + 2 * i, sizeof(h));
      return F16BitsToFloat(h);
    }
    case ElemType::kF8E4M3:
      return Fp8E4M3ToFloatBits(p[i]);
  }
  return BitsToFloat(0x7fc00000u);
}

// Element (row, col) of a weight matrix (row-major, `row_stride` elements between rows) as float:
// FP8 codes times their 128x128 block's scale (scale_inv[(row / 128) * scale_stride + col / 128]);
// other types converted exactly. This is what the CUDA backend feeds its GEMMs with (rounded to
// BF16 for FP8/BF16 weights).
HMOE_HOST_DEVICE inline float WeightElement(ElemType type, const void* data, int64_t row_stride,
                                            const float* scale_inv, int64_t scale_stride,
                                            int64_t row, int64_t col) {
  const int64_t i = row * row_stride + col;
  if (type == ElemType::kF8E4M3) {
    return DequantFp8Element(static_cast<const uint8_t*>(data)[i], scale_inv, scale_stride, row,
                             col);
  }
  return LoadElementAsFloat(type, data, i);
}

// ---------------------------------------------------------------------------------- RMSNorm

// 1 / sqrt(sum_squares / dim + eps), the sum of squares accumulated in double (as CpuDevice and
// the reference do), the factor rounded once to float.
HMOE_HOST_DEVICE inline float RmsNormInvRms(double sum_squares, int64_t dim, float eps) {
  return static_cast<float>(
      1.0 / SqrtD(sum_squares / static_cast<double>(dim) + static_cast<double>(eps)));
}

// One output element of RMSNorm: weight * (x * inv_rms), in float (CpuDevice's rounding).
HMOE_HOST_DEVICE inline float RmsNormApply(float x, float inv_rms, float weight) {
  return weight * (x * inv_rms);
}

// ---------------------------------------------------------------------------------- RoPE

// cos and sin of rotary pair i at position `pos` (angle pos * inv_freq[i] in double, as the
// reference's ApplyRopeInterleaved), times YaRN's attention factor.
HMOE_HOST_DEVICE inline void RopeCosSin(int64_t pos, float inv_freq, float attention_factor,
                                        double* cos_out, double* sin_out) {
  const double angle = static_cast<double>(pos) * static_cast<double>(inv_freq);
  *cos_out = CosD(angle) * static_cast<double>(attention_factor);
  *sin_out = SinD(angle) * static_cast<double>(attention_factor);
}

// Rotates the interleaved pair (x0, x1) in place: (x0 c - x1 s, x0 s + x1 c), in double.
HMOE_HOST_DEVICE inline void RopeRotatePair(float* x0, float* x1, double c, double s) {
  const double a = *x0;
  const double b = *x1;
  *x0 = static_cast<float>(a * c - b * s);
  *x1 = static_cast<float>(a * s + b * c);
}

// ---------------------------------------------------------------------------------- softmax

// One step of an online (flash-style) softmax over blocks of scores. Folds the `n` scores of the
// next block (masked entries are -infinity) into a row's running maximum and running sum of
// exponentials, replaces each score by its unnormalized probability exp(score - new max) (0 for
// -infinity), and returns the factor by which the row's accumulator of earlier blocks must be
// multiplied before this block's contributions are added (1 when the maximum did not change, or
// when the block is fully masked). Start with running_max = -infinity, running_sum = 0; after the
// last block, probabilities are accumulator / running_sum.
HMOE_HOST_DEVICE inline float OnlineSoftmaxStep(float* running_max, float* running_sum,
                                                float* scores, int64_t n) {
  const float neg_inf = NegInfinity();
  float block_max = neg_inf;
  for (int64_t i = 0; i < n; ++i) block_max = scores[i] > block_max ? scores[i] : block_max;
  if (block_max == neg_inf) {
    for (int64_t i = 0; i < n; ++i) scores[i] = 0.0f;
    return 1.0f;
  }
  const float old_max = *running_max;
  const float new_max = block_max > old_max ? block_max : old_max;
  const float correction = old_max == neg_inf ? 0.0f : ExpF(old_max - new_max);
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    scores[i] = scores[i] == neg_inf ? 0.0f : ExpF(scores[i] - new_max);
    sum += scores[i];
  }
  *running_sum = *running_sum * correction + sum;
  *running_max = new_max;
  return correction;
}

// ---------------------------------------------------------------------------------- MoE gate

// Bytes of scratch MoeGateSelect needs (8-byte aligned memory).
HMOE_HOST_DEVICE inline int64_t MoeGateScratchBytes(int64_t num_experts, int64_t n_group) {
  return 8 * n_group + 8 * num_experts + num_experts + n_group;
}

// noaux_tc selection for one token, the same decisions and weights as reference::MoeGate given the
// same logits: s = sigmoid(logit) (in double, rounded to float) gives the weights; b = s + bias
// (bias may be null) is used only for selection: group score = the sum (in double) of the two
// largest b of the group (the largest alone for one-expert groups), the topk_group best groups are
// kept (ties: lower group), and the K largest b of the kept groups are chosen in descending order
// (ties: lower id). weights[k] = s / (sum of the K s + 1e-20) when norm_topk_prob, times
// routed_scaling_factor. A single thread's scalar loops over small arrays (E is a few hundred):
// O(E * (K + topk_group)) comparisons. `scratch`: MoeGateScratchBytes, 8-byte aligned.
HMOE_HOST_DEVICE inline void MoeGateSelect(const float* logits, const float* bias,
                                           const MoeGateParams& config, void* scratch, int32_t* ids,
                                           float* weights) {
  const int64_t num_experts = config.num_experts;
  const int64_t n_group = config.n_group;
  const int64_t group_size = num_experts / n_group;
  unsigned char* p = static_cast<unsigned char*>(scratch);
  double* group_score = reinterpret_cast<double*>(p);
  p += 8 * n_group;
  float* scores = reinterpret_cast<float*>(p);
  p += 4 * num_experts;
  float* selectable = reinterpret_cast<float*>(p);
  p += 4 * num_experts;
  unsigned char* chosen = p;
  p += num_experts;
  unsigned char* kept = p;
  const float neg_inf = NegInfinity();

  for (int64_t e = 0; e < num_experts; ++e) {
    scores[e] = static_cast<float>(1.0 / (1.0 + ExpD(-static_cast<double>(logits[e]))));
    selectable[e] = scores[e] + (bias != nullptr ? bias[e] : 0.0f);
    chosen[e] = 0;
  }
  for (int64_t g = 0; g < n_group; ++g) {
    float best = neg_inf;
    float second = neg_inf;
    for (int64_t e = g * group_size; e < (g + 1) * group_size; ++e) {
      const float v = selectable[e];
      if (v > best) {
        second = best;
        best = v;
      } else if (v > second) {
        second = v;
      }
    }
    group_score[g] = group_size >= 2 ? static_cast<double>(best) + static_cast<double>(second)
                                     : static_cast<double>(best);
    kept[g] = 0;
  }
  for (int64_t k = 0; k < config.topk_group; ++k) {
    int64_t best = -1;
    for (int64_t g = 0; g < n_group; ++g) {
      if (kept[g] == 0 && (best < 0 || group_score[g] > group_score[best])) best = g;
    }
    kept[best] = 1;
  }
  for (int64_t e = 0; e < num_experts; ++e) {
    if (kept[e / group_size] == 0) selectable[e] = neg_inf;
  }
  double sum = 0.0;
  for (int64_t k = 0; k < config.top_k; ++k) {
    int64_t best = -1;
    for (int64_t e = 0; e < num_experts; ++e) {
      if (chosen[e] == 0 && (best < 0 || selectable[e] > selectable[best])) best = e;
    }
    chosen[best] = 1;
    ids[k] = static_cast<int32_t>(best);
    sum += static_cast<double>(scores[best]);
  }
  for (int64_t k = 0; k < config.top_k; ++k) {
    double w = static_cast<double>(scores[ids[k]]);
    if (config.norm_topk_prob) w /= (sum + 1e-20);
    weights[k] = static_cast<float>(w * config.routed_scaling_factor);
  }
}

}  // namespace hmoe::kernels
