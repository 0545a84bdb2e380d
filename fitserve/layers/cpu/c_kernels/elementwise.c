/* fitserve's CPU elementwise kernels for float32 decoder layers (RMSNorm with the residual add, rotary
 * embedding, SiLU-and-mul): one call each instead of 3 to 8 torch operations (a decode step's time on the
 * CPU goes largely to per-call overheads).
 *
 * Built with -ffp-contract=off (library.py), so a * b + c * d is two roundings of products and one of
 * the sum, as torch computes it: the rotary kernel gives StepRope.rotate's values bit for bit. The RMSNorm
 * sums squares in another order than torch's reduction, and SiLU's exponential is vector_exp.h's (float32
 * noise in the last bits). Written on vec16.h's 16-lane vectors: the AVX-512 and AVX2 builds give the same
 * bits.
 */
#include <math.h>
#include <stdint.h>

#include "vec16.h"
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
        v16_store(sr + d, v16_add(v16_load(xr + d), v16_load(rr + d)));
      source = sr;
    }
    v16f squares = v16_zero();
    for (int64_t d = 0; d < H; d += 16) {
      const v16f v = v16_load(source + d);
      squares = v16_add(squares, v16_mul(v, v));
    }
    const float inverse_rms = 1.0f / sqrtf(v16_reduce_add(squares) / (float)H + eps);
    const v16f scale = v16_set1(inverse_rms);
    float *o = out + r * H;
    for (int64_t d = 0; d < H; d += 16) {
      const v16f normed = v16_mul(v16_load(source + d), scale);
      v16_store(o + d, v16_mul(normed, v16_load(weight + d)));
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
        const v16f first = v16_load(v + d), second = v16_load(v + half + d);
        /* out[d] = x[d] cos[d] + x[d + half] sin[d]; out[d + half] = x[d + half] cos[d + half] + x[d] sin[d + half] */
        const v16f new_first = v16_add(v16_mul(first, v16_load(c + d)), v16_mul(second, v16_load(s + d)));
        const v16f new_second =
            v16_add(v16_mul(second, v16_load(c + half + d)), v16_mul(first, v16_load(s + half + d)));
        v16_store(v + d, new_first);
        v16_store(v + half + d, new_second);
      }
    }
  }
}

/* x [rows][2 d] (row stride in elements) -> out [rows][d] contiguous: silu(gate) * up with gate the first
 * d values of a row and up the last d; silu(g) = g / (1 + e^-g). d % 16 == 0. */
void fs_silu_and_mul(const float *x, int64_t rows, int64_t d, int64_t x_stride, float *out) {
  const v16f one = v16_set1(1.0f);
  for (int64_t r = 0; r < rows; r++) {
    const float *gate = x + r * x_stride, *up = gate + d;
    float *o = out + r * d;
    for (int64_t i = 0; i < d; i += 16) {
      const v16f g = v16_load(gate + i);
      const v16f silu = v16_div(g, v16_add(one, exp16(v16_sub(v16_zero(), g))));
      v16_store(o + i, v16_mul(silu, v16_load(up + i)));
    }
  }
}
