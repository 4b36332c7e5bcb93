/* Matrix products whose every output element is summed in one fixed order, whatever the number of rows,
 * the tiling or the thread count: a row's result depends on that row and the weight alone, so a sequence's
 * decode row gives the same bits alone (one row) and in a batch of any size.
 *
 * met_product ("dot" form, F.linear's weight layout: out[g, m, n] = sum_k x[g, m, k] * w[g, n, k]), the
 * fixed order of one element: LANES partial sums (lane j takes k = j, j + LANES, ... below the last whole
 * LANES), each a chain of fused multiply-adds (fmaf), folded pairwise (lanes j + j+4, then j + j+2, then
 * 0 + 1), then the K % LANES tail added by fmaf in k order.
 *
 * met_product_kn ("axpy" form, a [K, N] weight: out[g, m, n] = sum_k x[g, m, k] * w[g, k, n]): one chain
 * of fmaf per element, in k order.
 *
 * The AVX2+FMA code computes exactly these operations (a vector FMA is LANES scalar fmaf), and so does the
 * AVX-512 code (two weight rows' LANES lanes in one register); the portable C below them performs the same
 * ones in the same order, so all give the same bits. Weights are fp32 or bf16
 * (widened exactly), the rows and the sums fp32. Built with -ffp-contract=off: the only fused operations
 * are the explicit fmaf/FMA ones.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define MET_PRODUCT_AVX2 1
#endif

#define LANES 8
#define TILE_ROWS 4 /* rows of x per tile: their weight rows are read once for all of them */
#define TILE_COLS 3 /* weight rows per tile: 12 accumulators, with 3 weight and 1 row vector 16 registers */
/* A lone row (a decode step alone) reads its whole weight once, so its speed is the weight's stream from
 * memory. Weight rows next to each other read in step (2 KB apart for K = 512) stream at ~15 GB/s on an AVX2
 * EPYC; rows far apart — row n of each of as many contiguous sections of the weight (product() below) —
 * each read in order, at ~25 GB/s, four at a time (bench in docs/BENCHMARKS.md, session 19). */
#define LONE_ROW_STREAMS 4
#define MAX_TILE_COLS 4 /* the larger of TILE_COLS and LONE_ROW_STREAMS: the 8-lane tiles' arrays */

/* The threads share a product's weight rows from this many multiply-adds (a [1, 2048] x [2048, 2048]
 * decode product is 4M: spread; a small MoE expert's one row stays on one thread). */
#define PARALLEL_MIN_MACS (1 << 20)

static inline float bf16_value(const uint16_t *w, int64_t k) {
    uint32_t bits = (uint32_t)w[k] << 16;
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

static inline float weight_value(const void *w, int bf16, int64_t k) {
    return bf16 ? bf16_value((const uint16_t *)w, k) : ((const float *)w)[k];
}

/* One element in the fixed order, portable: the twin of the vector tiles below, operation for operation. */
static float dot_in_order(const float *x, const void *w, int bf16, int64_t K) {
    float lane[LANES] = {0};
    int64_t body = K - K % LANES;
    for (int64_t k = 0; k < body; k += LANES) {
        for (int j = 0; j < LANES; j++) lane[j] = fmaf(x[k + j], weight_value(w, bf16, k + j), lane[j]);
    }
    for (int width = LANES / 2; width >= 1; width /= 2) {
        for (int j = 0; j < width; j++) lane[j] = lane[j] + lane[j + width];
    }
    float sum = lane[0];
    for (int64_t k = body; k < K; k++) sum = fmaf(x[k], weight_value(w, bf16, k), sum);
    return sum;
}

#ifdef MET_PRODUCT_AVX2
static float tail_in_order(float folded, const float *x, const void *w, int bf16, int64_t body, int64_t K) {
    for (int64_t k = body; k < K; k++) folded = fmaf(x[k], weight_value(w, bf16, k), folded);
    return folded;
}

static inline __m256 load_weight(const void *w, int bf16, int64_t k) {
    if (bf16) {
        __m128i half = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + k));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
    }
    return _mm256_loadu_ps((const float *)w + k);
}

/* dot_in_order's fold: lanes j + j+4, then j + j+2, then 0 + 1. */
static inline float fold(__m256 lanes) {
    __m128 four = _mm_add_ps(_mm256_castps256_ps128(lanes), _mm256_extractf128_ps(lanes, 1));
    __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
    __m128 one = _mm_add_ss(two, _mm_shuffle_ps(two, two, 1));
    return _mm_cvtss_f32(one);
}

/* out[r, c] for ROWS rows of x and COLS weight rows (constants where it is called, so the accumulators
 * stay in registers). */
static inline __attribute__((always_inline)) void tile(const float *x, int64_t x_stride, const char *w,
                                                       int64_t w_stride_bytes, int bf16, float *out,
                                                       int64_t out_stride, int64_t K, const int ROWS,
                                                       const int COLS) {
    __m256 acc[TILE_ROWS][MAX_TILE_COLS];
    for (int r = 0; r < ROWS; r++)
        for (int c = 0; c < COLS; c++) acc[r][c] = _mm256_setzero_ps();
    int64_t body = K - K % LANES;
    for (int64_t k = 0; k < body; k += LANES) {
        __m256 wv[MAX_TILE_COLS];
        for (int c = 0; c < COLS; c++) wv[c] = load_weight(w + c * w_stride_bytes, bf16, k);
        for (int r = 0; r < ROWS; r++) {
            __m256 xv = _mm256_loadu_ps(x + r * x_stride + k);
            for (int c = 0; c < COLS; c++) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
        }
    }
    for (int r = 0; r < ROWS; r++)
        for (int c = 0; c < COLS; c++)
            out[r * out_stride + c] =
                tail_in_order(fold(acc[r][c]), x + r * x_stride, w + c * w_stride_bytes, bf16, body, K);
}

static void tile_any(const float *x, int64_t x_stride, const char *w, int64_t w_stride_bytes, int bf16,
                     float *out, int64_t out_stride, int64_t K, int rows, int cols) {
#define MET_TILE(R, C) tile(x, x_stride, w, w_stride_bytes, bf16, out, out_stride, K, R, C)
    if (rows == 1 && cols == LONE_ROW_STREAMS) {
        MET_TILE(1, LONE_ROW_STREAMS);
        return;
    }
    if (cols == TILE_COLS) {
        switch (rows) {
        case 4: MET_TILE(4, 3); return;
        case 3: MET_TILE(3, 3); return;
        case 2: MET_TILE(2, 3); return;
        default: MET_TILE(1, 3); return;
        }
    }
    for (int c = 0; c < cols; c++) {
        const char *wc = w + c * w_stride_bytes;
        switch (rows) {
        case 4: tile(x, x_stride, wc, w_stride_bytes, bf16, out + c, out_stride, K, 4, 1); break;
        case 3: tile(x, x_stride, wc, w_stride_bytes, bf16, out + c, out_stride, K, 3, 1); break;
        case 2: tile(x, x_stride, wc, w_stride_bytes, bf16, out + c, out_stride, K, 2, 1); break;
        default: tile(x, x_stride, wc, w_stride_bytes, bf16, out + c, out_stride, K, 1, 1); break;
        }
    }
#undef MET_TILE
}

#if defined(__AVX512F__) && defined(__AVX512DQ__)
#define MET_PRODUCT_AVX512 1
#define PAIRS 3 /* weight-row pairs per tile: 12 accumulators of 16 lanes */

/* Two weight rows' 8 lanes in one 16-lane register (row c in lanes 0-7, row c+1 in 8-15): each lane runs
 * the same fmaf chain as in the 8-lane tiles, so a 16-lane FMA is two 8-lane ones, bit for bit. */
static inline __m512 load_weight_pair(const char *w0, const char *w1, int bf16, int64_t k) {
    if (bf16) {
        __m128i low = _mm_loadu_si128((const __m128i *)((const uint16_t *)w0 + k));
        __m128i high = _mm_loadu_si128((const __m128i *)((const uint16_t *)w1 + k));
        __m256i both = _mm256_inserti128_si256(_mm256_castsi128_si256(low), high, 1);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(both), 16));
    }
    __m256 low = _mm256_loadu_ps((const float *)w0 + k);
    return _mm512_insertf32x8(_mm512_castps256_ps512(low), _mm256_loadu_ps((const float *)w1 + k), 1);
}

static inline __attribute__((always_inline)) void tile_pairs(const float *x, int64_t x_stride, const char *w,
                                                             int64_t w_stride_bytes, int bf16, float *out,
                                                             int64_t out_stride, int64_t K, const int ROWS,
                                                             const int PAIRS_N) {
    __m512 acc[TILE_ROWS][PAIRS];
    for (int r = 0; r < ROWS; r++)
        for (int p = 0; p < PAIRS_N; p++) acc[r][p] = _mm512_setzero_ps();
    int64_t body = K - K % LANES;
    for (int64_t k = 0; k < body; k += LANES) {
        __m512 wv[PAIRS];
        for (int p = 0; p < PAIRS_N; p++)
            wv[p] = load_weight_pair(w + 2 * p * w_stride_bytes, w + (2 * p + 1) * w_stride_bytes, bf16, k);
        for (int r = 0; r < ROWS; r++) {
            __m512 xv = _mm512_broadcast_f32x8(_mm256_loadu_ps(x + r * x_stride + k));
            for (int p = 0; p < PAIRS_N; p++) acc[r][p] = _mm512_fmadd_ps(xv, wv[p], acc[r][p]);
        }
    }
    for (int r = 0; r < ROWS; r++)
        for (int p = 0; p < PAIRS_N; p++)
            for (int half = 0; half < 2; half++) {
                __m256 lanes = half ? _mm512_extractf32x8_ps(acc[r][p], 1) : _mm512_castps512_ps256(acc[r][p]);
                const char *wc = w + (2 * p + half) * w_stride_bytes;
                out[r * out_stride + 2 * p + half] = tail_in_order(fold(lanes), x + r * x_stride, wc, bf16, body, K);
            }
}

static void tile_any_pairs(const float *x, int64_t x_stride, const char *w, int64_t w_stride_bytes, int bf16,
                           float *out, int64_t out_stride, int64_t K, int rows, int cols) {
    if (cols != 2 * PAIRS) {
        tile_any(x, x_stride, w, w_stride_bytes, bf16, out, out_stride, K, rows, cols);
        return;
    }
    switch (rows) {
    case 4: tile_pairs(x, x_stride, w, w_stride_bytes, bf16, out, out_stride, K, 4, PAIRS); return;
    case 3: tile_pairs(x, x_stride, w, w_stride_bytes, bf16, out, out_stride, K, 3, PAIRS); return;
    case 2: tile_pairs(x, x_stride, w, w_stride_bytes, bf16, out, out_stride, K, 2, PAIRS); return;
    default: tile_pairs(x, x_stride, w, w_stride_bytes, bf16, out, out_stride, K, 1, PAIRS); return;
    }
}
#endif
#endif

static void tile_portable(const float *x, int64_t x_stride, const char *w, int64_t w_stride_bytes, int bf16,
                          float *out, int64_t out_stride, int64_t K, int rows, int cols) {
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++)
            out[r * out_stride + c] = dot_in_order(x + r * x_stride, w + c * w_stride_bytes, bf16, K);
}

typedef void (*tile_function)(const float *, int64_t, const char *, int64_t, int, float *, int64_t, int64_t, int,
                              int);

#define MAX_TILE_WIDTH 6

/* Weight rows per column tile (at most MAX_TILE_WIDTH): the tiling only, no element's order depends on it. */
static int64_t tile_width(int64_t M) {
    if (M == 1) return LONE_ROW_STREAMS;
#ifdef MET_PRODUCT_AVX512
    return 2 * PAIRS;
#else
    return TILE_COLS;
#endif
}

static void product(tile_function tiles, const float *x, int64_t x_group, int64_t x_row, const void *w,
                    int64_t w_group, int64_t w_row, int bf16, float *out, int64_t G, int64_t M, int64_t N, int64_t K,
                    int threads) {
    int64_t element = bf16 ? 2 : 4;
    int64_t width = tile_width(M);
    /* A tile's weight rows are far apart (row n of each of `width` contiguous sections of `part` rows), so
     * each is read as its own sequential stream (see LONE_ROW_STREAMS); its results are put in place after. */
    int64_t part = (N + width - 1) / width;
#pragma omp parallel for schedule(static) num_threads(threads) if (G * M * N * K >= PARALLEL_MIN_MACS)
    for (int64_t task = 0; task < G * part; task++) {
        int64_t g = task / part, n = task % part;
        int cols = 0;
        while (cols < width && n + cols * part < N) cols++;
        const char *wg = (const char *)w + (g * w_group + n * w_row) * element;
        float tile_out[TILE_ROWS * MAX_TILE_WIDTH];
        for (int64_t m0 = 0; m0 < M; m0 += TILE_ROWS) {
            int rows = (int)(M - m0 < TILE_ROWS ? M - m0 : TILE_ROWS);
            tiles(x + g * x_group + m0 * x_row, x_row, wg, part * w_row * element, bf16, tile_out, width, K, rows,
                  cols);
            for (int r = 0; r < rows; r++)
                for (int c = 0; c < cols; c++) out[(g * M + m0 + r) * N + n + c * part] = tile_out[r * width + c];
        }
    }
}

/* x: [G, M, K] fp32, rows x_row apart, groups x_group apart; w: [G, N, K] fp32 (bf16 = 0) or bf16
 * (bf16 = 1), rows w_row apart, groups w_group apart (in elements); out: [G, M, N] fp32 contiguous.
 * out[g, m, n] = sum_k x[g, m, k] * w[g, n, k] in the fixed order above. */
void met_product(const float *x, int64_t x_group, int64_t x_row, const void *w, int64_t w_group, int64_t w_row,
                 int bf16, float *out, int64_t G, int64_t M, int64_t N, int64_t K, int threads) {
#if defined(MET_PRODUCT_AVX512)
    tile_function tiles = tile_any_pairs;
#elif defined(MET_PRODUCT_AVX2)
    tile_function tiles = tile_any;
#else
    tile_function tiles = tile_portable;
#endif
    product(tiles, x, x_group, x_row, w, w_group, w_row, bf16, out, G, M, N, K, threads);
}

/* met_product through the portable C alone (where the vector code is built, a test checks they agree). */
void met_product_portable(const float *x, int64_t x_group, int64_t x_row, const void *w, int64_t w_group,
                          int64_t w_row, int bf16, float *out, int64_t G, int64_t M, int64_t N, int64_t K,
                          int threads) {
    product(tile_portable, x, x_group, x_row, w, w_group, w_row, bf16, out, G, M, N, K, threads);
}

/* x: [G, M, K] fp32 as for met_product; w: [G, K, N] fp32 or bf16, rows (k) w_row apart, groups w_group
 * apart, unit stride along N; out: [G, M, N] fp32 contiguous. out[g, m, n] = one fmaf chain over k. The
 * loop over n is vectorized: lanes are different elements, each still one chain in k order. */
void met_product_kn(const float *x, int64_t x_group, int64_t x_row, const void *w, int64_t w_group, int64_t w_row,
                    int bf16, float *out, int64_t G, int64_t M, int64_t N, int64_t K, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (G * M * N * K >= PARALLEL_MIN_MACS)
    for (int64_t task = 0; task < G * M; task++) {
        int64_t g = task / M, m = task % M;
        const float *xr = x + g * x_group + m * x_row;
        float *restrict o = out + task * N;
        for (int64_t n = 0; n < N; n++) o[n] = 0.0f;
        for (int64_t k = 0; k < K; k++) {
            float xk = xr[k];
            if (bf16) {
                const uint16_t *wk = (const uint16_t *)w + g * w_group + k * w_row;
                for (int64_t n = 0; n < N; n++) o[n] = fmaf(xk, bf16_value(wk, n), o[n]);
            } else {
                const float *wk = (const float *)w + g * w_group + k * w_row;
                for (int64_t n = 0; n < N; n++) o[n] = fmaf(xk, wk[n], o[n]);
            }
        }
    }
}
