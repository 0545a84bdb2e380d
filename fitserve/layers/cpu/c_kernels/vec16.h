/* 16 float32 lanes for the C kernels, on the instruction set the library is built for (library.py compiles
 * every source once per kernel set): one __m512 with AVX-512, two __m256 (lanes 0-7, then 8-15) with AVX2.
 *
 * Each operation rounds as its AVX-512 instruction does (2^n scaling included, see v16_scale2), and the
 * horizontal sums add in the order GCC's _mm512_reduce_add_ps does (the upper 8 lanes to the lower, then
 * the upper 4 to the lower, then lanes 2 and 3 to 0 and 1, then those two), so a kernel written on these
 * gives the same bits from either set.
 */
#ifndef FITSERVE_VEC16_H
#define FITSERVE_VEC16_H

#include <immintrin.h>
#include <stdint.h>

#if defined(__AVX512F__) && (defined(FS_AVX2_ONLY) || defined(FS_WANT_AVX_VNNI))
#error "an AVX2 kernel set was asked for, but the compiler still enables AVX-512 (-mno-avx512f ignored)"
#elif defined(__AVX512F__)
#define FS_AVX512 1
#elif !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "this CPU lacks AVX2, FMA or F16C, which the C kernels need at the least"
#endif

#if FS_AVX512

typedef __m512 v16f;

static inline __mmask16 fs_first_lanes(int64_t n) {
  return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1);
}
static inline v16f v16_zero(void) { return _mm512_setzero_ps(); }
static inline v16f v16_set1(float a) { return _mm512_set1_ps(a); }
static inline v16f v16_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void v16_store(float *p, v16f v) { _mm512_storeu_ps(p, v); }
/* lanes [0, n) of p (n in 1..16); the others read as 0 and are never touched in memory */
static inline v16f v16_load_first(const float *p, int64_t n) {
  return _mm512_maskz_loadu_ps(fs_first_lanes(n), p);
}
static inline void v16_store_first(float *p, v16f v, int64_t n) {
  _mm512_mask_storeu_ps(p, fs_first_lanes(n), v);
}
/* v with lanes n.. set to 0 */
static inline v16f v16_keep_first(v16f v, int64_t n) { return _mm512_maskz_mov_ps(fs_first_lanes(n), v); }
/* 16 bfloat16 values as the float32 values they hold exactly (their upper 16 bits) */
static inline v16f v16_load_bf16(const uint16_t *p) {
  const __m256i bits = _mm256_loadu_si256((const __m256i *)p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
static inline v16f v16_add(v16f a, v16f b) { return _mm512_add_ps(a, b); }
static inline v16f v16_sub(v16f a, v16f b) { return _mm512_sub_ps(a, b); }
static inline v16f v16_mul(v16f a, v16f b) { return _mm512_mul_ps(a, b); }
static inline v16f v16_div(v16f a, v16f b) { return _mm512_div_ps(a, b); }
/* a * b + c, rounded once */
static inline v16f v16_fmadd(v16f a, v16f b, v16f c) { return _mm512_fmadd_ps(a, b, c); }
/* c - a * b, rounded once */
static inline v16f v16_fnmadd(v16f a, v16f b, v16f c) { return _mm512_fnmadd_ps(a, b, c); }
/* as MINPS/MAXPS: b where either is NaN */
static inline v16f v16_min(v16f a, v16f b) { return _mm512_min_ps(a, b); }
static inline v16f v16_max(v16f a, v16f b) { return _mm512_max_ps(a, b); }
static inline v16f v16_abs(v16f a) { return _mm512_abs_ps(a); }
/* to the nearest integer, ties to even */
static inline v16f v16_round(v16f a) {
  return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
/* a * 2^n for integral n in [-150, 128], rounded once */
static inline v16f v16_scale2(v16f a, v16f n) { return _mm512_scalef_ps(a, n); }
static inline float v16_reduce_add(v16f a) { return _mm512_reduce_add_ps(a); }
static inline float v16_reduce_max(v16f a) { return _mm512_reduce_max_ps(a); }
static inline float v16_reduce_min(v16f a) { return _mm512_reduce_min_ps(a); }
/* whether every lane is finite (v - v is 0 for finite v, NaN for an infinity or a NaN) */
static inline int v16_all_finite(v16f a) {
  return _mm512_cmp_ps_mask(_mm512_sub_ps(a, a), _mm512_setzero_ps(), _CMP_EQ_OQ) == 0xFFFF;
}
/* lanes holding integers in 0..255 -> 16 bytes */
static inline void v16_store_bytes(uint8_t *out, v16f a) {
  _mm_storeu_si128((__m128i *)out, _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(a)));
}

#else /* AVX2 + FMA: two halves */

typedef struct {
  __m256 lo, hi;
} v16f;

static inline v16f fs_pair(__m256 lo, __m256 hi) {
  v16f v = {lo, hi};
  return v;
}
/* per half, all-ones in the lanes whose index (0..15) is below n */
static inline __m256i fs_lanes_below(int64_t n, int upper) {
  const __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const int32_t limit = (int32_t)(n > 16 ? 16 : n) - (upper ? 8 : 0);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(limit), index);
}
static inline v16f v16_zero(void) { return fs_pair(_mm256_setzero_ps(), _mm256_setzero_ps()); }
static inline v16f v16_set1(float a) { return fs_pair(_mm256_set1_ps(a), _mm256_set1_ps(a)); }
static inline v16f v16_load(const float *p) { return fs_pair(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)); }
static inline void v16_store(float *p, v16f v) {
  _mm256_storeu_ps(p, v.lo);
  _mm256_storeu_ps(p + 8, v.hi);
}
static inline v16f v16_load_first(const float *p, int64_t n) {
  const __m256 lo = _mm256_maskload_ps(p, fs_lanes_below(n, 0));
  return fs_pair(lo, _mm256_maskload_ps(p + 8, fs_lanes_below(n, 1)));
}
static inline void v16_store_first(float *p, v16f v, int64_t n) {
  _mm256_maskstore_ps(p, fs_lanes_below(n, 0), v.lo);
  _mm256_maskstore_ps(p + 8, fs_lanes_below(n, 1), v.hi);
}
static inline v16f v16_keep_first(v16f v, int64_t n) {
  return fs_pair(_mm256_and_ps(v.lo, _mm256_castsi256_ps(fs_lanes_below(n, 0))),
                 _mm256_and_ps(v.hi, _mm256_castsi256_ps(fs_lanes_below(n, 1))));
}
static inline __m256 fs_bf16_half(const uint16_t *p) {
  const __m128i bits = _mm_loadu_si128((const __m128i *)p);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
static inline v16f v16_load_bf16(const uint16_t *p) { return fs_pair(fs_bf16_half(p), fs_bf16_half(p + 8)); }
#define FS_HALVES(op, a, b) fs_pair(op((a).lo, (b).lo), op((a).hi, (b).hi))
static inline v16f v16_add(v16f a, v16f b) { return FS_HALVES(_mm256_add_ps, a, b); }
static inline v16f v16_sub(v16f a, v16f b) { return FS_HALVES(_mm256_sub_ps, a, b); }
static inline v16f v16_mul(v16f a, v16f b) { return FS_HALVES(_mm256_mul_ps, a, b); }
static inline v16f v16_div(v16f a, v16f b) { return FS_HALVES(_mm256_div_ps, a, b); }
static inline v16f v16_min(v16f a, v16f b) { return FS_HALVES(_mm256_min_ps, a, b); }
static inline v16f v16_max(v16f a, v16f b) { return FS_HALVES(_mm256_max_ps, a, b); }
#undef FS_HALVES
static inline v16f v16_fmadd(v16f a, v16f b, v16f c) {
  return fs_pair(_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi));
}
static inline v16f v16_fnmadd(v16f a, v16f b, v16f c) {
  return fs_pair(_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi));
}
static inline v16f v16_abs(v16f a) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  return fs_pair(_mm256_and_ps(a.lo, magnitude), _mm256_and_ps(a.hi, magnitude));
}
static inline v16f v16_round(v16f a) {
  const int nearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return fs_pair(_mm256_round_ps(a.lo, nearest), _mm256_round_ps(a.hi, nearest));
}
/* 2^k for integer k in [-126, 127], exactly */
static inline __m256 fs_power_of_two(__m256i k) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k, _mm256_set1_epi32(127)), 23));
}
/* a * 2^n in two steps, 2^(n - n / 2) then 2^(n / 2), each a normal float32 for n in [-150, 128]. For the
 * a of vector_exp.h (within [0.7, 1.5]) the first product is exact, so the result rounds once, as
 * VSCALEFPS's does (to a subnormal or to infinity included). */
static inline __m256 fs_scale2_half(__m256 a, __m256 n) {
  const __m256i whole = _mm256_cvtps_epi32(n);
  const __m256i half = _mm256_srai_epi32(whole, 1);
  const __m256 first = _mm256_mul_ps(a, fs_power_of_two(_mm256_sub_epi32(whole, half)));
  return _mm256_mul_ps(first, fs_power_of_two(half));
}
static inline v16f v16_scale2(v16f a, v16f n) {
  return fs_pair(fs_scale2_half(a.lo, n.lo), fs_scale2_half(a.hi, n.hi));
}
/* GCC's _mm512_reduce_*_ps order: upper 8 lanes with the lower, upper 4 with the lower, then 2 and 3 with
 * 0 and 1, then those two */
#define FS_REDUCE(op256, op128, opfinal, a)                                           \
  const __m256 eight = op256((a).hi, (a).lo);                                         \
  const __m128 four = op128(_mm256_extractf128_ps(eight, 1), _mm256_castps256_ps128(eight)); \
  const __m128 two = op128(four, _mm_movehl_ps(four, four));                          \
  return opfinal(_mm_cvtss_f32(two), _mm_cvtss_f32(_mm_shuffle_ps(two, two, 1)))
static inline float fs_add(float a, float b) { return a + b; }
static inline float fs_max(float a, float b) {
  /* as MAXPS on the lanes [a, b]: b unless a > b */
  return a > b ? a : b;
}
static inline float fs_min(float a, float b) { return a < b ? a : b; }
static inline float v16_reduce_add(v16f a) { FS_REDUCE(_mm256_add_ps, _mm_add_ps, fs_add, a); }
static inline float v16_reduce_max(v16f a) { FS_REDUCE(_mm256_max_ps, _mm_max_ps, fs_max, a); }
static inline float v16_reduce_min(v16f a) { FS_REDUCE(_mm256_min_ps, _mm_min_ps, fs_min, a); }
#undef FS_REDUCE
static inline int v16_all_finite(v16f a) {
  const __m256 lo = _mm256_cmp_ps(_mm256_sub_ps(a.lo, a.lo), _mm256_setzero_ps(), _CMP_EQ_OQ);
  const __m256 hi = _mm256_cmp_ps(_mm256_sub_ps(a.hi, a.hi), _mm256_setzero_ps(), _CMP_EQ_OQ);
  return _mm256_movemask_ps(_mm256_and_ps(lo, hi)) == 0xFF;
}
static inline void v16_store_bytes(uint8_t *out, v16f a) {
  /* int32 -> int16 per 128-bit lane: [lo 0-3, hi 0-3 | lo 4-7, hi 4-7]; 0xD8 puts the quarters in order */
  const __m256i words = _mm256_packs_epi32(_mm256_cvtps_epi32(a.lo), _mm256_cvtps_epi32(a.hi));
  const __m256i ordered = _mm256_permute4x64_epi64(words, 0xD8);
  const __m128i upper = _mm256_extracti128_si256(ordered, 1);
  _mm_storeu_si128((__m128i *)out, _mm_packus_epi16(_mm256_castsi256_si128(ordered), upper));
}

#endif
#endif
