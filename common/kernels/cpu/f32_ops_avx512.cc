// AVX-512F implementations of f32_ops.h, compiled with -mavx512f (see CMakeLists.txt) and called
// only after a CPU check. No standard-library templates here (an inline function instantiated
// with AVX-512 flags could be the copy the linker keeps for the whole program).

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop

#include <cstddef>
#include <cstdint>

#include "common/kernels/cpu/f32_ops.h"

namespace hmoe::cpu::internal {
namespace {

inline __attribute__((always_inline)) float ReduceAdd(__m512 v) {
  v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0x4e));
  v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0xb1));
  v = _mm512_add_ps(v, _mm512_permute_ps(v, 0x4e));
  v = _mm512_add_ps(v, _mm512_permute_ps(v, 0xb1));
  return _mm512_cvtss_f32(v);
}

inline __attribute__((always_inline)) __mmask16 TailMask(int64_t rest) {
  return static_cast<__mmask16>((1u << rest) - 1u);
}

}  // namespace

float DotF32Avx512(const float* a, const float* b, int64_t n) {
  __m512 acc0 = _mm512_setzero_ps();
  __m512 acc1 = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc0);
    acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), acc1);
  }
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc0);
  }
  if (i < n) {
    const __mmask16 m = TailMask(n - i);
    acc1 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i), acc1);
  }
  return ReduceAdd(_mm512_add_ps(acc0, acc1));
}

void Dot4F32Avx512(const float* q, int64_t q_stride, const float* k, int64_t n, float* out) {
  // Per query exactly DotF32Avx512's order (two accumulators, the same tails), so a query's
  // score does not depend on whether it was computed alone or in a group of four.
  __m512 a0[4], a1[4];
  for (int j = 0; j < 4; ++j) a0[j] = a1[j] = _mm512_setzero_ps();
  const float* qs[4] = {q, q + q_stride, q + 2 * q_stride, q + 3 * q_stride};
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m512 k0 = _mm512_loadu_ps(k + i);
    const __m512 k1 = _mm512_loadu_ps(k + i + 16);
    for (int j = 0; j < 4; ++j) {
      a0[j] = _mm512_fmadd_ps(_mm512_loadu_ps(qs[j] + i), k0, a0[j]);
      a1[j] = _mm512_fmadd_ps(_mm512_loadu_ps(qs[j] + i + 16), k1, a1[j]);
    }
  }
  for (; i + 16 <= n; i += 16) {
    const __m512 k0 = _mm512_loadu_ps(k + i);
    for (int j = 0; j < 4; ++j) a0[j] = _mm512_fmadd_ps(_mm512_loadu_ps(qs[j] + i), k0, a0[j]);
  }
  if (i < n) {
    const __mmask16 m = TailMask(n - i);
    const __m512 kv = _mm512_maskz_loadu_ps(m, k + i);
    for (int j = 0; j < 4; ++j) {
      a1[j] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, qs[j] + i), kv, a1[j]);
    }
  }
  for (int j = 0; j < 4; ++j) out[j] = ReduceAdd(_mm512_add_ps(a0[j], a1[j]));
}

void AxpyF32Avx512(float a, const float* x, float* y, int64_t n) {
  const __m512 av = _mm512_set1_ps(a);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    _mm512_storeu_ps(y + i, _mm512_fmadd_ps(av, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
  }
  if (i < n) {
    const __mmask16 m = TailMask(n - i);
    _mm512_mask_storeu_ps(
        y + i, m,
        _mm512_fmadd_ps(av, _mm512_maskz_loadu_ps(m, x + i), _mm512_maskz_loadu_ps(m, y + i)));
  }
}

void Axpy4F32Avx512(const float* a, const float* x, float* y, int64_t y_stride, int64_t n) {
  const __m512 a0 = _mm512_set1_ps(a[0]);
  const __m512 a1 = _mm512_set1_ps(a[1]);
  const __m512 a2 = _mm512_set1_ps(a[2]);
  const __m512 a3 = _mm512_set1_ps(a[3]);
  float* y0 = y;
  float* y1 = y + y_stride;
  float* y2 = y + 2 * y_stride;
  float* y3 = y + 3 * y_stride;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 xv = _mm512_loadu_ps(x + i);
    _mm512_storeu_ps(y0 + i, _mm512_fmadd_ps(a0, xv, _mm512_loadu_ps(y0 + i)));
    _mm512_storeu_ps(y1 + i, _mm512_fmadd_ps(a1, xv, _mm512_loadu_ps(y1 + i)));
    _mm512_storeu_ps(y2 + i, _mm512_fmadd_ps(a2, xv, _mm512_loadu_ps(y2 + i)));
    _mm512_storeu_ps(y3 + i, _mm512_fmadd_ps(a3, xv, _mm512_loadu_ps(y3 + i)));
  }
  if (i < n) {
    const __mmask16 m = TailMask(n - i);
    const __m512 xv = _mm512_maskz_loadu_ps(m, x + i);
    _mm512_mask_storeu_ps(y0 + i, m, _mm512_fmadd_ps(a0, xv, _mm512_maskz_loadu_ps(m, y0 + i)));
    _mm512_mask_storeu_ps(y1 + i, m, _mm512_fmadd_ps(a1, xv, _mm512_maskz_loadu_ps(m, y1 + i)));
    _mm512_mask_storeu_ps(y2 + i, m, _mm512_fmadd_ps(a2, xv, _mm512_maskz_loadu_ps(m, y2 + i)));
    _mm512_mask_storeu_ps(y3 + i, m, _mm512_fmadd_ps(a3, xv, _mm512_maskz_loadu_ps(m, y3 + i)));
  }
}

void AxpyTile4F32Avx512(const float* p, int64_t p_stride, const float* const* x, int64_t nk,
                        float* y, int64_t y_stride, int64_t n) {
  float* y0 = y;
  float* y1 = y + y_stride;
  float* y2 = y + 2 * y_stride;
  float* y3 = y + 3 * y_stride;
  const float* p0 = p;
  const float* p1 = p + p_stride;
  const float* p2 = p + 2 * p_stride;
  const float* p3 = p + 3 * p_stride;
  int64_t i = 0;
  // 32 columns x 4 rows: eight accumulators, each updated in key order (as nk Axpy4F32 calls).
  for (; i + 32 <= n; i += 32) {
    __m512 c00 = _mm512_loadu_ps(y0 + i), c01 = _mm512_loadu_ps(y0 + i + 16);
    __m512 c10 = _mm512_loadu_ps(y1 + i), c11 = _mm512_loadu_ps(y1 + i + 16);
    __m512 c20 = _mm512_loadu_ps(y2 + i), c21 = _mm512_loadu_ps(y2 + i + 16);
    __m512 c30 = _mm512_loadu_ps(y3 + i), c31 = _mm512_loadu_ps(y3 + i + 16);
    for (int64_t j = 0; j < nk; ++j) {
      const __m512 x0 = _mm512_loadu_ps(x[j] + i);
      const __m512 x1 = _mm512_loadu_ps(x[j] + i + 16);
      const __m512 a0 = _mm512_set1_ps(p0[j]);
      const __m512 a1 = _mm512_set1_ps(p1[j]);
      const __m512 a2 = _mm512_set1_ps(p2[j]);
      const __m512 a3 = _mm512_set1_ps(p3[j]);
      c00 = _mm512_fmadd_ps(a0, x0, c00);
      c01 = _mm512_fmadd_ps(a0, x1, c01);
      c10 = _mm512_fmadd_ps(a1, x0, c10);
      c11 = _mm512_fmadd_ps(a1, x1, c11);
      c20 = _mm512_fmadd_ps(a2, x0, c20);
      c21 = _mm512_fmadd_ps(a2, x1, c21);
      c30 = _mm512_fmadd_ps(a3, x0, c30);
      c31 = _mm512_fmadd_ps(a3, x1, c31);
    }
    _mm512_storeu_ps(y0 + i, c00);
    _mm512_storeu_ps(y0 + i + 16, c01);
    _mm512_storeu_ps(y1 + i, c10);
    _mm512_storeu_ps(y1 + i + 16, c11);
    _mm512_storeu_ps(y2 + i, c20);
    _mm512_storeu_ps(y2 + i + 16, c21);
    _mm512_storeu_ps(y3 + i, c30);
    _mm512_storeu_ps(y3 + i + 16, c31);
  }
  for (; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? static_cast<__mmask16>(0xffff) : TailMask(n - i);
    __m512 c0 = _mm512_maskz_loadu_ps(m, y0 + i);
    __m512 c1 = _mm512_maskz_loadu_ps(m, y1 + i);
    __m512 c2 = _mm512_maskz_loadu_ps(m, y2 + i);
    __m512 c3 = _mm512_maskz_loadu_ps(m, y3 + i);
    for (int64_t j = 0; j < nk; ++j) {
      const __m512 xv = _mm512_maskz_loadu_ps(m, x[j] + i);
      c0 = _mm512_fmadd_ps(_mm512_set1_ps(p0[j]), xv, c0);
      c1 = _mm512_fmadd_ps(_mm512_set1_ps(p1[j]), xv, c1);
      c2 = _mm512_fmadd_ps(_mm512_set1_ps(p2[j]), xv, c2);
      c3 = _mm512_fmadd_ps(_mm512_set1_ps(p3[j]), xv, c3);
    }
    _mm512_mask_storeu_ps(y0 + i, m, c0);
    _mm512_mask_storeu_ps(y1 + i, m, c1);
    _mm512_mask_storeu_ps(y2 + i, m, c2);
    _mm512_mask_storeu_ps(y3 + i, m, c3);
  }
}

float DotBf16F32Avx512(const std::byte* w, const float* x, int64_t n) {
  __m512 acc0 = _mm512_setzero_ps();
  __m512 acc1 = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m512i wv = _mm512_loadu_si512(w + 2 * i);
    // Low and high 16 BF16 of the 32: widen to 32-bit lanes, shift into the F32 high half.
    const __m512 w0 = _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(wv)), 16));
    const __m512 w1 = _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(wv, 1)), 16));
    acc0 = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + i), acc0);
    acc1 = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + i + 16), acc1);
  }
  for (; i < n; i += 16) {
    const int64_t rest = n - i < 16 ? n - i : 16;
    const __mmask16 m = TailMask(rest);
    const __m256i wv = _mm256_maskz_loadu_epi16(m, w + 2 * i);
    const __m512 wf = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(wv), 16));
    acc0 = _mm512_fmadd_ps(wf, _mm512_maskz_loadu_ps(m, x + i), acc0);
  }
  return ReduceAdd(_mm512_add_ps(acc0, acc1));
}

}  // namespace hmoe::cpu::internal
