// AVX2 helpers shared by the kernels' avx2 paths: 8 float32 lanes, with float32, bfloat16 and
// float16 storage widened in registers (bf16: the bits shifted up; fp16: F16C) and narrowed
// back with round-to-nearest-even, as c10::BFloat16 / c10::Half do.
//
// Compiled only where the tier enables AVX2 + FMA + F16C (cpu_isa.py's avx2 tier and above).
#pragma once

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define KVS_AVX2 1
#include <immintrin.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace kvs_avx2 {

#define KVS_AVX2_INLINE inline __attribute__((always_inline))

KVS_AVX2_INLINE __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
KVS_AVX2_INLINE __m256 load8(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
KVS_AVX2_INLINE __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// The first n (< 8) elements, the rest zero: copied through a small buffer so nothing past
// p + n is read.
template <typename T>
KVS_AVX2_INLINE __m256 load8(const T* p, int64_t n) {
  alignas(32) T buf[8] = {};
  std::memcpy(buf, p, n * sizeof(T));
  return load8(static_cast<const T*>(buf));
}

KVS_AVX2_INLINE void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
KVS_AVX2_INLINE __m128i narrow_bf16(__m256 v) {  // round to nearest even; NaN -> quiet NaN
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(nan));
  // 8 x 32-bit (values < 2^16) -> 8 x 16-bit: pack within lanes, then put the halves in order.
  const __m256i packed = _mm256_packus_epi32(r, r);
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}
KVS_AVX2_INLINE void store8(c10::BFloat16* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), narrow_bf16(v));
}
KVS_AVX2_INLINE void store8(c10::Half* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}
template <typename T>
KVS_AVX2_INLINE void store8(T* p, __m256 v, int64_t n) {
  alignas(32) T buf[8];
  store8(static_cast<T*>(buf), v);
  std::memcpy(p, buf, n * sizeof(T));
}

// v rounded to T's precision and back (identity for float).
template <typename T>
KVS_AVX2_INLINE __m256 round8(__m256 v) {
  if constexpr (std::is_same<T, c10::BFloat16>::value) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(narrow_bf16(v)), 16));
  } else if constexpr (std::is_same<T, c10::Half>::value) {
    return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  }
  return v;
}

KVS_AVX2_INLINE float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

KVS_AVX2_INLINE float hmax8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// exp(x) for float32: Cephes' expf polynomial after reducing x by n * ln2 (about 1 ulp); 2^n
// is built in the exponent bits, with x clamped so that it stays a normal float (exp of
// anything below -87.3 is 0 to float32 precision in a softmax or a SiLU anyway; above 88.7
// it is clamped, as the AVX-512 path's scalef would overflow to inf there: -> 0 after
// 1 / (1 + inf) in SiLU, never reached in a softmax whose max is subtracted).
KVS_AVX2_INLINE __m256 exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.3f), hi = _mm256_set1_ps(88.7f);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  const __m256 over = _mm256_cmp_ps(x, hi, _CMP_GT_OQ);
  x = _mm256_max_ps(_mm256_min_ps(x, hi), lo);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500E-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507E-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073E-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894E-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459E-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201E-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  // 2^n for n in [-126, 128]: 2^n = 2^(n/2) * 2^(n - n/2) keeps both factors normal.
  const __m256i ni = _mm256_cvtps_epi32(n);
  const __m256i half = _mm256_srai_epi32(ni, 1);
  const __m256 f1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, _mm256_set1_epi32(127)), 23));
  const __m256 f2 = _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(ni, half), _mm256_set1_epi32(127)), 23));
  __m256 e = _mm256_mul_ps(_mm256_mul_ps(p, f1), f2);
  e = _mm256_blendv_ps(e, _mm256_setzero_ps(), under);
  return _mm256_blendv_ps(e, _mm256_set1_ps(__builtin_huge_valf()), over);
}

// q . k over D values (D a multiple of 8): float32 q, k widened in registers, two FMA chains.
template <typename T>
KVS_AVX2_INLINE float dot8(const float* q, const T* k, int64_t D) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) {
    a0 = _mm256_fmadd_ps(load8(k + d), _mm256_loadu_ps(q + d), a0);
    a1 = _mm256_fmadd_ps(load8(k + d + 8), _mm256_loadu_ps(q + d + 8), a1);
  }
  if (d < D) a0 = _mm256_fmadd_ps(load8(k + d), _mm256_loadu_ps(q + d), a0);
  return hsum8(_mm256_add_ps(a0, a1));
}

// s[j] = exp(s[j] - mx) for j < n, in place (a softmax's numerators); returns their sum.
KVS_AVX2_INLINE float exp_sum(float* s, int64_t n, float mx) {
  const __m256 vmx = _mm256_set1_ps(mx);
  __m256 vsum = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), vmx));
    _mm256_storeu_ps(s + j, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  float sum = hsum8(vsum);
  for (; j < n; ++j) sum += (s[j] = std::exp(s[j] - mx));
  return sum;
}

}  // namespace kvs_avx2

#endif  // AVX2 + FMA + F16C
