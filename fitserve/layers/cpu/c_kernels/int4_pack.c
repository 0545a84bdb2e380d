/* fitserve's int4 packer: a float32 or bfloat16 weight [N, K] made of 4-bit groups of 32 (a converted
 * Q4_1 GGUF's) -> the int4 GEMM's codes and scales (int4_gemm.c's layout), in one pass over the weight.
 * A bfloat16 weight (a converted checkpoint as stored) is read as the float32 values it holds exactly.
 *
 * It computes exactly what int4_layout.pack_for_kernel(find_int4_groups(w, "kernel")) does in torch
 * (layers/cpu/int4_linear.py; a unit test compares every byte): per group of 32,
 *   low = min, high = max, step = (high - low) / 15 (1 where that is 0),
 *   code = round-half-even((w - low) / step) clamped to 0..15,
 * and the deviation |code * f16(step) + f16(low) - w| / max(|low|, |high|) with step and low rounded to
 * float16 as stored. The weight is such a matrix when no deviation is above `tolerance` (and every value
 * is finite); the torch version takes about a dozen passes over the weight and was most of the default model's
 * load time. Built with -ffp-contract=off, so every product and sum rounds as torch's do; a group of 32
 * is two of vec16.h's 16-lane vectors (the same bytes from the AVX-512 and the AVX2 build).
 */
#include <math.h>
#include <stdint.h>

#include "vec16.h"

#define GROUP 32
#define BLOCK_COLUMNS 16

/* 16 weights as float32: from float32, or from bfloat16 (its upper 16 bits, exactly) */
static inline v16f load16(const void *w, int64_t index, int bf16) {
  return bf16 ? v16_load_bf16((const uint16_t *)w + index) : v16_load((const float *)w + index);
}

static inline float round_to_half(float value, uint16_t *half) {
  *half = _cvtss_sh(value, _MM_FROUND_TO_NEAREST_INT);
  return _cvtsh_ss(*half);
}

/* Returns 0 when w is int4 groups within tolerance (codes and scales written), 1 when it is not, 2 when
 * its shape does not fit the layout. *max_deviation receives the largest deviation (NaN when a value is
 * not finite: torch's version refuses those too). */
int fs_int4_pack(const void *w, int bf16, int64_t N, int64_t K, float tolerance, uint8_t *codes,
                 uint16_t *scales, float *max_deviation, int threads) {
  if (N % BLOCK_COLUMNS != 0 || K % GROUP != 0) return 2;
  const int64_t groups = K / GROUP, chunks = K / 8;
  float worst = 0.0f;
  int saw_non_finite = 0;
#pragma omp parallel for num_threads(threads) schedule(static) reduction(max : worst) reduction(| : saw_non_finite)
  for (int64_t n = 0; n < N; n++) {
    const int64_t block = n / BLOCK_COLUMNS, column = n % BLOCK_COLUMNS;
    for (int64_t g = 0; g < groups; g++) {
      const int64_t first = n * K + g * GROUP;
      const v16f zero = v16_zero();
      const v16f a = load16(w, first, bf16), b = load16(w, first + 16, bf16);
      saw_non_finite |= !(v16_all_finite(a) && v16_all_finite(b));
      const float low = v16_reduce_min(v16_min(a, b));
      const float high = v16_reduce_max(v16_max(a, b));
      const float step = (high - low) / 15.0f;
      const float divisor = step > 0.0f ? step : 1.0f;
      uint16_t step_half, low_half;
      const float stored_step = round_to_half(step, &step_half);
      const float stored_low = round_to_half(low, &low_half);
      float magnitude = fabsf(low) > fabsf(high) ? fabsf(low) : fabsf(high);
      magnitude = magnitude > 1.17549435e-38f ? magnitude : 1.17549435e-38f; /* float32's smallest normal */
      const v16f low_v = v16_set1(low), divisor_v = v16_set1(divisor);
      const v16f stored_step_v = v16_set1(stored_step), stored_low_v = v16_set1(stored_low);
      const v16f magnitude_v = v16_set1(magnitude), fifteen = v16_set1(15.0f);
      /* ties to even, as torch.round */
      v16f code_a = v16_round(v16_div(v16_sub(a, low_v), divisor_v));
      v16f code_b = v16_round(v16_div(v16_sub(b, low_v), divisor_v));
      code_a = v16_min(v16_max(code_a, zero), fifteen); /* a NaN (a refused group) becomes 0 */
      code_b = v16_min(v16_max(code_b, zero), fifteen);
      const v16f off_a = v16_sub(v16_add(v16_mul(code_a, stored_step_v), stored_low_v), a);
      const v16f off_b = v16_sub(v16_add(v16_mul(code_b, stored_step_v), stored_low_v), b);
      const float deviation = v16_reduce_max(
          v16_max(v16_div(v16_abs(off_a), magnitude_v), v16_div(v16_abs(off_b), magnitude_v)));
      worst = deviation > worst ? deviation : worst;
      uint8_t code[GROUP];
      v16_store_bytes(code, code_a);
      v16_store_bytes(code + 16, code_b);
      /* codes [N / 16][K / 8][64]: byte 4 column + i holds k = 8 chunk + i (low) and 8 chunk + 4 + i */
      for (int c = 0; c < GROUP / 8; c++) {
        uint8_t *out = codes + ((block * chunks) + g * (GROUP / 8) + c) * 64 + 4 * column;
        for (int i = 0; i < 4; i++) out[i] = (uint8_t)(code[8 * c + i] | (code[8 * c + 4 + i] << 4));
      }
      /* scales [N / 16][K / 32][2][16]: the block's 16 steps, then its 16 minimums */
      uint16_t *pair = scales + (block * groups + g) * 2 * BLOCK_COLUMNS + column;
      pair[0] = step_half;
      pair[BLOCK_COLUMNS] = low_half;
    }
  }
  *max_deviation = saw_non_finite ? NAN : worst;
  return (saw_non_finite || !(worst <= tolerance)) ? 1 : 0;
}
