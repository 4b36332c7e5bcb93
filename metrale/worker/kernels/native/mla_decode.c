/* Absorbed MLA for decode rows (one query row per sequence) over a block-paged latent cache, reading
 * each sequence's latents in place: met_mla_decode_f32 (fp32 cache) and met_mla_decode_bf16 (bf16).
 *
 * Position p of sequence b is the row cache[block_tables[b, p / block_size], p % block_size] of C + R
 * values (c_p, then r_p). Per sequence and head h, with q = [q_latent_h, q_rope_h] of C + R values:
 *     score_p = (q . row_p) * scale,   out_h = sum_p softmax(score)_p c_p      (p < context_lens[b])
 * all in fp32.
 *
 * Split over the context (flash-decoding): a sequence's positions are cut into splits of SPLIT positions,
 * [0, SPLIT), [SPLIT, 2 SPLIT), ..., and each (sequence, split) pair is one work item, so one long
 * sequence keeps every thread busy. An item runs an online softmax over its split, TILE rows at a time
 * (a tile whose best score beats the running maximum rescales what was summed so far), all heads per
 * tile, and leaves its unnormalised partial sums (max, sum of weights, weighted sum of c) per head. Then
 * each sequence's splits are combined in split order. The splits of a sequence depend on its own length
 * alone and every sum runs in a fixed order, so a sequence's output is the same bits whatever else is in
 * the batch and at any thread count. The plain twin is metrale/worker/kernels/mla.py:_attend_single_rows.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "exp.h"

#define TILE 16
#define SPLIT 256

/* q . x_j for four rows x_j at once (four independent sums: one dot is bound by its additions'
 * latency). Every score is computed by this one function, so its bits do not depend on its neighbours. */
static void dot4(const float *restrict q, const float *restrict x0, const float *restrict x1,
                 const float *restrict x2, const float *restrict x3, int64_t n, float *restrict out) {
    float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
    for (int64_t i = 0; i < n; i++) {
        s0 += q[i] * x0[i];
        s1 += q[i] * x1[i];
        s2 += q[i] * x2[i];
        s3 += q[i] * x3[i];
    }
    out[0] = s0, out[1] = s1, out[2] = s2, out[3] = s3;
}

/* One sequence's view of the cache: its block table, and the cache's layout and dtype. */
typedef struct {
    const void *cache;
    const int64_t *table;
    int64_t block_size, width;
    int bf16;
} Pages;

/* Rows [first, first + n) of one sequence, within one block, as fp32: in place (fp32 cache) or
 * converted into buffer (bf16 cache: a bf16 value is the top half of an fp32 one). */
static const float *tile_rows(const Pages *pages, int64_t first, int64_t n, float *restrict buffer) {
    int64_t at = pages->table[first / pages->block_size] * pages->block_size + first % pages->block_size;
    if (!pages->bf16) return (const float *)pages->cache + at * pages->width;
    const uint16_t *restrict x = (const uint16_t *)pages->cache + at * pages->width;
    for (int64_t i = 0; i < n * pages->width; i++) {
        uint32_t bits = (uint32_t)x[i] << 16;
        memcpy(buffer + i, &bits, sizeof bits);
    }
    return buffer;
}

#define ACC_HEADS 4  /* acc rows updated together: their blocks stay in registers over a tile's rows */
#define ACC_WIDTH 16 /* acc columns per block: ACC_HEADS x ACC_WIDTH fp32 accumulators (8 AVX2 registers) */

/* acc[h, c] += weight[h, t] * rows[t, c] for the tile's rows t in order, each element one chain of fmaf
 * (the order of the plain loop over t per head, so the same bits), heads ACC_HEADS and columns ACC_WIDTH at
 * a time: a row's block is loaded once for ACC_HEADS heads, and the accumulators stay in registers. */
static void accumulate(const float *restrict rows, int64_t width, int64_t n, const float *restrict weight,
                       int64_t weight_stride, float *restrict acc, int64_t H, int64_t C) {
    int64_t h0 = 0, c0;
    for (; h0 + ACC_HEADS <= H; h0 += ACC_HEADS) {
        for (c0 = 0; c0 + ACC_WIDTH <= C; c0 += ACC_WIDTH) {
            float a[ACC_HEADS][ACC_WIDTH];
            for (int h = 0; h < ACC_HEADS; h++)
                for (int c = 0; c < ACC_WIDTH; c++) a[h][c] = acc[(h0 + h) * C + c0 + c];
            for (int64_t t = 0; t < n; t++) {
                const float *restrict r = rows + t * width + c0;
#pragma GCC unroll 4
                for (int h = 0; h < ACC_HEADS; h++) {
                    float w = weight[(h0 + h) * weight_stride + t];
#pragma GCC unroll 16
                    for (int c = 0; c < ACC_WIDTH; c++) a[h][c] = fmaf(w, r[c], a[h][c]);
                }
            }
            for (int h = 0; h < ACC_HEADS; h++)
                for (int c = 0; c < ACC_WIDTH; c++) acc[(h0 + h) * C + c0 + c] = a[h][c];
        }
        for (int64_t h = h0; h < h0 + ACC_HEADS; h++) /* the last columns, plainly */
            for (int64_t t = 0; t < n; t++)
                for (int64_t c = c0; c < C; c++) acc[h * C + c] = fmaf(weight[h * weight_stride + t], rows[t * width + c], acc[h * C + c]);
    }
    for (int64_t h = h0; h < H; h++) /* the last heads, plainly */
        for (int64_t t = 0; t < n; t++)
            for (int64_t c = 0; c < C; c++) acc[h * C + c] = fmaf(weight[h * weight_stride + t], rows[t * width + c], acc[h * C + c]);
}

/* Positions [begin, end) of one sequence: per head h its running maximum max[h], the sum of its weights
 * sum[h] and the weighted sum of c, acc [H, C], all relative to max[h] (not normalised).
 * work: TILE * (C + R) + H * (TILE + 4) floats. */
static void attend_split(const float *restrict q, const Pages *pages, int64_t begin, int64_t end, int64_t H,
                         int64_t C, float scale, float *restrict max, float *restrict sum, float *restrict acc,
                         float *restrict work) {
    int64_t width = pages->width;
    float *buffer = work, *s = work + TILE * width; /* s: [H, TILE + 4] */
    for (int64_t h = 0; h < H; h++) {
        max[h] = -INFINITY;
        sum[h] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * H * C);
    for (int64_t first = begin; first < end;) {
        int64_t to_block_end = pages->block_size - first % pages->block_size;
        int64_t n = end - first < TILE ? end - first : TILE;
        n = n < to_block_end ? n : to_block_end;
        const float *rows = tile_rows(pages, first, n, buffer);
        /* Every head's scores first, four rows at a time: a row read from memory serves all the heads at
         * once (head by head, a long context's tile was streamed in again for each head's pass). */
        for (int64_t t = 0; t < n; t += 4) { /* a row of s has TILE + 4 slots: a last group past n is dropped */
            const float *x[4];
            for (int64_t j = 0; j < 4; j++) x[j] = rows + (t + j < n ? t + j : n - 1) * width;
            for (int64_t h = 0; h < H; h++) dot4(q + h * width, x[0], x[1], x[2], x[3], width, s + h * (TILE + 4) + t);
        }
        for (int64_t h = 0; h < H; h++) { /* each head's scores become its weights in place */
            float *restrict score = s + h * (TILE + 4);
            float best = max[h];
            for (int64_t t = 0; t < n; t++) {
                score[t] *= scale;
                best = score[t] > best ? score[t] : best;
            }
            if (best > max[h]) {
                float *restrict a = acc + h * C;
                float shrink = expf(max[h] - best); /* 0 for the first tile */
                for (int64_t c = 0; c < C; c++) a[c] *= shrink;
                sum[h] *= shrink;
                max[h] = best;
            }
            for (int64_t t = 0; t < n; t++) score[t] = met_expf(score[t] - best);
            for (int64_t t = 0; t < n; t++) sum[h] += score[t];
        }
        accumulate(rows, width, n, s, TILE + 4, acc, H, C);
        first += n;
    }
}

/* q: [B, H, C + R] fp32; cache: [num_blocks, block_size, C + R]; block_tables: [B, *] int64, rows
 * table_stride apart; context_lens: [B] int64, >= 1; out: [B, H, C] fp32. Returns 0, or -1 when the
 * partial sums could not be allocated. */
static int decode(const float *q, const void *cache, int bf16, const int64_t *block_tables, int64_t table_stride,
                  const int64_t *context_lens, float *out, int64_t B, int64_t H, int64_t C, int64_t R,
                  int64_t block_size, float scale, int threads) {
    int64_t *first_item = malloc(sizeof(int64_t) * (B + 1)); /* sequence b's items: first_item[b].. */
    if (!first_item) return -1;
    first_item[0] = 0;
    for (int64_t b = 0; b < B; b++) first_item[b + 1] = first_item[b] + (context_lens[b] + SPLIT - 1) / SPLIT;
    int64_t items = first_item[B], partial_size = H * C + 2 * H;
    int64_t *item_sequence = malloc(sizeof(int64_t) * items);
    float *partials = malloc(sizeof(float) * items * partial_size); /* per item: max [H], sum [H], acc [H, C] */
    if (!item_sequence || !partials) {
        free(first_item);
        free(item_sequence);
        free(partials);
        return -1;
    }
    for (int64_t b = 0; b < B; b++)
        for (int64_t i = first_item[b]; i < first_item[b + 1]; i++) item_sequence[i] = b;
#pragma omp parallel num_threads(threads) if (items > 1)
    {
        float work[TILE * (C + R) + H * (TILE + 4)];
#pragma omp for schedule(dynamic)
        for (int64_t i = 0; i < items; i++) {
            int64_t b = item_sequence[i], begin = (i - first_item[b]) * SPLIT;
            int64_t end = begin + SPLIT < context_lens[b] ? begin + SPLIT : context_lens[b];
            Pages pages = {cache, block_tables + b * table_stride, block_size, C + R, bf16};
            float *partial = partials + i * partial_size;
            attend_split(q + b * H * (C + R), &pages, begin, end, H, C, scale, partial, partial + H,
                         partial + 2 * H, work);
        }
#pragma omp for schedule(static)
        for (int64_t b = 0; b < B; b++) {
            for (int64_t h = 0; h < H; h++) {
                float best = -INFINITY, total = 0.0f, *restrict o = out + (b * H + h) * C;
                for (int64_t i = first_item[b]; i < first_item[b + 1]; i++) {
                    float m = partials[i * partial_size + h];
                    best = m > best ? m : best;
                }
                memset(o, 0, sizeof(float) * C);
                for (int64_t i = first_item[b]; i < first_item[b + 1]; i++) { /* in split order */
                    const float *partial = partials + i * partial_size;
                    float factor = expf(partial[h] - best); /* exactly 1 for a sequence of one split */
                    const float *restrict a = partial + 2 * H + h * C;
                    total = fmaf(factor, partial[H + h], total);
                    for (int64_t c = 0; c < C; c++) o[c] = fmaf(factor, a[c], o[c]);
                }
                float inv = 1.0f / total;
                for (int64_t c = 0; c < C; c++) o[c] *= inv;
            }
        }
    }
    free(first_item);
    free(item_sequence);
    free(partials);
    return 0;
}

int met_mla_decode_f32(const float *q, const float *cache, const int64_t *block_tables, int64_t table_stride,
                       const int64_t *context_lens, float *out, int64_t B, int64_t H, int64_t C, int64_t R,
                       int64_t block_size, float scale, int threads) {
    return decode(q, cache, 0, block_tables, table_stride, context_lens, out, B, H, C, R, block_size, scale,
                  threads);
}

int met_mla_decode_bf16(const float *q, const uint16_t *cache, const int64_t *block_tables, int64_t table_stride,
                        const int64_t *context_lens, float *out, int64_t B, int64_t H, int64_t C, int64_t R,
                        int64_t block_size, float scale, int threads) {
    return decode(q, cache, 1, block_tables, table_stride, context_lens, out, B, H, C, R, block_size, scale,
                  threads);
}
