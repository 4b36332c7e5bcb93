/* The Gated DeltaNet recurrence over a slot-indexed state pool, one token at a time: a decode step for a
 * batch (met_gdn_decode) and a varlen prefill (met_gdn_prefill). Both advance a head through advance_head,
 * so a token gives bitwise the same output and state whichever entry point feeds it, and whatever else is
 * in the batch. Each state is read from memory once and written once per token.
 *
 * Per token of (sequence b, value head h), with S = pool[slots[b], h] of shape [K, V] (fp32, row-major),
 * q and k those of key head h / (Hv / Hk) (already L2-normalised by the caller) and a = exp(g) one scalar
 * per head (KDA's decay is one per key channel: here it leaves the sums over keys, so a pass over S costs
 * two multiply-adds an element instead of KDA's two plus the decay's):
 *     u = k^T S,   w = q^T S                         (one pass over S)
 *     delta = beta * (v - a u)
 *     o = scale * (a w + (q . k) delta)              (= scale q^T S')
 *     S' = a S + k delta^T                           (second pass, S is still in cache)
 * The plain twin is metrale/worker/kernels/gdn/naive.py:gdn_step.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

/* Columns j0 .. j0 + RECALL_BLOCK of u = k^T S and w = q^T S, accumulated in registers. */
#define RECALL_BLOCK 64
static void recall_block(const float *restrict S, const float *restrict k, const float *restrict q,
                         float *restrict u, float *restrict w, int64_t K, int64_t V, int64_t j0) {
    float uu[RECALL_BLOCK] = {0}, ww[RECALL_BLOCK] = {0};
    for (int64_t i = 0; i < K; i++) {
        const float *restrict row = S + i * V + j0;
        float ki = k[i], qi = q[i];
        for (int j = 0; j < RECALL_BLOCK; j++) {
            uu[j] = fmaf(ki, row[j], uu[j]);
            ww[j] = fmaf(qi, row[j], ww[j]);
        }
    }
    for (int j = 0; j < RECALL_BLOCK; j++) {
        u[j0 + j] = uu[j];
        w[j0 + j] = ww[j];
    }
}

static void advance_head(float *restrict S, const float *restrict q, const float *restrict k,
                         const float *restrict v, float g, float beta, float *restrict o, int64_t K, int64_t V,
                         float scale, float *restrict scratch) {
    float *u = scratch, *w = scratch + V;
    float a = expf(g), qk = 0.0f;
    for (int64_t i = 0; i < K; i++) qk = fmaf(q[i], k[i], qk);
    int64_t j0 = 0;
    for (; j0 + RECALL_BLOCK <= V; j0 += RECALL_BLOCK) recall_block(S, k, q, u, w, K, V, j0);
    for (int64_t j = j0; j < V; j++) u[j] = w[j] = 0.0f;
    for (int64_t i = 0; i < K; i++) {
        const float *restrict row = S + i * V;
        float ki = k[i], qi = q[i];
        for (int64_t j = j0; j < V; j++) {
            u[j] = fmaf(ki, row[j], u[j]);
            w[j] = fmaf(qi, row[j], w[j]);
        }
    }
    for (int64_t j = 0; j < V; j++) {
        float delta = beta * (v[j] - a * u[j]);
        o[j] = scale * (a * w[j] + qk * delta);
        u[j] = delta;
    }
    for (int64_t i = 0; i < K; i++) {
        float *restrict row = S + i * V;
        float ki = k[i];
        for (int64_t j = 0; j < V; j++) row[j] = fmaf(ki, u[j], row[j] * a);
    }
}

/* A decode step spreads over threads only from this many state elements in all (B * Hv * K * V, 256 KiB):
 * KDA's threshold (kda_recurrence.c says why), the same memory-bound pass over the states. */
#define PARALLEL_MIN_STATE (1 << 16)

/* q, k: [B, Hk, K]; v, o: [B, Hv, V]; g, beta: [B, Hv]; pool: [P, Hv, K, V]; slots: [B]; all contiguous.
 * Items (b, h) are independent, so the result does not depend on the batch or on the thread count. */
void met_gdn_decode(float *pool, const int64_t *slots, const float *q, const float *k, const float *v,
                    const float *g, const float *beta, float *o, int64_t B, int64_t Hk, int64_t Hv, int64_t K,
                    int64_t V, float scale, int threads) {
    int64_t group = Hv / Hk;
#pragma omp parallel for schedule(static) num_threads(threads) if (B * Hv * K * V >= PARALLEL_MIN_STATE)
    for (int64_t bh = 0; bh < B * Hv; bh++) {
        float scratch[2 * V];
        int64_t b = bh / Hv, h = bh % Hv, key_row = b * Hk + h / group;
        float *S = pool + (slots[b] * Hv + h) * K * V;
        advance_head(S, q + key_row * K, k + key_row * K, v + bh * V, g[bh], beta[bh], o + bh * V, K, V, scale,
                     scratch);
    }
}

/* q, k: [N, Hk, K]; v, o: [N, Hv, V]; g, beta: [N, Hv]; sequence s owns rows cu_seqlens[s]..cu_seqlens[s+1];
 * pool: [P, Hv, K, V]; slots: [S]; has_initial_state: [S] (0 = start from zero, ignoring the pool row). */
void met_gdn_prefill(float *pool, const int64_t *slots, const uint8_t *has_initial_state, const int64_t *cu_seqlens,
                     const float *q, const float *k, const float *v, const float *g, const float *beta, float *o,
                     int64_t S, int64_t Hk, int64_t Hv, int64_t K, int64_t V, float scale, int threads) {
    int64_t group = Hv / Hk;
#pragma omp parallel for schedule(dynamic) num_threads(threads)
    for (int64_t sh = 0; sh < S * Hv; sh++) {
        float scratch[2 * V];
        int64_t s = sh / Hv, h = sh % Hv;
        float *state = pool + (slots[s] * Hv + h) * K * V;
        if (!has_initial_state[s]) memset(state, 0, sizeof(float) * K * V);
        for (int64_t t = cu_seqlens[s]; t < cu_seqlens[s + 1]; t++) {
            int64_t th = t * Hv + h, key_row = t * Hk + h / group;
            advance_head(state, q + key_row * K, k + key_row * K, v + th * V, g[th], beta[th], o + th * V, K, V,
                         scale, scratch);
        }
    }
}
