/* Absorbed MLA for decode rows (one query row per sequence) over a block-paged latent cache, reading
 * each sequence's latents in place: met_mla_decode_f32 (fp32 cache) and met_mla_decode_bf16 (bf16).
 *
 * Position p of sequence b is the row cache[block_tables[b, p / block_size], p % block_size] of C + R
 * values (c_p, then r_p). Per sequence and head h, with q = [q_latent_h, q_rope_h] of C + R values:
 *     score_p = (q . row_p) * scale,   out_h = sum_p softmax(score)_p c_p      (p < context_lens[b])
 * in one pass over the rows, TILE rows at a time (an online softmax: a tile whose best score beats the
 * running maximum rescales what was summed so far), all heads per tile, all in fp32. The plain twin is
 * metrale/worker/kernels/mla.py:_attend_single_rows. Sequences are independent, so a sequence's output
 * does not depend on the batch or on the thread count.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define TILE 16

static float dot(const float *restrict q, const float *restrict x, int64_t n) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; i++) sum += q[i] * x[i];
    return sum;
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

/* One sequence of `length` rows: out [H, C] fp32. work: TILE * (C + R) + H * TILE + 2 * H floats. */
static void attend(const float *restrict q, const Pages *pages, int64_t length, float *restrict out, int64_t H,
                   int64_t C, float scale, float *restrict work) {
    int64_t width = pages->width;
    float *buffer = work, *scores = work + TILE * width, *max = scores + H * TILE, *sum = max + H;
    for (int64_t h = 0; h < H; h++) {
        max[h] = -INFINITY;
        sum[h] = 0.0f;
    }
    memset(out, 0, sizeof(float) * H * C);
    for (int64_t first = 0; first < length;) {
        int64_t to_block_end = pages->block_size - first % pages->block_size;
        int64_t n = length - first < TILE ? length - first : TILE;
        n = n < to_block_end ? n : to_block_end;
        const float *rows = tile_rows(pages, first, n, buffer);
        for (int64_t h = 0; h < H; h++) {
            float *restrict s = scores + h * TILE, best = max[h];
            for (int64_t t = 0; t < n; t++) {
                s[t] = dot(q + h * width, rows + t * width, width) * scale;
                best = s[t] > best ? s[t] : best;
            }
            float *restrict acc = out + h * C;
            if (best > max[h]) {
                float shrink = expf(max[h] - best);  /* 0 for the first tile */
                for (int64_t c = 0; c < C; c++) acc[c] *= shrink;
                sum[h] *= shrink;
                max[h] = best;
            }
            for (int64_t t = 0; t < n; t++) {
                float weight = expf(s[t] - best);
                const float *restrict row = rows + t * width;
                sum[h] += weight;
                for (int64_t c = 0; c < C; c++) acc[c] = fmaf(weight, row[c], acc[c]);
            }
        }
        first += n;
    }
    for (int64_t h = 0; h < H; h++) {
        float inv = 1.0f / sum[h];
        for (int64_t c = 0; c < C; c++) out[h * C + c] *= inv;
    }
}

/* q: [B, H, C + R] fp32; cache: [num_blocks, block_size, C + R]; block_tables: [B, *] int64, rows
 * table_stride apart; context_lens: [B] int64, >= 1; out: [B, H, C] fp32. */
static void decode(const float *q, const void *cache, int bf16, const int64_t *block_tables, int64_t table_stride,
                   const int64_t *context_lens, float *out, int64_t B, int64_t H, int64_t C, int64_t R,
                   int64_t block_size, float scale, int threads) {
#pragma omp parallel for schedule(dynamic) num_threads(threads)
    for (int64_t b = 0; b < B; b++) {
        float work[TILE * (C + R) + H * TILE + 2 * H];
        Pages pages = {cache, block_tables + b * table_stride, block_size, C + R, bf16};
        attend(q + b * H * (C + R), &pages, context_lens[b], out + b * H * C, H, C, scale, work);
    }
}

void met_mla_decode_f32(const float *q, const float *cache, const int64_t *block_tables, int64_t table_stride,
                        const int64_t *context_lens, float *out, int64_t B, int64_t H, int64_t C, int64_t R,
                        int64_t block_size, float scale, int threads) {
    decode(q, cache, 0, block_tables, table_stride, context_lens, out, B, H, C, R, block_size, scale, threads);
}

void met_mla_decode_bf16(const float *q, const uint16_t *cache, const int64_t *block_tables, int64_t table_stride,
                         const int64_t *context_lens, float *out, int64_t B, int64_t H, int64_t C, int64_t R,
                         int64_t block_size, float scale, int threads) {
    decode(q, cache, 1, block_tables, table_stride, context_lens, out, B, H, C, R, block_size, scale, threads);
}
