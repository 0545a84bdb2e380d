/* e^x on 16 float32 lanes, for the C kernels that need it (softmax, SiLU).
 * x = n ln2 + r with |r| <= ln2 / 2; e^r by its degree-7 Taylor polynomial (truncation < 6e-9 relative on
 * that interval, so float32 rounding dominates: within a few ulp of expf); times 2^n with scalef.
 * x is clamped to [-104, 89]: below, the result is 0; above, +inf (as expf overflows). */
#ifndef FITSERVE_VECTOR_EXP_H
#define FITSERVE_VECTOR_EXP_H

#include <immintrin.h>

static inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.0f)), _mm512_set1_ps(89.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  /* ln 2 in two parts, the first with trailing zero bits so that n times it is exact */
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

#endif
