/* fitserve's CPU paged attention for decode steps (one new token per sequence), float32 KV cache.
 *
 * One call per layer and step does what paged_decode.py does in ~10 torch calls: writes each sequence's
 * new key and value at its slot, then each query head attends over its sequence's cached tokens, read
 * in place through the block table (no gather). Work is split over (sequence, key/value head) pairs;
 * a pair's query heads (grouped-query attention) share each key and value read.
 *
 * Per pair: scores s_t = scale * q . k_t for t < seq_len, p_t = exp(s_t - max s), out = sum p_t v_t /
 * sum p_t, all in float32 (what SDPA computes for a float32 cache, summed in another order).
 *
 * Shapes (elements; the caller checks them): q [B][H][D] with token stride q_stride, k and v [B][KVH][D]
 * with token strides k_stride and v_stride (heads contiguous, D contiguous, D % 16 == 0); kv_cache
 * [2][num_blocks][block_size][KVH][D] contiguous; slots int64 [B]; block_tables int32 [B][max_blocks];
 * seq_lens int32 [B] (the new token included); out [B][H][D] contiguous.
 */
#if !defined(__AVX512F__)
#error "this CPU lacks AVX-512 F, which the decode attention is written for"
#endif

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vector_exp.h"

#define MAX_GROUP 16 /* query heads per key/value head */

static inline float dot(const float *a, const float *b, int64_t D) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(b + d), acc);
  return _mm512_reduce_add_ps(acc);
}

static inline void add_scaled(float *acc, const float *x, float weight, int64_t D) {
  const __m512 w = _mm512_set1_ps(weight);
  for (int64_t d = 0; d < D; d += 16)
    _mm512_storeu_ps(acc + d, _mm512_fmadd_ps(_mm512_loadu_ps(x + d), w, _mm512_loadu_ps(acc + d)));
}

/* scores[0..len) := exp(scores - top); returns their sum */
static float exp_and_sum(float *scores, int64_t len, float top) {
  const __m512 shift = _mm512_set1_ps(top);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t t = 0; t < len; t += 16) {
    const __mmask16 live = len - t >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (len - t)) - 1);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, scores + t), shift));
    _mm512_mask_storeu_ps(scores + t, live, e);
    sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(live, e));
  }
  return _mm512_reduce_add_ps(sum);
}

/* Returns 0; -1 when a pair's score scratch cannot be allocated, -2 for a group over MAX_GROUP. */
int fs_paged_decode_attention(const float *q, int64_t q_stride, const float *k, int64_t k_stride,
                              const float *v, int64_t v_stride, float *kv_cache, int64_t num_blocks,
                              int64_t block_size, const int64_t *slots, const int32_t *block_tables,
                              int64_t max_blocks, const int32_t *seq_lens, int64_t B, int64_t H,
                              int64_t KVH, int64_t D, float scale, float *out, int threads) {
  const int64_t group = H / KVH;
  if (group > MAX_GROUP) return -2;
  const int64_t token_elems = KVH * D;
  const int64_t block_elems = block_size * token_elems;
  float *keys = kv_cache, *values = kv_cache + num_blocks * block_elems;
  for (int64_t b = 0; b < B; b++) {
    memcpy(keys + slots[b] * token_elems, k + b * k_stride, token_elems * sizeof(float));
    memcpy(values + slots[b] * token_elems, v + b * v_stride, token_elems * sizeof(float));
  }
  int status = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int64_t pair = 0; pair < B * KVH; pair++) {
    const int64_t b = pair / KVH, kv_head = pair % KVH;
    const int64_t len = seq_lens[b];
    const int64_t used_blocks = (len + block_size - 1) / block_size;
    const int32_t *table = block_tables + b * max_blocks;
    float *scores = malloc(sizeof(float) * (size_t)(len * group));
    if (!scores) {
#pragma omp atomic write
      status = -1;
      continue;
    }
    const float *queries = q + b * q_stride + kv_head * group * D;
    float top[MAX_GROUP];
    for (int64_t g = 0; g < group; g++) top[g] = -INFINITY;
    for (int64_t j = 0, t = 0; j < used_blocks; j++) {
      const float *block_keys = keys + (int64_t)table[j] * block_elems + kv_head * D;
      const int64_t n = len - t < block_size ? len - t : block_size;
      for (int64_t i = 0; i < n; i++, t++) {
        const float *key = block_keys + i * token_elems;
        for (int64_t g = 0; g < group; g++) {
          const float s = scale * dot(queries + g * D, key, D);
          scores[g * len + t] = s;
          top[g] = s > top[g] ? s : top[g];
        }
      }
    }
    float total[MAX_GROUP];
    for (int64_t g = 0; g < group; g++) total[g] = exp_and_sum(scores + g * len, len, top[g]);
    float *result = out + (b * H + kv_head * group) * D;
    memset(result, 0, sizeof(float) * (size_t)(group * D));
    for (int64_t j = 0, t = 0; j < used_blocks; j++) {
      const float *block_values = values + (int64_t)table[j] * block_elems + kv_head * D;
      const int64_t n = len - t < block_size ? len - t : block_size;
      for (int64_t i = 0; i < n; i++, t++) {
        const float *value = block_values + i * token_elems;
        for (int64_t g = 0; g < group; g++) add_scaled(result + g * D, value, scores[g * len + t], D);
      }
    }
    for (int64_t g = 0; g < group; g++) {
      const __m512 inverse = _mm512_set1_ps(1.0f / total[g]);
      for (int64_t d = 0; d < D; d += 16)
        _mm512_storeu_ps(result + g * D + d, _mm512_mul_ps(_mm512_loadu_ps(result + g * D + d), inverse));
    }
    free(scores);
  }
  return status;
}
