/* fitserve's CPU int4 GEMM: out[M, N] = x[M, K] @ W^T (+ bias), W held as 4-bit codes in groups of 32.
 *
 * Built at run time by library.py with the machine's C compiler (-O3 -march=native -fopenmp, once per kernel
 * set) and called through ctypes. Three forms of the same arithmetic, picked by the instructions the build
 * enables; all three give the same bits (the integer sums are exact and the float steps the same):
 *   AVX-512 F/BW/VNNI (set avx512): 16 columns per 512-bit VPDPBUSD;
 *   AVX2 + AVX-VNNI (set avx_vnni): 8 columns per 256-bit VPDPBUSD, a block's two halves one after the other;
 *   AVX2 (set avx2): VPDPBUSD done as VPMADDUBSW (codes <= 15 times |q| <= 127, summed in pairs: at most
 *     3,810, no int16 saturation), the low and high nibbles' pairs added (<= 7,620) and summed over a
 *     group's 4 chunks (<= 30,480, still no saturation), then VPMADDWD by 1s once per group.
 *
 * Weights: w[n, k] = code[n, k] * step[n, g] + minimum[n, g] for the group g = k / 32 (a Q4_1 GGUF's form).
 * Activations: each row of x is rounded per group of 32 to two int8 levels with the scale dx = max|x| / 127:
 * q1 = round(x / dx), then q2 = round(254 (x / dx - q1)), so x = dx (q1 + q2 / 254) within dx / 508, about
 * 1.6e-5 of the group's largest |x| (one int8 level, as llama.cpp rounds activations for its Q4_1 dot
 * products, is off by up to 1/254 of it: enough to change SmolLM2-135M's greedy answers). Then
 *   out[m, n] = sum_g dx[m, g] * (step[n, g] * sum_k code[n, k] (q1 + q2 / 254)[m, k]
 *                                 + minimum[n, g] * sum_k (q1 + q2 / 254)[m, k]),
 * the sums over k exact in int32 (VPDPBUSD: unsigned code bytes times signed q bytes, four per lane):
 * the exact product of the weights with the rounded activations, up to float32 rounding.
 *
 * Layout (int4_layout.py writes it; a unit test pins both):
 *   codes  uint8 [N / 16][K / 8][64]: for a block of 16 output columns and 8 consecutive k, byte 4 j + i
 *          holds code[16 b + j, k + i] in its low nibble and code[16 b + j, k + 4 + i] in its high one,
 *          so one 64-byte load gives a VPDPBUSD operand per nibble half.
 *   scales float16 [N / 16][K / 32][2][16]: per block and group, the 16 columns' steps, then minimums.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec16.h"

#if FS_AVX512 && (!defined(__AVX512BW__) || !defined(__AVX512VNNI__))
#error "this CPU lacks AVX-512 BW/VNNI, which the avx512 set's int4 GEMM is written for"
#endif
/* library.py asks for the AVX-VNNI form (FS_WANT_AVX_VNNI) or for plain AVX2 (FS_AVX2_ONLY) */
#if !FS_AVX512 && defined(FS_WANT_AVX_VNNI) && !defined(__AVXVNNI__)
#error "this CPU lacks AVX-VNNI, which the avx_vnni set's int4 GEMM is written for"
#endif
#if !FS_AVX512 && defined(__AVXVNNI__) && !defined(FS_AVX2_ONLY)
#define FS_AVX_VNNI 1
#endif

#define GROUP 32
#define BLOCK_COLUMNS 16
#define ROW_TILE 4
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 2048
#endif
/* the second activation level's steps per first-level step */
#define RESIDUAL_STEPS 254

int fs_int4_gemm_abi_version(void) { return 2; }

#if FS_AVX512

/* One group of 32 activations -> its two int8 levels q1 and q2, its scale dx and its rounded sum. */
static inline void quantize_group(const float *xs, int8_t *q1, int8_t *q2, float *dx, float *xsum) {
  const __m512 residual_scale = _mm512_set1_ps((float)RESIDUAL_STEPS);
  const __m512 a = _mm512_loadu_ps(xs), b = _mm512_loadu_ps(xs + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  const float d = amax / 127.0f;
  const __m512 inverse = _mm512_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
  /* rounds to nearest even (the default MXCSR mode) */
  const __m512 sa = _mm512_mul_ps(a, inverse), sb = _mm512_mul_ps(b, inverse);
  const __m512 ra = _mm512_roundscale_ps(sa, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 rb = _mm512_roundscale_ps(sb, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512i qa = _mm512_cvtps_epi32(ra), qb = _mm512_cvtps_epi32(rb);
  /* |x / d - round(x / d)| <= 1/2, so the second level's steps of 1/254 fit in -127..127 */
  const __m512i ea = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(sa, ra), residual_scale));
  const __m512i eb = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(sb, rb), residual_scale));
  _mm_storeu_si128((__m128i *)q1, _mm512_cvtsepi32_epi8(qa));
  _mm_storeu_si128((__m128i *)(q1 + 16), _mm512_cvtsepi32_epi8(qb));
  _mm_storeu_si128((__m128i *)q2, _mm512_cvtsepi32_epi8(ea));
  _mm_storeu_si128((__m128i *)(q2 + 16), _mm512_cvtsepi32_epi8(eb));
  const int32_t first = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
  const int32_t second = _mm512_reduce_add_epi32(_mm512_add_epi32(ea, eb));
  *dx = d;
  *xsum = d * ((float)first + (float)second / (float)RESIDUAL_STEPS);
}

#else

/* 32 int32 in four vectors (in order) -> 32 int8, saturating as VPMOVSDB does */
static inline void store_int8(int8_t *out, __m256i a, __m256i b, __m256i c, __m256i d) {
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d));
  /* dword i of each 128-bit lane holds 4 values of vector i: the lower lane's, then the upper's */
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  _mm256_storeu_si256((__m256i *)out, _mm256_permutevar8x32_epi32(bytes, order));
}

static inline int32_t sum_epi32(__m256i v) {
  const __m128i four = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  const __m128i two = _mm_add_epi32(four, _mm_unpackhi_epi64(four, four));
  return _mm_cvtsi128_si32(_mm_add_epi32(two, _mm_shuffle_epi32(two, 1)));
}

/* As the AVX-512 form, in four vectors of 8 (the same roundings, so the same q1, q2, dx and sum). */
static inline void quantize_group(const float *xs, int8_t *q1, int8_t *q2, float *dx, float *xsum) {
  const __m256 residual_scale = _mm256_set1_ps((float)RESIDUAL_STEPS);
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 v[4], amax = _mm256_setzero_ps();
  for (int i = 0; i < 4; i++) {
    v[i] = _mm256_loadu_ps(xs + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_and_ps(v[i], magnitude));
  }
  __m128 top = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  top = _mm_max_ps(top, _mm_movehl_ps(top, top));
  top = _mm_max_ss(top, _mm_shuffle_ps(top, top, 1));
  const float d = _mm_cvtss_f32(top) / 127.0f;
  const __m256 inverse = _mm256_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
  __m256i q[4], e[4];
  for (int i = 0; i < 4; i++) {
    const __m256 scaled = _mm256_mul_ps(v[i], inverse);
    const __m256 rounded = _mm256_round_ps(scaled, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    q[i] = _mm256_cvtps_epi32(rounded);
    e[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_sub_ps(scaled, rounded), residual_scale));
  }
  store_int8(q1, q[0], q[1], q[2], q[3]);
  store_int8(q2, e[0], e[1], e[2], e[3]);
  const __m256i q_sum = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
  const __m256i e_sum = _mm256_add_epi32(_mm256_add_epi32(e[0], e[1]), _mm256_add_epi32(e[2], e[3]));
  const int32_t first = sum_epi32(q_sum), second = sum_epi32(e_sum);
  *dx = d;
  *xsum = d * ((float)first + (float)second / (float)RESIDUAL_STEPS);
}

#endif

/* x [M, K] -> two int8 rows per row (q1, then q2 for what q1 leaves: x ~ dx (q1 + q2 / 254) within
 * dx / 508), and per row and group the scale dx and the sum of the rounded activations,
 * dx (sum q1 + sum q2 / 254). q holds [M][2][K]. */
static void quantize_rows(const float *x, int64_t rows, int64_t K, int64_t ldx, int8_t *q, float *dx,
                          float *xsum) {
  const int64_t groups = K / GROUP;
  for (int64_t r = 0; r < rows; r++) {
    int8_t *q1 = q + r * 2 * K, *q2 = q1 + K;
    for (int64_t g = 0; g < groups; g++)
      quantize_group(x + r * ldx + g * GROUP, q1 + g * GROUP, q2 + g * GROUP, dx + r * groups + g,
                     xsum + r * groups + g);
  }
}

#if FS_AVX512

/* One block of 16 columns for `rows` (a constant after inlining) rows of quantized activations. */
static inline __attribute__((always_inline)) void column_block(
    const int rows, const int8_t *q, int64_t K, const float *dx, const float *xsum,
    const uint8_t *codes, const uint16_t *scales, const float *bias, float *out, int64_t ldo) {
  const int64_t groups = K / GROUP;
  const __m512i nibble = _mm512_set1_epi8(15);
  const __m512 second_weight = _mm512_set1_ps(1.0f / (float)RESIDUAL_STEPS);
  __m512 acc[ROW_TILE];
  for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; g++) {
    /* per level, low and high nibbles accumulate apart: four independent dependency chains */
    __m512i low1[ROW_TILE], high1[ROW_TILE], low2[ROW_TILE], high2[ROW_TILE];
    for (int r = 0; r < rows; r++) {
      low1[r] = high1[r] = low2[r] = high2[r] = _mm512_setzero_si512();
    }
    const uint8_t *group_codes = codes + g * (GROUP / 8) * 64;
    for (int chunk = 0; chunk < GROUP / 8; chunk++) {
      _mm_prefetch((const char *)(group_codes + chunk * 64 + PREFETCH_BYTES), _MM_HINT_T0);
      const __m512i packed = _mm512_loadu_si512(group_codes + chunk * 64);
      const __m512i low = _mm512_and_si512(packed, nibble);
      const __m512i high = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble);
      const int64_t k = g * GROUP + chunk * 8;
      for (int r = 0; r < rows; r++) {
        const int8_t *q1 = q + r * 2 * K + k, *q2 = q1 + K;
        int32_t a1, b1, a2, b2;
        memcpy(&a1, q1, 4);
        memcpy(&b1, q1 + 4, 4);
        memcpy(&a2, q2, 4);
        memcpy(&b2, q2 + 4, 4);
        low1[r] = _mm512_dpbusd_epi32(low1[r], low, _mm512_set1_epi32(a1));
        high1[r] = _mm512_dpbusd_epi32(high1[r], high, _mm512_set1_epi32(b1));
        low2[r] = _mm512_dpbusd_epi32(low2[r], low, _mm512_set1_epi32(a2));
        high2[r] = _mm512_dpbusd_epi32(high2[r], high, _mm512_set1_epi32(b2));
      }
    }
    const uint16_t *group_scales = scales + g * 2 * BLOCK_COLUMNS;
    const __m512 step = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)group_scales));
    const __m512 minimum = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(group_scales + 16)));
    for (int r = 0; r < rows; r++) {
      const __m512 first = _mm512_cvtepi32_ps(_mm512_add_epi32(low1[r], high1[r]));
      const __m512 second = _mm512_cvtepi32_ps(_mm512_add_epi32(low2[r], high2[r]));
      const __m512 dot = _mm512_fmadd_ps(second, second_weight, first); /* sum code * x / dx */
      acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(step, _mm512_set1_ps(dx[r * groups + g])), acc[r]);
      acc[r] = _mm512_fmadd_ps(minimum, _mm512_set1_ps(xsum[r * groups + g]), acc[r]);
    }
  }
  const __m512 b = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  for (int r = 0; r < rows; r++) _mm512_storeu_ps(out + r * ldo, _mm512_add_ps(acc[r], b));
}

#else

/* Columns 8 half .. 8 half + 7 of a block of 16 for `rows` rows (both constants after inlining): the
 * AVX-512 form's arithmetic on 8 columns. Up to 2 rows, each level's low and high nibbles accumulate
 * apart (four dependency chains, as there); with more rows they share one (the registers run out). */
static inline __attribute__((always_inline)) void column_half(
    const int rows, const int half, const int8_t *q, int64_t K, const float *dx, const float *xsum,
    const uint8_t *codes, const uint16_t *scales, const float *bias, float *out, int64_t ldo) {
  const int64_t groups = K / GROUP;
  const __m256i nibble = _mm256_set1_epi8(15);
  const __m256 second_weight = _mm256_set1_ps(1.0f / (float)RESIDUAL_STEPS);
#if !FS_AVX_VNNI
  const __m256i ones = _mm256_set1_epi16(1);
#endif
  __m256 acc[ROW_TILE];
  for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; g++) {
    __m256i low1[ROW_TILE], high1[ROW_TILE], low2[ROW_TILE], high2[ROW_TILE];
    for (int r = 0; r < rows; r++) {
      low1[r] = high1[r] = low2[r] = high2[r] = _mm256_setzero_si256();
    }
    const uint8_t *group_codes = codes + g * (GROUP / 8) * 64 + 32 * half;
    for (int chunk = 0; chunk < GROUP / 8; chunk++) {
      _mm_prefetch((const char *)(group_codes + chunk * 64 + PREFETCH_BYTES), _MM_HINT_T0);
      const __m256i packed = _mm256_loadu_si256((const __m256i *)(group_codes + chunk * 64));
      const __m256i low = _mm256_and_si256(packed, nibble);
      const __m256i high = _mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble);
      const int64_t k = g * GROUP + chunk * 8;
      for (int r = 0; r < rows; r++) {
        const int8_t *q1 = q + r * 2 * K + k, *q2 = q1 + K;
        int32_t a1, b1, a2, b2;
        memcpy(&a1, q1, 4);
        memcpy(&b1, q1 + 4, 4);
        memcpy(&a2, q2, 4);
        memcpy(&b2, q2 + 4, 4);
        const __m256i x_a1 = _mm256_set1_epi32(a1), x_b1 = _mm256_set1_epi32(b1);
        const __m256i x_a2 = _mm256_set1_epi32(a2), x_b2 = _mm256_set1_epi32(b2);
#if FS_AVX_VNNI
        if (rows <= 2) {
          low1[r] = _mm256_dpbusd_avx_epi32(low1[r], low, x_a1);
          high1[r] = _mm256_dpbusd_avx_epi32(high1[r], high, x_b1);
          low2[r] = _mm256_dpbusd_avx_epi32(low2[r], low, x_a2);
          high2[r] = _mm256_dpbusd_avx_epi32(high2[r], high, x_b2);
        } else {
          low1[r] = _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(low1[r], low, x_a1), high, x_b1);
          low2[r] = _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(low2[r], low, x_a2), high, x_b2);
        }
#else
        /* int16 pair sums, low and high nibbles added, over the group's 4 chunks: <= 4 * 7,620 = 30,480 */
        low1[r] = _mm256_add_epi16(low1[r], _mm256_add_epi16(_mm256_maddubs_epi16(low, x_a1),
                                                             _mm256_maddubs_epi16(high, x_b1)));
        low2[r] = _mm256_add_epi16(low2[r], _mm256_add_epi16(_mm256_maddubs_epi16(low, x_a2),
                                                             _mm256_maddubs_epi16(high, x_b2)));
#endif
      }
    }
#if !FS_AVX_VNNI
    for (int r = 0; r < rows; r++) { /* the int16 pairs of each lane to its int32 sum */
      low1[r] = _mm256_madd_epi16(low1[r], ones);
      low2[r] = _mm256_madd_epi16(low2[r], ones);
    }
#endif
    const uint16_t *group_scales = scales + g * 2 * BLOCK_COLUMNS + 8 * half;
    const __m256 step = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)group_scales));
    const __m256 minimum = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(group_scales + 16)));
    for (int r = 0; r < rows; r++) {
      const __m256 first = _mm256_cvtepi32_ps(_mm256_add_epi32(low1[r], high1[r]));
      const __m256 second = _mm256_cvtepi32_ps(_mm256_add_epi32(low2[r], high2[r]));
      const __m256 dot = _mm256_fmadd_ps(second, second_weight, first); /* sum code * x / dx */
      acc[r] = _mm256_fmadd_ps(dot, _mm256_mul_ps(step, _mm256_set1_ps(dx[r * groups + g])), acc[r]);
      acc[r] = _mm256_fmadd_ps(minimum, _mm256_set1_ps(xsum[r * groups + g]), acc[r]);
    }
  }
  const __m256 b = bias ? _mm256_loadu_ps(bias + 8 * half) : _mm256_setzero_ps();
  for (int r = 0; r < rows; r++) _mm256_storeu_ps(out + r * ldo + 8 * half, _mm256_add_ps(acc[r], b));
}

/* One block of 16 columns: its two halves, one after the other (the second reads codes the first just
 * brought into the cache). */
static inline __attribute__((always_inline)) void column_block(
    const int rows, const int8_t *q, int64_t K, const float *dx, const float *xsum,
    const uint8_t *codes, const uint16_t *scales, const float *bias, float *out, int64_t ldo) {
  column_half(rows, 0, q, K, dx, xsum, codes, scales, bias, out, ldo);
  column_half(rows, 1, q, K, dx, xsum, codes, scales, bias, out, ldo);
}

#endif

/* Returns 0, or -1 when the scratch for the quantized activations cannot be allocated.
 * K % 32 == 0 and N % 16 == 0 (the caller checks); bias may be NULL; threads: OpenMP threads to use. */
int fs_int4_gemm(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *codes,
                 const uint16_t *scales, int64_t N, const float *bias, float *out, int64_t ldo,
                 int threads) {
  const int64_t groups = K / GROUP;
  int8_t *q = malloc((size_t)(2 * M * K + M * groups * 8));
  if (!q) return -1;
  float *dx = (float *)(q + 2 * M * K);
  float *xsum = dx + M * groups;
  quantize_rows(x, M, K, ldx, q, dx, xsum);
  const int64_t blocks = N / BLOCK_COLUMNS;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t b = 0; b < blocks; b++) {
    const uint8_t *block_codes = codes + b * (K / 8) * 64;
    const uint16_t *block_scales = scales + b * groups * 2 * BLOCK_COLUMNS;
    const float *block_bias = bias ? bias + b * BLOCK_COLUMNS : NULL;
    for (int64_t r0 = 0; r0 < M; r0 += ROW_TILE) {
      const int8_t *tile_q = q + r0 * 2 * K;
      const float *tile_dx = dx + r0 * groups;
      const float *tile_qsum = xsum + r0 * groups;
      float *tile_out = out + r0 * ldo + b * BLOCK_COLUMNS;
      switch (M - r0 >= ROW_TILE ? ROW_TILE : M - r0) {
        case 1:
          column_block(1, tile_q, K, tile_dx, tile_qsum, block_codes, block_scales, block_bias, tile_out, ldo);
          break;
        case 2:
          column_block(2, tile_q, K, tile_dx, tile_qsum, block_codes, block_scales, block_bias, tile_out, ldo);
          break;
        case 3:
          column_block(3, tile_q, K, tile_dx, tile_qsum, block_codes, block_scales, block_bias, tile_out, ldo);
          break;
        default:
          column_block(4, tile_q, K, tile_dx, tile_qsum, block_codes, block_scales, block_bias, tile_out, ldo);
          break;
      }
    }
  }
  free(q);
  return 0;
}
