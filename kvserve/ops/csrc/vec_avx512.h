// AVX-512 helpers shared by the CPU kernels (compiled where the tier has AVX-512 F).
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

namespace kvs_avx512 {

// exp(x) lane-wise: 2^n * P(r), x = n ln2 + r, |r| <= ln2/2, degree-6 Taylor polynomial
// (relative error ~2e-7). Arguments are clamped to [-100, 88]: below, the result is ~0; above,
// ~1.7e38 instead of overflowing (callers divide by 1 + exp: the quotient is ~0 either way).
inline __attribute__((always_inline)) __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-100.f)), _mm512_set1_ps(88.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);   // ln2 in two parts
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.f / 720.f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

}  // namespace kvs_avx512

#endif  // __AVX512F__
