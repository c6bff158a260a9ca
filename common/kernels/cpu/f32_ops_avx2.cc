// AVX2 + FMA implementations of f32_ops.h, compiled with -mavx2 -mfma (see CMakeLists.txt) and
// called only after a CPU check. The same structure as the AVX-512 file with 8-float vectors: two
// accumulators per query, a masked tail, one fixed reduction tree. No standard-library templates
// here (an inline function instantiated with AVX2 flags could be the copy the linker keeps for
// the whole program).
//
// Before this file the AVX2 variant (Zen 3, or HMOE_CPU_ISA=avx2) ran the portable loops: one
// scalar FMA chain per score, 4 cycles per multiply, which made the CPU MLA attention of a
// 512-token prefill about as expensive as all of its projections and experts together.

#include <cstddef>
#include <cstdint>

#include <immintrin.h>

#include "common/kernels/cpu/f32_ops.h"

namespace hmoe::cpu::internal {
namespace {

inline __attribute__((always_inline)) float ReduceAdd(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

// Lanes [0, rest) set, rest in [1, 8).
inline __attribute__((always_inline)) __m256i TailMask(int64_t rest) {
  const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(rest)), iota);
}

}  // namespace

float DotF32Avx2(const float* a, const float* b, int64_t n) {
  __m256 acc0 = _mm256_setzero_ps();
  __m256 acc1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
  }
  for (; i + 8 <= n; i += 8) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
  }
  if (i < n) {
    const __m256i m = TailMask(n - i);
    acc1 = _mm256_fmadd_ps(_mm256_maskload_ps(a + i, m), _mm256_maskload_ps(b + i, m), acc1);
  }
  return ReduceAdd(_mm256_add_ps(acc0, acc1));
}

void Dot4F32Avx2(const float* q, int64_t q_stride, const float* k, int64_t n, float* out) {
  // Per query exactly DotF32Avx2's order (two accumulators, the same tails), so a query's score
  // does not depend on whether it was computed alone or in a group of four.
  const float* q0 = q;
  const float* q1 = q + q_stride;
  const float* q2 = q + 2 * q_stride;
  const float* q3 = q + 3 * q_stride;
  __m256 a00 = _mm256_setzero_ps(), a01 = _mm256_setzero_ps();
  __m256 a10 = _mm256_setzero_ps(), a11 = _mm256_setzero_ps();
  __m256 a20 = _mm256_setzero_ps(), a21 = _mm256_setzero_ps();
  __m256 a30 = _mm256_setzero_ps(), a31 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256 k0 = _mm256_loadu_ps(k + i);
    const __m256 k1 = _mm256_loadu_ps(k + i + 8);
    a00 = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + i), k0, a00);
    a01 = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + i + 8), k1, a01);
    a10 = _mm256_fmadd_ps(_mm256_loadu_ps(q1 + i), k0, a10);
    a11 = _mm256_fmadd_ps(_mm256_loadu_ps(q1 + i + 8), k1, a11);
    a20 = _mm256_fmadd_ps(_mm256_loadu_ps(q2 + i), k0, a20);
    a21 = _mm256_fmadd_ps(_mm256_loadu_ps(q2 + i + 8), k1, a21);
    a30 = _mm256_fmadd_ps(_mm256_loadu_ps(q3 + i), k0, a30);
    a31 = _mm256_fmadd_ps(_mm256_loadu_ps(q3 + i + 8), k1, a31);
  }
  for (; i + 8 <= n; i += 8) {
    const __m256 k0 = _mm256_loadu_ps(k + i);
    a00 = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + i), k0, a00);
    a10 = _mm256_fmadd_ps(_mm256_loadu_ps(q1 + i), k0, a10);
    a20 = _mm256_fmadd_ps(_mm256_loadu_ps(q2 + i), k0, a20);
    a30 = _mm256_fmadd_ps(_mm256_loadu_ps(q3 + i), k0, a30);
  }
  if (i < n) {
    const __m256i m = TailMask(n - i);
    const __m256 kv = _mm256_maskload_ps(k + i, m);
    a01 = _mm256_fmadd_ps(_mm256_maskload_ps(q0 + i, m), kv, a01);
    a11 = _mm256_fmadd_ps(_mm256_maskload_ps(q1 + i, m), kv, a11);
    a21 = _mm256_fmadd_ps(_mm256_maskload_ps(q2 + i, m), kv, a21);
    a31 = _mm256_fmadd_ps(_mm256_maskload_ps(q3 + i, m), kv, a31);
  }
  out[0] = ReduceAdd(_mm256_add_ps(a00, a01));
  out[1] = ReduceAdd(_mm256_add_ps(a10, a11));
  out[2] = ReduceAdd(_mm256_add_ps(a20, a21));
  out[3] = ReduceAdd(_mm256_add_ps(a30, a31));
}

void AxpyF32Avx2(float a, const float* x, float* y, int64_t n) {
  const __m256 av = _mm256_set1_ps(a);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(av, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  }
  if (i < n) {
    const __m256i m = TailMask(n - i);
    _mm256_maskstore_ps(
        y + i, m, _mm256_fmadd_ps(av, _mm256_maskload_ps(x + i, m), _mm256_maskload_ps(y + i, m)));
  }
}

void Axpy4F32Avx2(const float* a, const float* x, float* y, int64_t y_stride, int64_t n) {
  const __m256 a0 = _mm256_set1_ps(a[0]);
  const __m256 a1 = _mm256_set1_ps(a[1]);
  const __m256 a2 = _mm256_set1_ps(a[2]);
  const __m256 a3 = _mm256_set1_ps(a[3]);
  float* y0 = y;
  float* y1 = y + y_stride;
  float* y2 = y + 2 * y_stride;
  float* y3 = y + 3 * y_stride;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 xv = _mm256_loadu_ps(x + i);
    _mm256_storeu_ps(y0 + i, _mm256_fmadd_ps(a0, xv, _mm256_loadu_ps(y0 + i)));
    _mm256_storeu_ps(y1 + i, _mm256_fmadd_ps(a1, xv, _mm256_loadu_ps(y1 + i)));
    _mm256_storeu_ps(y2 + i, _mm256_fmadd_ps(a2, xv, _mm256_loadu_ps(y2 + i)));
    _mm256_storeu_ps(y3 + i, _mm256_fmadd_ps(a3, xv, _mm256_loadu_ps(y3 + i)));
  }
  if (i < n) {
    const __m256i m = TailMask(n - i);
    const __m256 xv = _mm256_maskload_ps(x + i, m);
    _mm256_maskstore_ps(y0 + i, m, _mm256_fmadd_ps(a0, xv, _mm256_maskload_ps(y0 + i, m)));
    _mm256_maskstore_ps(y1 + i, m, _mm256_fmadd_ps(a1, xv, _mm256_maskload_ps(y1 + i, m)));
    _mm256_maskstore_ps(y2 + i, m, _mm256_fmadd_ps(a2, xv, _mm256_maskload_ps(y2 + i, m)));
    _mm256_maskstore_ps(y3 + i, m, _mm256_fmadd_ps(a3, xv, _mm256_maskload_ps(y3 + i, m)));
  }
}

void AxpyTile4F32Avx2(const float* p, int64_t p_stride, const float* const* x, int64_t nk, float* y,
                      int64_t y_stride, int64_t n) {
  float* y0 = y;
  float* y1 = y + y_stride;
  float* y2 = y + 2 * y_stride;
  float* y3 = y + 3 * y_stride;
  const float* p0 = p;
  const float* p1 = p + p_stride;
  const float* p2 = p + 2 * p_stride;
  const float* p3 = p + 3 * p_stride;
  int64_t i = 0;
  // 16 columns x 4 rows: eight accumulators, each updated in key order (as nk Axpy4F32 calls).
  for (; i + 16 <= n; i += 16) {
    __m256 c00 = _mm256_loadu_ps(y0 + i), c01 = _mm256_loadu_ps(y0 + i + 8);
    __m256 c10 = _mm256_loadu_ps(y1 + i), c11 = _mm256_loadu_ps(y1 + i + 8);
    __m256 c20 = _mm256_loadu_ps(y2 + i), c21 = _mm256_loadu_ps(y2 + i + 8);
    __m256 c30 = _mm256_loadu_ps(y3 + i), c31 = _mm256_loadu_ps(y3 + i + 8);
    for (int64_t j = 0; j < nk; ++j) {
      const __m256 x0 = _mm256_loadu_ps(x[j] + i);
      const __m256 x1 = _mm256_loadu_ps(x[j] + i + 8);
      const __m256 a0 = _mm256_broadcast_ss(p0 + j);
      const __m256 a1 = _mm256_broadcast_ss(p1 + j);
      const __m256 a2 = _mm256_broadcast_ss(p2 + j);
      const __m256 a3 = _mm256_broadcast_ss(p3 + j);
      c00 = _mm256_fmadd_ps(a0, x0, c00);
      c01 = _mm256_fmadd_ps(a0, x1, c01);
      c10 = _mm256_fmadd_ps(a1, x0, c10);
      c11 = _mm256_fmadd_ps(a1, x1, c11);
      c20 = _mm256_fmadd_ps(a2, x0, c20);
      c21 = _mm256_fmadd_ps(a2, x1, c21);
      c30 = _mm256_fmadd_ps(a3, x0, c30);
      c31 = _mm256_fmadd_ps(a3, x1, c31);
    }
    _mm256_storeu_ps(y0 + i, c00);
    _mm256_storeu_ps(y0 + i + 8, c01);
    _mm256_storeu_ps(y1 + i, c10);
    _mm256_storeu_ps(y1 + i + 8, c11);
    _mm256_storeu_ps(y2 + i, c20);
    _mm256_storeu_ps(y2 + i + 8, c21);
    _mm256_storeu_ps(y3 + i, c30);
    _mm256_storeu_ps(y3 + i + 8, c31);
  }
  for (; i < n; i += 8) {
    const __m256i m = n - i >= 8 ? _mm256_set1_epi32(-1) : TailMask(n - i);
    __m256 c0 = _mm256_maskload_ps(y0 + i, m);
    __m256 c1 = _mm256_maskload_ps(y1 + i, m);
    __m256 c2 = _mm256_maskload_ps(y2 + i, m);
    __m256 c3 = _mm256_maskload_ps(y3 + i, m);
    for (int64_t j = 0; j < nk; ++j) {
      const __m256 xv = _mm256_maskload_ps(x[j] + i, m);
      c0 = _mm256_fmadd_ps(_mm256_broadcast_ss(p0 + j), xv, c0);
      c1 = _mm256_fmadd_ps(_mm256_broadcast_ss(p1 + j), xv, c1);
      c2 = _mm256_fmadd_ps(_mm256_broadcast_ss(p2 + j), xv, c2);
      c3 = _mm256_fmadd_ps(_mm256_broadcast_ss(p3 + j), xv, c3);
    }
    _mm256_maskstore_ps(y0 + i, m, c0);
    _mm256_maskstore_ps(y1 + i, m, c1);
    _mm256_maskstore_ps(y2 + i, m, c2);
    _mm256_maskstore_ps(y3 + i, m, c3);
  }
}

float DotBf16F32Avx2(const std::byte* w, const float* x, int64_t n) {
  __m256 acc0 = _mm256_setzero_ps();
  __m256 acc1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 2 * i));
    // Low and high 8 BF16 of the 16: widen to 32-bit lanes, shift into the F32 high half.
    const __m256 w0 = _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(wv)), 16));
    const __m256 w1 = _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(wv, 1)), 16));
    acc0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + i), acc0);
    acc1 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + i + 8), acc1);
  }
  for (; i < n; i += 8) {
    const int64_t rest = n - i < 8 ? n - i : 8;
    // No masked 16-bit load in AVX2: copy the tail's BF16 values into a zeroed buffer.
    alignas(16) uint16_t tail[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    const unsigned char* src = reinterpret_cast<const unsigned char*>(w + 2 * i);
    unsigned char* dst = reinterpret_cast<unsigned char*>(tail);
    for (int64_t b = 0; b < 2 * rest; ++b) dst[b] = src[b];
    const __m256 wf = _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(tail))), 16));
    const __m256 xv =
        rest == 8 ? _mm256_loadu_ps(x + i) : _mm256_maskload_ps(x + i, TailMask(rest));
    acc0 = _mm256_fmadd_ps(wf, xv, acc0);
  }
  return ReduceAdd(_mm256_add_ps(acc0, acc1));
}

}  // namespace hmoe::cpu::internal
