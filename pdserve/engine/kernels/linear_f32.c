/* y = x @ W^T in float32 for AVX2 + FMA CPUs: the engine's linear layers on CPUs without native bfloat16.
 *
 * W (N outputs x K inputs) is packed once into panels of 16 outputs, each panel K rows of 16 floats
 * (packed[p][k][j] = W[16 p + j][k], zero rows past N), so a panel streams from memory in one pass.
 * A call walks the panels (split between threads) and, for each, the rows of x in tiles of up to 6
 * rows: 12 accumulators, two panel loads and one broadcast per k. Every output is one chain of fused
 * multiply-adds over k in order, whatever the number of rows, the tile a row falls in or the threads:
 * a row's bits never depend on the rows it shares a call with (the engine's batch invariance).
 *
 * From PREFETCH_MIN_ROWS rows on, each tile also asks for the thread's next panel, one 64-byte k-row of it per
 * k: with that many rows a panel's multiply-adds take long enough that memory would sit idle while they run,
 * and the next panel then arrives in their shadow (AVX2 EPYC, every SmolLM2 weight once, 2 threads, five runs:
 * 6 to 16 rows 6-21% faster, 128 rows 3-9%). At fewer rows the panels stream at memory's pace anyway and the
 * extra requests only cost (1 thread, 1-4 rows: up to 12% slower in one run).
 */
#include <immintrin.h>
#include <stddef.h>

#define PANEL 16
#define TILE_ROWS 6
#define BLOCK_ROWS 48 /* rows of x a pass over the panels keeps hot in L2 */
#define PREFETCH_MIN_ROWS 5

static inline __attribute__((always_inline)) void tile(const float *x, size_t k_len, const float *panel, float *y,
                                                        size_t n, size_t cols, int rows, const float *next) {
    __m256 lo[TILE_ROWS], hi[TILE_ROWS];
    for (int i = 0; i < TILE_ROWS; i++) {
        lo[i] = _mm256_setzero_ps();
        hi[i] = _mm256_setzero_ps();
    }
    for (size_t k = 0; k < k_len; k++) {
        if (next != NULL) _mm_prefetch((const char *)(next + k * PANEL), _MM_HINT_T1);
        __m256 w_lo = _mm256_loadu_ps(panel + k * PANEL), w_hi = _mm256_loadu_ps(panel + k * PANEL + 8);
        for (int i = 0; i < TILE_ROWS; i++) {
            if (i < rows) {
                __m256 xk = _mm256_broadcast_ss(x + i * k_len + k);
                lo[i] = _mm256_fmadd_ps(w_lo, xk, lo[i]);
                hi[i] = _mm256_fmadd_ps(w_hi, xk, hi[i]);
            }
        }
    }
    if (cols == PANEL) {
        for (int i = 0; i < rows; i++) {
            _mm256_storeu_ps(y + i * n, lo[i]);
            _mm256_storeu_ps(y + i * n + 8, hi[i]);
        }
        return;
    }
    /* The last panel of an N that is not a multiple of 16: store only its real columns. */
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256i mask_lo = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)cols), lane);
    __m256i mask_hi = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)cols - 8), lane);
    for (int i = 0; i < rows; i++) {
        _mm256_maskstore_ps(y + i * n, mask_lo, lo[i]);
        _mm256_maskstore_ps(y + i * n + 8, mask_hi, hi[i]);
    }
}

/* Rows [0, rows) of x against one panel, in as few tiles as fit and of even sizes (8 rows: 4 + 4, not 6 + 2: a
 * tile of 2 rows waits on its 4 chains of multiply-adds); the tile sizes are constants, so each unrolls into
 * registers. `next`: the panel to prefetch meanwhile, or NULL. */
static void panel_rows(const float *x, const float *panel, float *y, size_t rows, size_t k_len, size_t n,
                       size_t cols, const float *next) {
    const size_t tiles = (rows + TILE_ROWS - 1) / TILE_ROWS;
    for (size_t t = 0, r = 0; t < tiles; t++) {
        const size_t size = (rows - r) / (tiles - t) + ((rows - r) % (tiles - t) != 0);
        const float *xr = x + r * k_len;
        float *yr = y + r * n;
        r += size;
        switch (size) {
        case 1: tile(xr, k_len, panel, yr, n, cols, 1, next); break;
        case 2: tile(xr, k_len, panel, yr, n, cols, 2, next); break;
        case 3: tile(xr, k_len, panel, yr, n, cols, 3, next); break;
        case 4: tile(xr, k_len, panel, yr, n, cols, 4, next); break;
        case 5: tile(xr, k_len, panel, yr, n, cols, 5, next); break;
        default: tile(xr, k_len, panel, yr, n, cols, 6, next); break;
        }
    }
}

/* x: m x k_len, row-major; packed: ceil(n / 16) panels; y: m x n, row-major. */
void pdserve_linear_f32(const float *x, const float *packed, float *y, size_t m, size_t k_len, size_t n,
                        int threads) {
    const long panels = (long)((n + PANEL - 1) / PANEL);
    for (size_t r0 = 0; r0 < m; r0 += BLOCK_ROWS) {
        const size_t rows = m - r0 < BLOCK_ROWS ? m - r0 : BLOCK_ROWS;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
        for (long p = 0; p < panels; p++) {
            const size_t first = (size_t)p * PANEL, cols = n - first < PANEL ? n - first : PANEL;
            const float *next = rows >= PREFETCH_MIN_ROWS && p + 1 < panels ? packed + (size_t)(p + 1) * k_len * PANEL
                                                                            : NULL;
            panel_rows(x + r0 * k_len, packed + (size_t)p * k_len * PANEL, y + r0 * n + first, rows, k_len, n, cols,
                       next);
        }
    }
}
