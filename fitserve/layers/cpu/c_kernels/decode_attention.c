/* fitserve's CPU paged attention for decode steps (one new token per sequence), float32 KV cache.
 *
 * One call per layer and step does what paged_decode.py does in ~10 torch calls: writes each sequence's
 * new key and value at its slot, then each query head attends over its sequence's cached tokens, read
 * in place through the block table (no gather). Work is split over (sequence, key/value head) pairs.
 * Per query head: scores s_t = scale * q . k_t for t < seq_len, p_t = exp(s_t - max s) (vector_exp.h),
 * out = sum p_t v_t / sum p_t, all in float32 (what SDPA computes for a float32 cache, summed in another
 * order). A pair's query heads (grouped-query attention) then share each value row read, up to 4 heads
 * of 64 dims or 2 of 128 at once with their sums in registers: at a 1,000-token context that took a call
 * for SmolLM2's shapes from ~180 to ~110 us on one thread.
 *
 * Shapes (elements; the caller checks them): q [B][H][D] with token stride q_stride, k and v [B][KVH][D]
 * with token strides k_stride and v_stride (heads contiguous, D contiguous, D % 16 == 0); kv_cache
 * [2][num_blocks][block_size][KVH][D] contiguous; slots int64 [B]; block_tables int32 [B][max_blocks];
 * seq_lens int32 [B] (the new token included); out [B][H][D] contiguous.
 *
 * Written on vec16.h's 16-lane vectors, so the AVX2 build computes the same bits; it has 16 registers of 8
 * floats where AVX-512 has 32 of 16, so there the value sums go one head at a time (VALUE_HEADS_*).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec16.h"
#include "vector_exp.h"

/* query heads whose value sums are kept in registers at once, for heads of 64 and 128 dims */
#if FS_AVX512
#define VALUE_HEADS_64 4
#define VALUE_HEADS_128 2
#else
#define VALUE_HEADS_64 1
#define VALUE_HEADS_128 1
#endif

#define MAX_GROUP 16 /* query heads per key/value head */

/* scores[0..len) := exp(scores - top); returns their sum */
static float exp_and_sum(float *scores, int64_t len, float top) {
  const v16f shift = v16_set1(top);
  v16f sum = v16_zero();
  for (int64_t t = 0; t < len; t += 16) {
    const int64_t live = len - t; /* lanes past it are not the row's: neither stored nor summed */
    const v16f e = exp16(v16_sub(v16_load_first(scores + t, live), shift));
    v16_store_first(scores + t, e, live);
    sum = v16_add(sum, v16_keep_first(e, live));
  }
  return v16_reduce_add(sum);
}

/* One query head's scores over its sequence into scores[0..len), softmaxed in place; returns their sum
 * before normalizing. `chunks` is D / 16, a constant after inlining for the usual head sizes. */
static inline __attribute__((always_inline)) float head_scores(
    const int64_t chunks, const float *query, const float *keys, const int32_t *table, int64_t len,
    int64_t block_size, int64_t block_elems, int64_t token_elems, float scale, float *scores) {
  v16f q[16];
  for (int64_t c = 0; c < chunks; c++) q[c] = v16_load(query + 16 * c);
  const int64_t used_blocks = (len + block_size - 1) / block_size;
  float top = -INFINITY;
  for (int64_t j = 0, t = 0; j < used_blocks; j++) {
    const float *key = keys + (int64_t)table[j] * block_elems;
    const int64_t n = len - t < block_size ? len - t : block_size;
    for (int64_t i = 0; i < n; i++, t++, key += token_elems) {
      v16f acc = v16_mul(q[0], v16_load(key));
      for (int64_t c = 1; c < chunks; c++) acc = v16_fmadd(q[c], v16_load(key + 16 * c), acc);
      const float s = scale * v16_reduce_add(acc);
      scores[t] = s;
      top = s > top ? s : top;
    }
  }
  return exp_and_sum(scores, len, top);
}

/* The weighted values of `group` query heads sharing one key/value head (group and chunks constants
 * after inlining, group * chunks <= 16 when run): each value row is read once for all of them, the
 * sums stay in registers. scores: [group][len], softmaxed; totals: their sums; result: [group][D]. */
static inline __attribute__((always_inline)) void group_values(
    const int64_t group, const int64_t chunks, const float *values, const int32_t *table, int64_t len,
    int64_t block_size, int64_t block_elems, int64_t token_elems, const float *scores, const float *totals,
    float *result) {
  v16f out[64]; /* group * chunks of them are used: at most 16 on the paths attend_group takes */
  for (int64_t a = 0; a < group * chunks; a++) out[a] = v16_zero();
  const int64_t used_blocks = (len + block_size - 1) / block_size;
  for (int64_t j = 0, t = 0; j < used_blocks; j++) {
    const float *value = values + (int64_t)table[j] * block_elems;
    const int64_t n = len - t < block_size ? len - t : block_size;
    for (int64_t i = 0; i < n; i++, t++, value += token_elems) {
      for (int64_t c = 0; c < chunks; c++) {
        const v16f row = v16_load(value + 16 * c);
        for (int64_t g = 0; g < group; g++)
          out[g * chunks + c] = v16_fmadd(v16_set1(scores[g * len + t]), row, out[g * chunks + c]);
      }
    }
  }
  for (int64_t g = 0; g < group; g++) {
    const v16f inverse = v16_set1(1.0f / totals[g]);
    for (int64_t c = 0; c < chunks; c++)
      v16_store(result + g * chunks * 16 + 16 * c, v16_mul(out[g * chunks + c], inverse));
  }
}

/* One key/value head's query heads: their scores, then their values, `heads_at_once` at a time. */
static inline __attribute__((always_inline)) void attend_group(
    const int64_t chunks, const int64_t heads_at_once, int64_t group, const float *queries, const float *keys,
    const float *values, const int32_t *table, int64_t len, int64_t block_size, int64_t block_elems,
    int64_t token_elems, float scale, float *scores, float *result) {
  float totals[MAX_GROUP];
  for (int64_t g = 0; g < group; g++)
    totals[g] = head_scores(chunks, queries + g * chunks * 16, keys, table, len, block_size, block_elems,
                            token_elems, scale, scores + g * len);
  for (int64_t g = 0; g < group;) {
    const int64_t take = group - g < heads_at_once ? group - g : heads_at_once;
    const float *head_scores_g = scores + g * len;
    float *head_result = result + g * chunks * 16;
#define FS_GROUP_VALUES(n)                                                                                    \
  group_values(n, chunks, values, table, len, block_size, block_elems, token_elems, head_scores_g, totals + g, \
               head_result)
    switch (take) { /* each case a constant head count, so the sums stay in registers */
      case 4: FS_GROUP_VALUES(4); break;
      case 3: FS_GROUP_VALUES(3); break;
      case 2: FS_GROUP_VALUES(2); break;
      default: FS_GROUP_VALUES(1); break;
    }
#undef FS_GROUP_VALUES
    g += take;
  }
}

/* Returns 0; -1 when a pair's score scratch cannot be allocated, -2 for a group over MAX_GROUP or a head
 * over 256 dims. */
int fs_paged_decode_attention(const float *q, int64_t q_stride, const float *k, int64_t k_stride,
                              const float *v, int64_t v_stride, float *kv_cache, int64_t num_blocks,
                              int64_t block_size, const int64_t *slots, const int32_t *block_tables,
                              int64_t max_blocks, const int32_t *seq_lens, int64_t B, int64_t H,
                              int64_t KVH, int64_t D, float scale, float *out, int threads) {
  const int64_t group = H / KVH;
  if (group > MAX_GROUP || D > 256) return -2;
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
    float *scores = malloc(sizeof(float) * (size_t)(len * group));
    if (!scores) {
#pragma omp atomic write
      status = -1;
      continue;
    }
    const int32_t *table = block_tables + b * max_blocks;
    const float *queries = q + b * q_stride + kv_head * group * D;
    float *result = out + (b * H + kv_head * group) * D;
    const float *head_keys = keys + kv_head * D, *head_values = values + kv_head * D;
    /* value sums in registers: with AVX-512 up to 16 of 16 floats, 4 heads of 64 dims or 2 of 128 */
    switch (D) {
      case 64:
        attend_group(4, VALUE_HEADS_64, group, queries, head_keys, head_values, table, len, block_size,
                     block_elems, token_elems, scale, scores, result);
        break;
      case 128:
        attend_group(8, VALUE_HEADS_128, group, queries, head_keys, head_values, table, len, block_size,
                     block_elems, token_elems, scale, scores, result);
        break;
      default:
        attend_group(D / 16, 1, group, queries, head_keys, head_values, table, len, block_size, block_elems,
                     token_elems, scale, scores, result);
    }
    free(scores);
  }
  return status;
}
