/* The KDA recurrence over a slot-indexed state pool, one token at a time: a decode step for a batch
 * (met_kda_decode) and a varlen prefill (met_kda_prefill). Both advance a head through advance_head, so
 * a token gives bitwise the same output and state whichever entry point feeds it, and whatever else is
 * in the batch. Each state is read from memory once and written once per call.
 *
 * Per token of (sequence b, head h), with S = pool[slots[b], h] of shape [K, V] (fp32, row-major) and
 * a = exp(g):
 *     q <- scale * q / sqrt(|q|^2 + eps),   k <- k / sqrt(|k|^2 + eps)
 *     u = (k * a)^T S,   w = (q * a)^T S           (one pass over S)
 *     delta = beta * (v - u)
 *     o = w + (q . k) * delta                        (= q^T S')
 *     S' = a * S + k delta^T                         (second pass, S is still in cache)
 * The plain twin is metrale/worker/kernels/kda/naive.py:kda_step.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "exp.h"

#define L2_EPS 1e-6f

static void normalize(const float *x, float *out, int64_t n, float scale) {
    float sum = 0.0f;
    for (int64_t i = 0; i < n; i++) sum += x[i] * x[i];
    float inv = scale / sqrtf(sum + L2_EPS);
    for (int64_t i = 0; i < n; i++) out[i] = x[i] * inv;
}

/* Columns j0 .. j0 + RECALL_BLOCK of u = (k * a)^T S and w = (q * a)^T S, accumulated in registers. */
#define RECALL_BLOCK 64
static void recall_block(const float *restrict S, const float *restrict k, const float *restrict q,
                         const float *restrict a, float *restrict u, float *restrict w, int64_t K, int64_t V,
                         int64_t j0) {
    float uu[RECALL_BLOCK] = {0}, ww[RECALL_BLOCK] = {0};
    for (int64_t i = 0; i < K; i++) {
        const float *restrict row = S + i * V + j0;
        float ka = k[i] * a[i], qa = q[i] * a[i];
        for (int j = 0; j < RECALL_BLOCK; j++) {
            uu[j] = fmaf(ka, row[j], uu[j]);
            ww[j] = fmaf(qa, row[j], ww[j]);
        }
    }
    for (int j = 0; j < RECALL_BLOCK; j++) {
        u[j0 + j] = uu[j];
        w[j0 + j] = ww[j];
    }
}

static void advance_head(float *restrict S, const float *q_raw, const float *k_raw, const float *restrict v,
                         const float *g, float beta, float *restrict o, int64_t K, int64_t V, float scale,
                         float *restrict scratch) {
    float *q = scratch, *k = scratch + K, *a = scratch + 2 * K, *u = scratch + 3 * K, *w = u + V;
    normalize(q_raw, q, K, scale);
    normalize(k_raw, k, K, 1.0f);
    float qk = 0.0f;
    for (int64_t i = 0; i < K; i++) {
        a[i] = met_expf(g[i]);
        qk += q[i] * k[i];
    }
    int64_t j0 = 0;
    for (; j0 + RECALL_BLOCK <= V; j0 += RECALL_BLOCK) recall_block(S, k, q, a, u, w, K, V, j0);
    for (int64_t j = j0; j < V; j++) u[j] = w[j] = 0.0f;
    for (int64_t i = 0; i < K; i++) {
        const float *restrict row = S + i * V;
        float ka = k[i] * a[i], qa = q[i] * a[i];
        for (int64_t j = j0; j < V; j++) {
            u[j] = fmaf(ka, row[j], u[j]);
            w[j] = fmaf(qa, row[j], w[j]);
        }
    }
    for (int64_t j = 0; j < V; j++) {
        float delta = beta * (v[j] - u[j]);
        o[j] = w[j] + qk * delta;
        u[j] = delta;
    }
    for (int64_t i = 0; i < K; i++) {
        float *restrict row = S + i * V;
        float ai = a[i], ki = k[i];
        for (int64_t j = 0; j < V; j++) row[j] = fmaf(ki, u[j], row[j] * ai);
    }
}

/* A decode step spreads over threads only from this many state elements in all (B * H * K * V, 256 KiB).
 * Between two steps of a layer the rest of the model's weights stream through the caches, so a step reads
 * its states from memory, and two threads read them faster than one (one row of 4 heads x 128 x 128:
 * ~55 us on one thread, ~36 us on two, on a 2-vCPU Xeon); below this a step is a few microseconds, less
 * than waking a second thread. */
#define PARALLEL_MIN_STATE (1 << 16)

/* q, k, g: [B, H, K]; v, o: [B, H, V]; beta: [B, H]; pool: [P, H, K, V]; slots: [B]; all contiguous.
 * Items (b, h) are independent, so the result does not depend on the batch or on the thread count. */
void met_kda_decode(float *pool, const int64_t *slots, const float *q, const float *k, const float *v,
                    const float *g, const float *beta, float *o, int64_t B, int64_t H, int64_t K, int64_t V,
                    float scale, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (B * H * K * V >= PARALLEL_MIN_STATE)
    for (int64_t bh = 0; bh < B * H; bh++) {
        float scratch[3 * K + 2 * V];
        int64_t b = bh / H, h = bh % H;
        float *S = pool + (slots[b] * H + h) * K * V;
        advance_head(S, q + bh * K, k + bh * K, v + bh * V, g + bh * K, beta[bh], o + bh * V, K, V, scale,
                     scratch);
    }
}

/* q, k, g: [N, H, K]; v, o: [N, H, V]; beta: [N, H]; sequence s owns rows cu_seqlens[s]..cu_seqlens[s+1];
 * pool: [P, H, K, V]; slots: [S]; has_initial_state: [S] (0 = start from zero, ignoring the pool row). */
void met_kda_prefill(float *pool, const int64_t *slots, const uint8_t *has_initial_state, const int64_t *cu_seqlens,
                     const float *q, const float *k, const float *v, const float *g, const float *beta, float *o,
                     int64_t S, int64_t H, int64_t K, int64_t V, float scale, int threads) {
#pragma omp parallel for schedule(dynamic) num_threads(threads)
    for (int64_t sh = 0; sh < S * H; sh++) {
        float scratch[3 * K + 2 * V];
        int64_t s = sh / H, h = sh % H;
        float *state = pool + (slots[s] * H + h) * K * V;
        if (!has_initial_state[s]) memset(state, 0, sizeof(float) * K * V);
        for (int64_t t = cu_seqlens[s]; t < cu_seqlens[s + 1]; t++) {
            int64_t th = t * H + h;
            advance_head(state, q + th * K, k + th * K, v + th * V, g + th * K, beta[th], o + th * V, K, V, scale,
                         scratch);
        }
    }
}
