#include "common/kernels/cpu/f32_ops.h"

#include <cmath>
#include <cstdlib>
#include <cstring>

#include "common/kernels/cpu/fp8_gemv.h"

namespace hmoe::cpu {
namespace {

// AVX-512 F/BW/VL suffice here, so a CPU without VBMI (whose FP8 kernels are the AVX2 ones) still
// gets the AVX-512 variant unless HMOE_CPU_ISA lowers it by hand.
CpuIsa DetectIsa() {
  __builtin_cpu_init();
  const cpu::CpuIsa best = cpu::BestCpuIsa();  // honours HMOE_CPU_ISA
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl")) {
    if (best >= cpu::CpuIsa::kAvx512) return CpuIsa::kAvx512;
    const char* env = std::getenv("HMOE_CPU_ISA");
    if (env == nullptr || (std::strcmp(env, "scalar") != 0 && std::strcmp(env, "avx2") != 0)) {
      return CpuIsa::kAvx512;
    }
  }
  return best >= cpu::CpuIsa::kAvx2 ? CpuIsa::kAvx2 : CpuIsa::kScalar;
}

const CpuIsa kIsa = DetectIsa();

}  // namespace

namespace internal {

float DotF32Scalar(const float* a, const float* b, int64_t n) {
  float acc = 0.0f;
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

void Dot4F32Scalar(const float* q, int64_t q_stride, const float* k, int64_t n, float* out) {
  for (int j = 0; j < 4; ++j) out[j] = DotF32Scalar(q + j * q_stride, k, n);
}

void AxpyF32Scalar(float a, const float* x, float* y, int64_t n) {
  // Fused like the vector variants: every variant rounds each update once, identically.
  for (int64_t i = 0; i < n; ++i) y[i] = std::fma(a, x[i], y[i]);
}

void Axpy4F32Scalar(const float* a, const float* x, float* y, int64_t y_stride, int64_t n) {
  for (int j = 0; j < 4; ++j) AxpyF32Scalar(a[j], x, y + j * y_stride, n);
}

void AxpyTile4F32Scalar(const float* p, int64_t p_stride, const float* const* x, int64_t nk,
                        float* y, int64_t y_stride, int64_t n) {
  for (int64_t j = 0; j < nk; ++j) {
    const float a[4] = {p[j], p[p_stride + j], p[2 * p_stride + j], p[3 * p_stride + j]};
    Axpy4F32Scalar(a, x[j], y, y_stride, n);
  }
}

float DotBf16F32Scalar(const std::byte* w, const float* x, int64_t n) {
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

}  // namespace internal

bool F32OpsUseAvx512() { return kIsa == CpuIsa::kAvx512; }
CpuIsa F32OpsIsa() { return kIsa; }

float DotF32(const float* a, const float* b, int64_t n) {
  if (kIsa == CpuIsa::kAvx512) return internal::DotF32Avx512(a, b, n);
  if (kIsa == CpuIsa::kAvx2) return internal::DotF32Avx2(a, b, n);
  return internal::DotF32Scalar(a, b, n);
}

void Dot4F32(const float* q, int64_t q_stride, const float* k, int64_t n, float* out) {
  if (kIsa == CpuIsa::kAvx512) return internal::Dot4F32Avx512(q, q_stride, k, n, out);
  if (kIsa == CpuIsa::kAvx2) return internal::Dot4F32Avx2(q, q_stride, k, n, out);
  internal::Dot4F32Scalar(q, q_stride, k, n, out);
}

void AxpyF32(float a, const float* x, float* y, int64_t n) {
  if (kIsa == CpuIsa::kAvx512) return internal::AxpyF32Avx512(a, x, y, n);
  if (kIsa == CpuIsa::kAvx2) return internal::AxpyF32Avx2(a, x, y, n);
  internal::AxpyF32Scalar(a, x, y, n);
}

void Axpy4F32(const float* a, const float* x, float* y, int64_t y_stride, int64_t n) {
  if (kIsa == CpuIsa::kAvx512) return internal::Axpy4F32Avx512(a, x, y, y_stride, n);
  if (kIsa == CpuIsa::kAvx2) return internal::Axpy4F32Avx2(a, x, y, y_stride, n);
  internal::Axpy4F32Scalar(a, x, y, y_stride, n);
}

void AxpyTile4F32(const float* p, int64_t p_stride, const float* const* x, int64_t nk, float* y,
                  int64_t y_stride, int64_t n) {
  if (kIsa == CpuIsa::kAvx512) {
    return internal::AxpyTile4F32Avx512(p, p_stride, x, nk, y, y_stride, n);
  }
  if (kIsa == CpuIsa::kAvx2) return internal::AxpyTile4F32Avx2(p, p_stride, x, nk, y, y_stride, n);
  internal::AxpyTile4F32Scalar(p, p_stride, x, nk, y, y_stride, n);
}

float DotBf16F32(const std::byte* w, const float* x, int64_t n) {
  if (kIsa == CpuIsa::kAvx512) return internal::DotBf16F32Avx512(w, x, n);
  if (kIsa == CpuIsa::kAvx2) return internal::DotBf16F32Avx2(w, x, n);
  return internal::DotBf16F32Scalar(w, x, n);
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
