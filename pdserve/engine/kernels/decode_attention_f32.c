/* Decode attention in float32 for AVX2 + FMA CPUs: query rows, each over its own first positions of a cached
 * sequence: a decode step's rows (one per sequence), and a small prompt chunk's rows beside them (several in one
 * slot, each up to its own position).
 *
 * For each (row, KV head) the query heads that share the KV head are computed together, so that head's keys and
 * values are read once for all of them (torch's SDPA reads them once per query head); a chunk's rows share each
 * block of them too (attend_group). Per query head: scores
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

/* acc[h][c] += sum_j s[h][j] v[j][c] over positions [begin, end) of a row's `length`, for `heads` heads (scores
 * `length` apart) and `width` x 8 columns of the values (rows `head_dim` apart); the accumulators live in `acc`
 * (laid out as the output, `head_dim` per head) between calls. Constants at every call, so the loops unroll into
 * registers, and one FMA chain per accumulator in position order: blocks of positions give the sums of one pass
 * over them all. */
static inline __attribute__((always_inline)) void weigh(const float *s, size_t length, size_t begin, size_t end,
                                                         const float *values, size_t head_dim, float *acc_memory,
                                                         const int heads, const int width, const int prefetch) {
    __m256 acc[3][4];
    for (int h = 0; h < heads; h++)
        for (int i = 0; i < width; i++) acc[h][i] = _mm256_loadu_ps(acc_memory + h * head_dim + 8 * i);
    for (size_t j = begin; j < end; j++) {
        const float *v = values + j * head_dim;
        if (prefetch && j % 8 == 0) prefetch_rows(values, j + PREFETCH_ROWS, 8, length, head_dim);
        for (int h = 0; h < heads; h++) {
            const __m256 w = _mm256_set1_ps(s[h * length + j]);
            for (int i = 0; i < width; i++) acc[h][i] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8 * i), acc[h][i]);
        }
    }
    for (int h = 0; h < heads; h++)
        for (int i = 0; i < width; i++) _mm256_storeu_ps(acc_memory + h * head_dim + 8 * i, acc[h][i]);
}

/* The softmax of one head's `length` scores in place (max, exp, sum); returns 1 / the sum. */
static float softmax(float *s, size_t length) {
    size_t j;
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
        __m256 mask = _mm256_cmp_ps(_mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_ps((float)(length - j)),
                                    _CMP_LT_OQ);
        __m256 e = _mm256_and_ps(mask, exp_nonpositive(_mm256_loadu_ps(tail)));
        _mm256_storeu_ps(tail, e);
        for (size_t i = j; i < length; i++) s[i] = tail[i - j];
        sum += hsum(e);
    }
    return 1.0f / sum;
}

/* Rows of one slot (a prompt chunk's) are computed together, up to this many: a KV head's keys and values come
 * from memory once for all of them, KEY_BLOCK positions at a time (32 KiB of keys and values, in L1 and L2 while
 * every row of the group reads them), instead of once per row. */
#define GROUP_ROWS 8
#define KEY_BLOCK 64 /* a multiple of 8: blocks split no row's 8-position score groups */

/* The query heads [kv * g, kv * g + g) of `count` rows of one slot, each over its own first lengths[r] positions
 * of one KV head's keys and values. Every row's sums run exactly as they would for the row alone (position order,
 * the same 8-position groups), so its bits do not depend on the rows beside it. Returns -1 when out of memory. */
static int attend_group(const float *q, size_t q_stride, const float *keys, const float *values, float *out,
                        size_t out_stride, const long *lengths, size_t count, size_t g, size_t head_dim,
                        float scale) {
    size_t total = 0, longest = 0;
    for (size_t r = 0; r < count; r++) {
        total += (size_t)lengths[r];
        longest = (size_t)lengths[r] > longest ? (size_t)lengths[r] : longest;
    }
    /* Per row: g heads' scores, then g heads' accumulators (head_dim each), then g inverse sums. */
    float *memory = calloc(g * (total + count * (head_dim + 1)), sizeof(float));
    if (memory == NULL) return -1;
    float *scores[GROUP_ROWS], *acc[GROUP_ROWS], *inverse[GROUP_ROWS];
    for (size_t r = 0, offset = 0; r < count; r++) {
        scores[r] = memory + offset;
        acc[r] = scores[r] + g * (size_t)lengths[r];
        inverse[r] = acc[r] + g * head_dim;
        offset += g * ((size_t)lengths[r] + head_dim + 1);
    }
    const __m256 scale8 = _mm256_set1_ps(scale);
    /* Scores: q.k * scale, 8 positions at a time as far as a row's whole groups of 8 go, the rest one by one. */
    for (size_t block = 0; block < longest; block += KEY_BLOCK) {
        for (size_t r = 0; r < count; r++) {
            const size_t length = (size_t)lengths[r], whole = length - length % 8;
            const size_t end = block + KEY_BLOCK < whole ? block + KEY_BLOCK : whole;
            const float *qr = q + r * q_stride;
            for (size_t j = block; j < end; j += 8) {
                if (r == 0) prefetch_rows(keys, j + PREFETCH_ROWS, 8, length, head_dim);
                for (size_t h = 0; h < g; h++)
                    _mm256_storeu_ps(scores[r] + h * length + j,
                                     _mm256_mul_ps(dot8(qr + h * head_dim, keys + j * head_dim, head_dim), scale8));
            }
        }
    }
    for (size_t r = 0; r < count; r++) {
        const size_t length = (size_t)lengths[r];
        for (size_t j = length - length % 8; j < length; j++)
            for (size_t h = 0; h < g; h++)
                scores[r][h * length + j] = dot(q + r * q_stride + h * head_dim, keys + j * head_dim, head_dim) * scale;
        for (size_t h = 0; h < g; h++) inverse[r][h] = softmax(scores[r] + h * length, length);
    }
    /* The values weighted by the scores, for up to 3 heads at a time (one pass over the values serves them all)
     * and 32 columns (4 registers) at a time, so every accumulator stays in a register within a block. */
    for (size_t block = 0; block < longest; block += KEY_BLOCK) {
        for (size_t r = 0; r < count; r++) {
            const size_t length = (size_t)lengths[r];
            if (block >= length) continue;
            const size_t end = block + KEY_BLOCK < length ? block + KEY_BLOCK : length;
            for (size_t h = 0; h < g; h += 3) {
                const size_t heads = g - h < 3 ? g - h : 3;
                for (size_t d = 0; d < head_dim; d += head_dim - d >= 32 ? 32 : 8) {
                    const float *sh = scores[r] + h * length, *v = values + d;
                    float *a = acc[r] + h * head_dim + d;
                    const int first = r == 0 && h == 0 && d == 0; /* the pass that prefetches */
                    switch (heads * 10 + (head_dim - d >= 32 ? 4 : 1)) {
                    case 34: weigh(sh, length, block, end, v, head_dim, a, 3, 4, first); break;
                    case 31: weigh(sh, length, block, end, v, head_dim, a, 3, 1, first); break;
                    case 24: weigh(sh, length, block, end, v, head_dim, a, 2, 4, first); break;
                    case 21: weigh(sh, length, block, end, v, head_dim, a, 2, 1, first); break;
                    case 14: weigh(sh, length, block, end, v, head_dim, a, 1, 4, first); break;
                    default: weigh(sh, length, block, end, v, head_dim, a, 1, 1, first); break;
                    }
                }
            }
        }
    }
    for (size_t r = 0; r < count; r++)
        for (size_t h = 0; h < g; h++) {
            const __m256 inv = _mm256_set1_ps(inverse[r][h]);
            for (size_t c = 0; c < head_dim; c += 8)
                _mm256_storeu_ps(out + r * out_stride + h * head_dim + c,
                                 _mm256_mul_ps(_mm256_loadu_ps(acc[r] + h * head_dim + c), inv));
        }
    free(memory);
    return 0;
}

/* q: [rows] rows of `heads` query heads (row stride q_stride floats); cache: one layer's keys and values,
 * [slots][kv_heads][max_len][head_dim]; out: [rows][heads][head_dim]. Consecutive rows in the same slot (a
 * prompt chunk's) are computed in groups (attend_group). Returns 0, or -1 when out of memory. */
int pdserve_decode_attention_f32(const float *q, size_t q_stride, const float *keys, const float *values,
                                 const long *slots, const long *lengths, float *out, size_t rows, size_t heads,
                                 size_t kv_heads, size_t max_len, size_t head_dim, float scale, int threads) {
    const size_t g = heads / kv_heads;
    size_t *starts = malloc((rows + 1) * sizeof(size_t)); /* each group's first row, then `rows` */
    if (starts == NULL) return -1;
    size_t groups = 0;
    for (size_t row = 0; row < rows; row++)
        if (groups == 0 || slots[row] != slots[row - 1] || row - starts[groups - 1] == GROUP_ROWS)
            starts[groups++] = row;
    starts[groups] = rows;
    const long tasks = (long)(groups * kv_heads);
    int failed = 0;
    /* Dynamic: a group of a chunk's rows over a long prompt is many times a decode row's task. Which thread runs a
     * task changes none of its sums. */
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1) reduction(| : failed)
    for (long t = 0; t < tasks; t++) {
        const size_t group = (size_t)t / kv_heads, kv = (size_t)t % kv_heads, row = starts[group];
        const size_t base = (((size_t)slots[row] * kv_heads) + kv) * max_len * head_dim;
        failed |= attend_group(q + row * q_stride + kv * g * head_dim, q_stride, keys + base, values + base,
                               out + (row * heads + kv * g) * head_dim, heads * head_dim, lengths + row,
                               starts[group + 1] - row, g, head_dim, scale) != 0;
    }
    free(starts);
    return failed ? -1 : 0;
}
