#pragma once

// F32 vector helpers for the CPU attention and the F32-weight linear path: dot products, AXPY,
// and a plain F32 matrix-vector product. Three variants, chosen once per process: AVX-512 when
// the CPU has AVX-512 F/BW/VL, else AVX2 + FMA, else the portable loops; HMOE_CPU_ISA lowers the
// choice as for the FP8 kernels (`avx2`, `scalar`). Dot products agree between variants to F32
// rounding (summation order differs); the AXPYs are bitwise the same in every variant.
// Thread-safe, no threads.

#include <cstddef>
#include <cstdint>

#include "common/kernels/cpu/fp8_gemv.h"

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
// For j = 0 .. nk - 1 in order, for r < 4: y[r * y_stride + i] = fma(p[r * p_stride + j],
// x[j][i], y[r * y_stride + i]), i < n: bitwise nk calls of Axpy4F32, but each y element stays in
// a register over the nk updates (one load and one store per element instead of nk), so the
// attention's P V product runs at the FMA rate instead of the store rate.
void AxpyTile4F32(const float* p, int64_t p_stride, const float* const* x, int64_t nk, float* y,
                  int64_t y_stride, int64_t n);
// y[t * y_stride + (m - m_begin)] = sum_c w[m * row_stride + c] * x[t * x_stride + c] for t < n,
// m in [m_begin, m_end), c < cols.
void MatVecF32(const float* w, int64_t row_stride, int64_t cols, const float* x, int64_t x_stride,
               int64_t n, int64_t m_begin, int64_t m_end, float* y, int64_t y_stride);

// sum_i w[i] * x[i] with w BF16 (2-byte little-endian values at `w`, any alignment) converted
// exactly to F32 and x F32: full F32 precision (the router, whose decisions are discrete).
float DotBf16F32(const std::byte* w, const float* x, int64_t n);

// Whether the AVX-512 variant is in use.
bool F32OpsUseAvx512();
// The variant in use: kScalar, kAvx2 or kAvx512 (never kAvx512Bf16: no BF16 instructions here).
CpuIsa F32OpsIsa();

namespace internal {
// The portable loops (the scalar variant).
float DotF32Scalar(const float* a, const float* b, int64_t n);
void Dot4F32Scalar(const float* q, int64_t q_stride, const float* k, int64_t n, float* out);
void AxpyF32Scalar(float a, const float* x, float* y, int64_t n);
void Axpy4F32Scalar(const float* a, const float* x, float* y, int64_t y_stride, int64_t n);
void AxpyTile4F32Scalar(const float* p, int64_t p_stride, const float* const* x, int64_t nk,
                        float* y, int64_t y_stride, int64_t n);
float DotBf16F32Scalar(const std::byte* w, const float* x, int64_t n);
// The AVX2 + FMA implementations (f32_ops_avx2.cc); call only when the CPU has AVX2 and FMA.
float DotF32Avx2(const float* a, const float* b, int64_t n);
void Dot4F32Avx2(const float* q, int64_t q_stride, const float* k, int64_t n, float* out);
void AxpyF32Avx2(float a, const float* x, float* y, int64_t n);
void Axpy4F32Avx2(const float* a, const float* x, float* y, int64_t y_stride, int64_t n);
void AxpyTile4F32Avx2(const float* p, int64_t p_stride, const float* const* x, int64_t nk, float* y,
                      int64_t y_stride, int64_t n);
float DotBf16F32Avx2(const std::byte* w, const float* x, int64_t n);
// The AVX-512 implementations (f32_ops_avx512.cc); call only when the CPU has AVX-512 F/BW/VL.
float DotF32Avx512(const float* a, const float* b, int64_t n);
void Dot4F32Avx512(const float* q, int64_t q_stride, const float* k, int64_t n, float* out);
void AxpyF32Avx512(float a, const float* x, float* y, int64_t n);
void Axpy4F32Avx512(const float* a, const float* x, float* y, int64_t y_stride, int64_t n);
void AxpyTile4F32Avx512(const float* p, int64_t p_stride, const float* const* x, int64_t nk,
                        float* y, int64_t y_stride, int64_t n);
float DotBf16F32Avx512(const std::byte* w, const float* x, int64_t n);
}  // namespace internal

}  // namespace hmoe::cpu
