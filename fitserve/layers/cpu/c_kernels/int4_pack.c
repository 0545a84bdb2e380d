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
 * is two AVX-512 registers.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#define GROUP 32
#define BLOCK_COLUMNS 16

/* 16 weights as float32: from float32, or from bfloat16 (its upper 16 bits, exactly) */
static inline __m512 load16(const void *w, int64_t index, int bf16) {
  if (bf16) {
    const __m256i bits = _mm256_loadu_si256((const __m256i *)((const uint16_t *)w + index));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  }
  return _mm512_loadu_ps((const float *)w + index);
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
      const __m512 zero = _mm512_setzero_ps();
      const __m512 a = load16(w, first, bf16), b = load16(w, first + 16, bf16);
      /* v - v is 0 exactly for finite v, NaN for an infinity or a NaN */
      const __mmask16 finite = _mm512_cmp_ps_mask(_mm512_sub_ps(a, a), zero, _CMP_EQ_OQ) &
                               _mm512_cmp_ps_mask(_mm512_sub_ps(b, b), zero, _CMP_EQ_OQ);
      saw_non_finite |= finite != 0xFFFF;
      const float low = _mm512_reduce_min_ps(_mm512_min_ps(a, b));
      const float high = _mm512_reduce_max_ps(_mm512_max_ps(a, b));
      const float step = (high - low) / 15.0f;
      const float divisor = step > 0.0f ? step : 1.0f;
      uint16_t step_half, low_half;
      const float stored_step = round_to_half(step, &step_half);
      const float stored_low = round_to_half(low, &low_half);
      float magnitude = fabsf(low) > fabsf(high) ? fabsf(low) : fabsf(high);
      magnitude = magnitude > 1.17549435e-38f ? magnitude : 1.17549435e-38f; /* float32's smallest normal */
      const __m512 low_v = _mm512_set1_ps(low), divisor_v = _mm512_set1_ps(divisor);
      const __m512 stored_step_v = _mm512_set1_ps(stored_step), stored_low_v = _mm512_set1_ps(stored_low);
      const __m512 magnitude_v = _mm512_set1_ps(magnitude), fifteen = _mm512_set1_ps(15.0f);
      const int nearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC; /* ties to even, as torch.round */
      __m512 code_a = _mm512_roundscale_ps(_mm512_div_ps(_mm512_sub_ps(a, low_v), divisor_v), nearest);
      __m512 code_b = _mm512_roundscale_ps(_mm512_div_ps(_mm512_sub_ps(b, low_v), divisor_v), nearest);
      code_a = _mm512_min_ps(_mm512_max_ps(code_a, zero), fifteen); /* a NaN (a refused group) becomes 0 */
      code_b = _mm512_min_ps(_mm512_max_ps(code_b, zero), fifteen);
      const __m512 off_a = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(code_a, stored_step_v), stored_low_v), a);
      const __m512 off_b = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(code_b, stored_step_v), stored_low_v), b);
      const float deviation = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_div_ps(_mm512_abs_ps(off_a), magnitude_v),
                                                                 _mm512_div_ps(_mm512_abs_ps(off_b), magnitude_v)));
      worst = deviation > worst ? deviation : worst;
      uint8_t code[GROUP];
      _mm_storeu_si128((__m128i *)code, _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(code_a)));
      _mm_storeu_si128((__m128i *)(code + 16), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(code_b)));
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
