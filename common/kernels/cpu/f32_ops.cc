#include "common/kernels/cpu/f32_ops.h"

#include <cmath>
#include <cstdlib>
#include <cstring>

#include "common/kernels/cpu/fp8_gemv.h"

namespace hmoe::cpu {
namespace {

bool DetectAvx512() {
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw") ||
      !__builtin_cpu_supports("avx512vl")) {
    return false;
  }
  // The FP8 kernels' choice (HMOE_CPU_ISA lowers it). AVX-512 F/BW/VL suffice here, so a CPU
  // without VBMI (whose FP8 kernels are the AVX2 ones) still gets these unless lowered by hand.
  const cpu::CpuIsa isa = cpu::BestCpuIsa();
  if (isa >= cpu::CpuIsa::kAvx512) return true;
  const char* env = std::getenv("HMOE_CPU_ISA");
  return env == nullptr || (std::strcmp(env, "scalar") != 0 && std::strcmp(env, "avx2") != 0);
}

const bool kUseAvx512 = DetectAvx512();

}  // namespace

bool F32OpsUseAvx512() { return kUseAvx512; }

float DotF32(const float* a, const float* b, int64_t n) {
  if (kUseAvx512) return internal::DotF32Avx512(a, b, n);
  float acc = 0.0f;
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

void Dot4F32(const float* q, int64_t q_stride, const float* k, int64_t n, float* out) {
  if (kUseAvx512) return internal::Dot4F32Avx512(q, q_stride, k, n, out);
  for (int j = 0; j < 4; ++j) out[j] = DotF32(q + j * q_stride, k, n);
}

void AxpyF32(float a, const float* x, float* y, int64_t n) {
  if (kUseAvx512) return internal::AxpyF32Avx512(a, x, y, n);
  // Fused like the AVX-512 variant: every variant rounds each update once, identically.
  for (int64_t i = 0; i < n; ++i) y[i] = std::fma(a, x[i], y[i]);
}

void Axpy4F32(const float* a, const float* x, float* y, int64_t y_stride, int64_t n) {
  if (kUseAvx512) return internal::Axpy4F32Avx512(a, x, y, y_stride, n);
  for (int j = 0; j < 4; ++j) AxpyF32(a[j], x, y + j * y_stride, n);
}

float DotBf16F32(const std::byte* w, const float* x, int64_t n) {
  if (kUseAvx512) return internal::DotBf16F32Avx512(w, x, n);
  float acc = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    uint16_t b;
    std::memcpy(&b, w + 2 * i, sizeof(b));
    uint32_t u = static_cast<uint32_t>(b) << 16;
    float f;
    std::memcpy(&f, &u, sizeof(f));
    acc += f * x[i];
  }
  return acc;
}

void MatVecF32(const float* w, int64_t row_stride, int64_t cols, const float* x, int64_t x_stride,
               int64_t n, int64_t m_begin, int64_t m_end, float* y, int64_t y_stride) {
  for (int64_t m = m_begin; m < m_end; ++m) {
    const float* row = w + m * row_stride;
    int64_t t = 0;
    for (; t + 4 <= n; t += 4) {
      float out[4];
      Dot4F32(x + t * x_stride, x_stride, row, cols, out);
      for (int j = 0; j < 4; ++j) y[(t + j) * y_stride + (m - m_begin)] = out[j];
    }
    for (; t < n; ++t) y[t * y_stride + (m - m_begin)] = DotF32(x + t * x_stride, row, cols);
  }
}

}  // namespace hmoe::cpu
