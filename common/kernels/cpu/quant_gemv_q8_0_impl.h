// Q8_0 and Q5_0 (32-weight blocks) x Q8_K rows in 256-bit SIMD, included by quant_gemv_avx2.cc
// and quant_gemv_avx512.cc inside their anonymous namespaces (each ISA file compiles its own
// copy; nothing here is shared between translation units). Before including, define
// HMOE_QIMPL_INLINE and HMOE_UNROLL, and HMOE_QIMPL_VNNI to 1 where AVX512_VNNI + VL are enabled.
//
// Per 32-weight block and token, one ymm of 8 exact int32 sums: Q8_0 with vpdpbusd on the biased
// quants (w + 128, the bias removed as 128 * the block's activation sum from Q8_K's bsums) where
// VNNI is enabled, else vpsignb/vpabsb + vpmaddubsw + vpmaddwd (|w| * sign(x, w): pair sums at
// most 2 * 128 * 127, no saturation; Q8_K quants are never -128); Q5_0's unsigned 5-bit quants
// with vpmaddubsw, the -16 as 16 * the block's activation sum. Then one F32 multiply-add of
// d_w * d_x per block and token into 8 lanes, added once per row.

#pragma once

HMOE_QIMPL_INLINE __m256i Load256Q(const void* p) {
  return _mm256_loadu_si256(static_cast<const __m256i*>(p));
}

HMOE_QIMPL_INLINE float HalfQ(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

HMOE_QIMPL_INLINE float HorizontalSumQ(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The block's activation sum times `offset`, in lane 0 of a ymm (zero elsewhere).
HMOE_QIMPL_INLINE __m256i OffsetLane(const BlockQ8K& a, int64_t j, int offset) {
  const int sum = a.bsums[2 * (j % 8)] + a.bsums[2 * (j % 8) + 1];
  return _mm256_zextsi128_si256(_mm_cvtsi32_si128(offset * sum));
}

template <int N>
void RowsQ8_0(const QuantMatrixView& w, const BlockQ8K* x, int64_t x_stride, int64_t m_begin,
              int64_t m_end, float* y, int64_t y_stride) {
  const int64_t nb = w.cols / 32;
#if HMOE_QIMPL_VNNI
  const __m256i bias = _mm256_set1_epi8(static_cast<char>(0x80));
#else
  const __m256i ones = _mm256_set1_epi16(1);
#endif
  for (int64_t m = m_begin; m < m_end; ++m) {
    const uint8_t* row = w.data + m * w.row_stride;
    __m256 acc[N];
    HMOE_UNROLL for (int t = 0; t < N; ++t) acc[t] = _mm256_setzero_ps();
    for (int64_t j = 0; j < nb; ++j) {
      const uint8_t* blk = row + j * 34;
      _mm_prefetch(reinterpret_cast<const char*>(blk + 1024), _MM_HINT_T0);
      const __m256i q = Load256Q(blk + 2);
      const float d = HalfQ(blk);
#if HMOE_QIMPL_VNNI
      const __m256i u = _mm256_xor_si256(q, bias);  // w + 128 as unsigned bytes
#else
      const __m256i aq = _mm256_abs_epi8(q);
#endif
      HMOE_UNROLL for (int t = 0; t < N; ++t) {
        const BlockQ8K& a = x[t * x_stride + j / 8];
        const __m256i xq = Load256Q(a.qs + (j % 8) * 32);
#if HMOE_QIMPL_VNNI
        const __m256i dot = _mm256_dpbusd_epi32(
            _mm256_sub_epi32(_mm256_setzero_si256(), OffsetLane(a, j, 128)), u, xq);
#else
        const __m256i dot =
            _mm256_madd_epi16(_mm256_maddubs_epi16(aq, _mm256_sign_epi8(xq, q)), ones);
#endif
        acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d * a.d), _mm256_cvtepi32_ps(dot), acc[t]);
      }
    }
    HMOE_UNROLL for (int t = 0; t < N; ++t) y[t * y_stride + (m - m_begin)] =
        HorizontalSumQ(acc[t]);
  }
}

template <int N>
void RowsQ5_0(const QuantMatrixView& w, const BlockQ8K* x, int64_t x_stride, int64_t m_begin,
              int64_t m_end, float* y, int64_t y_stride) {
  const int64_t nb = w.cols / 32;
  const __m256i low4 = _mm256_set1_epi8(0x0f);
  const __m256i nibble_shift = _mm256_set_epi64x(4, 4, 0, 0);
  const __m256i ones = _mm256_set1_epi16(1);
  // Byte k of the 32 fifth bits (bit k of qh) to byte k: replicate qh byte k / 8 to bytes
  // 8 * (k / 8) .. + 7, keep bit k % 8, compare.
  const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2,
                                          2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  const __m256i fifth = _mm256_set1_epi8(0x10);
  for (int64_t m = m_begin; m < m_end; ++m) {
    const uint8_t* row = w.data + m * w.row_stride;
    __m256 acc[N];
    HMOE_UNROLL for (int t = 0; t < N; ++t) acc[t] = _mm256_setzero_ps();
    for (int64_t j = 0; j < nb; ++j) {
      const uint8_t* blk = row + j * 22;
      _mm_prefetch(reinterpret_cast<const char*>(blk + 1024), _MM_HINT_T0);
      uint32_t qh;
      std::memcpy(&qh, blk + 2, 4);
      // Weights 0-15: low nibbles of qs (low lane); 16-31: high nibbles (high lane).
      const __m256i qs =
          _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 6)));
      __m256i q = _mm256_and_si256(_mm256_srlv_epi64(qs, nibble_shift), low4);
      const __m256i h = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(qh)), spread);
      q = _mm256_or_si256(
          q, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(h, bit), bit), fifth));
      const float d = HalfQ(blk);
      HMOE_UNROLL for (int t = 0; t < N; ++t) {
        const BlockQ8K& a = x[t * x_stride + j / 8];
        const __m256i xq = Load256Q(a.qs + (j % 8) * 32);
        const __m256i dot = _mm256_sub_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(q, xq), ones),
                                             OffsetLane(a, j, 16));
        acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d * a.d), _mm256_cvtepi32_ps(dot), acc[t]);
      }
    }
    HMOE_UNROLL for (int t = 0; t < N; ++t) y[t * y_stride + (m - m_begin)] =
        HorizontalSumQ(acc[t]);
  }
}
