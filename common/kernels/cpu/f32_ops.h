#pragma once

// F32 vector helpers for the CPU attention and the F32-weight linear path: dot products, AXPY,
// and a plain F32 matrix-vector product. An AVX-512 variant is chosen at run time when the CPU
// has AVX-512 F/BW/VL (HMOE_CPU_ISA=scalar/avx2 forces the portable one); results agree with the
// portable loops to F32 rounding (summation order differs). Thread-safe, no threads.

#include <cstddef>
#include <cstdint>

namespace hmoe::cpu {

// sum_i a[i] * b[i].
float DotF32(const float* a, const float* b, int64_t n);
// out[j] = sum_i q[j * q_stride + i] * k[i] for j < 4: four queries against one key, sharing the
// key's loads. out[j] is bitwise DotF32(q + j * q_stride, k, n).
void Dot4F32(const float* q, int64_t q_stride, const float* k, int64_t n, float* out);
// y[i] = fma(a, x[i], y[i]): one rounding per update, bitwise the same in every variant (the
// engine's expert paths rely on it for batch-independent results).
void AxpyF32(float a, const float* x, float* y, int64_t n);
// y[j * y_stride + i] = fma(a[j], x[i], y[j * y_stride + i]) for j < 4.
void Axpy4F32(const float* a, const float* x, float* y, int64_t y_stride, int64_t n);
// y[t * y_stride + (m - m_begin)] = sum_c w[m * row_stride + c] * x[t * x_stride + c] for t < n,
// m in [m_begin, m_end), c < cols.
void MatVecF32(const float* w, int64_t row_stride, int64_t cols, const float* x, int64_t x_stride,
               int64_t n, int64_t m_begin, int64_t m_end, float* y, int64_t y_stride);

// sum_i w[i] * x[i] with w BF16 (2-byte little-endian values at `w`, any alignment) converted
// exactly to F32 and x F32: full F32 precision (the router, whose decisions are discrete).
float DotBf16F32(const std::byte* w, const float* x, int64_t n);

// Whether the AVX-512 variant is in use.
bool F32OpsUseAvx512();

namespace internal {
// The AVX-512 implementations (f32_ops_avx512.cc); call only when the CPU has AVX-512 F/BW/VL.
float DotF32Avx512(const float* a, const float* b, int64_t n);
void Dot4F32Avx512(const float* q, int64_t q_stride, const float* k, int64_t n, float* out);
void AxpyF32Avx512(float a, const float* x, float* y, int64_t n);
void Axpy4F32Avx512(const float* a, const float* x, float* y, int64_t y_stride, int64_t n);
float DotBf16F32Avx512(const std::byte* w, const float* x, int64_t n);
}  // namespace internal

}  // namespace hmoe::cpu
