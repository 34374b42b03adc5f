/* Decode attention in float32 for AVX2 + FMA CPUs: one query row per sequence over its own cached keys.
 *
 * For each (row, KV head) the query heads that share the KV head are computed together, so that head's keys and
 * values are read once for all of them (torch's SDPA reads them once per query head). Per query head: scores
 * q.k * scale over the row's first `length` positions, softmax (max, exp, sum), then the values weighted and
 * divided by the sum. Nothing is padded and nothing masked: a row reads exactly its own positions. Every sum
 * runs in one fixed order that depends only on the row itself, so a row's bits never depend on its batch, its
 * slot or the threads (the engine's batch invariance).
 */
#include <immintrin.h>
#include <stdlib.h>
#include <stddef.h>

/* exp(x) for x <= 0 (scores minus their max): 2^n * p(r), x = n ln2 + r, |r| <= ln2 / 2; below -87 it is 0.
 * Polynomial coefficients: Taylor's (degree 6), within 2 ulp of expf on that range. */
static inline __m256 exp_nonpositive(__m256 x) {
    const __m256 floor_ = _mm256_set1_ps(-87.0f);
    const __m256 underflow = _mm256_cmp_ps(x, floor_, _CMP_LT_OQ);
    x = _mm256_max_ps(x, floor_);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x); /* ln2, high bits */
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187045e-06f), r); /* ln2, the rest */
    __m256 p = _mm256_set1_ps(1.0f / 720.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(underflow, _mm256_mul_ps(p, _mm256_castsi256_ps(scale)));
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Rows this far ahead of the one being read are fetched into the cache before they are needed: one core's
 * hardware prefetchers alone kept far fewer misses in flight (a layer's keys and values of 8 rows of 1,050
 * positions read at ~11 GB/s from memory). */
#define PREFETCH_ROWS 48

static inline void prefetch_rows(const float *base, size_t first, size_t count, size_t length, size_t head_dim) {
    const size_t end = first + count < length ? first + count : length;
    for (size_t j = first; j < end; j++)
        for (size_t c = 0; c < head_dim; c += 16) _mm_prefetch((const char *)(base + j * head_dim + c), _MM_HINT_T0);
}

/* q.k over head_dim (a multiple of 8): lane-wise products summed in order, then the lanes in a fixed tree. */
static inline float dot(const float *q, const float *k, size_t head_dim) {
    __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(q), _mm256_loadu_ps(k));
    for (size_t d = 8; d < head_dim; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k + d), acc);
    return hsum(acc);
}

/* q.k for 8 consecutive keys at once, the same sums as dot() (lanes in order, then the lanes' tree differs:
 * pairs of lanes, then pairs of pairs, then halves), into the 8 lanes of the result. */
static inline __m256 dot8(const float *q, const float *k, size_t head_dim) {
    __m256 a[8];
    const __m256 q0 = _mm256_loadu_ps(q);
    for (int j = 0; j < 8; j++) a[j] = _mm256_mul_ps(q0, _mm256_loadu_ps(k + j * head_dim));
    for (size_t d = 8; d < head_dim; d += 8) {
        const __m256 qd = _mm256_loadu_ps(q + d);
        for (int j = 0; j < 8; j++) a[j] = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k + j * head_dim + d), a[j]);
    }
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* out[h][c] = inverse[h] * sum_j s[h][j] v[j][c] for `heads` heads (scores `length` apart) and `width` x 8
 * columns of the values (rows `head_dim` apart); constants at every call, so the loops unroll into registers. */
static inline __attribute__((always_inline)) void weigh(const float *s, size_t length, const float *values,
                                                         size_t head_dim, float *out, const float *inverse,
                                                         const int heads, const int width, const int first_pass) {
    __m256 acc[3][4];
    for (int h = 0; h < heads; h++)
        for (int i = 0; i < width; i++) acc[h][i] = _mm256_setzero_ps();
    for (size_t j = 0; j < length; j++) {
        const float *v = values + j * head_dim;
        if (first_pass && j % 8 == 0) prefetch_rows(values, j + PREFETCH_ROWS, 8, length, head_dim);
        for (int h = 0; h < heads; h++) {
            const __m256 w = _mm256_set1_ps(s[h * length + j]);
            for (int i = 0; i < width; i++) acc[h][i] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8 * i), acc[h][i]);
        }
    }
    for (int h = 0; h < heads; h++)
        for (int i = 0; i < width; i++)
            _mm256_storeu_ps(out + h * head_dim + 8 * i, _mm256_mul_ps(acc[h][i], _mm256_set1_ps(inverse[h])));
}

/* The query heads [group * g, group * g + g) of one row over one KV head's first `length` positions. */
static void one_group(const float *q, const float *keys, const float *values, float *out, float *scores,
                      float *inverse, size_t g, size_t length, size_t head_dim, float scale) {
    const __m256 scale8 = _mm256_set1_ps(scale);
    size_t j = 0;
    for (; j + 8 <= length; j += 8) {
        prefetch_rows(keys, j + PREFETCH_ROWS, 8, length, head_dim);
        for (size_t h = 0; h < g; h++)
            _mm256_storeu_ps(scores + h * length + j, _mm256_mul_ps(dot8(q + h * head_dim, keys + j * head_dim, head_dim), scale8));
    }
    for (; j < length; j++)
        for (size_t h = 0; h < g; h++) scores[h * length + j] = dot(q + h * head_dim, keys + j * head_dim, head_dim) * scale;
    for (size_t h = 0; h < g; h++) {
        float *s = scores + h * length;
        __m256 tops = _mm256_set1_ps(s[0]);
        for (j = 0; j + 8 <= length; j += 8) tops = _mm256_max_ps(tops, _mm256_loadu_ps(s + j));
        float top = s[0];
        for (; j < length; j++) top = s[j] > top ? s[j] : top;
        const __m128 half = _mm_max_ps(_mm256_castps256_ps128(tops), _mm256_extractf128_ps(tops, 1));
        float lanes[4];
        _mm_storeu_ps(lanes, half);
        for (int i = 0; i < 4; i++) top = lanes[i] > top ? lanes[i] : top;
        const __m256 top8 = _mm256_set1_ps(top);
        __m256 sum8 = _mm256_setzero_ps();
        for (j = 0; j + 8 <= length; j += 8) {
            __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + j), top8));
            _mm256_storeu_ps(s + j, e);
            sum8 = _mm256_add_ps(sum8, e);
        }
        float sum = hsum(sum8);
        if (j < length) { /* the last part of 8, through a zero-padded copy */
            float tail[8] = {0};
            for (size_t i = j; i < length; i++) tail[i - j] = s[i] - top;
            __m256 lanes = _mm256_cmp_ps(_mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_ps((float)(length - j)),
                                         _CMP_LT_OQ);
            __m256 e = _mm256_and_ps(lanes, exp_nonpositive(_mm256_loadu_ps(tail)));
            _mm256_storeu_ps(tail, e);
            for (size_t i = j; i < length; i++) s[i] = tail[i - j];
            sum += hsum(e);
        }
        inverse[h] = 1.0f / sum;
    }
    /* The values weighted by the scores, for up to 3 heads at a time (one pass over the values serves them all)
     * and 32 columns (4 registers) at a time, so every accumulator stays in a register. */
    for (size_t h = 0; h < g; h += 3) {
        const size_t heads = g - h < 3 ? g - h : 3;
        for (size_t d = 0; d < head_dim; d += head_dim - d >= 32 ? 32 : 8) {
            const float *sh = scores + h * length, *v = values + d;
            float *o = out + h * head_dim + d;
            const float *inv = inverse + h;
            const int first = h == 0 && d == 0; /* the pass that prefetches: it reads each row from its start */
            switch (heads * 10 + (head_dim - d >= 32 ? 4 : 1)) {
            case 34: weigh(sh, length, v, head_dim, o, inv, 3, 4, first); break;
            case 31: weigh(sh, length, v, head_dim, o, inv, 3, 1, first); break;
            case 24: weigh(sh, length, v, head_dim, o, inv, 2, 4, first); break;
            case 21: weigh(sh, length, v, head_dim, o, inv, 2, 1, first); break;
            case 14: weigh(sh, length, v, head_dim, o, inv, 1, 4, first); break;
            default: weigh(sh, length, v, head_dim, o, inv, 1, 1, first); break;
            }
        }
    }
}

/* q: [rows] rows of `heads` query heads (row stride q_stride floats); cache: one layer's keys and values,
 * [slots][kv_heads][max_len][head_dim]; out: [rows][heads][head_dim]. Returns 0, or -1 when out of memory. */
int pdserve_decode_attention_f32(const float *q, size_t q_stride, const float *keys, const float *values,
                                 const long *slots, const long *lengths, float *out, size_t rows, size_t heads,
                                 size_t kv_heads, size_t max_len, size_t head_dim, float scale, int threads) {
    const size_t g = heads / kv_heads;
    const long tasks = (long)(rows * kv_heads);
    int failed = 0;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1) reduction(| : failed)
    for (long t = 0; t < tasks; t++) {
        const size_t row = (size_t)t / kv_heads, kv = (size_t)t % kv_heads, length = (size_t)lengths[row];
        const size_t base = (((size_t)slots[row] * kv_heads) + kv) * max_len * head_dim;
        float *scores = malloc((g * length + g) * sizeof(float));
        if (scores == NULL) {
            failed = 1;
            continue;
        }
        one_group(q + row * q_stride + kv * g * head_dim, keys + base, values + base,
                  out + (row * heads + kv * g) * head_dim, scores, scores + g * length, g, length, head_dim, scale);
        free(scores);
    }
    return failed ? -1 : 0;
}
