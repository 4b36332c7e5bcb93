/* One KDA decode step per sequence over a slot-indexed state pool, fused: each state is read from
 * memory once and written once.
 *
 * Per (sequence b, head h), with S = pool[slots[b], h] of shape [K, V] (fp32, row-major) and
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

#define L2_EPS 1e-6f

static void normalize(const float *x, float *out, int64_t n, float scale) {
    float sum = 0.0f;
    for (int64_t i = 0; i < n; i++) sum += x[i] * x[i];
    float inv = scale / sqrtf(sum + L2_EPS);
    for (int64_t i = 0; i < n; i++) out[i] = x[i] * inv;
}

static void advance_head(float *restrict S, const float *q_raw, const float *k_raw, const float *restrict v,
                         const float *g, float beta, float *restrict o, int64_t K, int64_t V, float scale,
                         float *restrict scratch) {
    float *q = scratch, *k = scratch + K, *a = scratch + 2 * K, *u = scratch + 3 * K, *w = u + V;
    normalize(q_raw, q, K, scale);
    normalize(k_raw, k, K, 1.0f);
    float qk = 0.0f;
    for (int64_t i = 0; i < K; i++) {
        a[i] = expf(g[i]);
        qk += q[i] * k[i];
    }
    for (int64_t j = 0; j < V; j++) u[j] = w[j] = 0.0f;
    for (int64_t i = 0; i < K; i++) {
        const float *restrict row = S + i * V;
        float ka = k[i] * a[i], qa = q[i] * a[i];
        for (int64_t j = 0; j < V; j++) {
            u[j] += ka * row[j];
            w[j] += qa * row[j];
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
        for (int64_t j = 0; j < V; j++) row[j] = row[j] * ai + ki * u[j];
    }
}

/* q, k, g: [B, H, K]; v, o: [B, H, V]; beta: [B, H]; pool: [P, H, K, V]; slots: [B]; all contiguous.
 * Items (b, h) are independent, so the result does not depend on the batch or on the thread count. */
void met_kda_decode(float *pool, const int64_t *slots, const float *q, const float *k, const float *v,
                    const float *g, const float *beta, float *o, int64_t B, int64_t H, int64_t K, int64_t V,
                    float scale, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t bh = 0; bh < B * H; bh++) {
        float scratch[3 * K + 2 * V];
        int64_t b = bh / H, h = bh % H;
        float *S = pool + (slots[b] * H + h) * K * V;
        advance_head(S, q + bh * K, k + bh * K, v + bh * V, g + bh * K, beta[bh], o + bh * V, K, V, scale,
                     scratch);
    }
}
