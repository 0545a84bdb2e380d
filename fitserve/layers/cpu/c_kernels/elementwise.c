/* fitserve's CPU elementwise kernels for float32 decoder layers (RMSNorm with the residual add, rotary
 * embedding, SiLU-and-mul): one call each instead of 3 to 8 torch operations (a decode step's time on the
 * CPU goes largely to per-call overheads).
 *
 * Built with -ffp-contract=off (library.py), so a * b + c * d is two roundings of products and one of
 * the sum, as torch computes it: the rotary kernel gives StepRope.rotate's values bit for bit. The RMSNorm
 * sums squares in another order than torch's reduction, and SiLU's exponential is vector_exp.h's (float32
 * noise in the last bits).
 */
#if !defined(__AVX512F__)
#error "this CPU lacks AVX-512 F, which the elementwise kernels are written for"
#endif

#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "vector_exp.h"

/* Rows of H floats (row strides in elements). With `residual` (may be NULL): summed = x + residual,
 * written to `summed_out`; the normed row is weight * (s * (1 / sqrt(mean(s^2) + eps))) of s = the sum,
 * or of x itself without a residual. out and summed_out are contiguous rows and may be x and residual
 * themselves (contiguous): each row is read before it is written. H % 16 == 0. */
void fs_rms_norm(const float *x, int64_t x_stride, const float *residual, int64_t residual_stride,
                 const float *weight, float eps, int64_t rows, int64_t H, float *out, float *summed_out) {
  for (int64_t r = 0; r < rows; r++) {
    const float *xr = x + r * x_stride;
    const float *source = xr;
    if (residual) {
      const float *rr = residual + r * residual_stride;
      float *sr = summed_out + r * H;
      for (int64_t d = 0; d < H; d += 16)
        _mm512_storeu_ps(sr + d, _mm512_add_ps(_mm512_loadu_ps(xr + d), _mm512_loadu_ps(rr + d)));
      source = sr;
    }
    __m512 squares = _mm512_setzero_ps();
    for (int64_t d = 0; d < H; d += 16) {
      const __m512 v = _mm512_loadu_ps(source + d);
      squares = _mm512_add_ps(squares, _mm512_mul_ps(v, v));
    }
    const float inverse_rms = 1.0f / sqrtf(_mm512_reduce_add_ps(squares) / (float)H + eps);
    const __m512 scale = _mm512_set1_ps(inverse_rms);
    float *o = out + r * H;
    for (int64_t d = 0; d < H; d += 16) {
      const __m512 normed = _mm512_mul_ps(_mm512_loadu_ps(source + d), scale);
      _mm512_storeu_ps(o + d, _mm512_mul_ps(normed, _mm512_loadu_ps(weight + d)));
    }
  }
}

/* In place: x [T][heads][D] (token stride in elements, heads contiguous) becomes
 * x * cos + roll(x, D / 2) * sin_signed per head, with cos and sin_signed [T][D] (StepRope's tables:
 * sin's first half negated). D % 32 == 0. */
void fs_rotary(float *x, int64_t tokens, int64_t heads, int64_t D, int64_t token_stride, const float *cos,
               const float *sin_signed) {
  const int64_t half = D / 2;
  for (int64_t t = 0; t < tokens; t++) {
    const float *c = cos + t * D, *s = sin_signed + t * D;
    for (int64_t h = 0; h < heads; h++) {
      float *v = x + t * token_stride + h * D;
      for (int64_t d = 0; d < half; d += 16) {
        const __m512 first = _mm512_loadu_ps(v + d), second = _mm512_loadu_ps(v + half + d);
        /* out[d] = x[d] cos[d] + x[d + half] sin[d]; out[d + half] = x[d + half] cos[d + half] + x[d] sin[d + half] */
        const __m512 new_first = _mm512_add_ps(_mm512_mul_ps(first, _mm512_loadu_ps(c + d)),
                                               _mm512_mul_ps(second, _mm512_loadu_ps(s + d)));
        const __m512 new_second = _mm512_add_ps(_mm512_mul_ps(second, _mm512_loadu_ps(c + half + d)),
                                                _mm512_mul_ps(first, _mm512_loadu_ps(s + half + d)));
        _mm512_storeu_ps(v + d, new_first);
        _mm512_storeu_ps(v + half + d, new_second);
      }
    }
  }
}

/* x [rows][2 d] (row stride in elements) -> out [rows][d] contiguous: silu(gate) * up with gate the first
 * d values of a row and up the last d; silu(g) = g / (1 + e^-g). d % 16 == 0. */
void fs_silu_and_mul(const float *x, int64_t rows, int64_t d, int64_t x_stride, float *out) {
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t r = 0; r < rows; r++) {
    const float *gate = x + r * x_stride, *up = gate + d;
    float *o = out + r * d;
    for (int64_t i = 0; i < d; i += 16) {
      const __m512 g = _mm512_loadu_ps(gate + i);
      const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
      _mm512_storeu_ps(o + i, _mm512_mul_ps(silu, _mm512_loadu_ps(up + i)));
    }
  }
}
