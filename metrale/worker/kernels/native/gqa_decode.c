/* Grouped-query attention for decode rows (one query row per sequence) over a block-paged key/value
 * cache, reading each sequence's keys and values in place: met_gqa_decode_f32 (fp32 cache) and
 * met_gqa_decode_bf16 (bf16).
 *
 * Position p of sequence b is the token cache[block_tables[b, p / block_size], p % block_size] of
 * [2, Hkv, D] values (its keys, then its values, per KV head). Query head h reads KV head
 * g = h / (H / Hkv) (transformers' repeat_kv). Per sequence and head:
 *     score_p = (q_h . k_{p,g}) * scale,   out_h = sum_p softmax(score)_p v_{p,g}     (p < context_lens[b])
 * all in fp32. The plain twin is metrale/worker/kernels/gqa.py:attend_single_rows.
 *
 * Split over the context (flash-decoding): a sequence's positions are cut into splits of SPLIT positions,
 * [0, SPLIT), [SPLIT, 2 SPLIT), ..., and each (sequence, KV head, split) is one work item, so one long
 * sequence keeps every thread busy. An item runs an online softmax over its split, TILE positions at a
 * time (a tile whose best score beats the running maximum rescales what was summed so far; the heads of
 * a group share each tile of their KV head, read once), and leaves its unnormalised partial sums (max,
 * sum of weights, weighted sum of values) per head. Then each sequence's splits are combined in split
 * order. The splits depend on the sequence's own length alone and every sum runs in a fixed order, so a
 * sequence's output is the same bits whatever else is in the batch and at any thread count.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "exp.h"

#define TILE 16
#define SPLIT 256

/* q . x_j for four vectors x_j, `stride` floats apart, at once (four independent sums: one dot is bound
 * by its additions' latency). Every score is computed by this one function, so its bits do not depend on
 * its neighbours. */
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

/* One sequence and KV head's view of the cache: its block table, and the cache's layout and dtype. */
typedef struct {
    const void *cache;
    const int64_t *table;
    int64_t block_size, token_width; /* token_width = 2 * Hkv * D values per cached token */
    int64_t key_offset, value_offset; /* g * D and (Hkv + g) * D within a token */
    int64_t D;
    int bf16;
} Pages;

/* The key (or value) vectors of positions [first, first + n), within one block, as fp32 rows `*stride`
 * floats apart: in place (fp32 cache) or converted into buffer [n, D] (bf16: the top half of an fp32). */
static const float *tile_vectors(const Pages *pages, int64_t first, int64_t n, int64_t offset, float *restrict buffer,
                                 int64_t *stride) {
    int64_t at = pages->table[first / pages->block_size] * pages->block_size + first % pages->block_size;
    int64_t start = at * pages->token_width + offset;
    if (!pages->bf16) {
        *stride = pages->token_width;
        return (const float *)pages->cache + start;
    }
    const uint16_t *restrict x = (const uint16_t *)pages->cache + start;
    for (int64_t t = 0; t < n; t++) {
        for (int64_t d = 0; d < pages->D; d++) {
            uint32_t bits = (uint32_t)x[t * pages->token_width + d] << 16;
            memcpy(buffer + t * pages->D + d, &bits, sizeof bits);
        }
    }
    *stride = pages->D;
    return buffer;
}

/* The G query heads q [G, D] of one KV head over positions [begin, end): per head h its running maximum
 * max[h], the sum of its weights sum[h] and the weighted sum of values acc [G, D], all relative to max[h]
 * (not normalised). work: 2 * TILE * D + 2 * TILE + 4 floats. */
static void attend_split(const float *restrict q, const Pages *pages, int64_t begin, int64_t end, int64_t G,
                         float scale, float *restrict max, float *restrict sum, float *restrict acc,
                         float *restrict work) {
    int64_t D = pages->D;
    float *key_buffer = work, *value_buffer = work + TILE * D, *s = value_buffer + TILE * D, *weight = s + TILE + 4;
    for (int64_t h = 0; h < G; h++) {
        max[h] = -INFINITY;
        sum[h] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * G * D);
    for (int64_t first = begin; first < end;) {
        int64_t to_block_end = pages->block_size - first % pages->block_size;
        int64_t n = end - first < TILE ? end - first : TILE;
        n = n < to_block_end ? n : to_block_end;
        int64_t key_stride, value_stride;
        const float *keys = tile_vectors(pages, first, n, pages->key_offset, key_buffer, &key_stride);
        const float *values = tile_vectors(pages, first, n, pages->value_offset, value_buffer, &value_stride);
        for (int64_t h = 0; h < G; h++) {
            float best = max[h];
            for (int64_t t = 0; t < n; t += 4) { /* s has TILE + 4 slots: a last group past n is dropped */
                const float *x[4];
                for (int64_t j = 0; j < 4; j++) x[j] = keys + (t + j < n ? t + j : n - 1) * key_stride;
                dot4(q + h * D, x[0], x[1], x[2], x[3], D, s + t);
            }
            for (int64_t t = 0; t < n; t++) {
                s[t] *= scale;
                best = s[t] > best ? s[t] : best;
            }
            float *restrict a = acc + h * D;
            if (best > max[h]) {
                float shrink = expf(max[h] - best); /* 0 for the first tile */
                for (int64_t d = 0; d < D; d++) a[d] *= shrink;
                sum[h] *= shrink;
                max[h] = best;
            }
            for (int64_t t = 0; t < n; t++) weight[t] = met_expf(s[t] - best);
            for (int64_t t = 0; t < n; t++) sum[h] += weight[t];
            int64_t t = 0;
            for (; t + 2 <= n; t += 2) { /* two positions per pass over acc, still added in order */
                const float *restrict v0 = values + t * value_stride, *restrict v1 = v0 + value_stride;
                float w0 = weight[t], w1 = weight[t + 1];
                for (int64_t d = 0; d < D; d++) a[d] = fmaf(w1, v1[d], fmaf(w0, v0[d], a[d]));
            }
            if (t < n) {
                const float *restrict v0 = values + t * value_stride;
                float w0 = weight[t];
                for (int64_t d = 0; d < D; d++) a[d] = fmaf(w0, v0[d], a[d]);
            }
        }
        first += n;
    }
}

/* q: [B, H, D] fp32; cache: [num_blocks, block_size, 2, Hkv, D]; block_tables: [B, *] int64, rows
 * table_stride apart; context_lens: [B] int64, >= 1; out: [B, H, D] fp32. H is a multiple of Hkv.
 * Returns 0, or -1 when the partial sums could not be allocated. */
static int decode(const float *q, const void *cache, int bf16, const int64_t *block_tables, int64_t table_stride,
                  const int64_t *context_lens, float *out, int64_t B, int64_t H, int64_t Hkv, int64_t D,
                  int64_t block_size, float scale, int threads) {
    int64_t G = H / Hkv;
    int64_t *first_split = malloc(sizeof(int64_t) * (B + 1)); /* sequence b's splits: first_split[b].. */
    if (!first_split) return -1;
    first_split[0] = 0;
    for (int64_t b = 0; b < B; b++) first_split[b + 1] = first_split[b] + (context_lens[b] + SPLIT - 1) / SPLIT;
    int64_t splits = first_split[B], items = splits * Hkv, partial_size = G * D + 2 * G;
    int64_t *split_sequence = malloc(sizeof(int64_t) * splits);
    /* per item (split-major, then KV head): max [G], sum [G], acc [G, D] */
    float *partials = malloc(sizeof(float) * items * partial_size);
    if (!split_sequence || !partials) {
        free(first_split);
        free(split_sequence);
        free(partials);
        return -1;
    }
    for (int64_t b = 0; b < B; b++)
        for (int64_t i = first_split[b]; i < first_split[b + 1]; i++) split_sequence[i] = b;
#pragma omp parallel num_threads(threads) if (items > 1)
    {
        float work[2 * TILE * D + 2 * TILE + 4];
#pragma omp for schedule(dynamic)
        for (int64_t item = 0; item < items; item++) {
            int64_t i = item / Hkv, g = item % Hkv, b = split_sequence[i], begin = (i - first_split[b]) * SPLIT;
            int64_t end = begin + SPLIT < context_lens[b] ? begin + SPLIT : context_lens[b];
            Pages pages = {cache, block_tables + b * table_stride, block_size, 2 * Hkv * D, g * D, (Hkv + g) * D, D,
                           bf16};
            float *partial = partials + item * partial_size;
            attend_split(q + (b * H + g * G) * D, &pages, begin, end, G, scale, partial, partial + G,
                         partial + 2 * G, work);
        }
#pragma omp for collapse(2) schedule(static)
        for (int64_t b = 0; b < B; b++) {
            for (int64_t h = 0; h < H; h++) {
                int64_t g = h / G, j = h % G; /* KV head, and the head's place in its group */
                float best = -INFINITY, total = 0.0f, *restrict o = out + (b * H + h) * D;
                for (int64_t i = first_split[b]; i < first_split[b + 1]; i++) {
                    float m = partials[(i * Hkv + g) * partial_size + j];
                    best = m > best ? m : best;
                }
                memset(o, 0, sizeof(float) * D);
                for (int64_t i = first_split[b]; i < first_split[b + 1]; i++) { /* in split order */
                    const float *partial = partials + (i * Hkv + g) * partial_size;
                    float factor = expf(partial[j] - best); /* exactly 1 for a sequence of one split */
                    const float *restrict a = partial + 2 * G + j * D;
                    total = fmaf(factor, partial[G + j], total);
                    for (int64_t d = 0; d < D; d++) o[d] = fmaf(factor, a[d], o[d]);
                }
                float inv = 1.0f / total;
                for (int64_t d = 0; d < D; d++) o[d] *= inv;
            }
        }
    }
    free(first_split);
    free(split_sequence);
    free(partials);
    return 0;
}

int met_gqa_decode_f32(const float *q, const float *cache, const int64_t *block_tables, int64_t table_stride,
                       const int64_t *context_lens, float *out, int64_t B, int64_t H, int64_t Hkv, int64_t D,
                       int64_t block_size, float scale, int threads) {
    return decode(q, cache, 0, block_tables, table_stride, context_lens, out, B, H, Hkv, D, block_size, scale,
                  threads);
}

int met_gqa_decode_bf16(const float *q, const uint16_t *cache, const int64_t *block_tables, int64_t table_stride,
                        const int64_t *context_lens, float *out, int64_t B, int64_t H, int64_t Hkv, int64_t D,
                        int64_t block_size, float scale, int threads) {
    return decode(q, cache, 1, block_tables, table_stride, context_lens, out, B, H, Hkv, D, block_size, scale,
                  threads);
}
