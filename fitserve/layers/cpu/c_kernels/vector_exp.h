/* e^x on 16 float32 lanes (vec16.h), for the C kernels that need it (softmax, SiLU).
 * x = n ln2 + r with |r| <= ln2 / 2; e^r by its degree-7 Taylor polynomial (truncation < 6e-9 relative on
 * that interval, so float32 rounding dominates: within a few ulp of expf); times 2^n (v16_scale2, one
 * rounding on either instruction set, so both give the same bits).
 * x is clamped to [-104, 89]: below, the result is 0; above, +inf (as expf overflows). */
#ifndef FITSERVE_VECTOR_EXP_H
#define FITSERVE_VECTOR_EXP_H

#include "vec16.h"

static inline v16f exp16(v16f x) {
  x = v16_min(v16_max(x, v16_set1(-104.0f)), v16_set1(89.0f));
  const v16f n = v16_round(v16_mul(x, v16_set1(1.44269504088896341f)));
  /* ln 2 in two parts, the first with trailing zero bits so that n times it is exact */
  v16f r = v16_fnmadd(n, v16_set1(0.693145751953125f), x);
  r = v16_fnmadd(n, v16_set1(1.428606765330187045e-06f), r);
  v16f p = v16_set1(1.0f / 5040.0f);
  p = v16_fmadd(p, r, v16_set1(1.0f / 720.0f));
  p = v16_fmadd(p, r, v16_set1(1.0f / 120.0f));
  p = v16_fmadd(p, r, v16_set1(1.0f / 24.0f));
  p = v16_fmadd(p, r, v16_set1(1.0f / 6.0f));
  p = v16_fmadd(p, r, v16_set1(0.5f));
  p = v16_fmadd(p, r, v16_set1(1.0f));
  p = v16_fmadd(p, r, v16_set1(1.0f));
  return v16_scale2(p, n);
}

#endif
